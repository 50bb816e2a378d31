//! AdamW (torch.optim.AdamW's single-tensor update, operation for operation) and Decent-DP's AccumAdamW.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::config::OptimConfig;
#[cfg(feature = "cuda")]
use crate::flat::MIXED;
use crate::flat::{Flat, FlatMut, FlatRef, Place};
use crate::kernels::optim as kernels;
use crate::kernels::Segment;

/// Optimizer state for checkpoints: the step count and named flat buffers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimState {
    pub name: String,
    pub step: u64,
    #[serde(skip)]
    pub buffers: Vec<(String, Vec<f32>)>,
}

impl OptimState {
    /// Name and step, without the buffers.
    pub fn clone_header(&self) -> Self {
        Self {
            name: self.name.clone(),
            step: self.step,
            buffers: Vec::new(),
        }
    }
}

/// An optimizer's state borrowed in place, wherever its buffers live (what a checkpoint writes, without
/// a copy of the buffers in host memory).
pub struct OptimView<'a> {
    pub name: &'static str,
    pub step: u64,
    pub buffers: Vec<(&'static str, FlatRef<'a>)>,
}

impl OptimView<'_> {
    /// Name and step, without the buffers.
    pub fn header(&self) -> OptimState {
        OptimState {
            name: self.name.into(),
            step: self.step,
            buffers: Vec::new(),
        }
    }

    /// Name, step and a host copy of the buffers.
    pub fn to_state(&self) -> Result<OptimState> {
        let buffers = self
            .buffers
            .iter()
            .map(|&(n, b)| Ok((n.into(), b.to_host()?.into_owned())))
            .collect::<Result<_>>()?;
        Ok(OptimState {
            buffers,
            ..self.header()
        })
    }
}

/// One range of the flat buffers, updated alone (`Optimizer::step_shard`).
pub struct Shard<'a> {
    /// The parameters' segments cut to the range (`Segment::cut`).
    pub segs: &'a [Segment],
    pub params: &'a mut [f32],
    pub grads: &'a [f32],
    /// The optimizer's buffers cut to the range, in `view`'s order.
    pub state: Vec<&'a mut [f32]>,
}

/// A shard's parameters, gradient and N state buffers.
type ShardParts<'a, const N: usize> = (&'a mut [f32], &'a [f32], [&'a mut [f32]; N]);

impl<'a> Shard<'a> {
    /// The state's N buffers.
    fn state<const N: usize>(self) -> Result<ShardParts<'a, N>> {
        let n = self.state.len();
        let state = <[&mut [f32]; N]>::try_from(self.state).map_err(|_| {
            anyhow::anyhow!(
                "internal error: a shard of {n} optimizer buffer(s), this optimizer has {N}"
            )
        })?;
        Ok((self.params, self.grads, state))
    }
}

pub trait Optimizer: Send + Sync {
    /// One update of `params` with gradient `grads` at learning rate `lr`, where the buffers live (the
    /// kernels of `kernels/optim.cu` on the GPU, their CPU twins on the host).
    fn step(&mut self, params: FlatMut<'_>, grads: FlatRef<'_>, lr: f64) -> Result<()> {
        self.step_scaled(params, grads, lr, 1.0)
    }
    /// `step` with the gradient times `grad_scale` (gradient clipping's factor), applied as the update
    /// reads it: the same values as scaling the gradient first, without a pass of its own.
    fn step_scaled(
        &mut self,
        params: FlatMut<'_>,
        grads: FlatRef<'_>,
        lr: f64,
        grad_scale: f32,
    ) -> Result<()>;
    /// The step count and buffers, borrowed.
    fn view(&self) -> OptimView<'_>;
    /// The step count and a host copy of the buffers.
    fn state(&self) -> Result<OptimState> {
        self.view().to_state()
    }
    /// Takes a saved state (host buffers, moved to where this optimizer's buffers live).
    fn load_state(&mut self, state: OptimState) -> Result<()>;
    /// `step_scaled`'s update of one range of host buffers, as the step whose count is `t` (1 for the
    /// first) makes it there: the same values, element for element. It reads the optimizer's settings
    /// alone, not its buffers or count: the local engine's workers update their own ranges of one
    /// replica at once (`train::replica`).
    fn step_shard(&self, shard: Shard<'_>, t: u64, lr: f64, grad_scale: f32) -> Result<()>;
    /// The state's buffers in `view`'s order, for writing (an error on the GPU).
    fn host_state_mut(&mut self) -> Result<Vec<&mut [f32]>>;
}

/// A flat buffer's parameter segments, and their table on the GPU once a step has run there.
pub struct Segments {
    host: Vec<Segment>,
    #[cfg(feature = "cuda")]
    device: Option<crate::cuda::DeviceSegments>,
}

impl Segments {
    pub fn new(host: Vec<Segment>) -> Self {
        Self {
            host,
            #[cfg(feature = "cuda")]
            device: None,
        }
    }

    /// The kernels of the GPU buffer `p` and the table there (uploaded at the first call).
    #[cfg(feature = "cuda")]
    fn device(
        &mut self,
        p: &crate::flat::DeviceFlat,
    ) -> Result<(
        std::sync::Arc<crate::cuda::Kernels>,
        &crate::cuda::DeviceSegments,
    )> {
        if self.device.is_none() {
            self.device = Some(p.kernels.segments(&self.host)?);
        }
        Ok((p.kernels.clone(), self.device.as_ref().expect("set above")))
    }
}

/// Builds the configured optimizer for a flat buffer laid out as `segments`, its state in `place`.
pub fn build(
    cfg: &OptimConfig,
    segments: Vec<Segment>,
    numel: usize,
    place: &Place,
) -> Result<Box<dyn Optimizer>> {
    let segs = Segments::new(segments);
    Ok(match cfg {
        OptimConfig::AdamW(c) => Box::new(AdamW {
            betas: c.betas,
            eps: c.eps,
            wd: c.weight_decay,
            segs,
            m: place.zeros(numel)?,
            v: place.zeros(numel)?,
            t: 0,
        }),
        OptimConfig::Sgd(c) => Box::new(MomentumSgd {
            momentum: c.momentum,
            nesterov: c.nesterov,
            wd: c.weight_decay,
            segs,
            buf: place.zeros(if c.momentum > 0.0 { numel } else { 0 })?,
            t: 0,
        }),
        OptimConfig::AccumAdamW(c) => Box::new(AccumAdamW {
            betas: c.betas,
            eps: c.eps,
            wd: c.weight_decay,
            k: c.accum_steps,
            segs,
            sm: place.zeros(numel)?,
            sv: place.zeros(numel)?,
            acc: place.zeros(numel)?,
            t: 0,
        }),
    })
}

pub struct AdamW {
    betas: [f64; 2],
    eps: f64,
    wd: f64,
    segs: Segments,
    m: Flat,
    v: Flat,
    t: u64,
}

impl AdamW {
    fn coefficients(&self, t: u64, lr: f64, grad_scale: f32) -> kernels::AdamWStep {
        kernels::AdamWStep {
            grad_scale,
            ..kernels::AdamWStep::new(self.betas, self.eps, self.wd, lr, t)
        }
    }
}

impl Optimizer for AdamW {
    fn step_scaled(
        &mut self,
        params: FlatMut<'_>,
        grads: FlatRef<'_>,
        lr: f64,
        grad_scale: f32,
    ) -> Result<()> {
        self.t += 1;
        let c = self.coefficients(self.t, lr, grad_scale);
        match (params, grads, &mut self.m, &mut self.v) {
            (FlatMut::Host(p), FlatRef::Host(g), Flat::Host(m), Flat::Host(v)) => {
                kernels::adamw(p, g, m, v, &self.segs.host, &c)
            }
            #[cfg(feature = "cuda")]
            (FlatMut::Cuda(p), FlatRef::Cuda(g), Flat::Cuda(m), Flat::Cuda(v)) => {
                let (k, segs) = self.segs.device(p)?;
                k.adamw(&mut p.buf, &g.buf, &mut m.buf, &mut v.buf, segs, &c)?
            }
            #[cfg(feature = "cuda")]
            _ => bail!(MIXED),
        }
        Ok(())
    }

    fn view(&self) -> OptimView<'_> {
        OptimView {
            name: "adamw",
            step: self.t,
            buffers: vec![
                ("exp_avg", self.m.as_ref()),
                ("exp_avg_sq", self.v.as_ref()),
            ],
        }
    }

    fn load_state(&mut self, state: OptimState) -> Result<()> {
        let [m, v] = take(
            state,
            "adamw",
            ["exp_avg", "exp_avg_sq"],
            self.m.len(),
            &mut self.t,
        )?;
        let place = self.m.place();
        (self.m, self.v) = (place.from_host(m)?, place.from_host(v)?);
        Ok(())
    }

    fn step_shard(&self, shard: Shard<'_>, t: u64, lr: f64, grad_scale: f32) -> Result<()> {
        let segs = shard.segs;
        let (p, g, [m, v]) = shard.state()?;
        kernels::adamw(p, g, m, v, segs, &self.coefficients(t, lr, grad_scale));
        Ok(())
    }

    fn host_state_mut(&mut self) -> Result<Vec<&mut [f32]>> {
        Ok(vec![self.m.host_mut()?, self.v.host_mut()?])
    }
}

/// Plain SGD with decoupled weight decay, p <- p (1 - lr wd) - lr g: the outer optimizer when Radius runs
/// Adam inside its reducer (`sync::compress::correction`), where g is Adam's direction.
pub struct Sgd {
    wd: f64,
    segs: Segments,
    t: u64,
}

impl Sgd {
    pub fn new(wd: f64, segments: Vec<Segment>) -> Self {
        Self {
            wd,
            segs: Segments::new(segments),
            t: 0,
        }
    }

    /// The state of an SGD that has taken `step` steps (it has no buffers).
    pub fn state_at(step: u64) -> OptimState {
        OptimState {
            name: "sgd".into(),
            step,
            buffers: Vec::new(),
        }
    }
}

impl Optimizer for Sgd {
    fn step_scaled(
        &mut self,
        params: FlatMut<'_>,
        grads: FlatRef<'_>,
        lr: f64,
        grad_scale: f32,
    ) -> Result<()> {
        self.t += 1;
        match (params, grads) {
            (FlatMut::Host(p), FlatRef::Host(g)) => {
                kernels::sgd(p, g, &self.segs.host, self.wd, lr, grad_scale)
            }
            #[cfg(feature = "cuda")]
            (FlatMut::Cuda(p), FlatRef::Cuda(g)) => {
                let (k, segs) = self.segs.device(p)?;
                k.sgd(&mut p.buf, &g.buf, segs, self.wd, lr, grad_scale)?
            }
            #[cfg(feature = "cuda")]
            _ => bail!(MIXED),
        }
        Ok(())
    }

    fn view(&self) -> OptimView<'_> {
        OptimView {
            name: "sgd",
            step: self.t,
            buffers: Vec::new(),
        }
    }

    fn load_state(&mut self, state: OptimState) -> Result<()> {
        let [] = take(state, "sgd", [], 0, &mut self.t)?;
        Ok(())
    }

    fn step_shard(&self, shard: Shard<'_>, _t: u64, lr: f64, grad_scale: f32) -> Result<()> {
        let segs = shard.segs;
        let (p, g, []) = shard.state()?;
        kernels::sgd(p, g, segs, self.wd, lr, grad_scale);
        Ok(())
    }

    fn host_state_mut(&mut self) -> Result<Vec<&mut [f32]>> {
        Ok(Vec::new())
    }
}

/// torch.optim.SGD (single-tensor, foreach=False), operation for operation: g' = g + wd p (decaying
/// segments only); with momentum mu: b = g' at the first step, then b = mu b + g'; the update direction is
/// g' + mu b with Nesterov, else b; p <- p - lr d.
pub struct MomentumSgd {
    momentum: f64,
    nesterov: bool,
    wd: f64,
    segs: Segments,
    /// The momentum buffer (empty without momentum).
    buf: Flat,
    t: u64,
}

impl MomentumSgd {
    fn coefficients(&self, t: u64, lr: f64, grad_scale: f32) -> kernels::SgdStep {
        kernels::SgdStep {
            wd: self.wd as f32,
            momentum: self.momentum as f32,
            lr: lr as f32,
            nesterov: self.nesterov,
            first: t == 1,
            grad_scale,
        }
    }
}

impl Optimizer for MomentumSgd {
    fn step_scaled(
        &mut self,
        params: FlatMut<'_>,
        grads: FlatRef<'_>,
        lr: f64,
        grad_scale: f32,
    ) -> Result<()> {
        self.t += 1;
        let c = self.coefficients(self.t, lr, grad_scale);
        match (params, grads, &mut self.buf) {
            (FlatMut::Host(p), FlatRef::Host(g), Flat::Host(b)) => {
                kernels::momentum_sgd(p, g, b, &self.segs.host, &c)
            }
            #[cfg(feature = "cuda")]
            (FlatMut::Cuda(p), FlatRef::Cuda(g), Flat::Cuda(b)) => {
                let (k, segs) = self.segs.device(p)?;
                let mut b = (!b.buf.is_empty()).then(|| b.buf.slice_mut(..));
                k.momentum_sgd(
                    &mut p.buf.slice_mut(..),
                    &g.buf.slice(..),
                    b.as_mut(),
                    segs,
                    &c,
                )?
            }
            #[cfg(feature = "cuda")]
            _ => bail!(MIXED),
        }
        Ok(())
    }

    fn view(&self) -> OptimView<'_> {
        OptimView {
            name: "sgd",
            step: self.t,
            buffers: if self.buf.is_empty() {
                Vec::new()
            } else {
                vec![("momentum_buffer", self.buf.as_ref())]
            },
        }
    }

    fn load_state(&mut self, state: OptimState) -> Result<()> {
        if self.buf.is_empty() {
            let [] = take(state, "sgd", [], 0, &mut self.t)?;
        } else {
            let n = self.buf.len();
            let [b] = take(state, "sgd", ["momentum_buffer"], n, &mut self.t)?;
            self.buf = self.buf.place().from_host(b)?;
        }
        Ok(())
    }

    fn step_shard(&self, shard: Shard<'_>, t: u64, lr: f64, grad_scale: f32) -> Result<()> {
        let (segs, c) = (shard.segs, self.coefficients(t, lr, grad_scale));
        if self.buf.is_empty() {
            let (p, g, []) = shard.state()?;
            kernels::momentum_sgd(p, g, &mut [], segs, &c);
        } else {
            let (p, g, [b]) = shard.state()?;
            kernels::momentum_sgd(p, g, b, segs, &c);
        }
        Ok(())
    }

    fn host_state_mut(&mut self) -> Result<Vec<&mut [f32]>> {
        Ok(if self.buf.is_empty() {
            Vec::new()
        } else {
            vec![self.buf.host_mut()?]
        })
    }
}

/// Decent-DP's AccumAdamW (optim.py): moments committed every K steps from the running mean of the
/// gradients, look-ahead moments in between, bias correction counted in commits.
pub struct AccumAdamW {
    betas: [f64; 2],
    eps: f64,
    wd: f64,
    k: u64,
    segs: Segments,
    /// Committed moments, stored pre-multiplied by beta1 / beta2 (as the reference).
    sm: Flat,
    sv: Flat,
    /// Running mean of the gradients since the last commit.
    acc: Flat,
    t: u64,
}

impl AccumAdamW {
    fn coefficients(&self, t: u64, lr: f64, grad_scale: f32) -> kernels::AccumStep {
        kernels::AccumStep {
            grad_scale,
            ..kernels::AccumStep::new(self.betas, self.eps, self.wd, self.k, lr, t)
        }
    }
}

impl Optimizer for AccumAdamW {
    fn step_scaled(
        &mut self,
        params: FlatMut<'_>,
        grads: FlatRef<'_>,
        lr: f64,
        grad_scale: f32,
    ) -> Result<()> {
        self.t += 1;
        let c = self.coefficients(self.t, lr, grad_scale);
        match (params, grads, &mut self.sm, &mut self.sv, &mut self.acc) {
            (
                FlatMut::Host(p),
                FlatRef::Host(g),
                Flat::Host(sm),
                Flat::Host(sv),
                Flat::Host(acc),
            ) => kernels::accum_adamw(p, g, sm, sv, acc, &self.segs.host, &c),
            #[cfg(feature = "cuda")]
            (
                FlatMut::Cuda(p),
                FlatRef::Cuda(g),
                Flat::Cuda(sm),
                Flat::Cuda(sv),
                Flat::Cuda(acc),
            ) => {
                let (k, segs) = self.segs.device(p)?;
                let (sm, sv, acc) = (&mut sm.buf, &mut sv.buf, &mut acc.buf);
                k.accum_adamw(&mut p.buf, &g.buf, sm, sv, acc, segs, &c)?
            }
            #[cfg(feature = "cuda")]
            _ => bail!(MIXED),
        }
        Ok(())
    }

    fn view(&self) -> OptimView<'_> {
        OptimView {
            name: "accumadamw",
            step: self.t,
            buffers: vec![
                ("committed_m", self.sm.as_ref()),
                ("committed_v", self.sv.as_ref()),
                ("grad_mean", self.acc.as_ref()),
            ],
        }
    }

    fn load_state(&mut self, state: OptimState) -> Result<()> {
        let [sm, sv, acc] = take(
            state,
            "accumadamw",
            ["committed_m", "committed_v", "grad_mean"],
            self.sm.len(),
            &mut self.t,
        )?;
        let place = self.sm.place();
        (self.sm, self.sv, self.acc) = (
            place.from_host(sm)?,
            place.from_host(sv)?,
            place.from_host(acc)?,
        );
        Ok(())
    }

    fn step_shard(&self, shard: Shard<'_>, t: u64, lr: f64, grad_scale: f32) -> Result<()> {
        let segs = shard.segs;
        let (p, g, [sm, sv, acc]) = shard.state()?;
        let c = self.coefficients(t, lr, grad_scale);
        kernels::accum_adamw(p, g, sm, sv, acc, segs, &c);
        Ok(())
    }

    fn host_state_mut(&mut self) -> Result<Vec<&mut [f32]>> {
        Ok(vec![
            self.sm.host_mut()?,
            self.sv.host_mut()?,
            self.acc.host_mut()?,
        ])
    }
}

/// Checks a saved state against this optimizer and returns its buffers in `names` order.
fn take<const N: usize>(
    state: OptimState,
    kind: &str,
    names: [&str; N],
    numel: usize,
    t: &mut u64,
) -> Result<[Vec<f32>; N]> {
    if state.name != kind {
        bail!(
            "the checkpoint holds {} state but the config's optimizer is {kind}; use checkpoint_mode = \"weights\" to switch optimizers",
            state.name
        );
    }
    let mut out: [Vec<f32>; N] = std::array::from_fn(|_| Vec::new());
    let mut buffers = state.buffers;
    for (slot, name) in out.iter_mut().zip(names) {
        let i = buffers
            .iter()
            .position(|(n, _)| n == name)
            .ok_or_else(|| anyhow::anyhow!("optimizer state has no buffer {name}"))?;
        let (_, b) = buffers.swap_remove(i);
        if b.len() != numel {
            bail!(
                "optimizer buffer {name} has {} values, the model {numel}",
                b.len()
            );
        }
        *slot = b;
    }
    *t = state.step;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{AccumAdamWConfig, AdamWConfig};

    /// AdamW(lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1) on p = [1, -2] (decayed) and
    /// q = [0.5] (not decayed) with gradients g_t = [0.1 t, -0.2], [0.3 / t], three steps, against the
    /// algorithm as PyTorch's documentation states it (f64).
    #[test]
    fn adamw_matches_torch() {
        let cfg = OptimConfig::AdamW(AdamWConfig {
            betas: [0.9, 0.95],
            eps: 1e-8,
            weight_decay: 0.1,
        });
        let segs = vec![
            Segment {
                offset: 0,
                len: 2,
                decay: true,
            },
            Segment {
                offset: 2,
                len: 1,
                decay: false,
            },
        ];
        let mut opt = build(&cfg, segs, 3, &Place::Host).unwrap();
        let mut p = vec![1.0f32, -2.0, 0.5];
        for t in 1..=3 {
            let g = [0.1 * t as f32, -0.2, 0.3 / t as f32];
            opt.step((&mut p).into(), (&g[..]).into(), 0.1).unwrap();
        }
        let want = reference_adamw(
            &[1.0, -2.0, 0.5],
            [true, true, false],
            0.1,
            0.9,
            0.95,
            1e-8,
            0.1,
        );
        for (a, b) in p.iter().zip(&want) {
            assert!((a - b).abs() < 1e-6, "{p:?} vs {want:?}");
        }
    }

    /// The AdamW algorithm of the PyTorch documentation, in f64.
    fn reference_adamw(
        p0: &[f64],
        decay: [bool; 3],
        lr: f64,
        b1: f64,
        b2: f64,
        eps: f64,
        wd: f64,
    ) -> Vec<f32> {
        let mut p = p0.to_vec();
        let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
        for t in 1..=3 {
            let g = [0.1 * t as f64, -0.2, 0.3 / t as f64];
            for i in 0..3 {
                if decay[i] {
                    p[i] -= lr * wd * p[i];
                }
                m[i] = b1 * m[i] + (1.0 - b1) * g[i];
                v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
                let mh = m[i] / (1.0 - b1.powi(t));
                let vh = v[i] / (1.0 - b2.powi(t));
                p[i] -= lr * mh / (vh.sqrt() + eps);
            }
        }
        p.iter().map(|&x| x as f32).collect()
    }

    #[test]
    fn accumadamw_follows_the_reference_recurrence() {
        let cfg = OptimConfig::AccumAdamW(AccumAdamWConfig {
            betas: [0.9, 0.98],
            eps: 1e-8,
            weight_decay: 0.0,
            accum_steps: 2,
        });
        let mut opt = build(
            &cfg,
            vec![Segment {
                offset: 0,
                len: 1,
                decay: true,
            }],
            1,
            &Place::Host,
        )
        .unwrap();
        let mut p = vec![0.0f32];
        let gs = [1.0f64, 3.0, -2.0, 0.5];
        // f64 transcription of Decent-DP's optim.py.
        let (b1, b2, k, lr, eps) = (0.9f64, 0.98f64, 2u64, 0.01f64, 1e-8f64);
        let (mut sm, mut sv, mut acc, mut q) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
        for (i, &g) in gs.iter().enumerate() {
            let t = i as u64 + 1;
            opt.step((&mut p).into(), (&[g as f32][..]).into(), lr)
                .unwrap();
            acc += g / k as f64;
            let m = sm + (1.0 - b1) * g;
            let v = sv + (1.0 - b2) * g * g;
            let c = t.div_ceil(k) as i32;
            q -= lr / (1.0 - b1.powi(c)) * m / (v.sqrt() / (1.0 - b2.powi(c)).sqrt() + eps);
            if t.is_multiple_of(k) {
                sm = b1 * (sm + (1.0 - b1) * acc);
                sv = b2 * (sv + (1.0 - b2) * acc * acc);
                acc = 0.0;
            }
            assert!((p[0] as f64 - q).abs() < 1e-6, "step {t}: {} vs {q}", p[0]);
        }
    }

    /// Shards updated alone (`step_shard`, cut anywhere, even inside a segment) give the bits of the whole
    /// step, for every optimizer, over steps that cross AccumAdamW's commits and torch SGD's first step.
    #[test]
    fn shards_updated_apart_are_the_whole_step() {
        use crate::config::optim::SgdConfig;
        use rand::{Rng, SeedableRng};
        let configs = [
            OptimConfig::AdamW(AdamWConfig::default()),
            OptimConfig::AccumAdamW(AccumAdamWConfig {
                accum_steps: 2,
                ..AccumAdamWConfig::default()
            }),
            OptimConfig::Sgd(SgdConfig {
                momentum: 0.9,
                nesterov: true,
                weight_decay: 0.1,
            }),
            OptimConfig::Sgd(SgdConfig {
                momentum: 0.0,
                nesterov: false,
                weight_decay: 0.1,
            }),
        ];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let segs = Segment::end_to_end([(37, true), (5, false), (90, true), (1, false)]);
        let n = 133;
        let cuts = [0, 3, 37, 40, 41, 100, 133];
        let mut optimizers: Vec<(String, Box<dyn Optimizer>)> = configs
            .iter()
            .map(|c| {
                (
                    format!("{c:?}"),
                    build(c, segs.clone(), n, &Place::Host).unwrap(),
                )
            })
            .collect();
        optimizers.push(("plain sgd".into(), Box::new(Sgd::new(0.1, segs.clone()))));
        for (name, mut whole) in optimizers {
            let mut sharded = build_like(&name, &configs, &segs, n);
            let mut p: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut q = p.clone();
            for t in 1..=5u64 {
                let g: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
                let (lr, scale) = (0.01 * t as f64, 0.5 + 0.1 * t as f32);
                whole
                    .step_scaled((&mut p).into(), (&g[..]).into(), lr, scale)
                    .unwrap();
                // As the local engine's shared replica holds them: the buffers' addresses.
                let state: Vec<*mut f32> = sharded
                    .host_state_mut()
                    .unwrap()
                    .into_iter()
                    .map(|b| b.as_mut_ptr())
                    .collect();
                for w in cuts.windows(2) {
                    let r = w[0]..w[1];
                    let cut = Segment::cut(&segs, r.clone());
                    let shard = Shard {
                        segs: &cut,
                        params: &mut q[r.clone()],
                        grads: &g[r.clone()],
                        // SAFETY: disjoint ranges of live buffers, one shard at a time.
                        state: state
                            .iter()
                            .map(|&b| unsafe {
                                std::slice::from_raw_parts_mut(b.add(r.start), r.len())
                            })
                            .collect(),
                    };
                    sharded.step_shard(shard, t, lr, scale).unwrap();
                }
                assert_eq!(p, q, "{name}, step {t}");
            }
            let (a, b) = (whole.state().unwrap(), sharded.state().unwrap());
            assert_eq!(a.buffers, b.buffers, "{name}");
        }
    }

    fn build_like(
        name: &str,
        configs: &[OptimConfig],
        segs: &[Segment],
        n: usize,
    ) -> Box<dyn Optimizer> {
        match configs.iter().find(|c| format!("{c:?}") == name) {
            Some(c) => build(c, segs.to_vec(), n, &Place::Host).unwrap(),
            None => Box::new(Sgd::new(0.1, segs.to_vec())),
        }
    }

    #[test]
    fn cut_segments_cover_the_range_from_its_start() {
        let segs = Segment::end_to_end([(4, true), (3, false), (5, true)]);
        assert_eq!(
            Segment::cut(&segs, 2..9),
            Segment::end_to_end([(2, true), (3, false), (2, true)])
        );
        assert_eq!(Segment::cut(&segs, 4..7), Segment::end_to_end([(3, false)]));
        assert!(Segment::cut(&segs, 5..5).is_empty());
    }

    #[test]
    fn state_round_trips_and_rejects_another_optimizer() {
        let cfg = OptimConfig::AdamW(AdamWConfig::default());
        let seg = vec![Segment {
            offset: 0,
            len: 2,
            decay: true,
        }];
        let mut a = build(&cfg, seg.clone(), 2, &Place::Host).unwrap();
        let mut p = vec![1.0f32, 2.0];
        a.step((&mut p).into(), (&[0.5, -0.5][..]).into(), 0.01)
            .unwrap();
        let mut b = build(&cfg, seg.clone(), 2, &Place::Host).unwrap();
        b.load_state(a.state().unwrap()).unwrap();
        let mut p2 = p.clone();
        let g = [0.1f32, 0.2];
        a.step((&mut p).into(), (&g[..]).into(), 0.01).unwrap();
        b.step((&mut p2).into(), (&g[..]).into(), 0.01).unwrap();
        assert_eq!(p, p2);
        let mut c = build(
            &OptimConfig::AccumAdamW(AccumAdamWConfig::default()),
            seg,
            2,
            &Place::Host,
        )
        .unwrap();
        assert!(c
            .load_state(a.state().unwrap())
            .unwrap_err()
            .to_string()
            .contains("weights"));
    }
}

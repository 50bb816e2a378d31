//! AdamW (torch.optim.AdamW's single-tensor update, operation for operation) and Decent-DP's AccumAdamW.

use anyhow::Result;

use super::optimizer::{step_unfolded, take, OptimState, OptimView, Optimizer, Segments, Shard};
use crate::config::{AccumAdamWConfig, AdamWConfig};
#[cfg(feature = "cuda")]
use crate::flat::MIXED;
use crate::flat::{Flat, FlatMut, FlatRef, Place};
use crate::kernels::optim as kernels;
use crate::kernels::optim::Mixing;

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
    pub(super) fn new(
        c: &AdamWConfig,
        segs: Segments,
        numel: usize,
        place: &Place,
    ) -> Result<Self> {
        Ok(Self {
            betas: c.betas,
            eps: c.eps,
            wd: c.weight_decay,
            segs,
            m: place.state_zeros(numel)?,
            v: place.state_zeros(numel)?,
            t: 0,
        })
    }

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
            _ => anyhow::bail!(MIXED),
        }
        Ok(())
    }

    /// One pass: the mix, the update and the scaled copy a tile at a time (`kernels::adamw_mixed`).
    fn step_mixed(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        (lr, grad_scale): (f64, f32),
        mut mixing: Mixing<'_>,
    ) -> Result<()> {
        let c = self.coefficients(self.t + 1, lr, grad_scale);
        match (&mut self.m, &mut self.v) {
            (Flat::Host(m), Flat::Host(v)) if Mixing::covers(&self.segs.host, params.len()) => {
                self.t += 1;
                kernels::adamw_mixed(params, grads, m, v, &self.segs.host, &c, Some(&mut mixing));
                Ok(())
            }
            _ => step_unfolded(self, params, grads, (lr, grad_scale), mixing),
        }
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
    pub(super) fn new(
        c: &AccumAdamWConfig,
        segs: Segments,
        numel: usize,
        place: &Place,
    ) -> Result<Self> {
        Ok(Self {
            betas: c.betas,
            eps: c.eps,
            wd: c.weight_decay,
            k: c.accum_steps,
            segs,
            sm: place.state_zeros(numel)?,
            sv: place.state_zeros(numel)?,
            acc: place.state_zeros(numel)?,
            t: 0,
        })
    }

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
            _ => anyhow::bail!(MIXED),
        }
        Ok(())
    }

    /// One pass, as AdamW's (`kernels::accum_adamw_mixed`).
    fn step_mixed(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        (lr, grad_scale): (f64, f32),
        mut mixing: Mixing<'_>,
    ) -> Result<()> {
        let c = self.coefficients(self.t + 1, lr, grad_scale);
        match (&mut self.sm, &mut self.sv, &mut self.acc) {
            (Flat::Host(sm), Flat::Host(sv), Flat::Host(acc))
                if Mixing::covers(&self.segs.host, params.len()) =>
            {
                self.t += 1;
                let (segs, m) = (&self.segs.host, Some(&mut mixing));
                kernels::accum_adamw_mixed(params, grads, [sm, sv, acc], segs, &c, m);
                Ok(())
            }
            _ => step_unfolded(self, params, grads, (lr, grad_scale), mixing),
        }
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

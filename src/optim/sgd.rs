//! SGD: torch.optim.SGD with momentum and Nesterov, and the plain decoupled-decay SGD that runs as the
//! outer optimizer when the reducer computes the direction.

use anyhow::Result;

use super::optimizer::{take, OptimState, OptimView, Optimizer, Segments, Shard};
use crate::config::optim::SgdConfig;
#[cfg(feature = "cuda")]
use crate::flat::MIXED;
use crate::flat::{Flat, FlatMut, FlatRef, Place};
use crate::kernels::optim as kernels;
use crate::kernels::Segment;

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
            _ => anyhow::bail!(MIXED),
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
    pub(super) fn new(c: &SgdConfig, segs: Segments, numel: usize, place: &Place) -> Result<Self> {
        Ok(Self {
            momentum: c.momentum,
            nesterov: c.nesterov,
            wd: c.weight_decay,
            segs,
            buf: place.state_zeros(if c.momentum > 0.0 { numel } else { 0 })?,
            t: 0,
        })
    }

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
            _ => anyhow::bail!(MIXED),
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

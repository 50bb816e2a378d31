//! The optimizer interface: the trait the training loop steps, its checkpointed state, the views the
//! reducers read it through, and the builder from the config.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::adamw::{AccumAdamW, AdamW};
use super::muon::Muon;
use super::sgd::MomentumSgd;
use crate::config::OptimConfig;
use crate::flat::{FlatMut, FlatRef, Place};
use crate::kernels::optim::Mixing;
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
    pub(super) fn state<const N: usize>(self) -> Result<ShardParts<'a, N>> {
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
    /// `step_scaled` on host buffers with gossip's mix around it (`Mixing`): x <- own x + buf before the
    /// update, buf <- x other after it. The same values as the three passes one after the other, which
    /// this default makes; the element-wise optimizers fold the two into their own pass.
    fn step_mixed(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        (lr, grad_scale): (f64, f32),
        mixing: Mixing<'_>,
    ) -> Result<()> {
        step_unfolded(self, params, grads, (lr, grad_scale), mixing)
    }
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

/// `Optimizer::step_mixed` as three passes: the mix, `step_scaled`, the scaled copy.
pub(super) fn step_unfolded<O: Optimizer + ?Sized>(
    opt: &mut O,
    params: &mut [f32],
    grads: &[f32],
    (lr, grad_scale): (f64, f32),
    mut mixing: Mixing<'_>,
) -> Result<()> {
    mixing.before(params, 0);
    opt.step_scaled(FlatMut::Host(params), FlatRef::Host(grads), lr, grad_scale)?;
    mixing.after(params, 0);
    Ok(())
}

/// A flat buffer's parameter segments, and their table on the GPU once a step has run there.
pub(super) struct Segments {
    pub(super) host: Vec<Segment>,
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
    pub(super) fn device(
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

/// Builds the configured optimizer for a flat buffer laid out as `segments`, its state in `place`;
/// `hidden[i]`: whether segment i is a hidden matrix (Muon's group; the others ignore it).
pub fn build(
    cfg: &OptimConfig,
    segments: Vec<Segment>,
    hidden: &[bool],
    numel: usize,
    place: &Place,
) -> Result<Box<dyn Optimizer>> {
    let segs = Segments::new(segments);
    Ok(match cfg {
        OptimConfig::AdamW(c) => Box::new(AdamW::new(c, segs, numel, place)?),
        OptimConfig::Sgd(c) => Box::new(MomentumSgd::new(c, segs, numel, place)?),
        OptimConfig::AccumAdamW(c) => Box::new(AccumAdamW::new(c, segs, numel, place)?),
        OptimConfig::Muon(c) => Box::new(Muon::new(c, segs, hidden, numel, place)?),
    })
}

/// Checks a saved state against this optimizer and returns its buffers in `names` order.
pub(super) fn take<const N: usize>(
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

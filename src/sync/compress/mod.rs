//! Compressed gradient reducers for the gradient-averaging backend: top-k with error feedback, Radius
//! stable top-k and PowerSGD. A reducer turns this rank's flat gradient into the (approximate) average
//! over ranks, through the `Communicator`, and owns all its state (residuals, masks, low-rank factors)
//! so that checkpoints restore it exactly.

pub mod correction;
pub mod powersgd;
pub mod radius;
pub mod sparseloco;
pub mod topk;

use anyhow::{bail, Result};

use super::trace::{Collective, Op, Overlap};
use crate::comm::{all_reduce_bytes, CommStats, Communicator};
use crate::flat::FlatMut;
use crate::kernels::Segment;
use crate::sync::plan::ReducerPlan;

/// What one reduction measured, for the metrics rows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// ||g - g_hat|| / ||g|| on this rank: g its gradient plus residual, g_hat what it applies.
    pub error: Option<f64>,
    /// Radius: |new ∩ old| / |new| of the top-k selections at a re-selection.
    pub overlap: Option<f64>,
    /// PowerSGD: fraction of the parameters in compressed matrices.
    pub compressed_fraction: Option<f64>,
    /// Radius with correction: the reduced gradient's global norm before the reducer clipped it.
    pub grad_norm: Option<f64>,
}

/// A state buffer of the size of the model (a reducer's residual, a gossip channel's public copy): in
/// host memory on the host path, and after a restore until a GPU step moves it up; on the GPU on the
/// device path. The paths take it for a step and keep it after (`take_*`, `keep_*`), so that it can be
/// changed beside its owner's other fields.
#[derive(Default)]
pub struct StateBuf {
    host: Vec<f32>,
    #[cfg(feature = "cuda")]
    device: Option<cudarc::driver::CudaSlice<f32>>,
}

impl StateBuf {
    /// The host residual of `len` values (zeros when none of that length is kept; state read before it
    /// is written, so with its pages mapped: `flat::mapped_zeros`).
    pub fn take_host(&mut self, len: usize) -> Vec<f32> {
        match std::mem::take(&mut self.host) {
            r if r.len() == len => r,
            _ => crate::flat::mapped_zeros(len),
        }
    }

    pub fn keep_host(&mut self, r: Vec<f32>) {
        self.host = r;
    }

    /// The buffer kept in host memory (empty when none is, or it is on the GPU).
    pub fn host(&self) -> &[f32] {
        &self.host
    }

    /// The residual of `len` values on the GPU of `stream`: the one kept there, a restored one moved
    /// up, or zeros.
    #[cfg(feature = "cuda")]
    pub fn take_device(
        &mut self,
        len: usize,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<cudarc::driver::CudaSlice<f32>> {
        if let Some(r) = self.device.take().filter(|r| r.len() == len) {
            return Ok(r);
        }
        let restored = std::mem::take(&mut self.host);
        Ok(match restored.len() == len {
            true => stream.clone_htod(&restored)?,
            false => stream.alloc_zeros::<f32>(len)?,
        })
    }

    #[cfg(feature = "cuda")]
    pub fn keep_device(&mut self, r: cudarc::driver::CudaSlice<f32>) {
        self.device = Some(r);
    }

    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// A checkpoint's residual, kept on the host until a step takes it.
    pub fn restore(&mut self, r: Vec<f32>) {
        self.clear();
        self.host = r;
    }

    /// A reducer's state when the residual is all of it: `residual`, when one is kept.
    pub fn residual_state(&self) -> Result<State> {
        Ok(match self.to_host()? {
            Some(r) => vec![("residual".into(), r)],
            None => Vec::new(),
        })
    }

    /// Restores `residual_state` for a model of `numel` values (an empty state: no residual).
    pub fn load_residual(&mut self, mut state: State, numel: usize) -> Result<()> {
        self.clear();
        if !state.is_empty() {
            let r = take(&mut state, "residual", Some(numel))?;
            self.restore(r);
        }
        Ok(())
    }

    /// A host copy; None when no residual is kept.
    pub fn to_host(&self) -> Result<Option<Vec<f32>>> {
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.device {
            return Ok(Some(r.stream().clone_dtoh(r)?));
        }
        Ok((!self.host.is_empty()).then(|| self.host.clone()))
    }
}

/// Named f32 buffers: a reducer's state in a checkpoint.
pub type State = Vec<(String, Vec<f32>)>;

pub trait Reducer {
    /// Replaces `grads` (this rank's gradient) with the reduced average gradient of step `step`.
    fn reduce(
        &mut self,
        comm: &mut dyn Communicator,
        grads: &mut [f32],
        step: u64,
    ) -> Result<Report>;
    /// `reduce` on the gradient wherever it lives: on the GPU of an engine with device collectives the
    /// reducer's device path (`reduce_device`) where it has one, otherwise through a host copy.
    fn reduce_flat(
        &mut self,
        comm: &mut dyn Communicator,
        grads: FlatMut<'_>,
        step: u64,
    ) -> Result<Report> {
        match grads {
            #[cfg(feature = "cuda")]
            FlatMut::Cuda(d) if comm.device_collectives() && self.has_device_path() => {
                self.reduce_device(comm, d, step)
            }
            g => g.through_host(|g| self.reduce(comm, g, step)),
        }
    }
    /// Whether `reduce_device` is this reducer's: its steps as CUDA kernels on device buffers.
    fn has_device_path(&self) -> bool {
        false
    }
    /// On a shared replica a rank reads only `part` of the reduced gradient (its grad norm's tiles and
    /// its update's range): a reducer may then decode that part alone and leave any values in the rest
    /// of `grads`. The others decode it all.
    fn decode_part(&mut self, _part: std::ops::Range<usize>) {}
    /// `reduce` on a gradient on the GPU, with the engine's device collectives.
    #[cfg(feature = "cuda")]
    fn reduce_device(
        &mut self,
        _comm: &mut dyn Communicator,
        _grads: &mut crate::flat::DeviceFlat,
        _step: u64,
    ) -> Result<Report> {
        bail!("internal error: this reducer has no device path")
    }
    /// The collectives of step `step` over `world` ranks (what `reduce` runs then).
    fn step_comm(&self, world: usize, step: u64) -> Vec<Collective>;
    /// The state to checkpoint (host copies of device buffers).
    fn state(&self) -> Result<State>;
    /// Restores `state()`; an empty state (a dense checkpoint) starts the reducer fresh.
    fn load_state(&mut self, state: State) -> Result<()>;
    /// Live recovery (`train.membership`): the part of the state that every rank holds alike, which a
    /// rank coming back copies from a live peer (PowerSGD's factors, Radius's mask, the correction's
    /// Adam). None by default: error feedback is each rank's own.
    fn shared_state(&self) -> Result<State> {
        Ok(Vec::new())
    }
    /// On the rank that came back: takes a live peer's `shared_state`. What is the rank's own (its error
    /// feedback: the part of gradients of a model it no longer holds that it never sent) restarts at zero.
    fn rejoined(&mut self, shared: State) -> Result<()> {
        self.load_state(shared)
    }
}

/// The planned reducer (its rules were checked when the plan was resolved).
pub fn build(plan: &ReducerPlan, tensors: Vec<Segment>) -> Box<dyn Reducer> {
    match plan {
        ReducerPlan::TopK(k) => {
            Box::new(topk::TopK::new(tensors, k.density, k.error_feedback_on()))
        }
        ReducerPlan::Radius { cfg, correction } => {
            let numel = tensors.iter().map(|t| t.len).sum();
            let radius = Box::new(radius::Radius::new(tensors, cfg.clone()));
            match correction {
                None => radius,
                Some(c) => Box::new(correction::Corrected::new(
                    radius, numel, c.betas, c.eps, c.clip,
                )),
            }
        }
        ReducerPlan::PowerSgd { cfg, seed } => {
            Box::new(powersgd::PowerSgd::new(tensors, cfg.clone(), *seed))
        }
        ReducerPlan::SparseLoco(cfg) => Box::new(sparseloco::SparseLoco::new(tensors, cfg)),
    }
}

/// Checks and takes a named buffer out of a restored state.
pub fn take(state: &mut State, name: &str, len: Option<usize>) -> Result<Vec<f32>> {
    let Some(i) = state.iter().position(|(n, _)| n == name) else {
        bail!(crate::error::BadInput(format!(
            "checkpoint: the reducer state has no buffer {name:?} (found {:?})",
            state.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()
        )));
    };
    let (_, v) = state.swap_remove(i);
    if let Some(len) = len.filter(|&l| l != v.len()) {
        bail!(crate::error::BadInput(format!(
            "checkpoint: reducer buffer {name:?} holds {} values, this model needs {len}",
            v.len()
        )));
    }
    Ok(v)
}

/// Indices (u32) carried in f32 buffers bit for bit: collectives and checkpoints move bytes, never
/// arithmetic, on them.
pub fn indices_to_f32(idx: &[u32]) -> Vec<f32> {
    idx.iter().map(|&i| f32::from_bits(i)).collect()
}

pub fn f32_to_indices(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `x` cut into the tensors' entries, which tile it in order.
pub fn per_tensor<'a>(mut x: &'a mut [f32], tensors: &[Segment]) -> Vec<&'a mut [f32]> {
    let mut at = 0;
    let parts = tensors.iter().map(|t| {
        assert_eq!(t.offset, at, "tensors tile the flat buffer in order");
        let (head, rest) = std::mem::take(&mut x).split_at_mut(t.len);
        (x, at) = (rest, at + t.len);
        head
    });
    let parts = parts.collect();
    assert!(x.is_empty(), "tensors tile the flat buffer");
    parts
}

/// g[i] *= s at each i whose bit is set in `marks` (bit i % 64 of word i / 64), clearing the marks.
pub(super) fn scale_marked(g: &mut [f32], marks: &mut [u64], s: f32) {
    for (w, word) in marks.iter_mut().enumerate() {
        let mut bits = std::mem::take(word);
        while bits != 0 {
            g[64 * w + bits.trailing_zeros() as usize] *= s;
            bits &= bits - 1;
        }
    }
}

/// Number of entries of a matrix tensor that top-k keeps: max(floor(density * len), 1).
pub fn k_of(density: f64, len: usize) -> usize {
    ((density * len as f64) as usize).clamp(1, len.max(1))
}

/// An all-reduce of `words` over the world that waits for nothing else (compressed reducers).
pub fn all_reduce(words: usize, world: usize) -> Collective {
    Collective::world(
        Op::AllReduce {
            words: words as u64,
        },
        world,
        Overlap::None,
    )
}

/// Sums of the reducer metrics between two metrics rows.
#[derive(Debug, Default)]
pub struct Tally {
    dense_bytes: u64,
    sent_bytes: u64,
    error: (f64, u64),
    overlap: (f64, u64),
    fraction: Option<f64>,
}

impl Tally {
    pub fn add(
        &mut self,
        numel: usize,
        n: usize,
        rank: usize,
        before: &CommStats,
        after: &CommStats,
        r: &Report,
    ) {
        self.dense_bytes += all_reduce_bytes(numel, n, rank);
        self.sent_bytes += after.bytes_sent - before.bytes_sent;
        if let Some(e) = r.error {
            self.error.0 += e;
            self.error.1 += 1;
        }
        if let Some(o) = r.overlap {
            self.overlap.0 += o;
            self.overlap.1 += 1;
        }
        if r.compressed_fraction.is_some() {
            self.fraction = r.compressed_fraction;
        }
    }

    /// The averages since the last call, as written into the metrics row.
    pub fn take(&mut self) -> crate::sync::Metrics {
        let w = std::mem::take(self);
        let mean = |(s, c): (f64, u64)| (c > 0).then(|| s / c as f64);
        crate::sync::Metrics {
            compression_ratio: (w.sent_bytes > 0)
                .then(|| w.dense_bytes as f64 / w.sent_bytes as f64),
            compression_error: mean(w.error),
            topk_overlap: mean(w.overlap),
            compressed_fraction: w.fraction,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_survive_the_trip_through_f32() {
        let idx = vec![0u32, 1, 0x7fc0_0001, u32::MAX, 123_456_789];
        assert_eq!(f32_to_indices(&indices_to_f32(&idx)), idx);
    }
}

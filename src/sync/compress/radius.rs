//! Radius, stable top-k (the reference's `StableTopKReducerWithRangeBucketsEFCorrectionResIsGrad`, plain
//! mode). Dense all-reduce before `threshold`. Every `interval` steps after it: a dense all-reduce of
//! gradient + residual, the residual is cleared, and each matrix tensor's top-k indices of the *averaged*
//! gradient (widened by +-range) become the mask that all ranks share; vectors are always in the mask.
//! Other steps all-reduce only the masked values (no index exchange) and keep the rest as residual: the
//! residual is the gradient not yet sent ("residual is gradient").

use anyhow::Result;
use rayon::prelude::*;

use super::{
    all_reduce, f32_to_indices, indices_to_f32, k_of, take, Reducer, Report, Segment, State,
    StateBuf,
};
use crate::comm::{all_reduce_mean, Communicator};
use crate::config::backend::RadiusConfig;
use crate::kernels;
use crate::optim::global_norm;
use crate::sync::trace::Collective;

/// The key of `shared_state` that says the peer has no mask yet and selects one at its next compressed
/// step (it was restored from a dense checkpoint).
const UNSELECTED: &str = "unselected";

pub struct Radius {
    tensors: Vec<Segment>,
    cfg: RadiusConfig,
    residual: StateBuf,
    /// Sorted flat indices all-reduced on stable steps.
    mask: Vec<u32>,
    /// The top-k selections before widening, for the overlap between re-selections.
    core: Vec<u32>,
    /// Restored without a mask (from a dense checkpoint): the first compressed step selects one.
    unselected: bool,
    /// `mask` on the GPU, once a device step has used it.
    #[cfg(feature = "cuda")]
    device_mask: Option<cudarc::driver::CudaSlice<u32>>,
}

impl Radius {
    pub fn new(tensors: Vec<Segment>, cfg: RadiusConfig) -> Self {
        Self {
            tensors,
            cfg,
            residual: StateBuf::default(),
            mask: Vec::new(),
            core: Vec::new(),
            unselected: false,
            #[cfg(feature = "cuda")]
            device_mask: None,
        }
    }

    fn numel(&self) -> usize {
        self.tensors.iter().map(|t| t.len).sum()
    }

    /// Whether `step` re-selects the mask: on the interval grid from `threshold`, or when there is none
    /// yet (a run switched from a dense checkpoint).
    fn reselects(&self, step: u64) -> bool {
        self.mask.is_empty() || (step - self.cfg.threshold).is_multiple_of(self.cfg.interval)
    }

    /// Top-k of each matrix tensor of `avg` (the core) and the mask: core widened by +-range, plus
    /// every vector tensor whole.
    fn select(&self, avg: &[f32]) -> (Vec<u32>, Vec<u32>) {
        let cores: Vec<Vec<u32>> = self
            .tensors
            .par_iter()
            .map(|t| {
                let mut core = Vec::new();
                if t.matrix {
                    let k = k_of(self.cfg.density, t.len);
                    let base = t.offset as u32;
                    kernels::top_k(&avg[t.range()], k, base, &mut core, &mut Vec::new());
                }
                core
            })
            .collect();
        self.widen(cores)
    }

    /// The core (each matrix tensor's top-k indices, ascending, in `cores`) and the mask: every core
    /// index widened by +-range within its tensor, and every vector tensor whole.
    fn widen(&self, cores: Vec<Vec<u32>>) -> (Vec<u32>, Vec<u32>) {
        let range = self.cfg.range as usize;
        let mut mask = Vec::new();
        for (t, core) in self.tensors.iter().zip(&cores) {
            let (lo, hi) = (t.offset, t.offset + t.len);
            if !t.matrix {
                mask.extend(lo as u32..hi as u32);
                continue;
            }
            let start = mask.len();
            for &c in core {
                let c = c as usize;
                // core is ascending: skip what the previous window of this tensor already covered.
                let covered = mask[start..].last().map_or(lo, |&m| m as usize + 1);
                let from = c.saturating_sub(range).max(covered);
                let to = (c + range + 1).min(hi);
                mask.extend((from..to).map(|i| i as u32));
            }
        }
        (cores.concat(), mask)
    }

    /// Adopts a new selection; the report of a re-selection step.
    fn adopt(&mut self, (core, mask): (Vec<u32>, Vec<u32>)) -> Report {
        let had = !self.core.is_empty();
        let ov = overlap(&core, &self.core);
        (self.core, self.mask) = (core, mask);
        Report {
            error: Some(0.0),
            overlap: had.then_some(ov),
            ..Report::default()
        }
    }

    /// The mask of the current interval (for tests and diagnostics).
    pub fn mask(&self) -> &[u32] {
        &self.mask
    }
}

/// |a ∩ b| / |a| for ascending index lists.
fn overlap(a: &[u32], b: &[u32]) -> f64 {
    if a.is_empty() {
        return 1.0;
    }
    let (mut i, mut j, mut both) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                both += 1;
                i += 1;
                j += 1;
            }
        }
    }
    both as f64 / a.len() as f64
}

impl Reducer for Radius {
    fn reduce(
        &mut self,
        comm: &mut dyn Communicator,
        grads: &mut [f32],
        step: u64,
    ) -> Result<Report> {
        if step < self.cfg.threshold {
            all_reduce_mean(comm, grads)?;
            return Ok(Report::default());
        }
        let mut residual = self.residual.take_host(grads.len());
        let report = if self.reselects(step) {
            if self.cfg.error_feedback {
                kernels::ef_accumulate(grads, &residual);
            }
            all_reduce_mean(comm, grads)?;
            residual.iter_mut().for_each(|r| *r = 0.0);
            let selection = self.select(grads);
            self.adopt(selection)
        } else {
            // The accumulated gradient, its copy into the residual and its norm in one pass. The masked
            // values are sent; the residual is the gradient not sent (outside the mask).
            let feedback = self.cfg.error_feedback;
            let acc_norm = kernels::ef_accumulate_keep(grads, &mut residual, feedback).sqrt();
            let mut vals = vec![0.0f32; self.mask.len()];
            kernels::gather_clear(&mut residual, &self.mask, &mut vals);
            all_reduce_mean(comm, &mut vals)?;
            // The compression error (a pass over the residual) for the metrics rows, which rank 0
            // writes.
            let lost = (comm.rank() == 0).then(|| global_norm(&residual));
            if !self.cfg.error_feedback {
                residual.iter_mut().for_each(|r| *r = 0.0);
            }
            grads.iter_mut().for_each(|g| *g = 0.0);
            kernels::scatter_add(grads, &self.mask, &vals);
            Report {
                error: lost.map(|lost| if acc_norm > 0.0 { lost / acc_norm } else { 0.0 }),
                ..Report::default()
            }
        };
        self.residual.keep_host(residual);
        Ok(report)
    }

    #[cfg(feature = "cuda")]
    fn has_device_path(&self) -> bool {
        true
    }
    /// `reduce` on the GPU: the host path's steps, each the kernel whose twin the host path runs, with
    /// the residual and the mask on the device and the all-reduces NCCL's. The host sees the top-k
    /// indices of a re-selection (it widens them into the mask, which goes back up) and two norms.
    #[cfg(feature = "cuda")]
    fn reduce_device(
        &mut self,
        comm: &mut dyn Communicator,
        d: &mut crate::flat::DeviceFlat,
        step: u64,
    ) -> Result<Report> {
        use crate::comm::all_reduce_mean_device;
        let (k, s) = (d.kernels.clone(), d.kernels.stream().clone());
        if step < self.cfg.threshold {
            all_reduce_mean_device(comm, &mut d.buf, &k)?;
            return Ok(Report::default());
        }
        let len = d.buf.len();
        let mut residual = self.residual.take_device(len, &s)?;
        if self.cfg.error_feedback {
            k.ef_accumulate(&mut d.buf, &residual)?;
        }
        let report = if self.reselects(step) {
            all_reduce_mean_device(comm, &mut d.buf, &k)?;
            s.memset_zeros(&mut residual)?;
            let mut cores = Vec::with_capacity(self.tensors.len());
            for t in &self.tensors {
                let mut core = Vec::new();
                if t.matrix {
                    let kk = k_of(self.cfg.density, t.len);
                    let (idx, _) = k.top_k(&d.buf.slice(t.range()), kk, t.offset as u32)?;
                    core = s.clone_dtoh(&idx.slice(..kk))?;
                }
                cores.push(core);
            }
            let selection = self.widen(cores);
            self.device_mask = Some(s.clone_htod(&selection.1)?);
            self.adopt(selection)
        } else {
            let acc_norm = k.sum_squares(&d.buf)?.sqrt();
            // The masked values are sent; the residual is the gradient not sent.
            s.memcpy_dtod(&d.buf, &mut residual)?;
            let mask = match self.device_mask.take() {
                Some(m) => m,
                None => s.clone_htod(&self.mask)?,
            };
            let mut vals = s.alloc_zeros::<f32>(self.mask.len())?;
            // SAFETY: the mask's indices are distinct and below the flat buffer's length (the selection's
            // on every rank, residual's and d.buf's length).
            unsafe { k.gather_clear(&mut residual, &mask, &mut vals) }?;
            all_reduce_mean_device(comm, &mut vals, &k)?;
            let lost = k.sum_squares(&residual)?.sqrt();
            if !self.cfg.error_feedback {
                s.memset_zeros(&mut residual)?;
            }
            s.memset_zeros(&mut d.buf)?;
            // SAFETY: as above.
            unsafe { k.scatter_add(&mut d.buf, &mask.slice(..), &vals.slice(..)) }?;
            self.device_mask = Some(mask);
            Report {
                error: Some(if acc_norm > 0.0 { lost / acc_norm } else { 0.0 }),
                ..Report::default()
            }
        };
        self.residual.keep_device(residual);
        Ok(report)
    }

    /// Dense steps and (re-)selections all-reduce the whole gradient, the others the masked values: the
    /// current mask's, or before a run's first selection its expected size (vectors whole; per matrix, the
    /// entries within `range` of a selected one if the k selected entries scattered uniformly:
    /// len (1 - (1 - k/len)^(2 range + 1)); a run's logged bytes show the real masks).
    fn step_comm(&self, world: usize, step: u64) -> Vec<Collective> {
        let dense = step < self.cfg.threshold
            || (step - self.cfg.threshold).is_multiple_of(self.cfg.interval)
            || (self.unselected && self.mask.is_empty());
        let words = if dense {
            self.numel()
        } else if !self.mask.is_empty() {
            self.mask.len()
        } else {
            let window = 2 * self.cfg.range as i32 + 1;
            self.tensors
                .iter()
                .map(|t| match t.matrix {
                    true => {
                        let d = k_of(self.cfg.density, t.len) as f64 / t.len as f64;
                        let covered = 1.0 - (1.0 - d).powi(window);
                        ((t.len as f64 * covered).round() as usize).clamp(1, t.len)
                    }
                    false => t.len,
                })
                .sum()
        };
        vec![all_reduce(words, world)]
    }

    fn state(&self) -> Result<State> {
        if self.mask.is_empty() {
            return Ok(Vec::new());
        }
        let residual = self.residual.to_host()?.unwrap_or_default();
        Ok(vec![
            ("residual".into(), residual),
            ("mask".into(), indices_to_f32(&self.mask)),
            ("core".into(), indices_to_f32(&self.core)),
        ])
    }

    /// The mask and its core, which every rank adopts from the same averaged gradient, and whether a
    /// mask is still to be selected after a dense checkpoint; the residual is the rank's own.
    fn shared_state(&self) -> Result<State> {
        let mut s = self.state()?;
        s.retain(|(n, _)| n != "residual");
        if self.unselected && self.mask.is_empty() {
            s.push((UNSELECTED.into(), Vec::new()));
        }
        Ok(s)
    }

    /// The peer's mask, with no residual (zeros).
    fn rejoined(&mut self, mut shared: State) -> Result<()> {
        let unselected = shared.iter().any(|(n, _)| n == UNSELECTED);
        shared.retain(|(n, _)| n != UNSELECTED);
        if !shared.is_empty() {
            shared.push(("residual".into(), Vec::new()));
        }
        self.load_state(shared)?;
        self.unselected = unselected;
        Ok(())
    }

    fn load_state(&mut self, mut state: State) -> Result<()> {
        if state.is_empty() {
            *self = Self::new(std::mem::take(&mut self.tensors), self.cfg.clone());
            self.unselected = true;
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        {
            self.device_mask = None;
        }
        let numel = self.numel();
        // No values: no residual kept (zeros), as `state` writes one that is not.
        let residual = take(&mut state, "residual", None)?;
        if !residual.is_empty() && residual.len() != numel {
            anyhow::bail!(crate::error::BadInput(format!(
                "checkpoint: the Radius residual holds {} values, this model needs {numel}",
                residual.len()
            )));
        }
        self.residual.restore(residual);
        self.mask = f32_to_indices(&take(&mut state, "mask", None)?);
        self.core = f32_to_indices(&take(&mut state, "core", None)?);
        if self.mask.iter().any(|&i| i as usize >= numel)
            || !self.mask.windows(2).all(|w| w[0] < w[1])
        {
            anyhow::bail!(crate::error::BadInput(
                "checkpoint: the Radius mask is not an ascending list of parameter indices".into()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_of_index_lists() {
        assert_eq!(overlap(&[1, 2, 3, 4], &[2, 4, 9]), 0.5);
        assert_eq!(overlap(&[], &[1]), 1.0);
    }

    #[test]
    fn widened_mask_stays_inside_its_tensor_and_keeps_vectors_whole() {
        let tensors = vec![
            Segment {
                offset: 0,
                len: 3,
                rows: 3,
                cols: 1,
                matrix: false,
            },
            Segment {
                offset: 3,
                len: 20,
                rows: 4,
                cols: 5,
                matrix: true,
            },
        ];
        let cfg = RadiusConfig {
            density: 0.1,
            range: 2,
            ..RadiusConfig::default()
        };
        let r = Radius::new(tensors, cfg);
        let mut g = vec![0.0f32; 23];
        g[4] = 5.0; // near the tensor's start
        g[21] = -7.0; // near its end
        let (core, mask) = r.select(&g);
        assert_eq!(core, vec![4, 21]);
        assert_eq!(mask, vec![0, 1, 2, 3, 4, 5, 6, 19, 20, 21, 22]);
    }
}

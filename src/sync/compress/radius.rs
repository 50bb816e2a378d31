//! Radius, stable top-k (the reference's `StableTopKReducerWithRangeBucketsEFCorrectionResIsGrad`, plain
//! mode). Dense all-reduce before `threshold`. Every `interval` steps after it: a dense all-reduce of
//! gradient + residual, the residual is cleared, and each matrix tensor's top-k indices of the *averaged*
//! gradient (widened by +-range) become the mask that all ranks share; vectors are always in the mask.
//! Other steps all-reduce only the masked values (no index exchange) and keep the rest as residual: the
//! residual is the gradient not yet sent ("residual is gradient").

use anyhow::Result;
use rayon::prelude::*;

use super::{
    all_reduce, f32_to_indices, indices_to_f32, k_of, take, Reducer, Report, State, TensorView,
};
use crate::comm::{all_reduce_mean, Communicator};
use crate::config::backend::RadiusConfig;
use crate::kernels;
use crate::optim::global_norm;
use crate::sync::trace::Collective;

pub struct Radius {
    tensors: Vec<TensorView>,
    cfg: RadiusConfig,
    residual: Vec<f32>,
    /// Sorted flat indices all-reduced on stable steps.
    mask: Vec<u32>,
    /// The top-k selections before widening, for the overlap between re-selections.
    core: Vec<u32>,
    /// Restored without a mask (from a dense checkpoint): the first compressed step selects one.
    unselected: bool,
}

impl Radius {
    pub fn new(tensors: Vec<TensorView>, cfg: RadiusConfig) -> Self {
        Self {
            tensors,
            cfg,
            residual: Vec::new(),
            mask: Vec::new(),
            core: Vec::new(),
            unselected: false,
        }
    }

    fn numel(&self) -> usize {
        self.tensors.iter().map(|t| t.len).sum()
    }

    /// Whether `step` re-selects the mask: on the interval grid from `threshold`, or when there is none
    /// yet (a run switched from a dense checkpoint).
    fn reselects(&self, step: u64) -> bool {
        self.mask.is_empty() || (step - self.cfg.threshold) % self.cfg.interval == 0
    }

    /// Top-k of each matrix tensor of `avg` (the core) and the mask: core widened by +-range, plus
    /// every vector tensor whole.
    fn select(&self, avg: &[f32]) -> (Vec<u32>, Vec<u32>) {
        let range = self.cfg.range as usize;
        let per: Vec<(Vec<u32>, Vec<u32>)> = self
            .tensors
            .par_iter()
            .map(|t| {
                if !t.matrix {
                    let all: Vec<u32> = (t.offset as u32..(t.offset + t.len) as u32).collect();
                    return (Vec::new(), all);
                }
                let mut core = Vec::new();
                kernels::top_k(
                    &avg[t.range()],
                    k_of(self.cfg.density, t.len),
                    t.offset as u32,
                    &mut core,
                    &mut Vec::new(),
                );
                let mut mask = Vec::with_capacity(core.len() * (2 * range + 1));
                let (lo, hi) = (t.offset, t.offset + t.len);
                for &c in &core {
                    let c = c as usize;
                    let from = c.saturating_sub(range).max(lo);
                    let to = (c + range + 1).min(hi);
                    // core is ascending: skip what the previous window already covered.
                    let from = from.max(mask.last().map_or(0, |&m: &u32| m as usize + 1));
                    mask.extend((from..to).map(|i| i as u32));
                }
                (core, mask)
            })
            .collect();
        let core = per.iter().flat_map(|(c, _)| c.iter().copied()).collect();
        let mask = per.into_iter().flat_map(|(_, m)| m).collect();
        (core, mask)
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
        if self.residual.len() != grads.len() {
            self.residual = vec![0.0; grads.len()];
        }
        if self.cfg.error_feedback {
            kernels::ef_accumulate(grads, &self.residual);
        }
        if self.reselects(step) {
            all_reduce_mean(comm, grads)?;
            self.residual.iter_mut().for_each(|r| *r = 0.0);
            let (core, mask) = self.select(grads);
            let had = !self.core.is_empty();
            let ov = overlap(&core, &self.core);
            (self.core, self.mask) = (core, mask);
            return Ok(Report {
                error: Some(0.0),
                overlap: had.then_some(ov),
                ..Report::default()
            });
        }
        let acc_norm = global_norm(grads);
        // The masked values are sent; the residual is the gradient not sent (everything outside the mask).
        self.residual.copy_from_slice(grads);
        let mut vals = vec![0.0f32; self.mask.len()];
        kernels::gather_clear(&mut self.residual, &self.mask, &mut vals);
        all_reduce_mean(comm, &mut vals)?;
        let lost = global_norm(&self.residual);
        if !self.cfg.error_feedback {
            self.residual.iter_mut().for_each(|r| *r = 0.0);
        }
        grads.iter_mut().for_each(|g| *g = 0.0);
        kernels::scatter_add(grads, &self.mask, &vals);
        Ok(Report {
            error: Some(if acc_norm > 0.0 { lost / acc_norm } else { 0.0 }),
            ..Report::default()
        })
    }

    /// Dense steps and (re-)selections all-reduce the whole gradient, the others the masked values: the
    /// current mask's, or before a run's first selection its expected size (vectors whole; per matrix, the
    /// entries within `range` of a selected one if the k selected entries scattered uniformly:
    /// len (1 - (1 - k/len)^(2 range + 1)); a run's logged bytes show the real masks).
    fn step_comm(&self, world: usize, step: u64) -> Vec<Collective> {
        let dense = step < self.cfg.threshold
            || (step - self.cfg.threshold) % self.cfg.interval == 0
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
        Ok(vec![
            ("residual".into(), self.residual.clone()),
            ("mask".into(), indices_to_f32(&self.mask)),
            ("core".into(), indices_to_f32(&self.core)),
        ])
    }

    fn load_state(&mut self, mut state: State) -> Result<()> {
        if state.is_empty() {
            *self = Self::new(std::mem::take(&mut self.tensors), self.cfg.clone());
            self.unselected = true;
            return Ok(());
        }
        let numel = self.numel();
        self.residual = take(&mut state, "residual", Some(numel))?;
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
            TensorView {
                offset: 0,
                len: 3,
                rows: 3,
                cols: 1,
                matrix: false,
            },
            TensorView {
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

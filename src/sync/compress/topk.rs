//! Top-k sparsification with error feedback. Per matrix tensor, each rank keeps the k = density * numel
//! entries of largest magnitude of gradient + residual, all-gathers (values, indices) since every rank
//! picks different indices, and keeps what it did not send as its next residual. Vectors go dense.

use anyhow::Result;
use rayon::prelude::*;

use super::{
    all_reduce, f32_to_indices, indices_to_f32, k_of, take, Reducer, Report, State, TensorView,
};
use crate::comm::{all_reduce_mean, Communicator};
use crate::kernels;
use crate::optim::global_norm;
use crate::sync::trace::{Collective, Op, Overlap};

pub struct TopK {
    tensors: Vec<TensorView>,
    error_feedback: bool,
    /// Entries kept per tensor (0 for vectors, which are all-reduced whole).
    k: Vec<usize>,
    residual: Vec<f32>,
}

impl TopK {
    pub fn new(tensors: Vec<TensorView>, density: f64, error_feedback: bool) -> Self {
        let k = tensors
            .iter()
            .map(|t| if t.matrix { k_of(density, t.len) } else { 0 })
            .collect();
        Self {
            tensors,
            error_feedback,
            k,
            residual: Vec::new(),
        }
    }

    fn numel(&self) -> usize {
        self.tensors.iter().map(|t| t.len).sum()
    }
}

impl Reducer for TopK {
    fn reduce(
        &mut self,
        comm: &mut dyn Communicator,
        grads: &mut [f32],
        _step: u64,
    ) -> Result<Report> {
        let n = comm.world_size();
        if self.error_feedback {
            if self.residual.len() != grads.len() {
                self.residual = vec![0.0; grads.len()];
            }
            kernels::ef_accumulate(grads, &self.residual);
        }
        // Dense part: the vectors, in one all-reduce.
        let mut dense: Vec<f32> = self
            .tensors
            .iter()
            .filter(|t| !t.matrix)
            .flat_map(|t| grads[t.range()].iter().copied())
            .collect();
        all_reduce_mean(comm, &mut dense)?;
        // Sparse part: per-tensor selections (in parallel), packed as [values | indices].
        let selected: Vec<(Vec<u32>, Vec<f32>)> = self
            .tensors
            .par_iter()
            .zip(&self.k)
            .map(|(t, &k)| {
                let (mut idx, mut vals) = (Vec::with_capacity(k), Vec::with_capacity(k));
                if t.matrix {
                    kernels::top_k(&grads[t.range()], k, t.offset as u32, &mut idx, &mut vals);
                }
                (idx, vals)
            })
            .collect();
        let (idx, mut send): (Vec<u32>, Vec<f32>) = selected
            .into_iter()
            .flat_map(|(i, v)| i.into_iter().zip(v))
            .unzip();
        let kk = idx.len();
        send.extend(indices_to_f32(&idx));
        let mut all = vec![0.0f32; send.len() * n];
        comm.all_gather(&send, &mut all)?;

        let acc_norm = global_norm(grads);
        // The new residual: everything not sent (vectors are exact and leave none).
        let mut residual = std::mem::take(&mut self.residual);
        residual.clear();
        residual.extend_from_slice(grads);
        for t in self.tensors.iter().filter(|t| !t.matrix) {
            residual[t.range()].iter_mut().for_each(|r| *r = 0.0);
        }
        for &i in &idx {
            residual[i as usize] = 0.0;
        }
        let lost = global_norm(&residual);
        // Decompress: rank-ordered sums of every rank's values, then the mean; vectors from the dense part.
        let mut pos = 0;
        for t in &self.tensors {
            if t.matrix {
                grads[t.range()].iter_mut().for_each(|g| *g = 0.0);
            } else {
                grads[t.range()].copy_from_slice(&dense[pos..pos + t.len]);
                pos += t.len;
            }
        }
        for part in all.chunks(2 * kk.max(1)).take(n) {
            let (vals, ids) = part.split_at(kk);
            for (v, i) in vals.iter().zip(f32_to_indices(ids)) {
                grads[i as usize] += v;
            }
        }
        let inv = 1.0 / n as f32;
        for t in self.tensors.iter().filter(|t| t.matrix) {
            grads[t.range()].iter_mut().for_each(|g| *g *= inv);
        }
        if self.error_feedback {
            self.residual = residual;
        }
        Ok(Report {
            error: Some(if acc_norm > 0.0 { lost / acc_norm } else { 0.0 }),
            ..Report::default()
        })
    }

    /// The vectors in one all-reduce, then every rank's (values, indices) all-gathered.
    fn step_comm(&self, world: usize, _step: u64) -> Vec<Collective> {
        let dense = self
            .tensors
            .iter()
            .filter(|t| !t.matrix)
            .map(|t| t.len)
            .sum();
        let sparse = 2 * self.k.iter().sum::<usize>() as u64;
        vec![
            all_reduce(dense, world),
            Collective::world(
                Op::AllGather {
                    pieces: vec![sparse],
                },
                world,
                Overlap::None,
            ),
        ]
    }

    fn state(&self) -> State {
        if self.residual.is_empty() {
            return Vec::new();
        }
        vec![("residual".into(), self.residual.clone())]
    }

    fn load_state(&mut self, mut state: State) -> Result<()> {
        if state.is_empty() {
            self.residual.clear();
            return Ok(());
        }
        self.residual = take(&mut state, "residual", Some(self.numel()))?;
        Ok(())
    }
}

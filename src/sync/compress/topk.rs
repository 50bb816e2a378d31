//! Top-k sparsification with error feedback. Per matrix tensor, each rank keeps the k = density * numel
//! entries of largest magnitude of gradient + residual, all-gathers (values, indices) since every rank
//! picks different indices, and keeps what it did not send as its next residual. Vectors go dense.
//! On the GPU (an engine with device collectives) the same steps run as the CUDA kernels whose twins
//! the host path runs, on device buffers, the residual included.

use std::ops::Range;

use anyhow::Result;
use rayon::prelude::*;

use super::{
    all_reduce, indices_to_f32, k_of, per_tensor, Reducer, Report, Segment, State, StateBuf,
};
use crate::comm::{all_reduce_mean, Communicator, Gathered};
use crate::kernels;
use crate::kernels::optim::sum_squares;
use crate::sync::trace::{Collective, Op, Overlap};

pub struct TopK {
    tensors: Vec<Segment>,
    error_feedback: bool,
    /// Entries kept per tensor (0 for vectors, which are all-reduced whole).
    k: Vec<usize>,
    residual: StateBuf,
    /// The flat range this rank decodes (`Reducer::decode_part`; None: all of it).
    part: Option<Range<usize>>,
    /// The last step's message and all-gather buffers, filled again (fresh ones would be mapped anew).
    send: Vec<f32>,
    gathered: Vec<f32>,
    /// A bit per entry of the tensor being decoded: set where some rank sent it (all clear between uses).
    touched: Vec<u64>,
}

impl TopK {
    pub fn new(tensors: Vec<Segment>, density: f64, error_feedback: bool) -> Self {
        let k = tensors
            .iter()
            .map(|t| if t.matrix { k_of(density, t.len) } else { 0 })
            .collect();
        Self {
            tensors,
            error_feedback,
            k,
            residual: StateBuf::default(),
            part: None,
            send: Vec::new(),
            gathered: Vec::new(),
            touched: Vec::new(),
        }
    }

    fn numel(&self) -> usize {
        self.tensors.iter().map(|t| t.len).sum()
    }

    /// Decompresses `all`, every rank's [values | indices] (each as `selected` holds this rank's counts),
    /// into `grads` (zeros: the accumulation moved the gradient into the residual), tensor by tensor so
    /// that its scattered additions land in cache: the rank-ordered sum of every rank's values, then the
    /// mean, taken only where some rank sent an entry (elsewhere the +0 that scaling would leave as it
    /// is: a pass over the few entries sent instead of the whole tensor); vectors from the all-reduced
    /// `dense` part. Only the entries in `self.part` where it is set
    /// (each tensor's indices ascend, so a rank's entries there are one run of its part of the message).
    fn decode_mean(
        &mut self,
        grads: &mut [f32],
        all: &Gathered,
        selected: &[(Vec<u32>, Vec<f32>)],
        dense: &[f32],
    ) {
        let kk: usize = selected.iter().map(|(i, _)| i.len()).sum();
        let (mut pos, mut at, inv) = (0, 0, 1.0 / all.members() as f32);
        let touched = &mut self.touched;
        let tensors = self.tensors.iter().zip(per_tensor(grads, &self.tensors));
        for ((t, g), (idx, _)) in tensors.zip(selected) {
            let own = match &self.part {
                Some(p) => {
                    p.start.clamp(t.offset, t.offset + t.len)
                        ..p.end.clamp(t.offset, t.offset + t.len)
                }
                None => t.range(),
            };
            let g = &mut g[own.start - t.offset..own.end - t.offset];
            if !t.matrix {
                g.copy_from_slice(&dense[pos + own.start - t.offset..][..g.len()]);
                pos += t.len;
                continue;
            }
            let words = g.len().div_ceil(64);
            if touched.len() < words {
                touched.resize(words, 0);
            }
            for part in all.iter() {
                let (vals, ids) = part.split_at(kk);
                let (vals, ids) = (&vals[at..at + idx.len()], &ids[at..at + idx.len()]);
                let first = ids.partition_point(|i| (i.to_bits() as usize) < own.start);
                let end = ids.partition_point(|i| (i.to_bits() as usize) < own.end);
                for (v, i) in vals[first..end].iter().zip(&ids[first..end]) {
                    let j = i.to_bits() as usize - own.start;
                    g[j] += v;
                    touched[j / 64] |= 1 << (j % 64);
                }
            }
            super::scale_marked(g, &mut touched[..words], inv);
            at += idx.len();
        }
    }
}

/// The compression error ||unsent|| / ||accumulated||: the norm of what stays in the residual (the
/// accumulated gradient but the values sent and the vectors, which go whole) from the sums of squares
/// of the three (each square exact in f64), where a pass over the residual took one over the model.
/// It loses the accuracy of a difference only where almost all of the gradient is sent and the
/// error is near 0; it is never below 0.
fn unsent_ratio(acc_sq: f64, sent_sq: f64, dense_sq: f64) -> f64 {
    match acc_sq > 0.0 {
        true => ((acc_sq - sent_sq - dense_sq).max(0.0) / acc_sq).sqrt(),
        false => 0.0,
    }
}

impl Reducer for TopK {
    fn reduce(
        &mut self,
        comm: &mut dyn Communicator,
        grads: &mut [f32],
        _step: u64,
    ) -> Result<Report> {
        let mut residual = self.residual.take_host(grads.len());
        // The new residual starts as the whole accumulated gradient (gradient + residual, with error
        // feedback), and the gradient as zeros, into which the decoding adds what the ranks sent.
        let acc_sq = kernels::ef_accumulate_move(grads, &mut residual, self.error_feedback);
        // Dense part: the vectors, in one all-reduce.
        let mut dense: Vec<f32> = self
            .tensors
            .iter()
            .filter(|t| !t.matrix)
            .flat_map(|t| residual[t.range()].iter().copied())
            .collect();
        // The compression error for the metrics rows, which rank 0 writes: what the vectors and the
        // values sent take from the accumulated gradient's sum of squares (see `unsent_ratio`).
        let measure = comm.rank() == 0;
        let dense_sq = measure.then(|| sum_squares(&dense));
        all_reduce_mean(comm, &mut dense)?;
        // Sparse part: per-tensor selections (in parallel), packed as [values | indices]. What is sent
        // leaves the new residual while the tensor is in cache; vectors are exact and leave none.
        let selected: Vec<(Vec<u32>, Vec<f32>)> = self
            .tensors
            .par_iter()
            .zip(&self.k)
            .zip(per_tensor(&mut residual, &self.tensors))
            .map(|((t, &k), residual)| {
                let (mut idx, mut vals) = (Vec::with_capacity(k), Vec::with_capacity(k));
                match t.matrix {
                    true => {
                        kernels::top_k(residual, k, t.offset as u32, &mut idx, &mut vals);
                        idx.iter()
                            .for_each(|&i| residual[i as usize - t.offset] = 0.0);
                    }
                    false => residual.fill(0.0),
                }
                (idx, vals)
            })
            .collect();
        // [values | indices as f32 bits], tensor after tensor.
        let kk: usize = selected.iter().map(|(i, _)| i.len()).sum();
        let mut send = std::mem::take(&mut self.send);
        send.clear();
        send.reserve(2 * kk);
        selected.iter().for_each(|(_, v)| send.extend_from_slice(v));
        selected
            .iter()
            .for_each(|(i, _)| send.extend(indices_to_f32(i)));
        let all = comm.all_gather_shared(&send, std::mem::take(&mut self.gathered))?;
        let error = dense_sq.map(|d| unsent_ratio(acc_sq, sum_squares(&send[..kk]), d));
        self.send = send;
        self.decode_mean(grads, &all, &selected, &dense);
        self.gathered = all.into_spare();
        if self.error_feedback {
            self.residual.keep_host(residual);
        }
        Ok(Report {
            error,
            ..Report::default()
        })
    }

    #[cfg(feature = "cuda")]
    fn has_device_path(&self) -> bool {
        true
    }
    fn decode_part(&mut self, part: Range<usize>) {
        self.part = Some(part);
    }
    /// `reduce` on the GPU: the same steps in the same order as the host path, each a kernel (its twin
    /// is what the host path runs), the vectors' all-reduce and the (values, indices) all-gather on the
    /// device. The host sees the selection's digit histograms (the radix select) and two norms.
    #[cfg(feature = "cuda")]
    fn reduce_device(
        &mut self,
        comm: &mut dyn Communicator,
        d: &mut crate::flat::DeviceFlat,
        _step: u64,
    ) -> Result<Report> {
        let (k, s) = (d.kernels.clone(), d.kernels.stream().clone());
        let (n, len) = (comm.world_size(), d.buf.len());
        let mut residual = self.residual.take_device(len, &s)?;
        if self.error_feedback {
            k.ef_accumulate(&mut d.buf, &residual)?;
        }
        // Dense part: the vectors, in one all-reduce (the mean: the sum, then times 1 / N).
        let vectors: Vec<_> = self.tensors.iter().filter(|t| !t.matrix).cloned().collect();
        let mut dense = device::vectors(&vectors, d, &s)?;
        let dense_sq = k.sum_squares(&dense)?;
        if !vectors.is_empty() {
            crate::comm::all_reduce_mean_device(comm, &mut dense, &k)?;
        }
        let (send, idx_all, total) = device::select(&self.tensors, &self.k, d)?;
        let mut all = s.alloc_zeros::<f32>((2 * total * n).max(1))?;
        if total > 0 {
            comm.all_gather_device(&send.slice(..2 * total), &mut all)?;
        }
        let acc_sq = k.sum_squares(&d.buf)?;
        // The new residual: everything not sent (vectors are exact and leave none).
        s.memcpy_dtod(&d.buf, &mut residual)?;
        for t in &vectors {
            s.memset_zeros(&mut residual.slice_mut(t.range()))?;
        }
        // The values sent, in the message's order (the host path's `send[..kk]`).
        let mut sent_sq = 0.0;
        if total > 0 {
            // `idx_all` holds exactly the `total` indices here.
            let mut sent = s.alloc_zeros::<f32>(total)?;
            // SAFETY: idx_all holds top_k's distinct indices of each matrix, shifted to its offset in the
            // flat buffer (residual's length).
            unsafe { k.gather_clear(&mut residual, &idx_all, &mut sent) }?;
            sent_sq = k.sum_squares(&sent)?;
        }
        device::decompress(&self.tensors, d, &all, total, n, &dense)?;
        if self.error_feedback {
            self.residual.keep_device(residual);
        }
        Ok(Report {
            error: Some(unsent_ratio(acc_sq, sent_sq, dense_sq)),
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

    fn state(&self) -> Result<State> {
        self.residual.residual_state()
    }

    fn load_state(&mut self, state: State) -> Result<()> {
        self.residual.load_residual(state, self.numel())
    }
}

/// The steps of `TopK::reduce_device`.
#[cfg(feature = "cuda")]
mod device {
    use anyhow::{Context, Result};
    use cudarc::driver::{CudaSlice, CudaStream};

    use super::super::Segment;
    use crate::flat::DeviceFlat;

    /// The vectors of `d`, back to back in one buffer (their all-reduce's).
    pub fn vectors(
        vectors: &[Segment],
        d: &DeviceFlat,
        s: &std::sync::Arc<CudaStream>,
    ) -> Result<CudaSlice<f32>> {
        let dense_len: usize = vectors.iter().map(|t| t.len).sum();
        let mut dense = s.alloc_zeros::<f32>(dense_len.max(1))?;
        let mut at = 0;
        for t in vectors {
            s.memcpy_dtod(
                &d.buf.slice(t.range()),
                &mut dense.slice_mut(at..at + t.len),
            )?;
            at += t.len;
        }
        Ok(dense)
    }

    /// Each matrix's selection of its k entries, packed as [values | indices as f32 bits] (the message)
    /// with the indices also as u32 (for the residual); and how many.
    pub fn select(
        tensors: &[Segment],
        ks: &[usize],
        d: &DeviceFlat,
    ) -> Result<(CudaSlice<f32>, CudaSlice<u32>, usize)> {
        let (k, s) = (&d.kernels, d.kernels.stream());
        let mut selected = Vec::new();
        for (t, &kk) in tensors.iter().zip(ks) {
            if t.matrix && kk > 0 {
                let (idx, vals) = k.top_k(&d.buf.slice(t.range()), kk, t.offset as u32)?;
                selected.push((idx, vals, kk.min(t.len)));
            }
        }
        let total: usize = selected.iter().map(|(_, _, c)| c).sum();
        let mut send = s.alloc_zeros::<f32>((2 * total).max(1))?;
        let mut idx_all = s.alloc_zeros::<u32>(total.max(1))?;
        let mut at = 0;
        for (idx, vals, c) in &selected {
            s.memcpy_dtod(&vals.slice(..*c), &mut send.slice_mut(at..at + c))?;
            s.memcpy_dtod(&idx.slice(..*c), &mut idx_all.slice_mut(at..at + c))?;
            // SAFETY: u32 and f32 have the same size; the bits travel as f32 (`indices_to_f32`).
            let bits = unsafe { idx.transmute::<f32>(*c) }.context("index bits")?;
            s.memcpy_dtod(&bits, &mut send.slice_mut(total + at..total + at + c))?;
            at += c;
        }
        Ok((send, idx_all, total))
    }

    /// The matrices from every rank's message (rank-ordered sums, then the mean), the vectors from their
    /// all-reduced `dense` copy.
    pub fn decompress(
        tensors: &[Segment],
        d: &mut DeviceFlat,
        all: &CudaSlice<f32>,
        total: usize,
        n: usize,
        dense: &CudaSlice<f32>,
    ) -> Result<()> {
        let (k, s) = (d.kernels.clone(), d.kernels.stream().clone());
        for t in tensors.iter().filter(|t| t.matrix) {
            s.memset_zeros(&mut d.buf.slice_mut(t.range()))?;
        }
        for r in (0..n).filter(|_| total > 0) {
            let part = all.slice(r * 2 * total..(r + 1) * 2 * total);
            let vals = part.slice(..total);
            // SAFETY: the indices' bits, as `select` packed them.
            let ids =
                unsafe { part.slice(total..).transmute::<u32>(total) }.context("index bits")?;
            // SAFETY: rank r's indices, packed by the same code: distinct, inside the flat buffer.
            unsafe { k.scatter_add(&mut d.buf, &ids, &vals) }?;
        }
        // Times 1 / N everywhere, then the vectors' mean over it (the host path scales the matrices only).
        k.scale(&mut d.buf, 1.0 / n as f32)?;
        let mut at = 0;
        for t in tensors.iter().filter(|t| !t.matrix) {
            s.memcpy_dtod(
                &dense.slice(at..at + t.len),
                &mut d.buf.slice_mut(t.range()),
            )?;
            at += t.len;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The decoding equals the sum of every rank's values in rank order, times 1 / n, at each entry some
    /// rank sent (+0 at the others), bit for bit: ranks whose indices overlap in part, at worlds 1, 3, 5
    /// and 3 again on the same marks (each call leaves none behind), with a vector between two matrices.
    #[test]
    fn decoding_scales_every_sent_entry_once() {
        let tensors = Segment::from_shapes(&[(40, 30, true), (17, 1, false), (9, 70, true)]);
        let len: usize = tensors.iter().map(|t| t.len).sum();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let mut r = TopK::new(tensors.clone(), 0.1, true);
        for n in [1, 3, 5, 3] {
            let mut msgs = vec![Vec::new(); n];
            let mut want = vec![0.0f32; len];
            let mut sent = vec![false; len];
            let mut selected = Vec::new();
            for t in tensors.iter().filter(|t| t.matrix) {
                let k = k_of(0.1, t.len);
                // Half of each rank's indices from a small shared pool, so that ranks overlap.
                let sets: Vec<Vec<u32>> = (0..n)
                    .map(|_| {
                        let mut s = std::collections::BTreeSet::new();
                        while s.len() < k {
                            let span = if s.len() < k / 2 { k } else { t.len };
                            s.insert((t.offset + rng.random_range(0..span)) as u32);
                        }
                        s.into_iter().collect()
                    })
                    .collect();
                for (m, idx) in msgs.iter_mut().zip(&sets) {
                    let vals: Vec<f32> = idx.iter().map(|_| rng.random_range(-1.0..1.0)).collect();
                    for (&i, &v) in idx.iter().zip(&vals) {
                        want[i as usize] += v;
                        sent[i as usize] = true;
                    }
                    m.push((idx.clone(), vals));
                }
                selected.push((sets[0].clone(), vec![0.0; k]));
            }
            let inv = 1.0 / n as f32;
            want.iter_mut()
                .zip(&sent)
                .filter(|(_, &s)| s)
                .for_each(|(w, _)| *w *= inv);
            let dense: Vec<f32> = (0..17).map(|i| i as f32 * 0.25).collect();
            let vector = tensors[1].range();
            want[vector].copy_from_slice(&dense);
            // Each message: the values of its tensors, then their indices; `selected` gives the counts,
            // with an empty entry for the vector.
            selected.insert(1, (Vec::new(), Vec::new()));
            let all: Vec<f32> = msgs
                .iter()
                .flat_map(|m| {
                    let vals = m.iter().flat_map(|(_, v)| v.iter().copied());
                    let ids: Vec<f32> = m.iter().flat_map(|(i, _)| indices_to_f32(i)).collect();
                    vals.chain(ids).collect::<Vec<_>>()
                })
                .collect();
            let mut g = vec![0.0f32; len];
            r.decode_mean(&mut g, &Gathered::packed(all, n), &selected, &dense);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&g), bits(&want), "world {n}");
            assert!(r.touched.iter().all(|&w| w == 0), "world {n}: marks left");
        }
    }

    /// The error reported is ||residual|| / ||gradient + residual before||, with the residual as the
    /// step leaves it, to within rounding (1e-12 of it), at densities from 1% to all (there it is 0 up
    /// to the rounding of the sums, 1e-7), over steps whose residual carries over.
    #[test]
    fn the_error_is_the_residuals_norm_over_the_accumulated_gradients() {
        let tensors = Segment::from_shapes(&[(40, 30, true), (17, 1, false), (9, 70, true)]);
        let len: usize = tensors.iter().map(|t| t.len).sum();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let squares = |v: &[f32]| v.iter().map(|&x| x as f64 * x as f64).sum::<f64>();
        for density in [0.01, 0.1, 0.5, 1.0] {
            let mut r = TopK::new(tensors.clone(), density, true);
            let mut before = vec![0.0f32; len];
            for step in 0..3 {
                let g: Vec<f32> = (0..len).map(|_| rng.random_range(-1.0..1.0)).collect();
                let acc: Vec<f32> = g.iter().zip(&before).map(|(a, b)| a + b).collect();
                let mut out = g.clone();
                let error = r
                    .reduce(&mut crate::comm::Solo, &mut out, step)
                    .unwrap()
                    .error;
                let state = r.state().unwrap();
                let residual = &state.iter().find(|(k, _)| k == "residual").unwrap().1;
                let want = (squares(residual) / squares(&acc)).sqrt();
                let got = error.unwrap();
                let at = format!("density {density} step {step}: {got} against {want}");
                match density < 1.0 {
                    true => assert!((got - want).abs() <= 1e-12 * want && want > 0.0, "{at}"),
                    false => assert!(want == 0.0 && (0.0..1e-7).contains(&got), "{at}"),
                }
                before = residual.clone();
            }
        }
    }
}

//! PowerSGD (Vogels et al.), as PyTorch's `powerSGD_hook` computes it, plus the one-all-reduce variant.
//!
//! Three all-reduces per step (PyTorch): the uncompressed tensors; P = M Q (summed, then orthogonalized);
//! Q = M^T P (averaged); the approximation is P Q^T. With error feedback the new error is the rank's input
//! minus the averaged result over the whole gradient, uncompressed tensors included, as PyTorch does.
//!
//! `single_allreduce` alternates sides: even compressed steps send P = M q for the orthonormal q of the
//! previous step and apply avg(P) q^T; odd steps send Q = M^T p and apply p avg(Q)^T; the averaged factor,
//! orthogonalized, is the next step's fixed side. Each step is linear in M, so the average is exact for
//! the subspace, and the uncompressed tensors ride in the same all-reduce: one per step.

use anyhow::Result;
use candle_core::{Device, Tensor};
use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};

use super::{all_reduce, relative_error, take, Reducer, Report, State, TensorView};
use crate::comm::{all_reduce_mean, Communicator};
use crate::config::backend::PowerSgdConfig;
use crate::kernels;
use crate::sync::trace::Collective;

/// A compressed matrix: which tensor, its rank and where its factors live in `p` and `q`.
#[derive(Debug, Clone)]
struct Factor {
    t: usize,
    rank: usize,
    p_off: usize,
    q_off: usize,
}

pub struct PowerSgd {
    tensors: Vec<TensorView>,
    cfg: PowerSgdConfig,
    seed: u64,
    factors: Vec<Factor>,
    /// P (rows x r) and Q (cols x r) of every compressed matrix, row-major, concatenated.
    p: Vec<f32>,
    q: Vec<f32>,
    error: Vec<f32>,
    /// Compressed steps taken (the side of `single_allreduce`; 0: not started, Q to initialise).
    compressed_steps: u64,
}

/// PyTorch's `_should_compress`: worth it when (n + m) r * rate < n m.
fn should_compress(n: usize, m: usize, r: usize, rate: f64) -> bool {
    ((n + m) * r) as f64 * rate < (n * m) as f64
}

impl PowerSgd {
    pub fn new(tensors: Vec<TensorView>, cfg: PowerSgdConfig, seed: u64) -> Self {
        let (mut factors, mut p_len, mut q_len) = (Vec::new(), 0, 0);
        for (i, t) in tensors.iter().enumerate() {
            let rank = cfg.rank.min(t.rows).min(t.cols);
            if t.matrix && should_compress(t.rows, t.cols, rank, cfg.min_compression_rate) {
                factors.push(Factor {
                    t: i,
                    rank,
                    p_off: p_len,
                    q_off: q_len,
                });
                p_len += t.rows * rank;
                q_len += t.cols * rank;
            }
        }
        Self {
            tensors,
            cfg,
            seed,
            factors,
            p: vec![0.0; p_len],
            q: vec![0.0; q_len],
            error: Vec::new(),
            compressed_steps: 0,
        }
    }

    fn numel(&self) -> usize {
        self.tensors.iter().map(|t| t.len).sum()
    }

    /// Fraction of the parameters in compressed matrices.
    pub fn compressed_fraction(&self) -> f64 {
        let c: usize = self.factors.iter().map(|f| self.tensors[f.t].len).sum();
        c as f64 / self.numel().max(1) as f64
    }

    fn uncompressed(&self) -> Vec<usize> {
        let mut compressed = vec![false; self.tensors.len()];
        self.factors.iter().for_each(|f| compressed[f.t] = true);
        (0..self.tensors.len())
            .filter(|&i| !compressed[i])
            .collect()
    }

    /// Q ~ N(0, 1) from a generator seeded by (seed, step): identical on every rank, different per step.
    fn randomize_q(&mut self, step: u64) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(self.seed ^ 0x706f_7765_7273_6764);
        rng.set_stream(step);
        self.q
            .iter_mut()
            .for_each(|x| *x = StandardNormal.sample(&mut rng));
    }

    fn orthogonalize_all(&self, buf: &mut [f32], left: bool) {
        let eps = self.cfg.orthogonalization_epsilon as f32;
        for f in &self.factors {
            let t = &self.tensors[f.t];
            let (rows, off) = if left {
                (t.rows, f.p_off)
            } else {
                (t.cols, f.q_off)
            };
            kernels::gram_schmidt(&mut buf[off..off + rows * f.rank], rows, f.rank, eps);
        }
    }

    /// For every compressed M: `left` ? M q -> p : M^T p -> q, batched by shape if configured.
    fn project(&mut self, grads: &[f32], left: bool) -> Result<()> {
        let groups = self.groups();
        for group in groups {
            let f0 = &self.factors[group[0]];
            let (t0, r) = (&self.tensors[f0.t], f0.rank);
            let (rows, cols, b) = (t0.rows, t0.cols, group.len());
            let mats: Vec<f32> = group
                .iter()
                .flat_map(|&g| {
                    grads[self.tensors[self.factors[g].t].range()]
                        .iter()
                        .copied()
                })
                .collect();
            let m = Tensor::from_vec(mats, (b, rows, cols), &Device::Cpu)?;
            let (src, src_len, dst_len) = if left {
                (&self.q, cols * r, rows * r)
            } else {
                (&self.p, rows * r, cols * r)
            };
            let other: Vec<f32> = group
                .iter()
                .flat_map(|&g| {
                    let f = &self.factors[g];
                    let off = if left { f.q_off } else { f.p_off };
                    src[off..off + src_len].iter().copied()
                })
                .collect();
            let out = if left {
                m.matmul(&Tensor::from_vec(other, (b, cols, r), &Device::Cpu)?)?
            } else {
                m.transpose(1, 2)?
                    .matmul(&Tensor::from_vec(other, (b, rows, r), &Device::Cpu)?)?
            };
            let out = out.flatten_all()?.to_vec1::<f32>()?;
            for (i, &g) in group.iter().enumerate() {
                let f = &self.factors[g];
                let (dst, off) = if left {
                    (&mut self.p, f.p_off)
                } else {
                    (&mut self.q, f.q_off)
                };
                dst[off..off + dst_len].copy_from_slice(&out[i * dst_len..(i + 1) * dst_len]);
            }
        }
        Ok(())
    }

    /// Factor indices grouped for one batched multiplication: same shape and rank together when
    /// `batch_same_shape`, else one by one.
    fn groups(&self) -> Vec<Vec<usize>> {
        if !self.cfg.batch_same_shape {
            return (0..self.factors.len()).map(|i| vec![i]).collect();
        }
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let key = |i: usize| {
            let f = &self.factors[i];
            (self.tensors[f.t].rows, self.tensors[f.t].cols, f.rank)
        };
        for i in 0..self.factors.len() {
            match groups.iter_mut().find(|g| key(g[0]) == key(i)) {
                Some(g) => g.push(i),
                None => groups.push(vec![i]),
            }
        }
        groups
    }

    /// grads[M] = p q^T for every compressed M.
    fn decompress(&self, grads: &mut [f32]) -> Result<()> {
        for f in &self.factors {
            let t = &self.tensors[f.t];
            let p = Tensor::from_slice(
                &self.p[f.p_off..f.p_off + t.rows * f.rank],
                (t.rows, f.rank),
                &Device::Cpu,
            )?;
            let q = Tensor::from_slice(
                &self.q[f.q_off..f.q_off + t.cols * f.rank],
                (t.cols, f.rank),
                &Device::Cpu,
            )?;
            let m = p.matmul(&q.t()?)?.flatten_all()?.to_vec1::<f32>()?;
            grads[t.range()].copy_from_slice(&m);
        }
        Ok(())
    }

    fn pack(&self, grads: &[f32], idx: &[usize], buf: &mut Vec<f32>) {
        for &i in idx {
            buf.extend_from_slice(&grads[self.tensors[i].range()]);
        }
    }

    fn unpack(&self, grads: &mut [f32], idx: &[usize], buf: &[f32]) {
        let mut pos = 0;
        for &i in idx {
            let t = &self.tensors[i];
            grads[t.range()].copy_from_slice(&buf[pos..pos + t.len]);
            pos += t.len;
        }
    }
}

impl Reducer for PowerSgd {
    fn reduce(
        &mut self,
        comm: &mut dyn Communicator,
        grads: &mut [f32],
        step: u64,
    ) -> Result<Report> {
        if step < self.cfg.start_iter {
            all_reduce_mean(comm, grads)?;
            return Ok(Report::default());
        }
        let fraction = Some(self.compressed_fraction());
        let n = comm.world_size() as f32;
        if self.cfg.error_feedback {
            if self.error.len() != grads.len() {
                self.error = vec![0.0; grads.len()];
            }
            kernels::ef_accumulate(grads, &self.error);
        }
        let input = grads.to_vec();
        let dense_idx = self.uncompressed();
        let mut dense = Vec::new();
        self.pack(grads, &dense_idx, &mut dense);
        if self.compressed_steps == 0 || !self.cfg.warm_start {
            self.randomize_q(step);
        }
        if !self.cfg.single_allreduce {
            all_reduce_mean(comm, &mut dense)?;
            let mut q = std::mem::take(&mut self.q);
            self.orthogonalize_all(&mut q, false);
            self.q = q;
            self.project(grads, true)?;
            comm.all_reduce_sum(&mut self.p)?;
            let mut p = std::mem::take(&mut self.p);
            self.orthogonalize_all(&mut p, true);
            self.p = p;
            self.project(grads, false)?;
            comm.all_reduce_sum(&mut self.q)?;
            self.q.iter_mut().for_each(|x| *x /= n);
        } else {
            let left = self.compressed_steps % 2 == 0;
            if self.compressed_steps == 0 {
                let mut q = std::mem::take(&mut self.q);
                self.orthogonalize_all(&mut q, false);
                self.q = q;
            }
            // The fixed side is orthonormal from the previous step; send the other one with the vectors.
            self.project(grads, left)?;
            let factor = if left { &self.p } else { &self.q };
            let k = factor.len();
            let mut buf = factor.clone();
            buf.extend_from_slice(&dense);
            all_reduce_mean(comm, &mut buf)?;
            dense.copy_from_slice(&buf[k..]);
            if left {
                self.p.copy_from_slice(&buf[..k]);
            } else {
                self.q.copy_from_slice(&buf[..k]);
            }
        }
        self.decompress(grads)?;
        self.unpack(grads, &dense_idx, &dense);
        if self.cfg.single_allreduce {
            // The averaged side, orthonormalised, is next step's fixed side.
            let left = self.compressed_steps % 2 == 0;
            let mut buf = std::mem::take(if left { &mut self.p } else { &mut self.q });
            self.orthogonalize_all(&mut buf, left);
            *(if left { &mut self.p } else { &mut self.q }) = buf;
        }
        self.compressed_steps += 1;
        if self.cfg.error_feedback {
            self.error
                .iter_mut()
                .zip(input.iter().zip(grads.iter()))
                .for_each(|(e, (i, g))| *e = i - g);
        }
        Ok(Report {
            error: Some(relative_error(&input, grads)),
            compressed_fraction: fraction,
            ..Report::default()
        })
    }

    /// Dense before `start_iter`; then the uncompressed tensors, P and Q in three all-reduces, or with
    /// `single_allreduce` one side (P on even compressed steps, Q on odd ones) together with them.
    fn step_comm(&self, world: usize, step: u64) -> Vec<Collective> {
        if step < self.cfg.start_iter {
            return vec![all_reduce(self.numel(), world)];
        }
        let dense: usize = self
            .uncompressed()
            .iter()
            .map(|&i| self.tensors[i].len)
            .sum();
        if !self.cfg.single_allreduce {
            return [dense, self.p.len(), self.q.len()]
                .map(|w| all_reduce(w, world))
                .to_vec();
        }
        let left = (step - self.cfg.start_iter) % 2 == 0;
        let side = if left { self.p.len() } else { self.q.len() };
        vec![all_reduce(side + dense, world)]
    }

    fn state(&self) -> Result<State> {
        if self.compressed_steps == 0 {
            return Ok(Vec::new());
        }
        let steps = self.compressed_steps;
        Ok(vec![
            ("p".into(), self.p.clone()),
            ("q".into(), self.q.clone()),
            ("error".into(), self.error.clone()),
            (
                "compressed_steps".into(),
                crate::comm::pack_u64(steps).to_vec(),
            ),
        ])
    }

    fn load_state(&mut self, mut state: State) -> Result<()> {
        if state.is_empty() {
            *self = Self::new(
                std::mem::take(&mut self.tensors),
                self.cfg.clone(),
                self.seed,
            );
            return Ok(());
        }
        self.p = take(&mut state, "p", Some(self.p.len()))?;
        self.q = take(&mut state, "q", Some(self.q.len()))?;
        let error = take(&mut state, "error", None)?;
        if !error.is_empty() && error.len() != self.numel() {
            anyhow::bail!(crate::error::BadInput(format!(
                "checkpoint: PowerSGD error buffer holds {} values, this model needs {}",
                error.len(),
                self.numel()
            )));
        }
        self.error = error;
        let s = take(&mut state, "compressed_steps", Some(2))?;
        self.compressed_steps = crate::comm::unpack_u64([s[0], s[1]]);
        Ok(())
    }
}

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
use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};

use super::{all_reduce, take, Reducer, Report, Segment, State};
use crate::comm::{all_reduce_mean_flat, all_reduce_sum_flat, Communicator};
use crate::config::backend::PowerSgdConfig;
use crate::flat::{Flat, FlatMut, FlatRef, Place};
use crate::kernels::gemm::{mm, par_for, M};
use crate::kernels::thin::{self, THIN};
use crate::sync::trace::Collective;

/// A compressed matrix: which tensor, its rank and where its factors live in `p` and `q`.
#[derive(Debug, Clone)]
struct Factor {
    t: usize,
    rank: usize,
    p_off: usize,
    q_off: usize,
}

/// PowerSGD's state and steps. Its buffers live beside the gradient: in host memory, or on the GPU,
/// where the matmuls are candle's (cuBLAS), the orthogonalization is the `gram_schmidt` kernel and the
/// all-reduces run on the device (NCCL). The host path runs the same steps with the CPU matmul and the
/// kernel's twin, so the two agree up to the matmuls' summation order.
pub struct PowerSgd {
    tensors: Vec<Segment>,
    cfg: PowerSgdConfig,
    seed: u64,
    factors: Vec<Factor>,
    /// P (rows x r) and Q (cols x r) of every compressed matrix, row-major, concatenated.
    p: Flat,
    q: Flat,
    /// The error-feedback buffer (empty without error feedback, or before the first compressed step).
    error: Flat,
    /// Without error feedback, the step's input and the measure's difference (with it, the error buffer
    /// holds the input, and on the GPU the scratch holds -grads): kept between steps, so that a step does
    /// not fault in fresh pages.
    input: Flat,
    scratch: Flat,
    /// Compressed steps taken (the side of `single_allreduce`; 0: not started, Q to initialise).
    compressed_steps: u64,
}

/// `buf` taken out, `n` long at `place`: its own allocation and values where it already has that length,
/// else zeros.
fn reuse(buf: &mut Flat, place: &Place, n: usize) -> Result<Flat> {
    let mut b = std::mem::replace(buf, Flat::Host(Vec::new()));
    match b.len() == n {
        true => b.move_to(place)?,
        false => b = place.zeros(n)?,
    }
    Ok(b)
}

/// PyTorch's `_should_compress`: worth it when (n + m) r * rate < n m.
fn should_compress(n: usize, m: usize, r: usize, rate: f64) -> bool {
    ((n + m) * r) as f64 * rate < (n * m) as f64
}

impl PowerSgd {
    pub fn new(tensors: Vec<Segment>, cfg: PowerSgdConfig, seed: u64) -> Self {
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
            p: Flat::Host(vec![0.0; p_len]),
            q: Flat::Host(vec![0.0; q_len]),
            error: Flat::Host(Vec::new()),
            input: Flat::Host(Vec::new()),
            scratch: Flat::Host(Vec::new()),
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
    fn randomize_q(&mut self, step: u64) -> Result<()> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(self.seed ^ 0x706f_7765_7273_6764);
        rng.set_stream(step);
        let q: Vec<f32> = (0..self.q.len())
            .map(|_| StandardNormal.sample(&mut rng))
            .collect();
        self.q.as_mut().copy_from_host(0, &q)
    }

    /// Orthonormalizes the columns of every P (`left`) or every Q.
    fn orthogonalize_all(&mut self, left: bool) -> Result<()> {
        let eps = self.cfg.orthogonalization_epsilon as f32;
        let buf = if left { &mut self.p } else { &mut self.q };
        for f in &self.factors {
            let t = &self.tensors[f.t];
            let (rows, off) = if left {
                (t.rows, f.p_off)
            } else {
                (t.cols, f.q_off)
            };
            buf.as_mut()
                .gram_schmidt(off..off + rows * f.rank, rows, f.rank, eps)?;
        }
        Ok(())
    }

    /// For every compressed M: `left` ? M q -> p : M^T p -> q.
    fn project(&mut self, grads: FlatRef<'_>, left: bool) -> Result<()> {
        match grads {
            FlatRef::Host(g) => self.project_host(g, left),
            #[cfg(feature = "cuda")]
            FlatRef::Cuda(_) => self.project_tensors(grads, left),
        }
    }

    /// `project` in host memory: each product read from and written into the buffers themselves, by
    /// `kernels::thin` for a factor of up to `THIN` columns, else by the CPU GEMM (each threaded only
    /// where the product is large enough to pay for it).
    fn project_host(&mut self, grads: &[f32], left: bool) -> Result<()> {
        let (p, q) = (self.p.host_mut()?, self.q.host_mut()?);
        let mut qt = Vec::new();
        for f in &self.factors {
            let t = &self.tensors[f.t];
            let (rows, cols, r) = (t.rows, t.cols, f.rank);
            let (m, par) = (
                M::new(&grads[t.range()], rows, cols),
                par_for(rows * cols * r),
            );
            let (p, q) = (
                &mut p[f.p_off..f.p_off + rows * r],
                &mut q[f.q_off..f.q_off + cols * r],
            );
            match (r <= THIN, left) {
                (true, true) => {
                    thin::transpose(q, r, &mut qt);
                    thin::p_of(p, m.d, &qt, (rows, cols, r));
                }
                (true, false) => thin::q_of(q, m.d, p, (rows, cols, r)),
                (false, true) => mm(p, r, m, M::new(q, cols, r), false, 1.0, par),
                (false, false) => mm(q, r, m.t(), M::new(p, rows, r), false, 1.0, par),
            }
        }
        Ok(())
    }

    /// `project` with candle's matmul (cuBLAS on the GPU), batched by shape if configured.
    #[cfg(any(feature = "cuda", test))]
    fn project_tensors(&mut self, grads: FlatRef<'_>, left: bool) -> Result<()> {
        for group in self.groups() {
            let f0 = &self.factors[group[0]];
            let (t0, r) = (&self.tensors[f0.t], f0.rank);
            let (rows, cols, b) = (t0.rows, t0.cols, group.len());
            let mats: Vec<_> = group
                .iter()
                .map(|&g| self.tensors[self.factors[g].t].range())
                .collect();
            let m = grads.tensor(&mats, (b, rows, cols))?;
            let (src, src_len, dst_len) = if left {
                (&self.q, cols * r, rows * r)
            } else {
                (&self.p, rows * r, cols * r)
            };
            let others: Vec<_> = group
                .iter()
                .map(|&g| {
                    let f = &self.factors[g];
                    let off = if left { f.q_off } else { f.p_off };
                    off..off + src_len
                })
                .collect();
            let out = if left {
                m.matmul(&src.as_ref().tensor(&others, (b, cols, r))?)?
            } else {
                m.transpose(1, 2)?
                    .matmul(&src.as_ref().tensor(&others, (b, rows, r))?)?
            };
            let out = out.flatten_all()?;
            for (i, &g) in group.iter().enumerate() {
                let f = &self.factors[g];
                let (dst, off) = if left {
                    (&mut self.p, f.p_off)
                } else {
                    (&mut self.q, f.q_off)
                };
                dst.as_mut()
                    .copy_from_tensor(off, &out.narrow(0, i * dst_len, dst_len)?)?;
            }
        }
        Ok(())
    }

    /// Factor indices grouped for one batched multiplication: same shape and rank together when
    /// `batch_same_shape`, else one by one.
    #[cfg(any(feature = "cuda", test))]
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
    fn decompress(&self, grads: FlatMut<'_>) -> Result<()> {
        match grads {
            FlatMut::Host(g) => self.decompress_host(g),
            #[cfg(feature = "cuda")]
            FlatMut::Cuda(_) => self.decompress_tensors(grads),
        }
    }

    /// `decompress` in host memory, straight into the gradient (`kernels::thin` or the CPU GEMM, as
    /// `project_host`).
    fn decompress_host(&self, grads: &mut [f32]) -> Result<()> {
        let (p, q) = (self.p.to_host()?, self.q.to_host()?);
        let mut qt = Vec::new();
        for f in &self.factors {
            let t = &self.tensors[f.t];
            let (rows, cols, r) = (t.rows, t.cols, f.rank);
            let (p, q) = (
                &p[f.p_off..f.p_off + rows * r],
                &q[f.q_off..f.q_off + cols * r],
            );
            if r <= THIN {
                thin::transpose(q, r, &mut qt);
                thin::expand(&mut grads[t.range()], p, &qt, (rows, cols, r));
                continue;
            }
            let (p, q) = (M::new(p, rows, r), M::new(q, cols, r));
            mm(
                &mut grads[t.range()],
                cols,
                p,
                q.t(),
                false,
                1.0,
                par_for(rows * cols * r),
            );
        }
        Ok(())
    }

    /// `decompress` with candle's matmul (cuBLAS on the GPU).
    #[cfg(any(feature = "cuda", test))]
    fn decompress_tensors(&self, mut grads: FlatMut<'_>) -> Result<()> {
        for f in &self.factors {
            let t = &self.tensors[f.t];
            let p = self.p.as_ref().tensor(
                std::slice::from_ref(&(f.p_off..f.p_off + t.rows * f.rank)),
                (t.rows, f.rank),
            )?;
            let q = self.q.as_ref().tensor(
                std::slice::from_ref(&(f.q_off..f.q_off + t.cols * f.rank)),
                (t.cols, f.rank),
            )?;
            grads.copy_from_tensor(t.offset, &p.matmul(&q.t()?)?)?;
        }
        Ok(())
    }

    /// The tensors `idx` of `grads`, one after the other, in `buf`.
    fn pack(&self, grads: FlatRef<'_>, idx: &[usize], mut buf: FlatMut<'_>) -> Result<()> {
        let mut pos = 0;
        for &i in idx {
            let t = &self.tensors[i];
            buf.copy_from(pos, grads, t.range())?;
            pos += t.len;
        }
        Ok(())
    }

    /// `pack`'s inverse.
    fn unpack(&self, mut grads: FlatMut<'_>, idx: &[usize], buf: FlatRef<'_>) -> Result<()> {
        let mut pos = 0;
        for &i in idx {
            let t = &self.tensors[i];
            grads.copy_from(t.offset, buf, pos..pos + t.len)?;
            pos += t.len;
        }
        Ok(())
    }

    /// A compressed step, wherever the gradient lives (the state moves beside it the first time).
    fn reduce_compressed(
        &mut self,
        comm: &mut dyn Communicator,
        mut grads: FlatMut<'_>,
        step: u64,
    ) -> Result<Report> {
        let place = grads.as_ref().place();
        self.p.move_to(&place)?;
        self.q.move_to(&place)?;
        if self.compressed_steps == 0 || !self.cfg.warm_start {
            self.randomize_q(step)?;
        }
        if !self.cfg.single_allreduce || self.compressed_steps == 0 {
            self.orthogonalize_all(false)?;
        }
        // Both variants' first product is P = M Q, save `single_allreduce`'s odd steps.
        let left = !self.cfg.single_allreduce || self.compressed_steps.is_multiple_of(2);
        let measure = comm.rank() == 0;
        let (input, projected) = self.input(grads.as_ref(), measure, left)?;
        let source = match &input {
            Some(input) => input.as_ref(),
            None => grads.as_ref(),
        };
        if !projected {
            self.project(source, left)?;
        }
        let dense_idx = self.uncompressed();
        let dense_len = dense_idx.iter().map(|&i| self.tensors[i].len).sum();
        let mut dense = place.zeros(dense_len)?;
        self.pack(source, &dense_idx, dense.as_mut())?;
        if !self.cfg.single_allreduce {
            all_reduce_mean_flat(comm, dense.as_mut())?;
            all_reduce_sum_flat(comm, self.p.as_mut())?;
            self.orthogonalize_all(true)?;
            self.project(source, false)?;
            all_reduce_mean_flat(comm, self.q.as_mut())?;
        } else {
            // The fixed side is orthonormal from the previous step; send the other one with the vectors.
            let factor = if left { &mut self.p } else { &mut self.q };
            let k = factor.len();
            let mut buf = place.zeros(k + dense_len)?;
            buf.as_mut().copy_from(0, factor.as_ref(), 0..k)?;
            buf.as_mut().copy_from(k, dense.as_ref(), 0..dense_len)?;
            all_reduce_mean_flat(comm, buf.as_mut())?;
            factor.as_mut().copy_from(0, buf.as_ref(), 0..k)?;
            dense
                .as_mut()
                .copy_from(0, buf.as_ref(), k..k + dense_len)?;
        }
        self.unpack(grads.reborrow(), &dense_idx, dense.as_ref())?;
        let report = self.apply(grads, input, measure)?;
        if self.cfg.single_allreduce {
            // The averaged side, orthonormalised, is next step's fixed side.
            self.orthogonalize_all(left)?;
        }
        self.compressed_steps += 1;
        Ok(report)
    }

    /// The step's input: with error feedback the error buffer itself, plus the gradient (one pass, and the
    /// gradient stays as it came; on the host, with the first product P = M Q (`left`) taken in the same
    /// pass, when the second value is true); else a copy when the error is measured (rank 0's metrics
    /// rows) or none (the gradient is read in place).
    fn input(
        &mut self,
        grads: FlatRef<'_>,
        measure: bool,
        left: bool,
    ) -> Result<(Option<Flat>, bool)> {
        let (place, numel) = (grads.place(), grads.len());
        Ok(match (self.cfg.error_feedback, measure) {
            (true, _) => {
                let mut error = reuse(&mut self.error, &place, numel)?;
                let projected = match (error.as_mut(), grads) {
                    (FlatMut::Host(e), FlatRef::Host(g)) if left => {
                        self.accumulate_project(e, g)?;
                        true
                    }
                    (mut e, g) => {
                        e.add(g)?;
                        false
                    }
                };
                (Some(error), projected)
            }
            (false, true) => {
                let mut input = reuse(&mut self.input, &place, numel)?;
                input.as_mut().copy_from(0, grads, 0..numel)?;
                (Some(input), false)
            }
            (false, false) => (None, false),
        })
    }

    /// e += g and P = e Q for every compressed matrix, in one pass over e and g where the thin products
    /// allow it (`thin::accumulate_p_of`; elsewhere `kernels::ef_accumulate`, then the GEMM for a factor
    /// wider than `THIN`): the bits of `add` then `project_host(e, true)`.
    fn accumulate_project(&mut self, e: &mut [f32], g: &[f32]) -> Result<()> {
        let (p, q) = (self.p.host_mut()?, self.q.host_mut()?);
        let mut order: Vec<&Factor> = self.factors.iter().collect();
        order.sort_by_key(|f| self.tensors[f.t].offset);
        let (mut done, mut qt) = (0, Vec::new());
        for f in order {
            let t = &self.tensors[f.t];
            let (rows, cols, r) = (t.rows, t.cols, f.rank);
            crate::kernels::ef_accumulate(&mut e[done..t.offset], &g[done..t.offset]);
            done = t.offset + t.len;
            let (p, q) = (
                &mut p[f.p_off..f.p_off + rows * r],
                &q[f.q_off..f.q_off + cols * r],
            );
            if r <= THIN {
                thin::transpose(q, r, &mut qt);
                thin::accumulate_p_of(p, &mut e[t.range()], &g[t.range()], &qt, (rows, cols, r));
                continue;
            }
            crate::kernels::ef_accumulate(&mut e[t.range()], &g[t.range()]);
            let m = M::new(&e[t.range()], rows, cols);
            mm(
                p,
                r,
                m,
                M::new(q, cols, r),
                false,
                1.0,
                par_for(rows * cols * r),
            );
        }
        crate::kernels::ef_accumulate(&mut e[done..], &g[done..]);
        Ok(())
    }

    /// After the uncompressed tensors are in `grads`: grads[M] = P Q^T for every compressed M, then the new
    /// error feedback (`input` - `grads`, in place: with error feedback `input` is the error buffer) and,
    /// when `measure`, the compression error ||input - grads|| / ||input||.
    fn apply(
        &mut self,
        mut grads: FlatMut<'_>,
        input: Option<Flat>,
        measure: bool,
    ) -> Result<Report> {
        let report = Report {
            compressed_fraction: Some(self.compressed_fraction()),
            ..Report::default()
        };
        let Some(mut input) = input else {
            self.decompress(grads)?;
            return Ok(report);
        };
        let sums = match (self.cfg.error_feedback, input.as_mut(), grads.reborrow()) {
            (true, FlatMut::Host(e), FlatMut::Host(g)) => self.expand_subtract(e, g, measure)?,
            #[cfg(feature = "cuda")]
            (true, e, mut g) => {
                self.decompress(g.reborrow())?;
                self.subtract(e, g.as_ref(), measure)?
            }
            (false, x, mut g) => {
                self.decompress(g.reborrow())?;
                let mut diff = reuse(&mut self.scratch, &x.as_ref().place(), x.as_ref().len())?;
                let sums = difference(diff.as_mut(), x.as_ref(), g.as_ref(), measure)?;
                self.scratch = diff;
                sums
            }
        };
        let error = sums.map(|(lost, total)| match total > 0.0 {
            true => (lost / total).sqrt(),
            false => 0.0,
        });
        match self.cfg.error_feedback {
            true => self.error = input,
            false => self.input = input,
        }
        Ok(Report { error, ..report })
    }

    /// `decompress_host` and `kernels::optim::subtract(e, g, measure)` in one pass: each tile of g expanded
    /// from its factors (`thin::expand_part`) right before it is subtracted from e, with the bits of the
    /// two passes. Factors wider than `THIN` are expanded by the GEMM first.
    fn expand_subtract(
        &self,
        e: &mut [f32],
        g: &mut [f32],
        measure: bool,
    ) -> Result<Option<(f64, f64)>> {
        let (p, q) = (self.p.to_host()?, self.q.to_host()?);
        let mut parts = Vec::new();
        for f in &self.factors {
            let t = &self.tensors[f.t];
            let (rows, cols, r) = (t.rows, t.cols, f.rank);
            let (p, q) = (
                &p[f.p_off..f.p_off + rows * r],
                &q[f.q_off..f.q_off + cols * r],
            );
            if r > THIN {
                let (p, q) = (M::new(p, rows, r), M::new(q, cols, r));
                mm(
                    &mut g[t.range()],
                    cols,
                    p,
                    q.t(),
                    false,
                    1.0,
                    par_for(rows * cols * r),
                );
                continue;
            }
            let mut qt = Vec::new();
            thin::transpose(q, r, &mut qt);
            parts.push((t.range(), p, qt, (rows, cols, r)));
        }
        parts.sort_by_key(|(range, ..)| range.start);
        let fill = |tile: std::ops::Range<usize>, out: &mut [f32]| {
            let first = parts.partition_point(|(range, ..)| range.end <= tile.start);
            for (range, p, qt, dims) in parts[first..].iter().take_while(|x| x.0.start < tile.end) {
                let (lo, hi) = (tile.start.max(range.start), tile.end.min(range.end));
                let out = &mut out[lo - tile.start..hi - tile.start];
                thin::expand_part(out, lo - range.start, p, qt, *dims);
            }
        };
        Ok(crate::kernels::optim::fill_subtract(e, g, measure, fill))
    }

    /// On the GPU: x -= g (-g through the scratch buffer, added) and, when `measure`, the sums of
    /// squares of x after and before (the host's is `expand_subtract`).
    #[cfg(feature = "cuda")]
    fn subtract(
        &mut self,
        mut x: FlatMut<'_>,
        g: FlatRef<'_>,
        measure: bool,
    ) -> Result<Option<(f64, f64)>> {
        let before = measure.then(|| x.as_ref().sum_squares()).transpose()?;
        let mut neg = reuse(&mut self.scratch, &g.place(), g.len())?;
        neg.as_mut().assign_scaled(g, -1.0)?;
        x.add(neg.as_ref())?;
        self.scratch = neg;
        let after = before.map(|_| x.as_ref().sum_squares()).transpose()?;
        Ok(after.zip(before))
    }
}

/// out = x - g and, when `measure`, the sums of squares of out and of x (`kernels::optim::difference`; on
/// the GPU, -g then x added).
fn difference(
    out: FlatMut<'_>,
    x: FlatRef<'_>,
    g: FlatRef<'_>,
    measure: bool,
) -> Result<Option<(f64, f64)>> {
    Ok(match (out, g, x) {
        (FlatMut::Host(d), FlatRef::Host(g), FlatRef::Host(x)) => {
            crate::kernels::optim::difference(d, x, g, measure)
        }
        #[cfg(feature = "cuda")]
        (mut d, g, x) => {
            d.assign_scaled(g, -1.0)?;
            d.add(x)?;
            match measure {
                true => Some((d.as_ref().sum_squares()?, x.sum_squares()?)),
                false => None,
            }
        }
    })
}

impl Reducer for PowerSgd {
    fn reduce(
        &mut self,
        comm: &mut dyn Communicator,
        grads: &mut [f32],
        step: u64,
    ) -> Result<Report> {
        self.reduce_flat(comm, grads.into(), step)
    }

    /// On the GPU every buffer stays on the device (the all-reduces too, with the engine's device
    /// collectives).
    fn reduce_flat(
        &mut self,
        comm: &mut dyn Communicator,
        grads: FlatMut<'_>,
        step: u64,
    ) -> Result<Report> {
        if step < self.cfg.start_iter {
            all_reduce_mean_flat(comm, grads)?;
            return Ok(Report::default());
        }
        self.reduce_compressed(comm, grads, step)
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
        let left = (step - self.cfg.start_iter).is_multiple_of(2);
        let side = if left { self.p.len() } else { self.q.len() };
        vec![all_reduce(side + dense, world)]
    }

    fn state(&self) -> Result<State> {
        if self.compressed_steps == 0 {
            return Ok(Vec::new());
        }
        let steps = self.compressed_steps;
        Ok(vec![
            ("p".into(), self.p.to_host()?.into_owned()),
            ("q".into(), self.q.to_host()?.into_owned()),
            ("error".into(), self.error.to_host()?.into_owned()),
            (
                "compressed_steps".into(),
                crate::comm::pack_u64(steps).to_vec(),
            ),
        ])
    }

    /// The factors and the count of compressed steps (P and Q are the same on every rank after their
    /// all-reduces); the error buffer, the rank's own, goes empty: zeros at the next step.
    fn shared_state(&self) -> Result<State> {
        let mut s = self.state()?;
        s.iter_mut()
            .filter(|(n, _)| n == "error")
            .for_each(|(_, b)| b.clear());
        Ok(s)
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
        self.p = Flat::Host(take(&mut state, "p", Some(self.p.len()))?);
        self.q = Flat::Host(take(&mut state, "q", Some(self.q.len()))?);
        let error = take(&mut state, "error", None)?;
        if !error.is_empty() && error.len() != self.numel() {
            anyhow::bail!(crate::error::BadInput(format!(
                "checkpoint: PowerSGD error buffer holds {} values, this model needs {}",
                error.len(),
                self.numel()
            )));
        }
        self.error = Flat::Host(error);
        let s = take(&mut state, "compressed_steps", Some(2))?;
        self.compressed_steps = crate::comm::unpack_u64([s[0], s[1]]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The tensors of `shapes`, their entries and a generator seeded by `seed`.
    fn layout(
        shapes: &[(usize, usize, bool)],
        seed: u64,
    ) -> (Vec<Segment>, usize, rand_chacha::ChaCha8Rng) {
        let tensors = Segment::from_shapes(shapes);
        let n = tensors.iter().map(|t| t.len).sum();
        (tensors, n, rand_chacha::ChaCha8Rng::seed_from_u64(seed))
    }

    fn uniform(n: usize, rng: &mut impl Rng) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// The host path's products (each read from and written into the buffers by `kernels::thin` or the
    /// CPU GEMM) equal
    /// candle's (the path the GPU keeps), batched by shape or not, both ways and in the decompression,
    /// within f32 rounding (the GEMMs may add in another order): on shapes that repeat, a wide and a
    /// tall one, one too small to compress, and one large enough for the threaded GEMM.
    #[test]
    fn host_products_equal_candles() {
        let shapes = [
            (12, 9, true),
            (5, 40, true),
            (12, 9, true),
            (7, 1, false),
            (33, 3, true),
            (640, 512, true),
        ];
        let (tensors, n, mut rng) = layout(&shapes, 3);
        let g = uniform(n, &mut rng);
        let close = |a: &[f32], b: &[f32], what: &str| {
            let scale = b.iter().fold(1e-30f32, |m, x| m.max(x.abs()));
            let d = a
                .iter()
                .zip(b)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(d <= 1e-5 * scale, "{what}: {d} against {scale}");
        };
        // Rank 3: every factor thin (`kernels::thin`); rank 12: the GEMM for the factors wider than THIN.
        for (batch, rank) in [(false, 3), (true, 3), (false, 12), (true, 12)] {
            let cfg = PowerSgdConfig {
                rank,
                min_compression_rate: 0.0,
                batch_same_shape: batch,
                ..PowerSgdConfig::default()
            };
            let (mut a, mut b) = (
                PowerSgd::new(tensors.clone(), cfg.clone(), 5),
                PowerSgd::new(tensors.clone(), cfg, 5),
            );
            assert_eq!(a.factors.len(), 5, "every matrix compressed");
            a.randomize_q(0).unwrap();
            b.randomize_q(0).unwrap();
            for left in [true, false] {
                a.project_host(&g, left).unwrap();
                b.project_tensors(FlatRef::Host(&g), left).unwrap();
                close(a.p.host_mut().unwrap(), b.p.host_mut().unwrap(), "p");
                close(a.q.host_mut().unwrap(), b.q.host_mut().unwrap(), "q");
            }
            let (mut x, mut y) = (g.clone(), g.clone());
            a.decompress_host(&mut x).unwrap();
            b.decompress_tensors(FlatMut::Host(&mut y)).unwrap();
            close(&x, &y, "p q^T");
            close(
                &x[..108],
                &y[..108],
                "the first compressed tensor is rewritten",
            );
            assert_ne!(x[..108], g[..108]);
            assert_eq!(x[416..423], g[416..423], "a vector is left alone");
        }
    }

    /// The host step's fused passes (e += g with P = e Q; the expansion with e -= P Q^T and its sums of
    /// squares) leave the gradient, the error buffer, both factors and the reported error with the bits
    /// of the passes one after the other, over steps whose error and Q carry over: thin factors and ones
    /// for the GEMM, tensors too small to compress between them.
    #[test]
    fn fused_host_step_is_its_passes_one_after_the_other() {
        let shapes = [
            (12, 9, true),
            (7, 1, false),
            (40, 130, true),
            (33, 3, true),
            (2, 2, true),
        ];
        let (tensors, n, mut rng) = layout(&shapes, 4);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for rank in [3, 12] {
            let cfg = PowerSgdConfig {
                rank,
                start_iter: 0,
                min_compression_rate: 0.0,
                ..PowerSgdConfig::default()
            };
            let mut fused = PowerSgd::new(tensors.clone(), cfg.clone(), 7);
            let mut r = PowerSgd::new(tensors.clone(), cfg, 7);
            let mut e = vec![0.0f32; n];
            for step in 0..3 {
                let g = uniform(n, &mut rng);
                let mut out = g.clone();
                let report = fused
                    .reduce(&mut crate::comm::Solo, &mut out, step)
                    .unwrap();
                if step == 0 {
                    r.randomize_q(step).unwrap();
                }
                r.orthogonalize_all(false).unwrap();
                crate::kernels::add_to(&mut e, &g);
                r.project_host(&e, true).unwrap();
                r.orthogonalize_all(true).unwrap();
                r.project_host(&e, false).unwrap();
                let mut want = e.clone();
                r.decompress_host(&mut want).unwrap();
                let mut new_e = vec![0.0f32; n];
                let (lost, total) =
                    crate::kernels::optim::difference(&mut new_e, &e, &want, true).unwrap();
                e = new_e;
                assert_eq!(
                    bits(&out),
                    bits(&want),
                    "rank {rank}, step {step}: the update"
                );
                assert_eq!(bits(fused.error.host_mut().unwrap()), bits(&e), "the error");
                assert_eq!(
                    bits(fused.p.host_mut().unwrap()),
                    bits(r.p.host_mut().unwrap())
                );
                assert_eq!(
                    bits(fused.q.host_mut().unwrap()),
                    bits(r.q.host_mut().unwrap())
                );
                assert_eq!(report.error, Some((lost / total).sqrt()));
                assert_ne!(out[..108], g[..108], "the first matrix is compressed");
            }
        }
    }
}

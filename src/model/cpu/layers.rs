//! The CPU engine's layers, forward and backward, over slices of the flat buffers: cross entropy,
//! linear, layer norm, causal attention in blocks, and the element-wise ops between them.

use multiversion::multiversion;
use rayon::prelude::*;

use super::super::matmul::{
    mm, mm_bf16_packed, to_bf16, Bf16Buffers, Bf16Path, Op, PackedB, Rows16, M,
};
use super::super::ops::{
    row_max, row_sums_of, rows_lse, rows_per_task, rows_stats, CHUNK, ROWS, STRIP,
};
use super::{Linear, Norm, Params, LN_EPS};
use crate::kernels::{self, Lines};
use gemm::Parallelism;
use std::sync::Mutex;

/// Mean cross-entropy of the rows of `logits` (width v) against `y`, saving each row's log-sum-exp; per
/// task sums in f64 added in task order (deterministic for any thread count).
#[multiversion(targets = "simd")]
pub(super) fn cross_entropy(logits: &[f32], lse_out: &mut [f32], y: &[u32], v: usize) -> f32 {
    let n = y.len();
    // At least ROWS rows per task, so that wide rows (GPT-2's 50304) interleave too.
    let per = rows_per_task(n, v).max(ROWS);
    let sums: Vec<f64> = logits
        .par_chunks(per * v)
        .zip(lse_out.par_chunks_mut(per))
        .zip(y.par_chunks(per))
        .map(|((z, lse_out), y)| {
            // The rows' log-sum-exps ROWS at a time (their serial sums interleaved), the rest one by one.
            let full = lse_out.len() / ROWS * ROWS;
            for (z, o) in z.chunks(ROWS * v).zip(lse_out[..full].chunks_mut(ROWS)) {
                o.copy_from_slice(&rows_lse::<ROWS>(z, v));
            }
            for (z, o) in z[full * v..].chunks(v).zip(&mut lse_out[full..]) {
                *o = rows_lse::<1>(z, v)[0];
            }
            z.chunks(v)
                .zip(lse_out.iter())
                .zip(y)
                .map(|((row, &o), &target)| (o - row[target as usize]) as f64)
                .sum::<f64>()
        })
        .collect();
    (sums.iter().sum::<f64>() / n as f64) as f32
}

/// d loss / d logits = k (softmax - onehot), in place, from the rows' log-sum-exp.
#[multiversion(targets = "simd")]
pub(super) fn cross_entropy_backward(logits: &mut [f32], lse: &[f32], y: &[u32], v: usize, k: f32) {
    let per = rows_per_task(y.len(), v);
    logits
        .par_chunks_mut(per * v)
        .zip(lse.par_chunks(per))
        .zip(y.par_chunks(per))
        .for_each(|((z, lse), y)| {
            for ((row, &l), &target) in z.chunks_mut(v).zip(lse).zip(y) {
                row.iter_mut()
                    .for_each(|z| *z = k * super::super::ops::exp(*z - l));
                row[target as usize] -= k;
            }
        });
}

/// A saved output that only the products read: f32, or stored in bf16 (`to_bf16`) under bf16
/// products (`Products::stores_bf16`), which pack it as it is.
#[derive(Clone, Copy)]
pub(super) enum Act<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl<'a> Act<'a> {
    /// As a product's operand: `rows` x `cols`, row-major.
    fn op(self, rows: usize, cols: usize) -> Op<'a> {
        match self {
            Act::F32(d) => Op::F32(M::new(d, rows, cols)),
            Act::Bf16(d) => Op::Bf16(Rows16::new(d, rows, cols)),
        }
    }

    /// The transpose of `op(rows, cols)`.
    fn op_t(self, rows: usize, cols: usize) -> Op<'a> {
        match self {
            Act::F32(d) => Op::F32(M::new(d, rows, cols).t()),
            Act::Bf16(d) => Op::Bf16T(Rows16::new(d, rows, cols)),
        }
    }
}

/// Where a layer writes an output that only the products read (`Act`): f32, or bf16 rounded as
/// `path`'s products round it.
pub(super) enum ActMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16], Bf16Path),
}

impl ActMut<'_> {
    fn len(&self) -> usize {
        match self {
            ActMut::F32(d) => d.len(),
            ActMut::Bf16(d, _) => d.len(),
        }
    }
}

/// The element types of a saved output (`ActMut`).
pub(super) trait Stored: Copy + Send + Sync {
    /// Writes `out` with f, which fills an f32 slice of out's length: out itself, or `scratch` then
    /// rounded into out.
    fn write(out: &mut [Self], path: Bf16Path, scratch: &mut Vec<f32>, f: impl FnOnce(&mut [f32]));
}

impl Stored for f32 {
    #[inline(always)]
    fn write(out: &mut [f32], _: Bf16Path, _: &mut Vec<f32>, f: impl FnOnce(&mut [f32])) {
        f(out)
    }
}

impl Stored for u16 {
    #[inline(always)]
    fn write(out: &mut [u16], path: Bf16Path, scratch: &mut Vec<f32>, f: impl FnOnce(&mut [f32])) {
        scratch.resize(out.len(), 0.0);
        f(scratch);
        to_bf16(path, scratch, out);
    }
}

/// out = x W^T + b for x (n, in).
#[multiversion(targets = "simd")]
pub(super) fn linear(p: &Params, lin: Linear, x: Act, n: usize, out: &mut [f32]) {
    let w = M::new(p.get(lin.w), lin.out, lin.inp);
    let acc = match lin.b {
        Some(b) => {
            let bias = p.get(b);
            out.par_chunks_mut(lin.out * rows_per_task(n, lin.out))
                .for_each(|rows| {
                    rows.chunks_mut(lin.out)
                        .for_each(|r| r.copy_from_slice(bias))
                });
            true
        }
        None => false,
    };
    p.mm.mm_ops(out, lin.out, x.op(n, lin.inp), Op::F32(w.t()), acc);
}

/// Backward of `linear` given dy (n, out) and its input x (n, in): dW += dy^T x, db += column sums of
/// dy, dx = dy W. A dy stored in bf16 comes from a producer that added its column sums to db already
/// (`rows_into`), from its f32 values.
pub(super) fn linear_backward(
    p: &Params,
    grads: &mut [f32],
    lin: Linear,
    dy: Act,
    x: Act,
    n: usize,
    dx: &mut [f32],
) {
    let dw = lin.w.of(grads);
    p.mm.mm_ops(dw, lin.inp, dy.op_t(n, lin.out), x.op(n, lin.inp), true);
    if let (Some(b), Act::F32(dy)) = (lin.b, dy) {
        column_sums_into(b.of(grads), dy, lin.out);
    }
    let w = M::new(p.get(lin.w), lin.out, lin.inp);
    p.mm.mm_ops(dx, lin.inp, dy.op(n, lin.out), Op::F32(w), false);
}

/// acc[j] += sum over rows of m[., j], with per-task partial sums added in task order (the result does
/// not depend on the thread count).
#[multiversion(targets = "simd")]
pub(super) fn column_sums_into(acc: &mut [f32], m: &[f32], cols: usize) {
    let per = rows_per_task(m.len() / cols, cols);
    let partial: Vec<Vec<f32>> = m
        .par_chunks(per * cols)
        .map(|rows| {
            let mut s = vec![0.0f32; cols];
            for r in rows.chunks(cols) {
                s.iter_mut().zip(r).for_each(|(s, v)| *s += v);
            }
            s
        })
        .collect();
    for s in partial {
        acc.iter_mut().zip(&s).for_each(|(a, v)| *a += v);
    }
}

/// The rows of `out` (width `cols`), row r written by `f(r, row)` as f32 and stored as T (`Stored`);
/// with `sums`, their f32 column sums added into it as `column_sums_into` adds them (a partial sum per
/// task of `rows_per_task` rows in row order, the partials added in task order: the same bits).
#[multiversion(targets = "simd")]
pub(super) fn rows_into<T: Stored>(
    (out, path): (&mut [T], Bf16Path),
    cols: usize,
    sums: Option<&mut [f32]>,
    f: impl Fn(usize, &mut [f32]) + Sync,
) {
    let per = rows_per_task(out.len() / cols, cols);
    let width = if sums.is_some() { cols } else { 0 };
    let partial: Vec<Vec<f32>> = out
        .par_chunks_mut(per * cols)
        .enumerate()
        .map_init(Vec::new, |scratch, (t, rows)| {
            let mut s = vec![0.0f32; width];
            for (i, row) in rows.chunks_mut(cols).enumerate() {
                T::write(row, path, scratch, |row| {
                    f(t * per + i, row);
                    s.iter_mut().zip(row.iter()).for_each(|(s, v)| *s += v);
                });
            }
            s
        })
        .collect();
    if let Some(acc) = sums {
        for s in partial {
            acc.iter_mut().zip(&s).for_each(|(a, v)| *a += v);
        }
    }
}

/// LayerNorm of the rows of x (width c) into y, saving each row's (mean, 1/std).
pub(super) fn layer_norm(
    x: &[f32],
    p: &Params,
    norm: Norm,
    c: usize,
    y: ActMut,
    stats: &mut [(f32, f32)],
) {
    match y {
        ActMut::F32(y) => layer_norm_of(x, p, norm, c, (y, Bf16Path::EMULATED), stats),
        ActMut::Bf16(y, path) => layer_norm_of(x, p, norm, c, (y, path), stats),
    }
}

/// `layer_norm` into f32 or bf16 rows (`Stored`).
#[multiversion(targets = "simd")]
fn layer_norm_of<T: Stored>(
    x: &[f32],
    p: &Params,
    norm: Norm,
    c: usize,
    (y, path): (&mut [T], Bf16Path),
    stats: &mut [(f32, f32)],
) {
    let w = p.get(norm.w);
    let bias = norm.b.map(|b| p.get(b));
    let per = rows_per_task(stats.len(), c);
    y.par_chunks_mut(per * c)
        .zip(x.par_chunks(per * c))
        .zip(stats.par_chunks_mut(per))
        .for_each_init(Vec::new, |scratch, ((y, x), st)| {
            // The rows' statistics ROWS at a time (their serial sums interleaved), the rest one by one.
            let full = st.len() / ROWS * ROWS;
            for (x, st) in x.chunks(ROWS * c).zip(st[..full].chunks_mut(ROWS)) {
                st.copy_from_slice(&rows_stats::<ROWS>(x, c, LN_EPS));
            }
            for (x, st) in x[full * c..].chunks(c).zip(&mut st[full..]) {
                *st = rows_stats::<1>(x, c, LN_EPS)[0];
            }
            for ((y, x), &(mean, rstd)) in y.chunks_mut(c).zip(x.chunks(c)).zip(st.iter()) {
                T::write(y, path, scratch, |y| {
                    for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                        *y = (x - mean) * rstd * w;
                    }
                    if let Some(bias) = bias {
                        y.iter_mut().zip(bias).for_each(|(y, b)| *y += b);
                    }
                });
            }
        });
}

/// Backward of `layer_norm`: dx += rstd (g w - mean(g w) - xhat mean(g w xhat)), dw += sum g xhat,
/// db += sum g.
#[allow(clippy::too_many_arguments)]
#[multiversion(targets = "simd")]
pub(super) fn layer_norm_backward(
    x: &[f32],
    p: &Params,
    norm: Norm,
    c: usize,
    stats: &[(f32, f32)],
    g: &[f32],
    dx: &mut [f32],
    grads: &mut [f32],
) {
    let w = p.get(norm.w);
    let per = rows_per_task(stats.len(), c);
    let partial: Vec<Vec<f32>> = dx
        .par_chunks_mut(per * c)
        .zip(x.par_chunks(per * c))
        .zip(g.par_chunks(per * c))
        .zip(stats.par_chunks(per))
        .map(|(((dx, x), g), st)| {
            // dw then db of this task's rows.
            let mut dwb = vec![0.0f32; 2 * c];
            let (dw, db) = dwb.split_at_mut(c);
            let mut xhat = vec![0.0f32; ROWS * c];
            // ROWS rows at a time (their serial sums interleaved; the last group may be shorter).
            let groups = dx
                .chunks_mut(ROWS * c)
                .zip(x.chunks(ROWS * c))
                .zip(g.chunks(ROWS * c))
                .zip(st.chunks(ROWS));
            for (((dx, x), g), st) in groups {
                // The column-wise part row by row (it vectorizes), then the two serial sums of each row.
                for (r, &(mean, rstd)) in st.iter().enumerate() {
                    let (x, g) = (&x[r * c..][..c], &g[r * c..][..c]);
                    let xhat = &mut xhat[r * c..][..c];
                    let cols = xhat
                        .iter_mut()
                        .zip(x)
                        .zip(g)
                        .zip(dw.iter_mut().zip(db.iter_mut()));
                    for (((xh, &x), &g), (dw, db)) in cols {
                        *xh = (x - mean) * rstd;
                        *dw += g * *xh;
                        *db += g;
                    }
                }
                let (k, n) = (st.len(), c as f32);
                let gw = |r: usize, i: usize| g[r * c + i] * w[i];
                let m1 = row_sums_of(k, c, 0.0, gw);
                let m2 = row_sums_of(k, c, 0.0, |r, i| gw(r, i) * xhat[r * c + i]);
                for (r, &(_, rstd)) in st.iter().enumerate() {
                    let (m1, m2) = (m1[r] / n, m2[r] / n);
                    let (dx, g) = (&mut dx[r * c..][..c], &g[r * c..][..c]);
                    let xhat = &xhat[r * c..][..c];
                    for (((dx, &g), &w), &xh) in dx.iter_mut().zip(g).zip(w).zip(xhat) {
                        *dx += rstd * (g * w - m1 - xh * m2);
                    }
                }
            }
            dwb
        })
        .collect();
    for dwb in partial {
        let (dw, db) = dwb.split_at(c);
        norm.w
            .of(grads)
            .iter_mut()
            .zip(dw)
            .for_each(|(a, v)| *a += v);
        if let Some(b) = norm.b {
            b.of(grads).iter_mut().zip(db).for_each(|(a, v)| *a += v);
        }
    }
}

/// Rows per block of causal attention: a block of queries meets only the keys up to its last row, so the
/// products above the diagonal's blocks are never computed (at T = 256, 5/8 of the full T x T work).
pub(super) const ATT_BLOCK: usize = 64;

/// The row blocks `r0..r1` of a T x T attention matrix.
pub(super) fn att_blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t)
        .step_by(ATT_BLOCK)
        .map(move |r0| (r0, (r0 + ATT_BLOCK).min(t)))
}

/// The shape of a causal self-attention (sequence length, width and heads) and its products' precision:
/// f32, or with `amp` (`train.amp`, as PyTorch's autocast runs SDPA) bf16 operands summed in f32 as the
/// linear layers' are.
#[derive(Debug, Clone, Copy)]
pub(super) struct Att {
    pub t: usize,
    pub c: usize,
    pub h: usize,
    pub amp: Option<Bf16Path>,
}

impl Att {
    fn hs(self) -> usize {
        self.c / self.h
    }

    fn scale(self) -> f32 {
        1.0 / (self.hs() as f32).sqrt()
    }
}

/// The products of one head's task: f32 on the task's thread, or bf16 operands with f32 sums through
/// operand buffers of the task's own (from its `HeadScratch`), where each B operand (keys, values, ...)
/// is packed once per head into a slot and each block of rows reads the part it needs.
struct HeadMm<'a> {
    amp: Option<Bf16Path>,
    bufs: &'a mut Bf16Buffers,
    packed: &'a mut [PackedB; 4],
}

/// The attention's tasks' scratch, kept from call to call in the compute slot's activations: a task
/// takes one (or makes one) and it goes back when the task ends. Made anew for each task, their buffers
/// were allocated, zeroed and grown again at every call (on the medium config about 50 MB a step).
#[derive(Default)]
pub(super) struct HeadPool(Mutex<Vec<HeadScratch>>);

/// One task's scratch: its products' operand buffers and the backward's dS (T x T).
#[derive(Default)]
struct HeadScratch {
    bufs: Bf16Buffers,
    packed: [PackedB; 4],
    ds: Vec<f32>,
}

/// A task's scratch, back in its pool when the task ends.
struct Taken<'a> {
    pool: &'a HeadPool,
    scratch: HeadScratch,
}

impl HeadPool {
    fn take(&self) -> Taken<'_> {
        let scratch = self.lock().pop().unwrap_or_default();
        Taken {
            pool: self,
            scratch,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<HeadScratch>> {
        // A panicking task poisons the mutex; what it holds is only scratch.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        let scratch = std::mem::take(&mut self.scratch);
        self.pool.lock().push(scratch);
    }
}

impl Taken<'_> {
    /// The head's products in `amp`'s precision, and `n` floats of dS (what the last task left: the
    /// backward writes each entry before it reads it).
    fn parts(&mut self, amp: Option<Bf16Path>, n: usize) -> (HeadMm<'_>, &mut [f32]) {
        let s = &mut self.scratch;
        if s.ds.len() < n {
            s.ds.resize(n, 0.0);
        }
        let m = HeadMm {
            amp,
            bufs: &mut s.bufs,
            packed: &mut s.packed,
        };
        (m, &mut s.ds[..n])
    }
}

/// A B operand of a head's products, the slot it is packed in, and the part a product reads: rows from
/// k0 (as many as A has columns) and the first n columns.
struct HeadB<'a> {
    b: M<'a>,
    slot: usize,
    k0: usize,
    n: usize,
}

impl HeadMm<'_> {
    /// Packs b into `slot` for the head's bf16 products (nothing to do in f32).
    fn pack(&mut self, slot: usize, b: M) {
        if let Some(path) = self.amp {
            self.packed[slot].pack(path, b);
        }
    }

    /// out (a.rows x b.n, row stride `rs`) = alpha a (b's part); under bf16 b is read from its slot,
    /// packed by `pack`.
    fn mm(&mut self, out: &mut [f32], rs: usize, a: M, b: HeadB, alpha: f32) {
        let Some(path) = self.amp else {
            let part = b.b.part(b.k0, a.cols, b.n);
            return mm(out, rs, a, part, false, alpha, Parallelism::None);
        };
        let slot = &self.packed[b.slot];
        assert!(slot.holds(&b.b), "attention: slot {} is stale", b.slot);
        mm_bf16_packed(path, self.bufs, out, rs, a, (slot, b.k0, b.n));
        if alpha != 1.0 {
            for row in out.chunks_mut(rs).take(a.rows) {
                row[..b.n].iter_mut().for_each(|x| *x *= alpha);
            }
        }
    }
}

/// Causal self-attention of qkv (n, 3C: q | k | v, heads side by side) into y (n, C), saving the
/// probabilities (B, H, T, T; zero above the diagonal). One task per head of each sequence, so that a
/// batch of one sequence (GPT-2 at its full context) still fills every core: each writes its rows to
/// `heads` (n C floats, as (B, H, T, hs)), which are then laid out as y's.
pub(super) fn attention_forward(
    qkv: &[f32],
    att: &mut [f32],
    y: ActMut,
    heads: &mut [f32],
    pool: &HeadPool,
    s: Att,
) {
    let (t, c, h, hs) = (s.t, s.c, s.h, s.hs());
    assert_eq!(
        heads.len(),
        y.len(),
        "attention: scratch for the heads' rows"
    );
    att.par_chunks_mut(t * t)
        .zip(heads.par_chunks_mut(t * hs))
        .enumerate()
        .for_each_init(
            || pool.take(),
            |scratch, (i, (pr, yh))| {
                let qkv = &qkv[(i / h) * t * 3 * c + (i % h) * hs..];
                head_forward(&mut scratch.parts(s.amp, 0).0, qkv, pr, yh, s);
            },
        );
    from_heads(heads, y, None, s, 1);
}

/// One head of one sequence: `ATT_BLOCK` query rows at a time against the keys and values up to the
/// block's last row. `qkv` starts at the head's query columns of the sequence's first row; `pr` is the
/// head's T x T probabilities, `yh` its output rows (T x hs).
#[multiversion(targets = "simd")]
fn head_forward(m: &mut HeadMm, qkv: &[f32], pr: &mut [f32], yh: &mut [f32], s: Att) {
    let (t, c, hs) = (s.t, s.c, s.hs());
    let (kt, v) = (
        M::strided(&qkv[c..], t, hs, 3 * c).t(),
        M::strided(&qkv[2 * c..], t, hs, 3 * c),
    );
    m.pack(0, kt);
    m.pack(1, v);
    for (r0, r1) in att_blocks(t) {
        let q = M::strided(&qkv[r0 * 3 * c..], r1 - r0, hs, 3 * c);
        let pb = &mut pr[r0 * t..][..(r1 - r0) * t];
        let kt = HeadB {
            b: kt,
            slot: 0,
            k0: 0,
            n: r1,
        };
        m.mm(pb, t, q, kt, s.scale());
        for (g, rows) in pb.chunks_mut(ROWS * t).enumerate() {
            let i0 = r0 + g * ROWS;
            for (i, row) in (i0..).zip(rows.chunks_mut(t)) {
                let (keep, masked) = row.split_at_mut(i + 1);
                let max = row_max(keep);
                // The exponentials in a loop of their own (it vectorizes), their sums after.
                keep.iter_mut()
                    .for_each(|s| *s = super::super::ops::exp(*s - max));
                masked.iter_mut().for_each(|s| *s = 0.0);
            }
            let sums = causal_sums(rows.len() / t, i0, |r, j| rows[r * t + j]);
            for (r, row) in rows.chunks_mut(t).enumerate() {
                let inv = 1.0 / sums[r];
                row[..=i0 + r].iter_mut().for_each(|s| *s *= inv);
            }
        }
        let p = M::strided(pb, r1 - r0, r1, t);
        let v = HeadB {
            b: v,
            slot: 1,
            k0: 0,
            n: hs,
        };
        m.mm(&mut yh[r0 * hs..], hs, p, v, 1.0);
    }
}

/// For k <= ROWS causal rows from row i0 (row i0 + r keeps its first i0 + r + 1 terms), the sums of
/// `f(r, j)` over each row's terms, each serial in j from -0.0 as `Iterator::sum` adds them: the rows'
/// chains interleaved over their common i0 + 1 terms (`row_sums_of`), each row's last r after, so the
/// same bits as one sum a row with ROWS additions in flight instead of one.
#[inline(always)]
pub(super) fn causal_sums(k: usize, i0: usize, f: impl Fn(usize, usize) -> f32) -> [f32; ROWS] {
    let mut s = row_sums_of(k, i0 + 1, -0.0, &f);
    for (r, s) in s[..k].iter_mut().enumerate() {
        for j in i0 + 1..=i0 + r {
            *s += f(r, j);
        }
    }
    s
}

/// Rows kept per head as (B, H, T, parts, hs) laid out as the model's (B T, parts C): part p of head
/// `hd` at columns p C + hd hs of its row (`parts` 1: the attention's output; 3: q, k and v), stored
/// as `out` takes them (`rows_into`; with `sums`, their column sums added).
fn from_heads(heads: &[f32], out: ActMut, sums: Option<&mut [f32]>, s: Att, parts: usize) {
    let (t, h, hs) = (s.t, s.h, s.hs());
    let row = |i: usize, row: &mut [f32]| {
        let (b, r) = (i / t, i % t);
        for (p, hd) in (0..parts).flat_map(|p| (0..h).map(move |hd| (p, hd))) {
            let from = (((b * h + hd) * t + r) * parts + p) * hs;
            row[(p * h + hd) * hs..][..hs].copy_from_slice(&heads[from..][..hs]);
        }
    };
    match out {
        ActMut::F32(o) => rows_into((o, Bf16Path::EMULATED), parts * s.c, sums, row),
        ActMut::Bf16(o, path) => rows_into((o, path), parts * s.c, sums, row),
    }
}

/// Backward of `attention_forward` given dy (n, C): dqkv (n, 3C) is overwritten. A task per head of
/// each sequence as the forward, each writing its dq, dk and dv rows to `heads` (3 n C floats, as
/// (B, H, T, 3, hs)), then laid out as dqkv's.
pub(super) fn attention_backward(
    (qkv, att, dy): (&[f32], &[f32], &[f32]),
    (dqkv, sums): (ActMut, Option<&mut [f32]>),
    heads: &mut [f32],
    pool: &HeadPool,
    s: Att,
) {
    let (t, c, h, hs) = (s.t, s.c, s.h, s.hs());
    assert_eq!(
        heads.len(),
        dqkv.len(),
        "attention: scratch for the heads' rows"
    );
    att.par_chunks(t * t)
        .zip(heads.par_chunks_mut(t * 3 * hs))
        .enumerate()
        .for_each_init(
            || pool.take(),
            |scratch, (i, (pr, dh))| {
                let (b, hd) = (i / h, i % h);
                let qkv = &qkv[b * t * 3 * c + hd * hs..];
                let dy = &dy[b * t * c + hd * hs..];
                let (mut m, ds) = scratch.parts(s.amp, t * t);
                head_backward(&mut m, (qkv, pr, dy), dh, ds, s);
            },
        );
    from_heads(heads, dqkv, sums, s, 3);
}

/// One head of one sequence, blocked as the forward: a row block of dP, dS and dq reaches the block's
/// last column; a column block of dv and dk starts at the block's first row (P and dS are zero above
/// the diagonal). `qkv` and `dy` start at the head's columns of the sequence's first row; `dh` gets
/// its rows of (dq | dk | dv) (T x 3 hs); `ds` is T x T scratch.
#[multiversion(targets = "simd")]
fn head_backward(
    m: &mut HeadMm,
    (qkv, pr, dy): (&[f32], &[f32], &[f32]),
    dh: &mut [f32],
    ds: &mut [f32],
    s: Att,
) {
    let (t, c, hs) = (s.t, s.c, s.hs());
    // The head's B operands, each packed once: v^T (dP), k (dq), dy (dv) and q (dk).
    let k = M::strided(&qkv[c..], t, hs, 3 * c);
    let bs = [
        M::strided(&qkv[2 * c..], t, hs, 3 * c).t(),
        k,
        M::strided(dy, t, hs, c),
        M::strided(qkv, t, hs, 3 * c),
    ];
    for (slot, &b) in bs.iter().enumerate() {
        m.pack(slot, b);
    }
    let part = |slot: usize, k0: usize, n: usize| HeadB {
        b: bs[slot],
        slot,
        k0,
        n,
    };
    for (r0, r1) in att_blocks(t) {
        // dP = dy v^T, then dS = P (dP - rowsum(P dP)), zero where P is.
        let dyh = M::strided(&dy[r0 * c..], r1 - r0, hs, c);
        let dsb = &mut ds[r0 * t..][..(r1 - r0) * t];
        m.mm(dsb, t, dyh, part(0, 0, r1), 1.0);
        let groups = dsb.chunks_mut(ROWS * t).zip(pr[r0 * t..].chunks(ROWS * t));
        for (g, (dsg, prg)) in groups.enumerate() {
            // P is zero above the diagonal: those terms would add zeros to the rows' sums.
            let dots = causal_sums(dsg.len() / t, r0 + g * ROWS, |r, j| {
                dsg[r * t + j] * prg[r * t + j]
            });
            for (r, (ds, pr)) in dsg.chunks_mut(t).zip(prg.chunks(t)).enumerate() {
                ds[..r1]
                    .iter_mut()
                    .zip(pr)
                    .for_each(|(d, &p)| *d = p * (*d - dots[r]));
            }
        }
        // S = scale q k^T: dq = scale dS k over the keys up to the block's last row.
        let dsm = M::strided(&ds[r0 * t..], r1 - r0, r1, t);
        m.mm(
            &mut dh[r0 * 3 * hs..],
            3 * hs,
            dsm,
            part(1, 0, hs),
            s.scale(),
        );
    }
    for (c0, c1) in att_blocks(t) {
        // dv = P^T dy and dk = scale dS^T q, over the rows from the block's first on.
        let pcol = M::strided(&pr[c0 * t + c0..], t - c0, c1 - c0, t);
        let dv = &mut dh[c0 * 3 * hs + 2 * hs..];
        m.mm(dv, 3 * hs, pcol.t(), part(2, c0, hs), 1.0);
        let dscol = M::strided(&ds[c0 * t + c0..], t - c0, c1 - c0, t);
        let dk = &mut dh[c0 * 3 * hs + hs..];
        m.mm(dk, 3 * hs, dscol.t(), part(3, c0, hs), s.scale());
    }
}

/// out = a + b, in parallel chunks.
pub(super) fn add(out: &mut [f32], a: &[f32], b: &[f32]) {
    zip_map(out, a, b, |a, b| a + b);
}

/// out = a * b, in parallel chunks.
pub(super) fn mul(out: &mut [f32], a: &[f32], b: &[f32]) {
    zip_map(out, a, b, |a, b| a * b);
}

/// out = f(a, b), entry by entry, in parallel chunks.
#[multiversion(targets = "simd")]
fn zip_map(out: &mut [f32], a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) {
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK))
        .zip(b.par_chunks(CHUNK))
        .for_each(|((o, a), b)| {
            kernels::ahead(o, [a, b].map(Lines::of), |o, at| {
                let (a, b) = (&a[at..][..o.len()], &b[at..][..o.len()]);
                o.iter_mut()
                    .zip(a)
                    .zip(b)
                    .for_each(|((o, &a), &b)| *o = f(a, b))
            })
        });
}

/// out = f(x), in parallel chunks.
pub(super) fn map(out: ActMut, x: &[f32], f: impl Fn(f32) -> f32 + Sync) {
    match out {
        ActMut::F32(o) => map_of(o, Bf16Path::EMULATED, x, f),
        ActMut::Bf16(o, path) => map_of(o, path, x, f),
    }
}

/// `map` into f32 or bf16 (`Stored`).
#[multiversion(targets = "simd")]
fn map_of<T: Stored>(out: &mut [T], path: Bf16Path, x: &[f32], f: impl Fn(f32) -> f32 + Sync) {
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each_init(Vec::new, |scratch, (o, x)| {
            T::write(o, path, scratch, |o| {
                kernels::streamed(o, x, |o, x| {
                    o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x))
                })
            })
        });
}

/// (out, x) = f(x): a function's value into `out` and its derivative over `x`, in parallel chunks;
/// `f(x, v)` computes a strip of at most `ops::STRIP` entries (`ops::gelu_tanh_strip`).
pub(super) fn map_with_grad(out: ActMut, x: &mut [f32], f: impl Fn(&mut [f32], &mut [f32]) + Sync) {
    match out {
        ActMut::F32(o) => map_with_grad_of(o, Bf16Path::EMULATED, x, f),
        ActMut::Bf16(o, path) => map_with_grad_of(o, path, x, f),
    }
}

/// `map_with_grad` into f32 or bf16 (`Stored`); `f` is compiled for the vector unit itself.
fn map_with_grad_of<T: Stored>(
    out: &mut [T],
    path: Bf16Path,
    x: &mut [f32],
    f: impl Fn(&mut [f32], &mut [f32]) + Sync,
) {
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks_mut(CHUNK))
        .for_each_init(Vec::new, |scratch, (o, x)| {
            T::write(o, path, scratch, |o| {
                kernels::ahead_by::<STRIP, 1>(x, [Lines::of(o)], |x, at| {
                    f(x, &mut o[at..][..x.len()])
                })
            })
        });
}

/// out = g * d, row by row (width `cols`), stored as `out` takes it (`rows_into`), with `sums` the
/// column sums of g * d in f32 added: `scale_by` and `column_sums_into` in one pass, to the same bits.
pub(super) fn scaled_rows(
    out: ActMut,
    sums: Option<&mut [f32]>,
    (g, d): (&[f32], &[f32]),
    cols: usize,
) {
    let row = |r: usize, row: &mut [f32]| {
        let (g, d) = (&g[r * cols..][..cols], &d[r * cols..][..cols]);
        row.iter_mut()
            .zip(g.iter().zip(d))
            .for_each(|(o, (&g, &d))| *o = g * d);
    };
    match out {
        ActMut::F32(o) => rows_into((o, Bf16Path::EMULATED), cols, sums, row),
        ActMut::Bf16(o, path) => rows_into((o, path), cols, sums, row),
    }
}

/// g *= d, in parallel chunks.
#[multiversion(targets = "simd")]
pub(super) fn scale_by(g: &mut [f32], d: &[f32]) {
    g.par_chunks_mut(CHUNK)
        .zip(d.par_chunks(CHUNK))
        .for_each(|(g, d)| {
            kernels::streamed(g, d, |g, d| g.iter_mut().zip(d).for_each(|(g, &d)| *g *= d))
        });
}

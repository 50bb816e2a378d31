//! The vdpbf16ps GEMM, laid out as BLIS does: B packed into strips of NR columns, A into bf16
//! pairs along k, an MR x NR micro-kernel keeping its tile of C in registers over KC pairs of k.

use super::{a_stride, pair_along, widened, Lines, Op, Rows16, Strips, M, MR, NR};
use crate::kernels::amx::{BLOCK, PAIRS, STEP};
use rayon::prelude::*;
use std::arch::x86_64::*;
use std::cell::RefCell;

const _: () = assert!(MC.is_multiple_of(MR) && NC.is_multiple_of(NR));
/// Pairs of k per block: a B micro-strip of KC x NR pairs (16 KB) stays in L1.
const KC: usize = 128;
/// Rows and columns per parallel task.
const MC: usize = 128;
const NC: usize = 256;

/// Where a micro-tile reads its A pairs: pair p of row i at i * is + p * ps.
#[derive(Clone, Copy)]
struct APack {
    is: usize,
    ps: usize,
}

pub fn gemm(
    out: &mut [f32],
    out_rs: usize,
    a: &Op,
    b: &Op,
    acc: bool,
    pa: &mut Lines,
    pb: &mut Lines,
) {
    let kp = a.cols().div_ceil(2);
    pack_b(pb, b, kp, kp, b.cols().div_ceil(NR));
    let ap = pack_a(pa, a, kp);
    let b = Strips {
        words: pb.words(),
        stride: kp * NR,
        from: 0,
        cols: b.cols(),
    };
    run(out, out_rs, (pa.words(), ap, a.rows()), b, kp, acc);
}

/// out (a.rows x b.cols at stride `out_rs`) = a b over the pairs of b from each strip's `from`, where b
/// was packed once for several products (`PackedB`).
pub fn gemm_packed(out: &mut [f32], out_rs: usize, a: &M, b: Strips, pa: &mut Lines) {
    let kp = a.cols.div_ceil(2);
    let ap = pack_a(pa, &Op::F32(*a), kp);
    run(out, out_rs, (pa.words(), ap, a.rows), b, kp, false);
}

/// The product of packed operands over kp pairs: tasks of up to MC rows and NC columns (`task_shape`),
/// blocks of KC pairs.
fn run(
    out: &mut [f32],
    out_rs: usize,
    (pa, ap, m): (&[u32], APack, usize),
    b: Strips,
    kp: usize,
    acc: bool,
) {
    let n = b.cols;
    let strips = n.div_ceil(NR);
    let out_len = out.len();
    let c = SendPtr(out.as_mut_ptr());
    let (mc, nc) = task_shape(m, n, rayon::current_num_threads());
    let (mb, nb) = (m.div_ceil(mc), n.div_ceil(nc));
    (0..mb * nb).into_par_iter().for_each(|task| {
        let (ib, jb) = (task / nb, task % nb);
        for p0 in (0..kp).step_by(KC) {
            let kc = KC.min(kp - p0);
            let add = acc || p0 > 0;
            for s in (jb * nc / NR)..((jb + 1) * nc / NR).min(strips) {
                let bs = &b.words[s * b.stride + b.from + p0 * NR..][..kc * NR];
                let cols = NR.min(n - s * NR);
                for i0 in (ib * mc..((ib + 1) * mc).min(m)).step_by(MR) {
                    let rows = MR.min(m - i0);
                    let a0 = i0 * ap.is + p0 * ap.ps;
                    // Rows past m read the zeroed padding of the packed A.
                    assert!(a0 + (MR - 1) * ap.is + (kc - 1) * ap.ps < pa.len());
                    let c0 = i0 * out_rs + s * NR;
                    assert!(c0 + (rows - 1) * out_rs + cols <= out_len);
                    // SAFETY: the asserts above bound every read of pa and write of out; tasks
                    // write disjoint tiles of out; pb's strip holds kc x NR pairs; the CPU has
                    // AVX512-BF16 (only `Bf16Path::detect` makes the path that calls this).
                    unsafe {
                        kernel(
                            kc,
                            pa.as_ptr().add(a0),
                            ap,
                            bs.as_ptr(),
                            c.at(c0),
                            out_rs,
                            rows,
                            cols,
                            add,
                        )
                    };
                }
            }
        }
    });
}

/// Tasks per thread that `task_shape` asks for at least: with fewer, a thread that draws the last
/// task leaves the others waiting for up to a task's time.
const TASKS_PER_THREAD: usize = 3;

/// The rows and columns of `run`'s tasks for an m x n product on `threads` threads: MC x NC where that
/// makes TASKS_PER_THREAD tasks a thread; else halved (columns first, down to a strip; then rows, down
/// to a micro-tile) until it does, and evened out (384 columns as two tasks of 192, not 256 and 128).
/// The weight gradients of a small model (n_embd x n_embd over a batch's tokens: one MC x NC task)
/// would otherwise run on one thread while the others wait. Every tile of C is computed by the same
/// kernel calls in the same order whatever the shape: the same bits.
fn task_shape(m: usize, n: usize, threads: usize) -> (usize, usize) {
    let want = TASKS_PER_THREAD * threads;
    let tasks = |mc: usize, nc: usize| m.div_ceil(mc) * n.div_ceil(nc);
    if tasks(MC, NC) >= want {
        return (MC, NC);
    }
    let mut mc = m.next_multiple_of(MR).clamp(MR, MC);
    let mut nc = n.next_multiple_of(NR).clamp(NR, NC);
    while tasks(mc, nc) < want {
        if nc > NR {
            nc = (nc / 2).next_multiple_of(NR);
        } else if mc > MR {
            mc = (mc / 2).next_multiple_of(MR);
        } else {
            break;
        }
    }
    let even = |len: usize, c: usize, unit: usize| match len {
        0 => c,
        _ => len.div_ceil(len.div_ceil(c)).next_multiple_of(unit),
    };
    (even(m, mc, MR), even(n, nc, NR))
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);

impl SendPtr {
    /// # Safety
    /// `off` is inside the slice the pointer came from.
    unsafe fn at(self, off: usize) -> *mut f32 {
        // SAFETY: the caller keeps `off` inside the slice.
        unsafe { self.0.add(off) }
    }
}
// SAFETY: the tasks sharing it write disjoint tiles.
unsafe impl Send for SendPtr {}
// SAFETY: as for Send.
unsafe impl Sync for SendPtr {}

/// Pairs of rows a task of `pack_b` converts when B's rows are contiguous.
const PACK_PAIRS: usize = 32;

/// B (k x n) as strips of NR columns, each kq pairs x NR (columns past n and pairs past kp zero).
pub(super) fn pack_b(pb: &mut Lines, b: &Op, kp: usize, kq: usize, strips: usize) {
    let pb = pb.fit(strips * kq * NR);
    match b {
        Op::F32(b) if b.cs == 1 => pack_b_rows(pb, b, kp, kq),
        Op::F32(b) => pack_b_cols(pb, b, kp, kq),
        Op::Bf16(b) => pack_b_rows16(pb, b, kp, kq),
        // No layer stores a B transposed; its values widened to f32 pack to the same words.
        Op::Bf16T(x) => {
            let w = widened(x);
            pack_b_cols(pb, &M::new(&w, x.rows, x.cols).t(), kp, kq)
        }
    }
}

/// `pack_b` where B's rows are contiguous: each task a range of PACK_PAIRS pairs of rows, each pair
/// read along its whole width and stored into every strip (the reads one stream, the writes one a
/// strip, which the hardware prefetchers follow).
fn pack_b_rows(pb: &mut [u32], b: &M, kp: usize, kq: usize) {
    let (k, n) = (b.rows, b.cols);
    pack_pairs_of_rows(pb, kp, kq, |parts, at, p| {
        let r0 = &b.d[2 * p * b.rs..][..n];
        let r1 = (2 * p + 1 < k).then(|| &b.d[(2 * p + 1) * b.rs..][..n]);
        // SAFETY: the CPU has AVX512-BF16 (this module runs only where it does).
        unsafe { pair_rows_strips(parts, at, r0, r1) };
    });
}

/// `pack_b_rows` of a B stored in bf16: each pair of rows interleaved into every strip as they are.
fn pack_b_rows16(pb: &mut [u32], b: &Rows16, kp: usize, kq: usize) {
    pack_pairs_of_rows(pb, kp, kq, |parts, at, p| {
        let r1 = (2 * p + 1 < b.rows).then(|| b.row(2 * p + 1));
        interleave_strips(parts, at, b.row(2 * p), r1);
    });
}

/// B's strips by pairs of its rows: each task PACK_PAIRS pairs, `pair(parts, at, p)` storing pair p
/// into the NR words from `at` of every strip's part; pairs past kp zero up to kq.
fn pack_pairs_of_rows(
    pb: &mut [u32],
    kp: usize,
    kq: usize,
    pair: impl Fn(&mut [&mut [u32]], usize, usize) + Sync,
) {
    // Task t's part of every strip.
    parts_by_index(pb, kq * NR, PACK_PAIRS * NR)
        .into_par_iter()
        .enumerate()
        .for_each(|(t, mut parts)| {
            for pp in 0..parts.first().map_or(0, |p| p.len() / NR) {
                let (p, at) = (t * PACK_PAIRS + pp, pp * NR);
                if p >= kp {
                    parts.iter_mut().for_each(|s| s[at..][..NR].fill(0));
                } else {
                    pair(&mut parts, at, p);
                }
            }
        });
}

/// Rows r0 and r1 of bf16 values (r1 None: zeros) interleaved into the NR words from `at` of each
/// strip's part, strip s taking columns s NR to s NR + NR - 1: word j = (r0[j], r1[j]), zero past the
/// rows' end (`pair_rows_strips` without the rounding). Panics unless the parts cover the columns and
/// each holds NR words from `at`.
fn interleave_strips(parts: &mut [&mut [u32]], at: usize, r0: &[u16], r1: Option<&[u16]>) {
    let n = r0.len();
    assert!(
        n <= parts.len() * NR && r1.is_none_or(|r| r.len() == n),
        "rows wider than the strips"
    );
    for (s, part) in parts.iter_mut().enumerate() {
        let dst: &mut [u32; NR] = (&mut part[at..][..NR]).try_into().expect("NR words");
        let j0 = s * NR;
        if j0 + NR <= n {
            let lo: &[u16; NR] = r0[j0..][..NR].try_into().expect("NR columns");
            let hi = r1.map(|r1| <&[u16; NR]>::try_from(&r1[j0..][..NR]).expect("NR columns"));
            // SAFETY: the CPU has AVX512F (this module runs only where it does).
            unsafe { interleave32(dst, lo, hi) };
        } else {
            for (j, d) in dst.iter_mut().enumerate() {
                let at = |r: &[u16]| r.get(j0 + j).map_or(0, |&v| v as u32);
                *d = at(r0) | r1.map_or(0, at) << 16;
            }
        }
    }
}

/// dst[j] = (lo[j], hi[j]) (hi None: zeros), 16 words per instruction.
///
/// # Safety
/// The CPU has AVX512F.
#[target_feature(enable = "avx512f")]
unsafe fn interleave32(dst: &mut [u32; NR], lo: &[u16; NR], hi: Option<&[u16; NR]>) {
    for h in 0..NR / 16 {
        // SAFETY: each load reads 16 u16 (256 bits) from 16 h of a 32-value array, and each store
        // writes 16 u32 from 16 h of a 32-word array.
        unsafe {
            let widen = |x: &[u16; NR]| {
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(x.as_ptr().add(16 * h) as *const _))
            };
            let v = match hi {
                Some(hi) => _mm512_or_si512(widen(lo), _mm512_slli_epi32::<16>(widen(hi))),
                None => widen(lo),
            };
            _mm512_storeu_si512(dst.as_mut_ptr().add(16 * h) as *mut _, v);
        }
    }
}

/// Two rows of bf16 values (r1 None: zeros) interleaved: out[j] = (r0[j], r1[j]) (`pair_rows_bf16`
/// without the rounding). Panics unless the rows hold `out.len()` values.
pub(super) fn interleave_rows(out: &mut [u32], r0: &[u16], r1: Option<&[u16]>) {
    let n = out.len();
    let (r0, r1) = (&r0[..n], r1.map(|r| &r[..n]));
    let whole = n / NR * NR;
    for (j, dst) in out[..whole].chunks_exact_mut(NR).enumerate() {
        let lo: &[u16; NR] = r0[j * NR..][..NR].try_into().expect("NR values");
        let hi = r1.map(|r| <&[u16; NR]>::try_from(&r[j * NR..][..NR]).expect("NR values"));
        // SAFETY: the CPU has AVX512F (this module runs only where it does).
        unsafe { interleave32(dst.try_into().expect("NR words"), lo, hi) };
    }
    for j in whole..n {
        out[j] = r0[j] as u32 | r1.map_or(0, |r| r[j] as u32) << 16;
    }
}

/// A row of bf16 values as pairs along it: out[p] = (x[2p], x[2p + 1]), zero past x's end. These are
/// the row's bytes as they are (x86 words are little-endian: x[2p] is the low half).
fn pairs_of(out: &mut [u32], x: &[u16]) {
    let whole = x.len() / 2;
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out[..whole]);
    bytes.copy_from_slice(bytemuck::cast_slice(&x[..2 * whole]));
    if x.len() % 2 == 1 {
        out[whole] = x[2 * whole] as u32;
    }
    out[x.len().div_ceil(2)..].fill(0);
}

/// `buf`'s pieces of `piece` words, each cut into parts of `part` words (the last shorter where
/// `part` does not divide `piece`), grouped by index: group t holds part t of every piece, in piece
/// order (what a task writes when it takes the same part of each piece).
pub(super) fn parts_by_index(buf: &mut [u32], piece: usize, part: usize) -> Vec<Vec<&mut [u32]>> {
    let mut groups: Vec<Vec<&mut [u32]>> = (0..piece.div_ceil(part)).map(|_| vec![]).collect();
    for p in buf.chunks_exact_mut(piece) {
        for (t, part) in p.chunks_mut(part).enumerate() {
            groups[t].push(part);
        }
    }
    groups
}

/// Rows r0 and r1 (n columns each; r1 None past k: zeros) as bf16 pairs (`pair16`) into the NR
/// words from `at` of each strip's part, strip s taking columns s NR to s NR + NR - 1 (zero past n).
/// Panics unless the parts cover the columns and each holds NR words from `at`.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pair_rows_strips(parts: &mut [&mut [u32]], at: usize, r0: &[f32], r1: Option<&[f32]>) {
    let n = r0.len();
    assert!(
        n <= parts.len() * NR && r1.is_none_or(|r| r.len() == n),
        "rows wider than the strips"
    );
    for (s, part) in parts.iter_mut().enumerate() {
        let dst = &mut part[at..][..NR];
        for h in 0..2 {
            // SAFETY: the CPU has AVX512-BF16 (this function's contract).
            let v = unsafe { pair16(r0, r1, s * NR + 16 * h) };
            // SAFETY: dst holds NR = 32 words, so the 16 stored from 16 h stay inside it.
            unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add(16 * h) as *mut _, v) };
        }
    }
}

/// `pack_b` where B's columns are contiguous (B = W^T): each strip's columns paired along, then
/// transposed into it.
fn pack_b_cols(pb: &mut [u32], b: &M, kp: usize, kq: usize) {
    let (k, n) = (b.rows, b.cols);
    pb.par_chunks_mut(kq * NR)
        .enumerate()
        .for_each(|(s, strip)| {
            let j0 = s * NR;
            let cols = NR.min(n - j0);
            let (strip, pad) = strip.split_at_mut(kp * NR);
            pad.fill(0);
            with_buffer(NR * kp, |by_col| {
                for (jj, col) in by_col.chunks_exact_mut(kp).enumerate() {
                    if jj < cols {
                        // SAFETY: the CPU has AVX512-BF16 (this module runs only where it does).
                        unsafe { pair_along_bf16(col, b.d, (j0 + jj) * b.cs, b.rs, k) };
                    } else {
                        col.fill(0);
                    }
                }
                transpose_bits(by_col, kp, strip, NR, NR, kp);
            })
        });
}

/// f of `n` words of a buffer the calling thread keeps across calls (holding what its last use left:
/// what is read is written first), so that a packing's tasks neither allocate nor zero one each. A
/// call nested inside f (none of the packings' makes one) gets a fresh buffer.
pub(super) fn with_buffer<R>(n: usize, f: impl FnOnce(&mut [u32]) -> R) -> R {
    thread_local!(static WORDS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) });
    WORDS.with(|w| match w.try_borrow_mut() {
        Ok(mut w) => {
            if w.len() < n {
                w.resize(n, 0);
            }
            f(&mut w[..n])
        }
        Err(_) => f(&mut vec![0; n]),
    })
}

/// `kernels::transpose` of 32-bit words (dst, c x r at row stride ds, = src^T, src r x c at ss): a
/// transpose only moves bits.
pub(super) fn transpose_bits(
    src: &[u32],
    ss: usize,
    dst: &mut [u32],
    ds: usize,
    r: usize,
    c: usize,
) {
    let (src, dst): (&[f32], &mut [f32]) =
        (bytemuck::cast_slice(src), bytemuck::cast_slice_mut(dst));
    crate::kernels::transpose(src, ss, dst, ds, r, c);
}

/// A (m x k) as bf16 pairs along k, rows padded to a multiple of MR with zeros.
fn pack_a(pa: &mut Lines, a: &Op, kp: usize) -> APack {
    let mp = a.rows().div_ceil(MR) * MR;
    // Row i's pairs contiguous (the kernel reads none past kp).
    let is = a_stride(kp);
    let (m, k) = (a.rows(), a.cols());
    match a {
        Op::F32(a) if a.cs != 1 && a.rs == 1 => {
            pack_cols(pa.fit(kp * mp), m, |out, p| {
                let r0 = &a.d[2 * p * a.cs..][..m];
                let r1 = (2 * p + 1 < k).then(|| &a.d[(2 * p + 1) * a.cs..][..m]);
                pair_rows_into(out, r0, r1);
            });
        }
        Op::Bf16T(x) => {
            pack_cols(pa.fit(kp * mp), m, |out, p| {
                let r1 = (2 * p + 1 < k).then(|| x.row(2 * p + 1));
                interleave_rows(out, x.row(2 * p), r1);
            });
        }
        Op::F32(a) => {
            pack_rows(pa.fit(mp * is), a, kp, is);
            return APack { is, ps: 1 };
        }
        Op::Bf16(a) => {
            pack_rows16(pa.fit(mp * is), a, kp, is);
            return APack { is, ps: 1 };
        }
    }
    APack { is: 1, ps: mp }
}

/// A's rows as bf16 pairs along k in `pa`, row i's kp pairs at i `is`, MR rows a task; rows past m
/// zero.
fn pack_rows(pa: &mut [u32], a: &M, kp: usize, is: usize) {
    let (m, k) = (a.rows, a.cols);
    pa.par_chunks_mut(is * MR)
        .enumerate()
        .for_each(|(blk, rows)| {
            for (r, out) in rows.chunks_mut(is).enumerate() {
                if blk * MR + r < m {
                    let at = (blk * MR + r) * a.rs;
                    // SAFETY: the CPU has AVX512-BF16 (this module runs only where it does).
                    unsafe { pair_along_bf16(&mut out[..kp], a.d, at, a.cs, k) };
                } else {
                    out[..kp].fill(0);
                }
            }
        });
}

/// `pack_rows` of an A stored in bf16: its rows' pairs as they are.
fn pack_rows16(pa: &mut [u32], a: &Rows16, kp: usize, is: usize) {
    pa.par_chunks_mut(is * MR)
        .enumerate()
        .for_each(|(blk, rows)| {
            for (r, out) in rows.chunks_mut(is).enumerate() {
                match blk * MR + r {
                    i if i < a.rows => pairs_of(&mut out[..kp], a.row(i)),
                    _ => out[..kp].fill(0),
                }
            }
        });
}

/// `pack_row_tiles` of an A stored in bf16: each step of a row its 32 values as they are (zero past
/// the row's end and for rows past m).
pub(super) fn pack_row_tiles16(pa: &mut [u32], a: &Rows16, kq: usize) {
    pa.par_chunks_mut(BLOCK * kq)
        .enumerate()
        .for_each(|(blk, block)| {
            for r in 0..BLOCK {
                let x = match blk * BLOCK + r {
                    i if i < a.rows => a.row(i),
                    _ => &[],
                };
                for (s, step) in block.chunks_exact_mut(STEP).enumerate() {
                    let dst = &mut step[r * PAIRS..][..PAIRS];
                    let x = &x[(2 * PAIRS * s).min(x.len())..];
                    if x.len() >= 2 * PAIRS {
                        // A whole tile row: 64 bytes copied (a fixed-size copy, no call).
                        let src: &[u8; 4 * PAIRS] = bytemuck::cast_slice(&x[..2 * PAIRS])
                            .try_into()
                            .expect("a row");
                        let dst: &mut [u8; 4 * PAIRS] =
                            bytemuck::cast_slice_mut(dst).try_into().expect("a row");
                        *dst = *src;
                    } else {
                        pairs_of(dst, x);
                    }
                }
            }
        });
}

/// A's rows as bf16 pairs along k in the AMX GEMM's tiles: block b of BLOCK rows at b BLOCK kq, pairs
/// 16 s to 16 s + 15 of its row i at s STEP + i PAIRS (`kernels::amx::Amx::product`), a block per task;
/// pairs past kp and rows past m zero up to kq pairs and the blocks' end. Contiguous rows are converted
/// straight into their tile rows (`row_tiles_bf16`); strided ones through a buffer (`with_buffer`).
pub(super) fn pack_row_tiles(pa: &mut [u32], a: &M, kq: usize) {
    let (m, k) = (a.rows, a.cols);
    pa.par_chunks_mut(BLOCK * kq)
        .enumerate()
        .for_each(|(blk, block)| {
            for r in 0..BLOCK {
                let at = (blk * BLOCK + r) * a.rs;
                if blk * BLOCK + r >= m {
                    for step in block.chunks_exact_mut(STEP) {
                        step[r * PAIRS..][..PAIRS].fill(0);
                    }
                } else if a.cs == 1 {
                    // SAFETY: the CPU has AVX512-BF16 (this module runs only where it does).
                    unsafe { row_tiles_bf16(block, r, &a.d[at..][..k]) };
                } else {
                    with_buffer(kq, |row| {
                        pair_along(row, a.d, at, a.cs, k);
                        for (s, pairs) in row.chunks_exact(PAIRS).enumerate() {
                            block[s * STEP + r * PAIRS..][..PAIRS].copy_from_slice(pairs);
                        }
                    });
                }
            }
        });
}

/// Row `r` of a block of A's tiles (`pack_row_tiles`) from its contiguous elements `x`: each 32 of them
/// converted (as `pair_along_bf16` does) and stored as the row's 16 pairs in its step, zero past x's end.
/// Panics unless r < BLOCK and the block's steps hold x's pairs.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn row_tiles_bf16(block: &mut [u32], r: usize, x: &[f32]) {
    let steps = block.len() / STEP;
    assert!(
        r < BLOCK && x.len() <= steps * 2 * PAIRS,
        "row past its block"
    );
    for s in 0..steps {
        let c = s * 2 * PAIRS;
        let left = x.len().saturating_sub(c);
        let v: __m512i = if left >= 2 * PAIRS {
            // SAFETY: c + 32 <= x.len(): both 16-element loads stay inside x; the transmute
            // reinterprets 32 bf16 (512 bits) as the integer vector of the same width.
            unsafe {
                let lo = _mm512_loadu_ps(x.as_ptr().add(c));
                let hi = _mm512_loadu_ps(x.as_ptr().add(c + 16));
                std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
            }
        } else if left > 0 {
            // SAFETY: c < x.len(), and the masks cover only x's left elements from c (masked-off
            // lanes are neither read nor faulted on, and read as zeros, whose bf16 is zero).
            unsafe {
                let p = x.as_ptr().add(c);
                let lo = _mm512_maskz_loadu_ps(mask(left), p);
                let hi = _mm512_maskz_loadu_ps(mask(left.saturating_sub(16)), p.wrapping_add(16));
                std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
            }
        } else {
            _mm512_setzero_si512()
        };
        let at = s * STEP + r * PAIRS;
        assert!(at + PAIRS <= block.len());
        // SAFETY: the 16 words stored from `at` are inside block (asserted above).
        unsafe { _mm512_storeu_si512(block.as_mut_ptr().add(at) as *mut _, v) };
    }
}

/// A with contiguous columns (A = X^T, m = X's width) as its column pairs in `buf` (rows of mp):
/// `pair(row, p)` writes pair p, rows 2p and 2p + 1 of X paired along their width; zero past m.
fn pack_cols(buf: &mut [u32], m: usize, pair: impl Fn(&mut [u32], usize) + Sync) {
    let mp = m.div_ceil(MR) * MR;
    buf.par_chunks_mut(mp).enumerate().for_each(|(p, out)| {
        pair(&mut out[..m], p);
        out[m..].fill(0);
    });
}

/// `pair_rows_bf16` for the packings of a transposed A. Panics unless `r0` and `r1` hold `out.len()`
/// elements or more.
pub(super) fn pair_rows_into(out: &mut [u32], r0: &[f32], r1: Option<&[f32]>) {
    // SAFETY: the CPU has AVX512-BF16 (this module runs only where it does).
    unsafe { pair_rows_bf16(out, r0, r1) }
}

/// Two rows interleaved into bf16 pairs, 16 pairs per conversion (`pair16`): out[j] = (r0[j], r1[j]).
/// Panics unless `r0` and `r1` hold `out.len()` elements or more.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pair_rows_bf16(out: &mut [u32], r0: &[f32], r1: Option<&[f32]>) {
    let n = out.len();
    assert!(
        r0.len() >= n && r1.is_none_or(|r| r.len() >= n),
        "rows shorter than out"
    );
    for j in (0..n).step_by(16) {
        // SAFETY: the CPU has AVX512-BF16 (this function's contract).
        let v = unsafe { pair16(&r0[..n], r1.map(|r| &r[..n]), j) };
        // SAFETY: the masked lanes j .. min(j + 16, n) are inside out (n = out.len()).
        unsafe { _mm512_mask_storeu_epi32(out[j..].as_mut_ptr() as *mut _, mask(n - j), v) };
    }
}

/// Columns j to j + 15 of rows r0 and r1 as bf16 pairs: r0's element in the low half of each word,
/// r1's in the high (zero when r1 is None), zero past r0's end (r1 as long as r0). vcvtneps2bf16
/// rounds to nearest even as `bf16` does, and reads f32 subnormals as zero, as vdpbf16ps and
/// tdpbf16ps read bf16 ones.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pair16(r0: &[f32], r1: Option<&[f32]>, j: usize) -> __m512i {
    let k = mask(r0.len().saturating_sub(j));
    debug_assert!(r1.is_none_or(|r| r.len() == r0.len()));
    let widen = |x: &[f32]| {
        // SAFETY: the masked lanes are the columns from j below x's end, inside x (masked-off lanes
        // are neither read nor faulted on); the transmute reinterprets 16 bf16 (256 bits) as the
        // integer vector of the same width.
        let h: __m256i = unsafe {
            let v = _mm512_maskz_loadu_ps(k, x.as_ptr().wrapping_add(j));
            std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v))
        };
        _mm512_cvtepu16_epi32(h)
    };
    match r1 {
        Some(r1) => _mm512_or_si512(widen(r0), _mm512_slli_epi32::<16>(widen(r1))),
        None => widen(r0),
    }
}

/// `x` rounded to bf16 (their bits) by vcvtneps2bf16, as the packings round an f32 operand (see
/// `pair16`). Panics unless `out` and `x` have the same length.
pub(super) fn to_bf16(x: &[f32], out: &mut [u16]) {
    // SAFETY: the CPU has AVX512-BF16 (this module runs only where it does).
    unsafe { to_bf16_hw(x, out) }
}

/// `to_bf16`, 32 values per conversion.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn to_bf16_hw(x: &[f32], out: &mut [u16]) {
    assert_eq!(x.len(), out.len(), "bf16 copy of another length");
    let full = x.len() / 32 * 32;
    for c in (0..full).step_by(32) {
        // SAFETY: c + 32 <= full <= x.len() = out.len(): both 16-value loads and the 32-value store
        // stay inside the slices; the transmute reinterprets 32 bf16 (512 bits) as the integer
        // vector of the same width.
        unsafe {
            let lo = _mm512_loadu_ps(x.as_ptr().add(c));
            let hi = _mm512_loadu_ps(x.as_ptr().add(c + 16));
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(out.as_mut_ptr().add(c) as *mut _, v);
        }
    }
    for c in (full..x.len()).step_by(16) {
        let left = x.len() - c;
        // SAFETY: the masked lanes are x's values from c (fewer than 32 left; masked-off lanes are
        // neither read nor faulted on); the transmute reinterprets 16 bf16 (256 bits) as 16 u16.
        let words = unsafe {
            let v = _mm512_maskz_loadu_ps(mask(left), x.as_ptr().add(c));
            std::mem::transmute::<__m256bh, [u16; 16]>(_mm512_cvtneps_pbh(v))
        };
        let n = left.min(16);
        out[c..][..n].copy_from_slice(&words[..n]);
    }
}

/// `pair_along`, 16 pairs per conversion where the elements are contiguous (see `pair_rows_bf16`).
/// Panics unless `d` holds `len` elements from `start` and `out` holds `len / 2` pairs or more.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pair_along_bf16(out: &mut [u32], d: &[f32], start: usize, stride: usize, len: usize) {
    if stride != 1 {
        return pair_along(out, d, start, stride, len);
    }
    let x = &d[start..][..len];
    assert!(
        out.len() >= len / 2,
        "{} pairs for {len} elements",
        out.len()
    );
    let full = len / 32 * 32;
    for c in (0..full).step_by(32) {
        // SAFETY: c + 32 <= full <= len = x.len(): both 16-element loads stay inside x, and the
        // 16 u32 stored at c / 2 end at (c + 32) / 2 <= len / 2 <= out.len() (asserted above); the
        // transmute reinterprets 32 bf16 (512 bits) as the integer vector of the same width.
        unsafe {
            let lo = _mm512_loadu_ps(x[c..].as_ptr());
            let hi = _mm512_loadu_ps(x[c + 16..].as_ptr());
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(out[c / 2..].as_mut_ptr() as *mut _, v);
        }
    }
    pair_along(&mut out[full / 2..], x, full, 1, len - full);
}

/// C[rows x cols] (row stride c_rs) = (or += when `add`) the MR x NR tile of A B over kc pairs.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16; `a` has MR rows of kc pairs at `ap`'s strides, `b` kc x NR
/// pairs, `c` rows x cols at stride c_rs, rows <= MR, cols <= NR.
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel(
    kc: usize,
    a: *const u32,
    ap: APack,
    b: *const u32,
    c: *mut f32,
    c_rs: usize,
    rows: usize,
    cols: usize,
    add: bool,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for p in 0..kc {
        // SAFETY: b holds kc x NR pairs, so pair row p's 2 x 16 u32 are inside it; a holds MR rows of
        // kc pairs at ap's strides, so pair p of each row i < MR is inside it (the caller's contract);
        // the transmutes reinterpret 32 x 16-bit lanes as the 32 bf16 of the same 512 bits.
        unsafe {
            let bp = b.add(p * NR);
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp as *const _));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(16) as *const _));
            let ar = a.add(p * ap.ps);
            for (i, acc) in acc.iter_mut().enumerate() {
                let av: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*ar.add(i * ap.is) as i32));
                acc[0] = _mm512_dpbf16_ps(acc[0], b0, av);
                acc[1] = _mm512_dpbf16_ps(acc[1], b1, av);
            }
        }
    }
    let masks = [mask(cols.min(16)), mask(cols.saturating_sub(16))];
    for (i, acc) in acc.iter().enumerate().take(rows) {
        for v in 0..2 {
            let k = masks[v];
            if k == 0 {
                continue;
            }
            // SAFETY: row i < rows and the masked lanes 16 v .. 16 v + (cols - 16 v) < cols are inside
            // c's rows x cols at stride c_rs (the caller's contract); masked-off lanes are not touched.
            unsafe {
                let dst = c.add(i * c_rs + 16 * v);
                let val = if add {
                    _mm512_add_ps(_mm512_maskz_loadu_ps(k, dst), acc[v])
                } else {
                    acc[v]
                };
                _mm512_mask_storeu_ps(dst, k, val);
            }
        }
    }
}

fn mask(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tasks tile the product in whole micro-tiles and strips; there are TASKS_PER_THREAD a thread
    /// wherever micro-tiles and strips allow; a product with that many MC x NC tasks keeps them, and
    /// one cut finer has fewer than twice that many (each halving at most doubles the tasks), evened.
    #[test]
    fn products_are_cut_into_enough_tasks_for_the_threads() {
        for (m, n) in [
            (768, 384),
            (128, 128),
            (128, 384),
            (128, 85),
            (512, 128),
            (8, 32),
            (3, 5),
        ] {
            for threads in 1..=8 {
                let (mc, nc) = task_shape(m, n, threads);
                assert!(
                    mc % MR == 0 && nc % NR == 0 && mc <= MC && nc <= NC,
                    "{m}x{n}"
                );
                let tasks = m.div_ceil(mc) * n.div_ceil(nc);
                let (finest, want) = (m.div_ceil(MR) * n.div_ceil(NR), TASKS_PER_THREAD * threads);
                assert!(
                    tasks >= want.min(finest),
                    "{m}x{n} on {threads}: {tasks} tasks"
                );
                if m.div_ceil(MC) * n.div_ceil(NC) >= want {
                    assert_eq!((mc, nc), (MC, NC), "{m}x{n} on {threads}");
                    continue;
                }
                assert!(tasks < 2 * want, "{m}x{n} on {threads}: {tasks} tasks");
                // Even: the tasks' rows (columns) exceed m (n) by less than a micro-tile (strip) each.
                let (mb, nb) = (m.div_ceil(mc), n.div_ceil(nc));
                assert!(
                    mb * mc - m < mb * MR && nb * nc - n < nb * NR,
                    "{m}x{n}: {mc}x{nc}"
                );
            }
        }
        // An empty product has no tasks to cut.
        assert_eq!(task_shape(0, 5, 2).0 % MR + task_shape(5, 0, 2).1 % NR, 0);
        // The weight gradient of nanoGPT's CPU config (n_embd 128): six tasks on two threads, not one.
        let (mc, nc) = task_shape(128, 128, 2);
        assert!(128usize.div_ceil(mc) * 128usize.div_ceil(nc) >= 6);
    }
}

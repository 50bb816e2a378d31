//! The AMX GEMM: A packed as bf16 pairs along k in the tiles `kernels::amx` loads (blocks of 32 rows,
//! each 16 pairs of a block one piece of 2 KB), its rows padded to a multiple of 32 and its pairs to a
//! multiple of 16 (zeros); B in the vdpbf16ps GEMM's strips of NR = 32 columns (pairs padded the same
//! way). Each thread takes a band of rows and, strip after strip, sums each 32 x 32 block of C
//! over all of k in the tile registers (`kernels::amx`), from zero or from out's values when
//! accumulating, and stores it into out (blocks past out's edges through a buffer): one order of sums
//! per element, whatever the thread count.

use super::avx512::{
    interleave_rows, pack_b, pack_row_tiles, pack_row_tiles16, pair_rows_into, parts_by_index,
    transpose_bits, with_buffer,
};
use super::{Bf16Buffers, Lines, Op, Strips, M, NR};
use crate::kernels::amx::{Amx, BLOCK, PAIRS, STEP};
use rayon::prelude::*;

const _: () = assert!(NR == BLOCK);

/// Most bytes of A's pairs a band takes in a pass over k: they stay in the core's L2 while the strips of
/// B stream past.
const A_BAND_BYTES: usize = 1 << 20;
/// Pairs of k a pass sums (2048 of k): however long k is, a band of 256 rows fits in A_BAND_BYTES.
const K_PASS: usize = 1024;
const _: () = assert!(K_PASS.is_multiple_of(PAIRS));

/// Pairs along k, and those padded to whole tile rows.
pub(super) fn pairs(k: usize) -> (usize, usize) {
    let kp = k.div_ceil(2);
    (kp, kp.div_ceil(PAIRS) * PAIRS)
}

/// Words of the packed operands of an m x n x k product: A, B, and the buffer of a task of A's
/// transpose (`pack_a_cols`; one a thread while it runs).
pub(super) fn words(m: usize, n: usize, k: usize) -> (usize, usize, usize) {
    let kq = pairs(k).1;
    let mp = m.div_ceil(BLOCK) * BLOCK;
    (mp * kq, n.div_ceil(NR) * NR * kq, PAIRS * mp)
}

/// out (a.rows x b.cols, row stride `out_rs`) = a b, or += when `acc`, with a and b rounded to bf16.
pub(super) fn gemm(
    amx: Amx,
    out: &mut [f32],
    out_rs: usize,
    a: &Op,
    b: &Op,
    acc: bool,
    bufs: &mut Bf16Buffers,
) {
    let (kp, kq) = pairs(a.cols());
    let (pa, pb) = &mut bufs.packed;
    pack_b(pb, b, kp, kq, b.cols().div_ceil(NR));
    pack_a(pa, a, kp, kq);
    let b = Strips {
        words: pb.words(),
        stride: kq * NR,
        from: 0,
        cols: b.cols(),
    };
    bands(amx, out, out_rs, (pa.words(), a.rows()), b, kq, acc);
}

/// out (a.rows x b.cols at stride `out_rs`) = a b over `kq` pairs of b from each strip's `from` (a
/// multiple of 16 pairs), where b was packed once for several products (`PackedB`).
pub(super) fn gemm_packed(
    amx: Amx,
    out: &mut [f32],
    out_rs: usize,
    a: &M,
    b: Strips,
    bufs: &mut Bf16Buffers,
) {
    let (kp, kq) = pairs(a.cols);
    let (pa, _) = &mut bufs.packed;
    pack_a(pa, &Op::F32(*a), kp, kq);
    bands(amx, out, out_rs, (pa.words(), a.rows), b, kq, false);
}

/// The product of packed operands: A's m rows in blocks of BLOCK x kq pairs, B's strips over kq pairs, a
/// band of rows per task, k in passes of K_PASS pairs (each block's C reloaded for the next pass, so each
/// element's sum runs in k's order whatever the passes and bands).
fn bands(
    amx: Amx,
    out: &mut [f32],
    out_rs: usize,
    (pa, m): (&[u32], usize),
    b: Strips,
    kq: usize,
    acc: bool,
) {
    let (n, ab) = (b.cols, BLOCK * kq);
    let threads = rayon::current_num_threads().max(1);
    let fit_l2 = (A_BAND_BYTES / (4 * kq.min(K_PASS)) / BLOCK).max(1);
    let band = m.div_ceil(threads).div_ceil(BLOCK).clamp(1, fit_l2) * BLOCK;
    out[..out_len(m, n, out_rs)]
        .par_chunks_mut(band * out_rs)
        .enumerate()
        .for_each(|(t, rows_out)| {
            // `edge` is allocated at the first block past out's edges (none in most products).
            let (i0, mut edge) = (t * band, Vec::new());
            // The tiles configured once for the band's products.
            let _tiles = amx.hold();
            let rows = band.min(m - i0);
            for p0 in (0..kq).step_by(K_PASS) {
                let (steps, add) = (K_PASS.min(kq - p0) / PAIRS, acc || p0 > 0);
                let a = &pa[i0 / BLOCK * ab + p0 / PAIRS * STEP..];
                for s in 0..n.div_ceil(NR) {
                    let b = &b.words[s * b.stride + b.from + p0 * NR..][..steps * PAIRS * NR];
                    let (j0, cols) = (s * NR, NR.min(n - s * NR));
                    // The whole blocks of a whole strip straight into out; the rest through `edge`.
                    let whole = if cols == NR { rows / BLOCK } else { 0 };
                    let c = (&mut rows_out[j0..], out_rs);
                    amx.product(whole, steps, (a, ab), (b, NR), c, add);
                    for i in (whole * BLOCK..rows).step_by(BLOCK) {
                        let o = &mut rows_out[i * out_rs + j0..];
                        let a = (&a[i / BLOCK * ab..], ab);
                        let shape = (steps, (rows - i).min(BLOCK), cols, out_rs);
                        edge_block(amx, shape, a, b, (o, &mut edge), add);
                    }
                }
            }
        });
}

/// A block of C past out's edges (`rows` x `cols` of it at stride `out_rs` in `o`) through the 32 x 32
/// `edge`: out's values loaded into it first when adding, so that the sums run as in a whole block.
fn edge_block(
    amx: Amx,
    (steps, rows, cols, out_rs): (usize, usize, usize, usize),
    a: (&[u32], usize),
    b: &[u32],
    (o, edge): (&mut [f32], &mut Vec<f32>),
    add: bool,
) {
    edge.resize(BLOCK * BLOCK, 0.0);
    if add {
        edge.fill(0.0);
        for (r, e) in edge.chunks_exact_mut(BLOCK).take(rows).enumerate() {
            e[..cols].copy_from_slice(&o[r * out_rs..][..cols]);
        }
    }
    amx.product(1, steps, a, (b, NR), (edge, BLOCK), add);
    for (r, e) in edge.chunks_exact(BLOCK).take(rows).enumerate() {
        o[r * out_rs..][..cols].copy_from_slice(&e[..cols]);
    }
}

/// The length of out's m rows of n at stride out_rs: the last row ends at its n-th column.
fn out_len(m: usize, n: usize, out_rs: usize) -> usize {
    (m - 1) * out_rs + n
}

/// A (m x k) as bf16 pairs along k in the tiles `Amx::product` reads: block b of BLOCK rows at b BLOCK kq,
/// pairs 16 s to 16 s + 15 of its row i at s STEP + i PAIRS; pairs past kp and rows past m zero up to
/// kq pairs and a multiple of BLOCK rows.
fn pack_a(pa: &mut Lines, a: &Op, kp: usize, kq: usize) {
    let mp = a.rows().div_ceil(BLOCK) * BLOCK;
    let pa = pa.fit(mp * kq);
    if kq == 0 {
        return;
    }
    let (m, k) = (a.rows(), a.cols());
    match a {
        Op::F32(a) if a.cs != 1 && a.rs == 1 => pack_a_cols(pa, (m, kp, kq), |row, p| {
            let r0 = &a.d[2 * p * a.cs..][..m];
            let r1 = (2 * p + 1 < k).then(|| &a.d[(2 * p + 1) * a.cs..][..m]);
            pair_rows_into(row, r0, r1);
        }),
        Op::F32(a) => pack_row_tiles(pa, a, kq),
        Op::Bf16(a) => pack_row_tiles16(pa, a, kq),
        Op::Bf16T(x) => pack_a_cols(pa, (m, kp, kq), |row, p| {
            let r1 = (2 * p + 1 < k).then(|| x.row(2 * p + 1));
            interleave_rows(row, x.row(2 * p), r1);
        }),
    }
}

/// `pack_a` where A's columns are contiguous (A = X^T, m = X's width): each task a step of every block
/// (16 pairs of X's rows), `pair(row, p)` writing X's rows 2p and 2p + 1 paired along their width into
/// a row of the task's buffer (`pack_cols`' rows), then each block's BLOCK columns of it transposed into
/// the block's step.
fn pack_a_cols(
    pa: &mut [u32],
    (m, kp, kq): (usize, usize, usize),
    pair: impl Fn(&mut [u32], usize) + Sync,
) {
    let mp = m.div_ceil(BLOCK) * BLOCK;
    // Task s's step of every block.
    parts_by_index(pa, BLOCK * kq, STEP)
        .into_par_iter()
        .enumerate()
        .for_each(|(s, mut steps)| {
            let pairs = PAIRS.min(kp - s * PAIRS);
            with_buffer(PAIRS * mp, |buf| {
                for (q, row) in buf.chunks_exact_mut(mp).take(pairs).enumerate() {
                    pair(&mut row[..m], s * PAIRS + q);
                    row[m..].fill(0);
                }
                for (blk, step) in steps.iter_mut().enumerate() {
                    transpose_bits(&buf[blk * BLOCK..], mp, step, PAIRS, pairs, BLOCK);
                    if pairs < PAIRS {
                        step.chunks_exact_mut(PAIRS)
                            .for_each(|r| r[pairs..].fill(0));
                    }
                }
            })
        });
}

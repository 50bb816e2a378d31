//! The AMX GEMM: A packed as bf16 pairs along k, row-major, its rows padded to a multiple of 32 and its
//! pairs to a multiple of 16 (zeros); B in the vdpbf16ps GEMM's strips of NR = 32 columns (pairs padded
//! the same way). Each thread takes a band of rows and, strip after strip, sums each 32 x 32 tile of C
//! over all of k in the tile registers (`kernels::amx`), then writes it out: one order of sums per
//! element, whatever the thread count.

use super::avx512::{pack_b, pair_along_bf16, pair_rows_bf16, transpose_bits};
use super::{a_stride, fit, M, NR};
use crate::kernels::amx::{Amx, BLOCK, PAIRS};
use rayon::prelude::*;

const _: () = assert!(NR == BLOCK);

/// Most rows a band takes: 16 tile rows of A (up to 1 MB of pairs at k = 2048) stay in the core's L2
/// while the strips of B stream past.
const MAX_BAND: usize = 512;

/// Pairs along k, and those padded to whole tile rows.
fn pairs(k: usize) -> (usize, usize) {
    let kp = k.div_ceil(2);
    (kp, kp.div_ceil(PAIRS) * PAIRS)
}

/// Words of the packed operands of an m x n x k product: A, B, and the scratch of A's transpose.
pub(super) fn words(m: usize, n: usize, k: usize) -> (usize, usize, usize) {
    let (kp, kq) = pairs(k);
    let mp = m.div_ceil(BLOCK) * BLOCK;
    (mp * a_stride(kq), n.div_ceil(NR) * NR * kq, kp * mp)
}

/// The packed operands' buffers.
pub(super) struct Packed<'a> {
    pub a: &'a mut Vec<u32>,
    pub b: &'a mut Vec<u32>,
    pub scratch: &'a mut Vec<u32>,
}

/// out (a.rows x b.cols, row stride `out_rs`) = a b, or += when `acc`, with a and b rounded to bf16.
pub(super) fn gemm(amx: Amx, out: &mut [f32], out_rs: usize, a: &M, b: &M, acc: bool, p: Packed) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let (kp, kq) = pairs(k);
    let strips = n.div_ceil(NR);
    pack_b(p.b, b, kp, kq, strips);
    let is = pack_a(p.a, p.scratch, a, kp, kq);
    let threads = rayon::current_num_threads().max(1);
    let band = m
        .div_ceil(threads)
        .div_ceil(BLOCK)
        .clamp(1, MAX_BAND / BLOCK)
        * BLOCK;
    let (pa, pb) = (&p.a[..], &p.b[..]);
    out[..out_len(m, n, out_rs)]
        .par_chunks_mut(band * out_rs)
        .enumerate()
        .for_each(|(t, rows_out)| {
            let i0 = t * band;
            let rows = band.min(m - i0);
            let blocks = rows.div_ceil(BLOCK);
            let mut c = vec![0.0f32; blocks * BLOCK * BLOCK];
            for s in 0..strips {
                let strip = &pb[s * kq * NR..][..kq * NR];
                amx.product(blocks, kq / PAIRS, &pa[i0 * is..], is, strip, NR, &mut c);
                let (j0, cols) = (s * NR, NR.min(n - s * NR));
                for (r, tile_row) in c.chunks_exact(BLOCK).take(rows).enumerate() {
                    let o = &mut rows_out[r * out_rs + j0..][..cols];
                    match acc {
                        true => o.iter_mut().zip(tile_row).for_each(|(o, v)| *o += v),
                        false => o.copy_from_slice(&tile_row[..cols]),
                    }
                }
            }
        });
}

/// The length of out's m rows of n at stride out_rs: the last row ends at its n-th column.
fn out_len(m: usize, n: usize, out_rs: usize) -> usize {
    (m - 1) * out_rs + n
}

/// A (m x k) as bf16 pairs along k, row i at i x the returned stride, its pairs past kp and the rows past
/// m zero up to kq pairs and a multiple of 32 rows.
fn pack_a(pa: &mut Vec<u32>, scratch: &mut Vec<u32>, a: &M, kp: usize, kq: usize) -> usize {
    let (m, k) = (a.rows, a.cols);
    let mp = m.div_ceil(BLOCK) * BLOCK;
    let is = a_stride(kq);
    fit(pa, mp * is);
    if a.cs != 1 && a.rs == 1 {
        // Columns of A contiguous (A = X^T): pair p holds rows 2p and 2p + 1 of X for every i (kp x mp),
        // transposed into A's rows, a band of rows per task.
        fit(scratch, kp * mp);
        scratch.par_chunks_mut(mp).enumerate().for_each(|(p, out)| {
            let r0 = &a.d[2 * p * a.cs..][..m];
            let r1 = (2 * p + 1 < k).then(|| &a.d[(2 * p + 1) * a.cs..][..m]);
            // SAFETY: the CPU has AVX512-BF16 (an `Amx` is made only where it does: `Bf16Path`).
            unsafe { pair_rows_bf16(&mut out[..m], r0, r1) };
            out[m..].fill(0);
        });
        let scratch = &scratch[..];
        pa.par_chunks_mut(is * BLOCK)
            .enumerate()
            .for_each(|(blk, rows)| {
                let src = &scratch[blk * BLOCK..];
                transpose_bits(src, mp, rows, is, kp, BLOCK);
                rows.chunks_exact_mut(is).for_each(|r| r[kp..].fill(0));
            });
    } else {
        pa.par_chunks_mut(is * BLOCK)
            .enumerate()
            .for_each(|(blk, rows)| {
                for (r, out) in rows.chunks_exact_mut(is).enumerate() {
                    let i = blk * BLOCK + r;
                    if i < m {
                        // SAFETY: as above.
                        unsafe { pair_along_bf16(&mut out[..kp], a.d, i * a.rs, a.cs, k) };
                        out[kp..].fill(0);
                    } else {
                        out.fill(0);
                    }
                }
            });
    }
    is
}

//! PowerSGD's host products with a thin factor of r <= `THIN` columns, for a row-major M (rows x cols):
//! P = M Q, Q = M^T P and M = P Q^T. Each streams M once, in order, with the factor held in the core's
//! caches; a general GEMM packs M into panels first (a second pass over it) and fills a register tile
//! of 6 columns with 4. Two of them also come fused with the pass beside them in PowerSGD's step:
//! `accumulate_p_of` (M += G, then P = M Q, in one pass) and `expand_part` (any range of P Q^T, for a
//! pass that consumes it tile by tile).
//!
//! Every output is a sum in an order fixed by the definitions below, whatever the vector width and the
//! threads: `q_of` and `expand` add their terms one after the other, as a plain loop would; `p_of` adds
//! the products of lane l (the entries l, l + 16, ...) one after the other, then the 16 lanes by halves.

use multiversion::multiversion;
use rayon::prelude::*;

// How far ahead of its reads of M a product asks for M's lines (entries).
use super::STREAM_AHEAD as AHEAD;

/// The widest factor these products take.
pub const THIN: usize = 8;
/// The lanes of `p_of`'s sums.
const LANES: usize = 16;
/// The most accumulators `q_of` sums a band of columns into: 16 KiB, half of a core's first cache.
const BAND_FLOATS: usize = 4096;

/// The products run on the current pool's threads from this many multiply-adds on.
fn threaded(flops: usize) -> bool {
    flops >= 1 << 21 && rayon::current_num_threads() > 1
}

/// Calls `$f::<R>($args)` for the factor width `$r` (1..=THIN).
macro_rules! by_width {
    ($r:expr, $f:ident ( $($a:expr),* )) => {
        match $r {
            1 => $f::<1>($($a),*),
            2 => $f::<2>($($a),*),
            3 => $f::<3>($($a),*),
            4 => $f::<4>($($a),*),
            5 => $f::<5>($($a),*),
            6 => $f::<6>($($a),*),
            7 => $f::<7>($($a),*),
            8 => $f::<8>($($a),*),
            r => panic!("a thin factor has 1 to {THIN} columns, not {r}"),
        }
    };
}

/// p (rows x r, row-major) = m q, with q given transposed: qt (r x cols, row-major).
pub fn p_of(p: &mut [f32], m: &[f32], qt: &[f32], (rows, cols, r): (usize, usize, usize)) {
    assert!(p.len() == rows * r && m.len() == rows * cols && qt.len() == r * cols);
    if rows == 0 || r == 0 {
        return;
    }
    if cols == 0 {
        return p.fill(0.0);
    }
    by_rows((p, r), (m, cols), rows * cols * r, |p, m| {
        by_width!(r, p_rows(p, m, qt, cols))
    });
}

/// `f(out, src)` on whole rows of both (`out_w` and `src_w` entries a row): on blocks of 64 rows on the
/// pool's threads where `threaded(flops)`, else on all of them at once.
fn by_rows(
    (out, out_w): (&mut [f32], usize),
    (src, src_w): (&[f32], usize),
    flops: usize,
    f: impl Fn(&mut [f32], &[f32]) + Sync,
) {
    match threaded(flops) {
        true => out
            .par_chunks_mut(out_w * 64)
            .zip(src.par_chunks(src_w * 64))
            .for_each(|(o, s)| f(o, s)),
        false => f(out, src),
    }
}

#[multiversion(targets = "simd")]
fn p_rows<const R: usize>(p: &mut [f32], m: &[f32], qt: &[f32], cols: usize) {
    for (out, row) in p.chunks_exact_mut(R).zip(m.chunks_exact(cols)) {
        p_row::<R>(out, row, qt, cols);
    }
}

/// out (R) = row q: lane l adds the products of the entries l, l + 16, ... one after the other, then the
/// lanes are added by halves (`block_sum`).
#[inline(always)]
fn p_row<const R: usize>(out: &mut [f32], row: &[f32], qt: &[f32], cols: usize) {
    let full = cols - cols % LANES;
    let mut acc = [[0.0f32; LANES]; R];
    for k in (0..full).step_by(LANES) {
        products(&mut acc, row[k..k + LANES].try_into().unwrap(), qt, cols, k);
    }
    finish_row(out, &mut acc, row, qt, cols);
}

/// `p_row` on row + g, which it leaves in the row: the sum and the products in one loop, so that the
/// reads of the row and of g stream on while the products are taken (`next` and `g_next`: the rows
/// after them, whose lines are asked for ahead).
#[inline(always)]
fn accumulate_row<const R: usize>(
    out: &mut [f32],
    (row, next): (&mut [f32], &[f32]),
    (g, g_next): (&[f32], &[f32]),
    qt: &[f32],
    cols: usize,
) {
    let full = cols - cols % LANES;
    let mut acc = [[0.0f32; LANES]; R];
    for k in (0..full).step_by(LANES) {
        // The lines AHEAD entries on, in this row or the rows after it.
        match (k + AHEAD).checked_sub(cols) {
            Some(a) => {
                super::prefetch(next, a);
                super::prefetch(g_next, a);
            }
            None => {
                super::prefetch(row, k + AHEAD);
                super::prefetch(g, k + AHEAD);
            }
        }
        let (e, y): (&mut [f32; LANES], &[f32; LANES]) = (
            (&mut row[k..k + LANES]).try_into().unwrap(),
            g[k..k + LANES].try_into().unwrap(),
        );
        let x: [f32; LANES] = std::array::from_fn(|l| e[l] + y[l]);
        *e = x;
        products(&mut acc, &x, qt, cols, k);
    }
    row[full..]
        .iter_mut()
        .zip(&g[full..])
        .for_each(|(a, &b)| *a += b);
    finish_row(out, &mut acc, row, qt, cols);
}

/// acc[j][l] += x[l] q[k + l][j]: the lanes' products of the entries k..k + 16.
#[inline(always)]
fn products<const R: usize>(
    acc: &mut [[f32; LANES]; R],
    x: &[f32; LANES],
    qt: &[f32],
    cols: usize,
    k: usize,
) {
    for (j, acc) in acc.iter_mut().enumerate() {
        let y: &[f32; LANES] = qt[j * cols + k..j * cols + k + LANES].try_into().unwrap();
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
}

/// The row's last cols % 16 products into the first lanes, then out[j] = the sum of lane j's terms.
#[inline(always)]
fn finish_row<const R: usize>(
    out: &mut [f32],
    acc: &mut [[f32; LANES]; R],
    row: &[f32],
    qt: &[f32],
    cols: usize,
) {
    let full = cols - cols % LANES;
    for (j, acc) in acc.iter_mut().enumerate() {
        for (l, k) in (full..cols).enumerate() {
            acc[l] += row[k] * qt[j * cols + k];
        }
        out[j] = super::block_sum(acc);
    }
}

/// e (rows x cols, row-major) += g, then p (rows x r) = e q with q given transposed (qt, r x cols): one
/// pass over e and g where `add_to` and `p_of` take two, each row of e multiplied while it is in the
/// core's first cache. e and p get the bits that `add_to` then `p_of` give.
pub fn accumulate_p_of(
    p: &mut [f32],
    e: &mut [f32],
    g: &[f32],
    qt: &[f32],
    (rows, cols, r): (usize, usize, usize),
) {
    assert!(p.len() == rows * r && e.len() == rows * cols && g.len() == e.len());
    assert!(qt.len() == r * cols && (1..=THIN).contains(&r));
    if rows == 0 || cols == 0 {
        return p.fill(0.0);
    }
    let f =
        |p: &mut [f32], e: &mut [f32], g: &[f32]| by_width!(r, accumulate_rows(p, e, g, qt, cols));
    match threaded(rows * cols * r) {
        true => p
            .par_chunks_mut(r * 64)
            .zip(e.par_chunks_mut(cols * 64))
            .zip(g.par_chunks(cols * 64))
            .for_each(|((p, e), g)| f(p, e, g)),
        false => f(p, e, g),
    }
}

#[multiversion(targets = "simd")]
fn accumulate_rows<const R: usize>(
    p: &mut [f32],
    e: &mut [f32],
    g: &[f32],
    qt: &[f32],
    cols: usize,
) {
    let (mut e, mut g) = (e, g);
    for out in p.chunks_exact_mut(R) {
        let (row, rest) = std::mem::take(&mut e).split_at_mut(cols);
        let (gr, g_rest) = g.split_at(cols);
        accumulate_row::<R>(out, (row, &*rest), (gr, g_rest), qt, cols);
        (e, g) = (rest, g_rest);
    }
}

/// q (cols x r, row-major) = m^T p, p rows x r (row-major).
pub fn q_of(q: &mut [f32], m: &[f32], p: &[f32], (rows, cols, r): (usize, usize, usize)) {
    assert!(q.len() == cols * r && m.len() == rows * cols && p.len() == rows * r);
    if cols == 0 || r == 0 {
        return;
    }
    // Bands of columns, each summed over every row into its transposed accumulators (r x band): one a
    // thread, and none wider than the first cache holds beside the rows' reads.
    let threads = match threaded(rows * cols * r) {
        true => rayon::current_num_threads().min(cols.div_ceil(LANES)),
        false => 1,
    };
    let cap = (BAND_FLOATS / r).max(LANES) / LANES * LANES;
    let band = cols
        .div_ceil(threads)
        .next_multiple_of(LANES)
        .min(cap)
        .min(cols);
    let sums = |c0: usize| {
        let w = band.min(cols - c0);
        let mut acc = vec![0.0f32; r * w];
        by_width!(r, q_band(&mut acc, m, p, (cols, c0, w)));
        (c0, w, acc)
    };
    let starts: Vec<usize> = (0..cols).step_by(band).collect();
    let done: Vec<_> = match threads {
        1 => starts.into_iter().map(sums).collect(),
        _ => starts.into_par_iter().map(sums).collect(),
    };
    for (c0, w, acc) in done {
        for (j, col) in acc.chunks_exact(w).enumerate() {
            for (c, &v) in col.iter().enumerate() {
                q[(c0 + c) * r + j] = v;
            }
        }
    }
}

/// acc (R x w, row-major) += the columns c0..c0 + w of m^T p, a row of m after the other. The rows are
/// read in memory order, one at a time: the accumulators stay in the core's first cache, and the reads
/// of m are one stream (several rows at a time, with their terms in registers, ran at half the speed).
/// A band narrower than m asks for the next row's part of it as it reads this row's.
#[multiversion(targets = "simd")]
fn q_band<const R: usize>(
    acc: &mut [f32],
    m: &[f32],
    p: &[f32],
    (cols, c0, w): (usize, usize, usize),
) {
    assert!(acc.len() == R * w && c0 + w <= cols);
    let full = w - w % LANES;
    let ahead = if w == cols { AHEAD } else { cols };
    for (i, (row, pi)) in m.chunks_exact(cols).zip(p.chunks_exact(R)).enumerate() {
        let (x, pi): (&[f32], &[f32; R]) = (&row[c0..c0 + w], pi.try_into().unwrap());
        for c in (0..full).step_by(LANES) {
            super::prefetch(m, i * cols + c0 + c + ahead);
            let x: &[f32; LANES] = x[c..c + LANES].try_into().unwrap();
            for (j, &pij) in pi.iter().enumerate() {
                let a: &mut [f32; LANES] = (&mut acc[j * w + c..][..LANES]).try_into().unwrap();
                for l in 0..LANES {
                    a[l] += pij * x[l];
                }
            }
        }
        for c in full..w {
            for (j, &pij) in pi.iter().enumerate() {
                acc[j * w + c] += pij * x[c];
            }
        }
    }
}

/// m (rows x cols, row-major) = p q^T, p rows x r and q given transposed: qt (r x cols).
pub fn expand(m: &mut [f32], p: &[f32], qt: &[f32], (rows, cols, r): (usize, usize, usize)) {
    assert!(m.len() == rows * cols && p.len() == rows * r && qt.len() == r * cols);
    if rows == 0 || cols == 0 {
        return;
    }
    if r == 0 {
        return m.fill(0.0);
    }
    by_rows((m, cols), (p, r), rows * cols * r, |m, p| {
        by_width!(r, expand_rows(m, p, qt, cols))
    });
}

#[multiversion(targets = "simd")]
fn expand_rows<const R: usize>(m: &mut [f32], p: &[f32], qt: &[f32], cols: usize) {
    for (row, p) in m.chunks_exact_mut(cols).zip(p.chunks_exact(R)) {
        expand_row::<R>(row, p, qt, cols, 0);
    }
}

/// out = the entries c0..c0 + out.len() of a row of p q^T, p its row of p: each the sum over j of
/// p[j] qt[j][c] in the order of j.
#[inline(always)]
fn expand_row<const R: usize>(out: &mut [f32], p: &[f32], qt: &[f32], cols: usize, c0: usize) {
    for (c, out) in (c0..).zip(out.iter_mut()) {
        let mut s = 0.0f32;
        for j in 0..R {
            s += p[j] * qt[j * cols + c];
        }
        *out = s;
    }
}

/// out = the entries start..start + out.len() of p q^T (rows x cols, row-major; qt is q transposed, r x
/// cols), bit for bit those `expand` writes there: a part of the expansion, for a pass that consumes it
/// while it is in cache.
pub fn expand_part(
    out: &mut [f32],
    start: usize,
    p: &[f32],
    qt: &[f32],
    (rows, cols, r): (usize, usize, usize),
) {
    assert!(start + out.len() <= rows * cols && p.len() == rows * r && qt.len() == r * cols);
    if r == 0 {
        return out.fill(0.0);
    }
    by_width!(r, expand_part_rows(out, start, p, qt, cols))
}

#[multiversion(targets = "simd")]
fn expand_part_rows<const R: usize>(
    mut out: &mut [f32],
    start: usize,
    p: &[f32],
    qt: &[f32],
    cols: usize,
) {
    let mut at = start;
    while !out.is_empty() {
        let (i, c0) = (at / cols, at % cols);
        let n = (cols - c0).min(out.len());
        let (row, rest) = std::mem::take(&mut out).split_at_mut(n);
        expand_row::<R>(row, &p[i * R..i * R + R], qt, cols, c0);
        at += row.len();
        out = rest;
    }
}

/// a (n x r, row-major) transposed into out (r x n), by `kernels::transpose`.
pub fn transpose(a: &[f32], r: usize, out: &mut Vec<f32>) {
    let n = a.len() / r.max(1);
    out.clear();
    out.resize(r * n, 0.0);
    super::transpose(a, r, out, n, n, r);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, rng: &mut impl Rng) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// q_of and expand equal their plain loops bit for bit (the same sums in the same order), threaded
    /// or not; p_of equals its lane-by-lane definition bit for bit and the f64 product within rounding.
    #[test]
    fn thin_products_are_their_plain_loops() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        // The last is threaded (two million multiply-adds and more) wherever the pool has two threads.
        let shapes = [
            (1, 1),
            (3, 17),
            (17, 3),
            (64, 33),
            (33, 64),
            (5, 100),
            (700, 48),
            (40, 3000),
            (700, 3001),
        ];
        for (rows, cols) in shapes {
            for r in 1..=THIN {
                let (m, p0, q0) = (
                    random(rows * cols, &mut rng),
                    random(rows * r, &mut rng),
                    random(cols * r, &mut rng),
                );
                let dims = (rows, cols, r);
                let mut qt = Vec::new();
                transpose(&q0, r, &mut qt);
                // p = m q.
                let mut p = vec![f32::NAN; rows * r];
                p_of(&mut p, &m, &qt, dims);
                for i in 0..rows {
                    for j in 0..r {
                        let mut lanes = [0.0f32; LANES];
                        for k in 0..cols {
                            lanes[k % LANES] += m[i * cols + k] * q0[k * r + j];
                        }
                        assert_eq!(
                            p[i * r + j].to_bits(),
                            crate::kernels::block_sum(&mut lanes).to_bits(),
                            "{dims:?}"
                        );
                        let exact: f64 = (0..cols)
                            .map(|k| m[i * cols + k] as f64 * q0[k * r + j] as f64)
                            .sum();
                        assert!((p[i * r + j] as f64 - exact).abs() <= 1e-5 * (cols as f64).sqrt());
                    }
                }
                // q = m^T p.
                let mut q = vec![f32::NAN; cols * r];
                q_of(&mut q, &m, &p0, dims);
                for c in 0..cols {
                    for j in 0..r {
                        let mut s = 0.0f32;
                        for i in 0..rows {
                            s += p0[i * r + j] * m[i * cols + c];
                        }
                        assert_eq!(q[c * r + j].to_bits(), s.to_bits(), "{dims:?} q");
                    }
                }
                // m = p q^T.
                let mut out = vec![f32::NAN; rows * cols];
                expand(&mut out, &p0, &qt, dims);
                for i in 0..rows {
                    for c in 0..cols {
                        let mut s = 0.0f32;
                        for j in 0..r {
                            s += p0[i * r + j] * q0[c * r + j];
                        }
                        assert_eq!(out[i * cols + c].to_bits(), s.to_bits(), "{dims:?} m");
                    }
                }
            }
        }
    }

    /// `accumulate_p_of` leaves e and p with the bits of `add_to` then `p_of`, threaded or not, and
    /// `expand_part` writes any range of p q^T with the bits `expand` gives it (ranges inside a row, across
    /// rows, whole and empty).
    #[test]
    fn fused_products_are_the_passes_they_fuse() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        for (rows, cols) in [(1, 1), (3, 17), (64, 33), (5, 100), (700, 3001)] {
            for r in 1..=THIN {
                let dims = (rows, cols, r);
                let (e0, g, q0) = (
                    random(rows * cols, &mut rng),
                    random(rows * cols, &mut rng),
                    random(cols * r, &mut rng),
                );
                let mut qt = Vec::new();
                transpose(&q0, r, &mut qt);
                let (mut e, mut p) = (e0.clone(), vec![f32::NAN; rows * r]);
                accumulate_p_of(&mut p, &mut e, &g, &qt, dims);
                let (mut want_e, mut want_p) = (e0.clone(), vec![0.0; rows * r]);
                crate::kernels::add_to(&mut want_e, &g);
                p_of(&mut want_p, &want_e, &qt, dims);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&e), bits(&want_e), "{dims:?} e");
                assert_eq!(bits(&p), bits(&want_p), "{dims:?} p");
                let mut whole = vec![f32::NAN; rows * cols];
                expand(&mut whole, &p, &qt, dims);
                let n = rows * cols;
                for (a, b) in [
                    (0, n),
                    (0, 0),
                    (n / 3, n / 3 + 1),
                    (1, n),
                    (n / 2, n),
                    (cols / 2, n - cols / 3),
                ] {
                    let mut part = vec![f32::NAN; b.max(a) - a];
                    expand_part(&mut part, a, &p, &qt, dims);
                    assert_eq!(bits(&part), bits(&whole[a..b.max(a)]), "{dims:?} {a}..{b}");
                }
            }
        }
    }
}

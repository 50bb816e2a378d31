//! PowerSGD's host products with a thin factor of r <= `THIN` columns, for a row-major M (rows x cols):
//! P = M Q, Q = M^T P and M = P Q^T. Each streams M once, in order, with the factor held in the core's
//! caches; a general GEMM packs M into panels first (a second pass over it) and fills a register tile
//! of 6 columns with 4.
//!
//! Every output is a sum in an order fixed by the definitions below, whatever the vector width and the
//! threads: `q_of` and `expand` add their terms one after the other, as a plain loop would; `p_of` adds
//! the products of lane l (the entries l, l + 16, ...) one after the other, then the 16 lanes by halves.

use multiversion::multiversion;
use rayon::prelude::*;

/// The widest factor these products take.
pub const THIN: usize = 8;
/// The lanes of `p_of`'s sums.
const LANES: usize = 16;

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
    let full = cols - cols % LANES;
    for (out, row) in p.chunks_exact_mut(R).zip(m.chunks_exact(cols)) {
        let mut acc = [[0.0f32; LANES]; R];
        for k in (0..full).step_by(LANES) {
            let x: &[f32; LANES] = row[k..k + LANES].try_into().unwrap();
            for (j, acc) in acc.iter_mut().enumerate() {
                let y: &[f32; LANES] = qt[j * cols + k..j * cols + k + LANES].try_into().unwrap();
                for l in 0..LANES {
                    acc[l] += x[l] * y[l];
                }
            }
        }
        for (j, acc) in acc.iter_mut().enumerate() {
            for (l, k) in (full..cols).enumerate() {
                acc[l] += row[k] * qt[j * cols + k];
            }
            out[j] = super::block_sum(acc);
        }
    }
}

/// q (cols x r, row-major) = m^T p, p rows x r (row-major).
pub fn q_of(q: &mut [f32], m: &[f32], p: &[f32], (rows, cols, r): (usize, usize, usize)) {
    assert!(q.len() == cols * r && m.len() == rows * cols && p.len() == rows * r);
    if cols == 0 || r == 0 {
        return;
    }
    // Per thread a band of columns, summed over every row into its transposed accumulators (r x band).
    let bands = match threaded(rows * cols * r) {
        true => rayon::current_num_threads().min(cols.div_ceil(LANES)),
        false => 1,
    };
    let band = cols.div_ceil(bands).next_multiple_of(LANES).min(cols);
    let sums = |c0: usize| {
        let w = band.min(cols - c0);
        let mut acc = vec![0.0f32; r * w];
        by_width!(r, q_band(&mut acc, m, p, (cols, c0, w)));
        (c0, w, acc)
    };
    let done: Vec<_> = match bands {
        1 => vec![sums(0)],
        _ => (0..cols)
            .step_by(band)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(sums)
            .collect(),
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
#[multiversion(targets = "simd")]
fn q_band<const R: usize>(
    acc: &mut [f32],
    m: &[f32],
    p: &[f32],
    (cols, c0, w): (usize, usize, usize),
) {
    let full = w - w % LANES;
    for (row, pi) in m.chunks_exact(cols).zip(p.chunks_exact(R)) {
        let (x, pi): (&[f32], &[f32; R]) = (&row[c0..c0 + w], pi.try_into().unwrap());
        for c in (0..full).step_by(LANES) {
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
        for (c, out) in row.iter_mut().enumerate() {
            let mut s = 0.0f32;
            for j in 0..R {
                s += p[j] * qt[j * cols + c];
            }
            *out = s;
        }
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
}

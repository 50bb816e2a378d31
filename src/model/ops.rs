//! The scalar math of the CPU engine (`cpu`): branch-free polynomial exp / erf / tanh that the compiler
//! vectorizes (libm's expf / erff / tanhf are calls per element), GELU in both forms with their
//! derivatives, and the row helpers of LayerNorm and cross-entropy.

/// Elements per parallel task of the row-wise ops.
pub(crate) const CHUNK: usize = 1 << 14;

/// e^x for f32, branch-free (Cephes' expf: range reduction by ln 2, degree-6 polynomial); relative error
/// within 2 ulp on [-87, 88]; saturates outside.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.3);
    // Round to nearest with the 1.5 * 2^23 trick (no libm call, so the loop vectorizes).
    const MAGIC: f32 = 12_582_912.0;
    let m = x * LOG2E + MAGIC;
    let n = m - MAGIC;
    let r = x - n * C1 - n * C2;
    let p = 1.987_569_1e-4f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 5e-1;
    let y = p * r * r + r + 1.0;
    // y * 2^n through the exponent bits (n in [-126, 127] after the clamp). m lies in [2^23, 2^24), where
    // floats are the integers, so its bits are MAGIC's plus n: integer arithmetic that vectorizes (a cast
    // `n as i32` saturates, which compiles to a scalar conversion and NaN check per lane).
    let biased = m.to_bits().wrapping_sub(MAGIC.to_bits()).wrapping_add(127);
    y * f32::from_bits(biased << 23)
}

/// tanh through the exponential: 1 - 2 / (e^{2u} + 1) (absolute error ~1e-7).
#[inline(always)]
fn tanh(u: f32) -> f32 {
    tanh_of_exp(exp(2.0 * u))
}

/// tanh(u) from e = e^{2u}.
#[inline(always)]
fn tanh_of_exp(e: f32) -> f32 {
    1.0 - 2.0 / (e + 1.0)
}

/// erf (Abramowitz & Stegun 7.1.26, absolute error below 1.5e-7).
#[inline(always)]
fn erf(x: f32) -> f32 {
    erf_with(x, erf_exp(x))
}

/// The exponential in erf(x): e^{-x^2}.
#[inline(always)]
fn erf_exp(x: f32) -> f32 {
    let a = x.abs();
    exp(-a * a)
}

/// erf(x) from its exponential `ex` (`erf_exp`).
#[inline(always)]
fn erf_with(x: f32, ex: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_8 + t * (-1.453_152_1 + t * 1.061_405_4))));
    let y = 1.0 - poly * ex;
    y.copysign(x)
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const INV_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// The tanh's argument in `gelu_tanh`.
#[inline(always)]
fn gelu_tanh_arg(x: f32) -> f32 {
    SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)
}

/// The tanh's argument in `gelu_tanh_grad`.
#[inline(always)]
fn gelu_tanh_grad_arg(x: f32) -> f32 {
    SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * (x * x))
}

/// GELU and its derivative.
#[inline(always)]
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    gelu_tanh_with(x, tanh(gelu_tanh_arg(x)))
}

#[inline(always)]
pub(crate) fn gelu_tanh_grad(x: f32) -> f32 {
    gelu_tanh_grad_with(x, tanh(gelu_tanh_grad_arg(x)))
}

/// `gelu_tanh(x)` from its tanh `t`.
#[inline(always)]
fn gelu_tanh_with(x: f32, t: f32) -> f32 {
    0.5 * x * (1.0 + t)
}

/// `gelu_tanh_grad(x)` from its tanh `t`.
#[inline(always)]
fn gelu_tanh_grad_with(x: f32, t: f32) -> f32 {
    let x2 = x * x;
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044_715 * x2)
}

#[inline(always)]
pub(crate) fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * INV_SQRT_2))
}

/// erf-GELU's derivative alone: the reference `gelu_erf_and_grad` is held to.
#[cfg(test)]
fn gelu_erf_grad(x: f32) -> f32 {
    0.5 * (1.0 + erf(x * INV_SQRT_2)) + x * INV_SQRT_2PI * exp(-0.5 * x * x)
}

/// (`gelu_erf(x)`, `gelu_erf_grad(x)`) from one erf, the same floats.
#[inline(always)]
pub(crate) fn gelu_erf_and_grad(x: f32) -> (f32, f32) {
    gelu_erf_and_grad_with(x, erf_exp(x * INV_SQRT_2), exp(-0.5 * x * x))
}

/// `gelu_erf_and_grad(x)` from its two exponentials: erf's (`erf_exp`) and the derivative's.
#[inline(always)]
fn gelu_erf_and_grad_with(x: f32, erf_ex: f32, ex: f32) -> (f32, f32) {
    let e = erf_with(x * INV_SQRT_2, erf_ex);
    (0.5 * x * (1.0 + e), 0.5 * (1.0 + e) + x * INV_SQRT_2PI * ex)
}

/// A GELU's strip function (`gelu_tanh_strip`), and its value and derivative at one entry.
#[cfg(test)]
pub(crate) type Strip = fn(&mut [f32], &mut [f32]);
#[cfg(test)]
pub(crate) type Pair = fn(f32) -> (f32, f32);

/// Each GELU's strip function beside its value and derivative one entry at a time (the tests' list).
#[cfg(test)]
pub(crate) const GELU_FORMS: [(&str, Strip, Pair); 2] = [
    ("erf", gelu_erf_strip, gelu_erf_and_grad),
    ("tanh", gelu_tanh_strip, |x| {
        (gelu_tanh(x), gelu_tanh_grad(x))
    }),
];

/// Entries of a strip of a GELU's value and derivative (`gelu_tanh_strip`, `gelu_erf_strip`).
pub(crate) const STRIP: usize = 256;

/// (`gelu_tanh(x)`, `gelu_tanh_grad(x)`) of each entry of x (at most `STRIP` of them): the value into
/// `v` and the derivative over x, the same floats (`two_loops`).
#[multiversion::multiversion(targets = "simd")]
pub(crate) fn gelu_tanh_strip(x: &mut [f32], v: &mut [f32]) {
    two_loops(
        (x, v),
        |x| {
            let value = exp(2.0 * gelu_tanh_arg(x));
            (value, exp(2.0 * gelu_tanh_grad_arg(x)))
        },
        |x, value, slope| {
            let v = gelu_tanh_with(x, tanh_of_exp(value));
            (v, gelu_tanh_grad_with(x, tanh_of_exp(slope)))
        },
    )
}

/// `gelu_erf_and_grad` of each entry of x (at most `STRIP`): the value into `v`, the derivative over
/// x (`two_loops`).
#[multiversion::multiversion(targets = "simd")]
pub(crate) fn gelu_erf_strip(x: &mut [f32], v: &mut [f32]) {
    two_loops(
        (x, v),
        |x| (erf_exp(x * INV_SQRT_2), exp(-0.5 * x * x)),
        gelu_erf_and_grad_with,
    )
}

/// A strip's value (into v) and derivative (over x) in two loops: first `exps(x)`, each entry's two
/// exponentials (the first into v), then `rest(x, first, second)`. Each entry is a long chain of
/// dependent operations, and one loop that computed everything entry by entry kept only a few chains in
/// flight (the core's window held about one pass of its body); two short loops over the strip keep many.
#[inline(always)]
fn two_loops(
    (x, v): (&mut [f32], &mut [f32]),
    exps: impl Fn(f32) -> (f32, f32),
    rest: impl Fn(f32, f32, f32) -> (f32, f32),
) {
    let mut second = [0.0f32; STRIP];
    let second = &mut second[..x.len()];
    for ((a, b), &x) in v.iter_mut().zip(second.iter_mut()).zip(&*x) {
        (*a, *b) = exps(x);
    }
    for ((x, v), &b) in x.iter_mut().zip(v).zip(&*second) {
        (*v, *x) = rest(*x, *v, b);
    }
}

/// Rows per parallel task of the row-wise ops (a fixed split, so sums do not depend on the thread count).
pub(crate) fn rows_per_task(rows: usize, width: usize) -> usize {
    (CHUNK / width.max(1)).clamp(1, rows.max(1))
}

/// Rows whose serial sums run interleaved (`row_sums`).
pub(crate) const ROWS: usize = 8;

/// The sums over i in 0..c of `f(r, i)` for rows r in 0..R, each one serial in i from `init` (-0.0 is
/// `Iterator::sum`'s): the rows' chains interleave, so R additions are in flight at once instead of one
/// (a serial sum waits on each addition's latency), and every row's sum is bit for bit its own serial sum.
#[inline(always)]
pub(crate) fn row_sums<const R: usize>(
    c: usize,
    init: f32,
    f: impl Fn(usize, usize) -> f32,
) -> [f32; R] {
    let mut s = [init; R];
    add_row_sums(&mut s, c, f);
    s
}

/// `row_sums` of the first k <= ROWS rows: interleaved when k is ROWS, else one row at a time (the same
/// sums either way); the other entries are `init`.
#[inline(always)]
pub(crate) fn row_sums_of(
    k: usize,
    c: usize,
    init: f32,
    f: impl Fn(usize, usize) -> f32,
) -> [f32; ROWS] {
    if k == ROWS {
        return row_sums::<ROWS>(c, init, f);
    }
    let mut s = [init; ROWS];
    for (r, s) in s[..k].iter_mut().enumerate() {
        *s = row_sums::<1>(c, init, |_, i| f(r, i))[0];
    }
    s
}

/// `row_sums` continuing the rows' running sums `s`.
#[inline(always)]
pub(crate) fn add_row_sums<const R: usize>(
    s: &mut [f32; R],
    c: usize,
    f: impl Fn(usize, usize) -> f32,
) {
    for i in 0..c {
        for (r, s) in s.iter_mut().enumerate() {
            *s += f(r, i);
        }
    }
}

/// Mean and 1 / std of each of the R rows of `x` (rows of `c`), each one's serial sums as `row_sums`.
#[inline(always)]
pub(crate) fn rows_stats<const R: usize>(x: &[f32], c: usize, eps: f32) -> [(f32, f32); R] {
    let n = c as f32;
    let mean = row_sums::<R>(c, -0.0, |r, i| x[r * c + i]).map(|s| s / n);
    let var = row_sums::<R>(c, -0.0, |r, i| {
        let d = x[r * c + i] - mean[r];
        d * d
    });
    std::array::from_fn(|r| (mean[r], 1.0 / (var[r] / n + eps).sqrt()))
}

/// The largest value of a row (NEG_INFINITY when empty), 16 lanes at a time: the maximum does not depend
/// on the order it is taken in, so this is the serial fold's value, and it vectorizes.
#[inline(always)]
pub(crate) fn row_max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut rows = row.chunks_exact(16);
    for r in &mut rows {
        lanes.iter_mut().zip(r).for_each(|(m, &v)| *m = m.max(v));
    }
    let tail = rows
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    lanes.iter().fold(tail, |m, &v| m.max(v))
}

/// log-sum-exp of each of the R rows of `z` (rows of `v`): the sums of exponentials serial per row, as
/// `Iterator::sum` adds them, with the rows' chains interleaved (`row_sums`).
#[inline(always)]
pub(crate) fn rows_lse<const R: usize>(z: &[f32], v: usize) -> [f32; R] {
    const COLS: usize = 256;
    let max: [f32; R] = std::array::from_fn(|r| row_max(&z[r * v..][..v]));
    // The exponentials of a block of columns row by row (that vectorizes), then their sums.
    let (mut sums, mut e) = ([-0.0f32; R], [[0.0f32; COLS]; R]);
    for c0 in (0..v).step_by(COLS) {
        let w = COLS.min(v - c0);
        for (r, e) in e.iter_mut().enumerate() {
            let z = &z[r * v + c0..][..w];
            e[..w]
                .iter_mut()
                .zip(z)
                .for_each(|(e, &x)| *e = exp(x - max[r]));
        }
        add_row_sums(&mut sums, w, |r, i| e[r][i]);
    }
    std::array::from_fn(|r| max[r] + sums[r].ln())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_erf_tanh_match_libm() {
        for x in (-8000..8000).map(|i| i as f32 / 100.0) {
            let (a, b) = (exp(x), x.exp());
            assert!((a - b).abs() <= 3e-7 * b, "exp({x}): {a} vs {b}");
            assert!((tanh(x) - x.tanh()).abs() <= 2e-7, "tanh({x})");
            let e = erf(x) as f64 - libm_erf(x as f64);
            assert!(e.abs() <= 3e-7, "erf({x}): off by {e}");
        }
        assert_eq!(exp(-200.0), exp(-87.3));
        assert!(exp(100.0).is_finite());
    }

    /// exp with the exponent from the saturating cast `n as i32`, as it was written first: the oracle that
    /// taking it from MAGIC's bits changes no result.
    fn exp_cast(x: f32) -> f32 {
        let x = x.clamp(-87.3, 88.3);
        let n = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
        let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
        let p = 1.987_569_1e-4f32;
        let p = p * r + 1.398_199_9e-3;
        let p = p * r + 8.333_452e-3;
        let p = p * r + 4.166_579_6e-2;
        let p = p * r + 1.666_666_5e-1;
        let p = p * r + 5e-1;
        let y = p * r * r + r + 1.0;
        y * f32::from_bits(((n as i32 + 127) as u32) << 23)
    }

    /// The fused value and derivative are the separate functions' floats, bit for bit, and the
    /// derivative is the value's slope.
    #[test]
    fn gelu_erf_and_grad_is_the_value_and_the_derivative() {
        let special = [0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, f32::MAX, f32::MIN];
        let range = (-1_000_000..1_000_000).map(|i| i as f32 * 1e-5);
        for x in range.chain(special) {
            let (v, d) = gelu_erf_and_grad(x);
            assert_eq!(v.to_bits(), gelu_erf(x).to_bits(), "gelu_erf({x})");
            assert_eq!(
                d.to_bits(),
                gelu_erf_grad(x).to_bits(),
                "gelu_erf_grad({x})"
            );
        }
        for x in [-3.0f32, -1.0, -0.25, 0.5, 2.0] {
            let h = 1e-3;
            let slope = (gelu_erf(x + h) as f64 - gelu_erf(x - h) as f64) / (2.0 * h as f64);
            assert!(
                (gelu_erf_and_grad(x).1 as f64 - slope).abs() < 1e-3,
                "slope at {x}"
            );
        }
    }

    /// The strips are the value and derivative one entry at a time, bit for bit, in strips whole and
    /// short (each entry's floats do not depend on where it sits in the strip).
    #[test]
    fn gelu_strips_are_the_functions_entry_by_entry() {
        let special = [
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            30.0,
            -30.0,
            f32::MAX,
            f32::MIN,
            f32::NAN,
        ];
        let range = (-1_000_000..1_000_000).map(|i| i as f32 * 1e-5);
        let x: Vec<f32> = range.chain(special).collect();
        for (_, strip, pair) in GELU_FORMS {
            for len in [STRIP, STRIP - 1, 17, 1] {
                let (mut d, mut v) = (x.clone(), vec![0.0f32; x.len()]);
                for (d, v) in d.chunks_mut(len).zip(v.chunks_mut(len)) {
                    strip(d, v);
                }
                for ((&x, &v), &d) in x.iter().zip(&v).zip(&d) {
                    let (wv, wd) = pair(x);
                    assert_eq!(v.to_bits(), wv.to_bits(), "value at {x}, strips of {len}");
                    assert_eq!(
                        d.to_bits(),
                        wd.to_bits(),
                        "derivative at {x}, strips of {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn exp_is_bit_for_bit_the_cast_form() {
        for i in -1_000_000..1_000_000 {
            let x = i as f32 * 1e-4;
            assert_eq!(exp(x).to_bits(), exp_cast(x).to_bits(), "exp({x})");
        }
        for x in [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN,
            1e-30,
            -1e-30,
        ] {
            assert_eq!(exp(x).to_bits(), exp_cast(x).to_bits(), "exp({x})");
        }
        assert!(exp(f32::NAN).is_nan());
    }

    /// Interleaved row sums are each row's serial sum, bit for bit (a row of -0.0 included).
    #[test]
    fn interleaved_row_stats_are_the_serial_ones() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let c = 77;
        let mut x: Vec<f32> = (0..ROWS * c).map(|_| rng.random_range(-3.0..5.0)).collect();
        x[..c].iter_mut().for_each(|v| *v = -0.0);
        let got = rows_stats::<ROWS>(&x, c, 1e-5);
        for (r, row) in x.chunks(c).enumerate() {
            let n = c as f32;
            let mean = row.iter().sum::<f32>() / n;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
            let want = (mean, 1.0 / (var + 1e-5).sqrt());
            assert_eq!(
                (got[r].0.to_bits(), got[r].1.to_bits()),
                (want.0.to_bits(), want.1.to_bits()),
                "row {r}"
            );
            assert_eq!(
                rows_stats::<1>(row, c, 1e-5)[0].0.to_bits(),
                want.0.to_bits()
            );
        }
    }

    /// Interleaved log-sum-exps are each row's serial one, bit for bit.
    #[test]
    fn interleaved_lse_is_the_serial_one() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for v in [1, 15, 16, 17, 85, 1000] {
            let z: Vec<f32> = (0..ROWS * v)
                .map(|_| rng.random_range(-30.0..30.0))
                .collect();
            let got = rows_lse::<ROWS>(&z, v);
            for (r, row) in z.chunks(v).enumerate() {
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                let want = max + row.iter().map(|&x| exp(x - max)).sum::<f32>().ln();
                assert_eq!(got[r].to_bits(), want.to_bits(), "row {r} of {v}");
                assert_eq!(rows_lse::<1>(row, v)[0].to_bits(), want.to_bits());
            }
        }
    }

    /// erf in f64 from its series / continued fraction, as the reference for the f32 polynomial.
    fn libm_erf(x: f64) -> f64 {
        // erf(x) = 2/sqrt(pi) * sum_n (-1)^n x^(2n+1) / (n! (2n+1)), converging fast for |x| < 4.
        if x.abs() > 4.0 {
            return x.signum();
        }
        let (mut term, mut sum) = (x, x);
        for n in 1..200 {
            term *= -x * x / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }
}

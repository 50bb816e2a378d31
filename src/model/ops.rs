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
    let n = (x * LOG2E + MAGIC) - MAGIC;
    let r = x - n * C1 - n * C2;
    let p = 1.987_569_1e-4f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 5e-1;
    let y = p * r * r + r + 1.0;
    // y * 2^n through the exponent bits (n in [-126, 127] after the clamp).
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// tanh through the exponential: 1 - 2 / (e^{2u} + 1) (absolute error ~1e-7).
#[inline(always)]
fn tanh(u: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * u) + 1.0)
}

/// erf (Abramowitz & Stegun 7.1.26, absolute error below 1.5e-7).
#[inline(always)]
fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_8 + t * (-1.453_152_1 + t * 1.061_405_4))));
    let y = 1.0 - poly * exp(-a * a);
    y.copysign(x)
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const INV_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// GELU and its derivative.
#[inline(always)]
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + tanh(SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)))
}

#[inline(always)]
pub(crate) fn gelu_tanh_grad(x: f32) -> f32 {
    let x2 = x * x;
    let t = tanh(SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x2));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044_715 * x2)
}

#[inline(always)]
pub(crate) fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * INV_SQRT_2))
}

#[inline(always)]
pub(crate) fn gelu_erf_grad(x: f32) -> f32 {
    0.5 * (1.0 + erf(x * INV_SQRT_2)) + x * INV_SQRT_2PI * exp(-0.5 * x * x)
}

/// Rows per parallel task of the row-wise ops (a fixed split, so sums do not depend on the thread count).
pub(crate) fn rows_per_task(rows: usize, width: usize) -> usize {
    (CHUNK / width.max(1)).clamp(1, rows.max(1))
}

/// Mean and 1 / std of one row.
#[inline(always)]
pub(crate) fn row_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// log-sum-exp of a row.
#[inline(always)]
pub(crate) fn lse(row: &[f32]) -> f32 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    max + row.iter().map(|&v| exp(v - max)).sum::<f32>().ln()
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

//! Fused CPU ops with hand-written backward passes, as candle CustomOps. candle builds GELU from
//! elementwise primitives whose backward is another graph of them, and calls libm's tanhf / expm1f /
//! powf per element: on the quick-start model that was a third of the step. These kernels do one pass
//! forward and one pass backward, with branch-free polynomial exp / erf that the compiler vectorizes.
//! Each op is tested against the unfused candle reference, forward and backward.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::config::Activation;

/// Elements per parallel chunk; smaller tensors run on the calling thread.
const CHUNK: usize = 1 << 14;

/// The f32 data of a contiguous tensor.
fn data<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    let all = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&all[a..b]),
        None => candle_core::bail!("{op}: expects a contiguous f32 tensor"),
    }
}

/// out[i] = f(a[i]) (and b[i]), in parallel chunks for large tensors.
fn map1(a: &[f32], f: impl Fn(f32) -> f32 + Sync) -> Vec<f32> {
    let mut out = vec![0.0f32; a.len()];
    let run = |(o, x): (&mut [f32], &[f32])| o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x));
    if a.len() > 4 * CHUNK {
        out.par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK))
            .for_each(run);
    } else {
        run((&mut out, a));
    }
    out
}

fn map2(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) -> Vec<f32> {
    let mut out = vec![0.0f32; a.len()];
    let run = |((o, x), y): ((&mut [f32], &[f32]), &[f32])| {
        for ((o, &x), &y) in o.iter_mut().zip(x).zip(y) {
            *o = f(x, y);
        }
    };
    if a.len() > 4 * CHUNK {
        out.par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK))
            .zip(b.par_chunks(CHUNK))
            .for_each(run);
    } else {
        run(((&mut out, a), b));
    }
    out
}

/// e^x for f32, branch-free (Cephes' expf: range reduction by ln 2, degree-6 polynomial); relative error
/// within 2 ulp on [-87, 88]; saturates outside.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
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
fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + tanh(SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)))
}

#[inline(always)]
fn gelu_tanh_grad(x: f32) -> f32 {
    let x2 = x * x;
    let t = tanh(SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x2));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044_715 * x2)
}

#[inline(always)]
fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * INV_SQRT_2))
}

#[inline(always)]
fn gelu_erf_grad(x: f32) -> f32 {
    0.5 * (1.0 + erf(x * INV_SQRT_2)) + x * INV_SQRT_2PI * exp(-0.5 * x * x)
}

/// GELU, erf form (nanoGPT, `activation = "gelu"`) or tanh form (GPT-2, `"gelu_tanh"`).
#[derive(Debug, Clone, Copy)]
struct Gelu(Activation);

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "fused-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = data(s, l, self.name())?;
        let y = match self.0 {
            Activation::Gelu => map1(x, gelu_erf),
            Activation::GeluTanh => map1(x, gelu_tanh),
        };
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(
            &grad.contiguous()?,
            &GeluBackward(self.0),
        )?))
    }
}

/// d/dx of GELU times the incoming gradient.
#[derive(Debug, Clone, Copy)]
struct GeluBackward(Activation);

impl CustomOp2 for GeluBackward {
    fn name(&self) -> &'static str {
        "fused-gelu-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, g) = (data(s1, l1, self.name())?, data(s2, l2, self.name())?);
        let out = match self.0 {
            Activation::Gelu => map2(x, g, |x, g| g * gelu_erf_grad(x)),
            Activation::GeluTanh => map2(x, g, |x, g| g * gelu_tanh_grad(x)),
        };
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// GELU of `x` in one pass, with a one-pass backward.
pub fn gelu(x: &Tensor, kind: Activation) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(Gelu(kind))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn sample(n: usize, scale: f32) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        (0..n).map(|_| rng.random_range(-scale..scale)).collect()
    }

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

    #[test]
    fn fused_gelu_matches_candle_forward_and_backward() {
        for (kind, n) in [
            (Activation::Gelu, 1000),
            (Activation::GeluTanh, 1000),
            (Activation::Gelu, 300_000),
            (Activation::GeluTanh, 300_000),
        ] {
            let x = Var::from_vec(sample(n, 6.0), (n,), &Device::Cpu).unwrap();
            let w = Tensor::from_vec(sample(n, 1.0), (n,), &Device::Cpu).unwrap();
            let reference = match kind {
                Activation::Gelu => x.as_tensor().gelu_erf(),
                Activation::GeluTanh => x.as_tensor().gelu(),
            }
            .unwrap();
            let fused = gelu(x.as_tensor(), kind).unwrap();
            let close = |a: &Tensor, b: &Tensor, tol: f32, what: &str| {
                let (a, b) = (a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
                for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                    assert!(
                        (p - q).abs() <= tol * (1.0 + q.abs()),
                        "{kind:?} {what}[{i}]: {p} vs {q}"
                    );
                }
            };
            close(&fused, &reference, 1e-6, "forward");
            let g_ref = (reference * &w)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let g_fused = (fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
            close(
                g_fused.get(&x).unwrap(),
                g_ref.get(&x).unwrap(),
                2e-6,
                "backward",
            );
        }
    }
}

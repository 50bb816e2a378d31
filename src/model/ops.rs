//! Fused CPU ops with hand-written backward passes, as candle CustomOps. candle builds GELU from
//! elementwise primitives whose backward is another graph of them, and calls libm's tanhf / expm1f /
//! powf per element: on the quick-start model that was a third of the step. These kernels do one pass
//! forward and one pass backward, with branch-free polynomial exp / erf that the compiler vectorizes.
//! Each op is tested against the unfused candle reference, forward and backward.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Tensor};
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

/// Rows per parallel task of the row-wise ops (a fixed split, so sums do not depend on the thread count).
fn rows_per_task(rows: usize, width: usize) -> usize {
    (CHUNK / width.max(1)).clamp(1, rows.max(1))
}

/// LayerNorm without bias: y = (x - mean) / sqrt(var + eps) * w over the last dim (bias is added apart).
#[derive(Debug, Clone, Copy)]
struct LayerNorm {
    eps: f32,
}

/// Mean and 1 / std of one row.
#[inline(always)]
fn row_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl CustomOp2 for LayerNorm {
    fn name(&self) -> &'static str {
        "fused-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, w) = (data(s1, l1, self.name())?, data(s2, l2, self.name())?);
        let c = w.len();
        let mut y = vec![0.0f32; x.len()];
        let per = rows_per_task(x.len() / c, c);
        y.par_chunks_mut(per * c)
            .zip(x.par_chunks(per * c))
            .for_each(|(y, x)| {
                for (y, x) in y.chunks_mut(c).zip(x.chunks(c)) {
                    let (mean, rstd) = row_stats(x, self.eps);
                    for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                        *y = (x - mean) * rstd * w;
                    }
                }
            });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let out =
            x.apply_op3_no_bwd(w, &grad.contiguous()?, &LayerNormBackward { eps: self.eps })?;
        let n = x.elem_count();
        let dx = out.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = out.narrow(0, n, w.elem_count())?.reshape(w.shape())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// dx and dw of LayerNorm, concatenated: xhat = (x - mean) rstd, dw = sum_rows g xhat,
/// dx = rstd (g w - mean(g w) - xhat mean(g w xhat)).
#[derive(Debug, Clone, Copy)]
struct LayerNormBackward {
    eps: f32,
}

impl CustomOp3 for LayerNormBackward {
    fn name(&self) -> &'static str {
        "fused-layer-norm-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (x, w, g) = (
            data(s1, l1, name)?,
            data(s2, l2, name)?,
            data(s3, l3, name)?,
        );
        let c = w.len();
        let mut out = vec![0.0f32; x.len() + c];
        let (dx, dw_out) = out.split_at_mut(x.len());
        let per = rows_per_task(x.len() / c, c);
        // Per-task partial dw, summed in task order afterwards: deterministic for any thread count.
        let partial: Vec<Vec<f32>> = dx
            .par_chunks_mut(per * c)
            .zip(x.par_chunks(per * c))
            .zip(g.par_chunks(per * c))
            .map(|((dx, x), g)| {
                let mut dw = vec![0.0f32; c];
                let mut xhat = vec![0.0f32; c];
                for ((dx, x), g) in dx.chunks_mut(c).zip(x.chunks(c)).zip(g.chunks(c)) {
                    let (mean, rstd) = row_stats(x, self.eps);
                    let (mut m1, mut m2) = (0.0f32, 0.0f32);
                    for i in 0..c {
                        xhat[i] = (x[i] - mean) * rstd;
                        let gw = g[i] * w[i];
                        m1 += gw;
                        m2 += gw * xhat[i];
                        dw[i] += g[i] * xhat[i];
                    }
                    let (m1, m2) = (m1 / c as f32, m2 / c as f32);
                    for i in 0..c {
                        dx[i] = rstd * (g[i] * w[i] - m1 - xhat[i] * m2);
                    }
                }
                dw
            })
            .collect();
        for p in partial {
            dw_out.iter_mut().zip(&p).for_each(|(a, b)| *a += b);
        }
        Ok((CpuStorage::F32(out), Shape::from(x.len() + c)))
    }
}

/// LayerNorm over the last dim with gain `w` (and bias `b`, added as a broadcast).
pub fn layer_norm(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f64,
) -> candle_core::Result<Tensor> {
    let y = x
        .contiguous()?
        .apply_op2(&w.contiguous()?, LayerNorm { eps: eps as f32 })?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// softmax(scale * x + causal mask) over the last dim of (..., T, T) attention scores: row i keeps
/// columns 0..=i.
#[derive(Debug, Clone, Copy)]
struct CausalSoftmax {
    scale: f32,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "fused-causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = data(s, l, self.name())?;
        let t = l.dims()[l.dims().len() - 1];
        let mut y = vec![0.0f32; x.len()];
        let per = rows_per_task(x.len() / t, t);
        y.par_chunks_mut(per * t)
            .zip(x.par_chunks(per * t))
            .enumerate()
            .for_each(|(task, (y, x))| {
                for (r, (y, x)) in y.chunks_mut(t).zip(x.chunks(t)).enumerate() {
                    let i = (task * per + r) % t; // the query position of this row
                    let keep = &x[..=i];
                    let max = keep.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) * self.scale;
                    let mut sum = 0.0f32;
                    for (y, &x) in y[..=i].iter_mut().zip(keep) {
                        *y = exp(x * self.scale - max);
                        sum += *y;
                    }
                    let inv = 1.0 / sum;
                    y[..=i].iter_mut().for_each(|v| *v *= inv);
                }
            });
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(y.apply_op2_no_bwd(
            &grad.contiguous()?,
            &SoftmaxBackward { scale: self.scale },
        )?))
    }
}

/// dx = scale * y * (g - sum(g * y)) per row (masked entries have y = 0).
#[derive(Debug, Clone, Copy)]
struct SoftmaxBackward {
    scale: f32,
}

impl CustomOp2 for SoftmaxBackward {
    fn name(&self) -> &'static str {
        "fused-softmax-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (y, g) = (data(s1, l1, self.name())?, data(s2, l2, self.name())?);
        let t = l1.dims()[l1.dims().len() - 1];
        let mut dx = vec![0.0f32; y.len()];
        let per = rows_per_task(y.len() / t, t);
        dx.par_chunks_mut(per * t)
            .zip(y.par_chunks(per * t))
            .zip(g.par_chunks(per * t))
            .for_each(|((dx, y), g)| {
                for ((dx, y), g) in dx.chunks_mut(t).zip(y.chunks(t)).zip(g.chunks(t)) {
                    let dot: f32 = y.iter().zip(g).map(|(a, b)| a * b).sum();
                    for ((d, &y), &g) in dx.iter_mut().zip(y).zip(g) {
                        *d = self.scale * y * (g - dot);
                    }
                }
            });
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}

/// Causal softmax of attention scores (B, H, T, T) scaled by `scale`, in one pass each way.
pub fn causal_softmax(scores: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    scores.contiguous()?.apply_op1(CausalSoftmax {
        scale: scale as f32,
    })
}

/// Mean cross-entropy of logits (N, V) against u32 targets (N).
#[derive(Debug, Clone, Copy)]
struct CrossEntropy;

/// log-sum-exp of a row.
#[inline(always)]
fn lse(row: &[f32]) -> f32 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    max + row.iter().map(|&v| exp(v - max)).sum::<f32>().ln()
}

fn targets<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [u32]> {
    let all = s.as_slice::<u32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&all[a..b]),
        None => candle_core::bail!("cross-entropy: expects contiguous u32 targets"),
    }
}

/// Logits (N, V) and targets (N) of the cross-entropy ops, with V and the rows per parallel task.
fn logits_and_targets<'a>(
    s1: &'a CpuStorage,
    l1: &Layout,
    s2: &'a CpuStorage,
    l2: &Layout,
    op: &str,
) -> candle_core::Result<(&'a [f32], &'a [u32], usize, usize)> {
    let (z, y) = (data(s1, l1, op)?, targets(s2, l2)?);
    let v = l1.dims()[1];
    Ok((z, y, v, rows_per_task(y.len(), v)))
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (z, y, v, per) = logits_and_targets(s1, l1, s2, l2, self.name())?;
        // Per-task sums in f64, added in task order: deterministic for any thread count.
        let sums: Vec<f64> = z
            .par_chunks(per * v)
            .zip(y.par_chunks(per))
            .map(|(z, y)| {
                z.chunks(v)
                    .zip(y)
                    .map(|(row, &t)| (lse(row) - row[t as usize]) as f64)
                    .sum::<f64>()
            })
            .collect();
        let loss = sums.iter().sum::<f64>() / y.len() as f64;
        Ok((CpuStorage::F32(vec![loss as f32]), Shape::from(())))
    }

    fn bwd(
        &self,
        z: &Tensor,
        y: &Tensor,
        _loss: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let n = y.elem_count() as f64;
        let scale = grad.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()? as f64 / n;
        let dz = z.apply_op2_no_bwd(
            y,
            &CrossEntropyBackward {
                scale: scale as f32,
            },
        )?;
        Ok((Some(dz), None))
    }
}

/// d loss / d logits = scale * (softmax(z) - onehot(y)).
#[derive(Debug, Clone, Copy)]
struct CrossEntropyBackward {
    scale: f32,
}

impl CustomOp2 for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "fused-cross-entropy-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (z, y, v, per) = logits_and_targets(s1, l1, s2, l2, self.name())?;
        let mut dz = vec![0.0f32; z.len()];
        dz.par_chunks_mut(per * v)
            .zip(z.par_chunks(per * v))
            .zip(y.par_chunks(per))
            .for_each(|((dz, z), y)| {
                for ((d, row), &t) in dz.chunks_mut(v).zip(z.chunks(v)).zip(y) {
                    let l = lse(row);
                    for (d, &x) in d.iter_mut().zip(row) {
                        *d = self.scale * exp(x - l);
                    }
                    d[t as usize] -= self.scale;
                }
            });
        Ok((CpuStorage::F32(dz), l1.shape().clone()))
    }
}

/// Mean cross-entropy of `logits` (N, V) against `targets` (N, u32), with a fused backward.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let t = targets.to_dtype(candle_core::DType::U32)?.contiguous()?;
    let v = logits.dim(1)? as u32;
    if let Some(&bad) = t.to_vec1::<u32>()?.iter().find(|&&x| x >= v) {
        candle_core::bail!("cross-entropy: target {bad} is outside the vocabulary of {v}");
    }
    logits.contiguous()?.apply_op2(&t, CrossEntropy)
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

    /// Max |a - b| / (1 + |b|) over two tensors.
    fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
            .fold(0.0, f32::max)
    }

    fn var(shape: &[usize], scale: f32, seed: u64) -> Var {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-scale..scale)).collect();
        Var::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn fused_layer_norm_matches_the_primitive_one_forward_and_backward() {
        use candle_core::D;
        // Small, and large enough to split into several parallel tasks.
        for (rows, c) in [(7, 24), (3000, 48)] {
            let x = var(&[rows, c], 2.0, 1);
            let w = var(&[c], 1.5, 2);
            let b = var(&[c], 0.5, 3);
            let probe = var(&[rows, c], 1.0, 4);
            let reference = {
                let x = x.as_tensor();
                let mean = x.mean_keepdim(D::Minus1).unwrap();
                let xc = x.broadcast_sub(&mean).unwrap();
                let var = xc.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
                let xn = xc
                    .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
                    .unwrap();
                xn.broadcast_mul(w.as_tensor())
                    .unwrap()
                    .broadcast_add(b.as_tensor())
                    .unwrap()
            };
            let fused =
                layer_norm(x.as_tensor(), w.as_tensor(), Some(b.as_tensor()), 1e-5).unwrap();
            assert!(rel_diff(&fused, &reference) < 1e-5, "forward");
            let loss = |y: &Tensor| (y * probe.as_tensor()).unwrap().sum_all().unwrap();
            let gr = loss(&reference).backward().unwrap();
            let gf = loss(&fused).backward().unwrap();
            for (name, v) in [("x", &x), ("w", &w), ("b", &b)] {
                let d = rel_diff(gf.get(v).unwrap(), gr.get(v).unwrap());
                assert!(d < 2e-4, "d{name}: {d}");
            }
        }
    }

    #[test]
    fn fused_causal_softmax_matches_masked_softmax_forward_and_backward() {
        for (b, h, t) in [(1, 2, 5), (4, 4, 64)] {
            let scores = var(&[b, h, t, t], 4.0, 5);
            let probe = var(&[b, h, t, t], 1.0, 6);
            let scale = 0.35;
            let mask: Vec<f32> = (0..t)
                .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
                .collect();
            let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();
            let reference = candle_nn::ops::softmax(
                &(scores.as_tensor() * scale)
                    .unwrap()
                    .broadcast_add(&mask)
                    .unwrap(),
                candle_core::D::Minus1,
            )
            .unwrap();
            let fused = causal_softmax(scores.as_tensor(), scale).unwrap();
            assert!(rel_diff(&fused, &reference) < 1e-6, "forward");
            let loss = |y: &Tensor| (y * probe.as_tensor()).unwrap().sum_all().unwrap();
            let gr = loss(&reference).backward().unwrap();
            let gf = loss(&fused).backward().unwrap();
            let d = rel_diff(gf.get(&scores).unwrap(), gr.get(&scores).unwrap());
            assert!(d < 1e-5, "backward: {d}");
        }
    }

    #[test]
    fn fused_cross_entropy_matches_candle_forward_and_backward() {
        for (n, v) in [(9, 13), (2000, 300)] {
            let logits = var(&[n, v], 5.0, 7);
            let targets: Vec<u32> = (0..n).map(|i| ((i * 31 + 7) % v) as u32).collect();
            let y = Tensor::from_vec(targets, (n,), &Device::Cpu).unwrap();
            let reference = candle_nn::loss::cross_entropy(logits.as_tensor(), &y).unwrap();
            let fused = cross_entropy(logits.as_tensor(), &y).unwrap();
            let (a, b) = (
                fused.to_scalar::<f32>().unwrap(),
                reference.to_scalar::<f32>().unwrap(),
            );
            assert!(
                (a - b).abs() < 1e-5 * b.abs().max(1.0),
                "forward {a} vs {b}"
            );
            // A scaled loss checks that the incoming gradient is applied.
            let gr = (reference * 3.0).unwrap().backward().unwrap();
            let gf = (fused * 3.0).unwrap().backward().unwrap();
            let d = rel_diff(gf.get(&logits).unwrap(), gr.get(&logits).unwrap());
            assert!(d < 1e-6, "backward: {d}");
        }
        let logits = var(&[2, 3], 1.0, 8);
        let bad = Tensor::from_vec(vec![0u32, 3], (2,), &Device::Cpu).unwrap();
        let e = cross_entropy(logits.as_tensor(), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("outside the vocabulary"), "{e}");
    }
}

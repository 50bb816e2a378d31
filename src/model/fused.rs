//! The model's fused ops on candle's graph, each with its own backward: the attention's causal softmax
//! (softmax(s scale) over the keys up to each query), the cross-entropy of the logits, the layer norm, and
//! the GELU (the CPU engine's, `super::ops`, on both devices).
//! candle's composed forms (scale, add the mask, max, subtract, exp, sum, log, divide, gather, mean, square
//! root) run a dozen kernels over the (B, heads, T, T) scores, the (B T, vocab) logits and the (B T, C)
//! activations and keep each intermediate for their backward; each op here runs one kernel forward and one
//! to three backward and keeps only its inputs or output. On the CPU they
//! run the kernels' twins (`crate::kernels::model`), on a GPU the kernels of kernels/model.cu.

use anyhow::{ensure, Result};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use crate::flat::Place;
use crate::kernels::model as twin;

/// softmax(scores scale) over the last dim with the keys after each query masked (weight 0), for
/// `scores` of shape (.., T, T) in f32; differentiable. `place` holds the kernels of the scores' GPU.
pub fn causal_softmax(scores: &Tensor, scale: f32, place: &Place) -> Result<Tensor> {
    let dims = scores.dims();
    ensure!(
        dims.len() >= 2
            && dims[dims.len() - 1] == dims[dims.len() - 2]
            && scores.dtype() == DType::F32,
        "internal error: causal softmax of {:?} {:?} scores (f32 (.., T, T) expected)",
        scores.dtype(),
        dims
    );
    let op = CausalSoftmax {
        t: dims[dims.len() - 1],
        scale,
        place: place.clone(),
    };
    Ok(scores.contiguous()?.apply_op1(op)?)
}

/// Each row's cross-entropy, -log softmax(logits)_target, of the (rows, vocab) f32 `logits` with the u32
/// `targets` (rows); NaN where a target is not below vocab; differentiable in the logits.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, place: &Place) -> Result<Tensor> {
    let (rows, v) = logits.dims2()?;
    ensure!(
        logits.dtype() == DType::F32 && targets.dtype() == DType::U32 && targets.dims() == [rows],
        "internal error: cross-entropy of {:?} {:?} logits with {:?} {:?} targets ((rows, vocab) f32 and \
         (rows) u32 expected)",
        logits.dtype(),
        logits.dims(),
        targets.dtype(),
        targets.dims()
    );
    let op = CrossEntropy {
        v,
        place: place.clone(),
    };
    Ok(logits.contiguous()?.apply_op2(&targets.contiguous()?, op)?)
}

/// The layer norm of each row of `x` (.., c) with gain `w` and bias `b` (c each), all f32:
/// (x - mean) / sqrt(var + eps) w + b; differentiable in all three.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f32, place: &Place) -> Result<Tensor> {
    let c = x.dims().last().copied().unwrap_or(0);
    let f32s = [x, w, b].iter().all(|t| t.dtype() == DType::F32);
    ensure!(
        c > 0 && f32s && w.dims() == [c] && b.dims() == [c],
        "internal error: layer norm of {:?} with gain {:?} and bias {:?} (f32, (.., c), (c) and (c) expected)",
        x.dims(),
        w.dims(),
        b.dims()
    );
    let op = LayerNorm {
        c,
        eps,
        place: place.clone(),
    };
    Ok(x.contiguous()?
        .apply_op3(&w.contiguous()?, &b.contiguous()?, op)?)
}

/// GELU of each entry of the f32 `x`: the tanh form where `tanh_form` is set, else the erf form, as the
/// CPU engine computes them (`super::ops`); differentiable.
pub fn gelu(x: &Tensor, tanh_form: bool, place: &Place) -> Result<Tensor> {
    ensure!(
        x.dtype() == DType::F32,
        "internal error: GELU of {:?} values (f32 expected)",
        x.dtype()
    );
    let op = Gelu {
        tanh_form,
        place: place.clone(),
    };
    Ok(x.contiguous()?.apply_op1(op)?)
}

struct CausalSoftmax {
    t: usize,
    scale: f32,
    place: Place,
}

/// The backward of `CausalSoftmax`: (y, g) to the gradient at the scores.
struct Backward {
    t: usize,
    scale: f32,
    /// Read by the GPU path.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    place: Place,
}

/// The part of `v` a contiguous layout covers.
fn contiguous<'a, T>(v: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("internal error: the fused ops take contiguous tensors"),
    }
}

/// The f32 values of a contiguous host tensor.
fn host<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("internal error: the fused ops compute in f32");
    };
    contiguous(v, l)
}

/// The u32 values (targets) of a contiguous host tensor.
fn host_u32<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [u32]> {
    let CpuStorage::U32(v) = s else {
        candle_core::bail!("internal error: the cross-entropy's targets are u32");
    };
    contiguous(v, l)
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = host(s, l)?;
        let mut y = vec![0.0; x.len()];
        twin::causal_softmax(x, &mut y, self.t, self.scale);
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let x = device::view::<f32>(s, l)?;
        let y = device::kernels(&self.place)?
            .causal_softmax(&x, self.t, self.scale)
            .map_err(candle_core::Error::wrap)?;
        Ok((device::wrap(y, s), l.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let op = Backward {
            t: self.t,
            scale: self.scale,
            place: self.place.clone(),
        };
        Ok(Some(y.apply_op2_no_bwd(&g.contiguous()?, &op)?))
    }
}

impl CustomOp2 for Backward {
    fn name(&self) -> &'static str {
        "causal-softmax-backward"
    }

    fn cpu_fwd(
        &self,
        y: &CpuStorage,
        ly: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (y, g) = (host(y, ly)?, host(g, lg)?);
        let mut dx = vec![0.0; y.len()];
        twin::causal_softmax_backward(y, g, &mut dx, self.t, self.scale);
        Ok((CpuStorage::F32(dx), ly.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        ly: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (yv, gv) = (device::view::<f32>(y, ly)?, device::view::<f32>(g, lg)?);
        let dx = device::kernels(&self.place)?
            .causal_softmax_backward(&yv, &gv, self.t, self.scale)
            .map_err(candle_core::Error::wrap)?;
        Ok((device::wrap(dx, y), ly.shape().clone()))
    }
}

/// The cross-entropy of each row (`cross_entropy`); `v` the vocabulary.
struct CrossEntropy {
    v: usize,
    place: Place,
}

/// The backward of `CrossEntropy`: (logits, targets, g) to the gradient at the logits.
struct CrossEntropyBackward {
    v: usize,
    /// Read by the GPU path.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    place: Place,
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        y: &CpuStorage,
        ly: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = host_u32(y, ly)?;
        let mut loss = vec![0.0; y.len()];
        twin::cross_entropy(host(x, lx)?, y, &mut loss, self.v);
        Ok((CpuStorage::F32(loss), ly.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        y: &candle_core::CudaStorage,
        ly: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (xv, yv) = (device::view::<f32>(x, lx)?, device::view::<u32>(y, ly)?);
        let loss = device::kernels(&self.place)?
            .cross_entropy(&xv, &yv, self.v)
            .map_err(candle_core::Error::wrap)?;
        Ok((device::wrap(loss, x), ly.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        y: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let op = CrossEntropyBackward {
            v: self.v,
            place: self.place.clone(),
        };
        Ok((Some(x.apply_op3_no_bwd(y, &g.contiguous()?, &op)?), None))
    }
}

impl CustomOp3 for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "cross-entropy-backward"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        y: &CpuStorage,
        ly: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = host(x, lx)?;
        let mut dx = vec![0.0; x.len()];
        twin::cross_entropy_backward(x, host_u32(y, ly)?, host(g, lg)?, &mut dx, self.v);
        Ok((CpuStorage::F32(dx), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        y: &candle_core::CudaStorage,
        ly: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (xv, yv) = (device::view::<f32>(x, lx)?, device::view::<u32>(y, ly)?);
        let dx = device::kernels(&self.place)?
            .cross_entropy_backward(&xv, &yv, &device::view::<f32>(g, lg)?, self.v)
            .map_err(candle_core::Error::wrap)?;
        Ok((device::wrap(dx, x), lx.shape().clone()))
    }
}

/// The layer norm (`layer_norm`) over rows of c.
struct LayerNorm {
    c: usize,
    eps: f32,
    place: Place,
}

/// The backward of `LayerNorm`: (x, w, g) to dx, dw and db in one flat tensor, in that order.
struct LayerNormBackward {
    c: usize,
    eps: f32,
    /// Read by the GPU path.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    place: Place,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = host(x, lx)?;
        let mut y = vec![0.0; x.len()];
        twin::layer_norm(x, host(w, lw)?, host(b, lb)?, &mut y, self.c, self.eps);
        Ok((CpuStorage::F32(y), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (xv, wv, bv) = (
            device::view(x, lx)?,
            device::view(w, lw)?,
            device::view(b, lb)?,
        );
        let y = device::kernels(&self.place)?
            .layer_norm(&xv, (&wv, &bv), self.c, self.eps)
            .map_err(candle_core::Error::wrap)?;
        Ok((device::wrap(y, x), lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let op = LayerNormBackward {
            c: self.c,
            eps: self.eps,
            place: self.place.clone(),
        };
        let all = x.apply_op3_no_bwd(w, &g.contiguous()?, &op)?;
        let n = x.elem_count();
        let dx = all.narrow(0, 0, n)?.reshape(x.shape())?;
        let (dw, db) = (
            all.narrow(0, n, self.c)?,
            all.narrow(0, n + self.c, self.c)?,
        );
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

impl CustomOp3 for LayerNormBackward {
    fn name(&self) -> &'static str {
        "layer-norm-backward"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, w, g) = (host(x, lx)?, host(w, lw)?, host(g, lg)?);
        let mut dx = vec![0.0; x.len() + 2 * self.c];
        let mut stats = vec![0.0; 2 * (x.len() / self.c)];
        let (d, _) = dx.split_at_mut(x.len());
        twin::layer_norm_backward((x, w, g), d, &mut stats, self.c, self.eps);
        let (dw, db) = twin::layer_norm_columns(x, g, &stats, self.c);
        dx[x.len()..].copy_from_slice(&[dw, db].concat());
        let n = dx.len();
        Ok((CpuStorage::F32(dx), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (xv, wv, gv) = (
            device::view(x, lx)?,
            device::view(w, lw)?,
            device::view(g, lg)?,
        );
        let all = device::kernels(&self.place)?
            .layer_norm_backward((&xv, &wv, &gv), self.c, self.eps)
            .map_err(candle_core::Error::wrap)?;
        let n = all.len();
        Ok((device::wrap(all, x), Shape::from(n)))
    }
}

/// The GELU (`gelu`), and its backward (x, g) to g gelu'(x).
#[derive(Clone)]
struct Gelu {
    tanh_form: bool,
    /// Read by the GPU path.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    place: Place,
}

impl Gelu {
    /// The function and its derivative at x, as the CPU engine computes them.
    fn at(&self, x: f32) -> (f32, f32) {
        if self.tanh_form {
            (super::ops::gelu_tanh(x), super::ops::gelu_tanh_grad(x))
        } else {
            super::ops::gelu_erf_and_grad(x)
        }
    }
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        use rayon::prelude::*;
        let y = host(s, l)?.par_iter().map(|&x| self.at(x).0).collect();
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let y = device::kernels(&self.place)?
            .gelu(&device::view(s, l)?, self.tanh_form)
            .map_err(candle_core::Error::wrap)?;
        Ok((device::wrap(y, s), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&g.contiguous()?, self)?))
    }
}

impl CustomOp2 for Gelu {
    fn name(&self) -> &'static str {
        "gelu-backward"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        use rayon::prelude::*;
        let (x, g) = (host(x, lx)?, host(g, lg)?);
        let dx = x
            .par_iter()
            .zip(g)
            .map(|(&x, &g)| g * self.at(x).1)
            .collect();
        Ok((CpuStorage::F32(dx), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (xv, gv) = (device::view(x, lx)?, device::view(g, lg)?);
        let dx = device::kernels(&self.place)?
            .gelu_backward(&xv, &gv, self.tanh_form)
            .map_err(candle_core::Error::wrap)?;
        Ok((device::wrap(dx, x), lx.shape().clone()))
    }
}

#[cfg(feature = "cuda")]
mod device {
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaStorage, Layout};
    use cudarc::driver::{CudaSlice, CudaView};

    use crate::cuda::Kernels;
    use crate::flat::Place;

    /// The kernels of the GPU the op's tensors are on.
    pub fn kernels(place: &Place) -> candle_core::Result<&Kernels> {
        match place {
            Place::Cuda(k) => Ok(k),
            Place::Host => candle_core::bail!(
                "internal error: a fused op on the GPU from a model placed on the host"
            ),
        }
    }

    /// The values of a contiguous GPU tensor.
    pub fn view<'a, T: CudaDType>(
        s: &'a CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<CudaView<'a, T>> {
        match l.contiguous_offsets() {
            Some((a, b)) => Ok(s.as_cuda_slice::<T>()?.slice(a..b)),
            None => candle_core::bail!("internal error: the fused ops take contiguous tensors"),
        }
    }

    /// `buf` as a tensor's storage on the device of `like`.
    pub fn wrap(buf: CudaSlice<f32>, like: &CudaStorage) -> CudaStorage {
        CudaStorage::wrap_cuda_slice(buf, like.device.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    /// candle's composed form: scale, add the causal mask, softmax.
    fn composed(s: &Tensor, scale: f64) -> Tensor {
        let t = s.dim(D::Minus1).unwrap();
        let mask: Vec<f32> = (0..t * t)
            .map(|k| {
                if k % t > k / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), s.device()).unwrap();
        candle_nn::ops::softmax(
            &(s * scale).unwrap().broadcast_add(&mask).unwrap(),
            D::Minus1,
        )
        .unwrap()
    }

    /// The op and candle's composed softmax agree, forward and in the gradient of a weighted sum of the
    /// output (to f32 rounding: their sums add in different orders), on a non-contiguous input.
    #[test]
    fn the_op_is_candles_composed_masked_softmax_forward_and_backward() {
        let (b, h, t, scale) = (2, 3, 45, 0.125);
        let dev = Device::Cpu;
        let s = Var::from_tensor(&(Tensor::randn(0f32, 3.0, (b, h, t, t), &dev).unwrap())).unwrap();
        let w = Tensor::randn(0f32, 1.0, (b, h, t, t), &dev).unwrap();
        let st = s.as_tensor().transpose(2, 3).unwrap();
        let ours = causal_softmax(&st, scale as f32, &Place::Host).unwrap();
        let theirs = composed(&st, scale);
        let diff = |a: &Tensor, b: &Tensor| -> f32 {
            let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
            d.max(0).unwrap().to_scalar().unwrap()
        };
        assert!(
            diff(&ours, &theirs) < 1e-6,
            "forward: {}",
            diff(&ours, &theirs)
        );
        let grad = |y: &Tensor| (y * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let (go, gt) = (grad(&ours), grad(&theirs));
        let (go, gt) = (go.get(&s).unwrap(), gt.get(&s).unwrap());
        assert!(diff(go, gt) < 1e-6, "backward: {}", diff(go, gt));
        let zero = (go.abs().unwrap().sum_all().unwrap())
            .to_scalar::<f32>()
            .unwrap();
        assert!(zero > 0.1, "a gradient flows ({zero})");
    }

    /// The op's mean and candle's cross-entropy (log-softmax, gather, mean) agree in the loss and its
    /// gradient (to f32 rounding), on non-contiguous logits.
    #[test]
    fn the_op_is_candles_cross_entropy_forward_and_backward() {
        let (rows, v) = (37, 301);
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 4.0, (v, rows), &dev).unwrap()).unwrap();
        let y: Vec<u32> = (0..rows as u32).map(|r| r * 131 % v as u32).collect();
        let y = Tensor::from_vec(y, rows, &dev).unwrap();
        let xt = x.as_tensor().t().unwrap();
        let ours = cross_entropy(&xt, &y, &Place::Host)
            .unwrap()
            .mean_all()
            .unwrap();
        let theirs = candle_nn::loss::cross_entropy(&xt, &y).unwrap();
        let (a, b) = (
            ours.to_scalar::<f32>().unwrap(),
            theirs.to_scalar::<f32>().unwrap(),
        );
        assert!((a - b).abs() < 1e-5 * b.abs(), "loss: {a} vs {b}");
        let (go, gt) = (ours.backward().unwrap(), theirs.backward().unwrap());
        let (go, gt) = (go.get(&x).unwrap(), gt.get(&x).unwrap());
        let d = (go - gt).unwrap().abs().unwrap().flatten_all().unwrap();
        let d: f32 = d.max(0).unwrap().to_scalar().unwrap();
        assert!(d < 1e-7, "gradient: {d}");
        let norm: f32 = go.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        assert!(norm > 1e-3, "a gradient flows ({norm})");
    }

    /// The op and candle's composed layer norm (as the model built it before) agree, forward and in the
    /// gradients at x, w and b (to f32 rounding), on a non-contiguous input of more rows than a block of
    /// the column sums.
    #[test]
    fn the_op_is_candles_composed_layer_norm_forward_and_backward() {
        let (rows, c) = (130, 40);
        let dev = Device::Cpu;
        let randn = |shape: &[usize], s: f32| {
            Var::from_tensor(&Tensor::randn(0f32, s, shape, &dev).unwrap()).unwrap()
        };
        let (x, w, b) = (randn(&[c, rows], 2.0), randn(&[c], 1.0), randn(&[c], 1.0));
        let up = Tensor::randn(0f32, 1.0, (rows, c), &dev).unwrap();
        let xt = x.as_tensor().t().unwrap();
        let ours = layer_norm(&xt, &w, &b, 1e-5, &Place::Host).unwrap();
        let mean = xt.mean_keepdim(D::Minus1).unwrap();
        let xc = xt.broadcast_sub(&mean).unwrap();
        let var = xc.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let xn = xc
            .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
            .unwrap();
        let theirs = xn.broadcast_mul(&w).unwrap().broadcast_add(&b).unwrap();
        let diff = |a: &Tensor, b: &Tensor| -> f32 {
            let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
            d.max(0).unwrap().to_scalar().unwrap()
        };
        assert!(
            diff(&ours, &theirs) < 1e-5,
            "forward: {}",
            diff(&ours, &theirs)
        );
        let grad = |y: &Tensor| (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let (go, gt) = (grad(&ours), grad(&theirs));
        for (v, what, tol) in [(&x, "x", 1e-5), (&w, "w", 1e-4), (&b, "b", 1e-4)] {
            let (a, e) = (go.get(v).unwrap(), gt.get(v).unwrap());
            assert!(diff(a, e) < tol, "gradient at {what}: {}", diff(a, e));
            let norm: f32 = a.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
            assert!(norm > 1e-3, "a gradient flows to {what} ({norm})");
        }
    }

    /// Values over GELU's whole range: both tails (where exp saturates), the middle, and zero.
    fn gelu_inputs() -> Vec<f32> {
        let mut x: Vec<f32> = (0..4000).map(|i| (i as f32 - 2000.0) * 0.005).collect();
        x.extend([0.0, -0.0, 1e-30, -60.0, 60.0, 9.0, -9.0, 3.3e-3]);
        x
    }

    /// Both forms of the op follow candle's GELU (erf and tanh forms) forward and in the gradient, to the
    /// CPU engine's polynomial erf and exp (1e-6).
    #[test]
    fn the_gelu_op_follows_candles_gelu_forward_and_backward() {
        let dev = Device::Cpu;
        let xs = gelu_inputs();
        let x = Var::from_vec(xs.clone(), xs.len(), &dev).unwrap();
        let up = Tensor::randn(0f32, 1.0, xs.len(), &dev).unwrap();
        for tanh_form in [false, true] {
            let ours = gelu(&x, tanh_form, &Place::Host).unwrap();
            let theirs = if tanh_form {
                x.gelu().unwrap()
            } else {
                x.gelu_erf().unwrap()
            };
            let d = |a: &Tensor, b: &Tensor| -> f32 {
                (a - b)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar()
                    .unwrap()
            };
            assert!(
                d(&ours, &theirs) < 1e-6,
                "forward, tanh {tanh_form}: {}",
                d(&ours, &theirs)
            );
            let grad = |y: &Tensor| (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let (go, gt) = (grad(&ours), grad(&theirs));
            let (go, gt) = (go.get(&x).unwrap(), gt.get(&x).unwrap());
            assert!(
                d(go, gt) < 1e-5,
                "backward, tanh {tanh_form}: {}",
                d(go, gt)
            );
        }
    }

    /// The GELU kernels, run on the host with their launcher's grid, give the CPU engine's floats bit for
    /// bit (`ops`), in both forms.
    #[test]
    fn the_gelu_kernels_are_the_cpu_engines_gelu() {
        use crate::kernels::emulate::{per_element, Arg, Emulator, Source};
        let Some(e) = Emulator::get(Source::Model) else {
            return;
        };
        let x = gelu_inputs();
        let g: Vec<f32> = (0..x.len()).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for tanh_form in [false, true] {
            let op = Gelu {
                tanh_form,
                place: Place::Host,
            };
            let y: Vec<f32> = x.iter().map(|&v| op.at(v).0).collect();
            let dx: Vec<f32> = x.iter().zip(&g).map(|(&v, &g)| g * op.at(v).1).collect();
            let (n, form) = (Arg::U32(x.len() as u32), Arg::U32(tanh_form as u32));
            let mut args = [
                Arg::F32s(x.clone()),
                Arg::F32s(vec![f32::NAN; x.len()]),
                n.clone(),
                form.clone(),
            ];
            e.launch("gelu", per_element(x.len()), &mut args);
            assert_eq!(bits(args[1].f32s()), bits(&y), "forward, tanh {tanh_form}");
            let nan = Arg::F32s(vec![f32::NAN; x.len()]);
            let mut args = [Arg::F32s(x.clone()), Arg::F32s(g.clone()), nan, n, form];
            e.launch("gelu_backward", per_element(x.len()), &mut args);
            assert_eq!(
                bits(args[2].f32s()),
                bits(&dx),
                "backward, tanh {tanh_form}"
            );
        }
    }

    /// Scores that are not (.., T, T) f32, logits and targets of other shapes or types, and a gain and
    /// bias that do not fit the rows, are refused with an error, not a panic.
    #[test]
    fn other_shapes_are_refused() {
        let dev = Device::Cpu;
        for s in [
            Tensor::zeros((2, 3), DType::F32, &dev).unwrap(),
            Tensor::zeros(4, DType::F32, &dev).unwrap(),
            Tensor::zeros((3, 3), DType::BF16, &dev).unwrap(),
        ] {
            assert!(causal_softmax(&s, 1.0, &Place::Host).is_err());
        }
        let y = Tensor::zeros(2, DType::U32, &dev).unwrap();
        let logits = Tensor::zeros((2, 5), DType::F32, &dev).unwrap();
        assert!(cross_entropy(&logits, &y, &Place::Host).is_ok());
        assert!(cross_entropy(&logits, &y.to_dtype(DType::F32).unwrap(), &Place::Host).is_err());
        assert!(cross_entropy(&logits.t().unwrap(), &y, &Place::Host).is_err());
        let w = Tensor::zeros(5, DType::F32, &dev).unwrap();
        assert!(layer_norm(&logits, &w, &w, 1e-5, &Place::Host).is_ok());
        assert!(layer_norm(&logits, &w.narrow(0, 0, 4).unwrap(), &w, 1e-5, &Place::Host).is_err());
        assert!(layer_norm(&logits.t().unwrap(), &w, &w, 1e-5, &Place::Host).is_err());
    }
}

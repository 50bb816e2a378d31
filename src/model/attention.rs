//! The causal softmax of attention scores as one candle op with its own backward: softmax(s scale) over
//! the keys up to each query. candle's composed form (scale, add the mask, max, subtract, exp, sum,
//! divide) runs a dozen kernels over the (B, heads, T, T) scores a layer and keeps each intermediate for
//! its backward; this op runs one kernel forward and one backward and keeps only its output. On the CPU it
//! runs the kernels' twins (`crate::kernels::softmax`), on a GPU the kernels of kernels/attention.cu.

use anyhow::{ensure, Result};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};

use crate::flat::Place;
use crate::kernels::softmax as twin;

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

/// The f32 values of a contiguous host tensor.
fn host<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("internal error: the causal softmax computes in f32");
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("internal error: the causal softmax takes contiguous tensors"),
    }
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
        let x = device::view(s, l)?;
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
        let (yv, gv) = (device::view(y, ly)?, device::view(g, lg)?);
        let dx = device::kernels(&self.place)?
            .causal_softmax_backward(&yv, &gv, self.t, self.scale)
            .map_err(candle_core::Error::wrap)?;
        Ok((device::wrap(dx, y), ly.shape().clone()))
    }
}

#[cfg(feature = "cuda")]
mod device {
    use candle_core::{CudaStorage, Layout};
    use cudarc::driver::{CudaSlice, CudaView};

    use crate::cuda::Kernels;
    use crate::flat::Place;

    /// The kernels of the GPU the op's tensors are on.
    pub fn kernels(place: &Place) -> candle_core::Result<&Kernels> {
        match place {
            Place::Cuda(k) => Ok(k),
            Place::Host => candle_core::bail!(
                "internal error: a causal softmax on the GPU from a model placed on the host"
            ),
        }
    }

    /// The f32 values of a contiguous GPU tensor.
    pub fn view<'a>(s: &'a CudaStorage, l: &Layout) -> candle_core::Result<CudaView<'a, f32>> {
        match l.contiguous_offsets() {
            Some((a, b)) => Ok(s.as_cuda_slice::<f32>()?.slice(a..b)),
            None => {
                candle_core::bail!("internal error: the causal softmax takes contiguous tensors")
            }
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

    /// Scores that are not (.., T, T) f32 are refused with an error, not a panic.
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
    }
}

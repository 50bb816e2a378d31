//! The attention's causal softmax and its backward (`super::causal_softmax`).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

#[cfg(feature = "cuda")]
use super::device;
use super::{host, twin};
use crate::flat::Place;

pub(super) struct CausalSoftmax {
    pub(super) t: usize,
    pub(super) scale: f32,
    pub(super) place: Place,
}

/// The backward of `CausalSoftmax`: (y, g) to the gradient at the scores.
pub(super) struct SoftmaxBackward {
    pub(super) t: usize,
    pub(super) scale: f32,
    /// Read by the GPU path.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) place: Place,
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
        let op = SoftmaxBackward {
            t: self.t,
            scale: self.scale,
            place: self.place.clone(),
        };
        Ok(Some(y.apply_op2_no_bwd(&g.contiguous()?, &op)?))
    }
}

impl CustomOp2 for SoftmaxBackward {
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

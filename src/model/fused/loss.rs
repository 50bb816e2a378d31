//! The cross-entropy and its backward (`super::cross_entropy`).

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};

#[cfg(feature = "cuda")]
use super::device;
use super::{host, host_u32, twin};
use crate::flat::Place;

/// The cross-entropy of each row (`cross_entropy`); `v` the vocabulary.
pub(super) struct CrossEntropy {
    pub(super) v: usize,
    pub(super) place: Place,
}

/// The backward of `CrossEntropy`: (logits, targets, g) to the gradient at the logits.
pub(super) struct CrossEntropyBackward {
    pub(super) v: usize,
    /// Read by the GPU path.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) place: Place,
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

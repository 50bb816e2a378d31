//! The GELU and its backward (`super::gelu`).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

#[cfg(feature = "cuda")]
use super::device;
use super::host;
use crate::flat::Place;

/// The GELU (`gelu`), and its backward (x, g) to g gelu'(x).
#[derive(Clone)]
pub(super) struct Gelu {
    pub(super) tanh_form: bool,
    /// Read by the GPU path.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) place: Place,
}

impl Gelu {
    /// The function and its derivative at x, as the CPU engine computes them.
    pub(super) fn at(&self, x: f32) -> (f32, f32) {
        if self.tanh_form {
            (
                crate::model::ops::gelu_tanh(x),
                crate::model::ops::gelu_tanh_grad(x),
            )
        } else {
            crate::model::ops::gelu_erf_and_grad(x)
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

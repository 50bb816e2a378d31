//! The layer norm and its backward (`super::layer_norm`).

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

#[cfg(feature = "cuda")]
use super::device;
use super::{host, twin};
use crate::flat::Place;

/// The layer norm (`layer_norm`) over rows of c.
pub(super) struct LayerNorm {
    pub(super) c: usize,
    pub(super) eps: f32,
    pub(super) place: Place,
}

/// The backward of `LayerNorm`: (x, w, g) to dx, dw and db in one flat tensor, in that order.
pub(super) struct LayerNormBackward {
    pub(super) c: usize,
    pub(super) eps: f32,
    /// Read by the GPU path.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) place: Place,
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

//! A bias added to each row and its backward (`super::bias_add`).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

#[cfg(feature = "cuda")]
use super::device;
use super::{host, twin};
use crate::flat::Place;

/// x + b over rows of n (`super::bias_add`); its backward passes the gradient to x and sums its columns
/// for b (`ColumnSums`).
#[derive(Clone)]
pub(super) struct BiasAdd {
    pub(super) n: usize,
    /// Read by the GPU path.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) place: Place,
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "bias-add"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = host(x, lx)?;
        let mut y = vec![0.0f32; x.len()];
        twin::bias_add(x, host(b, lb)?, &mut y);
        Ok((CpuStorage::F32(y), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let y = device::kernels(&self.place)?
            .bias_add(&device::view(x, lx)?, &device::view(b, lb)?)
            .map_err(candle_core::Error::wrap)?;
        Ok((device::wrap(y, x), lx.shape().clone()))
    }

    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let db = g
            .contiguous()?
            .apply_op1_no_bwd(&ColumnSums(self.clone()))?;
        Ok((Some(g.clone()), Some(db)))
    }
}

/// Each column's sum over the rows of the gradient: the bias's gradient.
pub(super) struct ColumnSums(BiasAdd);

impl CustomOp1 for ColumnSums {
    fn name(&self) -> &'static str {
        "column-sums"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let sums = twin::column_sums(host(s, l)?, self.0.n);
        Ok((CpuStorage::F32(sums), self.0.n.into()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let sums = device::kernels(&self.0.place)?
            .column_sums(&device::view(s, l)?, self.0.n)
            .map_err(candle_core::Error::wrap)?;
        Ok((device::wrap(sums, s), self.0.n.into()))
    }
}

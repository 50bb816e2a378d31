//! The permutation between the attention's rows and heads (`super::to_heads`, `super::from_heads`), each
//! the other's backward.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

#[cfg(feature = "cuda")]
use super::device;
use super::host;
use crate::flat::Place;
use crate::kernels::model as twin;

/// Rows (B T, C) to heads (B, nh, T, hs) where `to_heads` is set, else heads to rows (C = nh hs).
#[derive(Clone)]
pub(super) struct Heads {
    pub(super) t: usize,
    pub(super) nh: usize,
    pub(super) hs: usize,
    pub(super) to_heads: bool,
    /// Read by the GPU path.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) place: Place,
}

impl Heads {
    /// The shape of the result for `len` values.
    fn shape(&self, len: usize) -> Shape {
        let c = self.nh * self.hs;
        match self.to_heads {
            true => (len / (self.t * c), self.nh, self.t, self.hs).into(),
            false => (len / c, c).into(),
        }
    }
}

impl CustomOp1 for Heads {
    fn name(&self) -> &'static str {
        match self.to_heads {
            true => "to-heads",
            false => "from-heads",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let src = host(s, l)?;
        let mut dst = vec![0.0f32; src.len()];
        twin::permute_heads(src, &mut dst, self.t, self.nh, self.hs, self.to_heads);
        Ok((CpuStorage::F32(dst), self.shape(src.len())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let src = device::view(s, l)?;
        let dst = device::kernels(&self.place)?
            .permute_heads(&src, self.t, self.nh, self.hs, self.to_heads)
            .map_err(candle_core::Error::wrap)?;
        let len = dst.len();
        Ok((device::wrap(dst, s), self.shape(len)))
    }

    /// The gradient goes back through the inverse permutation.
    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let back = Heads {
            to_heads: !self.to_heads,
            ..self.clone()
        };
        Ok(Some(g.contiguous()?.apply_op1_no_bwd(&back)?))
    }
}

//! The token embedding and its backward (`super::embedding`).

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

#[cfg(feature = "cuda")]
use super::device;
use super::host;
use crate::flat::Place;
use crate::kernels::model::{self as twin, TokenRuns};

/// The rows of a (v, c) table at a batch's tokens (`super::embedding`); its backward sums each token's
/// rows of the gradient in position order (`EmbeddingBackward`).
#[derive(Clone)]
pub(super) struct Embedding {
    pub(super) ids: Arc<Vec<u32>>,
    pub(super) runs: Arc<TokenRuns>,
    pub(super) v: usize,
    pub(super) c: usize,
    /// Read by the GPU path.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) place: Place,
}

impl CustomOp1 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let mut out = vec![0.0f32; self.ids.len() * self.c];
        twin::embedding(host(s, l)?, &self.ids, &mut out, self.c);
        Ok((CpuStorage::F32(out), (self.ids.len(), self.c).into()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = device::kernels(&self.place)?
            .embedding(&device::view(s, l)?, &self.ids, self.c)
            .map_err(candle_core::Error::wrap)?;
        Ok((device::wrap(out, s), (self.ids.len(), self.c).into()))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let back = EmbeddingBackward(self.clone());
        Ok(Some(g.contiguous()?.apply_op1_no_bwd(&back)?))
    }
}

/// The gradient at the table from the gradient at the embedding's rows: each token's row the sum of its
/// positions' rows, from +0 in position order (candle's `index_add` order on the CPU); zero elsewhere.
pub(super) struct EmbeddingBackward(Embedding);

impl CustomOp1 for EmbeddingBackward {
    fn name(&self) -> &'static str {
        "embedding-backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let e = &self.0;
        let mut dw = vec![0.0f32; e.v * e.c];
        twin::embedding_backward(host(s, l)?, &e.runs, &mut dw, e.c);
        Ok((CpuStorage::F32(dw), (e.v, e.c).into()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let e = &self.0;
        let dw = device::kernels(&e.place)?
            .embedding_backward(&device::view(s, l)?, &e.runs, e.v, e.c)
            .map_err(candle_core::Error::wrap)?;
        Ok((device::wrap(dw, s), (e.v, e.c).into()))
    }
}

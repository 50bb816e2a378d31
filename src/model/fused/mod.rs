//! The model's fused ops on candle's graph, each with its own backward: the attention's causal softmax
//! (softmax(s scale) over the keys up to each query), the cross-entropy of the logits, the layer norm, and
//! the GELU (the CPU engine's, `super::ops`, on both devices), the permutation between the attention's
//! rows and heads, the token embedding (whose backward candle runs as `index_add`: a thread a column,
//! each looping over every token of the batch), and a bias added to each row (candle's broadcast divides
//! each index by each dimension in 64 bits, and its gradient's column sums read a column a block).
//! candle's composed forms (scale, add the
//! mask, max, subtract, exp, sum, log, divide, gather, mean, square root, erf) run up to a dozen kernels
//! each over the (B, heads, T, T) scores, the (B T, vocab) logits and the activations, and keep each
//! intermediate for their backward; each op here runs one kernel forward and one to three backward and
//! keeps only its inputs or output. On the CPU they run the kernels' twins (`crate::kernels::model`; the
//! GELU's are `super::ops`), on a GPU the kernels of kernels/model.cu. One file an op, each with its
//! backward op.

use anyhow::{ensure, Result};
use candle_core::{CpuStorage, DType, Layout, Tensor};

use crate::flat::Place;
use crate::kernels::model as twin;

mod bias;
mod embedding;
mod gelu;
mod heads;
mod loss;
mod norm;
mod softmax;
#[cfg(test)]
mod tests;

use bias::BiasAdd;
use embedding::Embedding;
use gelu::Gelu;
use heads::Heads;
use loss::CrossEntropy;
use norm::LayerNorm;
use softmax::CausalSoftmax;

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

/// The heads (B, nh, T, hs) of the attention's f32 rows `x` (B T, C), C = nh hs: entry (b t, h hs + d)
/// of the rows is (b, h, t, d) of the heads, what reshape (B, T, nh, hs), transpose (1, 2) and contiguous
/// give, in one pass (candle's copy of a strided layout divides each index by every dim); differentiable.
pub fn to_heads(x: &Tensor, t: usize, nh: usize, place: &Place) -> Result<Tensor> {
    let (rows, c) = x.dims2()?;
    ensure!(
        x.dtype() == DType::F32
            && t > 0
            && nh > 0
            && c.is_multiple_of(nh)
            && rows.is_multiple_of(t),
        "internal error: {nh} heads over {t} positions of {:?} {:?} rows (f32 (B T, C) expected)",
        x.dtype(),
        x.dims()
    );
    let op = Heads {
        t,
        nh,
        hs: c / nh,
        to_heads: true,
        place: place.clone(),
    };
    Ok(x.contiguous()?.apply_op1(op)?)
}

/// The rows (B T, C) of the attention's f32 heads `y` (B, nh, T, hs): the inverse of `to_heads`;
/// differentiable.
pub fn from_heads(y: &Tensor, place: &Place) -> Result<Tensor> {
    let (_, nh, t, hs) = y.dims4()?;
    ensure!(
        y.dtype() == DType::F32 && t > 0 && nh * hs > 0,
        "internal error: rows of {:?} {:?} heads (f32 (B, nh, T, hs) expected)",
        y.dtype(),
        y.dims()
    );
    let op = Heads {
        t,
        nh,
        hs,
        to_heads: false,
        place: place.clone(),
    };
    Ok(y.contiguous()?.apply_op1(op)?)
}

/// The rows of the f32 table `w` (v, c) at the token `ids`: (ids, c); differentiable in `w`, whose
/// gradient sums each token's rows in position order (as candle's `index_add` on the CPU), a block of
/// threads a distinct token on a GPU. A token id of v or more is an error.
pub fn embedding(w: &Tensor, ids: &[u32], place: &Place) -> Result<Tensor> {
    let (v, c) = w.dims2()?;
    ensure!(
        w.dtype() == DType::F32 && c > 0,
        "internal error: an embedding table of {:?} {:?} (f32 (v, c) expected)",
        w.dtype(),
        w.dims()
    );
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= v) {
        anyhow::bail!("token id {bad} is past the embedding's {v} rows (model.vocab_size)");
    }
    let op = Embedding {
        runs: std::sync::Arc::new(twin::TokenRuns::new(ids)),
        ids: std::sync::Arc::new(ids.to_vec()),
        v,
        c,
        place: place.clone(),
    };
    Ok(w.contiguous()?.apply_op1(op)?)
}

/// x + b with the f32 bias `b` (n) added to each row of the f32 `x` (.., n); differentiable in both (the
/// gradient at b: each column's sum, in blocks of rows added in order).
pub fn bias_add(x: &Tensor, b: &Tensor, place: &Place) -> Result<Tensor> {
    let n = b.elem_count();
    ensure!(
        x.dtype() == DType::F32
            && b.dtype() == DType::F32
            && b.rank() == 1
            && x.dims().last() == Some(&n)
            && n > 0,
        "internal error: a bias of {:?} {:?} for {:?} {:?} (f32 (.., n) and (n) expected)",
        b.dtype(),
        b.dims(),
        x.dtype(),
        x.dims()
    );
    let op = BiasAdd {
        n,
        place: place.clone(),
    };
    Ok(x.contiguous()?.apply_op2(&b.contiguous()?, op)?)
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

#[cfg(feature = "cuda")]
pub(super) mod device {
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

//! Launchers of the model's kernels (kernels/model.cu): the attention's causal softmax and the
//! cross-entropy, each with its backward; their CPU twins are in `crate::kernels::softmax`.

use anyhow::{ensure, Result};
use cudarc::driver::{CudaSlice, CudaView, PushKernelArg};

use super::{grid, u32_of, Kernels};

/// The rows of `len` logits of `v` entries each, one target a row, with v as the kernels take it.
fn logit_rows(len: usize, v: usize, targets: usize) -> Result<(usize, u32)> {
    ensure!(
        v > 0 && len == targets * v,
        "internal error: {len} logits are not {targets} rows of {v}"
    );
    ensure!(
        targets <= i32::MAX as usize,
        "{targets} rows of logits: the cross-entropy kernels take at most 2^31 - 1 (one block each)"
    );
    Ok((targets, u32_of(v, "vocabulary size")?))
}

/// The rows of a (.., t, t) buffer of `len` values: one block each.
fn rows(len: usize, t: usize) -> Result<usize> {
    ensure!(
        t > 0 && len.is_multiple_of(t * t),
        "internal error: {len} values are not (.., {t}, {t}) attention scores"
    );
    let rows = len / t;
    ensure!(
        rows <= i32::MAX as usize,
        "{rows} rows of attention scores: the softmax kernels take at most 2^31 - 1 (one block each)"
    );
    Ok(rows)
}

impl Kernels {
    /// y = the causal softmax of `s` scale over each row of the contiguous (.., t, t) scores `s` (twin:
    /// `kernels::softmax::causal_softmax`), in a new buffer.
    pub fn causal_softmax(
        &self,
        s: &CudaView<f32>,
        t: usize,
        scale: f32,
    ) -> Result<CudaSlice<f32>> {
        let rows = rows(s.len(), t)?;
        let t32 = u32_of(t, "sequence length")?;
        // SAFETY: uninitialized memory for y, which the kernel writes whole: block b writes row b's t
        // entries (the kept ones and the masked zeros) of the rows = s.len() / t the grid has.
        let mut y = unsafe { self.stream.alloc::<f32>(s.len())? };
        // SAFETY: causal_softmax(s, y, t, scale) in model.cu: block b reads and writes the t entries
        // of row b of s and y, both rows x t long (checked above).
        unsafe { launch!(self, "causal_softmax", grid(rows), s, &mut y, &t32, &scale) };
        Ok(y)
    }

    /// The gradient at the scores from the softmax's output `y` and the gradient `g` at it, both
    /// contiguous (.., t, t) (twin: `kernels::softmax::causal_softmax_backward`), in a new buffer.
    pub fn causal_softmax_backward(
        &self,
        y: &CudaView<f32>,
        g: &CudaView<f32>,
        t: usize,
        scale: f32,
    ) -> Result<CudaSlice<f32>> {
        ensure!(
            y.len() == g.len(),
            "internal error: softmax backward of {} outputs and {} gradients",
            y.len(),
            g.len()
        );
        let rows = rows(y.len(), t)?;
        let t32 = u32_of(t, "sequence length")?;
        // SAFETY: uninitialized memory for dx, which the kernel writes whole (block b: row b's t entries).
        let mut dx = unsafe { self.stream.alloc::<f32>(y.len())? };
        // SAFETY: causal_softmax_backward(y, g, dx, t, scale) in model.cu: block b reads row b of y
        // and g and writes row b of dx, all rows x t long (checked above).
        unsafe {
            launch!(
                self,
                "causal_softmax_backward",
                grid(rows),
                y,
                g,
                &mut dx,
                &t32,
                &scale
            )
        };
        Ok(dx)
    }

    /// Each row's cross-entropy of the (rows, v) logits `x` with its target in `y` (twin:
    /// `kernels::softmax::cross_entropy`; NaN where a target is not below v), in a new buffer.
    pub fn cross_entropy(
        &self,
        x: &CudaView<f32>,
        y: &CudaView<u32>,
        v: usize,
    ) -> Result<CudaSlice<f32>> {
        let (rows, v32) = logit_rows(x.len(), v, y.len())?;
        // SAFETY: uninitialized memory for the losses, which the kernel writes whole (block b: loss b).
        let mut loss = unsafe { self.stream.alloc::<f32>(rows)? };
        // SAFETY: cross_entropy(x, y, loss, v) in model.cu: block b reads row b of x (rows x v, checked),
        // y[b] (rows), and x[b v + y[b]] only where y[b] < v, and writes loss[b].
        unsafe { launch!(self, "cross_entropy", grid(rows), x, y, &mut loss, &v32) };
        Ok(loss)
    }

    /// The gradient at the logits from `g`, the gradient at each row's loss (twin:
    /// `kernels::softmax::cross_entropy_backward`), in a new buffer.
    pub fn cross_entropy_backward(
        &self,
        x: &CudaView<f32>,
        y: &CudaView<u32>,
        g: &CudaView<f32>,
        v: usize,
    ) -> Result<CudaSlice<f32>> {
        let (rows, v32) = logit_rows(x.len(), v, y.len())?;
        ensure!(
            g.len() == rows,
            "internal error: {} loss gradients for {rows} rows",
            g.len()
        );
        // SAFETY: uninitialized memory for dx, which the kernel writes whole (block b: row b's v entries).
        let mut dx = unsafe { self.stream.alloc::<f32>(x.len())? };
        // SAFETY: cross_entropy_backward(x, y, g, dx, v) in model.cu: block b reads row b of x, y[b] and
        // g[b] and writes row b of dx, x and dx rows x v long, y and g rows long (checked above).
        unsafe {
            launch!(
                self,
                "cross_entropy_backward",
                grid(rows),
                x,
                y,
                g,
                &mut dx,
                &v32
            )
        };
        Ok(dx)
    }
}

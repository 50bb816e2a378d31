//! Launchers of the attention kernels (kernels/attention.cu); their CPU twins are in
//! `crate::kernels::softmax`.

use anyhow::{ensure, Result};
use cudarc::driver::{CudaSlice, CudaView, PushKernelArg};

use super::{grid, u32_of, Kernels};

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
        // SAFETY: causal_softmax(s, y, t, scale) in attention.cu: block b reads and writes the t entries
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
        // SAFETY: causal_softmax_backward(y, g, dx, t, scale) in attention.cu: block b reads row b of y
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
}

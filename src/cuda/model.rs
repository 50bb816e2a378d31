//! Launchers of the model's kernels (kernels/model.cu): the attention's causal softmax, the cross-entropy,
//! the layer norm and the GELU, each with its backward, the permutation between the attention's rows
//! and heads, the token embedding and its backward, and a bias and its backward; their CPU twins are in
//! `crate::kernels::model`
//! (the GELU's: the CPU engine's own, `crate::model::ops`).

use anyhow::{ensure, Result};
use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};

use crate::kernels::{model::LN_ROWS, BLOCK};

use super::{grid, per_element, u32_of, Kernels};

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

/// The rows of `len` values in rows of c, with per-column vectors of `columns` lengths (each c), and c as
/// the kernels take it.
fn norm_rows(len: usize, c: usize, columns: &[usize]) -> Result<(usize, u32)> {
    ensure!(
        c > 0 && len.is_multiple_of(c) && columns.iter().all(|&n| n == c),
        "internal error: layer norm of {len} values in rows of {c} with columns of {columns:?}"
    );
    let rows = len / c;
    ensure!(
        rows <= i32::MAX as usize,
        "{rows} rows: the layer norm kernels take at most 2^31 - 1 (one block each)"
    );
    Ok((rows, u32_of(c, "width")?))
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
    /// `kernels::model::causal_softmax`), in a new buffer.
    pub fn causal_softmax(
        &self,
        s: &CudaView<f32>,
        t: usize,
        scale: f32,
    ) -> Result<CudaSlice<f32>> {
        let rows = rows(s.len(), t)?;
        let t32 = u32_of(t, "sequence length")?;
        if rows == 0 {
            return Ok(self.stream.alloc_zeros::<f32>(0)?); // a grid has at least one block
        }
        // SAFETY: uninitialized memory for y, which the kernel writes whole: block b writes row b's t
        // entries (the kept ones and the masked zeros) of the rows = s.len() / t the grid has.
        let mut y = unsafe { self.stream.alloc::<f32>(s.len())? };
        // SAFETY: causal_softmax(s, y, t, scale) in model.cu: block b reads and writes the t entries
        // of row b of s and y, both rows x t long (checked above).
        unsafe { launch!(self, "causal_softmax", grid(rows), s, &mut y, &t32, &scale) };
        Ok(y)
    }

    /// The gradient at the scores from the softmax's output `y` and the gradient `g` at it, both
    /// contiguous (.., t, t) (twin: `kernels::model::causal_softmax_backward`), in a new buffer.
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
        if rows == 0 {
            return Ok(self.stream.alloc_zeros::<f32>(0)?);
        }
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
    /// `kernels::model::cross_entropy`; NaN where a target is not below v), in a new buffer.
    pub fn cross_entropy(
        &self,
        x: &CudaView<f32>,
        y: &CudaView<u32>,
        v: usize,
    ) -> Result<CudaSlice<f32>> {
        let (rows, v32) = logit_rows(x.len(), v, y.len())?;
        if rows == 0 {
            return Ok(self.stream.alloc_zeros::<f32>(0)?); // a grid has at least one block
        }
        // SAFETY: uninitialized memory for the losses, which the kernel writes whole (block b: loss b).
        let mut loss = unsafe { self.stream.alloc::<f32>(rows)? };
        // SAFETY: cross_entropy(x, y, loss, v) in model.cu: block b reads row b of x (rows x v, checked),
        // y[b] (rows), and x[b v + y[b]] only where y[b] < v, and writes loss[b].
        unsafe { launch!(self, "cross_entropy", grid(rows), x, y, &mut loss, &v32) };
        Ok(loss)
    }

    /// The gradient at the logits from `g`, the gradient at each row's loss (twin:
    /// `kernels::model::cross_entropy_backward`), in a new buffer.
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
        if rows == 0 {
            return Ok(self.stream.alloc_zeros::<f32>(0)?);
        }
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

    /// The layer norm of each row of c of `x` with gain `w` and bias `b` (twin:
    /// `kernels::model::layer_norm`), in a new buffer.
    pub fn layer_norm(
        &self,
        x: &CudaView<f32>,
        (w, b): (&CudaView<f32>, &CudaView<f32>),
        c: usize,
        eps: f32,
    ) -> Result<CudaSlice<f32>> {
        let (rows, c32) = norm_rows(x.len(), c, &[w.len(), b.len()])?;
        if rows == 0 {
            return Ok(self.stream.alloc_zeros::<f32>(0)?); // a grid has at least one block
        }
        // SAFETY: uninitialized memory for y, which the kernel writes whole (block r: row r's c entries).
        let mut y = unsafe { self.stream.alloc::<f32>(x.len())? };
        // SAFETY: layer_norm(x, w, b, y, c, eps) in model.cu: block r reads row r of x and w, b (c each,
        // checked) and writes row r of y, x and y rows x c long.
        unsafe { launch!(self, "layer_norm", grid(rows), x, w, b, &mut y, &c32, &eps) };
        Ok(y)
    }

    /// The layer norm's gradients from `g`, the gradient at its output, in one new buffer: dx (as x), then
    /// dw and db (c each) (twins: `kernels::model::layer_norm_backward`, `layer_norm_columns`).
    pub fn layer_norm_backward(
        &self,
        (x, w, g): (&CudaView<f32>, &CudaView<f32>, &CudaView<f32>),
        c: usize,
        eps: f32,
    ) -> Result<CudaSlice<f32>> {
        let (rows, c32) = norm_rows(x.len(), c, &[w.len()])?;
        ensure!(
            g.len() == x.len(),
            "internal error: {} gradients for {} values",
            g.len(),
            x.len()
        );
        if rows == 0 {
            return Ok(self.stream.alloc_zeros::<f32>(2 * c)?); // no rows: dw and db are 0
        }
        let blocks = rows.div_ceil(LN_ROWS);
        let (rows32, blocks32) = (u32_of(rows, "rows")?, u32_of(blocks, "row blocks")?);
        let columns = c.div_ceil(BLOCK);
        let over = LaunchConfig {
            grid_dim: (blocks32, u32_of(columns, "column blocks")?, 1),
            ..grid(1)
        };
        let s = &self.stream;
        // SAFETY: uninitialized memory that the kernels below write whole: dx (block r of
        // layer_norm_backward: row r) then dw and db (layer_norm_column_sums: entries j and c + j for each
        // column j), the statistics (entries 2 r and 2 r + 1 in block r), and the partial sums (block (k,
        // l) of layer_norm_columns: rows 2 k and 2 k + 1 of the columns of block l, c of them in all).
        let (mut out, mut stats, mut partial) = unsafe {
            (
                s.alloc::<f32>(x.len() + 2 * c)?,
                s.alloc::<f32>(2 * rows)?,
                s.alloc::<f32>(2 * blocks * c)?,
            )
        };
        let (mut dx, mut dwb) = out.split_at_mut(x.len());
        // SAFETY: model.cu's kernels, with the lengths checked above: layer_norm_backward(x, w, g, dx,
        // stats, c, eps) reads and writes row r of x, g, dx (rows x c) and w (c) in block r, and entries
        // 2 r, 2 r + 1 of stats (2 rows); layer_norm_columns(x, g, stats, partial, rows, c) reads rows below
        // `rows` and columns below c and writes rows 2 k, 2 k + 1 of partial (2 blocks x c);
        // layer_norm_column_sums(partial, dwb, blocks, c) reads those and writes dwb (2 c).
        unsafe {
            launch!(
                self,
                "layer_norm_backward",
                grid(rows),
                x,
                w,
                g,
                &mut dx,
                &mut stats,
                &c32,
                &eps
            );
            launch!(
                self,
                "layer_norm_columns",
                over,
                x,
                g,
                &stats,
                &mut partial,
                &rows32,
                &c32
            );
            launch!(
                self,
                "layer_norm_column_sums",
                grid(columns),
                &partial,
                &mut dwb,
                &blocks32,
                &c32
            );
        }
        Ok(out)
    }
    /// GELU of each entry of `x`, the tanh form where `tanh_form` is set, else the erf form (twins:
    /// `model::ops::gelu_erf_and_grad`, `gelu_tanh`), in a new buffer.
    pub fn gelu(&self, x: &CudaView<f32>, tanh_form: bool) -> Result<CudaSlice<f32>> {
        let (n, form) = (u32_of(x.len(), "length")?, u32::from(tanh_form));
        // SAFETY: uninitialized memory for y, which the kernel's grid-stride loop writes whole.
        let mut y = unsafe { self.stream.alloc::<f32>(x.len())? };
        // SAFETY: gelu(x, y, n, tanh_form) in model.cu: its grid-stride loop reads x and writes y below n,
        // the length of both.
        unsafe { launch!(self, "gelu", per_element(x.len()), x, &mut y, &n, &form) };
        Ok(y)
    }

    /// The gradient at the GELU's input: `g` times the derivative at `x` (twins:
    /// `model::ops::gelu_erf_and_grad`, `gelu_tanh_grad`), in a new buffer.
    pub fn gelu_backward(
        &self,
        x: &CudaView<f32>,
        g: &CudaView<f32>,
        tanh_form: bool,
    ) -> Result<CudaSlice<f32>> {
        ensure!(
            g.len() == x.len(),
            "internal error: {} gradients for {} GELU inputs",
            g.len(),
            x.len()
        );
        let (n, form) = (u32_of(x.len(), "length")?, u32::from(tanh_form));
        // SAFETY: uninitialized memory for dx, which the kernel's grid-stride loop writes whole.
        let mut dx = unsafe { self.stream.alloc::<f32>(x.len())? };
        // SAFETY: gelu_backward(x, g, dx, n, tanh_form) in model.cu: its grid-stride loop reads x and g and
        // writes dx below n, the length of all three (checked above).
        unsafe {
            launch!(
                self,
                "gelu_backward",
                per_element(x.len()),
                x,
                g,
                &mut dx,
                &n,
                &form
            )
        };
        Ok(dx)
    }

    /// The attention's heads (B, nh, T, hs) from its rows (B T, C), C = nh hs, where `to_heads` is set,
    /// else the rows from the heads (twin: `kernels::model::permute_heads`), in a new buffer.
    pub fn permute_heads(
        &self,
        src: &CudaView<f32>,
        t: usize,
        nh: usize,
        hs: usize,
        to_heads: bool,
    ) -> Result<CudaSlice<f32>> {
        ensure!(
            t > 0 && nh * hs > 0 && src.len().is_multiple_of(t * nh * hs),
            "internal error: {} values are not rows of {} over {t} positions",
            src.len(),
            nh * hs
        );
        let n = u32_of(src.len(), "length")?;
        let (t32, nh32, hs32) = (
            u32_of(t, "positions")?,
            u32_of(nh, "heads")?,
            u32_of(hs, "head size")?,
        );
        let to = u32::from(to_heads);
        // SAFETY: uninitialized memory for dst, which the kernel writes whole: entry i of the rows (the
        // grid-stride loop over n) and its image j < n under the permutation, one of them each.
        let mut dst = unsafe { self.stream.alloc::<f32>(src.len())? };
        // SAFETY: permute_heads(src, dst, n, t, nh, hs, to_heads) in model.cu: it reads and writes src and
        // dst below n, the length of both, whole rows of nh hs over whole runs of t positions (checked
        // above).
        unsafe {
            launch!(
                self,
                "permute_heads",
                per_element(src.len()),
                src,
                &mut dst,
                &n,
                &t32,
                &nh32,
                &hs32,
                &to
            )
        };
        Ok(dst)
    }

    /// The rows of the table `w` (rows of c) at the token `ids`, each below w's rows (twin:
    /// `kernels::model::embedding`), in a new buffer.
    pub fn embedding(&self, w: &CudaView<f32>, ids: &[u32], c: usize) -> Result<CudaSlice<f32>> {
        let rows = w.len() / c.max(1);
        ensure!(
            c > 0 && w.len() == rows * c && ids.iter().all(|&t| (t as usize) < rows),
            "internal error: token ids past a table of {rows} rows of {c}"
        );
        let n = u32_of(ids.len() * c, "embedding length")?;
        let c32 = u32_of(c, "width")?;
        let dids = self.stream.clone_htod(ids)?;
        // SAFETY: uninitialized memory for out, which the kernel's grid-stride loop writes whole.
        let mut out = unsafe { self.stream.alloc::<f32>(ids.len() * c)? };
        // SAFETY: embedding(w, ids, out, n, c) in model.cu: entry i < n = ids.len() c of out reads id
        // i / c, below ids.len(), and row ids[i / c] of w, each below w's rows (checked above).
        unsafe {
            launch!(
                self,
                "embedding",
                per_element(ids.len() * c),
                w,
                &dids,
                &mut out,
                &n,
                &c32
            )
        };
        Ok(out)
    }

    /// The embedding's gradient at a table of `rows` rows of c from the gradient `g` at its output, the
    /// batch's tokens grouped by `runs` (twin: `kernels::model::embedding_backward`), in a new buffer.
    pub fn embedding_backward(
        &self,
        g: &CudaView<f32>,
        runs: &crate::kernels::model::TokenRuns,
        rows: usize,
        c: usize,
    ) -> Result<CudaSlice<f32>> {
        let positions = runs.order.len();
        ensure!(
            c > 0
                && g.len() == positions * c
                && runs.starts.len() == runs.tokens.len() + 1
                && runs.starts.last() == Some(&(positions as u32))
                && runs.starts.windows(2).all(|w| w[0] <= w[1])
                && runs.order.iter().all(|&p| (p as usize) < positions)
                && runs.tokens.iter().all(|&t| (t as usize) < rows),
            "internal error: token runs that do not fit {positions} positions of a table of {rows} rows"
        );
        let c32 = u32_of(c, "width")?;
        let mut dw = self.stream.alloc_zeros::<f32>(rows * c)?;
        if runs.tokens.is_empty() {
            return Ok(dw); // a grid has at least one block
        }
        let order = self.stream.clone_htod(&runs.order)?;
        let starts = self.stream.clone_htod(&runs.starts)?;
        let tokens = self.stream.clone_htod(&runs.tokens)?;
        // SAFETY: embedding_backward(g, order, starts, tokens, dw, c) in model.cu: block s reads
        // starts[s], starts[s + 1] (starts has a block count + 1 entries), positions order[k] below
        // g's rows for k inside [0, positions) (ascending starts ending at positions), and writes row
        // tokens[s] of dw, below its rows (all checked above).
        unsafe {
            launch!(
                self,
                "embedding_backward",
                grid(runs.tokens.len()),
                g,
                &order,
                &starts,
                &tokens,
                &mut dw,
                &c32
            )
        };
        Ok(dw)
    }

    /// y = x + b over rows of b's length (twin: `kernels::model::bias_add`), in a new buffer.
    pub fn bias_add(&self, x: &CudaView<f32>, b: &CudaView<f32>) -> Result<CudaSlice<f32>> {
        ensure!(
            !b.is_empty() && x.len().is_multiple_of(b.len()),
            "internal error: a bias of {} entries for {} values",
            b.len(),
            x.len()
        );
        let (len, n) = (u32_of(x.len(), "length")?, u32_of(b.len(), "width")?);
        // SAFETY: uninitialized memory for y, which the kernel's grid-stride loop writes whole.
        let mut y = unsafe { self.stream.alloc::<f32>(x.len())? };
        // SAFETY: bias_add(x, b, y, len, n) in model.cu: entry i < len of x and y, the length of both,
        // and entry i mod n of b, n long.
        unsafe {
            launch!(
                self,
                "bias_add",
                per_element(x.len()),
                x,
                b,
                &mut y,
                &len,
                &n
            )
        };
        Ok(y)
    }

    /// Each column's sum over the rows of `g` (rows of n): blocks of `LN_ROWS` rows, then the blocks in
    /// order (twin: `kernels::model::column_sums`), in a new buffer of n.
    pub fn column_sums(&self, g: &CudaView<f32>, n: usize) -> Result<CudaSlice<f32>> {
        ensure!(
            n > 0 && g.len().is_multiple_of(n),
            "internal error: column sums of {} values in rows of {n}",
            g.len()
        );
        let rows = g.len() / n;
        if rows == 0 {
            return Ok(self.stream.alloc_zeros::<f32>(n)?); // no rows: the sums are 0
        }
        let blocks = rows.div_ceil(LN_ROWS);
        let (rows32, blocks32, n32) = (
            u32_of(rows, "rows")?,
            u32_of(blocks, "row blocks")?,
            u32_of(n, "width")?,
        );
        let columns = n.div_ceil(BLOCK);
        let over = LaunchConfig {
            grid_dim: (blocks32, u32_of(columns, "column blocks")?, 1),
            ..grid(1)
        };
        // SAFETY: uninitialized memory that the kernels below write whole: partial (block (k, l) of
        // column_partials: row k of the columns of block l, n of them in all) and out (column_totals:
        // entry j for each column j).
        let (mut partial, mut out) = unsafe {
            (
                self.stream.alloc::<f32>(blocks * n)?,
                self.stream.alloc::<f32>(n)?,
            )
        };
        // SAFETY: model.cu's kernels, with the lengths checked above: column_partials(g, partial, rows, n)
        // reads rows below `rows` and columns below n of g and writes row k of partial (blocks x n);
        // column_totals(partial, out, blocks, n) reads those and writes out (n).
        unsafe {
            launch!(
                self,
                "column_partials",
                over,
                g,
                &mut partial,
                &rows32,
                &n32
            );
            launch!(
                self,
                "column_totals",
                grid(columns),
                &partial,
                &mut out,
                &blocks32,
                &n32
            );
        }
        Ok(out)
    }
}

//! Launchers of the optimizer kernels (kernels/optim.cu); their CPU twins are in `crate::kernels::optim`,
//! which also computes each step's coefficients for both.

use anyhow::{ensure, Result};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use super::{grid, u32_of, Kernels};
use crate::kernels::optim::{self as twin, AccumStep, AdamWStep, SgdStep};
use crate::kernels::Segment;

/// A flat buffer's segment table on the device (see optim.cu), with the grid that covers it.
pub struct DeviceSegments {
    table: CudaSlice<u32>,
    cfg: LaunchConfig,
    /// The end of the last segment: the buffers stepped over it hold at least this many floats.
    end: usize,
}

impl DeviceSegments {
    /// Checks (on the host) that every buffer of `lens` covers the segments: the kernels index the
    /// buffers by the table's offsets alone.
    fn check(&self, lens: &[usize]) -> Result<()> {
        ensure!(
            lens.iter().all(|&l| l >= self.end),
            "internal error: optimizer buffers of {lens:?} floats for segments ending at {}",
            self.end
        );
        Ok(())
    }
}

impl Kernels {
    /// Uploads the segment table of `segments` (one block row per segment).
    pub fn segments(&self, segments: &[Segment]) -> Result<DeviceSegments> {
        ensure!(
            segments.len() <= 65_535,
            "{} parameters: the optimizer kernels take at most 65535 (one grid row each)",
            segments.len()
        );
        let (blocks, rows) = twin::segment_grid(segments);
        let mut cfg = grid(blocks);
        cfg.grid_dim.1 = rows as u32;
        let table = if segments.is_empty() {
            // One empty segment: the grid's single row does nothing.
            self.stream.clone_htod(&[0u32, 0, 0])?
        } else {
            self.stream.clone_htod(&twin::segment_table(segments)?)?
        };
        let end = segments.iter().map(|s| s.offset + s.len).max().unwrap_or(0);
        Ok(DeviceSegments { table, cfg, end })
    }

    /// AdamW over the segments (twin: `kernels::optim::adamw`).
    pub fn adamw(
        &self,
        p: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        segs: &DeviceSegments,
        c: &AdamWStep,
    ) -> Result<()> {
        segs.check(&[p.len(), g.len(), m.len(), v.len()])?;
        // SAFETY: the arguments are adamw's in optim.cu, in order; every segment of the table lies inside
        // p, g, m and v (checked above), and each grid row stays inside its segment.
        unsafe {
            launch!(
                self,
                "adamw",
                segs.cfg,
                p,
                g,
                m,
                v,
                &segs.table,
                &c.decay,
                &c.one_minus_b1,
                &c.b2,
                &c.one_minus_b2,
                &c.bc2_sqrt,
                &c.eps,
                &c.step_size,
                &c.grad_scale
            )
        };
        Ok(())
    }

    /// AccumAdamW over the segments (twin: `kernels::optim::accum_adamw`).
    #[allow(clippy::too_many_arguments)]
    pub fn accum_adamw(
        &self,
        p: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        sm: &mut CudaSlice<f32>,
        sv: &mut CudaSlice<f32>,
        acc: &mut CudaSlice<f32>,
        segs: &DeviceSegments,
        c: &AccumStep,
    ) -> Result<()> {
        let commit = u32::from(c.commit);
        segs.check(&[p.len(), g.len(), sm.len(), sv.len(), acc.len()])?;
        // SAFETY: the arguments are accum_adamw's in optim.cu, in order; every segment lies inside the
        // five buffers (checked above), and each grid row stays inside its segment.
        unsafe {
            launch!(
                self,
                "accum_adamw",
                segs.cfg,
                p,
                g,
                sm,
                sv,
                acc,
                &segs.table,
                &c.decay,
                &c.one_minus_b1,
                &c.one_minus_b2,
                &c.b1,
                &c.b2,
                &c.inv_k,
                &c.bc2_sqrt,
                &c.eps,
                &c.step_size,
                &commit,
                &c.grad_scale
            )
        };
        Ok(())
    }

    /// SGD with decoupled weight decay (twin: `kernels::optim::sgd`).
    pub fn sgd(
        &self,
        p: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        segs: &DeviceSegments,
        wd: f64,
        lr: f64,
        grad_scale: f32,
    ) -> Result<()> {
        let (decay, lr) = (twin::decay_factor(lr, wd), lr as f32);
        segs.check(&[p.len(), g.len()])?;
        // SAFETY: the arguments are sgd's in optim.cu, in order; every segment lies inside p and g
        // (checked above), and each grid row stays inside its segment.
        unsafe {
            launch!(
                self,
                "sgd",
                segs.cfg,
                p,
                g,
                &segs.table,
                &decay,
                &lr,
                &grad_scale
            )
        };
        Ok(())
    }

    /// Torch's SGD, with the momentum buffer `buf` when there is one (twin:
    /// `kernels::optim::momentum_sgd`).
    pub fn momentum_sgd(
        &self,
        p: &mut CudaViewMut<f32>,
        g: &CudaView<f32>,
        buf: Option<&mut CudaViewMut<f32>>,
        segs: &DeviceSegments,
        c: &SgdStep,
    ) -> Result<()> {
        let has_buf = u32::from(buf.is_some());
        let (first, nesterov) = (u32::from(c.first), u32::from(c.nesterov));
        // Without momentum the kernel never reads `buf`: a one-element stand-in fills the argument.
        let mut stand_in;
        let mut buf = match buf {
            Some(b) => b.slice_mut(..),
            None => {
                stand_in = self.stream.alloc_zeros::<f32>(1)?;
                stand_in.slice_mut(..)
            }
        };
        let lens = [p.len(), g.len(), buf.len()];
        segs.check(&lens[..2 + has_buf as usize])?;
        // SAFETY: the arguments are momentum_sgd's in optim.cu, in order; every segment lies inside p, g
        // and (read only when has_buf) buf (checked above), and each grid row stays inside its segment.
        unsafe {
            launch!(
                self,
                "momentum_sgd",
                segs.cfg,
                p,
                g,
                &mut buf,
                &has_buf,
                &segs.table,
                &c.wd,
                &c.momentum,
                &c.lr,
                &first,
                &nesterov,
                &c.grad_scale
            )
        };
        Ok(())
    }

    /// The f64 sum of squares of `x`: per tile on the device, the tiles added in order on the host
    /// (twin: `kernels::optim::sum_squares`).
    pub fn sum_squares(&self, x: &CudaSlice<f32>) -> Result<f64> {
        let n = u32_of(x.len(), "length")?;
        let tiles = x.len().div_ceil(twin::TILE);
        if tiles == 0 {
            return Ok(0.0);
        }
        let mut partial = self.stream.alloc_zeros::<f64>(tiles)?;
        // SAFETY: sum_squares(x, n, partial) in optim.cu: block t reads x below n (x's length) and writes
        // partial[t], one of the `tiles` = ceil(n / TILE) the grid has.
        unsafe { launch!(self, "sum_squares", grid(tiles), x, &n, &mut partial) };
        let partial = self.stream.clone_dtoh(&partial)?;
        Ok(partial.iter().fold(0.0, |a, b| a + b))
    }
}

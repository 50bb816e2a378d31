//! `nanodist calibrate`: measures this machine's engines and compute and writes a cluster profile (the
//! `local` profile), so that predictions for local and `mpirun` runs can be checked against measured
//! ones.
//!
//! - Links: all-reduce over 2 ranks at sizes 4 B .. 64 MB (ping-pong beside it, for the latency), fitted
//!   to the model's t = 2 (n - 1) alpha + 2 (n - 1) / n S / B by least squares.
//! - Compute: the peak of the GEMM the CPU engine uses (one thread, 512^3 f32) and the throughput of
//!   real training steps of the quick-start model (one thread), whose ratio is the MFU; and the sharing
//!   efficiency: a data-parallel step with two ranks per core and half the rows each, against one rank
//!   per core. Every rank
//!   measures at the same time, as in training, so the numbers are those of a busy machine.
//! - Memory: one thread copying 64 MB buffers.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::comm::Communicator;
use crate::config::ModelConfig;

/// Message sizes of the sweep, bytes: 4 B .. 64 MB in steps of x4.
fn sizes() -> Vec<usize> {
    (0..=12).map(|i| 4usize << (2 * i)).collect()
}

/// Median seconds of `f` over repeats (more for small messages).
fn time(bytes: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let reps = (20_000_000 / bytes.max(1)).clamp(3, 200);
    f()?;
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f().map(|_| s.elapsed().as_secs_f64())
        })
        .collect::<Result<_>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// (size, all-reduce seconds, ping-pong seconds) over the sweep; every rank calls it.
pub fn sweep(comm: &mut dyn Communicator) -> Result<Vec<(usize, f64, f64)>> {
    let (n, me) = (comm.world_size(), comm.rank());
    let peer = me ^ 1;
    let mut out = Vec::new();
    for bytes in sizes() {
        let words = bytes / 4;
        let mut buf = vec![1.0f32; words];
        comm.barrier()?;
        let ar = time(bytes, || comm.all_reduce_sum(&mut buf))?;
        let send = vec![1.0f32; words];
        let mut recv = vec![0.0f32; words];
        comm.barrier()?;
        let pp = time(bytes, || {
            if peer < n {
                comm.exchange(&[(peer, &send)], &mut [(peer, &mut recv)])
            } else {
                comm.exchange(&[], &mut [])
            }
        })?;
        out.push((bytes, ar, pp));
    }
    Ok(out)
}

/// Least-squares line t = a + b S.
fn fit(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (x, y) in points {
        sxy += (x - mx) * (y - my);
        sxx += (x - mx) * (x - mx);
    }
    let b = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (my - b * mx, b)
}

/// Alpha (seconds) and bandwidth (bytes/s) of an all-reduce sweep over `n` ranks: t = 2 (n - 1) alpha +
/// 2 (n - 1) / n S / B. The latency comes from the small messages and the bandwidth from the large ones,
/// each fitted where it dominates.
pub fn link_of(sweep: &[(usize, f64, f64)], n: usize) -> (f64, f64) {
    let k = 2.0 * (n - 1) as f64;
    let small: Vec<(f64, f64)> = sweep
        .iter()
        .filter(|p| p.0 <= 4096)
        .map(|p| (p.0 as f64, p.1))
        .collect();
    let large: Vec<(f64, f64)> = sweep
        .iter()
        .filter(|p| p.0 >= 1 << 20)
        .map(|p| (p.0 as f64, p.1))
        .collect();
    let alpha = (fit(&small).0 / k).max(1e-9);
    let slope = fit(&large).1.max(1e-15);
    let bandwidth = k / n as f64 / slope;
    (alpha, bandwidth)
}

/// Single-thread GEMM peak of the CPU engine's GEMM, FLOP/s.
pub fn gemm_peak() -> f64 {
    let n = 512;
    let (a, b) = (vec![0.5f32; n * n], vec![0.25f32; n * n]);
    let mut c = vec![0.0f32; n * n];
    let mut best = f64::MAX;
    for _ in 0..8 {
        let s = Instant::now();
        // SAFETY: a, b and c hold n x n row-major f32 each; c aliases neither input.
        unsafe {
            gemm::gemm(
                n,
                n,
                n,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr(),
                1,
                n as isize,
                b.as_ptr(),
                1,
                n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        best = best.min(s.elapsed().as_secs_f64());
    }
    std::hint::black_box(&c);
    2.0 * (n * n * n) as f64 / best
}

/// Single-thread copy bandwidth, bytes/s (read + write).
pub fn memory_bandwidth() -> f64 {
    let n = 16 << 20;
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let s = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        best = best.min(s.elapsed().as_secs_f64());
    }
    2.0 * 4.0 * n as f64 / best
}

/// The quick-start model's shape at width `n_embd`, with a step of `b` x 64 tokens.
struct Probe {
    cfg: ModelConfig,
    model: crate::model::gpt::Gpt,
    batch: crate::data::Batch,
    grads: Vec<f32>,
    weights: Vec<f32>,
    scratch: crate::model::Scratch,
}

impl Probe {
    fn new(n_embd: usize, b: usize) -> Result<Self> {
        let cfg = ModelConfig {
            n_layers: 4,
            n_heads: 4,
            n_embd,
            vocab_size: 128,
            bias: false,
            ..ModelConfig::default()
        };
        let t = 64;
        let model = crate::model::gpt::Gpt::new(&cfg, t, 1337, &candle_core::Device::Cpu)?;
        let x: Vec<u32> = (0..b * t).map(|i| (i * 7 % 128) as u32).collect();
        let y: Vec<u32> = x.iter().map(|v| (v + 1) % 128).collect();
        let grads = vec![0.0f32; model.params.numel];
        Ok(Self {
            cfg,
            weights: model.initial_weights(),
            model,
            batch: crate::data::Batch { b, t, x, y },
            grads,
            scratch: Default::default(),
        })
    }

    /// One forward and backward pass; its seconds.
    fn step(&mut self) -> Result<f64> {
        let s = Instant::now();
        self.model.loss_and_grads(
            &mut self.scratch,
            (&self.weights).into(),
            &self.batch,
            None,
            1.0,
            (&mut self.grads).into(),
        )?;
        Ok(s.elapsed().as_secs_f64())
    }

    fn flops(&self) -> f64 {
        self.cfg.flops_per_token(self.batch.t) as f64 * (self.batch.b * self.batch.t) as f64
    }
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// FLOP/s of a training step (forward + backward, one thread) of the quick-start model at width
/// `n_embd` over `rows` x 64 tokens: the median of 5 steps after a warm-up.
pub fn training_flops(n_embd: usize, rows: usize) -> Result<f64> {
    let mut p = Probe::new(n_embd, rows)?;
    p.step()?;
    let times = (0..5).map(|_| p.step()).collect::<Result<Vec<f64>>>()?;
    Ok(p.flops() / median(times))
}

/// Median seconds of a data-parallel step on every rank at once: the quick-start model's forward and
/// backward pass over `rows` x 64 tokens, then the gradient's all-reduce.
pub fn lockstep_step(comm: &mut dyn Communicator, rows: usize) -> Result<f64> {
    let mut p = Probe::new(128, rows)?;
    let mut step = || -> Result<f64> {
        let s = Instant::now();
        p.step()?;
        comm.all_reduce_sum(&mut p.grads)?;
        Ok(s.elapsed().as_secs_f64())
    };
    step()?;
    let times = (0..30).map(|_| step()).collect::<Result<Vec<f64>>>()?;
    Ok(median(times))
}

/// Rows per rank of the lockstep step alone (one rank per core); with two ranks per core each takes half.
pub const LOCKSTEP_ROWS: usize = 12;

/// Times the lockstep step is measured, alone and with two ranks per core, for the sharing efficiency
/// (the median of each).
pub const SHARING_REPEATS: usize = 3;

/// What one calibration measured.
pub struct Measured {
    pub engine: &'static str,
    pub ranks: usize,
    pub cores: usize,
    pub alpha: f64,
    pub bandwidth: f64,
    pub ping_pong_alpha: f64,
    pub peak: f64,
    pub achieved: f64,
    pub memory: f64,
    /// Throughput kept when two ranks share each core (1: not measured).
    pub sharing: f64,
    /// (bytes, all-reduce seconds, ping-pong seconds).
    pub sweep: Vec<(usize, f64, f64)>,
}

/// (width, rows) of the training steps whose mean throughput gives the MFU: the quick-start model at 6
/// and 12 rows of 64 tokens per rank (at 3 rows a step runs at about 0.8x the FLOP/s of 6). On CPUs wider models run closer to the peak (at width 256 about 1.4x
/// the quick-start's FLOP/s), which one MFU cannot follow: the profile holds for models of the
/// quick-start's width, deeper or shallower.
const LADDER: [(usize, usize); 2] = [(128, 6), (128, 12)];

/// Measures on `comm` (every rank calls it; compute is measured on every rank at once, rank 0's kept).
/// `shared_step`: the lockstep step's seconds with two ranks per core and half the rows each (the same
/// work per core), for the sharing efficiency.
pub fn measure(
    comm: &mut dyn Communicator,
    engine: &'static str,
    shared_step: Option<f64>,
) -> Result<Measured> {
    // Compute on every rank at once (a busy machine, as in training), five times spread around the link
    // sweep; the medians, so that a passing slowdown of a shared machine does not become the profile.
    let compute = || -> Result<(f64, f64, f64)> {
        let achieved = LADDER
            .iter()
            .map(|&(w, rows)| training_flops(w, rows))
            .sum::<Result<f64>>()?
            / LADDER.len() as f64;
        Ok((gemm_peak(), achieved, memory_bandwidth()))
    };
    let mut reps = Vec::new();
    for _ in 0..3 {
        comm.barrier()?;
        reps.push(compute()?);
    }
    // The median of three, as the probe of two ranks per core (`SHARING_REPEATS`): on a shared machine one
    // measurement of each can put the sharing efficiency anywhere from 0.75 to 1.
    let alone = median(
        (0..SHARING_REPEATS)
            .map(|_| lockstep_step(comm, LOCKSTEP_ROWS))
            .collect::<Result<_>>()?,
    );
    // Two ranks per core with half the rows each ideally take as long; what they take beyond that is
    // lost to sharing.
    let sharing = shared_step.map_or(1.0, |shared| (alone / shared).min(1.0));
    let sweep = sweep(comm)?;
    for _ in 0..2 {
        comm.barrier()?;
        reps.push(compute()?);
    }
    let peak = median(reps.iter().map(|r| r.0).collect());
    let achieved = median(reps.iter().map(|r| r.1).collect());
    let memory = median(reps.iter().map(|r| r.2).collect());
    let (alpha, bandwidth) = link_of(&sweep, comm.world_size());
    let small: Vec<(f64, f64)> = sweep
        .iter()
        .filter(|p| p.0 <= 4096)
        .map(|p| (p.0 as f64, p.2))
        .collect();
    // The cores the ranks may use: each rank's (a launcher binds one core to each), summed; the local
    // engine's ranks share one process's.
    let own = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cores = if engine == "local" {
        own
    } else {
        let mut c = [own as f32];
        comm.all_reduce_sum(&mut c)?;
        c[0] as usize
    };
    Ok(Measured {
        engine,
        ranks: comm.world_size(),
        cores,
        alpha,
        bandwidth,
        ping_pong_alpha: fit(&small).0.max(0.0),
        peak,
        achieved,
        memory,
        sharing,
        sweep,
    })
}

impl Measured {
    /// The measurements as a cluster profile (one node of `cores` single-thread ranks; the inter-node link
    /// is the same engine, for layouts that ask for more than one node).
    pub fn profile_toml(&self) -> String {
        let mut s = String::new();
        let gbps = self.bandwidth * 8.0 / 1e9;
        let us = self.alpha * 1e6;
        let _ = writeln!(s, "#:schema ../../schemas/cluster.schema.json");
        let _ = writeln!(
            s,
            "# Written by `nanodist calibrate --engine {}` ({} ranks, {} cores). Measured, not datasheet values:",
            self.engine, self.ranks, self.cores
        );
        let _ = writeln!(
            s,
            "# all-reduce over {} ranks at 4 B .. 64 MB fitted to 2(n-1)(alpha + S/(nB)); ping-pong latency {:.1} us.",
            self.ranks,
            self.ping_pong_alpha * 1e6
        );
        let _ = writeln!(
            s,
            "description = \"this machine: {} cores, {} engine\"",
            self.cores, self.engine
        );
        let _ = writeln!(
            s,
            "# One single-thread rank per core; more ranks share the cores."
        );
        let _ = writeln!(s, "devices_per_node = {}", self.cores);
        let _ = writeln!(s, "nic_shared = false");
        let _ = writeln!(
            s,
            "# nanodist's engines all-reduce after the backward pass."
        );
        let _ = writeln!(s, "overlap_backward = false\n");
        let _ = writeln!(s, "[device]");
        let _ = writeln!(s, "name = \"CPU core (f32, one thread)\"");
        let _ = writeln!(
            s,
            "# Single-thread f32 GEMM (512^3) of the CPU engine's GEMM."
        );
        let _ = writeln!(s, "peak_tflops = {:.6}", self.peak / 1e12);
        let _ = writeln!(
            s,
            "# Forward + backward of the quick-start model at 6 and 12 rows: {:.2} GFLOP/s on average.",
            self.achieved / 1e9
        );
        let _ = writeln!(
            s,
            "mfu = {:.4}",
            (self.achieved / self.peak).clamp(1e-4, 1.0)
        );
        let _ = writeln!(s, "# Single-thread copy, read + write.");
        let _ = writeln!(s, "memory_gbps = {:.2}", self.memory / 1e9);
        let _ = writeln!(
            s,
            "# Two ranks per core, half the rows each: a data-parallel step took {:.2}x its time alone.",
            1.0 / self.sharing
        );
        let _ = writeln!(s, "sharing_efficiency = {:.4}\n", self.sharing);
        let _ = writeln!(s, "# The sweep: bytes, all-reduce us, ping-pong us.");
        for (bytes, ar, pp) in &self.sweep {
            let _ = writeln!(s, "#   {bytes:>9}  {:>10.1}  {:>10.1}", ar * 1e6, pp * 1e6);
        }
        for table in ["intra", "inter"] {
            let _ = writeln!(s, "[{table}]");
            let _ = writeln!(s, "bandwidth_gbps = {gbps:.3}");
            let _ = writeln!(s, "latency_us = {us:.3}");
            let _ = writeln!(s, "efficiency = 1.0\n");
        }
        s.trim_end().to_string() + "\n"
    }
}

/// Writes `text` to `path` atomically (after checking it parses as a profile).
pub fn write_profile(path: &Path, text: &str) -> Result<()> {
    super::profile::parse(&path.display().to_string(), text)
        .context("internal error: calibration wrote an invalid profile")?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    crate::data::format::write_atomic(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_alpha_and_bandwidth_of_a_model_sweep() {
        let (alpha, b, n) = (20e-6, 3e9, 2usize);
        let sweep: Vec<(usize, f64, f64)> = sizes()
            .into_iter()
            .map(|s| {
                let t = 2.0 * (n - 1) as f64 * (alpha + s as f64 / (n as f64 * b));
                (s, t, alpha + s as f64 / b)
            })
            .collect();
        let (a, bw) = link_of(&sweep, n);
        assert!(
            (a - alpha).abs() < 1e-9 && (bw / b - 1.0).abs() < 1e-6,
            "{a} {bw}"
        );
    }
}

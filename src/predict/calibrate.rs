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

use super::codec::CodecName;
use crate::comm::Communicator;
use crate::config::ModelConfig;

/// Message sizes of the sweep, bytes: 4 B .. 64 MB in steps of x4, but from 4 kB to 4 MB every power of
/// two and 15/16 of each: points just under the sizes where MPI switches protocols, for the all-reduce's
/// messages (S / n) and the swaps (S) alike. Open MPI's TCP transport sends a message of up to 64 kB at
/// once and a larger one after a handshake: on a 4-host netlab at 50 Mbit/s a ring all-reduce's 64 kB
/// messages took 16.5 ms and its 16 kB ones 2.9 ms, and a curve with nothing between priced DeMo's 55 kB
/// all-gather pieces as handshaken ones (its step 16.5% over the measured one).
fn sizes() -> Vec<usize> {
    let mid = 4 << 10..=SWEEP_MIN_TOP;
    (2..=26)
        .map(|k| 1usize << k)
        .filter(|s| mid.contains(s) || s.trailing_zeros() % 2 == 0)
        .flat_map(|s| {
            let below = mid.contains(&s).then_some(s - s / 16);
            below.into_iter().chain([s])
        })
        .collect()
}

/// The sweep always reaches this size (the bandwidth is fitted from 1 MB and up); past it, a size is
/// measured while the previous all-reduce took under `SWEEP_SECONDS` on average over the ranks (on a
/// 20 Mbit/s link a 64 MB all-reduce takes half a minute).
const SWEEP_MIN_TOP: usize = 4 << 20;
const SWEEP_SECONDS: f64 = 0.25;

/// From this size up, `time` keeps the mean of repeats that follow each other without a barrier.
const STREAM_BYTES: usize = 64 << 10;

/// Idle time before each such repeat, as a training step computes between its collectives.
const GAP: std::time::Duration = std::time::Duration::from_millis(20);

/// Such repeats, each with its `GAP`, go on for about this long (5 to 200 of them).
const STREAM_SECONDS: f32 = 1.5;

/// Seconds of one call of `f`, every rank calling it. Small messages (their latency): the median of
/// repeats, each started together after a barrier. Large ones: the mean of repeats as training steps
/// run them, each after `GAP` of idle but none after a barrier, for about `STREAM_SECONDS`.
///
/// On a shaped link the forms differ, each measured against training on the netlab: repeats from a
/// barrier start from drained queues, and priced the quick-start model's all-reduce on 4 hosts at 50
/// Mbit/s at 1.05 s a step where it took 1.33; repeats with no idle between keep the queues full, and
/// priced its 2-host all-reduce at 500 Mbit/s at 126-146 ms where it took 99 (with `GAP`: 1.35 s and
/// 102-107 ms). The mean, because a slow round (a TCP loss recovered late) costs training its full
/// time; and a window of time, because 5 repeats of 50 ms gave 103 ms in one calibration and 144 in the
/// next.
fn time(
    comm: &mut dyn Communicator,
    bytes: usize,
    mut f: impl FnMut(&mut dyn Communicator) -> Result<()>,
) -> Result<f64> {
    f(comm)?;
    if bytes >= STREAM_BYTES {
        return time_streamed(comm, f);
    }
    let reps = (2_000_000 / bytes.max(1)).clamp(5, 200);
    let mut t: Vec<f64> = Vec::with_capacity(reps);
    for _ in 0..reps {
        comm.barrier()?;
        let s = Instant::now();
        f(comm)?;
        t.push(s.elapsed().as_secs_f64());
    }
    Ok(median(t))
}

/// `time` of a large message: the mean over repeats after `GAP` each, as many as fill `STREAM_SECONDS`
/// at the ranks' mean time of a first repeat plus the gap (every rank runs the same number).
fn time_streamed(
    comm: &mut dyn Communicator,
    mut f: impl FnMut(&mut dyn Communicator) -> Result<()>,
) -> Result<f64> {
    comm.barrier()?;
    let first = Instant::now();
    f(comm)?;
    let mut mean = [first.elapsed().as_secs_f32()];
    comm.all_reduce_sum(&mut mean)?;
    let each = (mean[0] / comm.world_size() as f32).max(1e-6);
    let reps = stream_reps(each);
    let mut total = 0.0;
    for _ in 0..reps {
        std::thread::sleep(GAP);
        let s = Instant::now();
        f(comm)?;
        total += s.elapsed().as_secs_f64();
    }
    Ok(total / reps as f64)
}

/// How many repeats of `each` seconds, each after `GAP`, fill `STREAM_SECONDS` (5 to 200).
fn stream_reps(each: f32) -> usize {
    ((STREAM_SECONDS / (each + GAP.as_secs_f32())) as usize).clamp(5, 200)
}

/// The partner of rank `me` of `n` in the `rep`th exchange of the sweep: the ring gossip's two rounds in
/// turn (its partner `me ^ 1`, then its other ring neighbour), as ring and exp gossip change partners
/// from step to step; with an odd `n`, `me ^ 1` always (the last rank sits out).
///
/// Changing partners chains the pairs: a pair starts when both of its members ended their previous
/// exchanges, each with another rank, so each step waits for the slower of two exchanges before it. On a
/// 4-host netlab at 50 Mbit/s, swaps timed between fixed pairs priced gossip's steps 7-11% short.
fn sweep_peer(me: usize, n: usize, rep: usize) -> usize {
    match (n % 2, rep % 2, me % 2) {
        (0, 1, 0) => (me + n - 1) % n,
        (0, 1, _) => (me + 1) % n,
        _ => me ^ 1,
    }
}

/// (size, all-reduce seconds, ping-pong seconds) over the sweep; every rank calls it.
pub fn sweep(comm: &mut dyn Communicator) -> Result<Vec<(usize, f64, f64)>> {
    let (n, me) = (comm.world_size(), comm.rank());
    let mut out = Vec::new();
    for bytes in sizes() {
        let words = bytes / 4;
        let mut buf = vec![1.0f32; words];
        let ar = time(comm, bytes, |c| {
            // Zeros stay zeros: repeats sum no infinities.
            buf.fill(0.0);
            c.all_reduce_sum(&mut buf)
        })?;
        let send = vec![1.0f32; words];
        let mut recv = vec![0.0f32; words];
        let mut rep = 0;
        let pp = time(comm, bytes, |c| {
            let peer = sweep_peer(me, n, rep);
            rep += 1;
            match peer < n {
                true => c.exchange(&[(peer, &send)], &mut [(peer, &mut recv)]),
                false => c.exchange(&[], &mut []),
            }
        })?;
        out.push((bytes, ar, pp));
        // Every rank gets the same sum, so every rank stops at the same size.
        let mut mean = [ar as f32];
        comm.all_reduce_sum(&mut mean)?;
        if bytes >= SWEEP_MIN_TOP && f64::from(mean[0]) / n as f64 > SWEEP_SECONDS {
            break;
        }
    }
    Ok(out)
}

/// Bytes each rank first swaps with each ring neighbour in `beside_compute`, to size the exchange.
const BESIDE_BYTES: usize = 1 << 20;

/// What `beside_compute` measured: the rate, and the bytes of the exchange it timed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BesideRate {
    pub rate: f64,
    pub bytes: usize,
}

/// How much slower an exchange runs beside training steps on the same ranks, as overlapped gossip's and
/// streaming DiLoCo's collectives run beside the next step where a rank's core also moves the bytes:
/// every rank swaps a message with both ring neighbours, first idle (`time`'s streamed form, E), then as
/// training's overlapped step runs it: the exchange on this thread and, started with it, one forward
/// and backward pass of the quick-start model on a scoped thread, step after step for about
/// `STREAM_SECONDS` (the exchange's mean E', the compute's C). The rate is the model's that `predict`
/// prices with (`predict::model::Beside`): the exchange progresses at 1 / r of its idle speed while
/// the compute runs, so E' = r E if it ends first, else E + C (1 - 1 / r). The message is sized so that
/// its idle exchange takes about as long as one pass (`beside_bytes`): against a much longer exchange,
/// the compute's effect is smaller than the link's own variation, and r is noise. The mean over the
/// ranks; None with one rank. Every rank calls it.
pub fn beside_compute(comm: &mut dyn Communicator) -> Result<Option<BesideRate>> {
    let (n, me) = (comm.world_size(), comm.rank());
    if n < 2 {
        return Ok(None);
    }
    let mut peers = vec![(me + 1) % n, (me + n - 1) % n];
    peers.dedup();
    let mut probe = Probe::new(128, 6)?;
    probe.step()?;
    let pass = median((0..3).map(|_| probe.step()).collect::<Result<_>>()?);
    let mut first = Swap::new(&peers, BESIDE_BYTES);
    first.run(comm)?;
    let mut ratio = [(pass / time_streamed(comm, |c| first.run(c))?) as f32];
    comm.all_reduce_sum(&mut ratio)?;
    let bytes = beside_bytes(ratio[0] / n as f32);
    let mut swap = Swap::new(&peers, bytes);
    swap.run(comm)?;
    let idle = time_streamed(comm, |c| swap.run(c))?;
    // Every rank runs as many steps (their exchanges meet).
    let mut each = [idle as f32];
    comm.all_reduce_sum(&mut each)?;
    let reps = stream_reps(each[0] / n as f32);
    let (mut exchange, mut compute) = (0.0, 0.0);
    comm.barrier()?;
    for _ in 0..reps {
        let (e, c) = std::thread::scope(|s| {
            let job = s.spawn(|| probe.step());
            let start = Instant::now();
            let swapped = swap.run(comm);
            let e = start.elapsed().as_secs_f64();
            let c = job.join().unwrap_or_else(|_| {
                Err(anyhow::anyhow!("the compute beside the exchange panicked"))
            });
            swapped.and(c.map(|c| (e, c)))
        })?;
        (exchange, compute) = (exchange + e, compute + c);
    }
    let r = beside_rate(idle, exchange / reps as f64, compute / reps as f64);
    let mut mean = [r as f32];
    comm.all_reduce_sum(&mut mean)?;
    Ok(Some(BesideRate {
        rate: f64::from(mean[0]) / n as f64,
        bytes,
    }))
}

/// The message of `beside_compute` whose exchange takes about as long as the compute, from the
/// compute's time over that of a `BESIDE_BYTES` exchange (the ranks' mean): `BESIDE_BYTES` scaled by
/// it, as whole 4 KiB pages, 16 KiB to 4 MiB.
fn beside_bytes(compute_over_exchange: f32) -> usize {
    let scaled = BESIDE_BYTES as f32 * compute_over_exchange;
    // max and min, unlike clamp, take a NaN to the bound; 4 MiB is itself a whole number of pages.
    let bytes = scaled.max((16 << 10) as f32).min((4 << 20) as f32) as usize;
    bytes.next_multiple_of(4 << 10)
}

/// Messages to and from each ring neighbour, swapped at once (`Communicator::exchange`).
struct Swap<'a> {
    peers: &'a [usize],
    send: Vec<f32>,
    recv: Vec<Vec<f32>>,
}

impl<'a> Swap<'a> {
    fn new(peers: &'a [usize], bytes: usize) -> Self {
        let words = bytes / 4;
        Self {
            peers,
            send: vec![1.0; words],
            recv: vec![vec![0.0; words]; peers.len()],
        }
    }

    fn run(&mut self, c: &mut dyn Communicator) -> Result<()> {
        let sends: Vec<(usize, &[f32])> = self.peers.iter().map(|&p| (p, &self.send[..])).collect();
        let mut recvs: Vec<(usize, &mut [f32])> = self
            .peers
            .iter()
            .zip(self.recv.iter_mut())
            .map(|(&p, r)| (p, &mut r[..]))
            .collect();
        c.exchange(&sends, &mut recvs)
    }
}

/// The rate r of `beside_compute`'s model from an exchange of `idle` seconds alone that took `busy`
/// beside `compute` seconds of compute: busy / idle where the compute outlasted it, else from busy =
/// idle + compute (1 - 1 / r); busy / idle where that has no solution (the exchange lost more than the
/// compute's time). At least 1: an exchange beside the compute that took less than alone is the link's
/// noise (on a 4-host lab at 50 Mbit/s, 30 ms of compute beside a 330 ms exchange that ran 50 ms faster
/// gave r = 0.36, which priced overlapped steps 13-19% short).
fn beside_rate(idle: f64, busy: f64, compute: f64) -> f64 {
    let lost = busy - idle;
    let r = match compute >= busy || lost >= compute {
        true => busy / idle,
        false => compute / (compute - lost),
    };
    r.max(1.0)
}

/// Sizes of the pairwise probe across nodes, bytes.
const PAIR_SIZES: [usize; 8] = [
    1 << 10,
    4 << 10,
    16 << 10,
    60 << 10,
    64 << 10,
    240 << 10,
    256 << 10,
    1 << 20,
];

/// Rounds of disjoint pairs of `n` ranks that meet every pair once (the circle method; with an odd `n`
/// one rank sits each round out).
fn pair_rounds(n: usize) -> Vec<Vec<(usize, usize)>> {
    let m = n + n % 2;
    (0..m - 1)
        .map(|r| {
            (0..m / 2)
                .map(|i| match i {
                    0 => (r, m - 1),
                    _ => ((r + i) % (m - 1), (r + m - 1 - i) % (m - 1)),
                })
                .filter(|&(a, b)| a < n && b < n)
                .map(|(a, b)| (a.min(b), a.max(b)))
                .collect()
        })
        .collect()
}

/// Each rank's own link, as `[bytes, us]` of one message at `PAIR_SIZES` (one rank a node): every pair
/// exchanges each size both ways at once, the pairs of a round at the same time. A pair runs at its
/// slower member's link, so a rank's fastest pair gives its own link (unless it is the fastest of all).
/// Every rank calls it; all get the same result.
pub fn node_messages(comm: &mut dyn Communicator) -> Result<Vec<Vec<[f64; 2]>>> {
    let (n, me, k) = (comm.world_size(), comm.rank(), PAIR_SIZES.len());
    // seen[(a n + b) k + s]: the seconds rank a took with rank b at size s.
    let mut seen = vec![0.0f32; n * n * k];
    for round in pair_rounds(n) {
        let partner = round
            .iter()
            .find_map(|&(a, b)| (a == me).then_some(b).or((b == me).then_some(a)));
        for (s, &bytes) in PAIR_SIZES.iter().enumerate() {
            let send = vec![1.0f32; bytes / 4];
            let mut recv = vec![0.0f32; bytes / 4];
            let t = time(comm, bytes, |c| match partner {
                Some(p) => c.exchange(&[(p, &send)], &mut [(p, &mut recv)]),
                None => c.exchange(&[], &mut []),
            })?;
            if let Some(p) = partner {
                seen[(me * n + p) * k + s] = t as f32;
            }
        }
    }
    comm.all_reduce_sum(&mut seen)?;
    let pair = |a: usize, b: usize, s: usize| {
        f64::from(seen[(a * n + b) * k + s].max(seen[(b * n + a) * k + s]))
    };
    Ok((0..n)
        .map(|a| {
            PAIR_SIZES
                .iter()
                .enumerate()
                .map(|(s, &bytes)| {
                    let best = (0..n)
                        .filter(|&b| b != a)
                        .map(|b| pair(a, b, s))
                        .fold(f64::INFINITY, f64::min);
                    [bytes as f64, best * 1e6]
                })
                .collect()
        })
        .collect())
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

/// Pairs of lockstep measurements, one rank per core then two, for the sharing efficiency (the median of
/// the pairs' ratios).
pub const SHARING_REPEATS: usize = 5;

/// The throughput kept when two ranks share each core, from `SHARING_REPEATS` pairs of (seconds of the
/// lockstep step with one rank per core and `LOCKSTEP_ROWS` rows, seconds with two ranks per core and
/// half the rows each): each pair is measured back to back, so that a shared machine's drift between
/// minutes cancels in its ratio (medians of separate runs put it at 0.68 and 0.91 in two calibrations
/// minutes apart), and the median of the ratios is kept.
pub fn sharing_efficiency(mut pair: impl FnMut() -> Result<(f64, f64)>) -> Result<f64> {
    let ratios = (0..SHARING_REPEATS)
        .map(|_| pair().map(|(alone, shared)| (alone / shared).min(1.0)))
        .collect::<Result<Vec<f64>>>()?;
    Ok(median(ratios))
}

/// What one calibration measured.
pub struct Measured {
    pub engine: &'static str,
    pub ranks: usize,
    /// Ranks on each node: `ranks` when they share one machine, 1 when each is on a node of its own
    /// (the sweep then measured the link between nodes).
    pub per_node: usize,
    pub cores: usize,
    pub alpha: f64,
    pub bandwidth: f64,
    pub ping_pong_alpha: f64,
    pub peak: f64,
    pub achieved: f64,
    pub memory: f64,
    /// Throughput kept when two ranks share each core (None: not measured).
    pub sharing: Option<f64>,
    /// The rate at which an exchange runs beside training steps, and its size (`beside_compute`).
    pub beside: Option<BesideRate>,
    /// (bytes, all-reduce seconds, ping-pong seconds).
    pub sweep: Vec<(usize, f64, f64)>,
    /// With one rank on each of 3 or more nodes: each node's own link (`node_messages`); else empty.
    pub nodes: Vec<Vec<[f64; 2]>>,
    /// Each codec's GB/s on one GPT-2-small block (`codec::measure`), every rank at once, rank 0's.
    pub codecs: Vec<(CodecName, f64)>,
}

/// Timed calls of each codec (their median is its rate).
const CODEC_RUNS: usize = 3;

/// Every codec's rate on this rank, measured while every rank measures (a busy machine, as in training).
fn codecs(comm: &mut dyn Communicator) -> Result<Vec<(CodecName, f64)>> {
    let block = super::codec::gpt2_block();
    comm.barrier()?;
    CodecName::ALL
        .iter()
        .map(|&c| Ok((c, super::codec::measure(c, &block, CODEC_RUNS)?)))
        .collect()
}

/// (width, rows) of the training steps whose mean throughput gives the MFU: the quick-start model at 6
/// and 12 rows of 64 tokens per rank (at 3 rows a step runs at about 0.8x the FLOP/s of 6). On CPUs wider models run closer to the peak (at width 256 about 1.4x
/// the quick-start's FLOP/s), which one MFU cannot follow: the profile holds for models of the
/// quick-start's width, deeper or shallower.
const LADDER: [(usize, usize); 2] = [(128, 6), (128, 12)];

/// Measures on `comm` (every rank calls it; compute is measured on every rank at once, rank 0's kept),
/// whose ranks run `per_node` to a node: all on one, or one on each. `sharing`: the sharing efficiency
/// measured before (`sharing_efficiency`), which the profile records.
pub fn measure(
    comm: &mut dyn Communicator,
    engine: &'static str,
    per_node: usize,
    sharing: Option<f64>,
) -> Result<Measured> {
    let world = comm.world_size();
    if per_node != world && per_node != 1 {
        return Err(crate::bad_input!(
            "calibrate measures one link: run its ranks all on one node, or one on each node (the link \
             between nodes); the launcher placed {per_node} of {world} on a node"
        ));
    }
    // Compute on every rank at once (a busy machine, as in training), five times spread around the link
    // sweep; the medians, so that a passing slowdown of a shared machine does not become the profile.
    let mut reps = Vec::new();
    for _ in 0..3 {
        comm.barrier()?;
        reps.push(compute()?);
    }
    let sweep = sweep(comm)?;
    let beside = beside_compute(comm)?;
    let codecs = codecs(comm)?;
    let nodes = match per_node == 1 && world >= 3 {
        true => node_messages(comm)?,
        false => Vec::new(),
    };
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
    let cores = job_cores(comm, engine)?;
    Ok(Measured {
        engine,
        ranks: world,
        per_node,
        cores,
        alpha,
        bandwidth,
        ping_pong_alpha: fit(&small).0.max(0.0),
        peak,
        achieved,
        memory,
        sharing,
        beside,
        sweep,
        nodes,
        codecs,
    })
}

/// (GEMM peak, training FLOP/s, memory bytes/s) of one rank.
fn compute() -> Result<(f64, f64, f64)> {
    let achieved = LADDER
        .iter()
        .map(|&(w, rows)| training_flops(w, rows))
        .sum::<Result<f64>>()?
        / LADDER.len() as f64;
    Ok((gemm_peak(), achieved, memory_bandwidth()))
}

/// The cores the ranks may use: each rank's (a launcher binds one core to each), summed; the local
/// engine's ranks share one process's.
fn job_cores(comm: &mut dyn Communicator, engine: &str) -> Result<usize> {
    let own = std::thread::available_parallelism().map_or(1, |n| n.get());
    if engine == "local" {
        return Ok(own);
    }
    let mut c = [own as f32];
    comm.all_reduce_sum(&mut c)?;
    Ok(c[0] as usize)
}

impl Measured {
    /// The measurements as a cluster profile: one node of `cores` single-thread ranks, whose links both
    /// are the engine's; or, with one rank on each node, nodes of one rank joined by the measured link.
    pub fn profile_toml(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "#:schema ../../schemas/cluster.schema.json");
        let _ = writeln!(
            s,
            "# Written by `nanodist calibrate --engine {}` ({} ranks, {} per node, {} cores). Measured, not \
             datasheet values:",
            self.engine, self.ranks, self.per_node, self.cores
        );
        let _ = writeln!(
            s,
            "# all-reduce over {} ranks at 4 B .. {} fitted to 2(n-1)(alpha + S/(nB)); ping-pong latency {:.1} us.",
            self.ranks,
            crate::units::bytes(self.sweep.last().map_or(0.0, |p| p.0 as f64)),
            self.ping_pong_alpha * 1e6
        );
        let spread = self.per_node == 1 && self.ranks > 1;
        let (description, per_node) = match spread {
            true => (
                format!("{} nodes of one rank, {} engine", self.ranks, self.engine),
                1,
            ),
            false => (
                format!("this machine: {} cores, {} engine", self.cores, self.engine),
                self.cores,
            ),
        };
        let _ = writeln!(s, "description = \"{description}\"");
        let _ = writeln!(
            s,
            "# One single-thread rank per device (a core); more ranks share it."
        );
        let _ = writeln!(s, "devices_per_node = {per_node}");
        let _ = writeln!(s, "nic_shared = false");
        let _ = writeln!(
            s,
            "# nanodist's engines all-reduce after the backward pass."
        );
        let _ = writeln!(s, "overlap_backward = false");
        let _ = writeln!(
            s,
            "# A rank's core also moves its messages: communication beside compute is not free."
        );
        let _ = writeln!(s, "overlap_compute = false");
        if let Some(b) = self.beside {
            let _ = writeln!(
                s,
                "# A ring exchange of {} with each neighbour runs at 1 / this of its idle speed while a \
                 training step runs beside it (measured on every rank, as overlapped steps run it).",
                crate::units::bytes(b.bytes as f64)
            );
            let _ = writeln!(s, "comm_beside_compute = {:.4}", b.rate);
        }
        let _ = writeln!(s);
        self.device_toml(&mut s);
        self.links_toml(&mut s, spread);
        if spread {
            self.all_reduce_toml(&mut s);
        }
        s.trim_end().to_string() + "\n"
    }

    /// `[all_reduce]`: the sweep's all-reduce over every node, one rank on each.
    fn all_reduce_toml(&self, s: &mut String) {
        let curve: Vec<[f64; 2]> = self
            .sweep
            .iter()
            .map(|&(bytes, ar, _)| [bytes as f64, ar * 1e6])
            .collect();
        let _ = writeln!(
            s,
            "# The sweep's all-reduce over these {} nodes, [bytes, us]: an all-reduce over as many nodes, \
             one rank on each, takes these times (MPI's algorithm for each size, a slow node's pace).",
            self.ranks
        );
        let _ = writeln!(s, "[all_reduce]\nnodes = {}", self.ranks);
        let _ = writeln!(s, "measured = [{}]", points(&curve));
    }

    fn device_toml(&self, s: &mut String) {
        let _ = writeln!(s, "[device]");
        let _ = writeln!(s, "name = \"CPU core (f32, one thread)\"");
        let _ = writeln!(
            s,
            "# Single-thread f32 GEMM (512^3) of the CPU engine's GEMM, on every rank at once."
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
        if let Some(sharing) = self.sharing {
            let _ = writeln!(
                s,
                "# Two ranks per core, half the rows each: a data-parallel step took {:.2}x its time alone.",
                1.0 / sharing
            );
            let _ = writeln!(s, "sharing_efficiency = {sharing:.4}");
        }
        self.codecs_toml(s);
        let _ = writeln!(s, "\n# The sweep: bytes, all-reduce us, ping-pong us.");
        for (bytes, ar, pp) in &self.sweep {
            let _ = writeln!(s, "#   {bytes:>9}  {:>10.1}  {:>10.1}", ar * 1e6, pp * 1e6);
        }
    }

    /// `[device.codec_gbps]`: each codec's measured rate, with what was measured.
    fn codecs_toml(&self, s: &mut String) {
        if self.codecs.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\n[device.codec_gbps]\n# GB/s of f32 gradient through encode + decode, one rank, on one \
             GPT-2-small block (7.1M floats), every rank at once."
        );
        for (c, gbps) in &self.codecs {
            let _ = writeln!(s, "# {}", c.measured_as());
            let _ = writeln!(s, "{} = {gbps:.4}", c.key());
        }
    }

    /// `[intra]` and `[inter]`: both the measured link (with one rank a node, nothing ran within a node,
    /// and `[intra]` says so).
    fn links_toml(&self, s: &mut String, spread: bool) {
        let slow = self.slow_nodes();
        // With a slow node the all-reduce sweep ran at its pace: the others' link is their pairs' median.
        let (alpha_us, gbps, base) = match slow.is_empty() {
            true => (
                self.alpha * 1e6,
                self.bandwidth * 8.0 / 1e9,
                self.messages(),
            ),
            false => {
                let base = median_curve(&self.nodes);
                let (a, b) = line_of(&base);
                (a, b, base)
            }
        };
        for table in ["intra", "inter"] {
            if spread && table == "intra" {
                let _ = writeln!(
                    s,
                    "# Not measured (one rank a node): the link between nodes, for layouts of more."
                );
            }
            let _ = writeln!(s, "[{table}]");
            write_link(s, alpha_us, gbps, None);
            if spread && table == "inter" {
                let _ = writeln!(
                    s,
                    "# {}: predictions take a message's time from these.",
                    match slow.is_empty() {
                        true => "Each message of the all-reduce sweep (S / n bytes, 1 / (2 (n - 1)) of its time)",
                        false => "The median node's message, exchanged with each other node in turn",
                    }
                );
                let _ = writeln!(s, "measured = [{}]", points(&base));
                // Of two ranks, the all-reduce's messages are their swap (with its sum) already.
                if slow.is_empty() && self.ranks > 2 {
                    let _ = writeln!(
                        s,
                        "# Two ranks swapping S bytes each way, the other ranks' pairs beside them, \
                         partners changing each time as ring gossip's do (the sweep's exchange): gossip's \
                         and CHOCO's pairs take their time from these."
                    );
                    let _ = writeln!(s, "pairs = [{}]", points(&self.swaps()));
                }
            }
            let _ = writeln!(s);
        }
        for k in slow {
            let curve = &self.nodes[k];
            let (a, b) = line_of(curve);
            let _ = writeln!(
                s,
                "# Node {k}'s link is slower than the others': its fastest exchange with another node."
            );
            let _ = writeln!(s, "[[node_links]]\nnode = {k}\n[node_links.link]");
            write_link(s, a, b, Some(curve));
            let _ = writeln!(s);
        }
    }

    /// The sweep's exchanges between pairs of ranks: `[bytes, us]` of a swap of `bytes` each way.
    fn swaps(&self) -> Vec<[f64; 2]> {
        self.sweep
            .iter()
            .map(|&(bytes, _, pp)| [bytes as f64, pp * 1e6])
            .collect()
    }

    /// `[bytes, us]` of one message of the all-reduce sweep: the all-reduce of S over n ranks is 2 (n - 1)
    /// exchanges of S / n.
    fn messages(&self) -> Vec<[f64; 2]> {
        let n = self.ranks.max(2) as f64;
        self.sweep
            .iter()
            .map(|(bytes, ar, _)| [(*bytes as f64 / n).round(), ar * 1e6 / (2.0 * (n - 1.0))])
            .collect()
    }

    /// Nodes whose 1 MB message took more than `SLOW_NODE` times the median node's.
    fn slow_nodes(&self) -> Vec<usize> {
        let lasts: Vec<f64> = self
            .nodes
            .iter()
            .map(|c| c.last().map_or(0.0, |p| p[1]))
            .collect();
        if lasts.is_empty() {
            return Vec::new();
        }
        let mid = median(lasts.clone());
        (0..lasts.len())
            .filter(|&k| lasts[k] > SLOW_NODE * mid)
            .collect()
    }
}

/// A node is slow when its largest message takes this many times the median node's.
const SLOW_NODE: f64 = 1.5;

/// The pointwise median of equally sized curves.
fn median_curve(curves: &[Vec<[f64; 2]>]) -> Vec<[f64; 2]> {
    (0..curves[0].len())
        .map(|i| {
            [
                curves[0][i][0],
                median(curves.iter().map(|c| c[i][1]).collect()),
            ]
        })
        .collect()
}

/// (latency us, bandwidth Gbit/s) of a message curve: its smallest message's time, and the rate between
/// its two largest.
fn line_of(curve: &[[f64; 2]]) -> (f64, f64) {
    let [b0, t0] = curve[curve.len() - 2];
    let [b1, t1] = curve[curve.len() - 1];
    let bytes_per_s = (b1 - b0) / ((t1 - t0).max(1e-3) * 1e-6);
    (curve[0][1], bytes_per_s * 8.0 / 1e9)
}

fn points(curve: &[[f64; 2]]) -> String {
    curve
        .iter()
        .map(|[b, us]| format!("[{b}, {us:.1}]"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn write_link(s: &mut String, alpha_us: f64, gbps: f64, measured: Option<&[[f64; 2]]>) {
    let _ = writeln!(s, "bandwidth_gbps = {gbps:.4}");
    let _ = writeln!(s, "latency_us = {alpha_us:.3}");
    let _ = writeln!(s, "efficiency = 1.0");
    if let Some(m) = measured {
        let _ = writeln!(s, "measured = [{}]", points(m));
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

    /// The sweep brackets each power of two from 4 kB to 4 MB from just below, for the swaps (S) and for
    /// the all-reduce's messages (S / n) on 2 and 4 ranks: 64 kB, where Open MPI's TCP transport starts
    /// its handshake, and 60 kB under it.
    #[test]
    fn the_sweep_brackets_each_protocol_limit_from_below() {
        let s = sizes();
        assert!(s.windows(2).all(|w| w[0] < w[1]), "{s:?}");
        assert_eq!((s[0], *s.last().unwrap()), (4, 64 << 20));
        for k in 12..=22 {
            let p = 1usize << k;
            assert!(s.contains(&p) && s.contains(&(p / 16 * 15)), "{p}");
        }
        for n in [1, 2, 4] {
            let messages: Vec<usize> = s.iter().map(|b| b / n).collect();
            assert!(messages.contains(&(60 << 10)) && messages.contains(&(64 << 10)));
        }
        assert!(PAIR_SIZES.contains(&(60 << 10)) && PAIR_SIZES.contains(&(64 << 10)));
    }

    /// A streamed size's repeats, their gaps counted, take about `STREAM_SECONDS` (within one repeat)
    /// unless 5 take longer or 200 take less: a fast link's messages are not repeated for 4 s.
    #[test]
    fn streamed_repeats_fill_their_window_with_the_gaps_counted() {
        let gap = GAP.as_secs_f32();
        for each in [1e-6, 1e-4, 1e-3, 5e-3, 0.03, 0.1, 0.25, 0.3, 1.0, 30.0] {
            let reps = stream_reps(each);
            let wall = reps as f32 * (each + gap);
            assert!((5..=200).contains(&reps), "{each}: {reps}");
            let fills = wall <= STREAM_SECONDS && wall + each + gap > STREAM_SECONDS;
            assert!(
                fills || reps == 5 || reps == 200,
                "{each} s: {reps} repeats, {wall} s"
            );
        }
        assert_eq!(stream_reps(1e-6), 74);
        assert_eq!(stream_reps(1.0), 5);
    }

    fn measured(ranks: usize, per_node: usize, sweep: Vec<(usize, f64, f64)>) -> Measured {
        Measured {
            engine: "mpi",
            ranks,
            per_node,
            cores: 2,
            alpha: 20e-6,
            bandwidth: 3e6,
            ping_pong_alpha: 10e-6,
            peak: 1e11,
            achieved: 5e10,
            memory: 1e10,
            sharing: None,
            beside: None,
            sweep,
            nodes: vec![],
            codecs: vec![(CodecName::TopK, 1.5), (CodecName::Demo, 0.25)],
        }
    }

    /// Ranks one to a node: nodes of one rank whose link prices a message of the all-reduce sweep's
    /// pieces (S / n) at its share of the all-reduce's time (1 / (2 (n - 1))), so that the model's
    /// all-reduce of a swept size takes what it took, and a pair's swap what the sweep's exchange took;
    /// no sharing efficiency where none was measured. On one node: the cores, the fitted line only.
    #[test]
    fn ranks_across_nodes_give_one_rank_nodes_priced_by_the_measured_messages() {
        let sweep = vec![
            (4096, 0.003, 0.001),
            (1 << 20, 1.2, 0.5),
            (4 << 20, 6.0, 2.0),
        ];
        let mut m = measured(4, 1, sweep.clone());
        m.beside = Some(BesideRate {
            rate: 1.3456,
            bytes: 96 << 10,
        });
        let text = m.profile_toml();
        assert!(text.contains("A ring exchange of 98.3 kB"), "{text}");
        let p = super::super::profile::parse("lab.toml", &text).unwrap();
        assert_eq!(p.devices_per_node, 1);
        assert_eq!(p.device.sharing_efficiency, None);
        assert_eq!(p.comm_beside_compute, Some(1.3456));
        // The codecs' rates, as measured; the others are not in the profile.
        let rates = &p.device.codec_gbps;
        assert_eq!(
            (rates.topk, rates.demo, rates.qsgd),
            (Some(1.5), Some(0.25), None)
        );
        let wire = super::super::model::Wire {
            link: &p.inter,
            share: 1,
        };
        for &(bytes, secs, swap) in &sweep {
            let t = super::super::model::ring_all_reduce(4, bytes as f64, wire);
            assert!((t / secs - 1.0).abs() < 1e-3, "{bytes}: {t} {secs}");
            // A pair swapping a swept size takes what the sweep's exchange took.
            let t = p.inter.swap_seconds(bytes as f64, 1);
            assert!((t / swap - 1.0).abs() < 1e-3, "{bytes}: {t} {swap}");
        }
        // The all-reduce over the 4 nodes is the sweep's, at its sizes and between them as the ring over
        // its messages gives it: predictions of links alike do not change.
        let world = crate::sync::trace::Collective {
            op: crate::sync::trace::Op::AllReduce { words: 0 },
            groups: vec![(0..4).collect()],
            overlap: crate::sync::trace::Overlap::None,
        };
        let layout = super::super::model::Layout {
            world: 4,
            ranks_per_node: 1,
        };
        let mut ring = p.clone();
        ring.all_reduce = None;
        for bytes in [4096u64, 1 << 19, 1 << 20, 3 << 20, 4 << 20, 9 << 20] {
            let c = crate::sync::trace::Collective {
                op: crate::sync::trace::Op::AllReduce { words: bytes / 4 },
                ..world.clone()
            };
            let t = super::super::model::collective_seconds(&c, &layout, &p);
            let r = super::super::model::collective_seconds(&c, &layout, &ring);
            assert!((t / r - 1.0).abs() < 1e-3, "{bytes}: {t} {r}");
            if let Some(&(_, secs, _)) = sweep.iter().find(|s| s.0 as u64 == bytes) {
                assert!((t / secs - 1.0).abs() < 1e-3, "{bytes}: {t} {secs}");
            }
        }
        assert_eq!(p.all_reduce.as_ref().map(|a| a.nodes), Some(4));
        let one = super::super::profile::parse(
            "l.toml",
            &measured(2, 2, vec![(4, 1e-5, 1e-5)]).profile_toml(),
        )
        .unwrap();
        assert_eq!(one.devices_per_node, 2);
        assert_eq!(one.comm_beside_compute, None);
        assert!(one.inter.measured.is_empty() && one.intra.measured.is_empty());
        assert_eq!(one.all_reduce, None);
    }

    /// `beside_rate` inverts `model::Beside::seconds`: the exchange the model gives for a rate of at
    /// least 1 and a compute gives that rate back.
    #[test]
    fn beside_rate_inverts_the_model_predict_prices_with() {
        for rate in [1.0, 1.3, 2.5] {
            for compute in [0.005, 0.03, 0.2] {
                for idle in [0.01, 0.05] {
                    let busy = crate::predict::model::Beside { rate, compute }.seconds(idle);
                    let got = beside_rate(idle, busy, compute);
                    assert!((got - rate).abs() < 1e-9, "{rate} {compute} {idle}: {got}");
                }
            }
        }
        // More lost than the compute's time: busy over idle.
        assert_eq!(beside_rate(0.01, 0.05, 0.02), 5.0);
        // Faster beside the compute than alone: 1.
        assert_eq!(beside_rate(0.33, 0.28, 0.03), 1.0);
        assert_eq!(beside_rate(0.05, 0.02, 0.03), 1.0);
    }

    /// The exchange is scaled to the compute's time, in whole pages within its bounds.
    #[test]
    fn beside_bytes_scale_the_first_exchange_to_the_compute() {
        assert_eq!(beside_bytes(1.0), 1 << 20);
        assert_eq!(beside_bytes(0.25), 256 << 10);
        assert_eq!(beside_bytes(0.1), 104 << 10);
        assert_eq!(beside_bytes(1e-4), 16 << 10);
        assert_eq!(beside_bytes(3.0), 3 << 20);
        assert_eq!(beside_bytes(100.0), 4 << 20);
        assert_eq!(beside_bytes(f32::INFINITY), 4 << 20);
        assert_eq!(beside_bytes(0.0), 16 << 10);
        assert_eq!(beside_bytes(f32::NAN), 16 << 10);
    }

    /// Every rank of a group gets the same rate, finite and at least 1, and the same message size, with
    /// two ranks (one neighbour) and three (two); one rank has no exchange to time.
    #[test]
    fn beside_compute_gives_every_rank_one_ratio() {
        for n in [1, 2, 3] {
            let comms = crate::comm::local::group(n, std::time::Duration::from_secs(60));
            let got: Vec<Option<BesideRate>> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .map(|mut c| s.spawn(move || beside_compute(&mut c).unwrap()))
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            match n {
                1 => assert_eq!(got, vec![None]),
                _ => {
                    let r = got[0].unwrap();
                    assert!(r.rate.is_finite() && r.rate >= 1.0, "{n}: {got:?}");
                    assert!((16 << 10..=4 << 20).contains(&r.bytes), "{n}: {got:?}");
                    assert!(got.iter().all(|g| *g == got[0]), "{n}: {got:?}");
                }
            }
        }
    }

    #[test]
    fn pair_rounds_meet_every_pair_once_in_disjoint_rounds() {
        for n in 2..=9 {
            let rounds = pair_rounds(n);
            let mut met = std::collections::BTreeSet::new();
            for round in &rounds {
                let mut busy = std::collections::BTreeSet::new();
                for &(a, b) in round {
                    assert!(
                        a < b && b < n && busy.insert(a) && busy.insert(b),
                        "{n}: {rounds:?}"
                    );
                    assert!(met.insert((a, b)), "{n}: ({a}, {b}) twice");
                }
            }
            assert_eq!(met.len(), n * (n - 1) / 2, "{n}");
        }
    }

    /// The sweep's exchanges take ring gossip's rounds in turn: with an even number of ranks, each
    /// repeat's partners are the pairs of that round; with an odd number, `me ^ 1` every time.
    #[test]
    fn the_sweep_swaps_with_ring_gossips_partners_in_turn() {
        use crate::config::backend::Topology;
        for n in (2..=12).step_by(2) {
            let rounds = crate::sync::topology::rounds(Topology::Ring, n, 1).unwrap();
            for rep in 0..4 {
                let mut pairs: Vec<(usize, usize)> = (0..n)
                    .map(|me| (me, sweep_peer(me, n, rep)))
                    .filter(|&(a, b)| a < b)
                    .collect();
                let mut want: Vec<(usize, usize)> = rounds[rep % 2]
                    .iter()
                    .map(|g| (g.ranks[0].min(g.ranks[1]), g.ranks[0].max(g.ranks[1])))
                    .collect();
                pairs.sort_unstable();
                want.sort_unstable();
                assert_eq!(pairs, want, "{n} ranks, repeat {rep}");
                assert!((0..n).all(|me| sweep_peer(sweep_peer(me, n, rep), n, rep) == me));
            }
        }
        for n in [3, 5] {
            for rep in 0..3 {
                assert!((0..n).all(|me| sweep_peer(me, n, rep) == me ^ 1), "{n}");
            }
        }
    }

    /// With a node 4x slower than the others, the profile gives it a link of its own (its curve, and
    /// the line through its two largest messages) and the others the median node's curve; with nodes
    /// alike, no node links and the all-reduce sweep's messages.
    #[test]
    fn a_slow_node_gets_a_link_of_its_own() {
        let curve = |k: f64| {
            PAIR_SIZES
                .iter()
                .map(|&b| [b as f64, 50.0 + k * b as f64 / 6.25])
                .collect()
        };
        let sweep = vec![
            (4096, 0.003, 0.001),
            (1 << 20, 1.2, 0.5),
            (4 << 20, 6.0, 2.0),
        ];
        let mut m = measured(4, 1, sweep);
        m.nodes = vec![curve(1.0), curve(4.0), curve(1.0), curve(1.1)];
        let p = super::super::profile::parse("lab.toml", &m.profile_toml()).unwrap();
        assert_eq!(p.node_links.len(), 1);
        assert_eq!(p.node_links[0].node, 1);
        for (got, want) in p.inter_of(1).measured.iter().zip(&m.nodes[1]) {
            assert!(
                got[0] == want[0] && (got[1] - want[1]).abs() <= 0.05,
                "{got:?} {want:?}"
            );
        }
        assert!((p.inter_of(1).bandwidth_gbps / (6.25e6 / 4.0 * 8.0 / 1e9) - 1.0).abs() < 1e-3);
        let base: Vec<[f64; 2]> = curve(1.1);
        for (got, want) in p.inter.measured.iter().zip(&base) {
            assert!((got[1] - want[1]).abs() < 0.1, "{got:?} {want:?}");
        }
        assert_eq!(p.inter_of(0), &p.inter);
        m.nodes = vec![curve(1.0), curve(1.2), curve(1.0), curve(1.1)];
        let p = super::super::profile::parse("lab.toml", &m.profile_toml()).unwrap();
        assert!(p.node_links.is_empty() && p.inter.measured.len() == 3);
    }
}

//! Wall-clock time on a real cluster: a run's steps priced by a calibrated model of devices and links.
//! Each step's collectives come from the backend that trains (`SyncBackend::step_comm`, built here on a
//! described world that never communicates), so the prediction follows the implementation; compute
//! comes from the model's FLOPs and the device's sustained throughput.

pub mod calibrate;
pub mod clock;
pub mod codec;
pub mod model;
pub mod profile;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::Result;
use serde::Serialize;

use crate::config::ConfigError;
use crate::plan::SyncPlan;
use crate::plan::{LaunchEnv, Loaded};
use crate::sync::trace::{self, Collective, Op, Overlap};
use crate::sync::SyncBackend;
use model::{Beside, Layout, StepTime};
use profile::{Cluster, ClusterProfile};

/// Bytes per parameter that a step moves outside the forward and backward pass: AdamW reads parameter,
/// gradient and both moments and writes three of them (28 B), the gradient is zeroed and its norm read
/// for clipping (8 B), and the new parameters are copied into the model (8 B). Memory-bound.
const UPDATE_BYTES_PER_PARAM: f64 = 44.0;

/// A configured run on a cluster, ready to price its steps.
pub struct Predictor {
    backend: Box<dyn SyncBackend>,
    pub layout: Layout,
    pub profile: ClusterProfile,
    /// Seconds of forward + backward per step and rank.
    pub compute: f64,
    /// Seconds of the optimizer's update (after the gradients are reduced, before the next step).
    pub update: f64,
    /// Seconds of compression on steps that communicate (compressing backends).
    pub codec: f64,
    /// How `codec` was priced: the codec, its GB/s on the cluster's device, and whether measured.
    pub codec_rate: Option<CodecRate>,
    /// Whether more ranks than devices share a node's devices (a CPU's cores).
    pub cores_shared: bool,
    /// Where collectives beside the compute are not free, for a compute that a run measured outside
    /// them: how they slow beside it (`Beside`).
    beside: Option<Beside>,
    /// Tokens of the mean step (with a ramp-up, the early steps are smaller).
    pub tokens_per_step: f64,
    /// The loop's own collectives: steps between log steps, and seconds between stop votes.
    log_interval: u64,
    stop_check_secs: f64,
}

/// The run's ranks placed `ranks_per_node` to a node (default: the cluster's devices per node).
pub fn layout(world: usize, ranks_per_node: Option<usize>, p: &ClusterProfile) -> Layout {
    Layout {
        world,
        ranks_per_node: ranks_per_node
            .unwrap_or(p.devices_per_node)
            .clamp(1, world.max(1)),
    }
}

impl Predictor {
    /// `loaded`'s plan on `layout`; `compute` overrides the FLOPs-based compute seconds per step (a run's
    /// measured step outside its communication and codec: the update included, so not added again).
    pub fn new(
        loaded: &Loaded,
        p: &ClusterProfile,
        layout: Layout,
        compute: Option<f64>,
    ) -> Result<Self> {
        let plan = &loaded.plan;
        let cfg = &loaded.config;
        let backend = crate::plan::described(cfg, plan)?;
        // More ranks than devices on a node share them (a CPU's cores, with `local`).
        let per_device = layout.ranks_per_node as f64 / p.devices_per_node as f64;
        let shared = match per_device > 1.0 {
            true => per_device / p.device.sharing_efficiency.unwrap_or(1.0),
            false => 1.0,
        };
        let n = plan.n_steps.max(1);
        let tokens_per_step = plan.tokens_before(n) as f64 / n as f64;
        let flops = plan.flops_per_token as f64 * tokens_per_step / plan.world_size as f64;
        // Ranks that share cores also share them for their intra-node transfers (the CPU copies them) and
        // wait for each other to be scheduled.
        let mut profile = p.clone();
        profile.intra = profile.intra.slowed(shared);
        let update = match compute {
            Some(_) => 0.0,
            None => {
                UPDATE_BYTES_PER_PARAM * plan.n_params as f64 / (p.device.memory_gbps * 1e9)
                    * shared
            }
        };
        let compute =
            compute.unwrap_or(flops / (p.device.peak_tflops * 1e12 * p.device.mfu) * shared);
        let codec_rate = codec::of(&plan.sync).map(|c| CodecRate::on(c, &p.device));
        let codec = codec_rate.as_ref().map_or(0.0, |r| {
            4.0 * plan.n_params as f64 / (r.gbps * 1e9) * shared
        });
        Ok(Self {
            backend,
            layout,
            profile,
            compute,
            update,
            codec,
            codec_rate,
            cores_shared: per_device > 1.0,
            beside: None,
            tokens_per_step,
            log_interval: cfg.log.log_interval.max(1),
            stop_check_secs: cfg.log.stop_check_secs,
        })
    }

    /// How often each pattern of collectives occurs over `steps` (runs repeat a few: dense and
    /// compressed steps, gossip rounds, sync points).
    pub fn patterns(&self, steps: std::ops::Range<u64>) -> HashMap<Vec<Collective>, u64> {
        trace::patterns(self.backend.as_ref(), steps)
    }

    /// The mean step of every worker present with these slowdowns, by the simulated clock over the first
    /// `steps` steps (at most 20000); and the steps simulated.
    pub fn clock_ms_per_step(&self, slowdown: &[f64], steps: u64) -> (f64, u64) {
        let steps = steps.min(20_000);
        let mut c = clock::Clock::new(slowdown.to_vec());
        let all: Vec<usize> = (0..slowdown.len()).collect();
        for s in 0..steps {
            c.step(self, &all, &self.backend.step_comm(s));
        }
        (c.now(&all) / steps.max(1) as f64 * 1e3, steps)
    }

    /// A step of these collectives on a worker whose compute takes `slowdown` times as long as the
    /// cluster's: its time, and each collective's (see `clock`).
    pub fn worker_step(&self, described: &[Collective], slowdown: f64) -> (f64, Vec<f64>) {
        let (secs, t) = self.price_with(described, self.compute * slowdown);
        (t.total(), secs)
    }

    /// A step of these collectives: each one's seconds, and the step's time.
    fn price(&self, described: &[Collective]) -> (Vec<f64>, StepTime) {
        self.price_with(described, self.compute)
    }

    /// `price` with a compute of `compute` seconds.
    fn price_with(&self, described: &[Collective], compute: f64) -> (Vec<f64>, StepTime) {
        let overlaps = self.overlaps();
        let mut secs: Vec<f64> = described
            .iter()
            .map(|c| model::collective_seconds(c, &self.layout, &self.profile))
            .collect();
        let beside = |c: &Collective| c.overlap == Overlap::Compute && !overlaps.compute;
        if let Some(b) = self.beside {
            let idle: f64 = described
                .iter()
                .zip(&secs)
                .filter(|(c, _)| beside(c))
                .map(|(_, t)| t)
                .sum();
            let scale = b.seconds(idle) / idle.max(f64::MIN_POSITIVE);
            for (c, t) in described.iter().zip(&mut secs) {
                if beside(c) {
                    *t *= scale;
                }
            }
        }
        let codec = if described.is_empty() {
            0.0
        } else {
            self.codec
        };
        let refs: Vec<(&Collective, f64)> = described.iter().zip(secs.iter().copied()).collect();
        let time = model::step_time(compute, codec + self.update, &refs, overlaps);
        (secs, time)
    }

    /// What runs beside the compute for free on this cluster.
    fn overlaps(&self) -> model::Overlaps {
        model::Overlaps {
            backward: self.profile.overlap_backward,
            compute: !self.cores_shared && self.profile.overlap_compute,
        }
    }

    /// The profile's `comm_beside_compute`, where collectives beside the compute are not free here.
    pub fn beside_rate(&self) -> Option<f64> {
        match self.overlaps().compute {
            true => None,
            false => self.profile.comm_beside_compute,
        }
    }

    /// Seconds per step of the training loop's own collectives on a run whose step takes `step` seconds:
    /// at each log step one all-gather of a few words a rank (the loss and the backend's means,
    /// `compute_ms` and the stop vote), and where steps are short against `log.stop_check_secs`, the
    /// timed stop votes between (an all-gather of 4 words a rank; see `train::worker`'s `vote`).
    /// Checkpoints are not priced.
    pub fn control_seconds(&self, step: f64) -> f64 {
        let world = self.layout.world;
        let price = |words: u64| {
            let c = Collective::world(
                Op::AllGather {
                    pieces: vec![words],
                },
                world,
                Overlap::None,
            );
            model::collective_seconds(&c, &self.layout, &self.profile)
        };
        let log = self.log_interval as f64;
        let gap = (self.stop_check_secs / step.max(1e-9)).floor().max(1.0);
        let timed = (1.0 / gap - 1.0 / log).max(0.0);
        price(8) / log + price(4) * timed
    }

    /// The average step over `steps`, with each kind of collective tallied.
    pub fn average(&self, steps: std::ops::Range<u64>) -> Average {
        self.average_of(&self.patterns(steps))
    }

    /// The average step over steps of these patterns.
    fn average_of(&self, patterns: &HashMap<Vec<Collective>, u64>) -> Average {
        let n = patterns.values().sum::<u64>().max(1) as f64;
        let mut sum = StepTime::default();
        let mut kinds: BTreeMap<String, CollectiveRow> = BTreeMap::new();
        for (described, &count) in patterns {
            let (secs, t) = self.price(described);
            let k = count as f64;
            sum.compute += k * t.compute;
            sum.serial += k * t.serial;
            sum.comm += k * t.comm;
            sum.exposed += k * t.exposed;
            for (c, secs) in described.iter().zip(secs) {
                let row = CollectiveRow::of(c);
                let e = kinds.entry(row.key()).or_insert(row);
                e.per_step += k / n;
                e.ms += k * secs * 1e3;
            }
        }
        let control = self.control_seconds(sum.total() / n);
        let mut collectives: Vec<CollectiveRow> = kinds.into_values().collect();
        for c in &mut collectives {
            // Mean time of one, from the sum over its occurrences.
            c.ms /= c.per_step * n;
        }
        Average {
            compute_ms: sum.compute / n * 1e3,
            update_ms: self.update * 1e3,
            codec_ms: sum.serial / n * 1e3 - self.update * 1e3,
            comm_ms: sum.comm / n * 1e3,
            exposed_comm_ms: sum.exposed / n * 1e3,
            control_ms: control * 1e3,
            ms_per_step: (sum.total() / n + control) * 1e3,
            collectives,
        }
    }
}

/// Whether the backend runs a compressor on the steps that communicate.
/// A codec's throughput on a device (`DeviceSpec::codec_rate`).
#[derive(Debug, Clone, Serialize)]
pub struct CodecRate {
    pub codec: &'static str,
    pub gbps: f64,
    /// Measured (`[device.codec_gbps]`), or the memory-bound estimate.
    pub measured: bool,
}

impl CodecRate {
    /// " (topk at 0.473 GB/s, measured)".
    fn describe(&self) -> String {
        let source = match self.measured {
            true => "measured",
            false => "memory-bound estimate",
        };
        format!(" ({} at {:.3} GB/s, {source})", self.codec, self.gbps)
    }

    fn on(c: codec::CodecName, device: &profile::DeviceSpec) -> Self {
        let (gbps, measured) = device.codec_rate(c);
        Self {
            codec: c.key(),
            gbps,
            measured,
        }
    }
}

/// What a run's measured sync compute (`sync_ms`) takes on `cluster` per second it took on `ran_on`: the
/// ratio of the two devices' rates for the plan's codec (measured or memory-bound), else of their memory
/// bandwidths (the backends' other work, averaging and outer steps, is memory-bound).
fn sync_scale(plan: &SyncPlan, ran_on: &ClusterProfile, cluster: &ClusterProfile) -> f64 {
    match codec::of(plan) {
        Some(c) => ran_on.device.codec_rate(c).0 / cluster.device.codec_rate(c).0,
        None => ran_on.device.memory_gbps / cluster.device.memory_gbps,
    }
}

/// One kind of collective in a prediction.
#[derive(Debug, Clone, Serialize)]
pub struct CollectiveRow {
    pub op: &'static str,
    /// The largest buffer or piece a member holds.
    pub bytes: u64,
    /// Ranks per group and groups at once.
    pub group_size: usize,
    pub groups: usize,
    pub overlap: Overlap,
    /// How often it runs per step, on average.
    pub per_step: f64,
    /// Milliseconds one takes.
    pub ms: f64,
}

impl CollectiveRow {
    fn of(c: &Collective) -> Self {
        Self {
            op: c.name(),
            bytes: c.bytes(),
            group_size: c.groups.iter().map(Vec::len).max().unwrap_or(0),
            groups: c.groups.len(),
            overlap: c.overlap,
            per_step: 0.0,
            ms: 0.0,
        }
    }

    fn key(&self) -> String {
        format!(
            "{}/{}/{}/{}/{:?}",
            self.op, self.bytes, self.group_size, self.groups, self.overlap
        )
    }
}

/// A run's average step on a cluster.
#[derive(Debug, Clone, Serialize)]
pub struct Average {
    /// Forward and backward.
    pub compute_ms: f64,
    /// The optimizer's update (memory-bound).
    pub update_ms: f64,
    /// Compression (from a run directory: everything the sync backend computed outside collectives).
    pub codec_ms: f64,
    pub comm_ms: f64,
    pub exposed_comm_ms: f64,
    /// The training loop's own collectives: loss means and stop votes (`Predictor::control_seconds`).
    pub control_ms: f64,
    pub ms_per_step: f64,
    pub collectives: Vec<CollectiveRow>,
}

/// `nanodist predict`'s answer.
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    pub cluster: String,
    pub cluster_source: String,
    pub description: String,
    pub world_size: usize,
    pub ranks_per_node: usize,
    pub nodes: usize,
    pub synchronisation: String,
    /// Steps averaged over (the run's).
    pub steps: u64,
    #[serde(flatten)]
    pub average: Average,
    pub tokens_per_s: f64,
    /// From a run directory: the predicted time at each evaluation.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub evals: Vec<EvalTime>,
    /// From a run directory: the predicted seconds at each metrics row.
    #[serde(skip)]
    pub row_clock: Vec<f64>,
    /// The codec's rate the compression was priced at.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub codec_rate: Option<CodecRate>,
    /// With stragglers: who, and the step with and without them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stragglers: Option<String>,
    /// From a run directory: rows whose logged `comm_bytes` equal the described step's bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_check: Option<BytesCheck>,
    /// What the prediction cannot see (`OVERLAPPED_ON_SHARED_CORES`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub caveat: Option<&'static str>,
}

/// The caveat of a run that ran collectives beside its compute on CPU ranks whose cores also move the
/// bytes, priced with its own compute (`--measured`) where the cluster does not say how much slower
/// they run there (`comm_beside_compute`).
pub const OVERLAPPED_ON_SHARED_CORES: &str = "this run overlapped collectives with its compute on cores \
    that also move the bytes (its machine's profile: overlap_compute = false), so its compute_ms is only \
    the part of the step outside them, and the cluster's profile does not say how much slower they run \
    beside the compute (comm_beside_compute, which `nanodist calibrate` measures): the prediction can be \
    short (8-31% for overlapped gossip and CHOCO at 500 Mbit/s in two runs of docs/benchmarks.md, Real \
    links); the run without overlap (train.overlap = false) measures its compute alone";

#[derive(Debug, Clone, Serialize)]
pub struct EvalTime {
    pub step: u64,
    pub val_loss: f64,
    pub predicted_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct BytesCheck {
    pub rows: usize,
    pub matching: usize,
    /// Logged / described bytes over the whole run (below 1 where masks were smaller than their bound).
    pub ratio: f64,
}

/// Loads the config at `path` (a run directory's `config.toml` included) for `world` ranks (default: the
/// config's workers) placed on `cluster` `ranks_per_node` to a node (default: its devices per node),
/// with `sets` applied. The plan is resolved for that layout (gossip topologies follow it).
pub fn load(
    path: &Path,
    sets: &[String],
    world: Option<usize>,
    cluster: &ClusterProfile,
    ranks_per_node: Option<usize>,
) -> Result<(Loaded, Layout)> {
    let src = std::fs::read_to_string(path)
        .map_err(|e| crate::bad_input!("{}: cannot read the config: {e}", path.display()))?;
    let (cfg, _) = crate::config::parse(&src, sets).map_err(|problems| ConfigError {
        file: path.display().to_string(),
        problems,
    })?;
    let world = world.or(cfg.train.workers).unwrap_or(1);
    let layout = layout(world, ranks_per_node, cluster);
    let mut sets = sets.to_vec();
    sets.push("train.engine=\"local\"".into());
    sets.push(format!("train.ranks_per_node={}", layout.ranks_per_node));
    let launch = LaunchEnv {
        workers_flag: Some(world),
        ..LaunchEnv::default()
    };
    Ok((crate::plan::load_str(path, &src, &sets, &launch)?, layout))
}

/// The prediction of `loaded` (its steps 0..n_steps) on `cluster`; with stragglers
/// (`[train.membership] stragglers`), the step is the simulated clock's (`clock`), as the run logs it.
pub fn predict(loaded: &Loaded, cluster: &Cluster, layout: Layout) -> Result<Prediction> {
    let p = Predictor::new(loaded, &cluster.profile, layout, None)?;
    let steps = loaded.plan.n_steps.max(1);
    let mut average = p.average(0..steps);
    let slow = loaded
        .plan
        .membership
        .as_ref()
        .filter(|m| m.slowdown.iter().any(|&s| s != 1.0));
    let mut stragglers = None;
    if let Some(m) = slow {
        let (ms, simulated) = p.clock_ms_per_step(&m.slowdown, steps);
        let who: Vec<String> = (m.slowdown.iter().enumerate())
            .filter(|(_, &s)| s != 1.0)
            .map(|(w, s)| format!("worker {w} x{s}"))
            .collect();
        stragglers = Some(format!(
            "{}: {ms:.2} ms/step with them, {:.2} ms without (the simulated clock over {simulated} steps)",
            who.join(", "),
            average.ms_per_step
        ));
        average.ms_per_step = ms;
    }
    let mut out = prediction(loaded, cluster, &p, average);
    out.stragglers = stragglers;
    Ok(out)
}

/// The answer around an average step.
pub fn prediction(
    loaded: &Loaded,
    cluster: &Cluster,
    p: &Predictor,
    average: Average,
) -> Prediction {
    let tokens_per_s = p.tokens_per_step / (average.ms_per_step / 1e3);
    Prediction {
        cluster: cluster.name.clone(),
        cluster_source: cluster.source.clone(),
        description: cluster.profile.description.clone(),
        world_size: p.layout.world,
        ranks_per_node: p.layout.ranks_per_node,
        nodes: p.layout.nodes(),
        synchronisation: loaded.plan.sync.describe(),
        steps: loaded.plan.n_steps,
        average,
        tokens_per_s,
        evals: Vec::new(),
        row_clock: Vec::new(),
        bytes_check: None,
        stragglers: None,
        caveat: None,
        codec_rate: p.codec_rate.clone(),
    }
}

/// A run directory's steps priced on a cluster: each metrics row's interval at the bytes it logged (so
/// data-dependent sizes, e.g. Radius's masks, count as they were), with the sync backend's own compute
/// as the run measured it (`sync_ms`, scaled by `sync_scale` from `ran_on`, the machine the run ran on,
/// to the cluster's device), and the time of each evaluation.
pub fn predict_run(
    loaded: &Loaded,
    rows: &[crate::metrics::Row],
    (cluster, ran_on): (&Cluster, &ClusterProfile),
    layout: Layout,
    compute: Option<f64>,
) -> Result<Prediction> {
    let mut p = Predictor::new(loaded, &cluster.profile, layout, compute)?;
    // A compute measured on cores that also moved the overlapped collectives' bytes.
    let mut beside = (compute.is_some() && !ran_on.overlap_compute).then(|| BesideRows {
        rate: p.beside_rate(),
        ..BesideRows::default()
    });
    let device_scale = sync_scale(&loaded.plan.sync, ran_on, &cluster.profile);
    let (mut clock, mut prev, mut matching, mut logged, mut described) = (0.0, 0u64, 0, 0u64, 0u64);
    let (mut sync_s, mut sync_steps) = (0.0, 0u64);
    let (mut evals, mut clocks) = (Vec::new(), Vec::new());
    let mut all: HashMap<Vec<Collective>, u64> = HashMap::new();
    for row in rows {
        let interval = p.patterns(prev..row.step);
        let bytes: u64 = interval.iter().map(|(c, k)| k * trace::sent_by(c, 0)).sum();
        matching += usize::from(bytes == row.comm_bytes);
        (logged, described) = (logged + row.comm_bytes, described + bytes);
        let scale = if bytes > 0 {
            row.comm_bytes as f64 / bytes as f64
        } else {
            1.0
        };
        let codec = row.sync_ms / 1e3 * device_scale;
        (sync_s, sync_steps) = (sync_s + codec, sync_steps + (row.step - prev));
        let start = clock;
        let over = overlapped_steps(&interval);
        p.beside = beside.as_mut().and_then(|b| b.row(row, over));
        for (c, k) in interval {
            let t = p.price(&c).1;
            clock += k as f64 * (t.compute + p.update + t.exposed * scale);
            *all.entry(c).or_default() += k;
        }
        clock += codec;
        let steps = row.step.saturating_sub(prev).max(1) as f64;
        clock += steps * p.control_seconds((clock - start) / steps);
        clocks.push(clock);
        if let Some(v) = row.val_loss {
            evals.push(EvalTime {
                step: row.step,
                val_loss: v,
                predicted_s: clock,
            });
        }
        prev = row.step;
    }
    // The average step: the run's own sync compute, on every step.
    p.codec = 0.0;
    p.beside = beside.as_ref().and_then(BesideRows::mean);
    let mut average = p.average_of(&all);
    let codec_ms = sync_s / sync_steps.max(1) as f64 * 1e3;
    (average.codec_ms, average.ms_per_step) = (codec_ms, average.ms_per_step + codec_ms);
    let overlapped = all.keys().flatten().any(|c| c.overlap == Overlap::Compute);
    let mut out = prediction(loaded, cluster, &p, average);
    if overlapped && beside.is_some_and(|b| !b.priced()) {
        out.caveat = Some(OVERLAPPED_ON_SHARED_CORES);
    }
    out.steps = prev;
    out.evals = evals;
    out.row_clock = clocks;
    out.bytes_check = Some(BytesCheck {
        rows: rows.len(),
        matching,
        ratio: if described > 0 {
            logged as f64 / described as f64
        } else {
            1.0
        },
    });
    Ok(out)
}

/// Steps of `interval` with collectives beside the compute.
fn overlapped_steps(interval: &HashMap<Vec<Collective>, u64>) -> u64 {
    interval
        .iter()
        .filter(|(c, _)| c.iter().any(|c| c.overlap == Overlap::Compute))
        .map(|(_, k)| k)
        .sum()
}

/// A run's compute beside its overlapped collectives, row by row (`overlap_compute_ms`), with the
/// cluster's `comm_beside_compute` (`rate`).
#[derive(Debug, Clone, Copy, Default)]
struct BesideRows {
    rate: Option<f64>,
    seconds: f64,
    steps: u64,
    /// A row with overlapped steps but no `overlap_compute_ms` (a run from before it was logged).
    missing: bool,
}

impl BesideRows {
    /// The `Beside` of a row whose interval had `steps` overlapped steps.
    fn row(&mut self, row: &crate::metrics::Row, steps: u64) -> Option<Beside> {
        if steps == 0 {
            return None;
        }
        let Some(ms) = row.overlap_compute_ms else {
            self.missing = true;
            return None;
        };
        (self.seconds, self.steps) = (self.seconds + ms / 1e3, self.steps + steps);
        self.rate.map(|rate| Beside {
            rate,
            compute: ms / 1e3 / steps as f64,
        })
    }

    /// Over every row so far.
    fn mean(&self) -> Option<Beside> {
        let rate = self.rate.filter(|_| self.steps > 0)?;
        Some(Beside {
            rate,
            compute: self.seconds / self.steps as f64,
        })
    }

    /// Whether every overlapped step was priced beside its compute.
    fn priced(&self) -> bool {
        self.rate.is_some() && !self.missing
    }
}

/// Seconds of compute per step on `cluster` from the run's own rows: the median over its rows of the
/// slowest rank's step outside every collective, less rank 0's codec (`compute_ms`: the update stays in),
/// scaled by the sustained FLOP/s of `ran_on` (the machine the run ran on) over the cluster's and by
/// the tokens per rank.
pub fn measured_compute(
    rows: &[crate::metrics::Row],
    run_world: usize,
    loaded: &Loaded,
    cluster: &Cluster,
    ran_on: &ClusterProfile,
) -> Result<f64> {
    let mut per_step: Vec<f64> = Vec::new();
    let mut prev = 0;
    for r in rows {
        let steps = r.step.saturating_sub(prev);
        prev = r.step;
        if steps > 0 && r.val_loss.is_none() {
            // Rows before `compute_ms` was logged: rank 0's step outside its algorithm's collectives.
            let ms = r
                .compute_ms
                .unwrap_or_else(|| (r.ms_per_step * steps as f64 - r.comm_ms - r.sync_ms).max(0.0));
            per_step.push(ms / steps as f64 / 1e3);
        }
    }
    if per_step.is_empty() {
        return Err(crate::bad_input!(
            "the run has no metrics rows without an evaluation to measure the step time from"
        ));
    }
    per_step.sort_by(f64::total_cmp);
    let measured = per_step[per_step.len() / 2];
    let speed = |p: &profile::ClusterProfile| p.device.peak_tflops * p.device.mfu;
    let tokens = run_world as f64 / loaded.plan.world_size as f64;
    Ok(measured * speed(ran_on) / speed(&cluster.profile) * tokens)
}

impl Prediction {
    /// The collectives' lines of the answer.
    fn collectives(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "collectives      (averaged over {} steps)", self.steps)?;
        for c in &self.average.collectives {
            writeln!(
                f,
                "  {:<15} {:>10}  {} group{} of {:<3} overlap {:<8} {:>7.3}/step {:>10.3} ms each",
                c.op,
                crate::units::bytes(c.bytes as f64),
                c.groups,
                if c.groups == 1 { " " } else { "s" },
                c.group_size,
                serde_json::to_value(c.overlap)
                    .ok()
                    .and_then(|v| v.as_str().map(String::from))
                    .unwrap_or_default(),
                c.per_step,
                c.ms
            )?;
        }
        Ok(())
    }
}

impl std::fmt::Display for Prediction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let a = &self.average;
        writeln!(
            f,
            "cluster          {} ({}): {}",
            self.cluster, self.cluster_source, self.description
        )?;
        writeln!(
            f,
            "layout           {} ranks, {} per node, {} node{}",
            self.world_size,
            self.ranks_per_node,
            self.nodes,
            if self.nodes == 1 { "" } else { "s" }
        )?;
        writeln!(f, "synchronisation  {}", self.synchronisation)?;
        writeln!(
            f,
            "compute          {:.2} ms/step (forward + backward)",
            a.compute_ms
        )?;
        writeln!(f, "update           {:.2} ms/step (optimizer)", a.update_ms)?;
        if a.codec_ms > 0.0 {
            let how = self
                .codec_rate
                .as_ref()
                .map_or(String::new(), CodecRate::describe);
            writeln!(f, "compression      {:.2} ms/step{how}", a.codec_ms)?;
        }
        self.collectives(f)?;
        writeln!(
            f,
            "communication    {:.2} ms/step, {:.2} ms exposed",
            a.comm_ms, a.exposed_comm_ms
        )?;
        writeln!(
            f,
            "bookkeeping      {:.2} ms/step (loss means and stop votes)",
            a.control_ms
        )?;
        writeln!(
            f,
            "step             {:.2} ms, {:.0} tokens/s",
            a.ms_per_step, self.tokens_per_s
        )?;
        if let Some(s) = &self.stragglers {
            writeln!(f, "stragglers       {s}")?;
        }
        if let Some(c) = self.caveat {
            writeln!(f, "caveat           {c}")?;
        }
        if let Some(c) = &self.bytes_check {
            writeln!(
                f,
                "bytes check      {} of {} rows log the described bytes (logged / described {:.3})",
                c.matching, c.rows, c.ratio
            )?;
        }
        for e in &self.evals {
            writeln!(
                f,
                "  step {:>7}  val loss {:.4}  at {}",
                e.step,
                e.val_loss,
                human_secs(e.predicted_s)
            )?;
        }
        Ok(())
    }
}

/// Seconds as h:mm:ss (or s with decimals under a minute).
pub fn human_secs(s: f64) -> String {
    if s < 60.0 {
        return format!("{s:.2} s");
    }
    let t = s.round() as u64;
    format!("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loaded(set: &[&str]) -> Loaded {
        let src = "[train]\nglobal_batch_size = 12\nn_steps = 100\n[train.lr_schedule]\nwarmup_steps = 1\n\
                   [model]\nn_layers = 2\nn_heads = 2\nn_embd = 64\nvocab_size = 128\n";
        let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        let launch = LaunchEnv {
            workers_flag: Some(4),
            ..Default::default()
        };
        crate::plan::load_str(Path::new("t.toml"), src, &set, &launch)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// A compressing plan's codec is priced at the profile's measured rate for it, else as memory-bound;
    /// a run's measured sync compute moves to another device by the ratio of the two devices' rates.
    #[test]
    fn a_measured_codec_rate_prices_the_compression() {
        let topk = loaded(&["train.compression={ name = \"topk\", density = 0.01 }"]);
        let bytes = 4.0 * topk.plan.n_params as f64;
        let mut a100 = profile::load("a100-ib100").unwrap().profile;
        let layout = layout(4, None, &a100);
        let estimate = Predictor::new(&topk, &a100, layout, None).unwrap();
        let memory_bound = bytes / (a100.device.memory_gbps / 8.0 * 1e9);
        assert!((estimate.codec / memory_bound - 1.0).abs() < 1e-12);
        assert!(!estimate.codec_rate.unwrap().measured);
        a100.device.codec_gbps.topk = Some(2.0);
        let measured = Predictor::new(&topk, &a100, layout, None).unwrap();
        assert!((measured.codec / (bytes / 2e9) - 1.0).abs() < 1e-12);
        let rate = measured.codec_rate.unwrap();
        assert_eq!((rate.codec, rate.gbps, rate.measured), ("topk", 2.0, true));
        let dense = loaded(&[]);
        assert_eq!(
            Predictor::new(&dense, &a100, layout, None).unwrap().codec,
            0.0
        );
        // The run's sync_ms: scaled by the codec's rates where the plan compresses, else by memory.
        let mut laptop = profile::load("local").unwrap().profile;
        laptop.device.codec_gbps.topk = Some(0.5);
        assert_eq!(sync_scale(&topk.plan.sync, &laptop, &a100), 0.25);
        let memory = laptop.device.memory_gbps / a100.device.memory_gbps;
        assert_eq!(sync_scale(&dense.plan.sync, &laptop, &a100), memory);
    }

    /// A run's compute per step is the median over its rows without an evaluation of the slowest rank's
    /// `compute_ms` over the row's steps; rows logged before that field, rank 0's step outside its
    /// algorithm's collectives and codec. Scaled by tokens per rank and the two devices' speeds.
    #[test]
    fn measured_compute_is_the_slowest_ranks_median_step() {
        use crate::metrics::Row;
        let plan = loaded(&[]);
        let local = profile::load("local").unwrap();
        let row = |step, ms_per_step, comm_ms, compute_ms, val_loss| Row {
            step,
            ms_per_step,
            comm_ms,
            sync_ms: 5.0,
            compute_ms,
            val_loss,
            ..Row::default()
        };
        // Rows of 5 steps: 60, 20 and 40 ms a step (the median 40); the evaluation's row is left out.
        let logged = [
            row(5, 90.0, 45.0, Some(300.0), None),
            row(10, 90.0, 45.0, Some(100.0), None),
            row(15, 90.0, 45.0, Some(200.0), None),
            row(20, 900.0, 45.0, Some(4000.0), Some(2.0)),
        ];
        let at = |rows: &[Row], world| measured_compute(rows, world, &plan, &local, &local.profile);
        assert!((at(&logged, 4).unwrap() - 0.040).abs() < 1e-12);
        // A run of 2 ranks priced as the plan's 4: each of those computes half a run rank's tokens.
        assert!((at(&logged, 2).unwrap() - 0.020).abs() < 1e-12);
        // Without compute_ms: 90 - (45 + 5) / 5 = 80 ms a step.
        let old: Vec<Row> = logged[..3]
            .iter()
            .map(|r| Row {
                compute_ms: None,
                ..r.clone()
            })
            .collect();
        assert!((at(&old, 4).unwrap() - 0.080).abs() < 1e-12);
        assert!(at(&logged[3..], 4).is_err());
    }
}

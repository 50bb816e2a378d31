//! From a validated config and the launch environment to the numbers a run needs (the `Plan`).

use std::fmt;

use super::backend::{
    Backend, Compression, DemoConfig, DilocoConfig, Engine, PowerSgdConfig, Quantize, RadiusConfig,
    TopKConfig, Topology,
};
use super::batch::BatchSchedule;
use super::error::Problem;
use super::tree::Node;
use super::{validate, Config, OptimConfig};
use crate::sync::choco::{ChocoPlan, Compressor};

/// What the launcher says about this process. Built from `--workers` and the environment
/// (`mpirun`, `srun`, torchrun conventions).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaunchEnv {
    /// `--workers N` from the command line.
    pub workers_flag: Option<usize>,
    /// World size and ranks per node reported by a launcher, if any.
    pub launcher_world: Option<usize>,
    pub launcher_local_world: Option<usize>,
    /// Processes started together by mpirun or srun (OMPI_COMM_WORLD_SIZE, SLURM_STEP_NUM_TASKS).
    pub launched_processes: Option<usize>,
    /// Path of the prepared data's vocabulary size (`meta.json`), when the data is present.
    pub data_vocab: Option<(String, usize)>,
}

impl LaunchEnv {
    /// This process's rank in a job started by mpirun or srun.
    pub fn process_rank() -> Option<usize> {
        ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"]
            .iter()
            .find_map(|n| std::env::var(n).ok()?.trim().parse().ok())
    }

    /// Reads the launcher's variables: Open MPI, Slurm, then torchrun's.
    pub fn from_env(workers_flag: Option<usize>) -> Self {
        let var = |names: &[&str]| {
            names
                .iter()
                .find_map(|n| std::env::var(n).ok()?.trim().parse::<usize>().ok())
        };
        Self {
            workers_flag,
            launcher_world: var(&[
                "OMPI_COMM_WORLD_SIZE",
                "PMI_SIZE",
                "SLURM_NTASKS",
                "WORLD_SIZE",
            ]),
            launcher_local_world: var(&[
                "OMPI_COMM_WORLD_LOCAL_SIZE",
                "MPI_LOCALNRANKS",
                "SLURM_NTASKS_PER_NODE",
                "LOCAL_WORLD_SIZE",
            ]),
            launched_processes: var(&["OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"]),
            data_vocab: None,
        }
    }
}

/// How the workers synchronise, with every default and cross-field rule of backends, topologies and
/// reducers applied (here, once). `sync::build` turns it into the backend; nothing else reads the
/// config's backend keys.
#[derive(Debug, Clone, PartialEq)]
pub enum SyncPlan {
    /// Gradient averaging by all-reduce in buckets of `bucket_elems` floats (PyTorch DDP).
    AllReduce { bucket_elems: usize },
    /// Parameter gossip over `topology` for `ranks_per_node` ranks to a node (Decent-DP).
    Gossip {
        topology: Topology,
        overlap: bool,
        ranks_per_node: usize,
        /// CHOCO-SGD compressed gossip (`[train.compression]` under decentdp).
        choco: Option<ChocoPlan>,
    },
    /// Gradient averaging through a compressed reducer.
    Compressed(ReducerPlan),
    /// DiLoCo / Streaming DiLoCo; `reducer` compresses the pseudo-gradients.
    Diloco {
        cfg: DilocoConfig,
        reducer: Option<ReducerPlan>,
    },
    /// SPARTA: a fraction `p` of the entries averaged after every step, masks drawn from `seed`.
    Sparta { p: f64, seed: u64 },
    /// DeMo; the loop's SGD applies its sign direction with decoupled `weight_decay`. The local gradient
    /// is clipped to `clip` before it enters the momentum (the sign is not clipped).
    Demo {
        cfg: DemoConfig,
        weight_decay: f64,
        clip: f64,
    },
}

/// A compressed reducer with its settings.
#[derive(Debug, Clone, PartialEq)]
pub enum ReducerPlan {
    TopK(TopKConfig),
    /// Radius stable top-k; `correction` runs Adam inside the reducer (see `sync::compress::correction`).
    Radius {
        cfg: RadiusConfig,
        correction: Option<Correction>,
    },
    /// PowerSGD; `seed` draws the initial factors.
    PowerSgd {
        cfg: PowerSgdConfig,
        seed: u64,
    },
}

/// Radius's correction mode: Adam with the run's AdamW betas and eps, clipping to `clip` inside the reducer;
/// the loop's SGD applies AdamW's `weight_decay`.
#[derive(Debug, Clone, PartialEq)]
pub struct Correction {
    pub betas: [f64; 2],
    pub eps: f64,
    pub clip: f64,
    pub weight_decay: f64,
}

impl SyncPlan {
    /// The backend's name as the config spells it.
    pub fn backend_name(&self) -> &'static str {
        match self {
            SyncPlan::AllReduce { .. } | SyncPlan::Compressed(_) => Backend::PytorchDdp.name(),
            SyncPlan::Gossip { .. } => Backend::DecentDp.name(),
            SyncPlan::Diloco { .. } => Backend::Diloco.name(),
            SyncPlan::Sparta { .. } => Backend::Sparta.name(),
            SyncPlan::Demo { .. } => Backend::Demo.name(),
        }
    }

    /// The decoupled weight decay of a plain SGD that the loop steps instead of `train.optim`'s update:
    /// Radius's correction runs Adam inside the reducer, DeMo computes its own direction.
    pub fn plain_sgd_in_loop(&self) -> Option<f64> {
        match self {
            SyncPlan::Demo { weight_decay, .. } => Some(*weight_decay),
            SyncPlan::Compressed(ReducerPlan::Radius {
                correction: Some(c),
                ..
            }) => Some(c.weight_decay),
            _ => None,
        }
    }

    /// Whether every rank applies the same update to the same parameters, so that the replicas stay equal:
    /// the gradient-reducing backends (the local engine then keeps one replica, see `train::replica`).
    pub fn replicas_stay_equal(&self) -> bool {
        matches!(
            self,
            SyncPlan::AllReduce { .. } | SyncPlan::Compressed(_) | SyncPlan::Demo { .. }
        )
    }

    /// Whether Adam runs inside the reducer (its state then travels with the reducer's).
    pub fn adam_in_reducer(&self) -> bool {
        matches!(
            self,
            SyncPlan::Compressed(ReducerPlan::Radius {
                correction: Some(_),
                ..
            })
        )
    }

    /// One line for `check` and the start of a run.
    pub fn describe(&self) -> String {
        match self {
            SyncPlan::AllReduce { bucket_elems } => {
                format!(
                    "all-reduce in buckets of {:.1} MB",
                    *bucket_elems as f64 * 4.0 / 1e6
                )
            }
            SyncPlan::Gossip {
                topology,
                overlap,
                ranks_per_node,
                choco,
            } => format!(
                "gossip over {:?}, {ranks_per_node} rank(s) per node, {}{}",
                topology.name(),
                if *overlap {
                    "overlapped"
                } else {
                    "synchronous"
                },
                choco.as_ref().map_or(String::new(), |c| format!(
                    ", CHOCO compressed: {}, consensus step {}",
                    c.compressor.describe(),
                    if c.tuned {
                        format!("{:.4} (auto: tuned on the consensus of random vectors)", c.gamma)
                    } else {
                        c.gamma.to_string()
                    }
                ))
            ),
            SyncPlan::Diloco { cfg, reducer } => format!(
                "diloco: sync every {} steps, outer SGD lr {} momentum {}{}, {} fragment(s){}, quantize {}{}",
                cfg.sync_every,
                cfg.outer_lr,
                cfg.outer_momentum,
                if cfg.nesterov { " (Nesterov)" } else { "" },
                cfg.fragments,
                if cfg.fragments > 1 {
                    format!(" (delay {}, alpha {})", cfg.fragment_delay, cfg.fragment_alpha)
                } else {
                    String::new()
                },
                cfg.quantize.name(),
                reducer
                    .as_ref()
                    .map_or(String::new(), |r| format!(", pseudo-gradients by {}", r.describe()))
            ),
            SyncPlan::Sparta { p, .. } => {
                format!("sparta: average a fraction {p} of the parameters after every step")
            }
            SyncPlan::Demo {
                cfg, weight_decay, ..
            } => format!(
                "demo: decay {}, top {} DCT coefficients per chunk of {}, sign update with SGD \
                 (lr schedule, decoupled weight decay {weight_decay})",
                cfg.decay, cfg.topk, cfg.chunk
            ),
            SyncPlan::Compressed(r) => r.describe(),
        }
    }
}

impl ReducerPlan {
    fn describe(&self) -> String {
        match self {
            ReducerPlan::TopK(k) => format!(
                "top-k density {}, error feedback {}",
                k.density,
                k.error_feedback_on()
            ),
            ReducerPlan::Radius { cfg, correction } => format!(
                "radius density {}, interval {}, dense until step {}{}",
                cfg.density,
                cfg.interval,
                cfg.threshold,
                if correction.is_some() {
                    ", correction"
                } else {
                    ""
                }
            ),
            ReducerPlan::PowerSgd { cfg, .. } => format!(
                "powersgd rank {}, dense until step {}{}",
                cfg.rank,
                cfg.start_iter,
                if cfg.single_allreduce {
                    ", one all-reduce per step"
                } else {
                    ""
                }
            ),
        }
    }
}

/// The resolved run: everything derived from config + launch environment.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The engine that runs (never `Auto`).
    pub engine: Engine,
    pub sync: SyncPlan,
    pub world_size: usize,
    /// Ranks per node, when known (the local engine is one node).
    pub local_world_size: Option<usize>,
    pub local_batch_size: usize,
    /// Micro-steps and tokens of a step at the full global batch.
    pub accum_steps: usize,
    pub tokens_per_step: u64,
    pub context_length: usize,
    /// Each step's global batch (constant, or ramping up).
    pub batches: BatchSchedule,
    pub n_params: u64,
    pub flops_per_token: u64,
    pub n_steps: u64,
    /// Compute threads per worker, where this machine decides them (`train.threads`, else on the local
    /// engine the cores shared by its workers); None: each process's RAYON_NUM_THREADS or cores.
    pub threads: Option<usize>,
    /// Forward/backward passes that run at once in this process: on the local engine cores / threads
    /// (at most one per worker, at least one; see `train::compute`), else 1.
    pub compute_slots: usize,
}

impl Plan {
    /// Seconds for the whole run at `tokens_per_s`.
    pub fn run_seconds(&self, tokens_per_s: f64) -> f64 {
        self.tokens_before(self.n_steps) as f64 / tokens_per_s
    }

    /// Micro-steps of each worker in `step`.
    pub fn accum_at(&self, step: u64) -> usize {
        self.batches.batch_at(step) as usize / (self.local_batch_size * self.world_size)
    }

    /// Tokens of the global batch of `step`.
    pub fn tokens_at(&self, step: u64) -> u64 {
        self.batches.batch_at(step) * self.context_length as u64
    }

    /// Tokens of the steps before `step`.
    pub fn tokens_before(&self, step: u64) -> u64 {
        self.batches.samples_before(step) * self.context_length as u64
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "engine            {}", self.engine.name())?;
        writeln!(f, "backend           {}", self.sync.backend_name())?;
        writeln!(f, "synchronisation   {}", self.sync.describe())?;
        writeln!(f, "world size        {}", self.world_size)?;
        match self.threads {
            Some(t) => writeln!(
                f,
                "workers x threads {} x {t} ({} computing at once)",
                self.world_size, self.compute_slots
            )?,
            None => writeln!(
                f,
                "workers x threads {} x (each process's RAYON_NUM_THREADS, else its cores)",
                self.world_size
            )?,
        }
        if let Some(l) = self.local_world_size {
            writeln!(f, "ranks per node    {l}")?;
        }
        writeln!(f, "local batch       {} sequences", self.local_batch_size)?;
        let full = match self.batches.ramps() {
            true => " at the full batch",
            false => "",
        };
        writeln!(
            f,
            "accumulation      {} micro-steps{full}",
            self.accum_steps
        )?;
        writeln!(f, "tokens per step   {}{full}", self.tokens_per_step)?;
        if self.batches.ramps() {
            let stages: Vec<(u64, u64)> = self.batches.stages().collect();
            let shown: Vec<String> = stages
                .iter()
                .take(4)
                .map(|(step, b)| format!("{b} from step {step}"))
                .collect();
            writeln!(
                f,
                "batch ramp-up     {}{} ({} stages; accumulation {} -> {} micro-steps)",
                shown.join(", "),
                match stages.len() > 4 {
                    true => format!(
                        ", ..., {} from step {}",
                        self.batches.global(),
                        self.batches.full_from()
                    ),
                    false => String::new(),
                },
                stages.len(),
                self.accum_at(0),
                self.accum_steps
            )?;
        }
        writeln!(
            f,
            "parameters        {} ({:.2}M)",
            self.n_params,
            self.n_params as f64 / 1e6
        )?;
        writeln!(f, "FLOPs per token   {:.3e}", self.flops_per_token as f64)?;
        write!(
            f,
            "total tokens      {:.3e} over {} steps",
            self.tokens_before(self.n_steps) as f64,
            self.n_steps
        )
    }
}

/// Human duration: 1d 02:03:04.
pub fn format_duration(secs: f64) -> String {
    if !secs.is_finite() {
        return "unknown".into();
    }
    let s = secs.round() as u64;
    let (d, h, m, s) = (s / 86400, s / 3600 % 24, s / 60 % 60, s % 60);
    if d > 0 {
        format!("{d}d {h:02}:{m:02}:{s:02}")
    } else {
        format!("{h:02}:{m:02}:{s:02}")
    }
}

/// The engine that runs: `auto` is "mpi" when a launcher started several processes, else "local".
fn engine(cfg: &Config, doc: &Node, launch: &LaunchEnv, problems: &mut Vec<Problem>) -> Engine {
    let launched = launch.launched_processes.filter(|&p| p > 1);
    match (cfg.train.engine, launched) {
        (Engine::Auto, Some(_)) => Engine::Mpi,
        (Engine::Auto, None) => Engine::Local,
        (Engine::Local, Some(p)) => {
            problems.push(validate::problem_at(
                doc,
                "train.engine",
                format!(
                    "the launcher started {p} processes but the engine is \"local\" (threads of one process), \
                     so every process would train alone; set train.engine = \"auto\" or \"mpi\" \
                     (--set train.engine=auto)"
                ),
            ));
            Engine::Local
        }
        (e, _) => e,
    }
}

pub fn resolve(
    cfg: &Config,
    doc: &Node,
    launch: &LaunchEnv,
) -> Result<(Plan, Vec<String>), Vec<Problem>> {
    let t = &cfg.train;
    let mut problems = Vec::new();
    let mut notes = Vec::new();
    let engine = engine(cfg, doc, launch, &mut problems);
    let (world, local_world) = match engine {
        Engine::Local | Engine::Auto => {
            let w = launch.workers_flag.or(t.workers).unwrap_or(1);
            (w, Some(t.ranks_per_node.unwrap_or(w)))
        }
        Engine::Mpi | Engine::Nccl => {
            if launch.workers_flag.is_some() {
                problems.push(Problem {
                    path: "train.engine".into(),
                    origin: None,
                    message: format!(
                        "--workers applies to the local engine only; engine {:?} takes the world size from its \
                         launcher (mpirun -np N / srun -n N)",
                        engine.name()
                    ),
                });
            }
            (
                launch.launcher_world.unwrap_or(1),
                t.ranks_per_node.or(launch.launcher_local_world),
            )
        }
    };
    problems.extend(validate::check_semantics(cfg, doc, world));
    let sync = sync_plan(cfg, doc, world, local_world, &mut problems);
    if let Some((meta, vocab)) = &launch.data_vocab {
        if cfg.model.vocab_size < *vocab {
            problems.push(validate::problem_at(
                doc,
                "model.vocab_size",
                format!(
                    "vocab_size = {} is smaller than the prepared data's vocabulary of {vocab} tokens ({meta})",
                    cfg.model.vocab_size
                ),
            ));
        }
    }
    let Some(sync) = sync.filter(|_| problems.is_empty()) else {
        return Err(problems);
    };
    if let (SyncPlan::Gossip { topology, .. }, 1) = (&sync, world) {
        notes.push(format!(
            "train.topology {:?} with one worker: gossip degenerates to local training",
            topology.name()
        ));
    }
    notes.extend(key_notes(t, doc));
    let local = t.local_batch(world);
    let accum = t.global_batch_size / (local * world);
    // config::parse checked the ramp-up's own rules.
    let batches = BatchSchedule::of(t.global_batch_size as u64, t.rampup_batch_size)
        .map_err(|e| vec![validate::problem_at(doc, "train.rampup_batch_size", e)])?;
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = t.threads.or(match engine {
        Engine::Local | Engine::Auto => Some((cores / world).max(1)),
        Engine::Mpi | Engine::Nccl => None,
    });
    let compute_slots = match (engine, threads) {
        (Engine::Local | Engine::Auto, Some(threads)) => (cores / threads).clamp(1, world),
        _ => 1,
    };
    let plan = Plan {
        engine,
        sync,
        world_size: world,
        local_world_size: local_world,
        local_batch_size: local,
        accum_steps: accum,
        tokens_per_step: (t.global_batch_size * t.context_length) as u64,
        context_length: t.context_length,
        batches,
        n_params: cfg.model.n_params(t.context_length),
        flops_per_token: cfg.model.flops_per_token(t.context_length),
        n_steps: t.n_steps,
        threads,
        compute_slots,
    };
    Ok((plan, notes))
}

/// Notes on keys as the run takes them: sample counts as the steps they became (config::parse converted
/// them), and keys that have no effect here.
fn key_notes(t: &super::TrainConfig, doc: &Node) -> Vec<String> {
    let mut notes = Vec::new();
    let lr = &t.lr_schedule;
    for (key, steps) in [
        (
            "train.train_samples",
            format!("train.n_steps = {}", t.n_steps),
        ),
        (
            "train.lr_schedule.lr_warmup_samples",
            format!("warmup_steps = {}", lr.warmup(t.n_steps)),
        ),
        (
            "train.lr_schedule.lr_decay_samples",
            format!("decay_steps = {}", lr.decay_end(t.n_steps)),
        ),
    ] {
        if let Some(node) = super::tree::find(doc, key) {
            notes.push(format!(
                "{key} = {}: {steps} ({})",
                node.value.to_json(),
                match t.rampup_batch_size {
                    None => format!(
                        "steps of global_batch_size {}, rounded up",
                        t.global_batch_size
                    ),
                    Some(_) => "the steps whose ramping batches reach it".into(),
                }
            ));
        }
    }
    if t.compile {
        notes.push(
            "train.compile = true has no meaning for nanodist (no torch.compile): ignored".into(),
        );
    }
    if t.amp && t.device == super::train::Device::Cpu {
        notes.push(format!(
            "train.amp = true on CPU: {}",
            crate::model::matmul::CpuAmp::get()
        ));
    }
    notes
}

/// The synchronisation plan: keys that belong to another backend are errors, defaults are filled in,
/// and the rules of topologies and reducers are checked. `None` when a problem was found.
fn sync_plan(
    cfg: &Config,
    doc: &Node,
    world: usize,
    local_world: Option<usize>,
    problems: &mut Vec<Problem>,
) -> Option<SyncPlan> {
    let t = &cfg.train;
    let before = problems.len();
    let mut add =
        |path: &str, message: String| problems.push(validate::problem_at(doc, path, message));
    owned_keys(t, &mut add);
    if let Some(Compression::PowerSgd(p)) = &t.compression {
        if p.start_fraction.is_some()
            && super::tree::find(doc, "train.compression.start_iter").is_some()
        {
            add(
                "train.compression.start_fraction",
                "give PowerSGD's start as start_iter or as start_fraction, not both".into(),
            );
        }
        if p.start_fraction.is_some() && t.backend == Backend::Diloco {
            add(
                "train.compression.start_fraction",
                "under diloco the reducer's start counts syncs, not steps: give start_iter (syncs)"
                    .into(),
            );
        }
    }
    let plan = match (t.backend, &t.compression) {
        (Backend::PytorchDdp, None) => SyncPlan::AllReduce {
            bucket_elems: ((t.bucket_size_mb.unwrap_or(25.0) * 1e6 / 4.0) as usize).max(1),
        },
        (Backend::PytorchDdp, Some(c)) => SyncPlan::Compressed(reducer_plan(t, c, &mut add)?),
        (Backend::Diloco, c) => {
            let reducer = match c {
                Some(c) => Some(reducer_plan(t, c, &mut add)?),
                None => None,
            };
            diloco_plan(t, reducer, &mut add)
        }
        (Backend::Sparta, _) => SyncPlan::Sparta {
            p: t.sparta.clone().unwrap_or_default().p,
            seed: t.seed,
        },
        (Backend::Demo, _) => demo_plan(t, &mut add),
        (Backend::DecentDp, c) => gossip_plan(t, c.as_ref(), world, local_world, &mut add)?,
    };
    (problems.len() == before).then_some(plan)
}

/// Keys that belong to some backends only are errors under the others.
fn owned_keys(t: &super::TrainConfig, add: &mut dyn FnMut(&str, String)) {
    let owners: [(&str, bool, &[Backend]); 7] = [
        (
            "bucket_size_mb",
            t.bucket_size_mb.is_some(),
            &[Backend::PytorchDdp],
        ),
        (
            "compression",
            t.compression.is_some(),
            &[Backend::PytorchDdp, Backend::Diloco, Backend::DecentDp],
        ),
        ("topology", t.topology.is_some(), &[Backend::DecentDp]),
        ("overlap", t.overlap.is_some(), &[Backend::DecentDp]),
        ("diloco", t.diloco.is_some(), &[Backend::Diloco]),
        ("sparta", t.sparta.is_some(), &[Backend::Sparta]),
        ("demo", t.demo.is_some(), &[Backend::Demo]),
    ];
    for (key, _, allowed) in owners.iter().filter(|(_, present, _)| *present) {
        if !allowed.contains(&t.backend) {
            let names: Vec<String> = allowed.iter().map(|b| format!("{:?}", b.name())).collect();
            add(
                &format!("train.{key}"),
                format!(
                    "`{key}` belongs to backend = {}, but backend = {:?}",
                    names.join(" or "),
                    t.backend.name()
                ),
            );
        }
    }
}

/// A reducer's rules: gossip's compressors and CHOCO's consensus step do not reduce gradients;
/// Radius's correction needs AdamW; PowerSGD's state needs dense steps first, and its single all-reduce
/// needs a warm start. `None` when a problem was found.
fn reducer_plan(
    t: &super::TrainConfig,
    c: &Compression,
    add: &mut dyn FnMut(&str, String),
) -> Option<ReducerPlan> {
    if c.consensus_step().is_some() {
        add(
            "train.compression.consensus_step",
            format!(
                "`consensus_step` is CHOCO's, for compressed gossip (backend = \"decentdp\"), but backend = {:?}",
                t.backend.name()
            ),
        );
        return None;
    }
    Some(match c {
        Compression::TopK(k) => ReducerPlan::TopK(k.clone()),
        Compression::RandomK(_) | Compression::Qsgd(_) | Compression::Sign(_) => {
            add(
                "train.compression.name",
                format!(
                    "compressor {:?} compresses gossip messages (CHOCO, backend = \"decentdp\"); under backend = \
                     {:?} the compressors are \"topk\", \"radius\" and \"powersgd\"",
                    c.name(),
                    t.backend.name()
                ),
            );
            return None;
        }
        Compression::Radius(r) => {
            let correction = match (&t.optim, r.correction) {
                (_, false) => None,
                (OptimConfig::AdamW(a), true) => Some(Correction {
                    betas: a.betas,
                    eps: a.eps,
                    clip: t.grad_norm_clip,
                    weight_decay: a.weight_decay,
                }),
                (other, true) => {
                    add(
                        "train.compression.correction",
                        format!(
                            "correction = true runs Adam inside the reducer with train.optim's betas and eps: \
                             it needs train.optim.name = \"adamw\", found {:?}",
                            other.name()
                        ),
                    );
                    None
                }
            };
            ReducerPlan::Radius {
                cfg: r.clone(),
                correction,
            }
        }
        Compression::PowerSgd(p) => {
            // The plan holds the start as a step.
            let start = p.start_step(t.n_steps);
            if start <= 1 && (p.error_feedback || p.warm_start) {
                let (key, given) = match p.start_fraction {
                    Some(f) => (
                        "start_fraction",
                        format!("start_fraction = {f} ({start} steps)"),
                    ),
                    None => ("start_iter", format!("start_iter = {start}")),
                };
                add(
                    &format!("train.compression.{key}"),
                    format!(
                        "{given} must be > 1 when error_feedback or warm_start is on (as PyTorch's \
                         PowerSGDState requires): their state is allocated during the dense steps before \
                         compression starts"
                    ),
                );
            }
            if p.single_allreduce && !p.warm_start {
                add(
                    "train.compression.single_allreduce",
                    "single_allreduce = true needs warm_start = true (each step reuses the factor averaged \
                     by the previous one)"
                        .into(),
                );
            }
            ReducerPlan::PowerSgd {
                cfg: PowerSgdConfig {
                    start_iter: start,
                    start_fraction: None,
                    ..p.clone()
                },
                seed: t.seed,
            }
        }
    })
}

/// Gossip's rules: the topology fits the world size and node layout (`sync::topology::fits`); a
/// compressor makes it CHOCO (`choco_plan`). `None` when a problem was found.
fn gossip_plan(
    t: &super::TrainConfig,
    compression: Option<&Compression>,
    world: usize,
    local_world: Option<usize>,
    add: &mut dyn FnMut(&str, String),
) -> Option<SyncPlan> {
    let topology = t.topology.unwrap_or_default();
    let ranks_per_node = match local_world {
        Some(l) => l,
        None if topology == Topology::AlternatingExpRing && world > 1 => {
            add(
                "train.topology",
                "topology \"alternating-exp-ring\" needs the node layout (ranks per node), which the \
                 launcher did not report; set train.ranks_per_node"
                    .into(),
            );
            world
        }
        None => world,
    };
    if let Err(msg) = crate::sync::topology::fits(topology, world, ranks_per_node) {
        add("train.topology", msg);
        return None;
    }
    let choco = match compression {
        Some(c) => Some(choco_plan(t, c, world, ranks_per_node, add)?),
        None => None,
    };
    Some(SyncPlan::Gossip {
        topology,
        overlap: t.overlap.unwrap_or(false),
        ranks_per_node,
        choco,
    })
}

/// Compressed gossip's rules: CHOCO's compressors only, no error feedback (the public copies are the
/// memory); the consensus step as given, CHOCO's default, or tuned for "auto".
fn choco_plan(
    t: &super::TrainConfig,
    c: &Compression,
    world: usize,
    ranks_per_node: usize,
    add: &mut dyn FnMut(&str, String),
) -> Option<ChocoPlan> {
    use super::backend::ConsensusStep;
    let compressor = match c {
        Compression::TopK(k) => {
            if k.error_feedback.is_some() {
                add(
                    "train.compression.error_feedback",
                    "error_feedback does not apply to compressed gossip: CHOCO's public copies are its \
                     memory (what a worker has not sent stays in x - x_hat and goes out in later rounds); \
                     remove the key"
                        .into(),
                );
                return None;
            }
            Compressor::TopK { density: k.density }
        }
        Compression::RandomK(r) => Compressor::RandomK { density: r.density },
        Compression::Qsgd(q) => Compressor::Qsgd {
            levels: q.levels,
            biased: q.biased,
            bucket: q.bucket,
        },
        Compression::Sign(_) => Compressor::Sign,
        Compression::Radius(_) | Compression::PowerSgd(_) => {
            add(
                "train.compression.name",
                format!(
                    "compressor {:?} reduces gradients (backend = \"pytorchddp\" or \"diloco\"); compressed \
                     gossip (backend = \"decentdp\", CHOCO) takes \"topk\", \"randomk\", \"qsgd\" or \"sign\"",
                    c.name()
                ),
            );
            return None;
        }
    };
    let (gamma, tuned) = match c.consensus_step() {
        Some(ConsensusStep::Value(g)) => (g, false),
        None => (crate::sync::choco::DEFAULT_GAMMA, false),
        Some(ConsensusStep::Auto(_)) => {
            let rounds = crate::sync::topology::rounds(
                t.topology.unwrap_or_default(),
                world,
                ranks_per_node,
            );
            match rounds.and_then(|r| crate::sync::choco::tune_gamma(&r, compressor, t.seed)) {
                Ok(g) => (g, true),
                Err(e) => {
                    add("train.compression.consensus_step", format!("{e:#}"));
                    return None;
                }
            }
        }
    };
    Some(ChocoPlan {
        compressor,
        gamma,
        tuned,
        seed: t.seed,
    })
}

/// DiLoCo's rules: fragments divide sync_every, the delay fits a period, compression only of whole-model
/// f32 pseudo-gradients.
fn diloco_plan(
    t: &super::TrainConfig,
    reducer: Option<ReducerPlan>,
    add: &mut dyn FnMut(&str, String),
) -> SyncPlan {
    let cfg = t.diloco.clone().unwrap_or_default();
    let (h, f) = (cfg.sync_every, cfg.fragments);
    if h % f != 0 {
        add(
            "train.diloco.fragments",
            format!("fragments = {f} must divide sync_every = {h} (each fragment syncs every {h} steps, one every {h}/{f})"),
        );
    } else if cfg.fragment_delay >= h / f {
        add(
            "train.diloco.fragment_delay",
            format!(
                "fragment_delay = {} must be smaller than sync_every / fragments = {}: a fragment's all-reduce \
                 must land before the next fragment starts",
                cfg.fragment_delay,
                h / f
            ),
        );
    }
    if f == 1 && (cfg.fragment_delay > 0 || cfg.fragment_alpha > 0.0) {
        add(
            "train.diloco.fragments",
            "fragment_delay and fragment_alpha are streaming DiLoCo settings: they need fragments > 1".into(),
        );
    }
    if let Some(r) = &reducer {
        if f > 1 || cfg.quantize != Quantize::None {
            add(
                "train.compression",
                "[train.compression] compresses whole-model pseudo-gradients: it needs diloco.fragments = 1 \
                 and diloco.quantize = \"none\""
                    .into(),
            );
        }
        if matches!(
            r,
            ReducerPlan::Radius {
                correction: Some(_),
                ..
            }
        ) {
            add(
                "train.compression.correction",
                "correction runs Adam on gradients inside the reducer; DiLoCo's outer optimizer is SGD".into(),
            );
        }
    }
    SyncPlan::Diloco { cfg, reducer }
}

/// DeMo replaces the optimizer: it takes train.optim = "sgd" for its weight decay alone.
fn demo_plan(t: &super::TrainConfig, add: &mut dyn FnMut(&str, String)) -> SyncPlan {
    let cfg = t.demo.clone().unwrap_or_default();
    let weight_decay = match &t.optim {
        OptimConfig::Sgd(s) => {
            if s.momentum != 0.0 || s.nesterov {
                add(
                    "train.optim.momentum",
                    "DeMo keeps its own momentum (train.demo.decay); train.optim.momentum and nesterov must be \
                     unset (DeMo uses train.optim.weight_decay and the lr schedule only)"
                        .into(),
                );
            }
            s.weight_decay
        }
        other => {
            add(
                "train.optim.name",
                format!(
                    "backend = \"demo\" replaces the optimizer with its sign update and uses only the weight decay \
                     and the lr schedule: set train.optim.name = \"sgd\" (with weight_decay), found {:?}",
                    other.name()
                ),
            );
            0.0
        }
    };
    SyncPlan::Demo {
        cfg,
        weight_decay,
        clip: t.grad_norm_clip,
    }
}

//! The run's plan: a validated config and its launch environment resolved into everything a run needs
//! (engine, world, batches, each backend's settings with their defaults and cross-field rules). It sits
//! above the modules whose types it fills in (`sync`'s `SyncPlan`, the model's sizes), so `config` stays
//! wire types and validation. `lines` renders what `check` prints of the synchronisation.

pub mod gamma;
mod launch;
mod lines;
pub mod membership;
mod rules;

use std::fmt;
use std::path::{Path, PathBuf};

use crate::config::backend::Engine;
use crate::config::batch::BatchSchedule;
use crate::config::tree::Node;
use crate::config::{validate, Config, ConfigError, Problem};
use crate::model::matmul::{CpuAmp, Precision};
pub use crate::sync::plan::{Correction, ReducerPlan, SyncPlan};
pub use launch::LaunchEnv;
pub use lines::{described, sync_lines};

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
    /// What was decided from the machine rather than the config (see `Decisions`).
    pub decisions: Decisions,
    /// Who takes part in each step, when workers leave and come back (`[train.membership]`).
    pub membership: Option<membership::Membership>,
}

/// What the plan decides from the machine rather than the config, so that it is decided once: rank 0's
/// decisions are every rank's (`train` broadcasts them), and a checkpoint's manifest records them for
/// every resume.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Decisions {
    /// `train.amp` on the CPU engine: its linear layers and lm head in bf16 (only where this CPU's bf16
    /// products outrun its f32 ones), else f32.
    pub cpu_bf16: bool,
    /// The rate of the CPU's bf16 products (AMX or vdpbf16ps) over its f32 FMA that decided it; None: no
    /// AVX512-BF16.
    pub cpu_bf16_rate: Option<f64>,
}

impl Decisions {
    /// The CPU engine's precision of its linear layers and lm head.
    pub fn cpu_precision(&self) -> Precision {
        match self.cpu_bf16 {
            true => Precision::Bf16,
            false => Precision::F32,
        }
    }
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
        if self.decisions.cpu_bf16 {
            writeln!(
                f,
                "CPU precision     bf16 linear layers, attention and lm head (train.amp; decided once: {})",
                match self.decisions.cpu_bf16_rate {
                    Some(r) => format!("bf16 products at {r:.2}x the f32 FMA's FLOP/s"),
                    None => "recorded".into(),
                }
            )?;
        }
        write!(
            f,
            "total tokens      {:.3e} over {} steps",
            self.tokens_before(self.n_steps) as f64,
            self.n_steps
        )
    }
}

/// A loaded, validated config with its resolved plan.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub path: PathBuf,
    pub config: Config,
    pub plan: Plan,
    /// Things accepted but worth saying once at start (flags without meaning here, degenerate topologies).
    pub notes: Vec<String>,
}

/// Loads `path`, applies `--set` overrides, validates everything and resolves the plan for `launch`.
pub fn load(path: &Path, overrides: &[String], launch: &LaunchEnv) -> Result<Loaded, ConfigError> {
    let fail = |problems: Vec<Problem>| ConfigError {
        file: path.display().to_string(),
        problems,
    };
    let src = std::fs::read_to_string(path).map_err(|e| {
        let hint = if path.join("config.toml").is_file() {
            format!(
                "; it is a run directory: pass its config, {}",
                path.join("config.toml").display()
            )
        } else if path.is_dir() {
            "; expected a TOML file".to_string()
        } else {
            String::new()
        };
        fail(vec![Problem {
            path: String::new(),
            origin: Some(crate::config::tree::Origin::Document),
            message: format!("cannot read the file: {e}{hint}"),
        }])
    })?;
    load_str(path, &src, overrides, launch)
}

/// As [`load`], for a document already in memory (`path` names it in messages).
pub fn load_str(
    path: &Path,
    src: &str,
    overrides: &[String],
    launch: &LaunchEnv,
) -> Result<Loaded, ConfigError> {
    let fail = |problems: Vec<Problem>| ConfigError {
        file: path.display().to_string(),
        problems,
    };
    let (config, doc) = crate::config::parse(src, overrides).map_err(fail)?;
    let (plan, notes) = resolve(&config, &doc, launch).map_err(fail)?;
    Ok(Loaded {
        path: path.to_path_buf(),
        config,
        plan,
        notes,
    })
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
    let (world, local_world) = world(t, doc, engine, launch, &mut problems);
    problems.extend(validate::check_semantics(cfg, doc, world));
    let sync = rules::sync_plan(cfg, doc, world, local_world, &mut problems);
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
    if let Some(s) = sync.as_ref().filter(|_| !t.membership.is_empty()) {
        problems.extend(membership::problems(doc, engine, s));
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
    notes.extend(default_step_note(t, &sync, world));
    notes.extend(key_notes(t, doc, launch));
    let local = t.local_batch(world);
    let accum = t.global_batch_size / (local * world);
    // config::parse checked the ramp-up's own rules.
    let batches = BatchSchedule::of(t.global_batch_size as u64, t.rampup_batch_size)
        .map_err(|e| vec![validate::problem_at(doc, "train.rampup_batch_size", e)])?;
    let (threads, compute_slots) = threads(t, engine, world, launch.cores.max(1));
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
        decisions: Decisions {
            // The CPU engine's (a CUDA run multiplies in bf16 on the GPU under amp).
            cpu_bf16: t.device != crate::config::Device::Cuda
                && CpuAmp::of(launch.cpu_bf16_rate).precision(t.amp) == Precision::Bf16,
            cpu_bf16_rate: launch.cpu_bf16_rate,
        },
        membership: membership::Membership::of(&t.membership, world, t.n_steps, t.seed),
    };
    if let Some(m) = &plan.membership {
        notes.push(membership_note(m, t.n_steps));
    }
    Ok((plan, notes))
}

/// What `check` says of a membership schedule: how often the workers present change, and the first few
/// changes.
fn membership_note(m: &membership::Membership, n_steps: u64) -> String {
    let changes = m.changes(n_steps);
    let first: Vec<String> = changes
        .iter()
        .take(4)
        .map(|(s, left, back)| {
            let mut what = Vec::new();
            if !left.is_empty() {
                what.push(format!("{left:?} leave"));
            }
            if !back.is_empty() {
                what.push(format!("{back:?} come back"));
            }
            format!("after step {s}: {}", what.join(", "))
        })
        .collect();
    let slow: Vec<String> = (m.slowdown.iter().enumerate())
        .filter(|(_, &s)| s != 1.0)
        .map(|(w, s)| format!("worker {w} x{s}"))
        .collect();
    format!(
        "train.membership: the workers present change {} time(s){}{}{}; simulated clock on {}{}",
        changes.len(),
        if first.is_empty() { "" } else { ": " },
        first.join("; "),
        if changes.len() > 4 { "; ..." } else { "" },
        m.cluster,
        if slow.is_empty() {
            String::new()
        } else {
            format!(", stragglers {}", slow.join(", "))
        }
    )
}

/// The world size and ranks per node: the local engine's from `--workers` or the config, a launcher's
/// from its environment (where `--workers`, or a `train.workers` that is not the launcher's world, is a
/// problem).
fn world(
    t: &crate::config::TrainConfig,
    doc: &Node,
    engine: Engine,
    launch: &LaunchEnv,
    problems: &mut Vec<Problem>,
) -> (usize, Option<usize>) {
    match engine {
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
            let world = launch.launcher_world.unwrap_or(1);
            if let Some(w) = t.workers.filter(|&w| w != world) {
                problems.push(validate::problem_at(
                    doc,
                    "train.workers",
                    format!(
                        "train.workers = {w} but the launcher started {world} rank(s); launch {w} \
                         (mpirun -np {w} / srun -n {w}), or set train.workers = {world} \
                         (--set train.workers={world}) or remove the key"
                    ),
                ));
            }
            (world, t.ranks_per_node.or(launch.launcher_local_world))
        }
    }
}

/// Compute threads per worker (`train.threads`, else on the local engine the cores shared by its
/// workers) and the compute slots of this process.
fn threads(
    t: &crate::config::TrainConfig,
    engine: Engine,
    world: usize,
    cores: usize,
) -> (Option<usize>, usize) {
    let threads = t.threads.or(match engine {
        Engine::Local | Engine::Auto => Some((cores / world).max(1)),
        Engine::Mpi | Engine::Nccl => None,
    });
    let compute_slots = match (engine, threads) {
        (Engine::Local | Engine::Auto, Some(threads)) => (cores / threads).clamp(1, world),
        _ => 1,
    };
    (threads, compute_slots)
}

/// Notes on keys as the run takes them: sample counts as the steps they became (config::parse converted
/// them), and keys that have no effect here.
fn key_notes(t: &crate::config::TrainConfig, doc: &Node, launch: &LaunchEnv) -> Vec<String> {
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
        if let Some(node) = crate::config::tree::find(doc, key) {
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
    if t.amp && t.device == crate::config::Device::Cpu {
        notes.push(format!(
            "train.amp = true on CPU: {}",
            CpuAmp::of(launch.cpu_bf16_rate)
        ));
    }
    notes
}

/// A note when CHOCO runs at its default consensus step (none given) and the consensus simulated at that
/// step (`sync::choco::consensus_growth`, as "auto" tunes) does not contract for this compressor,
/// topology and world: training at it can diverge (random-k 10% on `exp` at 8 ranks did).
fn default_step_note(
    t: &crate::config::TrainConfig,
    sync: &SyncPlan,
    world: usize,
) -> Option<String> {
    let SyncPlan::Gossip {
        topology,
        ranks_per_node,
        choco: Some(c),
        ..
    } = sync
    else {
        return None;
    };
    if c.tuned || t.compression.as_ref()?.consensus_step().is_some() {
        return None;
    }
    let rounds = crate::sync::topology::rounds(*topology, world, *ranks_per_node).ok()?;
    let growth =
        crate::sync::choco::consensus_growth(&rounds, c.compressor, c.seed, c.gamma).ok()?;
    (growth >= 1.0).then(|| {
        format!(
            "train.compression.consensus_step is not set: at CHOCO's default {} the consensus of {} on {:?} \
             with {world} ranks does not contract (simulated as \"auto\" tunes it, its error after {} steps \
             {}), and training at it can diverge; set consensus_step = \"auto\" to tune it, or a smaller value",
            c.gamma,
            c.compressor.describe(),
            topology.name(),
            crate::sync::choco::TUNE_ITERS,
            if growth.is_finite() {
                format!("is {growth:.2e} times its start")
            } else {
                "grew without bound".into()
            }
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_of(src: &str, launch: &LaunchEnv) -> Plan {
        load_str(Path::new("t.toml"), src, &[], launch)
            .unwrap_or_else(|e| panic!("{e}"))
            .plan
    }

    /// Resolving reads nothing but its inputs: the same config and launch give the same plan, and the
    /// CPU precision under `train.amp` follows the launch's bf16 rate alone (bf16 from 1.3x the f32
    /// FMA's FLOP/s; never without amp, on CUDA, or without AVX512-BF16).
    #[test]
    fn the_plan_is_a_function_of_the_config_and_the_launch() {
        let cpu = "[train]\namp = true\ndevice = \"cpu\"\nthreads = 1\n";
        let launch = |rate: Option<f64>| LaunchEnv {
            workers_flag: Some(2),
            cores: 3,
            cpu_bf16_rate: rate,
            ..LaunchEnv::default()
        };
        let a = plan_of(cpu, &launch(Some(2.0)));
        assert_eq!(a, plan_of(cpu, &launch(Some(2.0))));
        assert_eq!(
            a.compute_slots, 2,
            "3 cores of one thread each, for 2 workers"
        );
        for (src, rate, bf16) in [
            (cpu, Some(2.0), true),
            (cpu, Some(1.29), false),
            (cpu, None, false),
            ("[train]\namp = false\ndevice = \"cpu\"\n", Some(2.0), false),
            ("[train]\namp = true\ndevice = \"cuda\"\n", Some(2.0), false),
        ] {
            let d = plan_of(src, &launch(rate)).decisions;
            assert_eq!(
                (d.cpu_bf16, d.cpu_bf16_rate),
                (bf16, rate),
                "{src} at {rate:?}"
            );
        }
        assert!(a
            .to_string()
            .contains("bf16 linear layers, attention and lm head"));
    }

    /// CHOCO at its default consensus step gets a note where the consensus simulated at that step does not
    /// contract (random-k 10% on exp at 8 ranks, the run that diverged: its error grows ~1e38-fold; top-k 10%
    /// on a ring: ~460-fold), and none where it contracts (top-k 10% on exp: ~1e-2) or where the step is
    /// given.
    #[test]
    fn choco_at_a_default_step_that_does_not_contract_is_noted() {
        let launch = LaunchEnv {
            workers_flag: Some(8),
            cores: 2,
            ..LaunchEnv::default()
        };
        let notes = |topology: &str, compression: &str| {
            let src = format!(
                "[train]\nbackend = \"decentdp\"\ntopology = \"{topology}\"\nglobal_batch_size = 8\n\
                 compression = {compression}\n"
            );
            let loaded = load_str(Path::new("t.toml"), &src, &[], &launch);
            let notes = loaded.unwrap_or_else(|e| panic!("{e}")).notes;
            notes
                .into_iter()
                .filter(|n| n.contains("consensus_step is not set"))
                .collect::<Vec<_>>()
        };
        let random_k = notes("exp", r#"{ name = "randomk", density = 0.1 }"#);
        assert_eq!(random_k.len(), 1, "{random_k:?}");
        for part in [
            "default 0.9",
            "random-k density 0.1",
            "\"exp\"",
            "8 ranks",
            "\"auto\"",
        ] {
            assert!(random_k[0].contains(part), "{part} in {}", random_k[0]);
        }
        let given = r#"{ name = "randomk", density = 0.1, consensus_step = 0.9 }"#;
        assert_eq!(notes("exp", given), Vec::<String>::new());
        let top_k = r#"{ name = "topk", density = 0.1 }"#;
        assert_eq!(notes("ring", top_k).len(), 1);
        assert_eq!(notes("exp", top_k), Vec::<String>::new());
    }

    /// Under a launcher the world is the launcher's: a `train.workers` that says otherwise is a problem
    /// naming both numbers, its line and the fix; one that agrees (or none) plans that world.
    #[test]
    fn a_launchers_world_that_is_not_train_workers_is_refused() {
        let mpirun = |n: usize| LaunchEnv {
            launcher_world: Some(n),
            launcher_local_world: Some(n),
            launched_processes: Some(n),
            ..LaunchEnv::default()
        };
        let src = "[train]\nglobal_batch_size = 8\nworkers = 4\n";
        let err = load_str(Path::new("t.toml"), src, &[], &mpirun(2))
            .expect_err("2 ranks for train.workers = 4")
            .to_string();
        for part in [
            "t.toml:3:",
            "train.workers",
            "= 4",
            "started 2 rank",
            "mpirun -np 4",
        ] {
            assert!(err.contains(part), "{part:?} in {err}");
        }
        assert_eq!(plan_of(src, &mpirun(4)).world_size, 4);
        assert_eq!(
            plan_of("[train]\nglobal_batch_size = 8\n", &mpirun(2)).world_size,
            2
        );
    }
}

//! From a validated config and the launch environment to the numbers a run needs (the `Plan`).

use std::fmt;

use super::backend::{Backend, Engine};
use super::error::Problem;
use super::tree::Node;
use super::{validate, Config};

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

/// The resolved run: everything derived from config + launch environment.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub engine: Engine,
    pub backend: Backend,
    pub world_size: usize,
    /// Ranks per node, when known (the local engine is one node).
    pub local_world_size: Option<usize>,
    pub local_batch_size: usize,
    pub accum_steps: usize,
    pub tokens_per_step: u64,
    pub n_params: u64,
    pub flops_per_token: u64,
    pub n_steps: u64,
}

impl Plan {
    /// Seconds for the whole run at `tokens_per_s`.
    pub fn run_seconds(&self, tokens_per_s: f64) -> f64 {
        (self.tokens_per_step as f64 * self.n_steps as f64) / tokens_per_s
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "engine            {}", self.engine.name())?;
        writeln!(f, "backend           {}", self.backend.name())?;
        writeln!(f, "world size        {}", self.world_size)?;
        if let Some(l) = self.local_world_size {
            writeln!(f, "ranks per node    {l}")?;
        }
        writeln!(f, "local batch       {} sequences", self.local_batch_size)?;
        writeln!(f, "accumulation      {} micro-steps", self.accum_steps)?;
        writeln!(f, "tokens per step   {}", self.tokens_per_step)?;
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
            self.tokens_per_step as f64 * self.n_steps as f64,
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

pub fn resolve(
    cfg: &Config,
    doc: &Node,
    launch: &LaunchEnv,
) -> Result<(Plan, Vec<String>), Vec<Problem>> {
    let t = &cfg.train;
    let mut problems = Vec::new();
    let mut notes = Vec::new();
    let (world, local_world) = match t.engine {
        Engine::Local => {
            if let Some(p) = launch.launched_processes.filter(|&p| p > 1) {
                problems.push(Problem {
                    path: "train.engine".into(),
                    origin: super::tree::find(doc, "train.engine").map(|n| n.origin.clone()),
                    message: format!(
                        "the launcher started {p} processes but the engine is \"local\" (threads of one process), \
                         so every process would train alone; set train.engine = \"mpi\" (--set train.engine=mpi)"
                    ),
                });
            }
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
                        t.engine.name()
                    ),
                });
            }
            (
                launch.launcher_world.unwrap_or(1),
                t.ranks_per_node.or(launch.launcher_local_world),
            )
        }
    };
    problems.extend(validate::check_semantics(cfg, doc, world, local_world));
    if let Some((meta, vocab)) = &launch.data_vocab {
        if cfg.model.vocab_size < *vocab {
            problems.push(Problem {
                path: "model.vocab_size".into(),
                origin: super::tree::find(doc, "model.vocab_size").map(|n| n.origin.clone()),
                message: format!(
                    "vocab_size = {} is smaller than the prepared data's vocabulary of {vocab} tokens ({meta})",
                    cfg.model.vocab_size
                ),
            });
        }
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    if t.backend == Backend::DecentDp && world == 1 {
        notes.push(format!(
            "train.topology {:?} with one worker: gossip degenerates to local training",
            t.topology.unwrap_or_default().name()
        ));
    }
    if t.compile {
        notes.push(
            "train.compile = true has no meaning for nanodist (no torch.compile): ignored".into(),
        );
    }
    if t.amp && t.device == super::train::Device::Cpu {
        notes.push(
            "train.amp = true: mixed precision applies to CUDA only; training in f32 on CPU".into(),
        );
    }
    let local = t.local_batch_size.unwrap_or(t.global_batch_size / world);
    let accum = t.global_batch_size / (local * world);
    let plan = Plan {
        engine: t.engine,
        backend: t.backend,
        world_size: world,
        local_world_size: local_world,
        local_batch_size: local,
        accum_steps: accum,
        tokens_per_step: (t.global_batch_size * t.context_length) as u64,
        n_params: cfg.model.n_params(t.context_length),
        flops_per_token: cfg.model.flops_per_token(t.context_length),
        n_steps: t.n_steps,
    };
    Ok((plan, notes))
}

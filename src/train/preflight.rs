//! Everything that decides whether a run can start, beyond the config's own rules (those are in
//! `config::load`): the build's features for the engine and device, the device itself, the data files
//! and the checkpoint to start from. `check`, `sbatch` (also `--dry-run`) and `train` call this one
//! function, so they cannot disagree; `train` creates nothing before it has passed.

use std::path::Path;

use anyhow::Result;

use super::checkpoint;
use crate::bad_input;
use crate::config::{CheckpointMode, Device, Engine};
use crate::data::{Blend, Split};
use crate::plan::Loaded;

/// Where the run will happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Host {
    /// On this machine, with this binary (`check`, `train`): the device is probed too.
    Here,
    /// In a Slurm job on other nodes; `own_binary`: the job runs this binary, so its features count.
    Job { own_binary: bool },
}

/// The opened data of a run that may start.
pub struct Ready {
    pub train_data: Blend,
    pub val_data: Blend,
    /// The checkpoint named by `checkpoint = ...`, verified and compatible with the config.
    pub source: Option<(std::path::PathBuf, CheckpointMode)>,
}

/// Checks that `loaded` can run on `host`; returns its data, opened and validated.
pub fn check(loaded: &Loaded, host: Host) -> Result<Ready> {
    let (cfg, plan) = (&loaded.config, &loaded.plan);
    let own_binary = match host {
        Host::Here => true,
        Host::Job { own_binary } => own_binary,
    };
    if own_binary {
        build_supports(plan.engine, cfg.train.device, plan.world_size)?;
    }
    if host == Host::Here {
        crate::device::check(cfg.train.device)?;
        fits_in_memory(loaded)?;
    }
    let sample_len = cfg.train.context_length + 1;
    let train_data = Blend::open(cfg, Split::Train, sample_len, cfg.model.vocab_size)?;
    let val_data = Blend::open(cfg, Split::Val, sample_len, cfg.model.vocab_size)?;
    let source = match &cfg.checkpoint {
        Some(p) => {
            let dir = checkpoint::require(Path::new(p))?;
            compatible(loaded, &dir, Source::Named(cfg.checkpoint_mode), &[])?;
            Some((dir, cfg.checkpoint_mode))
        }
        None => None,
    };
    Ok(Ready {
        train_data,
        val_data,
        source,
    })
}

/// Config keys a resume may change freely: logging and evaluation, and how this invocation runs (not what
/// it computes). The device is one: checkpoints hold host copies of the same buffers on CPU and GPU, so a
/// CUDA run resumes on CPU and the other way round (with the other device's arithmetic from there on).
const FREE_TO_CHANGE: [&str; 11] = [
    "log.",
    "checkpoint",
    "checkpoint_mode",
    "in_memory",
    "train.exit_interval",
    "train.exit_duration_mins",
    "train.threads",
    "train.comm_timeout_secs",
    "train.engine",
    "train.workers",
    "train.device",
];

/// Whether `key` is `pattern` or lies under it (`pattern` = "train.optim" covers "train.optim.betas").
fn covers(pattern: &str, key: &str) -> bool {
    key == pattern
        || pattern.ends_with('.') && key.starts_with(pattern)
        || key.starts_with(&format!("{pattern}."))
}

/// An exact resume continues the run the checkpoint belongs to: every key that changes what it computes
/// must be the same, unless `allow` names it (`--allow-config-change`).
fn resume_changes(
    loaded: &Loaded,
    theirs: &crate::config::Config,
    step: u64,
    dir: &Path,
    allow: &[String],
) -> Result<()> {
    let refused: Vec<(String, String, String)> = crate::config::diff(theirs, &loaded.config)
        .into_iter()
        .filter(|(k, _, _)| !FREE_TO_CHANGE.iter().any(|p| covers(p, k)))
        .filter(|(k, _, _)| !allow.iter().any(|p| covers(p, k)))
        .collect();
    if refused.is_empty() {
        return Ok(());
    }
    let mut lines: Vec<String> = refused
        .iter()
        .map(|(k, a, b)| format!("  {k}: {a} in the checkpoint, {b} now"))
        .collect();
    let (t0, t1) = (&theirs.train, &loaded.config.train);
    let (lr0, lr1) = (
        crate::optim::lr_at(&t0.lr_schedule, step, t0.n_steps),
        crate::optim::lr_at(&t1.lr_schedule, step, t1.n_steps),
    );
    if lr0 != lr1 {
        lines.push(format!(
            "  (the learning rate at step {step} would jump from {lr0:.3e} to {lr1:.3e}: the schedule's decay \
             ends at train.lr_schedule.decay_steps, by default train.n_steps)"
        ));
    }
    let keys: Vec<&str> = refused.iter().map(|(k, _, _)| k.as_str()).collect();
    Err(bad_input!(
        "{}: resuming this run (step {step}) with a changed config would continue it under other settings:\n{}\n\
         restore the checkpoint's values, start over in a new run directory with `nanodist train --fresh`, \
         or accept the change with --allow-config-change {}",
        dir.display(),
        lines.join("\n"),
        keys.join(" ")
    ))
}

/// What a checkpoint is to this run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The run's own newest checkpoint: the run continues, so its config must not change (but for the
    /// keys that are free to change, or that `--allow-config-change` names).
    OwnRun,
    /// `checkpoint = ...` named by the config: a new run starting from it in `checkpoint_mode`, whose
    /// config may differ on purpose (e.g. a dense run continued with compression).
    Named(CheckpointMode),
}

/// A checkpoint this run can start from: the same model; for a full-state start the same world size;
/// for its own run the same config as above.
pub fn compatible(loaded: &Loaded, dir: &Path, source: Source, allow: &[String]) -> Result<()> {
    let mode = match source {
        Source::OwnRun => CheckpointMode::Full,
        Source::Named(m) => m,
    };
    let manifest = checkpoint::read_manifest(dir)?;
    let (theirs, _) = crate::config::parse(&manifest.config, &[]).map_err(|p| {
        bad_input!(
            "{}: the manifest's config does not parse: {}",
            dir.display(),
            p.first().map_or(String::new(), |p| p.message.clone())
        )
    })?;
    let ours = &loaded.config;
    let diff = crate::config::model_diff(&theirs, ours);
    if !diff.is_empty() {
        return Err(bad_input!(
            "{}: the checkpoint's model differs from this config's: {}; train this model in a new run \
             directory (log.run_name), or restore the checkpoint's values",
            dir.display(),
            diff.join(", ")
        ));
    }
    if source == Source::OwnRun {
        resume_changes(loaded, &theirs, manifest.step, dir, allow)?;
    }
    if mode == CheckpointMode::Full && manifest.world_size != loaded.plan.world_size {
        return Err(bad_input!(
            "{}: written by {} rank(s), this run has {}; an exact resume needs the same world size \
             (to start from its weights instead, set checkpoint = \"{}\" and checkpoint_mode = \"weights\" in a new run)",
            dir.display(),
            manifest.world_size,
            loaded.plan.world_size,
            dir.display()
        ));
    }
    Ok(())
}

/// The local engine's workers on CPU fit in this machine's memory (see `memory`): a run that cannot is
/// refused with the numbers, before the kernel would kill it halfway.
fn fits_in_memory(loaded: &Loaded) -> Result<()> {
    let (cfg, plan) = (&loaded.config, &loaded.plan);
    if plan.engine != Engine::Local || cfg.train.device != Device::Cpu {
        return Ok(());
    }
    let need = super::memory::estimate(cfg, plan);
    let Some(have) = super::memory::available()? else {
        return Ok(());
    };
    if need.peak() <= have {
        return Ok(());
    }
    let fit = have.saturating_sub(need.shared()) / need.per_worker().max(1);
    let fewer = match fit {
        0 => String::new(),
        n => format!("at most {n} workers here (--workers, train.workers), "),
    };
    Err(bad_input!(
        "{}: {} local worker(s) need about {} of memory ({need}), and {} is available (MemAvailable \
         within the cgroup's limit, or $NANODIST_MEMORY_GB); run {fewer}a smaller model or batch, or \
         the MPI engine across nodes",
        loaded.path.display(),
        plan.world_size,
        crate::units::bytes(need.peak() as f64),
        crate::units::bytes(have as f64),
    ))
}

/// Whether this build can run `engine` on `device`.
fn build_supports(engine: Engine, device: Device, world: usize) -> Result<()> {
    if engine == Engine::Mpi && !cfg!(feature = "mpi") {
        return Err(bad_input!(
            "train.engine = \"mpi\" ({world} ranks): this nanodist was built without MPI; rebuild with \
             `cargo build --release --features mpi` (needs libopenmpi-dev and libclang-dev)"
        ));
    }
    if engine == Engine::Nccl && !cfg!(feature = "cuda") {
        return Err(bad_input!(
            "train.engine = \"nccl\": this nanodist was built without CUDA support; rebuild with \
             `cargo build --release --features cuda,mpi` on a machine with the CUDA toolkit and NCCL"
        ));
    }
    if device == Device::Cuda && !cfg!(feature = "cuda") {
        return Err(bad_input!(
            "train.device = \"cuda\": this nanodist was built without CUDA support; rebuild with \
             `cargo build --release --features cuda`, or use device = \"cpu\""
        ));
    }
    Ok(())
}

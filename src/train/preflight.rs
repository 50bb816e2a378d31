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

/// Checks that `loaded` can run on `host`; returns its data, opened and validated. Every problem is
/// found (see `survey`) and returned at once (`all_of`).
pub fn check(loaded: &Loaded, host: Host) -> Result<Ready> {
    let (ready, problems) = survey(loaded, host);
    all_of(problems)?;
    Ok(ready.expect("the data of a run without problems"))
}

/// Ok without problems; one problem as it is; several as one error that lists them all.
pub fn all_of(mut problems: Vec<anyhow::Error>) -> Result<()> {
    match problems.len() {
        0 => Ok(()),
        1 => Err(problems.remove(0)),
        n => Err(bad_input!(
            "{n} problems:\n{}",
            problems
                .iter()
                .map(|e| format!("  - {e:#}"))
                .collect::<Vec<_>>()
                .join("\n")
        )),
    }
}

/// Every reason `loaded` cannot start on `host`, each checked on its own (data that is missing does not
/// hide an engine this build lacks), and the opened data when there is none.
pub fn survey(loaded: &Loaded, host: Host) -> (Option<Ready>, Vec<anyhow::Error>) {
    let (cfg, plan) = (&loaded.config, &loaded.plan);
    let own_binary = match host {
        Host::Here => true,
        Host::Job { own_binary } => own_binary,
    };
    let mut problems = Vec::new();
    if own_binary {
        problems.extend(build_supports(plan.engine, cfg.train.device, plan.world_size).err());
    }
    if host == Host::Here {
        problems.extend(crate::device::check(cfg.train.device).err());
        problems.extend(fits_in_memory(loaded).err());
    }
    if let Some(m) = &plan.membership {
        let profile = crate::predict::profile::load(&m.cluster);
        problems.extend(profile.err().map(|e| {
            bad_input!(
                "train.membership.cluster = {:?}, the simulated clock's: {e:#}",
                m.cluster
            )
        }));
    }
    let sample_len = cfg.train.context_length + 1;
    let mut open = |split| {
        Blend::open(cfg, split, sample_len, cfg.model.vocab_size)
            .map_err(|e| problems.push(e))
            .ok()
    };
    let (train_data, val_data) = (open(Split::Train), open(Split::Val));
    let source = match &cfg.checkpoint {
        Some(p) => {
            let named = checkpoint::require(Path::new(p)).and_then(|dir| {
                compatible(loaded, &dir, Source::Named(cfg.checkpoint_mode), &[])?;
                Ok((dir, cfg.checkpoint_mode))
            });
            named.map_err(|e| problems.push(e)).ok()
        }
        None => None,
    };
    let ready = match (train_data, val_data) {
        (Some(train_data), Some(val_data)) if problems.is_empty() => Some(Ready {
            train_data,
            val_data,
            source,
        }),
        _ => None,
    };
    (ready, problems)
}

/// Config keys a resume may change freely: logging and evaluation, and how this invocation runs (not what
/// it computes). The device is one: checkpoints hold host copies of the same buffers on CPU and GPU, so a
/// CUDA run resumes on CPU and the other way round (with the other device's arithmetic from there on).
const FREE_TO_CHANGE: [&str; 12] = [
    "log.",
    "checkpoint",
    "checkpoint_mode",
    "in_memory",
    "prefetch",
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
        n => format!("; or at most {n} workers here (--workers, train.workers)"),
    };
    let smaller = match largest_batch_that_fits(loaded, have) {
        Some((b, accum)) => format!(
            "train.local_batch_size = {b} fits, with {accum} accumulation step(s) for the same global \
             batch (--set train.local_batch_size={b}): the same experiment"
        ),
        None => "not even train.local_batch_size = 1 fits: a smaller model".into(),
    };
    Err(bad_input!(
        "{}: {} local worker(s) need about {} of memory ({need}), and {} is available (MemAvailable \
         within the cgroup's limit, or $NANODIST_MEMORY_GB); {smaller}{fewer}; or the MPI engine \
         across nodes",
        loaded.path.display(),
        plan.world_size,
        crate::units::bytes(need.peak() as f64),
        crate::units::bytes(have as f64),
    ))
}

/// The largest micro-batch below the plan's that fits in `have` bytes, and its accumulation steps for the
/// global batch: a divisor of the plan's micro-batch, so that it divides every step's share under a
/// ramp-up too.
fn largest_batch_that_fits(loaded: &Loaded, have: u64) -> Option<(usize, usize)> {
    let (cfg, plan) = (&loaded.config, &loaded.plan);
    let share = plan.local_batch_size * plan.accum_steps;
    (1..plan.local_batch_size)
        .rev()
        .filter(|b| plan.local_batch_size % b == 0)
        .find(|&b| {
            let mut smaller = plan.clone();
            smaller.local_batch_size = b;
            smaller.accum_steps = share / b;
            super::memory::estimate(cfg, &smaller).peak() <= have
        })
        .map(|b| (b, share / b))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A refusal for memory names the largest micro-batch that fits (a divisor of the planned one) and
    /// its accumulation for the same global batch: with room for a micro-batch of 2 of the planned 8, 2
    /// with 4 steps; with room for less than 1, none.
    #[test]
    fn the_largest_micro_batch_that_fits_keeps_the_global_batch() {
        let src = "[train]\nglobal_batch_size = 32\nlocal_batch_size = 8\ncontext_length = 256\n\
                   [model]\nn_layers = 2\nn_heads = 2\nn_embd = 64\nvocab_size = 64\n";
        let launch = crate::plan::LaunchEnv {
            workers_flag: Some(4),
            ..crate::plan::LaunchEnv::default()
        };
        let loaded = crate::plan::load_str(Path::new("t.toml"), src, &[], &launch).unwrap();
        assert_eq!(
            (loaded.plan.local_batch_size, loaded.plan.accum_steps),
            (8, 1)
        );
        let peak_at = |b: usize| {
            let mut plan = loaded.plan.clone();
            (plan.local_batch_size, plan.accum_steps) = (b, 8 / b);
            super::super::memory::estimate(&loaded.config, &plan).peak()
        };
        assert!(peak_at(4) > peak_at(2) && peak_at(2) > peak_at(1));
        assert_eq!(largest_batch_that_fits(&loaded, peak_at(2)), Some((2, 4)));
        assert_eq!(
            largest_batch_that_fits(&loaded, peak_at(4) - 1),
            Some((2, 4))
        );
        assert_eq!(largest_batch_that_fits(&loaded, peak_at(1) - 1), None);
    }
}

//! Everything that decides whether a run can start, beyond the config's own rules (those are in
//! `config::load`): the build's features for the engine and device, the device itself, the data files
//! and the checkpoint to start from. `check`, `sbatch` (also `--dry-run`) and `train` call this one
//! function, so they cannot disagree; `train` creates nothing before it has passed.

use std::path::Path;

use anyhow::Result;

use super::checkpoint;
use crate::bad_input;
use crate::config::{CheckpointMode, Device, Engine, Loaded};
use crate::data::{Blend, Split};

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
    }
    let sample_len = cfg.train.context_length + 1;
    let train_data = Blend::open(cfg, Split::Train, sample_len, cfg.model.vocab_size)?;
    let val_data = Blend::open(cfg, Split::Val, sample_len, cfg.model.vocab_size)?;
    let source = match &cfg.checkpoint {
        Some(p) => {
            let dir = checkpoint::require(Path::new(p))?;
            compatible(loaded, &dir, cfg.checkpoint_mode)?;
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

/// A checkpoint this run can start from in `mode`: the same model (any mode) and the same world size
/// (an exact resume).
pub fn compatible(loaded: &Loaded, dir: &Path, mode: CheckpointMode) -> Result<()> {
    let manifest = checkpoint::read_manifest(dir)?;
    let (theirs, _) = crate::config::parse(&manifest.config, &[]).map_err(|p| {
        bad_input!(
            "{}: the manifest's config does not parse: {}",
            dir.display(),
            p.first().map_or(String::new(), |p| p.message.clone())
        )
    })?;
    let ours = &loaded.config;
    let mut diff = crate::config::model_diff(&theirs, ours);
    if !diff.is_empty() {
        diff.sort();
        return Err(bad_input!(
            "{}: the checkpoint's model differs from this config's: {}; train this model in a new run \
             directory (log.run_name), or restore the checkpoint's values",
            dir.display(),
            diff.join(", ")
        ));
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

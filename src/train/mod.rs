//! Training: the preflight (`preflight`), one `Worker` per rank (`worker`: the loop), checkpoints,
//! the console, signals and injected faults. `run` checks everything a run needs before it creates
//! anything, connects the engine, and starts the workers.

pub mod checkpoint;
pub mod clock;
mod compute;
mod console;
mod engine;
pub mod fault;
pub mod lock;
pub mod memory;
pub mod preflight;
mod replica;
pub mod signals;
mod worker;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::comm::Communicator;
use crate::config::{CheckpointMode, Config, Engine};
use crate::data::format::write_atomic;
use crate::data::Blend;
use crate::plan::Loaded;
use signals::StopFlag;
use worker::Worker;

/// Why a run stopped.
#[derive(Debug, Clone, PartialEq)]
pub enum Exit {
    Finished,
    ExitInterval,
    ExitDuration,
    Signal(&'static str),
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Finished => write!(f, "finished"),
            Exit::ExitInterval => write!(f, "stopped at train.exit_interval"),
            Exit::ExitDuration => write!(f, "stopped at train.exit_duration_mins"),
            Exit::Signal(s) => write!(f, "stopped by {s} after saving a checkpoint"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Summary {
    pub run_dir: PathBuf,
    pub step: u64,
    pub last_val_loss: Option<f64>,
    pub exit: Exit,
    /// Bytes this rank sent in this run (since it started or resumed), bookkeeping included (loss means,
    /// exit votes, evaluations, checkpoints), as its engine counted them.
    pub bytes_sent: u64,
}

/// The run directory: log_dir/<run_name | $SLURM_ARRAY_JOB_ID | $SLURM_JOB_ID | start time>.
/// `started` is the job's start time (the same on every rank of a multi-process job).
pub fn run_dir(cfg: &Config, started: std::time::SystemTime) -> PathBuf {
    let name = cfg
        .log
        .run_name
        .clone()
        .or_else(|| std::env::var("SLURM_ARRAY_JOB_ID").ok())
        .or_else(|| std::env::var("SLURM_JOB_ID").ok())
        .unwrap_or_else(|| {
            humantime::format_rfc3339_seconds(started)
                .to_string()
                .replace(':', "-")
        });
    Path::new(&cfg.log_dir).join(name)
}

/// `dir` if it does not exist yet, else the first free `dir-2`, `dir-3`, ... (`train --fresh`).
fn fresh_dir(dir: &Path) -> PathBuf {
    if !dir.exists() {
        return dir.to_path_buf();
    }
    let name = dir
        .file_name()
        .map_or("run".into(), |n| n.to_string_lossy().to_string());
    (2..)
        .map(|i| dir.with_file_name(format!("{name}-{i}")))
        .find(|d| !d.exists())
        .unwrap_or_else(|| dir.to_path_buf())
}

/// What every worker shares: config, plan, data (opened once) and the run directory.
pub(crate) struct Setup {
    cfg: Config,
    plan: crate::plan::Plan,
    run_dir: PathBuf,
    train_data: Arc<Blend>,
    val_data: Blend,
    /// The thread that samples every worker's next batches (`prefetch`).
    loader: Option<rayon::ThreadPool>,
    tokenizer: Option<crate::data::Tokenizer>,
    /// The checkpoint to start from and what to take from it.
    source: Option<(PathBuf, CheckpointMode)>,
    stop: StopFlag,
    fault: Option<fault::Fault>,
    /// Where the workers compute: the local engine's slots (cores / threads of them, shared by all its
    /// workers), else this process's rayon pool.
    compute: compute::Compute,
    /// The local engine's one replica, when its workers share it (see `replica`).
    replica: replica::Slot,
    /// Nanoseconds from the command to the start of the first step of this process's last worker to
    /// start one (see `Row::startup_s`).
    first_step_ns: std::sync::atomic::AtomicU64,
    /// The initial weights the local engine's workers copy (see `replica::Initial`).
    initial: replica::Initial,
}

impl Setup {
    /// Whether this process runs several workers, as threads (the local engine).
    fn local_workers(&self) -> bool {
        self.plan.engine == Engine::Local && self.plan.world_size > 1
    }
}

/// How `train` treats an existing run directory.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Config keys that may differ from the run's checkpoint when it resumes (`--allow-config-change`).
    pub allow_config_change: Vec<String>,
    /// Start over in a new run directory instead of resuming (`--fresh`).
    pub fresh: bool,
}

/// Trains as the loaded config says; returns when the run finishes or an exit condition saves and stops it.
pub fn run(loaded: &Loaded) -> Result<Summary> {
    run_with(loaded, &RunOptions::default())
}

/// `run`, with the options of `nanodist train`.
pub fn run_with(loaded: &Loaded, opts: &RunOptions) -> Result<Summary> {
    let (cfg, plan) = (&loaded.config, &loaded.plan);
    let t = &cfg.train;
    // Everything `check` checks, before anything is created.
    let ready = preflight::check(loaded, preflight::Host::Here)?;
    if let Some(n) = t.threads {
        // Ignore the error when a pool already exists (tests run several trainings in one process).
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
    }
    let timeout = std::time::Duration::from_secs_f64(t.comm_timeout_secs);
    // A multi-process engine connects first: the ranks agree on the start time that names the run.
    let mut process_comm = engine::connect(plan, t.device, timeout)?;
    let started = engine::agreed_start(&mut process_comm)?;
    let mut run_dir = run_dir(cfg, started);
    if opts.fresh {
        run_dir = fresh_dir(&run_dir);
    }
    // One job at a time in a run directory, from before its checkpoints are read to the end of the run.
    let _lock = lock_run_dir(&run_dir, &mut process_comm)?;
    // Resume: the run's own newest checkpoint first (a requeued job), else `checkpoint = ...`.
    let source = match checkpoint::find_latest(&run_dir.join("checkpoints"))? {
        Some(dir) => {
            let own = preflight::Source::OwnRun;
            preflight::compatible(loaded, &dir, own, &opts.allow_config_change)?;
            Some((dir, CheckpointMode::Full))
        }
        None => ready.source,
    };
    let mut plan = plan.clone();
    plan.decisions = agree_decisions(&plan, source.as_ref(), &mut process_comm)?;
    std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    // The resolved config records the world that ran (--workers, or the launcher's ranks) and how its
    // ranks were placed (`predict RUN_DIR` prices that layout).
    let mut resolved = cfg.clone();
    resolved.train.workers = Some(plan.world_size);
    resolved.train.ranks_per_node = plan.local_world_size;
    resolved.train.engine = plan.engine;
    write_atomic(&run_dir.join("config.toml"), resolved.to_toml().as_bytes())?;
    // The plan as `check` prints it, with what was decided from the machine.
    write_atomic(&run_dir.join("plan.txt"), format!("{plan}\n").as_bytes())?;
    let on_cpu = crate::device::check(t.device)?.is_none();
    let compute = match plan.threads {
        Some(threads) if plan.engine == Engine::Local && plan.world_size > 1 => {
            compute::Compute::pools(plan.compute_slots, threads, on_cpu)?
        }
        _ => compute::Compute::here(on_cpu),
    };
    let world = plan.world_size;
    let setup = Setup {
        cfg: cfg.clone(),
        plan,
        train_data: Arc::new(ready.train_data),
        val_data: ready.val_data,
        loader: match cfg.prefetch {
            true => Some(crate::data::prefetch::loader().context("starting the batch loader")?),
            false => None,
        },
        tokenizer: crate::data::Meta::read(Path::new(&cfg.data_dir))
            .ok()
            .map(|m| m.tokenizer),
        run_dir,
        source,
        stop: StopFlag::install()?,
        fault: fault::Fault::from_env()?,
        compute,
        replica: replica::Slot::default(),
        first_step_ns: Default::default(),
        initial: Default::default(),
    };
    match (process_comm, world) {
        (Some(comm), _) => Worker::new(&setup, comm)?.train(),
        (None, 1) => Worker::new(&setup, Box::new(crate::comm::Solo))?.train(),
        (None, n) => run_local(Arc::new(setup), n, timeout),
    }
}

/// The run's decisions from the machine (`plan::Decisions`): a resumed checkpoint's recorded ones, else
/// rank 0's (each process probed its own machine), so that every rank and every resume trains alike.
fn agree_decisions(
    plan: &crate::plan::Plan,
    source: Option<&(PathBuf, CheckpointMode)>,
    comm: &mut Option<Box<dyn Communicator>>,
) -> Result<crate::plan::Decisions> {
    if let Some((dir, CheckpointMode::Full)) = source {
        if let Some(recorded) = checkpoint::read_manifest(dir)?.decisions {
            if recorded != plan.decisions {
                tracing::info!(
                    "train.amp on CPU: {} as {} recorded (this machine alone would decide {})",
                    precision_name(recorded.cpu_bf16),
                    dir.display(),
                    precision_name(plan.decisions.cpu_bf16)
                );
            }
            return Ok(recorded);
        }
    }
    let Some(comm) = comm.as_mut() else {
        return Ok(plan.decisions);
    };
    let d = plan.decisions;
    let mut wire = [0.0f32; 4];
    wire[0] = f32::from(d.cpu_bf16);
    wire[1] = f32::from(d.cpu_bf16_rate.is_some());
    wire[2..].copy_from_slice(&crate::comm::pack_u64(
        d.cpu_bf16_rate.unwrap_or(0.0).to_bits(),
    ));
    comm.broadcast(&mut wire, 0)?;
    let rate = f64::from_bits(crate::comm::unpack_u64([wire[2], wire[3]]));
    Ok(crate::plan::Decisions {
        cpu_bf16: wire[0] != 0.0,
        cpu_bf16_rate: (wire[1] != 0.0).then_some(rate),
    })
}

fn precision_name(bf16: bool) -> &'static str {
    match bf16 {
        true => "bf16 linear layers",
        false => "f32",
    }
}

/// Rank 0 takes the run directory's lock (see `lock`); the other ranks of a multi-process job learn
/// whether it did, so that none of them touches a directory that another job holds.
fn lock_run_dir(
    run_dir: &Path,
    comm: &mut Option<Box<dyn Communicator>>,
) -> Result<Option<lock::RunLock>> {
    let rank = comm.as_ref().map_or(0, |c| c.rank());
    let lock = (rank == 0).then(|| lock::RunLock::acquire(run_dir));
    if let Some(c) = comm.as_mut() {
        let mut held = [f32::from(lock.as_ref().is_none_or(Result::is_ok))];
        c.broadcast(&mut held, 0)?;
        if held[0] == 0.0 && rank != 0 {
            return Err(crate::bad_input!(
                "rank 0 could not lock the run directory {} (its message says why)",
                run_dir.display()
            ));
        }
    }
    lock.transpose()
}

/// N workers as threads of this process. A worker that fails or panics marks the group failed, so the
/// others stop at their next collective; one that hangs is named by the others' timeout. The first
/// error is returned once every worker has stopped, or, if some never do, a grace period after it:
/// those threads are abandoned (the process exits after the error) instead of hanging the job.
fn run_local(setup: Arc<Setup>, n: usize, timeout: std::time::Duration) -> Result<Summary> {
    let (tx, rx) = std::sync::mpsc::channel();
    for comm in crate::comm::local::group(n, timeout) {
        let (setup, tx) = (Arc::clone(&setup), tx.clone());
        let rank = comm.rank();
        std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                let failer = comm.failer();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    Worker::new(&setup, Box::new(comm))?.train()
                }))
                .unwrap_or_else(|p| {
                    let why = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    Err(anyhow::anyhow!("worker {rank} panicked: {why}"))
                });
                if let Err(e) = &r {
                    failer.fail(&format!("{e:#}"));
                }
                let _ = tx.send((rank, r));
            })
            .context("starting a worker thread")?;
    }
    drop(tx);
    let mut results: Vec<Option<Result<Summary>>> = (0..n).map(|_| None).collect();
    let mut deadline: Option<Instant> = None;
    while results.iter().any(Option::is_none) {
        let got = match deadline {
            None => rx.recv().ok(),
            Some(d) => rx
                .recv_timeout(d.saturating_duration_since(Instant::now()))
                .ok(),
        };
        let Some((rank, r)) = got else { break };
        if r.is_err() && deadline.is_none() {
            // The others fail at once through the group, or by timeout if they are inside compute.
            deadline = Some(Instant::now() + timeout + std::time::Duration::from_secs(5));
        }
        results[rank] = Some(r);
    }
    let stuck: Vec<usize> = (0..n).filter(|&r| results[r].is_none()).collect();
    // The first error that is not merely another rank reporting a failure wins.
    let mut first_err = None;
    let mut summary = None;
    for r in results.into_iter().flatten() {
        match r {
            Ok(s) if summary.is_none() => summary = Some(s),
            Ok(_) => {}
            Err(e) => {
                let echo = format!("{e:#}").contains("failed: ");
                if first_err
                    .as_ref()
                    .is_none_or(|(was_echo, _)| *was_echo && !echo)
                {
                    first_err = Some((echo, e));
                }
            }
        }
    }
    match (first_err, summary) {
        (Some((_, e)), _) if stuck.is_empty() => Err(e),
        (Some((_, e)), _) => Err(e.context(format!(
            "rank(s) {stuck:?} did not stop after the failure and were abandoned"
        ))),
        (None, Some(s)) => Ok(s),
        (None, None) => Err(anyhow::anyhow!("no worker ran")),
    }
}

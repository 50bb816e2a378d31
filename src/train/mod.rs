//! The training loop. It reads like the algorithm: sample, forward/backward, reduce gradients, clip,
//! step, mix; evaluate, checkpoint and exit on schedule. Everything that differs between algorithms
//! sits behind `SyncBackend`; everything configurable was resolved before the loop starts.

pub mod checkpoint;
pub mod fault;
pub mod signals;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::bad_input;
use crate::comm::Communicator;
use crate::config::{CheckpointMode, Config, Device as DeviceCfg, Engine, Loaded};
use crate::data::format::write_atomic;
use crate::data::{eval_batch, Blend, Sampler, Split};
use crate::metrics::{Row, Tracker};
use crate::model::Gpt;
use crate::optim::{self, Segment};
use crate::sync::SyncBackend;
use checkpoint::Manifest;
use signals::StopFlag;

/// A100 bf16 dense peak, nanoGPT's reference for MFU.
const PEAK_FLOPS: f64 = 312e12;
const DROPOUT_KEY: u64 = 0x6472_6f70; // "drop"

/// Why a run stopped.
#[derive(Debug, Clone, PartialEq)]
pub enum Exit {
    Finished,
    ExitInterval,
    ExitDuration,
    Signal(&'static str),
}

#[derive(Debug, Clone)]
pub struct Summary {
    pub run_dir: PathBuf,
    pub step: u64,
    pub last_val_loss: Option<f64>,
    pub exit: Exit,
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

/// Rank 0's value of `x` on every rank (exact: sent as 16-bit pieces, which f32 holds exactly).
fn broadcast_u64(comm: &mut dyn Communicator, x: u64) -> Result<u64> {
    let mut parts = [
        (x >> 48) as f32,
        ((x >> 32) & 0xffff) as f32,
        ((x >> 16) & 0xffff) as f32,
        (x & 0xffff) as f32,
    ];
    comm.broadcast(&mut parts, 0)?;
    Ok(parts.iter().fold(0u64, |acc, &p| (acc << 16) | p as u64))
}

/// What every worker shares: config, plan, data (opened once) and the run directory.
struct Setup {
    cfg: Config,
    plan: crate::config::Plan,
    run_dir: PathBuf,
    train_data: Blend,
    val_data: Blend,
    tokenizer: Option<crate::data::Tokenizer>,
    /// The checkpoint to start from and what to take from it.
    source: Option<(PathBuf, CheckpointMode)>,
    stop: StopFlag,
    fault: Option<fault::Fault>,
    /// Local engine with several workers: each computes on its own thread pool of this size, so that
    /// workers x threads fit the cores instead of all queueing on one shared pool.
    worker_threads: Option<usize>,
}

/// Trains as the loaded config says; returns when the run finishes or an exit condition saves and stops it.
pub fn run(loaded: &Loaded) -> Result<Summary> {
    let cfg = &loaded.config;
    let plan = &loaded.plan;
    let t = &cfg.train;
    // Before anything starts: CUDA asked for but absent is an input error.
    crate::device::check(t.device)?;
    if let Some(n) = t.threads {
        // Ignore the error when a pool already exists (tests run several trainings in one process).
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
    }
    let timeout = std::time::Duration::from_secs_f64(t.comm_timeout_secs);
    // A multi-process engine connects first: the ranks agree on the start time that names the run.
    let mut process_comm = match plan.engine {
        Engine::Local => None,
        Engine::Mpi => Some(connect_mpi(plan, timeout)?),
        Engine::Nccl => Some(connect_nccl(t.device, plan, timeout)?),
    };
    let now = std::time::SystemTime::now();
    let started = match process_comm.as_mut() {
        Some(c) => {
            let secs = now
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            std::time::UNIX_EPOCH + std::time::Duration::from_secs(broadcast_u64(c.as_mut(), secs)?)
        }
        None => now,
    };
    let run_dir = run_dir(cfg, started);
    std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    // The resolved config: on the local engine `workers` is the world size (--workers included).
    let mut resolved = cfg.clone();
    if plan.engine == Engine::Local {
        resolved.train.workers = Some(plan.world_size);
    }
    write_atomic(&run_dir.join("config.toml"), resolved.to_toml().as_bytes())?;
    let window = t.context_length + 1;
    // Resume: the run's own newest checkpoint first (a requeued job), else `checkpoint = ...`.
    let source = match (
        checkpoint::find_latest(&run_dir.join("checkpoints"))?,
        &cfg.checkpoint,
    ) {
        (Some(dir), _) => Some((dir, CheckpointMode::Full)),
        (None, Some(p)) => Some((checkpoint::require(Path::new(p))?, cfg.checkpoint_mode)),
        (None, None) => None,
    };
    let setup = Setup {
        cfg: cfg.clone(),
        plan: plan.clone(),
        train_data: Blend::open(cfg, Split::Train, window, cfg.model.vocab_size)?,
        val_data: Blend::open(cfg, Split::Val, window, cfg.model.vocab_size)?,
        tokenizer: crate::data::Meta::read(Path::new(&cfg.data_dir))
            .ok()
            .map(|m| m.tokenizer),
        run_dir,
        source,
        stop: StopFlag::install()?,
        fault: fault::Fault::from_env()?,
        worker_threads: (plan.engine == Engine::Local && plan.world_size > 1).then(|| {
            let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
            t.threads.unwrap_or((cores / plan.world_size).max(1))
        }),
    };
    if let Some(comm) = process_comm {
        return worker(&setup, comm);
    }
    let n = plan.world_size;
    if n == 1 {
        return worker(&setup, Box::new(crate::comm::Solo));
    }
    run_local(Arc::new(setup), n, timeout)
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
                    worker(&setup, Box::new(comm))
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

/// This process's rank of an `mpirun`/`srun` job.
#[cfg(feature = "mpi")]
fn connect_mpi(
    plan: &crate::config::Plan,
    timeout: std::time::Duration,
) -> Result<Box<dyn Communicator>> {
    let comm = crate::comm::mpi::MpiComm::init(timeout)?;
    if comm.world_size() != plan.world_size {
        anyhow::bail!(
            "MPI reports {} ranks but the launcher's environment said {}",
            comm.world_size(),
            plan.world_size
        );
    }
    Ok(Box::new(comm))
}

#[cfg(not(feature = "mpi"))]
fn connect_mpi(_: &crate::config::Plan, _: std::time::Duration) -> Result<Box<dyn Communicator>> {
    Err(bad_input!(
        "train.engine = \"mpi\": this nanodist was built without MPI; rebuild with `cargo build --release --features mpi` \
         (needs libopenmpi-dev and libclang-dev)"
    ))
}

/// The NCCL engine: this process's GPU (its local rank) and NCCL's id from rank 0, over MPI under an MPI
/// launcher in a build with `mpi`, else over TCP from MASTER_ADDR / MASTER_PORT.
#[cfg(feature = "cuda")]
fn connect_nccl(
    device: DeviceCfg,
    plan: &crate::config::Plan,
    timeout: std::time::Duration,
) -> Result<Box<dyn Communicator>> {
    use crate::comm::bootstrap;
    let env = |k: &str| std::env::var(k).ok();
    if device == DeviceCfg::Cpu {
        return Err(bad_input!(
            "train.engine = \"nccl\" runs on GPUs: set train.device = \"cuda\" (or use engine \"mpi\" on CPUs)"
        ));
    }
    let gpus = crate::device::gpus().map_err(|why| bad_input!("train.engine = \"nccl\": {why}"))?;
    let ordinal = crate::device::gpu_ordinal(crate::device::local_rank_from(env), 0, gpus)?;
    let n = plan.world_size;
    let mpi_rank = crate::config::resolve::LaunchEnv::process_rank();
    let rank = mpi_rank
        .or_else(|| env("RANK")?.trim().parse().ok())
        .unwrap_or(0);
    let comm = crate::comm::nccl::NcclComm::init(rank, n, ordinal, timeout, |id| {
        if n == 1 {
            return Ok(());
        }
        #[cfg(feature = "mpi")]
        if mpi_rank.is_some() {
            let mut mpi = crate::comm::mpi::MpiComm::init(timeout)?;
            return bootstrap::broadcast_bytes(&mut mpi, id);
        }
        bootstrap::tcp_share(&bootstrap::master_from_env(env)?, rank, n, id, timeout)
    })?;
    Ok(Box::new(comm))
}

#[cfg(not(feature = "cuda"))]
fn connect_nccl(
    _: DeviceCfg,
    _: &crate::config::Plan,
    _: std::time::Duration,
) -> Result<Box<dyn Communicator>> {
    Err(bad_input!(
        "train.engine = \"nccl\": this nanodist was built without CUDA support; rebuild with \
         `cargo build --release --features cuda` on a machine with the CUDA toolkit and NCCL"
    ))
}

/// Mean loss over `steps` fixed evaluation batches of `split`. Batch i is windows i*E..(i+1)*E with
/// E = local batch x world size (one micro-step of the global batch); rank r evaluates its b rows of each,
/// so N workers x b evaluate exactly the windows of 1 worker x N*b.
#[allow(clippy::too_many_arguments)]
fn evaluate_shared(
    pool: Option<&rayon::ThreadPool>,
    model: &Gpt,
    sync: &mut dyn SyncBackend,
    data: &Blend,
    split: Split,
    seed: u64,
    steps: u64,
    b: usize,
) -> Result<f64> {
    let (rank, n) = (sync.rank(), sync.world_size());
    let mut acc = [on(pool, || {
        eval_rows(model, data, split, seed, steps, b, n, rank..rank + 1)
    })? as f32];
    sync.mean_scalars(&mut acc)?;
    Ok(acc[0] as f64)
}

/// This rank's own model on all the windows of `evaluate_shared`; returns (mean, max) over the ranks.
fn evaluate_local(
    pool: Option<&rayon::ThreadPool>,
    model: &Gpt,
    sync: &mut dyn SyncBackend,
    data: &Blend,
    seed: u64,
    steps: u64,
    b: usize,
) -> Result<(f64, f64)> {
    let (rank, n) = (sync.rank(), sync.world_size());
    let mut all = vec![0.0f32; n];
    all[rank] = on(pool, || {
        eval_rows(model, data, Split::Val, seed, steps, b, n, 0..n)
    })? as f32;
    // The mean of a vector with one non-zero slot per rank gathers the ranks' values.
    sync.mean_scalars(&mut all)?;
    let losses: Vec<f64> = all.iter().map(|&x| x as f64 * n as f64).collect();
    Ok((
        losses.iter().sum::<f64>() / n as f64,
        losses.iter().cloned().fold(f64::MIN, f64::max),
    ))
}

/// Mean loss of `model` over the b-row slices `slices` of each of `steps` evaluation batches.
#[allow(clippy::too_many_arguments)]
fn eval_rows(
    model: &Gpt,
    data: &Blend,
    split: Split,
    seed: u64,
    steps: u64,
    b: usize,
    world: usize,
    slices: std::ops::Range<usize>,
) -> Result<f64> {
    let per_step = (b * world) as u64;
    let (mut sum, mut count) = (0.0f64, 0u64);
    for i in 0..steps {
        for r in slices.clone() {
            let first = i * per_step + (r * b) as u64;
            let batch = eval_batch(seed, split, first, data, b, model.context_length);
            sum += model.batch_loss(&batch)? as f64;
            count += 1;
        }
    }
    Ok(sum / count as f64)
}

/// Runs `compute` and, when the backend has communication pending, that communication at the same time:
/// the collective stays on this thread (an MPI communicator belongs to the thread that made it) and the
/// computation moves to a scoped thread.
fn overlapped<T: Send>(
    sync: &mut dyn SyncBackend,
    compute: impl FnOnce() -> Result<T> + Send,
) -> Result<T> {
    if !sync.has_pending() {
        return compute();
    }
    std::thread::scope(|s| {
        let job = s.spawn(compute);
        let comm = sync.communicate();
        let out = job
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the gradient computation panicked")));
        comm?;
        out
    })
}

/// Runs `f` on `pool` when there is one (a local worker's own threads), else on the calling thread.
fn on<T: Send>(pool: Option<&rayon::ThreadPool>, f: impl FnOnce() -> T + Send) -> T {
    match pool {
        Some(p) => p.install(f),
        None => f(),
    }
}

/// One rank's training loop.
fn worker(setup: &Setup, comm: Box<dyn Communicator>) -> Result<Summary> {
    let (cfg, plan) = (&setup.cfg, &setup.plan);
    let t = &cfg.train;
    let (ctx, local_b, accum) = (t.context_length, plan.local_batch_size, plan.accum_steps);
    let device = crate::device::select(t.device, comm.rank())?;
    let pool = match setup.worker_threads {
        Some(n) => Some(
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .context("starting a worker's thread pool")?,
        ),
        None => None,
    };
    let pool = pool.as_ref();
    // Mixed precision on GPUs: bf16 matmuls, f32 master weights, optimizer and reducer state.
    let model = Gpt::new(&cfg.model, ctx, t.seed, &device)?.with_amp(t.amp && device.is_cuda());
    let tensors = crate::sync::compress::TensorView::of(&model.params.params);
    let mut sync = crate::sync::build(cfg, plan, comm, tensors)?;
    let (rank, world) = (sync.rank(), sync.world_size());
    let root = rank == 0;
    let segments: Vec<Segment> = model
        .params
        .params
        .iter()
        .map(|p| Segment {
            offset: p.offset,
            len: p.len,
            decay: p.decays(),
        })
        .collect();
    let mut opt = optim::for_run(t, segments, model.params.numel);
    let mut flat = model.params.to_flat()?;
    let mut sampler = Sampler::new(t.seed);
    let mut dropout_rng = ChaCha8Rng::seed_from_u64(t.seed ^ DROPOUT_KEY);
    dropout_rng.set_stream(rank as u64);
    let (mut step, mut tokens, mut best_val, mut elapsed_before) =
        (0u64, 0u64, None::<f64>, 0.0f64);
    let mut loss_window = (0.0f64, 0u64);

    if let Some((dir, mode)) = &setup.source {
        match mode {
            CheckpointMode::Full => {
                let r = checkpoint::restore(dir, &model, rank, world)?;
                let m = &r.manifest;
                (step, tokens, best_val, elapsed_before) =
                    (m.step, m.tokens, m.best_val_loss, m.elapsed_s);
                flat = r.state.params;
                let (optimizer, reducer) = crate::sync::compress::correction::carry_over(
                    t.adam_in_reducer(),
                    r.state.optimizer,
                    r.state.reducer,
                )?;
                opt.load_state(optimizer)?;
                sync.load_state(reducer)?;
                let [hi, lo] = r.state.meta.dropout_word_pos;
                dropout_rng.set_word_pos(((hi as u128) << 64) | lo as u128);
                loss_window = r.state.meta.loss_window;
            }
            CheckpointMode::Weights => {
                checkpoint::verify(dir)?;
                flat = checkpoint::read_hf_weights(&dir.join("model.safetensors"), &model)?;
            }
        }
        model.params.set_flat(&flat)?;
        if root {
            eprintln!(
                "resumed from {} ({}) at step {step}",
                dir.display(),
                if *mode == CheckpointMode::Full {
                    "full state"
                } else {
                    "weights only"
                }
            );
        }
    }
    let run_dir = &setup.run_dir;
    if step >= t.n_steps {
        if root {
            eprintln!("run already finished at step {step} of {}", t.n_steps);
        }
        return Ok(Summary {
            run_dir: run_dir.clone(),
            step,
            last_val_loss: best_val,
            exit: Exit::Finished,
        });
    }

    let mut metrics = if root {
        Some(Tracker::open(cfg, run_dir, Some(step))?)
    } else {
        None
    };
    let console = Console::new(t.n_steps, step, root);
    let started = Instant::now();
    let start_step = step;
    let mut grads = vec![0.0f32; model.params.numel];
    let mut avg = Vec::new();
    let mut window = Window::new(sync.comm_stats());
    (window.loss_sum, window.loss_steps) = loss_window;
    let mut eval_window = (Instant::now(), step);
    let mut last_val = None;
    let exit = loop {
        if let Some(f) = &setup.fault {
            f.check(rank, step);
        }
        let lr = optim::lr_at(&t.lr_schedule, step, t.n_steps);
        // The forward/backward of this step; communication left pending by the last step runs beside it.
        let loss_sum = overlapped(sync.as_mut(), || {
            on(pool, || {
                grads.iter_mut().for_each(|g| *g = 0.0);
                let mut loss_sum = 0.0f64;
                for micro in 0..accum as u64 {
                    // Rows of this rank and micro-step in the step's global batch (see data::sampler).
                    let first_row = ((micro * world as u64) + rank as u64) * local_b as u64;
                    let batch = sampler.batch(&setup.train_data, step, first_row, local_b, ctx);
                    // Average over accumulation steps here and over workers in the reduce: DDP + nanoGPT's mean.
                    let scale = 1.0 / accum as f32;
                    loss_sum +=
                        model.loss_and_grads(&batch, Some(&mut dropout_rng), scale, &mut grads)?
                            as f64;
                }
                Ok(loss_sum)
            })
        })?;
        sync.reduce_grads(&mut grads, step)?;
        let grad_norm = match sync.clipped_grad_norm() {
            Some(norm) => norm,
            None => optim::clip_grad_norm(&mut grads, t.grad_norm_clip),
        };
        sync.before_step(&mut flat)?;
        opt.step(&mut flat, &grads, lr);
        sync.after_step(&mut flat, step)?;
        model.params.set_flat(&flat)?;
        step += 1;
        tokens += plan.tokens_per_step;
        window.steps += 1;
        window.loss_steps += 1;
        window.loss_sum += loss_sum / accum as f64;

        let eval_now = step % cfg.log.eval_interval == 0 || step == t.n_steps;
        if step % cfg.log.log_interval == 0 || eval_now {
            let mut losses = [(window.loss_sum / window.loss_steps as f64) as f32];
            sync.mean_scalars(&mut losses)?;
            let mut row = window.row(
                step,
                tokens,
                lr,
                losses[0] as f64,
                grad_norm,
                &flat,
                plan.tokens_per_step,
                sync.comm_stats(),
            );
            row.elapsed_s = elapsed_before + started.elapsed().as_secs_f64();
            row.mfu = Some(plan.flops_per_token as f64 * row.tokens_per_s / PEAK_FLOPS);
            if let Some(c) = sync.take_compression() {
                row.compression_ratio = c.compression_ratio;
                row.compression_error = c.compression_error;
                row.topk_overlap = c.topk_overlap;
                row.compressed_fraction = c.compressed_fraction;
            }
            if eval_now {
                // Train time counts training since the last evaluation, not the evaluation itself.
                let (secs, steps) = (eval_window.0.elapsed().as_secs_f64(), step - eval_window.1);
                // Evaluate the average of the replicas, then continue from the local ones.
                let distance = sync.average(&flat, &mut avg)?;
                model.params.set_flat(&avg)?;
                let val = evaluate_shared(
                    pool,
                    &model,
                    sync.as_mut(),
                    &setup.val_data,
                    Split::Val,
                    t.seed,
                    cfg.log.eval_steps,
                    local_b,
                )?;
                let tr = evaluate_shared(
                    pool,
                    &model,
                    sync.as_mut(),
                    &setup.train_data,
                    Split::Train,
                    t.seed,
                    cfg.log.eval_steps,
                    local_b,
                )?;
                model.params.set_flat(&flat)?;
                if cfg.log.eval_local {
                    let (mean, max) = evaluate_local(
                        pool,
                        &model,
                        sync.as_mut(),
                        &setup.val_data,
                        t.seed,
                        cfg.log.eval_steps,
                        local_b,
                    )?;
                    (row.val_loss_local, row.val_loss_local_max) = (Some(mean), Some(max));
                }
                console.eval_line(
                    step,
                    val,
                    tr,
                    secs,
                    steps,
                    row.elapsed_s,
                    row.tokens_per_s,
                    row.mfu,
                );
                eval_window = (Instant::now(), step);
                (row.val_loss, row.val_ppl, row.eval_train_loss) =
                    (Some(val), Some(val.exp()), Some(tr));
                if sync.name() == "decentdp" {
                    row.consensus_distance = Some(distance);
                }
                last_val = Some(val);
                if best_val.is_none_or(|b| val < b) {
                    best_val = Some(val);
                    if root {
                        checkpoint::save_weights(
                            &run_dir.join("best_model.safetensors"),
                            &model,
                            &avg,
                            step,
                        )?;
                    }
                }
            } else {
                console.progress(&row);
            }
            if let Some(m) = metrics.as_mut() {
                m.write(&row)?;
            }
            window = Window::new(sync.comm_stats());
        }

        // Every rank must take the same exit decision: combine the local reasons.
        let local = if step >= t.n_steps {
            1.0
        } else if setup.stop.received().is_some() {
            2.0
        } else if t.exit_interval.is_some_and(|n| step - start_step >= n) {
            3.0
        } else if t
            .exit_duration_mins
            .is_some_and(|m| started.elapsed().as_secs_f64() >= m * 60.0)
        {
            4.0
        } else {
            0.0
        };
        let mut votes = [local];
        if world > 1 {
            // Any rank's reason stops everyone (the largest code wins: signals beat time limits).
            let mut all = vec![0.0f32; world];
            all[rank] = local;
            sync.mean_scalars(&mut all)?;
            votes[0] = all.iter().cloned().fold(0.0, f32::max) * world as f32;
        }
        let exit = match votes[0].round() as u32 {
            0 => None,
            1 => Some(Exit::Finished),
            2 => Some(Exit::Signal(
                setup.stop.received().unwrap_or("a signal on another rank"),
            )),
            3 => Some(Exit::ExitInterval),
            _ => Some(Exit::ExitDuration),
        };
        let interval_save = cfg.log.ckpt_interval > 0 && step % cfg.log.ckpt_interval == 0;
        if exit.is_some() || interval_save {
            let optimizer = opt.state();
            // The metadata's copy: name and step (the buffers are tensors of their own).
            let meta_optimizer = optimizer.clone_header();
            let state = checkpoint::RankState {
                params: flat.clone(),
                optimizer,
                reducer: sync.state(),
                meta: checkpoint::RankMeta {
                    rank,
                    dropout_word_pos: {
                        let p = dropout_rng.get_word_pos();
                        [(p >> 64) as u64, p as u64]
                    },
                    loss_window: (window.loss_sum, window.loss_steps),
                    optimizer: meta_optimizer,
                },
            };
            let manifest = Manifest {
                format: "nanodist-checkpoint".into(),
                version: 1,
                step,
                tokens,
                world_size: world,
                elapsed_s: elapsed_before + started.elapsed().as_secs_f64(),
                best_val_loss: best_val,
                config: cfg.to_toml(),
                tokenizer: setup.tokenizer.clone(),
                files: Default::default(),
            };
            if let Some(m) = metrics.as_mut() {
                m.sync()?;
            }
            sync.average(&flat, &mut avg)?;
            let keep = cfg.log.keep_checkpoints as usize;
            let dir = checkpoint::save(
                sync.as_mut(),
                &run_dir.join("checkpoints"),
                &model,
                &state,
                &avg,
                manifest,
                keep,
            )?;
            console.note(&format!("saved checkpoint {}", dir.display()));
        }
        if let Some(e) = exit {
            break e;
        }
    };
    console.finish();
    if let Some(m) = metrics {
        m.finish(if matches!(exit, Exit::Signal(_)) {
            1
        } else {
            0
        })?;
    }
    Ok(Summary {
        run_dir: run_dir.clone(),
        step,
        last_val_loss: last_val,
        exit,
    })
}

/// Counters between two metrics rows.
struct Window {
    start: Instant,
    /// Steps timed in this process (throughput).
    steps: u64,
    /// Steps whose loss is in `loss_sum` (restored across a resume).
    loss_steps: u64,
    loss_sum: f64,
    comm: crate::comm::CommStats,
}

impl Window {
    fn new(comm: crate::comm::CommStats) -> Self {
        Self {
            start: Instant::now(),
            steps: 0,
            loss_steps: 0,
            loss_sum: 0.0,
            comm,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn row(
        &self,
        step: u64,
        tokens: u64,
        lr: f64,
        train_loss: f64,
        grad_norm: f64,
        params: &[f32],
        tokens_per_step: u64,
        comm: crate::comm::CommStats,
    ) -> Row {
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        let comm_s = comm.seconds - self.comm.seconds;
        Row {
            step,
            tokens,
            lr,
            train_loss,
            grad_norm,
            param_norm: optim::global_norm(params),
            tokens_per_s: (tokens_per_step * self.steps) as f64 / secs,
            ms_per_step: secs * 1e3 / self.steps as f64,
            comm_bytes: comm.bytes_sent - self.comm.bytes_sent,
            comm_ms: comm_s * 1e3,
            comm_frac: comm_s / secs,
            ..Row::default()
        }
    }
}

/// Console output: a progress bar on a terminal, plain lines otherwise (sbatch logs).
struct Console {
    bar: Option<indicatif::ProgressBar>,
    n_steps: u64,
    silent: bool,
}

impl Console {
    /// Only rank 0 prints; other ranks get a silent console.
    fn new(n_steps: u64, start: u64, root: bool) -> Self {
        if !root {
            return Self {
                bar: None,
                n_steps,
                silent: true,
            };
        }
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(n_steps);
            if let Ok(style) =
                indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} eta {eta}")
            {
                bar.set_style(style);
            }
            bar.set_position(start);
            bar
        });
        Self {
            bar,
            n_steps,
            silent: false,
        }
    }

    fn progress(&self, r: &Row) {
        if self.silent {
            return;
        }
        let msg = format!(
            "loss {:.4} lr {:.2e} {:.0} tok/s",
            r.train_loss, r.lr, r.tokens_per_s
        );
        match &self.bar {
            Some(bar) => {
                bar.set_position(r.step);
                bar.set_message(msg);
            }
            None => println!(
                "step {}/{} | {msg} | {:.1} ms/step",
                r.step, self.n_steps, r.ms_per_step
            ),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn eval_line(
        &self,
        step: u64,
        val: f64,
        train: f64,
        secs: f64,
        steps: u64,
        total: f64,
        tps: f64,
        mfu: Option<f64>,
    ) {
        // The seed runner's line, then throughput.
        let line = format!(
            "Step {step}, Val loss: {val:.4}, Train loss: {train:.4}, Train time: {secs:.2}s ({:.2}ms/step), \
             Total train time: {total:.2}s, {tps:.0} tokens/s, MFU {:.4}%",
            secs * 1e3 / steps.max(1) as f64,
            mfu.unwrap_or(0.0) * 100.0
        );
        self.note(&line);
        if let Some(bar) = &self.bar {
            bar.set_position(step);
        }
    }

    fn note(&self, line: &str) {
        if self.silent {
            return;
        }
        match &self.bar {
            Some(bar) => bar.println(line),
            None => println!("{line}"),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

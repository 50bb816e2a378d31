//! One rank's training: its model, optimizer and sync backend, and the loop.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::checkpoint::{self, Manifest, Progress, RankView};
use super::compute::Compute;
use super::console::{Console, Interval};
use super::replica::{self, Replica};
use super::{Exit, Setup, Summary};
use crate::comm::{pack_u64, unpack_u64, Communicator};
use crate::config::CheckpointMode;
use crate::data::prefetch::{Prefetch, Rows};
use crate::data::{eval_batch, Blend, Sampler, Split, View};
use crate::flat::{Flat, FlatMut, FlatRef};
use crate::kernels::Segment;
use crate::metrics::{Row, Tracker};
use crate::model::{Gpt, Scratch};
use crate::optim;
use crate::sync::SyncBackend;

mod churn;
mod vote;

use vote::{Ballot, Outcome, Vote};

/// A100 bf16 dense peak, nanoGPT's reference for MFU on GPUs.
const A100_BF16_PEAK_FLOPS: f64 = 312e12;

/// The peak FLOP/s that MFU divides by, and how the console names it. On CUDA, nanoGPT's convention: an
/// A100's bf16 peak. On CPU, the `local` cluster profile's single-thread f32 GEMM peak (what `nanodist
/// calibrate` measured; a `config/clusters/local.toml` of this machine's takes precedence over the
/// built-in one) times the cores of the job's nodes (`job_cores`): the machine's peak, whatever threads
/// the ranks start on it; with bf16 products (`train.amp`), times the rate of this CPU's AMX or vdpbf16ps over
/// its f32 FMA.
fn mfu_peak(cuda: bool, n: usize, decisions: &crate::plan::Decisions) -> Option<(f64, String)> {
    if cuda {
        return Some((A100_BF16_PEAK_FLOPS, "of an A100's bf16 peak".into()));
    }
    let local = crate::predict::profile::load("local").ok()?;
    let per_thread = local.profile.device.peak_tflops * 1e12;
    let label = format!(
        "of {n} core(s)' f32 GEMM peak ({:.0} GFLOP/s each, cluster profile {})",
        per_thread / 1e9,
        local.source
    );
    Some(
        match decisions.cpu_bf16_rate.filter(|_| decisions.cpu_bf16) {
            Some(ratio) => (
                per_thread * n as f64 * ratio,
                format!(
                    "{label} x {ratio:.2} (bf16 products: this CPU's AMX or vdpbf16ps rate over its f32 FMA's)"
                ),
            ),
            _ => (per_thread * n as f64, label),
        },
    )
}
/// The first line of a run's log, on every start and resume: the version, the config's digest (sha256 of
/// the config as resolved, the file that `config.toml` in the run directory holds), the world, the
/// backend, the engine and the precision.
fn header(setup: &Setup, cuda: bool) -> String {
    use sha2::Digest;
    let (cfg, plan) = (&setup.cfg, &setup.plan);
    let digest = sha2::Sha256::digest(cfg.to_toml().as_bytes());
    let hex: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
    let precision = match (cuda, cfg.train.amp, plan.decisions.cpu_precision()) {
        (true, true, _) => "bf16 matmuls, f32 weights (CUDA)",
        (true, false, _) => "f32 on CUDA",
        (false, _, crate::model::matmul::Precision::Bf16) => "bf16 products, f32 sums (CPU)",
        (false, _, crate::model::matmul::Precision::F32) => "f32 (CPU)",
    };
    format!(
        "nanodist {} | config {} sha256 {hex} | world {} ({} per node) | backend {} | engine {} | {precision}",
        env!("CARGO_PKG_VERSION"),
        setup.run_dir.join("config.toml").display(),
        plan.world_size,
        plan.local_world_size.unwrap_or(plan.world_size),
        cfg.train.backend.name(),
        plan.engine.name(),
    )
}

/// The cores a job computes on: every core of each of its nodes (the local engine's one; a launcher's
/// world over its ranks per node), nodes alike to this one. Ranks that share a node share its cores, so
/// however many threads they start, they compute on no more than these.
fn job_cores(plan: &crate::plan::Plan, cores: usize) -> usize {
    match plan.engine {
        crate::config::Engine::Local | crate::config::Engine::Auto => cores,
        _ => {
            let per_node = plan.local_world_size.unwrap_or(plan.world_size).max(1);
            plan.world_size.div_ceil(per_node) * cores
        }
    }
}

const DROPOUT_KEY: u64 = 0x6472_6f70; // "drop"

/// What the staged backward calls with each complete range of the gradient (`SyncBackend::grads_ready`).
type Ready<'a> = dyn FnMut(FlatMut<'_>, std::ops::Range<usize>) -> Result<()> + 'a;

/// What the ranks learn at a log step: the means of the loss and of the backend's per-rank values, the
/// slowest rank's compute seconds and the stop vote (the last two absent under `[train.membership]`).
struct Meeting {
    loss: f64,
    per_rank: [Option<f64>; 2],
    compute: Option<f64>,
    vote: Option<Outcome>,
}

pub(super) struct Worker<'s> {
    setup: &'s Setup,
    /// This worker's place in the whole world (its rank, also while others are away).
    id: usize,
    model: Gpt,
    sync: Box<dyn SyncBackend>,
    /// The parameters (name-ordered flat buffer) and the optimizer, this worker's or shared (see
    /// `replica`), and this step's gradient, on the model's device (see `crate::flat`). (The replicas'
    /// average, which evaluations and checkpoints need, lives only while they run.)
    replica: Replica,
    grads: Flat,
    batches: Prefetch<'s>,
    dropout: ChaCha8Rng,
    progress: Progress,
    /// The run's config segments (see `checkpoint::ConfigSegment`).
    segments: Vec<checkpoint::ConfigSegment>,
    last_val: Option<f64>,
    /// Counters since the last metrics row, and the time and step of the last evaluation.
    since_log: Interval,
    since_eval: (Instant, u64),
    started: Instant,
    start_step: u64,
    metrics: Option<Tracker>,
    console: Console,
    /// What MFU divides by (see `mfu_peak`).
    mfu_peak: Option<f64>,
    /// Worker 0 of a run with `[train.membership]`: the simulated clock and what prices it.
    clock: Option<Box<(crate::predict::Predictor, crate::predict::clock::Clock)>>,
    /// Whether the next row is this process's first after its first step (it carries `startup_s`).
    startup_due: bool,
    /// This rank's side of the votes on stopping.
    ballot: Ballot,
}

impl<'s> Worker<'s> {
    /// Builds the rank's model, backend and optimizer, and restores the checkpoint the run starts from.
    pub fn new(setup: &'s Setup, comm: Box<dyn Communicator>) -> Result<Self> {
        let (cfg, plan) = (&setup.cfg, &setup.plan);
        let t = &cfg.train;
        let device = crate::device::select(t.device, comm.rank())?;
        // Mixed precision: bf16 matmuls, f32 master weights, optimizer and reducer state.
        let model = Gpt::new(&cfg.model, t.context_length, t.seed, &device)?
            .with_amp(t.amp, plan.decisions.cpu_precision());
        let segments = model.params.segments();
        let mut sync = crate::sync::build(&plan.sync, comm, segments.clone())?;
        let mut dropout = ChaCha8Rng::seed_from_u64(t.seed ^ DROPOUT_KEY);
        dropout.set_stream(sync.rank() as u64);
        let shared = replica::shared_by(plan, &t.optim, device.is_cuda());
        let parts = replica::parts(model.params.numel, sync.world_size());
        let replica = Self::replica(setup, &model, sync.as_mut(), shared, &segments)?;
        let sync_id = sync.comm().id();
        let mut w = Self {
            setup,
            id: sync_id,
            replica,
            grads: model.place().zeros_for_collectives(model.params.numel)?,
            model,
            sync,
            batches: Prefetch::new(
                Arc::clone(&setup.train_data),
                Sampler::new(
                    t.seed,
                    View::of(
                        &setup.train_data,
                        &cfg.worker_data,
                        sync_id,
                        plan.world_size,
                        t.context_length + 1,
                    )?,
                ),
                setup.loader.as_ref(),
            ),
            dropout,
            progress: Progress::default(),
            segments: checkpoint::continue_segments(None, 0, cfg),
            last_val: None,
            since_log: Interval::new(Default::default()),
            since_eval: (Instant::now(), 0),
            started: Instant::now(),
            start_step: 0,
            metrics: None,
            console: Console::new(t.n_steps, 0, false),
            mfu_peak: None,
            clock: churn::clock(setup, sync_id)?,
            startup_due: true,
            ballot: Ballot::new(0),
        };
        if w.join_schedule()? {
            if let Some((dir, mode)) = &setup.source {
                w.restore(dir, *mode)?;
            }
        }
        if shared {
            if w.sync.rank() == 0 {
                w.replica = w.replica.share(&setup.replica, parts, &segments)?;
                w.sync.barrier()?;
            }
            w.sync.share_replica(parts);
        }
        w.open_logs(device.is_cuda())?;
        Ok(w)
    }

    /// This rank's parameters and optimizer: its own, or its part of the shared replica. Rank 0 makes the
    /// shared replica (restored with its own state) while the others wait, so that no other worker makes
    /// one of its own to drop.
    fn replica(
        setup: &Setup,
        model: &Gpt,
        sync: &mut dyn SyncBackend,
        shared: bool,
        segments: &[Segment],
    ) -> Result<Replica> {
        let (t, numel) = (&setup.cfg.train, model.params.numel);
        let parts = replica::parts(numel, sync.world_size());
        if shared && sync.rank() != 0 {
            sync.barrier()?;
        }
        let joined = if shared {
            setup.replica.member(sync.rank(), parts, segments)?
        } else {
            None
        };
        let place = model.place();
        Ok(match joined {
            Some(member) => member,
            None => Replica::Own {
                params: place.from_host(setup.initial.weights(model, setup.local_workers()))?,
                opt: optim::for_run(
                    &t.optim,
                    setup.plan.sync.plain_sgd_in_loop(),
                    segments.to_vec(),
                    &model.params.hidden_matrices(),
                    numel,
                    place,
                )?,
            },
        })
    }

    /// The metrics (rank 0), the console and train.log, and what MFU divides by, from the step the run
    /// starts at.
    fn open_logs(&mut self, cuda: bool) -> Result<()> {
        let setup = self.setup;
        let (t, step, root) = (&setup.cfg.train, self.progress.step, self.sync.rank() == 0);
        if root && step < t.n_steps {
            self.metrics = Some(Tracker::open(&setup.cfg, &setup.run_dir, Some(step))?);
        }
        self.console = Console::new(t.n_steps, step, root);
        self.console.log_to(&setup.run_dir.join("train.log"))?;
        self.console.line(&header(setup, cuda));
        if let Some((dir, mode)) = &setup.source {
            self.console.line(&format!(
                "resumed from {} ({}) at step {step}",
                dir.display(),
                match mode {
                    CheckpointMode::Full => "full state",
                    CheckpointMode::Weights => "weights only",
                }
            ));
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cores = job_cores(&setup.plan, cores);
        if let Some((peak, label)) = mfu_peak(cuda, cores, &setup.plan.decisions) {
            self.mfu_peak = Some(peak);
            self.console.mfu_label = label;
        }
        self.since_log.comm = self.sync.comm_stats();
        self.since_eval = (Instant::now(), step);
        self.start_step = step;
        Ok(())
    }

    fn restore(&mut self, dir: &std::path::Path, mode: CheckpointMode) -> Result<()> {
        let (rank, world) = (self.id, self.setup.plan.world_size);
        match mode {
            CheckpointMode::Full => {
                let r = checkpoint::restore(dir, &self.model, rank, world)?;
                self.progress = r.progress();
                self.segments = checkpoint::continue_segments(
                    Some(&r.manifest),
                    r.manifest.step,
                    &self.setup.cfg,
                );
                let (optimizer, reducer) = crate::sync::compress::correction::carry_over(
                    self.setup.plan.sync.adam_in_reducer(),
                    r.state.optimizer,
                    r.state.reducer,
                )?;
                // A shared replica was restored by rank 0, which made it.
                if let Replica::Own { params, opt } = &mut self.replica {
                    opt.load_state(optimizer)?;
                    *params = self.model.place().from_host(r.state.params)?;
                }
                self.sync.load_state(reducer)?;
                self.dropout.set_word_pos(r.state.meta.dropout_pos());
                if let (Some(c), Some(t)) = (&mut self.clock, r.state.meta.sim_clock) {
                    c.1.t = t.into_iter().map(f64::from_bits).collect();
                }
                (self.since_log.loss_sum, self.since_log.loss_steps) = r.state.meta.loss_since_log;
            }
            CheckpointMode::Weights => {
                if let Replica::Own { params, .. } = &mut self.replica {
                    let (weights, _) =
                        checkpoint::read_hf_weights(&dir.join("model.safetensors"), &self.model)?;
                    *params = self.model.place().from_host(weights)?;
                }
            }
        }
        self.model.load(self.replica.params())?;
        Ok(())
    }

    /// The training loop.
    pub fn train(mut self) -> Result<Summary> {
        let t = &self.setup.cfg.train;
        if self.progress.step >= t.n_steps {
            if self.sync.rank() == 0 {
                tracing::info!(
                    "run already finished at step {} of {}",
                    self.progress.step,
                    t.n_steps
                );
            }
            return Ok(self.summary(Exit::Finished, self.progress.best_val_loss));
        }
        self.start()?;
        let exit = loop {
            if !self.take_part()? {
                return Ok(self.summary(Exit::Finished, self.last_val));
            }
            let (lr, loss, grad_norm) = self.step()?;
            if let Some(exit) = self.after_step(lr, loss, grad_norm)? {
                break exit;
            }
        };
        self.console
            .line(&format!("{exit} at step {}", self.progress.step));
        self.console.finish();
        if let Some(m) = self.metrics.take() {
            m.finish(i32::from(matches!(exit, Exit::Signal(_))))?;
        }
        Ok(self.summary(exit, self.last_val))
    }

    /// After a step: its row and evaluation when due, the vote when due (see `vote`), and the checkpoint
    /// when due or stopping. Returns how the run ends, if it does here.
    fn after_step(&mut self, lr: f64, loss: f64, grad_norm: f64) -> Result<Option<Exit>> {
        let step = self.progress.step;
        self.ballot.record(step, loss, grad_norm);
        let (t, log) = (&self.setup.cfg.train, &self.setup.cfg.log);
        let eval_due = step.is_multiple_of(log.eval_interval) || step == t.n_steps;
        let log_due = step.is_multiple_of(log.log_interval) || eval_due;
        let ckpt_due = log.ckpt_interval > 0 && step.is_multiple_of(log.ckpt_interval);
        let every_secs = log.stop_check_secs;
        let stop = self.stop_vote();
        // A log step's vote rides in its row's collective (not under `[train.membership]`).
        let voted = match log_due {
            true => self.log(lr, grad_norm, eval_due, stop)?,
            false => None,
        };
        let out = match voted {
            Some(out) => out,
            None if log_due || ckpt_due || self.vote_due(step) => {
                self.control(|w| w.ballot.agree(stop, step, every_secs, w.sync.comm_mut()))?
            }
            None => return Ok(None),
        };
        if out.vote >= Vote::NonFiniteGradNorm {
            return Err(self.stop_non_finite(out));
        }
        if out.vote != Vote::Continue || ckpt_due {
            self.control(Self::save_checkpoint)?;
        }
        if out.vote == Vote::Continue {
            return Ok(None);
        }
        // Workers away stop waiting to come back.
        self.sync.comm_mut().end();
        Ok(Some(self.exit_of(out.vote)))
    }

    /// Whether the ranks vote after `step` besides the log, evaluation and checkpoint steps: at the timed
    /// vote, the last step, the exit interval's, and after every step under `[train.membership]`.
    fn vote_due(&self, step: u64) -> bool {
        let t = &self.setup.cfg.train;
        self.ballot.due(step)
            || step >= t.n_steps
            || t.exit_interval.is_some_and(|n| step - self.start_step >= n)
            || self.setup.plan.membership.is_some()
    }

    /// Before the first step: the local engine's workers wait until all are built (those built first would
    /// take the cores from those still building), the evaluation at start, and the time from the command
    /// to the first step (evaluation not counted) for `startup`.
    fn start(&mut self) -> Result<()> {
        if self.setup.local_workers() && self.setup.plan.membership.is_none() {
            self.sync.barrier()?;
        }
        let mut evaluating = std::time::Duration::ZERO;
        if self.progress.step == 0 && self.setup.cfg.log.eval_at_start {
            let begun = Instant::now();
            self.evaluate_at_start()?;
            evaluating = begun.elapsed();
        }
        let ready = super::clock::since_process_start().saturating_sub(evaluating);
        let ready_ns = u64::try_from(ready.as_nanos()).unwrap_or(u64::MAX);
        (self.setup.first_step_ns).fetch_max(ready_ns, std::sync::atomic::Ordering::Relaxed);
        self.ballot = Ballot::new(self.progress.step);
        Ok(())
    }

    /// One training step: forward and backward, the backend's reduction, clipping and the optimizer's
    /// update between the backend's hooks. Returns (lr, this rank's loss, the gradient norm).
    fn step(&mut self) -> Result<(f64, f64, f64)> {
        let t = &self.setup.cfg.train;
        let poison = match &self.setup.fault {
            Some(f) => f.check(self.sync.rank(), self.progress.step)?,
            None => false,
        };
        let lr = optim::lr_at(&t.lr_schedule, self.progress.step, t.n_steps);
        if t.dense_until() == Some(self.progress.step) {
            self.console.note(&format!(
                "step {}: the reducer switches from dense all-reduce to compressed ({})",
                self.progress.step,
                self.setup.plan.sync.describe()
            ));
        }
        // Debug builds (the tests) hold every step to the backend's description of it; not the step where
        // the members changed, whose overlapped round was sent at the change (see `churn`).
        let planned = (cfg!(debug_assertions) && !self.members_change()).then(|| {
            let step = self.progress.step;
            (self.sync.step_comm(step), self.sync.comm_stats().bytes_sent)
        });
        let described = self
            .clock
            .is_some()
            .then(|| self.sync.step_comm(self.progress.step));
        let mut loss = self.forward_backward()?;
        if poison {
            loss = f64::NAN;
            self.grads.as_mut().through_host(|g| {
                g.fill(f32::NAN);
                Ok(())
            })?;
        }
        let sync_start = self.since_log.sync_start(self.sync.comm_stats());
        self.sync
            .reduce_flat(self.grads.as_mut(), self.progress.step, lr)?;
        self.since_log.sync_end(sync_start, self.sync.comm_stats());
        // Clipping: the norm here, its factor applied as the optimizer reads the gradient.
        let (grad_norm, grad_scale) = match self.sync.clipped_grad_norm() {
            Some(norm) => (norm, 1.0),
            None => {
                let norm = self
                    .replica
                    .grad_norm(self.grads.as_ref(), self.sync.as_mut())?;
                (norm, optim::clip_factor(norm, t.grad_norm_clip))
            }
        };
        self.update(lr, grad_scale)?;
        if let Some((planned, before)) = planned {
            let (sent, rank) = (self.sync.comm_stats().bytes_sent - before, self.sync.rank());
            let want = crate::sync::trace::sent_by(&planned, rank);
            anyhow::ensure!(
                sent == want,
                "internal error: rank {rank} sent {sent} bytes in step {}, its backend's description \
                 says {want}: {planned:?}",
                self.progress.step - 1
            );
        }
        if let (Some(c), Some(d)) = (&mut self.clock, described) {
            c.1.step(&c.0, &self.sync.comm().ids(), &d);
        }
        self.since_log
            .add_step(loss, self.step_tokens(self.progress.step - 1));
        Ok((lr, loss, grad_norm))
    }

    /// This rank's gradient of the step, accumulated over the micro-steps; communication left pending by
    /// the last step (overlapped gossip) runs beside it. With a backend that overlaps the backward (DDP on
    /// GPUs), the last micro-step's backward runs in stages and hands each complete range of the gradient
    /// to the backend, which starts reducing it while the next stage computes. Returns the mean loss over
    /// the micro-steps.
    fn forward_backward(&mut self) -> Result<f64> {
        let step = self.progress.step;
        let waited = Instant::now();
        let batches = self.batches.take(&self.rows(step));
        if step + 1 < self.setup.cfg.train.n_steps {
            self.batches.ahead(self.rows(step + 1));
        }
        self.since_log.data_seconds += waited.elapsed().as_secs_f64();
        let accum = batches.len();
        let overlap_backward = self.sync.overlaps_backward(self.grads.as_ref());
        let (model, weights, grads, dropout) = (
            &self.model,
            self.replica.params(),
            &mut self.grads,
            &mut self.dropout,
        );
        let compute = &self.setup.compute;
        let mut micro_steps = |scratch: &mut Scratch, mut ready: Option<&mut Ready<'_>>| {
            grads.as_mut().fill_zero()?;
            let mut loss_sum = 0.0f64;
            for (micro, batch) in batches.iter().enumerate() {
                // Average over accumulation steps here and over workers in the reduce: DDP + nanoGPT's mean.
                let scale = 1.0 / accum as f32;
                let (g, drop) = (grads.as_mut(), Some(&mut *dropout));
                loss_sum += match ready.as_deref_mut() {
                    Some(ready) if micro + 1 == accum => {
                        model.loss_and_grads_staged(batch, drop, scale, g, ready)?
                    }
                    _ => model.loss_and_grads(scratch, weights, batch, drop, scale, g)?,
                } as f64;
            }
            anyhow::Ok(loss_sum)
        };
        let loss_sum = if overlap_backward {
            // On the GPU, on this thread: candle's graph computes without a CPU compute slot.
            let sync = self.sync.as_mut();
            let mut ready = |g: FlatMut<'_>, r| sync.grads_ready(g, r);
            micro_steps(&mut Scratch::default(), Some(&mut ready))?
        } else {
            let beside = &mut self.since_log.overlap_compute_seconds;
            overlapped(self.sync.as_mut(), beside, || {
                compute.run(|scratch| micro_steps(scratch, None))
            })?
        };
        Ok(loss_sum / accum as f64)
    }

    /// This worker's rows of `step`'s global batch, by its place in the whole world (the present keep
    /// theirs): in micro-step m, rows (m N + r) b .. (m N + r + 1) b (see `data::sampler`).
    fn rows(&self, step: u64) -> Rows {
        let plan = &self.setup.plan;
        let (b, world, rank) = (
            plan.local_batch_size as u64,
            plan.world_size as u64,
            self.id as u64,
        );
        Rows {
            step,
            first_rows: (0..plan.accum_at(step) as u64)
                .map(|m| (m * world + rank) * b)
                .collect(),
            b: plan.local_batch_size,
            t: self.setup.cfg.train.context_length,
        }
    }

    /// The optimizer step (the gradient times `grad_scale`, clipping's factor) between the backend's hooks
    /// (gossip mixes after it), then the model's weights.
    fn update(&mut self, lr: f64, grad_scale: f32) -> Result<()> {
        let start = self.since_log.sync_start(self.sync.comm_stats());
        let step = self.progress.step;
        let touches = !self.setup.plan.sync.replicas_stay_equal();
        let fold = match touches && self.replica.own_on_host() {
            true => self.sync.fold_mix(step)?,
            false => None,
        };
        match fold {
            Some(fold) => {
                self.since_log.sync_end(start, self.sync.comm_stats());
                let mixing = fold.over(self.sync.fold_buffer()?);
                let compute = &self.setup.compute;
                self.replica
                    .step_mixed(self.grads.as_ref(), (lr, grad_scale), mixing, compute)?;
            }
            None => {
                if touches {
                    self.sync.before_step_flat(self.replica.params_mut()?)?;
                }
                self.since_log.sync_end(start, self.sync.comm_stats());
                let (grads, sync) = (self.grads.as_ref(), self.sync.as_mut());
                self.replica
                    .step(grads, (lr, grad_scale), sync, &self.setup.compute)?;
            }
        }
        let start = self.since_log.sync_start(self.sync.comm_stats());
        match (fold.is_some(), touches) {
            (true, _) => self.sync.after_fold(self.replica.params_mut()?, step)?,
            (false, true) => self
                .sync
                .after_step_flat(self.replica.params_mut()?, step)?,
            (false, false) => {}
        }
        self.since_log.sync_end(start, self.sync.comm_stats());
        self.model.load(self.replica.params())?;
        self.progress.tokens += self.step_tokens(self.progress.step);
        self.progress.step += 1;
        Ok(())
    }

    /// Runs `f`, whose communication is bookkeeping (loss means, exit votes, evaluation, checkpoints):
    /// the rows' `comm_bytes` count the algorithm's traffic alone.
    fn control<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let before = self.sync.comm_stats();
        let out = f(self)?;
        self.since_log.exclude(&before, &self.sync.comm_stats());
        Ok(out)
    }

    /// A metrics row (the loss averaged over workers), with an evaluation when `eval_due` and the stop
    /// vote (`stop`: this rank's reason) in its collective, except under `[train.membership]`, where the
    /// vote follows on its own.
    fn log(
        &mut self,
        lr: f64,
        grad_norm: f64,
        eval_due: bool,
        stop: Vote,
    ) -> Result<Option<Outcome>> {
        let plan = &self.setup.plan;
        let m = self.sync.take_metrics();
        let per_rank = [m.pseudo_grad_norm, m.consensus_distance];
        let met = match plan.membership {
            None => self.control(|w| w.meet(per_rank, stop))?,
            Some(_) => {
                let (loss, per_rank) = self.control(|w| w.means_of_present(per_rank))?;
                Meeting {
                    loss,
                    per_rank,
                    compute: None,
                    vote: None,
                }
            }
        };
        let (loss, [norm, distance], compute) = (met.loss, met.per_rank, met.compute);
        let mut row =
            self.since_log
                .row(&self.progress, lr, loss, grad_norm, self.sync.comm_stats());
        let steps = self.since_log.steps;
        // Every rank's next interval starts as it leaves the row's collective (after an evaluation, as
        // it leaves the barrier below): each rank's `compute_ms` then spans the same time, and what the
        // row costs besides (rank 0 writes it) counts in the next, as the others go on meanwhile.
        if !eval_due {
            self.since_log = Interval::new(self.sync.comm_stats());
        }
        // The batch of the row's last step (of the workers that took part in it).
        let last = self.progress.step.saturating_sub(1);
        row.batch_size =
            plan.batches.batch_at(last) / plan.world_size as u64 * self.sync.world_size() as u64;
        row.workers = plan
            .membership
            .as_ref()
            .map(|_| self.sync.world_size() as u64);
        row.sim_s = self
            .clock
            .as_ref()
            .map(|c| c.1.now(&self.sync.comm().ids()));
        (row.pseudo_grad_norm, row.consensus_distance) = (norm, distance);
        row.compute_ms = compute.map(|s| s * 1e3);
        row.outer_lr = m.outer_lr;
        row.param_norm = optim::norm(self.replica.params())?;
        row.elapsed_s = self.elapsed();
        row.mfu = self
            .mfu_peak
            .map(|peak| plan.flops_per_token as f64 * row.tokens_per_s / peak);
        row.source_windows = self.source_windows()?;
        row.compression_ratio = m.compression_ratio;
        row.compression_error = m.compression_error;
        row.topk_overlap = m.topk_overlap;
        row.compressed_fraction = m.compressed_fraction;
        row.consensus_step = m.consensus_step;
        row.startup_s = self.startup();
        if eval_due {
            self.evaluate(&mut row)?;
            // Rank 0 saved a best model alone: the ranks start their next intervals together.
            self.control(|w| w.sync.barrier())?;
            self.since_log = Interval::new(self.sync.comm_stats());
        } else {
            self.console.progress(&row, steps);
        }
        if let Some(m) = self.metrics.as_mut() {
            m.write(&row)?;
        }
        Ok(met.vote)
    }

    /// A log step's one bookkeeping collective: an all-gather of each rank's loss since the last row, the
    /// backend's per-rank values (every rank has the same ones set: they follow the same schedule), its
    /// busy seconds (outside every collective, the backend's codec included: `Interval::busy_seconds`) and
    /// its ballot. Means are the rank-ordered sum times 1 / N (as `all_reduce_mean`). The compute is the
    /// slowest rank's busy time less this rank's codec: with rank 0's `sync_ms` beside it in the row, the
    /// two add up to the slowest rank's, whose codec may take longer than rank 0's (where ranks share
    /// cores, which rank waits longest for one changes from step to step).
    fn meet(&mut self, per_rank: [Option<f64>; 2], stop: Vote) -> Result<Meeting> {
        let codec = self.since_log.sync_seconds();
        let busy = self.since_log.busy_seconds(&self.sync.comm_stats());
        let mut mine: Vec<f32> = std::iter::once(self.since_log.mean_loss())
            .chain(per_rank.iter().flatten().copied())
            .chain([busy])
            .map(|x| x as f32)
            .collect();
        let every_secs = self.setup.cfg.log.stop_check_secs;
        let step = self.progress.step;
        mine.extend(self.ballot.words(stop, step, every_secs));
        let comm = self.sync.comm_mut();
        let (n, width) = (comm.world_size(), mine.len());
        let mut all = vec![0.0f32; n * width];
        comm.all_gather(&mine, &mut all)?;
        let field = |i: usize| all.chunks_exact(width).map(move |r| r[i]);
        let mean = |i: usize| field(i).fold(0.0f32, |a, x| a + x) * (1.0 / n as f32);
        let mut next = 0;
        let per_rank = per_rank.map(|v| {
            v.map(|_| {
                next += 1;
                mean(next) as f64
            })
        });
        let at = width - 5;
        let ballots: Vec<f32> = all
            .chunks_exact(width)
            .flat_map(|r| r[at + 1..].to_vec())
            .collect();
        Ok(Meeting {
            loss: mean(0) as f64,
            per_rank,
            compute: Some(slowest_compute(field(at), codec)),
            vote: Some(self.ballot.settle(&ballots, step)?),
        })
    }

    /// On the first row after this process's first step (every worker of it has started one by then: the
    /// row's means are a collective), the seconds from the command to the last one's start; rank 0 says it.
    fn startup(&mut self) -> Option<f64> {
        if !std::mem::take(&mut self.startup_due) {
            return None;
        }
        self.setup.initial.release();
        let ns = (self.setup.first_step_ns).load(std::sync::atomic::Ordering::Relaxed);
        let s = ns as f64 * 1e-9;
        if self.sync.rank() == 0 {
            let at_start = self.setup.cfg.log.eval_at_start && self.start_step == 0;
            self.console.note(&format!(
                "first step {s:.2} s after the command{}",
                if at_start {
                    " (the evaluation at start not counted)"
                } else {
                    ""
                }
            ));
        }
        Some(s)
    }

    /// With non-IID data, the windows each worker drew from each source since the last row (rank order);
    /// their exchange is bookkeeping.
    fn source_windows(&mut self) -> Result<Option<Vec<Vec<u64>>>> {
        let counts = self.batches.take_counts();
        if self.setup.cfg.worker_data == crate::config::WorkerData::Shared {
            return Ok(None);
        }
        let n = self.sync.world_size();
        let mine: Vec<f32> = counts.iter().flat_map(|&c| pack_u64(c)).collect();
        let mut all = vec![0.0f32; mine.len() * n];
        self.control(|w| w.sync.comm_mut().all_gather(&mine, &mut all))?;
        let unpack = |w: &[f32]| w.chunks(2).map(|c| unpack_u64([c[0], c[1]])).collect();
        Ok(Some(all.chunks(mine.len().max(1)).map(unpack).collect()))
    }

    /// The evaluation before the first step (`log.eval_at_start`): a row at step 0 whose `train_loss` is
    /// the evaluation's estimate on training batches, as nanoGPT logs it.
    fn evaluate_at_start(&mut self) -> Result<()> {
        let t = &self.setup.cfg.train;
        let mut row = Row {
            lr: optim::lr_at(&t.lr_schedule, 0, t.n_steps),
            batch_size: self.setup.plan.batches.batch_at(0),
            param_norm: optim::norm(self.replica.params())?,
            elapsed_s: self.elapsed(),
            ..Row::default()
        };
        self.evaluate(&mut row)?;
        if let Some(train) = row.eval_train_loss {
            row.train_loss = train;
        }
        if let Some(m) = self.metrics.as_mut() {
            m.write(&row)?;
        }
        self.since_log = Interval::new(self.sync.comm_stats());
        Ok(())
    }

    /// Val and train loss of the replicas' average (and of each replica with `log.eval_local`); saves the
    /// best model.
    fn evaluate(&mut self, row: &mut Row) -> Result<()> {
        let (cfg, step) = (&self.setup.cfg, self.progress.step);
        // Train time counts training since the last evaluation, not the evaluation itself.
        let (secs, steps) = (
            self.since_eval.0.elapsed().as_secs_f64(),
            step - self.since_eval.1,
        );
        // Evaluate the average of the replicas, then continue from the local ones.
        let setup = self.setup;
        let spec = self.eval_spec();
        // On the GPU, the evaluations run from a host copy of the parameters.
        let params = self.replica.params().to_host()?;
        let mut avg = Vec::new();
        let (weights, distance) = self
            .replica
            .average(self.sync.as_mut(), &params, &mut avg)?;
        self.model.load(weights.into())?;
        let (sync, compute, model) = (self.sync.as_mut(), &setup.compute, &self.model);
        let val = eval_shared(
            sync,
            compute,
            model,
            &spec,
            weights,
            &setup.val_data,
            Split::Val,
        )?;
        let train = eval_shared(
            sync,
            compute,
            model,
            &spec,
            weights,
            &setup.train_data,
            Split::Train,
        )?;
        self.model.load(self.replica.params())?;
        if cfg.log.eval_local {
            let (mean, max) = eval_local(sync, compute, model, &spec, &params, &setup.val_data)?;
            (row.val_loss_local, row.val_loss_local_max) = (Some(mean), Some(max));
        }
        self.since_eval = (Instant::now(), step);
        (row.val_loss, row.val_ppl, row.eval_train_loss) =
            (Some(val), Some(val.exp()), Some(train));
        if !setup.plan.sync.replicas_stay_equal() && distance.is_some() {
            row.consensus_distance = distance;
        }
        self.console
            .eval_line(row, secs, steps, self.since_log.steps);
        self.last_val = Some(val);
        if self.progress.best_val_loss.is_none_or(|b| val < b) {
            self.progress.best_val_loss = Some(val);
            if self.sync.rank() == 0 {
                let path = setup.run_dir.join("best_model.safetensors");
                self.console.line("New best model found. Saving...");
                checkpoint::save_weights(&path, &self.model, weights, step)?;
                self.console
                    .line(&format!("Saved model to {}", path.display()));
            }
        }
        Ok(())
    }

    fn eval_spec(&self) -> EvalSpec {
        EvalSpec {
            seed: self.setup.cfg.train.seed,
            steps: self.setup.cfg.log.eval_steps,
            local_b: self.setup.plan.local_batch_size,
            world: self.setup.plan.world_size,
        }
    }

    /// Every rank stopped at the vote after a non-finite step (`out`: its step, rank and value): nothing
    /// since the last checkpoint is saved; the error names the step, the rank, the value, the step where
    /// the ranks stopped and the checkpoint to resume from.
    fn stop_non_finite(&mut self, out: Outcome) -> anyhow::Error {
        let resume = match checkpoint::list(&self.setup.run_dir.join("checkpoints")).first() {
            Some(dir) => format!(
                "; the last checkpoint, {}, is intact: the same command resumes from it (with a lower \
                 learning rate: --set train.lr_schedule.lr=... --allow-config-change train.lr_schedule)",
                dir.display()
            ),
            None => "; no checkpoint was saved before it".into(),
        };
        let err = crate::error::NonFinite {
            // Steps as the console and the rows number them (steps done, this one included).
            step: out.step,
            stopped: self.progress.step,
            rank: out.rank,
            what: match out.vote {
                Vote::NonFiniteLoss => "train loss",
                _ => "gradient norm",
            },
            value: out.value,
            resume,
        };
        self.console.line(&format!("stopped: {err}"));
        self.console.finish();
        if let Some(m) = self.metrics.take() {
            if let Err(e) = m.finish(3) {
                tracing::warn!("closing the metrics after a non-finite step: {e:#}");
            }
        }
        err.into()
    }

    fn stop_vote(&self) -> Vote {
        let t = &self.setup.cfg.train;
        let step = self.progress.step;
        if step >= t.n_steps {
            Vote::Finished
        } else if self.setup.stop.received().is_some() {
            Vote::Signal
        } else if t
            .exit_duration_mins
            .is_some_and(|m| self.started.elapsed().as_secs_f64() >= m * 60.0)
        {
            Vote::ExitDuration
        } else if t.exit_interval.is_some_and(|n| step - self.start_step >= n) {
            Vote::ExitInterval
        } else {
            Vote::Continue
        }
    }

    fn exit_of(&self, vote: Vote) -> Exit {
        match vote {
            Vote::Continue | Vote::Finished | Vote::NonFiniteLoss | Vote::NonFiniteGradNorm => {
                Exit::Finished
            }
            Vote::ExitInterval => Exit::ExitInterval,
            Vote::ExitDuration => Exit::ExitDuration,
            Vote::Signal => Exit::Signal(
                self.setup
                    .stop
                    .received()
                    .unwrap_or("a signal on another rank"),
            ),
        }
    }

    /// Every rank saves its state; rank 0 adds the averaged model and the manifest.
    fn save_checkpoint(&mut self) -> Result<()> {
        let setup = self.setup;
        let mut progress = self.progress.clone();
        progress.elapsed_s = self.elapsed();
        let manifest = Manifest::new(
            &progress,
            setup.plan.world_size,
            &setup.cfg,
            setup.tokenizer.clone(),
            self.segments.clone(),
            setup.plan.decisions,
        );
        if let Some(m) = self.metrics.as_mut() {
            m.sync()?;
        }
        // One host copy of the parameters on the GPU (borrowed on the host) serves the average and the
        // rank's file.
        let params = self.replica.params().to_host()?;
        let mut avg = Vec::new();
        let (model_weights, _) = self
            .replica
            .average(self.sync.as_mut(), &params, &mut avg)?;
        let (params, replica, dropout) = (&params, &self.replica, &self.dropout);
        let sim_clock = (self.clock.as_ref()).map(|c| c.1.t.iter().map(|t| t.to_bits()).collect());
        let loss_since_log = (self.since_log.loss_sum, self.since_log.loss_steps);
        // The rank's state, written from its buffers in place (only the reducer's state is a copy) while
        // it holds a compute slot: on the local engine, as many writes and copies at once as slots.
        let write_rank = |sync: &dyn SyncBackend, path: &std::path::Path| {
            let _slot = setup.compute.hold();
            let mut state = RankView::new(
                sync.comm().id(),
                FlatRef::Host(params),
                replica.opt_view(),
                sync.state()?,
                dropout.get_word_pos(),
                loss_since_log,
            );
            state.meta.sim_clock = sim_clock;
            checkpoint::write_rank(path, &state)
        };
        let dir = checkpoint::save(
            self.sync.as_mut(),
            &setup.run_dir.join("checkpoints"),
            &self.model,
            write_rank,
            model_weights,
            manifest,
            setup.cfg.log.keep_checkpoints as usize,
        )?;
        if self.sync.rank() == 0 {
            self.console
                .note(&format!("saved checkpoint {}", dir.display()));
        }
        Ok(())
    }

    /// Training seconds of this run, earlier invocations included.
    fn elapsed(&self) -> f64 {
        self.progress.elapsed_s + self.started.elapsed().as_secs_f64()
    }

    fn summary(&self, exit: Exit, last_val_loss: Option<f64>) -> Summary {
        Summary {
            run_dir: self.setup.run_dir.clone(),
            step: self.progress.step,
            last_val_loss,
            exit,
            bytes_sent: self.sync.comm_stats().bytes_sent,
        }
    }
}

/// The fixed evaluation batches: `steps` batches of `local_b` rows per rank.
struct EvalSpec {
    seed: u64,
    steps: u64,
    local_b: usize,
    world: usize,
}

impl EvalSpec {
    /// Mean loss of `model` over the b-row slices `slices` of each evaluation batch.
    fn rows(
        &self,
        model: &Gpt,
        scratch: &mut crate::model::Scratch,
        weights: &[f32],
        data: &Blend,
        split: Split,
        slices: std::ops::Range<usize>,
    ) -> Result<f64> {
        let b = self.local_b;
        let per_step = (b * self.world) as u64;
        let (mut sum, mut count) = (0.0f64, 0u64);
        for i in 0..self.steps {
            for r in slices.clone() {
                let first = i * per_step + (r * b) as u64;
                let batch = eval_batch(self.seed, split, first, data, b, model.context_length);
                sum += model.batch_loss(scratch, weights, &batch)? as f64;
                count += 1;
            }
        }
        Ok(sum / count as f64)
    }
}

/// Mean loss over `log.eval_steps` fixed batches of `split`. Batch i is windows i*E..(i+1)*E with
/// E = local batch x world size (one micro-step of the global batch); rank r evaluates its b rows of
/// each, so N workers x b evaluate exactly the windows of 1 worker x N*b.
fn eval_shared(
    sync: &mut dyn SyncBackend,
    compute: &Compute,
    model: &Gpt,
    spec: &EvalSpec,
    weights: &[f32],
    data: &Blend,
    split: Split,
) -> Result<f64> {
    let (rank, present) = (sync.rank(), sync.world_size());
    if present < spec.world {
        return churn::eval_present(sync, compute, model, spec, weights, data, split);
    }
    let mut acc = [compute
        .run(|scratch| spec.rows(model, scratch, weights, data, split, rank..rank + 1))?
        as f32];
    sync.mean_scalars(&mut acc)?;
    Ok(acc[0] as f64)
}

/// Each rank's own model (`weights`) on all the windows of `eval_shared`; returns (mean, max) over the
/// ranks.
fn eval_local(
    sync: &mut dyn SyncBackend,
    compute: &Compute,
    model: &Gpt,
    spec: &EvalSpec,
    weights: &[f32],
    data: &Blend,
) -> Result<(f64, f64)> {
    let (rank, n) = (sync.rank(), sync.world_size());
    let mut all = vec![0.0f32; n];
    all[rank] = compute
        .run(|scratch| spec.rows(model, scratch, weights, data, Split::Val, 0..spec.world))?
        as f32;
    // The mean of a vector with one non-zero slot per rank gathers the ranks' values.
    sync.mean_scalars(&mut all)?;
    let losses: Vec<f64> = all.iter().map(|&x| x as f64 * n as f64).collect();
    Ok((
        losses.iter().sum::<f64>() / n as f64,
        losses.iter().cloned().fold(f64::MIN, f64::max),
    ))
}

/// Runs `compute` and, when the backend has communication pending, that communication at the same time:
/// the collective stays on this thread (an MPI communicator belongs to the thread that made it) and the
/// computation moves to a scoped thread, whose wall time is added to `beside`.
fn overlapped<T: Send>(
    sync: &mut dyn SyncBackend,
    beside: &mut Option<f64>,
    compute: impl FnOnce() -> Result<T> + Send,
) -> Result<T> {
    if !sync.has_pending() {
        return compute();
    }
    std::thread::scope(|s| {
        let job = s.spawn(|| {
            let start = Instant::now();
            compute().map(|out| (out, start.elapsed().as_secs_f64()))
        });
        let comm = sync.communicate();
        let joined = job
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the gradient computation panicked")));
        comm?;
        let (out, secs) = joined?;
        *beside = Some(beside.unwrap_or(0.0) + secs);
        Ok(out)
    })
}

/// The compute a row logs (`compute_ms`): the slowest rank's busy seconds (outside every collective,
/// its codec included) less this rank's codec, which the row logs beside it (`sync_ms`).
fn slowest_compute(busy: impl Iterator<Item = f32>, codec: f64) -> f64 {
    (busy.fold(f32::MIN, f32::max) as f64 - codec).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// compute_ms + sync_ms is the slowest rank's busy time, whichever rank spent longest in its codec:
    /// rank 0 (busy 10 s, 2 of them its codec) beside a rank busy 30 s gives 28.
    #[test]
    fn the_row_s_compute_and_rank_0_s_codec_add_up_to_the_slowest_rank_s_busy_time() {
        let busy = [10.0f32, 30.0, 20.0];
        assert_eq!(slowest_compute(busy.into_iter(), 2.0), 28.0);
        assert_eq!(slowest_compute(busy.into_iter(), 0.0), 30.0);
        assert_eq!(slowest_compute([1.0f32].into_iter(), 1.5), 0.0);
    }

    /// MFU's peak counts each node's cores once, however many ranks and threads share them: `mpirun -np 2`
    /// on 2 cores is 2 cores (it once logged MFU 100.18% against 2 ranks x 2 threads), 8 ranks on 2 nodes
    /// of 16 cores are 32, and the local engine's workers share this machine's.
    #[test]
    fn mfu_counts_the_cores_of_the_jobs_nodes_once() {
        let src = "[train]\nglobal_batch_size = 24\n";
        let plan = |launcher: Option<(usize, usize)>, workers: Option<usize>| {
            let launch = crate::plan::LaunchEnv {
                workers_flag: workers,
                launcher_world: launcher.map(|l| l.0),
                launcher_local_world: launcher.map(|l| l.1),
                launched_processes: launcher.map(|l| l.0),
                ..crate::plan::LaunchEnv::default()
            };
            crate::plan::load_str(std::path::Path::new("t.toml"), src, &[], &launch)
                .unwrap()
                .plan
        };
        assert_eq!(job_cores(&plan(Some((2, 2)), None), 2), 2);
        assert_eq!(job_cores(&plan(Some((8, 4)), None), 16), 32);
        assert_eq!(job_cores(&plan(Some((3, 2)), None), 4), 8);
        assert_eq!(job_cores(&plan(None, Some(4)), 2), 2);
    }
}

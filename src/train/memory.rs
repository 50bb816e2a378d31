//! The peak memory of a run's process, estimated before it starts: `check` prints it and `train` refuses a
//! run on the local engine that cannot fit in this machine's memory.
//!
//! Per worker, its state: parameters, gradient, the optimizer's buffers and the backend's
//! (`sync::footprint`); the CPU engine computes from the worker's parameters, without a copy. Where the
//! local engine's workers share one replica (`train::replica`), each keeps its gradient and backend state,
//! and the parameters and the optimizer's buffers are counted once. At
//! evaluations and checkpoints every worker also holds the replicas' average (not with one worker);
//! during a step, the backend's per-step buffers. Per compute slot (see `train::compute`): the
//! activations of one forward/backward and its GEMM packing buffers, or the copy of a backend's state
//! while a checkpoint writes it (parameters and optimizer are written in place). Then the process itself,
//! with rank 0's copy of one tensor in HF layout, and the initial weights the local engine's workers share
//! until each has started its first step (the first step's buffers meet them). `tests/memory.rs` holds
//! the estimate to the allocations of real runs, and `scripts/bench/workers.sh` to the peak RSS of 8 to
//! 512 workers.

use crate::config::{Config, Engine};
use crate::model::matmul::Precision;
use crate::plan::Plan;
use crate::plan::SyncPlan;
use crate::units::bytes;

/// The process's binary, its runtime, the data indexes and the metrics writers, measured: a one-worker
/// run of the quick-start model peaks at ~45 MB RSS, most of it the binary's pages.
const PROCESS_BYTES: u64 = 64 << 20;
/// Per worker beyond its buffers: its thread's stack and allocator heap, its console and sampler.
/// Measured: 256 to 512 workers of the quick-start model add 1.2 (gossip) to 1.9 MB (all-reduce) per
/// worker above their buffers (the allocator's per-thread heaps keep some freed blocks).
const WORKER_OVERHEAD_BYTES: u64 = 2 << 20;
/// Per compute thread: GEMM's packing buffers (gemm sizes them from the caches: 2.1 MB on the CI machine
/// class, measured in tests/memory.rs).
const GEMM_PACK_BYTES: u64 = 3 << 20;

/// Bytes of one run's process at its peak, in parts.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    /// Workers in this process: all of them on the local engine, else one.
    pub workers: u64,
    /// Each worker's state for the whole run (its buffers).
    pub state: u64,
    /// The replica the workers share (parameters and optimizer), once; 0 when each has its own.
    pub replica: u64,
    /// Each worker's buffers beside its state at the peak: the average at an evaluation or checkpoint,
    /// or the backend's per-step buffers, whichever is larger.
    pub transient: u64,
    /// Compute slots, and what each holds at most: the activations and scratch of a forward/backward
    /// (with the operands of its bf16 products under `train.amp`), or the copy of a rank's state a
    /// checkpoint writes.
    pub slots: u64,
    pub scratch: u64,
    /// GEMM's packing buffers of each slot's threads.
    pub gemm_pack: u64,
    /// What is not an allocation of ours: per worker (thread stack, allocator heap) and the process.
    pub worker_overhead: u64,
    pub fixed: u64,
    /// Rank 0's copy of a tensor of the model in HF layout, while it writes one.
    pub model_copy: u64,
    /// nanoGPT's initial weights, drawn once for the local engine's workers and held until every worker
    /// has started its first step (`replica::Initial`): the first step's buffers meet them.
    pub initial: u64,
}

impl Estimate {
    /// The process's peak resident memory.
    pub fn peak(&self) -> u64 {
        self.buffers() + self.workers * self.worker_overhead + self.fixed
    }

    /// The allocations of the peak: workers' state and transients, the slots' scratch and GEMM buffers,
    /// rank 0's model copy.
    pub fn buffers(&self) -> u64 {
        self.workers * (self.state + self.transient) + self.shared_buffers()
    }

    /// Per worker at the peak, overhead included.
    pub fn per_worker(&self) -> u64 {
        self.state + self.transient + self.worker_overhead
    }

    /// Everything but the workers: the shared replica, the slots and the process.
    pub fn shared(&self) -> u64 {
        self.shared_buffers() + self.fixed
    }

    /// The allocations that are no worker's: the shared replica, the slots, rank 0's model copy and the
    /// shared initial weights.
    fn shared_buffers(&self) -> u64 {
        self.replica + self.slots * (self.scratch + self.gemm_pack) + self.model_copy + self.initial
    }
}

/// The estimate for `cfg` as `plan` runs it (one process of a multi-process job, or all the local
/// engine's workers).
pub fn estimate(cfg: &Config, plan: &Plan) -> Estimate {
    let t = &cfg.train;
    let numel = plan.n_params;
    let local = matches!(plan.engine, Engine::Local | Engine::Auto);
    let workers = if local { plan.world_size as u64 } else { 1 };
    let named = crate::model::gpt::layout(&cfg.model, t.context_length)
        .into_iter()
        .map(|(name, shape, _)| (name, shape));
    let tensors = crate::kernels::Segment::of_shapes(named);
    let sync = crate::sync::footprint(&plan.sync, &tensors, plan.world_size as u64, local);
    let optimizer = crate::optim::state_buffers(&t.optim, plan.sync.plain_sgd_in_loop());
    // Parameters and gradient (the local engine's reductions copy nothing; its all-gathers keep their
    // last two messages, counted by the backends that gather).
    let cuda = t.device == crate::config::train::Device::Cuda;
    let shared = super::replica::shared_by(plan, &t.optim, cuda);
    // A shared replica holds the parameters, the optimizer's buffers and the replicas' average.
    let (state, replica) = if shared {
        (4 * (numel + sync.kept), 4 * numel * (2 + optimizer))
    } else {
        (4 * (numel * (2 + optimizer) + sync.kept), 0)
    };
    // The average to evaluate and checkpoint is a copy when there are replicas to average (in the
    // shared replica when there is one), and DiLoCo's global model is one at any world size; one worker
    // evaluates its own parameters.
    let average = if shared {
        0
    } else if plan.world_size > 1 || matches!(plan.sync, SyncPlan::Diloco { .. }) {
        numel
    } else {
        0
    };
    let transient = 4 * average.max(sync.during_step);
    // A checkpoint writes the parameters and the optimizer in place; the backend's state is a copy.
    let checkpoint_copy = 4 * sync.kept;
    let m = &cfg.model;
    let prec = match t.amp && t.device == crate::config::train::Device::Cpu {
        true => plan.decisions.cpu_precision(),
        false => Precision::F32,
    };
    let scratch = crate::model::cpu::scratch_bytes(
        m.n_layers,
        m.n_embd,
        m.n_heads,
        m.vocab_size,
        plan.local_batch_size,
        t.context_length,
        m.dropout > 0.0,
        prec,
    ) + if prec == Precision::Bf16 {
        let path = crate::model::matmul::Bf16Path::detect();
        let n = plan.local_batch_size * t.context_length;
        crate::model::matmul::bf16_bytes(path, n, m.n_embd, m.vocab_size)
    } else {
        0
    };
    let threads = plan
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |c| c.get()))
        as u64;
    Estimate {
        workers,
        state,
        replica,
        transient,
        slots: plan.compute_slots as u64,
        scratch: scratch.max(checkpoint_copy),
        gemm_pack: threads * GEMM_PACK_BYTES,
        worker_overhead: WORKER_OVERHEAD_BYTES,
        fixed: PROCESS_BYTES,
        // The largest tensor transposed into HF layout (the MLP's c_fc / c_proj: 4 C x C).
        model_copy: 4 * 4 * (m.n_embd as u64).pow(2),
        initial: if local && plan.world_size > 1 {
            4 * numel
        } else {
            0
        },
    }
}

/// Bytes this process may take: $NANODIST_MEMORY_GB when set (a share of a node, or a test's machine),
/// else the kernel's MemAvailable within the cgroup's limit when one is set; None where nothing says.
pub fn available() -> anyhow::Result<Option<u64>> {
    if let Some(v) = std::env::var_os("NANODIST_MEMORY_GB") {
        let v = v.to_string_lossy();
        return match v.trim().parse::<f64>() {
            Ok(gb) if gb > 0.0 => Ok(Some((gb * 1e9) as u64)),
            _ => Err(crate::bad_input!(
                "NANODIST_MEMORY_GB={v}: expected the memory this run may use, in GB (a positive number)"
            )),
        };
    }
    Ok(from_kernel())
}

fn from_kernel() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let avail = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())?
        * 1024;
    let cgroup = || -> Option<u64> {
        let max = std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok()?;
        let used = std::fs::read_to_string("/sys/fs/cgroup/memory.current").ok()?;
        let (max, used) = (
            max.trim().parse::<u64>().ok()?,
            used.trim().parse::<u64>().ok()?,
        );
        Some(max.saturating_sub(used))
    };
    Some(cgroup().map_or(avail, |c| c.min(avail)))
}

impl std::fmt::Display for Estimate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} peak: {} worker(s) x {} ({} state + {} at evaluations and steps){}{} + {} compute slot(s) x {} + {} process",
            bytes(self.peak() as f64),
            self.workers,
            bytes(self.per_worker() as f64),
            bytes(self.state as f64),
            bytes(self.transient as f64),
            if self.replica > 0 {
                format!(" + {} shared replica", bytes(self.replica as f64))
            } else {
                String::new()
            },
            if self.initial > 0 {
                format!(" + {} initial weights", bytes(self.initial as f64))
            } else {
                String::new()
            },
            self.slots,
            bytes((self.scratch + self.gemm_pack) as f64),
            bytes(self.fixed as f64)
        )
    }
}

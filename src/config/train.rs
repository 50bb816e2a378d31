//! `[train]`: batch, steps, exit conditions and the synchronisation algorithm.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::backend::{
    Backend, Compression, DemoConfig, DilocoConfig, Engine, SpartaConfig, Topology,
};
use super::lr::LrSchedule;
use super::membership::MembershipConfig;
use super::optim::OptimConfig;

/// The compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum Device {
    #[default]
    #[serde(rename = "cpu")]
    Cpu,
    /// One CUDA GPU per rank (cargo feature `cuda`).
    #[serde(rename = "cuda")]
    Cuda,
    /// CUDA when available, else CPU.
    #[serde(rename = "auto")]
    Auto,
}

/// Training: batch arithmetic, duration, synchronisation and optimisation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Synchronisation algorithm: "pytorchddp" (alias "allreduce"), "decentdp", "diloco", "sparta" or
    /// "demo".
    pub backend: Backend,
    /// Gossip topology; only with backend = "decentdp" (default "complete").
    pub topology: Option<Topology>,
    /// Overlap the gossip of step t with the computation of step t+1, as Decent-DP always does; only
    /// with backend = "decentdp" (default true; false: synchronous gossip). With overlap the gradient of
    /// step t+1 is taken at the parameters before the mix of step t (one step of delay).
    pub overlap: Option<bool>,
    /// Gradient bucket size in MB for the all-reduce; only with backend = "pytorchddp" (default 25).
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub bucket_size_mb: Option<f64>,
    /// Gradient compression; with backend = "pytorchddp", or "diloco" (its pseudo-gradients).
    pub compression: Option<Compression>,
    /// DiLoCo settings; only with backend = "diloco".
    pub diloco: Option<DilocoConfig>,
    /// SPARTA settings; only with backend = "sparta".
    pub sparta: Option<SpartaConfig>,
    /// DeMo settings; only with backend = "demo".
    pub demo: Option<DemoConfig>,
    /// Process engine: "auto" (default: "mpi" under a launcher that started several processes, else
    /// "local"), "local" threads, "mpi" processes or "nccl" GPUs.
    pub engine: Engine,
    /// World size of the local engine (overridden by --workers).
    #[schemars(range(min = 1, max = 1024))]
    pub workers: Option<usize>,
    /// Ranks per node as the topology sees it (`topology = "alternating-exp-ring"`). Default: the layout
    /// the launcher reports (mpirun, srun), and for the local engine all workers on one node; set it to
    /// simulate a multi-node layout.
    #[schemars(range(min = 1))]
    pub ranks_per_node: Option<usize>,
    /// Compute device.
    pub device: Device,
    /// Compute threads per worker (default: cores / workers, at least 1).
    #[schemars(range(min = 1))]
    pub threads: Option<usize>,
    /// Seconds a collective waits for a peer before failing with the missing rank's name.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub comm_timeout_secs: f64,
    /// Random seed: model initialisation and the order of training and validation data.
    pub seed: u64,
    /// Sequences per optimizer step summed over all workers and accumulation steps.
    #[schemars(range(min = 1, max = 16777216))]
    pub global_batch_size: usize,
    /// Batch-size ramp-up, Megatron's `--rampup-batch-size START INCREMENT SAMPLES`: the global batch
    /// starts at `start` sequences and grows by `increment` every samples / ((global_batch_size - start) /
    /// increment) samples until it is global_batch_size. The local batch stays and the accumulation steps
    /// follow, so start and increment are multiples of local_batch_size x world size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rampup_batch_size: Option<[u64; 3]>,
    /// Sequences per worker per forward pass (default: global_batch_size / world size, no accumulation;
    /// with a ramp-up, the largest local batch that divides every batch of the ramp).
    #[schemars(range(min = 1, max = 16777216))]
    pub local_batch_size: Option<usize>,
    /// Tokens per sequence (packed windows of the token stream).
    #[schemars(range(min = 1, max = 1048576))]
    pub context_length: usize,
    /// Total optimizer steps of the run.
    #[schemars(range(min = 1, max = 1_000_000_000_000_u64))]
    pub n_steps: u64,
    /// The run's length in samples (sequences) instead of `n_steps`, as BigScience's Megatron runs give it
    /// (`--train-samples`): n_steps is the number of steps whose batches reach train_samples
    /// (ceil(train_samples / global_batch_size) without a ramp-up).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub train_samples: Option<u64>,
    /// Clip the gradient to this global norm (0 disables clipping).
    #[schemars(range(min = 0.0))]
    pub grad_norm_clip: f64,
    /// torch.compile in the reference; no meaning for nanodist (reported at start).
    pub compile: bool,
    /// Automatic mixed precision: bf16 matmuls with f32 sums, f32 master weights and optimizer. On CPU
    /// the linear layers, the attention's products and the lm head, where the CPU's bf16 products outrun
    /// its f32 FMA (else f32, said at start).
    pub amp: bool,
    /// Stop after this many steps in this invocation (checkpoint first), as Megatron's --exit-interval.
    #[schemars(range(min = 1))]
    pub exit_interval: Option<u64>,
    /// Save a checkpoint and exit after this many minutes of wall time in this invocation.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub exit_duration_mins: Option<f64>,
    /// Optimizer.
    pub optim: OptimConfig,
    /// Learning-rate schedule.
    pub lr_schedule: LrSchedule,
    /// Workers that leave and come back (simulated churn; the local engine only).
    #[serde(skip_serializing_if = "MembershipConfig::is_default")]
    pub membership: MembershipConfig,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            backend: Backend::PytorchDdp,
            topology: None,
            overlap: None,
            bucket_size_mb: None,
            compression: None,
            diloco: None,
            sparta: None,
            demo: None,
            engine: Engine::Auto,
            workers: None,
            ranks_per_node: None,
            device: Device::Cpu,
            threads: None,
            comm_timeout_secs: 300.0,
            seed: 42,
            global_batch_size: 480,
            rampup_batch_size: None,
            local_batch_size: None,
            context_length: 1024,
            n_steps: 600_000,
            train_samples: None,
            grad_norm_clip: 1.0,
            compile: false,
            amp: false,
            exit_interval: None,
            exit_duration_mins: None,
            optim: OptimConfig::default(),
            lr_schedule: LrSchedule::default(),
            membership: MembershipConfig::default(),
        }
    }
}

impl TrainConfig {
    /// The first step of the compressed phase of a reducer that starts dense (Radius's `threshold`,
    /// PowerSGD's start); None when every step is alike. DiLoCo's reducers count syncs, not steps.
    pub fn dense_until(&self) -> Option<u64> {
        if self.backend != Backend::PytorchDdp {
            return None;
        }
        match &self.compression {
            Some(Compression::Radius(c)) => Some(c.threshold),
            Some(Compression::PowerSgd(c)) => Some(c.start_step(self.n_steps)),
            _ => None,
        }
        .filter(|&s| s > 0)
    }

    /// Sequences per worker per forward pass on `world` workers: `local_batch_size`, else the global batch
    /// shared by the workers (with a ramp-up: gcd(start, increment) shared, which divides every batch of
    /// the ramp). 0 when the workers cannot share it (a validation error).
    pub fn local_batch(&self, world: usize) -> usize {
        let world = world.max(1);
        let shared = match self.rampup_batch_size {
            None => self.global_batch_size,
            Some([start, increment, _]) => {
                let (mut a, mut b) = (start as usize, increment as usize);
                while b != 0 {
                    (a, b) = (b, a % b);
                }
                a
            }
        };
        let even = shared % world == 0;
        self.local_batch_size
            .unwrap_or(if even { shared / world } else { 0 })
    }
}

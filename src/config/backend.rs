//! How workers synchronise: `train.backend`, `train.topology` and `[train.compression]`.
//!
//! Backend-specific keys live beside `backend` (the seed configs put `topology` there); the validator
//! rejects a key that belongs to another backend, so adding a backend never reshapes existing files.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The synchronisation algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum Backend {
    /// Data parallel with gradient averaging by all-reduce, as PyTorch DDP (alias "allreduce").
    #[default]
    #[serde(rename = "pytorchddp", alias = "allreduce")]
    PytorchDdp,
    /// Decentralized data parallel: local optimizer steps, then parameter gossip over `topology` (Decent-DP).
    #[serde(rename = "decentdp")]
    DecentDp,
    /// DiLoCo: `train.optim` steps alone for `diloco.sync_every` steps, then an outer Nesterov step on the
    /// averaged pseudo-gradient (streaming with `fragments` > 1); settings in `[train.diloco]`.
    #[serde(rename = "diloco")]
    Diloco,
    /// SPARTA: after every step, average a random fraction `sparta.p` of the parameters, the mask drawn
    /// from a seed every rank shares; settings in `[train.sparta]`.
    #[serde(rename = "sparta")]
    Sparta,
    /// DeMo: DCT top-k of a decayed momentum, all-gathered, and a sign update (it replaces the optimizer;
    /// `train.optim` must be "sgd" for the weight decay); settings in `[train.demo]`.
    #[serde(rename = "demo")]
    Demo,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::PytorchDdp => "pytorchddp",
            Backend::DecentDp => "decentdp",
            Backend::Diloco => "diloco",
            Backend::Sparta => "sparta",
            Backend::Demo => "demo",
        }
    }
}

/// Gossip topology for `backend = "decentdp"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum Topology {
    /// One group of all ranks: a global parameter average every step.
    #[default]
    #[serde(rename = "complete")]
    Complete,
    /// Alternating pairs with the left and right neighbour (two rounds).
    #[serde(rename = "ring")]
    Ring,
    /// One-peer exponential graph: round i pairs rank j with j + 2^i (alias "one-peer-exp").
    #[serde(rename = "exp", alias = "one-peer-exp")]
    Exp,
    /// Intra-node averages alternating with one-peer exponential exchanges between nodes (uses the node layout).
    #[serde(rename = "alternating-exp-ring")]
    AlternatingExpRing,
}

impl Topology {
    pub fn name(self) -> &'static str {
        match self {
            Topology::Complete => "complete",
            Topology::Ring => "ring",
            Topology::Exp => "exp",
            Topology::AlternatingExpRing => "alternating-exp-ring",
        }
    }
}

/// The process engine that runs the workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum Engine {
    /// "mpi" when a launcher (mpirun, srun) started several processes, else "local".
    #[default]
    #[serde(rename = "auto")]
    Auto,
    /// N workers as threads of one process (`--workers N` or `train.workers`).
    #[serde(rename = "local")]
    Local,
    /// One process per rank, launched by mpirun or srun (cargo feature `mpi`).
    #[serde(rename = "mpi")]
    Mpi,
    /// One process per GPU with NCCL collectives (cargo feature `cuda`).
    #[serde(rename = "nccl")]
    Nccl,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Auto => "auto",
            Engine::Local => "local",
            Engine::Mpi => "mpi",
            Engine::Nccl => "nccl",
        }
    }
}

/// Compression, selected by `name`: of gradients for the gradient-averaging backends (topk, radius,
/// powersgd), of pseudo-gradients for diloco, of gossip messages for decentdp (CHOCO-SGD: topk, randomk,
/// qsgd, sign).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "name", deny_unknown_fields)]
pub enum Compression {
    /// Per-tensor top-k sparsification (with error feedback when reducing gradients); values and indices
    /// are sent.
    #[serde(rename = "topk")]
    TopK(TopKConfig),
    /// decentdp only: per tensor, a random `density` of the entries, drawn from a seed the receivers
    /// share (only values are sent).
    #[serde(rename = "randomk")]
    RandomK(RandomKConfig),
    /// decentdp only: QSGD, per tensor the 2-norm and each entry's sign and stochastic level in 0..=levels.
    #[serde(rename = "qsgd")]
    Qsgd(QsgdConfig),
    /// decentdp only: per tensor the signs, scaled by the mean magnitude (||x||_1 / d): one bit an entry.
    #[serde(rename = "sign")]
    Sign(SignConfig),
    /// Radius stable top-k: a mask re-selected every `interval` steps from the averaged gradient and shared
    /// by all ranks, so other steps all-reduce only the selected values.
    #[serde(rename = "radius")]
    Radius(RadiusConfig),
    /// PowerSGD low-rank compression (PyTorch's hook, or the one-all-reduce alternating variant).
    #[serde(rename = "powersgd")]
    PowerSgd(PowerSgdConfig),
    /// diloco only: SparseLoCo, chunk-wise top-k of the pseudo-gradient with values quantized to `bits`
    /// and a decaying error feedback (arXiv 2508.15706); (index, value) messages are all-gathered.
    #[serde(rename = "sparseloco")]
    SparseLoco(SparseLocoConfig),
}

impl Compression {
    pub fn name(&self) -> &'static str {
        match self {
            Compression::TopK(_) => "topk",
            Compression::Radius(_) => "radius",
            Compression::PowerSgd(_) => "powersgd",
            Compression::RandomK(_) => "randomk",
            Compression::Qsgd(_) => "qsgd",
            Compression::Sign(_) => "sign",
            Compression::SparseLoco(_) => "sparseloco",
        }
    }

    /// The consensus step given for compressed gossip (`None`: not given).
    pub fn consensus_step(&self) -> Option<ConsensusStep> {
        match self {
            Compression::TopK(c) => c.consensus_step,
            Compression::RandomK(c) => c.consensus_step,
            Compression::Qsgd(c) => c.consensus_step,
            Compression::Sign(c) => c.consensus_step,
            Compression::Radius(_) | Compression::PowerSgd(_) | Compression::SparseLoco(_) => None,
        }
    }
}

/// CHOCO's consensus step size gamma: a number in (0, 1], or "auto" to tune it at the start of the run
/// (the consensus simulated on random vectors with the run's mixing schedule and compressor).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum ConsensusStep {
    Value(#[schemars(extend("exclusiveMinimum" = 0), range(max = 1.0))] f64),
    Auto(Auto),
}

/// The word "auto".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Auto {
    #[serde(rename = "auto")]
    Auto,
}

/// Random-k options (compressed gossip).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RandomKConfig {
    /// Fraction of each tensor's entries sent per step, in (0, 1].
    #[schemars(extend("exclusiveMinimum" = 0), range(max = 1.0))]
    pub density: f64,
    /// Consensus step gamma (default 0.9, CHOCO's), or "auto".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consensus_step: Option<ConsensusStep>,
}

impl Default for RandomKConfig {
    fn default() -> Self {
        Self {
            density: 0.01,
            consensus_step: None,
        }
    }
}

/// QSGD options (compressed gossip); defaults: CHOCO's 4-bit quantization, rescaled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct QsgdConfig {
    /// Levels s of |x_i| / ||x||: each entry travels as its sign and a level in 0..=s.
    #[schemars(range(min = 1, max = 65535))]
    pub levels: u32,
    /// Divide by tau = 1 + min(d / s^2, sqrt(d) / s) (CHOCO's "qsgd-biased"), which contracts as CHOCO
    /// needs; false: unbiased QSGD.
    pub biased: bool,
    /// Entries that share one 2-norm (QSGD's buckets; 512 as in the QSGD paper): tau, and so the
    /// compressor's quality and the consensus step it needs, stay the same for tensors of any size.
    /// 0: one norm per tensor, as CHOCO's reference (tau then grows with sqrt(tensor size)).
    pub bucket: usize,
    /// Consensus step gamma (default 0.9, CHOCO's), or "auto".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consensus_step: Option<ConsensusStep>,
}

impl Default for QsgdConfig {
    fn default() -> Self {
        Self {
            levels: 15,
            biased: true,
            bucket: 512,
            consensus_step: None,
        }
    }
}

/// Sign options (compressed gossip).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SignConfig {
    /// Consensus step gamma (default 0.9, CHOCO's), or "auto".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consensus_step: Option<ConsensusStep>,
}

/// Top-k options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TopKConfig {
    /// Fraction of each tensor's entries sent per step, in (0, 1].
    #[schemars(extend("exclusiveMinimum" = 0), range(max = 1.0))]
    pub density: f64,
    /// Keep what was not sent as a residual added to the next gradient (default true; gradient reducers
    /// only: under decentdp, CHOCO's public copies are the memory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_feedback: Option<bool>,
    /// decentdp only: consensus step gamma (default 0.9, CHOCO's), or "auto".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consensus_step: Option<ConsensusStep>,
}

impl Default for TopKConfig {
    fn default() -> Self {
        Self {
            density: 0.01,
            error_feedback: None,
            consensus_step: None,
        }
    }
}

impl TopKConfig {
    /// Whether the reducer keeps a residual (the default).
    pub fn error_feedback_on(&self) -> bool {
        self.error_feedback.unwrap_or(true)
    }
}

/// SparseLoCo options (defaults: the paper's 2-bit values, chunks of 4096, error-feedback decay 0.95).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SparseLocoConfig {
    /// Fraction of each chunk's entries sent per sync, in (0, 1] (k = max(floor(density * chunk), 1)).
    #[schemars(extend("exclusiveMinimum" = 0), range(max = 1.0))]
    pub density: f64,
    /// Consecutive entries of a tensor that choose their top k together (the last chunk of a tensor may
    /// be shorter); an index travels in ceil(log2(chunk)) bits.
    #[schemars(range(min = 1, max = 65536))]
    pub chunk: usize,
    /// Bits per sent value: 2, 4 or 8 (a per-tensor statistical quantizer), or 32 (f32, unquantized).
    #[schemars(extend("enum" = [2, 4, 8, 32]))]
    pub bits: u32,
    /// Decay beta of the error feedback, e <- beta e + delta before each selection; it stands in for the
    /// outer momentum (the paper runs the outer SGD without momentum).
    #[schemars(range(min = 0.0, max = 1.0))]
    pub error_decay: f64,
}

impl Default for SparseLocoConfig {
    fn default() -> Self {
        Self {
            density: 0.015625,
            chunk: 4096,
            bits: 2,
            error_decay: 0.95,
        }
    }
}

/// How Radius trains before `threshold`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum WarmupMethod {
    /// Dense all-reduce (the reference's only method).
    #[default]
    #[serde(rename = "dense", alias = "Dense")]
    Dense,
}

/// Radius (stable top-k) options; defaults are the reference's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RadiusConfig {
    /// Fraction of each tensor's entries in the shared mask, in (0, 1].
    #[schemars(extend("exclusiveMinimum" = 0), range(max = 1.0))]
    pub density: f64,
    /// Steps between mask re-selections.
    #[schemars(range(min = 1))]
    pub interval: u64,
    /// Dense steps before compression starts.
    pub threshold: u64,
    /// Training before `threshold`.
    pub warmup_method: WarmupMethod,
    /// Widen each selected index by +-range neighbours.
    pub range: u64,
    /// Error feedback with the residual-is-gradient rule.
    pub error_feedback: bool,
    /// Run Adam inside the reducer (lr = 1, train.optim's betas and eps; needs optim name "adamw") on the
    /// clipped reduced gradient and hand its direction to an SGD outer optimizer.
    pub correction: bool,
}

impl Default for RadiusConfig {
    fn default() -> Self {
        Self {
            density: 0.01,
            interval: 100,
            threshold: 200,
            warmup_method: WarmupMethod::Dense,
            range: 50,
            error_feedback: true,
            correction: false,
        }
    }
}

/// PowerSGD options; defaults are PyTorch's `PowerSGDState`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PowerSgdConfig {
    /// Rank r of the approximation P Q^T.
    #[schemars(range(min = 1))]
    pub rank: usize,
    /// Dense steps before compression starts; must be > 1 with error feedback or warm start.
    pub start_iter: u64,
    /// The dense steps as a fraction of `train.n_steps` (rounded to steps), instead of `start_iter`
    /// (Optimus-CC's `--grad_comp_warm_up 0.1`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub start_fraction: Option<f64>,
    /// Compress an n x m matrix only if (n + m) * r * rate < n * m.
    #[schemars(range(min = 0.0))]
    pub min_compression_rate: f64,
    /// Add the previous step's approximation error to the gradient.
    pub error_feedback: bool,
    /// Reuse Q from the previous step.
    pub warm_start: bool,
    /// Added to norms during Gram-Schmidt orthogonalization.
    #[schemars(range(min = 0.0))]
    pub orthogonalization_epsilon: f64,
    /// Compress tensors of the same shape in one batched multiplication (on the GPU; in host memory each
    /// product runs on the buffers themselves, one tensor at a time, with the same result).
    pub batch_same_shape: bool,
    /// One all-reduce per step by alternating left and right multiplications (epfml reference).
    pub single_allreduce: bool,
}

impl PowerSgdConfig {
    /// The first compressed step of a run of `n_steps`.
    pub fn start_step(&self, n_steps: u64) -> u64 {
        match self.start_fraction {
            Some(f) => (f * n_steps as f64).round() as u64,
            None => self.start_iter,
        }
    }
}

impl Default for PowerSgdConfig {
    fn default() -> Self {
        Self {
            rank: 1,
            start_iter: 1000,
            start_fraction: None,
            min_compression_rate: 2.0,
            error_feedback: true,
            warm_start: true,
            orthogonalization_epsilon: 0.0,
            batch_same_shape: false,
            single_allreduce: false,
        }
    }
}

/// How DiLoCo's pseudo-gradients travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum Quantize {
    /// f32 values, all-reduced.
    #[default]
    #[serde(rename = "none")]
    None,
    /// bfloat16 (round to nearest even), summed in f32.
    #[serde(rename = "bf16")]
    Bf16,
    /// fp8 e4m3 row-wise: each row scaled to the format's largest value, one f32 scale per row.
    #[serde(rename = "fp8")]
    Fp8,
    /// uint8 min-max row-wise: 256 levels between each row's minimum and maximum (two f32 per row).
    #[serde(rename = "uint8")]
    Uint8,
}

impl Quantize {
    pub fn name(self) -> &'static str {
        match self {
            Quantize::None => "none",
            Quantize::Bf16 => "bf16",
            Quantize::Fp8 => "fp8",
            Quantize::Uint8 => "uint8",
        }
    }
}

/// `[train.diloco]`: DiLoCo and Streaming DiLoCo (defaults: torchft / OpenDiLoCo).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DilocoConfig {
    /// Inner steps between syncs of the whole model (H); each fragment syncs every H steps.
    #[schemars(range(min = 1))]
    pub sync_every: u64,
    /// Outer SGD learning rate (1 with momentum 0: LocalSGD).
    #[schemars(range(min = 0.0))]
    pub outer_lr: f64,
    /// Outer SGD momentum.
    #[schemars(range(min = 0.0))]
    pub outer_momentum: f64,
    /// Nesterov outer momentum.
    pub nesterov: bool,
    /// Fragments of the model (streaming DiLoCo when > 1); must divide sync_every.
    #[schemars(range(min = 1))]
    pub fragments: u64,
    /// Steps a fragment's all-reduce runs beside training before it is applied (tau < sync_every / fragments).
    pub fragment_delay: u64,
    /// At a fragment's sync the worker keeps alpha of its own parameters: (1 - alpha) global + alpha local.
    #[schemars(range(min = 0.0, max = 1.0))]
    pub fragment_alpha: f64,
    /// Pseudo-gradient quantization on the wire.
    pub quantize: Quantize,
    /// Eager outer steps (Kale, Douillard, Donchev 2025, arXiv 2502.12996): the all-reduce of sync t runs
    /// beside the next inner steps (see eager_pieces); at sync t each worker steps with the average of
    /// sync t - 1 plus 1 / N of (its own pseudo-gradient of t - its own of t - 1). Needs fragments = 1.
    pub eager: bool,
    /// Eager, f32 pseudo-gradients: the all-reduce is cut into this many pieces, one beside each of the
    /// steps after the sync (default 1: all of it beside the first step; at most sync_every). More pieces
    /// hide more of it behind computation, but each pays the link's latency once, so on high-latency
    /// links or small models fewer are faster (`nanodist predict` prices both). Quantized or compressed
    /// pseudo-gradients go in one piece.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub eager_pieces: Option<u64>,
    /// Hierarchical DiLoCo: ranks form groups of this many consecutive ranks (within a node when it
    /// divides ranks_per_node) that all-reduce their gradients every step, and the groups run DiLoCo
    /// among themselves. Must divide the world size; 1 (the default) is DiLoCo.
    #[schemars(range(min = 1))]
    pub group_size: u64,
}

impl Default for DilocoConfig {
    fn default() -> Self {
        Self {
            sync_every: 100,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            nesterov: true,
            fragments: 1,
            fragment_delay: 0,
            fragment_alpha: 0.0,
            quantize: Quantize::None,
            eager: false,
            eager_pieces: None,
            group_size: 1,
        }
    }
}

/// `[train.sparta]` (EXO Gym's default p).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SpartaConfig {
    /// Probability that a parameter entry is averaged after a step, in (0, 1].
    #[schemars(extend("exclusiveMinimum" = 0), range(max = 1.0))]
    pub p: f64,
}

impl Default for SpartaConfig {
    fn default() -> Self {
        Self { p: 0.005 }
    }
}

/// `[train.demo]` (bloc97/DeMo's defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DemoConfig {
    /// Decay beta of the momentum delta (delta <- beta delta + lr g).
    #[schemars(range(min = 0.0, max = 1.0))]
    pub decay: f64,
    /// DCT coefficients kept per chunk.
    #[schemars(range(min = 1))]
    pub topk: usize,
    /// Chunk side: matrices in chunk x chunk blocks, vectors in chunks of `chunk` (the largest divisor of
    /// each dimension that is <= chunk).
    #[schemars(range(min = 1))]
    pub chunk: usize,
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self {
            decay: 0.999,
            topk: 32,
            chunk: 64,
        }
    }
}

//! `[train.optim]`: the optimizer.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Optimizer, selected by `name`. Weight decay applies only to tensors of rank >= 2 (nanoGPT's groups).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "name", deny_unknown_fields)]
pub enum OptimConfig {
    /// torch.optim.AdamW: decoupled weight decay, bias-corrected moments.
    #[serde(rename = "adamw")]
    AdamW(AdamWConfig),
    /// Decent-DP's AccumAdamW: Adam moments committed every `accum_steps` steps from the running mean of
    /// the gradients, with look-ahead moments in between (lower variance with small per-worker batches).
    #[serde(rename = "accumadamw")]
    AccumAdamW(AccumAdamWConfig),
    /// torch.optim.SGD: momentum (dampening 0), optional Nesterov, L2 weight decay added to the gradient.
    #[serde(rename = "sgd")]
    Sgd(SgdConfig),
    /// Muon (Keller Jordan's `SingleDeviceMuonWithAuxAdam`): momentum SGD whose update of each hidden
    /// matrix (the blocks' four projections) is orthogonalised by a quintic Newton-Schulz iteration and
    /// scaled by sqrt(max(1, rows / cols)); the embeddings (and the head tied to them), norms and biases
    /// take AdamW at `adam_lr_ratio` times the schedule's learning rate. The schedule's `lr` is Muon's
    /// (the reference's 0.02). CPU only.
    #[serde(rename = "muon")]
    Muon(MuonConfig),
}

/// Muon hyper-parameters (the reference's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct MuonConfig {
    /// Momentum of the hidden matrices' SGD (the buffer is an exponential moving average of the
    /// gradient: m = momentum m + (1 - momentum) g).
    #[schemars(extend("minimum" = 0, "exclusiveMaximum" = 1))]
    pub momentum: f64,
    /// Nesterov's look-ahead: orthogonalise g + momentum (m - g) instead of m.
    pub nesterov: bool,
    /// Newton-Schulz iterations (coefficients 3.4445, -4.7750, 2.0315).
    #[schemars(range(min = 1, max = 20))]
    pub ns_steps: u32,
    /// Decoupled weight decay of the hidden matrices: p = (1 - lr weight_decay) p before the update.
    #[schemars(range(min = 0.0))]
    pub weight_decay: f64,
    /// The AdamW group's learning rate over the schedule's (3e-4 / 0.02 in the reference).
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub adam_lr_ratio: f64,
    /// The AdamW group's (beta1, beta2), each in [0, 1).
    #[schemars(extend("items" = {"type": "number", "minimum": 0, "exclusiveMaximum": 1}))]
    pub adam_betas: [f64; 2],
    /// The AdamW group's eps.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub adam_eps: f64,
    /// The AdamW group's decoupled weight decay.
    #[schemars(range(min = 0.0))]
    pub adam_weight_decay: f64,
}

impl Default for MuonConfig {
    fn default() -> Self {
        Self {
            momentum: 0.95,
            nesterov: true,
            ns_steps: 5,
            weight_decay: 0.0,
            adam_lr_ratio: 0.015,
            adam_betas: [0.9, 0.95],
            adam_eps: 1e-10,
            adam_weight_decay: 0.0,
        }
    }
}

/// SGD hyper-parameters (torch.optim.SGD's defaults).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SgdConfig {
    /// Momentum factor (0: plain SGD).
    #[schemars(range(min = 0.0))]
    pub momentum: f64,
    /// Nesterov momentum (needs momentum > 0).
    pub nesterov: bool,
    /// L2 penalty added to the gradient (applied to matrices and embeddings only).
    #[schemars(range(min = 0.0))]
    pub weight_decay: f64,
}

/// AdamW hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct AdamWConfig {
    /// Exponential decay rates (beta1, beta2) of the first and second moments, each in [0, 1).
    #[schemars(extend("items" = {"type": "number", "minimum": 0, "exclusiveMaximum": 1}))]
    pub betas: [f64; 2],
    /// Term added to the denominator for numerical stability.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub eps: f64,
    /// Decoupled weight decay (applied to matrices and embeddings only).
    #[schemars(range(min = 0.0))]
    pub weight_decay: f64,
}

/// AccumAdamW hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct AccumAdamWConfig {
    /// Exponential decay rates (beta1, beta2) of the first and second moments, each in [0, 1).
    #[schemars(extend("items" = {"type": "number", "minimum": 0, "exclusiveMaximum": 1}))]
    pub betas: [f64; 2],
    /// Term added to the denominator for numerical stability.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub eps: f64,
    /// Decoupled weight decay (applied to matrices and embeddings only).
    #[schemars(range(min = 0.0))]
    pub weight_decay: f64,
    /// Steps between moment commits (K); should grow with the number of workers.
    #[schemars(range(min = 1))]
    pub accum_steps: u64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            betas: [0.9, 0.95],
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

impl Default for AccumAdamWConfig {
    fn default() -> Self {
        Self {
            betas: [0.9, 0.98],
            eps: 1e-8,
            weight_decay: 0.1,
            accum_steps: 8,
        }
    }
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig::AdamW(AdamWConfig::default())
    }
}

impl OptimConfig {
    /// The `name` tag, as written in the config.
    pub fn name(&self) -> &'static str {
        match self {
            OptimConfig::AdamW(_) => "adamw",
            OptimConfig::AccumAdamW(_) => "accumadamw",
            OptimConfig::Sgd(_) => "sgd",
            OptimConfig::Muon(_) => "muon",
        }
    }
}

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
        }
    }
}

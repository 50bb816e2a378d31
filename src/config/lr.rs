//! `[train.lr_schedule]`: the learning-rate schedule.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Learning-rate schedule, selected by `name`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "name", deny_unknown_fields)]
pub enum LrSchedule {
    /// Linear warm-up from lr/warmup_steps to lr over `warmup_steps` (PyTorch
    /// `LinearLR(start_factor=1/warmup_steps)`), then cosine annealing to `eta_min` over the remaining
    /// `n_steps - warmup_steps` steps (`CosineAnnealingLR`), as the decentralized GPT-2 runner does.
    #[serde(rename = "cosine")]
    Cosine(CosineSchedule),
}

/// Parameters of the cosine schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CosineSchedule {
    /// Peak (base) learning rate.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub lr: f64,
    /// Steps of linear warm-up; must be smaller than `train.n_steps`.
    pub warmup_steps: u64,
    /// Final learning rate at the end of the cosine decay.
    #[schemars(range(min = 0.0))]
    pub eta_min: f64,
}

impl Default for CosineSchedule {
    fn default() -> Self {
        Self {
            lr: 6e-4,
            warmup_steps: 2000,
            eta_min: 6e-5,
        }
    }
}

impl Default for LrSchedule {
    fn default() -> Self {
        LrSchedule::Cosine(CosineSchedule::default())
    }
}

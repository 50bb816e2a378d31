//! `[train.lr_schedule]`: the learning-rate schedule.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Learning-rate schedule: a linear warm-up, then the decay that `name` selects. Every schedule warms up
/// from lr/warmup to lr over the warm-up steps (PyTorch `LinearLR(start_factor=1/warmup)`, as the
/// decentralized GPT-2 runner does).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LrSchedule {
    /// "cosine": cosine annealing to `eta_min` at `decay_steps` (`CosineAnnealingLR`, the seed runner's);
    /// "linear": linear decay to `eta_min` at `decay_steps`; "constant": `lr` after the warm-up; "wsd":
    /// warm-up, stable at `lr`, then a decay to `eta_min` over the last `decay_fraction` of the run
    /// (Megatron's WSD).
    pub name: ScheduleName,
    /// Peak (base) learning rate.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub lr: f64,
    /// Steps of linear warm-up (default 2000, the seed runner's, unless `warmup_fraction` is given); must
    /// end before the decay does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<u64>,
    /// The warm-up as a fraction of `train.n_steps` (rounded to steps), instead of `warmup_steps`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub warmup_fraction: Option<f64>,
    /// The warm-up in samples (Megatron's `--lr-warmup-samples`), instead of `warmup_steps`: rounded up
    /// to whole steps of `train.global_batch_size`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub lr_warmup_samples: Option<u64>,
    /// The final learning rate (cosine, linear, wsd).
    #[schemars(range(min = 0.0))]
    pub eta_min: f64,
    /// The step at which the decay reaches `eta_min`, which it keeps after (Megatron's
    /// `--lr-decay-iters`); default `train.n_steps`. Not for "constant".
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub decay_steps: Option<u64>,
    /// The end of the decay in samples (Megatron's `--lr-decay-samples`), instead of `decay_steps`:
    /// rounded up to whole steps of `train.global_batch_size`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub lr_decay_samples: Option<u64>,
    /// "wsd": the length of the final decay as a fraction of `train.n_steps` (default 0.1); it ends at
    /// `decay_steps`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0), range(max = 1.0))]
    pub decay_fraction: Option<f64>,
    /// "wsd": the shape of the final decay (Megatron's `--lr-wsd-decay-style`; default "exponential").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decay_style: Option<WsdDecay>,
}

/// The decay after the warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleName {
    #[default]
    Cosine,
    Linear,
    Constant,
    Wsd,
}

impl ScheduleName {
    pub fn name(self) -> &'static str {
        match self {
            ScheduleName::Cosine => "cosine",
            ScheduleName::Linear => "linear",
            ScheduleName::Constant => "constant",
            ScheduleName::Wsd => "wsd",
        }
    }
}

/// The shape of WSD's final decay, with r the fraction of it done: coefficient 1 - r (linear),
/// (1 + cos(pi r)) / 2 (cosine) or 2 * 0.5^r - 1 (exponential), between `eta_min` and `lr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WsdDecay {
    #[default]
    Exponential,
    Linear,
    Cosine,
}

/// The seed runner's warm-up when neither `warmup_steps` nor `warmup_fraction` is given.
pub const DEFAULT_WARMUP_STEPS: u64 = 2000;

/// WSD's decay fraction when none is given.
pub const DEFAULT_WSD_DECAY_FRACTION: f64 = 0.1;

impl LrSchedule {
    /// Warm-up steps of a run of `n_steps`.
    pub fn warmup(&self, n_steps: u64) -> u64 {
        match (self.warmup_steps, self.warmup_fraction) {
            (Some(w), _) => w,
            (None, Some(f)) => (f * n_steps as f64).round() as u64,
            (None, None) => DEFAULT_WARMUP_STEPS,
        }
    }

    /// The step at which the decay ends (at `eta_min`).
    pub fn decay_end(&self, n_steps: u64) -> u64 {
        self.decay_steps.unwrap_or(n_steps)
    }

    /// WSD: the step at which the final decay starts.
    pub fn wsd_decay_start(&self, n_steps: u64) -> u64 {
        let fraction = self.decay_fraction.unwrap_or(DEFAULT_WSD_DECAY_FRACTION);
        let len = (fraction * n_steps as f64).round() as u64;
        self.decay_end(n_steps).saturating_sub(len)
    }
}

impl Default for LrSchedule {
    fn default() -> Self {
        Self {
            name: ScheduleName::Cosine,
            lr: 6e-4,
            warmup_steps: None,
            warmup_fraction: None,
            lr_warmup_samples: None,
            eta_min: 6e-5,
            decay_steps: None,
            lr_decay_samples: None,
            decay_fraction: None,
            decay_style: None,
        }
    }
}

//! `[log]`: evaluation cadence, checkpoints and experiment tracking.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Logging, evaluation and checkpointing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// Log the run to Weights & Biases.
    pub wandb_log: bool,
    /// W&B project name.
    pub wandb_project: String,
    /// Evaluate train and validation loss every this many steps (and at the last step).
    #[schemars(range(min = 1))]
    pub eval_interval: u64,
    /// Number of fixed, seeded batches averaged for each evaluation.
    #[schemars(range(min = 1))]
    pub eval_steps: u64,
    /// Write a metrics row (and a console line when not on a terminal) every this many steps.
    #[schemars(range(min = 1))]
    pub log_interval: u64,
    /// Save a checkpoint every this many steps (0: only at exit and at the end).
    pub ckpt_interval: u64,
    /// How many step checkpoints to keep in the run directory (the newest ones).
    #[schemars(range(min = 1))]
    pub keep_checkpoints: u32,
    /// Name of the run directory under `log_dir`; default: $SLURM_JOB_ID, else a timestamp.
    pub run_name: Option<String>,
    /// Also write TensorBoard event files to log_dir/<run>/tb/.
    pub tensorboard: bool,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            wandb_log: false,
            wandb_project: "nanodist".into(),
            eval_interval: 1000,
            eval_steps: 200,
            log_interval: 10,
            ckpt_interval: 1000,
            keep_checkpoints: 2,
            run_name: None,
            tensorboard: false,
        }
    }
}

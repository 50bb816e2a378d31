//! `[log]`: evaluation cadence, checkpoints and experiment tracking.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Logging, evaluation and checkpointing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// Log the run to Weights & Biases.
    pub wandb_log: bool,
    /// W&B project name (WANDB_PROJECT overrides it).
    pub wandb_project: String,
    /// "offline" (write W&B's offline run directory; upload with `wandb sync`), "online" (also stream it
    /// with `wandb beta sync --live` when the wandb CLI is installed) or "disabled". WANDB_MODE overrides it.
    pub wandb_mode: WandbMode,
    /// W&B entity (team or user); default: the account's default entity (WANDB_ENTITY).
    pub wandb_entity: Option<String>,
    /// W&B display name; default: the run directory's name (WANDB_NAME).
    pub wandb_run_name: Option<String>,
    /// W&B group, e.g. one sweep of algorithms (WANDB_RUN_GROUP).
    pub wandb_group: Option<String>,
    /// W&B tags (WANDB_TAGS, comma-separated).
    pub wandb_tags: Vec<String>,
    /// Evaluate train and validation loss every this many steps (and at the last step).
    #[schemars(range(min = 1))]
    pub eval_interval: u64,
    /// Evaluate before the first step, as nanoGPT does: a metrics row at step 0 with the initial model's
    /// val loss, and as its `train_loss` the evaluation's estimate on training batches (no gradient yet:
    /// `grad_norm` 0, no throughput). A resumed run does not repeat it.
    pub eval_at_start: bool,
    /// Number of fixed, seeded batches averaged for each evaluation.
    #[schemars(range(min = 1))]
    pub eval_steps: u64,
    /// Gossip: besides the average of the replicas, evaluate each worker's own replica on the same
    /// batches; eval rows add `val_loss_local` (mean over workers) and `val_loss_local_max` (the worst).
    /// Costs world size x the validation evaluation.
    pub eval_local: bool,
    /// Write a metrics row (and a console line when not on a terminal) every this many steps.
    #[schemars(range(min = 1))]
    pub log_interval: u64,
    /// Save a checkpoint every this many steps (0: only at exit and at the end).
    pub ckpt_interval: u64,
    /// The ranks agree on whether to stop (a signal, `train.exit_duration_mins`, a non-finite loss or
    /// gradient norm) after every log, evaluation and checkpoint step, and in between after about this
    /// many seconds of training (0: after every step). Each agreement is a collective of every rank: a
    /// latency or more, which a run across slow links may want rarer, while a signal waits for the next.
    #[schemars(range(min = 0.0))]
    pub stop_check_secs: f64,
    /// How many step checkpoints to keep in the run directory (the newest ones).
    #[schemars(range(min = 1))]
    pub keep_checkpoints: u32,
    /// Name of the run directory under `log_dir` (a relative path that stays under it); default:
    /// $SLURM_JOB_ID, else a timestamp.
    pub run_name: Option<String>,
    /// Also write TensorBoard event files to log_dir/<run>/tb/.
    pub tensorboard: bool,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            wandb_log: false,
            wandb_project: "nanodist".into(),
            wandb_mode: WandbMode::Offline,
            wandb_entity: None,
            wandb_run_name: None,
            wandb_group: None,
            wandb_tags: Vec::new(),
            eval_interval: 1000,
            eval_at_start: true,
            eval_steps: 200,
            eval_local: false,
            log_interval: 10,
            ckpt_interval: 1000,
            stop_check_secs: 10.0,
            keep_checkpoints: 2,
            run_name: None,
            tensorboard: false,
        }
    }
}

/// How W&B logging reaches the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WandbMode {
    /// Write W&B's offline run directory; `wandb sync DIR` uploads it (compute nodes without internet).
    #[default]
    Offline,
    /// Also stream the directory with `wandb beta sync --live` when the wandb CLI is installed.
    Online,
    /// No W&B files at all.
    Disabled,
}

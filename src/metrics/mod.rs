//! Typed metrics rows and their sinks: metrics.jsonl (the source for plots and comparisons), W&B's offline
//! run files (`wandb`) and TensorBoard event files (`tensorboard`). The console is the training loop's
//! (`train::console`).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::data::format::write_atomic;

pub mod tensorboard;
pub mod wandb;

/// One logged step. Keys are a contract (plots, comparisons, W&B read them): add, do not rename.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub step: u64,
    pub tokens: u64,
    /// Sequences in the global batch of the row's last step (it changes with `train.rampup_batch_size`).
    #[serde(default)]
    pub batch_size: u64,
    pub lr: f64,
    pub train_loss: f64,
    pub grad_norm: f64,
    pub param_norm: f64,
    pub tokens_per_s: f64,
    pub ms_per_step: f64,
    pub elapsed_s: f64,
    pub comm_bytes: u64,
    pub comm_ms: f64,
    pub comm_frac: f64,
    /// Milliseconds over the interval that the sync backend computed outside collectives (compression,
    /// decompression, mixing arithmetic).
    #[serde(default)]
    pub sync_ms: f64,
    /// Milliseconds over the interval that rank 0 waited for its training batches: sampling them, or
    /// waiting for the loader that samples them ahead (`prefetch`).
    #[serde(default)]
    pub data_ms: f64,
    /// Milliseconds over the interval that rank 0's forward and backward passes ran beside collectives
    /// (overlapped gossip and CHOCO, streaming DiLoCo's delayed fragments): their wall time in those
    /// steps. Absent where no step overlapped.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub overlap_compute_ms: Option<f64>,
    /// Milliseconds over the interval that the slowest rank spent outside every collective (the
    /// algorithm's and the bookkeeping's): its forward, backward, update, batches and the sync backend's
    /// own compute, less rank 0's `sync_ms`, so that `compute_ms + sync_ms` is the slowest rank's busy
    /// time. A rank that leaves a collective early and waits in the next one counts that wait in neither
    /// its nor the slowest rank's compute. Absent with `[train.membership]`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub compute_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val_ppl: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub eval_train_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub mfu: Option<f64>,
    /// Gossip with `log.eval_local`: the mean over workers of their own replica's val loss, and the worst.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val_loss_local: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val_loss_local_max: Option<f64>,
    /// Gossip and SPARTA: mean distance of the replicas to their average, at evaluation. DiLoCo: the mean
    /// over workers of ||x_i - average|| just before the last sync since the previous row.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub consensus_distance: Option<f64>,
    /// DiLoCo: the mean over workers of their pseudo-gradient's norm at the last sync since the previous row.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub pseudo_grad_norm: Option<f64>,
    /// DiLoCo: the outer learning rate, on rows whose interval synced.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub outer_lr: Option<f64>,
    /// Compressed reducers, DiLoCo's quantized or compressed syncs, DeMo: dense f32 all-reduce bytes of the
    /// same values / bytes sent, over the steps since the last row.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub compression_ratio: Option<f64>,
    /// ||g - g_hat|| / ||g|| on rank 0 (g: gradient + residual, g_hat: what the step applied), mean over the steps.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub compression_error: Option<f64>,
    /// Radius: |new ∩ old| / |new| of the top-k sets at the re-selections since the last row.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub topk_overlap: Option<f64>,
    /// PowerSGD: the fraction of the parameters in the matrices it compresses (the rest is all-reduced
    /// dense), on rows whose interval ran compressed steps; absent while every step is dense (before
    /// `start_iter`). Not a compression ratio: see `compression_ratio`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub compressed_fraction: Option<f64>,
    /// Compressed gossip (CHOCO): the consensus step gamma, as given or tuned ("auto").
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub consensus_step: Option<f64>,
    /// Non-IID data (`[worker_data]`): per worker (rank order), the training windows it drew from each
    /// `train_data` source since the previous row.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub source_windows: Option<Vec<Vec<u64>>>,
    /// Runs with `[train.membership]`: the workers that took part in the row's last step.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub workers: Option<u64>,
    /// Runs with `[train.membership]`: the simulated seconds on its cluster when every worker present had
    /// done the row's last step (stragglers and churn included; see `predict::clock`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub sim_s: Option<f64>,
    /// The first row after this process's first step: seconds from the command to that step's start
    /// (config, plan and its tuning, data, workers, the resumed checkpoint; the evaluation at start not
    /// counted).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub startup_s: Option<f64>,
}

impl Row {
    /// Every numeric field this row has, by its key (`step` aside): what W&B and TensorBoard receive.
    pub fn numeric(&self) -> Result<Vec<(String, f64)>> {
        Ok(match serde_json::to_value(self)? {
            serde_json::Value::Object(m) => m
                .into_iter()
                .filter(|(k, _)| k != "step")
                .filter_map(|(k, v)| Some((k, v.as_f64()?)))
                .collect(),
            _ => Vec::new(),
        })
    }
}

/// Appends rows to `metrics.jsonl`, one JSON object per line, flushed per row.
pub struct JsonlSink {
    path: PathBuf,
    file: File,
    /// The bytes of the rows already in the file (a resumed run's before its checkpoint).
    comm_bytes_before: u64,
}

impl JsonlSink {
    /// Opens the file for appending. When resuming at `resume_step`, rows past it (written after that
    /// checkpoint by a run that then died) are dropped first, so the file reads as one continuous run.
    pub fn open(path: &Path, resume_step: Option<u64>) -> Result<Self> {
        let mut comm_bytes_before = 0;
        if let (Some(step), true) = (resume_step, path.exists()) {
            let f = File::open(path).with_context(|| format!("reading {}", path.display()))?;
            let mut kept = String::new();
            for line in BufReader::new(f).lines() {
                let line = line?;
                let row = serde_json::from_str::<serde_json::Value>(&line).ok();
                let field = |k: &str| row.as_ref().and_then(|v| v.get(k)?.as_u64());
                if field("step").is_some_and(|s| s <= step) {
                    comm_bytes_before += field("comm_bytes").unwrap_or(0);
                    kept.push_str(&line);
                    kept.push('\n');
                }
            }
            write_atomic(path, kept.as_bytes())?;
        }
        let file = File::options()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            comm_bytes_before,
        })
    }

    pub fn write(&mut self, row: &Row) -> Result<()> {
        let mut line = serde_json::to_string(row)?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .with_context(|| format!("writing {}", self.path.display()))
    }

    /// Makes the rows durable (called at checkpoints).
    pub fn sync(&mut self) -> Result<()> {
        self.file.sync_data()?;
        Ok(())
    }
}

/// Reads a metrics file (for tests and comparisons).
pub fn read_rows(path: &Path) -> Result<Vec<Row>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{}:{}", path.display(), i + 1))
        })
        .collect()
}

/// Where rank 0's rows go: metrics.jsonl always, W&B and TensorBoard when configured.
pub struct Tracker {
    jsonl: JsonlSink,
    wandb: Option<wandb::Run>,
    tb: Option<tensorboard::EventWriter>,
    /// The run's bytes so far (its rows' `comm_bytes` summed, across resumes): W&B and TensorBoard get
    /// it as `comm_bytes_total`, so that loss charts against cumulative bytes there.
    comm_bytes_total: u64,
}

impl Tracker {
    pub fn open(
        cfg: &crate::config::Config,
        run_dir: &Path,
        resume_step: Option<u64>,
    ) -> Result<Self> {
        let wandb = if cfg.log.wandb_log {
            let settings = wandb::Settings::resolve(&cfg.log, run_dir)?;
            let config = serde_json::to_value(cfg)?;
            wandb::Run::start(&settings, run_dir, &config)?
        } else {
            None
        };
        let tb = if cfg.log.tensorboard {
            let dir = run_dir.join("tb");
            let writer = tensorboard::EventWriter::create(&dir)?;
            // The log directory holds every run: TensorBoard shows them side by side.
            let logdir = run_dir.parent().unwrap_or(run_dir);
            tracing::info!(
                "TensorBoard scalars in {} (view: tensorboard --logdir {})",
                dir.display(),
                logdir.display()
            );
            Some(writer)
        } else {
            None
        };
        let jsonl = JsonlSink::open(&run_dir.join("metrics.jsonl"), resume_step)?;
        Ok(Self {
            comm_bytes_total: jsonl.comm_bytes_before,
            jsonl,
            wandb,
            tb,
        })
    }

    pub fn write(&mut self, row: &Row) -> Result<()> {
        self.jsonl.write(row)?;
        self.comm_bytes_total += row.comm_bytes;
        let mut metrics = row.numeric()?;
        metrics.push(("comm_bytes_total".into(), self.comm_bytes_total as f64));
        if let Some(w) = self.wandb.as_mut() {
            w.log(row.step, &metrics)?;
        }
        if let Some(tb) = self.tb.as_mut() {
            let scalars: Vec<(String, f64)> = metrics
                .iter()
                .map(|(k, v)| (tensorboard::tag(k), *v))
                .collect();
            tb.scalars(row.step, &scalars)?;
        }
        Ok(())
    }

    pub fn sync(&mut self) -> Result<()> {
        self.jsonl.sync()
    }

    /// Ends the W&B run with `exit_code` (a tracker dropped without this records exit code 1).
    pub fn finish(mut self, exit_code: i32) -> Result<()> {
        self.jsonl.sync()?;
        match self.wandb.take() {
            Some(w) => w.finish(exit_code),
            None => Ok(()),
        }
    }
}

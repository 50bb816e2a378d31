//! Reading finished (or running) run directories back: `nanodist compare` prints a table of runs and
//! `nanodist plot` draws their curves. Both work from what training wrote: `metrics.jsonl`, the resolved
//! `config.toml` and the newest checkpoint's manifest.

mod axis;
pub mod plot;
pub mod whatif;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::bad_input;
use crate::config::{Backend, Compression, Config};
use crate::metrics::{read_rows, Row};

/// One run directory, loaded.
#[derive(Debug, Clone)]
pub struct Run {
    pub dir: PathBuf,
    pub name: String,
    pub config: Config,
    /// From the newest checkpoint, else the resolved config's workers; None when neither says.
    pub world_size: Option<usize>,
    pub rows: Vec<Row>,
    /// Its steps priced on clusters (`--cluster`).
    pub predicted: Vec<Predicted>,
}

/// A run's steps priced on a cluster by `crate::predict`.
#[derive(Debug, Clone)]
pub struct Predicted {
    pub cluster: String,
    pub ms_per_step: f64,
    /// Predicted seconds at each row.
    pub clock: Vec<f64>,
}

impl Run {
    /// Prices this run's steps on `cluster` (its own world size and placement, `Run::placed_on`).
    pub fn predict_on(&mut self, cluster: &crate::predict::profile::Cluster) -> Result<()> {
        let config = self.dir.join("config.toml");
        let placed = self.placed_on(&cluster.profile);
        let (loaded, layout) =
            crate::predict::load(&config, &[], self.world_size, &cluster.profile, placed)?;
        let local = crate::predict::profile::load("local")?.profile;
        let p = crate::predict::predict_run(&loaded, &self.rows, (cluster, &local), layout, None)?;
        self.predicted.push(Predicted {
            cluster: cluster.name.clone(),
            ms_per_step: p.average.ms_per_step,
            clock: p.row_clock,
        });
        Ok(())
    }

    /// The ranks per node this run had (its resolved config records them; the local engine's workers
    /// share one machine), as placed on `profile`: where its devices cannot be shared (GPUs), at most
    /// one rank per device. None where the run did not record them (the profile's devices per node).
    pub fn placed_on(&self, profile: &crate::predict::profile::ClusterProfile) -> Option<usize> {
        let t = &self.config.train;
        let had = t.ranks_per_node.or(match t.engine {
            crate::config::Engine::Local => self.world_size,
            _ => None,
        })?;
        Some(match profile.device.sharing_efficiency {
            Some(_) => had,
            None => had.min(profile.devices_per_node),
        })
    }

    pub fn load(dir: &Path) -> Result<Self> {
        let metrics = dir.join("metrics.jsonl");
        if !metrics.is_file() {
            return Err(bad_input!(
                "{}: not a run directory (no metrics.jsonl); give the directory `train` printed{}",
                dir.display(),
                crate::train::checkpoint::runs_hint(dir)
            ));
        }
        let rows = read_rows(&metrics).map_err(|e| bad_input!("{e:#}"))?;
        let cfg_path = dir.join("config.toml");
        let src = std::fs::read_to_string(&cfg_path)
            .map_err(|e| bad_input!("{}: {e}", cfg_path.display()))?;
        let (config, _) = crate::config::parse(&src, &[]).map_err(|problems| {
            let msgs: Vec<String> = problems.iter().map(|p| p.message.clone()).collect();
            bad_input!("{}: {}", cfg_path.display(), msgs.join("; "))
        })?;
        // The world size is in every checkpoint's manifest; a run without one used the configured workers.
        let world_size = crate::train::checkpoint::find_latest(&dir.join("checkpoints"))
            .ok()
            .flatten()
            .and_then(|c| crate::train::checkpoint::verify(&c).ok())
            .map(|m| m.world_size)
            .or(config.train.workers);
        let name = dir.file_name().map_or_else(
            || dir.display().to_string(),
            |n| n.to_string_lossy().to_string(),
        );
        Ok(Self {
            dir: dir.to_path_buf(),
            name,
            config,
            world_size,
            rows,
            predicted: Vec::new(),
        })
    }

    /// The algorithm in a few words: "decentdp ring", "pytorchddp + powersgd r4", ...
    pub fn algorithm(&self) -> String {
        let t = &self.config.train;
        let mut s = t.backend.name().to_string();
        match t.backend {
            Backend::DecentDp => {
                s += &format!(" {}", t.topology.unwrap_or_default().name());
                if t.overlap == Some(true) {
                    s += " overlap";
                }
            }
            Backend::Diloco => {
                let d = t.diloco.clone().unwrap_or_default();
                s += &format!(" H={}", d.sync_every);
                if d.fragments > 1 {
                    s += &format!(" F={}", d.fragments);
                }
                if d.quantize != crate::config::backend::Quantize::None {
                    s += &format!(" {}", d.quantize.name());
                }
            }
            Backend::Sparta => s += &format!(" p={}", t.sparta.clone().unwrap_or_default().p),
            Backend::PytorchDdp | Backend::Demo => {}
        }
        match &t.compression {
            Some(Compression::TopK(c)) => s += &format!(" + topk {}", c.density),
            Some(Compression::Radius(c)) => s += &format!(" + radius {}", c.density),
            Some(Compression::PowerSgd(c)) => s += &format!(" + powersgd r{}", c.rank),
            Some(Compression::RandomK(c)) => s += &format!(" + randomk {}", c.density),
            Some(Compression::Qsgd(c)) => s += &format!(" + qsgd s{}", c.levels),
            Some(Compression::Sign(_)) => s += " + sign",
            Some(Compression::SparseLoco(c)) => {
                s += &format!(" + sparseloco {} {}-bit", c.density, c.bits)
            }
            None => {}
        }
        s
    }

    /// "name (algorithm, N workers)": the label of the run in plots.
    pub fn label(&self) -> String {
        match self.world_size {
            Some(1) => format!("{} ({}, 1 worker)", self.name, self.algorithm()),
            Some(n) => format!("{} ({}, {n} workers)", self.name, self.algorithm()),
            None => format!("{} ({})", self.name, self.algorithm()),
        }
    }

    pub fn evals(&self) -> impl Iterator<Item = (&Row, f64)> {
        self.rows.iter().filter_map(|r| r.val_loss.map(|v| (r, v)))
    }

    /// Bytes each worker sent from the start up to and including each row.
    pub fn cumulative_bytes(&self) -> Vec<u64> {
        self.rows
            .iter()
            .scan(0u64, |acc, r| {
                *acc += r.comm_bytes;
                Some(*acc)
            })
            .collect()
    }
}

/// One line of the comparison: the fields of `compare --format json` and the columns of `--format csv`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub name: String,
    pub algorithm: String,
    pub workers: Option<usize>,
    pub steps: u64,
    pub final_val: Option<f64>,
    pub best_val: Option<f64>,
    /// Mean training throughput of the whole job over the rows.
    pub tokens_per_s: f64,
    /// Bytes sent per worker per step, over the run.
    pub bytes_per_step: f64,
    /// A reducer that starts dense (Radius's threshold, PowerSGD's start_iter): bytes per worker per step
    /// over the rows wholly before the switch, and over those wholly after it.
    pub dense_bytes_per_step: Option<f64>,
    pub compressed_bytes_per_step: Option<f64>,
    /// Milliseconds per step of the synchronisation's collectives, and of its own computing outside them
    /// (compression and decompression, mixing arithmetic: the codec time).
    pub comm_ms_per_step: f64,
    pub sync_ms_per_step: f64,
    /// The share of training time the synchronisation took: its collectives and its codec time.
    pub comm_share: f64,
    /// The last consensus distance logged (gossip and SPARTA at evaluations, DiLoCo before a sync).
    pub consensus_distance: Option<f64>,
    /// The val loss to reach, and when the run first reached it: step and seconds of training.
    pub target: Option<f64>,
    pub steps_to_target: Option<u64>,
    pub time_to_target: Option<f64>,
    /// On `--cluster`: its name, the predicted ms per step and seconds to the target.
    pub cluster: Option<String>,
    pub predicted_ms_per_step: Option<f64>,
    pub predicted_to_target: Option<f64>,
}

/// Steps each row covers: from the previous row's step to its own.
fn row_steps(rows: &[Row]) -> impl Iterator<Item = (&Row, u64)> {
    rows.iter().scan(0u64, |prev, r| {
        let n = r.step.saturating_sub(*prev);
        *prev = r.step;
        Some((r, n))
    })
}

/// Bytes per step over the rows that `keep` (given a row's first step and its step) selects.
fn bytes_per_step_where(rows: &[Row], keep: impl Fn(u64, u64) -> bool) -> Option<f64> {
    let (bytes, steps) = row_steps(rows)
        .filter(|(r, n)| *n > 0 && keep(r.step - n, r.step))
        .fold((0u64, 0u64), |(b, s), (r, n)| (b + r.comm_bytes, s + n));
    (steps > 0).then(|| bytes as f64 / steps as f64)
}

pub fn summarize(run: &Run, target: Option<f64>) -> Summary {
    let last = run.rows.last();
    let steps = last.map_or(0, |r| r.step);
    let bytes: u64 = run.rows.iter().map(|r| r.comm_bytes).sum();
    // Rows that trained (not the evaluation at step 0).
    let tps: Vec<f64> = row_steps(&run.rows)
        .filter(|&(_, n)| n > 0)
        .map(|(r, _)| r.tokens_per_s)
        .collect();
    let hit = target.and_then(|t| {
        run.rows
            .iter()
            .position(|r| r.val_loss.is_some_and(|v| v <= t))
    });
    let hit_row = hit.map(|i| &run.rows[i]);
    let start = run.config.train.dense_until().filter(|&s| s < steps);
    let (comm_ms, sync_ms, total_ms) = row_steps(&run.rows)
        .fold((0.0, 0.0, 0.0), |(c, y, t), (r, n)| {
            (c + r.comm_ms, y + r.sync_ms, t + r.ms_per_step * n as f64)
        });
    let predicted = run.predicted.first();
    Summary {
        name: run.name.clone(),
        algorithm: run.algorithm(),
        workers: run.world_size,
        steps,
        final_val: run.evals().last().map(|(_, v)| v),
        best_val: run.evals().map(|(_, v)| v).reduce(f64::min),
        tokens_per_s: if tps.is_empty() {
            0.0
        } else {
            tps.iter().sum::<f64>() / tps.len() as f64
        },
        // The rows of a run (resumed ones included) cover steps 1..=last.
        bytes_per_step: bytes as f64 / steps.max(1) as f64,
        dense_bytes_per_step: start
            .and_then(|s| bytes_per_step_where(&run.rows, |_, end| end <= s)),
        compressed_bytes_per_step: start
            .and_then(|s| bytes_per_step_where(&run.rows, |first, _| first >= s)),
        comm_ms_per_step: comm_ms / steps.max(1) as f64,
        sync_ms_per_step: sync_ms / steps.max(1) as f64,
        comm_share: if total_ms > 0.0 {
            (comm_ms + sync_ms) / total_ms
        } else {
            0.0
        },
        consensus_distance: run.rows.iter().rev().find_map(|r| r.consensus_distance),
        target,
        time_to_target: hit_row.map(|r| r.elapsed_s),
        steps_to_target: hit_row.map(|r| r.step),
        cluster: predicted.map(|p| p.cluster.clone()),
        predicted_ms_per_step: predicted.map(|p| p.ms_per_step),
        predicted_to_target: predicted.and_then(|p| p.clock.get(hit?).copied()),
    }
}

/// How `compare` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Format {
    /// A table to read (and to paste into notes).
    #[default]
    Markdown,
    /// One line per run, the fields of `json` as columns (empty: not measured).
    Csv,
    /// An array of one object per run.
    Json,
}

/// The comparison of `runs`. `target` defaults to the worst final val loss of the runs, which every run
/// with an evaluation reaches.
pub fn compare(runs: &[Run], target: Option<f64>, format: Format) -> Result<String> {
    let target = target.or_else(|| {
        runs.iter()
            .filter_map(|r| r.evals().last().map(|(_, v)| v))
            .reduce(f64::max)
    });
    let summaries: Vec<Summary> = runs.iter().map(|r| summarize(r, target)).collect();
    Ok(match format {
        Format::Markdown => markdown(&summaries, target),
        Format::Json => serde_json::to_string_pretty(&summaries)? + "\n",
        Format::Csv => {
            let mut w = csv::Writer::from_writer(Vec::new());
            for s in &summaries {
                w.serialize(s)?;
            }
            String::from_utf8(w.into_inner().map_err(|e| anyhow::anyhow!("{e}"))?)?
        }
    })
}

fn markdown(summaries: &[Summary], target: Option<f64>) -> String {
    let opt = |x: Option<f64>, digits: usize| x.map_or("-".into(), |v| format!("{v:.digits$}"));
    let bytes = |x: Option<f64>| x.map_or("-".into(), crate::units::bytes);
    let cluster = summaries.iter().find_map(|s| s.cluster.clone());
    let phases = summaries.iter().any(|s| s.dense_bytes_per_step.is_some());
    let mut head = vec![
        "run".to_string(),
        "algorithm".into(),
        "workers".into(),
        "steps".into(),
        "final val".into(),
        "best val".into(),
        "tokens/s".into(),
        "bytes/step/worker".into(),
    ];
    if phases {
        head.extend(["dense phase".into(), "compressed phase".into()]);
    }
    head.extend([
        "comm ms/step".into(),
        "codec ms/step".into(),
        "comm share".into(),
        "consensus distance".into(),
        format!("to val <= {}", opt(target, 4)),
    ]);
    if let Some(c) = &cluster {
        head.extend([format!("{c}: ms/step"), format!("{c}: time to target")]);
    }
    let mut out = format!("| {} |\n|{}\n", head.join(" | "), "---|".repeat(head.len()));
    for s in summaries {
        let reach = match (s.steps_to_target, s.time_to_target) {
            (Some(step), Some(t)) => format!("step {step}, {}", crate::units::secs(t)),
            _ => "not reached".into(),
        };
        let mut cells = vec![
            s.name.clone(),
            s.algorithm.clone(),
            s.workers.map_or("?".into(), |w| w.to_string()),
            s.steps.to_string(),
            opt(s.final_val, 4),
            opt(s.best_val, 4),
            format!("{:.0}", s.tokens_per_s),
            crate::units::bytes(s.bytes_per_step),
        ];
        if phases {
            cells.extend([
                bytes(s.dense_bytes_per_step),
                bytes(s.compressed_bytes_per_step),
            ]);
        }
        cells.extend([
            crate::units::sig3(s.comm_ms_per_step),
            crate::units::sig3(s.sync_ms_per_step),
            format!("{}%", crate::units::sig3(s.comm_share * 100.0)),
            s.consensus_distance
                .map_or("-".into(), |d| format!("{d:.3e}")),
            reach,
        ]);
        if cluster.is_some() {
            cells.extend([
                s.predicted_ms_per_step
                    .map_or("-".into(), crate::units::sig3),
                s.predicted_to_target
                    .map_or("not reached".into(), crate::units::secs),
            ]);
        }
        let _ = writeln!(out, "| {} |", cells.join(" | "));
    }
    out
}

/// Loads every run directory, naming the one that fails.
pub fn load_runs(dirs: &[PathBuf]) -> Result<Vec<Run>> {
    dirs.iter()
        .map(|d| Run::load(d).with_context(|| format!("loading run {}", d.display())))
        .collect()
}

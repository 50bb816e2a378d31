//! Reading finished (or running) run directories back: `nanodist compare` prints a table of runs and
//! `nanodist plot` draws their curves. Both work from what training wrote: `metrics.jsonl`, the resolved
//! `config.toml` and the newest checkpoint's manifest.

pub mod plot;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

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
    /// Prices this run's steps on `cluster` (its own world size, the cluster's devices per node).
    pub fn predict_on(&mut self, cluster: &crate::predict::profile::Cluster) -> Result<()> {
        let config = self.dir.join("config.toml");
        let (loaded, layout) =
            crate::predict::load(&config, &[], self.world_size, &cluster.profile, None)?;
        let p = crate::predict::predict_run(&loaded, &self.rows, cluster, layout, None)?;
        self.predicted.push(Predicted {
            cluster: cluster.name.clone(),
            ms_per_step: p.average.ms_per_step,
            clock: p.row_clock,
        });
        Ok(())
    }

    pub fn load(dir: &Path) -> Result<Self> {
        let metrics = dir.join("metrics.jsonl");
        if !metrics.is_file() {
            return Err(bad_input!(
                "{}: not a run directory (no metrics.jsonl); give the directory `train` printed",
                dir.display()
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

/// One line of the comparison table.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub name: String,
    pub algorithm: String,
    pub workers: Option<usize>,
    pub steps: u64,
    pub final_val: Option<f64>,
    pub best_val: Option<f64>,
    /// Mean training throughput of the whole job over the rows (evaluation rows included).
    pub tokens_per_s: f64,
    /// Bytes sent per worker per step, over the run.
    pub bytes_per_step: f64,
    /// Seconds of training until the first evaluation at or below the target.
    pub time_to_target: Option<f64>,
    pub steps_to_target: Option<u64>,
    /// On the `--cluster`: predicted ms per step and seconds to the target.
    pub predicted_ms_per_step: Option<f64>,
    pub predicted_to_target: Option<f64>,
}

pub fn summarize(run: &Run, target: Option<f64>) -> Summary {
    let last = run.rows.last();
    let steps = last.map_or(0, |r| r.step);
    let bytes: u64 = run.rows.iter().map(|r| r.comm_bytes).sum();
    let tps: Vec<f64> = run.rows.iter().map(|r| r.tokens_per_s).collect();
    let hit = target.and_then(|t| {
        run.rows
            .iter()
            .position(|r| r.val_loss.is_some_and(|v| v <= t))
    });
    let hit_row = hit.map(|i| &run.rows[i]);
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
        time_to_target: hit_row.map(|r| r.elapsed_s),
        steps_to_target: hit_row.map(|r| r.step),
        predicted_ms_per_step: run.predicted.first().map(|p| p.ms_per_step),
        predicted_to_target: run
            .predicted
            .first()
            .and_then(|p| p.clock.get(hit?).copied()),
    }
}

/// Bytes as B, kB, MB or GB.
pub fn human_bytes(b: f64) -> String {
    match b {
        b if b >= 1e9 => format!("{:.2} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.2} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} kB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}

/// The comparison table in Markdown. `target` defaults to the worst final val loss of the runs, which
/// every run with an evaluation reaches.
pub fn compare(runs: &[Run], target: Option<f64>) -> String {
    let target = target.or_else(|| {
        runs.iter()
            .filter_map(|r| r.evals().last().map(|(_, v)| v))
            .reduce(f64::max)
    });
    let opt = |x: Option<f64>, digits: usize| x.map_or("-".into(), |v| format!("{v:.digits$}"));
    let mut out = String::new();
    let cluster = runs
        .iter()
        .find_map(|r| r.predicted.first().map(|p| p.cluster.clone()));
    let extra = cluster.as_ref().map_or(String::new(), |c| {
        format!(" {c}: ms/step | {c}: time to target |")
    });
    let _ = writeln!(
        out,
        "| run | algorithm | workers | steps | final val | best val | tokens/s | bytes/step/worker | to val <= {} |{extra}",
        opt(target, 4)
    );
    let _ = writeln!(
        out,
        "|---|---|---|---|---|---|---|---|---|{}",
        if cluster.is_some() { "---|---|" } else { "" }
    );
    for run in runs {
        let s = summarize(run, target);
        let reach = match (s.steps_to_target, s.time_to_target) {
            (Some(step), Some(t)) => format!("step {step}, {t:.1} s"),
            _ => "not reached".into(),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {:.0} | {} | {} |",
            s.name,
            s.algorithm,
            s.workers.map_or("?".into(), |w| w.to_string()),
            s.steps,
            opt(s.final_val, 4),
            opt(s.best_val, 4),
            s.tokens_per_s,
            human_bytes(s.bytes_per_step),
            reach
        );
        if cluster.is_some() {
            out.pop();
            let _ = writeln!(
                out,
                " {} | {} |",
                opt(s.predicted_ms_per_step, 1),
                s.predicted_to_target
                    .map_or("not reached".into(), crate::predict::human_secs)
            );
        }
    }
    out
}

/// Loads every run directory, naming the one that fails.
pub fn load_runs(dirs: &[PathBuf]) -> Result<Vec<Run>> {
    dirs.iter()
        .map(|d| Run::load(d).with_context(|| format!("loading run {}", d.display())))
        .collect()
}

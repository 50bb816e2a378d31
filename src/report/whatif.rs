//! `nanodist predict` for one target on one cluster (`one`) and its comparisons: several configs, run
//! directories or `--variant`s of them on one or more clusters in one table, with the speed-up of each
//! against the first entry on the same cluster, predicted time to a target loss for run directories, and a
//! note where per-message latency dominates a step (and what would change it).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Result;
use serde::Serialize;

use crate::predict::{self, profile::Cluster, Prediction};

/// What is priced, and how.
#[derive(Debug, Clone, Default)]
pub struct Question {
    /// `--set` for every entry.
    pub set: Vec<String>,
    /// World size (default: a run's own, else the config's).
    pub workers: Option<usize>,
    pub ranks_per_node: Option<usize>,
    /// A run's compute from its measured ms/step (run directories only).
    pub measured: bool,
    /// The machine the run directories ran on (default: the `local` profile): their measured times are
    /// scaled from its device to the cluster's.
    pub ran_on: Option<crate::predict::profile::ClusterProfile>,
}

/// One entry of a comparison: a config or run directory, with the `--set`s of its variant.
#[derive(Debug, Clone)]
pub struct Entry {
    pub label: String,
    pub target: PathBuf,
    pub set: Vec<String>,
}

impl Entry {
    /// Each target as it is, then with each variant ("KEY=VALUE,KEY=VALUE") added to its `--set`s.
    pub fn all(targets: &[PathBuf], variants: &[String]) -> Vec<Entry> {
        let name = |t: &Path| {
            t.file_stem()
                .map_or(t.display().to_string(), |s| s.to_string_lossy().to_string())
        };
        targets
            .iter()
            .flat_map(|t| {
                let plain = Entry {
                    label: name(t),
                    target: t.clone(),
                    set: Vec::new(),
                };
                let varied = variants.iter().map(move |v| Entry {
                    label: format!("{} {v}", name(t)),
                    target: t.clone(),
                    set: v.split(',').map(|kv| kv.trim().to_string()).collect(),
                });
                std::iter::once(plain).chain(varied)
            })
            .collect()
    }
}

/// `target` (a config, or a run directory: its logged communication and evaluations) on `cluster`.
pub fn one(target: &Path, extra: &[String], cluster: &Cluster, q: &Question) -> Result<Prediction> {
    let set: Vec<String> = q.set.iter().chain(extra).cloned().collect();
    if !target.join("metrics.jsonl").is_file() {
        if q.measured {
            return Err(crate::bad_input!(
                "--measured needs a run directory (its metrics.jsonl), not a config"
            ));
        }
        let (loaded, layout) =
            predict::load(target, &set, q.workers, &cluster.profile, q.ranks_per_node)?;
        return predict::predict(&loaded, cluster, layout);
    }
    let run = super::Run::load(target)?;
    let (loaded, layout) = predict::load(
        &target.join("config.toml"),
        &set,
        q.workers.or(run.world_size),
        &cluster.profile,
        q.ranks_per_node.or_else(|| run.placed_on(&cluster.profile)),
    )?;
    let ran_on = match &q.ran_on {
        Some(p) => p.clone(),
        None => predict::profile::load("local")?.profile,
    };
    let compute = match q.measured {
        true => Some(predict::measured_compute(
            &run.rows,
            run.world_size.unwrap_or(1),
            &loaded,
            cluster,
            &ran_on,
        )?),
        false => None,
    };
    predict::predict_run(&loaded, &run.rows, (cluster, &ran_on), layout, compute)
}

/// One line of a comparison (`predict --json` with several entries or clusters gives these).
#[derive(Debug, Clone, Serialize)]
pub struct Line {
    pub entry: String,
    pub cluster: String,
    pub ms_per_step: f64,
    pub tokens_per_s: f64,
    /// The first entry's ms/step on the same cluster over this one's.
    pub speedup: f64,
    pub exposed_comm_ms: f64,
    /// The part of the step that is per-message latency (the step priced with latency-free links
    /// subtracted from it), and the messages a step sends.
    pub latency_ms: f64,
    pub messages_per_step: f64,
    /// The training loop's own collectives (loss means and stop votes; see `Average::control_ms`).
    pub control_ms: f64,
    /// Run directories: the first evaluation at or below the target loss, and its predicted seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_step: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_to_target_s: Option<f64>,
}

/// Every entry on every cluster; `target` is the loss to reach (default: the worst final val loss of
/// the run directories, which each of them reaches).
pub fn compare(
    entries: &[Entry],
    clusters: &[Cluster],
    q: &Question,
    target: Option<f64>,
) -> Result<Vec<Line>> {
    let mut lines = Vec::new();
    for cluster in clusters {
        let mut flat = cluster.clone();
        flat.profile = flat.profile.latency_free();
        let mut first = None;
        let mut priced = Vec::new();
        for e in entries {
            let p = one(&e.target, &e.set, cluster, q)?;
            let latency =
                p.average.ms_per_step - one(&e.target, &e.set, &flat, q)?.average.ms_per_step;
            let base = *first.get_or_insert(p.average.ms_per_step);
            priced.push((e, p, latency, base));
        }
        let target = target.or_else(|| {
            let finals = priced
                .iter()
                .filter_map(|(_, p, ..)| p.evals.last().map(|e| e.val_loss));
            finals.reduce(f64::max)
        });
        for (e, p, latency, base) in priced {
            let reached = target.and_then(|t| p.evals.iter().find(|v| v.val_loss <= t));
            lines.push(Line {
                entry: e.label.clone(),
                cluster: cluster.name.clone(),
                ms_per_step: p.average.ms_per_step,
                tokens_per_s: p.tokens_per_s,
                speedup: base / p.average.ms_per_step,
                exposed_comm_ms: p.average.exposed_comm_ms,
                latency_ms: latency.max(0.0),
                messages_per_step: p.average.collectives.iter().map(|c| c.per_step).sum(),
                control_ms: p.average.control_ms,
                target_step: reached.map(|v| v.step),
                time_to_target_s: reached.map(|v| v.predicted_s),
            });
        }
    }
    Ok(lines)
}

/// The comparison as a Markdown table, then a note for each line whose step is mostly latency.
pub fn table(lines: &[Line]) -> String {
    use crate::units::{secs, sig3};
    let runs = lines.iter().any(|l| l.target_step.is_some());
    let mut out = String::from(
        "| entry | cluster | ms/step | tokens/s | speed-up | exposed comm ms | latency ms |",
    );
    out += if runs { " time to target |\n" } else { "\n" };
    out += &"|---".repeat(7 + usize::from(runs));
    out += "|\n";
    for l in lines {
        let _ = write!(
            out,
            "| {} | {} | {} | {} | {}x | {} | {} |",
            l.entry,
            l.cluster,
            sig3(l.ms_per_step),
            sig3(l.tokens_per_s),
            sig3(l.speedup),
            sig3(l.exposed_comm_ms),
            sig3(l.latency_ms)
        );
        if runs {
            let t = match (l.target_step, l.time_to_target_s) {
                (Some(step), Some(s)) => format!("step {step}, {}", secs(s)),
                _ => "not reached".into(),
            };
            let _ = write!(out, " {t} |");
        }
        out.push('\n');
    }
    for l in lines.iter().filter(|l| l.latency_ms > 0.5 * l.ms_per_step) {
        let _ = writeln!(
            out,
            "\n{} on {}: latency-bound, {} of its {} ms/step is per-message latency ({} collectives a step, \
             and {} ms/step of loss means and stop votes); fewer, larger messages would cut it \
             (train.bucket_size_mb for all-reduce's buckets, a longer train.diloco.sync_every, fewer gossip \
             rounds, a larger log.log_interval for the bookkeeping).",
            l.entry,
            l.cluster,
            sig3(l.latency_ms),
            sig3(l.ms_per_step),
            sig3(l.messages_per_step),
            sig3(l.control_ms)
        );
    }
    out
}

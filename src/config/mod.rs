//! The experiment config: one TOML file, typed and validated. This is the only module that knows TOML.
//!
//! Parsing runs in phases: parse (syntax errors with line:column), apply `--set` overrides, check the
//! shape against the generated JSON Schema, deserialize into the typed [`Config`]; `validate` checks the
//! cross-field rules. `crate::plan` resolves a config and its launch into the run's plan.

pub mod backend;
pub mod batch;
pub mod error;
pub mod log;
pub mod lr;
pub mod membership;
pub mod model;
pub mod optim;
pub mod train;
pub mod tree;
pub mod validate;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use backend::{Backend, Compression, Engine, Topology};
pub use error::{ConfigError, Problem};
pub use log::LogConfig;
pub use lr::{LrSchedule, ScheduleName, WsdDecay};
pub use model::{Activation, ModelConfig};
pub use optim::{AccumAdamWConfig, AdamWConfig, MuonConfig, OptimConfig};
pub use train::{Device, TrainConfig};

/// A nanodist experiment: data, logging, training and model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
#[schemars(title = "nanodist experiment config")]
pub struct Config {
    /// Directory under which each run gets its own directory (metrics, checkpoints, resolved config).
    pub log_dir: String,
    /// Name of the dataset, used in run names and logs.
    pub dataset: String,
    /// Directory with train.bin and val.bin (nanoGPT uint16 tokens, as `nanodist prepare` writes them).
    pub data_dir: String,
    /// Training token sources with blend weights (default: data_dir/train.bin). A path ending in .bin is a
    /// nanoGPT file; a path with a sibling .idx (or a prefix of one) is a Megatron indexed dataset.
    pub train_data: Vec<DataSource>,
    /// Validation token sources (default: data_dir/val.bin).
    pub val_data: Vec<DataSource>,
    /// How the training data is divided among the workers (default "shared": every worker samples the
    /// whole blend, IID).
    pub worker_data: WorkerData,
    /// Load token files into memory instead of memory-mapping them.
    pub in_memory: bool,
    /// Sample the next step's batches on a loader thread while the step computes (the same batches
    /// either way; false: each step samples its own before it computes).
    pub prefetch: bool,
    /// Checkpoint to start from (a checkpoint directory or a run directory, whose newest valid checkpoint
    /// is used). Without it, a run resumes from its own run directory when it has checkpoints.
    pub checkpoint: Option<String>,
    /// What to take from `checkpoint`: "full" (weights, optimizer, step, data position: a resume) or
    /// "weights" (weights only: fine-tuning, or switching algorithm from a dense checkpoint).
    pub checkpoint_mode: CheckpointMode,
    /// Logging, evaluation and checkpointing.
    pub log: LogConfig,
    /// Training.
    pub train: TrainConfig,
    /// Model architecture.
    pub model: ModelConfig,
}

/// `[worker_data]`: what each worker's training windows are drawn from, selected by `name`. Windows stay a
/// pure function of (seed, step, row), so runs resume exactly; evaluation always samples the whole blend.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "name", deny_unknown_fields)]
pub enum WorkerData {
    /// Every worker samples the whole blend (IID data).
    #[default]
    #[serde(rename = "shared")]
    Shared,
    /// Worker r of N samples only the r-th of N contiguous shards of every source (different parts of
    /// the corpus: documents, plays, books), with the blend's weights.
    #[serde(rename = "shard")]
    Shard,
    /// Worker r samples the `train_data` sources with its own weights: row r of `weights` (row r mod
    /// rows when there are fewer rows than workers), one weight per source.
    #[serde(rename = "blend")]
    Blend {
        /// One row per worker, one non-negative weight per `train_data` source (a row may not be all 0).
        weights: Vec<Vec<f64>>,
    },
}

impl WorkerData {
    pub fn name(&self) -> &'static str {
        match self {
            WorkerData::Shared => "shared",
            WorkerData::Shard => "shard",
            WorkerData::Blend { .. } => "blend",
        }
    }
}

/// One token source of a blend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DataSource {
    /// A nanoGPT .bin file, or a Megatron dataset prefix (`<prefix>.bin` + `<prefix>.idx`).
    pub path: String,
    /// Relative sampling weight (normalised over the sources).
    #[serde(default = "one")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub weight: f64,
}

fn one() -> f64 {
    1.0
}

/// What a `checkpoint` contributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum CheckpointMode {
    /// Weights, optimizer and reducer state, step, RNG and data position: an exact resume.
    #[default]
    #[serde(rename = "full")]
    Full,
    /// Weights only; training starts at step 0 with fresh optimizer state.
    #[serde(rename = "weights")]
    Weights,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            log_dir: "./log".into(),
            dataset: "openwebtext".into(),
            data_dir: "./data/openwebtext".into(),
            train_data: Vec::new(),
            val_data: Vec::new(),
            worker_data: WorkerData::Shared,
            in_memory: false,
            prefetch: true,
            checkpoint: None,
            checkpoint_mode: CheckpointMode::Full,
            log: LogConfig::default(),
            train: TrainConfig::default(),
            model: ModelConfig::default(),
        }
    }
}

/// The JSON Schema of the config, generated from the wire types and their doc comments.
pub fn schema() -> serde_json::Value {
    let mut schema = schemars::schema_for!(Config).to_value();
    add_aliases(&mut schema);
    schema
}

/// serde aliases are invisible to schemars; list them in the schema so editors accept them too.
fn add_aliases(schema: &mut serde_json::Value) {
    let aliases = [
        ("Backend", "allreduce", "pytorchddp"),
        ("Topology", "one-peer-exp", "exp"),
        ("WarmupMethod", "Dense", "dense"),
    ];
    for (def, alias, of) in aliases {
        if let Some(branches) = schema
            .pointer_mut(&format!("/$defs/{def}/oneOf"))
            .and_then(|v| v.as_array_mut())
        {
            branches.push(serde_json::json!({
                "type": "string",
                "const": alias,
                "description": format!("Alias of \"{of}\"."),
            }));
        }
    }
}

/// Parses and shape-checks a document with overrides (no cross-field rules); counts given in samples
/// become steps (`samples_to_steps`).
pub fn parse(src: &str, overrides: &[String]) -> Result<(Config, tree::Node), Vec<Problem>> {
    let (mut config, doc) = parse_as(src, overrides, &schema())?;
    samples_to_steps(&mut config, &doc)?;
    Ok((config, doc))
}

/// BigScience's sample counts (`train.train_samples`, `train.lr_schedule.lr_warmup_samples`,
/// `lr_decay_samples`) as the step counts they stand for: the steps whose batches (the ramp-up's, if any)
/// reach the count; the config keeps the steps only (what the run writes and resumes with). A count given
/// both ways is an error, and so is a ramp-up that breaks Megatron's rules (it sizes the steps).
fn samples_to_steps(cfg: &mut Config, doc: &tree::Node) -> Result<(), Vec<Problem>> {
    let t = &cfg.train;
    let batches = batch::BatchSchedule::of(t.global_batch_size as u64, t.rampup_batch_size)
        .map_err(|e| {
            vec![validate::problem_at(
                doc,
                "train.rampup_batch_size",
                format!("{e} (Megatron's --rampup-batch-size rules)"),
            )]
        })?;
    let steps = |samples: u64| batches.steps_for(samples);
    let given = |path: &str| tree::find(doc, path).is_some();
    let mut problems = Vec::new();
    let mut both = |samples: &str, steps: &[&str]| {
        if given(samples) {
            if let Some(s) = steps.iter().find(|s| given(s)) {
                problems.push(validate::problem_at(
                    doc,
                    samples,
                    format!("give {s} or {samples}, not both"),
                ));
            }
        }
    };
    both("train.train_samples", &["train.n_steps"]);
    both(
        "train.lr_schedule.lr_warmup_samples",
        &[
            "train.lr_schedule.warmup_steps",
            "train.lr_schedule.warmup_fraction",
        ],
    );
    both(
        "train.lr_schedule.lr_decay_samples",
        &["train.lr_schedule.decay_steps"],
    );
    if !problems.is_empty() {
        return Err(problems);
    }
    let t = &mut cfg.train;
    if let Some(s) = t.train_samples.take() {
        t.n_steps = steps(s);
    }
    let lr = &mut t.lr_schedule;
    if let Some(s) = lr.lr_warmup_samples.take() {
        lr.warmup_steps = Some(steps(s));
    }
    if let Some(s) = lr.lr_decay_samples.take() {
        lr.decay_steps = Some(steps(s));
    }
    Ok(())
}

/// Parses a TOML document of any wire type `T` (a config, a cluster profile), applies `--set` overrides
/// and checks it against `T`'s schema, every problem with its key path and position.
pub fn parse_as<T: serde::de::DeserializeOwned>(
    src: &str,
    overrides: &[String],
    schema: &serde_json::Value,
) -> Result<(T, tree::Node), Vec<Problem>> {
    let mut doc = tree::parse_document(src).map_err(|e| {
        vec![Problem {
            path: String::new(),
            origin: Some(tree::Origin::File {
                line: e.line,
                col: e.col,
            }),
            message: format!("TOML syntax error: {}", e.message),
        }]
    })?;
    let mut problems = Vec::new();
    for arg in overrides {
        if let Err(message) = tree::apply_override(&mut doc, arg) {
            // The message names the --set itself.
            problems.push(Problem {
                path: String::new(),
                origin: Some(tree::Origin::Document),
                message,
            });
        }
    }
    problems.extend(validate::check_schema(schema, &doc));
    if !problems.is_empty() {
        return Err(problems);
    }
    let config = serde_json::from_value::<T>(doc.value.to_json()).map_err(|e| {
        vec![Problem {
            path: String::new(),
            origin: None,
            message: format!("invalid document: {e}"),
        }]
    })?;
    Ok((config, doc))
}

/// Leaf key paths of a JSON value with their values (arrays are leaves).
fn leaves(v: &serde_json::Value, path: &str, out: &mut Vec<(String, serde_json::Value)>) {
    match v.as_object() {
        Some(m) => {
            for (k, v) in m {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                leaves(v, &p, out);
            }
        }
        None => out.push((path.to_string(), v.clone())),
    }
}

/// The keys whose values differ between two configs: (key, checkpoint's value, this run's value).
pub fn diff(theirs: &Config, ours: &Config) -> Vec<(String, String, String)> {
    let flat = |c: &Config| {
        let mut out = Vec::new();
        leaves(&serde_json::to_value(c).unwrap_or_default(), "", &mut out);
        out.into_iter()
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let (a, b) = (flat(theirs), flat(ours));
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    let show = |v: Option<&serde_json::Value>| match v {
        None | Some(serde_json::Value::Null) => "unset".to_string(),
        Some(v) => v.to_string(),
    };
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| (k.clone(), show(a.get(k)), show(b.get(k))))
        .collect()
}

/// The keys that shape the model's parameters (`model.*` and `train.context_length`, which sizes the
/// position embedding) whose values differ between `a` and `b`, as `key = a's value there, b's here`.
pub fn model_diff(a: &Config, b: &Config) -> Vec<String> {
    diff(a, b)
        .into_iter()
        .filter(|(k, _, _)| k.starts_with("model.") || k == "train.context_length")
        .map(|(k, x, y)| format!("{k} = {x} there, {y} here"))
        .collect()
}

impl Config {
    /// The resolved config as TOML, every default written out (saved in each run directory).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }
}

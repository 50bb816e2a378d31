//! Helpers shared by the integration tests: a small synthetic token stream and a tiny model config.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

use nanodist::comm::{local, Communicator};

/// Writes train.bin / val.bin (u16 tokens below 48) with learnable structure: mostly t -> 3t + 1 mod 48.
pub fn make_data(dir: &Path) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    for (name, n) in [("train.bin", 40_000), ("val.bin", 4_000)] {
        let mut t = 0u16;
        let bytes: Vec<u8> = (0..n)
            .flat_map(|_| {
                t = if rng.random::<f64>() < 0.8 {
                    (t * 3 + 1) % 48
                } else {
                    rng.random_range(0..48)
                };
                t.to_le_bytes()
            })
            .collect();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

/// A 2-layer, 32-wide GPT over the data in `dir`, 20 steps, evaluated every 10; logs to dir/log/<run_name>.
/// Without the evaluation before training (`log.eval_at_start`, on by default): the rows are the steps
/// trained; the tests of that evaluation turn it on.
pub fn tiny_config(dir: &Path, run_name: &str) -> String {
    format!(
        "log_dir = {:?}\ndata_dir = {:?}\n[log]\nrun_name = \"{run_name}\"\neval_interval = 10\neval_at_start = false\neval_steps = 4\nlog_interval = 1\n\
         ckpt_interval = 0\n[train]\nseed = 3\nglobal_batch_size = 8\ncontext_length = 16\nn_steps = 20\n\
         [train.lr_schedule]\nname = \"cosine\"\nlr = 3e-3\nwarmup_steps = 4\neta_min = 3e-4\n\
         [model]\nn_layers = 2\nn_heads = 2\nn_embd = 32\nvocab_size = 64\nbias = true\n",
        dir.join("log").display().to_string(),
        dir.display().to_string()
    )
}

/// A test that needs a Python module or tool says why it skipped, or, where CI sets
/// NANODIST_REQUIRE_PYTHON=1 (its setup installs them), fails instead.
pub fn skip_python(missing: &str) {
    if std::env::var_os("NANODIST_REQUIRE_PYTHON").is_some_and(|v| v != "0") {
        panic!("{missing}, and NANODIST_REQUIRE_PYTHON is set: this test must run");
    }
    eprintln!("skipped: {missing}");
}

/// Runs `f` on every rank of a local group of `n` and returns the results in rank order.
pub fn on_ranks<T: Send>(n: usize, f: impl Fn(Box<dyn Communicator>) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = local::group(n, std::time::Duration::from_secs(30))
            .into_iter()
            .map(|c| s.spawn(move || f(Box::new(c))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The tiny config (see `tiny_config`) with `set` applied in order (`key.path=TOML value`, as `--set`
/// takes them); without `run_name` the run directory is named by the job (Slurm) or the start time. The
/// one place the tests' configs come from.
pub fn config(dir: &Path, run_name: Option<&str>, set: &[&str]) -> String {
    let mut doc: toml::Table = tiny_config(dir, run_name.unwrap_or("run")).parse().unwrap();
    if run_name.is_none() {
        doc["log"].as_table_mut().unwrap().remove("run_name");
    }
    for s in set {
        let (key, value) = s
            .split_once('=')
            .unwrap_or_else(|| panic!("{s}: not KEY=VALUE"));
        let value = format!("v = {value}").parse::<toml::Table>().unwrap()["v"].clone();
        let mut path: Vec<&str> = key.split('.').collect();
        let last = path.pop().unwrap();
        let mut table = &mut doc;
        for part in path {
            table = table
                .entry(part)
                .or_insert_with(|| toml::Value::Table(Default::default()))
                .as_table_mut()
                .unwrap_or_else(|| panic!("{key}: {part} is not a table"));
        }
        table.insert(last.to_string(), value);
    }
    toml::to_string(&doc).unwrap()
}

/// Runs the nanodist binary with `args`.
pub fn nanodist(args: &[&str]) -> Output {
    nanodist_with(args, &[])
}

/// Runs the nanodist binary with `args` and the environment variables `env` added.
pub fn nanodist_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nanodist"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// Writes the tiny config (see `tiny_config`) to `dir/name`; returns its path.
pub fn write_tiny_config(dir: &Path, name: &str, run_name: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, tiny_config(dir, run_name)).unwrap();
    path
}

/// The one in-process training run of the tests: config text `src` with `set` applied, on `workers`
/// local workers.
pub fn train_config(src: &str, workers: usize, set: &[&str]) -> nanodist::train::Summary {
    let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
    let launch = nanodist::plan::LaunchEnv {
        workers_flag: Some(workers),
        ..Default::default()
    };
    let loaded = nanodist::plan::load_str(Path::new("t.toml"), src, &set, &launch)
        .unwrap_or_else(|e| panic!("{set:?}: {e}"));
    nanodist::train::run(&loaded).unwrap_or_else(|e| panic!("{set:?}: {e:#}"))
}

/// The metrics rows of a run.
pub fn rows_of(s: &nanodist::train::Summary) -> Vec<nanodist::metrics::Row> {
    nanodist::metrics::read_rows(&s.run_dir.join("metrics.jsonl")).unwrap()
}

/// Trains the tiny config (evaluated every 5 steps) on `workers` local workers with `set`, in process.
pub fn train_tiny(
    dir: &Path,
    name: &str,
    workers: usize,
    set: &[&str],
) -> nanodist::train::Summary {
    train_config(
        &config(dir, Some(name), &["log.eval_interval=5"]),
        workers,
        set,
    )
}

/// One run of every synchronisation (backends, topologies, reducers, low-communication methods) for 4
/// workers in 2 nodes: (name, `--set`s over the tiny config).
pub const EVERY_BACKEND: &[(&str, &[&str])] = &[
    ("allreduce", &["train.bucket_size_mb=0.004"]),
    ("ring", &["train.backend=\"decentdp\"", "train.topology=\"ring\""]),
    (
        "exp-overlap",
        &["train.backend=\"decentdp\"", "train.topology=\"exp\"", "train.overlap=true"],
    ),
    (
        "alt",
        &[
            "train.backend=\"decentdp\"",
            "train.topology=\"alternating-exp-ring\"",
            "train.ranks_per_node=2",
        ],
    ),
    (
        "choco-exp-overlap",
        &[
            "train.backend=\"decentdp\"",
            "train.topology=\"exp\"",
            "train.overlap=true",
            "train.compression={ name = \"topk\", density = 0.1, consensus_step = 0.3 }",
        ],
    ),
    (
        "choco-alt-qsgd",
        &[
            "train.backend=\"decentdp\"",
            "train.topology=\"alternating-exp-ring\"",
            "train.ranks_per_node=2",
            "train.compression={ name = \"qsgd\", levels = 7, consensus_step = 0.3 }",
        ],
    ),
    ("topk", &["train.compression={ name = \"topk\", density = 0.05 }"]),
    (
        "radius",
        &["train.compression={ name = \"radius\", density = 0.05, interval = 4, threshold = 3, range = 1 }"],
    ),
    (
        "powersgd",
        &["train.compression={ name = \"powersgd\", rank = 2, start_iter = 3 }"],
    ),
    (
        "powersgd1",
        &["train.compression={ name = \"powersgd\", rank = 2, start_iter = 3, single_allreduce = true }"],
    ),
    ("diloco", &["train.backend=\"diloco\"", "train.diloco={ sync_every = 4 }"]),
    (
        "streaming",
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 4, fragments = 2, fragment_delay = 1, fragment_alpha = 0.5, quantize = \"fp8\" }",
        ],
    ),
    (
        "diloco-topk",
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 2 }",
            "train.compression={ name = \"topk\", density = 0.1 }",
        ],
    ),
    ("sparta", &["train.backend=\"sparta\"", "train.sparta={ p = 0.1 }"]),
    (
        "demo",
        &[
            "train.backend=\"demo\"",
            "train.optim={ name = \"sgd\", weight_decay = 0.01 }",
            "train.demo={ topk = 8, chunk = 16 }",
        ],
    ),
];

/// Everything a resumed run must reproduce bit for bit: every field a row computes (timings aside).
pub fn exact(r: &nanodist::metrics::Row) -> impl PartialEq + std::fmt::Debug {
    (
        (r.step, r.tokens, r.lr.to_bits(), r.train_loss.to_bits()),
        (r.grad_norm.to_bits(), r.param_norm.to_bits()),
        (r.val_loss.map(f64::to_bits), r.comm_bytes),
        (
            r.consensus_distance.map(f64::to_bits),
            r.pseudo_grad_norm.map(f64::to_bits),
            r.compression_ratio.map(f64::to_bits),
            r.consensus_step.map(f64::to_bits),
        ),
    )
}

/// The tensors of a safetensors file, by name: (name, raw bytes), sorted.
pub fn tensors(path: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut named: Vec<(String, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.data().to_vec()))
        .collect();
    named.sort();
    named
}

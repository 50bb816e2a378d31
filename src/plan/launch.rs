//! What the launcher and the machine say about a process: besides the config, the one input of
//! `resolve`. Everything that reads the world (environment variables, the cores, the bf16 rate probe)
//! happens here, in `detect`, so that resolving is a function of (config, LaunchEnv).

use anyhow::{Context, Result};

/// What the launcher says about this process. Built from `--workers` and the environment
/// (`mpirun`, `srun`, torchrun conventions).
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchEnv {
    /// `--workers N` from the command line.
    pub workers_flag: Option<usize>,
    /// World size and ranks per node reported by a launcher, if any.
    pub launcher_world: Option<usize>,
    pub launcher_local_world: Option<usize>,
    /// Processes started together by mpirun or srun (OMPI_COMM_WORLD_SIZE, SLURM_STEP_NUM_TASKS).
    pub launched_processes: Option<usize>,
    /// Path of the prepared data's vocabulary size (`meta.json`), when the data is present.
    pub data_vocab: Option<(String, usize)>,
    /// This machine's cores (the local engine's threads and compute slots follow from them).
    pub cores: usize,
    /// The rate of this CPU's bf16 products (AMX or vdpbf16ps) over its f32 FMA, which decides `train.amp` on
    /// the CPU engine; None: no AVX512-BF16.
    pub cpu_bf16_rate: Option<f64>,
}

impl Default for LaunchEnv {
    /// No launcher, no flags, this machine's cores, and no bf16 products (as a CPU without AVX512-BF16):
    /// what tests and tools that resolve a config for their own purposes start from.
    fn default() -> Self {
        Self {
            workers_flag: None,
            launcher_world: None,
            launcher_local_world: None,
            launched_processes: None,
            data_vocab: None,
            cores: std::thread::available_parallelism().map_or(1, |c| c.get()),
            cpu_bf16_rate: None,
        }
    }
}

impl LaunchEnv {
    /// This process's rank in a job started by mpirun or srun.
    pub fn process_rank() -> Option<usize> {
        ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"]
            .iter()
            .find_map(|n| std::env::var(n).ok()?.trim().parse().ok())
    }

    /// This process as the launcher and the machine say: the launcher's variables, the cores, and the
    /// CPU's bf16 rate (see `cpu_bf16_rate`). The one place a plan's inputs are read from the world.
    pub fn detect(workers_flag: Option<usize>) -> Result<Self> {
        Ok(Self {
            cpu_bf16_rate: cpu_bf16_rate()?,
            ..Self::from_env(workers_flag)
        })
    }

    /// Reads the launcher's variables: Open MPI, Slurm, then torchrun's.
    pub fn from_env(workers_flag: Option<usize>) -> Self {
        let var = |names: &[&str]| {
            names
                .iter()
                .find_map(|n| std::env::var(n).ok()?.trim().parse::<usize>().ok())
        };
        Self {
            workers_flag,
            launcher_world: var(&[
                "OMPI_COMM_WORLD_SIZE",
                "PMI_SIZE",
                "SLURM_NTASKS",
                "WORLD_SIZE",
            ]),
            launcher_local_world: var(&[
                "OMPI_COMM_WORLD_LOCAL_SIZE",
                "MPI_LOCALNRANKS",
                "SLURM_NTASKS_PER_NODE",
                "LOCAL_WORLD_SIZE",
            ]),
            launched_processes: var(&["OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"]),
            ..Self::default()
        }
    }
}

/// The rate of this CPU's bf16 products over its f32 FMA (None: no AVX512-BF16):
/// `NANODIST_CPU_BF16_RATE` when set (a number, or `none`); else what the probe recorded for this CPU's
/// model in `cpu-probe.json` of the cache folder (`data::cache::dir`); else
/// the probe (`model::matmul::rate`, about 3 ms), recorded there. A rate near the threshold thus decides
/// the same way every time on one machine, and rank 0's decision is every rank's anyway.
pub fn cpu_bf16_rate() -> Result<Option<f64>> {
    if let Ok(v) = std::env::var("NANODIST_CPU_BF16_RATE") {
        return match v.trim() {
            "none" => Ok(None),
            x => x.parse::<f64>().ok().filter(|r| *r > 0.0).map(Some).ok_or_else(|| {
                crate::bad_input!(
                    "NANODIST_CPU_BF16_RATE={v:?}: expected the rate of this CPU's bf16 products over its f32 \
                     FMA (a positive number such as 2.0), or none"
                )
            }),
        };
    }
    let cache = crate::data::cache::dir().map(|d| d.join("cpu-probe.json"));
    let model = cpu_model();
    let mut known: serde_json::Map<String, serde_json::Value> = cache
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    if let Some(v) = known.get(&model) {
        return Ok(v.as_f64());
    }
    let rate = crate::model::matmul::rate::peaks().map(|(bf16, fma)| bf16 / fma);
    if let Some(path) = cache {
        known.insert(
            model,
            rate.map_or(serde_json::Value::Null, serde_json::Value::from),
        );
        let text = serde_json::to_string_pretty(&known)?;
        // A cache that cannot be written is only a cache.
        let _ = std::fs::create_dir_all(path.parent().unwrap_or(&path))
            .context("cache folder")
            .and_then(|_| crate::data::format::write_atomic(&path, text.as_bytes()));
    }
    Ok(rate)
}

/// The CPU's model name (`/proc/cpuinfo`), with this build's version: what a recorded probe is of.
fn cpu_model() -> String {
    let name = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("model name")?
                    .split(':')
                    .nth(1)
                    .map(str::trim)
                    .map(String::from)
            })
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!(
        "{name} (nanodist {}, probe {PROBE_REVISION})",
        env!("CARGO_PKG_VERSION")
    )
}

/// What `rate::peaks` measures, in the recorded probe's key: a rate an older probe recorded is not
/// reused (2: AMX's tdpbf16ps where the CPU has AMX; 1: vdpbf16ps).
const PROBE_REVISION: u32 = 2;

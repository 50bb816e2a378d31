//! `nanodist sbatch`: validate a config for the job it will run in, render the batch script from the
//! template in scripts/slurm/ and submit it. A config that would fail in the queue fails here instead.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::bad_input;
use crate::config::{self, Engine};
use crate::plan::{LaunchEnv, Loaded};
use crate::train::preflight;

/// The batch script every job runs (one source: scripts/slurm/gpu.sbatch is rendered from it).
pub const TEMPLATE: &str = include_str!("../scripts/slurm/cpu.sbatch");

/// What the job asks of Slurm; `None` takes the template's value or one derived from the config.
#[derive(Debug, Clone, Default)]
pub struct JobOptions {
    pub nodes: Option<usize>,
    pub tasks_per_node: Option<usize>,
    pub cpus_per_task: Option<usize>,
    /// GPUs per node: a GPU job, one rank per GPU on the NCCL engine (CUDA device).
    pub gpus_per_node: Option<usize>,
    /// Wall-clock limit, HH:MM:SS or D-HH:MM:SS.
    pub time: Option<String>,
    pub partition: Option<String>,
    /// A job array, e.g. "1-10%1": a chain of links, each resuming where the previous stopped.
    pub array: Option<String>,
    /// Seconds before the time limit at which Slurm sends USR1 (nanodist checkpoints and exits).
    pub signal_secs: u32,
    /// The nanodist binary the job runs (default: this one).
    pub nanodist: Option<PathBuf>,
    /// `#SBATCH` directives passed as they are: account, qos, constraint, mem, mail-type, mail-user,
    /// job-name (key, value); `exclusive` is bare.
    pub directives: Vec<(&'static str, String)>,
    pub exclusive: bool,
    /// Further directives, each `--flag=value` or `--flag` (`--sbatch-arg`).
    pub sbatch_args: Vec<String>,
    /// Lines run before the launch (`--setup FILE`: module loads, environments).
    pub setup: Option<PathBuf>,
    /// srun's MPI plugin (`--mpi`).
    pub mpi: String,
}

/// The `#SBATCH` keys that `nanodist sbatch` passes from flags of the same name.
pub const PASSED: [&str; 7] = [
    "account",
    "qos",
    "constraint",
    "mem",
    "mail-type",
    "mail-user",
    "job-name",
];

/// A rendered job: the script, its arguments, the loaded config it was validated as, and what a
/// submission refuses (the job's binary lacks the engine, the data is not where the job reads it).
#[derive(Debug)]
pub struct Job {
    pub script: String,
    pub args: Vec<String>,
    pub loaded: Loaded,
    pub tasks: usize,
    pub refusals: Vec<String>,
}

/// Sets `#SBATCH --key=value` (replacing the template's line, or adding one after the last directive),
/// or removes the directive when `value` is None.
fn set_directive(lines: &mut Vec<String>, key: &str, value: Option<&str>) {
    let prefix = format!("#SBATCH --{key}=");
    let bare = format!("#SBATCH --{key}");
    let at = lines
        .iter()
        .position(|l| l.starts_with(&prefix) || *l == bare);
    // An empty value is a bare flag (`#SBATCH --exclusive`).
    let line = |v: &str| match v {
        "" => bare.clone(),
        v => format!("{prefix}{v}"),
    };
    match (at, value) {
        (Some(i), Some(v)) => lines[i] = line(v),
        (Some(i), None) => {
            lines.remove(i);
        }
        (None, Some(v)) => {
            let last = lines
                .iter()
                .rposition(|l| l.starts_with("#SBATCH "))
                .map_or(1, |i| i + 1);
            lines.insert(last, line(v));
        }
        (None, None) => {}
    }
}

/// Sets the shell variable `NAME=` at the top of the template.
fn set_variable(lines: &mut [String], name: &str, value: &str) {
    let prefix = format!("{name}=");
    if let Some(l) = lines.iter_mut().find(|l| l.starts_with(&prefix)) {
        *l = format!("{prefix}{value}");
    }
}

/// A word for bash, single-quoted where needed.
pub fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Renders the template with `directives` and `variables` (both (key, value); None removes a directive).
pub fn render(directives: &[(&str, Option<String>)], variables: &[(&str, String)]) -> String {
    render_with(directives, variables, &[])
}

/// `render`, with `setup` lines run before the launch.
fn render_with(
    directives: &[(&str, Option<String>)],
    variables: &[(&str, String)],
    setup: &[String],
) -> String {
    let mut lines: Vec<String> = TEMPLATE.lines().map(str::to_string).collect();
    for (k, v) in directives {
        set_directive(&mut lines, k, v.as_deref());
    }
    for (k, v) in variables {
        set_variable(&mut lines, k, v);
    }
    if let Some(at) = lines.iter().position(|l| l.starts_with("srun ")) {
        lines.splice(at..at, setup.iter().cloned());
    }
    lines.join("\n") + "\n"
}

/// A `--sbatch-arg` as the directive it becomes: (key, value), "" for a bare flag.
fn sbatch_arg(arg: &str) -> Result<(String, String)> {
    let bad = || {
        bad_input!(
            "--sbatch-arg {arg:?}: expected --flag=value or --flag, as sbatch takes it (e.g. \
             --sbatch-arg=--reservation=big)"
        )
    };
    let flag = arg.strip_prefix("--").ok_or_else(bad)?;
    let (key, value) = flag.split_once('=').unwrap_or((flag, ""));
    let key_ok = !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
    if !key_ok || value.contains(['\n', '\r']) {
        return Err(bad());
    }
    Ok((key.to_string(), value.to_string()))
}

/// The lines of a `--setup` file, to run before the launch.
fn setup_lines(path: &Path) -> Result<Vec<String>> {
    let text =
        std::fs::read_to_string(path).map_err(|e| bad_input!("--setup {}: {e}", path.display()))?;
    let mut lines = vec![format!("# Site setup from {}", path.display())];
    lines.extend(text.lines().map(str::to_string));
    Ok(lines)
}

/// CPUs of a node of `partition` (the default partition when None), as Slurm knows them; None when sinfo
/// does not answer.
fn node_cpus(partition: Option<&str>) -> Option<usize> {
    let mut cmd = Command::new("sinfo");
    cmd.args(["-h", "-o", "%c"]);
    if let Some(p) = partition {
        cmd.args(["-p", p]);
    }
    let out = cmd.output().ok().filter(|o| o.status.success())?;
    // The smallest node of the partition, so that every node can hold the tasks.
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().trim_end_matches('+').parse::<usize>().ok())
        .min()
}

/// CPUs of a GPU rank when the partition's nodes are unknown here (data loading and the host side of its
/// steps; the GPU template's value).
const GPU_TASK_CPUS: usize = 8;

/// The GPU template (scripts/slurm/gpu.sbatch): one task per GPU on the NCCL engine.
pub fn gpu_template() -> String {
    render(
        &[
            ("ntasks-per-node", Some("4".into())),
            ("gpus-per-node", Some("4".into())),
            ("cpus-per-task", Some(GPU_TASK_CPUS.to_string())),
        ],
        &[("ENGINE", "nccl".into())],
    )
}

/// Checks `time` is a Slurm duration we can pass on: [D-]HH:MM:SS, MM:SS or minutes.
fn check_time(time: &str) -> Result<()> {
    let (days, rest) = match time.split_once('-') {
        Some((d, r)) => (Some(d), r),
        None => (None, time),
    };
    let parts: Vec<&str> = rest.split(':').collect();
    let numeric = |s: &str| !s.is_empty() && s.len() <= 4 && s.chars().all(|c| c.is_ascii_digit());
    let ok = days.is_none_or(numeric) && parts.len() <= 3 && parts.iter().all(|p| numeric(p));
    if !ok {
        return Err(bad_input!(
            "--time {time:?}: expected HH:MM:SS, D-HH:MM:SS, MM:SS or minutes"
        ));
    }
    Ok(())
}

/// CPUs per task: given, else train.threads (times the workers of the local engine), else the node's CPUs
/// shared by its tasks (each rank's threads follow: the script sets RAYON_NUM_THREADS from them); where
/// sinfo does not know the partition's nodes, 1 per CPU rank and `GPU_TASK_CPUS` per GPU rank.
fn cpus_per_task(
    opts: &JobOptions,
    threads: Option<usize>,
    engine: Engine,
    world: usize,
    tasks_per_node: usize,
) -> usize {
    let per_worker = |threads: usize| match engine {
        Engine::Local => world * threads,
        _ => threads,
    };
    match (opts.cpus_per_task, threads) {
        (Some(c), _) => c,
        (None, Some(t)) => per_worker(t),
        (None, None) => node_cpus(opts.partition.as_deref()).map_or(
            match engine {
                Engine::Nccl => GPU_TASK_CPUS,
                _ => per_worker(1),
            },
            |c| (c / tasks_per_node).max(1),
        ),
    }
}

/// `--sbatch-arg` directives as (key, value), "" for a bare flag.
type Directives = Vec<(String, String)>;

/// The site's additions, checked: the `--setup` lines and the `--sbatch-arg` directives; `--mpi` must
/// name a plugin.
fn site(opts: &JobOptions) -> Result<(Vec<String>, Directives)> {
    let mpi_ok = !opts.mpi.is_empty()
        && opts
            .mpi
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-".contains(c));
    if !mpi_ok {
        return Err(bad_input!(
            "--mpi {:?}: an srun MPI plugin name, e.g. pmix, pmi2 or none (srun --mpi=list shows them)",
            opts.mpi
        ));
    }
    let setup = match &opts.setup {
        Some(p) => setup_lines(p)?,
        None => Vec::new(),
    };
    let extra = opts
        .sbatch_args
        .iter()
        .map(|a| sbatch_arg(a))
        .collect::<Result<Vec<_>>>()?;
    Ok((setup, extra))
}

/// Validates `config` (with `set`) for the job described by `opts` and renders its script.
pub fn prepare(config: &Path, set: &[String], opts: &JobOptions) -> Result<Job> {
    let config_abs = std::fs::canonicalize(config)
        .map_err(|e| bad_input!("config {}: {e}", config.display()))?;
    // First the config as written (engine and layout defaults); a config that does not parse gets the
    // full report of `load`.
    let src = std::fs::read_to_string(config)
        .map_err(|e| bad_input!("config {}: {e}", config.display()))?;
    let cfg = match config::parse(&src, set) {
        Ok((c, _)) => c,
        Err(_) => {
            crate::plan::load(config, set, &LaunchEnv::default())?;
            return Err(bad_input!("config {}: does not parse", config.display()));
        }
    };
    let layout = Layout::of(&cfg.train, opts)?;
    // The job's engine (and a GPU job's device), as the script passes them to `train`.
    let mut set = set.to_vec();
    let given = set.len();
    set.push(format!("train.engine=\"{}\"", layout.engine.name()));
    if layout.engine == Engine::Nccl {
        set.push("train.device=\"cuda\"".into());
    }
    let mpi = layout.engine != Engine::Local;
    let launch = LaunchEnv {
        workers_flag: None,
        launcher_world: mpi.then_some(layout.tasks),
        launcher_local_world: mpi.then_some(layout.tasks_per_node),
        launched_processes: Some(layout.tasks),
        ..LaunchEnv::default()
    };
    let loaded = crate::plan::load(config, &set, &launch)?;
    if let Some(time) = &opts.time {
        check_time(time)?;
    }
    // What `train` checks at the start of the job: `submit` refuses a job with any of these before it
    // waits in the queue; a dry run renders it and lists them.
    let own_binary = opts.nanodist.is_none();
    let (_, refusals) = preflight::survey(&loaded, preflight::Host::Job { own_binary });
    let refusals = refusals.iter().map(|e| format!("{e:#}")).collect();
    let script = script(&loaded, &layout, &config_abs, opts)?;
    let mut args = vec![config_abs.display().to_string()];
    for s in &set[..given] {
        args.extend(["--set".to_string(), s.clone()]);
    }
    Ok(Job {
        script,
        args,
        loaded,
        tasks: layout.tasks,
        refusals,
    })
}

/// A job's nodes, tasks and engine.
struct Layout {
    nodes: usize,
    tasks_per_node: usize,
    tasks: usize,
    engine: Engine,
}

impl Layout {
    /// The flags' layout, else the config's. The engine is resolved as `train` resolves "auto" under
    /// srun (one task: local threads; several: MPI) and passed on to it explicitly; a config written for
    /// the local engine runs its ranks on MPI when the job has several tasks. `--gpus-per-node G` makes a
    /// GPU job: the NCCL engine, one task per GPU.
    fn of(t: &crate::config::TrainConfig, opts: &JobOptions) -> Result<Self> {
        let nodes = opts.nodes.unwrap_or(1).max(1);
        if let Some(g) = opts.gpus_per_node {
            return Self::gpu(t.engine, nodes, g, opts.tasks_per_node);
        }
        if t.engine == Engine::Nccl {
            return Err(bad_input!(
                "train.engine = \"nccl\" runs one rank per GPU, and the job asks for none: add \
                 --gpus-per-node N (the GPUs of each node), or set train.engine = \"mpi\" for CPU nodes"
            ));
        }
        let world_cfg = t.workers.unwrap_or(1);
        let tasks_per_node = opts.tasks_per_node.or(t.ranks_per_node).unwrap_or_else(|| {
            if matches!(t.engine, Engine::Local | Engine::Auto) {
                1
            } else {
                (world_cfg / nodes).max(1)
            }
        });
        let tasks = nodes * tasks_per_node;
        let engine = match (t.engine, tasks) {
            (Engine::Auto | Engine::Local, 1) => Engine::Local,
            (Engine::Auto | Engine::Local, _) => Engine::Mpi,
            (e, _) => e,
        };
        Ok(Layout {
            nodes,
            tasks_per_node,
            tasks,
            engine,
        })
    }

    /// A GPU job of `gpus` per node: one NCCL rank per GPU. A CPU engine in the config, or a task count
    /// that is not one per GPU, is refused with the flag to change.
    fn gpu(engine: Engine, nodes: usize, gpus: usize, tasks: Option<usize>) -> Result<Self> {
        if gpus == 0 {
            return Err(bad_input!(
                "--gpus-per-node 0: give the GPUs of each node, or drop the flag for a CPU job"
            ));
        }
        if matches!(engine, Engine::Mpi | Engine::Local) {
            return Err(bad_input!(
                "--gpus-per-node {gpus} asks for GPUs, but train.engine = \"{}\" trains on CPUs: set \
                 train.engine = \"nccl\" (--set train.engine=nccl) or \"auto\", or drop --gpus-per-node",
                engine.name()
            ));
        }
        if let Some(t) = tasks.filter(|&t| t != gpus) {
            return Err(bad_input!(
                "--tasks-per-node {t} with --gpus-per-node {gpus}: the NCCL engine runs one rank per GPU; \
                 drop --tasks-per-node or make it {gpus}"
            ));
        }
        Ok(Layout {
            nodes,
            tasks_per_node: gpus,
            tasks: nodes * gpus,
            engine: Engine::Nccl,
        })
    }
}

/// The job script of `loaded` on `layout`: the #SBATCH directives (the derived ones, then the flags
/// passed as they are, so that those win, then the site file's) and the template's variables.
fn script(
    loaded: &Loaded,
    layout: &Layout,
    config_abs: &Path,
    opts: &JobOptions,
) -> Result<String> {
    let cfg = &loaded.config;
    let cpus = cpus_per_task(
        opts,
        cfg.train.threads,
        layout.engine,
        loaded.plan.world_size,
        layout.tasks_per_node,
    );
    let (setup, extra) = site(opts)?;
    let log_dir = crate::error::absolute(Path::new(&cfg.log_dir));
    let nanodist = match &opts.nanodist {
        Some(p) => crate::error::absolute(p),
        None => std::env::current_exe().context("locating the nanodist binary")?,
    };
    let gpus = (layout.engine == Engine::Nccl).then(|| layout.tasks_per_node.to_string());
    let stem = config_abs
        .file_stem()
        .map_or("run".into(), |s| s.to_string_lossy().to_string());
    let mut directives: Vec<(&str, Option<String>)> = vec![
        ("job-name", Some(format!("nanodist-{stem}"))),
        ("nodes", Some(layout.nodes.to_string())),
        ("ntasks-per-node", Some(layout.tasks_per_node.to_string())),
        ("cpus-per-task", Some(cpus.to_string())),
        ("gpus-per-node", gpus),
        ("time", opts.time.clone()),
        ("partition", opts.partition.clone()),
        ("array", opts.array.clone()),
        ("signal", Some(format!("B:USR1@{}", opts.signal_secs))),
        (
            "output",
            Some(format!("{}/slurm-%j.out", log_dir.display())),
        ),
    ];
    directives.extend(opts.directives.iter().map(|(k, v)| (*k, Some(v.clone()))));
    if opts.exclusive {
        directives.push(("exclusive", Some(String::new())));
    }
    directives.extend(extra.iter().map(|(k, v)| (k.as_str(), Some(v.clone()))));
    let run_name = match cfg.log.run_name.as_deref() {
        None | Some("") => String::new(),
        Some(name) => shell_quote(name),
    };
    Ok(render_with(
        &directives,
        &[
            ("NANODIST", shell_quote(&nanodist.display().to_string())),
            ("LOG_DIR", shell_quote(&log_dir.display().to_string())),
            ("ENGINE", layout.engine.name().to_string()),
            ("RUN_NAME", run_name),
            ("MPI", opts.mpi.clone()),
        ],
        &setup,
    ))
}

/// Writes the script to `<log_dir>/sbatch/`; returns its path.
pub fn write_script(job: &Job) -> Result<PathBuf> {
    let log_dir = crate::error::absolute(Path::new(&job.loaded.config.log_dir));
    let dir = log_dir.join("sbatch");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now())
        .to_string()
        .replace(':', "-");
    let path = dir.join(format!("{stamp}-{}.sbatch", std::process::id()));
    crate::data::format::write_atomic(&path, job.script.as_bytes())?;
    Ok(path)
}

/// The run directory the job will use: `<log_dir>/<log.run_name>`, else `<log_dir>/<job id>`.
pub fn run_dir(job: &Job, id: &str) -> PathBuf {
    let cfg = &job.loaded.config;
    crate::error::absolute(Path::new(&cfg.log_dir)).join(cfg.log.run_name.as_deref().unwrap_or(id))
}

/// Writes the script to `<log_dir>/sbatch/` and submits it; returns the job id and the script's path. A
/// job with refusals is not submitted: the error lists them all.
pub fn submit(job: &Job) -> Result<(String, PathBuf)> {
    if !job.refusals.is_empty() {
        return Err(bad_input!(
            "not submitted: the job would stop at its start:\n  - {}",
            job.refusals.join("\n  - ")
        ));
    }
    let path = write_script(job)?;
    let out = Command::new("sbatch")
        .arg("--parsable")
        .arg(&path)
        .args(&job.args)
        .output()
        .map_err(|e| anyhow::anyhow!("running sbatch: {e} (is Slurm's sbatch on PATH?)"))?;
    if !out.status.success() {
        anyhow::bail!(
            "sbatch {} failed ({}): {}",
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let id = stdout
        .trim()
        .split(';')
        .next()
        .unwrap_or_default()
        .to_string();
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_digit()) {
        anyhow::bail!("sbatch printed no job id: {stdout:?}");
    }
    Ok((id, path))
}

/// The sbatch command that submits `job` from its script at `script` (printed by --dry-run).
pub fn command_line(job: &Job, script: &Path) -> String {
    std::iter::once(format!(
        "sbatch {}",
        shell_quote(&script.display().to_string())
    ))
    .chain(job.args.iter().map(|a| shell_quote(a)))
    .collect::<Vec<_>>()
    .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives_are_replaced_added_and_removed() {
        let s = render(
            &[
                ("nodes", Some("4".into())),
                ("partition", Some("gpu".into())),
                ("requeue", None),
            ],
            &[("ENGINE", "nccl".into())],
        );
        assert!(s.contains("#SBATCH --nodes=4\n"));
        assert!(s.contains("#SBATCH --partition=gpu\n"));
        assert!(!s.contains("#SBATCH --requeue"));
        assert!(s.contains("\nENGINE=nccl\n"));
        assert_eq!(s.matches("#SBATCH --nodes").count(), 1);
        // Directives stay in the header: sbatch stops reading them at the first command.
        let first_cmd = s.find("\nNANODIST=").unwrap();
        assert!(s.rfind("#SBATCH").unwrap() < first_cmd);
    }

    #[test]
    fn committed_gpu_template_is_the_rendered_one() {
        let committed = include_str!("../scripts/slurm/gpu.sbatch");
        assert_eq!(
            committed,
            gpu_template(),
            "scripts/slurm/gpu.sbatch is stale: run `nanodist sbatch --print-gpu-template > scripts/slurm/gpu.sbatch`"
        );
    }

    #[test]
    fn quoting_and_time_checks() {
        assert_eq!(shell_quote("a/b.toml"), "a/b.toml");
        assert_eq!(shell_quote("x=\"y z\""), "'x=\"y z\"'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        for ok in ["20:00:00", "1-00:00:00", "30", "05:00"] {
            assert!(check_time(ok).is_ok(), "{ok}");
        }
        for bad in ["", "1h", "20:00:00:00", "a-10:00"] {
            assert!(check_time(bad).is_err(), "{bad}");
        }
    }
}

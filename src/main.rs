//! The nanodist command line. Each subcommand parses its flags and calls into the library.
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use nanodist::config;
use nanodist::generate::SampleOptions;
use nanodist::plan::{self, LaunchEnv};
use nanodist::predict;
use nanodist::slurm;
use nanodist::train::preflight;

/// Training allocates and frees large tensors every step; glibc's malloc maps and unmaps them each time,
/// and the page faults cost ~8% of a step. mimalloc keeps them for reuse.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use nanodist::data::{self, OutputFormat, PrepareOptions, TokenizerKind};

#[derive(Parser)]
#[command(
    name = "nanodist",
    version,
    about = "Declarative GPT pre-training experiments: allreduce, gossip and compressed data parallelism"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Config flags shared by `check` and `train`.
#[derive(clap::Args)]
struct ConfigArgs {
    /// The experiment's TOML file.
    config: PathBuf,
    /// Override a config key, e.g. --set train.lr_schedule.lr=3e-4 (repeatable; validated like the file).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Number of local workers (threads of this process) for the local engine.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    workers: Option<u32>,
}

#[derive(clap::Args)]
struct PrepareArgs {
    /// Input files or directories (read recursively; .jsonl/.ndjson lines are documents, other files are
    /// one document each).
    #[arg(long, required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    /// Output directory (train.bin, val.bin, meta.json).
    #[arg(long)]
    output: PathBuf,
    #[arg(long, value_enum, default_value = "gpt2")]
    tokenizer: TokenizerKind,
    /// Fraction of documents drawn into the validation split.
    #[arg(long, default_value_t = 0.0005)]
    val_fraction: f64,
    /// Seed of the train/val split.
    #[arg(long, default_value_t = 2357)]
    seed: u64,
    #[arg(long, value_enum, default_value = "nanogpt")]
    format: OutputFormat,
    /// JSONL field holding the text.
    #[arg(long, default_value = "text")]
    json_key: String,
    /// Tokenizer threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(clap::Args)]
struct SampleArgs {
    /// Checkpoint directory, a run directory (its newest valid checkpoint), or a weights file such as
    /// <run>/best_model.safetensors.
    ckpt: PathBuf,
    /// Text the samples continue ("\n" in it is a newline).
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    max_new_tokens: usize,
    /// Softmax temperature (lower is more conservative; 0: greedy, the most likely token).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 200)]
    top_k: usize,
    /// Seed of the sampling RNG (sample i uses seed + i).
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Number of samples.
    #[arg(long, default_value_t = 1)]
    num_samples: usize,
}

#[derive(clap::Args)]
struct SbatchArgs {
    /// The experiment's TOML file.
    #[arg(required_unless_present = "print_gpu_template")]
    config: Option<PathBuf>,
    /// Override a config key (repeatable); passed on to the job.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Nodes (default 1).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    nodes: Option<u32>,
    /// Ranks per node (default: train.ranks_per_node, else train.workers / nodes; 1 for the local engine).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    tasks_per_node: Option<u32>,
    /// CPUs per task (default: train.threads, times the workers on the local engine).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    cpus_per_task: Option<u32>,
    /// Time limit, HH:MM:SS or D-HH:MM:SS (default: the partition's).
    #[arg(long)]
    time: Option<String>,
    /// Slurm partition (default: the cluster's default partition).
    #[arg(long)]
    partition: Option<String>,
    /// Run as a chain of array tasks, e.g. 1-10%1; each link resumes where the last stopped.
    #[arg(long)]
    array: Option<String>,
    /// Seconds before the time limit at which nanodist is told to checkpoint and stop.
    #[arg(long, default_value_t = 120)]
    signal_secs: u32,
    /// The nanodist binary the job runs (default: this one; it must be visible on the nodes).
    #[arg(long)]
    nanodist: Option<PathBuf>,
    /// Slurm account (#SBATCH --account).
    #[arg(long, short = 'A')]
    account: Option<String>,
    /// Quality of service (#SBATCH --qos).
    #[arg(long)]
    qos: Option<String>,
    /// Node features (#SBATCH --constraint), e.g. "a100&ib".
    #[arg(long)]
    constraint: Option<String>,
    /// GPUs per node: a GPU job, one rank per GPU on the NCCL engine with train.device = "cuda"
    /// (#SBATCH --gpus-per-node; --tasks-per-node follows it).
    #[arg(long)]
    gpus_per_node: Option<u32>,
    /// Memory per node (#SBATCH --mem), e.g. 64G.
    #[arg(long)]
    mem: Option<String>,
    /// Whole nodes (#SBATCH --exclusive).
    #[arg(long)]
    exclusive: bool,
    /// Mail events (#SBATCH --mail-type), e.g. END,FAIL.
    #[arg(long)]
    mail_type: Option<String>,
    /// Mail address (#SBATCH --mail-user).
    #[arg(long)]
    mail_user: Option<String>,
    /// Job name (#SBATCH --job-name; default nanodist-<config name>).
    #[arg(long)]
    job_name: Option<String>,
    /// Any other #SBATCH directive, as sbatch takes it (repeatable): --sbatch-arg=--reservation=big.
    #[arg(long, value_name = "--FLAG[=VALUE]", allow_hyphen_values = true)]
    sbatch_arg: Vec<String>,
    /// A file of shell lines run before the launch (module load ..., source venv/bin/activate).
    #[arg(long, value_name = "FILE")]
    setup: Option<PathBuf>,
    /// srun's MPI plugin (srun --mpi=...).
    #[arg(long, default_value = "pmix")]
    mpi: String,
    /// Write the script to <log_dir>/sbatch/ and print it, its path and the sbatch command, instead of
    /// submitting.
    #[arg(long)]
    dry_run: bool,
    /// Print scripts/slurm/gpu.sbatch as rendered from the template, and exit.
    #[arg(long, conflicts_with = "config")]
    print_gpu_template: bool,
}

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  nanodist predict config/gpt2-small.toml --cluster a100-ib100 --workers 16\n  \
nanodist predict log/quickstart-char --cluster wan-1g --json\n  \
nanodist predict config/gpt2-small.toml --workers 16 --cluster a100-ib100 --cluster wan-1g \
--variant train.backend=diloco --variant train.bucket_size_mb=1000"
)]
struct PredictArgs {
    /// Config files, or run directories (their logged communication and evaluations); several make a
    /// comparison.
    #[arg(required = true, num_args = 1..)]
    targets: Vec<PathBuf>,
    /// A built-in profile (a40-25gbe, a100-ib100, h100-ib400, t4-ib, wan-1g, local) or a profile file;
    /// repeatable: each entry on each cluster.
    #[arg(long, value_name = "NAME|FILE", required = true)]
    cluster: Vec<String>,
    /// Each target again with these keys set (KEY=VALUE[,KEY=VALUE...]), compared with it; repeatable.
    #[arg(long, value_name = "KEY=VALUE,...")]
    variant: Vec<String>,
    /// In a comparison of run directories: the val loss to reach (default: the worst final one).
    #[arg(long, value_name = "VAL_LOSS")]
    target_loss: Option<f64>,
    /// World size (default: the run's, else the config's train.workers).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    workers: Option<u32>,
    /// Ranks per node (default: the cluster's devices per node).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    ranks_per_node: Option<u32>,
    /// Override config keys, as `train --set`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Compute from the run's own measured ms/step (minus its communication) scaled by the ratio of the
    /// `--ran-on` profile's device speed to the cluster's, instead of from FLOPs (run directories only).
    #[arg(long)]
    measured: bool,
    /// The profile of the machine the run directories ran on (default: local): their measured codec
    /// time (and compute, with --measured) is scaled from its device to the cluster's. A netlab run:
    /// the profile `calibrate` wrote inside the lab.
    #[arg(long, value_name = "NAME|FILE")]
    ran_on: Option<String>,
    /// JSON instead of the table.
    #[arg(long)]
    json: bool,
}

/// A job's layout for `check` to plan, as a launcher would start it, instead of this machine's.
#[derive(clap::Args)]
struct Preview {
    /// Plan for N ranks started by a launcher (mpirun -np N, srun -n N), not for this machine.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65536))]
    ranks: Option<u32>,
    /// With --ranks: the ranks of each node (default all of them on one).
    #[arg(long, value_name = "M", requires = "ranks", value_parser = clap::value_parser!(u32).range(1..))]
    ranks_per_node: Option<u32>,
    /// With --ranks: the device the job's ranks train on (cuda: the NCCL engine, one rank per GPU).
    #[arg(long, value_enum, requires = "ranks")]
    device: Option<PreviewDevice>,
}

#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum PreviewDevice {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum CalibrateEngine {
    Local,
    Mpi,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a config and print the resolved plan (world size, batch arithmetic, model size, run time).
    #[command(
        after_help = "Examples:\n  nanodist check config/quickstart-char.toml\n  \
nanodist check config/gpt2-small.toml --ranks 16 --ranks-per-node 4"
    )]
    Check {
        #[command(flatten)]
        args: ConfigArgs,
        /// Throughput (tokens/s for the whole job) used to estimate the run time.
        #[arg(long, value_name = "TOKENS_PER_S")]
        tokens_per_s: Option<f64>,
        #[command(flatten)]
        preview: Preview,
    },
    /// Tokenize text, directories of text or JSONL into train/val token files and meta.json.
    Prepare(PrepareArgs),
    /// Train as the config says; resumes from the run directory's newest valid checkpoint.
    Train {
        #[command(flatten)]
        args: ConfigArgs,
        /// Resume even though these config keys (or key prefixes, e.g. train.optim) differ from the
        /// checkpoint's; every other change to a run that resumes is refused with the differences.
        #[arg(long, value_name = "KEY", num_args = 1..)]
        allow_config_change: Vec<String>,
        /// Start over in a new run directory (NAME-2, NAME-3, ...) instead of resuming this one.
        #[arg(long)]
        fresh: bool,
    },
    /// Loss and perplexity of a checkpoint on a token file (.bin / Megatron prefix) or raw text.
    Eval {
        /// Checkpoint directory, a run directory (its newest valid checkpoint), or a weights file such as
        /// <run>/best_model.safetensors.
        ckpt: PathBuf,
        /// Token file, Megatron prefix, or a UTF-8 text file (tokenized with the checkpoint's tokenizer).
        #[arg(long)]
        data: PathBuf,
        /// Sequences per batch.
        #[arg(long, default_value_t = 8)]
        batch_size: usize,
        /// Evaluate at most this many tokens (consecutive windows from the start).
        #[arg(long)]
        max_tokens: Option<usize>,
    },
    /// Generate text from a checkpoint.
    Sample(SampleArgs),
    /// Validate a config for a Slurm job, render its batch script (scripts/slurm/) and submit it.
    Sbatch(Box<SbatchArgs>),
    /// Draw loss curves of runs (vs step, tokens, wall time and bytes sent) into a PNG and an SVG.
    Plot {
        /// Run directories (log_dir/<run>).
        #[arg(required = true, num_args = 1..)]
        runs: Vec<PathBuf>,
        /// The PNG to write; the SVG goes beside it.
        #[arg(long, default_value = "runs.png")]
        output: PathBuf,
        /// Draw val loss against the time predicted on this cluster (a built-in name or a profile file)
        /// instead of the measured wall time; repeat for a panel per cluster.
        #[arg(long, value_name = "NAME|FILE")]
        cluster: Vec<String>,
        /// The figure's title (default: the run's label, or "N runs").
        #[arg(long)]
        title: Option<String>,
        /// Draw steps, tokens and time on logarithmic axes (bytes always are).
        #[arg(long)]
        log_x: bool,
        /// Draw the loss on a logarithmic axis.
        #[arg(long)]
        log_y: bool,
        /// The loss axis's range, LO,HI (default: where the runs differ, past each panel's first tenth).
        #[arg(long, value_name = "LO,HI", value_parser = parse_ylim)]
        ylim: Option<(f64, f64)>,
        /// Smooth each curve: the trailing mean of its last N logged points.
        #[arg(long, value_name = "N", default_value_t = 1)]
        smooth: usize,
    },
    /// Compare runs: algorithm, workers, steps, final/best val loss, tokens/s, bytes per step (and per phase
    /// of a reducer that starts dense), comm share, consensus distance, time to a target.
    Compare {
        /// Run directories (log_dir/<run>).
        #[arg(required = true, num_args = 1..)]
        runs: Vec<PathBuf>,
        /// Val loss to reach (default: the worst final val loss among the runs).
        #[arg(long)]
        target: Option<f64>,
        /// Add the predicted ms/step and time to the target on this cluster (a built-in name or a
        /// profile file).
        #[arg(long, value_name = "NAME|FILE")]
        cluster: Option<String>,
        /// Print a Markdown table, CSV (one line per run) or JSON (an array of runs).
        #[arg(long, value_enum, default_value = "markdown")]
        format: nanodist::report::Format,
    },
    /// Predict a config's or a run's ms/step and time on a cluster (alpha-beta links, device FLOPs,
    /// each backend's own collectives and overlap).
    Predict(PredictArgs),
    /// Measure this machine's engines (all-reduce, ping-pong) and compute, and write a cluster profile.
    Calibrate {
        /// The engine to measure: in-process threads, or MPI processes (started with mpirun -np 2 when
        /// not already under a launcher).
        #[arg(long, value_enum, default_value = "local")]
        engine: CalibrateEngine,
        /// The profile to write.
        #[arg(long, default_value = "config/clusters/local.toml")]
        output: PathBuf,
        /// Internal (the MPI ranks of a calibration): the sharing efficiency, measured by earlier
        /// launches.
        #[arg(long, hide = true)]
        sharing: Option<f64>,
        /// Internal: only measure the lockstep step with this many rows per rank (rank 0 prints its
        /// seconds).
        #[arg(long, hide = true)]
        probe: Option<usize>,
    },
    /// Hosts in network namespaces joined by shaped links on this machine, for real multi-host runs
    /// (needs root, iproute2, and Open MPI for `run`).
    #[command(subcommand)]
    Netlab(nanodist::netlab::NetlabCommand),
    /// Print the config's JSON Schema (for editors: Taplo / Even Better TOML).
    Schema {
        /// The cluster profile's schema instead of the config's.
        #[arg(long)]
        cluster: bool,
        /// Write to this file instead of stdout.
        #[arg(long)]
        output: Option<PathBuf>,
    },
}

/// The plan of `args` for `ranks` ranks started by a launcher, `preview.ranks_per_node` to a node, on
/// `preview.device` (CUDA: the NCCL engine).
fn preview_load(args: &mut ConfigArgs, ranks: usize, preview: &Preview) -> Result<plan::Loaded> {
    if args.workers.is_some() {
        return Err(nanodist::bad_input!(
            "--workers sizes the local engine of this machine; with --ranks, leave it out"
        ));
    }
    if let Some(device) = preview.device {
        let (engine, device) = match device {
            PreviewDevice::Cuda => ("nccl", "cuda"),
            PreviewDevice::Cpu => ("auto", "cpu"),
        };
        args.set.push(format!("train.engine=\"{engine}\""));
        args.set.push(format!("train.device=\"{device}\""));
    }
    let mut launch = LaunchEnv {
        launcher_world: Some(ranks),
        launcher_local_world: Some(preview.ranks_per_node.map_or(ranks, |m| m as usize)),
        launched_processes: Some(ranks),
        ..LaunchEnv::default()
    };
    launch.data_vocab = data_vocab(&args.config, &args.set);
    Ok(plan::load(&args.config, &args.set, &launch)?)
}

/// `--ylim LO,HI`: two numbers, LO below HI.
fn parse_ylim(s: &str) -> std::result::Result<(f64, f64), String> {
    let parsed = s
        .split_once(',')
        .and_then(|(a, b)| Some((a.trim().parse::<f64>().ok()?, b.trim().parse::<f64>().ok()?)));
    match parsed {
        Some((lo, hi)) if lo < hi && lo.is_finite() && hi.is_finite() => Ok((lo, hi)),
        _ => Err(format!(
            "{s:?}: expected LO,HI with LO < HI, e.g. --ylim 2.3,2.6"
        )),
    }
}

fn load(args: &ConfigArgs) -> Result<plan::Loaded> {
    let mut launch = LaunchEnv::detect(args.workers.map(|w| w as usize))?;
    launch.data_vocab = data_vocab(&args.config, &args.set);
    Ok(plan::load(&args.config, &args.set, &launch)?)
}

/// The vocabulary of the prepared data, when the config's data directory has a meta.json.
fn data_vocab(path: &std::path::Path, set: &[String]) -> Option<(String, usize)> {
    let src = std::fs::read_to_string(path).ok()?;
    let (cfg, _) = config::parse(&src, set).ok()?;
    let meta = PathBuf::from(&cfg.data_dir).join("meta.json");
    let m = data::Meta::read(&PathBuf::from(&cfg.data_dir)).ok()?;
    Some((meta.display().to_string(), m.vocab_size))
}

/// `check`: the config's rules and everything `train` checks before it starts (data, build, device), on
/// this machine or for a previewed job layout.
fn check(mut args: ConfigArgs, tokens_per_s: Option<f64>, preview: Preview) -> Result<()> {
    let (loaded, host, place) = match preview.ranks {
        None => (load(&args)?, preflight::Host::Here, "on this machine"),
        Some(ranks) => (
            preview_load(&mut args, ranks as usize, &preview)?,
            preflight::Host::Job { own_binary: true },
            "for the job",
        ),
    };
    for note in &loaded.notes {
        tracing::info!("note: {note}");
    }
    // The plan first, then every problem with it at once (exit 2).
    let (_, problems) = preflight::survey(&loaded, host);
    println!(
        "{}: {}",
        loaded.path.display(),
        match problems.len() {
            0 => "ok".to_string(),
            n => format!("{n} problem(s) {place}, listed after the plan"),
        }
    );
    println!("{}", plan_text(&loaded)?);
    match tokens_per_s {
        Some(tps) if tps > 0.0 => println!(
            "run time          {} at {tps} tokens/s",
            nanodist::units::duration(loaded.plan.run_seconds(tps))
        ),
        Some(tps) => {
            return Err(nanodist::bad_input!(
                "--tokens-per-s must be positive, found {tps}"
            ))
        }
        None => println!("run time          pass --tokens-per-s N for an estimate"),
    }
    preflight::all_of(problems)
}

fn prepare(a: PrepareArgs) -> Result<()> {
    let report = data::prepare(&PrepareOptions {
        inputs: a.input,
        output: a.output,
        tokenizer: a.tokenizer,
        val_fraction: a.val_fraction,
        seed: a.seed,
        format: a.format,
        json_key: a.json_key,
        threads: a.threads,
        progress: true,
    })?;
    let m = &report.meta;
    println!(
        "{} tokenizer (vocab {}): train {} tokens in {} documents, val {} tokens in {} documents ({} split)",
        m.tokenizer.name(),
        m.vocab_size,
        m.train.tokens,
        m.train.documents,
        m.val.tokens,
        m.val.documents,
        m.split
    );
    println!(
        "{:.1} MB in {:.2} s: {:.2} MB/s",
        m.input_bytes as f64 / 1e6,
        report.seconds,
        report.mb_per_s()
    );
    for f in &m.files {
        println!("wrote {f}");
    }
    Ok(())
}

/// The resolved plan and what its synchronisation sends, as `check` and `train` print it.
fn plan_text(loaded: &plan::Loaded) -> Result<String> {
    let mut text = loaded.plan.to_string();
    for (key, value) in plan::sync_lines(&loaded.config, &loaded.plan)? {
        text += &format!("\n{key:<17} {value}");
    }
    if loaded.config.train.device == config::Device::Cpu {
        let memory = nanodist::train::memory::estimate(&loaded.config, &loaded.plan);
        text += &format!("\n{:<17} {memory}", "memory");
    }
    Ok(text)
}

fn train(args: ConfigArgs, opts: &nanodist::train::RunOptions) -> Result<()> {
    let loaded = load(&args)?;
    // In a multi-process job only rank 0 talks.
    let root = LaunchEnv::process_rank().unwrap_or(0) == 0;
    if root {
        for note in &loaded.notes {
            tracing::info!("note: {note}");
        }
        eprintln!("{}", plan_text(&loaded)?);
    }
    let summary = nanodist::train::run_with(&loaded, opts)?;
    if !root {
        return Ok(());
    }
    println!(
        "{} at step {} (last val loss {}); run directory {}",
        summary.exit,
        summary.step,
        summary
            .last_val_loss
            .map_or("n/a".into(), |v| format!("{v:.4}")),
        summary.run_dir.display()
    );
    if summary.bytes_sent > 0 {
        println!(
            "rank 0 sent {} ({} B) in this run, bookkeeping included",
            nanodist::units::bytes(summary.bytes_sent as f64),
            summary.bytes_sent
        );
    }
    Ok(())
}

fn eval(ckpt: PathBuf, data: PathBuf, batch_size: usize, max_tokens: Option<usize>) -> Result<()> {
    let r = nanodist::generate::eval_file(&ckpt, &data, batch_size, max_tokens)?;
    println!(
        "{}: {} tokens in {} windows of {}: loss {:.4}, perplexity {:.2}",
        data.display(),
        r.tokens,
        r.windows,
        r.context,
        r.loss,
        r.loss.exp()
    );
    Ok(())
}

fn sample(a: SampleArgs) -> Result<()> {
    let prompt = a.prompt.replace("\\n", "\n");
    for i in 0..a.num_samples {
        let opts = SampleOptions {
            max_new_tokens: a.max_new_tokens,
            temperature: a.temperature,
            top_k: a.top_k,
            seed: a.seed + i as u64,
        };
        println!("{}", nanodist::generate::sample(&a.ckpt, &prompt, &opts)?);
        if i + 1 < a.num_samples {
            println!("---------------");
        }
    }
    Ok(())
}

fn sbatch(a: SbatchArgs) -> Result<()> {
    let Some(config) = a.config.filter(|_| !a.print_gpu_template) else {
        print!("{}", slurm::gpu_template());
        return Ok(());
    };
    let opts = slurm::JobOptions {
        nodes: a.nodes.map(|n| n as usize),
        tasks_per_node: a.tasks_per_node.map(|n| n as usize),
        cpus_per_task: a.cpus_per_task.map(|n| n as usize),
        gpus_per_node: a.gpus_per_node.map(|n| n as usize),
        time: a.time,
        partition: a.partition,
        array: a.array,
        signal_secs: a.signal_secs,
        nanodist: a.nanodist,
        directives: slurm::PASSED
            .iter()
            .zip([
                a.account,
                a.qos,
                a.constraint,
                a.mem,
                a.mail_type,
                a.mail_user,
                a.job_name,
            ])
            .filter_map(|(k, v)| Some((*k, v?)))
            .collect(),
        exclusive: a.exclusive,
        sbatch_args: a.sbatch_arg,
        setup: a.setup,
        mpi: a.mpi,
    };
    let job = slurm::prepare(&config, &a.set, &opts)?;
    if a.dry_run {
        let path = slurm::write_script(&job)?;
        print!("{}", job.script);
        println!("# written to {}", path.display());
        println!("# submit with: {}", slurm::command_line(&job, &path));
        for r in &job.refusals {
            println!("# a submission from here would be refused: {r}");
        }
        return Ok(());
    }
    let (id, path) = slurm::submit(&job)?;
    println!(
        "submitted job {id} ({} task(s), engine {}): script {}; run directory {}",
        job.tasks,
        job.loaded.plan.engine.name(),
        path.display(),
        slurm::run_dir(&job, &id).display()
    );
    Ok(())
}

fn schema(cluster: bool, output: Option<PathBuf>) -> Result<()> {
    let schema = if cluster {
        nanodist::predict::profile::schema()
    } else {
        config::schema()
    };
    let text = serde_json::to_string_pretty(&schema)? + "\n";
    match output {
        Some(p) => std::fs::write(&p, text).with_context(|| format!("writing {}", p.display())),
        None => {
            print!("{text}");
            Ok(())
        }
    }
}

/// Run directories, priced on each of `clusters`.
fn runs_on(dirs: &[PathBuf], clusters: &[String]) -> Result<Vec<nanodist::report::Run>> {
    let mut runs = nanodist::report::load_runs(dirs)?;
    for name in clusters {
        let cluster = predict::profile::load(name)?;
        for run in &mut runs {
            run.predict_on(&cluster)
                .with_context(|| format!("predicting {} on {name}", run.dir.display()))?;
        }
    }
    Ok(runs)
}

fn predict(a: PredictArgs) -> Result<()> {
    use nanodist::report::whatif;
    let q = whatif::Question {
        set: a.set,
        workers: a.workers.map(|n| n as usize),
        ranks_per_node: a.ranks_per_node.map(|n| n as usize),
        measured: a.measured,
        ran_on: a
            .ran_on
            .as_deref()
            .map(predict::profile::load)
            .transpose()?
            .map(|c| c.profile),
    };
    let clusters = a
        .cluster
        .iter()
        .map(|c| predict::profile::load(c))
        .collect::<Result<Vec<_>>>()?;
    if let ([target], [cluster], []) = (&a.targets[..], &clusters[..], &a.variant[..]) {
        let out = whatif::one(target, &[], cluster, &q)?;
        match a.json {
            true => println!("{}", serde_json::to_string_pretty(&out)?),
            false => print!("{out}"),
        }
        return Ok(());
    }
    let entries = whatif::Entry::all(&a.targets, &a.variant);
    let lines = whatif::compare(&entries, &clusters, &q, a.target_loss)?;
    match a.json {
        true => println!("{}", serde_json::to_string_pretty(&lines)?),
        false => print!("{}", whatif::table(&lines)),
    }
    Ok(())
}

fn calibrate(
    engine: CalibrateEngine,
    output: &std::path::Path,
    sharing: Option<f64>,
    probe: Option<usize>,
) -> Result<()> {
    let measured = match engine {
        CalibrateEngine::Local => {
            // One rank per core, then two, each on its own thread, for the sharing efficiency; then two
            // ranks.
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let lockstep = |ranks: usize, rows: usize| {
                on_threads(ranks, |c| predict::calibrate::lockstep_step(c, rows)).map(|s| s[0])
            };
            let rows = predict::calibrate::LOCKSTEP_ROWS;
            let sharing = predict::calibrate::sharing_efficiency(|| {
                Ok((lockstep(cores, rows)?, lockstep(2 * cores, rows / 2)?))
            })?;
            on_threads(2, |c| {
                predict::calibrate::measure(c, "local", 2, Some(sharing))
            })?
            .swap_remove(0)
        }
        CalibrateEngine::Mpi => match calibrate_mpi(output, sharing, probe)? {
            Some(m) => m,
            None => return Ok(()),
        },
    };
    predict::calibrate::write_profile(output, &measured.profile_toml())?;
    println!(
        "{} engine, {} ranks ({} per node): alpha {:.1} us, bandwidth {:.4} GB/s; GEMM peak {:.1} GFLOP/s, \
         training {:.1} GFLOP/s, sharing efficiency {}; wrote {}",
        measured.engine,
        measured.ranks,
        measured.per_node,
        measured.alpha * 1e6,
        measured.bandwidth / 1e9,
        measured.peak / 1e9,
        measured.achieved / 1e9,
        measured
            .sharing
            .map_or("not measured".into(), |s| format!("{s:.2}")),
        output.display()
    );
    Ok(())
}

/// Runs `f` on `n` ranks of a local group, each on a one-thread pool of its own; results in rank order.
fn on_threads<T: Send>(
    n: usize,
    f: impl Fn(&mut dyn nanodist::comm::Communicator) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let comms = nanodist::comm::local::group(n, std::time::Duration::from_secs(300));
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                s.spawn(move || {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
                    pool.install(|| f(&mut c))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a calibration thread panicked")))
            })
            .collect()
    })
}

/// Under an MPI launcher: this rank's part (rank 0's measurement, None elsewhere; with `probe`, rank 0
/// prints the lockstep step's seconds). Otherwise launches the probes with one rank per core and two, in
/// pairs, then the measurement with two ranks, whose rank 0 writes the profile.
#[cfg(feature = "mpi")]
fn calibrate_mpi(
    output: &std::path::Path,
    sharing: Option<f64>,
    probe: Option<usize>,
) -> Result<Option<predict::calibrate::Measured>> {
    use nanodist::comm::Communicator;
    if LaunchEnv::process_rank().is_some() {
        let mut comm = nanodist::comm::mpi::MpiComm::init(std::time::Duration::from_secs(300))?;
        if let Some(rows) = probe {
            let secs = predict::calibrate::lockstep_step(&mut comm, rows)?;
            if comm.rank() == 0 {
                println!("{secs}");
            }
            return Ok(None);
        }
        let per_node = LaunchEnv::from_env(None)
            .launcher_local_world
            .unwrap_or(comm.world_size());
        let m = predict::calibrate::measure(&mut comm, "mpi", per_node, sharing)?;
        return Ok((comm.rank() == 0).then_some(m));
    }
    let exe = std::env::current_exe().context("locating this program for mpirun")?;
    // Open MPI refuses to start as root unless both of its variables say so (its documented override).
    let root = nanodist::netlab::is_root();
    if root {
        eprintln!(
            "calibrate: running as root, so mpirun gets OMPI_ALLOW_RUN_AS_ROOT=1 and \
             OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
        );
    }
    let mpirun = |np: usize, args: &[String]| -> Result<String> {
        let mut c = std::process::Command::new("mpirun");
        if root {
            c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        }
        let out = c
            .args(["--oversubscribe", "-np", &np.to_string()])
            .arg(&exe)
            .args(["calibrate", "--engine", "mpi"])
            .args(args)
            .env("RAYON_NUM_THREADS", "1")
            .stderr(std::process::Stdio::inherit())
            .output()
            .context("starting mpirun (apt-get install openmpi-bin)")?;
        if !out.status.success() {
            anyhow::bail!(
                "mpirun -np {np} nanodist calibrate --engine mpi failed: {}",
                out.status
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).to_string())
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let probe = |ranks: usize, rows: usize| -> Result<f64> {
        let probed = mpirun(ranks, &["--probe".into(), rows.to_string()])?;
        probed
            .trim()
            .parse::<f64>()
            .with_context(|| format!("the sharing probe printed {probed:?}"))
    };
    let rows = predict::calibrate::LOCKSTEP_ROWS;
    let sharing = predict::calibrate::sharing_efficiency(|| {
        Ok((probe(cores, rows)?, probe(2 * cores, rows / 2)?))
    })?;
    let args = [
        "--output".to_string(),
        output.display().to_string(),
        "--sharing".into(),
        sharing.to_string(),
    ];
    print!("{}", mpirun(2, &args)?);
    Ok(None)
}

#[cfg(not(feature = "mpi"))]
fn calibrate_mpi(
    _: &std::path::Path,
    _: Option<f64>,
    _: Option<usize>,
) -> Result<Option<predict::calibrate::Measured>> {
    Err(nanodist::bad_input!(
        "calibrate --engine mpi: this nanodist was built without MPI; rebuild with `cargo build --release --features mpi`"
    ))
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Check {
            args,
            tokens_per_s,
            preview,
        } => check(args, tokens_per_s, preview),
        Command::Prepare(a) => prepare(a),
        Command::Train {
            args,
            allow_config_change,
            fresh,
        } => train(
            args,
            &nanodist::train::RunOptions {
                allow_config_change,
                fresh,
            },
        ),
        Command::Eval {
            ckpt,
            data,
            batch_size,
            max_tokens,
        } => eval(ckpt, data, batch_size, max_tokens),
        Command::Sample(a) => sample(a),
        Command::Sbatch(a) => sbatch(*a),
        Command::Plot {
            runs,
            output,
            cluster,
            title,
            log_x,
            log_y,
            ylim,
            smooth,
        } => {
            let runs = runs_on(&runs, &cluster)?;
            let style = nanodist::report::plot::Style {
                title,
                log_x,
                log_y,
                ylim,
                smooth,
            };
            let (png, svg) = nanodist::report::plot::plot(&runs, &output, &style)?;
            println!("wrote {} and {}", png.display(), svg.display());
            Ok(())
        }
        Command::Compare {
            runs,
            target,
            cluster,
            format,
        } => {
            let runs = runs_on(&runs, cluster.as_slice())?;
            print!("{}", nanodist::report::compare(&runs, target, format)?);
            Ok(())
        }
        Command::Predict(a) => predict(a),
        Command::Calibrate {
            engine,
            output,
            sharing,
            probe,
        } => calibrate(engine, &output, sharing, probe),
        Command::Schema { cluster, output } => schema(cluster, output),
        Command::Netlab(c) => match nanodist::netlab::command(c)? {
            0 => Ok(()),
            // The job's own exit code (a failed rank's), after the counters were printed.
            code => std::process::exit(code),
        },
    }
}

/// On Linux mimalloc commits its arenas eagerly and then keeps their freed pages: with hundreds of local
/// workers that held ~9 MB per worker above what they use (128 workers of the quick-start model: 4.9 GB
/// peak RSS, 3.8 GB with eager commit off, the same step time). The option must be set before the first
/// arena is reserved, i.e. before the Rust runtime's first allocation: from an ELF constructor.
#[cfg(target_os = "linux")]
#[used]
#[link_section = ".init_array"]
static MIMALLOC_OPTIONS: extern "C" fn() = mimalloc_options;

#[cfg(target_os = "linux")]
extern "C" fn mimalloc_options() {
    /// `mi_option_arena_eager_commit`: index 4 of `mi_option_e` in mimalloc v2 and v3 (the bindings
    /// name only some options).
    const ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;
    // SAFETY: sets one of mimalloc's global options; it allocates nothing and reads nothing of ours.
    unsafe { libmimalloc_sys::mi_option_set(ARENA_EAGER_COMMIT, 0) };
}

fn main() -> ExitCode {
    nanodist::train::clock::mark_process_start();
    // candle runs its elementwise ops on a spin-waiting barrier pool beside rayon's. Training on CPU does
    // not use it (the CPU engine runs on rayon alone), but candle's graph does (generation); on a few cores
    // the spinning threads steal the cores rayon needs: one candle thread was 20% faster on 2 cores. Set
    // before any thread starts; an explicit value wins.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    // Read by Open MPI at MPI_Init; set before any thread starts (and inherited by the `mpirun` that
    // `netlab run` starts).
    for (key, value) in nanodist::comm::open_mpi_defaults(|k| std::env::var_os(k).is_some()) {
        std::env::set_var(key, value);
    }
    nanodist::logging::init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => {
            #[cfg(feature = "mpi")]
            nanodist::comm::mpi::finalize();
            ExitCode::SUCCESS
        }
        Err(e) => {
            // One rank of many names itself, and exits without finalising MPI (see `comm::mpi`).
            match mpi_rank() {
                Some(rank) => eprintln!("error: rank {rank}: {e:#}"),
                None => eprintln!("error: {e:#}"),
            }
            ExitCode::from(nanodist::error::exit_code(&e) as u8)
        }
    }
}

/// This process's rank, when it is one of several in an MPI job.
fn mpi_rank() -> Option<usize> {
    #[cfg(feature = "mpi")]
    if let Some((rank, n)) = nanodist::comm::mpi::joined() {
        return (n > 1).then_some(rank);
    }
    None
}

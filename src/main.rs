//! The nanodist command line. Each subcommand parses its flags and calls into the library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use nanodist::config::{self, resolve::format_duration, LaunchEnv};

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
    /// Override a config key, e.g. --set train.optim.lr=3e-4 (repeatable; validated like the file).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Number of local workers (threads of this process) for the local engine.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    workers: Option<u32>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a config and print the resolved plan (world size, batch arithmetic, model size, run time).
    Check {
        #[command(flatten)]
        args: ConfigArgs,
        /// Throughput (tokens/s for the whole job) used to estimate the run time.
        #[arg(long, value_name = "TOKENS_PER_S")]
        tokens_per_s: Option<f64>,
    },
    /// Tokenize text, directories of text or JSONL into train/val token files and meta.json.
    Prepare {
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
    },
    /// Train as the config says; resumes from the run directory's newest valid checkpoint.
    Train {
        #[command(flatten)]
        args: ConfigArgs,
    },
    /// Loss and perplexity of a checkpoint on a token file (.bin / Megatron prefix) or raw text.
    Eval {
        /// Checkpoint directory, or a run directory (its newest valid checkpoint).
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
    Sample {
        /// Checkpoint directory, or a run directory (its newest valid checkpoint).
        ckpt: PathBuf,
        #[arg(long, default_value = "\n")]
        prompt: String,
        /// Tokens to generate.
        #[arg(long, default_value_t = 200)]
        max_new_tokens: usize,
        /// Softmax temperature (> 0; lower is more conservative).
        #[arg(long, default_value_t = 0.8)]
        temperature: f64,
        /// Sample among the k most likely tokens (0: all).
        #[arg(long, default_value_t = 200)]
        top_k: usize,
        #[arg(long, default_value_t = 1337)]
        seed: u64,
        /// Number of samples.
        #[arg(long, default_value_t = 1)]
        num_samples: usize,
    },
    /// Validate a config for a Slurm job, render its batch script (scripts/slurm/) and submit it.
    Sbatch {
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
        /// Print the script and the sbatch command instead of submitting.
        #[arg(long)]
        dry_run: bool,
        /// Print scripts/slurm/gpu.sbatch as rendered from the template, and exit.
        #[arg(long, conflicts_with = "config")]
        print_gpu_template: bool,
    },
    /// Draw loss curves of runs (vs step, tokens, wall time and bytes sent) into a PNG and an SVG.
    Plot {
        /// Run directories (log_dir/<run>).
        #[arg(required = true, num_args = 1..)]
        runs: Vec<PathBuf>,
        /// The PNG to write; the SVG goes beside it.
        #[arg(long, default_value = "runs.png")]
        output: PathBuf,
    },
    /// Compare runs: algorithm, workers, steps, final/best val loss, tokens/s, bytes per step, time to a target.
    Compare {
        /// Run directories (log_dir/<run>).
        #[arg(required = true, num_args = 1..)]
        runs: Vec<PathBuf>,
        /// Val loss to reach (default: the worst final val loss among the runs).
        #[arg(long)]
        target: Option<f64>,
    },
    /// Print the config's JSON Schema (for editors: Taplo / Even Better TOML).
    Schema {
        /// Write to this file instead of stdout.
        #[arg(long)]
        output: Option<PathBuf>,
    },
}

fn load(args: &ConfigArgs) -> Result<config::Loaded> {
    let mut launch = LaunchEnv::from_env(args.workers.map(|w| w as usize));
    launch.data_vocab = nanodist_data_vocab(&args.config, &args.set);
    Ok(config::load(&args.config, &args.set, &launch)?)
}

/// The vocabulary of the prepared data, when the config's data directory has a meta.json.
fn nanodist_data_vocab(path: &std::path::Path, set: &[String]) -> Option<(String, usize)> {
    let src = std::fs::read_to_string(path).ok()?;
    let (cfg, _) = config::parse(&src, set).ok()?;
    let meta = PathBuf::from(&cfg.data_dir).join("meta.json");
    let m = data::Meta::read(&PathBuf::from(&cfg.data_dir)).ok()?;
    Some((meta.display().to_string(), m.vocab_size))
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Check { args, tokens_per_s } => {
            let loaded = load(&args)?;
            for note in &loaded.notes {
                println!("note: {note}");
            }
            println!("{}: ok", loaded.path.display());
            println!("{}", loaded.plan);
            match tokens_per_s {
                Some(tps) if tps > 0.0 => println!(
                    "run time          {} at {tps} tokens/s",
                    format_duration(loaded.plan.run_seconds(tps))
                ),
                Some(tps) => {
                    return Err(nanodist::bad_input!(
                        "--tokens-per-s must be positive, found {tps}"
                    ))
                }
                None => println!("run time          pass --tokens-per-s N for an estimate"),
            }
            Ok(())
        }
        Command::Prepare {
            input,
            output,
            tokenizer,
            val_fraction,
            seed,
            format,
            json_key,
            threads,
        } => {
            let report = data::prepare(&PrepareOptions {
                inputs: input,
                output,
                tokenizer,
                val_fraction,
                seed,
                format,
                json_key,
                threads,
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
        Command::Train { args } => {
            let loaded = load(&args)?;
            // In a multi-process job only rank 0 talks.
            let root = LaunchEnv::process_rank().unwrap_or(0) == 0;
            if root {
                for note in &loaded.notes {
                    eprintln!("note: {note}");
                }
                eprintln!("{}", loaded.plan);
            }
            let summary = nanodist::train::run(&loaded)?;
            if !root {
                return Ok(());
            }
            let how = match &summary.exit {
                nanodist::train::Exit::Finished => "finished".to_string(),
                nanodist::train::Exit::ExitInterval => "stopped at train.exit_interval".to_string(),
                nanodist::train::Exit::ExitDuration => {
                    "stopped at train.exit_duration_mins".to_string()
                }
                nanodist::train::Exit::Signal(s) => {
                    format!("stopped by {s} after saving a checkpoint")
                }
            };
            println!(
                "{how} at step {} (last val loss {}); run directory {}",
                summary.step,
                summary
                    .last_val_loss
                    .map_or("n/a".into(), |v| format!("{v:.4}")),
                summary.run_dir.display()
            );
            Ok(())
        }
        Command::Eval {
            ckpt,
            data,
            batch_size,
            max_tokens,
        } => {
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
        Command::Sample {
            ckpt,
            prompt,
            max_new_tokens,
            temperature,
            top_k,
            seed,
            num_samples,
        } => {
            let prompt = prompt.replace("\\n", "\n");
            for i in 0..num_samples {
                let text = nanodist::generate::sample(
                    &ckpt,
                    &prompt,
                    &nanodist::generate::SampleOptions {
                        max_new_tokens,
                        temperature,
                        top_k,
                        seed: seed + i as u64,
                    },
                )?;
                println!("{text}");
                if i + 1 < num_samples {
                    println!("---------------");
                }
            }
            Ok(())
        }
        Command::Sbatch {
            config,
            set,
            nodes,
            tasks_per_node,
            cpus_per_task,
            time,
            partition,
            array,
            signal_secs,
            nanodist,
            dry_run,
            print_gpu_template,
        } => {
            use nanodist::slurm;
            let Some(config) = config.filter(|_| !print_gpu_template) else {
                print!("{}", slurm::gpu_template());
                return Ok(());
            };
            let opts = slurm::JobOptions {
                nodes: nodes.map(|n| n as usize),
                tasks_per_node: tasks_per_node.map(|n| n as usize),
                cpus_per_task: cpus_per_task.map(|n| n as usize),
                time,
                partition,
                array,
                signal_secs,
                nanodist,
            };
            let job = slurm::prepare(&config, &set, &opts)?;
            if dry_run {
                print!("{}", job.script);
                println!("# submit with: {}", slurm::command_line(&job));
                return Ok(());
            }
            slurm::preflight(&job)?;
            let (id, path) = slurm::submit(&job)?;
            println!(
                "submitted job {id} ({} task(s), engine {}): script {}; run directory {}/{id}",
                job.tasks,
                job.loaded.plan.engine.name(),
                path.display(),
                job.loaded.config.log_dir
            );
            Ok(())
        }
        Command::Plot { runs, output } => {
            let runs = nanodist::report::load_runs(&runs)?;
            let (png, svg) = nanodist::report::plot::plot(&runs, &output)?;
            println!("wrote {} and {}", png.display(), svg.display());
            Ok(())
        }
        Command::Compare { runs, target } => {
            let runs = nanodist::report::load_runs(&runs)?;
            print!("{}", nanodist::report::compare(&runs, target));
            Ok(())
        }
        Command::Schema { output } => {
            let text = serde_json::to_string_pretty(&config::schema())? + "\n";
            match output {
                Some(p) => {
                    std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
                }
                None => {
                    print!("{text}");
                    Ok(())
                }
            }
        }
    }
}

fn main() -> ExitCode {
    // candle runs its elementwise ops on a spin-waiting barrier pool beside rayon's. Training on CPU does
    // not use it (the CPU engine runs on rayon alone), but candle's graph does (generation); on a few cores
    // the spinning threads steal the cores rayon needs: one candle thread was 20% faster on 2 cores. Set
    // before any thread starts; an explicit value wins.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(nanodist::error::exit_code(&e) as u8)
        }
    }
}

//! The nanodist command line. Each subcommand parses its flags and calls into the library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use nanodist::config::{self, resolve::format_duration, LaunchEnv};

#[derive(Parser)]
#[command(name = "nanodist", version, about = "Declarative GPT pre-training experiments: allreduce, gossip and compressed data parallelism")]
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
    let text = std::fs::read_to_string(&meta).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    Some((meta.display().to_string(), v.get("vocab_size")?.as_u64()? as usize))
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
                    return Err(nanodist::bad_input!("--tokens-per-s must be positive, found {tps}"))
                }
                None => println!("run time          pass --tokens-per-s N for an estimate"),
            }
            Ok(())
        }
        Command::Schema { output } => {
            let text = serde_json::to_string_pretty(&config::schema())? + "\n";
            match output {
                Some(p) => std::fs::write(&p, text).with_context(|| format!("writing {}", p.display())),
                None => {
                    print!("{text}");
                    Ok(())
                }
            }
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(nanodist::error::exit_code(&e) as u8)
        }
    }
}

//! The README's example commands, run as written: every line of a ```sh block that starts with `nanodist`
//! or `./target/release/nanodist` runs through `sh -c` in a scratch directory laid out like a checkout
//! (a copy of config/, data/ prepared from text this test writes, and log/ with the run directories the
//! examples name, trained here for a few steps), and must exit 0. The lines that cannot run here are listed
//! in NOT_HERE with the reason; a NOT_HERE entry that matches no README line fails the test, so the list
//! cannot go stale.

use std::path::Path;
use std::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_nanodist");

/// (a piece of the command line, why it does not run in a test).
const NOT_HERE: &[(&str, &str)] = &[
    (
        "nanodist calibrate",
        "measures this machine for minutes and rewrites config/clusters/local.toml \
         (tests/predict_validation.rs runs calibrate)",
    ),
    (
        "--time 20:00:00",
        "submits a 20-hour job to Slurm (the --dry-run line beside it renders the same job here; \
         tests/slurm.rs submits real jobs)",
    ),
];

/// The nanodist command lines of the README's ```sh blocks.
fn examples(readme: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_sh = false;
    for line in readme.lines() {
        let t = line.trim();
        if t.starts_with("```") {
            in_sh = !in_sh && t == "```sh";
            continue;
        }
        if in_sh && (t.starts_with("nanodist ") || t.starts_with("./target/release/nanodist ")) {
            out.push(t.to_string());
        }
    }
    out
}

/// Text for the example datasets, 20 documents of generated dialogue (no third-party text), with the
/// characters of the README's prompt.
fn write_text(dir: &Path) {
    use rand::{Rng, SeedableRng};
    std::fs::create_dir_all(dir).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let names = ["ROMEO", "JULIET", "NURSE", "FRIAR"];
    let words = [
        "the", "night", "is", "young", "and", "fair", "my", "lord", "speak", "again", "light",
        "soft", "what", "window", "breaks", "love", "sweet", "sorrow", "parting", "good",
    ];
    for doc in 0..20 {
        let mut text = String::new();
        for _ in 0..100 {
            text += names[rng.random_range(0..names.len())];
            text += ":\n";
            let n = rng.random_range(4..12);
            let line: Vec<&str> = (0..n)
                .map(|_| words[rng.random_range(0..words.len())])
                .collect();
            text += &line.join(" ");
            text += ".\n\n";
        }
        std::fs::write(dir.join(format!("play{doc:02}.txt")), text).unwrap();
    }
}

fn nanodist(dir: &Path, args: &[&str]) {
    let out = Command::new(EXE)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "nanodist {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

/// A scratch checkout: config/, data/shakespeare_char and data/openwebtext, the runs the examples name in
/// log/, and `nanodist` both on PATH and at ./target/release/nanodist.
fn scratch(dir: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    copy_dir(&root.join("config"), &dir.join("config"));
    let text = dir.join("plays");
    write_text(&text);
    let text = text.to_str().unwrap();
    for (out, tokenizer) in [("shakespeare_char", "char"), ("openwebtext", "gpt2")] {
        let out = format!("data/{out}");
        nanodist(
            dir,
            &[
                "prepare",
                "--input",
                text,
                "--output",
                &out,
                "--tokenizer",
                tokenizer,
                "--val-fraction",
                "0.1",
            ],
        );
    }
    let short = [
        "--set",
        "train.n_steps=30",
        "--set",
        "train.lr_schedule.warmup_steps=5",
        "--set",
        "log.eval_interval=10",
        "--set",
        "log.eval_steps=2",
        "--set",
        "log.log_interval=5",
    ];
    let runs: [(&str, &[&str]); 5] = [
        ("quickstart-char", &[]),
        ("dense", &["--workers", "2"]),
        (
            "ring",
            &[
                "--workers",
                "2",
                "--set",
                "train.backend=\"decentdp\"",
                "--set",
                "train.topology=\"ring\"",
            ],
        ),
        (
            "powersgd",
            &[
                "--workers",
                "2",
                "--set",
                "train.compression={name=\"powersgd\", rank=4, start_iter=10}",
            ],
        ),
        (
            "diloco",
            &[
                "--workers",
                "2",
                "--set",
                "train.backend=\"diloco\"",
                "--set",
                "train.diloco={sync_every=5}",
            ],
        ),
    ];
    for (name, extra) in runs {
        let run_name = format!("log.run_name=\"{name}\"");
        let mut args = vec!["train", "config/quickstart-char.toml", "--set", &run_name];
        args.extend(short);
        args.extend(extra);
        nanodist(dir, &args);
    }
    let bin = dir.join("bin");
    for at in [bin.clone(), dir.join("target/release")] {
        std::fs::create_dir_all(&at).unwrap();
        std::os::unix::fs::symlink(EXE, at.join("nanodist")).unwrap();
    }
}

#[test]
fn every_example_command_of_the_readme_runs_as_written() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let lines = examples(&readme);
    assert!(lines.len() >= 10, "{lines:#?}");
    for (piece, _) in NOT_HERE {
        assert!(
            lines.iter().any(|l| l.contains(piece)),
            "NOT_HERE names {piece:?}, which no README example contains any more"
        );
    }
    let d = tempfile::tempdir().unwrap();
    scratch(d.path());
    let path = format!(
        "{}:{}",
        d.path().join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut ran = 0;
    for line in &lines {
        if NOT_HERE.iter().any(|(piece, _)| line.contains(piece)) {
            continue;
        }
        // The job's layout (2 nodes x 4 MPI ranks) is validated against this build's engines.
        if line.contains(" sbatch ") && !cfg!(feature = "mpi") {
            eprintln!("skipped without the mpi feature: {line}");
            continue;
        }
        let out = Command::new("sh")
            .arg("-c")
            .arg(line)
            .current_dir(d.path())
            .env("PATH", &path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "README example failed ({}): {line}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ran += 1;
    }
    assert!(ran >= 8, "ran {ran} of {} examples", lines.len());
}

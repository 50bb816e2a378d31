//! The example commands of the README, of docs/*.md and of every `--help`, run as written: every line of
//! a ```sh block that starts with `nanodist` or `./target/release/nanodist`, and every line under a `--help`'s
//! "Examples:", runs through `sh -c` in a scratch directory laid out like a checkout
//! (a copy of config/, data/ prepared from text this test writes, and log/ with the run directories the
//! examples name, trained here for a few steps), and must exit 0. The lines that cannot run here are listed
//! in NOT_HERE with the reason; a NOT_HERE entry that matches no README line fails the test, so the list
//! cannot go stale.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_nanodist");

/// (a piece of the command line, why it does not run in a test).
const NOT_HERE: &[(&str, &str)] = &[
    (
        "nanodist calibrate",
        "measures this machine for minutes and rewrites config/clusters/local.toml \
         (tests/cluster/predict_validation.rs runs calibrate)",
    ),
    (
        "--time 20:00:00",
        "submits a 20-hour job to Slurm (the --dry-run line beside it renders the same job here; \
         tests/cluster/slurm.rs submits real jobs)",
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
    train_named_runs(dir);
    let bin = dir.join("bin");
    for at in [bin.clone(), dir.join("target/release")] {
        std::fs::create_dir_all(&at).unwrap();
        std::os::unix::fs::symlink(EXE, at.join("nanodist")).unwrap();
    }
}

/// The short runs the README's examples name, in `dir`'s log/.
fn train_named_runs(dir: &Path) {
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
}

/// The examples every command's `--help` gives (the lines under "Examples:").
fn help_examples() -> Vec<String> {
    let help = |args: &[&str]| {
        let out = Command::new(EXE).args(args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let top = help(&["--help"]);
    let commands = top
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help");
    commands
        .flat_map(|c| {
            let text = help(&[c, "--help"]);
            let lines: Vec<String> = text
                .lines()
                .skip_while(|l| !l.starts_with("Examples:"))
                .map(str::trim)
                .filter(|l| l.starts_with("nanodist "))
                .map(String::from)
                .collect();
            lines
        })
        .collect()
}

#[test]
fn every_example_command_of_the_readme_and_the_help_runs_as_written() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut docs = vec![root.join("README.md")];
    let mut more: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    more.sort();
    docs.extend(more);
    let mut lines: Vec<String> = docs
        .iter()
        .flat_map(|d| examples(&std::fs::read_to_string(d).unwrap()))
        .collect();
    assert!(lines.len() >= 10, "{lines:#?}");
    for (piece, _) in NOT_HERE {
        assert!(
            lines.iter().any(|l| l.contains(piece)),
            "NOT_HERE names {piece:?}, which no README or docs example contains any more"
        );
    }
    let help = help_examples();
    assert!(help.len() >= 4, "{help:#?}");
    lines.extend(help);
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
        if (line.contains(" sbatch ") || line.contains(" --ranks ")) && !cfg!(feature = "mpi") {
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

/// The top-level modules of src/ and the `crate::` paths each one's files write (use lines and inline
/// paths, outside comments and the `#[cfg(test)] mod tests` tail, where tests may reach anywhere):
/// module -> (used module -> first "file:line").
fn module_uses(src: &Path) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut files = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let module = |p: &Path| {
        let first = p.strip_prefix(src).unwrap().components().next().unwrap();
        let name = first.as_os_str().to_string_lossy().to_string();
        name.strip_suffix(".rs").unwrap_or(&name).to_string()
    };
    let modules: BTreeSet<String> = files.iter().map(|f| module(f)).collect();
    let path = regex::Regex::new(r"crate::([a-z_][a-z0-9_]*)").unwrap();
    let block = regex::Regex::new(r"use\s+crate::\{([^;]*)\}").unwrap();
    let word = regex::Regex::new(r"(?:^|[\s,{])([a-z_][a-z0-9_]*)(?:::|\s*[,}]|$)").unwrap();
    let mut uses: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for f in &files {
        let a = module(f);
        let text = std::fs::read_to_string(f).unwrap();
        let text = text.split("#[cfg(test)]\nmod tests").next().unwrap();
        let lines: Vec<&str> = text
            .lines()
            .map(|l| l.split("//").next().unwrap())
            .collect();
        let mut add = |b: &str, at: String| {
            if b != a && modules.contains(b) && a != "main" && a != "lib" {
                uses.entry(a.clone())
                    .or_default()
                    .entry(b.into())
                    .or_insert(at);
            }
        };
        for (i, l) in lines.iter().enumerate() {
            for c in path.captures_iter(l) {
                add(&c[1], format!("{}:{}", f.display(), i + 1));
            }
        }
        for c in block.captures_iter(&lines.join("\n")) {
            for w in word.captures_iter(&c[1]) {
                add(&w[1], format!("{} (use crate::{{...}})", f.display()));
            }
        }
    }
    for m in modules {
        uses.entry(m).or_default();
    }
    uses
}

/// README "Architecture" states the layers of src/'s modules; every module is in exactly one, and each
/// uses only modules of the layers below its own (no cycles, so no module's change reaches below it).
#[test]
fn the_modules_use_only_the_layers_below_them_as_the_readme_states() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let line = readme
        .lines()
        .find_map(|l| l.strip_prefix("layers: "))
        .expect("README Architecture has a `layers: ...` line");
    // Top layer first in the README; layer 0 is the bottom here.
    let mut layers: Vec<Vec<&str>> = line
        .split(" > ")
        .map(|l| l.split_whitespace().collect())
        .collect();
    layers.reverse();
    let layer_of = |m: &str| layers.iter().position(|l| l.contains(&m));
    let uses = module_uses(&root.join("src"));
    let mut problems = Vec::new();
    for (a, used) in &uses {
        if a == "main" || a == "lib" {
            continue;
        }
        let Some(la) = layer_of(a) else {
            problems.push(format!(
                "module `{a}` is in no layer of README's `layers:` line"
            ));
            continue;
        };
        for (b, at) in used {
            match layer_of(b) {
                Some(lb) if lb < la => {}
                _ => problems.push(format!(
                    "`{a}` (layer {la}) uses `{b}` (layer {:?}), not below it: {at}",
                    layer_of(b)
                )),
            }
        }
    }
    for l in &layers {
        for m in l {
            if !uses.contains_key(*m) {
                problems.push(format!(
                    "README's layers name `{m}`, which src/ does not have"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every function of src/, tests/ and examples/ reads in one screen: at most 80 lines from its signature
/// to its closing brace (README "Architecture").
#[test]
fn every_function_is_at_most_80_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let signature = regex::Regex::new(r"^\s*(pub(\([a-z]+\))?\s+)?(unsafe\s+)?fn\s").unwrap();
    let mut long = Vec::new();
    let mut dirs: Vec<_> = ["src", "tests", "examples"].map(|d| root.join(d)).into();
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            for (i, l) in lines.iter().enumerate() {
                if !signature.is_match(l) || l.trim_end().ends_with(';') {
                    continue;
                }
                let (mut depth, mut started, mut j) = (0i64, false, i);
                while j < lines.len() {
                    depth +=
                        lines[j].matches('{').count() as i64 - lines[j].matches('}').count() as i64;
                    started |= lines[j].contains('{');
                    if started && depth <= 0 {
                        break;
                    }
                    j += 1;
                }
                if j - i + 1 > 80 {
                    long.push(format!("{}:{} ({} lines)", p.display(), i + 1, j - i + 1));
                }
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over 80 lines:\n{}",
        long.join("\n")
    );
}

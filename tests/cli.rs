//! The command line: exit codes, the plan printed by `check`, `schema` output, vocabulary checks against
//! prepared data, and text in and out of a trained model.

use std::path::Path;
use std::process::{Command, Output};

fn nanodist(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nanodist"))
        .args(args)
        .output()
        .unwrap()
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn check_prints_the_resolved_plan() {
    let cfg = root().join("config/gpt2-small.toml");
    let out = nanodist(&[
        "check",
        cfg.to_str().unwrap(),
        "--workers",
        "4",
        "--tokens-per-s",
        "100000",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "world size        4",
        "local batch       30 sequences",
        "accumulation      4 micro-steps",
        "tokens per step   491520",
        "parameters        124373760",
        "run time          34d 03:12:00",
        "note: train.compile = true has no meaning",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
}

#[test]
fn bad_configs_and_flags_exit_2_with_the_location() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "[train]\nn_step = 3\n").unwrap();
    let out = nanodist(&["check", cfg.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.toml:2:1: train.n_step"), "{err}");
    assert_eq!(
        nanodist(&["check", "/nonexistent.toml"]).status.code(),
        Some(2)
    );
    assert_eq!(nanodist(&["check"]).status.code(), Some(2));
    assert_eq!(
        nanodist(&["check", cfg.to_str().unwrap(), "--workers", "0"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(nanodist(&["frobnicate"]).status.code(), Some(2));
    for cmd in ["check", "schema", "prepare", "train", "eval", "sample"] {
        assert_eq!(
            nanodist(&[cmd, "--help"]).status.code(),
            Some(0),
            "{cmd} --help"
        );
    }
}

#[test]
fn schema_command_prints_the_committed_schema() {
    let out = nanodist(&["schema"]);
    let committed = std::fs::read_to_string(root().join("schemas/config.schema.json")).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), committed);
}

#[test]
fn model_vocabulary_must_cover_the_prepared_data() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("doc.txt"), "some words for the tokenizer").unwrap();
    let data = dir.path().join("data");
    let prep = nanodist(&[
        "prepare",
        "--input",
        dir.path().join("doc.txt").to_str().unwrap(),
        "--output",
        data.to_str().unwrap(),
    ]);
    assert!(prep.status.success());
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        format!(
            "data_dir = {:?}\n[model]\nvocab_size = 1000\n",
            data.display().to_string()
        ),
    )
    .unwrap();
    let out = nanodist(&["check", cfg.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("model.vocab_size") && err.contains("50257") && err.contains("c.toml:3:14"),
        "{err}"
    );
}

#[test]
fn char_model_trains_samples_and_evaluates_text() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus");
    std::fs::create_dir_all(&corpus).unwrap();
    for i in 0..20 {
        let doc: String = (0..200)
            .map(|j| ["the cat ", "sat on ", "a mat. ", "and then "][(i + j) % 4])
            .collect();
        std::fs::write(corpus.join(format!("{i}.txt")), doc).unwrap();
    }
    let data = dir.path().join("data");
    let p = nanodist(&[
        "prepare",
        "--input",
        corpus.to_str().unwrap(),
        "--output",
        data.to_str().unwrap(),
        "--tokenizer",
        "char",
        "--val-fraction",
        "0.2",
    ]);
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, format!(
        "log_dir = {:?}\ndata_dir = {:?}\n[log]\nrun_name = \"r\"\neval_interval = 30\neval_steps = 2\n\
         [train]\nglobal_batch_size = 8\ncontext_length = 32\nn_steps = 30\n[train.lr_schedule]\nname = \"cosine\"\n\
         lr = 1e-2\nwarmup_steps = 3\neta_min = 1e-3\n[model]\nn_layers = 1\nn_heads = 2\nn_embd = 32\nvocab_size = 32\n",
        dir.path().join("log").display().to_string(), data.display().to_string())).unwrap();
    let t = nanodist(&[
        "train",
        cfg.to_str().unwrap(),
        "--set",
        "train.exit_duration_mins=0.00001",
    ]);
    assert!(t.status.success(), "{}", String::from_utf8_lossy(&t.stderr));
    assert!(String::from_utf8_lossy(&t.stdout)
        .contains("stopped at train.exit_duration_mins at step 1"));
    let t = nanodist(&["train", cfg.to_str().unwrap()]);
    assert!(
        String::from_utf8_lossy(&t.stdout).contains("finished at step 30"),
        "{}",
        String::from_utf8_lossy(&t.stdout)
    );
    let run = dir.path().join("log/r");
    let s = nanodist(&[
        "sample",
        run.to_str().unwrap(),
        "--prompt",
        "the cat",
        "--max-new-tokens",
        "40",
        "--seed",
        "3",
    ]);
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
    let text = String::from_utf8_lossy(&s.stdout);
    assert!(
        text.starts_with("the cat") && text.trim_end().chars().count() >= 40,
        "{text}"
    );
    let again = nanodist(&[
        "sample",
        run.to_str().unwrap(),
        "--prompt",
        "the cat",
        "--max-new-tokens",
        "40",
        "--seed",
        "3",
    ]);
    assert_eq!(
        again.stdout, s.stdout,
        "sampling is deterministic for a seed"
    );
    let e = nanodist(&[
        "eval",
        run.to_str().unwrap(),
        "--data",
        corpus.join("0.txt").to_str().unwrap(),
    ]);
    assert!(e.status.success(), "{}", String::from_utf8_lossy(&e.stderr));
    assert!(String::from_utf8_lossy(&e.stdout).contains("perplexity"));
    let bad = nanodist(&["sample", run.to_str().unwrap(), "--prompt", "XYZ"]);
    assert_eq!(
        bad.status.code(),
        Some(2),
        "characters outside the vocabulary are bad input"
    );
    let bad = nanodist(&[
        "eval",
        dir.path().join("nope").to_str().unwrap(),
        "--data",
        "x.bin",
    ]);
    assert_eq!(bad.status.code(), Some(2));
}

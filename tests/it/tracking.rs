//! W&B offline runs and TensorBoard event files, read back by the real Python readers (wandb's protobuf
//! classes, tensorboard's strict record reader). Skipped, saying so, when those packages are missing;
//! `.ci/run` installs them.

use std::path::{Path, PathBuf};
use std::process::Command;

use nanodist::metrics::read_rows;
use serde_json::Value;

use crate::common;
use crate::common::{make_data, tiny_config};

fn python_has(module: &str) -> bool {
    Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn python_json(script: &str, arg: &Path) -> Value {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("python3")
        .arg(root.join("scripts").join(script))
        .arg(arg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn train(dir: &Path, set: &[&str]) -> PathBuf {
    let mut set = set.to_vec();
    set.extend(["log.wandb_log=true", "log.tensorboard=true"]);
    common::train_config(&tiny_config(dir, "tracked"), 2, &set).run_dir
}

fn wandb_files(run_dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(run_dir.join("wandb"))
        .unwrap()
        .flatten()
        .flat_map(|d| {
            std::fs::read_dir(d.path())
                .unwrap()
                .flatten()
                .map(|f| f.path())
        })
        .filter(|p| p.extension().is_some_and(|e| e == "wandb"))
        .collect();
    files.sort();
    files
}

#[test]
fn wandb_offline_run_reads_back_with_wandbs_own_protobufs_and_resumes_the_same_run() {
    if !python_has("wandb") {
        common::skip_python("Python wandb not installed (pip install wandb)");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    // Stop at step 10, then resume to 20: one W&B run id, two offline segments.
    let first = train(
        d.path(),
        &["train.exit_interval=10", "log.wandb_project=\"proj\""],
    );
    let steps: Vec<u64> = read_rows(&first.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .map(|r| r.step)
        .collect();
    assert_eq!(steps, (1..=10).collect::<Vec<u64>>(), "stopped at step 10");
    assert_eq!(wandb_files(&first).len(), 1);
    let run_dir = train(d.path(), &["log.wandb_project=\"proj\""]);
    let rows = read_rows(&run_dir.join("metrics.jsonl")).unwrap();
    let files = wandb_files(&run_dir);
    let tree = Command::new("find").arg(&run_dir).output().unwrap();
    assert_eq!(files.len(), 2, "{}", String::from_utf8_lossy(&tree.stdout));
    let parts: Vec<Value> = files
        .iter()
        .map(|f| python_json("read_wandb.py", f))
        .collect();
    assert_eq!(
        parts[0]["run_id"], parts[1]["run_id"],
        "a resumed run keeps its id"
    );
    let mut steps = Vec::new();
    for p in &parts {
        assert_eq!(p["project"], "proj");
        assert_eq!(p["config"]["train"]["seed"], 3);
        assert_eq!(p["config"]["model"]["n_embd"], 32);
        assert_eq!(p["exit_code"], 0);
        let order: Vec<&str> = p["order"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(order[0], "run");
        assert_eq!(&order[order.len() - 2..], ["exit", "final"]);
        steps.extend(history_matches_the_rows(p, &rows));
    }
    assert_eq!(
        steps,
        (1..=20).collect::<Vec<u64>>(),
        "every logged step once"
    );
    let last = rows.last().unwrap();
    let summary = &parts[1]["summary"];
    assert_eq!(summary["train_loss"].as_f64().unwrap(), last.train_loss);
    assert_eq!(
        summary["val_loss"].as_f64().unwrap(),
        last.val_loss.unwrap()
    );
    assert_eq!(summary["_step"], 20);
}

/// The steps of one W&B segment's history, each row's train loss, runtime and cumulative bytes
/// (carried across the resume: loss charts against them in W&B) checked against the run's rows.
fn history_matches_the_rows(p: &Value, rows: &[nanodist::metrics::Row]) -> Vec<u64> {
    let mut steps = Vec::new();
    for h in p["history"].as_array().unwrap() {
        steps.push(h["_step"].as_u64().unwrap());
        let row = rows
            .iter()
            .find(|r| r.step == h["_step"].as_u64().unwrap())
            .unwrap();
        assert_eq!(h["train_loss"].as_f64().unwrap(), row.train_loss);
        assert!(h["_runtime"].as_f64().unwrap() >= 0.0);
        // Cumulative bytes, carried across the resume: loss charts against them in W&B.
        let total: u64 = rows
            .iter()
            .filter(|r| r.step <= row.step)
            .map(|r| r.comm_bytes)
            .sum();
        assert!(total > 0);
        assert_eq!(
            h["comm_bytes_total"].as_f64().unwrap(),
            total as f64,
            "step {}",
            row.step
        );
    }
    steps
}

#[test]
fn tensorboard_scalars_read_back_with_the_strict_reader() {
    if !python_has("tensorboard") {
        common::skip_python("Python tensorboard not installed (pip install tensorboard)");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let run_dir = train(d.path(), &[]);
    let rows = read_rows(&run_dir.join("metrics.jsonl")).unwrap();
    let tb = python_json("read_tensorboard.py", &run_dir.join("tb"));
    assert_eq!(tb["file_version"], "brain.Event:2");
    let s = &tb["scalars"];
    // Stored as f32; the JSON round trip may differ in the last printed digit.
    let same = |a: f64, b: f64| (a - b as f32 as f64).abs() <= 1e-6 * b.abs();
    // Grouped tags, spelled out: dashboards and scripts name them.
    for (tag, key) in [
        ("train/loss", "train_loss"),
        ("train/lr", "lr"),
        ("train/grad_norm", "grad_norm"),
        ("train/param_norm", "param_norm"),
        ("train/tokens_per_s", "tokens_per_s"),
        ("train/ms_per_step", "ms_per_step"),
        ("train/tokens", "tokens"),
        ("comm/bytes", "comm_bytes"),
        ("comm/ms", "comm_ms"),
        ("comm/frac", "comm_frac"),
        ("comm/sync_ms", "sync_ms"),
        ("val/loss", "val_loss"),
        ("val/ppl", "val_ppl"),
        ("val/train_loss", "eval_train_loss"),
    ] {
        assert_eq!(nanodist::metrics::tensorboard::tag(key), tag);
    }
    assert_eq!(s["train/batch_size"].as_object().unwrap().len(), 20);
    // Every numeric metric of every row is there, with the row's value.
    for r in &rows {
        for (key, v) in r.numeric().unwrap() {
            let tag = nanodist::metrics::tensorboard::tag(&key);
            let got = s[&tag][r.step.to_string()]
                .as_f64()
                .unwrap_or_else(|| panic!("{tag} missing at step {}", r.step));
            assert!(same(got, v), "{tag} at step {}: {got} vs {v}", r.step);
        }
    }
    assert_eq!(s["train/loss"].as_object().unwrap().len(), 20);
    assert_eq!(s["val/loss"].as_object().unwrap().len(), 2);
    let mut total = 0;
    for r in &rows {
        total += r.comm_bytes;
        let got = s["comm/bytes_total"][r.step.to_string()].as_f64().unwrap();
        assert!(
            total > 0 && same(got, total as f64),
            "step {}: {got} vs {total}",
            r.step
        );
    }
}

/// A W&B run stopped at step 10 and resumed to 20 (two offline segments of one run id).
fn resumed_wandb_run(dir: &Path) -> (PathBuf, Vec<PathBuf>) {
    make_data(dir);
    train(dir, &["train.exit_interval=10"]);
    let run_dir = train(dir, &[]);
    let segments = wandb_files(&run_dir)
        .iter()
        .map(|f| f.parent().unwrap().to_path_buf())
        .collect();
    (run_dir, segments)
}

#[test]
fn wandb_sync_uploads_the_run_to_a_stand_in_server() {
    let has_cli = Command::new("wandb")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_cli {
        common::skip_python("the wandb CLI is not installed (pip install wandb)");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (run_dir, segments) = resumed_wandb_run(d.path());
    let rows = read_rows(&run_dir.join("metrics.jsonl")).unwrap();
    let (log, out) = sync_to_a_stand_in(d.path(), &segments);
    let requests: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The run itself, with the resolved config.
    let upserts: Vec<&Value> = requests
        .iter()
        .filter(|r| {
            r["body"]["query"]
                .as_str()
                .is_some_and(|q| q.contains("UpsertBucket"))
        })
        .collect();
    assert!(!upserts.is_empty(), "no run was created: {out}");
    let vars = &upserts[0]["body"]["variables"];
    assert_eq!(vars["displayName"], "tracked");
    let config: Value = serde_json::from_str(vars["config"].as_str().unwrap()).unwrap();
    assert_eq!(config["train"]["value"]["seed"], 3);
    assert_eq!(config["model"]["value"]["n_embd"], 32);
    streams_hold_every_step_and_a_clean_exit(&requests, &rows);
}

/// `wandb sync` of `segments` to the stand-in server (scripts/wandb_standin.py), which prints its port,
/// then logs every request it answers: the log's path, and what `wandb sync` printed.
fn sync_to_a_stand_in(dir: &Path, segments: &[PathBuf]) -> (PathBuf, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let log = dir.join("requests.jsonl");
    let mut server = Command::new("python3")
        .arg(root.join("scripts/wandb_standin.py"))
        .arg(&log)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut port = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(server.stdout.take().unwrap()),
        &mut port,
    )
    .unwrap();
    let sync = Command::new("wandb")
        .arg("sync")
        .args(segments)
        .env(
            "WANDB_BASE_URL",
            format!("http://127.0.0.1:{}", port.trim()),
        )
        .env("WANDB_API_KEY", "a".repeat(40))
        .env("WANDB_DIR", dir)
        .output()
        .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    let out =
        String::from_utf8_lossy(&sync.stdout).to_string() + &String::from_utf8_lossy(&sync.stderr);
    assert!(out.contains("done"), "{out}");
    (log, out)
}

/// Every history step once in the file streams, with the values nanodist logged; the summary; a clean
/// exit.
fn streams_hold_every_step_and_a_clean_exit(requests: &[Value], rows: &[nanodist::metrics::Row]) {
    let streams: Vec<&Value> = requests
        .iter()
        .filter(|r| {
            r["path"]
                .as_str()
                .is_some_and(|p| p.ends_with("/file_stream"))
        })
        .collect();
    let mut steps = Vec::new();
    let mut summary = None;
    for s in &streams {
        let files = &s["body"]["files"];
        for line in files["wandb-history.jsonl"]["content"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let h: Value = serde_json::from_str(line.as_str().unwrap()).unwrap();
            let step = h["_step"].as_u64().unwrap();
            let row = rows.iter().find(|r| r.step == step).unwrap();
            assert_eq!(h["train_loss"].as_f64().unwrap(), row.train_loss);
            steps.push(step);
        }
        for line in files["wandb-summary.json"]["content"]
            .as_array()
            .into_iter()
            .flatten()
        {
            summary = Some(serde_json::from_str::<Value>(line.as_str().unwrap()).unwrap());
        }
    }
    steps.sort();
    assert_eq!(
        steps,
        (1..=20).collect::<Vec<u64>>(),
        "history steps received"
    );
    let summary = summary.expect("a summary was streamed");
    assert_eq!(summary["_step"], 20);
    assert_eq!(
        summary["val_loss"].as_f64().unwrap(),
        rows.last().unwrap().val_loss.unwrap()
    );
    assert!(
        streams
            .iter()
            .any(|s| s["body"]["complete"] == true && s["body"]["exitcode"] == 0),
        "the run ends complete with exit code 0"
    );
}

#[test]
fn the_newest_wandb_reads_the_run_with_leet_inspect() {
    // scripts/setup.sh installs the newest wandb release into .venv/wandb-latest.
    let exe = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/wandb-latest/bin/wandb");
    if !exe.exists() {
        common::skip_python(&format!(
            "no {} (scripts/setup.sh installs it)",
            exe.display()
        ));
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (run_dir, segments) = resumed_wandb_run(d.path());
    let rows = read_rows(&run_dir.join("metrics.jsonl")).unwrap();
    let mut steps = Vec::new();
    for (i, seg) in segments.iter().enumerate() {
        let out = Command::new(&exe)
            .args(["leet", "inspect", "--json"])
            .arg(seg)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.trim().is_empty(),
            "leet inspect complained: {stderr}"
        );
        let records: Vec<Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let types: Vec<&str> = records
            .iter()
            .map(|r| r["type"].as_str().unwrap())
            .collect();
        assert_eq!(types[0], "run", "{types:?}");
        assert!(types.contains(&"exit"), "{types:?}");
        let run = &records[0]["run"];
        assert_eq!(run["config"]["update"]["train"]["seed"], 3);
        assert_eq!(run["display_name"], "tracked");
        for r in records.iter().filter(|r| r["type"] == "history") {
            let h = &r["history"]["item"];
            let step = h["_step"].as_u64().unwrap();
            assert_eq!(
                h["train_loss"].as_f64().unwrap(),
                rows.iter().find(|x| x.step == step).unwrap().train_loss
            );
            steps.push(step);
        }
        let exit = records.iter().find(|r| r["type"] == "exit").unwrap();
        assert_eq!(
            exit["exit"]["exit_code"].as_i64().unwrap_or(0),
            0,
            "segment {i}"
        );
    }
    assert_eq!(steps, (1..=20).collect::<Vec<u64>>());
}

/// Online mode with stand-in `wandb` executables on PATH: a CLI whose `beta sync` lacks --live (as wandb
/// 0.22), one whose live sync fails, and one that succeeds. Only the last may say "streamed"; the others
/// fall back to offline and print the upload command.
#[test]
fn online_mode_says_streamed_only_when_the_live_sync_succeeded() {
    use std::os::unix::fs::PermissionsExt;
    let cases = [
        (
            "no-live",
            "if [ \"$3\" = --help ]; then echo 'Usage: wandb beta sync [OPTIONS] PATH'; exit 0; fi\n\
             echo \"Error: No such option '--live'.\" >&2; exit 2",
            "has no --live option",
        ),
        (
            "fails",
            "if [ \"$3\" = --help ]; then echo '  --live  stream'; exit 0; fi\nexit 3",
            "the live sync (`wandb beta sync --live`) failed",
        ),
        (
            "works",
            "if [ \"$3\" = --help ]; then echo '  --live  stream'; exit 0; fi\nexit 0",
            "streamed by `wandb beta sync --live`",
        ),
    ];
    for (name, body, want) in cases {
        let d = tempfile::tempdir().unwrap();
        make_data(d.path());
        let bin = d.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let exe = bin.join("wandb");
        std::fs::write(&exe, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let cfg = common::write_tiny_config(d.path(), "c.toml", name);
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = Command::new(env!("CARGO_BIN_EXE_nanodist"))
            .args([
                "train",
                cfg.to_str().unwrap(),
                "--set",
                "log.wandb_log=true",
            ])
            .args([
                "--set",
                "log.wandb_mode=\"online\"",
                "--set",
                "train.n_steps=6",
            ])
            .args(["--set", "log.eval_interval=4"])
            .env("PATH", path)
            .env_remove("WANDB_MODE")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {err}");
        assert!(err.contains(want), "{name}: {want:?} missing:\n{err}");
        if name != "works" {
            assert!(
                !err.contains("streamed"),
                "{name}: claims streaming:\n{err}"
            );
            assert!(
                err.contains("wandb sync "),
                "{name}: no upload command:\n{err}"
            );
        }
    }
}

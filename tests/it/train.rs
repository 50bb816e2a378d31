//! Training runs on tiny generated data: resume is bit-exact, damaged checkpoints fall back to the
//! previous one, signals save before exiting, and the trained model evaluates and samples.

use sha2::Digest;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nanodist::metrics::{read_rows, Row};
use nanodist::plan::LaunchEnv;
use nanodist::train::{self, checkpoint, Exit};

use crate::common;
use crate::common::make_data;

/// The tiny config with a local batch of 2 (accumulation on one worker), dropout (its RNG is state to
/// resume), and checkpoints every 5 steps.
fn config_text(dir: &Path) -> String {
    common::config(
        dir,
        Some("run"),
        &[
            "log.eval_steps=2",
            "log.log_interval=2",
            "log.ckpt_interval=5",
            "log.keep_checkpoints=3",
            "train.global_batch_size=4",
            "train.local_batch_size=2",
            "model.dropout=0.1",
        ],
    )
}

fn run(dir: &Path, set: &[&str]) -> train::Summary {
    common::train_config(&config_text(dir), 1, set)
}

/// The parts of a row that must be identical between runs (not timings).
fn numbers(r: &Row) -> (u64, u64, u64, u64, u64, u64, Option<u64>) {
    (
        r.step,
        r.tokens,
        r.lr.to_bits(),
        r.train_loss.to_bits(),
        r.grad_norm.to_bits(),
        r.param_norm.to_bits(),
        r.val_loss.map(f64::to_bits),
    )
}

#[test]
fn stopped_and_resumed_run_equals_uninterrupted_run_bit_for_bit() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    make_data(a.path());
    make_data(b.path());
    // With the evaluation before training: a resumed segment does not repeat it.
    let at_start = "log.eval_at_start=true";
    let full = run(a.path(), &[at_start]);
    assert_eq!((full.step, full.exit.clone()), (20, Exit::Finished));

    // Stop at step 7 (between checkpoints: the exit path saves), then twice more, then finish.
    let first = run(b.path(), &[at_start, "train.exit_interval=7"]);
    assert_eq!((first.step, first.exit), (7, Exit::ExitInterval));
    // The middle segment names another device (auto: the CPU here), which a resume may change.
    let elsewhere = "train.device=\"auto\"";
    assert_eq!(
        run(b.path(), &[at_start, "train.exit_interval=6", elsewhere]).step,
        13
    );
    let last = run(b.path(), &[at_start]);
    assert_eq!((last.step, last.exit.clone()), (20, Exit::Finished));

    let rows_a = read_rows(&full.run_dir.join("metrics.jsonl")).unwrap();
    let rows_b = read_rows(&last.run_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(rows_a.len(), rows_b.len());
    assert_eq!(rows_b.iter().filter(|r| r.step == 0).count(), 1);
    for (x, y) in rows_a.iter().zip(&rows_b) {
        assert_eq!(numbers(x), numbers(y), "rows differ at step {}", x.step);
    }
    let weights = |s: &train::Summary| {
        common::tensors(
            &s.run_dir
                .join("checkpoints/step_00000020/model.safetensors"),
        )
    };
    assert!(weights(&full) == weights(&last), "final weights differ");
    // Byte for byte, headers included: checksums of identical runs compare.
    for file in [
        "best_model.safetensors",
        "checkpoints/step_00000020/model.safetensors",
        "checkpoints/step_00000020/rank_0.safetensors",
    ] {
        assert!(
            std::fs::read(full.run_dir.join(file)).unwrap()
                == std::fs::read(last.run_dir.join(file)).unwrap(),
            "{file} differs between the uninterrupted and the resumed run"
        );
    }
    // The manifest names every other file of the checkpoint with its SHA-256 (the writers hash what they
    // write; the checksums they pass on are not left behind).
    let step_dir = last.run_dir.join("checkpoints/step_00000020");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(step_dir.join("manifest.json")).unwrap()).unwrap();
    let files = manifest["files"].as_object().unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&step_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "manifest.json")
        .collect();
    names.sort();
    assert_eq!(names, files.keys().cloned().collect::<Vec<_>>());
    for (name, sum) in files {
        let bytes = std::fs::read(step_dir.join(name)).unwrap();
        let got: String = sha2::Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(sum.as_str().unwrap(), got, "{name}'s checksum");
    }
    assert!(
        rows_a.last().unwrap().val_loss.unwrap() < rows_a[0].train_loss,
        "the model should learn"
    );
    // Finished runs do nothing when started again.
    assert_eq!(run(b.path(), &[at_start]).step, 20);
}

#[test]
fn a_run_stopped_inside_a_batch_ramp_up_resumes_bit_for_bit() {
    // Megatron's batches for global 8 from 2 by 2 over 12 samples: 2, 2, 4, 6, then 8 from step 4; with a
    // local batch of 2, one to four micro-steps.
    let ramp = [
        "train.global_batch_size=8",
        "train.rampup_batch_size=[2, 2, 12]",
    ];
    let batches = [2u64, 2, 4, 6, 8];
    let batch_of = |step: u64| batches[(step as usize).min(4)];
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    make_data(a.path());
    make_data(b.path());
    // Each step samples its own batches here; the cut run's are sampled ahead by the loader.
    let full = run(a.path(), &[ramp[0], ramp[1], "prefetch=false"]);
    // Stop after step 3, whose successor is the first at batch 6; then after the ramp's last change.
    let at = |n: &'static str| [ramp[0], ramp[1], n];
    assert_eq!(run(b.path(), &at("train.exit_interval=3")).step, 3);
    assert_eq!(run(b.path(), &at("train.exit_interval=2")).step, 5);
    let last = run(b.path(), &ramp);
    assert_eq!(last.step, 20);
    let rows_a = read_rows(&full.run_dir.join("metrics.jsonl")).unwrap();
    let rows_b = read_rows(&last.run_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(rows_a.len(), rows_b.len());
    for (x, y) in rows_a.iter().zip(&rows_b) {
        assert_eq!(numbers(x), numbers(y), "rows differ at step {}", x.step);
        assert_eq!(x.batch_size, y.batch_size);
        // The row's batch is its last step's; its tokens, every step's real batch (context 16).
        assert_eq!(x.batch_size, batch_of(x.step - 1), "step {}", x.step);
        let tokens: u64 = (0..x.step).map(batch_of).sum::<u64>() * 16;
        assert_eq!(x.tokens, tokens, "step {}", x.step);
    }
}

/// `train.log` holds the decentralized GPT-2 runner's lines in its exact format (prefix, 6 decimals, a space
/// before the units), the new-best-model lines after each improvement, and nanodist's extra figures on
/// lines of their own; a resumed run appends to it.
#[test]
fn train_log_has_the_seed_runners_lines() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let first = run(
        d.path(),
        &["log.eval_at_start=true", "train.exit_interval=12"],
    );
    let done = run(d.path(), &["log.eval_at_start=true"]);
    assert_eq!((first.step, done.step), (12, 20));
    let log = std::fs::read_to_string(done.run_dir.join("train.log")).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    let prefix = r"^\[\d{2}:\d{2}:\d{2}  INFO\] ";
    let any = regex::Regex::new(prefix).unwrap();
    assert!(lines.iter().all(|l| any.is_match(l)), "{log}");
    let eval = regex::Regex::new(&format!(
        r"{prefix}Step (\d+), Val loss: \d+\.\d{{6}}, Train loss: \d+\.\d{{6}}, Train time: \d+\.\d{{3}} s \(\d+\.\d{{3}} ms/step\), Total train time: \d+\.\d{{3}} s$"
    ))
    .unwrap();
    let steps: Vec<u64> = lines
        .iter()
        .filter_map(|l| eval.captures(l))
        .map(|c| c[1].parse().unwrap())
        .collect();
    // Step 0, the evaluation at step 10 (first segment), and step 20 after the resume.
    assert_eq!(steps, [0, 10, 20], "{log}");
    segments_are_headed_and_ended(&lines, prefix, &log);
    let rows = read_rows(&done.run_dir.join("metrics.jsonl")).unwrap();
    let val = |step: u64| {
        rows.iter()
            .find(|r| r.step == step)
            .and_then(|r| r.val_loss)
            .unwrap()
    };
    assert!(
        log.contains(&format!("Step 10, Val loss: {:.6}, ", val(10))),
        "{log}"
    );
    let saved = format!(
        "Saved model to {}",
        done.run_dir.join("best_model.safetensors").display()
    );
    for (i, l) in lines.iter().enumerate() {
        if l.ends_with("New best model found. Saving...") {
            assert!(lines[i + 1].ends_with(&saved), "{}", lines[i + 1]);
        }
    }
    assert!(
        log.matches("New best model found. Saving...").count() >= 2,
        "{log}"
    );
    // Throughput goes on its own line after the runner's.
    assert!(
        regex::Regex::new(&format!(r"{prefix}Step 10: \d+ tokens/s"))
            .unwrap()
            .is_match(log.lines().find(|l| l.contains("Step 10: ")).unwrap_or("")),
        "{log}"
    );
    mfu_is_of_the_machines_gemm_peak(d.path(), &rows, &log);
}

/// Each start of `lines` (a `train.log` of two segments) opens with a header (version, config digest,
/// world, backend, engine, precision); the resume says where it resumed from, and each segment ends with
/// why it stopped.
fn segments_are_headed_and_ended(lines: &[&str], prefix: &str, log: &str) {
    let header = regex::Regex::new(&format!(
        r"{prefix}nanodist \d+\.\d+\.\d+ \| config \S+config\.toml sha256 [0-9a-f]{{12}} \| world 1 \(1 per node\) \| backend pytorchddp \| engine local \| [^|]+$"
    ))
    .unwrap();
    let headers: Vec<usize> = (0..lines.len())
        .filter(|&i| header.is_match(lines[i]))
        .collect();
    assert_eq!(headers.len(), 2, "{log}");
    assert_eq!(headers[0], 0, "{log}");
    let after = lines[headers[1] + 1];
    assert!(
        after.contains("resumed from ") && after.ends_with("step_00000012 (full state) at step 12"),
        "{after}"
    );
    assert!(
        lines[headers[1] - 1].ends_with("] stopped at train.exit_interval at step 12"),
        "{log}"
    );
    assert!(
        lines.last().unwrap().ends_with("] finished at step 20"),
        "{log}"
    );
    // Once per segment.
    let ends = lines
        .iter()
        .filter(|l| l.contains("] stopped at ") || l.contains("] finished at "))
        .count();
    assert_eq!(ends, 2, "{log}");
}

/// On CPU, MFU is a fraction of the `local` profile's GEMM peak per thread times the threads that
/// computed (one worker here), and the log's line says so.
fn mfu_is_of_the_machines_gemm_peak(dir: &Path, rows: &[Row], log: &str) {
    let local = nanodist::predict::profile::load("local").unwrap();
    let loaded = nanodist::plan::load_str(
        Path::new("t.toml"),
        &config_text(dir),
        &[],
        &LaunchEnv::default(),
    )
    .unwrap();
    // The machine's peak: every core of it, whatever threads the run starts.
    let cores = std::thread::available_parallelism().unwrap().get();
    let peak = local.profile.device.peak_tflops * 1e12 * cores as f64;
    for r in rows.iter().filter(|r| r.step > 0) {
        let want = loaded.plan.flops_per_token as f64 * r.tokens_per_s / peak;
        let mfu = r.mfu.unwrap();
        assert!(
            (mfu - want).abs() <= 1e-12 * want,
            "step {}: {mfu} vs {want}",
            r.step
        );
    }
    assert!(
        log.contains(&format!("of {cores} core(s)' f32 GEMM peak")),
        "{log}"
    );
}

/// The evaluation before training (`log.eval_at_start`, nanoGPT's eval at iter 0) evaluates exactly the
/// weights the run starts from: a run started from another run's final weights logs, at step 0, the val
/// and train-split losses that run logged at its end, bit for bit; and 2 workers evaluate what 1 does.
#[test]
fn the_evaluation_before_training_is_a_row_at_step_0_of_the_starting_weights() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let on = "log.eval_at_start=true";
    let first = run(d.path(), &[on, "log.run_name=\"first\""]);
    let first_rows = read_rows(&first.run_dir.join("metrics.jsonl")).unwrap();
    let zero = &first_rows[0];
    assert_eq!((zero.step, zero.tokens, zero.comm_bytes), (0, 0, 0));
    assert_eq!(zero.grad_norm, 0.0);
    assert_eq!(Some(zero.train_loss), zero.eval_train_loss);
    assert!(zero.val_loss.is_some() && first_rows[1].step > 0);
    assert_eq!(first_rows.iter().filter(|r| r.step == 0).count(), 1);
    // An untrained model of a 64-token vocabulary: about ln 64.
    assert!(
        (zero.val_loss.unwrap() - 64f64.ln()).abs() < 0.5,
        "{zero:?}"
    );

    let ckpt = first.run_dir.join("checkpoints/step_00000020");
    let from = format!("checkpoint={:?}", ckpt.display().to_string());
    let second = run(
        d.path(),
        &[
            on,
            "log.run_name=\"second\"",
            &from,
            "checkpoint_mode=\"weights\"",
        ],
    );
    let second_rows = read_rows(&second.run_dir.join("metrics.jsonl")).unwrap();
    let (end, start) = (first_rows.last().unwrap(), &second_rows[0]);
    assert_eq!(start.step, 0);
    assert_eq!(start.val_loss, end.val_loss);
    assert_eq!(start.eval_train_loss, end.eval_train_loss);

    let off = run(d.path(), &["log.run_name=\"off\""]);
    let off_rows = read_rows(&off.run_dir.join("metrics.jsonl")).unwrap();
    assert!(off_rows[0].step > 0, "eval_at_start = false: no step-0 row");

    let two = {
        let launch = LaunchEnv {
            workers_flag: Some(2),
            ..LaunchEnv::default()
        };
        // 2 workers x 1 row evaluate the windows of 1 worker x 2 rows.
        let set = vec![
            on.to_string(),
            "log.run_name=\"two\"".to_string(),
            "train.local_batch_size=1".to_string(),
        ];
        let loaded =
            nanodist::plan::load_str(Path::new("t.toml"), &config_text(d.path()), &set, &launch)
                .unwrap();
        train::run(&loaded).unwrap()
    };
    let two_rows = read_rows(&two.run_dir.join("metrics.jsonl")).unwrap();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs();
    assert!(close(two_rows[0].val_loss.unwrap(), zero.val_loss.unwrap()));
}

#[test]
fn damaged_newest_checkpoint_is_rejected_and_the_previous_one_used() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let s = run(d.path(), &["train.exit_interval=10"]);
    let ckpts = s.run_dir.join("checkpoints");
    let newest = ckpts.join("step_00000010");
    let model = newest.join("model.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let err = format!("{:#}", checkpoint::verify(&newest).unwrap_err());
    assert!(
        err.contains("checksum mismatch") && err.contains("model.safetensors"),
        "{err}"
    );
    assert_eq!(
        checkpoint::find_latest(&ckpts).unwrap().unwrap(),
        ckpts.join("step_00000005")
    );
    // A leftover temporary directory from a killed save is not a checkpoint either.
    std::fs::create_dir_all(ckpts.join(".step_00000015.tmp999")).unwrap();
    let resumed = run(d.path(), &["train.exit_interval=3"]);
    assert_eq!(resumed.step, 8, "resumed from step 5");
}

#[test]
fn eval_and_sample_use_the_trained_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let s = run(d.path(), &[]);
    let r = nanodist::generate::eval_file(&s.run_dir, &d.path().join("val.bin"), 4, Some(2000))
        .unwrap();
    assert_eq!(r.tokens, 1999);
    let val = read_rows(&s.run_dir.join("metrics.jsonl"))
        .unwrap()
        .last()
        .unwrap()
        .val_loss
        .unwrap();
    assert!(
        (r.loss - val).abs() < 0.3,
        "eval {} vs training's val loss {val}",
        r.loss
    );
    assert!(r.loss < (48f64).ln(), "better than uniform");
    // Windows batched into one forward pass give the loss of one window at a time (the last, shorter
    // window alone either way).
    for batch in [1, 16] {
        let b =
            nanodist::generate::eval_file(&s.run_dir, &d.path().join("val.bin"), batch, Some(2000))
                .unwrap();
        assert_eq!((b.tokens, b.windows), (r.tokens, r.windows));
        assert!(
            (b.loss - r.loss).abs() <= 1e-5 * r.loss,
            "batch {batch}: {} vs {}",
            b.loss,
            r.loss
        );
    }
}

fn wait_for(path: &Path, timeout: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// Two `train` of one run directory: while the first runs (it hangs at step 3, holding the directory),
/// the second exits 2 naming its PID and host, and writes nothing there; once the first is killed
/// (SIGKILL: its lock file stays, the kernel drops its lock) the second takes the directory over with a
/// warning, resumes from the first one's checkpoint and finishes; the lock file goes with it.
#[test]
fn a_run_directory_in_use_is_refused_and_a_dead_holders_lock_taken_over() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let cfg = d.path().join("t.toml");
    std::fs::write(&cfg, config_text(d.path())).unwrap();
    let args = |extra: &[&str]| {
        let mut a = vec!["train".to_string(), cfg.display().to_string()];
        for s in ["train.n_steps=8", "log.ckpt_interval=2"]
            .iter()
            .chain(extra)
        {
            a.extend(["--set".to_string(), s.to_string()]);
        }
        a
    };
    let mut first = Command::new(env!("CARGO_BIN_EXE_nanodist"))
        .args(args(&[]))
        .env("NANODIST_FAULT", "0:3:hang")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let run_dir = d.path().join("log/run");
    assert!(wait_for(
        &run_dir.join("checkpoints/step_00000002"),
        Duration::from_secs(60)
    ));
    let second = Command::new(env!("CARGO_BIN_EXE_nanodist"))
        .args(args(&["train.n_steps=9"]))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(2), "{err}");
    let holder = format!(
        "in use by PID {} on host {}",
        first.id(),
        nanodist::train::lock::host_name()
    );
    assert!(
        err.contains(&holder) && err.contains("it holds the lock"),
        "{err}"
    );
    let config = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
    assert!(
        config.contains("n_steps = 8"),
        "the refused run wrote its config:\n{config}"
    );
    first.kill().unwrap();
    first.wait().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_nanodist"))
        .args(args(&[]))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("taking over the lock of PID"), "{err}");
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(log.contains("resumed from"), "{log}");
    assert!(!run_dir.join("train.lock").exists());
}

#[test]
fn sigusr1_and_sigterm_save_a_checkpoint_then_exit_cleanly() {
    for sig in ["USR1", "TERM"] {
        let d = tempfile::tempdir().unwrap();
        make_data(d.path());
        let cfg = d.path().join("t.toml");
        std::fs::write(&cfg, config_text(d.path())).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_nanodist"))
            .args(["train"])
            .arg(&cfg)
            .args([
                "--set",
                "train.n_steps=100000",
                "--set",
                "log.ckpt_interval=0",
                "--set",
                "log.eval_interval=1000",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let run_dir: PathBuf = d.path().join("log/run");
        assert!(wait_for(
            &run_dir.join("metrics.jsonl"),
            Duration::from_secs(60)
        ));
        std::thread::sleep(Duration::from_millis(300));
        let kill = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(child.id().to_string())
            .status()
            .unwrap();
        assert!(kill.success());
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "exit {:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains(&format!("stopped by SIG{sig} after saving a checkpoint")),
            "{stdout}"
        );
        let ckpt = checkpoint::find_latest(&run_dir)
            .unwrap()
            .expect("a checkpoint");
        let m = checkpoint::verify(&ckpt).unwrap();
        assert!(m.step > 0 && m.step < 100000);
    }
}

#[test]
fn missing_data_and_unimplemented_backends_are_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("t.toml");
    std::fs::write(&cfg, config_text(d.path())).unwrap();
    let exe = env!("CARGO_BIN_EXE_nanodist");
    let out = Command::new(exe).arg("train").arg(&cfg).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("train.bin"));
    make_data(d.path());
    let out = Command::new(exe)
        .arg("train")
        .arg(&cfg)
        .args(["--set", "train.engine=nccl"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("\"nccl\"") && err.contains("without CUDA support"),
        "{err}"
    );
    // CUDA is not part of this build: a clear bad-input error, never a panic from a missing library.
    let out = Command::new(exe)
        .arg("train")
        .arg(&cfg)
        .args(["--set", "train.device=cuda"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("train.device = \"cuda\"") && err.contains("without CUDA"),
        "{err}"
    );
    let out = Command::new(exe)
        .arg("train")
        .arg(&cfg)
        .args([
            "--set",
            "train.compression={ name = \"radius\", correction = true }",
            "--set",
            "train.optim={ name = \"accumadamw\" }",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("correction = true") && err.contains("train.optim.name = \"adamw\""),
        "{err}"
    );
}

//! The `mpi` engine, run for real: `mpirun --oversubscribe -np N nanodist train ...` as separate
//! processes. The oracle is the `local` engine, which the distributed tests tie to one worker: both
//! engines add contributions in rank order, so their losses must agree exactly for the same seed.
//! Needs Open MPI's `mpirun` (apt-get install openmpi-bin libopenmpi-dev).
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nanodist::metrics::{read_rows, Row};

use crate::common;
use crate::common::{make_data, tiny_config};

fn mpirun(np: usize, args: &[String]) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--oversubscribe", "-np", &np.to_string()])
        .arg(env!("CARGO_BIN_EXE_nanodist"))
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("RAYON_NUM_THREADS", "1");
    c
}

fn write_config(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, tiny_config(dir, name)).unwrap();
    path
}

fn train_args(cfg: &Path, set: &[&str]) -> Vec<String> {
    let mut a = vec!["train".to_string(), cfg.display().to_string()];
    for s in ["train.engine=mpi", "train.threads=1"].iter().chain(set) {
        a.push("--set".into());
        a.push(s.to_string());
    }
    a
}

fn wait_with_deadline(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("mpirun still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    child.wait_with_output().unwrap()
}

fn run_mpi(np: usize, cfg: &Path, set: &[&str]) -> Output {
    let child = mpirun(np, &train_args(cfg, set))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun on PATH (apt-get install openmpi-bin)");
    wait_with_deadline(child, Duration::from_secs(300))
}

fn run_local(dir: &Path, name: &str, workers: usize, set: &[&str]) -> Vec<Row> {
    common::rows_of(&common::train_config(&tiny_config(dir, name), workers, set))
}

fn assert_same(local: &[Row], mpi: &[Row], what: &str) {
    assert_eq!(local.len(), mpi.len(), "{what}: rows");
    for (a, b) in local.iter().zip(mpi) {
        let key = |r: &Row| {
            (
                r.step,
                r.train_loss,
                r.grad_norm,
                r.param_norm,
                r.val_loss,
                r.consensus_distance,
            )
        };
        assert_eq!(key(a), key(b), "{what}: local vs mpi at step {}", a.step);
        assert_eq!(
            a.comm_bytes, b.comm_bytes,
            "{what}: bytes at step {}",
            a.step
        );
    }
}

/// A config that does not name an engine runs on MPI under mpirun (engine "auto"), equals the local
/// engine's 2 workers and records that world in its saved config; an explicit "local" under mpirun, and a
/// `train.workers` that is not mpirun's world, stay clear errors (exit 2 on every rank).
#[test]
fn the_default_engine_is_mpi_under_mpirun_and_explicit_local_is_refused() {
    let _turn = crate::turn();
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let cfg = write_config(d.path(), "auto");
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a = vec!["train".into(), cfg.display().to_string()];
        for s in ["train.threads=1"].iter().chain(extra) {
            a.extend(["--set".to_string(), s.to_string()]);
        }
        a
    };
    let spawn = |a: Vec<String>| {
        let child = mpirun(2, &a)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("mpirun on PATH");
        wait_with_deadline(child, Duration::from_secs(300))
    };
    let out = spawn(args(&[]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let resolved = std::fs::read_to_string(d.path().join("log/auto/config.toml")).unwrap();
    assert!(resolved.contains("engine = \"mpi\""), "{resolved}");
    assert!(resolved.contains("workers = 2"), "{resolved}");
    let mpi = read_rows(&d.path().join("log/auto/metrics.jsonl")).unwrap();
    assert_same(
        &run_local(d.path(), "auto-local", 2, &[]),
        &mpi,
        "engine auto",
    );

    let local = spawn(args(&[
        "train.engine=\"local\"",
        "log.run_name=\"refused\"",
    ]));
    let stderr = String::from_utf8_lossy(&local.stderr);
    assert!(!local.status.success(), "{stderr}");
    assert!(
        stderr.contains("the launcher started 2 processes but the engine is \"local\""),
        "{stderr}"
    );
    assert!(!d.path().join("log/refused").exists());

    let four = spawn(args(&["train.workers=4", "log.run_name=\"four\""]));
    let stderr = String::from_utf8_lossy(&four.stderr);
    assert_eq!(four.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("train.workers = 4 but the launcher started 2 rank(s)"),
        "{stderr}"
    );
    assert!(!d.path().join("log/four").exists());
}

#[test]
fn mpi_engine_gives_the_local_engines_losses_for_every_backend_and_topology() {
    let _turn = crate::turn();
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let cases: Vec<(usize, Vec<&str>)> = vec![
        (2, vec!["train.backend=pytorchddp"]),
        // With the evaluation before training: its step-0 row is the same under MPI.
        (
            4,
            vec!["train.backend=pytorchddp", "log.eval_at_start=true"],
        ),
        (
            4,
            vec![
                "train.backend=decentdp",
                "train.optim.name=accumadamw",
                "train.topology=complete",
            ],
        ),
        (4, vec!["train.backend=decentdp", "train.topology=ring"]),
        (4, vec!["train.backend=decentdp", "train.topology=exp"]),
        (
            4,
            vec![
                "train.backend=decentdp",
                "train.topology=ring",
                "train.overlap=false",
            ],
        ),
        (
            4,
            vec![
                "train.backend=decentdp",
                "train.topology=alternating-exp-ring",
                "train.ranks_per_node=2",
            ],
        ),
        (
            2,
            vec![r#"train.compression={ name = "topk", density = 0.05 }"#],
        ),
        (
            2,
            vec![
                r#"train.compression={ name = "radius", density = 0.05, interval = 4, threshold = 3 }"#,
            ],
        ),
        (
            2,
            vec![r#"train.compression={ name = "powersgd", rank = 2, start_iter = 3 }"#],
        ),
    ];
    for (i, (np, set)) in cases.into_iter().enumerate() {
        mpi_case_matches_the_local_engine(d.path(), &format!("case{i}"), np, &set);
    }
}

/// One case of `mpi_engine_gives_the_local_engines_losses_for_every_backend_and_topology`: `np` ranks
/// under mpirun with `set` give the local engine's rows, only rank 0 reports, and every step sends.
fn mpi_case_matches_the_local_engine(dir: &Path, name: &str, np: usize, set: &[&str]) {
    let cfg = write_config(dir, name);
    let out = run_mpi(np, &cfg, set);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{set:?} np={np}: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.matches("finished at step 20 (last val loss").count(),
        1,
        "only rank 0 reports: {stdout}"
    );
    let mpi = read_rows(&dir.join("log").join(name).join("metrics.jsonl")).unwrap();
    let local = run_local(dir, &format!("{name}-local"), np, set);
    assert_same(&local, &mpi, &format!("{set:?} np={np}"));
    // Every step sends (comm_bytes counts the algorithm's traffic only); overlapped gossip (decentdp's
    // default) sends step t's mix during step t + 1, so its row of step 1 (after the synchronous step
    // 0) has none, and the evaluation before training trains no step.
    let silent = mpi.iter().filter(|r| r.comm_bytes == 0).count();
    let overlap = set.iter().any(|s| s.contains("decentdp"))
        && !set.iter().any(|s| s.contains("overlap=false"));
    let at_start = set.iter().any(|s| s.contains("eval_at_start"));
    assert_eq!(
        silent,
        usize::from(overlap) + usize::from(at_start),
        "{set:?}: rows without traffic"
    );
    if at_start {
        assert_eq!((mpi[0].step, mpi[0].val_loss.is_some()), (0, true));
    }
}

/// DiLoCo (streaming with fp8, with Muon inside (MuLoCo), with PowerSGD pseudo-gradients, SparseLoCo, eager, hierarchical, non-IID data), SPARTA and
/// DeMo on MPI give the local engine's rows bit for bit at 2 and 4 ranks, and an MPI run stopped
/// mid-period resumes exactly.
#[test]
fn low_communication_backends_match_the_local_engine_and_resume_under_mpi() {
    let _turn = crate::turn();
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let cases: [&[&str]; 7] = [
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 4, fragments = 2, fragment_delay = 1, quantize = \"fp8\" }",
        ],
        // MuLoCo: Muon as DiLoCo's inner optimizer.
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 4 }",
            "train.optim={ name = \"muon\" }",
            "train.lr_schedule.lr=0.02",
        ],
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 2 }",
            r#"train.compression={ name = "powersgd", rank = 2, start_iter = 2 }"#,
        ],
        // SparseLoCo (2-bit top-k pseudo-gradients, decaying error feedback) with eager outer steps.
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 2, outer_momentum = 0.0, outer_lr = 1.0, eager = true }",
            r#"train.compression={ name = "sparseloco", density = 0.05, chunk = 256 }"#,
        ],
        // Hierarchical (groups of 2 all-reduce gradients every step, DiLoCo between the groups), eager
        // (the all-reduce spread over the 4 steps after a sync), each worker on its shard of the data.
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 4, group_size = 2, eager = true, eager_pieces = 4 }",
            r#"worker_data={ name = "shard" }"#,
        ],
        &["train.backend=\"sparta\"", "train.sparta={ p = 0.1 }"],
        &[
            "train.backend=\"demo\"",
            "train.optim={ name = \"sgd\" }",
            "train.demo={ topk = 8, chunk = 16 }",
        ],
    ];
    for (i, set) in cases.iter().enumerate() {
        for np in [2, 4] {
            let name = format!("low{i}-{np}");
            let cfg = write_config(d.path(), &name);
            let out = run_mpi(np, &cfg, set);
            assert!(
                out.status.success(),
                "{set:?} np={np}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let mpi = read_rows(&d.path().join("log").join(&name).join("metrics.jsonl")).unwrap();
            let local = run_local(d.path(), &format!("{name}-local"), np, set);
            assert_same(&local, &mpi, &format!("{set:?} np={np}"));
            // Stopped at step 5 (mid-period; the streaming case with a fragment in flight) and resumed.
            let stop = format!("{name}-stop");
            let cfg = write_config(d.path(), &stop);
            let mut first = set.to_vec();
            first.push("train.exit_interval=5");
            for part in [&first[..], set] {
                let out = run_mpi(np, &cfg, part);
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let resumed =
                read_rows(&d.path().join("log").join(&stop).join("metrics.jsonl")).unwrap();
            assert_same(
                &local,
                &resumed,
                &format!("{set:?} np={np} resumed under mpirun"),
            );
        }
    }
}

/// A NaN loss on rank 1 (injected) stops both MPI ranks at that step: mpirun ends with the guard's exit
/// code 3, the message names the step and the rank, no checkpoint of that step is written, and the same
/// command resumes from the last good one to the local engine's rows.
#[test]
fn a_non_finite_step_stops_every_mpi_rank_and_resumes_from_the_last_checkpoint() {
    let _turn = crate::turn();
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let set = ["train.n_steps=10", "log.ckpt_interval=3"];
    let cfg = write_config(d.path(), "nan");
    let child = mpirun(2, &train_args(&cfg, &set))
        .env("NANODIST_FAULT", "1:5:nan")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun on PATH");
    let out = wait_with_deadline(child, Duration::from_secs(300));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("step 6: rank 1's train loss is NaN"), "{err}");
    let run = d.path().join("log").join("nan");
    let kept: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(kept, ["step_00000003"]);
    let out = run_mpi(2, &cfg, &set);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let local = run_local(d.path(), "nan-local", 2, &set);
    assert_same(
        &local,
        &read_rows(&run.join("metrics.jsonl")).unwrap(),
        "resumed after NaN",
    );
}

/// Each process probes its own CPU; the run trains as rank 0 decided. Two ranks told different bf16 rates
/// (rank 0 fast bf16 products, rank 1 slow ones) give the rows of two ranks that both have rank 0's, bit for
/// bit, and not those of two that both have rank 1's.
#[test]
fn ranks_with_different_probe_results_train_as_rank_0_decided() {
    let _turn = crate::turn();
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let run = |name: &str, rates: [&str; 2]| {
        let cfg = write_config(d.path(), name);
        let args = train_args(&cfg, &["train.amp=true", "train.n_steps=8"]);
        let mut c = Command::new("mpirun");
        c.arg("--oversubscribe");
        for (i, rate) in rates.iter().enumerate() {
            if i > 0 {
                c.arg(":");
            }
            c.args(["-np", "1", "-x", &format!("NANODIST_CPU_BF16_RATE={rate}")])
                .arg(env!("CARGO_BIN_EXE_nanodist"))
                .args(&args);
        }
        let child = c
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("RAYON_NUM_THREADS", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("mpirun on PATH");
        let out = wait_with_deadline(child, Duration::from_secs(300));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        read_rows(&d.path().join("log").join(name).join("metrics.jsonl")).unwrap()
    };
    let mixed = run("mixed", ["2.0", "0.5"]);
    assert_same(
        &run("bf16", ["2.0", "2.0"]),
        &mixed,
        "rank 0's bf16 decision",
    );
    let f32_rows = run("f32", ["0.5", "0.5"]);
    assert_ne!(
        f32_rows[3].train_loss, mixed[3].train_loss,
        "f32 differs from bf16"
    );
}

/// Compressed gossip (CHOCO) with each compressor on ring and exp: 4 MPI processes give the local engine's
/// rows bit for bit ("auto" tunes the same step on every rank); an overlapped run stopped with a message
/// in flight resumes under mpirun to the same rows.
#[test]
fn compressed_gossip_matches_the_local_engine_and_resumes_under_mpi() {
    let _turn = crate::turn();
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let compressors = [
        r#"train.compression={ name = "topk", density = 0.2, consensus_step = 0.3 }"#,
        r#"train.compression={ name = "randomk", density = 0.2, consensus_step = 0.2 }"#,
        r#"train.compression={ name = "qsgd", levels = 7, consensus_step = 0.3 }"#,
        r#"train.compression={ name = "sign", consensus_step = "auto" }"#,
    ];
    for (i, compression) in compressors.iter().enumerate() {
        for topology in ["ring", "exp"] {
            let topo = format!("train.topology={topology}");
            let set = ["train.backend=decentdp", topo.as_str(), compression];
            let name = format!("choco{i}-{topology}");
            let cfg = write_config(d.path(), &name);
            let out = run_mpi(4, &cfg, &set);
            assert!(
                out.status.success(),
                "{set:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let mpi = read_rows(&d.path().join("log").join(&name).join("metrics.jsonl")).unwrap();
            let local = run_local(d.path(), &format!("{name}-local"), 4, &set);
            assert_same(&local, &mpi, &format!("{set:?}"));
        }
    }
    let set = [
        "train.backend=decentdp",
        "train.topology=exp",
        "train.overlap=true",
        compressors[2],
    ];
    let local = run_local(d.path(), "choco-overlap-local", 4, &set);
    let cfg = write_config(d.path(), "choco-overlap");
    let mut first = set.to_vec();
    first.push("train.exit_interval=5");
    for part in [&first[..], &set[..]] {
        let out = run_mpi(4, &cfg, part);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let resumed = read_rows(&d.path().join("log/choco-overlap/metrics.jsonl")).unwrap();
    assert_same(
        &local,
        &resumed,
        "overlapped qsgd gossip resumed under mpirun",
    );
}

/// The pid of rank `rank` among the processes whose command line mentions `marker`.
fn rank_pid(marker: &str, rank: usize) -> Option<u32> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}\0");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let env = std::fs::read(e.path().join("environ")).ok()?;
        (String::from_utf8_lossy(&cmd).contains(marker)
            && String::from_utf8_lossy(&env).contains(&want))
        .then_some(pid)
    })
}

/// Starts a long run on 2 ranks, waits until it trains, sends `signal` to rank 1 and returns mpirun's
/// output and how long the job took to end after the signal.
fn hurt_rank_one(signal: &str, timeout_secs: u32) -> (Output, Duration) {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let cfg = write_config(d.path(), "hurt");
    let timeout = format!("train.comm_timeout_secs={timeout_secs}");
    let mut child = mpirun(
        2,
        &train_args(
            &cfg,
            &["train.n_steps=100000", "log.eval_interval=100000", &timeout],
        ),
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let metrics = d.path().join("log/hurt/metrics.jsonl");
    let start = Instant::now();
    while !metrics.is_file() || std::fs::metadata(&metrics).unwrap().len() == 0 {
        if child.try_wait().unwrap().is_some() {
            let out = child.wait_with_output().unwrap();
            panic!(
                "the job ended before training: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the run never started"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let marker = cfg.display().to_string();
    let pid = rank_pid(&marker, 1).expect("rank 1's process");
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let hurt = Instant::now();
    let out = wait_with_deadline(child, Duration::from_secs(timeout_secs as u64 + 60));
    let took = hurt.elapsed();
    // A stopped rank may outlive the job; do not leave it behind.
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    (out, took)
}

#[test]
fn a_hung_rank_is_named_and_the_job_ends_within_the_timeout() {
    let _turn = crate::turn();
    let (out, took) = hurt_rank_one("-STOP", 3);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("rank 0: timed out after 3 s waiting for rank(s) [1]"),
        "{stderr}"
    );
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

#[test]
fn a_killed_rank_ends_the_job_instead_of_hanging() {
    let _turn = crate::turn();
    let (out, took) = hurt_rank_one("-KILL", 600);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("rank 1") && stderr.contains("signal 9"),
        "{stderr}"
    );
    assert!(took < Duration::from_secs(60), "took {took:?}");
}

/// A rank whose run fails (an error, or a panic) while the others wait on it in a collective: its own
/// message names it and the job ends at once, long before the others' `comm_timeout_secs`.
#[test]
fn a_rank_that_fails_is_named_and_ends_the_job_at_once() {
    let _turn = crate::turn();
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    for (kind, says) in [
        ("error", "error: rank 1: injected error on rank 1 at step 3"),
        ("panic", "injected fault on rank 1 at step 3"),
    ] {
        let cfg = write_config(d.path(), kind);
        let set = ["train.n_steps=50", "train.comm_timeout_secs=600"];
        let child = mpirun(2, &train_args(&cfg, &set))
            .env("NANODIST_FAULT", format!("1:3:{kind}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("mpirun on PATH");
        let start = Instant::now();
        let out = wait_with_deadline(child, Duration::from_secs(300));
        let took = start.elapsed();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{kind}: {err}");
        assert!(err.contains(says), "{kind}: {err}");
        assert!(!err.contains("timed out"), "{kind}: {err}");
        assert!(took < Duration::from_secs(120), "{kind}: took {took:?}");
    }
}

/// `btl_tcp_flags` as `ompi_info` reports it: (value, source), with `OMPI_MCA_btl_tcp_flags` set to
/// `env` or unset.
fn ompi_tcp_flags(env: Option<&str>) -> (String, String) {
    let mut c = Command::new("ompi_info");
    c.args(["--param", "btl", "tcp", "--level", "5", "--parsable"]);
    match env {
        Some(v) => c.env("OMPI_MCA_btl_tcp_flags", v),
        None => c.env_remove("OMPI_MCA_btl_tcp_flags"),
    };
    let out = c
        .output()
        .expect("ompi_info on PATH (apt-get install openmpi-bin)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let field = |name: &str| {
        let key = format!("mca:btl:tcp:param:btl_tcp_flags:{name}:");
        let line = text.lines().find_map(|l| l.strip_prefix(key.as_str()));
        line.unwrap_or_else(|| panic!("no {key} in ompi_info's output:\n{text}"))
            .to_string()
    };
    (field("value"), field("source"))
}

/// The Open MPI settings nanodist runs with change only what they mean to, and Open MPI takes them:
/// `btl_tcp_flags` is the installed default without `put`, and `ompi_info` given nanodist's value in
/// the environment reports it, read from there.
#[test]
fn open_mpi_takes_the_tcp_flags_without_put() {
    let (default, source) = ompi_tcp_flags(None);
    assert_eq!(source, "default");
    let [(key, ours)] = nanodist::comm::OPEN_MPI_DEFAULTS;
    assert_eq!(key, "OMPI_MCA_btl_tcp_flags");
    let without_put: Vec<&str> = default.split(',').filter(|f| *f != "put").collect();
    assert!(default.split(',').any(|f| f == "put"), "default {default}");
    assert_eq!(ours, without_put.join(","));
    assert_eq!(
        ompi_tcp_flags(Some(ours)),
        (ours.to_string(), "environment".to_string())
    );
}

//! `nanodist sbatch` against a real single-node Slurm (scripts/slurm/local-cluster.sh; CI starts it and
//! sets NANODIST_REQUIRE_SLURM=1). The oracle for every job is the same config trained in this process
//! on the local engine: the MPI engine adds in the same rank order, so losses must agree bit for bit,
//! however often the job was stopped, requeued or chained.
//! Without Slurm the tests that need it print "skipped"; the bad-config test runs everywhere.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nanodist::metrics::{read_rows, Row};
use nanodist::plan::LaunchEnv;
use nanodist::train;

use crate::common;
use crate::common::make_data;

const EXE: &str = env!("CARGO_BIN_EXE_nanodist");

/// A small run without run_name, so that the job names its run directory after the job id.
fn config_text(dir: &Path, set: &[&str]) -> String {
    common::config(dir, None, &[&["log.ckpt_interval=10"], set].concat())
}

fn slurm_up() -> bool {
    let up = Command::new("sinfo")
        .args(["-h", "-N", "-o", "%T"])
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l == "idle" || l == "mixed" || l == "allocated")
        });
    if !up {
        assert!(
            std::env::var_os("NANODIST_REQUIRE_SLURM").is_none(),
            "NANODIST_REQUIRE_SLURM is set but no Slurm node answers (scripts/slurm/local-cluster.sh start)"
        );
        eprintln!("skipped: no Slurm (scripts/slurm/local-cluster.sh start)");
    }
    up
}

/// `nanodist sbatch CONFIG ARGS...` with one CPU per task (the node claims 4 CPUs on 2 cores, so that 4-rank
/// jobs fit: the default, the node's CPUs shared by the tasks, would oversubscribe the cores); returns the
/// job id.
fn sbatch(cfg: &Path, args: &[&str]) -> String {
    let out = Command::new(EXE)
        .arg("sbatch")
        .arg(cfg)
        .args(["--cpus-per-task", "1"])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "nanodist sbatch: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .split_whitespace()
        .nth(2)
        .expect("submitted job ID ...")
        .to_string()
}

/// Waits until no task of job `id` is pending or running.
/// Waits until squeue no longer lists job `id`. On the loaded node squeue itself fails at times (slurmctld
/// answers late) and prints nothing: only a successful, empty answer, twice in a row, ends the wait (a CI
/// run once read the job's log while its last seconds still ran).
fn wait_job(id: &str, limit: Duration) {
    let start = Instant::now();
    let mut gone = 0;
    loop {
        let out = Command::new("squeue")
            .args(["-h", "-j", id, "-o", "%T"])
            .output()
            .unwrap();
        let states = String::from_utf8_lossy(&out.stdout).trim().to_string();
        // A job purged from slurmctld (MinJobAge after its end) is an error to squeue.
        let purged = String::from_utf8_lossy(&out.stderr).contains("Invalid job id");
        gone = match (out.status.success() && states.is_empty()) || purged {
            true => gone + 1,
            false => 0,
        };
        if gone == 2 {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "job {id} still {states} after {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn job_log(run_dir: &Path) -> String {
    let mut text = String::new();
    for e in std::fs::read_dir(run_dir).unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("slurm-") {
            text += &std::fs::read_to_string(e.path()).unwrap();
        }
    }
    text
}

/// The rows of config `src` trained here, uninterrupted, with `workers` local workers.
fn local_rows(src: &str, workers: usize) -> Vec<Row> {
    let launch = LaunchEnv {
        workers_flag: Some(workers),
        ..LaunchEnv::default()
    };
    let set = vec!["log.run_name=\"local\"".to_string()];
    let loaded = nanodist::plan::load_str(Path::new("t.toml"), src, &set, &launch).unwrap();
    read_rows(&train::run(&loaded).unwrap().run_dir.join("metrics.jsonl")).unwrap()
}

fn assert_same_losses(job: &[Row], local: &[Row], what: &str) {
    let key = |r: &Row| {
        (
            r.step,
            r.train_loss.to_bits(),
            r.grad_norm.to_bits(),
            r.param_norm.to_bits(),
            r.val_loss.map(f64::to_bits),
        )
    };
    assert_eq!(job.len(), local.len(), "{what}: rows");
    for (a, b) in job.iter().zip(local) {
        assert_eq!(key(a), key(b), "{what}: step {}", a.step);
    }
}

fn setup(set: &[&str]) -> (tempfile::TempDir, PathBuf) {
    // Slurm's daemons run as root and the job reads the files: keep them outside private tmp dirs.
    let d = tempfile::Builder::new()
        .prefix("nanodist-slurm-")
        .tempdir_in(
            std::env::var_os("CARGO_TARGET_TMPDIR").map_or(std::env::temp_dir(), PathBuf::from),
        )
        .unwrap();
    make_data(d.path());
    let cfg = d.path().join("run.toml");
    std::fs::write(&cfg, config_text(d.path(), set)).unwrap();
    (d, cfg)
}

#[test]
fn sbatch_runs_a_two_rank_mpi_job_to_the_end() {
    let _turn = crate::turn();
    if !slurm_up() {
        return;
    }
    let (d, cfg) = setup(&[]);
    let id = sbatch(&cfg, &["--tasks-per-node", "2", "--time", "00:05:00"]);
    wait_job(&id, Duration::from_secs(240));
    let run = d.path().join("log").join(&id);
    let log = job_log(&run);
    assert!(log.contains("finished at step 20"), "{log}");
    assert!(log.contains("world size        2"), "{log}");
    assert!(run
        .join("checkpoints/step_00000020/manifest.json")
        .is_file());
    assert!(run
        .join("checkpoints/step_00000010/manifest.json")
        .is_file());
    let rows = read_rows(&run.join("metrics.jsonl")).unwrap();
    assert_same_losses(
        &rows,
        &local_rows(&config_text(d.path(), &[]), 2),
        "sbatch job",
    );
}

/// A config with `log.run_name`: the job's output lands in that run directory with the run's files, and the
/// submit message names it. Without --cpus-per-task or train.threads, each task gets the node's CPUs shared
/// by the tasks (this node: 4 CPUs, 2 tasks).
#[test]
fn a_named_run_keeps_its_job_output_and_tasks_share_the_nodes_cpus() {
    let _turn = crate::turn();
    if !slurm_up() {
        return;
    }
    let (d, cfg) = setup(&["log.run_name=\"named\""]);
    let dry = Command::new(EXE)
        .arg("sbatch")
        .arg(&cfg)
        .args(["--tasks-per-node", "2", "--dry-run"])
        .output()
        .unwrap();
    let script = String::from_utf8_lossy(&dry.stdout);
    let cpus = Command::new("sinfo")
        .args(["-h", "-o", "%c"])
        .output()
        .unwrap();
    let cpus: usize = String::from_utf8_lossy(&cpus.stdout)
        .trim()
        .parse()
        .unwrap();
    assert!(
        script.contains(&format!("#SBATCH --cpus-per-task={}\n", (cpus / 2).max(1))),
        "{script}"
    );
    let out = Command::new(EXE)
        .arg("sbatch")
        .arg(&cfg)
        .args([
            "--tasks-per-node",
            "2",
            "--time",
            "00:05:00",
            "--cpus-per-task",
            "1",
        ])
        .output()
        .unwrap();
    let message = String::from_utf8_lossy(&out.stdout).to_string();
    let run = d.path().join("log").join("named");
    assert!(
        message.ends_with(&format!("run directory {}\n", run.display())),
        "{message}"
    );
    let id = message.split_whitespace().nth(2).unwrap().to_string();
    wait_job(&id, Duration::from_secs(240));
    let log = std::fs::read_to_string(run.join(format!("slurm-{id}.out"))).unwrap();
    assert!(log.contains("finished at step 20"), "{log}");
    assert!(run.join("metrics.jsonl").is_file() && !d.path().join("log").join(&id).exists());
    // The job's output is in the run directory only: Slurm's empty file in log_dir is gone.
    let left = d.path().join("log").join(format!("slurm-{id}.out"));
    assert!(!left.exists(), "{} left behind", left.display());
}

#[test]
fn a_job_at_its_time_limit_checkpoints_requeues_and_matches_an_uninterrupted_run() {
    let _turn = crate::turn();
    if !slurm_up() {
        return;
    }
    // The job has a 10-minute limit and --signal=B:USR1@540, so Slurm itself sends USR1 to the batch shell
    // about a minute in, and the shell passes it to the ranks through srun. On this 2-CPU node, busy with
    // the job's two ranks, everything beside the job runs late: sbatch returned up to a minute after the
    // job started, Slurm's signals and this test's own deliveries landed 16 s to over a minute late
    // (measured), so a 20000-step job could end first. So the job is 60000 steps (~3.5 min), and the test
    // also delivers the time limit's signals itself once the job has logged its first metrics row (step
    // 250): USR1 to the batch shell (its trap marks the job for requeue) and to the ranks (what srun
    // forwards). The checkpoint, the requeue and the resume are the job's own. A later USR1 (Slurm's, in
    // the requeued job) requeues it once more, which the run survives the same way. The uninterrupted run
    // trains first, so that the job has the node to itself.
    let (d, cfg) = setup(&[
        "train.n_steps=60000",
        "log.log_interval=250",
        "log.eval_interval=20000",
        "log.ckpt_interval=0",
        "model.n_embd=64",
        "train.context_length=32",
    ]);
    let patched = std::fs::read_to_string(&cfg).unwrap();
    let local = local_rows(&patched, 2);
    // The delivery runs as a shell loop beside the job (from this test process, pgrep and kill were seen
    // to wait until the job had ended): once the job has logged step 250, USR1 to the batch shell
    // (bash running slurmd's copy of the script, job<id>/slurm_script), then to the ranks and srun (their
    // command lines name the config), again every 3 s until the ranks say they stopped. On this node the
    // loop itself has been seen to run only when the job was done (CI: the first USR1 went out as the
    // job saved its final checkpoint); then the job is submitted again, up to three times in all: what is
    // tested (the checkpoint, the requeue, the resume) must happen in one of them, untouched.
    let cfg_abs = std::fs::canonicalize(&cfg).unwrap();
    let mut tries = Vec::new();
    let (run, log) = loop {
        let (run, log, tried) = time_limited_job(&cfg, &cfg_abs, &d.path().join("log"));
        tries.push(tried);
        if log.contains("stopped by SIGUSR1 after saving a checkpoint") || tries.len() == 3 {
            break (run, log);
        }
    };
    assert!(
        log.contains("USR1: checkpointing before the time limit"),
        "{}",
        tries.join("\n")
    );
    assert!(
        log.contains("stopped by SIGUSR1 after saving a checkpoint"),
        "{}",
        tries.join("\n")
    );
    assert!(log.contains("requeueing job"), "{log}");
    assert!(log.contains("(restart 1)"), "{log}");
    assert!(log.contains("finished at step 60000"), "{log}");
    let rows = read_rows(&run.join("metrics.jsonl")).unwrap();
    assert_same_losses(&rows, &local, "requeued job");
}

/// One submission of the time-limited job of
/// `a_job_at_its_time_limit_checkpoints_requeues_and_matches_an_uninterrupted_run`, with the shell loop
/// that delivers USR1 beside it: the run directory, the job's log, and what was sent, for the message.
fn time_limited_job(cfg: &Path, cfg_abs: &Path, log_dir: &Path) -> (PathBuf, String, String) {
    let id = sbatch(
        cfg,
        &[
            "--tasks-per-node",
            "2",
            "--time",
            "00:10:00",
            "--signal-secs",
            "540",
        ],
    );
    let run = log_dir.join(&id);
    let signaller = Command::new("bash")
        .arg("-c")
        .arg(
            r#"for _ in $(seq 1 1800); do grep -q '"step":250' "$RUN/metrics.jsonl" 2>/dev/null && break; sleep 0.1; done
for _ in $(seq 1 60); do
    echo "at $(date +%T.%N):"
    for p in $(pgrep -f "job0*$ID/slurm_script") $(pgrep -f "train $CFG"); do kill -USR1 "$p" && echo "$p $(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null)"; done
    for _ in $(seq 1 30); do cat "$RUN"/slurm-*.out 2>/dev/null | grep -q 'stopped by SIGUSR1' && exit 0; sleep 0.1; done
done"#,
        )
        .env("RUN", &run)
        .env("ID", &id)
        .env("CFG", cfg_abs)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_job(&id, Duration::from_secs(1200));
    let signalled = signaller.wait_with_output().unwrap();
    let log = job_log(&run);
    let tried = format!(
        "job {id}: USR1 sent {}\n{log}",
        String::from_utf8_lossy(&signalled.stdout)
    );
    (run, log, tried)
}

#[test]
fn an_array_chain_resumes_link_by_link_and_later_links_exit_at_once() {
    let _turn = crate::turn();
    if !slurm_up() {
        return;
    }
    // Each link trains 7 steps: links 1-3 reach 20; link 4 finds the run finished.
    let (d, cfg) = setup(&["train.exit_interval=7"]);
    let id = sbatch(
        &cfg,
        &[
            "--tasks-per-node",
            "2",
            "--array",
            "1-4%1",
            "--time",
            "00:05:00",
        ],
    );
    wait_job(&id, Duration::from_secs(300));
    let run = d.path().join("log").join(&id);
    let log = job_log(&run);
    for step in [7, 14] {
        assert!(
            log.contains(&format!("stopped at train.exit_interval at step {step}")),
            "{log}"
        );
    }
    assert!(log.contains("finished at step 20"), "{log}");
    assert!(log.contains("run already finished at step 20"), "{log}");
    let rows = read_rows(&run.join("metrics.jsonl")).unwrap();
    // The chain stops every 7 steps; the local run goes straight through.
    assert_same_losses(
        &rows,
        &local_rows(&config_text(d.path(), &[]), 2),
        "array chain",
    );
}

#[test]
fn exit_duration_mins_under_srun_stops_every_rank_at_one_step_and_the_chain_finishes_exactly() {
    let _turn = crate::turn();
    if !slurm_up() {
        return;
    }
    // Each link gets a third of the time the uninterrupted run takes here (machines of this class run
    // 0.2-2 ms a step; a fixed budget once let the fast ones finish within the first link), so the chain
    // has several links on any of them: the ranks must agree on the step at which time runs out, or the
    // chain could not match the uninterrupted run bit for bit.
    let set = [
        "train.n_steps=12000",
        "log.log_interval=500",
        "log.eval_interval=2000",
        "log.ckpt_interval=0",
    ];
    let (d, cfg) = setup(&set);
    let start = Instant::now();
    let local = local_rows(&std::fs::read_to_string(&cfg).unwrap(), 2);
    let link_mins = (start.elapsed().as_secs_f64() / 3.0).max(0.5) / 60.0;
    let budget = format!("train.exit_duration_mins={link_mins}");
    std::fs::write(
        &cfg,
        config_text(d.path(), &[&set[..], &[&budget]].concat()),
    )
    .unwrap();
    let id = sbatch(
        &cfg,
        &[
            "--tasks-per-node",
            "2",
            "--array",
            "1-40%1",
            "--time",
            "00:05:00",
        ],
    );
    wait_job(&id, Duration::from_secs(600));
    let run = d.path().join("log").join(&id);
    let log = job_log(&run);
    assert!(log.contains("stopped at train.exit_duration_mins"), "{log}");
    assert!(log.contains("finished at step 12000"), "{log}");
    let rows = read_rows(&run.join("metrics.jsonl")).unwrap();
    assert_same_losses(&rows, &local, "exit_duration chain");
}

#[test]
fn a_bad_config_is_rejected_before_sbatch_is_called() {
    let d = tempfile::tempdir().unwrap();
    // A stand-in sbatch that records its calls: it must not be called for a bad config.
    let bin = d.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let calls = d.path().join("calls");
    let fake = bin.join("sbatch");
    std::fs::write(
        &fake,
        format!("#!/bin/sh\necho \"$@\" >> {}\necho 4242\n", calls.display()),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = |cfg: &Path, args: &[&str]| {
        Command::new(EXE)
            .arg("sbatch")
            .arg(cfg)
            .args(args)
            .env("PATH", &path)
            .output()
            .unwrap()
    };
    let cfg = d.path().join("run.toml");
    // A typo in a key, a topology that does not fit the job, and missing data.
    let cases = [
        (
            config_text(d.path(), &[]).replace("n_steps", "n_stepz"),
            vec![],
            "n_stepz",
        ),
        (
            config_text(
                d.path(),
                &["train.backend=\"decentdp\"", "train.topology=\"exp\""],
            ),
            vec!["--tasks-per-node", "3"],
            "power-of-two",
        ),
        (config_text(d.path(), &[]), vec![], "train.bin"),
        (
            config_text(d.path(), &[]),
            vec!["--time", "ten minutes"],
            "--time",
        ),
    ];
    for (text, args, needle) in cases {
        std::fs::write(&cfg, text).unwrap();
        let out = run(&cfg, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{needle}: {err}");
        assert!(err.contains(needle), "{needle}: {err}");
        assert!(
            !calls.exists(),
            "sbatch was called for a bad config ({needle})"
        );
    }
    // A good one reaches sbatch with the config and its overrides.
    make_data(d.path());
    std::fs::write(&cfg, config_text(d.path(), &[])).unwrap();
    let out = run(&cfg, &["--set", "train.seed=4"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("submitted job 4242"));
    let called = std::fs::read_to_string(&calls).unwrap();
    assert!(
        called.contains("--parsable")
            && called.contains("run.toml")
            && called.contains("train.seed=4"),
        "{called}"
    );
}

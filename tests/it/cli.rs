//! The command line: exit codes, the plan printed by `check`, `schema` output, vocabulary checks against
//! prepared data, and text in and out of a trained model.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common::{make_data, nanodist, nanodist_with, write_tiny_config};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn check_prints_the_resolved_plan() {
    let cfg = root().join("config/gpt2-small.toml");
    let dir = tempfile::tempdir().unwrap();
    make_data(dir.path());
    let data = format!("data_dir={:?}", dir.path().display().to_string());
    // Four workers of GPT-2 small at 30 sequences each need ~100 GB (attention probabilities of 12 x 30 x
    // 12 x 1024 x 1024 per compute slot): the plan is printed for a machine that has them.
    let out = nanodist_with(
        &[
            "check",
            cfg.to_str().unwrap(),
            "--set",
            &data,
            "--workers",
            "4",
            "--tokens-per-s",
            "100000",
        ],
        &[("NANODIST_MEMORY_GB", "1000")],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    for want in [
        "synchronisation   all-reduce in buckets of 25.0 MB",
        "world size        4",
        "local batch       30 sequences",
        "accumulation      4 micro-steps",
        "tokens per step   491520",
        "parameters        124373760",
        "run time          34d 03:12:00",
        "peak: 4 worker(s) x 500 MB (497 MB state + 0 B at evaluations and steps) + 1.99 GB shared replica",
        "note: train.compile = true has no meaning",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
}

/// A local run that cannot fit in memory is refused by `check` and `train` alike, before any work, with the
/// estimate's numbers.
#[test]
fn check_and_train_refuse_local_workers_that_do_not_fit_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    make_data(dir.path());
    let cfg = write_tiny_config(dir.path(), "t.toml", "mem");
    let run = |cmd: &str, gb: &str| {
        let args = [cmd, cfg.to_str().unwrap(), "--workers", "8"];
        nanodist_with(&args, &[("NANODIST_MEMORY_GB", gb)])
    };
    let ok = run("check", "100");
    assert_eq!(ok.status.code(), Some(0), "{}", text(&ok));
    let line = text(&ok)
        .lines()
        .find(|l| l.starts_with("memory "))
        .map(String::from)
        .unwrap_or_else(|| panic!("no memory line in {}", text(&ok)));
    assert!(line.contains("peak: 8 worker(s) x"), "{line}");
    for cmd in ["check", "train"] {
        // Below the process's own share: refused on any machine.
        let out = run(cmd, "0.05");
        let err = text(&out);
        assert_eq!(out.status.code(), Some(2), "{cmd}: {err}");
        for want in [
            "8 local worker(s) need about",
            "50.0 MB is available",
            "peak: 8 worker(s)",
            "not even train.local_batch_size = 1 fits",
        ] {
            assert!(err.contains(want), "{cmd}: missing {want:?} in {err}");
        }
        // `check` prints the plan before the problems.
        let printed = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            cmd == "check",
            printed.contains("\nmemory "),
            "{cmd}: {printed}"
        );
        assert!(
            !dir.path().join("log/mem").exists(),
            "{cmd} created the run"
        );
    }
    let bad = run("check", "lots");
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        text(&bad).contains("NANODIST_MEMORY_GB=lots"),
        "{}",
        text(&bad)
    );
}

/// `check` shows the synchronisation: workers x threads, gossip's rounds, the overlap, and the bytes each
/// worker sends per step, per phase of a reducer that starts dense; `train` prints the same plan and a line
/// at the step the reducer switches. The byte figures are the engines' own accounting of a ring all-reduce
/// over each group (`comm::all_reduce_bytes`).
#[test]
fn check_shows_what_each_worker_sends_and_train_says_when_a_reducer_switches() {
    let dir = tempfile::tempdir().unwrap();
    make_data(dir.path());
    let cfg = write_tiny_config(dir.path(), "t.toml", "plan");
    let cfg = cfg.to_str().unwrap();
    let numel = {
        let src = std::fs::read_to_string(cfg).unwrap();
        let launch = nanodist::plan::LaunchEnv::default();
        nanodist::plan::load_str(Path::new("t.toml"), &src, &[], &launch)
            .unwrap()
            .plan
            .n_params as usize
    };
    let bytes = |n: usize| {
        let sum: u64 = (0..n)
            .map(|r| nanodist::comm::all_reduce_bytes(numel, n, r))
            .sum();
        nanodist::units::bytes(sum as f64 / n as f64)
    };
    let check = |args: &[&str]| {
        let out = nanodist(&[&["check", cfg], args].concat());
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        text(&out)
    };
    let ring = check(&[
        "--workers",
        "4",
        "--set",
        "train.threads=1",
        "--set",
        "train.backend=\"decentdp\"",
        "--set",
        "train.topology=\"ring\"",
        "--set",
        "train.overlap=false",
    ]);
    for want in [
        "workers x threads 4 x 1".to_string(),
        "gossip rounds     2 in a cycle (step t mixes in round t mod 2), groups of 2 rank(s)"
            .into(),
        "overlap           none (the step waits for its collectives)".into(),
        format!(
            "sent per worker   {}/step over the run's 20 steps",
            bytes(2)
        ),
    ] {
        assert!(ring.contains(&want), "missing {want:?} in:\n{ring}");
    }
    assert!(!ring.contains("one worker"), "{ring}");
    let powersgd = [
        "--workers",
        "2",
        "--set",
        r#"train.compression={ name = "powersgd", rank = 2, start_iter = 10 }"#,
    ];
    let plan = check(&powersgd);
    let want = format!("sent per worker   {}/step in steps 0-9 (dense), ", bytes(2));
    assert!(plan.contains(&want), "missing {want:?} in:\n{plan}");
    assert!(plan.contains("/step from step 10 (compressed); "), "{plan}");
    assert!(
        plan.contains("overlap           none (the step waits for its collectives)"),
        "{plan}"
    );
    train_prints_the_plan_and_the_switch(dir.path(), cfg, &powersgd, &want);
    let ddp = check(&["--workers", "2"]);
    assert!(
        ddp.contains("overlap           gradient buckets with the backward pass"),
        "{ddp}"
    );
}

/// `train` with `args` (PowerSGD from step 10) prints the plan (`want`, its dense phase's line), where
/// its TensorBoard scalars go, and one line at the step the reducer switches.
fn train_prints_the_plan_and_the_switch(dir: &Path, cfg: &str, powersgd: &[&str], want: &str) {
    let tensorboard = ["--set", "log.tensorboard=true"];
    let out = nanodist(&[&["train", cfg], powersgd, &tensorboard[..]].concat());
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let log = text(&out);
    let logdir = dir.join("log");
    let tb = format!(
        "TensorBoard scalars in {}/plan/tb (view: tensorboard --logdir {})",
        logdir.display(),
        logdir.display()
    );
    assert!(log.contains(&tb), "missing {tb:?} in {log}");
    assert!(log.contains(want), "train prints the plan: {log}");
    let switch =
        "step 10: the reducer switches from dense all-reduce to compressed (powersgd rank 2, \
                  dense until step 10)";
    assert_eq!(log.matches(switch).count(), 1, "{log}");
}

/// `sbatch --dry-run` writes the script it would submit, with every flag passed into its `#SBATCH` lines, the
/// site setup before the launch, the MPI plugin and the run's name; the printed command submits that file.
#[test]
fn sbatch_dry_run_writes_the_script_with_every_passed_flag() {
    let dir = tempfile::tempdir().unwrap();
    make_data(dir.path());
    let cfg = write_tiny_config(dir.path(), "t.toml", "named");
    let cfg = cfg.to_str().unwrap();
    let setup = dir.path().join("site.sh");
    std::fs::write(
        &setup,
        "module load openmpi/4.1\nsource /opt/venv/bin/activate\n",
    )
    .unwrap();
    let out = nanodist(&[
        "sbatch",
        cfg,
        "--dry-run",
        "-A",
        "acct",
        "--qos",
        "high",
        "--constraint",
        "a100&ib",
        "--gpus-per-node",
        "4",
        "--mem",
        "64G",
        "--exclusive",
        "--mail-type",
        "END,FAIL",
        "--mail-user",
        "me@example.org",
        "--job-name",
        "myjob",
        "--sbatch-arg=--reservation=big",
        "--sbatch-arg",
        "--hint=nomultithread",
        "--setup",
        setup.to_str().unwrap(),
        "--mpi",
        "pmi2",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    for want in [
        "#SBATCH --account=acct\n",
        "#SBATCH --qos=high\n",
        "#SBATCH --constraint=a100&ib\n",
        "#SBATCH --gpus-per-node=4\n",
        "#SBATCH --mem=64G\n",
        "#SBATCH --exclusive\n",
        "#SBATCH --mail-type=END,FAIL\n",
        "#SBATCH --mail-user=me@example.org\n",
        "#SBATCH --job-name=myjob\n",
        "#SBATCH --reservation=big\n",
        "#SBATCH --hint=nomultithread\n",
        "\nRUN_NAME=named\n",
        "\nMPI=pmi2\n",
    ] {
        assert!(printed.contains(want), "missing {want:?} in:\n{printed}");
    }
    assert_eq!(printed.matches("--job-name").count(), 1, "{printed}");
    the_script_is_ordered_written_and_submitted(&printed);
    bad_sbatch_flags_exit_2(cfg);
}

/// The dry run's `printed` script: every directive before the first command (sbatch stops reading them
/// there), the site setup right before the launch, and the script written where the message says, which
/// the printed command submits.
fn the_script_is_ordered_written_and_submitted(printed: &str) {
    let first_command = printed.find("\nNANODIST=").unwrap();
    assert!(printed.rfind("#SBATCH").unwrap() < first_command);
    // The site setup runs right before the launch.
    let module = printed.find("module load openmpi/4.1").unwrap();
    let venv = printed.find("source /opt/venv/bin/activate").unwrap();
    let srun = printed.find("\nsrun --mpi=\"$MPI\"").unwrap();
    assert!(
        first_command < module && module < venv && venv < srun,
        "{printed}"
    );
    // The script is written where the message says, and the command submits it.
    let written = printed
        .lines()
        .find_map(|l| l.strip_prefix("# written to "))
        .unwrap();
    let script = std::fs::read_to_string(written).unwrap();
    assert!(printed.starts_with(&script));
    let submit = printed
        .lines()
        .find_map(|l| l.strip_prefix("# submit with: "))
        .unwrap();
    assert!(
        submit.starts_with(&format!("sbatch {written} ")),
        "{submit}"
    );
    let syntax = std::process::Command::new("bash")
        .args(["-n", written])
        .status()
        .unwrap();
    assert!(syntax.success());
}

/// Bad `sbatch` flags exit 2 and say what is allowed.
fn bad_sbatch_flags_exit_2(cfg: &str) {
    for (args, says) in [
        (
            &["--sbatch-arg", "reservation=big"][..],
            "expected --flag=value",
        ),
        (&["--mpi", "pm ix"][..], "an srun MPI plugin name"),
        (
            &["--setup", "/nonexistent/site.sh"][..],
            "--setup /nonexistent/site.sh",
        ),
    ] {
        let out = nanodist(&[&["sbatch", cfg, "--dry-run"], args].concat());
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
        assert!(text(&out).contains(says), "{args:?}: {}", text(&out));
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

/// A char-level model trained on a small corpus (stopped by its time limit, then resumed to the end)
/// samples deterministically, evaluates text, and refuses bad input with exit code 2.
#[test]
fn char_model_trains_samples_and_evaluates_text() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = train_char_model(dir.path());
    let run = dir.path().join("log/r");
    sampling_is_deterministic_for_a_seed(&run);
    let e = nanodist(&[
        "eval",
        run.to_str().unwrap(),
        "--data",
        corpus.join("0.txt").to_str().unwrap(),
    ]);
    assert!(e.status.success(), "{}", String::from_utf8_lossy(&e.stderr));
    assert!(String::from_utf8_lossy(&e.stdout).contains("perplexity"));
    a_weights_file_samples_greedily(&run);
    eval_refuses_what_it_cannot_read(dir.path(), &run, &corpus);
}

/// Prepares a corpus of 20 documents as char tokens in `dir`/data and trains run "r" on them: a first
/// segment stopped by `train.exit_duration_mins`, then resumed to step 30. Returns the corpus folder.
fn train_char_model(dir: &Path) -> PathBuf {
    let corpus = dir.join("corpus");
    std::fs::create_dir_all(&corpus).unwrap();
    for i in 0..20 {
        let doc: String = (0..200)
            .map(|j| ["the cat ", "sat on ", "a mat. ", "and then "][(i + j) % 4])
            .collect();
        std::fs::write(corpus.join(format!("{i}.txt")), doc).unwrap();
    }
    let data = dir.join("data");
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
    let cfg = dir.join("c.toml");
    let data_dir = format!("data_dir={:?}", data.display().to_string());
    let config_text = common::config(
        dir,
        Some("r"),
        &[
            &data_dir,
            "log.eval_interval=30",
            "log.eval_steps=2",
            "log.log_interval=10",
            "train.context_length=32",
            "train.n_steps=30",
            "train.lr_schedule={name=\"cosine\", lr=1e-2, warmup_steps=3, eta_min=1e-3}",
            "model.n_layers=1",
            "model.vocab_size=32",
        ],
    );
    std::fs::write(&cfg, config_text).unwrap();
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
    corpus
}

/// Sampling from a run: the prompt continued, the same text for the same seed, and characters outside
/// the vocabulary refused with exit code 2.
fn sampling_is_deterministic_for_a_seed(run: &Path) {
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
    let sampled = String::from_utf8_lossy(&s.stdout);
    assert!(
        sampled.starts_with("the cat") && sampled.trim_end().chars().count() >= 40,
        "{sampled}"
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
    let bad = nanodist(&["sample", run.to_str().unwrap(), "--prompt", "XYZ"]);
    assert_eq!(
        bad.status.code(),
        Some(2),
        "characters outside the vocabulary are bad input"
    );
}

/// A weights file loads too, and says what it loaded; temperature 0 is greedy (seed-independent).
fn a_weights_file_samples_greedily(run: &Path) {
    let best = run.join("best_model.safetensors");
    let greedy: Vec<Output> = ["1", "2"]
        .iter()
        .map(|seed| {
            nanodist(&[
                "sample",
                best.to_str().unwrap(),
                "--prompt",
                "the ",
                "--temperature",
                "0",
                "--max-new-tokens",
                "20",
                "--seed",
                seed,
            ])
        })
        .collect();
    assert!(greedy[0].status.success(), "{}", text(&greedy[0]));
    assert_eq!(
        greedy[0].stdout, greedy[1].stdout,
        "greedy decoding ignores the seed"
    );
    let want = format!("loaded {} (step 30)", best.display());
    assert!(text(&greedy[0]).contains(&want), "{}", text(&greedy[0]));
}

/// `eval` of text with a character the model never saw, of a folder, and of a missing run: exit code 2
/// with the file, line and column where there is one.
fn eval_refuses_what_it_cannot_read(dir: &Path, run: &Path, corpus: &Path) {
    // Text with a character the model never saw: exit 2 with the file, line and column.
    let odd = dir.join("odd.txt");
    // The training text has no newline: the first unknown character is the one ending line 1.
    std::fs::write(&odd, "the cat\nsat \u{2603} on").unwrap();
    let e = nanodist(&[
        "eval",
        run.to_str().unwrap(),
        "--data",
        odd.to_str().unwrap(),
    ]);
    assert_eq!(e.status.code(), Some(2), "{}", text(&e));
    let want = format!(
        "{}:1:8: character '\\n' is not in the char vocabulary",
        odd.display()
    );
    assert!(text(&e).contains(&want), "{}", text(&e));
    let e = nanodist(&[
        "eval",
        run.to_str().unwrap(),
        "--data",
        corpus.to_str().unwrap(),
    ]);
    assert_eq!(e.status.code(), Some(2), "{}", text(&e));
    assert!(
        text(&e).contains("is a directory; --data takes a token file"),
        "{}",
        text(&e)
    );
    let bad = nanodist(&[
        "eval",
        dir.join("nope").to_str().unwrap(),
        "--data",
        "x.bin",
    ]);
    assert_eq!(bad.status.code(), Some(2));
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
}

/// `check`, `sbatch` and `train` run one set of checks: for each bad input all three exit 2 with the same
/// reason (`sbatch` before it calls Slurm's), `sbatch --dry-run` renders what it can and names the same
/// reason, and `train` creates no run directory.
#[test]
fn check_sbatch_and_train_refuse_the_same_inputs_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    make_data(dir.path());
    let cfg = write_tiny_config(dir.path(), "c.toml", "r");
    let cfg = cfg.to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (
            &["--set", "data_dir=\"/nonexistent\""],
            "/nonexistent/train.bin",
        ),
        (
            &["--set", "train.engine=\"nccl\""],
            "built without CUDA support",
        ),
        (
            &["--set", "train.device=\"cuda\""],
            "built without CUDA support",
        ),
        (
            &[
                "--set",
                "train.compression={name=\"radius\", correction=true}",
                "--set",
                "train.optim={name=\"accumadamw\"}",
            ],
            "train.compression.correction",
        ),
        (
            &[
                "--set",
                "train.backend=\"decentdp\"",
                "--set",
                "train.topology=\"alternating-exp-ring\"",
                "--set",
                "train.workers=4",
                "--set",
                "train.ranks_per_node=4",
            ],
            "--set train.ranks_per_node=2",
        ),
    ];
    for (set, why) in cases {
        // A dry run renders what it can and lists what a submission would refuse.
        for cmd in [
            &["check"][..],
            &["sbatch"],
            &["sbatch", "--dry-run"],
            &["train"],
        ] {
            let mut args: Vec<&str> = cmd.to_vec();
            args.push(cfg);
            args.extend(set);
            if cmd[0] == "sbatch" && set.contains(&"train.engine=\"nccl\"") {
                args.extend(["--gpus-per-node", "1"]); // a GPU job asks for its GPUs
            }
            let out = nanodist(&args);
            let refused = text(&out).contains("# a submission from here would be refused");
            let code = if refused { Some(0) } else { Some(2) };
            assert_eq!(out.status.code(), code, "{args:?}: {}", text(&out));
            assert!(
                text(&out).contains(why),
                "{args:?}: {why:?} missing:\n{}",
                text(&out)
            );
        }
        assert!(
            !dir.path().join("log/r").exists(),
            "{set:?}: train created its run directory"
        );
    }
}

/// The decentralized seed config on one worker: `check`, `sbatch` (one task) and `train` all accept it
/// (gossip degenerates to local training), and the same one-worker layout trains.
#[test]
fn one_worker_gossip_passes_check_sbatch_and_train_alike() {
    let dir = tempfile::tempdir().unwrap();
    make_data(dir.path());
    let data = format!("data_dir={:?}", dir.path().display().to_string());
    let seed = root().join("config/decent-gpt2-small.toml");
    let seed = seed.to_str().unwrap();
    // One worker with the seed's whole batch needs ~700 GB (its attention probabilities): checked as
    // for a machine that has them.
    let check = nanodist_with(
        &["check", seed, "--set", &data],
        &[("NANODIST_MEMORY_GB", "1000")],
    );
    assert_eq!(check.status.code(), Some(0), "{}", text(&check));
    assert!(text(&check).contains("degenerates to local training"));
    let dry = nanodist(&[
        "sbatch",
        seed,
        "--set",
        &data,
        "--nodes",
        "1",
        "--tasks-per-node",
        "1",
        "--dry-run",
    ]);
    assert_eq!(dry.status.code(), Some(0), "{}", text(&dry));
    let tiny = write_tiny_config(dir.path(), "g.toml", "g");
    let t = nanodist(&[
        "train",
        tiny.to_str().unwrap(),
        "--set",
        "train.backend=\"decentdp\"",
        "--set",
        "train.topology=\"alternating-exp-ring\"",
        "--set",
        "train.n_steps=5",
    ]);
    assert_eq!(t.status.code(), Some(0), "{}", text(&t));
}

/// A relative path that does not resolve is shown absolute.
#[test]
fn a_missing_relative_data_dir_is_named_absolute() {
    let out = nanodist(&[
        "check",
        root().join("config/quickstart-char.toml").to_str().unwrap(),
        "--set",
        "data_dir=\"no/such/dir\"",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let want = std::env::current_dir()
        .unwrap()
        .join("no/such/dir/train.bin");
    assert!(
        text(&out).contains(&want.display().to_string()),
        "{}",
        text(&out)
    );
}

/// Resuming with a different model is refused before anything is written: config.toml stays the
/// checkpoint's. A damaged newest checkpoint is skipped with a warning the user sees.
#[test]
fn resume_checks_happen_before_writes_and_skipped_checkpoints_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    make_data(dir.path());
    let cfg = write_tiny_config(dir.path(), "c.toml", "r");
    let cfg = cfg.to_str().unwrap();
    let longer = ["--set", "train.n_steps=30", "--set", "log.ckpt_interval=10"];
    let first = nanodist(
        &[
            &["train", cfg, "--set", "train.exit_interval=20"][..],
            &longer,
        ]
        .concat(),
    );
    assert_eq!(first.status.code(), Some(0), "{}", text(&first));
    let run = dir.path().join("log/r");
    let saved = std::fs::read(run.join("config.toml")).unwrap();
    let changed = nanodist(&[
        "train",
        cfg,
        "--set",
        "model.n_embd=64",
        "--set",
        "train.n_steps=30",
    ]);
    assert_eq!(changed.status.code(), Some(2), "{}", text(&changed));
    assert!(
        text(&changed).contains("model.n_embd = 32 there, 64 here"),
        "{}",
        text(&changed)
    );
    assert_eq!(std::fs::read(run.join("config.toml")).unwrap(), saved);
    // Corrupt the newest checkpoint's model: the resume falls back to step 10 and says why.
    let newest = run.join("checkpoints/step_00000020/model.safetensors");
    let mut bytes = std::fs::read(&newest).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&newest, bytes).unwrap();
    let again = nanodist(&[&["train", cfg][..], &longer].concat());
    assert_eq!(again.status.code(), Some(0), "{}", text(&again));
    let log = text(&again);
    assert!(log.contains("skipping damaged checkpoint"), "{log}");
    assert!(log.contains("WARN"), "{log}");
    assert!(
        log.contains("step_00000010 (full state) at step 10"),
        "{log}"
    );
}

/// A run resumes only under the config it ran with: a changed key is refused with the differences (and
/// the learning-rate jump); log settings may change; --allow-config-change accepts named keys and the
/// manifest records the new segment; --fresh starts over beside it.
#[test]
fn resuming_with_a_changed_config_is_refused_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    make_data(dir.path());
    let cfg = write_tiny_config(dir.path(), "c.toml", "r");
    let cfg = cfg.to_str().unwrap();
    assert!(nanodist(&["train", cfg]).status.success());
    let run = dir.path().join("log/r");
    let saved = std::fs::read(run.join("config.toml")).unwrap();
    changed_configs_are_refused_with_the_differences(cfg, &run, &saved);
    // Log settings are free to change: the finished run is simply finished.
    let logs = nanodist(&[
        "train",
        cfg,
        "--set",
        "log.eval_steps=2",
        "--set",
        "log.log_interval=5",
    ]);
    assert!(logs.status.success(), "{}", text(&logs));
    // An explicit allowance resumes, and the manifest keeps both configs.
    let allowed = nanodist(&[
        "train",
        cfg,
        "--set",
        "train.n_steps=30",
        "--allow-config-change",
        "train.n_steps",
    ]);
    assert!(allowed.status.success(), "{}", text(&allowed));
    let ckpt = nanodist::train::checkpoint::find_latest(&run)
        .unwrap()
        .unwrap();
    let m = nanodist::train::checkpoint::read_manifest(&ckpt).unwrap();
    assert_eq!((m.step, m.segments.len()), (30, 2));
    assert_eq!(m.segments[1].from_step, 20);
    assert!(
        m.segments[0].config.contains("n_steps = 20")
            && m.segments[1].config.contains("n_steps = 30")
    );
    // --fresh trains from step 0 in a new directory beside it.
    let fresh = nanodist(&[
        "train",
        cfg,
        "--set",
        "train.lr_schedule.lr=3e-2",
        "--fresh",
    ]);
    assert!(fresh.status.success(), "{}", text(&fresh));
    assert!(text(&fresh).contains("log/r-2"), "{}", text(&fresh));
    let rows = nanodist::metrics::read_rows(&dir.path().join("log/r-2/metrics.jsonl")).unwrap();
    assert_eq!((rows[0].step, rows.last().unwrap().step), (1, 20));
}

/// Resuming run `run` of `cfg` with changed keys: exit code 2, each difference and the learning-rate
/// jump named, the flags that would allow it, and nothing written (its config still `saved`).
fn changed_configs_are_refused_with_the_differences(cfg: &str, run: &Path, saved: &[u8]) {
    let changed = nanodist(&[
        "train",
        cfg,
        "--set",
        "train.n_steps=30",
        "--set",
        "train.lr_schedule.lr=3e-2",
        "--set",
        "train.optim={ name = \"adamw\", weight_decay = 0.0 }",
    ]);
    let err = text(&changed);
    assert_eq!(changed.status.code(), Some(2), "{err}");
    for want in [
        "train.n_steps: 20 in the checkpoint, 30 now",
        "train.lr_schedule.lr: 0.003 in the checkpoint, 0.03 now",
        "train.optim.weight_decay: 0.1 in the checkpoint, 0.0 now",
        "the learning rate at step 20 would jump from 3.000e-4",
        "--allow-config-change train.lr_schedule.lr train.n_steps train.optim.weight_decay",
        "nanodist train --fresh",
    ] {
        assert!(err.contains(want), "{want:?} missing:\n{err}");
    }
    let gossip = nanodist(&[
        "train",
        cfg,
        "--set",
        "train.backend=\"decentdp\"",
        "--set",
        "train.topology=\"ring\"",
    ]);
    assert_eq!(gossip.status.code(), Some(2));
    assert!(
        text(&gossip).contains("train.backend: \"pytorchddp\" in the checkpoint, \"decentdp\" now")
    );
    assert_eq!(
        std::fs::read(run.join("config.toml")).unwrap(),
        saved,
        "refusals write nothing"
    );
}

/// Messages by exact text: a file that cannot be read, a run directory given as the config, a malformed
/// --set, and a cross-field error caused by a --set.
#[test]
fn errors_name_the_file_or_the_set_that_caused_them() {
    let dir = tempfile::tempdir().unwrap();
    make_data(dir.path());
    let cfg = write_tiny_config(dir.path(), "c.toml", "r");
    let cfg = cfg.to_str().unwrap();
    let cases: [(&[&str], String); 4] = [
        (
            &["check", "/nonexistent/nope.toml"],
            "/nonexistent/nope.toml: cannot read the file: No such file or directory (os error 2)".into(),
        ),
        (
            &["check", cfg, "--set", "train.n_steps:100"],
            format!("  {cfg}: --set train.n_steps:100: expected KEY=VALUE, e.g. --set train.lr_schedule.lr=3e-4"),
        ),
        (
            &["check", cfg, "--set", "train.n_steps=4"],
            "  --set train.n_steps=4: train.lr_schedule.warmup_steps: warmup_steps = 4 must be smaller than \
             train.n_steps = 4; try --set train.n_steps=5 or --set train.lr_schedule.warmup_steps=0"
                .into(),
        ),
        (
            &["train", dir.path().to_str().unwrap()],
            "cannot read the file: Is a directory (os error 21); expected a TOML file".into(),
        ),
    ];
    for (args, want) in cases {
        let out = nanodist(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = text(&out);
        assert!(err.contains(&want), "{args:?}: {want:?} missing:\n{err}");
        assert!(!err.contains("(default value)"), "{args:?}: {err}");
    }
    // A run directory: the hint names its config.
    assert!(nanodist(&["train", cfg, "--set", "train.n_steps=5"])
        .status
        .success());
    let run = dir.path().join("log/r");
    let out = nanodist(&["train", run.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let want = format!(
        "it is a run directory: pass its config, {}",
        run.join("config.toml").display()
    );
    assert!(text(&out).contains(&want), "{}", text(&out));
}

/// Every `--set KEY=VALUE` example in the commands' help texts is a valid override.
#[test]
fn help_examples_are_valid_overrides() {
    let dir = tempfile::tempdir().unwrap();
    make_data(dir.path());
    let cfg = write_tiny_config(dir.path(), "c.toml", "r");
    let mut seen = 0;
    for cmd in [
        "check", "train", "sbatch", "eval", "sample", "prepare", "plot", "compare",
    ] {
        let help = String::from_utf8_lossy(&nanodist(&[cmd, "--help"]).stdout).to_string();
        for example in help.split("--set ").skip(1) {
            let Some(kv) = example
                .split_whitespace()
                .next()
                .filter(|w| w.contains('=') && !w.starts_with('<'))
            else {
                continue;
            };
            let out = nanodist(&["check", cfg.to_str().unwrap(), "--set", kv]);
            assert!(
                out.status.success(),
                "`{cmd} --help` example --set {kv}: {}",
                text(&out)
            );
            seen += 1;
        }
    }
    assert!(seen >= 2, "no --set examples found in the help texts");
}

/// The CPU's bf16 rate is probed once and recorded: `check` twice gives the same plan, the second from
/// the record (here doctored to 7.5x, which no probe measures), and a run resumes with the precision its
/// checkpoint recorded whatever the machine says then: the rows of a run stopped under a bf16 decision
/// and resumed under an f32 one are the uninterrupted bf16 run's, bit for bit.
#[test]
fn machine_decisions_are_recorded_once_and_kept_by_every_resume() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let cache = d.path().join("cache");
    let cfg = write_tiny_config(d.path(), "t.toml", "amp");
    let cfg = cfg.to_str().unwrap();
    let env = [("NANODIST_CACHE_DIR", cache.to_str().unwrap())];
    let amp = ["--set", "train.amp=true", "--set", "train.device=\"cpu\""];
    let check = || {
        let out = nanodist_with(&[&["check", cfg][..], &amp].concat(), &env);
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let first = check();
    let probe = cache.join("cpu-probe.json");
    let recorded: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&probe).unwrap()).unwrap();
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(check(), first, "the second check reads the record");
    let cpu = recorded.keys().next().unwrap().clone();
    std::fs::write(&probe, serde_json::json!({ cpu: 7.5 }).to_string()).unwrap();
    assert!(check().contains("bf16 products at 7.50x"), "{}", check());
    // A run under bf16 stopped at step 5, resumed on a machine whose probe says f32.
    let train = |run: &str, rate: &str, extra: &[&str]| {
        let args: Vec<&str> = [&["train", cfg][..], &amp, &["--set", run], extra].concat();
        let out = nanodist_with(&args, &[("NANODIST_CPU_BF16_RATE", rate)]);
        assert!(out.status.success(), "{}", text(&out));
        text(&out)
    };
    train("log.run_name=\"whole\"", "2.0", &[]);
    train(
        "log.run_name=\"cut\"",
        "2.0",
        &["--set", "train.exit_interval=5"],
    );
    let resumed = train("log.run_name=\"cut\"", "0.5", &[]);
    assert!(resumed.contains("bf16 linear layers as"), "{resumed}");
    let rows = |run: &str| {
        let rows =
            nanodist::metrics::read_rows(&d.path().join("log").join(run).join("metrics.jsonl"));
        rows.unwrap()
            .iter()
            .map(common::exact)
            .map(|r| format!("{r:?}"))
            .collect::<Vec<_>>()
    };
    assert_eq!(rows("cut"), rows("whole"));
    train("log.run_name=\"f32\"", "0.5", &[]);
    assert_ne!(rows("f32"), rows("whole"), "bf16 and f32 products differ");
}

/// Paths that name the wrong thing get exit 2 and what to give instead: a metrics file to `sample`, a
/// missing checkpoint to `eval` (with the ones that exist), a directory of runs to `eval` and `compare`
/// (with the runs in it), a plot into a directory that does not exist.
#[test]
fn wrong_paths_exit_2_with_what_to_give_instead() {
    let dir = tempfile::tempdir().unwrap();
    make_data(dir.path());
    let cfg = write_tiny_config(dir.path(), "c.toml", "r");
    let trained = nanodist(&[
        "train",
        cfg.to_str().unwrap(),
        "--set",
        "train.n_steps=6",
        "--set",
        "log.ckpt_interval=2",
    ]);
    assert_eq!(trained.status.code(), Some(0), "{}", text(&trained));
    let (log, run) = (dir.path().join("log"), dir.path().join("log/r"));
    let path = |p: &Path| p.display().to_string();
    let val = path(&dir.path().join("val.bin"));
    let cases: [(Vec<String>, &[&str]); 5] = [
        (
            vec!["sample".into(), path(&run.join("metrics.jsonl"))],
            &["not a weights file", "best_model.safetensors"],
        ),
        (
            vec![
                "eval".into(),
                path(&run.join("checkpoints/step_00000050")),
                "--data".into(),
                val.clone(),
            ],
            &["no such file", "holds step_00000004, step_00000006"],
        ),
        (
            vec!["eval".into(), path(&log), "--data".into(), val.clone()],
            &["a directory of runs: name one", &path(&run)],
        ),
        (
            vec!["compare".into(), path(&log)],
            &["not a run directory", "runs there: r"],
        ),
        (
            vec![
                "plot".into(),
                path(&run),
                "--output".into(),
                path(&dir.path().join("missing/dir/x.png")),
            ],
            &["there is no directory", "mkdir -p"],
        ),
    ];
    for (args, parts) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = nanodist(&args);
        let err = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        for part in parts {
            assert!(err.contains(part), "{args:?}: {part:?} in {err}");
        }
    }
}

/// `sbatch --gpus-per-node` renders a GPU job from any build: the seed GPT-2 config on 4 nodes x 4 GPUs
/// is one NCCL rank per GPU on CUDA, with CPUs per task for the GPU ranks; the dry run lists what a
/// submission from here would refuse (this build's engines, the data that is not on this machine) and a
/// submission refuses it (exit 2, before sbatch). GPUs with a CPU engine, the NCCL engine without GPUs,
/// and tasks that are not one per GPU are errors naming the flag to change.
#[test]
fn sbatch_renders_a_gpu_job_from_any_build() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = root().join("config/gpt2-small.toml");
    let log_dir = format!("log_dir={:?}", dir.path().display().to_string());
    let job = |extra: &[&str]| {
        let base = [
            "sbatch",
            cfg.to_str().unwrap(),
            "--set",
            &log_dir,
            "--nodes",
            "4",
        ];
        nanodist(&[&base[..], extra].concat())
    };
    // A partition this machine's Slurm (if any) does not know: its nodes' CPUs are unknown here.
    let gpus = [
        "--gpus-per-node",
        "4",
        "-A",
        "proj",
        "--partition",
        "gpu",
        "--time",
        "20:00:00",
    ];
    let out = job(&[&gpus[..], &["--dry-run"]].concat());
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    for want in [
        "#SBATCH --nodes=4\n",
        "#SBATCH --ntasks-per-node=4\n",
        "#SBATCH --gpus-per-node=4\n",
        "#SBATCH --cpus-per-task=8\n",
        "#SBATCH --account=proj\n",
        "\nENGINE=nccl\n",
    ] {
        assert!(printed.contains(want), "missing {want:?} in:\n{printed}");
    }
    let refused: Vec<&str> = printed
        .lines()
        .filter(|l| l.starts_with("# a submission from here would be refused: "))
        .collect();
    let no_cuda = usize::from(!cfg!(feature = "cuda"));
    assert_eq!(refused.len(), no_cuda + 2, "{printed}");
    assert!(
        refused.iter().any(|l| l.contains("no token data there")),
        "{printed}"
    );
    if no_cuda == 1 {
        assert!(printed.contains("built without CUDA support"), "{printed}");
        let submitted = job(&gpus);
        assert_eq!(submitted.status.code(), Some(2), "{}", text(&submitted));
        assert!(
            text(&submitted).contains("not submitted"),
            "{}",
            text(&submitted)
        );
    }
    for (extra, says) in [
        (
            &["--gpus-per-node", "4", "--set", "train.engine=\"mpi\""][..],
            "--gpus-per-node 4 asks for GPUs, but train.engine = \"mpi\"",
        ),
        (
            &["--set", "train.engine=\"nccl\"", "--dry-run"][..],
            "add --gpus-per-node N",
        ),
        (
            &["--gpus-per-node", "4", "--tasks-per-node", "2", "--dry-run"][..],
            "drop --tasks-per-node or make it 4",
        ),
    ] {
        let out = job(extra);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {}", text(&out));
        assert!(text(&out).contains(says), "{extra:?}: {}", text(&out));
    }
}

/// `check --ranks N --ranks-per-node M [--device cuda]` plans a launcher's job instead of this machine:
/// the world and ranks per node are the flags', CUDA means the NCCL engine, and the problems are the
/// job's (this build's engines, the data), listed after the plan; `--workers` with `--ranks` is refused.
#[test]
fn check_previews_a_job_layout_it_is_not_running_on() {
    let dir = tempfile::tempdir().unwrap();
    make_data(dir.path());
    let cfg = write_tiny_config(dir.path(), "c.toml", "r");
    let check = |extra: &[&str]| nanodist(&[&["check", cfg.to_str().unwrap()][..], extra].concat());
    let out = check(&["--ranks", "4", "--ranks-per-node", "2"]);
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    let mpi = cfg!(feature = "mpi");
    assert_eq!(
        out.status.code(),
        Some(if mpi { 0 } else { 2 }),
        "{}",
        text(&out)
    );
    for want in [
        "engine            mpi\n",
        "world size        4\n",
        "ranks per node    2\n",
    ] {
        assert!(printed.contains(want), "{want:?} in {printed}");
    }
    let out = check(&["--ranks", "8", "--device", "cuda"]);
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(printed.contains("engine            nccl\n"), "{printed}");
    assert!(printed.contains("world size        8\n"), "{printed}");
    if !cfg!(feature = "cuda") {
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(printed.contains("1 problem(s) for the job"), "{printed}");
        assert!(
            text(&out).contains("built without CUDA support"),
            "{}",
            text(&out)
        );
    }
    let both = check(&["--ranks", "4", "--workers", "2"]);
    assert_eq!(both.status.code(), Some(2), "{}", text(&both));
    assert!(
        text(&both).contains("with --ranks, leave it out"),
        "{}",
        text(&both)
    );
}

/// The first row after the first step carries the seconds from the command to it (and no other row
/// does), and `consensus_step = "auto"` is tuned once per cache directory: a second run reads the cached
/// answer (a planted one, to tell reading from tuning again).
#[test]
fn the_first_row_says_when_training_started_and_a_tuned_gamma_is_read_from_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    make_data(dir.path());
    let cache = dir.path().join("cache");
    let cfg = write_tiny_config(dir.path(), "c.toml", "c");
    let train = |fresh: bool| {
        let began = std::time::Instant::now();
        let mut args = vec![
            "train",
            cfg.to_str().unwrap(),
            "--workers",
            "4",
            "--set",
            "train.backend=\"decentdp\"",
            "--set",
            "train.topology=\"ring\"",
            "--set",
            "train.compression={ name = \"topk\", density = 0.1, consensus_step = \"auto\" }",
            "--set",
            "train.n_steps=6",
        ];
        if fresh {
            args.push("--fresh");
        }
        let out = nanodist_with(&args, &[("NANODIST_CACHE_DIR", cache.to_str().unwrap())]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        (out, began.elapsed().as_secs_f64())
    };
    let (_, wall) = train(false);
    let rows = nanodist::metrics::read_rows(&dir.path().join("log/c/metrics.jsonl")).unwrap();
    let started = rows[0].startup_s.expect("the first row's startup_s");
    assert!(started > 0.0 && started < wall, "{started} s of {wall}");
    assert!(rows[1..].iter().all(|r| r.startup_s.is_none()));
    let tuned = rows[0].consensus_step.unwrap();
    let files: Vec<_> = std::fs::read_dir(cache.join("choco-gamma"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let mut entry: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&files[0]).unwrap()).unwrap();
    assert_eq!(f64::from_bits(entry["bits"].as_u64().unwrap()), tuned);
    entry["bits"] = 0.25f64.to_bits().into();
    std::fs::write(&files[0], entry.to_string()).unwrap();
    let (again, _) = train(true);
    assert!(text(&again).contains("log/c-2"), "{}", text(&again));
    let rows = nanodist::metrics::read_rows(&dir.path().join("log/c-2/metrics.jsonl")).unwrap();
    assert_eq!(rows[0].consensus_step, Some(0.25));
}

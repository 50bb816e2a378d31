//! `nanodist predict` and `calibrate`: every backend's step description equals the bytes its runs log,
//! the command's answers (JSON fields, run directories, compare and plot with --cluster, bad input), and
//! predictions of real `mpirun` runs on this machine against their measured ms/step.

use std::path::Path;

use nanodist::predict;

use crate::common;
use crate::common::{make_data, nanodist};

/// Trains the tiny config on `workers` local workers with `set`; returns the run directory.
fn train_run(dir: &Path, name: &str, workers: usize, set: &[&str]) -> std::path::PathBuf {
    common::train_tiny(dir, name, workers, set).run_dir
}

/// The runs of `common::EVERY_BACKEND` whose collectives run beside the next step's compute: gossip and
/// CHOCO (overlap is their default), streaming DiLoCo's delayed fragments.
const OVERLAPPED: [&str; 6] = [
    "ring",
    "exp-overlap",
    "alt",
    "choco-exp-overlap",
    "choco-alt-qsgd",
    "streaming",
];

/// Each backend's description of its steps, priced from the run directory, sums to the `comm_bytes` of
/// every metrics row the run logged (Radius: on its dense steps; from a config its masks are priced at
/// their expected size, which the data makes larger or smaller). The training loop of debug builds also
/// checks every step against the description as it runs. Priced with their own compute, the overlapped
/// runs carry the caveat of `predict::OVERLAPPED_ON_SHARED_CORES`.
#[test]
fn every_backends_step_description_sums_to_the_bytes_its_run_logs() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let cluster = predict::profile::load("a100-ib100").unwrap();
    for (name, set) in common::EVERY_BACKEND {
        let run = train_run(d.path(), name, 4, set);
        let rows = nanodist::metrics::read_rows(&run.join("metrics.jsonl")).unwrap();
        let (loaded, layout) = predict::load(
            &run.join("config.toml"),
            &[],
            Some(4),
            &cluster.profile,
            Some(2),
        )
        .unwrap();
        let local = predict::profile::load("local").unwrap().profile;
        let p = predict::predict_run(&loaded, &rows, (&cluster, &local), layout, None).unwrap();
        // Priced with its own compute, a run that ran collectives beside its compute on cores that also
        // moved the bytes (`local`) says that its compute leaves out what ran beside them; on GPUs
        // (a100-ib100 has free overlap) it does not.
        let own =
            |ran_on| predict::predict_run(&loaded, &rows, (&cluster, ran_on), layout, Some(1e-3));
        let overlapped = OVERLAPPED.contains(name);
        assert_eq!(own(&local).unwrap().caveat.is_some(), overlapped, "{name}");
        assert!(own(&cluster.profile).unwrap().caveat.is_none(), "{name}");
        assert!(p.caveat.is_none(), "{name}");
        beside_compute_prices_only_the_overlapped(name, &rows, &loaded, layout, &local);
        let check = p.bytes_check.unwrap();
        assert_eq!(check.rows, 20, "{name}");
        if *name == "radius" {
            // Dense steps match; masked steps send about the expected mask.
            assert!(
                check.matching >= 4 && check.ratio > 0.3 && check.ratio < 3.0,
                "{name}: {check:?}"
            );
        } else {
            assert_eq!(check.matching, check.rows, "{name}: {check:?}");
        }
        assert!(rows.iter().map(|r| r.comm_bytes).sum::<u64>() > 0, "{name}");
        assert_eq!(p.evals.len(), 4, "{name}");
        assert!(p
            .evals
            .windows(2)
            .all(|w| w[0].predicted_s < w[1].predicted_s));
    }
}

/// On a cluster whose cores also move the bytes, with `comm_beside_compute` measured, a run priced with
/// its own compute has no caveat, and only its overlapped collectives slow beside its compute: at a rate
/// of 1 not at all, with a rate ever larger by at most the compute that ran beside them, and at a huge
/// rate by exactly that compute, which the rows log (`overlap_compute_ms`, absent without overlap).
/// Unmeasured, they are priced at their idle time, with the caveat.
fn beside_compute_prices_only_the_overlapped(
    name: &str,
    rows: &[nanodist::metrics::Row],
    loaded: &nanodist::plan::Loaded,
    layout: predict::model::Layout,
    local: &predict::profile::ClusterProfile,
) {
    let at = |f: Option<f64>| {
        let mut c = predict::profile::Cluster {
            name: "lab".into(),
            source: "test".into(),
            profile: local.clone(),
        };
        c.profile.comm_beside_compute = f;
        predict::predict_run(loaded, rows, (&c, &c.profile), layout, Some(1e-3)).unwrap()
    };
    let [none, one, two, huge] = [None, Some(1.0), Some(2.0), Some(1e12)].map(at);
    let overlapped = OVERLAPPED.contains(&name);
    // Rows whose steps had nothing pending (a start) have none; every overlapped step was priced with
    // its row's compute beside it, or `one` would carry the caveat.
    let logged: Vec<Option<f64>> = rows.iter().map(|r| r.overlap_compute_ms).collect();
    assert_eq!(
        logged.iter().any(Option::is_some),
        overlapped,
        "{name}: {logged:?}"
    );
    assert!(
        logged.iter().flatten().all(|&ms| ms > 0.0),
        "{name}: {logged:?}"
    );
    assert_eq!(none.caveat.is_some(), overlapped, "{name}");
    assert!(one.caveat.is_none() && huge.caveat.is_none(), "{name}");
    let comm = |p: &predict::Prediction| p.average.comm_ms;
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * (1.0 + b.abs());
    assert!(close(comm(&none), comm(&one)), "{name}");
    let beside_ms = logged.iter().flatten().sum::<f64>() / rows.last().unwrap().step as f64;
    match overlapped {
        true => {
            assert!(
                comm(&one) < comm(&two) && comm(&two) < comm(&huge),
                "{name}"
            );
            assert!(
                close(comm(&huge) - comm(&one), beside_ms),
                "{name}: {} {beside_ms}",
                comm(&huge) - comm(&one)
            );
        }
        // (Equal but for the order of sums over the run's patterns.)
        false => assert!(
            close(comm(&one), comm(&two)) && close(comm(&one), comm(&huge)),
            "{name}"
        ),
    }
}

fn json(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn predict_answers_per_cluster_and_layout() {
    let d = tempfile::tempdir().unwrap();
    let cfg = common::write_tiny_config(d.path(), "c.toml", "x");
    let cfg = cfg.to_str().unwrap();
    let ask = |cluster: &str, extra: &[&str]| {
        let mut args = vec![
            "predict",
            cfg,
            "--cluster",
            cluster,
            "--json",
            "--set",
            "model.n_embd=256",
            "--set",
            "train.global_batch_size=64",
        ];
        args.extend(extra);
        json(&nanodist(&args))
    };
    let fast = ask("h100-ib400", &["--workers", "16"]);
    for key in [
        "ms_per_step",
        "compute_ms",
        "comm_ms",
        "exposed_comm_ms",
        "tokens_per_s",
        "world_size",
        "cluster",
        "collectives",
    ] {
        assert!(fast.get(key).is_some(), "missing {key}: {fast}");
    }
    assert_eq!(fast["world_size"], 16);
    assert_eq!(fast["nodes"], 2);
    // Slower links, same model: more time communicating.
    let slow = ask("wan-1g", &["--workers", "16"]);
    assert!(slow["comm_ms"].as_f64().unwrap() > 100.0 * fast["comm_ms"].as_f64().unwrap());
    // The step is compute + serial work + exposed communication, and tokens/s follows it.
    let total = slow["compute_ms"].as_f64().unwrap()
        + slow["update_ms"].as_f64().unwrap()
        + slow["codec_ms"].as_f64().unwrap()
        + slow["exposed_comm_ms"].as_f64().unwrap()
        + slow["control_ms"].as_f64().unwrap();
    assert!((total - slow["ms_per_step"].as_f64().unwrap()).abs() < 1e-6 * total);
    // DiLoCo communicates once per 100 steps: far less per step than all-reduce over the WAN (logging
    // every 100 steps too: the tiny config's row every step is an all-gather of every rank, 750 ms here).
    let diloco = ask(
        "wan-1g",
        &[
            "--workers",
            "16",
            "--set",
            "log.log_interval=100",
            "--set",
            "train.backend=\"diloco\"",
            "--set",
            "train.n_steps=400",
            "--set",
            "train.diloco={ sync_every = 100 }",
        ],
    );
    assert!(diloco["ms_per_step"].as_f64().unwrap() < slow["ms_per_step"].as_f64().unwrap() / 10.0);
    let c = &diloco["collectives"][0];
    assert_eq!(c["op"], "all-reduce");
    assert!((c["per_step"].as_f64().unwrap() - 0.01).abs() < 1e-9, "{c}");
    // Text output names the cluster and the layout.
    let text = nanodist(&["predict", cfg, "--cluster", "a40-25gbe", "--workers", "8"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("a40-25gbe") && text.contains("8 ranks, 4 per node, 2 nodes"),
        "{text}"
    );
}

/// A run directory is priced on the layout it had: its config.toml records the ranks per node (4 local
/// workers: one node), which a CPU profile keeps (its cores are shared, `local`'s 2 included) and a GPU
/// profile caps at one rank per GPU (wan-1g has one a site); `--ranks-per-node` still decides. With
/// `--ran-on` naming the run's own machine, its codec time is used as measured.
#[test]
fn a_run_is_priced_on_the_layout_it_had() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let set = ["train.compression={ name = \"topk\", density = 0.1 }"];
    let run = train_run(d.path(), "placed", 4, &set);
    let saved = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(saved.contains("ranks_per_node = 4"), "{saved}");
    let ask = |extra: &[&str]| {
        let mut args = vec!["predict", run.to_str().unwrap(), "--json"];
        args.extend(extra);
        json(&nanodist(&args))
    };
    let layout = |v: &serde_json::Value| (v["ranks_per_node"].clone(), v["nodes"].clone());
    let local = ask(&["--cluster", "local"]);
    assert_eq!(layout(&local), (4.into(), 1.into()));
    assert_eq!(layout(&ask(&["--cluster", "wan-1g"])), (1.into(), 4.into()));
    assert_eq!(
        layout(&ask(&["--cluster", "local", "--ranks-per-node", "2"])),
        (2.into(), 2.into())
    );
    let rows = nanodist::metrics::read_rows(&run.join("metrics.jsonl")).unwrap();
    let codec: f64 = rows.iter().map(|r| r.sync_ms).sum::<f64>() / rows.last().unwrap().step as f64;
    let own = ask(&["--cluster", "local", "--ran-on", "local"]);
    assert!(
        (own["codec_ms"].as_f64().unwrap() - codec).abs() < 1e-9 * codec.max(1.0),
        "{own}"
    );
}

#[test]
fn bad_clusters_and_targets_are_refused_with_exit_code_2() {
    let d = tempfile::tempdir().unwrap();
    let cfg = common::write_tiny_config(d.path(), "c.toml", "x");
    let cfg = cfg.to_str().unwrap();
    let out = nanodist(&["predict", cfg, "--cluster", "a100"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("a100-ib100") && err.contains("no such profile"),
        "{err}"
    );
    let bad = d.path().join("bad.toml");
    let text = predict::profile::BUILTIN[0]
        .1
        .replace("efficiency = 0.8\n", "efficency = 0.8\n");
    std::fs::write(&bad, text).unwrap();
    let out = nanodist(&["predict", cfg, "--cluster", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.toml:") && err.contains("efficiency") && err.contains("intra"),
        "{err}"
    );
    let out = nanodist(&["predict", cfg, "--cluster", "local", "--measured"]);
    assert_eq!(out.status.code(), Some(2));
    let out = nanodist(&["predict", "/nonexistent.toml", "--cluster", "local"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn compare_and_plot_price_runs_on_a_cluster() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let a = train_run(d.path(), "ar", 2, &[]);
    let b = train_run(d.path(), "gossip", 2, &["train.backend=\"decentdp\""]);
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let out = nanodist(&["compare", a, b, "--cluster", "wan-1g"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        table.contains("wan-1g: ms/step") && table.contains("wan-1g: time to target"),
        "{table}"
    );
    let png = d.path().join("p.png");
    let out = nanodist(&[
        "plot",
        a,
        b,
        "--cluster",
        "wan-1g",
        "--cluster",
        "h100-ib400",
        "--output",
        png.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let svg = std::fs::read_to_string(png.with_extension("svg")).unwrap();
    assert!(svg.contains("predicted time") && svg.contains("wan-1g") && svg.contains("h100-ib400"));
    // From the run directory, the predicted time of every evaluation.
    let p = json(&nanodist(&["predict", a, "--cluster", "wan-1g", "--json"]));
    assert_eq!(p["evals"].as_array().unwrap().len(), 4);
    assert_eq!(p["bytes_check"]["matching"], p["bytes_check"]["rows"]);
    let m = json(&nanodist(&[
        "predict",
        a,
        "--cluster",
        "wan-1g",
        "--json",
        "--measured",
    ]));
    assert!(m["compute_ms"].as_f64().unwrap() > 0.0);
}

/// `predict` answers a comparison in one call: configs and run directories with `--variant`s on several
/// clusters, each line the same prediction as its own call, the speed-up against the first entry on its
/// cluster, the predicted time to a target loss for run directories, and a note where per-message latency
/// dominates (all-reduce's default buckets on the WAN profile, not DiLoCo's rare syncs).
#[test]
fn predict_compares_entries_on_clusters_in_one_call() {
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/gpt2-small.toml");
    let cfg = cfg.to_str().unwrap();
    let base = [
        "predict",
        cfg,
        "--workers",
        "16",
        "--cluster",
        "a100-ib100",
        "--cluster",
        "wan-1g",
    ];
    let with = |extra: &[&str]| nanodist(&[&base[..], extra].concat());
    let lines = json(&with(&["--variant", "train.backend=diloco", "--json"]));
    let lines = lines.as_array().unwrap();
    assert_eq!(lines.len(), 4);
    for (i, l) in lines.iter().enumerate() {
        let cluster = l["cluster"].as_str().unwrap();
        let mut single = vec![
            "predict",
            cfg,
            "--workers",
            "16",
            "--cluster",
            cluster,
            "--json",
        ];
        if i % 2 == 1 {
            single.extend(["--set", "train.backend=diloco"]);
        }
        let alone = json(&nanodist(&single));
        assert_eq!(l["ms_per_step"], alone["ms_per_step"], "{l}");
        let first = lines[i - i % 2]["ms_per_step"].as_f64().unwrap();
        let speedup = first / l["ms_per_step"].as_f64().unwrap();
        assert!(
            (l["speedup"].as_f64().unwrap() - speedup).abs() < 1e-12,
            "{l}"
        );
        let latency = l["latency_ms"].as_f64().unwrap();
        assert!(
            latency >= 0.0 && latency < l["ms_per_step"].as_f64().unwrap(),
            "{l}"
        );
    }
    assert_eq!(lines[2]["cluster"], "wan-1g");
    assert!(
        lines[3]["speedup"].as_f64().unwrap() > 10.0,
        "DiLoCo on the WAN: {lines:?}"
    );
    let table =
        String::from_utf8_lossy(&with(&["--variant", "train.backend=diloco"]).stdout).to_string();
    the_table_notes_where_latency_dominates(&table);
    run_directories_are_priced_to_the_target();
}

/// `predict`'s Markdown table of gpt2-small with its DiLoCo variant on the two clusters: one note, for
/// all-reduce's default buckets on the WAN.
fn the_table_notes_where_latency_dominates(table: &str) {
    assert!(
        table.starts_with("| entry | cluster | ms/step |"),
        "{table}"
    );
    let notes: Vec<&str> = table
        .lines()
        .filter(|l| l.contains("latency-bound"))
        .collect();
    assert_eq!(notes.len(), 1, "{table}");
    assert!(
        notes[0].starts_with("gpt2-small on wan-1g:") && notes[0].contains("train.bucket_size_mb")
    );
    // Its loss means and stop votes: one vote a step, as its 40 s step is longer than
    // `log.stop_check_secs` (15 latencies of 50 ms each on 16 sites).
    assert!(
        notes[0].contains("and 750 ms/step of loss means and stop votes"),
        "{table}"
    );
}

/// Run directories: the time each is predicted to reach the worse final val loss.
fn run_directories_are_priced_to_the_target() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let dense = train_run(d.path(), "dense", 2, &[]);
    let ring = train_run(
        d.path(),
        "ring",
        2,
        &["train.backend=\"decentdp\"", "train.topology=\"ring\""],
    );
    let args = [
        "predict",
        dense.to_str().unwrap(),
        ring.to_str().unwrap(),
        "--cluster",
        "wan-1g",
    ];
    let lines = json(&nanodist(&[&args[..], &["--json"]].concat()));
    for l in lines.as_array().unwrap() {
        assert!(l["target_step"].as_u64().is_some(), "{l}");
        assert!(l["time_to_target_s"].as_f64().unwrap() > 0.0, "{l}");
    }
    let table = String::from_utf8_lossy(&nanodist(&args).stdout).to_string();
    assert!(table.contains(" time to target |"), "{table}");
}

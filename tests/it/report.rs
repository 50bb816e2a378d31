//! `nanodist compare` and `nanodist plot` on real runs: the table's numbers against what the runs did
//! (and the all-reduce vs gossip byte ratio the theory gives), and the PNG decoded back.

use std::path::{Path, PathBuf};
use std::process::Command;

use nanodist::plan::LaunchEnv;

use crate::common;
use crate::common::{make_data, tiny_config};

const EXE: &str = env!("CARGO_BIN_EXE_nanodist");

fn train_run(dir: &Path, name: &str, set: &[&str]) -> PathBuf {
    common::train_config(&tiny_config(dir, name), 4, set).run_dir
}

/// Runs `cmd`, which must succeed.
fn succeed(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn compare_and_plot_read_real_runs() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let dense = train_run(d.path(), "dense", &[]);
    let ring = train_run(
        d.path(),
        "ring",
        &[
            "train.backend=decentdp",
            "train.topology=ring",
            "train.overlap=false",
        ],
    );
    let powersgd = train_run(
        d.path(),
        "powersgd",
        &[r#"train.compression={ name = "powersgd", rank = 2, start_iter = 10 }"#],
    );
    let expected = markdown_table_compares_the_runs(d.path(), &dense, &ring);
    let all = compare_json(&[&dense, &ring, &powersgd]);
    json_matches_the_runs_rows(&all, [&dense, &ring, &powersgd], expected);
    powersgd_phases_are_compared(&all, &dense, &powersgd);
    plot_draws_the_runs(d.path(), &dense, &ring);
    plot_panels_frame_the_runs(&dense, &ring, d.path());
}

/// `compare`'s Markdown table of the dense and ring runs: their rows, the target each reaches, the
/// comm figures' digits, and bytes per step whose difference is the gradient all-reduce minus the
/// ring's mix. Returns that difference as the config's size predicts it.
fn markdown_table_compares_the_runs(dir: &Path, dense: &Path, ring: &Path) -> f64 {
    let out = succeed(Command::new(EXE).arg("compare").args([dense, ring]));
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    let rows: Vec<Vec<String>> = table
        .lines()
        .skip(2)
        .map(|l| l.split('|').map(|c| c.trim().to_string()).collect())
        .collect();
    assert_eq!(rows.len(), 2, "{table}");
    assert_eq!(
        &rows[0][1..5],
        ["dense", "pytorchddp", "4", "20"],
        "{table}"
    );
    assert_eq!(
        &rows[1][1..5],
        ["ring", "decentdp ring", "4", "20"],
        "{table}"
    );
    // The default target is the worse final val loss, so both runs reach it.
    assert!(rows.iter().all(|r| r[13].starts_with("step ")), "{table}");
    // Collective and codec ms per step, comm share in percent (three significant digits each); a
    // consensus distance for gossip only.
    for r in &rows {
        let share: f64 = r[11].trim_end_matches('%').parse().unwrap();
        assert!(share > 0.0 && share < 100.0, "{table}");
        for cell in &r[9..12] {
            let digits = cell
                .trim_end_matches('%')
                .chars()
                .filter(char::is_ascii_digit);
            let significant = digits.skip_while(|&c| c == '0').count();
            assert!(
                significant >= 3 || cell.trim_end_matches('%') == "0",
                "{cell}: {table}"
            );
        }
    }
    assert_eq!(rows[0][12], "-", "{table}");
    assert!(rows[1][12].parse::<f64>().unwrap() > 0.0, "{table}");
    // Bytes per step per worker, to three significant digits. Both runs evaluate, vote and checkpoint
    // alike, so their difference is the gradient all-reduce (2 (N - 1) / N of the model at N = 4) minus the
    // (synchronous) ring's pair mix (1 model).
    let mb = |cell: &str| -> f64 {
        let (v, unit) = cell.split_once(' ').unwrap();
        v.parse::<f64>().unwrap() * if unit == "MB" { 1e6 } else { 1e3 }
    };
    let src = tiny_config(dir, "x");
    let numel = nanodist::plan::load_str(Path::new("t.toml"), &src, &[], &LaunchEnv::default())
        .unwrap()
        .plan
        .n_params as usize;
    let expected = nanodist::comm::all_reduce_bytes(numel, 4, 0) as f64 - 4.0 * numel as f64;
    let got = mb(&rows[0][8]) - mb(&rows[1][8]);
    // Each cell is within half a unit of its third digit.
    let rounding = (mb(&rows[0][8]) + mb(&rows[1][8])) * 0.005;
    assert!(
        (got - expected).abs() <= 0.01 * expected + rounding,
        "bytes/step difference {got} vs {expected}: {table}"
    );

    expected
}

/// A run's rows.
fn metrics(run: &Path) -> Vec<nanodist::metrics::Row> {
    nanodist::metrics::read_rows(&run.join("metrics.jsonl")).unwrap()
}

/// `compare --format json` of `runs`.
fn compare_json(runs: &[&Path]) -> serde_json::Value {
    let out = succeed(
        Command::new(EXE)
            .arg("compare")
            .args(runs)
            .args(["--format", "json"]),
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// JSON: the same fields as the table, unformatted, against the runs' own rows; `expected` the dense
/// run's bytes per step above the ring's.
fn json_matches_the_runs_rows(all: &serde_json::Value, runs: [&Path; 3], expected: f64) {
    let exact =
        all[0]["bytes_per_step"].as_f64().unwrap() - all[1]["bytes_per_step"].as_f64().unwrap();
    assert!(
        (exact / expected - 1.0).abs() < 0.01,
        "{exact} vs {expected}"
    );
    for (i, run) in runs.iter().enumerate() {
        let rows = metrics(run);
        let bytes: u64 = rows.iter().map(|r| r.comm_bytes).sum();
        assert_eq!(all[i]["bytes_per_step"], bytes as f64 / 20.0);
        // The comm share counts the codec's time with the collectives'.
        let (comm, sync) = rows
            .iter()
            .fold((0.0, 0.0), |(c, y), r| (c + r.comm_ms, y + r.sync_ms));
        let mut prev = 0;
        let total: f64 = rows
            .iter()
            .map(|r| r.ms_per_step * (r.step - std::mem::replace(&mut prev, r.step)) as f64)
            .sum();
        // The slowest rank's compute: some, and no more than the row's interval. Each rank's interval
        // starts as it leaves the previous row's collective, so a rank woken later than the others (4
        // workers on 2 busy cores) starts later: a row may exceed its interval by that delay (up to a
        // few scheduler slices), the typical row, which `predict --measured` takes, not at all.
        let mut prev = 0;
        let mut ratios = Vec::new();
        for r in &rows {
            let interval = r.ms_per_step * (r.step - std::mem::replace(&mut prev, r.step)) as f64;
            let c = r.compute_ms.expect("every row logs compute_ms");
            assert!(c > 0.0 && c <= interval + 15.0, "{c} of {interval} ms");
            ratios.push(c / interval);
        }
        ratios.sort_by(f64::total_cmp);
        assert!(ratios[ratios.len() / 2] <= 1.02, "{ratios:?}");
        let near = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
        assert!(near(
            all[i]["comm_ms_per_step"].as_f64().unwrap(),
            comm / 20.0
        ));
        assert!(near(
            all[i]["sync_ms_per_step"].as_f64().unwrap(),
            sync / 20.0
        ));
        assert!(near(
            all[i]["comm_share"].as_f64().unwrap(),
            (comm + sync) / total
        ));
        assert_eq!(all[i]["workers"], 4);
        assert_eq!(all[i]["steps"], 20);
    }
    let last_distance = metrics(runs[1])
        .iter()
        .rev()
        .find_map(|r| r.consensus_distance);
    assert_eq!(all[1]["consensus_distance"].as_f64(), last_distance);
    assert!(all[0]["consensus_distance"].is_null());
}

/// PowerSGD's dense and compressed phases in JSON, CSV and the Markdown table; a target no run reaches.
fn powersgd_phases_are_compared(all: &serde_json::Value, dense: &Path, powersgd: &Path) {
    // PowerSGD from step 10: dense steps 0-9 send what the dense run sends, the compressed steps less.
    let p = &all[2];
    let dense_per_step = all[0]["bytes_per_step"].as_f64().unwrap();
    assert_eq!(p["dense_bytes_per_step"].as_f64(), Some(dense_per_step));
    let rows = metrics(powersgd);
    let late: u64 = rows
        .iter()
        .filter(|r| r.step > 10)
        .map(|r| r.comm_bytes)
        .sum();
    assert_eq!(
        p["compressed_bytes_per_step"].as_f64(),
        Some(late as f64 / 10.0)
    );
    assert!((late as f64 / 10.0) < dense_per_step / 2.0);
    assert!(all[0]["dense_bytes_per_step"].is_null());
    let out = succeed(
        Command::new(EXE)
            .arg("compare")
            .args([dense, powersgd])
            .args(["--format", "csv"]),
    );
    let mut csv = csv::Reader::from_reader(&out.stdout[..]);
    let head = csv.headers().unwrap().clone();
    let lines: Vec<csv::StringRecord> = csv.records().map(Result::unwrap).collect();
    assert_eq!(lines.len(), 2);
    let field = |line: &csv::StringRecord, name: &str| {
        line[head.iter().position(|h| h == name).unwrap()].to_string()
    };
    assert_eq!(field(&lines[0], "name"), "dense");
    assert_eq!(field(&lines[1], "algorithm"), "pytorchddp + powersgd r2");
    assert_eq!(field(&lines[0], "dense_bytes_per_step"), "");
    assert_eq!(
        field(&lines[1], "dense_bytes_per_step")
            .parse::<f64>()
            .unwrap(),
        dense_per_step
    );
    // The Markdown table adds the phase columns when a run has phases.
    let out = succeed(Command::new(EXE).arg("compare").args([dense, powersgd]));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("| dense phase | compressed phase |"),
        "{table}"
    );
    // A target no run reaches.
    let out = Command::new(EXE)
        .args(["compare", "--target", "0.01"])
        .arg(dense)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("not reached"));
}

/// `plot` of the dense and ring runs: a drawn PNG, one legend, and the title, log axis and smoothing.
fn plot_draws_the_runs(dir: &Path, dense: &Path, ring: &Path) {
    let png = dir.join("curves.png");
    succeed(
        Command::new(EXE)
            .arg("plot")
            .args([dense, ring])
            .arg("--output")
            .arg(&png),
    );
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), nanodist::report::plot::size(4));
    let pixels = &buf[..info.buffer_size()];
    let step = info.color_type.samples();
    let mut colors: Vec<&[u8]> = pixels.chunks(step).collect();
    colors.sort();
    colors.dedup();
    assert!(
        colors.len() > 20,
        "a drawn plot, not a blank page: {} colors",
        colors.len()
    );
    let svg = std::fs::read_to_string(png.with_extension("svg")).unwrap();
    // One legend for the four panels: each run's label once.
    for label in [
        "dense (pytorchddp, 4 workers)",
        "ring (decentdp ring, 4 workers)",
    ] {
        assert_eq!(svg.matches(label).count(), 1, "{label}");
    }
    // Title, log axis and smoothing.
    let styled = dir.join("styled.png");
    succeed(
        Command::new(EXE)
            .arg("plot")
            .args([dense, ring])
            .args(["--title", "dense vs ring", "--log-y", "--smooth", "3"])
            .arg("--output")
            .arg(&styled),
    );
    let svg = std::fs::read_to_string(styled.with_extension("svg")).unwrap();
    assert!(svg.contains("dense vs ring") && svg.contains("log scale"));
}

/// The panels of `plot`: the loss axis frames where the runs differ (not the initial loss) unless
/// `--ylim` says otherwise, ticks are round numbers, bytes are on a log axis (and steps with `--log-x`),
/// and each `--cluster` has a time panel of its own, in a figure that grows with the panels.
fn plot_panels_frame_the_runs(dense: &Path, ring: &Path, dir: &Path) {
    use nanodist::report::plot::{panels, size, Style};
    let mut runs = nanodist::report::load_runs(&[dense.to_path_buf(), ring.to_path_buf()]).unwrap();
    let plain = panels(&runs, &Style::default());
    assert_eq!(plain.len(), 4);
    let step = &plain[0];
    let first = runs[0].rows[0].train_loss.max(runs[1].rows[0].train_loss);
    let last_val = runs
        .iter()
        .map(|r| r.evals().last().unwrap().1)
        .fold(f64::MAX, f64::min);
    assert!(
        step.y.hi < first && step.y.lo <= last_val,
        "{:?} vs {first}, {last_val}",
        step.y
    );
    for axis in [&step.x, &step.y] {
        let gap = axis.ticks[1] - axis.ticks[0];
        assert!(
            axis.ticks.len() >= 3
                && axis
                    .ticks
                    .iter()
                    .all(|t| ((t / gap).round() * gap - t).abs() < 1e-9 * gap.max(1.0)),
            "{axis:?}"
        );
    }
    assert!(plain[2].x.log && !step.x.log && plain[3].caption.contains("wall time"));
    let styled = Style {
        log_x: true,
        ylim: Some((2.0, 3.0)),
        ..Style::default()
    };
    let styled = panels(&runs, &styled);
    assert!(styled[0].x.log && (styled[0].y.lo, styled[0].y.hi) == (2.0, 3.0));
    for cluster in ["a100-ib100", "wan-1g"] {
        let c = nanodist::predict::profile::load(cluster).unwrap();
        for r in &mut runs {
            r.predict_on(&c).unwrap();
        }
    }
    let priced = panels(&runs, &Style::default());
    let captions: Vec<&str> = priced.iter().map(|p| p.caption.as_str()).collect();
    assert_eq!(captions.len(), 5, "{captions:?}");
    assert!(
        captions[3].ends_with("on a100-ib100") && captions[4].ends_with("on wan-1g"),
        "{captions:?}"
    );
    let png = dir.join("clusters.png");
    let args = [
        "plot",
        dense.to_str().unwrap(),
        ring.to_str().unwrap(),
        "--cluster",
        "a100-ib100",
        "--cluster",
        "wan-1g",
        "--output",
    ];
    succeed(Command::new(EXE).args(args).arg(&png));
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap()));
    let info = decoder.read_info().unwrap().info().clone();
    assert_eq!((info.width, info.height), size(5));
}

/// `--smooth` is a trailing mean, point by point.
#[test]
fn plot_style_smooths_each_curve() {
    let style = nanodist::report::plot::Style {
        smooth: 2,
        ..Default::default()
    };
    let got = style.apply(&[(0.0, 10.0), (1.0, 1000.0), (2.0, 10.0)]);
    let want = [(0.0, 10.0), (1.0, 505.0), (2.0, 505.0)];
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g.0 - w.0).abs() < 1e-12 && (g.1 - w.1).abs() < 1e-12,
            "{got:?}"
        );
    }
}

#[test]
fn plot_and_compare_reject_what_is_not_a_run() {
    let d = tempfile::tempdir().unwrap();
    for args in [vec!["compare"], vec!["plot", "--output", "x.png"]] {
        let out = Command::new(EXE)
            .args(&args)
            .arg(d.path())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("not a run directory"));
    }
}

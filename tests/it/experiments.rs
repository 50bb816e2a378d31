//! The reproductions in config/experiments/ run as `scripts/experiments.sh NAME` runs them, in a shortened
//! form (120 steps, on the tests' generated data): every run of every experiment trains to its end and is
//! evaluated, and the comparison table and figure are written with one entry per run.

use std::path::Path;
use std::process::Command;

use crate::common::make_data;

/// The shortened form: long enough for each method's phases (Radius's dense steps, PowerSGD's warm-up,
/// two DiLoCo syncs).
const SHORTENED: [&str; 4] = [
    "train.n_steps=120",
    "log.eval_interval=60",
    "log.eval_steps=2",
    "log.log_interval=20",
];

#[test]
fn every_experiment_runs_shortened_and_writes_its_table_and_figure() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    std::fs::create_dir(&data).unwrap();
    make_data(&data);
    let mut names: Vec<String> = std::fs::read_dir(root.join("config/experiments"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(names.len() >= 4, "{names:?}");
    for name in &names {
        let out = Command::new("bash")
            .arg(root.join("scripts/experiments.sh"))
            .arg(name)
            .args(SHORTENED.iter().flat_map(|s| ["--set", s]))
            .env("NANODIST", env!("CARGO_BIN_EXE_nanodist"))
            .env("NANODIST_EXPERIMENTS_OUT", d.path().join("out"))
            .env("NANODIST_EXPERIMENTS_DATA", &data)
            .output()
            .unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{name}: {said}");
        let dir = d.path().join("out").join(name);
        let table = std::fs::read_to_string(dir.join("compare.md")).unwrap();
        let mut runs: Vec<String> = std::fs::read_dir(root.join("config/experiments").join(name))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
            .collect();
        runs.sort();
        assert!(runs.len() >= 2, "{name}: {runs:?}");
        for run in &runs {
            assert!(
                table.lines().any(|l| l.starts_with(&format!("| {run} |"))),
                "{name}: no row for {run} in\n{table}"
            );
            let rows = nanodist::metrics::read_rows(&dir.join(run).join("metrics.jsonl")).unwrap();
            let last = rows.last().unwrap();
            assert_eq!(last.step, 120, "{name}/{run}");
            assert!(last.val_loss.is_some_and(f64::is_finite), "{name}/{run}");
        }
        let png = std::fs::File::open(dir.join("compare.png")).unwrap();
        let info = png::Decoder::new(std::io::BufReader::new(png))
            .read_info()
            .unwrap()
            .info()
            .clone();
        assert!(info.width > 0 && info.height > 0, "{name}");
        assert!(dir.join("compare.svg").exists(), "{name}");
    }
}

//! The time model against real runs: `nanodist calibrate --engine mpi`, then real `mpirun` runs against
//! their predictions. Timing-sensitive: it runs in its turn (`crate::turn`), and cargo runs test binaries
//! one after another, so nothing else competes for the cores.
#![cfg(feature = "mpi")]

use std::path::Path;

use crate::common;
use crate::common::make_data;

/// The validation on this machine (scripts/bench/predict.py): after `calibrate --engine mpi`, predicted
/// ms/step of real `mpirun -np 2` and `-np 4` runs (all-reduce, ring and exp gossip, PowerSGD, top-k; the
/// quick-start model and one 4x larger) are within 30% of the measured ones, plus twice each run's own
/// spread of step times (ranks that share this machine's cores scatter), but for at most one row in ten,
/// and none past 1.5 times its bound. The script prints each row's error and bound and exits 1 otherwise.
/// Timing on shared cores is noisy (the machine's speed drifts between minutes): a failed try is retried
/// once, and both tries are printed.
#[test]
fn predictions_of_mpirun_runs_are_within_30_percent_plus_their_spread_but_for_one_in_ten() {
    let _turn = crate::turn();
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let attempt = || {
        std::process::Command::new("python3")
            .arg(root.join("scripts/bench/predict.py"))
            .args([
                "--nanodist",
                env!("CARGO_BIN_EXE_nanodist"),
                "--steps",
                "40",
            ])
            .arg("--data")
            .arg(d.path())
            .output()
    };
    let mut tries = Vec::new();
    for n in 1..=2 {
        let out = match attempt() {
            Ok(o) => o,
            Err(e) => return common::skip_python(&format!("python3: {e}")),
        };
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        eprintln!("try {n}:\n{text}");
        let rows = text.matches("| 2 |").count() + text.matches("| 4 |").count();
        assert_eq!(
            rows,
            20,
            "try {n}: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        tries.push(text);
        if out.status.success() {
            return;
        }
    }
    panic!(
        "both tries had rows past their bound:\n{}",
        tries.join("\n")
    );
}

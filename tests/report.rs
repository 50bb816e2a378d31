//! `nanodist compare` and `nanodist plot` on real runs: the table's numbers against what the runs did
//! (and the all-reduce vs gossip byte ratio the theory gives), and the PNG decoded back.

use std::path::{Path, PathBuf};
use std::process::Command;

use nanodist::config::{self, LaunchEnv};
use nanodist::train;

mod common;
use common::{make_data, tiny_config};

const EXE: &str = env!("CARGO_BIN_EXE_nanodist");

fn train_run(dir: &Path, name: &str, set: &[&str]) -> PathBuf {
    let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
    let launch = LaunchEnv {
        workers_flag: Some(4),
        ..LaunchEnv::default()
    };
    let loaded =
        config::load_str(Path::new("t.toml"), &tiny_config(dir, name), &set, &launch).unwrap();
    train::run(&loaded).unwrap().run_dir
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
        &["train.backend=decentdp", "train.topology=ring"],
    );
    let out = succeed(Command::new(EXE).arg("compare").args([&dense, &ring]));
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
    assert!(rows.iter().all(|r| r[9].starts_with("step ")), "{table}");
    // Bytes per step per worker. Both runs evaluate, vote and checkpoint alike, so their difference is
    // the gradient all-reduce (2 (N - 1) / N of the model at N = 4) minus the ring's pair mix (1 model).
    let mb = |cell: &str| -> f64 {
        let (v, unit) = cell.split_once(' ').unwrap();
        v.parse::<f64>().unwrap() * if unit == "MB" { 1e6 } else { 1e3 }
    };
    let src = tiny_config(d.path(), "x");
    let numel = config::load_str(Path::new("t.toml"), &src, &[], &LaunchEnv::default())
        .unwrap()
        .plan
        .n_params as usize;
    let expected = nanodist::comm::all_reduce_bytes(numel, 4, 0) as f64 - 4.0 * numel as f64;
    let got = mb(&rows[0][8]) - mb(&rows[1][8]);
    assert!(
        (got / expected - 1.0).abs() < 0.01,
        "bytes/step difference {got} vs {expected}: {table}"
    );
    // A target no run reaches.
    let out = Command::new(EXE)
        .args(["compare", "--target", "0.01"])
        .arg(&dense)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("not reached"));

    let png = d.path().join("curves.png");
    succeed(
        Command::new(EXE)
            .arg("plot")
            .args([&dense, &ring])
            .arg("--output")
            .arg(&png),
    );
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), nanodist::report::plot::SIZE);
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
    assert!(
        svg.contains("dense (pytorchddp, 4 workers)")
            && svg.contains("ring (decentdp ring, 4 workers)")
    );
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

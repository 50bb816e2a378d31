//! Several workers on the local engine: the oracles of DESIGN.md (N workers x b == 1 worker x N*b,
//! complete gossip == the global average, consensus behaviour) and the seed configs on every topology.

use std::path::Path;

use nanodist::config::{self, LaunchEnv, Topology};
use nanodist::metrics::read_rows;
use nanodist::sync::{topology, Gossip, SyncBackend};
use nanodist::train;

mod common;
use common::{make_data, on_ranks, tiny_config};

fn train_with(dir: &Path, workers: usize, set: &[&str]) -> Vec<nanodist::metrics::Row> {
    let src = tiny_config(dir, &format!("w{workers}"));
    let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
    let launch = LaunchEnv {
        workers_flag: Some(workers),
        ..LaunchEnv::default()
    };
    let loaded = config::load_str(Path::new("t.toml"), &src, &set, &launch).unwrap();
    let s = train::run(&loaded).unwrap();
    read_rows(&s.run_dir.join("metrics.jsonl")).unwrap()
}

#[test]
fn allreduce_with_n_workers_at_batch_b_equals_one_worker_at_batch_n_b() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let one = train_with(d.path(), 1, &["train.local_batch_size=8"]);
    for n in [2usize, 4] {
        let b = (8 / n).to_string();
        let many = train_with(d.path(), n, &[&format!("train.local_batch_size={b}")]);
        assert_eq!(one.len(), many.len());
        for (a, m) in one.iter().zip(&many) {
            let close = |x: f64, y: f64| (x - y).abs() <= 1e-4 * (1.0 + x.abs());
            assert!(
                close(a.train_loss, m.train_loss),
                "n={n} step {}: {} vs {}",
                a.step,
                a.train_loss,
                m.train_loss
            );
            assert!(
                close(a.grad_norm, m.grad_norm),
                "n={n} step {}: grad norm {} vs {}",
                a.step,
                a.grad_norm,
                m.grad_norm
            );
            if let (Some(x), Some(y)) = (a.val_loss, m.val_loss) {
                assert!(close(x, y), "n={n} step {}: val {x} vs {y}", a.step);
            }
        }
        assert!(
            many.iter().all(|r| r.comm_bytes > 0),
            "all-reduce traffic is counted"
        );
    }
    // Accumulation: 1 worker with local batch 2 (4 micro-steps) equals the same global batch.
    let accum = train_with(
        d.path(),
        1,
        &["train.local_batch_size=2", "log.run_name=\"acc\""],
    );
    for (a, m) in one.iter().zip(&accum) {
        assert!(
            (a.train_loss - m.train_loss).abs() < 1e-4 * (1.0 + a.train_loss),
            "step {}",
            a.step
        );
    }
}

#[test]
fn gossip_runs_on_every_topology_and_complete_keeps_replicas_identical() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    for (topo, extra) in [
        ("complete", ""),
        ("ring", ""),
        ("exp", ""),
        ("alternating-exp-ring", "train.ranks_per_node=2"),
    ] {
        let mut set = vec![
            "train.backend=decentdp".to_string(),
            format!("train.topology={topo}"),
            format!("log.run_name=\"{topo}\""),
            "train.optim={ name = \"accumadamw\", accum_steps = 4 }".to_string(),
        ];
        if !extra.is_empty() {
            set.push(extra.to_string());
        }
        let set: Vec<&str> = set.iter().map(String::as_str).collect();
        let rows = train_with(d.path(), 4, &set);
        let evals: Vec<_> = rows.iter().filter(|r| r.val_loss.is_some()).collect();
        assert_eq!(evals.len(), 2, "{topo}");
        let dist = evals[1].consensus_distance.unwrap();
        // With 2 nodes, alternating-exp-ring's second round averages all 4 ranks: at even steps the
        // replicas are equal, as with complete.
        if topo == "complete" || topo == "alternating-exp-ring" {
            assert!(
                dist < 1e-6,
                "{topo}: replicas identical after a global round, distance {dist}"
            );
        } else {
            assert!(
                dist > 0.0,
                "{topo}: replicas see different data and drift apart between mixings"
            );
        }
        assert!(
            evals[1].val_loss.unwrap() < evals[0].train_loss + 1.0,
            "{topo} trains"
        );
    }
}

fn replica(rank: usize) -> Vec<f32> {
    (0..50)
        .map(|i| ((i * 13 + rank * 29) % 17) as f32 - 8.0)
        .collect()
}

#[test]
fn complete_gossip_is_the_global_average() {
    let n = 4;
    let out = on_ranks(n, |c| {
        let rank = c.rank();
        let mut g = Gossip::new(c, topology::rounds(Topology::Complete, n, n).unwrap());
        let mut p = replica(rank);
        g.after_step(&mut p, 0).unwrap();
        p
    });
    for i in 0..50 {
        let mean: f32 = (0..n).map(|r| replica(r)[i]).sum::<f32>() / n as f32;
        for p in &out {
            assert!((p[i] - mean).abs() < 1e-5, "{} vs {mean}", p[i]);
        }
    }
}

#[test]
fn ring_gossip_shrinks_consensus_distance_and_keeps_the_mean() {
    let n = 6;
    let out = on_ranks(n, |c| {
        let rank = c.rank();
        let mut g = Gossip::new(c, topology::rounds(Topology::Ring, n, n).unwrap());
        let mut p = replica(rank);
        let mut avg = Vec::new();
        let mut dists = vec![g.average(&p, &mut avg).unwrap()];
        let mean0 = avg.clone();
        for step in 0..12 {
            g.after_step(&mut p, step).unwrap();
            dists.push(g.average(&p, &mut avg).unwrap());
        }
        (dists, mean0, avg)
    });
    let (dists, mean0, mean_end) = &out[0];
    assert!(dists[0] > 1.0);
    assert!(dists.windows(2).all(|w| w[1] <= w[0] + 1e-6), "{dists:?}");
    assert!(dists[12] < dists[0] * 0.2, "{dists:?}");
    for (a, b) in mean0.iter().zip(mean_end) {
        assert!(
            (a - b).abs() < 1e-4,
            "doubly stochastic mixing keeps the mean"
        );
    }
}

#[test]
fn seed_configs_run_scaled_down_with_four_local_workers() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let common = [
        format!("data_dir={:?}", d.path().display().to_string()),
        format!("log_dir={:?}", d.path().join("log").display().to_string()),
        "model.n_layers=1".into(),
        "model.n_heads=2".into(),
        "model.n_embd=16".into(),
        "model.vocab_size=64".into(),
        "train.context_length=16".into(),
        "train.global_batch_size=8".into(),
        "train.n_steps=3".into(),
        "train.lr_schedule.warmup_steps=1".into(),
        "log.eval_interval=3".into(),
        "log.eval_steps=1".into(),
        "log.ckpt_interval=0".into(),
        "log.wandb_log=false".into(),
    ];
    let runs: Vec<(&str, Vec<String>)> = vec![
        ("gpt2-small.toml", vec!["train.local_batch_size=2".into()]),
        (
            "decent-gpt2-small.toml",
            vec!["train.topology=complete".into()],
        ),
        ("decent-gpt2-small.toml", vec!["train.topology=ring".into()]),
        ("decent-gpt2-small.toml", vec!["train.topology=exp".into()]),
        (
            "decent-gpt2-small.toml",
            vec!["train.ranks_per_node=2".into()],
        ),
    ];
    for (i, (file, extra)) in runs.into_iter().enumerate() {
        let mut set: Vec<String> = common.to_vec();
        set.extend(extra);
        set.push(format!("log.run_name=\"seed{i}\""));
        let launch = LaunchEnv {
            workers_flag: Some(4),
            ..LaunchEnv::default()
        };
        let loaded = config::load(&root.join("config").join(file), &set, &launch).unwrap();
        let s = train::run(&loaded).unwrap();
        assert_eq!(s.step, 3, "{file} {i}");
        assert!(s.last_val_loss.unwrap().is_finite());
    }
}

//! Compressed gossip (CHOCO-SGD) end to end: with every entry sent and gamma = 1 it is uncompressed
//! gossip, every compressor resumes bit for bit on ring and exp (overlapped too), its messages are the
//! bytes the format defines, and "auto" tunes the consensus step and logs it.

use std::path::Path;

use nanodist::metrics::Row;

use crate::common;
use crate::common::{exact, make_data};

fn rows(dir: &Path, name: &str, workers: usize, set: &[&str]) -> (u64, Vec<Row>) {
    let s = common::train_tiny(dir, name, workers, set);
    (s.step, common::rows_of(&s))
}

const COMPRESSORS: [&str; 4] = [
    "{ name = \"topk\", density = 0.2, consensus_step = 0.3 }",
    "{ name = \"randomk\", density = 0.2, consensus_step = 0.2 }",
    "{ name = \"qsgd\", levels = 7, consensus_step = 0.3 }",
    "{ name = \"sign\", consensus_step = \"auto\" }",
];

/// Synchronous gossip on `topology` (a later `train.overlap=true` overlaps it).
fn gossip(topology: &str) -> Vec<String> {
    vec![
        "train.backend=\"decentdp\"".into(),
        format!("train.topology=\"{topology}\""),
        "train.overlap=false".into(),
    ]
}

#[test]
fn every_entry_sent_with_gamma_one_is_uncompressed_gossip() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    for (topology, extra) in [
        ("ring", None),
        ("exp", Some("train.overlap=true")),
        ("alternating-exp-ring", Some("train.ranks_per_node=2")),
    ] {
        let mut plain = gossip(topology);
        plain.extend(extra.map(String::from));
        let mut choco = plain.clone();
        choco.push(
            "train.compression={ name = \"topk\", density = 1.0, consensus_step = 1.0 }".into(),
        );
        let plain: Vec<&str> = plain.iter().map(String::as_str).collect();
        let choco: Vec<&str> = choco.iter().map(String::as_str).collect();
        let (_, a) = rows(d.path(), &format!("plain-{topology}"), 4, &plain);
        let (_, b) = rows(d.path(), &format!("choco-{topology}"), 4, &choco);
        assert_eq!(a.len(), b.len());
        // x_hat + (x - x_hat) is x up to rounding: the runs agree to float precision, not bit for bit.
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-4 * (1.0 + x.abs());
        for (x, y) in a.iter().zip(&b) {
            assert!(
                close(x.train_loss, y.train_loss),
                "{topology} step {}: {} vs {}",
                x.step,
                x.train_loss,
                y.train_loss
            );
            if let (Some(p), Some(q)) = (x.consensus_distance, y.consensus_distance) {
                assert!(
                    (p - q).abs() <= 1e-3 * p + 1e-6,
                    "{topology}: distance {p} vs {q}"
                );
            }
        }
        assert!(b.iter().all(|r| r.consensus_step == Some(1.0)));
    }
}

#[test]
fn each_compressor_on_ring_and_exp_trains_and_resumes_bit_for_bit() {
    for (topology, overlap) in [("ring", false), ("exp", true)] {
        for (i, compression) in COMPRESSORS.iter().enumerate() {
            let d = tempfile::tempdir().unwrap();
            make_data(d.path());
            let mut set = gossip(topology);
            if overlap {
                set.push("train.overlap=true".into());
            }
            set.push(format!("train.compression={compression}"));
            let set: Vec<&str> = set.iter().map(String::as_str).collect();
            let what = format!("{topology} {compression}");
            let (_, full) = rows(d.path(), "full", 4, &set);
            let mut first = set.clone();
            first.push("train.exit_interval=5");
            let (step, _) = rows(d.path(), "cut", 4, &first);
            assert_eq!(step, 5, "{what}");
            let (step, cut) = rows(d.path(), "cut", 4, &set);
            assert_eq!(step, 20, "{what}");
            assert_eq!(
                full.iter().map(exact).collect::<Vec<_>>(),
                cut.iter().map(exact).collect::<Vec<_>>(),
                "case {i}: {what}"
            );
            let last = full.last().unwrap();
            assert!(
                last.val_loss.unwrap() < full[0].train_loss - 0.3,
                "{what} learns: {:?} from {}",
                last.val_loss,
                full[0].train_loss
            );
            assert!(last.consensus_distance.unwrap() > 0.0, "{what}");
            // Less than uncompressed gossip sends (the ratio of its bytes to ours).
            assert!(last.compression_ratio.unwrap() > 1.5, "{what}: {last:?}");
            let gamma = last.consensus_step.unwrap();
            assert!(gamma > 0.0 && gamma <= 1.0, "{what}: gamma {gamma}");
        }
    }
}

/// Words of one message of the tiny model, from the formats' definitions: top-k sends values and
/// indices, random-k values, QSGD a norm per 512 entries (its default bucket) and 4 bits an entry (7
/// levels and a sign), sign a scale and a bit an entry; per tensor, words rounded up.
fn message_words(compressor: &str, lens: &[usize]) -> usize {
    lens.iter()
        .map(|&n| match compressor {
            "topk" => 2 * ((0.2 * n as f64) as usize).max(1),
            "randomk" => ((0.2 * n as f64) as usize).max(1),
            "qsgd" => n.div_ceil(512) + (4 * n).div_ceil(32),
            "sign" => 1 + n.div_ceil(32),
            other => panic!("{other}"),
        })
        .sum()
}

#[test]
fn each_step_sends_one_compressed_message_to_each_peer() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let model = nanodist::config::ModelConfig {
        n_layers: 2,
        n_heads: 2,
        n_embd: 32,
        vocab_size: 64,
        bias: true,
        ..Default::default()
    };
    let lens: Vec<usize> = nanodist::model::gpt::layout(&model, 16)
        .into_iter()
        .map(|(_, shape, _)| shape.iter().product())
        .collect();
    for (name, compression) in ["topk", "randomk", "qsgd", "sign"].iter().zip(COMPRESSORS) {
        // exp on 4 workers: one peer per step; complete: all 3 others.
        for (topology, peers) in [("exp", 1), ("complete", 3)] {
            let mut set = gossip(topology);
            set.push(format!("train.compression={compression}"));
            let set: Vec<&str> = set.iter().map(String::as_str).collect();
            let (_, r) = rows(d.path(), &format!("{name}-{topology}"), 4, &set);
            let want = 4 * peers * message_words(name, &lens) as u64;
            for row in &r {
                assert_eq!(row.comm_bytes, want, "{name} {topology} step {}", row.step);
            }
        }
    }
}

#[test]
fn auto_tunes_the_consensus_step_prints_and_logs_it() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let cfg = common::write_tiny_config(d.path(), "t.toml", "auto");
    let args = [
        "check",
        cfg.to_str().unwrap(),
        "--workers",
        "4",
        "--set",
        "train.backend=\"decentdp\"",
        "--set",
        "train.topology=\"ring\"",
        "--set",
        "train.compression={ name = \"topk\", density = 0.05, consensus_step = \"auto\" }",
    ];
    let out = common::nanodist(&args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let gamma: f64 = text
        .split("consensus step ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no tuned consensus step in:\n{text}"));
    assert!(text.contains("(auto: tuned"), "{text}");
    assert!(text.contains("public copies     2 group(s)"), "{text}");
    // Aggressive compression needs a small step; the same on every call.
    assert!(gamma > 1e-3 && gamma < 0.5, "{gamma}");
    let again = common::nanodist(&args);
    assert_eq!(String::from_utf8_lossy(&again.stdout), text);
    let (_, r) = rows(
        d.path(),
        "auto-run",
        4,
        &[
            "train.backend=\"decentdp\"",
            "train.topology=\"ring\"",
            "train.compression={ name = \"topk\", density = 0.05, consensus_step = \"auto\" }",
        ],
    );
    for row in &r {
        let logged = row.consensus_step.unwrap();
        // Printed to 4 decimals.
        assert!((logged - gamma).abs() < 1e-3 * gamma, "{logged} vs {gamma}");
    }
}

#[test]
fn gossip_checkpoints_switch_to_and_from_compression_with_one_change() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let plain = [
        "train.backend=\"decentdp\"",
        "train.topology=\"exp\"",
        "train.overlap=false",
    ];
    let compressed = "train.compression={ name = \"sign\", consensus_step = 0.3 }";
    // Each run stops at step 10; the next one starts from its checkpoint with the other algorithm.
    let mut first = plain.to_vec();
    first.extend([compressed, "train.exit_interval=10"]);
    let (step, _) = rows(d.path(), "choco", 4, &first);
    assert_eq!(step, 10);
    let from_choco = format!(
        "checkpoint={:?}",
        d.path().join("log/choco").display().to_string()
    );
    let mut second = plain.to_vec();
    second.extend([from_choco.as_str(), "train.exit_interval=5"]);
    let (step, r) = rows(d.path(), "plain", 4, &second);
    assert_eq!(
        (step, r[0].step),
        (15, 11),
        "plain gossip continues from step 10"
    );
    assert!(r.iter().all(|r| r.compression_ratio.is_none()));
    let from_plain = format!(
        "checkpoint={:?}",
        d.path().join("log/plain").display().to_string()
    );
    let mut third = plain.to_vec();
    third.extend([compressed, from_plain.as_str()]);
    let (step, r) = rows(d.path(), "choco-again", 4, &third);
    assert_eq!(
        (step, r[0].step),
        (20, 16),
        "compressed gossip continues from step 15"
    );
    assert!(r
        .iter()
        .all(|r| r.compression_ratio.is_some_and(|c| c > 5.0)));

    // An overlapped run stops with its message in flight: the other algorithm refuses to drop it.
    let cfg = common::write_tiny_config(d.path(), "t.toml", "overlapped");
    let cfg = cfg.to_str().unwrap();
    let train = |extra: &[&str]| {
        let mut args = vec!["train", cfg, "--workers", "4"];
        for s in plain
            .iter()
            .chain(["train.overlap=true"].iter())
            .chain(extra)
        {
            args.extend(["--set", s]);
        }
        common::nanodist(&args)
    };
    assert!(train(&[compressed, "train.exit_interval=5"])
        .status
        .success());
    let ckpt = format!(
        "checkpoint={:?}",
        d.path().join("log/overlapped").display().to_string()
    );
    let out = train(&[ckpt.as_str(), "log.run_name=\"switched\""]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("left a message in flight"), "{err}");
}

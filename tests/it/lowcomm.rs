//! The low-communication family (DiLoCo, Streaming DiLoCo, SPARTA, DeMo): oracles against the methods
//! they reduce to, exact resume at any step (mid-period, with a fragment in flight), and the bytes of
//! each step.

use std::path::Path;

use nanodist::metrics::Row;
use nanodist::train;

use crate::common;
use crate::common::{exact, make_data};

/// Trains the tiny config on `workers` local workers with `set`; returns the summary and the rows.
fn train_rows(dir: &Path, name: &str, workers: usize, set: &[&str]) -> (train::Summary, Vec<Row>) {
    let s = common::train_tiny(dir, name, workers, set);
    let rows = common::rows_of(&s);
    (s, rows)
}

fn rows(dir: &Path, name: &str, workers: usize, set: &[&str]) -> Vec<Row> {
    train_rows(dir, name, workers, set).1
}

/// Rank `rank`'s compressing reducer's residual in the run's newest checkpoint.
fn residual(s: &train::Summary, rank: usize) -> Vec<f32> {
    let ckpt = train::checkpoint::find_latest(&s.run_dir).unwrap().unwrap();
    let bytes = std::fs::read(ckpt.join(format!("rank_{rank}.safetensors"))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let residual = st
        .tensor("reducer.compress.residual")
        .expect("the reducer's residual");
    residual
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Rows agree within `tol` (relative) on the losses.
fn assert_close(a: &[Row], b: &[Row], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: rows");
    let close = |x: f64, y: f64| (x - y).abs() <= tol * (1.0 + x.abs());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.step, y.step);
        assert!(
            close(x.train_loss, y.train_loss),
            "{what} step {}: train {} vs {}",
            x.step,
            x.train_loss,
            y.train_loss
        );
        if let (Some(p), Some(q)) = (x.val_loss, y.val_loss) {
            assert!(close(p, q), "{what} step {}: val {p} vs {q}", x.step);
        }
    }
}

const DILOCO_LOCALSGD_EVERY_STEP: &str =
    "train.diloco={ sync_every = 1, outer_lr = 1.0, outer_momentum = 0.0, nesterov = false }";

#[test]
fn diloco_reduces_to_plain_training_and_to_data_parallel_sgd() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    // One worker, H = 1, outer SGD lr 1, momentum 0: the outer step gives the inner result back.
    let plain = rows(d.path(), "plain", 1, &[]);
    let diloco = rows(
        d.path(),
        "diloco1",
        1,
        &["train.backend=\"diloco\"", DILOCO_LOCALSGD_EVERY_STEP],
    );
    assert_close(&plain, &diloco, 1e-5, "1 worker, H = 1");
    // N workers with plain SGD (no clipping: it acts on the average in data parallel, on each worker
    // here): averaging x - lr g_i is stepping with the averaged gradient.
    let sgd = [
        "train.optim={ name = \"sgd\" }",
        "train.grad_norm_clip=0",
        "train.lr_schedule={ name = \"cosine\", lr = 0.3, warmup_steps = 2, eta_min = 0.03 }",
    ];
    let ddp = rows(d.path(), "ddp", 4, &sgd);
    let mut set = sgd.to_vec();
    set.extend(["train.backend=\"diloco\"", DILOCO_LOCALSGD_EVERY_STEP]);
    let local_sgd = rows(d.path(), "localsgd", 4, &set);
    assert_close(&ddp, &local_sgd, 1e-4, "4 workers, SGD, H = 1");
    assert!(
        ddp.last().unwrap().val_loss.unwrap() < ddp[0].train_loss,
        "SGD learns"
    );
    // Streaming with one fragment, no delay, alpha 0 is DiLoCo, bit for bit.
    let base = [
        "train.backend=\"diloco\"",
        "train.diloco={ sync_every = 4 }",
    ];
    let a = rows(d.path(), "dil4", 2, &base);
    let b = rows(
        d.path(),
        "stream1",
        2,
        &[
            base[0],
            "train.diloco={ sync_every = 4, fragments = 1, fragment_delay = 0, fragment_alpha = 0.0 }",
        ],
    );
    assert_eq!(
        a.iter().map(exact).collect::<Vec<_>>(),
        b.iter().map(exact).collect::<Vec<_>>()
    );
}

#[test]
fn sparta_with_p_one_is_parameter_averaging_every_step() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let sparta = rows(
        d.path(),
        "sparta1",
        4,
        &["train.backend=\"sparta\"", "train.sparta={ p = 1.0 }"],
    );
    let averaging = rows(
        d.path(),
        "avg",
        4,
        &["train.backend=\"diloco\"", DILOCO_LOCALSGD_EVERY_STEP],
    );
    assert_close(&sparta, &averaging, 1e-5, "SPARTA p = 1");
    // The replicas are equal after every step: nothing to measure at evaluation.
    assert!(sparta
        .iter()
        .filter_map(|r| r.consensus_distance)
        .all(|c| c < 1e-6));
}

/// Every backend stopped mid-period (a fragment in flight for the streaming one) and resumed equals the
/// uninterrupted run bit for bit, and it learns.
#[test]
fn each_low_communication_backend_resumes_bit_for_bit() {
    let cases: [&[&str]; 10] = [
        &["train.backend=\"diloco\"", "train.diloco={ sync_every = 4 }"],
        // MuLoCo: Muon inside DiLoCo; and Muon under all-reduce (whose workers then keep replicas of
        // their own: Muon has no range update for a shared one).
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 4 }",
            "train.optim={ name = \"muon\" }",
            "train.lr_schedule.lr=0.02",
        ],
        &["train.optim={ name = \"muon\" }", "train.lr_schedule.lr=0.02"],
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 4, fragments = 2, fragment_delay = 1, fragment_alpha = 0.5, quantize = \"fp8\" }",
        ],
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 2, outer_lr = 0.5 }",
            "train.compression={ name = \"topk\", density = 0.1 }",
        ],
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 2, outer_momentum = 0.0, outer_lr = 1.0 }",
            "train.compression={ name = \"sparseloco\", density = 0.05, chunk = 256 }",
        ],
        // Eager outer steps, stopped with the all-reduce of sync 4 in four pieces, one beside each of
        // steps 5-8; and with fp8 pseudo-gradients, whose all-reduce goes whole beside step 5.
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 4, eager = true, eager_pieces = 4 }",
        ],
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 4, eager = true, quantize = \"fp8\" }",
        ],
        &["train.backend=\"sparta\"", "train.sparta={ p = 0.1 }"],
        &[
            "train.backend=\"demo\"",
            "train.optim={ name = \"sgd\", weight_decay = 0.01 }",
            "train.demo={ topk = 8, chunk = 16 }",
        ],
    ];
    for (i, set) in cases.iter().enumerate() {
        let d = tempfile::tempdir().unwrap();
        make_data(d.path());
        let full = rows(d.path(), "full", 2, set);
        let mut first = set.to_vec();
        first.push("train.exit_interval=5");
        let (s, _) = train_rows(d.path(), "cut", 2, &first);
        assert_eq!(s.step, 5, "case {i}");
        let (s, cut) = train_rows(d.path(), "cut", 2, set);
        assert_eq!(s.step, 20, "case {i}");
        assert_eq!(
            full.iter().map(exact).collect::<Vec<_>>(),
            cut.iter().map(exact).collect::<Vec<_>>(),
            "case {i}: {set:?}"
        );
        let last = full.last().unwrap().val_loss.unwrap();
        assert!(last < full[0].train_loss - 0.3, "case {i} learns: {last}");
    }
}

#[test]
fn diloco_sends_only_at_syncs_and_logs_its_metrics() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let r = rows(
        d.path(),
        "h4",
        4,
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 4 }",
        ],
    );
    // The model is all-reduced once per 4 steps: the bytes of one step of gradient all-reduce.
    let dense = rows(d.path(), "ddp", 4, &[])[0].comm_bytes;
    for row in &r {
        if row.step % 4 == 0 {
            assert_eq!(row.comm_bytes, dense, "step {}", row.step);
            assert!(row.pseudo_grad_norm.unwrap() > 0.0);
            assert!(row.consensus_distance.unwrap() > 0.0);
            assert_eq!(row.outer_lr, Some(0.7));
        } else {
            assert_eq!(row.comm_bytes, 0, "step {}: no sync, no bytes", row.step);
            assert_eq!(row.pseudo_grad_norm, None);
        }
    }
    // fp8 sends a quarter of the bytes, plus a scale per row.
    let q = rows(
        d.path(),
        "h4fp8",
        4,
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 4, quantize = \"fp8\" }",
        ],
    );
    let ratio = q[3].compression_ratio.unwrap();
    assert!((3.0..4.0).contains(&ratio), "fp8 compression ratio {ratio}");
}

/// Compressed pseudo-gradients: a reducer that sends everything is the plain all-reduce (up to the order of
/// the sums), and with top-k the error feedback keeps what a sync did not send for the next sync: the
/// residual in the checkpoint is the unsent part of the pseudo-gradients, not zero.
#[test]
fn diloco_pseudo_gradients_through_a_reducer_keep_what_was_not_sent() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let base = [
        "train.backend=\"diloco\"",
        "train.diloco={ sync_every = 2 }",
    ];
    let plain = rows(d.path(), "plain", 2, &base);
    let all = [
        base[0],
        base[1],
        "train.compression={ name = \"topk\", density = 1.0 }",
    ];
    assert_close(
        &plain,
        &rows(d.path(), "all", 2, &all),
        1e-5,
        "top-k density 1",
    );
    let some = [
        base[0],
        base[1],
        "train.compression={ name = \"topk\", density = 0.05 }",
    ];
    let (s, r) = train_rows(d.path(), "some", 2, &some);
    assert!(r
        .iter()
        .filter_map(|r| r.compression_ratio)
        .all(|c| c > 5.0));
    let norm = residual(&s, 1)
        .iter()
        .map(|x| (*x as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!(norm > 0.0, "nothing kept for the next sync");
}

/// SparseLoCo sending every entry as f32 is DiLoCo bit for bit (the decayed residual stays zero and the
/// rank-ordered mean of the messages is the all-reduce's); at 2 bits and 2% it sends about 3% of DiLoCo's
/// bytes, counted exactly (debug builds hold every step to the backend's description), keeps a residual,
/// and learns.
#[test]
fn sparseloco_with_everything_sent_in_f32_is_diloco_and_two_bits_still_learn() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let base = [
        "train.backend=\"diloco\"",
        "train.diloco={ sync_every = 2 }",
    ];
    let plain = rows(d.path(), "plain", 2, &base);
    let all = [
        base[0],
        base[1],
        "train.compression={ name = \"sparseloco\", density = 1.0, bits = 32, chunk = 64 }",
    ];
    // Everything but the bytes (indices travel too) and the compression metrics.
    let learning = |r: &Row| {
        let bits = |x: Option<f64>| x.map(f64::to_bits);
        let (pg, cd) = (bits(r.pseudo_grad_norm), bits(r.consensus_distance));
        (r.step, r.train_loss.to_bits(), bits(r.val_loss), pg, cd)
    };
    assert_eq!(
        plain.iter().map(learning).collect::<Vec<_>>(),
        rows(d.path(), "all", 2, &all)
            .iter()
            .map(learning)
            .collect::<Vec<_>>(),
        "density 1, 32 bits"
    );
    let two_bits = [
        base[0],
        "train.diloco={ sync_every = 2, outer_momentum = 0.0, outer_lr = 1.0 }",
        "train.compression={ name = \"sparseloco\", density = 0.02, chunk = 256 }",
    ];
    let (s, r) = train_rows(d.path(), "two", 2, &two_bits);
    let ratios: Vec<f64> = r.iter().filter_map(|r| r.compression_ratio).collect();
    assert!(
        !ratios.is_empty() && ratios.iter().all(|c| *c > 20.0),
        "{ratios:?}"
    );
    let last = r.last().unwrap().val_loss.unwrap();
    assert!(
        last < r[0].train_loss - 0.3,
        "2-bit SparseLoCo learns: {last}"
    );
    assert!(
        residual(&s, 0).iter().any(|x| *x != 0.0),
        "nothing kept for the next sync"
    );
}

/// Hierarchical DiLoCo: groups of one are DiLoCo bit for bit; one group of every worker with LocalSGD's
/// outer step is data-parallel training; 2 groups of 2 resume bit for bit, and the groups' gradient
/// all-reduce is counted every step (debug builds hold each step's bytes to its description).
#[test]
fn hierarchical_diloco_reduces_to_diloco_and_to_data_parallel() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let h = |rest: &str| format!("train.diloco={{ sync_every = 4{rest} }}");
    let diloco = rows(d.path(), "flat", 4, &["train.backend=\"diloco\"", &h("")]);
    let ones = rows(
        d.path(),
        "ones",
        4,
        &["train.backend=\"diloco\"", &h(", group_size = 1")],
    );
    assert_eq!(
        diloco.iter().map(exact).collect::<Vec<_>>(),
        ones.iter().map(exact).collect::<Vec<_>>()
    );
    let ddp = rows(d.path(), "ddp", 4, &[]);
    let local_sgd = ", outer_lr = 1.0, outer_momentum = 0.0, nesterov = false, group_size = 4";
    // H = 5: the evaluations (every 5 steps) see the outer model right after a sync.
    let world_h5 = format!("train.diloco={{ sync_every = 5{local_sgd} }}");
    let world = rows(
        d.path(),
        "world",
        4,
        &["train.backend=\"diloco\"", &world_h5],
    );
    assert_close(&ddp, &world, 1e-5, "one group of 4");
    let two = [
        "train.backend=\"diloco\"".to_string(),
        h(", group_size = 2"),
    ];
    let two: Vec<&str> = two.iter().map(String::as_str).collect();
    let full = rows(d.path(), "two", 4, &two);
    let mut first = two.clone();
    first.push("train.exit_interval=5");
    train_rows(d.path(), "cut", 4, &first);
    let cut = rows(d.path(), "cut", 4, &two);
    assert_eq!(
        full.iter().map(exact).collect::<Vec<_>>(),
        cut.iter().map(exact).collect::<Vec<_>>()
    );
    // Every step sends the group's all-reduce; sync steps also the pseudo-gradients'.
    assert!(full.iter().all(|r| r.comm_bytes > 0));
    assert!(full[3].comm_bytes > full[2].comm_bytes);
    assert_ne!(
        full.last().unwrap().val_loss,
        diloco.last().unwrap().val_loss
    );
}

//! Compressed reducers against their oracles: dense all-reduce at full density / full rank, mass
//! conservation of error feedback, PowerSGD exactness on low-rank input, the Radius mask against the
//! top-k of the averaged gradient, and exact resume of reducer state through the training loop.

use std::path::Path;

use nanodist::comm::Communicator;
use nanodist::config::backend::{PowerSgdConfig, RadiusConfig};
use nanodist::kernels::Segment;
use nanodist::metrics::Row;
use nanodist::sync::compress::{self, powersgd::PowerSgd, radius::Radius, topk::TopK, Reducer};
use rand::{Rng, SeedableRng};

use crate::common;
use crate::common::{make_data, on_ranks, tiny_config};

/// A vector, two matrices of different shapes and one of the same shape as the first.
pub(crate) fn tensors() -> Vec<Segment> {
    let shapes: [(usize, usize, bool); 4] =
        [(7, 1, false), (12, 9, true), (6, 20, true), (12, 9, true)];
    Segment::from_shapes(&shapes)
}

pub(crate) fn numel() -> usize {
    tensors().iter().map(|t| t.len).sum()
}

pub(crate) fn gradient(rank: usize, step: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rank as u64 * 1000 + step);
    (0..numel())
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect()
}

fn dense_mean(n: usize, step: u64) -> Vec<f32> {
    let mut out = gradient(0, step);
    for r in 1..n {
        out.iter_mut()
            .zip(gradient(r, step))
            .for_each(|(o, g)| *o += g);
    }
    out.iter_mut().for_each(|o| *o *= 1.0 / n as f32);
    out
}

/// Runs `steps` reductions of `gradient(rank, step)` on `n` ranks; returns each rank's outputs per step
/// and its final reducer state.
fn run(
    n: usize,
    steps: u64,
    make: impl Fn() -> Box<dyn Reducer> + Sync,
) -> Vec<(Vec<Vec<f32>>, compress::State)> {
    on_ranks(n, |mut comm: Box<dyn Communicator>| {
        let mut r = make();
        let outs = (0..steps)
            .map(|s| {
                let mut g = gradient(comm.rank(), s);
                r.reduce(comm.as_mut(), &mut g, s).unwrap();
                g
            })
            .collect();
        (outs, r.state().unwrap())
    })
}

/// Radius at density 0.1 with +-1 windows, dense at step 0 and re-selecting at steps 1, 4, 7, ...
pub(crate) fn reselecting_radius() -> RadiusConfig {
    RadiusConfig {
        density: 0.1,
        interval: 3,
        threshold: 1,
        range: 1,
        ..RadiusConfig::default()
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn powersgd(f: impl FnOnce(&mut PowerSgdConfig)) -> PowerSgdConfig {
    let mut c = PowerSgdConfig {
        start_iter: 2,
        ..PowerSgdConfig::default()
    };
    f(&mut c);
    c
}

#[test]
fn full_density_topk_is_dense_allreduce_bit_for_bit() {
    let n = 4;
    for (outs, _) in run(n, 3, || Box::new(TopK::new(tensors(), 1.0, true))) {
        for (s, o) in outs.iter().enumerate() {
            assert_eq!(o, &dense_mean(n, s as u64), "step {s}");
        }
    }
}

#[test]
fn full_rank_powersgd_is_dense_allreduce() {
    let n = 3;
    let cfg = powersgd(|c| {
        c.rank = 100;
        c.min_compression_rate = 0.0;
    });
    for batch in [false, true] {
        let cfg = PowerSgdConfig {
            batch_same_shape: batch,
            ..cfg.clone()
        };
        for (outs, _) in run(n, 5, || Box::new(PowerSgd::new(tensors(), cfg.clone(), 7))) {
            for (s, o) in outs.iter().enumerate() {
                let d = max_diff(o, &dense_mean(n, s as u64));
                assert!(d < 1e-4, "batch {batch} step {s}: {d}");
            }
        }
    }
}

/// Top-k on a shared replica decodes only the rank's part (`Reducer::decode_part`): on that part the
/// reduced gradient of the full decoding, bit for bit, over steps with error feedback (the rest is left
/// unread), with parts that cut tensors in the middle, start at zero, end at the end, and one that is
/// empty.
#[test]
fn topk_decoding_a_part_gives_that_part_of_the_full_decoding() {
    let (n, steps, len) = (3, 4, numel());
    let full = run(n, steps, || Box::new(TopK::new(tensors(), 0.2, true)));
    for part in [0..50, 50..len, 13..200, 100..100] {
        let parts = on_ranks(n, |mut comm: Box<dyn Communicator>| {
            let mut r = TopK::new(tensors(), 0.2, true);
            r.decode_part(part.clone());
            (0..steps)
                .map(|s| {
                    let mut g = gradient(comm.rank(), s);
                    r.reduce(comm.as_mut(), &mut g, s).unwrap();
                    g
                })
                .collect::<Vec<_>>()
        });
        for (rank, (outs, (want, _))) in parts.iter().zip(&full).enumerate() {
            for (s, (got, want)) in outs.iter().zip(want).enumerate() {
                let at = format!("part {part:?}, rank {rank}, step {s}");
                assert_eq!(bits(&got[part.clone()]), bits(&want[part.clone()]), "{at}");
            }
        }
    }
}

#[test]
fn error_feedback_conserves_mass() {
    // n * sum_t output_t + sum_r residual_r = sum_{r,t} g_{r,t}: nothing is lost, only delayed.
    let n = 3;
    let steps = 6u64;
    let check = |name: &str, results: Vec<(Vec<Vec<f32>>, compress::State)>, buffer: &str| {
        let mut lhs = vec![0.0f64; numel()];
        for o in &results[0].0 {
            lhs.iter_mut()
                .zip(o)
                .for_each(|(l, x)| *l += n as f64 * *x as f64);
        }
        for (_, state) in &results {
            let (_, res) = state.iter().find(|(k, _)| k == buffer).expect(buffer);
            lhs.iter_mut().zip(res).for_each(|(l, x)| *l += *x as f64);
        }
        let mut rhs = vec![0.0f64; numel()];
        for r in 0..n {
            for s in 0..steps {
                rhs.iter_mut()
                    .zip(gradient(r, s))
                    .for_each(|(l, x)| *l += x as f64);
            }
        }
        let d = lhs
            .iter()
            .zip(&rhs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(d < 1e-4, "{name}: {d}");
        // And compression did happen: this reducer's residual buffer is not zero on any rank.
        for (rank, (_, state)) in results.iter().enumerate() {
            let (_, res) = state.iter().find(|(k, _)| k == buffer).expect(buffer);
            assert!(
                res.iter().any(|&x| x != 0.0),
                "{name}: rank {rank}'s {buffer} is all zero"
            );
        }
    };
    check(
        "topk",
        run(n, steps, || Box::new(TopK::new(tensors(), 0.1, true))),
        "residual",
    );
    // Re-selections at steps 1 and 4 clear the residual; the last step (5) is a stable one.
    let radius = reselecting_radius();
    check(
        "radius",
        run(n, steps, || {
            Box::new(Radius::new(tensors(), radius.clone()))
        }),
        "residual",
    );
    for single in [false, true] {
        let cfg = powersgd(|c| c.single_allreduce = single);
        check(
            "powersgd",
            run(n, steps, || {
                Box::new(PowerSgd::new(tensors(), cfg.clone(), 3))
            }),
            "error",
        );
    }
}

/// PowerSGD's error feedback is the reducer without it, run on the gradient plus the error kept outside
/// (e = what it was given - what it applied): the same outputs, logged errors and error buffer, bit for
/// bit, with and without the single all-reduce, at a thin rank and at one the GEMM computes.
#[test]
fn powersgd_error_feedback_is_the_plain_reducer_on_the_accumulated_input() {
    let (n, steps) = (3, 6u64);
    for (single, rank) in [(false, 2), (true, 2), (false, 9), (true, 9)] {
        let cfg = |ef: bool| {
            powersgd(|c| {
                (c.single_allreduce, c.rank, c.error_feedback) = (single, rank, ef);
                c.min_compression_rate = 0.0;
            })
        };
        let (with, without) = (cfg(true), cfg(false));
        let runs = on_ranks(n, |mut comm: Box<dyn Communicator>| {
            let me = comm.rank();
            let (mut fed, mut plain) = (
                PowerSgd::new(tensors(), with.clone(), 3),
                PowerSgd::new(tensors(), without.clone(), 3),
            );
            let mut error = vec![0.0f32; numel()];
            let mut rows = Vec::new();
            for s in 0..steps {
                let mut g = gradient(me, s);
                let a = fed.reduce(comm.as_mut(), &mut g, s).unwrap().error;
                let mut input: Vec<f32> = gradient(me, s)
                    .iter()
                    .zip(&error)
                    .map(|(g, e)| g + e)
                    .collect();
                let kept = input.clone();
                let b = plain.reduce(comm.as_mut(), &mut input, s).unwrap().error;
                if s >= 2 {
                    error = kept.iter().zip(&input).map(|(x, y)| x - y).collect();
                }
                rows.push((
                    bits(&g),
                    bits(&input),
                    a.map(f64::to_bits),
                    b.map(f64::to_bits),
                ));
            }
            let state = fed.state().unwrap();
            let (_, kept) = state.iter().find(|(k, _)| k == "error").expect("error");
            (rows, bits(kept), bits(&error))
        });
        for (rank_of, (rows, kept, error)) in runs.into_iter().enumerate() {
            for (s, (fed, plain, a, b)) in rows.into_iter().enumerate() {
                assert_eq!(
                    fed, plain,
                    "single {single} rank {rank}: rank {rank_of}'s step {s}"
                );
                assert_eq!(a, b, "the logged error, rank {rank_of}'s step {s}");
            }
            assert_eq!(
                kept, error,
                "single {single} rank {rank}: rank {rank_of}'s error buffer"
            );
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn powersgd_is_exact_on_rank_r_input() {
    // Every rank's matrix is U V_r^T with a shared U (rows x 2): the average has rank 2.
    let (rows, cols, r, n) = (10, 8, 2, 3);
    let t = vec![Segment {
        offset: 0,
        len: rows * cols,
        rows,
        cols,
        matrix: true,
    }];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    let u: Vec<f32> = (0..rows * r).map(|_| rng.random_range(-1.0..1.0)).collect();
    let v: Vec<Vec<f32>> = (0..n)
        .map(|_| (0..cols * r).map(|_| rng.random_range(-1.0..1.0)).collect())
        .collect();
    let m = |k: usize| -> Vec<f32> {
        (0..rows * cols)
            .map(|e| {
                (0..r)
                    .map(|j| u[(e / cols) * r + j] * v[k][(e % cols) * r + j])
                    .sum()
            })
            .collect()
    };
    let mean: Vec<f32> = (0..rows * cols)
        .map(|e| (0..n).map(|k| m(k)[e]).sum::<f32>() / n as f32)
        .collect();
    let cfg = powersgd(|c| {
        c.rank = r;
        c.start_iter = 0;
        c.error_feedback = false;
        c.warm_start = false;
        c.min_compression_rate = 0.0;
    });
    let outs = on_ranks(n, |mut comm: Box<dyn Communicator>| {
        let mut p = PowerSgd::new(t.clone(), cfg.clone(), 1);
        let mut g = m(comm.rank());
        p.reduce(comm.as_mut(), &mut g, 0).unwrap();
        g
    });
    for o in outs {
        assert!(max_diff(&o, &mean) < 1e-4, "{}", max_diff(&o, &mean));
    }
}

#[test]
fn radius_mask_with_identical_inputs_is_the_top_k_of_the_average() {
    let n = 4;
    let cfg = RadiusConfig {
        density: 0.2,
        interval: 3,
        threshold: 0,
        range: 0,
        ..RadiusConfig::default()
    };
    let masks = on_ranks(n, |mut comm: Box<dyn Communicator>| {
        let mut r = Radius::new(tensors(), cfg.clone());
        let mut g = gradient(0, 0); // the same on every rank
        r.reduce(comm.as_mut(), &mut g, 0).unwrap();
        r.mask().to_vec()
    });
    let g = gradient(0, 0);
    let mut want = Vec::new();
    for t in tensors() {
        if !t.matrix {
            want.extend(t.offset as u32..(t.offset + t.len) as u32);
            continue;
        }
        let k = ((0.2 * t.len as f64) as usize).max(1);
        let mut order: Vec<usize> = t.range().collect();
        order.sort_by(|&a, &b| g[b].abs().total_cmp(&g[a].abs()));
        let mut top: Vec<u32> = order[..k].iter().map(|&i| i as u32).collect();
        top.sort();
        want.extend(top);
    }
    for m in masks {
        assert_eq!(m, want);
    }
}

#[test]
fn radius_stable_steps_send_only_the_masked_values() {
    let n = 2;
    let cfg = RadiusConfig {
        density: 0.1,
        interval: 5,
        threshold: 2,
        range: 0,
        ..RadiusConfig::default()
    };
    let per_step = on_ranks(n, |mut comm: Box<dyn Communicator>| {
        let mut r = Radius::new(tensors(), cfg.clone());
        (0..5u64)
            .map(|s| {
                let before = comm.stats().bytes_sent;
                let mut g = gradient(comm.rank(), s);
                r.reduce(comm.as_mut(), &mut g, s).unwrap();
                (comm.stats().bytes_sent - before, r.mask().len())
            })
            .collect::<Vec<_>>()
    });
    let dense = nanodist::comm::all_reduce_bytes(numel(), n, 0);
    let steps = &per_step[0];
    assert_eq!(steps[0].0, dense, "dense before threshold");
    assert_eq!(steps[2].0, dense, "re-selection is dense");
    let mask = steps[3].1;
    assert!(mask < numel() / 2);
    assert_eq!(
        steps[3].0,
        nanodist::comm::all_reduce_bytes(mask, n, 0),
        "stable step"
    );
}

fn train(dir: &Path, name: &str, workers: usize, set: &[String]) -> Vec<Row> {
    let set: Vec<&str> = set.iter().map(String::as_str).collect();
    common::rows_of(&common::train_config(
        &tiny_config(dir, name),
        workers,
        &set,
    ))
}

fn reducer_settings() -> Vec<(&'static str, String)> {
    vec![
        ("topk", r#"train.compression={ name = "topk", density = 0.05 }"#.into()),
        (
            "radius",
            r#"train.compression={ name = "radius", density = 0.05, interval = 4, threshold = 3, range = 1 }"#.into(),
        ),
        ("powersgd", r#"train.compression={ name = "powersgd", rank = 2, start_iter = 3 }"#.into()),
        (
            "radius-correction",
            r#"train.compression={ name = "radius", density = 0.05, interval = 4, threshold = 3, range = 1, correction = true }"#.into(),
        ),
        (
            "powersgd1",
            r#"train.compression={ name = "powersgd", rank = 2, start_iter = 3, single_allreduce = true }"#.into(),
        ),
    ]
}

#[test]
fn each_reducer_trains_reports_its_metrics_and_resumes_exactly() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let dense = train(d.path(), "dense", 2, &[]);
    for (name, setting) in reducer_settings() {
        let set = vec![setting.clone(), "log.ckpt_interval=0".into()];
        let full = train(d.path(), &format!("{name}-full"), 2, &set);
        let first = full[0].train_loss;
        let last = full.last().unwrap();
        assert!(
            last.train_loss < first - 0.3,
            "{name} learns: {first} -> {}",
            last.train_loss
        );
        let dense_val = dense.last().unwrap().val_loss.unwrap();
        assert!(
            last.val_loss.unwrap() < dense_val * 1.25,
            "{name}: {:?} vs dense {dense_val}",
            last.val_loss
        );
        let late = &full[10];
        assert!(
            late.compression_ratio.unwrap() > 1.5,
            "{name}: {:?}",
            late.compression_ratio
        );
        let e = late.compression_error.unwrap();
        assert!(e > 0.0 && e < 1.0, "{name}: error {e}");
        if name.starts_with("powersgd") {
            let f = late.compressed_fraction.unwrap();
            assert!(f > 0.5 && f < 1.0, "{name}: fraction {f}");
            // Steps 0-2 (rows 1-3) are dense: nothing compressed, no fraction; step 3 compresses.
            assert!(full[..3].iter().all(|r| r.compressed_fraction.is_none()));
            assert_eq!(full[3].compressed_fraction, Some(f));
        }
        if name.starts_with("radius") {
            assert!(
                full.iter().any(|r| r.topk_overlap.is_some()),
                "radius reports overlap"
            );
        }
        // Stop at step 9 (mid-interval, residuals non-zero) and resume: the same run, bit for bit.
        let run = format!("{name}-resumed");
        let mut stop = set.clone();
        stop.push("train.exit_interval=9".into());
        train(d.path(), &run, 2, &stop);
        let resumed = train(d.path(), &run, 2, &set);
        assert_eq!(resumed.len(), full.len(), "{name}");
        for (a, b) in full.iter().zip(&resumed) {
            assert_eq!(
                (
                    a.step,
                    a.train_loss,
                    a.grad_norm,
                    a.val_loss,
                    a.compression_error
                ),
                (
                    b.step,
                    b.train_loss,
                    b.grad_norm,
                    b.val_loss,
                    b.compression_error
                ),
                "{name}: step {}",
                a.step
            );
        }
    }
}

#[test]
fn a_dense_checkpoint_switches_to_a_compressed_run_with_one_change() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let dense = vec!["train.exit_interval=10".to_string()];
    train(d.path(), "dense", 2, &dense);
    let ckpt = d.path().join("log/dense");
    let set = vec![
        reducer_settings()[1].1.clone(),
        format!("checkpoint={:?}", ckpt.display().to_string()),
    ];
    let rows = train(d.path(), "switched", 2, &set);
    assert_eq!(rows.first().unwrap().step, 11, "continues from step 10");
    assert!(rows
        .iter()
        .any(|r| r.compression_ratio.is_some_and(|c| c > 1.5)));
}

/// Max relative difference of train loss, grad norm and val loss between two runs' rows.
fn max_rel_diff(a: &[Row], b: &[Row]) -> f64 {
    assert_eq!(a.len(), b.len());
    let rel = |x: f64, y: f64| (x - y).abs() / y.abs().max(1e-12);
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert_eq!(x.step, y.step);
            let v = match (x.val_loss, y.val_loss) {
                (Some(p), Some(q)) => rel(p, q),
                _ => 0.0,
            };
            rel(x.train_loss, y.train_loss)
                .max(rel(x.grad_norm, y.grad_norm))
                .max(v)
        })
        .fold(0.0, f64::max)
}

/// Adam inside the reducer with SGD outside is AdamW on the reduced gradient: the same run as the plain
/// mode up to float rounding; a checkpoint moves between the modes (and from a dense run) with its Adam
/// state, so a switched run continues the same trajectory.
#[test]
fn radius_correction_equals_the_plain_mode_and_checkpoints_move_between_them() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let radius = |correction: bool| {
        format!(
            r#"train.compression={{ name = "radius", density = 0.05, interval = 4, threshold = 3, range = 1, correction = {correction} }}"#
        )
    };
    let plain = train(d.path(), "plain", 2, &[radius(false)]);
    let corrected = train(d.path(), "corrected", 2, &[radius(true)]);
    let diff = max_rel_diff(&corrected, &plain);
    assert!(diff < 1e-4, "correction vs plain: {diff}");
    assert!(corrected
        .iter()
        .any(|r| r.compression_ratio.is_some_and(|c| c > 1.5)));

    // Plain mode stopped at step 8, resumed with correction (and the reverse): the same runs.
    for (first, then, reference) in [(false, true, &plain), (true, false, &corrected)] {
        let run = format!("switch-{first}-{then}");
        train(
            d.path(),
            &run,
            2,
            &[radius(first), "train.exit_interval=8".into()],
        );
        let ckpt = d.path().join(format!("log/{run}"));
        let cont = train(
            d.path(),
            &format!("{run}-cont"),
            2,
            &[
                radius(then),
                format!("checkpoint={:?}", ckpt.display().to_string()),
            ],
        );
        assert_eq!(cont[0].step, 9, "{run} continues from step 8");
        let tail: Vec<Row> = reference.iter().filter(|r| r.step > 8).cloned().collect();
        let cont_tail: Vec<Row> = cont.iter().filter(|r| r.step > 8).cloned().collect();
        let diff = max_rel_diff(&cont_tail, &tail);
        assert!(diff < 1e-4, "{run}: {diff}");
    }
}

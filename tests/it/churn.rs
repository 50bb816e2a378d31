//! Workers that come and go (`[train.membership]`): an empty schedule is today's run, every method
//! trains through leaves and returns and resumes bit for bit while a worker is away, DiLoCo's outer
//! average is over the workers present and a worker back starts from the global model, and the config
//! says what it cannot do.

use std::path::Path;

use nanodist::comm::Regroup;
use nanodist::config::backend::{DilocoConfig, PowerSgdConfig, SparseLocoConfig};
use nanodist::kernels::Segment;
use nanodist::metrics::Row;
use nanodist::plan::LaunchEnv;
use nanodist::sync::compress::{
    correction::Corrected, powersgd::PowerSgd, radius::Radius, sparseloco::SparseLoco, topk::TopK,
    Reducer, State,
};
use nanodist::sync::{diloco::Diloco, SyncBackend};

use crate::common;
use crate::common::{exact, make_data, on_ranks};
use crate::compression::{gradient, numel, reselecting_radius, tensors};

/// Worker 2 misses steps 4 to 9, worker 3 leaves after step 6 for good, worker 1 computes 3x as long;
/// the simulated clock runs on wan-1g.
const AWAY: &str = "train.membership={ absences = [{ worker = 2, from = 3, until = 9 }, { worker = 3, from = 6 }], \
                    stragglers = [{ worker = 1, slowdown = 3.0 }], cluster = \"wan-1g\" }";

/// `exact` and the simulated clock.
fn exact_in_time(r: &Row) -> impl PartialEq + std::fmt::Debug {
    (exact(r), r.sim_s.map(f64::to_bits))
}

fn rows(dir: &Path, name: &str, set: &[&str]) -> Vec<Row> {
    common::rows_of(&common::train_tiny(dir, name, 4, set))
}

#[test]
fn an_empty_schedule_is_todays_run_bit_for_bit() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    for (i, set) in [
        &[][..],
        &[
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 4 }",
        ],
    ]
    .into_iter()
    .enumerate()
    {
        let today = rows(d.path(), &format!("today{i}"), set);
        let mut empty = set.to_vec();
        empty.push("train.membership={ absences = [] }");
        let with = rows(d.path(), &format!("empty{i}"), &empty);
        assert_eq!(
            today.iter().map(exact).collect::<Vec<_>>(),
            with.iter().map(exact).collect::<Vec<_>>()
        );
        assert!(with.iter().all(|r| r.workers.is_none()));
    }
}

/// Every method the schedule supports, through a leave, a return and a leave for good; stopped while
/// a worker is away (step 7) and resumed, it equals the run that never stopped, and it learns.
#[test]
fn every_method_trains_through_leaves_and_returns_and_resumes_mid_absence_bit_for_bit() {
    let cases: [(&str, &[&str]); 11] = [
        ("allreduce", &[]),
        (
            "topk",
            &["train.compression={ name = \"topk\", density = 0.1 }"],
        ),
        (
            "radius-correction",
            &["train.compression={ name = \"radius\", density = 0.05, interval = 4, threshold = 3, range = 1, correction = true }"],
        ),
        (
            "diloco-powersgd",
            &[
                "train.backend=\"diloco\"",
                "train.diloco={ sync_every = 2 }",
                "train.compression={ name = \"powersgd\", rank = 2, start_iter = 2 }",
            ],
        ),
        (
            "exp-overlap",
            &["train.backend=\"decentdp\"", "train.topology=\"exp\""],
        ),
        (
            "ring",
            &[
                "train.backend=\"decentdp\"",
                "train.topology=\"ring\"",
                "train.overlap=false",
            ],
        ),
        (
            "choco",
            &[
                "train.backend=\"decentdp\"",
                "train.topology=\"ring\"",
                "train.compression={ name = \"topk\", density = 0.3 }",
            ],
        ),
        (
            "diloco",
            &[
                "train.backend=\"diloco\"",
                "train.diloco={ sync_every = 4 }",
            ],
        ),
        (
            "streaming",
            &[
                "train.backend=\"diloco\"",
                "train.diloco={ sync_every = 4, fragments = 2, fragment_alpha = 0.5 }",
            ],
        ),
        (
            "sparta",
            &["train.backend=\"sparta\"", "train.sparta={ p = 0.1 }"],
        ),
        (
            "demo",
            &[
                "train.backend=\"demo\"",
                "train.optim={ name = \"sgd\", weight_decay = 0.01 }",
                "train.demo={ topk = 8, chunk = 16 }",
            ],
        ),
    ];
    for (name, set) in cases {
        trains_through_churn_and_resumes_mid_absence(name, set);
    }
}

/// One method of `every_method_trains_through_leaves_and_returns_and_resumes_mid_absence_bit_for_bit`:
/// its workers per row, the batch that shrinks with them, the resume at step 7, the simulated clock,
/// and the loss it reaches.
fn trains_through_churn_and_resumes_mid_absence(name: &str, set: &[&str]) {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let mut set = set.to_vec();
    set.push(AWAY);
    let full = rows(d.path(), "full", &set);
    let workers: Vec<u64> = full.iter().map(|r| r.workers.unwrap()).collect();
    let want: Vec<u64> = (1..=20)
        .map(|s| match s {
            1..=3 => 4,
            4..=6 => 3,
            7..=9 => 2,
            _ => 3,
        })
        .collect();
    assert_eq!(workers, want, "{name}: workers present per row");
    // Each worker keeps its batch: the global batch shrinks with the workers.
    assert!(
        full.iter().all(|r| r.batch_size == 2 * r.workers.unwrap()),
        "{name}"
    );
    let mut first = set.clone();
    first.push("train.exit_interval=7");
    let s = common::train_tiny(d.path(), "cut", 4, &first);
    assert_eq!(s.step, 7, "{name}");
    let cut = rows(d.path(), "cut", &set);
    assert_eq!(
        full.iter().map(exact_in_time).collect::<Vec<_>>(),
        cut.iter().map(exact_in_time).collect::<Vec<_>>(),
        "{name}: resumed while workers 2 and 3 were away"
    );
    let clock: Vec<f64> = full.iter().map(|r| r.sim_s.unwrap()).collect();
    assert!(
        clock[0] > 0.0 && clock.windows(2).all(|w| w[0] <= w[1]),
        "{name}: {clock:?}"
    );
    let last = full.last().unwrap().val_loss.unwrap();
    assert!(last < full[0].train_loss - 0.3, "{name} learns: {last}");
}

fn diloco(c: Box<dyn nanodist::comm::Communicator>) -> Diloco {
    let cfg = DilocoConfig {
        sync_every: 2,
        ..Default::default()
    };
    Diloco::new(
        c,
        cfg,
        Segment::from_shapes(&[(4, 8, true), (8, 1, false)]),
        None,
    )
    .unwrap()
}

/// Rank r's parameters at inner step `step` (what its optimizer would have made of them).
fn params_at(rank: usize, step: u64) -> Vec<f32> {
    (0..40)
        .map(|i| ((i * 7 + rank * 13 + step as usize * 5) % 23) as f32 / 23.0 - 0.5)
        .collect()
}

/// Inner steps `steps` of DiLoCo on one rank; returns the parameters after the last.
fn inner_steps(d: &mut Diloco, rank: usize, steps: std::ops::Range<u64>) -> Vec<f32> {
    // The replicas start alike, as the model's initial weights.
    let mut p = params_at(if steps.start == 0 { 0 } else { rank }, steps.start);
    for s in steps {
        d.before_step(&mut p).unwrap();
        let next = params_at(rank, s + 1);
        p.iter_mut().zip(&next).for_each(|(x, y)| *x += 0.1 * y);
        d.after_step(&mut p, s).unwrap();
    }
    p
}

/// Four workers sync once; worker 3 leaves; the others' next sync equals that of a world of three
/// holding the same state. Worker 3 then comes back, copies a live peer's recovery state, and continues
/// from the global model.
#[test]
fn diloco_averages_over_the_workers_present_and_a_worker_back_starts_from_the_global_model() {
    let shared = std::sync::Mutex::new((Vec::new(), None));
    let four = on_ranks(4, |c| {
        let rank = c.rank();
        let mut d = diloco(c);
        inner_steps(&mut d, rank, 0..2);
        let state = d.state().unwrap();
        let all = [0, 1, 2, 3];
        let r = d.comm_mut().regroup(2, &all, &[0, 1, 2]).unwrap();
        assert_eq!(
            r,
            if rank == 3 {
                Regroup::Away
            } else {
                Regroup::Member
            }
        );
        let mut after = None;
        if rank < 3 {
            after = Some(inner_steps(&mut d, rank, 2..4));
        }
        // Worker 3 comes back at step 4: worker 2, its neighbour, hands it the global state.
        assert_eq!(
            d.comm_mut().regroup(4, &[0, 1, 2], &all).unwrap(),
            Regroup::Member
        );
        if rank == 2 {
            shared.lock().unwrap().1 = Some(d.recovery_state().unwrap());
        }
        d.comm_mut().barrier().unwrap();
        let mut p = params_at(2, 4);
        if rank == 3 {
            let peer = shared.lock().unwrap().1.clone().unwrap();
            d.recovered(peer, &mut p).unwrap();
        }
        let mut global = Vec::new();
        let global = d.average(&[], &mut global).unwrap().0.to_vec();
        if rank == 3 {
            assert_eq!(p, global, "the worker back continues from the global model");
        }
        (state, after, global)
    });
    shared.lock().unwrap().0 = four.iter().map(|(s, _, _)| s.clone()).collect();
    let three = on_ranks(3, |c| {
        let rank = c.rank();
        let mut d = diloco(c);
        d.load_state(shared.lock().unwrap().0[rank].clone())
            .unwrap();
        inner_steps(&mut d, rank, 2..4)
    });
    for rank in 0..3 {
        let elastic = four[rank].1.as_ref().unwrap();
        let close = elastic
            .iter()
            .zip(&three[rank])
            .all(|(a, b)| (a - b).abs() <= 1e-6);
        assert!(close, "rank {rank}: {elastic:?} vs {:?}", three[rank]);
    }
    // Every worker, the one back included, holds the same global model.
    assert!(four.iter().all(|(_, _, g)| *g == four[0].2));
}

fn problems(set: &[&str]) -> String {
    let d = tempfile::tempdir().unwrap();
    let src = common::config(d.path(), Some("r"), &[]);
    let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
    let launch = LaunchEnv {
        workers_flag: Some(4),
        ..Default::default()
    };
    match nanodist::plan::load_str(Path::new("t.toml"), &src, &set, &launch) {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn schedules_that_cannot_run_are_refused_with_the_key_and_the_fix() {
    let cases: [(&str, &[&str]); 7] = [
        (
            "train.membership={ stragglers = [{ worker = 1, slowdown = 2.0 }, { worker = 1, slowdown = 3.0 }] }",
            &["stragglers[1].worker", "listed twice"],
        ),
        (
            "train.membership={ absences = [{ worker = 0, from = 3 }] }",
            &["train.membership.absences[0].worker", "worker 0 writes"],
        ),
        (
            "train.membership={ absences = [{ worker = 1, from = 3, until = 8 }, { worker = 1, from = 5 }] }",
            &["absences[1].from", "overlap"],
        ),
        (
            "train.membership={ absences = [{ worker = 1, from = 20 }] }",
            &["absences[0].from", "never leave"],
        ),
        (
            "train.membership={ absences = [{ worker = 1, from = 4, until = 4 }] }",
            &["absences[0].until", "after from"],
        ),
        (
            "train.membership={ mean_steps_up = 10.0 }",
            &["train.membership.down_steps", "needs both"],
        ),
        (
            "train.membership={ absences = [{ worker = 4, from = 2 }] }",
            &["worker 4 cannot leave", "1 to 3"],
        ),
    ];
    for (set, want) in cases {
        let e = problems(&[set]);
        for w in want {
            assert!(e.contains(w), "{set}: {w:?} not in {e}");
        }
    }
    let mpi = problems(&["train.engine=\"mpi\"", AWAY]);
    assert!(mpi.contains("simulated by the local engine"), "{mpi}");
    let topk = "train.compression={ name = \"topk\", density = 0.1 }";
    assert_eq!(problems(&[topk, AWAY]), "");
    assert_eq!(problems(&[AWAY]), "");
}

#[test]
fn check_refuses_a_clock_on_a_cluster_that_does_not_exist_and_creates_nothing() {
    let d = tempfile::tempdir().unwrap();
    make_data(d.path());
    let cfg = d.path().join("c.toml");
    let set = ["train.membership={ cluster = \"nope\" }"];
    std::fs::write(&cfg, common::config(d.path(), Some("r"), &set)).unwrap();
    for cmd in ["check", "train"] {
        let out = common::nanodist(&[cmd, cfg.to_str().unwrap(), "--workers", "2"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{cmd}: {err}");
        assert!(
            err.contains("train.membership.cluster = \"nope\"") && err.contains("wan-1g"),
            "{err}"
        );
    }
    assert!(!d.path().join("log").join("r").exists());
}

type MakeReducer = Box<dyn Fn() -> Box<dyn Reducer> + Sync>;

/// The reducers a worker can come back to, each with the name of its own (error feedback) buffer.
fn reducers() -> Vec<(&'static str, &'static str, MakeReducer)> {
    // Re-selections at steps 1 and 4: the peers choose a mask while the worker is away.
    let radius = reselecting_radius();
    let powersgd = |single_allreduce| PowerSgdConfig {
        start_iter: 1,
        single_allreduce,
        ..PowerSgdConfig::default()
    };
    let sparseloco = SparseLocoConfig {
        density: 0.2,
        chunk: 16,
        bits: 4,
        error_decay: 0.9,
    };
    let plain = radius.clone();
    vec![
        (
            "topk",
            "residual",
            Box::new(|| Box::new(TopK::new(tensors(), 0.2, true))),
        ),
        (
            "radius",
            "residual",
            Box::new(move || Box::new(Radius::new(tensors(), plain.clone()))),
        ),
        (
            "radius-correction",
            "residual",
            Box::new(move || {
                let inner = Box::new(Radius::new(tensors(), radius.clone()));
                Box::new(Corrected::new(inner, numel(), [0.9, 0.95], 1e-8, 1.0))
            }),
        ),
        (
            "powersgd",
            "error",
            Box::new(move || Box::new(PowerSgd::new(tensors(), powersgd(false), 3))),
        ),
        (
            "powersgd-single",
            "error",
            Box::new(move || Box::new(PowerSgd::new(tensors(), powersgd(true), 3))),
        ),
        (
            "sparseloco",
            "residual",
            Box::new(move || Box::new(SparseLoco::new(tensors(), &sparseloco))),
        ),
    ]
}

/// What rank 0 holds when rank 2 comes back: its shared state and its whole state.
struct Donor {
    shared: State,
    state: State,
}

/// Three ranks reduce steps 0 to 2; rank 2 is away for steps 3 and 4 and comes back at 5, where
/// `rejoin` gives it what rank 0 holds; all three reduce steps 5 and 6. Returns each rank's outputs of
/// steps 5 and 6 and its state after them.
fn away_and_back(
    make: &MakeReducer,
    rejoin: &(dyn Fn(&mut Box<dyn Reducer>, &Donor) + Sync),
) -> Vec<(Vec<Vec<f32>>, State)> {
    let donor = std::sync::Mutex::new(None);
    on_ranks(3, |mut c| {
        let (me, mut r) = (c.id(), make());
        let step = |c: &mut Box<dyn nanodist::comm::Communicator>, r: &mut Box<dyn Reducer>, s| {
            let mut g = gradient(me, s);
            r.reduce(c.as_mut(), &mut g, s).unwrap();
            g
        };
        (0..3).for_each(|s| drop(step(&mut c, &mut r, s)));
        c.regroup(3, &[0, 1, 2], &[0, 1]).unwrap();
        if me < 2 {
            (3..5).for_each(|s| drop(step(&mut c, &mut r, s)));
        }
        assert_eq!(c.regroup(5, &[0, 1], &[0, 1, 2]).unwrap(), Regroup::Member);
        if me == 0 {
            *donor.lock().unwrap() = Some(Donor {
                shared: r.shared_state().unwrap(),
                state: r.state().unwrap(),
            });
        }
        c.barrier().unwrap();
        if me == 2 {
            rejoin(&mut r, donor.lock().unwrap().as_ref().unwrap());
        }
        let outs = (5..7).map(|s| step(&mut c, &mut r, s)).collect();
        (outs, r.state().unwrap())
    })
}

/// A compressed reducer's worker coming back (`Reducer::rejoined` with a live peer's `shared_state`)
/// continues exactly as one restored from that peer's whole state with its own error feedback zeroed:
/// the same outputs and states on every rank, bit for bit. (A reducer restarted fresh instead would
/// select its own Radius mask, draw PowerSGD's Q anew, or restart the correction's Adam.)
#[test]
fn a_compressed_reducers_worker_back_takes_the_shared_state_and_zeroes_its_error_feedback() {
    for (name, own, make) in reducers() {
        let rejoined = away_and_back(&make, &|r, d| r.rejoined(d.shared.clone()).unwrap());
        let restored = away_and_back(&make, &|r, d| {
            let mut state = d.state.clone();
            state
                .iter_mut()
                .filter(|(n, _)| n == own)
                .for_each(|(_, b)| b.iter_mut().for_each(|x| *x = 0.0));
            *r = make();
            r.load_state(state).unwrap();
        });
        assert_eq!(rejoined, restored, "{name}");
        // `own` names a buffer the reducer keeps, so the oracle zeroes something.
        let kept = &rejoined[0].1;
        assert!(
            kept.iter()
                .any(|(n, b)| n == own && b.iter().any(|&x| x != 0.0)),
            "{name}: no {own} in {:?}",
            kept.iter().map(|(n, _)| n).collect::<Vec<_>>()
        );
    }
}

//! Each backend's rules: keys that belong to another backend are errors, defaults are filled in, and the
//! rules of topologies, reducers and the low-communication family are checked, giving the `SyncPlan`.

use crate::config::backend::{
    Backend, Compression, DilocoConfig, PowerSgdConfig, Quantize, Topology,
};
use crate::config::tree::Node;
use crate::config::{validate, Config, OptimConfig, Problem};
use crate::sync::choco::{ChocoPlan, Compressor};
use crate::sync::plan::{Correction, ReducerPlan, SyncPlan};

/// The synchronisation plan: keys that belong to another backend are errors, defaults are filled in,
/// and the rules of topologies and reducers are checked. `None` when a problem was found.
pub(super) fn sync_plan(
    cfg: &Config,
    doc: &Node,
    world: usize,
    local_world: Option<usize>,
    problems: &mut Vec<Problem>,
) -> Option<SyncPlan> {
    let t = &cfg.train;
    let before = problems.len();
    let mut add =
        |path: &str, message: String| problems.push(validate::problem_at(doc, path, message));
    owned_keys(t, &mut add);
    if let Some(Compression::PowerSgd(p)) = &t.compression {
        if p.start_fraction.is_some()
            && crate::config::tree::find(doc, "train.compression.start_iter").is_some()
        {
            add(
                "train.compression.start_fraction",
                "give PowerSGD's start as start_iter or as start_fraction, not both".into(),
            );
        }
        if p.start_fraction.is_some() && t.backend == Backend::Diloco {
            add(
                "train.compression.start_fraction",
                "under diloco the reducer's start counts syncs, not steps: give start_iter (syncs)"
                    .into(),
            );
        }
    }
    let plan = match (t.backend, &t.compression) {
        (Backend::PytorchDdp, None) => SyncPlan::AllReduce {
            bucket_elems: ((t.bucket_size_mb.unwrap_or(25.0) * 1e6 / 4.0) as usize).max(1),
        },
        (Backend::PytorchDdp, Some(c)) => SyncPlan::Compressed(reducer_plan(t, c, &mut add)?),
        (Backend::Diloco, c) => {
            let reducer = match c {
                Some(c) => Some(reducer_plan(t, c, &mut add)?),
                None => None,
            };
            diloco_plan(t, reducer, world, &mut add)
        }
        (Backend::Sparta, _) => SyncPlan::Sparta {
            p: t.sparta.clone().unwrap_or_default().p,
            seed: t.seed,
        },
        (Backend::Demo, _) => demo_plan(t, &mut add),
        (Backend::DecentDp, c) => gossip_plan(t, c.as_ref(), world, local_world, &mut add)?,
    };
    (problems.len() == before).then_some(plan)
}

/// Keys that belong to some backends only are errors under the others.
fn owned_keys(t: &crate::config::TrainConfig, add: &mut dyn FnMut(&str, String)) {
    let owners: [(&str, bool, &[Backend]); 7] = [
        (
            "bucket_size_mb",
            t.bucket_size_mb.is_some(),
            &[Backend::PytorchDdp],
        ),
        (
            "compression",
            t.compression.is_some(),
            &[Backend::PytorchDdp, Backend::Diloco, Backend::DecentDp],
        ),
        ("topology", t.topology.is_some(), &[Backend::DecentDp]),
        ("overlap", t.overlap.is_some(), &[Backend::DecentDp]),
        ("diloco", t.diloco.is_some(), &[Backend::Diloco]),
        ("sparta", t.sparta.is_some(), &[Backend::Sparta]),
        ("demo", t.demo.is_some(), &[Backend::Demo]),
    ];
    for (key, _, allowed) in owners.iter().filter(|(_, present, _)| *present) {
        if !allowed.contains(&t.backend) {
            let names: Vec<String> = allowed.iter().map(|b| format!("{:?}", b.name())).collect();
            add(
                &format!("train.{key}"),
                format!(
                    "`{key}` belongs to backend = {}, but backend = {:?}",
                    names.join(" or "),
                    t.backend.name()
                ),
            );
        }
    }
}

/// A reducer's rules: gossip's compressors and CHOCO's consensus step do not reduce gradients;
/// Radius's correction needs AdamW; PowerSGD's state needs dense steps first, and its single all-reduce
/// needs a warm start. `None` when a problem was found.
fn reducer_plan(
    t: &crate::config::TrainConfig,
    c: &Compression,
    add: &mut dyn FnMut(&str, String),
) -> Option<ReducerPlan> {
    if c.consensus_step().is_some() {
        add(
            "train.compression.consensus_step",
            format!(
                "`consensus_step` is CHOCO's, for compressed gossip (backend = \"decentdp\"), but backend = {:?}",
                t.backend.name()
            ),
        );
        return None;
    }
    Some(match c {
        Compression::TopK(k) => ReducerPlan::TopK(k.clone()),
        Compression::RandomK(_) | Compression::Qsgd(_) | Compression::Sign(_) => {
            add(
                "train.compression.name",
                format!(
                    "compressor {:?} compresses gossip messages (CHOCO, backend = \"decentdp\"); under backend = \
                     {:?} the compressors are \"topk\", \"radius\" and \"powersgd\"",
                    c.name(),
                    t.backend.name()
                ),
            );
            return None;
        }
        Compression::Radius(r) => ReducerPlan::Radius {
            cfg: r.clone(),
            correction: radius_correction(t, r.correction, add),
        },
        Compression::PowerSgd(p) => powersgd_plan(t, p, add),
        Compression::SparseLoco(c) if t.backend == Backend::Diloco => {
            ReducerPlan::SparseLoco(c.clone())
        }
        Compression::SparseLoco(_) => {
            add(
                "train.compression.name",
                format!(
                    "\"sparseloco\" compresses DiLoCo's pseudo-gradients (backend = \"diloco\"), but backend = \
                     {:?}; for gradients take \"topk\"",
                    t.backend.name()
                ),
            );
            return None;
        }
    })
}

/// Radius's correction mode: Adam inside the reducer, with train.optim's AdamW betas and eps.
fn radius_correction(
    t: &crate::config::TrainConfig,
    on: bool,
    add: &mut dyn FnMut(&str, String),
) -> Option<Correction> {
    match (&t.optim, on) {
        (_, false) => None,
        (OptimConfig::AdamW(a), true) => Some(Correction {
            betas: a.betas,
            eps: a.eps,
            clip: t.grad_norm_clip,
            weight_decay: a.weight_decay,
        }),
        (other, true) => {
            add(
                "train.compression.correction",
                format!(
                    "correction = true runs Adam inside the reducer with train.optim's betas and eps: \
                     it needs train.optim.name = \"adamw\", found {:?}",
                    other.name()
                ),
            );
            None
        }
    }
}

/// PowerSGD's rules: its state needs dense steps first, and its single all-reduce a warm start. The plan
/// holds the start as a step.
fn powersgd_plan(
    t: &crate::config::TrainConfig,
    p: &PowerSgdConfig,
    add: &mut dyn FnMut(&str, String),
) -> ReducerPlan {
    let start = p.start_step(t.n_steps);
    if start <= 1 && (p.error_feedback || p.warm_start) {
        let (key, given) = match p.start_fraction {
            Some(f) => (
                "start_fraction",
                format!("start_fraction = {f} ({start} steps)"),
            ),
            None => ("start_iter", format!("start_iter = {start}")),
        };
        add(
            &format!("train.compression.{key}"),
            format!(
                "{given} must be > 1 when error_feedback or warm_start is on (as PyTorch's \
                 PowerSGDState requires): their state is allocated during the dense steps before \
                 compression starts"
            ),
        );
    }
    if p.single_allreduce && !p.warm_start {
        add(
            "train.compression.single_allreduce",
            "single_allreduce = true needs warm_start = true (each step reuses the factor averaged \
             by the previous one)"
                .into(),
        );
    }
    ReducerPlan::PowerSgd {
        cfg: PowerSgdConfig {
            start_iter: start,
            start_fraction: None,
            ..p.clone()
        },
        seed: t.seed,
    }
}

/// Gossip's rules: the topology fits the world size and node layout (`sync::topology::fits`); a
/// compressor makes it CHOCO (`choco_plan`). `None` when a problem was found.
fn gossip_plan(
    t: &crate::config::TrainConfig,
    compression: Option<&Compression>,
    world: usize,
    local_world: Option<usize>,
    add: &mut dyn FnMut(&str, String),
) -> Option<SyncPlan> {
    let topology = t.topology.unwrap_or_default();
    let ranks_per_node = match local_world {
        Some(l) => l,
        None if topology == Topology::AlternatingExpRing && world > 1 => {
            add(
                "train.topology",
                "topology \"alternating-exp-ring\" needs the node layout (ranks per node), which the \
                 launcher did not report; set train.ranks_per_node"
                    .into(),
            );
            world
        }
        None => world,
    };
    if let Err(msg) = crate::sync::topology::fits(topology, world, ranks_per_node) {
        add("train.topology", msg);
        return None;
    }
    let choco = match compression {
        Some(c) => Some(choco_plan(t, c, world, ranks_per_node, add)?),
        None => None,
    };
    Some(SyncPlan::Gossip {
        topology,
        // Decent-DP always overlaps the gossip of step t with the compute of step t + 1.
        overlap: t.overlap.unwrap_or(true),
        ranks_per_node,
        choco,
    })
}

/// Compressed gossip's rules: CHOCO's compressors only, no error feedback (the public copies are the
/// memory); the consensus step as given, CHOCO's default, or tuned for "auto".
/// Eager outer steps: the whole model at once, and pieces only of f32 all-reduces, at most one a step.
fn eager_rules(cfg: &DilocoConfig, compressed: bool, add: &mut dyn FnMut(&str, String)) {
    let (h, f) = (cfg.sync_every, cfg.fragments);
    if cfg.eager && f > 1 {
        add(
            "train.diloco.eager",
            format!(
                "eager outer steps overlap the whole model's all-reduce with the next {h} steps; with \
                 fragments = {f} the streaming fragments overlap theirs (fragment_delay): set fragments = 1 \
                 or eager = false"
            ),
        );
    }
    if let Some(p) = cfg.eager_pieces {
        let whole = compressed || cfg.quantize != Quantize::None;
        let why = match (cfg.eager, whole) {
            (false, _) => Some("eager_pieces cuts eager DiLoCo's all-reduce: it needs eager = true".to_string()),
            (true, true) if p > 1 => Some(
                "quantized or compressed pseudo-gradients go in one piece: remove eager_pieces".to_string(),
            ),
            _ if p > h => Some(format!(
                "eager_pieces = {p}: at most sync_every = {h} (one piece beside each step up to the next sync)"
            )),
            _ => None,
        };
        if let Some(why) = why {
            add("train.diloco.eager_pieces", why);
        }
    }
}

fn choco_plan(
    t: &crate::config::TrainConfig,
    c: &Compression,
    world: usize,
    ranks_per_node: usize,
    add: &mut dyn FnMut(&str, String),
) -> Option<ChocoPlan> {
    use crate::config::backend::ConsensusStep;
    let compressor = match c {
        Compression::TopK(k) => {
            if k.error_feedback.is_some() {
                add(
                    "train.compression.error_feedback",
                    "error_feedback does not apply to compressed gossip: CHOCO's public copies are its \
                     memory (what a worker has not sent stays in x - x_hat and goes out in later rounds); \
                     remove the key"
                        .into(),
                );
                return None;
            }
            Compressor::TopK { density: k.density }
        }
        Compression::RandomK(r) => Compressor::RandomK { density: r.density },
        Compression::Qsgd(q) => Compressor::Qsgd {
            levels: q.levels,
            biased: q.biased,
            bucket: q.bucket,
        },
        Compression::Sign(_) => Compressor::Sign,
        Compression::Radius(_) | Compression::PowerSgd(_) | Compression::SparseLoco(_) => {
            add(
                "train.compression.name",
                format!(
                    "compressor {:?} reduces gradients (backend = \"pytorchddp\" or \"diloco\"); compressed \
                     gossip (backend = \"decentdp\", CHOCO) takes \"topk\", \"randomk\", \"qsgd\" or \"sign\"",
                    c.name()
                ),
            );
            return None;
        }
    };
    let (gamma, tuned) = match c.consensus_step() {
        Some(ConsensusStep::Value(g)) => (g, false),
        None => (crate::sync::choco::DEFAULT_GAMMA, false),
        Some(ConsensusStep::Auto(_)) => {
            let rounds = crate::sync::topology::rounds(
                t.topology.unwrap_or_default(),
                world,
                ranks_per_node,
            );
            match rounds.and_then(|r| super::gamma::tuned(&r, compressor, t.seed)) {
                Ok(g) => (g, true),
                Err(e) => {
                    add("train.compression.consensus_step", format!("{e:#}"));
                    return None;
                }
            }
        }
    };
    Some(ChocoPlan {
        compressor,
        gamma,
        tuned,
        seed: t.seed,
    })
}

/// DiLoCo's rules: fragments divide sync_every, the delay fits a period, compression only of whole-model
/// f32 pseudo-gradients.
fn diloco_plan(
    t: &crate::config::TrainConfig,
    reducer: Option<ReducerPlan>,
    world: usize,
    add: &mut dyn FnMut(&str, String),
) -> SyncPlan {
    let cfg = t.diloco.clone().unwrap_or_default();
    let (h, f) = (cfg.sync_every, cfg.fragments);
    if !(world as u64).is_multiple_of(cfg.group_size) {
        add(
            "train.diloco.group_size",
            format!(
                "group_size = {} must divide the world size {world} (groups of consecutive ranks)",
                cfg.group_size
            ),
        );
    }
    if h % f != 0 {
        add(
            "train.diloco.fragments",
            format!("fragments = {f} must divide sync_every = {h} (each fragment syncs every {h} steps, one every {h}/{f})"),
        );
    } else if cfg.fragment_delay >= h / f {
        add(
            "train.diloco.fragment_delay",
            format!(
                "fragment_delay = {} must be smaller than sync_every / fragments = {}: a fragment's all-reduce \
                 must land before the next fragment starts",
                cfg.fragment_delay,
                h / f
            ),
        );
    }
    eager_rules(&cfg, reducer.is_some(), add);
    if f == 1 && (cfg.fragment_delay > 0 || cfg.fragment_alpha > 0.0) {
        add(
            "train.diloco.fragments",
            "fragment_delay and fragment_alpha are streaming DiLoCo settings: they need fragments > 1".into(),
        );
    }
    if let Some(r) = &reducer {
        if f > 1 || cfg.quantize != Quantize::None {
            add(
                "train.compression",
                "[train.compression] compresses whole-model pseudo-gradients: it needs diloco.fragments = 1 \
                 and diloco.quantize = \"none\""
                    .into(),
            );
        }
        if matches!(
            r,
            ReducerPlan::Radius {
                correction: Some(_),
                ..
            }
        ) {
            add(
                "train.compression.correction",
                "correction runs Adam on gradients inside the reducer; DiLoCo's outer optimizer is SGD".into(),
            );
        }
    }
    SyncPlan::Diloco { cfg, reducer }
}

/// DeMo replaces the optimizer: it takes train.optim = "sgd" for its weight decay alone.
fn demo_plan(t: &crate::config::TrainConfig, add: &mut dyn FnMut(&str, String)) -> SyncPlan {
    let cfg = t.demo.clone().unwrap_or_default();
    let weight_decay = match &t.optim {
        OptimConfig::Sgd(s) => {
            if s.momentum != 0.0 || s.nesterov {
                add(
                    "train.optim.momentum",
                    "DeMo keeps its own momentum (train.demo.decay); train.optim.momentum and nesterov must be \
                     unset (DeMo uses train.optim.weight_decay and the lr schedule only)"
                        .into(),
                );
            }
            s.weight_decay
        }
        other => {
            add(
                "train.optim.name",
                format!(
                    "backend = \"demo\" replaces the optimizer with its sign update and uses only the weight decay \
                     and the lr schedule: set train.optim.name = \"sgd\" (with weight_decay), found {:?}",
                    other.name()
                ),
            );
            0.0
        }
    };
    SyncPlan::Demo {
        cfg,
        weight_decay,
        clip: t.grad_norm_clip,
    }
}

//! The planned backend on a described world, and what `check` and the start of a run show of the
//! synchronisation: from the backend's own step descriptions, so the lines say what the run does.

use std::ops::Range;

use anyhow::Result;

use super::{Plan, SyncPlan};
use crate::config::Config;
use crate::sync::trace::{bytes_per_step, patterns, Overlap};
use crate::sync::{topology, SyncBackend};
use crate::units::bytes;

/// The planned backend of `cfg` on a described world (`comm::Shape`, rank 0) that never communicates:
/// its step descriptions are what `check` shows and `predict` prices. The model's parameters are not
/// allocated.
pub fn described(cfg: &Config, plan: &Plan) -> Result<Box<dyn SyncBackend>> {
    let named = crate::model::gpt::layout(&cfg.model, cfg.train.context_length)
        .into_iter()
        .map(|(name, shape, _)| (name, shape));
    let tensors = crate::kernels::Segment::of_shapes(named);
    let comm = Box::new(crate::comm::Shape {
        rank: 0,
        world: plan.world_size,
    });
    crate::sync::build(&plan.sync, comm, tensors)
}

/// What `check` and the start of a run show of the synchronisation, beyond the plan's line: gossip's
/// rounds, what the collectives overlap, and the bytes each worker sends per step in each phase of the
/// run (from the backend's own step descriptions, the accounting the runs log and debug builds check).
pub fn sync_lines(cfg: &Config, plan: &Plan) -> Result<Vec<(&'static str, String)>> {
    let backend = described(cfg, plan)?;
    let backend = backend.as_ref();
    let mut lines = gossip_lines(plan)?;
    let whole = patterns(backend, 0..plan.n_steps);
    if let Some(overlap) = overlap_line(&whole) {
        lines.push(("overlap", overlap));
    }
    let rate = |(mean, max): (f64, f64)| {
        let mut s = format!("{}/step", bytes(mean));
        if max > mean * (1.0 + 1e-9) {
            s += &format!(" (one worker up to {})", bytes(max));
        }
        s
    };
    let (n, world) = (plan.n_steps, plan.world_size);
    let over = |steps: Range<u64>| rate(bytes_per_step(&patterns(backend, steps), world));
    let whole = rate(bytes_per_step(&whole, world));
    let sent = match cfg.train.dense_until().filter(|&s| s < n) {
        Some(start) => format!(
            "{} in steps 0-{} (dense), {} from step {start} (compressed); {whole} over the run",
            over(0..start),
            start - 1,
            over(start..n),
        ),
        None => format!("{whole} over the run's {n} steps"),
    };
    lines.push(("sent per worker", sent));
    Ok(lines)
}

/// Gossip's rounds, and CHOCO's public copies.
fn gossip_lines(plan: &Plan) -> Result<Vec<(&'static str, String)>> {
    let mut lines = Vec::new();
    let SyncPlan::Gossip {
        topology,
        ranks_per_node,
        choco,
        ..
    } = &plan.sync
    else {
        return Ok(lines);
    };
    let rounds = topology::rounds(*topology, plan.world_size, *ranks_per_node)?;
    let mut sizes: Vec<usize> = rounds.iter().flatten().map(|g| g.ranks.len()).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let sizes: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
    lines.push((
        "gossip rounds",
        format!(
            "{} in a cycle (step t mixes in round t mod {}), groups of {} rank(s)",
            rounds.len(),
            rounds.len(),
            sizes.join(" or ")
        ),
    ));
    if choco.is_some() {
        let channels = crate::sync::choco::Channels::new(&rounds, 0, 0)?.count();
        lines.push((
            "public copies",
            format!(
                "{channels} group(s) a worker meets x (copy + memory) = {} model-sized buffers per \
                 worker ({})",
                2 * channels,
                bytes((8 * channels as u64 * plan.n_params) as f64)
            ),
        ));
    }
    Ok(lines)
}

/// What the collectives of the run's steps may overlap, and on how many steps (overlapped gossip mixes
/// step 0 synchronously); None without collectives.
fn overlap_line(
    whole: &std::collections::HashMap<Vec<crate::sync::trace::Collective>, u64>,
) -> Option<String> {
    let mut overlaps: Vec<(Overlap, u64)> = Vec::new();
    for (p, &count) in whole {
        let mut kinds: Vec<Overlap> = p.iter().map(|c| c.overlap).collect();
        kinds.sort_by_key(|&k| k as u8);
        kinds.dedup();
        for kind in kinds {
            match overlaps.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, c)) => *c += count,
                None => overlaps.push((kind, count)),
            }
        }
    }
    overlaps.sort_by_key(|&(k, c)| (std::cmp::Reverse(c), k as u8));
    let several = overlaps.len() > 1;
    let overlap: Vec<String> = overlaps
        .iter()
        .map(|&(kind, count)| {
            let what = match kind {
                Overlap::None => "none (the step waits for its collectives)",
                Overlap::Backward => {
                    "gradient buckets with the backward pass (on a cluster; nanodist's engines reduce after it)"
                }
                Overlap::Compute => "with the next step's forward and backward pass",
            };
            match several {
                true => format!("{what} on {count} step(s)"),
                false => what.to_string(),
            }
        })
        .collect();
    (!overlap.is_empty()).then(|| overlap.join("; "))
}

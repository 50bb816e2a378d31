//! One step's communication as data: the collectives a backend runs in a step, their sizes, groups and
//! what they may overlap with. Each backend describes its own steps (`SyncBackend::step_comm`) from the
//! same state and helpers that size its messages, tests check the description against the bytes the
//! engines count, and the cluster-time model (`crate::predict`) prices it.

use std::collections::HashMap;
use std::ops::Range;

use serde::Serialize;

use super::SyncBackend;
use crate::comm::all_reduce_bytes;

/// A collective over f32 words (the engines move f32 buffers; indices and quantized codes travel as f32 bit
/// patterns).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// The sum of a buffer of `words` over each group (reduce-scatter + all-gather, as a ring).
    AllReduce { words: u64 },
    /// Every member's piece to every other member: member i's piece holds `pieces[i]` words (one entry:
    /// the same for all).
    AllGather { pieces: Vec<u64> },
    /// Member i receives chunk i, of `pieces[i]` words, of every other member's buffer.
    ReduceScatter { pieces: Vec<u64> },
}

/// What a collective may run beside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Nothing: the step waits for it.
    None,
    /// A gradient bucket: it may start once the backward pass has produced its gradients and run while
    /// the backward pass computes the rest (PyTorch DDP's bucketed all-reduce).
    Backward,
    /// Issued by the previous step and run beside this step's forward and backward pass (overlapped
    /// gossip, DiLoCo's delayed fragments).
    Compute,
}

/// One collective of a step.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Collective {
    #[serde(flatten)]
    pub op: Op,
    /// The groups that run it at the same time (ranks in group order); one group of all ranks for a
    /// world collective, a gossip round's groups otherwise.
    pub groups: Vec<Vec<usize>>,
    pub overlap: Overlap,
}

impl Collective {
    /// A collective of all `world` ranks.
    pub fn world(op: Op, world: usize, overlap: Overlap) -> Self {
        Self {
            op,
            groups: vec![(0..world).collect()],
            overlap,
        }
    }

    /// The group `rank` belongs to and its position there.
    fn place(&self, rank: usize) -> Option<(&[usize], usize)> {
        self.groups
            .iter()
            .find_map(|g| g.iter().position(|&r| r == rank).map(|p| (&g[..], p)))
    }

    /// Bytes `rank` sends, as the engines count them.
    pub fn sent_by(&self, rank: usize) -> u64 {
        let Some((group, pos)) = self.place(rank) else {
            return 0;
        };
        let g = group.len();
        if g < 2 {
            return 0;
        }
        match &self.op {
            Op::AllReduce { words } => all_reduce_bytes(*words as usize, g, pos),
            Op::AllGather { pieces } => 4 * (g as u64 - 1) * piece(pieces, pos),
            Op::ReduceScatter { pieces } => {
                4 * (0..g)
                    .filter(|&i| i != pos)
                    .map(|i| piece(pieces, i))
                    .sum::<u64>()
            }
        }
    }

    /// The largest buffer a member holds, in bytes (all-reduce: the buffer; all-gather and reduce-scatter:
    /// the largest piece).
    pub fn bytes(&self) -> u64 {
        4 * match &self.op {
            Op::AllReduce { words } => *words,
            Op::AllGather { pieces } | Op::ReduceScatter { pieces } => {
                pieces.iter().copied().max().unwrap_or(0)
            }
        }
    }

    pub fn name(&self) -> &'static str {
        match self.op {
            Op::AllReduce { .. } => "all-reduce",
            Op::AllGather { .. } => "all-gather",
            Op::ReduceScatter { .. } => "reduce-scatter",
        }
    }
}

fn piece(pieces: &[u64], i: usize) -> u64 {
    match pieces {
        [one] => *one,
        _ => pieces.get(i).copied().unwrap_or(0),
    }
}

/// Bytes `rank` sends over a step's collectives.
pub fn sent_by(step: &[Collective], rank: usize) -> u64 {
    step.iter().map(|c| c.sent_by(rank)).sum()
}

/// How often each pattern of collectives occurs over `steps` (runs repeat a few: dense and compressed
/// steps, gossip rounds, sync points).
pub fn patterns(backend: &dyn SyncBackend, steps: Range<u64>) -> HashMap<Vec<Collective>, u64> {
    let mut out: HashMap<Vec<Collective>, u64> = HashMap::new();
    for s in steps {
        *out.entry(backend.step_comm(s)).or_default() += 1;
    }
    out
}

/// Bytes a worker sends per step over `steps` steps of these `patterns`, as the runs count them: the mean
/// over the `world` workers, and the most that one worker sends.
pub fn bytes_per_step(patterns: &HashMap<Vec<Collective>, u64>, world: usize) -> (f64, f64) {
    let n = patterns.values().sum::<u64>().max(1) as f64;
    let per_rank = (0..world).map(|r| {
        patterns
            .iter()
            .map(|(p, &count)| count as f64 * sent_by(p, r) as f64)
            .sum::<f64>()
            / n
    });
    let (sum, max) = per_rank.fold((0.0, 0.0f64), |(s, m), b| (s + b, m.max(b)));
    (sum / world.max(1) as f64, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_sent_follow_each_collective_and_group() {
        let ar = Collective::world(Op::AllReduce { words: 100 }, 4, Overlap::None);
        // 2 (n - 1) / n of the buffer.
        assert_eq!(ar.sent_by(0), 2 * 3 * 100);
        let pairs = Collective {
            op: Op::AllReduce { words: 10 },
            groups: vec![vec![0, 1], vec![2], vec![3, 4, 5]],
            overlap: Overlap::Compute,
        };
        assert_eq!(pairs.sent_by(1), 40);
        assert_eq!(pairs.sent_by(2), 0);
        assert_eq!(pairs.sent_by(9), 0);
        let ag = Collective::world(Op::AllGather { pieces: vec![3] }, 3, Overlap::None);
        assert_eq!(ag.sent_by(2), 4 * 2 * 3);
        let rs = Collective::world(
            Op::ReduceScatter {
                pieces: vec![1, 2, 3],
            },
            3,
            Overlap::None,
        );
        assert_eq!(rs.sent_by(0), 4 * 5);
        assert_eq!(rs.bytes(), 12);
    }
}

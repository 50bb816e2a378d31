//! Gossip topologies as pure data: a cyclic list of rounds; in each round every rank belongs to exactly
//! one group, and mixes x_i <- w x_i + (1 - w) / (|R| - 1) * sum_{j in R, j != i} x_j (Decent-DP's ddp.py).
//! Round used at step t: rounds[t mod len].

use anyhow::{bail, Result};

use crate::config::Topology;

/// One group of a round and its self-weight w.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    pub ranks: Vec<usize>,
    pub weight: f64,
}

impl Group {
    /// A member's two mixing weights (own, other), where x_i <- own * x_i + sum_{j in group} other * x_j
    /// (the group sums other * x_j over all its members, as Decent-DP does).
    pub fn mix_weights(&self) -> (f32, f32) {
        let r = self.ranks.len();
        if r == 1 {
            return (1.0, 0.0);
        }
        let other = ((1.0 - self.weight) / (r - 1) as f64) as f32;
        (self.weight as f32 - other, other)
    }

    /// Whether its members' mix is the sum alone (own = 0: uniform weights), which a group of several
    /// can run in place on the parameters.
    pub fn sums_in_place(&self) -> bool {
        self.ranks.len() > 1 && self.mix_weights().0 == 0.0
    }
}

pub type Round = Vec<Group>;

/// Whether `topo` can mix `world` ranks laid out `per_node` to a node (the reference's constraints).
/// This is the one rule: `check`, `sbatch` and `train` reach it through the resolved plan, and `rounds`
/// through this function. One rank has nothing to mix with: every topology degenerates to local training.
pub fn fits(topo: Topology, world: usize, per_node: usize) -> Result<(), String> {
    if world == 1 {
        return Ok(());
    }
    match topo {
        Topology::Complete => Ok(()),
        Topology::Ring if !world.is_multiple_of(2) => Err(format!(
            "topology \"ring\" pairs neighbours in two rounds and needs an even world size, found {world}"
        )),
        Topology::Exp if !world.is_power_of_two() => Err(format!(
            "topology \"exp\" (one-peer exponential) needs a power-of-two world size, found {world}"
        )),
        Topology::AlternatingExpRing => {
            let nodes = world / per_node.max(1);
            if per_node > 0 && world.is_multiple_of(per_node) && nodes >= 2 && nodes.is_power_of_two() {
                return Ok(());
            }
            let found = format!(
                "topology \"alternating-exp-ring\" needs a power-of-two number >= 2 of nodes with equal ranks \
                 per node; found world size {world} with {per_node} rank(s) per node ({} node(s))",
                world as f64 / per_node.max(1) as f64
            );
            // Two nodes of world / 2 ranks always fit an even world; an odd one fits no layout.
            Err(if world.is_multiple_of(2) {
                format!(
                    "{found}; e.g. two nodes: --set train.ranks_per_node={} (or launch {} task(s) per node)",
                    world / 2,
                    world / 2
                )
            } else {
                format!("{found}; an odd world size has no such layout: use an even number of workers")
            })
        }
        Topology::Ring | Topology::Exp => Ok(()),
    }
}

/// The rounds of `topo` for `world` ranks with `per_node` ranks per node.
pub fn rounds(topo: Topology, world: usize, per_node: usize) -> Result<Vec<Round>> {
    fits(topo, world, per_node).map_err(anyhow::Error::msg)?;
    if world == 1 {
        return Ok(vec![vec![Group {
            ranks: vec![0],
            weight: 1.0,
        }]]);
    }
    let pair = |a: usize, b: usize| Group {
        ranks: vec![a, b],
        weight: 0.5,
    };
    Ok(match topo {
        Topology::Complete => vec![vec![Group {
            ranks: (0..world).collect(),
            weight: 1.0 / world as f64,
        }]],
        Topology::Ring => vec![
            (0..world).step_by(2).map(|i| pair(i, i + 1)).collect(),
            (0..world)
                .step_by(2)
                .map(|i| pair(i, (i + world - 1) % world))
                .collect(),
        ],
        Topology::Exp => {
            let k = world.trailing_zeros() as usize;
            (0..k)
                .map(|i| {
                    exp_pairs(world, 1 << i)
                        .into_iter()
                        .map(|(a, b)| pair(a, b))
                        .collect()
                })
                .collect()
        }
        Topology::AlternatingExpRing => {
            let l = per_node;
            let m = world / l;
            let node = |j: usize| (j * l..(j + 1) * l).collect::<Vec<usize>>();
            let intra = |j: usize| Group {
                ranks: node(j),
                weight: 1.0 / l as f64,
            };
            let mut out = Vec::new();
            for i in 0..m.trailing_zeros() as usize {
                let (mut first, mut second) = (Vec::new(), Vec::new());
                for (p, (a, b)) in exp_pairs(m, 1 << i).into_iter().enumerate() {
                    let mut both = node(a);
                    both.extend(node(b));
                    let inter = Group {
                        ranks: both,
                        weight: 1.0 / (2 * l) as f64,
                    };
                    // Alternate which sub-round mixes across nodes, pair by pair.
                    if p % 2 == 0 {
                        first.extend([intra(a), intra(b)]);
                        second.push(inter);
                    } else {
                        first.push(inter);
                        second.extend([intra(a), intra(b)]);
                    }
                }
                out.push(first);
                out.push(second);
            }
            out
        }
    })
}

/// The rounds of `topo` over the `world` workers present after some left (positions 0..world): those
/// of `rounds` where the topology fits that count; else ring's and exp's pairings over it, where a
/// worker left without a partner mixes alone (weight 1) in that round. Every round stays a partition
/// into groups that mix uniformly, so its mixing matrix stays symmetric and doubly stochastic.
pub fn rounds_over(topo: Topology, world: usize, per_node: usize) -> Result<Vec<Round>> {
    if fits(topo, world, per_node).is_ok() {
        return rounds(topo, world, per_node);
    }
    let with_singles = |pairs: Vec<(usize, usize)>| -> Round {
        let mut paired = vec![false; world];
        let mut round: Round = pairs
            .into_iter()
            .map(|(a, b)| {
                (paired[a], paired[b]) = (true, true);
                Group {
                    ranks: vec![a, b],
                    weight: 0.5,
                }
            })
            .collect();
        round.extend((0..world).filter(|&i| !paired[i]).map(|i| Group {
            ranks: vec![i],
            weight: 1.0,
        }));
        round
    };
    Ok(match topo {
        Topology::Ring => vec![
            with_singles((0..world - 1).step_by(2).map(|i| (i, i + 1)).collect()),
            with_singles((1..world - 1).step_by(2).map(|i| (i, i + 1)).collect()),
        ],
        Topology::Exp => (0..world.next_power_of_two().trailing_zeros())
            .map(|i| with_singles(exp_pairs(world, 1 << i)))
            .collect(),
        Topology::Complete | Topology::AlternatingExpRing => {
            bail!(
                "{topo:?} over {world} workers: {}",
                fits(topo, world, per_node).unwrap_err()
            )
        }
    })
}

/// Pairs (j, j + d mod n), greedily from j = 0 upward, each index used once (j xor d for powers of two).
fn exp_pairs(n: usize, d: usize) -> Vec<(usize, usize)> {
    let mut used = vec![false; n];
    let mut out = Vec::new();
    for j in 0..n {
        let k = (j + d) % n;
        if !used[j] && !used[k] && j != k {
            used[j] = true;
            used[k] = true;
            out.push((j, k));
        }
    }
    out
}

/// The mixing matrix of one round (row i: the weights rank i gives every rank).
pub fn mixing_matrix(round: &Round, world: usize) -> Result<Vec<Vec<f64>>> {
    let mut w = vec![vec![0.0; world]; world];
    let mut seen = vec![0; world];
    for g in round {
        let r = g.ranks.len();
        for &i in &g.ranks {
            seen[i] += 1;
            for &j in &g.ranks {
                w[i][j] = if i == j {
                    g.weight
                } else {
                    (1.0 - g.weight) / (r - 1) as f64
                };
            }
        }
    }
    if let Some(i) = seen.iter().position(|&c| c != 1) {
        bail!("rank {i} is in {} groups of this round", seen[i]);
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_all(topo: Topology, world: usize, per_node: usize) -> usize {
        let rs = rounds(topo, world, per_node).unwrap();
        for round in &rs {
            let w = mixing_matrix(round, world).unwrap();
            for (i, wi) in w.iter().enumerate() {
                let row: f64 = wi.iter().sum();
                let col: f64 = (0..world).map(|j| w[j][i]).sum();
                assert!(
                    (row - 1.0).abs() < 1e-12 && (col - 1.0).abs() < 1e-12,
                    "{topo:?} n={world}: not doubly stochastic"
                );
            }
        }
        rs.len()
    }

    #[test]
    fn every_round_is_doubly_stochastic_with_each_rank_in_one_group() {
        for n in [2, 4, 6, 8, 16] {
            assert_eq!(check_all(Topology::Complete, n, n), 1);
            assert_eq!(check_all(Topology::Ring, n, n), 2);
        }
        for n in [2, 4, 8, 16, 32] {
            assert_eq!(check_all(Topology::Exp, n, n), n.trailing_zeros() as usize);
        }
        for (n, l) in [(4, 2), (8, 2), (8, 4), (16, 4), (16, 2), (4, 1)] {
            assert_eq!(
                check_all(Topology::AlternatingExpRing, n, l),
                2 * (n / l).trailing_zeros() as usize
            );
        }
    }

    /// Any membership schedule: the rounds over the workers present, embedded in the whole world (the
    /// absent keep their parameters), are doubly stochastic in every round and put each present worker
    /// in exactly one group.
    #[test]
    fn rounds_over_any_members_stay_doubly_stochastic() {
        use proptest::prelude::*;
        let schedule = (2usize..40, proptest::collection::vec(any::<u64>(), 1..12));
        proptest!(|((world, masks) in schedule, topo in 0usize..3)| {
            let topo = [Topology::Ring, Topology::Exp, Topology::Complete][topo];
            for mask in masks {
                // Worker 0 never leaves; the others are present where their bit is set.
                let present: Vec<usize> =
                    (0..world).filter(|&w| w == 0 || mask >> (w % 64) & 1 == 1).collect();
                let m = present.len();
                for round in rounds_over(topo, m, m).unwrap() {
                    let mut full = vec![vec![0.0; world]; world];
                    let local = mixing_matrix(&round, m).unwrap();
                    for (w, row) in full.iter_mut().enumerate() {
                        row[w] = 1.0;
                    }
                    for (i, &a) in present.iter().enumerate() {
                        for (j, &b) in present.iter().enumerate() {
                            full[a][b] = local[i][j];
                        }
                    }
                    for (i, r) in full.iter().enumerate() {
                        let row: f64 = r.iter().sum();
                        let col: f64 = (0..world).map(|j| full[j][i]).sum();
                        prop_assert!((row - 1.0).abs() < 1e-12 && (col - 1.0).abs() < 1e-12);
                    }
                }
            }
        });
    }

    #[test]
    fn rounds_match_the_reference_layouts() {
        let ring = rounds(Topology::Ring, 4, 4).unwrap();
        let ranks = |r: &Round| r.iter().map(|g| g.ranks.clone()).collect::<Vec<_>>();
        assert_eq!(ranks(&ring[0]), vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(ranks(&ring[1]), vec![vec![0, 3], vec![2, 1]]);
        let exp = rounds(Topology::Exp, 8, 8).unwrap();
        assert_eq!(
            ranks(&exp[2]),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        // 4 nodes of 2: round 0 pairs nodes (0,1) and (2,3); pair 0 mixes within first, pair 1 across first.
        let aer = rounds(Topology::AlternatingExpRing, 8, 2).unwrap();
        assert_eq!(
            ranks(&aer[0]),
            vec![vec![0, 1], vec![2, 3], vec![4, 5, 6, 7]]
        );
        assert_eq!(
            ranks(&aer[1]),
            vec![vec![0, 1, 2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(aer[1][0].weight, 0.25);
        assert!(rounds(Topology::Ring, 3, 3).is_err());
    }
}

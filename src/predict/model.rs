//! The time model: alpha-beta costs of each collective on the cluster's two link levels, compute from the
//! model's FLOPs, and the overlap each backend implements.
//!
//! - Ring all-reduce of S bytes over n ranks on one link: 2 (n - 1) (alpha + S / (n B)).
//! - All-gather and reduce-scatter, pieces of P bytes: (n - 1) (alpha + P / B).
//! - A group spanning nodes with m > 1 of its members on each node: hierarchical all-reduce (intra-node
//!   reduce-scatter, all-reduce of each rank's 1/m shard across the nodes, intra-node all-gather).
//!   Otherwise a group spanning nodes is a flat ring whose slowest hop is the inter-node link.
//! - An all-reduce over every node, one rank on each, where the profile measured one over that many
//!   nodes (`[all_reduce]`): its measured time.
//! - NIC sharing (`nic_shared`): the ranks of a node that send off-node at the same time split its
//!   bandwidth (all m ranks in the hierarchical all-reduce's middle phase; in a round of gossip, every
//!   rank of the node whose group crosses nodes).
//! - A collective's groups run at once; the collective ends with its slowest group.

use super::profile::{ClusterProfile, Link};
use crate::sync::trace::{Collective, Op, Overlap};

/// Where ranks run: rank r on node r / ranks_per_node.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Layout {
    pub world: usize,
    pub ranks_per_node: usize,
}

impl Layout {
    pub fn node(&self, rank: usize) -> usize {
        rank / self.ranks_per_node.max(1)
    }

    pub fn nodes(&self) -> usize {
        self.world.div_ceil(self.ranks_per_node.max(1))
    }
}

/// A link whose bandwidth `share` concurrent senders split.
#[derive(Clone, Copy)]
pub struct Wire<'a> {
    pub link: &'a Link,
    pub share: usize,
}

impl Wire<'_> {
    fn message(&self, bytes: f64) -> f64 {
        self.link.message_seconds(bytes, self.share)
    }
}

fn shared(link: &Link, share: usize) -> Wire<'_> {
    Wire { link, share }
}

/// Ring all-reduce of `bytes` over `n` ranks: 2 (n - 1) messages of S / n, each alpha + S / (n B).
pub fn ring_all_reduce(n: usize, bytes: f64, wire: Wire) -> f64 {
    if n < 2 {
        return 0.0;
    }
    2.0 * (n - 1) as f64 * wire.message(bytes / n as f64)
}

/// Ring all-gather (or reduce-scatter) of pieces of `piece` bytes over `n` ranks: (n - 1) (alpha + P / B).
pub fn ring_all_gather(n: usize, piece: f64, wire: Wire) -> f64 {
    if n < 2 {
        return 0.0;
    }
    (n - 1) as f64 * wire.message(piece)
}

/// Hierarchical all-reduce over `nodes` nodes with `m` ranks each: intra-node reduce-scatter, the 1/m
/// shards all-reduced across nodes over `inter` by all m ranks at once (sharing the NIC when
/// `nic_shared`), intra-node all-gather.
pub fn hierarchical_all_reduce(
    m: usize,
    nodes: usize,
    bytes: f64,
    p: &ClusterProfile,
    inter: &Link,
) -> f64 {
    let intra = shared(&p.intra, 1);
    let inter = shared(inter, if p.nic_shared { m } else { 1 });
    let shard = bytes / m as f64;
    2.0 * ring_all_gather(m, shard, intra) + ring_all_reduce(nodes, shard, inter)
}

/// Seconds one collective takes on the cluster.
pub fn collective_seconds(c: &Collective, layout: &Layout, p: &ClusterProfile) -> f64 {
    // Ranks of each node that send off-node in this collective (their groups cross nodes).
    let mut off_node = vec![0usize; layout.nodes()];
    for g in &c.groups {
        if g.len() > 1 && spans(g, layout) {
            g.iter().for_each(|&r| off_node[layout.node(r)] += 1);
        }
    }
    c.groups
        .iter()
        .map(|g| group_seconds(c, g, layout, p, &off_node))
        .fold(0.0, f64::max)
}

fn spans(g: &[usize], layout: &Layout) -> bool {
    g.iter().any(|&r| layout.node(r) != layout.node(g[0]))
}

/// The slowest of `nodes`' links for a message of `bytes`: a collective across them runs at its pace.
fn slowest(p: &ClusterProfile, nodes: impl Iterator<Item = usize>, bytes: f64) -> &Link {
    nodes
        .map(|k| p.inter_of(k))
        .max_by(|a, b| {
            a.message_seconds(bytes, 1)
                .total_cmp(&b.message_seconds(bytes, 1))
        })
        .unwrap_or(&p.inter)
}

fn group_seconds(
    c: &Collective,
    g: &[usize],
    layout: &Layout,
    p: &ClusterProfile,
    off_node: &[usize],
) -> f64 {
    let n = g.len();
    if n < 2 {
        return 0.0;
    }
    let bytes = c.bytes() as f64;
    if !spans(g, layout) {
        let link = shared(&p.intra, 1);
        return match c.op {
            Op::AllReduce { .. } => ring_all_reduce(n, bytes, link),
            Op::AllGather { .. } | Op::ReduceScatter { .. } => ring_all_gather(n, bytes, link),
        };
    }
    // Members per node: hierarchical when every node holds the same number m > 1 of them.
    let mut per_node = std::collections::BTreeMap::<usize, usize>::new();
    g.iter()
        .for_each(|&r| *per_node.entry(layout.node(r)).or_default() += 1);
    let m = per_node.values().copied().max().unwrap_or(1);
    let regular = per_node.values().all(|&k| k == m);
    // An all-reduce over every node, one rank on each, as it was measured.
    let measured = match (&c.op, &p.all_reduce) {
        (Op::AllReduce { .. }, Some(a)) if m == 1 && n == layout.nodes() => a.seconds(n, bytes),
        _ => None,
    };
    if let Some(t) = measured {
        return t;
    }
    let inter = slowest(p, per_node.keys().copied(), bytes / n as f64);
    match c.op {
        Op::AllReduce { .. } if m > 1 && regular => {
            hierarchical_all_reduce(m, per_node.len(), bytes, p, inter)
        }
        // A flat ring across nodes: its slowest hop is inter-node. In a ring over ranks placed in order
        // one rank per node sends off-node; gossip groups of a round all send at once. Two ranks swap
        // their buffers.
        Op::AllReduce { .. } => {
            let share = link_share(c, g, layout, p, off_node);
            match n {
                2 => inter.swap_seconds(bytes, share),
                _ => ring_all_reduce(n, bytes, shared(inter, share)),
            }
        }
        // Two ranks swap their pieces (CHOCO's pairs): the measured swaps, where `calibrate` wrote them.
        Op::AllGather { .. } | Op::ReduceScatter { .. } if n == 2 && !inter.pairs.is_empty() => {
            inter.swap_seconds(bytes, link_share(c, g, layout, p, off_node))
        }
        Op::AllGather { .. } | Op::ReduceScatter { .. } => {
            ring_all_gather(n, bytes, shared(inter, 1))
        }
    }
}

/// Senders that split each link of group `g` of `c`: its nodes' ranks that send off-node at once, with
/// `nic_shared` and other groups beside it; else 1.
fn link_share(
    c: &Collective,
    g: &[usize],
    layout: &Layout,
    p: &ClusterProfile,
    off_node: &[usize],
) -> usize {
    match p.nic_shared && c.groups.len() > 1 {
        true => g
            .iter()
            .map(|&r| off_node[layout.node(r)])
            .max()
            .unwrap_or(1),
        false => 1,
    }
}

/// One step's time, split as a researcher reads it (seconds).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTime {
    pub compute: f64,
    /// Work that overlaps no communication: compression and decompression, the optimizer's update.
    pub serial: f64,
    /// Every collective's time, overlapped or not.
    pub comm: f64,
    /// The part of `comm` the step waits for.
    pub exposed: f64,
}

impl StepTime {
    pub fn total(&self) -> f64 {
        self.compute + self.serial + self.exposed
    }
}

/// What may run beside the compute on a cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overlaps {
    /// All-reduce buckets beside the backward pass (DDP on GPUs: the profile's `overlap_backward`).
    pub backward: bool,
    /// Collectives beside the next step's forward and backward (overlapped gossip, streaming DiLoCo's
    /// fragments). Not where ranks share cores: their CPU then copies the messages instead of computing.
    pub compute: bool,
}

/// How a step's collectives slow beside its compute where the cores that compute also move the bytes:
/// they progress at 1 / `rate` of their idle speed while the forward and backward pass runs beside them
/// (`compute` seconds a step, as the run measured it: `overlap_compute_ms`), and at their idle speed
/// after it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Beside {
    /// The profile's `comm_beside_compute`.
    pub rate: f64,
    pub compute: f64,
}

impl Beside {
    /// Seconds of collectives that take `idle` seconds alone: `rate` x `idle` where they end within the
    /// compute, else the compute plus what is left of them after it.
    pub fn seconds(&self, idle: f64) -> f64 {
        match self.compute >= self.rate * idle {
            true => self.rate * idle,
            false => idle + self.compute * (1.0 - 1.0 / self.rate),
        }
    }
}

/// The step's time given its compute (forward + backward; the backward is 2/3 of it), its serial work
/// and its collectives, each with its time on the cluster.
///
/// Overlap as the backends implement it: `Backward` buckets (with `overlaps.backward`) become ready as
/// the backward pass produces their gradients, in order and evenly over the backward pass; each starts
/// when ready and after the previous bucket, and what runs past the backward pass is exposed (so one
/// bucket hides nothing, many hide all but the last). `Compute` collectives (with `overlaps.compute`)
/// run beside the whole forward and backward pass and are exposed by what exceeds it. The rest is
/// exposed in full.
pub fn step_time(
    compute: f64,
    serial: f64,
    comm: &[(&Collective, f64)],
    overlaps: Overlaps,
) -> StepTime {
    let overlap_backward = overlaps.backward;
    let backward = compute * 2.0 / 3.0;
    let forward = compute - backward;
    let buckets: Vec<(f64, f64)> = comm
        .iter()
        .filter(|(c, _)| c.overlap == Overlap::Backward && overlap_backward)
        .map(|(c, t)| (c.bytes() as f64, *t))
        .collect();
    let total_bytes: f64 = buckets.iter().map(|b| b.0).sum::<f64>().max(1.0);
    let (mut ready, mut end) = (forward, forward);
    for (bytes, t) in &buckets {
        ready += backward * bytes / total_bytes;
        end = end.max(ready) + t;
    }
    let mut exposed = (end - compute).max(0.0);
    let beside: f64 = comm
        .iter()
        .filter(|(c, _)| c.overlap == Overlap::Compute && overlaps.compute)
        .map(|(_, t)| t)
        .sum();
    exposed += (beside - compute).max(0.0);
    exposed += comm
        .iter()
        .filter(|(c, _)| match c.overlap {
            Overlap::None => true,
            Overlap::Backward => !overlap_backward,
            Overlap::Compute => !overlaps.compute,
        })
        .map(|(_, t)| t)
        .sum::<f64>();
    StepTime {
        compute,
        serial,
        comm: comm.iter().map(|(_, t)| t).sum(),
        exposed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::predict::profile::{parse, DeviceSpec, BUILTIN};

    /// `Beside::seconds` against the process it describes, stepped in time: collectives of `idle`
    /// seconds progress at 1 / rate of their speed while the compute runs, at full speed after it.
    #[test]
    fn beside_is_a_slower_exchange_while_the_compute_runs() {
        let dt = 1e-6;
        for rate in [0.8, 1.0, 1.5, 3.0] {
            for compute in [0.0, 0.01, 0.05, 0.2] {
                for idle in [0.001, 0.02, 0.1] {
                    let (mut done, mut t) = (0.0, 0.0);
                    while done < idle {
                        done += dt * if t < compute { 1.0 / rate } else { 1.0 };
                        t += dt;
                    }
                    let got = Beside { rate, compute }.seconds(idle);
                    assert!((got - t).abs() < 1e-5, "{rate} {compute} {idle}: {got} {t}");
                }
            }
        }
    }

    fn profile(nic_shared: bool) -> ClusterProfile {
        // Intra: alpha 1 us, 1e9 B/s; inter: alpha 10 us, 1e8 B/s (efficiency 1).
        ClusterProfile {
            description: "test".into(),
            devices_per_node: 4,
            device: DeviceSpec {
                name: "x".into(),
                peak_tflops: 1.0,
                mfu: 1.0,
                memory_gbps: 1.0,
                sharing_efficiency: None,
                codec_gbps: Default::default(),
            },
            intra: Link {
                bandwidth_gbps: 8.0,
                latency_us: 1.0,
                efficiency: 1.0,
                measured: vec![],
                pairs: vec![],
            },
            inter: Link {
                bandwidth_gbps: 0.8,
                latency_us: 10.0,
                efficiency: 1.0,
                measured: vec![],
                pairs: vec![],
            },
            nic_shared,
            overlap_backward: true,
            overlap_compute: true,
            comm_beside_compute: None,
            node_links: vec![],
            all_reduce: None,
        }
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-12 + 1e-9 * b.abs(), "{a} vs {b}");
    }

    fn all_reduce(bytes: u64, groups: Vec<Vec<usize>>, overlap: Overlap) -> Collective {
        Collective {
            op: Op::AllReduce { words: bytes / 4 },
            groups,
            overlap,
        }
    }

    #[test]
    fn flat_ring_inside_a_node_is_the_textbook_formula() {
        let p = profile(true);
        let layout = Layout {
            world: 4,
            ranks_per_node: 4,
        };
        let c = all_reduce(4_000_000, vec![(0..4).collect()], Overlap::None);
        // 2 * 3 * (1e-6 + 4e6 / (4 * 1e9)) = 6 * 1.001e-3
        close(collective_seconds(&c, &layout, &p), 6.0 * (1e-6 + 1e-3));
        let ag = Collective {
            op: Op::AllGather {
                pieces: vec![250_000],
            },
            groups: vec![(0..4).collect()],
            overlap: Overlap::None,
        };
        // 3 * (1e-6 + 1e6 / 1e9)
        close(collective_seconds(&ag, &layout, &p), 3.0 * (1e-6 + 1e-3));
    }

    /// A node with a link of its own 10x slower: a collective that spans it runs at its pace, a gossip
    /// pair beside it at the others'; in a hierarchical all-reduce only the inter-node phase slows.
    #[test]
    fn a_slow_node_slows_the_groups_it_is_in() {
        let mut p = profile(false);
        p.node_links.push(crate::predict::profile::NodeLink {
            node: 1,
            link: p.inter.slowed(10.0),
        });
        let one = Layout {
            world: 4,
            ranks_per_node: 1,
        };
        let c = all_reduce(4_000_000, vec![(0..4).collect()], Overlap::None);
        close(collective_seconds(&c, &one, &p), 6.0 * (1e-4 + 1e6 / 1e7));
        let pairs = all_reduce(4_000_000, vec![vec![0, 1], vec![2, 3]], Overlap::None);
        let fast = all_reduce(4_000_000, vec![vec![2, 3]], Overlap::None);
        close(
            collective_seconds(&pairs, &one, &p),
            2.0 * (1e-4 + 2e6 / 1e7),
        );
        close(
            collective_seconds(&fast, &one, &p),
            2.0 * (1e-5 + 2e6 / 1e8),
        );
        let two = Layout {
            world: 8,
            ranks_per_node: 4,
        };
        let c = all_reduce(4_000_000, vec![(0..8).collect()], Overlap::None);
        close(
            collective_seconds(&c, &two, &p),
            6.0 * (1e-6 + 1e-3) + 2.0 * (1e-4 + 1e6 / (2.0 * 1e7)),
        );
    }

    /// A measured all-reduce over every node, one rank on each, prices that all-reduce alone: a slow
    /// node's ring would be slower here, but other groups, layouts, node counts and all-gathers keep the
    /// model's own pricing.
    #[test]
    fn a_measured_all_reduce_prices_only_the_all_reduce_it_measured() {
        let mut p = profile(false);
        p.node_links.push(crate::predict::profile::NodeLink {
            node: 1,
            link: p.inter.slowed(10.0),
        });
        let before = p.clone();
        p.all_reduce = Some(crate::predict::profile::MeasuredAllReduce {
            nodes: 4,
            measured: vec![[4e5, 20_000.0], [4e6, 200_000.0]],
        });
        let one = |world| Layout {
            world,
            ranks_per_node: 1,
        };
        let world = all_reduce(4_000_000, vec![(0..4).collect()], Overlap::None);
        close(collective_seconds(&world, &one(4), &p), 0.2);
        let half = all_reduce(2_200_000, vec![(0..4).collect()], Overlap::None);
        close(collective_seconds(&half, &one(4), &p), 0.11);
        let two = Layout {
            world: 8,
            ranks_per_node: 2,
        };
        let gather = Collective {
            op: Op::AllGather {
                pieces: vec![250_000],
            },
            groups: vec![(0..4).collect()],
            overlap: Overlap::None,
        };
        let others = [
            (
                all_reduce(4_000_000, vec![vec![0, 1, 2]], Overlap::None),
                one(4),
            ),
            (
                all_reduce(4_000_000, vec![(0..5).collect()], Overlap::None),
                one(5),
            ),
            (
                all_reduce(4_000_000, vec![(0..8).collect()], Overlap::None),
                two,
            ),
            (gather, one(4)),
        ];
        for (c, layout) in &others {
            let (got, want) = (
                collective_seconds(c, layout, &p),
                collective_seconds(c, layout, &before),
            );
            close(got, want);
        }
        close(
            collective_seconds(&world, &one(4), &before),
            6.0 * (1e-4 + 1e6 / 1e7),
        );
    }

    #[test]
    fn hierarchical_ring_and_nic_sharing_across_nodes() {
        let layout = Layout {
            world: 8,
            ranks_per_node: 4,
        };
        let c = all_reduce(4_000_000, vec![(0..8).collect()], Overlap::None);
        // Intra reduce-scatter and all-gather of 1e6-byte shards: 2 * 3 * (1e-6 + 1e6 / 1e9); across
        // the 2 nodes, 2 * 1 * (1e-5 + 1e6 / (2 * B)) with B = 1e8 / 4 shared, or 1e8 with a NIC each.
        let intra = 6.0 * (1e-6 + 1e-3);
        close(
            collective_seconds(&c, &layout, &profile(true)),
            intra + 2.0 * (1e-5 + 1e6 / (2.0 * 2.5e7)),
        );
        close(
            collective_seconds(&c, &layout, &profile(false)),
            intra + 2.0 * (1e-5 + 1e6 / (2.0 * 1e8)),
        );
        // One rank per node: a flat ring over the inter-node link, one sender per node.
        let one = Layout {
            world: 4,
            ranks_per_node: 1,
        };
        let c = all_reduce(4_000_000, vec![(0..4).collect()], Overlap::None);
        close(
            collective_seconds(&c, &one, &profile(true)),
            6.0 * (1e-5 + 4e6 / (4.0 * 1e8)),
        );
    }

    #[test]
    fn gossip_pairs_use_the_link_between_their_members_nodes() {
        let layout = Layout {
            world: 8,
            ranks_per_node: 4,
        };
        // A pair inside a node: 2 (alpha + S / (2 B)) on the intra link.
        let inside = all_reduce(
            2_000_000,
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]],
            Overlap::None,
        );
        close(
            collective_seconds(&inside, &layout, &profile(true)),
            2.0 * (1e-6 + 1e6 / 1e9),
        );
        // Pairs across nodes (r, r + 4): all four ranks of a node send off-node at once and share its NIC.
        let across = all_reduce(
            2_000_000,
            (0..4).map(|r| vec![r, r + 4]).collect(),
            Overlap::None,
        );
        close(
            collective_seconds(&across, &layout, &profile(true)),
            2.0 * (1e-5 + 1e6 / 2.5e7),
        );
        close(
            collective_seconds(&across, &layout, &profile(false)),
            2.0 * (1e-5 + 1e6 / 1e8),
        );
        // One crossing pair among local ones: it alone uses the NIC, and the round waits for it.
        let mixed = all_reduce(
            2_000_000,
            vec![vec![0, 1], vec![2], vec![3, 4], vec![5, 6], vec![7]],
            Overlap::None,
        );
        close(
            collective_seconds(&mixed, &layout, &profile(true)),
            2.0 * (1e-5 + 1e6 / 1e8),
        );
    }

    /// A link with measured swaps prices a pair across nodes from them (their own time at their
    /// sizes, interpolated between, the bytes times the senders that share a NIC), and every other
    /// collective from its messages as before.
    #[test]
    fn pairs_across_nodes_take_the_measured_swaps() {
        let one = Layout {
            world: 4,
            ranks_per_node: 1,
        };
        let mut p = profile(false);
        p.inter.pairs = vec![[1e6, 5_000.0], [4e6, 11_000.0]];
        let pairs = all_reduce(2_000_000, vec![vec![0, 1], vec![2, 3]], Overlap::None);
        close(collective_seconds(&pairs, &one, &p), 7_000e-6);
        let exact = all_reduce(4_000_000, vec![vec![0, 2], vec![1, 3]], Overlap::None);
        close(collective_seconds(&exact, &one, &p), 11_000e-6);
        let four = all_reduce(4_000_000, vec![(0..4).collect()], Overlap::None);
        close(
            collective_seconds(&four, &one, &p),
            6.0 * (1e-5 + 4e6 / (4.0 * 1e8)),
        );
        // Two ranks of each node cross at once over a shared NIC: as one swap of twice the bytes.
        let two = Layout {
            world: 4,
            ranks_per_node: 2,
        };
        p.nic_shared = true;
        let crossing = all_reduce(2_000_000, vec![vec![0, 2], vec![1, 3]], Overlap::None);
        close(collective_seconds(&crossing, &two, &p), 11_000e-6);
        // CHOCO's pairs swap their pieces: the measured swaps too; three ranks gather on the ring.
        p.nic_shared = false;
        let gather = |bytes: u64, groups| Collective {
            op: Op::AllGather {
                pieces: vec![bytes / 4],
            },
            groups,
            overlap: Overlap::None,
        };
        let swap = gather(2_000_000, vec![vec![0, 1], vec![2, 3]]);
        close(collective_seconds(&swap, &one, &p), 7_000e-6);
        let three = gather(1_000_000, vec![vec![0, 1, 2]]);
        close(
            collective_seconds(&three, &one, &p),
            2.0 * (1e-5 + 1e6 / 1e8),
        );
        // Without measured swaps, a pair's pieces take one message each way, as before.
        p.inter.pairs.clear();
        close(collective_seconds(&swap, &one, &p), 1e-5 + 2e6 / 1e8);
    }

    const BOTH: Overlaps = Overlaps {
        backward: true,
        compute: true,
    };

    #[test]
    fn overlap_hides_what_fits_under_the_compute_it_may_overlap() {
        let buckets: Vec<Collective> = (0..4)
            .map(|_| all_reduce(400, vec![vec![0, 1]], Overlap::Backward))
            .collect();
        // Compute 3 s: forward 1 s, backward 2 s; four equal buckets ready at 1.5, 2, 2.5, 3 s.
        let comm: Vec<(&Collective, f64)> = buckets.iter().map(|c| (c, 0.25)).collect();
        let t = step_time(3.0, 0.0, &comm, BOTH);
        close(t.exposed, 0.25);
        close(t.comm, 1.0);
        // Long buckets queue: 1.5 + 4 * 1.0 = 5.5 s, 2.5 s past the backward pass.
        let comm: Vec<(&Collective, f64)> = buckets.iter().map(|c| (c, 1.0)).collect();
        close(step_time(3.0, 0.0, &comm, BOTH).exposed, 2.5);
        // Without overlap (nanodist's engines) every bucket is exposed.
        close(
            step_time(
                3.0,
                0.0,
                &comm,
                Overlaps {
                    backward: false,
                    compute: true,
                },
            )
            .exposed,
            4.0,
        );
        // Overlapped gossip hides under the whole step's compute.
        let mix = all_reduce(400, vec![vec![0, 1]], Overlap::Compute);
        close(step_time(3.0, 0.5, &[(&mix, 2.0)], BOTH).exposed, 0.0);
        let t = step_time(3.0, 0.5, &[(&mix, 5.0)], BOTH);
        close(t.exposed, 2.0);
        close(t.total(), 5.5);
        let sync = all_reduce(400, vec![vec![0, 1]], Overlap::None);
        close(step_time(3.0, 0.0, &[(&sync, 2.0)], BOTH).exposed, 2.0);
        // Ranks that share cores copy the overlapped mix themselves: it is exposed in full.
        let shared = Overlaps {
            backward: true,
            compute: false,
        };
        close(step_time(3.0, 0.5, &[(&mix, 2.0)], shared).exposed, 2.0);
    }

    #[test]
    fn builtin_links_convert_to_bytes_per_second() {
        let p = parse("a40", BUILTIN[0].1).unwrap();
        close(p.inter.bytes_per_s(), 25e9 / 8.0 * 0.8);
        close(p.inter.alpha(), 50e-6);
    }
}

//! CHOCO's consensus simulated in one process, and the tuning of its consensus step on it (`"auto"`).

use anyhow::Result;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::codec::mix;
use super::{Channels, Codec, Compressor};
use crate::kernels::Segment;
use crate::sync::topology::Round;

/// All ranks' CHOCO consensus in one process (no communication, no gradients): the same channels,
/// codec and steps as the backend. For tuning gamma and for tests.
pub struct Simulation {
    pub rounds: Vec<Round>,
    pub codec: Codec,
    pub gamma: f32,
    pub nodes: Vec<Channels>,
}

impl Simulation {
    pub fn new(rounds: Vec<Round>, codec: Codec, gamma: f32, numel: usize) -> Result<Self> {
        let world = rounds
            .first()
            .map_or(0, |r| r.iter().map(|g| g.ranks.len()).sum());
        let nodes = (0..world)
            .map(|rank| Channels::new(&rounds, rank, numel))
            .collect::<Result<_>>()?;
        Ok(Self {
            rounds,
            codec,
            gamma,
            nodes,
        })
    }

    /// The consensus of step `step` on the ranks' vectors `xs`.
    pub fn step(&mut self, xs: &mut [Vec<f32>], step: u64) {
        let round = (step % self.rounds.len() as u64) as usize;
        let msgs: Vec<Vec<f32>> = self
            .nodes
            .iter_mut()
            .zip(xs.iter())
            .map(|(node, x)| {
                let mut m = Vec::new();
                node.encode(&self.codec, round, x, step, &mut m);
                m
            })
            .collect();
        for (node, x) in self.nodes.iter_mut().zip(xs.iter_mut()) {
            let members = node.members(round).unwrap_or(&[]).to_vec();
            node.absorb(
                &self.codec,
                round,
                step,
                |pos| &msgs[members[pos]][..],
                x,
                self.gamma,
            );
        }
    }

    /// CHOCO's tuning error: sum_i ||x_i - mean||^2 + sum over channels ||x_i - x_hat_{i,G}||^2.
    pub fn error(&self, xs: &[Vec<f32>]) -> f64 {
        let mean = mean_of(xs);
        let mut e = 0.0;
        for (node, x) in self.nodes.iter().zip(xs) {
            e += x
                .iter()
                .zip(&mean)
                .map(|(&a, &m)| (a as f64 - m).powi(2))
                .sum::<f64>();
            for ch in &node.list {
                // A channel that has not met yet holds zero.
                let hat = |i: usize| ch.hat.host().get(i).copied().unwrap_or(0.0) as f64;
                e += x
                    .iter()
                    .enumerate()
                    .map(|(i, &a)| (a as f64 - hat(i)).powi(2))
                    .sum::<f64>();
            }
        }
        e
    }
}

/// The element-wise mean of the ranks' vectors.
pub fn mean_of(xs: &[Vec<f32>]) -> Vec<f64> {
    let n = xs.len().max(1) as f64;
    let mut m = vec![0.0f64; xs.first().map_or(0, Vec::len)];
    for x in xs {
        m.iter_mut().zip(x).for_each(|(m, &v)| *m += v as f64);
    }
    m.iter_mut().for_each(|v| *v /= n);
    m
}

/// Standard normal vectors, one per rank, from `seed`.
pub fn random_vectors(world: usize, dim: usize, seed: u64) -> Vec<Vec<f32>> {
    use rand_distr::{Distribution, StandardNormal};
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..world)
        .map(|_| (0..dim).map(|_| StandardNormal.sample(&mut rng)).collect())
        .collect()
}

/// Iterations of the tuning simulation (the reference's `num_iters`).
pub const TUNE_ITERS: u64 = 1000;

/// Tunes gamma as CHOCO's `tune_consensus_stepsize.py`: the consensus alone on standard normal vectors
/// (one per rank; `dim` entries, smaller for large worlds to bound the work) with the run's rounds and
/// compressor, `TUNE_ITERS` steps for each gamma of a 20-point log grid over [1e-3, 1], and the gamma of
/// the lowest final error. Two changes for f32 arithmetic, which stops improving near 1e-10 of the start:
/// the consensus part of the error is measured from the current average (rounding moves the average a
/// little, whatever gamma does), and final errors below 1e-9 of the start are ties, broken by the sum of
/// the errors along the way (the fastest consensus wins). Deterministic: every rank gets the same value.
pub fn tune_gamma(rounds: &[Round], compressor: Compressor, seed: u64) -> Result<f64> {
    let world: usize = rounds
        .first()
        .map_or(1, |r| r.iter().map(|g| g.ranks.len()).sum());
    if world < 2 {
        return Ok(1.0);
    }
    // About 64k entries decoded per step: each rank decodes its group's messages.
    let group = rounds
        .iter()
        .flatten()
        .map(|g| g.ranks.len())
        .max()
        .unwrap_or(1);
    let dim = (64_000 / (world * group)).clamp(16, 1000);
    let tensors = Segment::from_shapes(&[(1, dim, false)]);
    let codec = Codec::new(compressor, &tensors, seed);
    let x0 = random_vectors(world, dim, mix(&[seed, 0x7475_6e65]));
    let start = Simulation::new(rounds.to_vec(), codec.clone(), 0.0, dim)?.error(&x0);
    let grid: Vec<f64> = (0..20)
        .map(|i| 10f64.powf(-3.0 + 3.0 * i as f64 / 19.0))
        .collect();
    let scores: Vec<(f64, f64)> = grid
        .par_iter()
        .map(|&gamma| -> Result<(f64, f64)> {
            let mut sim = Simulation::new(rounds.to_vec(), codec.clone(), gamma as f32, dim)?;
            let mut xs = x0.clone();
            let mut area = 0.0;
            for step in 0..TUNE_ITERS {
                sim.step(&mut xs, step);
                if step % 10 == 9 {
                    area += sim.error(&xs);
                }
            }
            let finite = |e: f64| if e.is_finite() { e } else { f64::INFINITY };
            Ok((finite(sim.error(&xs)).max(1e-9 * start), finite(area)))
        })
        .collect::<Result<_>>()?;
    let best = (0..grid.len())
        .min_by(|&a, &b| {
            let (x, y) = (scores[a], scores[b]);
            x.0.total_cmp(&y.0).then(x.1.total_cmp(&y.1))
        })
        .unwrap_or(grid.len() - 1);
    Ok(grid[best])
}

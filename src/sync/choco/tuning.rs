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
    /// Per rank: its message, and its decoding as a dense vector; one group's sum of them.
    msgs: Vec<Vec<f32>>,
    decoded: Vec<Vec<f32>>,
    sum: Vec<f32>,
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
            msgs: vec![Vec::new(); world],
            decoded: vec![vec![0.0; numel]; world],
            sum: vec![0.0; numel],
        })
    }

    /// The consensus of step `step` on the ranks' vectors `xs`. Each message is decoded once and each
    /// group's messages summed once: a member's memory gains w_other * sum + (w_own - w_other) * its
    /// own, which is the backend's sum over the members (`step_per_member`) up to the order of the f32
    /// additions, in O(world) instead of O(world x group) (a complete topology of 512 ranks: 512x less).
    pub fn step(&mut self, xs: &mut [Vec<f32>], step: u64) {
        let round = (step % self.rounds.len() as u64) as usize;
        for (rank, (node, x)) in self.nodes.iter_mut().zip(xs.iter()).enumerate() {
            node.encode(&self.codec, round, x, step, &mut self.msgs[rank]);
            let q = &mut self.decoded[rank];
            q.fill(0.0);
            if !self.msgs[rank].is_empty() {
                self.codec
                    .decode_spans(&self.msgs[rank], step, rank, &[], |at, v| {
                        let q = &mut q[at..at + v.len()];
                        q.iter_mut().zip(v).for_each(|(q, &v)| *q += v);
                    });
            }
        }
        for group in &self.rounds[round] {
            if group.ranks.len() < 2 {
                continue;
            }
            self.sum.fill(0.0);
            for &j in &group.ranks {
                for (s, &q) in self.sum.iter_mut().zip(&self.decoded[j]) {
                    *s += q;
                }
            }
            for &i in &group.ranks {
                let (q, sum) = (&self.decoded[i], &self.sum);
                self.nodes[i].absorb_sum(round, q, sum, &mut xs[i], self.gamma);
            }
        }
    }

    /// The backend's own consensus (`Channels::absorb`: every member decodes every member's message),
    /// the reference `step` is tested against.
    #[cfg(test)]
    pub fn step_per_member(&mut self, xs: &mut [Vec<f32>], step: u64) {
        let round = (step % self.rounds.len() as u64) as usize;
        for (rank, (node, x)) in self.nodes.iter_mut().zip(xs.iter()).enumerate() {
            node.encode(&self.codec, round, x, step, &mut self.msgs[rank]);
        }
        for (node, x) in self.nodes.iter_mut().zip(xs.iter_mut()) {
            let members = node.members(round).unwrap_or(&[]).to_vec();
            let msgs = &self.msgs;
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

/// The tuning's version, for caches of its answers (`plan::gamma`): raised whenever a change can move
/// them (the simulation's arithmetic, the grid, the score).
pub const TUNING_VERSION: u32 = 3;

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
    tune_with(rounds, compressor, seed, Simulation::step)
}

/// A consensus step of the simulation: `Simulation::step`, or in tests the backend's own.
pub(super) type StepFn = fn(&mut Simulation, &mut [Vec<f32>], u64);

/// `tune_gamma` with the simulation stepped by `step`.
pub(super) fn tune_with(
    rounds: &[Round],
    compressor: Compressor,
    seed: u64,
    step_fn: StepFn,
) -> Result<f64> {
    let Some(setup) = Setup::new(rounds, compressor, seed)? else {
        return Ok(1.0);
    };
    let grid: Vec<f64> = (0..20)
        .map(|i| 10f64.powf(-3.0 + 3.0 * i as f64 / 19.0))
        .collect();
    let scores: Vec<(f64, f64)> = grid
        .par_iter()
        .map(|&gamma| {
            let (last, area) = setup.run(gamma, step_fn)?;
            Ok((last.max(1e-9 * setup.start), area))
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

/// CHOCO's consensus error after `TUNE_ITERS` simulated steps at `gamma`, over the error it starts from,
/// measured as `tune_gamma` measures it (1.0 for a single rank): below 1 the consensus contracts; above,
/// it does not, and infinite, it diverged.
pub fn consensus_growth(
    rounds: &[Round],
    compressor: Compressor,
    seed: u64,
    gamma: f64,
) -> Result<f64> {
    let Some(setup) = Setup::new(rounds, compressor, seed)? else {
        return Ok(1.0);
    };
    Ok(setup.run(gamma, Simulation::step)?.0 / setup.start)
}

/// What every simulated gamma starts from: the rounds, the codec, the vectors and their error.
struct Setup {
    rounds: Vec<Round>,
    codec: Codec,
    dim: usize,
    x0: Vec<Vec<f32>>,
    start: f64,
}

impl Setup {
    /// None for a single rank (nothing to agree on).
    fn new(rounds: &[Round], compressor: Compressor, seed: u64) -> Result<Option<Self>> {
        let world: usize = rounds
            .first()
            .map_or(1, |r| r.iter().map(|g| g.ranks.len()).sum());
        if world < 2 {
            return Ok(None);
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
        Ok(Some(Self {
            rounds: rounds.to_vec(),
            codec,
            dim,
            x0,
            start,
        }))
    }

    /// `TUNE_ITERS` steps at `gamma`: the final error and the sum of the errors every 10 steps, both
    /// infinite once the simulation diverged.
    fn run(&self, gamma: f64, step_fn: StepFn) -> Result<(f64, f64)> {
        let mut sim = Simulation::new(
            self.rounds.clone(),
            self.codec.clone(),
            gamma as f32,
            self.dim,
        )?;
        let mut xs = self.x0.clone();
        let mut area = 0.0;
        for step in 0..TUNE_ITERS {
            step_fn(&mut sim, &mut xs, step);
            if step % 10 == 9 {
                area += sim.error(&xs);
                // Diverged: an entry that is infinite or NaN stays so (sums of it never become
                // finite), so its final error and area are not finite either.
                if !area.is_finite() {
                    return Ok((f64::INFINITY, f64::INFINITY));
                }
            }
        }
        let finite = |e: f64| if e.is_finite() { e } else { f64::INFINITY };
        Ok((finite(sim.error(&xs)), finite(area)))
    }
}

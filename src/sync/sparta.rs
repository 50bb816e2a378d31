//! SPARTA (EXO Gym's `sparta.py`): after every local step, each parameter entry is averaged over the
//! workers with probability p. The mask of step t is drawn from (train.seed, t), the same on every rank,
//! so only the selected values travel (EXO Gym broadcasts a dense bool mask instead); it is a function
//! of the step, so a checkpoint needs no RNG state to resume it.
//!
//! Entries are drawn independently with P(keep) = p, per element of the flat buffer (the same law as
//! per-tensor masks), by geometric skips: the gap to the next kept entry is floor(ln u / ln(1 - p)), so a
//! step costs O(p n), not O(n) draws.

use anyhow::Result;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::trace::{Collective, Op, Overlap};
use super::SyncBackend;
use crate::comm::{all_reduce_mean, Communicator};
#[cfg(feature = "cuda")]
use crate::flat::FlatMut;
use crate::kernels;

const MASK_KEY: u64 = 0x7370_6172_7461; // "sparta"

pub struct Sparta {
    comm: Box<dyn Communicator>,
    p: f64,
    seed: u64,
    numel: usize,
    idx: Vec<u32>,
    vals: Vec<f32>,
}

impl Sparta {
    pub fn new(comm: Box<dyn Communicator>, p: f64, seed: u64, numel: usize) -> Self {
        Self {
            comm,
            p,
            seed,
            numel,
            idx: Vec::new(),
            vals: Vec::new(),
        }
    }
}

/// The ascending indices below `n` kept at `step` (each with probability `p`).
pub fn mask(seed: u64, step: u64, p: f64, n: usize, out: &mut Vec<u32>) {
    out.clear();
    if p >= 1.0 {
        out.extend(0..n as u32);
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ MASK_KEY);
    rng.set_stream(step);
    let log_q = (1.0 - p).ln();
    let mut i = 0usize;
    loop {
        // u in (0, 1]: ln u is finite.
        let u = 1.0 - rng.random::<f64>();
        let gap = (u.ln() / log_q).floor();
        if !gap.is_finite() || gap >= (n - i) as f64 {
            break;
        }
        i += gap as usize;
        out.push(i as u32);
        i += 1;
        if i >= n {
            break;
        }
    }
}

impl SyncBackend for Sparta {
    fn name(&self) -> &'static str {
        "sparta"
    }
    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }
    fn comm_mut(&mut self) -> &mut dyn Communicator {
        self.comm.as_mut()
    }
    /// The all-reduce of the step's selected values (their number is the mask's, a function of seed and step).
    fn step_comm(&self, step: u64) -> Vec<Collective> {
        let mut idx = Vec::new();
        mask(self.seed, step, self.p, self.numel, &mut idx);
        let words = idx.len() as u64;
        vec![Collective::world(
            Op::AllReduce { words },
            self.world_size(),
            Overlap::None,
        )]
    }
    /// The selected entries' mean over the ranks replaces them (the `gather` and `scatter` kernels'
    /// twins).
    fn after_step(&mut self, params: &mut [f32], step: u64) -> Result<()> {
        mask(self.seed, step, self.p, params.len(), &mut self.idx);
        self.vals.resize(self.idx.len(), 0.0);
        kernels::gather(params, &self.idx, &mut self.vals);
        all_reduce_mean(self.comm.as_mut(), &mut self.vals)?;
        kernels::scatter(params, &self.idx, &self.vals);
        Ok(())
    }
    /// On the GPU with device collectives: the mask drawn on the host, the rest on the device (the
    /// mean as the host's: the sum, then times 1 / N).
    #[cfg(feature = "cuda")]
    fn after_step_flat(&mut self, params: FlatMut<'_>, step: u64) -> Result<()> {
        let d = match params {
            FlatMut::Cuda(d) if self.comm.device_collectives() => d,
            p => return p.through_host(|p| self.after_step(p, step)),
        };
        let (k, s) = (d.kernels.clone(), d.kernels.stream().clone());
        mask(self.seed, step, self.p, d.buf.len(), &mut self.idx);
        let n = self.comm.world_size();
        if self.idx.is_empty() || n == 1 {
            return Ok(());
        }
        let idx = s.clone_htod(&self.idx)?;
        let mut vals = s.alloc_zeros::<f32>(self.idx.len())?;
        // SAFETY: `mask` drew distinct indices below d.buf.len().
        unsafe { k.gather(&d.buf, &idx, &mut vals) }?;
        crate::comm::all_reduce_mean_device(self.comm.as_mut(), &mut vals, &k)?;
        // SAFETY: as above.
        unsafe { k.scatter(&mut d.buf, &idx, &vals) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_keep_a_fraction_p_ascending_and_depend_only_on_seed_and_step() {
        let n = 200_000;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for p in [0.005, 0.1, 0.5] {
            mask(3, 7, p, n, &mut a);
            let frac = a.len() as f64 / n as f64;
            // Binomial: 5 standard deviations.
            let sd = (p * (1.0 - p) / n as f64).sqrt();
            assert!((frac - p).abs() < 5.0 * sd, "p {p}: kept {frac}");
            assert!(a.windows(2).all(|w| w[0] < w[1]) && a.iter().all(|&i| (i as usize) < n));
            mask(3, 7, p, n, &mut b);
            assert_eq!(a, b);
            mask(3, 8, p, n, &mut b);
            assert_ne!(a, b);
        }
        mask(3, 7, 1.0, 10, &mut a);
        assert_eq!(a, (0..10).collect::<Vec<u32>>());
    }
}

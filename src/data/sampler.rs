//! Batch sampling: random windows of context_length + 1 tokens.
//!
//! A window is a pure function of (seed, step, row of the step's global batch): row g draws from its own
//! ChaCha stream g, at the position of the step. In micro-step m, worker r of N with local batch b takes
//! rows (m N + r) b .. (m N + r + 1) b. So every worker reads its own streams, the data of a step is the
//! same for any world size and accumulation (N workers x b == 1 worker x N*b == 1 worker x b with N
//! accumulation steps), and a resumed run needs no sampler state beyond the step. Evaluation window k is likewise a pure function of
//! (seed, split, k): eval losses are comparable across runs, world sizes and resumes.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::source::{Blend, Split};

/// A batch of `b` sequences of `t` tokens: inputs and next-token targets, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub b: usize,
    pub t: usize,
    pub x: Vec<u32>,
    pub y: Vec<u32>,
}

const TRAIN_KEY: u64 = 0x7472_6169_6e00_0000; // "train"
const EVAL_KEY: u64 = 0x6576_616c_0000_0000; // "eval"
/// ChaCha words consumed by one window draw (two u64: source pick and offset).
const WORDS_PER_DRAW: u128 = 4;

/// Training sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed ^ TRAIN_KEY),
        }
    }

    /// Rows `first_row..first_row + b` of the global batch of optimizer step `step`.
    pub fn batch(&mut self, data: &Blend, step: u64, first_row: u64, b: usize, t: usize) -> Batch {
        let mut out = Batch {
            b,
            t,
            x: vec![0; b * t],
            y: vec![0; b * t],
        };
        let mut window = vec![0u32; t + 1];
        for row in 0..b {
            self.rng.set_stream(first_row + row as u64);
            self.rng.set_word_pos(step as u128 * WORDS_PER_DRAW);
            draw_into(&mut self.rng, data, &mut window);
            out.x[row * t..(row + 1) * t].copy_from_slice(&window[..t]);
            out.y[row * t..(row + 1) * t].copy_from_slice(&window[1..]);
        }
        out
    }
}

/// Evaluation windows `first_window..first_window + b` of `split`: window k is the same for every run
/// with this seed, whatever the batch size or world size that asks for it.
pub fn eval_batch(
    seed: u64,
    split: Split,
    first_window: u64,
    data: &Blend,
    b: usize,
    t: usize,
) -> Batch {
    let split_key = match split {
        Split::Train => 1,
        Split::Val => 2,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ EVAL_KEY ^ split_key);
    let mut out = Batch {
        b,
        t,
        x: vec![0; b * t],
        y: vec![0; b * t],
    };
    let mut window = vec![0u32; t + 1];
    for row in 0..b {
        rng.set_stream(first_window + row as u64);
        rng.set_word_pos(0);
        draw_into(&mut rng, data, &mut window);
        out.x[row * t..(row + 1) * t].copy_from_slice(&window[..t]);
        out.y[row * t..(row + 1) * t].copy_from_slice(&window[1..]);
    }
    out
}

/// One window: a source by weight, then a uniform start (modulo of a 64-bit draw: the bias is below
/// 2^-30 for any file under 2^34 tokens, and the draw always uses the same number of words).
fn draw_into(rng: &mut ChaCha8Rng, data: &Blend, window: &mut [u32]) {
    let u = (rng.random::<u64>() >> 11) as f64 / (1u64 << 53) as f64;
    let f = &data.files[data.pick(u)];
    let start = rng.random::<u64>() % (f.len() - window.len() + 1) as u64;
    f.read(start as usize, window);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::format::TokenFile;

    fn blend(tokens: &[u16]) -> (tempfile::TempDir, Blend) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(&p, bytes).unwrap();
        (
            dir,
            Blend::single(TokenFile::open_nanogpt(&p, false).unwrap()),
        )
    }

    #[test]
    fn targets_are_inputs_shifted_by_one() {
        let tokens: Vec<u16> = (0..1000).collect();
        let (_d, data) = blend(&tokens);
        let batch = Sampler::new(1).batch(&data, 0, 0, 4, 16);
        for r in 0..4 {
            for i in 0..16 {
                assert_eq!(batch.y[r * 16 + i], batch.x[r * 16 + i] + 1);
            }
        }
    }

    #[test]
    fn worker_slices_compose_the_global_batch_for_any_world_size() {
        let tokens: Vec<u16> = (0..5000).map(|i| (i * 7 % 5000) as u16).collect();
        let (_d, data) = blend(&tokens);
        let mut s = Sampler::new(42);
        let whole = s.batch(&data, 9, 0, 8, 8);
        for world in [2usize, 4, 8] {
            let b = 8 / world;
            let mut x = Vec::new();
            for rank in 0..world {
                x.extend(Sampler::new(42).batch(&data, 9, (rank * b) as u64, b, 8).x);
            }
            assert_eq!(x, whole.x, "world {world}");
        }
        assert_ne!(
            s.batch(&data, 10, 0, 8, 8),
            whole,
            "each step draws new windows"
        );
        assert_ne!(
            Sampler::new(43).batch(&data, 9, 0, 8, 8),
            whole,
            "the seed matters"
        );
    }

    #[test]
    fn eval_batches_are_fixed() {
        let tokens: Vec<u16> = (0..5000).collect();
        let (_d, data) = blend(&tokens);
        let e1 = eval_batch(42, Split::Val, 5, &data, 2, 8);
        assert_eq!(e1, eval_batch(42, Split::Val, 5, &data, 2, 8));
        assert_eq!(
            e1.x[8..],
            eval_batch(42, Split::Val, 6, &data, 1, 8).x[..],
            "window 6 is window 6"
        );
        assert_ne!(e1, eval_batch(42, Split::Val, 7, &data, 2, 8));
        assert_ne!(e1, eval_batch(42, Split::Train, 5, &data, 2, 8));
    }
}

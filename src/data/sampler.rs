//! Batch sampling: random windows of context_length + 1 tokens. Every worker draws from its own
//! ChaCha stream derived from (seed, rank); the stream position is the whole sampler state, so a
//! checkpoint stores one number instead of replaying the RNG from step 0. Evaluation batch i is a pure
//! function of (seed, split, i): eval losses are comparable across runs, world sizes and resumes.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::source::{Blend, Split};

/// A batch of `b` sequences of `t` tokens: inputs and next-token targets, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub b: usize,
    pub t: usize,
    pub x: Vec<u32>,
    pub y: Vec<u32>,
}

/// Per-rank training sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    rng: ChaCha8Rng,
}

/// What a checkpoint keeps of a sampler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    pub rank: u64,
    /// ChaCha word position (128-bit, as two halves for JSON).
    pub word_pos_hi: u64,
    pub word_pos_lo: u64,
}

const TRAIN_KEY: u64 = 0x7472_6169_6e00_0000; // "train"
const EVAL_KEY: u64 = 0x6576_616c_0000_0000; // "eval"

impl Sampler {
    pub fn new(seed: u64, rank: usize) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ TRAIN_KEY);
        rng.set_stream(rank as u64);
        Self { rng }
    }

    pub fn state(&self) -> SamplerState {
        let pos = self.rng.get_word_pos();
        SamplerState {
            rank: self.rng.get_stream(),
            word_pos_hi: (pos >> 64) as u64,
            word_pos_lo: pos as u64,
        }
    }

    pub fn from_state(seed: u64, s: &SamplerState) -> Self {
        let mut sampler = Self::new(seed, s.rank as usize);
        sampler
            .rng
            .set_word_pos(((s.word_pos_hi as u128) << 64) | s.word_pos_lo as u128);
        sampler
    }

    /// The next training batch.
    pub fn next_batch(&mut self, data: &Blend, b: usize, t: usize) -> Batch {
        draw(&mut self.rng, data, b, t)
    }
}

/// Evaluation batch `index` of `split`: the same for every run with this seed.
pub fn eval_batch(seed: u64, split: Split, index: u64, data: &Blend, b: usize, t: usize) -> Batch {
    let split_key = match split {
        Split::Train => 1,
        Split::Val => 2,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ EVAL_KEY ^ split_key);
    rng.set_stream(index);
    draw(&mut rng, data, b, t)
}

fn draw(rng: &mut ChaCha8Rng, data: &Blend, b: usize, t: usize) -> Batch {
    let mut x = vec![0u32; b * t];
    let mut y = vec![0u32; b * t];
    let mut window = vec![0u32; t + 1];
    for row in 0..b {
        let f = &data.files[data.pick(rng.random::<f64>())];
        let start = rng.random_range(0..=f.len() - (t + 1));
        f.read(start, &mut window);
        x[row * t..(row + 1) * t].copy_from_slice(&window[..t]);
        y[row * t..(row + 1) * t].copy_from_slice(&window[1..]);
    }
    Batch { b, t, x, y }
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
        let batch = Sampler::new(1, 0).next_batch(&data, 4, 16);
        for r in 0..4 {
            for i in 0..16 {
                assert_eq!(batch.y[r * 16 + i], batch.x[r * 16 + i] + 1);
            }
        }
    }

    #[test]
    fn resumed_sampler_continues_the_same_stream() {
        let tokens: Vec<u16> = (0..5000).map(|i| (i * 7 % 5000) as u16).collect();
        let (_d, data) = blend(&tokens);
        let mut a = Sampler::new(42, 3);
        for _ in 0..5 {
            a.next_batch(&data, 3, 8);
        }
        let state = a.state();
        let json = serde_json::to_string(&state).unwrap();
        let mut b = Sampler::from_state(42, &serde_json::from_str(&json).unwrap());
        assert_eq!(a.next_batch(&data, 3, 8), b.next_batch(&data, 3, 8));
    }

    #[test]
    fn ranks_draw_different_streams_and_eval_is_fixed() {
        let tokens: Vec<u16> = (0..5000).collect();
        let (_d, data) = blend(&tokens);
        let r0 = Sampler::new(42, 0).next_batch(&data, 2, 8);
        let r1 = Sampler::new(42, 1).next_batch(&data, 2, 8);
        assert_ne!(r0, r1);
        let e1 = eval_batch(42, Split::Val, 5, &data, 2, 8);
        assert_eq!(e1, eval_batch(42, Split::Val, 5, &data, 2, 8));
        assert_ne!(e1, eval_batch(42, Split::Val, 6, &data, 2, 8));
        assert_ne!(e1, eval_batch(42, Split::Train, 5, &data, 2, 8));
    }
}

//! Batch sampling: random windows of context_length + 1 tokens.
//!
//! A window is a pure function of (seed, step, row of the step's global batch): row g draws from its own
//! ChaCha stream g, at the position of the step. In micro-step m, worker r of N with local batch b takes
//! rows (m N + r) b .. (m N + r + 1) b. So every worker reads its own streams, the data of a step is the
//! same for any world size and accumulation (N workers x b == 1 worker x N*b == 1 worker x b with N
//! accumulation steps), and a resumed run needs no sampler state beyond the step. Evaluation window k is likewise a pure function of
//! (seed, split, k): eval losses are comparable across runs, world sizes and resumes.
//!
//! With non-IID data (`[worker_data]`) a worker draws its windows from its own `View` of the blend: its
//! shard of every source, or its own source weights. The draws take the same random words, so the view
//! of the whole blend gives today's windows exactly; the data of a step then depends on the world size.

use std::ops::Range;

use anyhow::Result;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::source::{Blend, Split};
use crate::bad_input;
use crate::config::WorkerData;

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

/// What one worker's windows are drawn from: each source's cumulative weight and the range of its tokens
/// that windows lie in.
#[derive(Debug, Clone, PartialEq)]
pub struct View {
    cumulative: Vec<f64>,
    ranges: Vec<Range<usize>>,
}

impl View {
    /// The whole blend, with its weights (IID data, and evaluation).
    pub fn whole(data: &Blend) -> Self {
        Self {
            cumulative: data.cumulative().to_vec(),
            ranges: data.files.iter().map(|f| 0..f.len()).collect(),
        }
    }

    /// Worker `rank` of `world`'s view under `how`; every window holds `sample_len` tokens.
    pub fn of(
        data: &Blend,
        how: &WorkerData,
        rank: usize,
        world: usize,
        sample_len: usize,
    ) -> Result<Self> {
        let mut view = Self::whole(data);
        match how {
            WorkerData::Shared => {}
            WorkerData::Shard => {
                for (f, r) in data.files.iter().zip(&mut view.ranges) {
                    *r = f.len() * rank / world..f.len() * (rank + 1) / world;
                    if r.len() < sample_len {
                        return Err(bad_input!(
                            "worker_data = \"shard\": {}'s shard {rank} of {world} holds {} tokens, fewer \
                             than one sample of context_length + 1 = {sample_len}; use fewer workers, more \
                             data or \"shared\"",
                            f.path().display(),
                            r.len()
                        ));
                    }
                }
            }
            WorkerData::Blend { weights } => {
                // Checked when the config was resolved: a row per source, not all zero.
                let row = &weights[rank % weights.len()];
                let total: f64 = row.iter().sum();
                let mut acc = 0.0;
                view.cumulative = row
                    .iter()
                    .map(|w| {
                        acc += w / total;
                        acc
                    })
                    .collect();
                // The last source with weight takes the rounding: u < 1 never falls past it.
                if let Some(last) = row.iter().rposition(|&w| w > 0.0) {
                    view.cumulative[last..].iter_mut().for_each(|c| *c = 1.0);
                }
            }
        }
        Ok(view)
    }

    /// Index of the source that uniform `u` in [0, 1) selects.
    fn pick(&self, u: f64) -> usize {
        self.cumulative
            .iter()
            .position(|&c| u < c)
            .unwrap_or(self.cumulative.len() - 1)
    }
}

/// Training sampler of one worker.
#[derive(Debug, Clone)]
pub struct Sampler {
    rng: ChaCha8Rng,
    view: View,
    /// Windows drawn from each source since `take_counts`.
    counts: Vec<u64>,
}

impl Sampler {
    pub fn new(seed: u64, view: View) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed ^ TRAIN_KEY),
            counts: vec![0; view.ranges.len()],
            view,
        }
    }

    /// Windows drawn from each source since the last call.
    pub fn take_counts(&mut self) -> Vec<u64> {
        let zeros = vec![0; self.counts.len()];
        std::mem::replace(&mut self.counts, zeros)
    }

    /// Adds windows drawn by a copy of this sampler (see `prefetch`).
    pub fn add_counts(&mut self, counts: &[u64]) {
        self.counts
            .iter_mut()
            .zip(counts)
            .for_each(|(c, n)| *c += n);
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
            let source = draw_into(&mut self.rng, data, &self.view, &mut window);
            self.counts[source] += 1;
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
    let (mut window, view) = (vec![0u32; t + 1], View::whole(data));
    for row in 0..b {
        rng.set_stream(first_window + row as u64);
        rng.set_word_pos(0);
        draw_into(&mut rng, data, &view, &mut window);
        out.x[row * t..(row + 1) * t].copy_from_slice(&window[..t]);
        out.y[row * t..(row + 1) * t].copy_from_slice(&window[1..]);
    }
    out
}

/// One window of `view`: a source by weight, then a uniform start in its range (modulo of a 64-bit draw:
/// the bias is below 2^-30 for any file under 2^34 tokens, and the draw always uses the same number of
/// words). Returns the source.
fn draw_into(rng: &mut ChaCha8Rng, data: &Blend, view: &View, window: &mut [u32]) -> usize {
    let u = (rng.random::<u64>() >> 11) as f64 / (1u64 << 53) as f64;
    let source = view.pick(u);
    let r = &view.ranges[source];
    let start = r.start as u64 + rng.random::<u64>() % (r.len() - window.len() + 1) as u64;
    data.files[source].read(start as usize, window);
    source
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
        let batch = Sampler::new(1, View::whole(&data)).batch(&data, 0, 0, 4, 16);
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
        let mut s = Sampler::new(42, View::whole(&data));
        let whole = s.batch(&data, 9, 0, 8, 8);
        for world in [2usize, 4, 8] {
            let b = 8 / world;
            let mut x = Vec::new();
            for rank in 0..world {
                x.extend(
                    Sampler::new(42, View::whole(&data))
                        .batch(&data, 9, (rank * b) as u64, b, 8)
                        .x,
                );
            }
            assert_eq!(x, whole.x, "world {world}");
        }
        assert_ne!(
            s.batch(&data, 10, 0, 8, 8),
            whole,
            "each step draws new windows"
        );
        assert_ne!(
            Sampler::new(43, View::whole(&data)).batch(&data, 9, 0, 8, 8),
            whole,
            "the seed matters"
        );
    }

    /// Non-IID views: with one source, a blend row and the shard of one worker are today's sampler;
    /// shards keep each worker's windows inside its part; blend rows keep a worker on its sources.
    #[test]
    fn worker_views_draw_from_their_own_data() {
        let tokens: Vec<u16> = (0..6000).collect();
        let (_d, data) = blend(&tokens);
        let whole = Sampler::new(7, View::whole(&data)).batch(&data, 3, 0, 8, 8);
        let one_row = WorkerData::Blend {
            weights: vec![vec![2.5]],
        };
        for (how, world) in [
            (WorkerData::Shared, 4),
            (one_row, 4),
            (WorkerData::Shard, 1),
        ] {
            let view = View::of(&data, &how, 0, world, 9).unwrap();
            assert_eq!(view, View::whole(&data), "{how:?}");
            let b = Sampler::new(7, view).batch(&data, 3, 0, 8, 8);
            assert_eq!(b, whole, "{how:?}");
        }
        for rank in 0..3 {
            let view = View::of(&data, &WorkerData::Shard, rank, 3, 9).unwrap();
            let mut s = Sampler::new(7, view);
            for step in 0..20 {
                let b = s.batch(&data, step, 0, 4, 8);
                let (lo, hi) = (2000 * rank as u32, 2000 * (rank as u32 + 1));
                assert!(b.x.iter().chain(&b.y).all(|&t| (lo..hi).contains(&t)));
            }
            assert_eq!(s.take_counts(), vec![80]);
            assert_eq!(s.take_counts(), vec![0]);
        }
        assert!(
            View::of(&data, &WorkerData::Shard, 0, 1000, 9).is_err(),
            "6 tokens a shard"
        );
    }

    #[test]
    fn blend_rows_keep_each_worker_on_its_sources() {
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<TokenFile> = (0..2u16)
            .map(|k| {
                let p = dir.path().join(format!("{k}.bin"));
                let bytes: Vec<u8> = (0..500u16)
                    .flat_map(|t| (t + 1000 * k).to_le_bytes())
                    .collect();
                std::fs::write(&p, bytes).unwrap();
                TokenFile::open_nanogpt(&p, false).unwrap()
            })
            .collect();
        let data = Blend::from_files(files, &[1.0, 1.0]);
        let how = WorkerData::Blend {
            weights: vec![vec![1.0, 0.0], vec![0.0, 3.0], vec![1.0, 1.0]],
        };
        let counts: Vec<Vec<u64>> = (0..3)
            .map(|rank| {
                let mut s = Sampler::new(1, View::of(&data, &how, rank, 3, 9).unwrap());
                let b = s.batch(&data, 0, 0, 200, 8);
                let own = |t: u32| match rank {
                    0 => t < 1000,
                    1 => t >= 1000,
                    _ => true,
                };
                assert!(b.x.iter().all(|&t| own(t)), "rank {rank}");
                s.take_counts()
            })
            .collect();
        assert_eq!(counts[0], vec![200, 0]);
        assert_eq!(counts[1], vec![0, 200]);
        assert!(
            counts[2].iter().all(|&c| (60..140).contains(&c)),
            "{:?}",
            counts[2]
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

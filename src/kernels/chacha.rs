//! ChaCha8 as rand_chacha's `ChaCha8Rng` yields it (64-bit block counter in words 12-13, 64-bit stream in
//! words 14-15): one word at a time (`chacha8_word`, the twin of the QSGD kernel's draw) and whole runs
//! of the stream (`ChaCha8`, what the QSGD encoding on the host draws), 16 blocks at a time with one
//! block per vector lane.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// "expand 32-byte k", the first four words of every block.
const SIGMA: [u32; 4] = [0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574];
/// Blocks computed together, one per vector lane.
const LANES: usize = 16;
/// Words per block.
const WORDS: usize = 16;
/// Words per batch of `LANES` consecutive blocks.
const BATCH: usize = LANES * WORDS;

/// Twin of `chacha8_word`: the e-th u32 that rand_chacha's ChaCha8Rng with seed `key` (its `get_seed()`,
/// as eight little-endian words) yields after `set_stream(stream)`: word e % 16 of block e / 16.
pub fn chacha8_word(key: &[u32; 8], stream: u64, e: u64) -> u32 {
    let ctr = e / 16;
    let mut s = [0u32; 16];
    s[..4].copy_from_slice(&SIGMA);
    s[4..12].copy_from_slice(key);
    s[12..].copy_from_slice(&[
        ctr as u32,
        (ctr >> 32) as u32,
        stream as u32,
        (stream >> 32) as u32,
    ]);
    let mut x = s;
    let qr = |x: &mut [u32; 16], a: usize, b: usize, c: usize, d: usize| {
        x[a] = x[a].wrapping_add(x[b]);
        x[d] = (x[d] ^ x[a]).rotate_left(16);
        x[c] = x[c].wrapping_add(x[d]);
        x[b] = (x[b] ^ x[c]).rotate_left(12);
        x[a] = x[a].wrapping_add(x[b]);
        x[d] = (x[d] ^ x[a]).rotate_left(8);
        x[c] = x[c].wrapping_add(x[d]);
        x[b] = (x[b] ^ x[c]).rotate_left(7);
    };
    for _ in 0..4 {
        for (a, b, c, d) in [
            (0, 4, 8, 12),
            (1, 5, 9, 13),
            (2, 6, 10, 14),
            (3, 7, 11, 15),
            (0, 5, 10, 15),
            (1, 6, 11, 12),
            (2, 7, 8, 13),
            (3, 4, 9, 14),
        ] {
            qr(&mut x, a, b, c, d);
        }
    }
    let w = (e % 16) as usize;
    x[w].wrapping_add(s[w])
}

/// One ChaCha8 stream from word 0 on: `fill` yields the words that rand_chacha's `ChaCha8Rng` with seed
/// `key` (its `get_seed()`, as eight little-endian words) yields after `set_stream(stream)`. With AVX-512
/// it computes 16 blocks at a time, one per lane; elsewhere it is that `ChaCha8Rng`.
pub struct ChaCha8(Source);

enum Source {
    #[cfg(target_arch = "x86_64")]
    Wide(wide::Stream),
    Portable(Box<ChaCha8Rng>),
}

impl ChaCha8 {
    pub fn new(key: [u32; 8], stream: u64) -> Self {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512f") {
            return Self(Source::Wide(wide::Stream::new(key, stream)));
        }
        Self(Source::Portable(Box::new(portable(key, stream))))
    }

    /// The stream's next `out.len()` words.
    pub fn fill(&mut self, out: &mut [u32]) {
        match &mut self.0 {
            #[cfg(target_arch = "x86_64")]
            Source::Wide(s) => s.fill(out),
            Source::Portable(rng) => rng.fill(out),
        }
    }
}

/// rand_chacha's generator of the stream.
fn portable(key: [u32; 8], stream: u64) -> ChaCha8Rng {
    let mut seed = [0u8; 32];
    for (bytes, k) in seed.chunks_exact_mut(4).zip(key) {
        bytes.copy_from_slice(&k.to_le_bytes());
    }
    let mut rng = ChaCha8Rng::from_seed(seed);
    rng.set_stream(stream);
    rng
}

/// A block's 16 words, one row per word, one lane per block.
type Rows = [[u32; LANES]; WORDS];

/// The input words of blocks `first..first + LANES`: constants, key, each lane's block counter, the
/// stream.
#[inline(always)]
fn initial(key: &[u32; 8], stream: u64, first: u64) -> Rows {
    let mut x = [[0u32; LANES]; WORDS];
    for (row, &c) in x.iter_mut().zip(SIGMA.iter().chain(key)) {
        *row = [c; LANES];
    }
    let ctr: [u64; LANES] = std::array::from_fn(|lane| first + lane as u64);
    x[12] = ctr.map(|c| c as u32);
    x[13] = ctr.map(|c| (c >> 32) as u32);
    x[14] = [stream as u32; LANES];
    x[15] = [(stream >> 32) as u32; LANES];
    x
}

/// A column round, then a diagonal round.
#[inline(always)]
fn double_round(x: &mut Rows) {
    quarter(x, 0, 4, 8, 12);
    quarter(x, 1, 5, 9, 13);
    quarter(x, 2, 6, 10, 14);
    quarter(x, 3, 7, 11, 15);
    quarter(x, 0, 5, 10, 15);
    quarter(x, 1, 6, 11, 12);
    quarter(x, 2, 7, 8, 13);
    quarter(x, 3, 4, 9, 14);
}

/// One quarter round on every lane (a loop over a row that vectorizes).
#[inline(always)]
fn quarter(x: &mut Rows, a: usize, b: usize, c: usize, d: usize) {
    let (mut va, mut vb, mut vc, mut vd) = (x[a], x[b], x[c], x[d]);
    for l in 0..LANES {
        va[l] = va[l].wrapping_add(vb[l]);
        vd[l] = (vd[l] ^ va[l]).rotate_left(16);
        vc[l] = vc[l].wrapping_add(vd[l]);
        vb[l] = (vb[l] ^ vc[l]).rotate_left(12);
        va[l] = va[l].wrapping_add(vb[l]);
        vd[l] = (vd[l] ^ va[l]).rotate_left(8);
        vc[l] = vc[l].wrapping_add(vd[l]);
        vb[l] = (vb[l] ^ vc[l]).rotate_left(7);
    }
    (x[a], x[b], x[c], x[d]) = (va, vb, vc, vd);
}

#[cfg(target_arch = "x86_64")]
mod wide {
    use super::{double_round, initial, BATCH, LANES, WORDS};
    use std::arch::x86_64::*;

    /// The AVX-512 stream: its next word's index, and the batch of `LANES` blocks (words
    /// `BATCH * held..`) kept for a fill that ends inside it.
    pub struct Stream {
        key: [u32; 8],
        stream: u64,
        pos: u64,
        buf: Box<[u32; BATCH]>,
        held: Option<u64>,
    }

    impl Stream {
        /// Only where the processor has AVX-512F (`ChaCha8::new` checks).
        pub fn new(key: [u32; 8], stream: u64) -> Self {
            assert!(is_x86_feature_detected!("avx512f"));
            let (pos, buf, held) = (0, Box::new([0; BATCH]), None);
            Self {
                key,
                stream,
                pos,
                buf,
                held,
            }
        }

        pub fn fill(&mut self, out: &mut [u32]) {
            let mut done = 0;
            while done < out.len() {
                let (index, off) = (self.pos / BATCH as u64, (self.pos % BATCH as u64) as usize);
                let rest = &mut out[done..];
                let n = if off == 0 && rest.len() >= BATCH {
                    let b: &mut [u32; BATCH] =
                        (&mut rest[..BATCH]).try_into().expect("BATCH words");
                    // SAFETY: `new` asserted that this processor has AVX-512F.
                    unsafe { batch(&self.key, self.stream, index * LANES as u64, b) };
                    BATCH
                } else {
                    if self.held != Some(index) {
                        // SAFETY: as above.
                        unsafe {
                            batch(&self.key, self.stream, index * LANES as u64, &mut self.buf)
                        };
                        self.held = Some(index);
                    }
                    let n = rest.len().min(BATCH - off);
                    rest[..n].copy_from_slice(&self.buf[off..off + n]);
                    n
                };
                done += n;
                self.pos += n as u64;
            }
        }
    }

    /// Blocks `first..first + LANES` of the stream, block after block: the rounds on rows of lanes,
    /// then the 16 x 16 transpose from rows of words to blocks. Only where the processor has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn batch(key: &[u32; 8], stream: u64, first: u64, out: &mut [u32; BATCH]) {
        let start = initial(key, stream, first);
        let mut x = start;
        for _ in 0..4 {
            double_round(&mut x);
        }
        // SAFETY: unaligned loads of 16 u32 from arrays of 16.
        let load = |r: &[u32; LANES]| unsafe { _mm512_loadu_si512(r.as_ptr().cast()) };
        let mut rows: [__m512i; WORDS] =
            std::array::from_fn(|w| _mm512_add_epi32(load(&x[w]), load(&start[w])));
        swap_blocks::<8>(&mut rows);
        swap_blocks::<4>(&mut rows);
        swap_blocks::<2>(&mut rows);
        swap_blocks::<1>(&mut rows);
        for (block, row) in out.chunks_exact_mut(WORDS).zip(rows) {
            // SAFETY: an unaligned store of 16 u32 into a chunk of 16.
            unsafe { _mm512_storeu_si512(block.as_mut_ptr().cast(), row) };
        }
    }

    /// One stage of the transpose: in every tile of 2 half x 2 half entries, the top right and bottom
    /// left half x half blocks swap. The four stages (HALF 8, 4, 2, 1) together transpose.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn swap_blocks<const HALF: usize>(rows: &mut [__m512i; WORDS]) {
        let [top, bottom] = PICKS[HALF.trailing_zeros() as usize];
        // SAFETY: unaligned loads of 16 i32 from arrays of 16.
        let (top, bottom) = unsafe {
            (
                _mm512_loadu_si512(top.as_ptr().cast()),
                _mm512_loadu_si512(bottom.as_ptr().cast()),
            )
        };
        for i in (0..WORDS / 2).map(|j| (j / HALF) * 2 * HALF + j % HALF) {
            let (a, b) = (rows[i], rows[i + HALF]);
            rows[i] = _mm512_permutex2var_epi32(a, top, b);
            rows[i + HALF] = _mm512_permutex2var_epi32(a, bottom, b);
        }
    }

    /// `_mm512_permutex2var_epi32`'s indices for the stages of half 1, 2, 4, 8: position p of the new top
    /// row takes the top row's entry (index < 16) where p's bit `half` is clear, the bottom row's
    /// (index + 16) where it is set, from the first half of p's tile; the new bottom row the same from
    /// the tile's second half.
    const PICKS: [[[i32; 16]; 2]; 4] = [picks(1), picks(2), picks(4), picks(8)];

    const fn picks(half: usize) -> [[i32; 16]; 2] {
        let mut out = [[0i32; 16]; 2];
        let mut p = 0;
        while p < 16 {
            let (tile, q) = (p & !(2 * half - 1), p & (2 * half - 1));
            let (from, col) = if q < half { (0, q) } else { (16, q - half) };
            out[0][p] = (from + tile + col) as i32;
            out[1][p] = (from + tile + half + col) as i32;
            p += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngCore, SeedableRng};

    fn rand_chacha(seed: u64, stream: u64) -> (rand_chacha::ChaCha8Rng, [u32; 8]) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(stream);
        let bytes = rng.get_seed();
        let key = std::array::from_fn(|i| {
            u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap())
        });
        (rng, key)
    }

    /// The ChaCha8 twin (what the QSGD kernel draws) is rand_chacha's ChaCha8Rng, word for word, on
    /// several streams and across block and buffer boundaries.
    #[test]
    fn chacha8_word_is_rand_chachas_stream() {
        for (seed, stream) in [(1u64, 0u64), (0x9e37_79b9, 5), (u64::MAX, 1 << 40)] {
            let (mut rng, key) = rand_chacha(seed, stream);
            for e in 0..300u64 {
                assert_eq!(
                    chacha8_word(&key, stream, e),
                    rng.next_u32(),
                    "seed {seed}, word {e}"
                );
            }
        }
    }

    /// `ChaCha8::fill` is rand_chacha's stream word for word whatever the lengths of the fills: runs
    /// that start and end inside a batch, inside a block, on a batch's edge, and span many batches.
    #[test]
    fn filling_gives_rand_chachas_stream_whatever_the_lengths() {
        let lengths = [
            1usize, 15, 16, 17, 240, 255, 256, 257, 511, 512, 1000, 4096, 3, 767, 5000,
        ];
        for (seed, stream) in [(7u64, 0u64), (0x9e37_79b9, 3), (u64::MAX, 1 << 40)] {
            let (_, key) = rand_chacha(seed, stream);
            // What `new` picks here (16 lanes where there is AVX-512), and rand_chacha's own.
            for mut ours in [
                ChaCha8::new(key, stream),
                ChaCha8(Source::Portable(Box::new(portable(key, stream)))),
            ] {
                let (mut rng, _) = rand_chacha(seed, stream);
                for (i, &n) in lengths.iter().cycle().take(40).enumerate() {
                    let mut got = vec![0u32; n];
                    ours.fill(&mut got);
                    let want: Vec<u32> = (0..n).map(|_| rng.next_u32()).collect();
                    assert_eq!(got, want, "seed {seed}, stream {stream}, fill {i} of {n}");
                }
            }
        }
    }

    /// The 16-lane batch where the block counter's low word wraps into its high word between two lanes.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_wide_batch_carries_the_block_counter_between_lanes() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("no AVX-512 here: the 16-lane batch is not run");
            return;
        }
        let (key, stream, first) = ([1, 2, 3, 4, 5, 6, 7, 8], 9, u32::MAX as u64 - 3);
        let mut out = [0u32; BATCH];
        // SAFETY: this processor has AVX-512F (checked above).
        unsafe { wide::batch(&key, stream, first, &mut out) };
        for (i, &w) in out.iter().enumerate() {
            let e = first * WORDS as u64 + i as u64;
            assert_eq!(w, chacha8_word(&key, stream, e), "word {e}");
        }
    }
}

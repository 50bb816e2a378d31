//! ChaCha8 as rand_chacha's `ChaCha8Rng` yields it (64-bit block counter in words 12-13, 64-bit stream in
//! words 14-15): one word at a time (`chacha8_word`, the twin of the QSGD kernel's draw) and whole runs
//! of the stream (`ChaCha8`, what the QSGD encoding on the host draws), 16 blocks at a time with AVX-512
//! and 8 with AVX2, one block per vector lane.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// "expand 32-byte k", the first four words of every block.
const SIGMA: [u32; 4] = [0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574];
/// Words per block.
const WORDS: usize = 16;
/// Words of the widest batch: 16 consecutive blocks, one per AVX-512 lane.
#[cfg(target_arch = "x86_64")]
const MAX_BATCH: usize = 16 * WORDS;

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
        if let Some(width) = wide::Width::here() {
            return Self(Source::Wide(wide::Stream::new(width, key, stream)));
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

/// L blocks' 16 words, one row per word, one lane per block.
type Rows<const L: usize> = [[u32; L]; WORDS];

/// The input words of blocks `first..first + L`: constants, key, each lane's block counter, the stream.
#[inline(always)]
fn initial<const L: usize>(key: &[u32; 8], stream: u64, first: u64) -> Rows<L> {
    let mut x = [[0u32; L]; WORDS];
    for (row, &c) in x.iter_mut().zip(SIGMA.iter().chain(key)) {
        *row = [c; L];
    }
    let ctr: [u64; L] = std::array::from_fn(|lane| first + lane as u64);
    x[12] = ctr.map(|c| c as u32);
    x[13] = ctr.map(|c| (c >> 32) as u32);
    x[14] = [stream as u32; L];
    x[15] = [(stream >> 32) as u32; L];
    x
}

/// A column round, then a diagonal round.
#[inline(always)]
fn double_round<const L: usize>(x: &mut Rows<L>) {
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
fn quarter<const L: usize>(x: &mut Rows<L>, a: usize, b: usize, c: usize, d: usize) {
    let (mut va, mut vb, mut vc, mut vd) = (x[a], x[b], x[c], x[d]);
    for l in 0..L {
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
    use super::{double_round, initial, MAX_BATCH, WORDS};
    use std::arch::x86_64::*;

    /// The vector width the stream is computed in: blocks per batch, one per lane.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Width {
        /// 16 blocks in AVX-512 vectors.
        Avx512,
        /// 8 blocks in AVX2 vectors.
        Avx2,
    }

    impl Width {
        /// The widest this processor has, if any.
        pub fn here() -> Option<Self> {
            if is_x86_feature_detected!("avx512f") {
                Some(Self::Avx512)
            } else if is_x86_feature_detected!("avx2") {
                Some(Self::Avx2)
            } else {
                None
            }
        }

        /// Blocks per batch.
        pub fn lanes(self) -> usize {
            match self {
                Self::Avx512 => 16,
                Self::Avx2 => 8,
            }
        }

        /// Words per batch.
        fn batch_words(self) -> usize {
            self.lanes() * WORDS
        }

        /// Blocks `first..first + lanes` of the stream into `out` (one batch of words).
        pub fn batch(self, key: &[u32; 8], stream: u64, first: u64, out: &mut [u32]) {
            match self {
                Self::Avx512 => {
                    let out = out.try_into().expect("a batch of 16 blocks");
                    assert!(is_x86_feature_detected!("avx512f"));
                    // SAFETY: this processor has AVX-512F (asserted above).
                    unsafe { batch16(key, stream, first, out) }
                }
                Self::Avx2 => {
                    let out = out.try_into().expect("a batch of 8 blocks");
                    assert!(is_x86_feature_detected!("avx2"));
                    // SAFETY: this processor has AVX2 (asserted above).
                    unsafe { batch8(key, stream, first, out) }
                }
            }
        }
    }

    /// The vector stream: its width, its next word's index, and the batch of blocks (words
    /// `width.batch_words() * held..`) kept for a fill that ends inside it.
    pub struct Stream {
        width: Width,
        key: [u32; 8],
        stream: u64,
        pos: u64,
        buf: Box<[u32; MAX_BATCH]>,
        held: Option<u64>,
    }

    impl Stream {
        pub fn new(width: Width, key: [u32; 8], stream: u64) -> Self {
            let (pos, buf, held) = (0, Box::new([0; MAX_BATCH]), None);
            Self {
                width,
                key,
                stream,
                pos,
                buf,
                held,
            }
        }

        pub fn fill(&mut self, out: &mut [u32]) {
            let (width, words) = (self.width, self.width.batch_words());
            let mut done = 0;
            while done < out.len() {
                let (index, off) = (self.pos / words as u64, (self.pos % words as u64) as usize);
                let first = index * width.lanes() as u64;
                let rest = &mut out[done..];
                let n = if off == 0 && rest.len() >= words {
                    width.batch(&self.key, self.stream, first, &mut rest[..words]);
                    words
                } else {
                    let buf = &mut self.buf[..words];
                    if self.held != Some(index) {
                        width.batch(&self.key, self.stream, first, buf);
                        self.held = Some(index);
                    }
                    let n = rest.len().min(words - off);
                    rest[..n].copy_from_slice(&buf[off..off + n]);
                    n
                };
                done += n;
                self.pos += n as u64;
            }
        }
    }

    /// Blocks `first..first + 16` of the stream, block after block: the rounds on rows of lanes, then
    /// the 16 x 16 transpose from rows of words to blocks. Only where the processor has AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn batch16(key: &[u32; 8], stream: u64, first: u64, out: &mut [u32; 16 * WORDS]) {
        let start = initial::<16>(key, stream, first);
        let mut x = start;
        for _ in 0..4 {
            double_round(&mut x);
        }
        // SAFETY: unaligned loads of 16 u32 from arrays of 16.
        let load = |r: &[u32; 16]| unsafe { _mm512_loadu_si512(r.as_ptr().cast()) };
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

    /// Blocks `first..first + 8` of the stream, block after block: the rounds on rows of 8 lanes (16
    /// rows, one AVX2 register each), then words 0-7 and 8-15 of the blocks each transposed 8 x 8.
    /// Only where the processor has AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn batch8(key: &[u32; 8], stream: u64, first: u64, out: &mut [u32; 8 * WORDS]) {
        let start = initial::<8>(key, stream, first);
        let mut x = start;
        for _ in 0..4 {
            double_round(&mut x);
        }
        // SAFETY: unaligned loads of 8 u32 from arrays of 8.
        let load = |r: &[u32; 8]| unsafe { _mm256_loadu_si256(r.as_ptr().cast()) };
        let rows: [__m256i; WORDS] =
            std::array::from_fn(|w| _mm256_add_epi32(load(&x[w]), load(&start[w])));
        for (half, rows) in rows.chunks_exact(8).enumerate() {
            let columns = transpose8(rows.try_into().expect("8 rows"));
            for (block, column) in out.chunks_exact_mut(WORDS).zip(columns) {
                let to = &mut block[8 * half..8 * half + 8];
                // SAFETY: an unaligned store of 8 u32 into a slice of 8.
                unsafe { _mm256_storeu_si256(to.as_mut_ptr().cast(), column) };
            }
        }
    }

    /// The 8 x 8 transpose of rows of 8 u32: pairs of rows interleaved by words, then by pairs of
    /// words, then the 128-bit halves exchanged.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn transpose8(r: [__m256i; 8]) -> [__m256i; 8] {
        let t: [__m256i; 8] = std::array::from_fn(|i| {
            let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
            if i % 2 == 0 {
                _mm256_unpacklo_epi32(a, b)
            } else {
                _mm256_unpackhi_epi32(a, b)
            }
        });
        // u[4 h + j]: words j of rows 4h..4h+4, in each 128-bit half (j = 0, 1, 2, 3).
        let u: [__m256i; 8] = std::array::from_fn(|i| {
            let (h, j) = (i / 4, i % 4);
            let (a, b) = (t[4 * h + j / 2], t[4 * h + 2 + j / 2]);
            if j % 2 == 0 {
                _mm256_unpacklo_epi64(a, b)
            } else {
                _mm256_unpackhi_epi64(a, b)
            }
        });
        std::array::from_fn(|c| {
            let (a, b) = (u[c % 4], u[4 + c % 4]);
            if c < 4 {
                _mm256_permute2x128_si256::<0x20>(a, b)
            } else {
                _mm256_permute2x128_si256::<0x31>(a, b)
            }
        })
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
            1usize, 15, 16, 17, 240, 255, 256, 257, 511, 512, 1000, 4096, 3, 767, 5000, 127, 128,
            129, 383,
        ];
        for (seed, stream) in [(7u64, 0u64), (0x9e37_79b9, 3), (u64::MAX, 1 << 40)] {
            let (_, key) = rand_chacha(seed, stream);
            // What `new` picks here, every vector width this processor has, and rand_chacha's own.
            let mut sources = vec![
                ChaCha8::new(key, stream),
                ChaCha8(Source::Portable(Box::new(portable(key, stream)))),
            ];
            #[cfg(target_arch = "x86_64")]
            sources
                .extend(widths().map(|w| ChaCha8(Source::Wide(wide::Stream::new(w, key, stream)))));
            for mut ours in sources {
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

    /// The vector widths this processor has.
    #[cfg(target_arch = "x86_64")]
    fn widths() -> impl Iterator<Item = wide::Width> {
        let has = [
            is_x86_feature_detected!("avx512f"),
            is_x86_feature_detected!("avx2"),
        ];
        [wide::Width::Avx512, wide::Width::Avx2]
            .into_iter()
            .zip(has)
            .filter_map(|(w, has)| has.then_some(w))
    }

    /// Each width's batch where the block counter's low word wraps into its high word between two lanes.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_wide_batch_carries_the_block_counter_between_lanes() {
        let (key, stream, first) = ([1, 2, 3, 4, 5, 6, 7, 8], 9, u32::MAX as u64 - 3);
        for width in widths() {
            let mut out = vec![0u32; width.lanes() * WORDS];
            width.batch(&key, stream, first, &mut out);
            for (i, &w) in out.iter().enumerate() {
                let e = first * WORDS as u64 + i as u64;
                assert_eq!(w, chacha8_word(&key, stream, e), "{width:?}, word {e}");
            }
        }
    }
}

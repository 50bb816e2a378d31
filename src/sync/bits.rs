//! Codes of a few bits packed into f32 words (as u32 bit patterns), lowest bits first: what the
//! compressors send (CHOCO's QSGD levels, SparseLoCo's indices and values). Collectives move the words'
//! bytes and never compute on them.

/// Codes of a few bits packed into f32 words (as u32 bit patterns), lowest bits first.
pub struct BitWriter<'a> {
    out: &'a mut [f32],
    word: usize,
    acc: u64,
    used: u32,
}

impl<'a> BitWriter<'a> {
    pub fn new(out: &'a mut [f32]) -> Self {
        Self {
            out,
            word: 0,
            acc: 0,
            used: 0,
        }
    }

    pub fn put(&mut self, code: u32, bits: u32) {
        self.acc |= (code as u64) << self.used;
        self.used += bits;
        if self.used >= 32 {
            self.out[self.word] = f32::from_bits(self.acc as u32);
            self.word += 1;
            self.acc >>= 32;
            self.used -= 32;
        }
    }

    /// `put` of each code in turn, with the writer's state in registers for the run: with AVX-512 and
    /// codes of up to 16 bits, 32 codes at a time packed in the vector lanes (`wide::put`); else runs
    /// of whole blocks of 32 packed into `bits` whole words a block (`pack_run`), each word then
    /// shifted past the bits already pending; the rest one at a time.
    pub fn put_all(&mut self, codes: &[u32], bits: u32) {
        #[cfg(target_arch = "x86_64")]
        let codes = self.put_blocks(codes, bits);
        let (mut acc, mut used, mut word) = (self.acc, self.used, self.word);
        let b = bits as usize;
        let mut rest = codes;
        if let Some(pack) = block(bits).map(|f| f.0) {
            let mut packed = [0u32; RUN + 4];
            let whole = codes.len() / 32 * 32;
            for run in codes[..whole].chunks(RUN) {
                let n = run.len() / 32 * b;
                pack_run(run, bits, pack, &mut packed);
                for (o, &p) in self.out[word..word + n].iter_mut().zip(&packed[..n]) {
                    let x = acc | (p as u64) << used;
                    *o = f32::from_bits(x as u32);
                    acc = x >> 32;
                }
                word += n;
            }
            rest = &codes[whole..];
        }
        for &code in rest {
            acc |= (code as u64) << used;
            used += bits;
            if used >= 32 {
                self.out[word] = f32::from_bits(acc as u32);
                word += 1;
                acc >>= 32;
                used -= 32;
            }
        }
        (self.acc, self.used, self.word) = (acc, used, word);
    }

    /// With AVX-512, the first codes in blocks of 32 (`wide::put`), where codes are 1 to
    /// `wide::MAX_PACKED` bits wide; the codes left over.
    #[cfg(target_arch = "x86_64")]
    fn put_blocks<'c>(&mut self, codes: &'c [u32], bits: u32) -> &'c [u32] {
        let fits = (1..=wide::MAX_PACKED).contains(&bits);
        if !fits || codes.len() < 32 || !is_x86_feature_detected!("avx512f") {
            return codes;
        }
        let whole = codes.len() / 32 * 32;
        let state = (self.acc as u32, self.used, self.word);
        // SAFETY: this processor has AVX-512F (checked above), and bits is 1 to MAX_PACKED.
        let (acc, used, word) = unsafe { wide::put(&codes[..whole], bits, self.out, state) };
        (self.acc, self.used, self.word) = (acc as u64, used, word);
        &codes[whole..]
    }
}

impl Drop for BitWriter<'_> {
    fn drop(&mut self) {
        if self.used > 0 {
            self.out[self.word] = f32::from_bits(self.acc as u32);
        }
    }
}

pub struct BitReader<'a> {
    words: &'a [f32],
    word: usize,
    acc: u64,
    have: u32,
}

impl<'a> BitReader<'a> {
    pub fn new(words: &'a [f32]) -> Self {
        Self {
            words,
            word: 0,
            acc: 0,
            have: 0,
        }
    }

    /// A reader from bit `bit` of `words` on (bit 0 is the lowest of word 0, as `BitWriter` fills them).
    pub fn at(words: &'a [f32], bit: u64) -> Self {
        let mut r = Self::new(words);
        r.word = (bit / 32) as usize;
        match (bit % 32) as u32 {
            0 => {}
            skip => {
                r.get(skip);
            }
        }
        r
    }

    pub fn get(&mut self, bits: u32) -> u32 {
        if self.have < bits {
            let w = self.words.get(self.word).map_or(0, |w| w.to_bits());
            self.acc |= (w as u64) << self.have;
            self.have += 32;
            self.word += 1;
        }
        let code = (self.acc & ((1u64 << bits) - 1)) as u32;
        self.acc >>= bits;
        self.have -= bits;
        code
    }

    /// `get` of as many codes as `out` holds, with the reader's state in registers for the run: 32 codes
    /// at a time from `bits` words, realigned past the bits already read and unpacked with shifts fixed
    /// at compile time (`unpack`), while whole words remain; the rest one at a time.
    pub fn get_all(&mut self, bits: u32, out: &mut [u32]) {
        #[cfg(target_arch = "x86_64")]
        let out = self.get_blocks(bits, out);
        let (mut acc, mut have, mut word) = (self.acc, self.have, self.word);
        let mask = (1u64 << bits) - 1;
        let b = bits as usize;
        let mut rest = out;
        if let Some(unpack) = block(bits).map(|f| f.1) {
            let mut aligned = [0u32; 32];
            while rest.len() >= 32 && word + b <= self.words.len() && have < 32 {
                for (a, w) in aligned[..b].iter_mut().zip(&self.words[word..word + b]) {
                    let x = acc | (w.to_bits() as u64) << have;
                    *a = x as u32;
                    acc = x >> 32;
                }
                word += b;
                let (block, tail) = std::mem::take(&mut rest).split_at_mut(32);
                unpack(&aligned[..b], block);
                rest = tail;
            }
        }
        for o in rest {
            if have < bits {
                let w = self.words.get(word).map_or(0, |w| w.to_bits());
                acc |= (w as u64) << have;
                have += 32;
                word += 1;
            }
            *o = (acc & mask) as u32;
            acc >>= bits;
            have -= bits;
        }
        (self.acc, self.have, self.word) = (acc, have, word);
    }

    /// The first codes of `out` straight from the words, in vectors: with AVX-512, in blocks of 32
    /// (`wide::unpack`) while 32 words lie at and past the next code's word; else with AVX2 and codes of
    /// up to `narrow::MAX_BITS` bits, in groups of 8 (`narrow::unpack`) while 16 bytes lie at and past
    /// the group's first byte. The rest of `out`.
    #[cfg(target_arch = "x86_64")]
    fn get_blocks<'o>(&mut self, bits: u32, out: &'o mut [u32]) -> &'o mut [u32] {
        // The next code's bit: `acc` holds the `have` bits before word `word`.
        let at = self.word * 32 - self.have as usize;
        let done = if bits <= wide::MAX_BITS && is_x86_feature_detected!("avx512f") {
            self.wide_blocks(at, bits, out)
        } else if narrow::usable(bits) {
            // SAFETY: this processor has AVX2, and bits is 1 to MAX_BITS (`usable`).
            unsafe { narrow::unpack(self.words, at, bits, out) }
        } else {
            0
        };
        if done == 0 {
            return out;
        }
        // Codes were read: word `at / 32` after them lies inside the words.
        let at = at + done * bits as usize;
        let (word, off) = (at / 32, (at % 32) as u32);
        (self.word, self.have, self.acc) = match off {
            0 => (word, 0, 0),
            _ => (
                word + 1,
                32 - off,
                (self.words[word].to_bits() >> off) as u64,
            ),
        };
        &mut out[done..]
    }

    /// `wide::unpack` of blocks of 32 codes from bit `at` on into `out`, while 32 words lie at and past
    /// the block's first word; how many codes that was. Only where the processor has AVX-512F, with
    /// bits at most `wide::MAX_BITS`.
    #[cfg(target_arch = "x86_64")]
    fn wide_blocks(&self, mut at: usize, bits: u32, out: &mut [u32]) -> usize {
        let room = |at: usize| at / 32 + 32 <= self.words.len();
        let mut done = 0;
        for block in out.chunks_exact_mut(32) {
            if !room(at) {
                break;
            }
            let block: &mut [u32; 32] = block.try_into().expect("32 codes");
            // SAFETY: the caller checked AVX-512F and the width.
            unsafe { wide::unpack(self.words, at, bits, block) };
            at += 32 * bits as usize;
            done += 32;
        }
        done
    }
}

/// The positions of the set bits of the bitmap `set` (bit i of word w: position 64 w + i), ascending.
/// With AVX-512, a word at a time without a branch per bit (`wide::positions`).
pub fn positions(set: &[u64]) -> Vec<u32> {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vbmi2")
    {
        // SAFETY: this processor has AVX-512F, BW and VBMI2 (checked above).
        return unsafe { wide::positions(set) };
    }
    positions_scalar(set)
}

/// `positions` a bit at a time.
fn positions_scalar(set: &[u64]) -> Vec<u32> {
    let mut out = Vec::new();
    for (w, &word) in set.iter().enumerate() {
        let mut word = word;
        while word != 0 {
            out.push((64 * w) as u32 + word.trailing_zeros());
            word &= word - 1;
        }
    }
    out
}

/// Unpacking with AVX-512: each lane takes its code from the two words it straddles. Packing: codes
/// joined pairwise, level by level, in the lanes.
#[cfg(target_arch = "x86_64")]
mod wide {
    use std::arch::x86_64::*;

    /// The widest codes `put` packs: 32 of them in at most 16 words (one vector).
    pub const MAX_PACKED: u32 = 16;

    /// Each 64-bit lane of `x` holding two values of `w` bits in its halves: the pair joined into one
    /// of 2w bits, the low half's value first.
    #[target_feature(enable = "avx512f")]
    fn join(x: __m512i, w: u32) -> __m512i {
        let low = _mm512_and_si512(x, _mm512_set1_epi64(u32::MAX as i64));
        let high = _mm512_sll_epi64(_mm512_srli_epi64::<32>(x), _mm_cvtsi32_si128(w as i32));
        _mm512_or_si512(low, high)
    }

    /// The 32 codes of `bits` bits in `lo` and `hi` joined pairwise into groups, level by level, up
    /// to groups of `w` bits (a power of two times `bits`, at most 32) in 32-bit lanes; those joined
    /// once more: the groups of 2w bits in 64-bit lanes, in order.
    #[target_feature(enable = "avx512f")]
    fn groups(lo: __m512i, hi: __m512i, bits: u32, w: u32) -> __m512i {
        // The even 32-bit lanes of two vectors (the joined groups narrowed), in order.
        let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let mut v = _mm512_permutex2var_epi32(join(lo, bits), evens, join(hi, bits));
        let mut width = 2 * bits;
        while width < w {
            v = _mm512_permutexvar_epi32(evens, join(v, width));
            width *= 2;
        }
        join(v, w)
    }

    /// The 32-bit words at bits o of 64-bit groups a of `wide` bits (wide > 32) of `groups`, in
    /// the groups' order: each the group's bits from o on, then the next group's.
    #[target_feature(enable = "avx512f")]
    fn words_of(groups: __m512i, wide: u32, a: __m512i, o: __m512i) -> __m256i {
        let next = _mm512_add_epi64(a, _mm512_set1_epi64(1));
        let rest = _mm512_sub_epi64(_mm512_set1_epi64(wide as i64), o);
        let first = _mm512_srlv_epi64(_mm512_permutexvar_epi64(a, groups), o);
        let second = _mm512_sllv_epi64(_mm512_permutexvar_epi64(next, groups), rest);
        _mm512_cvtepi64_epi32(_mm512_or_si512(first, second))
    }

    /// `BitWriter::put` of each of `codes` (whole blocks of 32, of 1 to `MAX_PACKED` bits) from the
    /// writer's state (pending bits, their count, next word) into `out`; the state after. Each block
    /// is packed in the lanes: codes joined pairwise while the groups fit in 32 bits, once more into
    /// 64-bit groups of W > 32 bits, then word j taken from the groups bit 32 j lies in and after;
    /// the words are then shifted past the pending bits and stored. Only where the processor has
    /// AVX-512F; panics if `out` runs short.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn put(
        codes: &[u32],
        bits: u32,
        out: &mut [f32],
        (acc, used, mut word): (u32, u32, usize),
    ) -> (u32, u32, usize) {
        let mut w = 2 * bits;
        while 2 * w <= 32 {
            w *= 2;
        }
        // Word j's group a and its bit o there, in 64-bit lanes j of two vectors.
        let (mut at, mut off) = ([0u64; 16], [0u64; 16]);
        for (j, (a, o)) in at.iter_mut().zip(&mut off).enumerate() {
            (*a, *o) = (
                32 * j as u64 / (2 * w as u64),
                32 * j as u64 % (2 * w as u64),
            );
        }
        let table = [at, off];
        // SAFETY: unaligned loads of 8 values from arrays of 16, at 0 and 8.
        let [a, o] = table.map(|v| unsafe {
            let p = v.as_ptr().cast::<__m512i>();
            [_mm512_loadu_si512(p), _mm512_loadu_si512(p.add(1))]
        });
        let (b, mask) = (bits as usize, ((1u32 << bits) - 1) as u16);
        let up = _mm512_set1_epi32(used as i32);
        let down = _mm512_set1_epi32(32 - used as i32);
        // The last word put (its top `used` bits pending), in every lane.
        let mut last = _mm512_set1_epi32(acc.checked_shl(32 - used).unwrap_or(0) as i32);
        for block in codes.chunks_exact(32) {
            // SAFETY: unaligned loads of the 16 + 16 codes of the block.
            let (lo, hi) = unsafe {
                let p = block.as_ptr().cast::<__m512i>();
                (_mm512_loadu_si512(p), _mm512_loadu_si512(p.add(1)))
            };
            let groups = groups(lo, hi, bits, w);
            let words = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(words_of(groups, 2 * w, a[0], o[0])),
                words_of(groups, 2 * w, a[1], o[1]),
            );
            // Word j shifted past the pending bits, with word j - 1's top bits below (for j = 0, the
            // last word before, whose top bits are the pending ones); a shift by 32 gives 0.
            let before = _mm512_alignr_epi32::<15>(words, last);
            let joined = _mm512_or_si512(
                _mm512_sllv_epi32(words, up),
                _mm512_srlv_epi32(before, down),
            );
            let dst = &mut out[word..word + b];
            // SAFETY: a masked store of the first b lanes into the b words of dst.
            unsafe { _mm512_mask_storeu_epi32(dst.as_mut_ptr().cast(), mask, joined) };
            last = _mm512_permutexvar_epi32(_mm512_set1_epi32(b as i32 - 1), words);
            word += b;
        }
        let last = _mm_cvtsi128_si32(_mm512_castsi512_si128(last)) as u32;
        let acc = last.checked_shr(32 - used).unwrap_or(0);
        (acc, used, word)
    }

    /// The widest codes `unpack` reads: 32 of them from a first bit anywhere in a word end inside the
    /// 32 words it loads (31 + 32 x 24 bits < 25 words).
    pub const MAX_BITS: u32 = 24;

    /// `super::positions`: the bit numbers of a word's set bits compressed to the front of a vector of
    /// 64 bytes, widened 16 at a time, offset by the word's first position and stored whole at the end
    /// of the output so far, which then grows by their count. Only where the processor has AVX-512F,
    /// BW and VBMI2.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi2")]
    pub unsafe fn positions(set: &[u64]) -> Vec<u32> {
        let count: usize = set.iter().map(|w| w.count_ones() as usize).sum();
        // Room for a whole vector of 16 past the last position.
        let mut out = Vec::<u32>::with_capacity(count + 16);
        let (p, mut n) = (out.as_mut_ptr(), 0);
        let bit = _mm512_set_epi8(
            63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42,
            41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20,
            19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0,
        );
        for (w, &word) in set.iter().enumerate() {
            let picked = _mm512_maskz_compress_epi8(word, bit);
            let first = _mm512_set1_epi32((64 * w) as i32);
            let set_bits = word.count_ones() as usize;
            // One piece at least: at random-k's densities most words have no bit or one, and a loop
            // that always runs once there branches as the processor expects.
            for piece in 0..set_bits.div_ceil(16).max(1) {
                let bytes = match piece {
                    0 => _mm512_castsi512_si128(picked),
                    1 => _mm512_extracti32x4_epi32::<1>(picked),
                    2 => _mm512_extracti32x4_epi32::<2>(picked),
                    _ => _mm512_extracti32x4_epi32::<3>(picked),
                };
                let at = _mm512_add_epi32(_mm512_cvtepu8_epi32(bytes), first);
                // SAFETY: n + 16 piece is below n + set_bits where the word has bits (else it is n),
                // and n + set_bits is at most `count` (n counts the bits before this word), so 16
                // lanes there fit in the capacity of count + 16.
                unsafe { _mm512_storeu_si512(p.add(n + 16 * piece).cast(), at) };
            }
            n += set_bits;
        }
        // SAFETY: the first n = count entries were written above.
        unsafe { out.set_len(n) };
        out
    }

    /// The 32 codes of `bits` bits at bit `at` of `words` on (lowest bits first). Only where the
    /// processor has AVX-512F, with bits at most `MAX_BITS`; panics unless 32 words lie at and past
    /// the first code's word.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn unpack(words: &[f32], at: usize, bits: u32, out: &mut [u32; 32]) {
        let w = &words[at / 32..at / 32 + 32];
        // SAFETY: unaligned loads of the 16 + 16 words of w.
        let (lo, hi) = unsafe {
            let p = w.as_ptr().cast::<__m512i>();
            (_mm512_loadu_si512(p), _mm512_loadu_si512(p.add(1)))
        };
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let mask = _mm512_set1_epi32(((1u64 << bits) - 1) as i32);
        for (half, codes) in out.chunks_exact_mut(16).enumerate() {
            // Lane i's first bit within w, its word and its shift there.
            let first = (at % 32) as i32 + 16 * half as i32 * bits as i32;
            let bit = _mm512_add_epi32(
                _mm512_set1_epi32(first),
                _mm512_mullo_epi32(lanes, _mm512_set1_epi32(bits as i32)),
            );
            let (j, s) = (
                _mm512_srli_epi32::<5>(bit),
                _mm512_and_si512(bit, _mm512_set1_epi32(31)),
            );
            let low = _mm512_permutex2var_epi32(lo, j, hi);
            let next = _mm512_add_epi32(j, _mm512_set1_epi32(1));
            let high = _mm512_permutex2var_epi32(lo, next, hi);
            // A shift by 32 (s = 0) gives 0: the code lies in its first word.
            let up = _mm512_sllv_epi32(high, _mm512_sub_epi32(_mm512_set1_epi32(32), s));
            let code = _mm512_and_si512(_mm512_or_si512(_mm512_srlv_epi32(low, s), up), mask);
            // SAFETY: an unaligned store of 16 u32 into a chunk of 16.
            unsafe { _mm512_storeu_si512(codes.as_mut_ptr().cast(), code) };
        }
    }
}

/// Codes packed at a time by `BitWriter::put_all` before they are shifted into place: whole blocks of 32.
/// The words a run's vector stores leave are read back after the whole run is packed, not while the
/// stores are in flight (a load from two stores in flight waits for both to complete).
const RUN: usize = 256;

/// `run` (whole blocks of 32, at most `RUN` codes) of `bits` bits packed into `packed`, `bits` words a
/// block: with AVX2 and codes of up to `narrow::MAX_BITS` bits 8 at a time (`narrow::pack`), else by
/// `pack`, the unrolled block.
fn pack_run(run: &[u32], bits: u32, pack: fn(&[u32], &mut [u32]), packed: &mut [u32; RUN + 4]) {
    #[cfg(target_arch = "x86_64")]
    if narrow::usable(bits) {
        // SAFETY: this processor has AVX2, and bits is 1 to MAX_BITS (`usable`).
        unsafe { narrow::pack(run, bits, packed) };
        return;
    }
    let words = packed.chunks_mut(bits as usize);
    run.chunks_exact(32)
        .zip(words)
        .for_each(|(c, w)| pack(c, w));
}

/// Packing and unpacking with AVX2, 8 codes at a time: 8 codes of `bits` bits fill `bits` whole bytes,
/// so every group of 8 starts in its first byte at the bit the run's first code starts at there.
#[cfg(target_arch = "x86_64")]
mod narrow {
    use super::RUN;
    use std::arch::x86_64::*;

    /// The widest codes packed and unpacked here: a group's 8 codes from a first bit anywhere in a byte
    /// end inside its 16 bytes (7 + 8 x 15 < 128), and 4 of them fit in 64 bits.
    pub const MAX_BITS: u32 = 15;

    /// Whether this processor has AVX2 and codes of `bits` bits are packed and unpacked here.
    pub fn usable(bits: u32) -> bool {
        (1..=MAX_BITS).contains(&bits) && is_x86_feature_detected!("avx2")
    }

    /// `super::pack` of `codes` (whole groups of 8, at most `RUN`) of `bits` bits (1 to `MAX_BITS`):
    /// `bits` words per 32 codes from the first word of `words` on, a group at a time: its codes joined
    /// pairwise into 64-bit lanes, the pairs joined in each 128-bit half, the halves joined into the
    /// group's 8 bits bits, stored from its first byte (the zeros above them overwritten by the next
    /// group's). Only where the processor has AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn pack(codes: &[u32], bits: u32, words: &mut [u32; RUN + 4]) {
        assert!(codes.len() <= RUN && codes.len().is_multiple_of(8));
        let count = |n: u32| _mm_cvtsi32_si128(n as i32);
        let (one, two, four, rest) = (
            count(bits),
            count(2 * bits),
            count(4 * bits),
            count(64 - 4 * bits),
        );
        let low = _mm256_set1_epi64x(u32::MAX as i64);
        let out = words.as_mut_ptr().cast::<u8>();
        for (g, group) in codes.chunks_exact(8).enumerate() {
            // SAFETY: an unaligned load of the group's 8 codes.
            let x = unsafe { _mm256_loadu_si256(group.as_ptr().cast()) };
            // Pairs of 2 bits bits in the 64-bit lanes, then pairs of pairs in each half's low lane.
            let pairs = _mm256_or_si256(
                _mm256_and_si256(x, low),
                _mm256_sll_epi64(_mm256_srli_epi64::<32>(x), one),
            );
            let quads =
                _mm256_or_si256(pairs, _mm256_sll_epi64(_mm256_srli_si256::<8>(pairs), two));
            let (lo, hi) = (
                _mm256_castsi256_si128(quads),
                _mm256_extracti128_si256::<1>(quads),
            );
            // lo + hi 2^(4 bits) in 128 bits (4 bits < 64).
            let group = _mm_or_si128(
                _mm_move_epi64(_mm_or_si128(lo, _mm_sll_epi64(hi, four))),
                _mm_slli_si128::<8>(_mm_srl_epi64(hi, rest)),
            );
            // SAFETY: 16 bytes from byte g bits < (RUN / 8) 15 of the 4 (RUN + 4) bytes of `words`.
            unsafe { _mm_storeu_si128(out.add(g * bits as usize).cast(), group) };
        }
    }

    /// The codes of `bits` bits (1 to `MAX_BITS`) from bit `at` of `words` on into `out`, 8 at a time
    /// while the 16 bytes from the group's first byte lie inside the words: each lane shuffled the 4
    /// bytes from its code's first byte, shifted by the code's bit there and masked. How many codes
    /// that was (a multiple of 8). Only where the processor has AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn unpack(words: &[f32], at: usize, bits: u32, out: &mut [u32]) -> usize {
        let bytes: &[u8] = bytemuck::cast_slice(words);
        let (first, b) = (at / 8, bits as usize);
        let fit = bytes
            .len()
            .checked_sub(first + 16)
            .map_or(0, |room| room / b + 1);
        let groups = (out.len() / 8).min(fit);
        // Lane i's first bit from its group's first byte, at % 8 + i bits: its byte (a lane's shuffle
        // takes that byte and the three after it, those past 15 wrapping onto bytes below, whose bits
        // lie above the code and are masked off) and its bit there.
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let bit = _mm256_add_epi32(
            _mm256_set1_epi32((at % 8) as i32),
            _mm256_mullo_epi32(lanes, _mm256_set1_epi32(bits as i32)),
        );
        let take = _mm256_add_epi32(
            _mm256_mullo_epi32(_mm256_srli_epi32::<3>(bit), _mm256_set1_epi32(0x0101_0101)),
            _mm256_set1_epi32(0x0302_0100),
        );
        let shift = _mm256_and_si256(bit, _mm256_set1_epi32(7));
        let mask = _mm256_set1_epi32((1 << bits) - 1);
        for (g, codes) in out.chunks_exact_mut(8).take(groups).enumerate() {
            // SAFETY: the group's 16 bytes lie inside the words (`fit`).
            let v = unsafe { _mm_loadu_si128(bytes.as_ptr().add(first + g * b).cast()) };
            let lanes = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(v), take);
            let c = _mm256_and_si256(_mm256_srlv_epi32(lanes, shift), mask);
            // SAFETY: an unaligned store of 8 u32 into a chunk of 8.
            unsafe { _mm256_storeu_si256(codes.as_mut_ptr().cast(), c) };
        }
        8 * groups
    }
}

/// Packs 32 codes of `B` bits into `B` words, code i at bit i B (as `put` in turn from bit 0). Unrolled,
/// so that every shift and every word's end is fixed at compile time.
#[allow(clippy::erasing_op, clippy::identity_op)] // the copies for I = 0 and 1 multiply by 0 and 1
fn pack<const B: usize>(codes: &[u32], words: &mut [u32]) {
    let c: &[u32; 32] = codes[..32].try_into().expect("32 codes");
    let w: &mut [u32; B] = (&mut words[..B]).try_into().expect("B words");
    let mut acc = 0u64;
    seq_macro::seq!(I in 0..32 {
        acc |= (c[I] as u64) << (I * B % 32);
        if I * B % 32 + B >= 32 {
            w[I * B / 32] = acc as u32;
            acc >>= 32;
        }
    });
}

/// The 32 codes of `B` bits that `pack` put into `B` words, unrolled as `pack` is.
#[allow(clippy::erasing_op, clippy::identity_op)] // the copies for I = 0 and 1 multiply by 0 and 1
fn unpack<const B: usize>(words: &[u32], codes: &mut [u32]) {
    let w: &[u32; B] = words[..B].try_into().expect("B words");
    let c: &mut [u32; 32] = (&mut codes[..32]).try_into().expect("32 codes");
    let mask = ((1u64 << B) - 1) as u32;
    seq_macro::seq!(I in 0..32 {
        let (j, s) = (I * B / 32, I * B % 32);
        let high = if s + B > 32 { (w[j + 1] as u64) << 32 } else { 0 };
        c[I] = ((w[j] as u64 | high) >> s) as u32 & mask;
    });
}

/// A block of 32 codes of `B` bits: `pack`, `unpack`.
type Block = (fn(&[u32], &mut [u32]), fn(&[u32], &mut [u32]));

/// `pack` and `unpack` for `bits` from 1 to 24 (the codes the compressors make), compiled for each.
fn block(bits: u32) -> Option<Block> {
    macro_rules! widths {
        ($($b:literal)*) => {
            match bits {
                $($b => Some((pack::<$b>, unpack::<$b>)),)*
                _ => None,
            }
        };
    }
    widths!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Codes read past the end of the words are zeros, one at a time or in runs.
    #[test]
    fn codes_past_the_end_read_as_zeros() {
        let words = [f32::from_bits(u32::MAX); 2];
        let mut r = BitReader::new(&words);
        let first: Vec<u32> = (0..3).map(|_| r.get(24)).collect();
        assert_eq!(first, [0xff_ffff, 0xff_ffff, 0xffff]);
        let mut rest = [1u32; 40];
        r.get_all(24, &mut rest);
        assert_eq!(rest, [0; 40]);
    }

    /// A reader started at any bit reads the codes from there on as a reader from bit 0 does after
    /// skipping that many.
    #[test]
    fn a_reader_at_a_bit_reads_what_follows_it() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let words: Vec<f32> = (0..40).map(|_| f32::from_bits(rng.random())).collect();
        for bit in 0..=(40 * 32 - 7) as u64 {
            let mut from = BitReader::new(&words);
            let mut left = bit;
            while left > 0 {
                let b = left.min(31) as u32;
                from.get(b);
                left -= b as u64;
            }
            let mut at = BitReader::at(&words, bit);
            for b in [7, 1, 13] {
                assert_eq!(at.get(b), from.get(b), "bit {bit}");
            }
        }
    }

    /// `put_all` and `get_all`, called on runs of any length and mixed with single calls, give the
    /// words and codes that one `put` and one `get` per code give: runs of whole blocks of 32 and not,
    /// starting at any bit of a word, for every width the blocks are compiled for and one past.
    #[test]
    fn runs_of_codes_pack_and_unpack_as_one_code_at_a_time() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for bits in (1..=25u32).flat_map(|b| [b; 3]) {
            let n = rng.random_range(2..3000usize);
            let codes: Vec<u32> = (0..n).map(|_| rng.random::<u32>() >> (32 - bits)).collect();
            let words = (n * bits as usize).div_ceil(32);
            let (mut one, mut runs) = (vec![0.0f32; words], vec![0.0f32; words]);
            let mut w = BitWriter::new(&mut one);
            codes.iter().for_each(|&c| w.put(c, bits));
            drop(w);
            let cuts = [0, n / 3, n / 3 + 1, n];
            let mut w = BitWriter::new(&mut runs);
            for c in cuts.windows(2) {
                w.put_all(&codes[c[0]..c[1]], bits);
            }
            drop(w);
            let raw = |m: &[f32]| m.iter().map(|w| w.to_bits()).collect::<Vec<_>>();
            assert_eq!(raw(&runs), raw(&one), "{bits} bits");
            let mut r = BitReader::new(&one);
            let mut got = vec![0u32; n];
            for c in cuts.windows(2) {
                if c[1] == c[0] + 1 {
                    got[c[0]] = r.get(bits);
                } else {
                    r.get_all(bits, &mut got[c[0]..c[1]]);
                }
            }
            assert_eq!(got, codes, "{bits} bits");
        }
    }

    /// The AVX2 packing and unpacking alone (where the processor has AVX2; `put_all` and `get_all` take
    /// AVX-512's where it has that too) are the unrolled blocks' words and one `get` per code: runs of
    /// every length up to `RUN`, every width they take, first codes at every bit of a byte and word,
    /// and words that end right after the last group's 16 bytes.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_groups_are_the_blocks_and_the_single_codes() {
        if !is_x86_feature_detected!("avx2") {
            eprintln!("no AVX2 here: the groups of 8 are not run");
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for bits in 1..=narrow::MAX_BITS {
            let b = bits as usize;
            for blocks in 1..=RUN / 32 {
                let codes: Vec<u32> = (0..32 * blocks)
                    .map(|_| rng.random::<u32>() >> (32 - bits))
                    .collect();
                let mut want = [0u32; RUN + 4];
                let scalar = block(bits).expect("a block of this width").0;
                codes
                    .chunks_exact(32)
                    .zip(want.chunks_mut(b))
                    .for_each(|(c, w)| scalar(c, w));
                let mut got = [u32::MAX; RUN + 4];
                // SAFETY: this processor has AVX2 (checked above), and bits is 1 to MAX_BITS.
                unsafe { narrow::pack(&codes, bits, &mut got) };
                assert_eq!(
                    got[..blocks * b],
                    want[..blocks * b],
                    "{bits} bits, {blocks} blocks"
                );
            }
            let words: Vec<f32> = (0..40).map(|_| f32::from_bits(rng.random())).collect();
            for at in 0..64 {
                let mut got = vec![0u32; 8 * 40];
                // SAFETY: as above.
                let n = unsafe { narrow::unpack(&words, at, bits, &mut got) };
                // Every group that fits in the 160 bytes, or every code asked for.
                let end = |groups: usize| at / 8 + groups * b + 16;
                let fits = n > 0 && end(n / 8 - 1) <= 160;
                assert!(
                    fits && (n == got.len() || end(n / 8) > 160),
                    "{bits} bits, {at}: {n}"
                );
                let mut one = BitReader::at(&words, at as u64);
                let want: Vec<u32> = (0..n).map(|_| one.get(bits)).collect();
                assert_eq!(got[..n], want[..], "{bits} bits from bit {at}");
            }
        }
    }

    /// The positions of a bitmap's set bits with AVX-512 (where the processor has it) are those found a
    /// bit at a time, at every density, for lengths that end inside a word and across its 16-bit pieces.
    #[test]
    fn positions_of_set_bits_are_those_found_a_bit_at_a_time() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for density in [0.0, 0.01, 0.1, 0.5, 0.97, 1.0] {
            for words in [0, 1, 3, 17, 1000] {
                let set: Vec<u64> = (0..words)
                    .map(|_| {
                        (0..64).fold(0u64, |w, b| {
                            w | ((rng.random::<f64>() < density) as u64) << b
                        })
                    })
                    .collect();
                let want = positions_scalar(&set);
                assert_eq!(
                    want.len() as u32,
                    set.iter().map(|w| w.count_ones()).sum::<u32>()
                );
                assert_eq!(positions(&set), want, "density {density}, {words} words");
            }
        }
    }
}

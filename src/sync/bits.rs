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

    /// `put` of each code in turn, with the writer's state in registers for the run.
    pub fn put_all(&mut self, codes: &[u32], bits: u32) {
        let (mut acc, mut used, mut word) = (self.acc, self.used, self.word);
        for &code in codes {
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

    /// `get` of as many codes as `out` holds, with the reader's state in registers for the run.
    pub fn get_all(&mut self, bits: u32, out: &mut [u32]) {
        let (mut acc, mut have, mut word) = (self.acc, self.have, self.word);
        let mask = (1u64 << bits) - 1;
        for o in out {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// `put_all` and `get_all`, called on runs of any length and mixed with single calls, give the
    /// words and codes that one `put` and one `get` per code give.
    #[test]
    fn runs_of_codes_pack_and_unpack_as_one_code_at_a_time() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for bits in 1..=24u32 {
            let n = rng.random_range(2..300usize);
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
}

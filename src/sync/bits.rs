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
}

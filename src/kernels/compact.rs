//! The entries of a span whose key (|v|'s bits) reaches a floor, with their indices, in index order:
//! the candidates the top-k selections choose from. With AVX2, 8 entries at a time are compared in one
//! vector, and the ones that pass are packed to the front of the vector by a permutation looked up from
//! their 8-bit mask and stored at the output's end (then the end moves by their count); elsewhere, and
//! for the last entries, a mask of each group of 16 is made in one vectorized pass and its set bits are
//! visited. Both keep exactly the entries whose key is at least the floor, in order.

use super::abs_key;

/// The entries of `span` (at `start` in its tensor) whose key is at least `floor`, with their indices.
pub(super) fn candidates(span: &[f32], start: usize, floor: u32) -> (Vec<u32>, Vec<f32>) {
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    let done = x86::packed(span, start, floor, &mut idx, &mut val);
    by_masks(&span[done..], start + done, floor, &mut idx, &mut val);
    (idx, val)
}

/// `candidates` of `span` appended to idx and val: each group of 16 gives a bit mask of its candidates
/// in one vectorized pass, and only the set bits are visited.
#[multiversion::multiversion(targets = "simd")]
fn by_masks(span: &[f32], start: usize, floor: u32, idx: &mut Vec<u32>, val: &mut Vec<f32>) {
    for (g, group) in span.chunks(16).enumerate() {
        let mut mask = 0u32;
        for (b, &v) in group.iter().enumerate() {
            mask |= u32::from(abs_key(v) >= floor) << b;
        }
        while mask != 0 {
            let b = mask.trailing_zeros() as usize;
            idx.push((start + 16 * g + b) as u32);
            val.push(group[b]);
            mask &= mask - 1;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// For each 8-bit mask, the lanes whose bit is set, in order, then zeros: the permutation that
    /// packs them to the front of a vector.
    const PACK: [[u32; 8]; 256] = {
        let mut t = [[0u32; 8]; 256];
        let mut m = 0;
        while m < 256 {
            let (mut lane, mut at) = (0, 0);
            while lane < 8 {
                if m >> lane & 1 == 1 {
                    t[m][at] = lane as u32;
                    at += 1;
                }
                lane += 1;
            }
            m += 1;
        }
        t
    };

    /// `candidates` of span's whole groups of 8 appended to idx and val when the processor has AVX2:
    /// the entries done (0 without AVX2).
    pub fn packed(
        span: &[f32],
        start: usize,
        floor: u32,
        idx: &mut Vec<u32>,
        val: &mut Vec<f32>,
    ) -> usize {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return 0;
        }
        let whole = span.len() / 8 * 8;
        // SAFETY: the processor has AVX2 (checked above); `pack` reads span[..whole] only.
        unsafe { pack(&span[..whole], start, floor, idx, val) };
        whole
    }

    /// `packed` of a span of whole groups of 8.
    ///
    /// # Safety
    /// The processor has AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn pack(span: &[f32], start: usize, floor: u32, idx: &mut Vec<u32>, val: &mut Vec<f32>) {
        // Keys are below 2^31, so a signed comparison with floor - 1 is key >= floor (any key is >= 0).
        let below = _mm256_set1_epi32((floor as i64 - 1).clamp(-1, i32::MAX as i64) as i32);
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (g, group) in span.chunks_exact(8).enumerate() {
            let group: &[f32; 8] = group.try_into().expect("a group of 8");
            // SAFETY: an unaligned load of the 8 floats of `group`.
            let v = unsafe { _mm256_loadu_ps(group.as_ptr()) };
            let key = _mm256_and_si256(_mm256_castps_si256(v), abs);
            let mask =
                _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(key, below))) as usize;
            if mask == 0 {
                continue;
            }
            // SAFETY: an unaligned load of PACK's row of 8 u32.
            let perm = unsafe { _mm256_loadu_si256(PACK[mask].as_ptr().cast()) };
            let at = _mm256_add_epi32(_mm256_set1_epi32((start + 8 * g) as i32), lanes);
            let (n, len) = (mask.count_ones() as usize, idx.len());
            idx.reserve(8);
            val.reserve(8);
            // SAFETY: both vectors have room for 8 more entries past `len` (reserved above), so the
            // unaligned stores of 8 lanes there write inside their allocations; the first n lanes are
            // the candidates, in order, and only those become part of the vectors (set_len to len + n,
            // every entry below it written).
            unsafe {
                _mm256_storeu_si256(
                    idx.as_mut_ptr().add(len).cast(),
                    _mm256_permutevar8x32_epi32(at, perm),
                );
                _mm256_storeu_ps(val.as_mut_ptr().add(len), _mm256_permutevar8x32_ps(v, perm));
                idx.set_len(len + n);
                val.set_len(len + n);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    pub fn packed(_: &[f32], _: usize, _: u32, _: &mut Vec<u32>, _: &mut Vec<f32>) -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The definition: every entry whose key reaches the floor, with its index, in order.
    fn reference(span: &[f32], start: usize, floor: u32) -> (Vec<u32>, Vec<f32>) {
        span.iter()
            .enumerate()
            .filter(|(_, &v)| abs_key(v) >= floor)
            .map(|(i, &v)| ((start + i) as u32, v))
            .unzip()
    }

    /// Both paths against the definition, bit for bit: lengths with and without whole groups, floors
    /// from 0 (every entry) to above every key, both signs of zero, infinities and NaNs.
    #[test]
    fn candidates_are_the_entries_that_reach_the_floor() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut x: Vec<f32> = (0..1000).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        x[3] = -0.0;
        x[17] = f32::INFINITY;
        x[40] = f32::NAN;
        x[41] = -f32::NAN;
        x[99] = f32::NEG_INFINITY;
        let floors = [
            0,
            1,
            0.5f32.to_bits(),
            1.5f32.to_bits(),
            0x7f80_0000,
            0x7fff_ffff,
            u32::MAX,
        ];
        for len in [0, 1, 7, 8, 9, 16, 63, 1000] {
            for &floor in &floors {
                let want = reference(&x[..len], 5, floor);
                let bits =
                    |(i, v): (Vec<u32>, Vec<f32>)| (i, v.iter().map(|v| v.to_bits()).collect());
                let got: (Vec<u32>, Vec<u32>) = bits(candidates(&x[..len], 5, floor));
                assert_eq!(got, bits(want.clone()), "length {len}, floor {floor:#x}");
                let mut masks = (Vec::new(), Vec::new());
                by_masks(&x[..len], 5, floor, &mut masks.0, &mut masks.1);
                assert_eq!(
                    bits(masks),
                    bits(want),
                    "by masks: length {len}, floor {floor:#x}"
                );
            }
        }
    }
}

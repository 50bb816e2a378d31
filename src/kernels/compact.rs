//! The entries of a span whose key (|v|'s bits) reaches a floor, with their indices, in index order:
//! the candidates the top-k selections choose from, and the selection among them at a threshold. With
//! AVX-512, 16 entries at a time are compared in one vector and the ones that pass are compressed to the
//! front of the vector (`vpcompressd`), which is stored at the output's end (then the end moves by their
//! count); with AVX2, 8 at a time, packed by a permutation looked up from their 8-bit mask; elsewhere,
//! and for the last entries, a mask of each group of 16 is made in one vectorized pass and its set bits
//! are visited. All keep exactly the entries whose key is at least the floor, in order. The values can
//! also be a difference x - hat, formed as the entries are read (CHOCO's message of x - x_hat), so that
//! the difference is never written out whole.

use super::abs_key;

/// The entries of `span` (at `start` in its tensor) whose key is at least `floor`, with their indices.
pub(super) fn candidates(span: &[f32], start: usize, floor: u32) -> (Vec<u32>, Vec<f32>) {
    gather::<false>(span, span, start, floor)
}

/// `candidates` of the difference x - hat, entry by entry (the same f32 subtraction as a scalar
/// `x[i] - hat[i]`). `hat` is as long as `x`.
pub(super) fn difference_candidates(
    x: &[f32],
    hat: &[f32],
    start: usize,
    floor: u32,
) -> (Vec<u32>, Vec<f32>) {
    assert_eq!(x.len(), hat.len(), "x - hat of unequal lengths");
    gather::<true>(x, hat, start, floor)
}

/// The candidates of `x` (DIFF: of x - hat) through the widest vectors the processor has, then the
/// rest by masks.
fn gather<const DIFF: bool>(
    x: &[f32],
    hat: &[f32],
    start: usize,
    floor: u32,
) -> (Vec<u32>, Vec<f32>) {
    gather_in::<DIFF>(x86::lanes(), x, hat, start, floor)
}

/// `gather` with vectors of at most `width` lanes (0: by masks only).
fn gather_in<const DIFF: bool>(
    width: usize,
    x: &[f32],
    hat: &[f32],
    start: usize,
    floor: u32,
) -> (Vec<u32>, Vec<f32>) {
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    let done = x86::packed_in::<DIFF>(width, x, hat, start, floor, &mut idx, &mut val);
    by_masks::<DIFF>(
        &x[done..],
        &hat[done..],
        start + done,
        floor,
        &mut idx,
        &mut val,
    );
    (idx, val)
}

/// `candidates` of `x` (DIFF: of x - hat) appended to idx and val: each group of 16 gives a bit mask
/// of its candidates in one vectorized pass, and only the set bits are visited.
#[multiversion::multiversion(targets = "simd")]
fn by_masks<const DIFF: bool>(
    x: &[f32],
    hat: &[f32],
    start: usize,
    floor: u32,
    idx: &mut Vec<u32>,
    val: &mut Vec<f32>,
) {
    let mut group = [0.0f32; 16];
    for (g, xs) in x.chunks(16).enumerate() {
        let group = &mut group[..xs.len()];
        group.copy_from_slice(xs);
        if DIFF {
            let hs = &hat[16 * g..16 * g + xs.len()];
            group.iter_mut().zip(hs).for_each(|(v, &h)| *v -= h);
        }
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

/// Appends to idx (each plus `base`) and val the `k` candidates selected at the threshold key `t`:
/// those whose key is above it, then, to make up k, the first of those whose key equals it, in order.
/// The entries whose key reaches `t` are taken in one vectorized pass; past k (ties at `t`, rare), the
/// last of those equal to it are dropped.
pub(super) fn take(
    cand_i: &[u32],
    cand_v: &[f32],
    t: u32,
    k: usize,
    base: u32,
    idx: &mut Vec<u32>,
    val: &mut Vec<f32>,
) {
    take_in(x86::lanes(), (cand_i, cand_v), (t, k), base, idx, val);
}

/// `take` with vectors of at most `width` lanes (0: one entry at a time).
fn take_in(
    width: usize,
    (cand_i, cand_v): (&[u32], &[f32]),
    (t, k): (u32, usize),
    base: u32,
    idx: &mut Vec<u32>,
    val: &mut Vec<f32>,
) {
    let start = idx.len();
    let done = x86::taken_in(width, cand_i, cand_v, t, base, idx, val);
    for (&i, &v) in cand_i[done..].iter().zip(&cand_v[done..]) {
        if abs_key(v) >= t {
            idx.push(base + i);
            val.push(v);
        }
    }
    let taken = val.len() - start;
    assert!(
        taken >= k,
        "{taken} candidates reach the threshold, fewer than k = {k}"
    );
    let mut extra: Vec<usize> = (start..val.len())
        .rev()
        .filter(|&p| abs_key(val[p]) == t)
        .take(taken - k)
        .collect();
    extra.reverse();
    let Some(&first) = extra.first() else {
        return;
    };
    let (mut write, mut dropped) = (first, 0);
    for read in first..val.len() {
        if dropped < extra.len() && extra[dropped] == read {
            dropped += 1;
            continue;
        }
        (idx[write], val[write]) = (idx[read], val[read]);
        write += 1;
    }
    idx.truncate(write);
    val.truncate(write);
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

    /// The widest vectors this processor compresses in: 16 lanes (AVX-512), 8 (AVX2, with the POPCNT
    /// that every AVX2 processor has) or none.
    pub fn lanes() -> usize {
        if is_x86_feature_detected!("avx512f") {
            16
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("popcnt") {
            8
        } else {
            0
        }
    }

    /// A signed comparison with this is key >= `floor`: keys are below 2^31 and any key is >= 0.
    fn below(floor: u32) -> i32 {
        (floor as i64 - 1).clamp(-1, i32::MAX as i64) as i32
    }

    /// `candidates` of x's whole groups of `width` entries (DIFF: of x - hat, as long as x) appended to
    /// idx and val, in vectors of that many lanes (16 or 8; at most what `lanes` found): the entries done.
    pub fn packed_in<const DIFF: bool>(
        width: usize,
        x: &[f32],
        hat: &[f32],
        start: usize,
        floor: u32,
        idx: &mut Vec<u32>,
        val: &mut Vec<f32>,
    ) -> usize {
        let width = width.min(lanes());
        let whole = x
            .len()
            .checked_div(width)
            .map_or(0, |groups| groups * width);
        let (x, hat) = (&x[..whole], &hat[..whole]);
        match width {
            // SAFETY: a width of 16 is at most what `lanes` found, so the processor has AVX-512F; the
            // kernel reads x and hat, whole groups of 16.
            16 => unsafe { pack16::<DIFF>(x, hat, start, floor, idx, val) },
            // SAFETY: as above, with AVX2 and POPCNT and groups of 8.
            8 => unsafe { pack8::<DIFF>(x, hat, start, floor, idx, val) },
            _ => return 0,
        }
        whole
    }

    /// `take`'s entries whose key reaches `t` among the candidates' whole groups of `width`, appended, in
    /// vectors of that many lanes (16 or 8; at most what `lanes` found): the candidates done.
    pub fn taken_in(
        width: usize,
        cand_i: &[u32],
        cand_v: &[f32],
        t: u32,
        base: u32,
        idx: &mut Vec<u32>,
        val: &mut Vec<f32>,
    ) -> usize {
        let width = width.min(lanes());
        let whole = cand_v
            .len()
            .checked_div(width)
            .map_or(0, |groups| groups * width);
        let (cand_i, cand_v) = (&cand_i[..whole], &cand_v[..whole]);
        match width {
            // SAFETY: a width of 16 is at most what `lanes` found, so the processor has AVX-512F; the
            // kernel reads cand_i and cand_v, whole groups of 16.
            16 => unsafe { take16(cand_i, cand_v, t, base, idx, val) },
            // SAFETY: as above, with AVX2 and POPCNT and groups of 8.
            8 => unsafe { take8(cand_i, cand_v, t, base, idx, val) },
            _ => return 0,
        }
        whole
    }

    /// Appends the lanes of `ids` and `v` whose bit of `mask` is set, in order.
    ///
    /// # Safety
    /// The processor has AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn push16(
        mask: __mmask16,
        ids: __m512i,
        v: __m512,
        idx: &mut Vec<u32>,
        val: &mut Vec<f32>,
    ) {
        let (n, len) = (mask.count_ones() as usize, idx.len());
        idx.reserve(16);
        val.reserve(16);
        // SAFETY: both vectors have room for 16 more entries past `len` (reserved above), so the
        // unaligned stores of 16 lanes there write inside their allocations; the first n lanes are the
        // compressed entries, in order, and only those become part of the vectors (set_len to len + n,
        // every entry below it written).
        unsafe {
            _mm512_storeu_si512(
                idx.as_mut_ptr().add(len).cast(),
                _mm512_maskz_compress_epi32(mask, ids),
            );
            _mm512_storeu_ps(val.as_mut_ptr().add(len), _mm512_maskz_compress_ps(mask, v));
            idx.set_len(len + n);
            val.set_len(len + n);
        }
    }

    /// Groups whose room `pack16` and `pack8` reserve at once.
    const BLOCK: usize = 16;

    /// `packed` with AVX-512, of whole groups of 16. Room for a block of `BLOCK` groups' entries is
    /// reserved at once, then each group's compressed lanes are stored whether any passed or none (a
    /// mask that is empty about half the time, as in DeMo's chunks, mispredicts a branch on it).
    ///
    /// # Safety
    /// The processor has AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack16<const DIFF: bool>(
        x: &[f32],
        hat: &[f32],
        start: usize,
        floor: u32,
        idx: &mut Vec<u32>,
        val: &mut Vec<f32>,
    ) {
        let below = _mm512_set1_epi32(below(floor));
        let abs = _mm512_set1_epi32(0x7fff_ffff);
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let blocks = x.chunks(16 * BLOCK).zip(hat.chunks(16 * BLOCK));
        for (b, (xb, hb)) in blocks.enumerate() {
            idx.reserve(xb.len());
            val.reserve(xb.len());
            let (pi, pv, mut len) = (idx.as_mut_ptr(), val.as_mut_ptr(), idx.len());
            for (g, (xs, hs)) in xb.chunks_exact(16).zip(hb.chunks_exact(16)).enumerate() {
                // The loop does little else, and waited on its loads for two thirds of its time
                // without asking ahead.
                let ahead = 16 * (b * BLOCK + g) + crate::kernels::STREAM_AHEAD;
                crate::kernels::prefetch(x, ahead);
                if DIFF {
                    crate::kernels::prefetch(hat, ahead);
                }
                // SAFETY: unaligned loads of the 16 floats of `xs` and of `hs`.
                let mut v = unsafe { _mm512_loadu_ps(xs.as_ptr()) };
                if DIFF {
                    // SAFETY: as above.
                    v = _mm512_sub_ps(v, unsafe { _mm512_loadu_ps(hs.as_ptr()) });
                }
                let key = _mm512_and_si512(_mm512_castps_si512(v), abs);
                let mask = _mm512_cmpgt_epi32_mask(key, below);
                let at = start + 16 * (b * BLOCK + g);
                let ids = _mm512_add_epi32(_mm512_set1_epi32(at as i32), lanes);
                // SAFETY: both vectors had room for xb.len() entries past their length before this
                // block (reserved above) and `len` has grown by at most 16 a group before this one, so
                // the 16 lanes stored at `len` stay inside both allocations.
                unsafe {
                    _mm512_storeu_si512(pi.add(len).cast(), _mm512_maskz_compress_epi32(mask, ids));
                    _mm512_storeu_ps(pv.add(len), _mm512_maskz_compress_ps(mask, v));
                }
                len += mask.count_ones() as usize;
            }
            // SAFETY: every entry below `len` was written: the first (set bits of the mask) lanes of
            // each group's stores, in order, each store starting where the previous group's entries end.
            unsafe {
                idx.set_len(len);
                val.set_len(len);
            }
        }
    }

    /// `taken` with AVX-512, of whole groups of 16.
    ///
    /// # Safety
    /// The processor has AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn take16(
        cand_i: &[u32],
        cand_v: &[f32],
        t: u32,
        base: u32,
        idx: &mut Vec<u32>,
        val: &mut Vec<f32>,
    ) {
        let below = _mm512_set1_epi32(below(t));
        let (abs, base) = (
            _mm512_set1_epi32(0x7fff_ffff),
            _mm512_set1_epi32(base as i32),
        );
        for (is, vs) in cand_i.chunks_exact(16).zip(cand_v.chunks_exact(16)) {
            // SAFETY: unaligned loads of the 16 entries of `vs` and `is`.
            let (v, i) = unsafe {
                (
                    _mm512_loadu_ps(vs.as_ptr()),
                    _mm512_loadu_si512(is.as_ptr().cast()),
                )
            };
            let key = _mm512_and_si512(_mm512_castps_si512(v), abs);
            let mask = _mm512_cmpgt_epi32_mask(key, below);
            // SAFETY: this processor has AVX-512F (this function's contract).
            unsafe { push16(mask, _mm512_add_epi32(i, base), v, idx, val) };
        }
    }

    /// Appends the lanes of `ids` and `v` whose bit of `mask` is set, in order.
    ///
    /// # Safety
    /// The processor has AVX2 and POPCNT.
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn push8(mask: usize, ids: __m256i, v: __m256, idx: &mut Vec<u32>, val: &mut Vec<f32>) {
        // SAFETY: an unaligned load of PACK's row of 8 u32.
        let perm = unsafe { _mm256_loadu_si256(PACK[mask].as_ptr().cast()) };
        let (n, len) = (mask.count_ones() as usize, idx.len());
        idx.reserve(8);
        val.reserve(8);
        // SAFETY: both vectors have room for 8 more entries past `len` (reserved above), so the
        // unaligned stores of 8 lanes there write inside their allocations; the first n lanes are the
        // packed entries, in order, and only those become part of the vectors (set_len to len + n,
        // every entry below it written).
        unsafe {
            _mm256_storeu_si256(
                idx.as_mut_ptr().add(len).cast(),
                _mm256_permutevar8x32_epi32(ids, perm),
            );
            _mm256_storeu_ps(val.as_mut_ptr().add(len), _mm256_permutevar8x32_ps(v, perm));
            idx.set_len(len + n);
            val.set_len(len + n);
        }
    }

    /// `packed` with AVX2, of whole groups of 8, as `pack16` does it: room for a block of `BLOCK`
    /// groups' entries reserved at once, then each group's packed lanes stored whether any passed or
    /// none. CHOCO's top-10% passes about an eighth of the entries, so a group is empty about a third
    /// of the time, and a branch on it mispredicted.
    ///
    /// A group's entry ids are its first id plus PACK's row: the row is the packed lanes' positions.
    ///
    /// # Safety
    /// The processor has AVX2 and POPCNT.
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn pack8<const DIFF: bool>(
        x: &[f32],
        hat: &[f32],
        start: usize,
        floor: u32,
        idx: &mut Vec<u32>,
        val: &mut Vec<f32>,
    ) {
        let below = _mm256_set1_epi32(below(floor));
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        let blocks = x.chunks(8 * BLOCK).zip(hat.chunks(8 * BLOCK));
        for (b, (xb, hb)) in blocks.enumerate() {
            idx.reserve(xb.len());
            val.reserve(xb.len());
            let (pi, pv, mut len) = (idx.as_mut_ptr(), val.as_mut_ptr(), idx.len());
            // The id of the group's first entry, in every lane.
            let mut at = _mm256_set1_epi32((start + 8 * b * BLOCK) as i32);
            for (g, (xs, hs)) in xb.chunks_exact(8).zip(hb.chunks_exact(8)).enumerate() {
                let ahead = 8 * (b * BLOCK + g) + crate::kernels::STREAM_AHEAD;
                crate::kernels::prefetch(x, ahead);
                if DIFF {
                    crate::kernels::prefetch(hat, ahead);
                }
                // SAFETY: unaligned loads of the 8 floats of `xs` and of `hs`.
                let mut v = unsafe { _mm256_loadu_ps(xs.as_ptr()) };
                if DIFF {
                    // SAFETY: as above.
                    v = _mm256_sub_ps(v, unsafe { _mm256_loadu_ps(hs.as_ptr()) });
                }
                let key = _mm256_and_si256(_mm256_castps_si256(v), abs);
                let mask = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(key, below)));
                // SAFETY: an unaligned load of PACK's row of 8 u32 (mask < 256).
                let perm = unsafe { _mm256_loadu_si256(PACK[mask as usize].as_ptr().cast()) };
                // The first (set bits of the mask) lanes: the passing entries' ids, in order.
                let ids = _mm256_add_epi32(at, perm);
                at = _mm256_add_epi32(at, _mm256_set1_epi32(8));
                // SAFETY: both vectors had room for xb.len() entries past their length before this
                // block (reserved above) and `len` has grown by at most 8 a group before this one, so
                // the 8 lanes stored at `len` stay inside both allocations.
                unsafe {
                    _mm256_storeu_si256(pi.add(len).cast(), ids);
                    _mm256_storeu_ps(pv.add(len), _mm256_permutevar8x32_ps(v, perm));
                }
                len += mask.count_ones() as usize;
            }
            // SAFETY: every entry below `len` was written: the first (set bits of the mask) lanes of
            // each group's stores, in order, each store starting where the previous group's entries end.
            unsafe {
                idx.set_len(len);
                val.set_len(len);
            }
        }
    }

    /// `taken` with AVX2, of whole groups of 8.
    ///
    /// # Safety
    /// The processor has AVX2 and POPCNT.
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn take8(
        cand_i: &[u32],
        cand_v: &[f32],
        t: u32,
        base: u32,
        idx: &mut Vec<u32>,
        val: &mut Vec<f32>,
    ) {
        let below = _mm256_set1_epi32(below(t));
        let (abs, base) = (
            _mm256_set1_epi32(0x7fff_ffff),
            _mm256_set1_epi32(base as i32),
        );
        for (is, vs) in cand_i.chunks_exact(8).zip(cand_v.chunks_exact(8)) {
            // SAFETY: unaligned loads of the 8 entries of `vs` and `is`.
            let (v, i) = unsafe {
                (
                    _mm256_loadu_ps(vs.as_ptr()),
                    _mm256_loadu_si256(is.as_ptr().cast()),
                )
            };
            let key = _mm256_and_si256(_mm256_castps_si256(v), abs);
            let mask = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(key, below)));
            // SAFETY: this processor has AVX2 and POPCNT (this function's contract).
            unsafe { push8(mask as usize, _mm256_add_epi32(i, base), v, idx, val) };
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    pub fn lanes() -> usize {
        0
    }

    pub fn packed_in<const DIFF: bool>(
        _: usize,
        _: &[f32],
        _: &[f32],
        _: usize,
        _: u32,
        _: &mut Vec<u32>,
        _: &mut Vec<f32>,
    ) -> usize {
        0
    }

    pub fn taken_in(
        _: usize,
        _: &[u32],
        _: &[f32],
        _: u32,
        _: u32,
        _: &mut Vec<u32>,
        _: &mut Vec<f32>,
    ) -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The vector widths to test: each path this processor has, and none (by masks only).
    const WIDTHS: [usize; 3] = [0, 8, 16];

    /// The definition: every entry whose key reaches the floor, with its index, in order.
    fn reference(span: &[f32], start: usize, floor: u32) -> (Vec<u32>, Vec<f32>) {
        span.iter()
            .enumerate()
            .filter(|(_, &v)| abs_key(v) >= floor)
            .map(|(i, &v)| ((start + i) as u32, v))
            .unzip()
    }

    fn bits((i, v): (Vec<u32>, Vec<f32>)) -> (Vec<u32>, Vec<u32>) {
        (i, v.iter().map(|v| v.to_bits()).collect())
    }

    /// Values with both signs of zero, infinities and NaNs among uniform ones.
    fn awkward(rng: &mut impl Rng, n: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        for (i, v) in [
            (3, -0.0),
            (17, f32::INFINITY),
            (40, f32::NAN),
            (41, -f32::NAN),
        ] {
            x[i] = v;
        }
        x[99] = f32::NEG_INFINITY;
        x
    }

    /// Every path against the definition, bit for bit, of x and of x - hat: lengths with and without
    /// whole groups, floors from 0 (every entry) to above every key, both signs of zero, infinities and
    /// NaNs (in x and in hat).
    #[test]
    fn candidates_are_the_entries_that_reach_the_floor() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let x = awkward(&mut rng, 1000);
        let mut hat = awkward(&mut rng, 1000);
        hat[5] = x[5];
        let floors = [
            0,
            1,
            0.5f32.to_bits(),
            1.5f32.to_bits(),
            0x7f80_0000,
            0x7fff_ffff,
            u32::MAX,
        ];
        for len in [0, 1, 7, 8, 9, 16, 17, 63, 1000] {
            let (x, hat) = (&x[..len], &hat[..len]);
            let diff: Vec<f32> = x.iter().zip(hat).map(|(a, b)| a - b).collect();
            for &floor in &floors {
                let want = bits(reference(x, 5, floor));
                let want_diff = bits(reference(&diff, 5, floor));
                for width in WIDTHS {
                    let at = format!("length {len}, floor {floor:#x}, width {width}");
                    assert_eq!(
                        bits(gather_in::<false>(width, x, x, 5, floor)),
                        want,
                        "{at}"
                    );
                    let got = bits(gather_in::<true>(width, x, hat, 5, floor));
                    assert_eq!(got, want_diff, "x - hat: {at}");
                }
                assert_eq!(bits(candidates(x, 5, floor)), want);
                assert_eq!(bits(difference_candidates(x, hat, 5, floor)), want_diff);
            }
        }
    }

    /// `take` against its definition (one entry at a time: above the threshold, or equal to it while
    /// ties remain, k of them), bit for bit: few distinct keys so that many tie, every tie count,
    /// appended after entries already there.
    #[test]
    fn take_keeps_the_keys_above_and_the_first_ties() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for len in [0, 1, 8, 15, 16, 33, 200] {
            let cand_v: Vec<f32> = (0..len)
                .map(|_| rng.random_range(-4i32..=4) as f32 * 0.5)
                .collect();
            let cand_i: Vec<u32> = (0..len as u32).map(|i| 3 * i + 1).collect();
            for t in [0.0f32, 0.5, 1.0, 2.0, 3.0] {
                let t = abs_key(t);
                let equal = cand_v.iter().filter(|&&v| abs_key(v) == t).count();
                for ties in 0..=equal {
                    let mut want = (vec![9], vec![9.0]);
                    let mut left = ties;
                    for (&i, &v) in cand_i.iter().zip(&cand_v) {
                        let key = abs_key(v);
                        if key > t || (key == t && left > 0) {
                            left -= usize::from(key == t);
                            want.0.push(100 + i);
                            want.1.push(v);
                        }
                    }
                    let k = want.0.len() - 1;
                    for width in WIDTHS {
                        let mut got = (vec![9], vec![9.0]);
                        take_in(
                            width,
                            (&cand_i, &cand_v),
                            (t, k),
                            100,
                            &mut got.0,
                            &mut got.1,
                        );
                        let at = format!("length {len}, key {t:#x}, ties {ties}, width {width}");
                        assert_eq!(bits(got), bits(want.clone()), "{at}");
                    }
                }
            }
        }
    }
}

//! Signs written past the caches, for a destination that is not read again soon.

/// Writes signs, with non-temporal stores where asked and the CPU has AVX2 or AVX-512
/// (`with_sign_stream`).
pub struct SignStream {
    #[cfg(target_arch = "x86_64")]
    past: Past,
}

/// How a `SignStream` writes: through the caches, or past them 32 or 64 bytes a store.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Debug)]
enum Past {
    No,
    Avx2,
    Avx512,
}

/// Runs `f` with a `SignStream` that writes past the caches when `past_caches` (for a destination too
/// large to stay in them until it is read); the stores it made are fenced (`sfence`) before this
/// returns or unwinds, so that every later access, from any thread, sees them.
pub fn with_sign_stream<R>(past_caches: bool, f: impl FnOnce(&mut SignStream) -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    let past = match past_caches {
        false => Past::No,
        true if std::arch::is_x86_feature_detected!("avx512f") => Past::Avx512,
        true if std::arch::is_x86_feature_detected!("avx2") => Past::Avx2,
        true => Past::No,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = past_caches;
    fenced(
        SignStream {
            #[cfg(target_arch = "x86_64")]
            past,
        },
        f,
    )
}

/// Runs `f` with `stream`, its stores fenced (`sfence`) before this returns or unwinds.
fn fenced<R>(mut stream: SignStream, f: impl FnOnce(&mut SignStream) -> R) -> R {
    /// Fences on drop: on return and on unwind alike.
    struct Fence;
    impl Drop for Fence {
        fn drop(&mut self) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: SSE is part of x86_64's baseline.
            unsafe {
                std::arch::x86_64::_mm_sfence()
            };
        }
    }
    let _fence = Fence;
    f(&mut stream)
}

impl SignStream {
    /// `dst[i] = sign(src[i])`: +1, -1, or +0 for zeros and NaN. Past the caches (with AVX2 or
    /// AVX-512), the whole 64-byte lines of `dst` are written with non-temporal stores, which skip
    /// reading each line into the cache before overwriting it (and leave it out of the cache). Inlined,
    /// so that the plain loop takes the caller's target features (the decoding's `multiversion`).
    #[inline(always)]
    pub fn store(&mut self, dst: &mut [f32], src: &[f32]) {
        assert_eq!(dst.len(), src.len(), "SignStream::store: lengths differ");
        #[cfg(target_arch = "x86_64")]
        match self.past {
            Past::Avx512 => {
                // SAFETY: the CPU has AVX-512F (probed by `with_sign_stream`); the fence that the
                // non-temporal stores need runs when `with_sign_stream` ends.
                return unsafe { x86::store_signs(dst, src) };
            }
            Past::Avx2 => {
                // SAFETY: the CPU has AVX2 (probed by `with_sign_stream`); fenced as above.
                return unsafe { x86::store_signs_avx2(dst, src) };
            }
            Past::No => {}
        }
        dst.iter_mut().zip(src).for_each(|(o, &d)| *o = sign(d));
    }
}

/// torch.sign: 0 stays 0 (NaN gives +0 here, where torch gives NaN). Without branches, so that a row
/// of them vectorizes.
#[inline(always)]
pub fn sign(d: f32) -> f32 {
    f32::from(u8::from(d > 0.0)) - f32::from(u8::from(d < 0.0))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::sign;
    use std::arch::x86_64::*;

    /// The entries of `dst` before its first 64-byte line, and those of its whole lines after them.
    fn lines(dst: &[f32]) -> (usize, usize) {
        let head = dst.as_ptr().align_offset(64).min(dst.len());
        (head, (dst.len() - head) / 16 * 16)
    }

    /// Signs with plain stores (the entries outside whole lines).
    fn plain(dst: &mut [f32], src: &[f32]) {
        dst.iter_mut().zip(src).for_each(|(o, &d)| *o = sign(d));
    }

    /// # Safety
    /// The CPU has AVX-512F, and an `_mm_sfence` runs before any other access to `dst`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn store_signs(dst: &mut [f32], src: &[f32]) {
        let (head, whole) = lines(dst);
        let end = head + whole;
        plain(&mut dst[..head], &src[..head]);
        let (one, minus, zero) = (
            _mm512_set1_ps(1.0),
            _mm512_set1_ps(-1.0),
            _mm512_setzero_ps(),
        );
        let vs = src[head..end].chunks_exact(16);
        for (o, v) in dst[head..end].chunks_exact_mut(16).zip(vs) {
            // SAFETY: `v` holds 16 floats; `o` holds 16 and starts a 64-byte line (`lines`).
            let d = unsafe { _mm512_loadu_ps(v.as_ptr()) };
            let pos = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(d, zero);
            let neg = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(d, zero);
            let s = _mm512_mask_mov_ps(_mm512_maskz_mov_ps(pos, one), neg, minus);
            // SAFETY: as above; the caller fences these stores before `dst` is read.
            unsafe { _mm512_stream_ps(o.as_mut_ptr(), s) };
        }
        plain(&mut dst[end..], &src[end..]);
    }

    /// `store_signs` with AVX2: each whole line as two 32-byte non-temporal stores, which the core
    /// joins into one write of the line.
    ///
    /// # Safety
    /// The CPU has AVX2, and an `_mm_sfence` runs before any other access to `dst`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn store_signs_avx2(dst: &mut [f32], src: &[f32]) {
        let (head, whole) = lines(dst);
        let end = head + whole;
        plain(&mut dst[..head], &src[..head]);
        let (one, zero) = (_mm256_set1_ps(1.0), _mm256_setzero_ps());
        let vs = src[head..end].chunks_exact(8);
        for (o, v) in dst[head..end].chunks_exact_mut(8).zip(vs) {
            // SAFETY: `v` holds 8 floats; `o` holds 8 and starts at a 32-byte boundary (the halves
            // of the lines `lines` found).
            let d = unsafe { _mm256_loadu_ps(v.as_ptr()) };
            // (d > 0) - (d < 0), as `sign`: NaN compares false both ways and gives +0.
            let pos = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(d, zero), one);
            let neg = _mm256_and_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(d, zero), one);
            // SAFETY: as above; the caller fences these stores before `dst` is read.
            unsafe { _mm256_stream_ps(o.as_mut_ptr(), _mm256_sub_ps(pos, neg)) };
        }
        plain(&mut dst[end..], &src[end..]);
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Every way this CPU can write signs.
    fn ways() -> Vec<Past> {
        let mut ways = vec![Past::No];
        if std::arch::is_x86_feature_detected!("avx2") {
            ways.push(Past::Avx2);
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            ways.push(Past::Avx512);
        }
        ways
    }

    #[test]
    fn streamed_signs_equal_the_scalar_signs_at_every_offset_and_length() {
        let specials = [
            0.0,
            -0.0,
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-45,
            -1e-45,
        ];
        let src: Vec<f32> = (0..300)
            .map(|i| match i % 11 {
                k @ 0..=7 => specials[k],
                8 => i as f32 * 0.37,
                _ => -(i as f32) * 1.3,
            })
            .collect();
        let mut dst = vec![7.0f32; 300];
        for at in 0..20 {
            for len in [0, 1, 15, 16, 17, 33, 64, 100, 280 - at] {
                for past in ways() {
                    dst.fill(7.0);
                    let (d, s) = (&mut dst[at..at + len], &src[at..at + len]);
                    fenced(SignStream { past }, |stream| stream.store(d, s));
                    for (i, &o) in dst.iter().enumerate() {
                        let want = if (at..at + len).contains(&i) {
                            sign(src[i])
                        } else {
                            7.0
                        };
                        let what = format!("entry {i}, offset {at}, length {len}, {past:?}");
                        assert_eq!(o.to_bits(), want.to_bits(), "{what}");
                    }
                }
            }
        }
    }
}

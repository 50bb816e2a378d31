//! Out-of-place transpose of a strided matrix: tiles of 16 x 16 through AVX-512's shuffles where the
//! processor has them (64 shuffles a tile: 32-bit, 64-bit and two 128-bit interleaves), else tiles of
//! 8 x 8 through AVX's shuffles (24 a tile: 32-bit and 64-bit interleaves, then 128-bit halves), and
//! tiles of 8 x 8 through arrays where neither is there and at the edges. A transpose moves values and
//! computes nothing, so the paths agree bit for bit.

/// dst (c x r, row stride `ds`) = src^T (src: r x c, row stride `ss`).
///
/// Panics if a row runs past its stride or a matrix past its slice.
pub fn transpose(src: &[f32], ss: usize, dst: &mut [f32], ds: usize, r: usize, c: usize) {
    if r == 0 || c == 0 {
        return;
    }
    assert!(
        c <= ss && r <= ds,
        "transpose: rows longer than their stride"
    );
    assert!(
        (r - 1) * ss + c <= src.len() && (c - 1) * ds + r <= dst.len(),
        "transpose: the matrix runs past its slice"
    );
    let (r0, c0) = x86::tiles(src, ss, dst, ds, r, c);
    // The bands the vector tiles left: the last rows (all columns), then the last columns.
    if r0 < r {
        tiles8(&src[r0 * ss..], ss, &mut dst[r0..], ds, r - r0, c);
    }
    if c0 < c && r0 > 0 {
        tiles8(&src[c0..], ss, &mut dst[c0 * ds..], ds, r0, c - c0);
    }
}

/// `transpose` in tiles of 8 x 8 held in arrays (a column of the whole matrix at once would walk
/// one cache set), any size.
fn tiles8(src: &[f32], ss: usize, dst: &mut [f32], ds: usize, r: usize, c: usize) {
    const T: usize = 8;
    for i0 in (0..r).step_by(T) {
        for t0 in (0..c).step_by(T) {
            if i0 + T <= r && t0 + T <= c {
                let mut tile = [[0.0f32; T]; T];
                for (i, row) in tile.iter_mut().enumerate() {
                    row.copy_from_slice(&src[(i0 + i) * ss + t0..][..T]);
                }
                for t in 0..T {
                    let col: [f32; T] = std::array::from_fn(|i| tile[i][t]);
                    dst[(t0 + t) * ds + i0..][..T].copy_from_slice(&col);
                }
            } else {
                for i in i0..(i0 + T).min(r) {
                    for t in t0..(t0 + T).min(c) {
                        dst[t * ds + i] = src[i * ss + t];
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The whole tiles of an r x c matrix transposed through the widest shuffles the processor has
    /// (16 x 16 with AVX-512F, else 8 x 8 with AVX): the rows and columns done, multiples of the
    /// tile's side; (0, 0) (nothing written) with neither or when no whole tile fits.
    pub fn tiles(
        src: &[f32],
        ss: usize,
        dst: &mut [f32],
        ds: usize,
        r: usize,
        c: usize,
    ) -> (usize, usize) {
        match tiles_of(16, src, ss, dst, ds, r, c) {
            (0, 0) => tiles_of(8, src, ss, dst, ds, r, c),
            done => done,
        }
    }

    /// `tiles` with tiles of `side` (16 or 8) alone: (0, 0) where the processor lacks its feature.
    pub fn tiles_of(
        side: usize,
        src: &[f32],
        ss: usize,
        dst: &mut [f32],
        ds: usize,
        r: usize,
        c: usize,
    ) -> (usize, usize) {
        let has = match side {
            16 => std::arch::is_x86_feature_detected!("avx512f"),
            8 => std::arch::is_x86_feature_detected!("avx"),
            _ => false,
        };
        if !has {
            return (0, 0);
        }
        let (r, c) = (r / side * side, c / side * side);
        if r == 0 || c == 0 {
            return (0, 0);
        }
        assert!(c <= ss && r <= ds);
        assert!((r - 1) * ss + c <= src.len() && (c - 1) * ds + r <= dst.len());
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        // SAFETY: the processor has the feature of the side (checked above), and every row of `side`
        // floats that the tile loops read (row i < r, columns < c) or write (row t < c, columns < r)
        // lies in its slice (asserted above); dst is borrowed mutably, so it does not overlap src.
        unsafe {
            match side {
                16 => tiles16(s, ss, d, ds, r, c),
                _ => tiles8(s, ss, d, ds, r, c),
            }
        }
        (r, c)
    }

    /// The 16 x 16 tiles by pointers, which keeps the tile loop free of bounds checks.
    ///
    /// # Safety
    /// The processor has AVX-512F; src holds r rows of c floats (c and r multiples of 16) at stride
    /// ss, dst c rows of r at stride ds, and the two do not overlap.
    #[target_feature(enable = "avx512f")]
    unsafe fn tiles16(src: *const f32, ss: usize, dst: *mut f32, ds: usize, r: usize, c: usize) {
        for i0 in (0..r).step_by(16) {
            for t0 in (0..c).step_by(16) {
                let mut x = [_mm512_setzero_ps(); 16];
                for (i, x) in x.iter_mut().enumerate() {
                    // SAFETY: row i0 + i < r, columns t0..t0 + 16 <= c (the caller's contract).
                    *x = unsafe { _mm512_loadu_ps(src.add((i0 + i) * ss + t0)) };
                }
                for (t, v) in tile(x).iter().enumerate() {
                    // SAFETY: row t0 + t < c, columns i0..i0 + 16 <= r (the caller's contract).
                    unsafe { _mm512_storeu_ps(dst.add((t0 + t) * ds + i0), *v) };
                }
            }
        }
    }

    /// The columns of 16 rows of 16: rows 2i and 2i + 1 interleaved by floats, then pairs of those
    /// by doubles, then 128-bit lanes of rows j and j + 4 of each 8, then of rows j and j + 8.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn tile(mut x: [__m512; 16]) -> [__m512; 16] {
        let (pd, ps) = (_mm512_castps_pd, _mm512_castpd_ps);
        let mut y = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            y[2 * i] = _mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]);
            y[2 * i + 1] = _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]);
        }
        for q in (0..16).step_by(4) {
            for j in 0..2 {
                let (u, v) = (pd(y[q + j]), pd(y[q + 2 + j]));
                x[q + 2 * j] = ps(_mm512_unpacklo_pd(u, v));
                x[q + 2 * j + 1] = ps(_mm512_unpackhi_pd(u, v));
            }
        }
        for q in [0, 8] {
            for j in 0..4 {
                y[q + j] = _mm512_shuffle_f32x4::<0b10_00_10_00>(x[q + j], x[q + j + 4]);
                y[q + j + 4] = _mm512_shuffle_f32x4::<0b11_01_11_01>(x[q + j], x[q + j + 4]);
            }
        }
        for j in 0..8 {
            x[j] = _mm512_shuffle_f32x4::<0b10_00_10_00>(y[j], y[j + 8]);
            x[j + 8] = _mm512_shuffle_f32x4::<0b11_01_11_01>(y[j], y[j + 8]);
        }
        x
    }

    /// The 8 x 8 tiles by pointers.
    ///
    /// # Safety
    /// The processor has AVX; src holds r rows of c floats (c and r multiples of 8) at stride ss, dst
    /// c rows of r at stride ds, and the two do not overlap.
    #[target_feature(enable = "avx")]
    unsafe fn tiles8(src: *const f32, ss: usize, dst: *mut f32, ds: usize, r: usize, c: usize) {
        for i0 in (0..r).step_by(8) {
            for t0 in (0..c).step_by(8) {
                let mut x = [_mm256_setzero_ps(); 8];
                for (i, x) in x.iter_mut().enumerate() {
                    // SAFETY: row i0 + i < r, columns t0..t0 + 8 <= c (the caller's contract).
                    *x = unsafe { _mm256_loadu_ps(src.add((i0 + i) * ss + t0)) };
                }
                for (t, v) in tile8(x).iter().enumerate() {
                    // SAFETY: row t0 + t < c, columns i0..i0 + 8 <= r (the caller's contract).
                    unsafe { _mm256_storeu_ps(dst.add((t0 + t) * ds + i0), *v) };
                }
            }
        }
    }

    /// The columns of 8 rows of 8: rows 2i and 2i + 1 interleaved by floats, then pairs of those by
    /// doubles, then the 128-bit halves of rows j and j + 4.
    #[target_feature(enable = "avx")]
    #[inline]
    fn tile8(mut x: [__m256; 8]) -> [__m256; 8] {
        let (pd, ps) = (_mm256_castps_pd, _mm256_castpd_ps);
        let mut y = [_mm256_setzero_ps(); 8];
        for i in 0..4 {
            y[2 * i] = _mm256_unpacklo_ps(x[2 * i], x[2 * i + 1]);
            y[2 * i + 1] = _mm256_unpackhi_ps(x[2 * i], x[2 * i + 1]);
        }
        for q in [0, 4] {
            for j in 0..2 {
                let (u, v) = (pd(y[q + j]), pd(y[q + 2 + j]));
                x[q + 2 * j] = ps(_mm256_unpacklo_pd(u, v));
                x[q + 2 * j + 1] = ps(_mm256_unpackhi_pd(u, v));
            }
        }
        for j in 0..4 {
            y[j] = _mm256_permute2f128_ps::<0x20>(x[j], x[j + 4]);
            y[j + 4] = _mm256_permute2f128_ps::<0x31>(x[j], x[j + 4]);
        }
        y
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    pub fn tiles(
        _: &[f32],
        _: usize,
        _: &mut [f32],
        _: usize,
        _: usize,
        _: usize,
    ) -> (usize, usize) {
        (0, 0)
    }

    #[cfg(test)]
    pub fn tiles_of(
        _: usize,
        _: &[f32],
        _: usize,
        _: &mut [f32],
        _: usize,
        _: usize,
        _: usize,
    ) -> (usize, usize) {
        (0, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path against the definition, over sizes with and without whole 16 x 16 and 8 x 8 tiles and
    /// strides wider than the rows.
    #[test]
    fn transposes_are_the_definition() {
        for (r, c) in [
            (1, 1),
            (3, 5),
            (8, 8),
            (8, 24),
            (40, 16),
            (16, 16),
            (17, 33),
            (64, 64),
            (48, 7),
            (5, 80),
            (96, 1),
        ] {
            let (ss, ds) = (c + 3, r + 1);
            let src: Vec<f32> = (0..r * ss).map(|i| i as f32 * 0.5 - 7.0).collect();
            let mut want = vec![-1.0; c * ds];
            for i in 0..r {
                for t in 0..c {
                    want[t * ds + i] = src[i * ss + t];
                }
            }
            let mut got = vec![-1.0; c * ds];
            transpose(&src, ss, &mut got, ds, r, c);
            assert_eq!(got, want, "{r} x {c}");
            let mut plain = vec![-1.0; c * ds];
            tiles8(&src, ss, &mut plain, ds, r, c);
            assert_eq!(plain, want, "{r} x {c}, tiles of 8");
            // Each vector path alone, where this processor has it: its whole tiles, nothing else.
            for side in [16, 8] {
                let mut got = vec![-1.0; c * ds];
                let (r0, c0) = x86::tiles_of(side, &src, ss, &mut got, ds, r, c);
                for t in 0..c {
                    for i in 0..r {
                        let w = if t < c0 && i < r0 {
                            want[t * ds + i]
                        } else {
                            -1.0
                        };
                        assert_eq!(
                            got[t * ds + i],
                            w,
                            "{r} x {c}, SIMD tiles of {side}: ({t}, {i})"
                        );
                    }
                }
            }
        }
    }
}

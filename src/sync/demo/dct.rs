//! DeMo's orthonormal 2-D DCT-II of a chunk and its inverse, by Lee's fast algorithm (B. G. Lee, "A new
//! algorithm to compute the discrete cosine transform", 1984), the same sequence of float operations
//! on the host and in the GPU kernels (`lee` in kernels/reducers.cu).
//!
//! C is the unnormalized DCT-II of size n, C(k, i) = cos(pi (2i + 1) k / 2n), and the orthonormal one is
//! D = S C with S = diag(s), s_0 = sqrt(1/n), s_k = sqrt(2/n). For even n (h = n / 2), with
//! g_i = x_i + x_{n-1-i} and u_i = (x_i - x_{n-1-i}) t_i, t_i = 1 / (2 cos(pi (2i + 1) / 2n)):
//! (C x)_{2k} = (C_h g)_k and (C x)_{2k+1} = (C_h u)_k + (C_h u)_{k+1} (the last term 0 at k = h - 1).
//! Halving runs down to the odd part m of n (n = m 2^depth), where C_m is applied as a dense sum. The
//! inverse applies C^T, the same flow graph transposed. A chunk of r x c goes forward as
//! D_r X D_c^T (C_r on each column, then S_r; C_c on each row, then S_c) and back as D_r^T K D_c (S_r,
//! then C_r^T on each column; S_c, then C_c^T on each row). That is n log n work where the matrix
//! product was n^2 per vector; the sums are not the product's, so the two agree to rounding (the
//! tests state how close). The encoding's inverse of a chunk's few kept coefficients skips the rows'
//! transform: a row that holds kept coefficients gets their basis rows of D_c as a sparse sum, the
//! others stay zero, and only the columns' transform runs (`kept_inverse`). So does the decoding's
//! inverse of the ranks' mean coefficients while they are few (`sparse_inverse`).
//!
//! On the host every pass works on whole rows of the block (a column transform adds and scales rows;
//! a row transform runs on the transposed block), so it vectorizes across the lanes of independent
//! vectors and each lane computes what the GPU's thread for that vector computes, bit for bit. A pass
//! takes three halving (or merging) levels at once where three are left, else two: the same
//! operations on each lane, a third (or half) of the loads and stores.

/// One transform size: its scale, its halving levels' factors and the odd base's dense matrix.
pub(super) struct Dct {
    pub n: usize,
    /// The odd part m of n.
    base: usize,
    /// s_k, k < n.
    scale: Vec<f32>,
    /// t_i (i < b / 2) for b = n, n / 2, ..., 2m, one level after the other (n - m values).
    twiddle: Vec<f32>,
    /// C_m, row k: frequency k (m x m).
    dense: Vec<f32>,
    /// D = S C, row k: frequency k (n x n), for the inverse of a chunk's few kept coefficients
    /// (`kept_inverse`).
    basis: Vec<f32>,
    /// Whether S is applied in the pass on the whole vector (`merge3` last, `unmerge3` first) rather
    /// than in a pass of its own: where n = m 8^j past 8.
    folds: bool,
}

impl Dct {
    pub fn new(n: usize) -> Self {
        let base = n >> n.trailing_zeros();
        let pi = std::f64::consts::PI;
        // s_k and C(k, i) of size m, in f64.
        let s = |k: usize| (if k == 0 { 1.0 } else { 2.0 } / n as f64).sqrt();
        let cos =
            |k: usize, i: usize, m: usize| (pi * ((2 * i + 1) * k) as f64 / (2 * m) as f64).cos();
        let scale = (0..n).map(|k| s(k) as f32).collect();
        let (mut twiddle, mut b) = (Vec::with_capacity(n - base), n);
        while b > base {
            twiddle.extend((0..b / 2).map(|i| (1.0 / (2.0 * cos(1, i, b))) as f32));
            b /= 2;
        }
        let dense = (0..base * base)
            .map(|o| cos(o / base, o % base, base) as f32)
            .collect();
        let basis = (0..n * n)
            .map(|o| (s(o / n) * cos(o / n, o % n, n)) as f32)
            .collect();
        let depth = n.trailing_zeros();
        Self {
            n,
            base,
            scale,
            twiddle,
            dense,
            basis,
            folds: depth >= 3 && depth.is_multiple_of(3) && n != 8,
        }
    }

    /// What the kernels read for this size: s, then the factors, then C_m, then D.
    pub fn words(&self) -> Vec<f32> {
        [&self.scale[..], &self.twiddle, &self.dense, &self.basis].concat()
    }
}

/// Lanes a pass's step takes of each row it reads (`lanes`), in a function multiversioned for the vector
/// unit: 16 where it has AVX-512 (a row's lanes in one of its 32 registers), 8 elsewhere (the passes that
/// read 8 or 15 rows would spill AVX2's 16 registers at 16 lanes, two registers a row).
macro_rules! lanes_per_step {
    () => {
        if multiversion::target::target_cfg_f!(target_feature = "avx512f") {
            16
        } else {
            8
        }
    };
}

/// Each of `g` chunks side by side in p (r rows of g c, r = a.n and c = b.n) transformed in place:
/// D_r x D_c^T, or with `inverse` D_r^T x D_c; q is scratch of p's length. Every column of the block is
/// one vector of the first stage; for the second the block is transposed so that lane (chunk, row)
/// holds that chunk row's c entries, g r lanes wide.
#[multiversion::multiversion(targets = "simd")]
pub(super) fn transform(p: &mut [f32], q: &mut [f32], a: &Dct, b: &Dct, g: usize, inverse: bool) {
    transform_in::<{ lanes_per_step!() }>(p, q, a, b, g, inverse)
}

/// `transform`, its passes taking L lanes a step (`lanes`): the same floats at any L.
#[inline(always)]
fn transform_in<const L: usize>(
    p: &mut [f32],
    q: &mut [f32],
    a: &Dct,
    b: &Dct,
    g: usize,
    inverse: bool,
) {
    let (r, c) = (a.n, b.n);
    // Each stage leaves its result in its block or its scratch (`lee`); the transposes go from the one
    // that holds it to the other.
    let first = stage::<L>(a, p, q, g * c, inverse);
    let (x, y) = if first {
        (&mut *q, &mut *p)
    } else {
        (&mut *p, &mut *q)
    };
    transpose(x, y, r, c, g, false);
    let second = stage::<L>(b, y, x, g * r, inverse);
    let (x, y) = if second { (x, y) } else { (y, x) };
    transpose(y, x, r, c, g, true);
    if first != second {
        p.copy_from_slice(q);
    }
}

/// D_r^T K D_c of each of `g` chunks side by side in p (r rows of g c, r = a.n and c = b.n), where a
/// chunk's K holds only its kept coefficients: `msg`, per chunk [k indices in the chunk, ascending, as
/// f32 bits | k values]. Each kept row's K D_c as a sparse sum (from +0, the coefficients in index
/// order, each value times its basis row of D_c), then the column stage of `transform`; q is scratch.
/// A handful of rows with entries need no transform along the rows (the kernels' `kept_inverse`).
/// Returns the result: p, or q where the column stage left it there.
#[multiversion::multiversion(targets = "simd")]
pub(super) fn kept_inverse<'a>(
    p: &'a mut [f32],
    q: &'a mut [f32],
    a: &Dct,
    b: &Dct,
    g: usize,
    msg: &[f32],
    k: usize,
) -> &'a [f32] {
    let (c, w) = (b.n, g * b.n);
    p.fill(0.0);
    if k == 0 {
        return p;
    }
    for (jc, m) in msg.chunks_exact(2 * k).take(g).enumerate() {
        for (i, &v) in m[..k].iter().zip(&m[k..]) {
            let (u, f) = (i.to_bits() as usize / c, i.to_bits() as usize % c);
            add_scaled(&mut p[u * w + jc * c..][..c], &b.basis[f * c..], v);
        }
    }
    match stage::<{ lanes_per_step!() }>(a, p, q, w, true) {
        true => q,
        false => p,
    }
}

/// D_r^T K D_c of each of `g` chunks side by side in p (as `transform` with `inverse`), for a sparse K
/// (the decoding's few sent coefficients): each row's K D_c as a sparse sum into q over the row's
/// marked entries (from +0, in index order, each value times its basis row of D_c, as `kept_inverse`),
/// then the column stage; returns the result, in q or (where the stage left it there) in p. `marks`
/// (`mark`) holds a bit for each entry that may be nonzero; marking a zero changes no bit of the
/// result: a sum that starts at +0 never becomes -0, and adding a zero product leaves it as it is.
#[multiversion::multiversion(targets = "simd")]
pub(super) fn sparse_inverse<'a>(
    p: &'a mut [f32],
    q: &'a mut [f32],
    a: &Dct,
    b: &Dct,
    g: usize,
    marks: &[u64],
) -> &'a [f32] {
    let (c, w) = (b.n, g * b.n);
    q.fill(0.0);
    let rows = p.chunks_exact(w).zip(q.chunks_exact_mut(w));
    for ((krow, orow), m) in rows.zip(marks.chunks_exact(w.div_ceil(64))) {
        for (word, &bits) in m.iter().enumerate() {
            let mut bits = bits;
            while bits != 0 {
                let at = word * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                add_scaled(
                    &mut orow[at / c * c..][..c],
                    &b.basis[at % c * c..],
                    krow[at],
                );
            }
        }
    }
    match stage::<{ lanes_per_step!() }>(a, q, p, w, true) {
        true => p,
        false => q,
    }
}

/// Words of `sparse_inverse`'s marks for a block of rows of w.
pub(super) fn mark_words(rows: usize, w: usize) -> usize {
    rows * w.div_ceil(64)
}

/// Marks entry `at` of a block of rows of w: bit t % 64 of word i ceil(w / 64) + t / 64 for row i,
/// column t.
#[inline(always)]
pub(super) fn mark(marks: &mut [u64], at: usize, w: usize) {
    let (i, t) = (at / w, at % w);
    marks[i * w.div_ceil(64) + t / 64] |= 1 << (t % 64);
}

/// D x of each column of x (d.n rows of w): C, then S; with `inverse` D^T x: S, then C^T (S in a pass
/// of its own unless `lee` applies it). True where the result is in `scratch` rather than x (`lee`).
#[inline(always)]
fn stage<const L: usize>(
    d: &Dct,
    x: &mut [f32],
    scratch: &mut [f32],
    w: usize,
    inverse: bool,
) -> bool {
    if inverse && !d.folds {
        scale_rows(x, &d.scale, w);
    }
    let moved = match w {
        64 => lee::<64, L>(d, x, scratch, w, inverse),
        _ => lee::<0, L>(d, x, scratch, w, inverse),
    };
    if !inverse && !d.folds {
        scale_rows(if moved { scratch } else { x }, &d.scale, w);
    }
    moved
}

/// `transform` of a copy of x.
#[cfg(test)]
pub(super) fn transformed(x: &[f32], a: &Dct, b: &Dct, g: usize, inverse: bool) -> Vec<f32> {
    let (mut p, mut q) = (x.to_vec(), vec![0.0; x.len()]);
    transform(&mut p, &mut q, a, b, g, inverse);
    p
}

/// `transform_in` at L lanes of a copy of x, whatever this machine's vector unit would take.
#[cfg(test)]
fn transformed_at<const L: usize>(
    x: &[f32],
    a: &Dct,
    b: &Dct,
    g: usize,
    inverse: bool,
) -> Vec<f32> {
    let (mut p, mut q) = (x.to_vec(), vec![0.0; x.len()]);
    transform_in::<L>(&mut p, &mut q, a, b, g, inverse);
    p
}

/// The lanes a step `transform` takes on this machine.
#[cfg(test)]
#[multiversion::multiversion(targets = "simd")]
fn lanes_here() -> usize {
    lanes_per_step!()
}

/// A chunk's message of its nonzero entries: their indices as f32 bits, then their values.
#[cfg(test)]
pub(super) fn message(x: &[f32]) -> (Vec<f32>, usize) {
    let at: Vec<usize> = (0..x.len()).filter(|&i| x[i] != 0.0).collect();
    let mut m: Vec<f32> = at.iter().map(|&i| f32::from_bits(i as u32)).collect();
    m.extend(at.iter().map(|&i| x[i]));
    (m, at.len())
}

/// `kept_inverse` of the message of x's nonzero entries into a fresh block.
#[cfg(test)]
pub(super) fn kept_inverted(x: &[f32], a: &Dct, b: &Dct) -> Vec<f32> {
    let (m, k) = message(x);
    let (mut p, mut q) = (vec![f32::NAN; x.len()], vec![0.0; x.len()]);
    kept_inverse(&mut p, &mut q, a, b, 1, &m, k).to_vec()
}

/// Row i of x (rows of w) times s_i.
#[inline(always)]
fn scale_rows(x: &mut [f32], s: &[f32], w: usize) {
    for (row, &s) in x.chunks_exact_mut(w).zip(s) {
        row.iter_mut().for_each(|v| *v *= s);
    }
}

/// The block x of r rows of g chunks of c (entry (i, t) of chunk j at i g c + j c + t) into y as c rows
/// of g lanes of r (at t g r + j r + i); with `back`, y to x. Chunk by chunk (`kernels::transpose`).
#[inline(always)]
fn transpose(x: &mut [f32], y: &mut [f32], r: usize, c: usize, g: usize, back: bool) {
    for j in 0..g {
        let (xs, ys) = (&mut x[j * c..], &mut y[j * r..]);
        match back {
            false => crate::kernels::transpose(xs, g * c, ys, g * r, r, c),
            true => crate::kernels::transpose(ys, g * r, xs, g * c, c, r),
        }
    }
}

/// C x (or, with `inverse`, C^T x) of each column of p (d.n rows of w); q is scratch of p's length.
/// Each pass reads one buffer and writes the other: true where the result ends in q (an odd number of
/// passes), false where it is in p. Where `d.folds`, S x too (S first with `inverse`), in the pass on
/// the whole vector: the same products as a pass of their own.
#[inline(always)]
fn lee<const W: usize, const L: usize>(
    d: &Dct,
    p: &mut [f32],
    q: &mut [f32],
    w: usize,
    inverse: bool,
) -> bool {
    let w = if W > 0 { W } else { w };
    let (n, m) = (d.n, d.base);
    let (mut src, mut dst, mut swaps) = (p, q, 0);
    // The factors of the level with blocks of b rows start at n - b (n/2 + n/4 + ... + b before it).
    let t = |b: usize| &d.twiddle[n - b..n - b / 2];
    // Three levels a pass where three are left, else two, else one (`split3`, `split2`, `split`: the
    // same operations, a third or half of the loads and stores). Where n is 8^j, the last three
    // halvings and the first three merges (blocks of 8 rows) are one pass.
    let fused = m == 1 && n >= 8 && n.trailing_zeros().is_multiple_of(3);
    let mut b = n;
    while b > if fused { 8 } else { m } {
        let levels = levels_left(b / m);
        match (inverse, levels) {
            (false, 3) => split3::<L>(src, dst, b, [t(b), t(b / 2), t(b / 4)], w),
            (false, 2) => split2::<L>(src, dst, b, [t(b), t(b / 2)], w),
            (false, _) => split::<L>(src, dst, b, t(b), w),
            (true, 3) if d.folds && b == n => unmerge3::<L, true>(src, dst, b, w, &d.scale),
            (true, 3) => unmerge3::<L, false>(src, dst, b, w, &[]),
            (true, 2) => unmerge2::<L>(src, dst, b, w),
            (true, _) => unmerge::<L>(src, dst, b, w),
        }
        (src, dst, swaps, b) = (dst, src, swaps + 1, b >> levels);
    }
    if fused {
        match inverse {
            false => split_merge3::<L>(src, dst, [t(8), t(4), t(2)], w),
            true => unmerge_unsplit3::<L>(src, dst, [t(8), t(4), t(2)], w),
        }
        (src, dst, swaps) = (dst, src, swaps + 1);
    } else if m > 1 {
        dense(src, dst, &d.dense, m, w, inverse);
        (src, dst, swaps) = (dst, src, swaps + 1);
    }
    while b < n {
        let levels = levels_left(n / b);
        b <<= levels;
        match (inverse, levels) {
            (false, 3) if d.folds && b == n => merge3::<L, true>(src, dst, b, w, &d.scale),
            (false, 3) => merge3::<L, false>(src, dst, b, w, &[]),
            (false, 2) => merge2::<L>(src, dst, b, w),
            (false, _) => merge::<L>(src, dst, b, w),
            (true, 3) => unsplit3::<L>(src, dst, b, [t(b), t(b / 2), t(b / 4)], w),
            (true, 2) => unsplit2::<L>(src, dst, b, [t(b), t(b / 2)], w),
            (true, _) => unsplit::<L>(src, dst, b, t(b), w),
        }
        (src, dst, swaps) = (dst, src, swaps + 1);
    }
    swaps % 2 == 1
}

/// Levels one pass takes when `ratio` (a power of two > 1) is what is left to halve or merge: 3, 2 or 1.
#[inline(always)]
fn levels_left(ratio: usize) -> usize {
    (ratio.trailing_zeros() as usize).min(3)
}

/// y cut into two parts of `len` floats.
#[inline(always)]
fn halves(y: &mut [f32], len: usize) -> [&mut [f32]; 2] {
    let (a, b) = y.split_at_mut(len);
    [a, &mut b[..len]]
}

/// y cut into four parts of `len` floats.
#[inline(always)]
fn quarters(y: &mut [f32], len: usize) -> [&mut [f32]; 4] {
    let (lo, hi) = y.split_at_mut(2 * len);
    let ([a, b], [c, d]) = (halves(lo, len), halves(hi, len));
    [a, b, c, d]
}

/// y cut into eight parts of `len` floats.
#[inline(always)]
fn eighths(y: &mut [f32], len: usize) -> [&mut [f32]; 8] {
    let (lo, hi) = y.split_at_mut(4 * len);
    let ([a, b, c, d], [e, f, g, h]) = (quarters(lo, len), quarters(hi, len));
    [a, b, c, d, e, f, g, h]
}

/// Rows `at` of x (rows of w). (Loops, not `array::map` or `from_fn`: those are not always inlined
/// into the vector code.)
#[inline(always)]
fn rows<const N: usize>(x: &[f32], at: [usize; N], w: usize) -> [&[f32]; N] {
    let mut out: [&[f32]; N] = [&[]; N];
    for (o, i) in out.iter_mut().zip(at) {
        *o = row(x, i, w);
    }
    out
}

/// Row `i` of x (rows of w), to write.
#[inline(always)]
fn row_mut(x: &mut [f32], i: usize, w: usize) -> &mut [f32] {
    &mut x[i * w..(i + 1) * w]
}

/// Row `i` of x (rows of w).
#[inline(always)]
fn row(x: &[f32], i: usize, w: usize) -> &[f32] {
    &x[i * w..(i + 1) * w]
}

/// out_j = f(in_0, ..., in_{I-1})_j lane by lane. Lanes go L at a time (`lanes_per_step`) through
/// arrays held in registers, so that they vectorize without the checks for overlap that keep a plain
/// loop scalar.
#[inline(always)]
fn lanes<const L: usize, const I: usize, const O: usize>(
    mut out: [&mut [f32]; O],
    ins: [&[f32]; I],
    f: impl Fn([f32; I]) -> [f32; O],
) {
    let w = out[0].len();
    let whole = w / L * L;
    // Plain loops over the arrays, not `array::from_fn` or `map`, which are not always inlined.
    let mut x = [[0.0f32; L]; I];
    let mut a = [0.0f32; I];
    for k in (0..whole).step_by(L) {
        for (x, i) in x.iter_mut().zip(&ins) {
            x.copy_from_slice(&i[k..k + L]);
        }
        let mut y = [[0.0f32; L]; O];
        for t in 0..L {
            for i in 0..I {
                a[i] = x[i][t];
            }
            let v = f(a);
            for j in 0..O {
                y[j][t] = v[j];
            }
        }
        for (o, y) in out.iter_mut().zip(&y) {
            o[k..k + L].copy_from_slice(y);
        }
    }
    for k in whole..w {
        for i in 0..I {
            a[i] = ins[i][k];
        }
        for (o, v) in out.iter_mut().zip(f(a)) {
            o[k] = v;
        }
    }
}

/// The forward halving of each block of b rows: g_i = x_i + x_{b-1-i} to rows [0, h), (x_i - x_{b-1-i})
/// t_i to rows [h, b).
#[inline(always)]
fn split<const L: usize>(x: &[f32], y: &mut [f32], b: usize, t: &[f32], w: usize) {
    let h = b / 2;
    for (xb, yb) in x.chunks_exact(b * w).zip(y.chunks_exact_mut(b * w)) {
        let [g, u] = halves(yb, h * w);
        for (i, &t) in t.iter().enumerate() {
            let ins = [row(xb, i, w), row(xb, b - 1 - i, w)];
            let out = [row_mut(g, i, w), row_mut(u, i, w)];
            lanes::<L, _, _>(out, ins, |[l, h]| [l + h, (l - h) * t]);
        }
    }
}

/// The forward merge of each block of b rows (G: rows [0, h), H: rows [h, b)): row 2k = G_k,
/// row 2k + 1 = H_k + H_{k+1}, the last row H_{h-1}.
#[inline(always)]
fn merge<const L: usize>(x: &[f32], y: &mut [f32], b: usize, w: usize) {
    let h = b / 2;
    for (xb, yb) in x.chunks_exact(b * w).zip(y.chunks_exact_mut(b * w)) {
        for (k, pair) in yb.chunks_exact_mut(2 * w).enumerate() {
            let out = halves(pair, w);
            let (g, a) = (row(xb, k, w), row(xb, h + k, w));
            match k + 1 < h {
                true => {
                    lanes::<L, _, _>(out, [g, a, row(xb, h + k + 1, w)], |[g, a, z]| [g, a + z])
                }
                false => lanes::<L, _, _>(out, [g, a], |[g, a]| [g, a]),
            }
        }
    }
}

/// `merge` transposed: G'_k = row 2k to rows [0, h); H'_0 = row 1 and H'_k = row 2k + 1 + row 2k - 1
/// to rows [h, b).
#[inline(always)]
fn unmerge<const L: usize>(x: &[f32], y: &mut [f32], b: usize, w: usize) {
    let h = b / 2;
    for (xb, yb) in x.chunks_exact(b * w).zip(y.chunks_exact_mut(b * w)) {
        let [lo, hi] = halves(yb, h * w);
        for k in 0..h {
            let out = [row_mut(lo, k, w), row_mut(hi, k, w)];
            let (g, a) = (row(xb, 2 * k, w), row(xb, 2 * k + 1, w));
            match k > 0 {
                true => {
                    lanes::<L, _, _>(out, [g, a, row(xb, 2 * k - 1, w)], |[g, a, z]| [g, a + z])
                }
                false => lanes::<L, _, _>(out, [g, a], |[g, a]| [g, a]),
            }
        }
    }
}

/// `split` transposed: with v_i = u_i t_i (g: rows [0, h), u: rows [h, b)), row i = g_i + v_i and
/// row b - 1 - i = g_i - v_i.
#[inline(always)]
fn unsplit<const L: usize>(x: &[f32], y: &mut [f32], b: usize, t: &[f32], w: usize) {
    let h = b / 2;
    for (xb, yb) in x.chunks_exact(b * w).zip(y.chunks_exact_mut(b * w)) {
        let [lo, hi] = halves(yb, h * w);
        for (i, &t) in t.iter().enumerate() {
            let ins = [row(xb, i, w), row(xb, h + i, w)];
            let out = [row_mut(lo, i, w), row_mut(hi, h - 1 - i, w)];
            lanes::<L, _, _>(out, ins, |[g, u]| [g + u * t, g - u * t]);
        }
    }
}

/// `split` at b, then at b / 2 on both halves, in one pass (q = b / 4, t = [t_b, t_{b/2}]): rows i,
/// h - 1 - i, h + i and b - 1 - i of the block (i < q) make its rows i, q + i, h + i and h + q + i.
#[inline(always)]
fn split2<const L: usize>(x: &[f32], y: &mut [f32], b: usize, t: [&[f32]; 2], w: usize) {
    let (h, q) = (b / 2, b / 4);
    for (xb, yb) in x.chunks_exact(b * w).zip(y.chunks_exact_mut(b * w)) {
        let [gg, gu, ug, uu] = quarters(yb, q * w);
        for i in 0..q {
            let (ti, tj, t2) = (t[0][i], t[0][h - 1 - i], t[1][i]);
            let ins = rows(xb, [i, b - 1 - i, h - 1 - i, h + i], w);
            let out = [
                row_mut(gg, i, w),
                row_mut(gu, i, w),
                row_mut(ug, i, w),
                row_mut(uu, i, w),
            ];
            lanes::<L, _, _>(out, ins, |[a, z, c, e]| {
                let (gi, ui) = (a + z, (a - z) * ti);
                let (gj, uj) = (c + e, (c - e) * tj);
                [gi + gj, (gi - gj) * t2, ui + uj, (ui - uj) * t2]
            });
        }
    }
}

/// `merge` at b / 2 on both halves, then at b, in one pass (q = b / 4): rows 4j..4j + 4 of the
/// block from rows j, q + j, h + j and h + q + j (and the next of each but the first).
#[inline(always)]
fn merge2<const L: usize>(x: &[f32], y: &mut [f32], b: usize, w: usize) {
    let (h, q) = (b / 2, b / 4);
    for (xb, yb) in x.chunks_exact(b * w).zip(y.chunks_exact_mut(b * w)) {
        for (j, four) in yb.chunks_exact_mut(4 * w).enumerate() {
            let out = quarters(four, w);
            match j + 1 < q {
                true => {
                    let ins = [
                        j,
                        q + j,
                        q + j + 1,
                        h + j,
                        h + q + j,
                        h + q + j + 1,
                        h + j + 1,
                    ];
                    lanes::<L, _, _>(out, rows(xb, ins, w), |[ag, a0, a1, bg, b0, b1, bn]| {
                        let hb = b0 + b1;
                        [ag, bg + hb, a0 + a1, hb + bn]
                    })
                }
                false => {
                    let ins = rows(xb, [j, q + j, h + j, h + q + j], w);
                    lanes::<L, _, _>(out, ins, |[ag, a0, bg, b0]| [ag, bg + b0, a0, b0])
                }
            }
        }
    }
}

/// `unmerge` at b, then at b / 2 on both halves, in one pass (q = b / 4): rows j, q + j, h + j and
/// h + q + j of the block from rows 4j - 3..4j + 4.
#[inline(always)]
fn unmerge2<const L: usize>(x: &[f32], y: &mut [f32], b: usize, w: usize) {
    let q = b / 4;
    for (xb, yb) in x.chunks_exact(b * w).zip(y.chunks_exact_mut(b * w)) {
        let [o0, o1, o2, o3] = quarters(yb, q * w);
        for j in 0..q {
            let out = [
                row_mut(o0, j, w),
                row_mut(o1, j, w),
                row_mut(o2, j, w),
                row_mut(o3, j, w),
            ];
            match j > 0 {
                true => {
                    let ins = [
                        4 * j,
                        4 * j + 1,
                        4 * j + 2,
                        4 * j + 3,
                        4 * j - 1,
                        4 * j - 2,
                        4 * j - 3,
                    ];
                    lanes::<L, _, _>(out, rows(xb, ins, w), |[x0, x1, x2, x3, p1, p2, p3]| {
                        [x0, x2 + p2, x1 + p1, (x3 + x1) + (p1 + p3)]
                    })
                }
                false => {
                    let ins = rows(xb, [0, 1, 2, 3], w);
                    lanes::<L, _, _>(out, ins, |[x0, x1, x2, x3]| [x0, x2, x1, x3 + x1])
                }
            }
        }
    }
}

/// `unsplit` at b / 2 on both halves, then at b, in one pass (q = b / 4, t = [t_b, t_{b/2}]): rows
/// i, q + i, h + i and h + q + i of the block (i < q) make its rows i, h - 1 - i, h + i and b - 1 - i.
#[inline(always)]
fn unsplit2<const L: usize>(x: &[f32], y: &mut [f32], b: usize, t: [&[f32]; 2], w: usize) {
    let (h, q) = (b / 2, b / 4);
    for (xb, yb) in x.chunks_exact(b * w).zip(y.chunks_exact_mut(b * w)) {
        let [y0, y1, y2, y3] = quarters(yb, q * w);
        for i in 0..q {
            let (ti, tj, t2) = (t[0][i], t[0][h - 1 - i], t[1][i]);
            let ins = rows(xb, [i, q + i, h + i, h + q + i], w);
            let out = [
                row_mut(y0, i, w),
                row_mut(y1, q - 1 - i, w),
                row_mut(y2, i, w),
                row_mut(y3, q - 1 - i, w),
            ];
            lanes::<L, _, _>(out, ins, |[gg, gu, ug, uu]| {
                let (gi, gj) = (gg + gu * t2, gg - gu * t2);
                let (ui, uj) = (ug + uu * t2, ug - uu * t2);
                [gi + ui * ti, gj + uj * tj, gj - uj * tj, gi - ui * ti]
            });
        }
    }
}

/// The factors a three-level pass on blocks of b uses for i: t_b at i, h - 1 - i, q - 1 - i and
/// h - q + i; t_{b/2} at i and q - 1 - i; t_{b/4} at i.
#[inline(always)]
fn factors3(t: [&[f32]; 3], b: usize, i: usize) -> ([f32; 4], [f32; 2], f32) {
    let (h, q) = (b / 2, b / 4);
    let t1 = [t[0][i], t[0][h - 1 - i], t[0][q - 1 - i], t[0][h - q + i]];
    (t1, [t[1][i], t[1][q - 1 - i]], t[2][i])
}

/// Whether a pass on blocks of b rows of w is on a 64 x 64 chunk's block (b and w 64), which the
/// three-level passes then take as constants: every row they read or write is then at a fixed offset
/// from the block's start, where otherwise they would hold 8 or 15 row addresses, more than the
/// registers left beside the lanes.
#[inline(always)]
fn fixed(b: usize, w: usize) -> bool {
    b == 64 && w == 64
}

/// `split3_at` with b and w constants where they are a 64 x 64 chunk's (`fixed`).
#[inline(always)]
fn split3<const L: usize>(x: &[f32], y: &mut [f32], b: usize, t: [&[f32]; 3], w: usize) {
    match fixed(b, w) {
        true => split3_at::<L>(x, y, 64, t, 64),
        false => split3_at::<L>(x, y, b, t, w),
    }
}

/// `split` at b, b / 2 and b / 4 in one pass (e = b / 8, t = [t_b, t_{b/2}, t_{b/4}]): for i < e, rows
/// i, b - 1 - i, h - 1 - i, h + i, q - 1 - i, b - q + i, h - q + i and h + q - 1 - i of the block make
/// row i of each of its eighths.
#[inline(always)]
fn split3_at<const L: usize>(x: &[f32], y: &mut [f32], b: usize, t: [&[f32]; 3], w: usize) {
    let (h, q, e) = (b / 2, b / 4, b / 8);
    for (xb, yb) in x.chunks_exact(b * w).zip(y.chunks_exact_mut(b * w)) {
        let mut ys = eighths(yb, e * w);
        for i in 0..e {
            let ts = factors3(t, b, i);
            let (j, k, l) = (h - 1 - i, q - 1 - i, h - q + i);
            let at = [i, b - 1 - i, j, h + i, k, b - q + i, l, h + q - 1 - i];
            let out = part_rows(&mut ys, [i; 8], w);
            lanes::<L, _, _>(out, rows(xb, at, w), |v| split3_lane(v, ts));
        }
    }
}

/// One lane of `split3`: its eight rows in the order `split3` reads them, to the eighths' rows.
#[inline(always)]
fn split3_lane(x: [f32; 8], (t1, t2, t3): ([f32; 4], [f32; 2], f32)) -> [f32; 8] {
    let f = |a: f32, z: f32, t: f32| (a + z, (a - z) * t);
    let [x0, x1, x2, x3, x4, x5, x6, x7] = x;
    let ((g0, u0), (g1, u1)) = (f(x0, x1, t1[0]), f(x2, x3, t1[1]));
    let ((g2, u2), (g3, u3)) = (f(x4, x5, t1[2]), f(x6, x7, t1[3]));
    let ((gg0, gu0), (gg1, gu1)) = (f(g0, g1, t2[0]), f(g2, g3, t2[1]));
    let ((ug0, uu0), (ug1, uu1)) = (f(u0, u1, t2[0]), f(u2, u3, t2[1]));
    let ((a0, a1), (b0, b1)) = (f(gg0, gg1, t3), f(gu0, gu1, t3));
    let ((c0, c1), (d0, d1)) = (f(ug0, ug1, t3), f(uu0, uu1, t3));
    [a0, a1, b0, b1, c0, c1, d0, d1]
}

/// `split3` then `merge3` on each block of 8 rows (the last three halvings, down to single rows, and
/// the first three merges) in one pass, for sizes 8^j: the same operations in the same order,
/// half the loads and stores. Block b = 8 has e = 1: `split3` reads its rows in the order below and
/// writes rows 0..8, which `merge3`'s last (only) j reads in order.
#[inline(always)]
fn split_merge3<const L: usize>(x: &[f32], y: &mut [f32], t: [&[f32]; 3], w: usize) {
    let ts = factors3(t, 8, 0);
    for (xb, yb) in x.chunks_exact(8 * w).zip(y.chunks_exact_mut(8 * w)) {
        let ins = rows(xb, [0, 7, 3, 4, 1, 6, 2, 5], w);
        lanes::<L, _, _>(eighths(yb, w), ins, |v| merge3_last(split3_lane(v, ts)));
    }
}

/// `unmerge3` then `unsplit3` on each block of 8 rows, in one pass (`split_merge3` transposed).
#[inline(always)]
fn unmerge_unsplit3<const L: usize>(x: &[f32], y: &mut [f32], t: [&[f32]; 3], w: usize) {
    let ts = factors3(t, 8, 0);
    for (xb, yb) in x.chunks_exact(8 * w).zip(y.chunks_exact_mut(8 * w)) {
        let ins = rows(xb, [0, 1, 2, 3, 4, 5, 6, 7], w);
        lanes::<L, _, _>(eighths(yb, w), ins, |v| {
            unsplit3_lane(unmerge3_first(v), ts)
        });
    }
}

/// Row `at[k]` of part k of eight, to write.
#[inline(always)]
fn part_rows<'a>(parts: &'a mut [&mut [f32]; 8], at: [usize; 8], w: usize) -> [&'a mut [f32]; 8] {
    let [a, b, c, d, e, f, g, h] = parts;
    [
        row_mut(a, at[0], w),
        row_mut(b, at[1], w),
        row_mut(c, at[2], w),
        row_mut(d, at[3], w),
        row_mut(e, at[4], w),
        row_mut(f, at[5], w),
        row_mut(g, at[6], w),
        row_mut(h, at[7], w),
    ]
}

/// `merge3_at` with b and w constants where they are a 64 x 64 chunk's (`fixed`).
#[inline(always)]
fn merge3<const L: usize, const S: bool>(x: &[f32], y: &mut [f32], b: usize, w: usize, s: &[f32]) {
    match fixed(b, w) {
        true => merge3_at::<L, S>(x, y, 64, 64, s),
        false => merge3_at::<L, S>(x, y, b, w, s),
    }
}

/// `merge` at b / 4 on the quarters, at b / 2 on the halves, then at b, in one pass (e = b / 8, E_k
/// the block's eighths): rows 8j..8j + 8 of the block from row j of each eighth and, but for the last
/// j, row j + 1 of all but the first. With S each row written is times its s (the block is the
/// whole vector).
#[inline(always)]
fn merge3_at<const L: usize, const S: bool>(
    x: &[f32],
    y: &mut [f32],
    b: usize,
    w: usize,
    s: &[f32],
) {
    let e = b / 8;
    for (xb, yb) in x.chunks_exact(b * w).zip(y.chunks_exact_mut(b * w)) {
        for (j, eight) in yb.chunks_exact_mut(8 * w).enumerate() {
            let out = eighths(eight, w);
            let r = |k: usize, next: usize| k * e + j + next;
            let sj = scales::<S, 8>(s, std::array::from_fn(|k| 8 * j + k));
            match j + 1 < e {
                true => {
                    let at = [
                        r(0, 0),
                        r(1, 0),
                        r(1, 1),
                        r(2, 0),
                        r(3, 0),
                        r(3, 1),
                        r(2, 1),
                        r(4, 0),
                        r(5, 0),
                        r(5, 1),
                        r(6, 0),
                        r(7, 0),
                        r(7, 1),
                        r(6, 1),
                        r(4, 1),
                    ];
                    lanes::<L, _, _>(out, rows(xb, at, w), |v: [f32; 15]| {
                        let [e0, e1, e1n, e2, e3, e3n, e2n, e4, e5, e5n, e6, e7, e7n, e6n, e4n] = v;
                        let (a1, c1) = (e1 + e1n, e3 + e3n);
                        let (d1, f1) = (e5 + e5n, e7 + e7n);
                        let (m1, m3) = (e2 + c1, c1 + e2n);
                        let (n1, n3) = (e6 + f1, f1 + e6n);
                        times::<S, 8>([e0, e4 + n1, m1, n1 + d1, a1, d1 + n3, m3, n3 + e4n], sj)
                    })
                }
                false => {
                    let at = [
                        r(0, 0),
                        r(1, 0),
                        r(2, 0),
                        r(3, 0),
                        r(4, 0),
                        r(5, 0),
                        r(6, 0),
                        r(7, 0),
                    ];
                    lanes::<L, _, _>(out, rows(xb, at, w), |v| times::<S, 8>(merge3_last(v), sj))
                }
            }
        }
    }
}

/// s at rows `at` where S (the scale folded into a pass), else unused ones.
#[inline(always)]
fn scales<const S: bool, const N: usize>(s: &[f32], at: [usize; N]) -> [f32; N] {
    let mut out = [1.0; N];
    if S {
        for (o, i) in out.iter_mut().zip(at) {
            *o = s[i];
        }
    }
    out
}

/// v times s entry by entry where S; v as it is otherwise.
#[inline(always)]
fn times<const S: bool, const N: usize>(mut v: [f32; N], s: [f32; N]) -> [f32; N] {
    if S {
        for (v, s) in v.iter_mut().zip(s) {
            *v *= s;
        }
    }
    v
}

/// One lane of `merge3`'s last j: row j of each eighth to the block's rows 8j..8j + 8.
#[inline(always)]
fn merge3_last([e0, e1, e2, e3, e4, e5, e6, e7]: [f32; 8]) -> [f32; 8] {
    let (m1, n1) = (e2 + e3, e6 + e7);
    [e0, e4 + n1, m1, n1 + e5, e1, e5 + e7, e3, e7]
}

/// `unmerge3_at` with b and w constants where they are a 64 x 64 chunk's (`fixed`).
#[inline(always)]
fn unmerge3<const L: usize, const S: bool>(
    x: &[f32],
    y: &mut [f32],
    b: usize,
    w: usize,
    s: &[f32],
) {
    match fixed(b, w) {
        true => unmerge3_at::<L, S>(x, y, 64, 64, s),
        false => unmerge3_at::<L, S>(x, y, b, w, s),
    }
}

/// `unmerge` at b, at b / 2 on the halves, then at b / 4 on the quarters, in one pass (e = b / 8): row
/// j of each of the block's eighths from rows 8j - 7..8j + 8 (rows 0..8 for j = 0). With S each row
/// read is times its s first (the block is the whole vector).
#[inline(always)]
fn unmerge3_at<const L: usize, const S: bool>(
    x: &[f32],
    y: &mut [f32],
    b: usize,
    w: usize,
    s: &[f32],
) {
    let e = b / 8;
    for (xb, yb) in x.chunks_exact(b * w).zip(y.chunks_exact_mut(b * w)) {
        let mut ys = eighths(yb, e * w);
        for j in 0..e {
            let out = part_rows(&mut ys, [j; 8], w);
            match j > 0 {
                true => {
                    let r = 8 * j;
                    let (a, z) = ([0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1]);
                    let mut at = [r; 15];
                    for (o, d) in at.iter_mut().zip(a) {
                        *o += d;
                    }
                    for (o, d) in at[8..].iter_mut().zip(z) {
                        *o -= d;
                    }
                    let sa = scales::<S, 15>(s, at);
                    lanes::<L, _, _>(out, rows(xb, at, w), |v: [f32; 15]| {
                        let v = times::<S, 15>(v, sa);
                        let [x0, x1, x2, x3, x4, x5, x6, x7, p7, p6, p5, p4, p3, p2, p1] = v;
                        let (y31, q13) = (x3 + x1, p1 + p3);
                        [
                            x0,
                            x4 + p4,
                            x2 + p2,
                            (x6 + x2) + (p2 + p6),
                            x1 + p1,
                            (x5 + x3) + (p3 + p5),
                            y31 + q13,
                            ((x7 + x5) + y31) + (q13 + (p5 + p7)),
                        ]
                    })
                }
                false => {
                    let at = [0, 1, 2, 3, 4, 5, 6, 7];
                    let s0 = scales::<S, 8>(s, at);
                    lanes::<L, _, _>(out, rows(xb, at, w), |v| {
                        unmerge3_first(times::<S, 8>(v, s0))
                    })
                }
            }
        }
    }
}

/// One lane of `unmerge3`'s first j: the block's rows 0..8 to row 0 of each eighth.
#[inline(always)]
fn unmerge3_first([x0, x1, x2, x3, x4, x5, x6, x7]: [f32; 8]) -> [f32; 8] {
    let y31 = x3 + x1;
    [x0, x4, x2, x6 + x2, x1, x5 + x3, y31, (x7 + x5) + y31]
}

/// `unsplit3_at` with b and w constants where they are a 64 x 64 chunk's (`fixed`).
#[inline(always)]
fn unsplit3<const L: usize>(x: &[f32], y: &mut [f32], b: usize, t: [&[f32]; 3], w: usize) {
    match fixed(b, w) {
        true => unsplit3_at::<L>(x, y, 64, t, 64),
        false => unsplit3_at::<L>(x, y, b, t, w),
    }
}

/// `unsplit` at b / 4 on the quarters, at b / 2 on the halves, then at b, in one pass (e = b / 8,
/// t = [t_b, t_{b/2}, t_{b/4}]): for i < e, row i of each of the block's eighths makes its rows i,
/// q - 1 - i, q + i, h - 1 - i, h + i, h + q - 1 - i, h + q + i and b - 1 - i.
#[inline(always)]
fn unsplit3_at<const L: usize>(x: &[f32], y: &mut [f32], b: usize, t: [&[f32]; 3], w: usize) {
    let (h, q, e) = (b / 2, b / 4, b / 8);
    for (xb, yb) in x.chunks_exact(b * w).zip(y.chunks_exact_mut(b * w)) {
        let mut ys = eighths(yb, e * w);
        for i in 0..e {
            let ts = factors3(t, b, i);
            let at = [
                i,
                e + i,
                q + i,
                q + e + i,
                h + i,
                h + e + i,
                h + q + i,
                h + q + e + i,
            ];
            let (ii, jj) = (i, e - 1 - i);
            let out = part_rows(&mut ys, [ii, jj, ii, jj, ii, jj, ii, jj], w);
            lanes::<L, _, _>(out, rows(xb, at, w), |v| unsplit3_lane(v, ts));
        }
    }
}

/// One lane of `unsplit3`: row i of each eighth, in order, to the rows `unsplit3` writes.
#[inline(always)]
fn unsplit3_lane(x: [f32; 8], (t1, t2, t3): ([f32; 4], [f32; 2], f32)) -> [f32; 8] {
    let f = |g: f32, u: f32, t: f32| (g + u * t, g - u * t);
    let [x0, x1, x2, x3, x4, x5, x6, x7] = x;
    let ((ggi, ggk), (gui, guk)) = (f(x0, x1, t3), f(x2, x3, t3));
    let ((ugi, ugk), (uui, uuk)) = (f(x4, x5, t3), f(x6, x7, t3));
    let ((gi, gj), (gk, gl)) = (f(ggi, gui, t2[0]), f(ggk, guk, t2[1]));
    let ((ui, uj), (uk, ul)) = (f(ugi, uui, t2[0]), f(ugk, uuk, t2[1]));
    let ((yi, ybi), (yj, yhi)) = (f(gi, ui, t1[0]), f(gj, uj, t1[1]));
    let ((yk, ybk), (yl, yhl)) = (f(gk, uk, t1[2]), f(gl, ul, t1[3]));
    [yi, yk, yl, yj, yhi, yhl, ybk, ybi]
}

/// o = o + c b, lane by lane, 16 at a time through arrays.
#[inline(always)]
fn add_scaled(o: &mut [f32], b: &[f32], c: f32) {
    const L: usize = 16;
    let w = o.len();
    let b = &b[..w];
    let whole = w / L * L;
    for k in (0..whole).step_by(L) {
        let (x, y): (&mut [f32; L], &[f32; L]) = (
            (&mut o[k..k + L]).try_into().unwrap(),
            b[k..][..L].try_into().unwrap(),
        );
        let s: [f32; L] = std::array::from_fn(|t| x[t] + c * y[t]);
        *x = s;
    }
    for k in whole..w {
        o[k] += c * b[k];
    }
}

/// C_m (or C_m^T) on each block of m rows: row k = the sum from +0 of c(k, i) row i over i ascending.
#[inline(always)]
fn dense(x: &[f32], y: &mut [f32], c: &[f32], m: usize, w: usize, inverse: bool) {
    for (xb, yb) in x.chunks_exact(m * w).zip(y.chunks_exact_mut(m * w)) {
        for (k, out) in yb.chunks_exact_mut(w).enumerate() {
            out.fill(0.0);
            for i in 0..m {
                let ck = if inverse { c[i * m + k] } else { c[k * m + i] };
                add_scaled(out, row(xb, i, w), ck);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The orthonormal DCT-II matrix of size n (row k: frequency k), as torch's norm="ortho", in f64.
    fn dct_matrix(n: usize) -> Vec<f64> {
        let mut d = vec![0.0; n * n];
        for k in 0..n {
            let s = (if k == 0 { 1.0 } else { 2.0 } / n as f64).sqrt();
            for i in 0..n {
                let a = std::f64::consts::PI * (2 * i + 1) as f64 * k as f64 / (2 * n) as f64;
                d[k * n + i] = s * a.cos();
            }
        }
        d
    }

    /// D_r x D_c^T (or D_r^T x D_c) as matrix products in f64.
    fn exact(x: &[f32], r: usize, c: usize, inverse: bool) -> Vec<f64> {
        let (a, b) = (dct_matrix(r), dct_matrix(c));
        let at = |i: usize, k: usize| if inverse { a[k * r + i] } else { a[i * r + k] };
        let bt = |k: usize, j: usize| if inverse { b[k * c + j] } else { b[j * c + k] };
        let mut tmp = vec![0.0f64; r * c];
        for i in 0..r {
            for k in 0..r {
                for j in 0..c {
                    tmp[i * c + j] += at(i, k) * x[k * c + j] as f64;
                }
            }
        }
        let mut y = vec![0.0f64; r * c];
        for i in 0..r {
            for j in 0..c {
                y[i * c + j] = (0..c).map(|k| tmp[i * c + k] * bt(k, j)).sum();
            }
        }
        y
    }

    /// C v (or C^T v) of one vector, written as the recursion of the module's formulas and a scalar at
    /// a time, as the GPU's thread for that vector computes it (`lee` in kernels/reducers.cu).
    fn lee_recursive(v: &[f32], inverse: bool) -> Vec<f32> {
        let (n, d) = (v.len(), Dct::new(v.len()));
        if n % 2 == 1 {
            if n == 1 {
                return v.to_vec();
            }
            let c = |k: usize, i: usize| {
                if inverse {
                    d.dense[i * n + k]
                } else {
                    d.dense[k * n + i]
                }
            };
            let sum = |k: usize| (0..n).fold(0.0f32, |s, i| s + c(k, i) * v[i]);
            return (0..n).map(sum).collect();
        }
        let (h, t) = (n / 2, &d.twiddle[..n / 2]);
        let mut out = vec![0.0f32; n];
        if inverse {
            let g: Vec<f32> = (0..h).map(|k| v[2 * k]).collect();
            let u: Vec<f32> = (0..h)
                .map(|k| {
                    if k == 0 {
                        v[1]
                    } else {
                        v[2 * k + 1] + v[2 * k - 1]
                    }
                })
                .collect();
            let (g, u) = (lee_recursive(&g, true), lee_recursive(&u, true));
            for i in 0..h {
                let w = u[i] * t[i];
                (out[i], out[n - 1 - i]) = (g[i] + w, g[i] - w);
            }
        } else {
            let g: Vec<f32> = (0..h).map(|i| v[i] + v[n - 1 - i]).collect();
            let u: Vec<f32> = (0..h).map(|i| (v[i] - v[n - 1 - i]) * t[i]).collect();
            let (g, u) = (lee_recursive(&g, false), lee_recursive(&u, false));
            for k in 0..h {
                out[2 * k] = g[k];
                out[2 * k + 1] = if k + 1 < h { u[k] + u[k + 1] } else { u[k] };
            }
        }
        out
    }

    /// `lee_recursive` on the vector of d.n floats at stride `stride` in v, in place.
    fn lee_scalar(d: &Dct, v: &mut [f32], stride: usize, inverse: bool) {
        let col: Vec<f32> = (0..d.n).map(|i| v[i * stride]).collect();
        for (i, x) in lee_recursive(&col, inverse).into_iter().enumerate() {
            v[i * stride] = x;
        }
    }

    /// The 2-D transform as the kernels run it: one column, then one row, at a time.
    fn transform_by_vectors(x: &[f32], a: &Dct, b: &Dct, inverse: bool) -> Vec<f32> {
        let (r, c) = (a.n, b.n);
        let mut y = x.to_vec();
        let scale = |y: &mut [f32], s: &[f32], stride: usize| {
            for (i, &s) in s.iter().enumerate() {
                y[i * stride] *= s;
            }
        };
        for j in 0..c {
            if inverse {
                scale(&mut y[j..], &a.scale, c);
            }
            lee_scalar(a, &mut y[j..], c, inverse);
            if !inverse {
                scale(&mut y[j..], &a.scale, c);
            }
        }
        for i in 0..r {
            let row = &mut y[i * c..(i + 1) * c];
            if inverse {
                scale(row, &b.scale, 1);
            }
            lee_scalar(b, row, 1, inverse);
            if !inverse {
                scale(row, &b.scale, 1);
            }
        }
        y
    }

    const SHAPES: [(usize, usize); 9] = [
        (1, 1),
        (3, 4),
        (7, 13),
        (1, 64),
        (64, 64),
        (29, 64),
        (64, 32),
        (48, 16),
        (2, 6),
    ];

    fn block(rng: &mut rand_chacha::ChaCha8Rng, len: usize, kept: usize) -> Vec<f32> {
        let mut x = vec![0.0f32; len];
        for _ in 0..kept {
            x[rng.random_range(0..len)] = rng.random_range(-1.0f32..1.0);
        }
        for _ in 0..kept / 4 {
            x[rng.random_range(0..len)] = if rng.random() { 0.0 } else { -0.0 };
        }
        x
    }

    /// `sparse_inverse` of x (g chunks side by side) into a fresh block, its nonzero entries marked or,
    /// with `every`, all of them.
    fn sparse_inverted(x: &[f32], a: &Dct, b: &Dct, g: usize, every: bool) -> Vec<f32> {
        let w = g * b.n;
        let mut marks = vec![0; mark_words(a.n, w)];
        for (at, v) in x.iter().enumerate() {
            if every || *v != 0.0 {
                mark(&mut marks, at, w);
            }
        }
        let (mut p, mut q) = (x.to_vec(), vec![f32::NAN; x.len()]);
        sparse_inverse(&mut p, &mut q, a, b, g, &marks).to_vec()
    }

    /// The fast transform is the orthonormal DCT: within 2e-6 of the exact f64 product relative to the
    /// block's norm (f32 rounding through the log2(n) levels; the dense f32 product it replaces was
    /// within 1e-6), both ways, on dense and sparse blocks; and the inverse undoes the forward. So is
    /// the inverse of a few kept coefficients (`kept_inverse`), and the inverse as sparse rows
    /// (`sparse_inverse`) is that one bit for bit, its nonzeros marked or every entry.
    #[test]
    fn the_fast_transform_is_the_orthonormal_dct_within_rounding() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for (r, c) in SHAPES {
            let (a, b) = (Dct::new(r), Dct::new(c));
            for kept in [r * c, 32, 3] {
                let x = block(&mut rng, r * c, kept);
                let norm = x
                    .iter()
                    .map(|v| (v * v) as f64)
                    .sum::<f64>()
                    .sqrt()
                    .max(1e-30);
                for inverse in [false, true] {
                    let (fast, want) = (
                        transformed(&x, &a, &b, 1, inverse),
                        exact(&x, r, c, inverse),
                    );
                    let err = fast
                        .iter()
                        .zip(&want)
                        .map(|(&f, &w)| (f as f64 - w).abs())
                        .fold(0.0, f64::max);
                    assert!(err <= 2e-6 * norm, "{r} x {c}, {kept}, {inverse}: {err}");
                }
                let (sparse, want) = (kept_inverted(&x, &a, &b), exact(&x, r, c, true));
                let err = sparse
                    .iter()
                    .zip(&want)
                    .map(|(&f, &w)| (f as f64 - w).abs())
                    .fold(0.0, f64::max);
                assert!(err <= 2e-6 * norm, "{r} x {c}, {kept}: kept inverse {err}");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                for every in [false, true] {
                    let got = sparse_inverted(&x, &a, &b, 1, every);
                    assert_eq!(
                        bits(&got),
                        bits(&sparse),
                        "{r} x {c}, {kept}: sparse, {every}"
                    );
                }
                let back = transformed(&transformed(&x, &a, &b, 1, false), &a, &b, 1, true);
                let err = x
                    .iter()
                    .zip(&back)
                    .map(|(p, q)| (p - q).abs())
                    .fold(0.0, f32::max);
                assert!(err as f64 <= 4e-6 * norm, "{r} x {c}: round trip {err}");
            }
        }
    }

    /// The passes take 16 lanes a step where the vector unit has AVX-512 and 8 elsewhere.
    #[test]
    fn the_lanes_a_step_follow_the_vector_unit() {
        #[cfg(target_arch = "x86_64")]
        let want = if std::arch::is_x86_feature_detected!("avx512f") {
            16
        } else {
            8
        };
        #[cfg(not(target_arch = "x86_64"))]
        let want = 8;
        assert_eq!(lanes_here(), want);
    }

    /// The row-wise transform of g chunks side by side (vectorized across the block's columns, then
    /// across the lanes of the transposed block, at this machine's lanes a step and at 8 and 16) adds and
    /// scales the same floats in the same order as the kernels' thread per vector does for each chunk
    /// alone: bit for bit, both ways, on every chunk shape DeMo makes, one to five chunks at a time,
    /// dense and sparse, zeros of either sign. The inverse as sparse rows of g chunks is each chunk's
    /// `kept_inverse` of its nonzeros, bit for bit.
    #[test]
    fn the_row_wise_transform_equals_the_vector_at_a_time_one_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for (r, c) in SHAPES {
            let (a, b) = (Dct::new(r), Dct::new(c));
            for (g, kept) in [
                (1, r * c),
                (3, r * c / 2),
                (1, 32),
                (5, 128),
                (2, 3),
                (1, 1),
                (4, 0),
            ] {
                let chunks: Vec<Vec<f32>> = (0..g).map(|_| block(&mut rng, r * c, kept)).collect();
                // Chunk j's row i at row i of the block, columns [j c, (j + 1) c).
                let x: Vec<f32> = (0..r)
                    .flat_map(|i| {
                        chunks
                            .iter()
                            .flat_map(move |ch| ch[i * c..(i + 1) * c].to_vec())
                    })
                    .collect();
                let q = sparse_inverted(&x, &a, &b, g, false);
                for (j, ch) in chunks.iter().enumerate() {
                    let got: Vec<f32> = (0..r)
                        .flat_map(|i| q[(i * g + j) * c..(i * g + j + 1) * c].to_vec())
                        .collect();
                    let want = kept_inverted(ch, &a, &b);
                    assert_eq!(bits(&got), bits(&want), "{r} x {c}, {g}: {j}, sparse");
                }
                for (inverse, at) in [false, true]
                    .into_iter()
                    .flat_map(|i| [(i, 0), (i, 8), (i, 16)])
                {
                    let fast = match at {
                        8 => transformed_at::<8>(&x, &a, &b, g, inverse),
                        16 => transformed_at::<16>(&x, &a, &b, g, inverse),
                        _ => transformed(&x, &a, &b, g, inverse),
                    };
                    for (j, ch) in chunks.iter().enumerate() {
                        let slow = transform_by_vectors(ch, &a, &b, inverse);
                        let got: Vec<f32> = (0..r)
                            .flat_map(|i| fast[(i * g + j) * c..(i * g + j + 1) * c].to_vec())
                            .collect();
                        assert_eq!(
                            bits(&got),
                            bits(&slow),
                            "{r} x {c}, {g}: {j}, {kept}, {inverse}, lanes {at}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn each_size_splits_down_to_its_odd_part() {
        for (n, m) in [(1, 1), (64, 1), (48, 3), (29, 29), (6, 3)] {
            let d = Dct::new(n);
            assert_eq!((d.base, d.twiddle.len(), d.dense.len()), (m, n - m, m * m));
            assert_eq!(d.words().len(), n + n - m + m * m + n * n);
        }
    }

    /// The kernels' `dct2` and `kept_inverse` (kernels/reducers.cu, run on the host by
    /// `kernels::emulate` as one block of 256 threads, through its test kernels) give the host
    /// transforms' bits, both ways, for kept coefficients and as sparse rows (`sparse_inverse`), on the
    /// chunk shapes DeMo makes: the GPU
    /// twin checked without a GPU.
    #[test]
    fn the_kernels_transform_gives_the_same_bits() {
        use crate::kernels::emulate::{Arg, Emulator, Source};
        let Some(e) = Emulator::get(Source::Reducers) else {
            return;
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (r, c) in [(64, 64), (29, 64), (48, 16), (1, 64), (6, 12), (7, 13)] {
            let (a, b) = (Dct::new(r), Dct::new(c));
            // Modes: 0 forward, 1 inverse, 2 the inverse of the kept (nonzero) coefficients.
            // 3: the inverse as sparse rows.
            let modes = [
                (r * c, 0),
                (r * c, 1),
                (5, 1),
                (5, 2),
                (r * c / 3, 2),
                (40, 3),
                (r * c / 2, 3),
            ];
            for (kept, mode) in modes {
                let x = block(&mut rng, r * c, kept);
                let (head, tail) = (
                    [Arg::U32(r as u32), Arg::U32(c as u32)],
                    [a.words(), b.words()],
                );
                let (want, got) = match mode {
                    2 => {
                        let (m, k) = message(&x);
                        let (idx, val) = m.split_at(k);
                        let mut args = [
                            vec![
                                Arg::F32s(vec![f32::NAN; r * c]),
                                Arg::F32s(vec![0.0; r * c]),
                            ],
                            head.to_vec(),
                            tail.map(Arg::F32s).to_vec(),
                            vec![
                                Arg::F32s(idx.to_vec()),
                                Arg::F32s(val.to_vec()),
                                Arg::U32(k as u32),
                            ],
                        ]
                        .concat();
                        e.launch("test_kept_inverse", (1, 1), &mut args);
                        (kept_inverted(&x, &a, &b), args[0].f32s().to_vec())
                    }
                    3 => {
                        let mut args = [
                            vec![Arg::F32s(x.clone()), Arg::F32s(vec![f32::NAN; r * c])],
                            head.to_vec(),
                            tail.map(Arg::F32s).to_vec(),
                        ]
                        .concat();
                        e.launch("test_sparse_inverse", (1, 1), &mut args);
                        (kept_inverted(&x, &a, &b), args[1].f32s().to_vec())
                    }
                    _ => {
                        let mut args = [
                            vec![Arg::F32s(x.clone()), Arg::F32s(vec![0.0; r * c])],
                            head.to_vec(),
                            tail.map(Arg::F32s).to_vec(),
                            vec![Arg::U32(mode)],
                        ]
                        .concat();
                        e.launch("test_dct2", (1, 1), &mut args);
                        (
                            transformed(&x, &a, &b, 1, mode == 1),
                            args[0].f32s().to_vec(),
                        )
                    }
                };
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{r} x {c}, mode {mode}, {kept} kept"
                );
            }
        }
    }
}

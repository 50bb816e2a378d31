//! The CPU engine's matrix products: f32 through the gemm crate (the kernels candle's CPU backend
//! uses), and bf16 for mixed precision (`train.amp`): operands rounded to bf16 (round to nearest even),
//! products summed in f32, written to an f32 output.
//!
//! The bf16 product runs on AVX512-BF16's `vdpbf16ps` (two bf16 products summed into each f32 lane,
//! twice the multiply-adds per instruction of an f32 FMA) where the CPU has it. Its twin for every other
//! CPU rounds the operands to bf16 in f32 buffers and multiplies them with the f32 gemm: the same
//! products (a bf16 x bf16 product is exact in f32), summed in another order.

use crate::kernels::gemm::dims;
pub use crate::kernels::gemm::{mm, par, M};
use multiversion::multiversion;
use rayon::prelude::*;
use std::cell::RefCell;

/// The precision of the engine's linear layers and lm head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    /// bf16 operands, f32 sums (mixed precision).
    Bf16,
}

/// How this CPU runs bf16 products: AVX512-BF16's vdpbf16ps, or emulated (operands rounded to bf16 in
/// f32, multiplied by the f32 gemm). The AVX-512 path is a private field that only `detect` sets, after
/// the CPU says it has the instructions: safe code cannot run them on a CPU without them.
///
/// ```compile_fail
/// // The AVX-512 path cannot be made by hand.
/// let path = nanodist::model::matmul::Bf16Path { avx512: true };
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bf16Path {
    avx512: bool,
}

impl Bf16Path {
    /// Operands rounded to bf16 in f32, multiplied by the f32 gemm (any CPU).
    pub const EMULATED: Self = Self { avx512: false };

    /// The fastest path this CPU has.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
        {
            return Self { avx512: true };
        }
        Self::EMULATED
    }

    /// Whether products run on vdpbf16ps.
    pub fn is_avx512(self) -> bool {
        self.avx512
    }
}

impl std::fmt::Display for Bf16Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.avx512 {
            true => "AVX512-BF16 (vdpbf16ps)",
            false => "emulated: operands rounded to bf16, f32 gemm",
        })
    }
}

/// What `train.amp` does on a CPU. bf16 products pay only where vdpbf16ps outruns the f32 FMA: on
/// AMD Zen 4 it does twice the FLOP/s of one (one 512-bit FMA per cycle), on the Intel Xeons of the CI
/// class half (two FMA ports, one for vdpbf16ps). The rate is measured by `rate::peaks` (through the
/// launch environment, `plan::LaunchEnv::detect`) and decided here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CpuAmp {
    /// bf16 linear layers and lm head: vdpbf16ps at `ratio` x the f32 FMA's FLOP/s.
    Bf16 { ratio: f64 },
    /// f32: vdpbf16ps at `ratio` x the f32 FMA's FLOP/s, so bf16 products would be slower.
    Slower { ratio: f64 },
    /// f32: the CPU has no AVX512-BF16.
    Unsupported,
}

/// The least rate of vdpbf16ps over the f32 FMA at which bf16 products run (a bf16 GEMM also packs its
/// operands, so it needs a margin over parity).
const BF16_MIN_RATIO: f64 = 1.3;

impl CpuAmp {
    /// The decision for a CPU whose bf16 products run at `rate` times its f32 FMA's FLOP/s (None: it has
    /// no AVX512-BF16).
    pub fn of(rate: Option<f64>) -> Self {
        match rate {
            Some(ratio) if ratio >= BF16_MIN_RATIO => CpuAmp::Bf16 { ratio },
            Some(ratio) => CpuAmp::Slower { ratio },
            None => CpuAmp::Unsupported,
        }
    }

    /// The precision of the linear layers and lm head under `train.amp = on`.
    pub fn precision(self, on: bool) -> Precision {
        match self {
            CpuAmp::Bf16 { .. } if on => Precision::Bf16,
            _ => Precision::F32,
        }
    }
}

impl std::fmt::Display for CpuAmp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CpuAmp::Bf16 { ratio } => write!(
                f,
                "the linear layers and lm head multiply in bf16 with f32 sums (attention, norms, master \
                 weights and optimizer in f32): this CPU's vdpbf16ps runs at {ratio:.2}x the FLOP/s of \
                 its f32 FMA"
            ),
            CpuAmp::Slower { ratio } => write!(
                f,
                "ignored, training in f32: this CPU's vdpbf16ps runs at {ratio:.2}x the FLOP/s of its f32 \
                 FMA (bf16 products pay from {BF16_MIN_RATIO}x)"
            ),
            CpuAmp::Unsupported => {
                f.write_str("ignored, training in f32: this CPU has no AVX512-BF16")
            }
        }
    }
}

pub mod rate {
    //! The peak rate of AVX512-BF16's dot product (vdpbf16ps: 32 bf16 products summed into 16 f32
    //! lanes) against the f32 FMA (16 products), one core, 24 independent accumulators each (enough to
    //! hide either instruction's latency), in FLOP/s (a product and its sum count 2).

    /// The FLOP/s of vdpbf16ps and of the f32 FMA on one core, the best of 3 interleaved runs of about
    /// a millisecond each; None without AVX512-BF16.
    pub fn peaks() -> Option<(f64, f64)> {
        #[cfg(target_arch = "x86_64")]
        if super::Bf16Path::detect().is_avx512() {
            let time = |f: &dyn Fn() -> f32| {
                let t = std::time::Instant::now();
                std::hint::black_box(f());
                t.elapsed().as_secs_f64()
            };
            let (mut bf, mut fma) = (f64::MAX, f64::MAX);
            for _ in 0..3 {
                // SAFETY: the CPU has AVX512F and AVX512-BF16 (detected above).
                bf = bf.min(time(&|| unsafe { x86::bf16_dot(std::hint::black_box(N)) }));
                // SAFETY: as above.
                fma = fma.min(time(&|| unsafe { x86::f32_fma(std::hint::black_box(N)) }));
            }
            // 64 FLOPs per vdpbf16ps, 32 per FMA.
            let flops = (N * x86::ACC) as f64 * 32.0;
            return Some((2.0 * flops / bf, flops / fma));
        }
        None
    }

    const N: usize = 50_000;

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        pub const ACC: usize = 24;

        #[target_feature(enable = "avx512f,avx512bf16")]
        pub fn bf16_dot(n: usize) -> f32 {
            // 1.0 in bf16 in every lane.
            // SAFETY: 32 x 16-bit lanes reinterpreted as the 32 bf16 of the same 512 bits.
            let a: __m512bh =
                unsafe { std::mem::transmute(_mm512_set1_epi16(std::hint::black_box(0x3f80))) };
            let mut acc = [_mm512_setzero_ps(); ACC];
            for _ in 0..n {
                for x in acc.iter_mut() {
                    *x = _mm512_dpbf16_ps(*x, a, a);
                }
            }
            sum(&acc)
        }

        #[target_feature(enable = "avx512f")]
        fn sum(acc: &[__m512; ACC]) -> f32 {
            _mm512_reduce_add_ps(
                acc.iter()
                    .fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x)),
            )
        }

        #[target_feature(enable = "avx512f")]
        pub fn f32_fma(n: usize) -> f32 {
            let a = _mm512_set1_ps(std::hint::black_box(1.000_000_1));
            let mut acc = [_mm512_setzero_ps(); ACC];
            for _ in 0..n {
                for x in acc.iter_mut() {
                    *x = _mm512_fmadd_ps(*x, a, a);
                }
            }
            sum(&acc)
        }
    }
}

/// f32 -> bf16 bits, round to nearest even (NaN stays a quiet NaN).
#[inline(always)]
pub(crate) fn bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// x rounded to bf16, as f32.
#[inline(always)]
pub(crate) fn round_bf16(x: f32) -> f32 {
    f32::from_bits((bf16(x) as u32) << 16)
}

/// The operands of bf16 products, packed (AVX512-BF16) or rounded (emulated), kept across calls: the lm
/// head's are tens of MB, which allocating per call would fault in each time. They belong to a compute
/// slot's `Scratch`, as the activations do.
#[derive(Default)]
pub struct Bf16Buffers {
    packed: (Vec<u32>, Vec<u32>),
    rounded: (Vec<f32>, Vec<f32>),
}

impl Bf16Buffers {
    /// Bytes they hold now.
    pub fn bytes(&self) -> usize {
        4 * (self.packed.0.capacity()
            + self.packed.1.capacity()
            + self.rounded.0.capacity()
            + self.rounded.1.capacity())
    }
}

/// Bytes of the bf16 operands of the largest products of a forward/backward over `n` tokens of a model
/// of width `c` and vocabulary `vocab`: of each linear layer (the lm head is one of wte) the forward
/// (n, out, in), the weight's gradient (out, in, n) and the input's (n, in, out).
pub fn bf16_bytes(path: Bf16Path, n: usize, c: usize, vocab: usize) -> u64 {
    let layers = [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c), (c, vocab)];
    let (a, b) = layers
        .iter()
        .flat_map(|&(i, o)| [(n, o, i), (o, i, n), (n, i, o)])
        .map(|(m, n, k)| match path.is_avx512() {
            true => {
                let kp = k.div_ceil(2);
                (m.div_ceil(MR) * MR * a_stride(kp), n.div_ceil(NR) * NR * kp)
            }
            false => (m * k, k * n),
        })
        .fold((0, 0), |(a, b), (pa, pb)| (a.max(pa), b.max(pb)));
    4 * (a + b) as u64
}

/// Rows of a micro-tile of the packed GEMM.
const MR: usize = 8;
/// Columns of a micro-tile: two vectors of 16 f32.
const NR: usize = 32;

/// The packed A's row stride for kp pairs along k: a multiple of 256 pairs (1 KB) would map the MR rows a
/// micro-tile reads to the same few L1 sets, so it is padded.
fn a_stride(kp: usize) -> usize {
    kp + if kp.is_multiple_of(256) { 16 } else { 0 }
}

/// The products of the linear layers and lm head, in one precision.
#[derive(Clone, Copy)]
pub(super) struct Products<'a> {
    pub prec: Precision,
    pub path: Bf16Path,
    pub bufs: &'a RefCell<Bf16Buffers>,
}

impl Products<'_> {
    /// out (a.rows x b.cols, row stride `out_rs`) = a b, or += when `acc`.
    pub fn mm(&self, out: &mut [f32], out_rs: usize, a: M, b: M, acc: bool) {
        match self.prec {
            Precision::F32 => mm(out, out_rs, a, b, acc, 1.0, par()),
            Precision::Bf16 => {
                let mut bufs = self.bufs.borrow_mut();
                mm_bf16(self.path, &mut bufs, out, out_rs, a, b, acc)
            }
        }
    }
}

/// out (a.rows x b.cols, row stride `out_rs`) = a b, or += when `acc`, with a and b rounded to bf16.
pub fn mm_bf16(
    path: Bf16Path,
    bufs: &mut Bf16Buffers,
    out: &mut [f32],
    out_rs: usize,
    a: M,
    b: M,
    acc: bool,
) {
    let (m, n, k) = dims(out, out_rs, &a, &b);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !acc {
            out.chunks_mut(out_rs)
                .take(m)
                .for_each(|r| r[..n].fill(0.0));
        }
        return;
    }
    match path.is_avx512() {
        #[cfg(target_arch = "x86_64")]
        true => {
            let (pa, pb) = &mut bufs.packed;
            avx512::gemm(out, out_rs, &a, &b, acc, pa, pb);
        }
        _ => {
            let (ra, rb) = &mut bufs.rounded;
            round_into(ra, &a);
            round_into(rb, &b);
            mm(
                out,
                out_rs,
                M::new(ra, m, k),
                M::new(rb, k, n),
                acc,
                1.0,
                par(),
            );
        }
    }
}

/// `buf` = the rows of `x` rounded to bf16, row-major.
fn round_into(buf: &mut Vec<f32>, x: &M) {
    fit(buf, x.rows * x.cols);
    let cols = x.cols;
    buf.par_chunks_mut(cols * 64)
        .enumerate()
        .for_each(|(blk, rows)| {
            for (r, row) in rows.chunks_mut(cols).enumerate() {
                let i = blk * 64 + r;
                if x.cs == 1 {
                    round_row(row, &x.d[i * x.rs..][..cols]);
                } else {
                    row.iter_mut()
                        .enumerate()
                        .for_each(|(j, o)| *o = round_bf16(x.at(i, j)));
                }
            }
        });
}

#[multiversion(targets = "simd")]
fn round_row(out: &mut [f32], x: &[f32]) {
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = round_bf16(v));
}

/// Two rows interleaved into bf16 pairs: out[j] = (r0[j], r1[j]) (r1 zero when absent).
fn pair_rows(out: &mut [u32], r0: &[f32], r1: Option<&[f32]>) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = bf16(r0[j]) as u32 | (r1.map_or(0, |r| bf16(r[j]) as u32) << 16);
    }
}

/// `len` elements of `d` from `start`, `stride` apart, as bf16 pairs of consecutive elements:
/// out[p] = (x[2p], x[2p + 1]) (zero past the end).
fn pair_along(out: &mut [u32], d: &[f32], start: usize, stride: usize, len: usize) {
    let x = |i: usize| {
        if i < len {
            bf16(d[start + i * stride]) as u32
        } else {
            0
        }
    };
    for (p, o) in out.iter_mut().enumerate() {
        *o = x(2 * p) | x(2 * p + 1) << 16;
    }
}

/// `v` with length `n`, its kept elements as they were (what is read is written first).
fn fit<T: Copy + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.reserve_exact(n - v.len());
        v.resize(n, T::default());
    }
    v.truncate(n);
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The vdpbf16ps GEMM, laid out as BLIS does: B packed into strips of NR columns, A into bf16
    //! pairs along k, an MR x NR micro-kernel keeping its tile of C in registers over KC pairs of k.

    use super::{a_stride, fit, pair_along, pair_rows, M, MR, NR};
    use rayon::prelude::*;
    use std::arch::x86_64::*;

    const _: () = assert!(MC.is_multiple_of(MR) && NC.is_multiple_of(NR));
    /// Pairs of k per block: a B micro-strip of KC x NR pairs (16 KB) stays in L1.
    const KC: usize = 128;
    /// Rows and columns per parallel task.
    const MC: usize = 128;
    const NC: usize = 256;

    /// Where a micro-tile reads its A pairs: pair p of row i at i * is + p * ps.
    #[derive(Clone, Copy)]
    struct APack {
        is: usize,
        ps: usize,
    }

    pub fn gemm(
        out: &mut [f32],
        out_rs: usize,
        a: &M,
        b: &M,
        acc: bool,
        pa: &mut Vec<u32>,
        pb: &mut Vec<u32>,
    ) {
        let (m, n, k) = (a.rows, b.cols, a.cols);
        let kp = k.div_ceil(2);
        let strips = n.div_ceil(NR);
        pack_b(pb, b, kp, strips);
        let ap = pack_a(pa, a, kp);
        let out_len = out.len();
        let c = SendPtr(out.as_mut_ptr());
        let (mb, nb) = (m.div_ceil(MC), n.div_ceil(NC));
        let (pa, pb) = (&pa[..], &pb[..]);
        (0..mb * nb).into_par_iter().for_each(|task| {
            let (ib, jb) = (task / nb, task % nb);
            for p0 in (0..kp).step_by(KC) {
                let kc = KC.min(kp - p0);
                let add = acc || p0 > 0;
                for s in (jb * NC / NR)..((jb + 1) * NC / NR).min(strips) {
                    let bs = &pb[(s * kp + p0) * NR..][..kc * NR];
                    let cols = NR.min(n - s * NR);
                    for i0 in (ib * MC..((ib + 1) * MC).min(m)).step_by(MR) {
                        let rows = MR.min(m - i0);
                        let a0 = i0 * ap.is + p0 * ap.ps;
                        // Rows past m read the zeroed padding of the packed A.
                        assert!(a0 + (MR - 1) * ap.is + (kc - 1) * ap.ps < pa.len());
                        let c0 = i0 * out_rs + s * NR;
                        assert!(c0 + (rows - 1) * out_rs + cols <= out_len);
                        // SAFETY: the asserts above bound every read of pa and write of out; tasks
                        // write disjoint tiles of out; pb's strip holds kc x NR pairs; the CPU has
                        // AVX512-BF16 (only `Bf16Path::detect` makes the path that calls this).
                        unsafe {
                            kernel(
                                kc,
                                pa.as_ptr().add(a0),
                                ap,
                                bs.as_ptr(),
                                c.at(c0),
                                out_rs,
                                rows,
                                cols,
                                add,
                            )
                        };
                    }
                }
            }
        });
    }

    #[derive(Clone, Copy)]
    struct SendPtr(*mut f32);

    impl SendPtr {
        /// # Safety
        /// `off` is inside the slice the pointer came from.
        unsafe fn at(self, off: usize) -> *mut f32 {
            // SAFETY: the caller keeps `off` inside the slice.
            unsafe { self.0.add(off) }
        }
    }
    // SAFETY: the tasks sharing it write disjoint tiles.
    unsafe impl Send for SendPtr {}
    // SAFETY: as for Send.
    unsafe impl Sync for SendPtr {}

    /// B (k x n) as strips of NR columns, each kp pairs x NR (columns past n zero).
    fn pack_b(pb: &mut Vec<u32>, b: &M, kp: usize, strips: usize) {
        let (k, n) = (b.rows, b.cols);
        fit(pb, strips * kp * NR);
        pb.par_chunks_mut(kp * NR)
            .enumerate()
            .for_each(|(s, strip)| {
                let j0 = s * NR;
                let cols = NR.min(n - j0);
                if b.cs == 1 {
                    // Rows of B are contiguous: pair row 2p with row 2p + 1.
                    for (p, out) in strip.chunks_exact_mut(NR).enumerate() {
                        let r0 = &b.d[2 * p * b.rs + j0..][..cols];
                        let r1 = (2 * p + 1 < k).then(|| &b.d[(2 * p + 1) * b.rs + j0..][..cols]);
                        // SAFETY: the CPU has AVX512-BF16 (this module runs only where it does).
                        unsafe { pair_rows_bf16(&mut out[..cols], r0, r1) };
                        out[cols..].fill(0);
                    }
                } else {
                    // Columns of B are contiguous (B = W^T): pair along each column, then scatter.
                    let mut col = vec![0u32; kp];
                    for jj in 0..NR {
                        if jj < cols {
                            // SAFETY: as above.
                            unsafe { pair_along_bf16(&mut col, b.d, (j0 + jj) * b.cs, b.rs, k) };
                        } else {
                            col.fill(0);
                        }
                        for (p, &v) in col.iter().enumerate() {
                            strip[p * NR + jj] = v;
                        }
                    }
                }
            });
    }

    /// A (m x k) as bf16 pairs along k, rows padded to a multiple of MR with zeros.
    fn pack_a(pa: &mut Vec<u32>, a: &M, kp: usize) -> APack {
        let (m, k) = (a.rows, a.cols);
        let mp = m.div_ceil(MR) * MR;
        if a.cs == 1 || a.rs != 1 {
            // Row i's pairs contiguous (the kernel reads none past kp).
            let is = a_stride(kp);
            fit(pa, mp * is);
            pa.par_chunks_mut(is * MR)
                .enumerate()
                .for_each(|(blk, rows)| {
                    for (r, out) in rows.chunks_mut(is).enumerate() {
                        let i = blk * MR + r;
                        if i < m {
                            // SAFETY: the CPU has AVX512-BF16.
                            unsafe { pair_along_bf16(&mut out[..kp], a.d, i * a.rs, a.cs, k) };
                        } else {
                            out[..kp].fill(0);
                        }
                    }
                });
            APack { is, ps: 1 }
        } else {
            // Columns of A contiguous (A = X^T): pair p holds rows 2p and 2p + 1 of X, for every i.
            fit(pa, kp * mp);
            pa.par_chunks_mut(mp).enumerate().for_each(|(p, out)| {
                let r0 = &a.d[2 * p * a.cs..][..m];
                let r1 = (2 * p + 1 < k).then(|| &a.d[(2 * p + 1) * a.cs..][..m]);
                // SAFETY: the CPU has AVX512-BF16.
                unsafe { pair_rows_bf16(&mut out[..m], r0, r1) };
                out[m..].fill(0);
            });
            APack { is: 1, ps: mp }
        }
    }

    /// `pair_rows` 16 pairs per conversion (vcvtneps2bf16 rounds to nearest even as `bf16` does, and
    /// reads f32 subnormals as zero, as vdpbf16ps reads bf16 ones). Panics unless `r0` and `r1` hold
    /// `out.len()` elements or more (the vector loads read 16 of them at a time).
    ///
    /// # Safety
    /// The CPU has AVX512F and AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn pair_rows_bf16(out: &mut [u32], r0: &[f32], r1: Option<&[f32]>) {
        let n = out.len();
        assert!(
            r0.len() >= n && r1.is_none_or(|r| r.len() >= n),
            "rows shorter than out"
        );
        let full = n / 16 * 16;
        let widen = |x: &[f32], j: usize| {
            // SAFETY: j + 16 <= full <= n <= x.len() (asserted above), so the load stays inside x; the
            // transmute reinterprets 16 bf16 (256 bits) as the integer vector of the same width.
            let h: __m256i = unsafe {
                std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(x[j..].as_ptr())))
            };
            _mm512_cvtepu16_epi32(h)
        };
        for j in (0..full).step_by(16) {
            let mut v = widen(r0, j);
            if let Some(r1) = r1 {
                v = _mm512_or_si512(v, _mm512_slli_epi32::<16>(widen(r1, j)));
            }
            // SAFETY: j + 16 <= full <= out.len(): the 16 lanes stored stay inside out.
            unsafe { _mm512_storeu_si512(out[j..].as_mut_ptr() as *mut _, v) };
        }
        pair_rows(&mut out[full..], &r0[full..], r1.map(|r| &r[full..]));
    }

    /// `pair_along`, 16 pairs per conversion where the elements are contiguous (see `pair_rows_bf16`).
    /// Panics unless `d` holds `len` elements from `start` and `out` holds `len / 2` pairs or more.
    ///
    /// # Safety
    /// The CPU has AVX512F and AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn pair_along_bf16(out: &mut [u32], d: &[f32], start: usize, stride: usize, len: usize) {
        if stride != 1 {
            return pair_along(out, d, start, stride, len);
        }
        let x = &d[start..][..len];
        assert!(
            out.len() >= len / 2,
            "{} pairs for {len} elements",
            out.len()
        );
        let full = len / 32 * 32;
        for c in (0..full).step_by(32) {
            // SAFETY: c + 32 <= full <= len = x.len(): both 16-element loads stay inside x, and the
            // 16 u32 stored at c / 2 end at (c + 32) / 2 <= len / 2 <= out.len() (asserted above); the
            // transmute reinterprets 32 bf16 (512 bits) as the integer vector of the same width.
            unsafe {
                let lo = _mm512_loadu_ps(x[c..].as_ptr());
                let hi = _mm512_loadu_ps(x[c + 16..].as_ptr());
                let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_si512(out[c / 2..].as_mut_ptr() as *mut _, v);
            }
        }
        pair_along(&mut out[full / 2..], x, full, 1, len - full);
    }

    /// C[rows x cols] (row stride c_rs) = (or += when `add`) the MR x NR tile of A B over kc pairs.
    ///
    /// # Safety
    /// The CPU has AVX512F and AVX512-BF16; `a` has MR rows of kc pairs at `ap`'s strides, `b` kc x NR
    /// pairs, `c` rows x cols at stride c_rs, rows <= MR, cols <= NR.
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn kernel(
        kc: usize,
        a: *const u32,
        ap: APack,
        b: *const u32,
        c: *mut f32,
        c_rs: usize,
        rows: usize,
        cols: usize,
        add: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        for p in 0..kc {
            // SAFETY: b holds kc x NR pairs, so pair row p's 2 x 16 u32 are inside it; a holds MR rows of
            // kc pairs at ap's strides, so pair p of each row i < MR is inside it (the caller's contract);
            // the transmutes reinterpret 32 x 16-bit lanes as the 32 bf16 of the same 512 bits.
            unsafe {
                let bp = b.add(p * NR);
                let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp as *const _));
                let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(16) as *const _));
                let ar = a.add(p * ap.ps);
                for (i, acc) in acc.iter_mut().enumerate() {
                    let av: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*ar.add(i * ap.is) as i32));
                    acc[0] = _mm512_dpbf16_ps(acc[0], b0, av);
                    acc[1] = _mm512_dpbf16_ps(acc[1], b1, av);
                }
            }
        }
        let masks = [mask(cols.min(16)), mask(cols.saturating_sub(16))];
        for (i, acc) in acc.iter().enumerate().take(rows) {
            for v in 0..2 {
                let k = masks[v];
                if k == 0 {
                    continue;
                }
                // SAFETY: row i < rows and the masked lanes 16 v .. 16 v + (cols - 16 v) < cols are inside
                // c's rows x cols at stride c_rs (the caller's contract); masked-off lanes are not touched.
                unsafe {
                    let dst = c.add(i * c_rs + 16 * v);
                    let val = if add {
                        _mm512_add_ps(_mm512_maskz_loadu_ps(k, dst), acc[v])
                    } else {
                        acc[v]
                    };
                    _mm512_mask_storeu_ps(dst, k, val);
                }
            }
        }
    }

    fn mask(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
            })
            .collect()
    }

    fn paths() -> Vec<Bf16Path> {
        let mut p = vec![Bf16Path::EMULATED];
        if Bf16Path::detect().is_avx512() {
            p.push(Bf16Path::detect());
        }
        p
    }

    /// half's conversion (round to nearest even, quiet NaNs) is the oracle of `bf16`.
    #[test]
    fn bf16_rounds_as_half_does() {
        let mut xs = values(1 << 16, 3);
        xs.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::from_bits(0x3f80_8000), // a tie: rounds to even (down)
            f32::from_bits(0x3f81_8000), // a tie: rounds to even (up)
            f32::from_bits(0x7f7f_ffff), // rounds to infinity
        ]);
        xs.extend(
            (0..1u32 << 16).map(|i| f32::from_bits(i.wrapping_mul(65_537).wrapping_add(0x1234))),
        );
        for x in xs {
            let want = half::bf16::from_f32(x).to_bits();
            if x.is_nan() {
                assert!(f32::from_bits((bf16(x) as u32) << 16).is_nan(), "{x}");
            } else {
                assert_eq!(bf16(x), want, "{x} ({:#x})", x.to_bits());
            }
        }
    }

    /// The operand views of the engine's products: row-major, transposed (W^T, X^T), and general strides.
    fn view<'a>(d: &'a [f32], rows: usize, cols: usize, layout: usize) -> M<'a> {
        match layout {
            0 => M::new(d, rows, cols),
            1 => M::new(d, cols, rows).t(),
            _ => M {
                d,
                rows,
                cols,
                rs: 2 * cols + 1,
                cs: 2,
            },
        }
    }

    /// Every path's product is the product of the operands rounded to bf16, summed in f64, within the
    /// rounding of an f32 sum of k terms; and it is not the product of the unrounded operands.
    #[test]
    fn bf16_products_are_those_of_the_rounded_operands() {
        let mut bufs = Bf16Buffers::default();
        let mut rounding_seen = false;
        for (m, n, k) in [
            (1, 1, 1),
            (3, 5, 2),
            (8, 32, 7),
            (9, 33, 64),
            (17, 70, 129),
            (130, 260, 257),
            (40, 300, 300),
        ] {
            for (la, lb) in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 2), (0, 2), (2, 1)] {
                let ad = values(m * k * 3 + 2 * k + 2, (m * n) as u64);
                let bd = values(k * n * 3 + 2 * n + 2, (n * k + 1) as u64);
                let (a, b) = (view(&ad, m, k, la), view(&bd, k, n, lb));
                for acc in [false, true] {
                    let rs = n + 3;
                    let init = values(m * rs, 9);
                    let mut want = vec![0.0f64; m * n];
                    let mut bound = vec![0.0f64; m * n];
                    let mut exact = vec![0.0f64; m * n];
                    for i in 0..m {
                        for j in 0..n {
                            let c0 = if acc { init[i * rs + j] as f64 } else { 0.0 };
                            let (mut s, mut e, mut abs) = (c0, c0, c0.abs());
                            for p in 0..k {
                                let (x, y) = (a.at(i, p), b.at(p, j));
                                let r = round_bf16(x) as f64 * round_bf16(y) as f64;
                                s += r;
                                abs += r.abs();
                                e += x as f64 * y as f64;
                            }
                            want[i * n + j] = s;
                            bound[i * n + j] = (k + 2) as f64 * f32::EPSILON as f64 * abs;
                            exact[i * n + j] = e;
                        }
                    }
                    for path in paths() {
                        let mut out = init.clone();
                        mm_bf16(path, &mut bufs, &mut out, rs, a, b, acc);
                        for i in 0..m {
                            for j in 0..n {
                                let (got, w) = (out[i * rs + j] as f64, want[i * n + j]);
                                assert!(
                                    (got - w).abs() <= bound[i * n + j],
                                    "{path:?} {m}x{n}x{k} layouts {la}{lb} acc {acc} [{i},{j}]: {got} vs {w}"
                                );
                                rounding_seen |= (got - exact[i * n + j]).abs() > bound[i * n + j];
                            }
                            // Past the n columns of each row: untouched.
                            assert_eq!(out[i * rs + n..][..3], init[i * rs + n..][..3]);
                        }
                    }
                }
            }
        }
        assert!(rounding_seen, "the operands were not rounded to bf16");
    }

    /// The rate probe times real instructions (an optimized-away loop once made it read 2.00 anywhere):
    /// one core's FLOP/s are within what a core can do.
    #[test]
    fn the_rate_probe_measures_instructions() {
        if let Some((bf16, fma)) = rate::peaks() {
            for f in [bf16, fma] {
                assert!((1e9..2e12).contains(&f), "{bf16} and {fma} FLOP/s");
            }
        }
    }

    /// k = 0: an empty sum, so out = 0 (or stays when accumulating).
    #[test]
    fn an_empty_inner_dimension_gives_zeros() {
        for path in paths() {
            let mut out = vec![5.0f32; 6];
            let a = M::new(&[], 2, 0);
            let b = M::new(&[], 0, 3);
            mm_bf16(path, &mut Bf16Buffers::default(), &mut out, 3, a, b, true);
            assert_eq!(out, [5.0; 6]);
            mm_bf16(path, &mut Bf16Buffers::default(), &mut out, 3, a, b, false);
            assert_eq!(out, [0.0; 6]);
        }
    }

    /// The result does not depend on the thread count (the k blocks are summed in one order).
    #[test]
    fn bf16_products_do_not_depend_on_the_thread_count() {
        let (m, n, k) = (300, 200, 700);
        let (ad, bd) = (values(m * k, 1), values(k * n, 2));
        for path in paths() {
            let runs: Vec<Vec<f32>> = [1, 2, 3]
                .into_iter()
                .map(|threads| {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    pool.install(|| {
                        let mut out = vec![0.0f32; m * n];
                        let (a, b) = (M::new(&ad, m, k), M::new(&bd, n, k).t());
                        mm_bf16(path, &mut Bf16Buffers::default(), &mut out, n, a, b, false);
                        out
                    })
                })
                .collect();
            assert!(runs.windows(2).all(|w| w[0] == w[1]), "{path:?}");
        }
    }
}

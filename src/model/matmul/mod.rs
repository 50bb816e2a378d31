//! The CPU engine's matrix products: f32 through the gemm crate (the kernels candle's CPU backend
//! uses), and bf16 for mixed precision (`train.amp`): operands rounded to bf16 (round to nearest even),
//! products summed in f32, written to an f32 output.
//!
//! The bf16 product runs on AMX tiles (`amx`: `tdpbf16ps`, 16 x 16 x 32 products an instruction) where
//! the CPU has them, else on AVX512-BF16's `vdpbf16ps` (`avx512`: two bf16 products summed into each f32
//! lane, twice the multiply-adds per instruction of an f32 FMA). Its twin for every other CPU rounds the
//! operands to bf16 in f32 buffers and multiplies them with the f32 gemm: the same products (a bf16 x
//! bf16 product is exact in f32), summed in another order.

use crate::kernels::amx::Amx;
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

/// How this CPU runs bf16 products: AMX tiles (`tdpbf16ps`, 16 x 16 x 32 products an instruction),
/// AVX512-BF16's vdpbf16ps, or emulated (operands rounded to bf16 in f32, multiplied by the f32 gemm).
/// The hardware paths are a private field that only `detect` and `available` set, after the CPU (and for
/// AMX the kernel) says they can run: safe code cannot run them on a CPU without them.
///
/// ```compile_fail
/// // A hardware path cannot be made by hand.
/// let path = nanodist::model::matmul::Bf16Path { unit: Default::default() };
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bf16Path {
    unit: Unit,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    Emulated,
    Avx512,
    Amx(Amx),
}

impl Bf16Path {
    /// Operands rounded to bf16 in f32, multiplied by the f32 gemm (any CPU).
    pub const EMULATED: Self = Self {
        unit: Unit::Emulated,
    };

    /// The fastest path this CPU has: AMX, else vdpbf16ps, else emulated.
    pub fn detect() -> Self {
        *Self::available().last().unwrap_or(&Self::EMULATED)
    }

    /// Every path this CPU runs, slowest first (emulated, then vdpbf16ps and AMX where it has them).
    pub fn available() -> Vec<Self> {
        let mut paths = vec![Self::EMULATED];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
        {
            paths.push(Self { unit: Unit::Avx512 });
            // The AMX GEMM packs its operands with the AVX-512 conversions.
            if let Some(amx) = Amx::get() {
                paths.push(Self {
                    unit: Unit::Amx(amx),
                });
            }
        }
        paths
    }

    /// Whether products run on bf16 hardware (AMX or vdpbf16ps), packing their operands.
    pub fn is_hardware(self) -> bool {
        self.unit != Unit::Emulated
    }

    /// Whether products run on AMX tiles.
    pub fn is_amx(self) -> bool {
        matches!(self.unit, Unit::Amx(_))
    }
}

impl std::fmt::Display for Bf16Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.unit {
            Unit::Amx(_) => "AMX tiles (tdpbf16ps)",
            Unit::Avx512 => "AVX512-BF16 (vdpbf16ps)",
            Unit::Emulated => "emulated: operands rounded to bf16, f32 gemm",
        })
    }
}

/// What `train.amp` does on a CPU. bf16 products pay only where the CPU's bf16 instruction outruns the
/// f32 FMA: on AMD Zen 4 vdpbf16ps does twice the FLOP/s of one (one 512-bit FMA per cycle), on the Intel
/// Xeons of the CI class half (two FMA ports, one for vdpbf16ps), but there AMX's tdpbf16ps does many
/// times more. The rate of the fastest path (`Bf16Path::detect`) is measured by `rate::peaks` (through
/// the launch environment, `plan::LaunchEnv::detect`) and decided here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CpuAmp {
    /// bf16 linear layers and lm head: bf16 products at `ratio` x the f32 FMA's FLOP/s.
    Bf16 { ratio: f64 },
    /// f32: bf16 products at `ratio` x the f32 FMA's FLOP/s, so they would be slower.
    Slower { ratio: f64 },
    /// f32: the CPU has no AVX512-BF16.
    Unsupported,
}

/// The least rate of bf16 products over the f32 FMA at which bf16 products run (a bf16 GEMM also packs its
/// operands, so it needs a margin over parity).
const BF16_MIN_RATIO: f64 = 1.3;

/// The instructions `rate::peaks` measures.
const BF16_UNITS: &str = "AMX's tdpbf16ps where it has AMX, else vdpbf16ps";

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
                "the linear layers, attention products and lm head multiply in bf16 with f32 sums \
                 (norms, master weights and optimizer in f32): this CPU's bf16 products \
                 ({BF16_UNITS}) run at {ratio:.2}x the FLOP/s of its f32 FMA"
            ),
            CpuAmp::Slower { ratio } => write!(
                f,
                "ignored, training in f32: this CPU's bf16 products ({BF16_UNITS}) run at {ratio:.2}x \
                 the FLOP/s of its f32 FMA (they pay from {BF16_MIN_RATIO}x)"
            ),
            CpuAmp::Unsupported => {
                f.write_str("ignored, training in f32: this CPU has no AVX512-BF16")
            }
        }
    }
}

pub mod rate {
    //! The peak rate of the CPU's fastest bf16 product against the f32 FMA (16 products), one core, in
    //! FLOP/s (a product and its sum count 2): AMX's tdpbf16ps (`kernels::amx::Amx::peak`) where the CPU
    //! has AMX, else AVX512-BF16's dot product (vdpbf16ps: 32 bf16 products summed into 16 f32 lanes), 24
    //! independent accumulators for each vector instruction (enough to hide its latency).

    /// The FLOP/s of the fastest bf16 path (`Bf16Path::detect`) and of the f32 FMA on one core, the
    /// best of 3 runs of about a millisecond each; None without AVX512-BF16.
    pub fn peaks() -> Option<(f64, f64)> {
        #[cfg(target_arch = "x86_64")]
        if super::Bf16Path::detect().is_hardware() {
            let time = |f: &dyn Fn() -> f32| {
                let t = std::time::Instant::now();
                std::hint::black_box(f());
                t.elapsed().as_secs_f64()
            };
            let amx = match super::Bf16Path::detect().unit {
                super::Unit::Amx(amx) => Some(amx),
                _ => None,
            };
            let (mut bf, mut fma) = (f64::MAX, f64::MAX);
            for _ in 0..3 {
                if amx.is_none() {
                    // SAFETY: the CPU has AVX512F and AVX512-BF16 (a hardware path is detected above).
                    bf = bf.min(time(&|| unsafe { x86::bf16_dot(std::hint::black_box(N)) }));
                }
                // SAFETY: as above.
                fma = fma.min(time(&|| unsafe { x86::f32_fma(std::hint::black_box(N)) }));
            }
            // 64 FLOPs per vdpbf16ps, 32 per FMA.
            let flops = (N * x86::ACC) as f64 * 32.0;
            let bf16 = amx.map_or(2.0 * flops / bf, |amx| amx.peak());
            return Some((bf16, flops / fma));
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
    packed: (Lines, Lines),
    rounded: (Vec<f32>, Vec<f32>),
}

impl Bf16Buffers {
    /// Bytes they hold now.
    pub fn bytes(&self) -> usize {
        4 * (self.packed.0.v.capacity()
            + self.packed.1.v.capacity()
            + self.rounded.0.capacity()
            + self.rounded.1.capacity())
    }
}

/// Words of a packed operand whose slice starts on a 64-byte cache line. The packed rows are whole lines
/// (16 words a tile row or vector), so each then lies in one line; from the allocator's 16-byte alignment
/// every one straddles two, and AMX's tile loads ran at half the rate (2048 squares on one core: 403-478
/// GFLOP/s in the tiles, 766-850 aligned).
#[derive(Default)]
struct Lines {
    v: Vec<u32>,
    len: usize,
}

/// u32 words in a cache line.
const LINE: usize = 16;

impl Lines {
    /// `n` words from a line's start (holding what the last use left, or zeros: what is read is
    /// written first). The buffer only grows: consecutive products of different sizes would otherwise
    /// zero the words between them again at each call (about 120 MB a step of the medium config).
    fn fit(&mut self, n: usize) -> &mut [u32] {
        let want = n + LINE - 1;
        if self.v.len() < want {
            self.v.reserve_exact(want - self.v.len());
            self.v.resize(want, 0);
        }
        self.len = n;
        let at = self.start();
        &mut self.v[at..at + n]
    }

    /// The words of the last `fit`.
    fn words(&self) -> &[u32] {
        let at = self.start();
        &self.v[at..][..self.len]
    }

    /// Words from the buffer's start to the first line boundary in it (0 when empty).
    fn start(&self) -> usize {
        match self.v.is_empty() {
            true => 0,
            false => (self.v.as_ptr() as usize).wrapping_neg() % (4 * LINE) / 4,
        }
    }
}

/// Bytes of the bf16 operands of the largest products of a forward/backward over `n` tokens of a model
/// of width `c` and vocabulary `vocab`: of each linear layer (the lm head is one of wte) the forward
/// (n, out, in), the weight's gradient (out, in, n) and the input's (n, in, out).
pub fn bf16_bytes(path: Bf16Path, n: usize, c: usize, vocab: usize) -> u64 {
    let layers = [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c), (c, vocab)];
    let (a, b, s) = layers
        .iter()
        .flat_map(|&(i, o)| [(n, o, i), (o, i, n), (n, i, o)])
        .map(|(m, n, k)| match path.unit {
            #[cfg(target_arch = "x86_64")]
            Unit::Amx(_) => line_slack(amx::words(m, n, k)),
            Unit::Avx512 => {
                let kp = k.div_ceil(2);
                line_slack((
                    m.div_ceil(MR) * MR * a_stride(kp),
                    n.div_ceil(NR) * NR * kp,
                    0,
                ))
            }
            _ => (m * k, k * n, 0),
        })
        .fold((0, 0, 0), |(a, b, s), (pa, pb, ps)| {
            (a.max(pa), b.max(pb), s.max(ps))
        });
    4 * (a + b + s) as u64
}

/// The words of packed buffers (`Lines`) of these sizes: up to a line's less one before the first.
fn line_slack((a, b, s): (usize, usize, usize)) -> (usize, usize, usize) {
    let slack = |w: usize| if w == 0 { 0 } else { w + LINE - 1 };
    (slack(a), slack(b), slack(s))
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
    /// Whether bf16 products' operands that only they read are stored in bf16 (`stores_bf16`);
    /// stored in f32, they are rounded as they are packed, to the same bits.
    pub half: bool,
}

impl Products<'_> {
    /// out (a.rows x b.cols, row stride `out_rs`) = a b, or += when `acc`.
    pub fn mm(&self, out: &mut [f32], out_rs: usize, a: M, b: M, acc: bool) {
        self.mm_ops(out, out_rs, Op::F32(a), Op::F32(b), acc);
    }

    /// `mm` of operands that may be stored in bf16 already (`Products::stores_bf16`).
    ///
    /// Panics on a bf16 operand of f32 products: the layers store their outputs in bf16 only for bf16
    /// products.
    pub fn mm_ops(&self, out: &mut [f32], out_rs: usize, a: Op, b: Op, acc: bool) {
        match (self.prec, a, b) {
            (Precision::F32, Op::F32(a), Op::F32(b)) => mm(out, out_rs, a, b, acc, 1.0, par()),
            (Precision::F32, ..) => panic!("a bf16 operand of an f32 product"),
            (Precision::Bf16, ..) => {
                let mut bufs = self.bufs.borrow_mut();
                mm_bf16_ops(self.path, &mut bufs, out, out_rs, a, b, acc)
            }
        }
    }

    /// Whether the outputs that only these products read are stored in bf16 (`to_bf16`): under bf16
    /// products, whose packing would round them to the same bits.
    pub fn stores_bf16(&self) -> bool {
        self.prec == Precision::Bf16 && self.half
    }
}

/// A row-major matrix of bf16 values (their bits), as the layers store the outputs that only bf16
/// products read (`to_bf16`): the products pack them as they are, where an f32 operand is rounded first.
#[derive(Clone, Copy)]
pub struct Rows16<'a> {
    pub d: &'a [u16],
    pub rows: usize,
    pub cols: usize,
}

impl<'a> Rows16<'a> {
    pub fn new(d: &'a [u16], rows: usize, cols: usize) -> Self {
        Self { d, rows, cols }
    }

    /// Row i's elements.
    fn row(&self, i: usize) -> &'a [u16] {
        &self.d[i * self.cols..][..self.cols]
    }
}

/// An operand of a bf16 product: f32 (rounded to bf16 as it is packed), or bf16 already: rows, or the
/// transpose of rows (a weight gradient's dy^T).
#[derive(Clone, Copy)]
pub enum Op<'a> {
    F32(M<'a>),
    Bf16(Rows16<'a>),
    Bf16T(Rows16<'a>),
}

impl Op<'_> {
    fn rows(&self) -> usize {
        match self {
            Op::F32(m) => m.rows,
            Op::Bf16(h) => h.rows,
            Op::Bf16T(h) => h.cols,
        }
    }

    fn cols(&self) -> usize {
        match self {
            Op::F32(m) => m.cols,
            Op::Bf16(h) => h.cols,
            Op::Bf16T(h) => h.rows,
        }
    }

    /// The last element it reads is inside its slice.
    fn fits(&self) -> bool {
        match self {
            Op::F32(m) => m.fits(m.d.len()),
            Op::Bf16(h) | Op::Bf16T(h) => h.rows * h.cols <= h.d.len(),
        }
    }
}

/// bf16 bits widened to the f32 of the same value (exact).
fn widen(v: u16) -> f32 {
    f32::from_bits((v as u32) << 16)
}

/// The f32 values of bf16 rows, row-major.
fn widened(h: &Rows16) -> Vec<f32> {
    h.d[..h.rows * h.cols].iter().map(|&v| widen(v)).collect()
}

/// `out` = `x` rounded to bf16 (their bits) as `path`'s packing rounds an f32 operand: round to nearest
/// even, and on the bf16 hardware paths (vcvtneps2bf16) f32 subnormals read as zero, as vdpbf16ps and
/// tdpbf16ps read bf16 ones. The products of what it stores are then those of `x`, bit for bit.
///
/// Panics unless `out` and `x` have the same length.
pub fn to_bf16(path: Bf16Path, x: &[f32], out: &mut [u16]) {
    assert_eq!(x.len(), out.len(), "bf16 copy of another length");
    match path.unit {
        #[cfg(target_arch = "x86_64")]
        Unit::Avx512 | Unit::Amx(_) => avx512::to_bf16(x, out),
        _ => out.iter_mut().zip(x).for_each(|(o, &v)| *o = bf16(v)),
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
    mm_bf16_ops(path, bufs, out, out_rs, Op::F32(a), Op::F32(b), acc);
}

/// `mm_bf16` of operands that may be stored in bf16 already (`Op`).
pub fn mm_bf16_ops(
    path: Bf16Path,
    bufs: &mut Bf16Buffers,
    out: &mut [f32],
    out_rs: usize,
    a: Op,
    b: Op,
    acc: bool,
) {
    let (m, n, k) = (a.rows(), b.cols(), a.cols());
    assert_eq!(k, b.rows(), "inner dimensions");
    assert!(
        a.fits() && b.fits() && M::strided(out, m, n, out_rs).fits(out.len()),
        "matmul operand out of bounds"
    );
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
    match path.unit {
        #[cfg(target_arch = "x86_64")]
        Unit::Amx(amx) => amx::gemm(amx, out, out_rs, &a, &b, acc, bufs),
        #[cfg(target_arch = "x86_64")]
        Unit::Avx512 => {
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

/// B's packed strips as a product reads them: strip s from word `s stride + from`, its first `cols`
/// columns.
struct Strips<'a> {
    words: &'a [u32],
    stride: usize,
    from: usize,
    cols: usize,
}

/// A B operand packed once for several products, each over a part of it: rows (k) from a multiple of 32
/// and its first columns (attention packs a head's keys and values once, and each block of rows reads
/// them up to its diagonal). The products are those `mm_bf16` gives for the same parts.
#[derive(Default)]
pub struct PackedB {
    words: Lines,
    rounded: Vec<f32>,
    /// The path that packed it, B's (rows, cols), its pairs per strip, and where B was (what `holds`
    /// compares).
    path: Option<Bf16Path>,
    dims: (usize, usize),
    kq: usize,
    from: (usize, usize, usize, usize),
}

impl PackedB {
    /// b packed for `path`'s products.
    pub fn pack(&mut self, path: Bf16Path, b: M) {
        let (k, n) = (b.rows, b.cols);
        let strips = n.div_ceil(NR);
        self.kq = match path.unit {
            #[cfg(target_arch = "x86_64")]
            Unit::Amx(_) => {
                let (kp, kq) = amx::pairs(k);
                avx512::pack_b(&mut self.words, &Op::F32(b), kp, kq, strips);
                kq
            }
            #[cfg(target_arch = "x86_64")]
            Unit::Avx512 => {
                let kp = k.div_ceil(2);
                avx512::pack_b(&mut self.words, &Op::F32(b), kp, kp, strips);
                kp
            }
            _ => {
                round_into(&mut self.rounded, &Op::F32(b));
                0
            }
        };
        (self.path, self.dims, self.from) = (Some(path), (k, n), Self::key(&b));
    }

    /// Whether it holds `b` as packed last (the same elements of the same slice).
    pub fn holds(&self, b: &M) -> bool {
        self.path.is_some() && self.from == Self::key(b) && self.dims == (b.rows, b.cols)
    }

    fn key(b: &M) -> (usize, usize, usize, usize) {
        (b.d.as_ptr() as usize, b.d.len(), b.rs, b.cs)
    }
}

/// out (a.rows x n, row stride `out_rs`) = a times rows k0 .. k0 + a.cols of `b` and its first n
/// columns, with a rounded to bf16: `mm_bf16` of that part of b, from b packed once.
///
/// Panics unless `path` packed b, k0 is a multiple of 32 and the part lies inside b.
pub fn mm_bf16_packed(
    path: Bf16Path,
    bufs: &mut Bf16Buffers,
    out: &mut [f32],
    out_rs: usize,
    a: M,
    (b, k0, n): (&PackedB, usize, usize),
) {
    let (m, k) = (a.rows, a.cols);
    assert_eq!(b.path, Some(path), "a B packed for another path");
    assert!(
        k0.is_multiple_of(32) && k0 + k <= b.dims.0 && n <= b.dims.1,
        "part of a packed B past its edge"
    );
    assert!(
        a.fits(a.d.len()) && M::strided(out, m, n, out_rs).fits(out.len()),
        "matmul operand out of bounds"
    );
    if m == 0 || n == 0 || k == 0 {
        out.chunks_mut(out_rs)
            .take(m)
            .for_each(|r| r[..n].fill(0.0));
        return;
    }
    let strips = Strips {
        words: b.words.words(),
        stride: b.kq * NR,
        from: k0 / 2 * NR,
        cols: n,
    };
    match path.unit {
        #[cfg(target_arch = "x86_64")]
        Unit::Amx(amx) => amx::gemm_packed(amx, out, out_rs, &a, strips, bufs),
        #[cfg(target_arch = "x86_64")]
        Unit::Avx512 => avx512::gemm_packed(out, out_rs, &a, strips, &mut bufs.packed.0),
        // B's part, already rounded, rounds to itself: `mm_bf16` lays it out as for the unpacked part.
        _ => {
            let part = M::new(&b.rounded, b.dims.0, b.dims.1).part(k0, k, n);
            mm_bf16(path, bufs, out, out_rs, a, part, false);
        }
    }
}

/// `buf` = the rows of `x` rounded to bf16, row-major (bf16 values widened, which is exact).
fn round_into(buf: &mut Vec<f32>, x: &Op) {
    let x = match x {
        Op::F32(x) => x,
        Op::Bf16(h) => {
            fit(buf, h.rows * h.cols);
            buf.par_chunks_mut(1 << 14)
                .zip(h.d[..h.rows * h.cols].par_chunks(1 << 14))
                .for_each(|(o, v)| o.iter_mut().zip(v).for_each(|(o, &v)| *o = widen(v)));
            return;
        }
        Op::Bf16T(h) => {
            fit(buf, h.rows * h.cols);
            buf.par_chunks_mut(h.rows).enumerate().for_each(|(j, o)| {
                o.iter_mut()
                    .enumerate()
                    .for_each(|(i, o)| *o = widen(h.d[i * h.cols + j]))
            });
            return;
        }
    };
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
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(test)]
mod tests {
    use super::*;

    /// A packed operand starts on a 64-byte line and holds the words asked for, through every growth
    /// and shrink of its buffer.
    #[test]
    fn packed_operands_start_on_a_cache_line() {
        let mut lines = Lines::default();
        assert!(lines.words().is_empty());
        for n in [1, 15, 16, 17, 1000, 100_003, 7, 250_000] {
            let w = lines.fit(n);
            assert_eq!((w.len(), w.as_ptr() as usize % 64), (n, 0), "{n} words");
            w.fill(n as u32);
            let w = lines.words();
            assert_eq!((w.len(), w.as_ptr() as usize % 64), (n, 0), "{n} words");
            assert!(w.iter().all(|&x| x == n as u32));
        }
    }

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
        Bf16Path::available()
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

    /// A product over a part of a B packed once (rows from a multiple of 32, the first columns) is, bit
    /// for bit, `mm_bf16` of that part, on every path and layout of A and B, for parts that end inside B,
    /// at its last row and column, and on odd counts of rows.
    #[test]
    fn products_of_a_packed_b_are_those_of_its_parts() {
        let (mut bufs, mut packed) = (Bf16Buffers::default(), PackedB::default());
        let (k_all, n_all) = (203, 77);
        for path in paths() {
            for (la, lb) in [(0, 0), (1, 1), (2, 0), (0, 2)] {
                let bd = values(k_all * n_all * 3 + 2 * n_all + 2, 5);
                let b = view(&bd, k_all, n_all, lb);
                packed.pack(path, b);
                assert!(packed.holds(&b) && !packed.holds(&b.part(1, 3, 3)));
                for (k0, k, n, m) in [
                    (0, 64, 77, 40),
                    (64, 139, 33, 3),
                    (160, 43, 1, 70),
                    (32, 7, 64, 33),
                ] {
                    let ad = values(m * k * 3 + 2 * k + 2, (k0 + k) as u64);
                    let a = view(&ad, m, k, la);
                    let rs = n + 5;
                    let (mut got, mut want) = (vec![7.0f32; m * rs], vec![7.0f32; m * rs]);
                    mm_bf16_packed(path, &mut bufs, &mut got, rs, a, (&packed, k0, n));
                    let part = b.part(k0, k, n);
                    mm_bf16(path, &mut bufs, &mut want, rs, a, part, false);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{path:?} {la}{lb} k0 {k0} {m}x{n}x{k}"
                    );
                }
            }
        }
    }

    /// Operands stored in bf16 (`Op::Bf16`, and transposed rows, `Op::Bf16T`, as `to_bf16` rounds them)
    /// give, bit for bit, the products of their f32 sources on every path: as A, as B and both,
    /// accumulating or not, over odd k and n, rows past a tile's edge, k under a tile row and over three
    /// of the AMX GEMM's passes.
    #[test]
    fn products_of_bf16_operands_are_those_of_their_f32_sources() {
        let mut bufs = Bf16Buffers::default();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let transposed = |d: &[f32], rows: usize, cols: usize| -> Vec<f32> {
            (0..cols)
                .flat_map(|j| (0..rows).map(move |i| d[i * cols + j]))
                .collect()
        };
        for path in paths() {
            let half = |v: &[f32]| {
                let mut h = vec![0u16; v.len()];
                to_bf16(path, v, &mut h);
                h
            };
            for (m, n, k) in [
                (1, 1, 1),
                (3, 5, 2),
                (33, 70, 129),
                (64, 32, 384),
                (37, 45, 4200),
            ] {
                let (ad, bd) = (values(m * k, (m + k) as u64), values(k * n, (n + k) as u64));
                let (ah, bh) = (half(&ad), half(&bd));
                let (ath, bth) = (half(&transposed(&ad, m, k)), half(&transposed(&bd, k, n)));
                let (a, b) = (M::new(&ad, m, k), M::new(&bd, k, n));
                let a_ops = [
                    Op::F32(a),
                    Op::Bf16(Rows16::new(&ah, m, k)),
                    Op::Bf16T(Rows16::new(&ath, k, m)),
                ];
                let b_ops = [
                    Op::F32(b),
                    Op::Bf16(Rows16::new(&bh, k, n)),
                    Op::Bf16T(Rows16::new(&bth, n, k)),
                ];
                for acc in [false, true] {
                    let init = values(m * n, 4);
                    let mut want = init.clone();
                    mm_bf16(path, &mut bufs, &mut want, n, a, b, acc);
                    for (ia, ib) in (0..3).flat_map(|i| (0..3).map(move |j| (i, j))).skip(1) {
                        let mut got = init.clone();
                        mm_bf16_ops(path, &mut bufs, &mut got, n, a_ops[ia], b_ops[ib], acc);
                        assert!(
                            bits(&got) == bits(&want),
                            "{path} {m}x{n}x{k} A {ia} B {ib} acc {acc}"
                        );
                    }
                }
            }
        }
    }

    /// `to_bf16` rounds as each path's packing does: to nearest even, and on the hardware paths an f32
    /// subnormal to zero (what their products read a bf16 subnormal as), over lengths that end
    /// mid-vector.
    #[test]
    fn to_bf16_rounds_as_the_packing_does() {
        let mut xs = values(1000, 8);
        xs.extend([
            0.0,
            -0.0,
            1e-40,
            -1e-40,
            f32::from_bits(0x007f_ffff),
            f32::MIN_POSITIVE,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::INFINITY,
            f32::MAX,
        ]);
        for path in paths() {
            for len in [xs.len(), 33, 17, 1] {
                let x = &xs[xs.len() - len..];
                let mut got = vec![0u16; len];
                to_bf16(path, x, &mut got);
                for (&v, &g) in x.iter().zip(&got) {
                    let want = match path.is_hardware() && v.is_subnormal() {
                        true => bf16(0.0f32.copysign(v)),
                        false => bf16(v),
                    };
                    assert_eq!(g, want, "{path} {v:e} of {len}");
                }
            }
        }
    }

    /// A part past the packed B's edge, or from a row not a multiple of 32, panics.
    #[test]
    fn a_packed_b_refuses_parts_past_its_edges() {
        let bd = values(100 * 40, 1);
        let path = Bf16Path::detect();
        let mut packed = PackedB::default();
        packed.pack(path, M::new(&bd, 100, 40));
        let ad = values(10 * 100, 2);
        for (k0, k, n) in [(16, 10, 40), (96, 10, 40), (0, 10, 41)] {
            let r = std::panic::catch_unwind(|| {
                let mut out = vec![0.0f32; 10 * 41];
                let a = M::new(&ad, 10, k);
                mm_bf16_packed(
                    path,
                    &mut Bf16Buffers::default(),
                    &mut out,
                    41,
                    a,
                    (&packed, k0, n),
                );
            });
            assert!(r.is_err(), "k0 {k0} k {k} n {n}");
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
            // Three of the AMX GEMM's passes over k, with blocks past the edges.
            (37, 45, 4200),
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

    /// The packed operands' buffers only grow, so a product finds there what a larger one left (and the
    /// pairs and rows past its edges are not zero unless it writes them): every product equals, bit for
    /// bit, the same product through fresh buffers, on every path, with transposed operands too.
    #[test]
    fn buffers_a_larger_product_left_change_no_bit() {
        let mut kept = Bf16Buffers::default();
        for (m, n, k) in [
            (130, 260, 257),
            (5, 7, 3),
            (70, 33, 129),
            (1, 1, 1),
            (33, 65, 31),
        ] {
            for (la, lb) in [(0, 0), (1, 1), (0, 1), (1, 0)] {
                let ad = values(m * k * 3 + 2 * k + 2, (m + k) as u64);
                let bd = values(k * n * 3 + 2 * n + 2, (n + 2 * k) as u64);
                let (a, b) = (view(&ad, m, k, la), view(&bd, k, n, lb));
                for path in paths() {
                    let (mut fresh, mut again) = (vec![0.0; m * n], vec![0.0; m * n]);
                    mm_bf16(
                        path,
                        &mut Bf16Buffers::default(),
                        &mut fresh,
                        n,
                        a,
                        b,
                        false,
                    );
                    mm_bf16(path, &mut kept, &mut again, n, a, b, false);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert!(
                        bits(&again) == bits(&fresh),
                        "{path:?} {m}x{n}x{k} {la}{lb}"
                    );
                }
            }
        }
    }

    /// The rate probe times real instructions (an optimized-away loop once made it read 2.00 anywhere):
    /// one core's FLOP/s are within what a core can do: at most 64 a cycle for the f32 FMA and vdpbf16ps
    /// (two 512-bit units), 1024 for AMX's tdpbf16ps, at up to 6 GHz.
    #[test]
    fn the_rate_probe_measures_instructions() {
        if let Some((bf16, fma)) = rate::peaks() {
            let bf16_max = match Bf16Path::detect().is_amx() {
                true => 1024.0 * 6e9,
                false => 128.0 * 6e9,
            };
            assert!((1e9..bf16_max).contains(&bf16), "bf16 {bf16} FLOP/s");
            assert!((1e9..64.0 * 6e9).contains(&fma), "f32 FMA {fma} FLOP/s");
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

    /// The result does not depend on the thread count (the k blocks are summed in one order), nor on
    /// the tasks the threads split the product into (a small model's weight gradient, 128 x 128 over
    /// 768 tokens, is cut into more of them the more threads there are).
    #[test]
    fn bf16_products_do_not_depend_on_the_thread_count() {
        for (m, n, k, path) in [
            (300, 200, 700),
            (70, 50, 4500),
            (128, 128, 768),
            (128, 384, 768),
        ]
        .into_iter()
        .flat_map(|s| paths().into_iter().map(move |p| (s.0, s.1, s.2, p)))
        {
            let (ad, bd) = (values(m * k, 1), values(k * n, 2));
            let runs: Vec<Vec<f32>> = [1, 2, 3, 4]
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

//! Intel AMX (Advanced Matrix Extensions) for bf16 products: eight tile registers of 16 rows x 64 bytes,
//! and `tdpbf16ps`, which adds to a tile of 16 x 16 f32 the products of a 16-row tile of bf16 pairs (A) and
//! a tile of 16 pair rows x 16 columns (B): 8192 multiply-adds an instruction, where AVX-512's vdpbf16ps
//! does 32.
//!
//! Rust has no stable AMX intrinsics, so the instructions are written in inline assembly, behind a safe API:
//! an `Amx` exists only where the CPU reports AMX-TILE and AMX-BF16 and the kernel has granted this
//! process the tile data (Linux asks each process to request it: `arch_prctl(ARCH_REQ_XCOMP_PERM)`), and
//! `Amx::product` checks its slices before the tiles read or write them.

use std::sync::OnceLock;

/// Pairs of k in one tile row (64 bytes of bf16 pairs).
pub const PAIRS: usize = 16;
/// Rows (and columns) of C one `Amx::product` step covers: two tiles a side.
pub const BLOCK: usize = 32;

/// Proof that this process may run AMX bf16 instructions: only `Amx::get` makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Amx(());

/// The tile configuration every call loads: palette 1, the eight tiles each 16 rows of 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

const CONFIG: Config = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64;
        c[48 + t] = 16;
        t += 1;
    }
    Config(c)
};

/// This thread's tile registers configured as `CONFIG`, until the guard drops and releases them. Not
/// `Send`: the configuration belongs to the thread that loaded it.
struct Tiles(std::marker::PhantomData<*const ()>);

impl Tiles {
    fn configure(_: Amx) -> Self {
        // SAFETY: the `Amx` proves the CPU has AMX-TILE and the process holds the tile data.
        unsafe { x86::configure() };
        Tiles(std::marker::PhantomData)
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: `configure` ran on this thread (the guard is not `Send`), so the CPU has AMX-TILE.
        unsafe { x86::release() };
    }
}

impl Amx {
    /// The AMX unit, where the CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use its
    /// tile data; asked once per process.
    pub fn get() -> Option<Amx> {
        static GRANTED: OnceLock<bool> = OnceLock::new();
        GRANTED.get_or_init(request).then_some(Amx(()))
    }

    /// C = A B (or C += A B with `add`) for `blocks` row blocks of 32 against one strip of 32 columns,
    /// over `steps` x 16 pairs of k. `a` holds the row blocks' 32 x `blocks` rows, row i at `i * a_stride`
    /// u32, each row's pairs contiguous; `b` holds the strip's pair rows, row p at `p * b_stride` u32, its
    /// 32 columns contiguous (each a bf16 pair: element 2p of the column in the low half, 2p + 1 in the
    /// high); `c` holds the blocks' 32 x `blocks` rows of 32 f32, row i at `i * c_stride`.
    ///
    /// Panics if a slice is shorter than that, or a stride shorter than a row.
    pub fn product(
        self,
        blocks: usize,
        steps: usize,
        (a, a_stride): (&[u32], usize),
        (b, b_stride): (&[u32], usize),
        (c, c_stride): (&mut [f32], usize),
        add: bool,
    ) {
        if blocks == 0 {
            return;
        }
        let (k, rows) = (steps * PAIRS, blocks * BLOCK);
        assert!(
            a_stride >= k && b_stride >= BLOCK && c_stride >= BLOCK,
            "AMX product: a stride shorter than a row"
        );
        assert!(
            k == 0 || (rows - 1) * a_stride + k <= a.len(),
            "AMX product: A shorter than its rows"
        );
        assert!(
            k == 0 || (k - 1) * b_stride + BLOCK <= b.len(),
            "AMX product: B shorter than its pair rows"
        );
        assert!(
            (rows - 1) * c_stride + BLOCK <= c.len(),
            "AMX product: C shorter than its rows"
        );
        // Configured once for all the blocks: loading the configuration and releasing the tiles take
        // about 50 ns, as long as a block's products over 64 of k.
        let tiles = Tiles::configure(self);
        for blk in 0..blocks {
            let a = &a[blk * BLOCK * a_stride..];
            let c = &mut c[blk * BLOCK * c_stride..];
            // SAFETY: `tiles` proves this thread's tiles are configured as `CONFIG`, on a CPU with
            // AMX-TILE and AMX-BF16 whose process holds the tile data. The asserts above bound every
            // tile access: A's two tiles read rows 0..32 (this block's, at a_stride) x 64 bytes from
            // pair 16 s for s < steps, that is up to (31 a_stride + k) u32; B's read pair rows 0..k x
            // 32 u32 at b_stride; C's loads and stores touch 32 rows of 32 f32 at c_stride, up to
            // (31 c_stride + 32) f32.
            unsafe {
                x86::block(
                    &tiles,
                    steps,
                    (a.as_ptr(), a_stride),
                    (b.as_ptr(), b_stride),
                    (c, c_stride),
                    add,
                )
            };
        }
    }

    /// The multiply-add rate of `tdpbf16ps` on one core, in FLOP/s (a product and its sum count 2): four
    /// independent accumulator tiles, the best of 3 runs of about a millisecond.
    pub fn peak(self) -> f64 {
        const N: usize = 2_000;
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = std::time::Instant::now();
            // SAFETY: `self` proves the CPU has AMX-TILE and AMX-BF16 and the process holds the tile
            // data; the loop reads and writes tile registers only.
            unsafe { x86::dots(std::hint::black_box(N)) };
            best = best.min(t.elapsed().as_secs_f64());
        }
        // Four tdpbf16ps a round, each 16 x 16 x 32 products.
        (N * 4 * 2 * 16 * 16 * 32) as f64 / best
    }
}

/// Whether the CPU has AMX-TILE and AMX-BF16 and the kernel grants this process their tile data.
fn request() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        // Leaf 7 sub-leaf 0: the extended features.
        let f = std::arch::x86_64::__cpuid_count(7, 0);
        let (bf16, tile) = (f.edx >> 22 & 1 == 1, f.edx >> 24 & 1 == 1);
        if !(bf16 && tile) {
            return false;
        }
        // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): 0 where the kernel enables the tile state
        // and grants it (Linux 5.16 and later), an error otherwise.
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: the call only changes which register state this process may use.
        let r = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        r == 0
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    false
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod x86 {
    use super::{Config, Tiles, CONFIG};
    use std::arch::asm;

    /// Loads `CONFIG` into this thread's tile configuration.
    ///
    /// # Safety
    /// The CPU has AMX-TILE and the process holds the tile data.
    pub unsafe fn configure() {
        let cfg: &Config = &CONFIG;
        // SAFETY: reads the 64 bytes of `CONFIG` (the caller's contract covers the instruction).
        unsafe { asm!("ldtilecfg [{cfg}]", cfg = in(reg) cfg.0.as_ptr(), options(nostack)) };
    }

    /// Releases this thread's tiles (their configuration and data).
    ///
    /// # Safety
    /// The CPU has AMX-TILE.
    pub unsafe fn release() {
        // SAFETY: register state only (the caller's contract covers the instruction).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// C (32 x 32 f32) = A B, or C += A B with `add`, over `steps` x 16 pairs: tiles 0-3 hold C's
    /// quarters, 4-5 A's two row halves, 6-7 B's two column halves.
    ///
    /// # Safety
    /// The CPU has AMX-BF16, and `_tiles` (this thread's configuration) the tiles; `a` has 32 rows at
    /// `a_stride` u32 of 16 `steps` pairs, `b` 16 `steps` pair rows at `b_stride` u32 of 32 columns, `c`
    /// 32 rows at `c_stride` f32 of 32.
    pub unsafe fn block(
        _tiles: &Tiles,
        steps: usize,
        (a, a_stride): (*const u32, usize),
        (b, b_stride): (*const u32, usize),
        (c, c_stride): (&mut [f32], usize),
        add: bool,
    ) {
        let (sa, sb, sc) = (4 * a_stride, 4 * b_stride, 4 * c_stride);
        // SAFETY: the caller's contract bounds the loads and the stores.
        unsafe {
            asm!(
                "test {add}, {add}",
                "jz 4f",
                "tileloadd tmm0, [{c} + {sc}*1]",
                "tileloadd tmm1, [{c} + {sc}*1 + 64]",
                "tileloadd tmm2, [{c2} + {sc}*1]",
                "tileloadd tmm3, [{c2} + {sc}*1 + 64]",
                "jmp 5f",
                "4:",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "5:",
                "test {n}, {n}",
                "jz 3f",
                "2:",
                "tileloadd tmm4, [{a} + {sa}*1]",
                "tileloadd tmm5, [{a2} + {sa}*1]",
                "tileloadd tmm6, [{b} + {sb}*1]",
                "tileloadd tmm7, [{b} + {sb}*1 + 64]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a}, 64",
                "add {a2}, 64",
                "add {b}, {bstep}",
                "dec {n}",
                "jnz 2b",
                "3:",
                "tilestored [{c} + {sc}*1], tmm0",
                "tilestored [{c} + {sc}*1 + 64], tmm1",
                "tilestored [{c2} + {sc}*1], tmm2",
                "tilestored [{c2} + {sc}*1 + 64], tmm3",
                add = in(reg) add as usize,
                n = inout(reg) steps => _,
                a = inout(reg) a => _,
                a2 = inout(reg) a.add(16 * a_stride) => _,
                b = inout(reg) b => _,
                sa = in(reg) sa,
                sb = in(reg) sb,
                bstep = in(reg) 16 * sb,
                c = in(reg) c.as_mut_ptr(),
                c2 = in(reg) c.as_mut_ptr().add(16 * c_stride),
                sc = in(reg) sc,
                out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                options(nostack),
            );
        }
    }

    /// `n` rounds of four tdpbf16ps on tiles in registers (the rate probe).
    ///
    /// # Safety
    /// The CPU has AMX-TILE and AMX-BF16 and the process holds the tile data.
    pub unsafe fn dots(n: usize) {
        let cfg: &Config = &CONFIG;
        // SAFETY: register-only tile instructions (the caller's contract).
        unsafe {
            asm!(
                "ldtilecfg [{cfg}]",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "tilezero tmm4",
                "tilezero tmm5",
                "tilezero tmm6",
                "tilezero tmm7",
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "dec {n}",
                "jnz 2b",
                "tilerelease",
                cfg = in(reg) cfg.0.as_ptr(),
                n = inout(reg) n.max(1) => _,
                out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                options(nostack),
            );
        }
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod x86 {
    use super::Tiles;
    /// Never called: no `Amx` exists off x86-64 Linux.
    pub unsafe fn configure() {
        unreachable!("no AMX here")
    }
    /// Never called, as `configure`.
    pub unsafe fn release() {
        unreachable!("no AMX here")
    }
    /// Never called, as `configure`.
    pub unsafe fn block(
        _: &Tiles,
        _: usize,
        _: (*const u32, usize),
        _: (*const u32, usize),
        _: (&mut [f32], usize),
        _: bool,
    ) {
        unreachable!("no AMX here")
    }
    /// Never called, as `block`.
    pub unsafe fn dots(_: usize) {
        unreachable!("no AMX here")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 bits of small integers and halves (exact in bf16, and their products' sums exact in f32).
    fn pair(lo: f32, hi: f32) -> u32 {
        (lo.to_bits() >> 16) | (hi.to_bits() >> 16) << 16
    }

    fn value(i: usize) -> f32 {
        ((i * 7919) % 13) as f32 * 0.5 - 3.0
    }

    /// Each tile of C is the sum over k of A's and B's pairs (added to C's values with `add`, in their
    /// place without), at strides wider than the rows, for several row blocks, and C's entries past its
    /// 32 columns stay; sums of exact products are exact, so the oracle is equality.
    #[test]
    fn tiles_sum_the_products_of_the_pairs() {
        let Some(amx) = Amx::get() else {
            return;
        };
        let (blocks, steps, a_stride, b_stride) = (2, 3, 3 * PAIRS + 5, BLOCK + 7);
        let k = steps * PAIRS;
        let a: Vec<u32> = (0..blocks * BLOCK * a_stride)
            .map(|i| pair(value(2 * i), value(2 * i + 1)))
            .collect();
        let b: Vec<u32> = (0..k * b_stride)
            .map(|i| pair(value(3 * i + 1), value(5 * i + 2)))
            .collect();
        let c_stride = BLOCK + 3;
        let init: Vec<f32> = (0..blocks * BLOCK * c_stride).map(value).collect();
        let half = |w: u32, h: u32| f32::from_bits((w >> (16 * h)) << 16);
        for add in [false, true] {
            let mut c = init.clone();
            let ab = ((&a[..], a_stride), (&b[..], b_stride));
            amx.product(blocks, steps, ab.0, ab.1, (&mut c, c_stride), add);
            for i in 0..blocks * BLOCK {
                for j in 0..c_stride {
                    let at = i * c_stride + j;
                    if j >= BLOCK {
                        assert_eq!(
                            c[at].to_bits(),
                            init[at].to_bits(),
                            "[{i}, {j}] past the tile"
                        );
                        continue;
                    }
                    let want: f32 = (0..k)
                        .map(|p| {
                            let (x, y) = (a[i * a_stride + p], b[p * b_stride + j]);
                            half(x, 0) * half(y, 0) + half(x, 1) * half(y, 1)
                        })
                        .sum();
                    let want = if add { init[at] + want } else { want };
                    assert_eq!(c[at], want, "[{i}, {j}] add {add}");
                }
            }
        }
    }

    /// A slice shorter than the product reads panics before any tile touches it.
    #[test]
    fn short_operands_panic() {
        let Some(amx) = Amx::get() else {
            return;
        };
        let (a, b) = (vec![0u32; BLOCK * PAIRS], vec![0u32; PAIRS * BLOCK]);
        let mut c = vec![0.0f32; BLOCK * BLOCK];
        for (a, b, c_len) in [
            (&a[1..], &b[..], BLOCK * BLOCK),
            (&a[..], &b[1..], BLOCK * BLOCK),
            (&a[..], &b[..], BLOCK * BLOCK - 1),
        ] {
            let c = &mut c[..c_len];
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                amx.product(1, 1, (a, PAIRS), (b, BLOCK), (c, BLOCK), false)
            }));
            assert!(r.is_err());
        }
    }

    /// The probe agrees with CPUID: an `Amx` exists only where the CPU reports AMX-TILE and AMX-BF16.
    #[test]
    fn the_unit_exists_only_where_cpuid_reports_it() {
        #[cfg(target_arch = "x86_64")]
        {
            let f = std::arch::x86_64::__cpuid_count(7, 0);
            if f.edx >> 22 & 1 == 0 || f.edx >> 24 & 1 == 0 {
                assert!(Amx::get().is_none());
            }
        }
        if std::env::var_os("NANODIST_REQUIRE_AMX").is_some() {
            assert!(
                Amx::get().is_some(),
                "NANODIST_REQUIRE_AMX is set, and AMX is not usable"
            );
        }
    }
}

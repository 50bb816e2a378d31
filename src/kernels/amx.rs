//! Intel AMX (Advanced Matrix Extensions) for bf16 products: eight tile registers of 16 rows x 64 bytes,
//! and `tdpbf16ps`, which adds to a tile of 16 x 16 f32 the products of a 16-row tile of bf16 pairs (A) and
//! a tile of 16 pair rows x 16 columns (B): 8192 multiply-adds an instruction, where AVX-512's vdpbf16ps
//! does 32.
//!
//! Rust has no stable AMX intrinsics, so the instructions are written in inline assembly, behind a safe API:
//! an `Amx` exists only where the CPU reports AMX-TILE and AMX-BF16 and the kernel has granted this
//! process the tile data (Linux asks each process to request it: `arch_prctl(ARCH_REQ_XCOMP_PERM)`), and
//! `Amx::product` checks its slices before the tiles read or write them.

use std::cell::Cell;
use std::sync::OnceLock;

/// Pairs of k in one tile row (64 bytes of bf16 pairs).
pub const PAIRS: usize = 16;
/// Rows (and columns) of C one `Amx::product` step covers: two tiles a side.
pub const BLOCK: usize = 32;
/// Words of A one step of `Amx::product` reads: its two tiles, the block's 32 rows of 16 pairs.
pub const STEP: usize = BLOCK * PAIRS;

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

thread_local! {
    /// How many `Tiles` guards this thread holds: the first configures the tiles, the last to drop
    /// releases them.
    static HELD: Cell<usize> = const { Cell::new(0) };
}

/// This thread's tile registers configured as `CONFIG` while a guard lives (`Amx::hold`). Not `Send`:
/// the configuration belongs to the thread that loaded it. Guards nest: only the first loads the
/// configuration, and only the last releases the tiles.
pub struct Tiles(std::marker::PhantomData<*const ()>);

impl Tiles {
    fn configure(_: Amx) -> Self {
        HELD.with(|held| {
            if held.get() == 0 {
                // SAFETY: the `Amx` proves the CPU has AMX-TILE and the process holds the tile data.
                unsafe { x86::configure() };
            }
            held.set(held.get() + 1);
        });
        Tiles(std::marker::PhantomData)
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        HELD.with(|held| {
            held.set(held.get() - 1);
            if held.get() == 0 {
                // SAFETY: `configure` ran on this thread (the guard is not `Send`), so the CPU has
                // AMX-TILE.
                unsafe { x86::release() };
            }
        });
    }
}

impl Amx {
    /// The AMX unit, where the CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use its
    /// tile data; asked once per process.
    pub fn get() -> Option<Amx> {
        static GRANTED: OnceLock<bool> = OnceLock::new();
        GRANTED.get_or_init(request).then_some(Amx(()))
    }

    /// This thread's tiles kept configured until the guard drops, so that the products run meanwhile
    /// do not each load the configuration: loading it waits for the tiles' last stores, and per
    /// product (a strip of 32 columns) that was a tenth of the medium config's products.
    pub fn hold(self) -> Tiles {
        Tiles::configure(self)
    }

    /// C = A B (or C += A B with `add`) for `blocks` row blocks of 32 against one strip of 32 columns,
    /// over `steps` x 16 pairs of k. `a` holds the row blocks tile by tile: block r at `r * a_block` u32,
    /// its step s (pairs 16 s to 16 s + 15 of its 32 rows) at `s * STEP` from there, row i of the step
    /// at `i * PAIRS`, so that each tile is 1 KB in one piece; `b` holds the strip's pair rows, row p at
    /// `p * b_stride` u32, its 32 columns contiguous (each a bf16 pair: element 2p of the column in the
    /// low half, 2p + 1 in the high); `c` holds the blocks' 32 x `blocks` rows of 32 f32, row i at
    /// `i * c_stride`.
    ///
    /// Panics if a slice is shorter than that, or a stride shorter than a block or a row.
    pub fn product(
        self,
        blocks: usize,
        steps: usize,
        (a, a_block): (&[u32], usize),
        (b, b_stride): (&[u32], usize),
        (c, c_stride): (&mut [f32], usize),
        add: bool,
    ) {
        if blocks == 0 {
            return;
        }
        let (k, rows) = (steps * PAIRS, blocks * BLOCK);
        assert!(
            a_block >= steps * STEP && b_stride >= BLOCK && c_stride >= BLOCK,
            "AMX product: a stride shorter than a block or a row"
        );
        assert!(
            (blocks - 1) * a_block + steps * STEP <= a.len(),
            "AMX product: A shorter than its blocks"
        );
        assert!(
            k == 0 || (k - 1) * b_stride + BLOCK <= b.len(),
            "AMX product: B shorter than its pair rows"
        );
        assert!(
            (rows - 1) * c_stride + BLOCK <= c.len(),
            "AMX product: C shorter than its rows"
        );
        // Configured once for all the blocks, or not at all where the caller holds the tiles.
        let tiles = self.hold();
        for blk in 0..blocks {
            let a = &a[blk * a_block..];
            // The next block of C, its lines asked for while this one computes: out is written once a
            // pass over k, so its lines are seldom in the cache, and waiting for them stalled the stores
            // (a sixth of the time of the medium config's fc layer, whose blocks sum 384 of k).
            let next = if blk + 1 < blocks {
                (c[(blk + 1) * BLOCK * c_stride..].as_ptr(), BLOCK)
            } else {
                (c.as_ptr(), 0)
            };
            let c = &mut c[blk * BLOCK * c_stride..];
            // SAFETY: `tiles` proves this thread's tiles are configured as `CONFIG`, on a CPU with
            // AMX-TILE and AMX-BF16 whose process holds the tile data. The asserts above bound every
            // tile access: A's two tiles read this block's steps s < steps, STEP u32 each from
            // s STEP, that is up to steps STEP u32; B's read pair rows 0..k x 32 u32 at b_stride; C's
            // loads and stores touch 32 rows of 32 f32 at c_stride, up to (31 c_stride + 32) f32; the
            // requests for the next block's lines read nothing and cannot fault.
            unsafe {
                x86::block(
                    &tiles,
                    steps,
                    a.as_ptr(),
                    next,
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
        let tiles = self.hold();
        for _ in 0..3 {
            let t = std::time::Instant::now();
            // SAFETY: `tiles` proves this thread's tiles are configured, on a CPU with AMX-BF16; the
            // loop reads and writes tile registers only.
            unsafe { x86::dots(&tiles, std::hint::black_box(N)) };
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
    use super::{Config, Tiles, CONFIG, PAIRS, STEP};
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
    /// quarters, 4-5 A's two row halves, 6-7 B's two column halves. Each tile is loaded just before
    /// its first product, so that the loads of a step overlap the products of the last. The first
    /// steps also ask for 4 rows each of `next`'s first rows (of 32 f32 at `c_stride`: up to its
    /// count, a multiple of 4), with the intent to write them (prefetchw).
    ///
    /// # Safety
    /// The CPU has AMX-BF16, and `_tiles` (this thread's configuration) the tiles; `a` has `steps`
    /// steps of `STEP` u32 (the 32 rows of 16 pairs, one after another), `b` 16 `steps` pair rows at
    /// `b_stride` u32 of 32 columns, `c` 32 rows at `c_stride` f32 of 32.
    pub unsafe fn block(
        _tiles: &Tiles,
        steps: usize,
        a: *const u32,
        (pf, pf_rows): (*const f32, usize),
        (b, b_stride): (*const u32, usize),
        (c, c_stride): (&mut [f32], usize),
        add: bool,
    ) {
        let (sb, sc) = (4 * b_stride, 4 * c_stride);
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
                "tileloadd tmm6, [{b} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b} + {sb}*1 + 64]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a} + {sa}*1 + {half}]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a}, {step}",
                "add {b}, {bstep}",
                "test {pfn}, {pfn}",
                "jz 6f",
                "prefetchw [{pf}]",
                "prefetchw [{pf} + 64]",
                "prefetchw [{pf} + {sc}*1]",
                "prefetchw [{pf} + {sc}*1 + 64]",
                "lea {pf}, [{pf} + {sc}*2]",
                "prefetchw [{pf}]",
                "prefetchw [{pf} + 64]",
                "prefetchw [{pf} + {sc}*1]",
                "prefetchw [{pf} + {sc}*1 + 64]",
                "lea {pf}, [{pf} + {sc}*2]",
                "sub {pfn}, 4",
                "6:",
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
                pf = inout(reg) pf => _,
                pfn = inout(reg) pf_rows => _,
                b = inout(reg) b => _,
                sa = in(reg) 4 * PAIRS,
                half = const 2 * STEP,
                step = const 4 * STEP,
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
    /// The CPU has AMX-BF16, and `_tiles` (this thread's configuration) the tiles.
    pub unsafe fn dots(_tiles: &Tiles, n: usize) {
        // SAFETY: register-only tile instructions (the caller's contract).
        unsafe {
            asm!(
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
        _: *const u32,
        _: (*const f32, usize),
        _: (*const u32, usize),
        _: (&mut [f32], usize),
        _: bool,
    ) {
        unreachable!("no AMX here")
    }
    /// Never called, as `block`.
    pub unsafe fn dots(_: &Tiles, _: usize) {
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
    /// place without), at strides wider than the blocks and rows, for several row blocks, and C's entries
    /// past its 32 columns stay; sums of exact products are exact, so the oracle is equality.
    #[test]
    fn tiles_sum_the_products_of_the_pairs() {
        let Some(amx) = Amx::get() else {
            return;
        };
        let (blocks, steps, a_block, b_stride) = (2, 3, 3 * STEP + 5, BLOCK + 7);
        let k = steps * PAIRS;
        // Pair p of row i: in row i % 32 of step p / 16 of block i / 32.
        let pair_at = |i: usize, p: usize| {
            (i / BLOCK) * a_block + (p / PAIRS) * STEP + (i % BLOCK) * PAIRS + p % PAIRS
        };
        let a: Vec<u32> = (0..blocks * a_block)
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
            let ab = ((&a[..], a_block), (&b[..], b_stride));
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
                            let (x, y) = (a[pair_at(i, p)], b[p * b_stride + j]);
                            half(x, 0) * half(y, 0) + half(x, 1) * half(y, 1)
                        })
                        .sum();
                    let want = if add { init[at] + want } else { want };
                    assert_eq!(c[at], want, "[{i}, {j}] add {add}");
                }
            }
        }
    }

    /// Guards nest: a product run while a guard is held leaves the tiles configured for the holder
    /// (released there, the holder's next tile instruction would fault), and the last guard to drop
    /// releases them.
    #[test]
    fn held_tiles_outlive_the_products_run_inside() {
        let Some(amx) = Amx::get() else {
            return;
        };
        let outer = amx.hold();
        let (a, b) = (vec![0u32; STEP], vec![0u32; PAIRS * BLOCK]);
        let mut c = vec![1.0f32; BLOCK * BLOCK];
        amx.product(1, 1, (&a, STEP), (&b, BLOCK), (&mut c, BLOCK), false);
        assert!(c.iter().all(|&x| x == 0.0));
        assert_eq!(HELD.with(Cell::get), 1);
        // SAFETY: `outer` keeps this thread's tiles configured (what this test checks), on a CPU with
        // AMX-BF16.
        unsafe { x86::dots(&outer, 4) };
        drop(outer);
        assert_eq!(HELD.with(Cell::get), 0);
    }

    /// A slice shorter than the product reads panics before any tile touches it.
    #[test]
    fn short_operands_panic() {
        let Some(amx) = Amx::get() else {
            return;
        };
        let (a, b) = (vec![0u32; STEP], vec![0u32; PAIRS * BLOCK]);
        let mut c = vec![0.0f32; BLOCK * BLOCK];
        for (a, b, c_len) in [
            (&a[1..], &b[..], BLOCK * BLOCK),
            (&a[..], &b[1..], BLOCK * BLOCK),
            (&a[..], &b[..], BLOCK * BLOCK - 1),
        ] {
            let c = &mut c[..c_len];
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                amx.product(1, 1, (a, STEP), (b, BLOCK), (c, BLOCK), false)
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

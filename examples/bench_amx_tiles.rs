//! Benchmark: the AMX tile kernel (`Amx::product`, the inner loop of `train.amp`'s GEMM on Xeons with
//! AMX) on one core, against the rate of `tdpbf16ps` on tiles already in registers (`Amx::peak`),
//! measured in the same run. Each row is one product of the medium config's or GPT-2 small's shapes,
//! cut as `bands` cuts it for a thread (bands of rows, each against every strip of B over all of k; the
//! GEMM itself sums a k past 2048 in passes), with its operands:
//!
//! - `L1`: one 32 x 32 block over 256 of k, 16 KB of A and of B, repeated (the kernel's own ceiling);
//! - `L1 unaligned`: the same, A and B 16 bytes past a cache line (every tile row then spans two);
//! - `warm`: the band's products repeated, so that what fits of A, B and C stays in the core's caches;
//! - `cold`: the caches flushed (64 MB written) before each product, nothing of A, B or C left in them
//!   (in a training step C was last touched by other layers' work, while A and B were just packed).
//!
//!     cargo run --release --example bench_amx_tiles

use std::time::Instant;

use nanodist::kernels::amx::{Amx, BLOCK, PAIRS, STEP};

/// An operand of `words` u32 (bf16 pairs of values of magnitude 2^-7 to 2, both signs) starting
/// `skew` words past a cache line: the vector and the offset of its first word.
fn operand(words: usize, skew: usize) -> (Vec<u32>, usize) {
    let v: Vec<u32> = (0..words + 32)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761) & 0xbfff_bfff | 0x3c00_3c00)
        .collect();
    let line = (v.as_ptr() as usize).wrapping_neg() % 64 / 4;
    (v, line + skew)
}

/// Where a product's operands are when it starts.
#[derive(Clone, Copy, PartialEq)]
enum Cache {
    Hot,
    Cold,
}

/// GFLOP/s of `Amx::product` over m x n x k (multiples of 32) in bands of `band` blocks, the best of 5
/// runs after a warm-up.
fn rate(amx: Amx, (m, n, k): (usize, usize, usize), band: usize, cache: Cache, skew: usize) -> f64 {
    let (blocks, steps, strips) = (m / BLOCK, k / (2 * PAIRS), n / BLOCK);
    let a_block = steps * STEP;
    let (a, ao) = operand(blocks * a_block, skew);
    let (b, bo) = operand(strips * steps * PAIRS * BLOCK, skew);
    let mut c = vec![0f32; m * n + 16];
    let co = (c.as_ptr() as usize).wrapping_neg() % 64 / 4;
    let (flush, mut sink) = (vec![1u8; 64 << 20], vec![0u8; 64 << 20]);
    let reps = match cache {
        Cache::Hot => (1 << 28) / (m * n * k) + 1,
        Cache::Cold => 1,
    };
    let mut best = f64::MAX;
    // Run 0, the warm-up, maps C's pages.
    for run in 0..6 {
        if cache == Cache::Cold {
            sink.copy_from_slice(&flush);
        }
        let _tiles = amx.hold();
        let t = Instant::now();
        for _ in 0..reps {
            for b0 in (0..blocks).step_by(band) {
                for s in 0..strips {
                    let a = (&a[ao + b0 * a_block..], a_block);
                    let b = (&b[bo + s * steps * PAIRS * BLOCK..], BLOCK);
                    let c = (&mut c[co + b0 * BLOCK * n + s * BLOCK..], n);
                    amx.product(band.min(blocks - b0), steps, a, b, c, false);
                }
            }
        }
        if run > 0 {
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
    }
    std::hint::black_box(&sink);
    2.0 * (m * n * k) as f64 / best / 1e9
}

fn main() {
    let Some(amx) = Amx::get() else {
        eprintln!("this CPU (or kernel) offers no AMX tiles: nothing to measure");
        return;
    };
    let peak = amx.peak() / 1e9;
    println!("one core; tdpbf16ps on tiles in registers: {peak:.0} GFLOP/s");
    println!(
        "{:<28} {:>16} {:>12} {:>9} {:>9}",
        "product", "m x n x k", "operands", "GFLOP/s", "of peak"
    );
    let row = |name: &str, shape: (usize, usize, usize), at: &str, r: f64| {
        let dims = format!("{}x{}x{}", shape.0, shape.1, shape.2);
        println!(
            "{name:<28} {dims:>16} {at:>12} {r:>9.0} {:>8.1}%",
            100.0 * r / peak
        );
    };
    let one = (BLOCK, BLOCK, 256);
    row("one block", one, "L1", rate(amx, one, 1, Cache::Hot, 0));
    row(
        "one block",
        one,
        "L1 unaligned",
        rate(amx, one, 1, Cache::Hot, 4),
    );
    // A thread's band of each product (`bands`: half of the rows of a 2-thread step, at most 1 MB of
    // A's pairs), as (name, m, n, k).
    let shapes = [
        ("medium qkv forward", 1024, 1152, 384),
        ("medium fc dx", 1024, 384, 1536),
        ("medium fc dW", 768, 384, 2048),
        ("gpt2 fc forward", 512, 3072, 768),
        ("gpt2 fc dx", 512, 768, 3072),
    ];
    for (name, m, n, k) in shapes {
        let band = (1 << 20) / (2 * k) / BLOCK;
        let shape = (m, n, k);
        row(name, shape, "warm", rate(amx, shape, band, Cache::Hot, 0));
        row(name, shape, "cold", rate(amx, shape, band, Cache::Cold, 0));
    }
}

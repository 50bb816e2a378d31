//! Peak rate of the CPU's AVX512-BF16 dot product (`vdpbf16ps`: 32 bf16 products summed into 16 f32 lanes)
//! against the f32 FMA (`vfmadd`: 16 products), one core, 24 independent accumulators each (enough to hide
//! either instruction's latency), in FLOP/s (a bf16 pair's product and sum count 2). It decides whether a bf16
//! matmul path can beat f32 on a CPU: on the CI machine class it measured 94-98 vs 194-199 GFLOP/s.
//!
//!     rustc -O --edition 2021 scripts/bench/bf16_rate.rs -o /tmp/bf16_rate && /tmp/bf16_rate
//!
//! Needs a CPU with avx512_bf16 (/proc/cpuinfo) and Rust >= 1.89.

use std::arch::x86_64::*;
use std::time::Instant;

const ACC: usize = 24;

#[target_feature(enable = "avx512f,avx512bf16")]
fn bf16_dot(n: usize) -> f32 {
    // 1.0 in bf16 in every lane.
    let a: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi16(0x3f80)) };
    let mut acc = [_mm512_setzero_ps(); ACC];
    for _ in 0..n {
        for x in acc.iter_mut() {
            *x = _mm512_dpbf16_ps(*x, a, a);
        }
    }
    _mm512_reduce_add_ps(acc.iter().fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x)))
}

#[target_feature(enable = "avx512f")]
fn f32_fma(n: usize) -> f32 {
    let a = _mm512_set1_ps(1.000_000_1);
    let mut acc = [_mm512_setzero_ps(); ACC];
    for _ in 0..n {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, a);
        }
    }
    _mm512_reduce_add_ps(acc.iter().fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x)))
}

fn main() {
    if !is_x86_feature_detected!("avx512bf16") || !is_x86_feature_detected!("avx512f") {
        eprintln!("this CPU has no avx512_bf16");
        std::process::exit(2);
    }
    let n = 50_000_000;
    for _ in 0..3 {
        let t = Instant::now();
        let r = unsafe { bf16_dot(n) };
        let bf = (n * ACC * 64) as f64 / t.elapsed().as_secs_f64() / 1e9;
        let t = Instant::now();
        let r2 = unsafe { f32_fma(n) };
        let f = (n * ACC * 32) as f64 / t.elapsed().as_secs_f64() / 1e9;
        println!("bf16 dot {bf:.0} GFLOP/s, f32 FMA {f:.0} GFLOP/s, ratio {:.2} ({r} {r2})", bf / f);
    }
}

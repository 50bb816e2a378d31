//! Benchmark: the CPU engine's bf16 GEMMs (`train.amp`: AVX512-BF16's vdpbf16ps, and AMX tiles where the
//! CPU has them) against the f32 gemm they replace, on the products of a training step: each linear
//! layer's forward, input gradient and weight gradient, for nanoGPT's CPU config (4x128x64, 12
//! sequences), the 6x384x256 config (8 sequences) and GPT-2 small (1 sequence of 1024, its lm head).
//! GFLOP/s of each, the fastest path's ratio to f32, and its fraction of the bf16 instruction peak of
//! this many threads (the rate of one core's fastest bf16 instruction, measured in the same run, times
//! the threads). The twin row (operands rounded to bf16, f32 gemm) is what CPUs without AVX512-BF16
//! would compute. The "stored" column is the fastest path with the operands that training stores in
//! bf16 given so (the layers' inputs but the lm head's, and the qkv and fc layers' dy): their packing
//! copies or interleaves bf16 instead of rounding f32 ("-" where the product has none).
//!
//!     cargo run --release --example bench_bf16_gemm [-- --threads 2]
//!
//! `--squares` prints instead, as one JSON line, the GFLOP/s of the f32 gemm and of the fastest bf16
//! path on square products of 512, 1024 and 2048 (the best of 5 runs of each; `bf16` is null on a CPU
//! without AVX512-BF16): `scripts/bench/train.py` counts them in the machine's GEMM peaks beside
//! numpy's and PyTorch's, so that no row is measured against a peak slower than nanodist's own GEMM.

use std::time::Instant;

use nanodist::model::matmul::{
    mm, mm_bf16, mm_bf16_ops, par, rate, to_bf16, Bf16Buffers, Bf16Path, Op, Rows16, M,
};
use rand::{Rng, SeedableRng};

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-0.5..0.5)).collect()
}

/// Best of 5 runs after a warm-up, in seconds.
fn time(f: &mut dyn FnMut()) -> f64 {
    f();
    (0..5)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

/// How a product's operands lie: the forward's x W^T, the input gradient's dy W, the weight
/// gradient's dy^T x.
#[derive(Clone, Copy)]
enum Kind {
    Forward,
    InputGrad,
    WeightGrad,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads = args
        .iter()
        .position(|a| a == "--threads")
        .and_then(|i| args.get(i + 1))
        .map_or(2, |t| t.parse().expect("--threads N"));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    if args.iter().any(|a| a == "--squares") {
        return pool.install(squares);
    }
    let Some((bf16_core, fma_core)) = rate::peaks() else {
        eprintln!("this CPU has no AVX512-BF16: nothing to measure");
        std::process::exit(2);
    };
    let peak = bf16_core * threads as f64;
    println!(
        "{threads} threads; one core: {} {:.0} GFLOP/s, f32 FMA {:.0} GFLOP/s ({:.2}x); bf16 \
         instruction peak of {threads} threads {:.0} GFLOP/s",
        Bf16Path::detect(),
        bf16_core / 1e9,
        fma_core / 1e9,
        bf16_core / fma_core,
        peak / 1e9
    );
    products(&pool, peak);
}

/// The best GFLOP/s of the f32 gemm and of the fastest bf16 path (null without bf16 hardware) on
/// square products, as one JSON line.
fn squares() {
    let path = Bf16Path::detect();
    let (mut f32_best, mut bf16_best) = (0.0f64, 0.0f64);
    for n in [512, 1024, 2048] {
        let (ad, bd) = (values(n * n, 1), values(n * n, 2));
        let (a, b) = (M::new(&ad, n, n), M::new(&bd, n, n));
        let mut o = vec![0.0f32; n * n];
        let flops = 2.0 * (n * n * n) as f64;
        f32_best = f32_best.max(flops / time(&mut || mm(&mut o, n, a, b, false, 1.0, par())));
        if path.is_hardware() {
            let mut bufs = Bf16Buffers::default();
            let t = time(&mut || mm_bf16(path, &mut bufs, &mut o, n, a, b, false));
            bf16_best = bf16_best.max(flops / t);
        }
    }
    let bf16 = if path.is_hardware() {
        format!("{:.1}", bf16_best / 1e9)
    } else {
        "null".into()
    };
    println!("{{\"f32\": {:.1}, \"bf16\": {bf16}}}", f32_best / 1e9);
}

/// Each product of a training step of the three configs: GFLOP/s of f32, of every bf16 hardware
/// path and of the twin, and the fastest path's ratio to f32 and fraction of `peak`.
fn products(pool: &rayon::ThreadPool, peak: f64) {
    // rate::peaks measured the fastest path, so there is one.
    let hw: Vec<Bf16Path> = Bf16Path::available()
        .into_iter()
        .filter(|p| p.is_hardware())
        .collect();
    let names: Vec<&str> = hw
        .iter()
        .map(|p| if p.is_amx() { "amx" } else { "vdpbf16ps" })
        .collect();
    print!("{:<24} {:>16} {:>9}", "product", "m x n x k", "f32");
    names.iter().for_each(|n| print!(" {n:>9}"));
    println!(
        " {:>7} {:>10} {:>9} {:>9}",
        "ratio", "bf16 peak", "twin", "stored"
    );
    // (config, tokens, width, vocab)
    let configs = [
        ("cpu", 12 * 64, 128, 65),
        ("medium", 8 * 256, 384, 85),
        ("gpt2", 1024, 768, 50304),
    ];
    for (name, n, c, v) in configs {
        let layers = [
            ("qkv", c, 3 * c),
            ("fc", c, 4 * c),
            ("mlp proj", 4 * c, c),
            ("lm head", c, v),
        ];
        for (layer, inp, out) in layers {
            for kind in [Kind::Forward, Kind::InputGrad, Kind::WeightGrad] {
                let (m, cols, k) = match kind {
                    Kind::Forward => (n, out, inp),
                    Kind::InputGrad => (n, inp, out),
                    Kind::WeightGrad => (out, inp, n),
                };
                let label = match kind {
                    Kind::Forward => "forward",
                    Kind::InputGrad => "dx",
                    Kind::WeightGrad => "dW",
                };
                print!(
                    "{:<24} {:>16}",
                    format!("{name} {layer} {label}"),
                    format!("{m}x{cols}x{k}")
                );
                // Training stores the layers' inputs in bf16 but the lm head's, and the qkv and fc
                // layers' dy: which of this product's operands (A, B) they are.
                let (x16, dy16) = (layer != "lm head", layer == "qkv" || layer == "fc");
                let stored = match kind {
                    Kind::Forward => (x16, false),
                    Kind::InputGrad => (dy16, false),
                    Kind::WeightGrad => (dy16, x16),
                };
                pool.install(|| row(&hw, kind, (m, cols, k), peak, stored));
            }
        }
    }
}

/// The rest of one product's row: f32, each bf16 hardware path, the fastest's ratio to f32 and
/// fraction of `peak`, the twin, and the fastest with the `stored` operands (A, B) in bf16.
fn row(
    hw: &[Bf16Path],
    kind: Kind,
    (m, cols, k): (usize, usize, usize),
    peak: f64,
    stored: (bool, bool),
) {
    let (ad, bd) = (values(m * k, 1), values(k * cols, 2));
    let a = match kind {
        Kind::WeightGrad => M::new(&ad, k, m).t(),
        _ => M::new(&ad, m, k),
    };
    let b = match kind {
        Kind::Forward => M::new(&bd, cols, k).t(),
        _ => M::new(&bd, k, cols),
    };
    let mut o = vec![0.0f32; m * cols];
    let mut bufs = Bf16Buffers::default();
    let t16: Vec<f64> = hw
        .iter()
        .map(|&p| time(&mut || mm_bf16(p, &mut bufs, &mut o, cols, a, b, false)))
        .collect();
    let t32 = time(&mut || mm(&mut o, cols, a, b, false, 1.0, par()));
    let twin = time(&mut || mm_bf16(Bf16Path::EMULATED, &mut bufs, &mut o, cols, a, b, false));
    let flops = 2.0 * (m * cols * k) as f64;
    print!(" {:>9.1}", flops / t32 / 1e9);
    t16.iter().for_each(|t| print!(" {:>9.1}", flops / t / 1e9));
    // The fastest path's (the last: `available` lists them slowest first).
    let best = t16[t16.len() - 1];
    let stored = match stored {
        (false, false) => "-".to_string(),
        (sa, sb) => {
            let path = hw[hw.len() - 1];
            // The bf16 operands as training stores them: x and dy row-major (A = dy^T transposed).
            let half = |v: &[f32]| {
                let mut h = vec![0u16; v.len()];
                to_bf16(path, v, &mut h);
                h
            };
            let (ah, bh) = (half(&ad), half(&bd));
            let oa = match (sa, kind) {
                (false, _) => Op::F32(a),
                (true, Kind::WeightGrad) => Op::Bf16T(Rows16::new(&ah, k, m)),
                (true, _) => Op::Bf16(Rows16::new(&ah, m, k)),
            };
            let ob = match sb {
                false => Op::F32(b),
                true => Op::Bf16(Rows16::new(&bh, k, cols)),
            };
            let t = time(&mut || mm_bf16_ops(path, &mut bufs, &mut o, cols, oa, ob, false));
            format!("{:.1}", flops / t / 1e9)
        }
    };
    println!(
        " {:>6.2}x {:>9.1}% {:>9.1} {:>9}",
        t32 / best,
        100.0 * flops / best / peak,
        flops / twin / 1e9,
        stored,
    );
}

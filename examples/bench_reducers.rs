//! Benchmark: encode + decode throughput of every codec (`nanodist::predict::codec`: the compressed
//! reducers, CHOCO's compressors, DiLoCo's quantizers and DeMo's transform) on one GPT-2-small-sized
//! gradient (124M floats, the real tensor shapes), in GB/s of gradient processed, next to this machine's
//! memcpy bandwidth measured in the same run. World size 1, so this is the codecs' own compute, not the
//! network. `nanodist calibrate` measures the same codecs on one GPT-2-small block for a profile's
//! `[device.codec_gbps]`.
//!
//! The row `demo-dct` times DeMo's transform apart from the rest of its codec.
//!
//!     cargo run --release --example bench_reducers [-- --runs 3] [--only fp8 topk demo-dct ...]

use std::time::Instant;

/// The allocator nanodist itself runs on (src/main.rs): a codec's temporary buffers are reused between
/// steps there, where the system allocator would map and fault them in afresh at every call.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use nanodist::kernels::Segment;
use nanodist::predict::codec::{self, CodecName};
use rand::{Rng, SeedableRng};

/// GPT-2 small (nanoGPT, vocab 50304, context 1024): (rows, cols, is matrix).
fn gpt2_small() -> Vec<Segment> {
    let (d, v, c, l) = (768, 50304, 1024, 12);
    let mut shapes = vec![(v, d, true), (c, d, true), (d, 1, false), (d, 1, false)];
    for _ in 0..l {
        shapes.extend([
            (d, 1, false),
            (d, 1, false),
            (3 * d, d, true),
            (3 * d, 1, false),
            (d, d, true),
            (d, 1, false),
            (d, 1, false),
            (d, 1, false),
            (4 * d, d, true),
            (4 * d, 1, false),
            (d, 4 * d, true),
            (d, 1, false),
        ]);
    }
    Segment::from_shapes(&shapes)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let runs: usize = std::env::args()
        .skip_while(|a| a != "--runs")
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let tensors = gpt2_small();
    let numel: usize = tensors.iter().map(|t| t.len).sum();
    let gb = numel as f64 * 4.0 / 1e9;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let grad: Vec<f32> = (0..numel).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut work = grad.clone();
    // memcpy is measured again beside each codec: this machine's speed drifts between minutes, and a
    // ratio of two numbers taken seconds apart is the one to compare.
    let mut memcpy = || {
        let rates = (0..runs).map(|_| {
            let t = Instant::now();
            work.copy_from_slice(&grad);
            std::hint::black_box(&work);
            gb / t.elapsed().as_secs_f64()
        });
        median(rates.collect())
    };
    println!(
        "gradient: {numel} floats ({:.2} GB), {} threads",
        gb,
        rayon::current_num_threads()
    );
    println!(
        "| codec | measured as | GB/s | memcpy GB/s beside it | vs memcpy |\n|---|---|---|---|---|"
    );
    let args: Vec<String> = std::env::args().collect();
    let only: Vec<&str> = match args.iter().position(|a| a == "--only") {
        Some(i) => args[i + 1..].iter().map(String::as_str).collect(),
        None => Vec::new(),
    };
    for c in CodecName::ALL
        .into_iter()
        .filter(|c| only.is_empty() || only.contains(&c.key()))
    {
        let before = memcpy();
        let s = codec::measure(c, &tensors, runs)?;
        let m = (before + memcpy()) / 2.0;
        println!(
            "| {} | {} | {s:.2} | {m:.2} | {:.3} |",
            c.key(),
            c.measured_as(),
            s / m
        );
    }
    // DeMo's transform apart from its codec: the DCT of every chunk forward and back (dense).
    if only.is_empty() || only.contains(&"demo-dct") {
        let before = memcpy();
        let s = codec::measure_demo_transform(&tensors, runs)?;
        let m = (before + memcpy()) / 2.0;
        println!(
            "| demo-dct | DeMo's transform alone (each 64x64 chunk's DCT and its inverse) | {s:.2} | {m:.2} | {:.3} |",
            s / m
        );
    }
    Ok(())
}

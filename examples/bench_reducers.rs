//! Benchmark: compress + decompress throughput of each reducer on one GPT-2-small-sized gradient
//! (124M floats, the real tensor shapes), in GB/s of gradient processed, next to this machine's memcpy
//! bandwidth measured in the same run. World size 1, so this is the reducers' own compute (selection,
//! packing, low-rank products), not the network. Also compressed gossip's codecs (CHOCO): encode of
//! x - x_hat, then decode into the public copy and the memory.
//!
//!     cargo run --release --example bench_reducers [-- --runs 3]

use std::time::Instant;

use nanodist::comm::Solo;
use nanodist::config::backend::{PowerSgdConfig, RadiusConfig};
use nanodist::kernels::Segment;
use nanodist::sync::choco::{Codec, Compressor};
use nanodist::sync::compress::{powersgd::PowerSgd, radius::Radius, topk::TopK, Reducer};
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
    let memcpy = median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                work.copy_from_slice(&grad);
                std::hint::black_box(&work);
                gb / t.elapsed().as_secs_f64()
            })
            .collect(),
    );
    println!(
        "gradient: {numel} floats ({:.2} GB), {} threads",
        gb,
        rayon::current_num_threads()
    );
    println!("| operation | GB/s | vs memcpy |\n|---|---|---|");
    println!("| memcpy | {memcpy:.2} | 1.00 |");
    let radius = RadiusConfig {
        density: 0.01,
        threshold: 0,
        interval: 1_000_000,
        range: 0,
        ..RadiusConfig::default()
    };
    let power = |single| PowerSgdConfig {
        rank: 4,
        start_iter: 0,
        single_allreduce: single,
        ..PowerSgdConfig::default()
    };
    let cases: Vec<(&str, Box<dyn Reducer>, u64)> = vec![
        (
            "topk density 0.01 (select + pack + scatter)",
            Box::new(TopK::new(tensors.clone(), 0.01, true)),
            0,
        ),
        (
            "radius density 0.01, stable step (mask gather/scatter)",
            Box::new(Radius::new(tensors.clone(), radius.clone())),
            1,
        ),
        (
            "radius density 0.01, re-selection step",
            Box::new(Radius::new(tensors.clone(), radius)),
            0,
        ),
        (
            "powersgd rank 4 (3 all-reduces)",
            Box::new(PowerSgd::new(tensors.clone(), power(false), 0)),
            0,
        ),
        (
            "powersgd rank 4 (1 all-reduce)",
            Box::new(PowerSgd::new(tensors.clone(), power(true), 0)),
            0,
        ),
    ];
    let mut comm = Solo;
    for (name, mut r, first_timed) in cases {
        let mut speeds = Vec::new();
        for step in 0..first_timed + runs as u64 {
            work.copy_from_slice(&grad);
            let t = Instant::now();
            // Radius re-selects at step 0 only (interval is huge): later steps are stable steps.
            let s = if name.contains("re-selection") {
                0
            } else {
                step
            };
            if name.contains("re-selection") {
                r.load_state(Vec::new())?;
            }
            r.reduce(&mut comm, &mut work, s)?;
            if step >= first_timed {
                speeds.push(gb / t.elapsed().as_secs_f64());
            }
        }
        let s = median(speeds);
        println!("| {name} | {s:.2} | {:.3} |", s / memcpy);
    }
    let zero = vec![0.0f32; numel];
    let (mut hat, mut memory, mut msg) = (vec![0.0f32; numel], vec![0.0f32; numel], Vec::new());
    for c in [
        Compressor::TopK { density: 0.01 },
        Compressor::RandomK { density: 0.01 },
        Compressor::Qsgd {
            levels: 15,
            biased: true,
            bucket: 512,
        },
        Compressor::Sign,
    ] {
        let codec = Codec::new(c, &tensors, 0);
        let speeds = (0..runs as u64)
            .map(|step| {
                let t = Instant::now();
                codec.encode(&grad, &zero, step, 0, &mut msg);
                codec.decode(&msg, step, 0, |i, q| {
                    hat[i] += q;
                    memory[i] += 0.5 * q;
                });
                gb / t.elapsed().as_secs_f64()
            })
            .collect();
        let s = median(speeds);
        println!(
            "| choco {} (encode + decode) | {s:.2} | {:.3} |",
            c.describe(),
            s / memcpy
        );
    }
    Ok(())
}

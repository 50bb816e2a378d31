//! The compressors' own cost: which codec a plan runs, and its measured throughput on this machine, in
//! GB/s of f32 gradient through encode and decode on one rank (world 1, so no network). `calibrate`
//! writes the rates into a profile's `[device.codec_gbps]`, `predict` prices a compressing run's codec
//! with them, and `examples/bench_reducers.rs` prints them against memcpy on GPT-2-small shapes.

use std::time::Instant;

use anyhow::Result;

use crate::comm::Solo;
use crate::config::backend::{DemoConfig, PowerSgdConfig, Quantize, RadiusConfig};
use crate::kernels::{Lines, Segment};
use crate::plan::SyncPlan;
use crate::sync::choco::{absorb_span, Codec, Compressor};
use crate::sync::compress::sparseloco::SparseLoco;
use crate::sync::compress::{powersgd::PowerSgd, radius::Radius, topk::TopK, Reducer};
use crate::sync::plan::ReducerPlan;
use crate::sync::SyncBackend;

/// A codec, by the key a profile's `[device.codec_gbps]` gives its rate under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodecName {
    TopK,
    RandomK,
    Qsgd,
    Sign,
    Radius,
    PowerSgd,
    Bf16,
    Fp8,
    Uint8,
    Demo,
    SparseLoco,
}

impl CodecName {
    pub const ALL: [CodecName; 11] = [
        CodecName::TopK,
        CodecName::RandomK,
        CodecName::Qsgd,
        CodecName::Sign,
        CodecName::Radius,
        CodecName::PowerSgd,
        CodecName::Bf16,
        CodecName::Fp8,
        CodecName::Uint8,
        CodecName::Demo,
        CodecName::SparseLoco,
    ];

    /// The profile's key.
    pub fn key(self) -> &'static str {
        match self {
            CodecName::TopK => "topk",
            CodecName::RandomK => "randomk",
            CodecName::Qsgd => "qsgd",
            CodecName::Sign => "sign",
            CodecName::Radius => "radius",
            CodecName::PowerSgd => "powersgd",
            CodecName::Bf16 => "bf16",
            CodecName::Fp8 => "fp8",
            CodecName::Uint8 => "uint8",
            CodecName::Demo => "demo",
            CodecName::SparseLoco => "sparseloco",
        }
    }

    /// What `measure` runs, in a few words (the settings a profile's rate was measured at).
    pub fn measured_as(self) -> &'static str {
        match self {
            CodecName::TopK => "top-k 1% with error feedback (select, pack, scatter)",
            CodecName::RandomK => "CHOCO random-k 1% (encode + decode)",
            CodecName::Qsgd => "CHOCO QSGD 15 levels, buckets of 512 (encode + decode)",
            CodecName::Sign => "CHOCO sign (encode + decode)",
            CodecName::Radius => "Radius 1%, stable step (mask gather and scatter)",
            CodecName::PowerSgd => "PowerSGD rank 4 (products, orthogonalisation, error feedback)",
            CodecName::Bf16 => "bf16 all-reduce codec (encode, decode, requantize)",
            CodecName::Fp8 => "fp8 e4m3 row-wise all-reduce codec",
            CodecName::Uint8 => "uint8 min-max row-wise all-reduce codec",
            CodecName::Demo => "DeMo (momentum, chunked DCT, top-32 of 64x64, sign)",
            CodecName::SparseLoco => {
                "SparseLoCo 64 of each 4096, 2-bit values (select, quantize, pack, decode)"
            }
        }
    }
}

fn reducer_codec(r: &ReducerPlan) -> CodecName {
    match r {
        ReducerPlan::TopK(_) => CodecName::TopK,
        ReducerPlan::Radius { .. } => CodecName::Radius,
        ReducerPlan::PowerSgd { .. } => CodecName::PowerSgd,
        ReducerPlan::SparseLoco(_) => CodecName::SparseLoco,
    }
}

/// The codec a plan runs on the steps that communicate (None: it sends uncompressed f32).
pub fn of(plan: &SyncPlan) -> Option<CodecName> {
    match plan {
        SyncPlan::Compressed(r)
        | SyncPlan::Diloco {
            reducer: Some(r), ..
        } => Some(reducer_codec(r)),
        SyncPlan::Diloco { cfg, .. } => match cfg.quantize {
            Quantize::None => None,
            Quantize::Bf16 => Some(CodecName::Bf16),
            Quantize::Fp8 => Some(CodecName::Fp8),
            Quantize::Uint8 => Some(CodecName::Uint8),
        },
        SyncPlan::Gossip { choco, .. } => choco.as_ref().map(|c| match c.compressor {
            Compressor::TopK { .. } => CodecName::TopK,
            Compressor::RandomK { .. } => CodecName::RandomK,
            Compressor::Qsgd { .. } => CodecName::Qsgd,
            Compressor::Sign => CodecName::Sign,
        }),
        SyncPlan::Demo { .. } => Some(CodecName::Demo),
        SyncPlan::AllReduce { .. } | SyncPlan::Sparta { .. } => None,
    }
}

/// One GPT-2-small block's weights and biases (width 768): 7.1M floats, 28 MB, beyond a core's caches.
pub fn gpt2_block() -> Vec<Segment> {
    let d = 768;
    Segment::from_shapes(&[
        (3 * d, d, true),
        (3 * d, 1, false),
        (d, d, true),
        (d, 1, false),
        (4 * d, d, true),
        (4 * d, 1, false),
        (d, 4 * d, true),
        (d, 1, false),
    ])
}

/// `codec`'s median throughput over `runs` timed calls (after one untimed) on a gradient laid out as
/// `tensors`: GB/s of f32 gradient, 4 bytes a parameter.
pub fn measure(codec: CodecName, tensors: &[Segment], runs: usize) -> Result<f64> {
    timed(passes(codec, tensors), tensors, runs)
}

/// DeMo's transform alone (`Demo::transform_round_trip`: every chunk's 2-D DCT and its inverse of every
/// coefficient), timed as `measure` times a codec: GB/s of f32 gradient.
pub fn measure_demo_transform(tensors: &[Segment], runs: usize) -> Result<f64> {
    let demo = crate::sync::demo::Demo::new(Box::new(Solo), DemoConfig::default(), 0.0, tensors);
    timed(
        Box::new(move |g, _| demo.transform_round_trip(g)),
        tensors,
        runs,
    )
}

/// The median throughput of `pass` over `runs` timed calls (after one untimed) on a gradient laid out as
/// `tensors`.
fn timed(mut pass: Pass, tensors: &[Segment], runs: usize) -> Result<f64> {
    let numel: usize = tensors.iter().map(|t| t.len).sum();
    // Spread evenly over +-0.005 (in f64: in f32 the fraction of i x 0.618 runs out of bits past 2^24 and
    // most of a model's gradient would be one value).
    let grad: Vec<f32> = (0..numel)
        .map(|i| (((i as f64 * 0.618_033_988_749_895).fract() - 0.5) * 1e-2) as f32)
        .collect();
    let mut work = grad.clone();
    let mut times = Vec::with_capacity(runs);
    for step in 0..=runs as u64 {
        work.copy_from_slice(&grad);
        let t = Instant::now();
        pass(&mut work, step)?;
        if step > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(numel as f64 * 4.0 / super::calibrate::median(times) / 1e9)
}

/// One encode and decode of `codec` over a gradient, as a closure of (gradient, step).
type Pass = Box<dyn FnMut(&mut [f32], u64) -> Result<()>>;

fn passes(codec: CodecName, tensors: &[Segment]) -> Pass {
    let t = tensors.to_vec();
    match codec {
        CodecName::TopK => reducer(Box::new(TopK::new(t, 0.01, true)), false),
        CodecName::Radius => {
            let cfg = RadiusConfig {
                interval: u64::MAX,
                threshold: 0,
                range: 0,
                ..RadiusConfig::default()
            };
            // Step 0 selects the mask; the untimed first call runs it, the timed ones are stable steps.
            reducer(Box::new(Radius::new(t, cfg)), true)
        }
        CodecName::PowerSgd => {
            let cfg = PowerSgdConfig {
                rank: 4,
                start_iter: 0,
                ..PowerSgdConfig::default()
            };
            reducer(Box::new(PowerSgd::new(t, cfg, 0)), false)
        }
        CodecName::RandomK => choco(Compressor::RandomK { density: 0.01 }, &t),
        CodecName::Qsgd => choco(
            Compressor::Qsgd {
                levels: 15,
                biased: true,
                bucket: 512,
            },
            &t,
        ),
        CodecName::Sign => choco(Compressor::Sign, &t),
        CodecName::Bf16 => quantized(Quantize::Bf16, &t),
        CodecName::Fp8 => quantized(Quantize::Fp8, &t),
        CodecName::Uint8 => quantized(Quantize::Uint8, &t),
        CodecName::Demo => {
            let mut demo =
                crate::sync::demo::Demo::new(Box::new(Solo), DemoConfig::default(), 0.0, &t);
            Box::new(move |g, step| demo.reduce_grads(g, step, 1e-3))
        }
        CodecName::SparseLoco => {
            let cfg = crate::config::backend::SparseLocoConfig::default();
            reducer(Box::new(SparseLoco::new(t, &cfg)), false)
        }
    }
}

/// A compressed reducer's `reduce` at world 1; `stable`: every timed call is step 1 (Radius's kept mask).
fn reducer(mut r: Box<dyn Reducer>, stable: bool) -> Pass {
    let mut comm = Solo;
    Box::new(move |g, step| {
        let step = if stable { step.min(1) } else { step };
        r.reduce(&mut comm, g, step).map(|_| ())
    })
}

/// CHOCO's codec: the message of the gradient against a zero public copy, then its decoding into the
/// public copy and the memory, as a gossip round does with each message.
fn choco(c: Compressor, tensors: &[Segment]) -> Pass {
    let codec = Codec::new(c, tensors, 0);
    let numel: usize = tensors.iter().map(|t| t.len).sum();
    // The public copy x_hat the message encodes x - x_hat against, zeros in pages of their own: memory never
    // written reads as the OS's one shared zero page, from the cache, where CHOCO's x_hat is read from memory.
    let zero = crate::flat::mapped_zeros(numel);
    let (mut hat, mut memory, mut msg) = (vec![0.0f32; numel], vec![0.0f32; numel], Vec::new());
    Box::new(move |g, step| {
        codec.encode(g, &zero, step, 0, &mut msg);
        let ahead = [Lines::of(&hat), Lines::of(&memory)];
        codec.decode_spans(&msg, step, 0, &ahead, |at, q| {
            let span = at..at + q.len();
            let (h, m) = (&mut hat[span.clone()], &mut memory[span]);
            absorb_span(Some(h), m, q, 0.5);
        });
        Ok(())
    })
}

/// DiLoCo's quantized all-reduce of the pseudo-gradient at world 1, by rows (matrices' rows, vectors whole).
fn quantized(q: Quantize, tensors: &[Segment]) -> Pass {
    let rows = crate::sync::diloco::rows_of(tensors);
    let mut comm = Solo;
    let mut scratch = crate::sync::quantize::Scratch::default();
    Box::new(move |g, _| {
        crate::sync::quantize::all_reduce_mean(&mut comm, g, &rows, q, &mut scratch)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every codec runs its real pass and reports a finite rate; a bigger gradient takes longer.
    #[test]
    fn every_codec_measures_a_finite_rate() {
        let small = Segment::from_shapes(&[(64, 128, true), (64, 1, false), (128, 64, true)]);
        for c in CodecName::ALL {
            let r = measure(c, &small, 2).unwrap();
            assert!(r.is_finite() && r > 0.0, "{c:?}: {r}");
        }
        let r = measure_demo_transform(&small, 2).unwrap();
        assert!(r.is_finite() && r > 0.0, "DeMo's transform: {r}");
    }

    /// A plan's codec: what its steps compress with.
    #[test]
    fn plans_name_their_codec() {
        use crate::config::backend::DilocoConfig;
        let d = |q| SyncPlan::Diloco {
            cfg: DilocoConfig {
                quantize: q,
                ..DilocoConfig::default()
            },
            reducer: None,
        };
        assert_eq!(of(&d(Quantize::None)), None);
        assert_eq!(of(&d(Quantize::Fp8)), Some(CodecName::Fp8));
        assert_eq!(of(&SyncPlan::AllReduce { bucket_elems: 1 }), None);
        let demo = SyncPlan::Demo {
            cfg: DemoConfig::default(),
            weight_decay: 0.0,
            clip: 0.0,
        };
        assert_eq!(of(&demo), Some(CodecName::Demo));
    }
}

//! CHOCO's unit tests: codecs, channels, the consensus simulation and gamma tuning.

use super::channels::*;
use super::codec::*;
use super::tuning::*;
use super::*;
use crate::config::Topology;
use crate::kernels;
use crate::sync::compress::k_of;
use crate::sync::topology;

const COMPRESSORS: [Compressor; 5] = [
    Compressor::TopK { density: 0.1 },
    Compressor::RandomK { density: 0.1 },
    Compressor::Qsgd {
        levels: 3,
        biased: true,
        bucket: 16,
    },
    Compressor::Qsgd {
        levels: 15,
        biased: false,
        bucket: 0,
    },
    Compressor::Sign,
];

fn topologies() -> Vec<(&'static str, Vec<Round>)> {
    vec![
        (
            "complete",
            topology::rounds(Topology::Complete, 8, 8).unwrap(),
        ),
        ("ring", topology::rounds(Topology::Ring, 8, 8).unwrap()),
        ("exp", topology::rounds(Topology::Exp, 8, 8).unwrap()),
        (
            "alternating-exp-ring",
            topology::rounds(Topology::AlternatingExpRing, 8, 2).unwrap(),
        ),
    ]
}

fn shapes() -> Vec<Segment> {
    Segment::from_shapes(&[(7, 9, true), (1, 13, false), (3, 40, true)])
}

#[test]
fn messages_decode_to_what_the_compressor_defines() {
    let tensors = shapes();
    let n: usize = tensors.iter().map(|t| t.len).sum();
    let x = &random_vectors(1, n, 5)[0];
    let zero = vec![0.0; n];
    for c in COMPRESSORS {
        let codec = Codec::new(c, &tensors, 11);
        let mut msg = Vec::new();
        codec.encode(x, &zero, 3, 2, &mut msg);
        assert_eq!(msg.len(), codec.words(), "{c:?}");
        let mut q = vec![0.0f32; n];
        let mut seen = 0;
        codec.decode(&msg, 3, 2, |i, v| {
            q[i] += v;
            seen += 1;
        });
        for t in &tensors {
            let (u, q) = (&x[t.range()], &q[t.range()]);
            let d = t.len as f32;
            match c {
                Compressor::TopK { density } => {
                    let k = k_of(density, t.len);
                    let kept: Vec<usize> = (0..t.len).filter(|&i| q[i] != 0.0).collect();
                    assert_eq!(kept.len(), k);
                    let floor = kept.iter().map(|&i| u[i].abs()).fold(f32::MAX, f32::min);
                    for i in 0..t.len {
                        if q[i] != 0.0 {
                            assert_eq!(q[i], u[i]);
                        } else {
                            assert!(u[i].abs() <= floor);
                        }
                    }
                }
                Compressor::RandomK { density } => {
                    let kept = (0..t.len).filter(|&i| q[i] != 0.0).count();
                    assert_eq!(kept, k_of(density, t.len));
                    assert!((0..t.len).all(|i| q[i] == 0.0 || q[i] == u[i]));
                }
                Compressor::Qsgd {
                    levels,
                    biased,
                    bucket,
                } => {
                    let s = levels as f32;
                    let b = if bucket == 0 { t.len } else { bucket };
                    for i in 0..t.len {
                        let r = (i / b * b)..((i / b + 1) * b).min(t.len);
                        let norm = u[r.clone()].iter().map(|v| v * v).sum::<f32>().sqrt();
                        let nb = r.len() as f32;
                        let tau = if biased {
                            1.0 + (nb / (s * s)).min(nb.sqrt() / s)
                        } else {
                            1.0
                        };
                        // |q| tau s / norm is the level: floor or ceil of s |u| / norm, same sign.
                        let level = q[i].abs() * tau * s / norm;
                        let lf = s * u[i].abs() / norm;
                        assert!((level - level.round()).abs() < 1e-3, "{c:?}: level {level}");
                        assert!(level.round() == lf.floor() || level.round() == lf.ceil());
                        assert!(q[i] == 0.0 || q[i].signum() == u[i].signum());
                    }
                }
                Compressor::Sign => {
                    let scale = u.iter().map(|v| v.abs()).sum::<f32>() / d;
                    for i in 0..t.len {
                        assert!((q[i].abs() - scale).abs() < 1e-6 * scale);
                        assert_eq!(q[i] < 0.0, u[i] < 0.0);
                    }
                }
            }
        }
        // Random draws depend on the step and the sender.
        let mut other = Vec::new();
        codec.encode(x, &zero, 4, 2, &mut other);
        if matches!(c, Compressor::TopK { .. } | Compressor::Sign) {
            assert_eq!(msg, other, "{c:?}: deterministic");
        }
        assert!(seen > 0);
    }
}

#[test]
fn unbiased_qsgd_is_unbiased() {
    let tensors = Segment::from_shapes(&[(1, 50, false)]);
    let x = &random_vectors(1, 50, 9)[0];
    let zero = vec![0.0; 50];
    let codec = Codec::new(
        Compressor::Qsgd {
            levels: 2,
            biased: false,
            bucket: 0,
        },
        &tensors,
        1,
    );
    let mut mean = vec![0.0f64; 50];
    let draws = 4000;
    let mut msg = Vec::new();
    for step in 0..draws {
        codec.encode(x, &zero, step, 0, &mut msg);
        codec.decode(&msg, step, 0, |i, q| mean[i] += q as f64 / draws as f64);
    }
    let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt() as f64;
    for (m, &u) in mean.iter().zip(x) {
        // Each draw's spread is at most norm / s: 5 standard errors.
        assert!((m - u as f64).abs() < 5.0 * norm / 2.0 / (draws as f64).sqrt());
    }
}

#[test]
fn the_consensus_keeps_the_average_on_every_topology_with_every_compressor() {
    let tensors = shapes();
    let n: usize = tensors.iter().map(|t| t.len).sum();
    for (name, rounds) in topologies() {
        for c in COMPRESSORS {
            let codec = Codec::new(c, &tensors, 3);
            let mut sim = Simulation::new(rounds.clone(), codec, 0.7, n).unwrap();
            let mut xs = random_vectors(8, n, 1);
            let before = mean_of(&xs);
            for step in 0..25 {
                sim.step(&mut xs, step);
            }
            let after = mean_of(&xs);
            let drift = before
                .iter()
                .zip(&after)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(drift < 1e-5, "{name} {c:?}: the average moved by {drift}");
        }
    }
}

fn distance(xs: &[Vec<f32>]) -> f64 {
    let m = mean_of(xs);
    xs.iter()
        .map(|x| {
            x.iter()
                .zip(&m)
                .map(|(&a, &b)| (a as f64 - b).powi(2))
                .sum::<f64>()
                .sqrt()
        })
        .sum::<f64>()
        / xs.len() as f64
}

#[test]
fn consensus_distance_shrinks_after_a_perturbation_with_every_compressor() {
    let tensors = shapes();
    let n: usize = tensors.iter().map(|t| t.len).sum();
    for (name, rounds) in topologies()
        .into_iter()
        .filter(|(n, _)| *n == "ring" || *n == "exp")
    {
        for c in COMPRESSORS {
            let gamma = tune_gamma(&rounds, c, 4).unwrap();
            let codec = Codec::new(c, &tensors, 3);
            let mut sim = Simulation::new(rounds.clone(), codec, gamma as f32, n).unwrap();
            // Equal replicas (after some public-copy traffic), then one is perturbed.
            let mut xs = vec![random_vectors(1, n, 2).remove(0); 8];
            for step in 0..50 {
                sim.step(&mut xs, step);
            }
            for (v, p) in xs[3].iter_mut().zip(&random_vectors(1, n, 7)[0]) {
                *v += p;
            }
            let start = distance(&xs);
            for step in 50..650 {
                sim.step(&mut xs, step);
            }
            let end = distance(&xs);
            assert!(
                end < 0.2 * start,
                "{name} {c:?} (gamma {gamma}): consensus distance {start} -> {end}"
            );
        }
    }
}

#[test]
fn with_every_entry_sent_and_gamma_one_the_consensus_is_plain_gossip() {
    let tensors = shapes();
    let n: usize = tensors.iter().map(|t| t.len).sum();
    for (name, rounds) in topologies() {
        let codec = Codec::new(Compressor::TopK { density: 1.0 }, &tensors, 3);
        let mut sim = Simulation::new(rounds.clone(), codec, 1.0, n).unwrap();
        let mut xs = random_vectors(8, n, 1);
        for step in 0..6 {
            let round = &rounds[step % rounds.len()];
            let w = topology::mixing_matrix(round, 8).unwrap();
            let want: Vec<Vec<f64>> = (0..8)
                .map(|i| {
                    (0..n)
                        .map(|e| (0..8).map(|j| w[i][j] * xs[j][e] as f64).sum())
                        .collect()
                })
                .collect();
            sim.step(&mut xs, step as u64);
            for (x, y) in xs.iter().zip(&want) {
                for (a, b) in x.iter().zip(y) {
                    assert!(
                        (*a as f64 - b).abs() < 1e-5,
                        "{name} step {step}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn channels_per_topology_are_the_groups_a_rank_meets() {
    let count = |topo, world, per_node| {
        let rounds = topology::rounds(topo, world, per_node).unwrap();
        Channels::new(&rounds, 0, 1).unwrap().count()
    };
    assert_eq!(count(Topology::Complete, 8, 8), 1);
    assert_eq!(count(Topology::Ring, 8, 8), 2);
    assert_eq!(count(Topology::Ring, 2, 2), 1);
    assert_eq!(count(Topology::Exp, 8, 8), 3);
    assert_eq!(count(Topology::Exp, 512, 512), 9);
    assert_eq!(count(Topology::AlternatingExpRing, 16, 4), 3);
}

#[test]
fn tuning_is_deterministic_and_picks_a_small_step_for_aggressive_compression() {
    let rounds = topology::rounds(Topology::Ring, 8, 8).unwrap();
    let a = tune_gamma(&rounds, Compressor::TopK { density: 0.01 }, 1).unwrap();
    let b = tune_gamma(&rounds, Compressor::TopK { density: 0.01 }, 1).unwrap();
    assert_eq!(a, b);
    let dense = tune_gamma(&rounds, Compressor::TopK { density: 1.0 }, 1).unwrap();
    assert!(a < dense, "top-1% {a} vs every entry {dense}");
    assert!(dense > 0.5, "every entry sent: gamma {dense}");
}

#[test]
fn the_simulations_group_sums_follow_the_backends_consensus() {
    // The two differ only in the order of f32 additions into the memory (1e-7 relative a step). Sparse
    // messages stay within 1e-4 after 30 steps; QSGD's stochastic rounding and sign's bits are
    // thresholds, and an entry within rounding of one can flip (a jump of a fraction of a level), so
    // there the tuning's error is compared (within 1%, or 1e-6 of the start's near f32's floor). A wrong
    // weight or a missed member is O(1).
    let tensors = shapes();
    let n: usize = tensors.iter().map(|t| t.len).sum();
    for (name, rounds) in topologies() {
        for c in COMPRESSORS {
            let codec = Codec::new(c, &tensors, 3);
            let mut fast = Simulation::new(rounds.clone(), codec.clone(), 0.4, n).unwrap();
            let mut reference = Simulation::new(rounds.clone(), codec, 0.4, n).unwrap();
            let (mut a, mut b) = (random_vectors(8, n, 1), random_vectors(8, n, 1));
            let start = fast.error(&a);
            for step in 0..30 {
                fast.step(&mut a, step);
                reference.step_per_member(&mut b, step);
            }
            let (ea, eb) = (fast.error(&a), reference.error(&b));
            let tolerance = 1e-2 * eb + 1e-6 * start;
            assert!(
                (ea - eb).abs() < tolerance,
                "{name} {c:?}: error {ea} vs {eb}"
            );
            if fast.codec.sparse() {
                let gap = a
                    .iter()
                    .flatten()
                    .zip(b.iter().flatten())
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0f32, f32::max);
                assert!(gap < 1e-4, "{name} {c:?}: the simulations differ by {gap}");
            }
        }
    }
}

#[test]
fn tuning_on_the_group_sums_picks_the_backends_consensus_step() {
    // The grid's points are a factor 1.44 apart, and rounding does not move the pick, except for sign:
    // its consensus stalls on a noisy plateau (on exp, gamma 1's final error moves 7x between the two
    // orders of additions), so its pick is a draw among near-equal points; its steps are checked above.
    for (name, rounds) in topologies() {
        for c in COMPRESSORS.into_iter().filter(|c| *c != Compressor::Sign) {
            let fast = tune_gamma(&rounds, c, 4).unwrap();
            let reference = tune_with(&rounds, c, 4, Simulation::step_per_member).unwrap();
            assert_eq!(fast, reference, "{name} {c:?}");
        }
    }
}

/// The encoder writes every word of its message: one into last step's buffer, full of other words,
/// equals one into an empty buffer, for every compressor and tensor lengths that leave partial words.
#[test]
fn messages_overwrite_the_buffer_they_are_written_to() {
    let tensors = span_shapes();
    let n: usize = tensors.iter().map(|t| t.len).sum();
    let (x, hat) = (&random_vectors(1, n, 8)[0], &random_vectors(1, n, 9)[0]);
    for c in COMPRESSORS {
        let codec = Codec::new(c, &tensors, 5);
        let mut want = Vec::new();
        codec.encode(x, hat, 2, 1, &mut want);
        for fill in [f32::NAN, f32::from_bits(u32::MAX), -1.0] {
            let mut msg = vec![fill; codec.words()];
            codec.encode(x, hat, 2, 1, &mut msg);
            assert_eq!(bits(&msg), bits(&want), "{c:?} over {fill}");
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Tensors whose lengths straddle the sign encoding's chunks and the dense decoding's spans.
fn span_shapes() -> Vec<Segment> {
    let lens = [1, 31, 33, SPAN - 1, SPAN, SPAN + 1, 3 * SPAN + 517];
    Segment::from_shapes(&lens.map(|n| (n, 1, false)))
}

/// Sign's message as written before it was formed a chunk at a time: u = x - hat whole, its l1 norm by
/// `block_strided_sum`, its signs folded 32 to a word.
fn sign_by_reference(codec: &Codec, x: &[f32], hat: &[f32]) -> Vec<f32> {
    let mut msg = Vec::new();
    for &(off, len) in &codec.tensors {
        let u: Vec<f32> = (off..off + len).map(|i| x[i] - hat[i]).collect();
        let l1 = kernels::block_strided_sum(&u, |v| v.abs() as f64);
        msg.push((l1 / len.max(1) as f64) as f32);
        for vals in u.chunks(32) {
            let bits = vals.iter().enumerate();
            let bits = bits.fold(0u32, |b, (i, &v)| b | u32::from(v < 0.0) << i);
            msg.push(f32::from_bits(bits));
        }
    }
    msg
}

/// QSGD's message as written before it was formed a chunk at a time: u = x - hat whole, each bucket's
/// norm by `block_strided_sum`, and for its rounding half a `rng.next_u32()` per entry (a bucket's
/// entries 2j and 2j + 1 the low and high halves of its word j), packed a code at a time.
fn qsgd_by_reference(codec: &Codec, x: &[f32], hat: &[f32], step: u64, rank: usize) -> Vec<f32> {
    use rand::RngCore;
    let Compressor::Qsgd { levels, bucket, .. } = codec.compressor else {
        unreachable!()
    };
    let mut msg = vec![0.0f32; codec.words()];
    for (t, &(off, len)) in codec.tensors.iter().enumerate() {
        let u: Vec<f32> = (off..off + len).map(|i| x[i] - hat[i]).collect();
        let mut rng = codec.rng(super::codec::QSGD_KEY, step, rank, t);
        let ranges = buckets(len, bucket);
        let part = &mut msg[codec.parts[t]..codec.parts[t + 1]];
        let (norms, codes) = part.split_at_mut(ranges.len());
        let (bits, s) = (qsgd_bits(levels), levels as f32);
        let mut w = crate::sync::bits::BitWriter::new(codes);
        for (norm_out, r) in norms.iter_mut().zip(ranges) {
            let norm = kernels::block_strided_sum(&u[r.clone()], |v| (v as f64) * (v as f64));
            let norm = norm.sqrt() as f32;
            *norm_out = norm;
            let mut word = 0;
            for (j, &v) in u[r].iter().enumerate() {
                if j % 2 == 0 {
                    word = rng.next_u32();
                }
                let uniform = (word >> (16 * (j % 2)) & 0xffff) as f32 / 65536.0;
                let lf = if norm > 0.0 && norm.is_finite() {
                    v.abs() * (s / norm)
                } else {
                    0.0
                };
                let lo = lf.min(s).floor() as u32;
                let up = uniform < lf - lo as f32;
                let level = (lo + u32::from(up)).min(levels);
                w.put(level | u32::from(v < 0.0) << (bits - 1), bits);
            }
        }
    }
    msg
}

/// A dense message's values one entry at a time, read with a `BitReader` from the format's definition.
fn dense_by_reference(codec: &Codec, msg: &[f32]) -> Vec<f32> {
    let mut out = Vec::new();
    for (t, &(_, len)) in codec.tensors.iter().enumerate() {
        let part = &msg[codec.parts[t]..codec.parts[t + 1]];
        match codec.compressor {
            Compressor::Sign => out.extend((0..len).map(|i| {
                let neg = part[1 + i / 32].to_bits() >> (i % 32) & 1 == 1;
                if neg {
                    -part[0]
                } else {
                    part[0]
                }
            })),
            Compressor::Qsgd {
                levels,
                biased,
                bucket,
            } => {
                let ranges = buckets(len, bucket);
                let (norms, codes) = part.split_at(ranges.len());
                let (bits, mut r) = (qsgd_bits(levels), crate::sync::bits::BitReader::new(codes));
                for (norm, range) in norms.iter().zip(ranges) {
                    let unit = norm / levels as f32 / qsgd_tau(levels, range.len(), biased);
                    for _ in range {
                        let code = r.get(bits);
                        let q = unit * (code & ((1 << (bits - 1)) - 1)) as f32;
                        out.push(if code >> (bits - 1) == 1 { -q } else { q });
                    }
                }
            }
            _ => unreachable!(),
        }
    }
    out
}

/// The chunked sign encoding equals the whole-tensor reference bit for bit, and the dense decoding's
/// spans (sign, QSGD) tile every tensor in order with the reference's values, bit for bit, and
/// `decode`'s entries with them.
#[test]
fn dense_messages_encode_and_decode_by_spans_as_the_reference_does() {
    // Long tensors (spans of SPAN), and short ones whose spans are cut to the longest's sign words.
    let short = Segment::from_shapes(&[(5, 1, false), (62, 1, false), (1, 1, false)]);
    for tensors in [span_shapes(), short] {
        dense_messages_match_the_reference(&tensors);
    }
}

fn dense_messages_match_the_reference(tensors: &[Segment]) {
    let n: usize = tensors.iter().map(|t| t.len).sum();
    let mut v = random_vectors(2, n, 9);
    // Zero differences, one large enough that s |u| overflows, and a NaN in a later bucket.
    for (i, a) in [(2, 0.0), (3, 0.0), (40, 3e38), (n - 1, f32::NAN)] {
        if i < n {
            (v[0][i], v[1][i]) = (a, 0.0);
        }
    }
    let (x, hat) = (&v[0], &v[1]);
    let qsgd = |bucket| Compressor::Qsgd {
        levels: 15,
        biased: true,
        bucket,
    };
    let levels = |levels, biased| Compressor::Qsgd {
        levels,
        biased,
        bucket: 512,
    };
    let qsgds = [
        qsgd(512),
        qsgd(0),
        qsgd(100),
        qsgd(37),
        levels(1, false),
        levels(65535, true),
    ];
    for c in std::iter::once(Compressor::Sign).chain(qsgds) {
        let codec = Codec::new(c, tensors, 5);
        let mut msg = Vec::new();
        codec.encode(x, hat, 7, 1, &mut msg);
        let want = match c {
            Compressor::Sign => sign_by_reference(&codec, x, hat),
            _ => qsgd_by_reference(&codec, x, hat, 7, 1),
        };
        assert_eq!(bits(&msg), bits(&want), "{c:?}: the message");
        let want = dense_by_reference(&codec, &msg);
        let mut got = Vec::new();
        codec.decode_spans(&msg, 7, 1, &[], |at, q| {
            assert_eq!(at, got.len(), "{c:?}: spans in order");
            assert!(!q.is_empty() && q.len() <= SPAN);
            got.extend_from_slice(q);
        });
        assert_eq!(bits(&got), bits(&want), "{c:?}");
        let mut each = vec![f32::NAN; n];
        codec.decode(&msg, 7, 1, |i, q| each[i] = q);
        assert_eq!(bits(&each), bits(&want), "{c:?}");
    }
}

/// The QSGD and sign kernels (kernels/reducers.cu, run on the host by `kernels::emulate` with the grids
/// `crate::cuda` launches) write the host codec's message bit for bit, u formed as the GPU path forms it
/// (`scaled_copy` of hat by -1, then `ef_accumulate` of x); and their absorb kernels leave a channel's
/// public copy and memory as the host's `Channels::absorb` does, for the sender itself and for another
/// member.
#[test]
fn the_dense_codecs_kernels_give_the_hosts_messages_and_channels() {
    use crate::kernels::emulate::{per_element, Arg, Emulator, Source};
    let Some(e) = Emulator::get(Source::Reducers) else {
        return;
    };
    let tensors = Segment::from_shapes(&[(40, 25, true), (7, 1, false), (1100, 1, false)]);
    let n: usize = tensors.iter().map(|t| t.len).sum();
    let mut v = random_vectors(4, n, 21);
    // Zero differences, a zero bucket, one entry large enough that s |u| overflows.
    for i in [2, 3, 40].into_iter().chain(1007..1023) {
        (v[0][i], v[1][i]) = (if i == 40 { 3e38 } else { 0.0 }, 0.0);
    }
    let (x, hat) = (&v[0], &v[1]);
    let mut u = Arg::F32s(vec![0.0; n]);
    let mut args = [
        u,
        Arg::F32s(hat.clone()),
        Arg::U32(n as u32),
        Arg::F32(-1.0),
    ];
    e.launch("scaled_copy", per_element(n), &mut args);
    [u, ..] = args;
    let mut args = [u, Arg::F32s(x.clone()), Arg::U32(n as u32)];
    e.launch("ef_accumulate", per_element(n), &mut args);
    let u = args[0].f32s().to_vec();
    let qsgd = |levels, biased, bucket| Compressor::Qsgd {
        levels,
        biased,
        bucket,
    };
    let compressors = [
        qsgd(15, true, 512),
        qsgd(3, false, 16),
        qsgd(16, true, 0),
        qsgd(255, true, 100),
        qsgd(7, true, 37),
        qsgd(65535, false, 512),
        Compressor::Sign,
    ];
    for c in compressors {
        let codec = Codec::new(c, &tensors, 5);
        let mut msg = Vec::new();
        codec.encode(x, hat, 7, 1, &mut msg);
        let dev = encode_emulated(e, &codec, &u, 7, 1);
        assert_eq!(bits(&dev), bits(&msg), "{c:?}: the message");
        for (w, own) in [(0.625f32, true), (0.1875, false)] {
            let (mut h, mut m) = (v[2].clone(), v[3].clone());
            codec.decode_spans(&msg, 7, 1, &[], |at, q| {
                for (i, &q) in (at..).zip(q) {
                    if own {
                        h[i] += q;
                    }
                    m[i] += w * q;
                }
            });
            let (dh, dm) = absorb_emulated(e, &codec, &msg, (&v[2], &v[3]), (w, own));
            assert_eq!(
                (bits(&dh), bits(&dm)),
                (bits(&h), bits(&m)),
                "{c:?}, own {own}"
            );
        }
    }
}

/// The message of `u` (x - hat) by the emulated `qsgd_encode` or `sign_encode`, tensor by tensor, as
/// the GPU path (`Choco::encode_device`) launches them.
fn encode_emulated(
    e: &crate::kernels::emulate::Emulator,
    codec: &Codec,
    u: &[f32],
    step: u64,
    rank: usize,
) -> Vec<f32> {
    use crate::kernels::emulate::Arg;
    let mut msg = vec![0.0f32; codec.words()];
    for (t, &(off, len)) in codec.tensors.iter().enumerate() {
        let part = &mut msg[codec.parts[t]..codec.parts[t + 1]];
        let ut = Arg::F32s(u[off..off + len].to_vec());
        match codec.compressor {
            Compressor::Qsgd { levels, bucket, .. } => {
                let nb = buckets(len, bucket).len();
                let mut args = [
                    ut,
                    Arg::U32(len as u32),
                    Arg::U32(bucket_len(len, bucket) as u32),
                    Arg::U32s(codec.qsgd_key(step, rank).to_vec()),
                    Arg::U64(t as u64),
                    Arg::U32(levels),
                    Arg::U32(qsgd_bits(levels)),
                    Arg::F32s(vec![0.0; nb]),
                    Arg::F32s(vec![0.0; part.len() - nb]),
                ];
                e.launch("qsgd_encode", (nb as u32, 1), &mut args);
                part[..nb].copy_from_slice(args[7].f32s());
                part[nb..].copy_from_slice(args[8].f32s());
            }
            _ => {
                let mut args = [ut, Arg::U32(len as u32), Arg::F32s(vec![0.0; part.len()])];
                e.launch("sign_encode", (1, 1), &mut args);
                part.copy_from_slice(args[2].f32s());
            }
        }
    }
    msg
}

/// The channel (hat, memory) after the emulated `qsgd_absorb` or `sign_absorb` of `msg` from a member
/// of weight `w` (`own`: this rank's message), tensor by tensor, as `absorb_device` launches them.
fn absorb_emulated(
    e: &crate::kernels::emulate::Emulator,
    codec: &Codec,
    msg: &[f32],
    (hat, memory): (&[f32], &[f32]),
    (w, own): (f32, bool),
) -> (Vec<f32>, Vec<f32>) {
    use crate::kernels::emulate::{per_element, Arg};
    let (mut h, mut m) = (Arg::F32s(hat.to_vec()), Arg::F32s(memory.to_vec()));
    for (t, &(off, len)) in codec.tensors.iter().enumerate() {
        let part = &msg[codec.parts[t]..codec.parts[t + 1]];
        let mut args = match codec.compressor {
            Compressor::Qsgd {
                levels,
                biased,
                bucket,
            } => {
                let ranges = buckets(len, bucket);
                let b = bucket_len(len, bucket);
                let last = ranges.last().map_or(0, |r| r.len());
                let (norms, codes) = part.split_at(ranges.len());
                vec![
                    h,
                    m,
                    Arg::U32(off as u32),
                    Arg::U32(len as u32),
                    Arg::U32(b as u32),
                    Arg::F32s(norms.to_vec()),
                    Arg::F32s(codes.to_vec()),
                    Arg::U32(levels),
                    Arg::U32(qsgd_bits(levels)),
                    Arg::F32(qsgd_tau(levels, b.min(len), biased)),
                    Arg::F32(qsgd_tau(levels, last, biased)),
                    Arg::F32(w),
                    Arg::U32(own.into()),
                ]
            }
            _ => vec![
                h,
                m,
                Arg::U32(off as u32),
                Arg::U32(len as u32),
                Arg::F32s(part.to_vec()),
                Arg::F32(w),
                Arg::U32(own.into()),
            ],
        };
        let name = match codec.compressor {
            Compressor::Qsgd { .. } => "qsgd_absorb",
            _ => "sign_absorb",
        };
        e.launch(name, per_element(len), &mut args);
        let mut rest = args.into_iter();
        (h, m) = (rest.next().unwrap(), rest.next().unwrap());
    }
    (h.f32s().to_vec(), m.f32s().to_vec())
}

/// `absorb_span`, compiled for the machine's vectors, leaves the public copy and the memory as the
/// plain loop does, bit for bit, with the public copy (the rank's own message) and without.
#[test]
fn absorbing_a_span_adds_as_the_plain_loop_does() {
    let v = random_vectors(3, 1037, 4);
    for (w, own) in [(0.625f32, true), (0.1875, false), (1.0 / 3.0, true)] {
        let (mut h, mut m) = (v[0].clone(), v[1].clone());
        absorb_span(own.then_some(&mut h[..]), &mut m, &v[2], w);
        let (mut want_h, mut want_m) = (v[0].clone(), v[1].clone());
        for (i, &q) in v[2].iter().enumerate() {
            if own {
                want_h[i] += q;
            }
            want_m[i] += w * q;
        }
        assert_eq!(bits(&h), bits(&want_h), "w {w}, own {own}");
        assert_eq!(bits(&m), bits(&want_m), "w {w}, own {own}");
    }
}

/// A channel absorbs the dense formats' messages span by span, all members' at once with the consensus
/// step (the sparse ones tensor by tensor), and leaves x, the public copy and the memory as a pass per
/// member over the whole model and then the step's pass do, bit for bit: groups of 2 (exp) and of 8
/// (complete), the rank first, inside and last in its group, tensors and QSGD buckets that straddle the
/// spans, the channel's second meeting.
#[test]
fn channels_absorb_as_a_pass_per_member_then_the_step() {
    let tensors = span_shapes();
    let n: usize = tensors.iter().map(|t| t.len).sum();
    let qsgd = |levels, bucket| Compressor::Qsgd {
        levels,
        biased: true,
        bucket,
    };
    let topos = [Topology::Exp, Topology::Complete];
    for (topo, c) in topos.into_iter().flat_map(|t| {
        let sparse = [
            Compressor::TopK { density: 0.1 },
            Compressor::RandomK { density: 0.3 },
        ];
        let dense = [qsgd(15, 512), qsgd(7, 100), qsgd(3, 0), Compressor::Sign];
        sparse.into_iter().chain(dense).map(move |c| (t, c))
    }) {
        let rounds = topology::rounds(topo, 8, 8).unwrap();
        let codec = Codec::new(c, &tensors, 9);
        for rank in [0, 3, 7] {
            let mut channels = Channels::new(&rounds, rank, n).unwrap();
            let mut x = random_vectors(1, n, rank as u64).remove(0);
            let (mut want_x, mut h, mut m) = (x.clone(), vec![0.0f32; n], vec![0.0f32; n]);
            // Round 0 twice: the second time its channel holds the first's public copy and memory.
            for step in [0, rounds.len() as u64] {
                let round = 0;
                let ch = &channels.list[channels.of_round[round].unwrap()];
                let (ranks, own, other) = (ch.ranks.clone(), ch.own, ch.other);
                let v = random_vectors(2 * ranks.len(), n, 40 + step);
                let msgs: Vec<Vec<f32>> = (0..ranks.len())
                    .map(|p| {
                        let mut msg = Vec::new();
                        codec.encode(&v[2 * p], &v[2 * p + 1], step, ranks[p], &mut msg);
                        msg
                    })
                    .collect();
                channels.absorb(&codec, round, step, |p| &msgs[p], &mut x, 0.3);
                for (msg, &j) in msgs.iter().zip(&ranks) {
                    let w = if j == rank { own } else { other };
                    codec.decode(msg, step, j, |i, q| {
                        if j == rank {
                            h[i] += q;
                        }
                        m[i] += w * q;
                    });
                }
                kernels::choco_step(&mut want_x, &m, &h, 0.3);
                let case = format!("{topo:?} {c:?} rank {rank} step {step}");
                assert_eq!(bits(&x), bits(&want_x), "{case}: x");
                let state = channels.state().unwrap();
                let c = channels.of_round[round].unwrap();
                let of = |name: String| state.iter().find(|(k, _)| *k == name).unwrap().1.clone();
                assert_eq!(bits(&of(format!("choco.hat.{c}"))), bits(&h), "{case}: hat");
                assert_eq!(
                    bits(&of(format!("choco.memory.{c}"))),
                    bits(&m),
                    "{case}: memory"
                );
            }
        }
    }
}

/// Random-k's index sets kept from the last message encoded are those drawn afresh (a clone of the codec
/// keeps none), for that message's sender and step; every other sender and step draws its own.
#[test]
fn kept_index_sets_are_the_drawn_ones() {
    let tensors = shapes();
    let n: usize = tensors.iter().map(|t| t.len).sum();
    let x = &random_vectors(1, n, 5)[0];
    let codec = Codec::new(Compressor::RandomK { density: 0.3 }, &tensors, 11);
    let fresh = codec.clone();
    let mut msg = Vec::new();
    codec.encode(x, &vec![0.0; n], 4, 1, &mut msg);
    for (step, sender) in [(4, 1), (4, 0), (5, 1), (3, 2)] {
        for t in 0..tensors.len() {
            let (kept, drawn) = (
                codec.random_indices(step, sender, t),
                fresh.random_indices(step, sender, t),
            );
            assert_eq!(kept, drawn, "step {step}, sender {sender}, tensor {t}");
        }
    }
    assert_ne!(fresh.random_indices(4, 1, 2), fresh.random_indices(4, 0, 2));
    // Kept: read back, not drawn again.
    let again =
        |c: &Codec| std::sync::Arc::ptr_eq(&c.random_indices(4, 1, 0), &c.random_indices(4, 1, 0));
    assert!(again(&codec) && !again(&fresh));
}

/// Every value below the range comes from the same number of words, every word counted (12-bit words,
/// every range up to 2^12).
#[test]
fn uniform_words_below_a_range_are_exactly_uniform() {
    let bits = 12;
    for range in 1..=1u64 << bits {
        let mut counts = vec![0u32; range as usize];
        for word in 0..1u64 << bits {
            if let Some(v) = below_of(word, bits, range) {
                counts[v as usize] += 1;
            }
        }
        let each = ((1u64 << bits) / range) as u32;
        assert!(
            counts.iter().all(|&c| c == each),
            "range {range}: {counts:?}"
        );
    }
}

/// Random-k's sampler gives k distinct indices below len, ascending, and every set of k equally often:
/// 60000 draws of 3 of 9 (84 sets, 714 expected each) stay within 5 standard deviations of it, and the
/// extremes (none, all) come out whole.
#[test]
fn random_k_draws_every_set_of_k_equally_often() {
    use rand::SeedableRng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    let mut counts = std::collections::HashMap::new();
    let draws = 60_000;
    for _ in 0..draws {
        let set = sample_ascending(&mut rng, 9, 3);
        assert!(
            set.windows(2).all(|w| w[0] < w[1]) && set.len() == 3 && set[2] < 9,
            "{set:?}"
        );
        *counts.entry(set).or_insert(0usize) += 1;
    }
    assert_eq!(counts.len(), 84, "every set of 3 of 9 drawn");
    let expected = draws as f64 / 84.0;
    let sd = (expected * (1.0 - 1.0 / 84.0)).sqrt();
    for (set, &c) in &counts {
        assert!(
            (c as f64 - expected).abs() < 5.0 * sd,
            "{set:?}: {c} of {draws}"
        );
    }
    assert_eq!(
        sample_ascending(&mut rng, 70, 70),
        (0..70).collect::<Vec<u32>>()
    );
    assert!(sample_ascending(&mut rng, 70, 0).is_empty());
    let big = sample_ascending(&mut rng, 100_003, 10_000);
    assert!(big.windows(2).all(|w| w[0] < w[1]) && big.len() == 10_000 && big[9_999] < 100_003);
}

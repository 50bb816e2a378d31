//! GPU checks, run by the GPU self-test (scripts/gpu/selftest.py) on a machine with a GPU: every reducer,
//! optimizer and attention kernel against its CPU twin (bit for bit: same algorithm, same blocking, no
//! contracted multiply-adds; to a stated tolerance where the GPU's expf or logf enters), and the NCCL
//! engine at world size 1. CI builds them into the self-test bundle
//! (scripts/gpu-bundle.sh); without a GPU they fail at their first line, naming the missing device.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaStream;
use nanodist::comm::Communicator;
use nanodist::cuda::Kernels;
use nanodist::kernels as twin;
use nanodist::kernels::Segment;
use rand::{Rng, SeedableRng};

/// The kernels on candle's stream of GPU 0, opened as a rank opens its GPU.
fn kernels() -> Kernels {
    let dev = nanodist::device::open_cuda(0).expect("GPU 0 (these tests need a CUDA GPU)");
    Kernels::for_candle(&dev).expect("loading the reducer kernels")
}

/// Values spread out, or on a few levels (many ties).
fn values(n: usize, seed: u64, ties: bool) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            if ties {
                rng.random_range(-4i32..5) as f32 * 0.25
            } else {
                rng.random_range(-1.0f32..1.0)
            }
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn top_k_kernel_equals_its_twin() {
    let k = kernels();
    let s: &Arc<CudaStream> = k.stream();
    for (n, kk, ties) in [
        (1, 1, false),
        (5000, 37, false),
        (5000, 2500, true),
        (3 * 4096 + 17, 4000, true),
        (1 << 22, 41_943, false),
        (1 << 22, 1 << 21, true),
    ] {
        let x = values(n, n as u64 + kk as u64, ties);
        let (mut idx, mut val) = (Vec::new(), Vec::new());
        twin::top_k(&x, kk, 100, &mut idx, &mut val);
        let dx = s.clone_htod(&x).unwrap();
        let (gi, gv) = k.top_k(&dx.slice(..), kk, 100).unwrap();
        assert_eq!(s.clone_dtoh(&gi).unwrap(), idx, "indices, n {n} k {kk}");
        assert_eq!(
            bits(&s.clone_dtoh(&gv).unwrap()),
            bits(&val),
            "values, n {n} k {kk}"
        );
    }
}

#[test]
fn gather_scatter_and_error_feedback_kernels_equal_their_twins() {
    let k = kernels();
    let s = k.stream();
    let n = 100_003;
    let (g, r) = (values(n, 1, false), values(n, 2, false));
    // acc = residual + g; select; split into sent and kept; scatter the sent values back.
    let mut acc = r.clone();
    twin::ef_accumulate(&mut acc, &g);
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    twin::top_k(&acc, 1000, 0, &mut idx, &mut val);
    let mut gathered = vec![0.0; idx.len()];
    twin::gather(&acc, &idx, &mut gathered);
    let mut sent = vec![0.0; idx.len()];
    twin::gather_clear(&mut acc, &idx, &mut sent);
    let mut dense = vec![0.0; n];
    twin::scatter_add(&mut dense, &idx, &sent);
    twin::scale(&mut dense, 0.25);

    let mut dacc = s.clone_htod(&r).unwrap();
    k.ef_accumulate(&mut dacc, &s.clone_htod(&g).unwrap())
        .unwrap();
    let didx = s.clone_htod(&idx).unwrap();
    let mut dgathered = s.alloc_zeros::<f32>(idx.len()).unwrap();
    // SAFETY: idx holds distinct indices below n, the length of dacc and ddense.
    unsafe { k.gather(&dacc, &didx, &mut dgathered) }.unwrap();
    let mut dsent = s.alloc_zeros::<f32>(idx.len()).unwrap();
    // SAFETY: as above.
    unsafe { k.gather_clear(&mut dacc, &didx, &mut dsent) }.unwrap();
    let mut ddense = s.alloc_zeros::<f32>(n).unwrap();
    // SAFETY: as above.
    unsafe { k.scatter_add(&mut ddense, &didx.slice(..), &dsent.slice(..)) }.unwrap();
    k.scale(&mut ddense, 0.25).unwrap();
    assert_eq!(bits(&s.clone_dtoh(&dgathered).unwrap()), bits(&gathered));
    assert_eq!(bits(&s.clone_dtoh(&dsent).unwrap()), bits(&sent));
    assert_eq!(bits(&s.clone_dtoh(&dacc).unwrap()), bits(&acc));
    assert_eq!(bits(&s.clone_dtoh(&ddense).unwrap()), bits(&dense));
}

#[test]
fn gram_schmidt_kernel_equals_its_twin() {
    let k = kernels();
    let s = k.stream();
    for (rows, cols, m, eps) in [
        (1, 1, 1, 0.0),
        (768, 4, 3, 0.0),
        (50257, 8, 1, 1e-8),
        (3072, 32, 2, 0.0),
    ] {
        let mut p = values(rows * cols * m, rows as u64, false);
        let mut dp = s.clone_htod(&p).unwrap();
        twin::gram_schmidt(&mut p, rows, cols, eps);
        k.gram_schmidt(&mut dp.slice_mut(..), rows, cols, eps)
            .unwrap();
        assert_eq!(
            bits(&s.clone_dtoh(&dp).unwrap()),
            bits(&p),
            "{rows} x {cols}"
        );
    }
}

/// Segments of a GPT-like layout: long decaying matrices, short non-decaying vectors, and an empty one.
fn segments() -> Vec<Segment> {
    Segment::end_to_end([
        (70_001, true),
        (769, false),
        (0, false),
        (300_017, true),
        (1, false),
    ])
}

/// The optimizer tests' setup: the kernels, the segments, their table on the device, and the initial
/// parameters.
fn optimizer_case() -> (
    Kernels,
    Vec<Segment>,
    nanodist::cuda::DeviceSegments,
    Vec<f32>,
) {
    let k = kernels();
    let segs = segments();
    let n = segs.last().map(|s| s.offset + s.len).unwrap();
    let dsegs = k.segments(&segs).unwrap();
    (k, segs, dsegs, values(n, 7, false))
}

/// Step t's gradient (ties on even steps) and learning rate.
fn optimizer_step(n: usize, t: u64) -> (Vec<f32>, f64) {
    (values(n, 100 + t, t.is_multiple_of(2)), 1e-3 * t as f64)
}

/// Asserts that each (name, device buffer, host buffer) holds the same bits after step t.
fn same_state(
    s: &Arc<CudaStream>,
    t: u64,
    pairs: &[(&str, &cudarc::driver::CudaSlice<f32>, &[f32])],
) {
    for (name, dev, host) in pairs {
        assert_eq!(
            bits(&s.clone_dtoh(*dev).unwrap()),
            bits(host),
            "{name} after step {t}"
        );
    }
}

/// AdamW (clipping's gradient scale 0.7): five steps, compared after every step.
#[test]
fn adamw_kernel_equals_its_twin_over_several_steps() {
    use twin::optim::AdamWStep;
    let (k, segs, dsegs, p0) = optimizer_case();
    let (s, n) = (k.stream(), p0.len());
    let (mut p, mut m, mut v) = (p0.clone(), vec![0.0f32; n], vec![0.0f32; n]);
    let (mut dp, mut dm, mut dv) = (
        s.clone_htod(&p).unwrap(),
        s.clone_htod(&m).unwrap(),
        s.clone_htod(&v).unwrap(),
    );
    for t in 1..=5u64 {
        let (g, lr) = optimizer_step(n, t);
        let dg = s.clone_htod(&g).unwrap();
        let c = AdamWStep {
            grad_scale: 0.7,
            ..AdamWStep::new([0.9, 0.95], 1e-8, 0.1, lr, t)
        };
        twin::optim::adamw(&mut p, &g, &mut m, &mut v, &segs, &c);
        k.adamw(&mut dp, &dg, &mut dm, &mut dv, &dsegs, &c).unwrap();
        same_state(
            s,
            t,
            &[
                ("adamw p", &dp, &p),
                ("adamw m", &dm, &m),
                ("adamw v", &dv, &v),
            ],
        );
    }
}

/// AccumAdamW (k = 2: commits and look-ahead steps): five steps, compared after every step.
#[test]
fn accum_adamw_kernel_equals_its_twin_over_several_steps() {
    use twin::optim::AccumStep;
    let (k, segs, dsegs, p0) = optimizer_case();
    let (s, n) = (k.stream(), p0.len());
    let up = |v: &[f32]| s.clone_htod(v).unwrap();
    let zeros = || vec![0.0f32; n];
    let (mut q, mut sm, mut sv, mut acc) = (p0.clone(), zeros(), zeros(), zeros());
    let (mut dq, mut dsm, mut dsv, mut dacc) = (up(&q), up(&sm), up(&sv), up(&acc));
    for t in 1..=5u64 {
        let (g, lr) = optimizer_step(n, t);
        let dg = up(&g);
        let c = AccumStep::new([0.9, 0.99], 1e-8, 0.1, 2, lr, t);
        twin::optim::accum_adamw(&mut q, &g, &mut sm, &mut sv, &mut acc, &segs, &c);
        k.accum_adamw(&mut dq, &dg, &mut dsm, &mut dsv, &mut dacc, &dsegs, &c)
            .unwrap();
        let pairs = [
            ("accumadamw p", &dq, &q[..]),
            ("accumadamw sm", &dsm, &sm[..]),
            ("accumadamw sv", &dsv, &sv[..]),
            ("accumadamw acc", &dacc, &acc[..]),
        ];
        same_state(s, t, &pairs);
    }
}

/// torch's SGD with Nesterov momentum and without momentum, and decoupled SGD: five steps each,
/// compared after every step.
#[test]
fn sgd_kernels_equal_their_twins_over_several_steps() {
    use twin::optim::SgdStep;
    let (k, segs, dsegs, p0) = optimizer_case();
    let (s, n) = (k.stream(), p0.len());
    let up = |v: &[f32]| s.clone_htod(v).unwrap();
    let (mut r, mut buf, mut u, mut w) = (p0.clone(), vec![0.0f32; n], p0.clone(), p0.clone());
    let (mut dr, mut dbuf, mut du, mut dw) = (up(&r), up(&buf), up(&u), up(&w));
    for t in 1..=5u64 {
        let (g, lr) = optimizer_step(n, t);
        let dg = up(&g);
        let c = SgdStep {
            wd: 0.01,
            momentum: 0.9,
            lr: lr as f32,
            nesterov: true,
            first: t == 1,
            grad_scale: 0.5,
        };
        twin::optim::momentum_sgd(&mut r, &g, &mut buf, &segs, &c);
        k.momentum_sgd(
            &mut dr.slice_mut(..),
            &dg.slice(..),
            Some(&mut dbuf.slice_mut(..)),
            &dsegs,
            &c,
        )
        .unwrap();
        let plain = SgdStep {
            momentum: 0.0,
            nesterov: false,
            ..c
        };
        twin::optim::momentum_sgd(&mut u, &g, &mut [], &segs, &plain);
        k.momentum_sgd(&mut du.slice_mut(..), &dg.slice(..), None, &dsegs, &plain)
            .unwrap();
        twin::optim::sgd(&mut w, &g, &segs, 0.1, lr, 0.9);
        k.sgd(&mut dw, &dg, &dsegs, 0.1, lr, 0.9).unwrap();
        let pairs = [
            ("nesterov p", &dr, &r[..]),
            ("nesterov buf", &dbuf, &buf[..]),
            ("sgd p", &du, &u[..]),
            ("decoupled sgd p", &dw, &w[..]),
        ];
        same_state(s, t, &pairs);
    }
}

#[test]
fn gossip_kernels_equal_their_twins() {
    let k = kernels();
    let s = k.stream();
    let n = 100_003;
    let (x, b) = (values(n, 11, false), values(n, 12, false));
    let (mut dx, db) = (s.clone_htod(&x).unwrap(), s.clone_htod(&b).unwrap());
    let mut dsent = s.alloc_zeros::<f32>(n).unwrap();
    k.scaled_copy(&mut dsent.slice_mut(..), &dx.slice(..), 0.3)
        .unwrap();
    k.mix(&mut dx.slice_mut(..), &db.slice(..), 0.7).unwrap();
    let mut sent = vec![0.0; n];
    twin::scaled_copy(&mut sent, &x, 0.3);
    let mut mixed = x.clone();
    twin::mix(&mut mixed, &b, 0.7);
    assert_eq!(bits(&s.clone_dtoh(&dsent).unwrap()), bits(&sent));
    assert_eq!(bits(&s.clone_dtoh(&dx).unwrap()), bits(&mixed));
}

#[test]
fn sum_squares_kernel_equals_its_twin() {
    let k = kernels();
    for n in [0, 1, 4095, 4096, 4097, 1_000_003] {
        let x = values(n, n as u64, false);
        let got = k.sum_squares(&k.stream().clone_htod(&x).unwrap()).unwrap();
        let want = twin::optim::sum_squares(&x);
        assert_eq!(got.to_bits(), want.to_bits(), "n = {n}: {got} vs {want}");
    }
}

/// The attention's causal softmax: its backward gives its twin's bits (no transcendental functions); the
/// forward is within 1e-6 relative of its twin (the GPU's expf is within 2 ulp of the host's, and each
/// output divides by a sum of them).
#[test]
fn attention_kernels_follow_their_twins() {
    let k = kernels();
    let s = k.stream();
    for (t, heads, scale) in [(1, 1, 1.0), (5, 3, 0.125), (300, 2, 0.3), (1024, 2, 0.125)] {
        let x: Vec<f32> = values(heads * t * t, t as u64, false)
            .iter()
            .map(|v| 6.0 * v)
            .collect();
        let g = values(x.len(), t as u64 + 1, false);
        let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        twin::model::causal_softmax(&x, &mut y, t, scale);
        twin::model::causal_softmax_backward(&y, &g, &mut dx, t, scale);
        let gy = k
            .causal_softmax(&s.clone_htod(&x).unwrap().slice(..), t, scale)
            .unwrap();
        let gy = s.clone_dtoh(&gy).unwrap();
        for (i, (a, b)) in gy.iter().zip(&y).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "softmax, t {t}, at {i}: {a} vs {b}"
            );
        }
        let (dy, dg) = (s.clone_htod(&y).unwrap(), s.clone_htod(&g).unwrap());
        let gdx = k
            .causal_softmax_backward(&dy.slice(..), &dg.slice(..), t, scale)
            .unwrap();
        assert_eq!(
            bits(&s.clone_dtoh(&gdx).unwrap()),
            bits(&dx),
            "backward, t {t}"
        );
    }
}

/// The cross-entropy: each row's loss within 2e-6 (1 + |loss|) of its twin's and each gradient within
/// 2e-6 |g| (the GPU's expf and logf are within 2 and 1 ulp of the host's); NaN where a target is past
/// the vocabulary, as the twin.
#[test]
fn cross_entropy_kernels_follow_their_twins() {
    let k = kernels();
    let s = k.stream();
    for (rows, v) in [(1, 1), (3, 200), (64, 50_304)] {
        let x: Vec<f32> = values(rows * v, v as u64, false)
            .iter()
            .map(|a| 15.0 * a)
            .collect();
        let y: Vec<u32> = (0..rows)
            .map(|r| if r > 0 && r == rows - 1 { v } else { r * 7919 % v } as u32)
            .collect();
        let g = values(rows, 3, false);
        let (mut loss, mut dx) = (vec![0.0; rows], vec![0.0; x.len()]);
        twin::model::cross_entropy(&x, &y, &mut loss, v);
        twin::model::cross_entropy_backward(&x, &y, &g, &mut dx, v);
        let (dxs, dys, dgs) = (
            s.clone_htod(&x).unwrap(),
            s.clone_htod(&y).unwrap(),
            s.clone_htod(&g).unwrap(),
        );
        let gl = k.cross_entropy(&dxs.slice(..), &dys.slice(..), v).unwrap();
        for (r, (a, b)) in s.clone_dtoh(&gl).unwrap().iter().zip(&loss).enumerate() {
            let close = (a - b).abs() <= 2e-6 * (1.0 + b.abs()) || (a.is_nan() && b.is_nan());
            assert!(close, "loss, v {v}, row {r}: {a} vs {b}");
        }
        let gdx = k
            .cross_entropy_backward(&dxs.slice(..), &dys.slice(..), &dgs.slice(..), v)
            .unwrap();
        for (i, (a, b)) in s.clone_dtoh(&gdx).unwrap().iter().zip(&dx).enumerate() {
            assert!(
                (a - b).abs() <= 2e-6 * g[i / v].abs(),
                "gradient, v {v}, at {i}: {a} vs {b}"
            );
        }
    }
}

/// The layer norm's kernels give their twins' bits (square roots and divisions only, IEEE-rounded on
/// both): the forward, dx, and dw and db over more rows than a block of the column sums.
#[test]
fn layer_norm_kernels_equal_their_twins() {
    let k = kernels();
    let s = k.stream();
    for (rows, c) in [(1, 1), (3, 100), (12 * 1024, 768)] {
        let (x, w, b) = (
            values(rows * c, 1, false),
            values(c, 2, false),
            values(c, 3, false),
        );
        let g = values(rows * c, 4, false);
        let mut y = vec![0.0; x.len()];
        twin::model::layer_norm(&x, &w, &b, &mut y, c, 1e-5);
        let (mut dx, mut stats) = (vec![0.0; x.len()], vec![0.0; 2 * rows]);
        twin::model::layer_norm_backward((&x, &w, &g), &mut dx, &mut stats, c, 1e-5);
        let (dw, db) = twin::model::layer_norm_columns(&x, &g, &stats, c);
        let up = |v: &[f32]| s.clone_htod(v).unwrap();
        let (dxs, dws, dbs, dgs) = (up(&x), up(&w), up(&b), up(&g));
        let gy = k
            .layer_norm(&dxs.slice(..), (&dws.slice(..), &dbs.slice(..)), c, 1e-5)
            .unwrap();
        assert_eq!(
            bits(&s.clone_dtoh(&gy).unwrap()),
            bits(&y),
            "forward, {rows} x {c}"
        );
        let all = k
            .layer_norm_backward((&dxs.slice(..), &dws.slice(..), &dgs.slice(..)), c, 1e-5)
            .unwrap();
        let want = [dx, dw, db].concat();
        assert_eq!(
            bits(&s.clone_dtoh(&all).unwrap()),
            bits(&want),
            "backward, {rows} x {c}"
        );
    }
}

/// `run` with the host's device and place, then with the GPU's: (the host's result, the GPU's).
fn on_host_and_gpu<T>(run: impl Fn(&candle_core::Device, &nanodist::flat::Place) -> T) -> (T, T) {
    use nanodist::flat::Place;
    let k = Arc::new(kernels());
    let gpu = candle_core::Device::Cuda(k.candle_device().unwrap().clone());
    let host = run(&candle_core::Device::Cpu, &Place::Host);
    (host, run(&gpu, &Place::Cuda(k.clone())))
}

/// A tensor's values as bits.
fn tensor_bits(t: &candle_core::Tensor) -> Vec<u32> {
    bits(&t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
}

/// The gradient at `x` of sum(y up), as bits.
fn grad_bits(y: &candle_core::Tensor, up: &candle_core::Tensor, x: &candle_core::Var) -> Vec<u32> {
    let grads = (y * up).unwrap().sum_all().unwrap().backward().unwrap();
    tensor_bits(grads.get(x).unwrap())
}

/// The GELU op on the GPU gives the CPU engine's floats bit for bit (the same polynomial erf and exp, no
/// libm), forward and in the gradient, both forms: the op on the GPU against the op on the host.
#[test]
fn gelu_kernels_equal_the_cpu_engines_gelu() {
    use candle_core::{Tensor, Var};
    let x: Vec<f32> = values(1 << 20, 9, false).iter().map(|v| 12.0 * v).collect();
    let g = values(x.len(), 10, false);
    for tanh_form in [false, true] {
        let (host, device) = on_host_and_gpu(|dev, place| {
            let xv = Var::from_vec(x.clone(), x.len(), dev).unwrap();
            let y = nanodist::model::fused::gelu(&xv, tanh_form, place).unwrap();
            let up = Tensor::from_vec(g.clone(), g.len(), dev).unwrap();
            (tensor_bits(&y), grad_bits(&y, &up, &xv))
        });
        assert_eq!(device.0, host.0, "forward, tanh form {tanh_form}");
        assert_eq!(device.1, host.1, "gradient, tanh form {tanh_form}");
    }
}

/// The token embedding: the op on the GPU gives the host's rows and gradient at the table bit for bit
/// (each token's rows summed in position order), at GPT-2 small's vocabulary with repeated tokens.
#[test]
fn embedding_kernels_equal_their_twins() {
    use candle_core::{Tensor, Var};
    let (v, c) = (50_304, 768);
    let ids: Vec<u32> = (0..4096u32).map(|i| i * 7919 % 1000 * 50).collect();
    let w = values(v * c, 5, false);
    let g = values(ids.len() * c, 6, false);
    let (host, device) = on_host_and_gpu(|dev, place| {
        let wv = Var::from_vec(w.clone(), (v, c), dev).unwrap();
        let y = nanodist::model::fused::embedding(&wv, &ids, place).unwrap();
        let up = Tensor::from_vec(g.clone(), (ids.len(), c), dev).unwrap();
        (tensor_bits(&y), grad_bits(&y, &up, &wv))
    });
    assert_eq!(device.0, host.0, "forward");
    assert_eq!(device.1, host.1, "gradient");
}

/// A bias added to each row: the op on the GPU gives the host's values and gradients bit for bit (the
/// gradient at the bias: column sums in blocks of rows, added in order), at GPT-2 small's MLP width.
#[test]
fn bias_kernels_equal_their_twins() {
    use candle_core::{Tensor, Var};
    for (rows, n) in [(12 * 1024, 3072), (130, 300), (1, 1)] {
        let x = values(rows * n, 7, false);
        let b = values(n, 8, false);
        let g = values(rows * n, 9, false);
        let (host, device) = on_host_and_gpu(|dev, place| {
            let xv = Var::from_vec(x.clone(), (rows, n), dev).unwrap();
            let bv = Var::from_vec(b.clone(), n, dev).unwrap();
            let y = nanodist::model::fused::bias_add(&xv, &bv, place).unwrap();
            let up = Tensor::from_vec(g.clone(), (rows, n), dev).unwrap();
            let grads = (&y * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let at = |v: &Var| tensor_bits(grads.get(v).unwrap());
            (tensor_bits(&y), at(&xv), at(&bv))
        });
        assert_eq!(device, host, "{rows} x {n}");
    }
}

/// The permutation between the attention's rows and heads: the ops on the GPU give the host's values
/// and gradients bit for bit, both ways, at GPT-2 small's head size and at odd sizes.
#[test]
fn heads_kernels_equal_their_twins() {
    use candle_core::{Tensor, Var};
    use nanodist::model::fused::{from_heads, to_heads};
    for (b, t, nh, hs) in [(2, 1024, 12, 64), (3, 7, 5, 9), (1, 1, 1, 1)] {
        let x = values(b * t * nh * hs, t as u64, false);
        let g = values(x.len(), 3, false);
        let (host, device) = on_host_and_gpu(|dev, place| {
            let xv = Var::from_vec(x.clone(), (b * t, nh * hs), dev).unwrap();
            let y = to_heads(&xv, t, nh, place).unwrap();
            let back = from_heads(&y, place).unwrap();
            let up = Tensor::from_vec(g.clone(), (b * t, nh * hs), dev).unwrap();
            (
                tensor_bits(&y),
                tensor_bits(&back),
                grad_bits(&back, &up, &xv),
            )
        });
        assert_eq!(device, host, "({b}, {nh}, {t}, {hs})");
    }
}

#[test]
fn nccl_engine_at_world_size_one() {
    let mut c = nanodist::comm::nccl::NcclComm::init(0, 1, 0, Duration::from_secs(30), |_| Ok(()))
        .expect("NCCL on GPU 0");
    let mut buf = values(1000, 3, false);
    let before = buf.clone();
    c.all_reduce_sum(&mut buf).unwrap();
    assert_eq!(buf, before);
    c.group_all_reduce_sum(&mut buf, &[0]).unwrap();
    assert_eq!(buf, before);
    let mut out = vec![0.0; 1000];
    c.all_gather(&buf, &mut out).unwrap();
    assert_eq!(out, before);
    c.broadcast(&mut buf, 0).unwrap();
    assert_eq!(buf, before);
    c.barrier().unwrap();
}

/// Whether `a` and `b` agree: bit for bit (`tol` None), or within `tol` relative to b's largest value.
fn agree(a: &[f32], b: &[f32], tol: Option<f32>) -> bool {
    match tol {
        None => bits(a) == bits(b),
        Some(tol) => {
            let scale = b
                .iter()
                .fold(0f32, |m, x| m.max(x.abs()))
                .max(f32::MIN_POSITIVE);
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol * scale)
        }
    }
}

/// A reducer's device path (its kernels, NCCL on device buffers) against its host path (the twins) over
/// several steps at world size 1: the same reduced gradient, report and state, bit for bit, or within
/// `tol` where the device path uses cuBLAS's matmuls.
fn reducer_on_the_gpu_equals_its_host_path(
    tol: Option<f32>,
    make: impl Fn(Vec<Segment>) -> Box<dyn nanodist::sync::compress::Reducer>,
) {
    use nanodist::flat::{DeviceFlat, FlatMut};
    let k = Arc::new(kernels());
    let s = k.stream().clone();
    let mut nccl =
        nanodist::comm::nccl::NcclComm::init(0, 1, 0, Duration::from_secs(30), |_| Ok(()))
            .expect("NCCL on GPU 0");
    let tensors = Segment::from_shapes(&[(300, 200, true), (777, 1, false), (50, 129, true)]);
    let n: usize = tensors.iter().map(|t| t.len).sum();
    let (mut host, mut dev) = (make(tensors.clone()), make(tensors));
    for step in 0..6 {
        let g = values(n, 40 + step, step % 2 == 1);
        let mut hg = g.clone();
        let hr = host
            .reduce(&mut nanodist::comm::Solo, &mut hg, step)
            .unwrap();
        let mut d = DeviceFlat {
            buf: s.clone_htod(&g).unwrap(),
            kernels: k.clone(),
        };
        let dr = dev
            .reduce_flat(&mut nccl, FlatMut::Cuda(&mut d), step)
            .unwrap();
        assert!(
            agree(&s.clone_dtoh(&d.buf).unwrap(), &hg, tol),
            "step {step}"
        );
        let close = |a: Option<f64>, b: Option<f64>| match (a, b, tol) {
            (Some(a), Some(b), None) => a.to_bits() == b.to_bits(),
            (Some(a), Some(b), Some(t)) => (a - b).abs() <= t as f64 * b.abs().max(1e-30),
            (a, b, _) => a.is_none() && b.is_none(),
        };
        let report = |r: &nanodist::sync::compress::Report| {
            [r.error, r.overlap, r.grad_norm, r.compressed_fraction]
        };
        let (a, b) = (report(&dr), report(&hr));
        assert!(
            a.iter().zip(&b).all(|(&a, &b)| close(a, b)),
            "report of step {step}: {a:?} against {b:?}"
        );
        let (a, b) = (dev.state().unwrap(), host.state().unwrap());
        assert_eq!(a.len(), b.len());
        for ((na, va), (nb, vb)) in a.iter().zip(&b) {
            assert!(na == nb && agree(va, vb, tol), "{na} after step {step}");
        }
    }
}

/// Top-k with error feedback.
#[test]
fn top_k_reducer_on_the_gpu_equals_its_host_path() {
    use nanodist::sync::compress::topk::TopK;
    reducer_on_the_gpu_equals_its_host_path(None, |t| Box::new(TopK::new(t, 0.05, true)));
}

/// Radius, plain and in correction mode (Adam on the device), through a dense step, re-selections and
/// stable steps.
#[test]
fn radius_reducer_on_the_gpu_equals_its_host_path() {
    use nanodist::config::backend::RadiusConfig;
    use nanodist::sync::compress::{correction::Corrected, radius::Radius};
    let cfg = RadiusConfig {
        density: 0.05,
        range: 2,
        threshold: 1,
        interval: 3,
        ..RadiusConfig::default()
    };
    reducer_on_the_gpu_equals_its_host_path(None, |t| Box::new(Radius::new(t, cfg.clone())));
    reducer_on_the_gpu_equals_its_host_path(None, |t| {
        let numel = t.iter().map(|t| t.len).sum();
        let radius = Box::new(Radius::new(t, cfg.clone()));
        Box::new(Corrected::new(radius, numel, [0.9, 0.95], 1e-8, 0.5))
    });
}

/// PowerSGD with its factors, error and matmuls on the GPU (cuBLAS) against the host path (the CPU
/// matmul), three all-reduces and one, with error feedback: the same up to the matmuls' summation order.
#[test]
fn powersgd_reducer_on_the_gpu_follows_its_host_path() {
    use nanodist::config::backend::PowerSgdConfig;
    use nanodist::sync::compress::powersgd::PowerSgd;
    for single_allreduce in [false, true] {
        let cfg = PowerSgdConfig {
            rank: 4,
            start_iter: 1,
            single_allreduce,
            ..PowerSgdConfig::default()
        };
        reducer_on_the_gpu_equals_its_host_path(Some(1e-4), |t| {
            Box::new(PowerSgd::new(t, cfg.clone(), 7))
        });
    }
}

/// DiLoCo's device path (backup, outer momentum and pseudo-gradients on the GPU; the outer step, the
/// delta and the blend as kernels; the all-reduce NCCL's) against its host path (the twins), streaming
/// with two fragments, a delay and a blend, at world size 1: the same parameters and state, bit for bit.
#[test]
fn diloco_on_the_gpu_equals_its_host_path() {
    use nanodist::config::backend::DilocoConfig;
    use nanodist::flat::{DeviceFlat, FlatMut};
    use nanodist::sync::{diloco::Diloco, SyncBackend};
    let k = Arc::new(kernels());
    let s = k.stream().clone();
    let nccl = nanodist::comm::nccl::NcclComm::init(0, 1, 0, Duration::from_secs(30), |_| Ok(()))
        .expect("NCCL on GPU 0");
    let tensors = Segment::from_shapes(&[(300, 200, true), (777, 1, false), (50, 129, true)]);
    let n: usize = tensors.iter().map(|t| t.len).sum();
    let cfg = DilocoConfig {
        sync_every: 4,
        outer_lr: 0.7,
        outer_momentum: 0.9,
        nesterov: true,
        fragments: 2,
        fragment_delay: 1,
        fragment_alpha: 0.25,
        ..DilocoConfig::default()
    };
    let mut host = Diloco::new(
        Box::new(nanodist::comm::Solo),
        cfg.clone(),
        tensors.clone(),
        None,
    )
    .unwrap();
    let mut dev = Diloco::new(Box::new(nccl), cfg, tensors, None).unwrap();
    let mut p = values(n, 90, false);
    let mut d = DeviceFlat {
        buf: s.clone_htod(&p).unwrap(),
        kernels: k.clone(),
    };
    host.before_step(&mut p).unwrap();
    dev.before_step_flat(FlatMut::Cuda(&mut d)).unwrap();
    for step in 0..10 {
        // An inner step: the same change on both.
        let g = values(n, 100 + step, false);
        twin::ef_accumulate(&mut p, &g);
        k.ef_accumulate(&mut d.buf, &s.clone_htod(&g).unwrap())
            .unwrap();
        host.after_step(&mut p, step).unwrap();
        dev.after_step_flat(FlatMut::Cuda(&mut d), step).unwrap();
        assert_eq!(
            bits(&s.clone_dtoh(&d.buf).unwrap()),
            bits(&p),
            "step {step}"
        );
        let (a, b) = (dev.state().unwrap(), host.state().unwrap());
        assert_eq!(a.len(), b.len());
        for ((na, va), (nb, vb)) in a.iter().zip(&b) {
            assert!(na == nb && bits(va) == bits(vb), "{na} after step {step}");
        }
    }
}

/// DeMo's device path (clipping, momentum, the `demo_encode` / `demo_decode` chunk kernels, NCCL's
/// all-gather) against its host path (their twin) at world size 1, over several steps: the same sign
/// direction, clipped norm and momentum, bit for bit.
#[test]
fn demo_on_the_gpu_equals_its_host_path() {
    use nanodist::config::backend::DemoConfig;
    use nanodist::flat::{DeviceFlat, FlatMut};
    use nanodist::sync::{demo::Demo, SyncBackend};
    let k = Arc::new(kernels());
    let s = k.stream().clone();
    let nccl = nanodist::comm::nccl::NcclComm::init(0, 1, 0, Duration::from_secs(30), |_| Ok(()))
        .expect("NCCL on GPU 0");
    let tensors = Segment::from_shapes(&[(192, 128, true), (777, 1, false), (50, 129, true)]);
    let n: usize = tensors.iter().map(|t| t.len).sum();
    let cfg = DemoConfig {
        topk: 7,
        chunk: 64,
        ..DemoConfig::default()
    };
    let mut host = Demo::new(Box::new(nanodist::comm::Solo), cfg.clone(), 1.0, &tensors);
    let mut dev = Demo::new(Box::new(nccl), cfg, 1.0, &tensors);
    for step in 0..4 {
        let mut g = values(n, 200 + step, step == 2);
        let mut d = DeviceFlat {
            buf: s.clone_htod(&g).unwrap(),
            kernels: k.clone(),
        };
        host.reduce_grads(&mut g, step, 0.01).unwrap();
        dev.reduce_flat(FlatMut::Cuda(&mut d), step, 0.01).unwrap();
        assert_eq!(
            bits(&s.clone_dtoh(&d.buf).unwrap()),
            bits(&g),
            "step {step}"
        );
        assert_eq!(
            dev.clipped_grad_norm().map(f64::to_bits),
            host.clipped_grad_norm().map(f64::to_bits)
        );
        let (a, b) = (dev.state().unwrap(), host.state().unwrap());
        assert_eq!(a.len(), b.len());
        for ((na, va), (nb, vb)) in a.iter().zip(&b) {
            assert!(na == nb && bits(va) == bits(vb), "{na} after step {step}");
        }
    }
}

/// The in-process engine with device collectives on one GPU: its `exchange_device` runs the host
/// exchange on copies, so that two ranks in one process can run a backend's device path against each
/// other (NCCL needs a GPU per rank).
struct Loopback(nanodist::comm::local::LocalComm);

impl Communicator for Loopback {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> anyhow::Result<()> {
        self.0.all_reduce_sum(buf)
    }
    fn group_all_reduce_sum(&mut self, buf: &mut [f32], group: &[usize]) -> anyhow::Result<()> {
        self.0.group_all_reduce_sum(buf, group)
    }
    fn all_gather(&mut self, send: &[f32], out: &mut [f32]) -> anyhow::Result<()> {
        self.0.all_gather(send, out)
    }
    fn exchange(
        &mut self,
        sends: &[(usize, &[f32])],
        recvs: &mut [(usize, &mut [f32])],
    ) -> anyhow::Result<()> {
        self.0.exchange(sends, recvs)
    }
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> anyhow::Result<()> {
        self.0.broadcast(buf, root)
    }
    fn barrier(&mut self) -> anyhow::Result<()> {
        self.0.barrier()
    }
    fn stats(&self) -> nanodist::comm::CommStats {
        self.0.stats()
    }
    fn device_collectives(&self) -> bool {
        true
    }
    fn exchange_device(
        &mut self,
        send: &cudarc::driver::CudaSlice<f32>,
        sends: &[(usize, std::ops::Range<usize>)],
        recv: &mut cudarc::driver::CudaSlice<f32>,
        recvs: &[(usize, std::ops::Range<usize>)],
    ) -> anyhow::Result<()> {
        let s = send.stream().clone();
        let mine = s.clone_dtoh(send)?;
        let mut got: Vec<Vec<f32>> = recvs.iter().map(|(_, r)| vec![0.0f32; r.len()]).collect();
        let host_sends: Vec<(usize, &[f32])> =
            sends.iter().map(|(p, r)| (*p, &mine[r.clone()])).collect();
        let mut host_recvs: Vec<(usize, &mut [f32])> = recvs
            .iter()
            .zip(&mut got)
            .map(|((p, _), g)| (*p, &mut g[..]))
            .collect();
        self.0.exchange(&host_sends, &mut host_recvs)?;
        for ((_, r), g) in recvs.iter().zip(&got) {
            s.memcpy_htod(g, &mut recv.slice_mut(r.clone()))?;
        }
        Ok(())
    }
}

/// Parameters and state of each rank after five steps of CHOCO on two ranks (ring, overlap), on the GPU
/// or on the host.
type RankEnds = Vec<(Vec<f32>, nanodist::sync::compress::State)>;

/// Two ranks of CHOCO with `plan` over `tensors`, five steps, on the GPU (`device`, through the loopback
/// engine) or on the host.
fn choco_ranks(
    k: &Arc<Kernels>,
    plan: &nanodist::sync::choco::ChocoPlan,
    tensors: &[Segment],
    device: bool,
) -> RankEnds {
    let comms = nanodist::comm::local::group(2, Duration::from_secs(60));
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| scope.spawn(move || choco_rank(k, plan, tensors, c, device)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// One rank of `choco_ranks`.
fn choco_rank(
    k: &Arc<Kernels>,
    plan: &nanodist::sync::choco::ChocoPlan,
    tensors: &[Segment],
    c: nanodist::comm::local::LocalComm,
    device: bool,
) -> (Vec<f32>, nanodist::sync::compress::State) {
    use nanodist::config::backend::Topology;
    use nanodist::flat::{DeviceFlat, FlatMut};
    use nanodist::sync::choco::Choco;
    use nanodist::sync::{topology, SyncBackend};
    let (rank, n) = (c.rank(), tensors.iter().map(|t| t.len).sum());
    let rounds = topology::rounds(Topology::Ring, 2, 1).unwrap();
    let comm: Box<dyn Communicator> = match device {
        true => Box::new(Loopback(c)),
        false => Box::new(c),
    };
    let mut choco = Choco::new(comm, rounds, true, plan, tensors).unwrap();
    let s = k.stream().clone();
    let mut p = values(n, 300 + rank as u64, false);
    let mut d = DeviceFlat {
        buf: s.clone_htod(&p).unwrap(),
        kernels: k.clone(),
    };
    for step in 0..5 {
        let g = values(n, 400 + step + 10 * rank as u64, false);
        if device {
            k.ef_accumulate(&mut d.buf, &s.clone_htod(&g).unwrap())
                .unwrap();
            choco.before_step_flat(FlatMut::Cuda(&mut d)).unwrap();
            choco.after_step_flat(FlatMut::Cuda(&mut d), step).unwrap();
        } else {
            twin::ef_accumulate(&mut p, &g);
            choco.before_step(&mut p).unwrap();
            choco.after_step(&mut p, step).unwrap();
        }
    }
    if device {
        p = s.clone_dtoh(&d.buf).unwrap();
    }
    (p, choco.state().unwrap())
}

/// CHOCO's device path (public copies, memories and messages on the GPU; the encoding and absorbing
/// kernels of every compressor, and `choco_step`) against its host path, two ranks on a ring with
/// overlap, every compressor (QSGD with codes that straddle words, per bucket and per tensor): the same
/// parameters and state on both ranks after five steps, bit for bit.
#[test]
fn choco_on_the_gpu_equals_its_host_path() {
    use nanodist::sync::choco::{ChocoPlan, Compressor};
    let k = Arc::new(kernels());
    let tensors = Segment::from_shapes(&[(300, 200, true), (777, 1, false), (50, 129, true)]);
    for compressor in [
        Compressor::TopK { density: 0.05 },
        Compressor::RandomK { density: 0.05 },
        Compressor::Qsgd {
            levels: 3,
            biased: true,
            bucket: 500,
        },
        Compressor::Qsgd {
            levels: 16,
            biased: false,
            bucket: 0,
        },
        Compressor::Sign,
    ] {
        let plan = ChocoPlan {
            compressor,
            gamma: 0.6,
            tuned: false,
            seed: 5,
        };
        let host = choco_ranks(&k, &plan, &tensors, false);
        let dev = choco_ranks(&k, &plan, &tensors, true);
        for (rank, ((hp, hs), (dp, ds))) in host.iter().zip(&dev).enumerate() {
            assert_eq!(
                bits(dp),
                bits(hp),
                "{compressor:?}: rank {rank}'s parameters"
            );
            assert_eq!(hs.len(), ds.len());
            for ((na, va), (nb, vb)) in ds.iter().zip(hs) {
                assert!(
                    na == nb && bits(va) == bits(vb),
                    "{compressor:?}: rank {rank}'s {na}"
                );
            }
        }
    }
}

/// DiLoCo's quantized all-reduce on device buffers (the `quantize_rows` / `dequantize_rows` kernels, the
/// exchanges on the device) against the host's (`quantize::encode` / `decode`, their twins), two ranks
/// sharing one GPU through the loopback engine, bf16, fp8 and uint8 over rows of odd lengths: the same
/// mean on both ranks, bit for bit.
#[test]
fn quantized_all_reduce_on_the_gpu_equals_its_host_path() {
    use nanodist::config::backend::Quantize;
    use nanodist::flat::DeviceFlat;
    use nanodist::sync::quantize;
    let k = Arc::new(kernels());
    let lens = [7usize, 300, 1, 33, 128, 5, 64, 999];
    let mut rows = Vec::new();
    let mut at = 0;
    for &l in &lens {
        rows.push(at..at + l);
        at += l;
    }
    let n = at;
    for q in [Quantize::Bf16, Quantize::Fp8, Quantize::Uint8] {
        let run = |device: bool| -> Vec<Vec<f32>> {
            let comms = nanodist::comm::local::group(2, Duration::from_secs(60));
            std::thread::scope(|scope| {
                let handles: Vec<_> = comms
                    .into_iter()
                    .map(|c| {
                        let (k, rows) = (k.clone(), rows.clone());
                        scope.spawn(move || {
                            let mut x = values(n, 500 + c.rank() as u64, false);
                            if device {
                                let s = k.stream().clone();
                                let mut d = DeviceFlat {
                                    buf: s.clone_htod(&x).unwrap(),
                                    kernels: k.clone(),
                                };
                                let mut comm = Loopback(c);
                                quantize::all_reduce_mean_device(&mut comm, &mut d, &rows, q)
                                    .unwrap();
                                s.clone_dtoh(&d.buf).unwrap()
                            } else {
                                let mut comm = c;
                                let mut scratch = quantize::Scratch::default();
                                quantize::all_reduce_mean(
                                    &mut comm,
                                    &mut x,
                                    &rows,
                                    q,
                                    &mut scratch,
                                )
                                .unwrap();
                                x
                            }
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        let (host, dev) = (run(false), run(true));
        for (rank, (h, d)) in host.iter().zip(&dev).enumerate() {
            assert_eq!(bits(d), bits(h), "{q:?}: rank {rank}");
        }
    }
}

/// One piece of a GPT-2 small step timed alone: `f` maps the inputs to an output, whose backward runs
/// from a fixed upstream gradient; `count` pieces like it a step; `bytes` (memory-bound pieces) or `flops`
/// (matmuls) of its forward, for the rate printed beside its time.
struct Piece {
    name: &'static str,
    count: usize,
    inputs: Vec<candle_core::Var>,
    work: Work,
    f: PieceFn,
}

type PieceFn = Box<dyn Fn(&[candle_core::Tensor]) -> candle_core::Tensor>;

enum Work {
    Bytes(f64),
    Flops(f64),
}

/// Mean milliseconds of `f` over `reps` runs after one warm-up, the device synchronized around them.
fn time_ms(dev: &candle_core::Device, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    dev.synchronize().unwrap();
    let t = std::time::Instant::now();
    for _ in 0..reps {
        f();
    }
    dev.synchronize().unwrap();
    t.elapsed().as_secs_f64() * 1e3 / reps as f64
}

/// GPT-2 small's shapes: batch, sequence, width, heads, vocabulary (batch 12 x 1024 as nanoGPT's).
const SHAPES: (usize, usize, usize, usize, usize) = (12, 1024, 768, 12, 50_304);

fn var(dev: &candle_core::Device, shape: &[usize]) -> candle_core::Var {
    candle_core::Var::randn(0f32, 1.0, shape, dev).unwrap()
}

/// a b in bf16, returned as f32 (the model's matmul under `train.amp`).
fn mm_bf16(a: &candle_core::Tensor, w: &candle_core::Tensor) -> candle_core::Tensor {
    use candle_core::DType;
    let bf = |x: &candle_core::Tensor| x.to_dtype(DType::BF16).unwrap();
    bf(a).matmul(&bf(w)).unwrap().to_dtype(DType::F32).unwrap()
}

/// f32 bytes of `passes` passes over `elems` entries.
fn f32s(elems: usize, passes: usize) -> Work {
    Work::Bytes((4 * elems * passes) as f64)
}

/// The step's matmuls, as the model's `linear` and attention run them.
fn matmul_pieces(dev: &candle_core::Device) -> Vec<Piece> {
    let (b, t, c, h, v) = SHAPES;
    let n = b * t;
    let linear = |name, count, k: usize, m: usize| Piece {
        name,
        count,
        inputs: vec![var(dev, &[n, k]), var(dev, &[m, k])],
        work: Work::Flops(2.0 * (n * k * m) as f64),
        f: Box::new(move |x| mm_bf16(&x[0], &x[1].t().unwrap())),
    };
    let qkv = || var(dev, &[b, h, t, c / h]);
    vec![
        linear("matmul bf16: attention q, k, v (each)", 36, c, c),
        linear("matmul bf16: attention out", 12, c, c),
        linear("matmul bf16: mlp up", 12, c, 4 * c),
        linear("matmul bf16: mlp down", 12, 4 * c, c),
        linear("matmul bf16: lm head", 1, c, v),
        Piece {
            name: "matmul bf16: attention q k^T, att v",
            count: 12,
            inputs: vec![qkv(), qkv(), qkv()],
            work: Work::Flops(4.0 * (b * h * t * t * (c / h)) as f64),
            f: Box::new(move |x| mm_bf16(&mm_bf16(&x[0], &x[1].t().unwrap()), &x[2])),
        },
    ]
}

/// The fused ops of `model::fused`.
fn fused_pieces(dev: &candle_core::Device, place: &nanodist::flat::Place) -> Vec<Piece> {
    let (b, t, c, h, v) = SHAPES;
    let n = b * t;
    let [p1, p2, p3, p4, p5, p6, p7, p8] = [0; 8].map(|_| place.clone());
    let tokens: Vec<u32> = (0..n as u32).map(|i| i * 7919 % v as u32).collect();
    let ids = (0..n as u32).map(|i| i * 7919 % v as u32).collect();
    let targets = candle_core::Tensor::from_vec(ids, n, dev).unwrap();
    vec![
        Piece {
            name: "causal softmax (fused)",
            count: 12,
            inputs: vec![var(dev, &[b, h, t, t])],
            work: f32s(b * h * t * t, 2),
            f: Box::new(move |x| {
                nanodist::model::fused::causal_softmax(&x[0], 0.125, &p1).unwrap()
            }),
        },
        Piece {
            name: "gelu, erf form (fused)",
            count: 12,
            inputs: vec![var(dev, &[n, 4 * c])],
            work: f32s(n * 4 * c, 2),
            f: Box::new(move |x| nanodist::model::fused::gelu(&x[0], false, &p4).unwrap()),
        },
        Piece {
            name: "layer norm (fused)",
            count: 25,
            inputs: vec![var(dev, &[n, c]), var(dev, &[c]), var(dev, &[c])],
            work: f32s(n * c, 2),
            f: Box::new(move |x| {
                nanodist::model::fused::layer_norm(&x[0], &x[1], &x[2], 1e-5, &p3).unwrap()
            }),
        },
        Piece {
            name: "rows to heads: q, k, v (fused)",
            count: 36,
            inputs: vec![var(dev, &[n, c])],
            work: f32s(n * c, 2),
            f: Box::new(move |x| nanodist::model::fused::to_heads(&x[0], t, h, &p5).unwrap()),
        },
        Piece {
            name: "heads to rows: attention output (fused)",
            count: 12,
            inputs: vec![var(dev, &[b, h, t, c / h])],
            work: f32s(n * c, 2),
            f: Box::new(move |x| nanodist::model::fused::from_heads(&x[0], &p6).unwrap()),
        },
        Piece {
            name: "bias add, mlp up (fused)",
            count: 12,
            inputs: vec![var(dev, &[n, 4 * c]), var(dev, &[4 * c])],
            work: f32s(n * 4 * c, 2),
            f: Box::new(move |x| nanodist::model::fused::bias_add(&x[0], &x[1], &p8).unwrap()),
        },
        Piece {
            name: "token embedding (fused)",
            count: 1,
            inputs: vec![var(dev, &[v, c])],
            work: f32s(n * c, 2),
            f: Box::new(move |x| nanodist::model::fused::embedding(&x[0], &tokens, &p7).unwrap()),
        },
        Piece {
            name: "cross-entropy (fused) and mean",
            count: 1,
            inputs: vec![var(dev, &[n, v])],
            work: f32s(n * v, 1),
            f: Box::new(move |x| {
                let rows = nanodist::model::fused::cross_entropy(&x[0], &targets, &p2).unwrap();
                rows.mean_all().unwrap()
            }),
        },
    ]
}

/// The step's other ops, candle's, as the model composes them.
fn composed_pieces(dev: &candle_core::Device) -> Vec<Piece> {
    let (b, t, c, _, _) = SHAPES;
    let n = b * t;
    let piece = |name, count, shapes: &[&[usize]], work, f: PieceFn| Piece {
        name,
        count,
        inputs: shapes.iter().map(|s| var(dev, s)).collect(),
        work,
        f,
    };
    vec![piece(
        "residual add",
        24,
        &[&[n, c], &[n, c]],
        f32s(n * c, 3),
        Box::new(|x| (&x[0] + &x[1]).unwrap()),
    )]
}

/// Not a check (run with `--ignored --nocapture`): the GPU time of each piece of a GPT-2 small step,
/// forward and backward, and the whole model's, as lines `op<TAB>name<TAB>count<TAB>forward ms<TAB>backward
/// ms<TAB>rate` that the self-test's `ops` step reads. The backward includes the upstream gradient's
/// multiply and sum.
#[test]
#[ignore]
fn op_times() {
    use candle_core::Tensor;
    let k = Arc::new(kernels());
    let dev = candle_core::Device::Cuda(k.candle_device().unwrap().clone());
    let place = nanodist::flat::Place::Cuda(k.clone());
    let all = [
        matmul_pieces(&dev),
        fused_pieces(&dev, &place),
        composed_pieces(&dev),
    ];
    for p in all.into_iter().flatten() {
        let x: Vec<Tensor> = p.inputs.iter().map(|v| v.as_tensor().clone()).collect();
        let g = (p.f)(&x).randn_like(0.0, 1.0).unwrap();
        let fwd = time_ms(&dev, 5, || drop((p.f)(&x)));
        let both = time_ms(&dev, 5, || {
            let y = (p.f)(&x);
            drop((y * &g).unwrap().sum_all().unwrap().backward().unwrap());
        });
        let rate = match p.work {
            Work::Bytes(b) => format!("{:.0} GB/s", b / fwd / 1e6),
            Work::Flops(f) => format!("{:.0} TFLOP/s", f / fwd / 1e9),
        };
        println!(
            "op\t{}\t{}\t{fwd:.3}\t{:.3}\t{rate}",
            p.name,
            p.count,
            both - fwd
        );
    }
    let cfg = nanodist::config::ModelConfig {
        n_layers: 12,
        n_heads: 12,
        n_embd: 768,
        dropout: 0.0,
        vocab_size: 50_304,
        bias: true,
        activation: nanodist::config::Activation::Gelu,
    };
    let m = nanodist::model::Gpt::new(&cfg, 1024, 0, &dev)
        .unwrap()
        .with_amp(true, nanodist::model::matmul::Precision::Bf16);
    let ids: Vec<u32> = (0..12 * 1024u32).map(|i| i * 7919 % 50_257).collect();
    let x = Tensor::from_vec(ids, (12, 1024), &dev).unwrap();
    let y = x.clone();
    let fwd = time_ms(&dev, 3, || drop(m.loss(&x, &y, None).unwrap()));
    let both = time_ms(&dev, 3, || {
        drop(m.loss(&x, &y, None).unwrap().backward().unwrap())
    });
    println!(
        "op\twhole model: loss and its backward\t1\t{fwd:.3}\t{:.3}\t",
        both - fwd
    );
}

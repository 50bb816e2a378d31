//! GPU checks, run by scripts/gpu-selftest.sh on a machine with a GPU: every reducer kernel against its
//! CPU twin (bit for bit: same algorithm, same blocking, no contracted multiply-adds), and the NCCL engine
//! at world size 1. CI compiles them (`cargo check --all-targets --features cuda,mpi`); without a GPU
//! they fail at their first line, naming the missing device.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use nanodist::comm::Communicator;
use nanodist::cuda::Kernels;
use nanodist::kernels as twin;
use rand::{Rng, SeedableRng};

fn kernels() -> Kernels {
    let ctx = CudaContext::new(0).expect("GPU 0 (these tests need a CUDA GPU)");
    Kernels::new(ctx.default_stream()).expect("loading the reducer PTX")
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
        let (gi, gv) = k.top_k(&dx, kk, 100).unwrap();
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
    k.gather(&dacc, &didx, &mut dgathered).unwrap();
    let mut dsent = s.alloc_zeros::<f32>(idx.len()).unwrap();
    k.gather_clear(&mut dacc, &didx, &mut dsent).unwrap();
    let mut ddense = s.alloc_zeros::<f32>(n).unwrap();
    k.scatter_add(&mut ddense, &didx, &dsent).unwrap();
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
        k.gram_schmidt(&mut dp, rows, cols, eps).unwrap();
        assert_eq!(
            bits(&s.clone_dtoh(&dp).unwrap()),
            bits(&p),
            "{rows} x {cols}"
        );
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

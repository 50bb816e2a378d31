use super::*;
use crate::config::{AccumAdamWConfig, AdamWConfig, OptimConfig};
use crate::kernels::Segment;

/// AdamW(lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1) on p = [1, -2] (decayed) and
/// q = [0.5] (not decayed) with gradients g_t = [0.1 t, -0.2], [0.3 / t], three steps, against the
/// algorithm as PyTorch's documentation states it (f64).
#[test]
fn adamw_matches_torch() {
    let cfg = OptimConfig::AdamW(AdamWConfig {
        betas: [0.9, 0.95],
        eps: 1e-8,
        weight_decay: 0.1,
    });
    let segs = vec![Segment::flat(0, 2, true), Segment::flat(2, 1, false)];
    let mut opt = build(&cfg, segs, &[], 3, &Place::Host).unwrap();
    let mut p = vec![1.0f32, -2.0, 0.5];
    for t in 1..=3 {
        let g = [0.1 * t as f32, -0.2, 0.3 / t as f32];
        opt.step((&mut p).into(), (&g[..]).into(), 0.1).unwrap();
    }
    let want = reference_adamw(
        &[1.0, -2.0, 0.5],
        [true, true, false],
        0.1,
        0.9,
        0.95,
        1e-8,
        0.1,
    );
    for (a, b) in p.iter().zip(&want) {
        assert!((a - b).abs() < 1e-6, "{p:?} vs {want:?}");
    }
}

/// The AdamW algorithm of the PyTorch documentation, in f64.
fn reference_adamw(
    p0: &[f64],
    decay: [bool; 3],
    lr: f64,
    b1: f64,
    b2: f64,
    eps: f64,
    wd: f64,
) -> Vec<f32> {
    let mut p = p0.to_vec();
    let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
    for t in 1..=3 {
        let g = [0.1 * t as f64, -0.2, 0.3 / t as f64];
        for i in 0..3 {
            if decay[i] {
                p[i] -= lr * wd * p[i];
            }
            m[i] = b1 * m[i] + (1.0 - b1) * g[i];
            v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
            let mh = m[i] / (1.0 - b1.powi(t));
            let vh = v[i] / (1.0 - b2.powi(t));
            p[i] -= lr * mh / (vh.sqrt() + eps);
        }
    }
    p.iter().map(|&x| x as f32).collect()
}

#[test]
fn accumadamw_follows_the_reference_recurrence() {
    let cfg = OptimConfig::AccumAdamW(AccumAdamWConfig {
        betas: [0.9, 0.98],
        eps: 1e-8,
        weight_decay: 0.0,
        accum_steps: 2,
    });
    let mut opt = build(&cfg, vec![Segment::flat(0, 1, true)], &[], 1, &Place::Host).unwrap();
    let mut p = vec![0.0f32];
    let gs = [1.0f64, 3.0, -2.0, 0.5];
    // f64 transcription of Decent-DP's optim.py.
    let (b1, b2, k, lr, eps) = (0.9f64, 0.98f64, 2u64, 0.01f64, 1e-8f64);
    let (mut sm, mut sv, mut acc, mut q) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (i, &g) in gs.iter().enumerate() {
        let t = i as u64 + 1;
        opt.step((&mut p).into(), (&[g as f32][..]).into(), lr)
            .unwrap();
        acc += g / k as f64;
        let m = sm + (1.0 - b1) * g;
        let v = sv + (1.0 - b2) * g * g;
        let c = t.div_ceil(k) as i32;
        q -= lr / (1.0 - b1.powi(c)) * m / (v.sqrt() / (1.0 - b2.powi(c)).sqrt() + eps);
        if t.is_multiple_of(k) {
            sm = b1 * (sm + (1.0 - b1) * acc);
            sv = b2 * (sv + (1.0 - b2) * acc * acc);
            acc = 0.0;
        }
        assert!((p[0] as f64 - q).abs() < 1e-6, "step {t}: {} vs {q}", p[0]);
    }
}

/// Shards updated alone (`step_shard`, cut anywhere, even inside a segment) give the bits of the whole
/// step, for every optimizer, over steps that cross AccumAdamW's commits and torch SGD's first step.
#[test]
fn shards_updated_apart_are_the_whole_step() {
    use crate::config::optim::SgdConfig;
    use rand::{Rng, SeedableRng};
    let configs = [
        OptimConfig::AdamW(AdamWConfig::default()),
        OptimConfig::AccumAdamW(AccumAdamWConfig {
            accum_steps: 2,
            ..AccumAdamWConfig::default()
        }),
        OptimConfig::Sgd(SgdConfig {
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.1,
        }),
        OptimConfig::Sgd(SgdConfig {
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.1,
        }),
    ];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let segs = Segment::end_to_end([(37, true), (5, false), (90, true), (1, false)]);
    let n = 133;
    let cuts = [0, 3, 37, 40, 41, 100, 133];
    let mut optimizers: Vec<(String, Box<dyn Optimizer>)> = configs
        .iter()
        .map(|c| {
            (
                format!("{c:?}"),
                build(c, segs.clone(), &[], n, &Place::Host).unwrap(),
            )
        })
        .collect();
    optimizers.push(("plain sgd".into(), Box::new(Sgd::new(0.1, segs.clone()))));
    for (name, mut whole) in optimizers {
        let mut sharded = build_like(&name, &configs, &segs, n);
        let mut p: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut q = p.clone();
        for t in 1..=5u64 {
            let g: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let (lr, scale) = (0.01 * t as f64, 0.5 + 0.1 * t as f32);
            whole
                .step_scaled((&mut p).into(), (&g[..]).into(), lr, scale)
                .unwrap();
            // As the local engine's shared replica holds them: the buffers' addresses.
            let state: Vec<*mut f32> = sharded
                .host_state_mut()
                .unwrap()
                .into_iter()
                .map(|b| b.as_mut_ptr())
                .collect();
            for w in cuts.windows(2) {
                let r = w[0]..w[1];
                let cut = Segment::cut(&segs, r.clone());
                let shard = Shard {
                    segs: &cut,
                    params: &mut q[r.clone()],
                    grads: &g[r.clone()],
                    // SAFETY: disjoint ranges of live buffers, one shard at a time.
                    state: state
                        .iter()
                        .map(|&b| unsafe {
                            std::slice::from_raw_parts_mut(b.add(r.start), r.len())
                        })
                        .collect(),
                };
                sharded.step_shard(shard, t, lr, scale).unwrap();
            }
            assert_eq!(p, q, "{name}, step {t}");
        }
        let (a, b) = (whole.state().unwrap(), sharded.state().unwrap());
        assert_eq!(a.buffers, b.buffers, "{name}");
    }
}

fn build_like(
    name: &str,
    configs: &[OptimConfig],
    segs: &[Segment],
    n: usize,
) -> Box<dyn Optimizer> {
    match configs.iter().find(|c| format!("{c:?}") == name) {
        Some(c) => build(c, segs.to_vec(), &[], n, &Place::Host).unwrap(),
        None => Box::new(Sgd::new(0.1, segs.to_vec())),
    }
}

#[test]
fn cut_segments_cover_the_range_from_its_start() {
    let segs = Segment::end_to_end([(4, true), (3, false), (5, true)]);
    assert_eq!(
        Segment::cut(&segs, 2..9),
        Segment::end_to_end([(2, true), (3, false), (2, true)])
    );
    assert_eq!(Segment::cut(&segs, 4..7), Segment::end_to_end([(3, false)]));
    assert!(Segment::cut(&segs, 5..5).is_empty());
}

#[test]
fn state_round_trips_and_rejects_another_optimizer() {
    let cfg = OptimConfig::AdamW(AdamWConfig::default());
    let seg = vec![Segment::flat(0, 2, true)];
    let mut a = build(&cfg, seg.clone(), &[], 2, &Place::Host).unwrap();
    let mut p = vec![1.0f32, 2.0];
    a.step((&mut p).into(), (&[0.5, -0.5][..]).into(), 0.01)
        .unwrap();
    let mut b = build(&cfg, seg.clone(), &[], 2, &Place::Host).unwrap();
    b.load_state(a.state().unwrap()).unwrap();
    let mut p2 = p.clone();
    let g = [0.1f32, 0.2];
    a.step((&mut p).into(), (&g[..]).into(), 0.01).unwrap();
    b.step((&mut p2).into(), (&g[..]).into(), 0.01).unwrap();
    assert_eq!(p, p2);
    let mut c = build(
        &OptimConfig::AccumAdamW(AccumAdamWConfig::default()),
        seg,
        &[],
        2,
        &Place::Host,
    )
    .unwrap();
    assert!(c
        .load_state(a.state().unwrap())
        .unwrap_err()
        .to_string()
        .contains("weights"));
}

#[test]
fn clipping_scales_to_the_max_norm_and_reports_the_pre_clip_norm() {
    let mut g = vec![3.0f32, 4.0];
    assert_eq!(clip_grad_norm(&mut g, 1.0), 5.0);
    assert!((global_norm(&g) - 1.0).abs() < 1e-6);
    let mut g = vec![0.3f32, 0.4];
    clip_grad_norm(&mut g, 1.0);
    assert_eq!(g, vec![0.3, 0.4]);
    let mut g = vec![30.0f32, 40.0];
    clip_grad_norm(&mut g, 0.0);
    assert_eq!(g, vec![30.0, 40.0]);
}

/// The clipping folded into the update (`step_scaled`) gives what scaling the gradient first gave,
/// bit for bit, for every optimizer the loop runs.
#[test]
fn a_scaled_step_is_the_step_of_the_scaled_gradient() {
    use crate::config::optim::SgdConfig;
    use crate::config::OptimConfig;
    let sgd = |momentum, nesterov| {
        OptimConfig::Sgd(SgdConfig {
            momentum,
            nesterov,
            weight_decay: 0.1,
        })
    };
    let accum = OptimConfig::AccumAdamW(crate::config::AccumAdamWConfig {
        accum_steps: 2,
        ..Default::default()
    });
    let dense = None;
    let segs = Segment::end_to_end([(7, true), (3, false)]);
    for optim in [
        OptimConfig::default(),
        accum,
        sgd(0.0, false),
        sgd(0.9, true),
    ] {
        let mut a = for_run(&optim, dense, segs.clone(), &[], 10, &Place::Host).unwrap();
        let mut b = for_run(&optim, dense, segs.clone(), &[], 10, &Place::Host).unwrap();
        let (mut pa, mut pb) = (vec![0.3f32; 10], vec![0.3f32; 10]);
        for t in 0..4 {
            let g: Vec<f32> = (0..10).map(|i| (i as f32 - 4.5) * (t + 1) as f32).collect();
            let mut clipped = g.clone();
            let norm = clip_grad_norm(&mut clipped, 1.0);
            let c = clip_factor(norm, 1.0);
            a.step((&mut pa).into(), (&clipped).into(), 0.01).unwrap();
            b.step_scaled((&mut pb).into(), (&g).into(), 0.01, c)
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&pa), bits(&pb), "{optim:?} step {t}");
        }
    }
}

/// `state_buffers` (what `check` budgets) is what each optimizer holds after a step.
#[test]
fn state_buffers_counts_what_the_optimizers_hold() {
    use crate::config::optim::SgdConfig;
    use crate::config::OptimConfig;
    let sgd = |momentum| {
        OptimConfig::Sgd(SgdConfig {
            momentum,
            nesterov: false,
            weight_decay: 0.0,
        })
    };
    let accum = OptimConfig::AccumAdamW(Default::default());
    let dense = None;
    for optim in [OptimConfig::default(), accum, sgd(0.0), sgd(0.9)] {
        let numel = 10;
        let seg = vec![Segment::flat(0, numel, true)];
        let mut opt = for_run(&optim, dense, seg, &[], numel, &Place::Host).unwrap();
        let mut p = vec![1.0f32; numel];
        opt.step((&mut p).into(), (&[0.5; 10][..]).into(), 0.1)
            .unwrap();
        let held: usize = opt.view().buffers.iter().map(|(_, b)| b.len()).sum();
        assert_eq!(
            held as u64,
            state_buffers(&optim, dense) * numel as u64,
            "{optim:?}"
        );
    }
}

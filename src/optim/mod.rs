//! Optimizers, learning-rate schedules and gradient clipping: pure functions of flat parameter,
//! gradient and state buffers (name-sorted, as `model::ParamSet` lays them out).

pub mod adamw;
pub mod schedule;

pub use adamw::{build, OptimState, OptimView, Optimizer, Sgd};
pub use schedule::lr_at;

use anyhow::Result;

use crate::flat::{FlatRef, Place};
use crate::kernels::Segment;

/// The optimizer the training loop steps: the configured one, or, when `plain_sgd` gives its decoupled
/// weight decay, SGD (Radius runs Adam inside its reducer, `sync::compress::correction`; DeMo computes
/// the direction: `SyncPlan::plain_sgd_in_loop`).
pub fn for_run(
    optim: &crate::config::OptimConfig,
    plain_sgd: Option<f64>,
    segments: Vec<Segment>,
    numel: usize,
    place: &Place,
) -> Result<Box<dyn Optimizer>> {
    match plain_sgd {
        Some(wd) => Ok(Box::new(Sgd::new(wd, segments))),
        None => build(optim, segments, numel, place),
    }
}

/// Whole-model buffers (of the parameters' size) that the loop's optimizer of `for_run` keeps.
pub fn state_buffers(optim: &crate::config::OptimConfig, plain_sgd: Option<f64>) -> u64 {
    use crate::config::OptimConfig;
    match (plain_sgd, optim) {
        (Some(_), _) => 0,
        (None, OptimConfig::AdamW(_)) => 2,
        (None, OptimConfig::AccumAdamW(_)) => 3,
        (None, OptimConfig::Sgd(c)) => u64::from(c.momentum > 0.0),
    }
}

/// Global L2 norm of a flat buffer: the f64 sum of squares of the `sum_squares` kernel (its CPU twin).
pub fn global_norm(g: &[f32]) -> f64 {
    crate::kernels::optim::sum_squares(g).sqrt()
}

/// Global L2 norm of a flat buffer wherever it lives (the `sum_squares` kernel on the GPU).
pub fn norm(x: FlatRef<'_>) -> Result<f64> {
    Ok(x.sum_squares()?.sqrt())
}

/// torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1.
/// Returns the norm before clipping. `max_norm <= 0` disables clipping. (The training loop applies the
/// factor in the optimizer's pass instead: `Optimizer::step_scaled`.)
pub fn clip_grad_norm(g: &mut [f32], max_norm: f64) -> f64 {
    let norm = global_norm(g);
    let c = clip_factor(norm, max_norm);
    if c < 1.0 {
        crate::kernels::scale(g, c);
    }
    norm
}

/// The factor torch.nn.utils.clip_grad_norm_ scales a gradient of global norm `norm` by:
/// max_norm / (norm + 1e-6) when that is below 1, else 1 (`max_norm <= 0` disables clipping).
pub fn clip_factor(norm: f64, max_norm: f64) -> f32 {
    let coef = max_norm / (norm + 1e-6);
    if max_norm > 0.0 && coef < 1.0 {
        coef as f32
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            let mut a = for_run(&optim, dense, segs.clone(), 10, &Place::Host).unwrap();
            let mut b = for_run(&optim, dense, segs.clone(), 10, &Place::Host).unwrap();
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
            let seg = vec![Segment {
                offset: 0,
                len: numel,
                decay: true,
            }];
            let mut opt = for_run(&optim, dense, seg, numel, &Place::Host).unwrap();
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
}

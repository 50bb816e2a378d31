//! Optimizers, learning-rate schedules and gradient clipping: pure functions of flat parameter,
//! gradient and state buffers (name-sorted, as `model::ParamSet` lays them out).

pub mod adamw;
pub mod schedule;

pub use adamw::{build, OptimState, OptimView, Optimizer, Segment, Sgd};
pub use schedule::lr_at;

use anyhow::Result;

use crate::flat::{FlatMut, FlatRef, Place};

/// The optimizer the training loop steps: the configured one, or SGD with decoupled weight decay when
/// Radius runs Adam inside its reducer (`sync::compress::correction`) or DeMo computes the direction.
pub fn for_run(
    optim: &crate::config::OptimConfig,
    sync: &crate::config::resolve::SyncPlan,
    segments: Vec<Segment>,
    numel: usize,
    place: &Place,
) -> Result<Box<dyn Optimizer>> {
    match sync.plain_sgd_in_loop() {
        Some(wd) => Ok(Box::new(Sgd::new(wd, segments))),
        None => build(optim, segments, numel, place),
    }
}

/// Whole-model buffers (of the parameters' size) that the loop's optimizer of `for_run` keeps.
pub fn state_buffers(
    optim: &crate::config::OptimConfig,
    sync: &crate::config::resolve::SyncPlan,
) -> u64 {
    use crate::config::OptimConfig;
    match (sync.plain_sgd_in_loop(), optim) {
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
/// Returns the norm before clipping. `max_norm <= 0` disables clipping.
pub fn clip_grad_norm(g: &mut [f32], max_norm: f64) -> f64 {
    clip_flat(g.into(), max_norm).expect("host buffers: the kernels' twins cannot fail")
}

/// `clip_grad_norm` of a buffer wherever it lives (the `sum_squares` and `scale` kernels on the GPU).
pub fn clip_flat(mut g: FlatMut<'_>, max_norm: f64) -> Result<f64> {
    let norm = g.as_ref().sum_squares()?.sqrt();
    if max_norm > 0.0 {
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            g.scale(coef as f32)?;
        }
    }
    Ok(norm)
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

    /// `state_buffers` (what `check` budgets) is what each optimizer holds after a step.
    #[test]
    fn state_buffers_counts_what_the_optimizers_hold() {
        use crate::config::optim::SgdConfig;
        use crate::config::resolve::SyncPlan;
        use crate::config::OptimConfig;
        let sgd = |momentum| {
            OptimConfig::Sgd(SgdConfig {
                momentum,
                nesterov: false,
                weight_decay: 0.0,
            })
        };
        let accum = OptimConfig::AccumAdamW(Default::default());
        let dense = SyncPlan::AllReduce { bucket_elems: 8 };
        for optim in [OptimConfig::default(), accum, sgd(0.0), sgd(0.9)] {
            let numel = 10;
            let seg = vec![Segment {
                offset: 0,
                len: numel,
                decay: true,
            }];
            let mut opt = for_run(&optim, &dense, seg, numel, &Place::Host).unwrap();
            let mut p = vec![1.0f32; numel];
            opt.step((&mut p).into(), (&[0.5; 10][..]).into(), 0.1)
                .unwrap();
            let held: usize = opt.view().buffers.iter().map(|(_, b)| b.len()).sum();
            assert_eq!(
                held as u64,
                state_buffers(&optim, &dense) * numel as u64,
                "{optim:?}"
            );
        }
    }
}

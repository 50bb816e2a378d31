//! Optimizers, learning-rate schedules and gradient clipping: pure functions of flat parameter,
//! gradient and state buffers (name-sorted, as `model::ParamSet` lays them out).

pub mod adamw;
pub mod muon;
mod optimizer;
pub mod schedule;
pub mod sgd;
#[cfg(test)]
mod tests;

pub use optimizer::{build, OptimState, OptimView, Optimizer, Shard};
pub use schedule::lr_at;
pub use sgd::Sgd;

use anyhow::Result;

use crate::flat::{FlatRef, Place};
use crate::kernels::Segment;

/// The optimizer the training loop steps: the configured one, or, when `plain_sgd` gives its decoupled
/// weight decay, SGD (Radius runs Adam inside its reducer, `sync::compress::correction`; DeMo computes
/// the direction: `SyncPlan::plain_sgd_in_loop`). `hidden[i]`: whether segment i is a hidden matrix
/// (Muon's group).
pub fn for_run(
    optim: &crate::config::OptimConfig,
    plain_sgd: Option<f64>,
    segments: Vec<Segment>,
    hidden: &[bool],
    numel: usize,
    place: &Place,
) -> Result<Box<dyn Optimizer>> {
    match plain_sgd {
        Some(wd) => Ok(Box::new(Sgd::new(wd, segments))),
        None => build(optim, segments, hidden, numel, place),
    }
}

/// Whether the optimizer updates each element from its own state alone, so that ranges of a buffer
/// can be updated apart (`Optimizer::step_shard`): all but Muon, whose update of a matrix needs all of it.
pub fn elementwise(optim: &crate::config::OptimConfig, plain_sgd: Option<f64>) -> bool {
    plain_sgd.is_some() || !matches!(optim, crate::config::OptimConfig::Muon(_))
}

/// Whole-model buffers (of the parameters' size) that the loop's optimizer of `for_run` keeps.
pub fn state_buffers(optim: &crate::config::OptimConfig, plain_sgd: Option<f64>) -> u64 {
    use crate::config::OptimConfig;
    match (plain_sgd, optim) {
        (Some(_), _) => 0,
        (None, OptimConfig::AdamW(_)) => 2,
        (None, OptimConfig::AccumAdamW(_)) => 3,
        (None, OptimConfig::Sgd(c)) => u64::from(c.momentum > 0.0),
        (None, OptimConfig::Muon(_)) => 3,
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

//! The seed runner's schedule: PyTorch SequentialLR of LinearLR(start_factor = 1/warmup) for
//! `warmup_steps` steps and CosineAnnealingLR(T_max = n_steps - warmup_steps, eta_min), in closed form.

use crate::config::LrSchedule;

/// Learning rate used for optimizer step `step` (0-based).
pub fn lr_at(schedule: &LrSchedule, step: u64, n_steps: u64) -> f64 {
    let LrSchedule::Cosine(c) = schedule;
    let w = c.warmup_steps;
    if step < w {
        let start = 1.0 / w as f64;
        return c.lr * (start + (1.0 - start) * step as f64 / w as f64);
    }
    let t_max = n_steps.saturating_sub(w).max(1) as f64;
    let e = (step - w) as f64;
    c.eta_min + (c.lr - c.eta_min) * (1.0 + (std::f64::consts::PI * e / t_max).cos()) / 2.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CosineSchedule;

    fn seed_schedule() -> LrSchedule {
        LrSchedule::Cosine(CosineSchedule {
            lr: 6e-4,
            warmup_steps: 2000,
            eta_min: 6e-5,
        })
    }

    #[test]
    fn pinned_values_of_the_seed_schedule() {
        let s = seed_schedule();
        let n = 600_000;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-15;
        assert!(close(lr_at(&s, 0, n), 6e-4 / 2000.0)); // step 0: lr / warmup
        assert!(close(
            lr_at(&s, 1000, n),
            6e-4 * (1.0 / 2000.0 + (1.0 - 1.0 / 2000.0) * 0.5)
        ));
        assert!(close(lr_at(&s, 2000, n), 6e-4)); // warm-up end: peak
        assert!(close(lr_at(&s, 2000 + 299_000, n), (6e-4 + 6e-5) / 2.0)); // middle of the cosine
        assert!(close(lr_at(&s, n, n), 6e-5)); // end: eta_min
                                               // Monotone decay after warm-up.
        assert!(lr_at(&s, 100_000, n) > lr_at(&s, 100_001, n));
    }
}

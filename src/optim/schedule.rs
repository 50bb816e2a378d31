//! Learning-rate schedules in closed form. Warm-up: the seed runner's PyTorch SequentialLR, LinearLR with
//! start_factor = 1/warmup for `warmup` steps; then the decay by name, Megatron's semantics
//! (OptimizerParamScheduler): the decay reaches `eta_min` at `decay_steps` and stays there.

use crate::config::lr::{ScheduleName, WsdDecay};
use crate::config::LrSchedule;

/// Learning rate used for optimizer step `step` (0-based) of a run of `n_steps`.
pub fn lr_at(s: &LrSchedule, step: u64, n_steps: u64) -> f64 {
    let w = s.warmup(n_steps);
    if step < w {
        let start = 1.0 / w as f64;
        return s.lr * (start + (1.0 - start) * step as f64 / w as f64);
    }
    let end = s.decay_end(n_steps);
    if s.name == ScheduleName::Constant {
        return s.lr;
    }
    if step >= end {
        return s.eta_min;
    }
    let (from, len) = match s.name {
        ScheduleName::Wsd => {
            let start = s.wsd_decay_start(n_steps).max(w);
            if step < start {
                return s.lr;
            }
            (start, end - start)
        }
        _ => (w, end - w),
    };
    let r = (step - from) as f64 / len.max(1) as f64;
    let coeff = match (s.name, s.decay_style.unwrap_or_default()) {
        (ScheduleName::Linear, _) | (ScheduleName::Wsd, WsdDecay::Linear) => 1.0 - r,
        (ScheduleName::Wsd, WsdDecay::Exponential) => 2.0 * 0.5f64.powf(r) - 1.0,
        _ => (1.0 + (std::f64::consts::PI * r).cos()) / 2.0,
    };
    s.eta_min + (s.lr - s.eta_min) * coeff
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(name: ScheduleName) -> LrSchedule {
        LrSchedule {
            name,
            lr: 6e-4,
            warmup_steps: Some(2000),
            eta_min: 6e-5,
            ..LrSchedule::default()
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-15
    }

    #[test]
    fn pinned_values_of_the_seed_schedule() {
        let s = schedule(ScheduleName::Cosine);
        let n = 600_000;
        assert!(close(lr_at(&s, 0, n), 6e-4 / 2000.0)); // step 0: lr / warmup
        assert!(close(
            lr_at(&s, 1000, n),
            6e-4 * (1.0 / 2000.0 + (1.0 - 1.0 / 2000.0) * 0.5)
        ));
        assert!(close(lr_at(&s, 2000, n), 6e-4)); // warm-up end: peak
        assert!(close(lr_at(&s, 2000 + 299_000, n), (6e-4 + 6e-5) / 2.0)); // middle of the cosine
        assert!(close(lr_at(&s, n, n), 6e-5)); // end: eta_min
        assert!(lr_at(&s, 100_000, n) > lr_at(&s, 100_001, n)); // monotone decay after warm-up
                                                                // The default warm-up is the seed runner's 2000 steps.
        let default = LrSchedule {
            warmup_steps: None,
            ..s.clone()
        };
        assert_eq!(lr_at(&default, 1234, n), lr_at(&s, 1234, n));
    }

    #[test]
    fn each_schedule_follows_its_formula() {
        let n = 10_000;
        let pi = std::f64::consts::PI;
        // Cosine ending at decay_steps = 6000 < n: eta_min from there on.
        let cos = LrSchedule {
            decay_steps: Some(6000),
            ..schedule(ScheduleName::Cosine)
        };
        let at = |s: &LrSchedule, step| lr_at(s, step, n);
        let r = (3000.0 - 2000.0) / 4000.0;
        assert!(close(
            at(&cos, 3000),
            6e-5 + 5.4e-4 * (1.0 + (pi * r).cos()) / 2.0
        ));
        assert!(close(at(&cos, 6000), 6e-5) && close(at(&cos, 9000), 6e-5));
        // Linear to eta_min at n.
        let lin = schedule(ScheduleName::Linear);
        assert!(close(at(&lin, 6000), 6e-5 + 5.4e-4 * 0.5));
        assert!(close(at(&lin, n), 6e-5));
        // Constant after the warm-up, through the end.
        let constant = schedule(ScheduleName::Constant);
        assert!(close(at(&constant, 2000), 6e-4) && close(at(&constant, n + 5), 6e-4));
        assert!(close(at(&constant, 1000), at(&cos, 1000)));
        // WSD: stable until n - 0.1 n, then exponential (default), linear or cosine decay.
        let wsd = |style| LrSchedule {
            decay_style: style,
            ..schedule(ScheduleName::Wsd)
        };
        let exp = wsd(None);
        assert!(close(at(&exp, 2000), 6e-4) && close(at(&exp, 8999), 6e-4));
        assert!(close(at(&exp, 9000), 6e-4)); // r = 0
        let r = 0.5;
        assert!(close(
            at(&exp, 9500),
            6e-5 + 5.4e-4 * (2.0 * 0.5f64.powf(r) - 1.0)
        ));
        assert!(close(
            at(&wsd(Some(WsdDecay::Linear)), 9500),
            6e-5 + 5.4e-4 * 0.5
        ));
        assert!(close(
            at(&wsd(Some(WsdDecay::Cosine)), 9750),
            6e-5 + 5.4e-4 * (1.0 + (pi * 0.75).cos()) / 2.0
        ));
        assert!(close(at(&exp, n), 6e-5));
        // A decay fraction and decay_steps: the decay is the 2000 steps before step 8000.
        let short = LrSchedule {
            decay_fraction: Some(0.2),
            decay_steps: Some(8000),
            decay_style: Some(WsdDecay::Linear),
            ..schedule(ScheduleName::Wsd)
        };
        assert!(close(at(&short, 5999), 6e-4) && close(at(&short, 7000), 6e-5 + 5.4e-4 * 0.5));
        assert!(close(at(&short, 8000), 6e-5));
        // Warm-up as a fraction of the run: 5% of 10000 = 500 steps.
        let frac = LrSchedule {
            warmup_steps: None,
            warmup_fraction: Some(0.05),
            ..schedule(ScheduleName::Linear)
        };
        assert!(close(
            at(&frac, 250),
            6e-4 * (1.0 / 500.0 + (1.0 - 1.0 / 500.0) * 0.5)
        ));
        assert!(close(at(&frac, 500), 6e-4));
    }
}

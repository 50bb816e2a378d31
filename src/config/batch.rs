//! The global batch of each step: constant, or growing as Megatron's `--rampup-batch-size START INCREMENT
//! SAMPLES` makes it (megatron/microbatches.py, `RampupBatchsizeNumMicroBatches`).
//!
//! Megatron's rule: with `n = (global - start) / increment` increments, after `consumed` samples the batch
//! is `start + floor(consumed / (samples / n)) * increment`, and `global` once `consumed > samples`. The
//! batch of a step depends on the samples consumed before it, so the schedule is a list of stages (first
//! step, batch, samples before it), built once; every question about a step is a lookup, and a resumed run
//! needs nothing but its step.

/// Per-step global batch sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchSchedule {
    global: u64,
    /// Stages in step order; the last one has the full batch and lasts for ever.
    stages: Vec<Stage>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stage {
    first_step: u64,
    batch: u64,
    samples_before: u64,
}

impl BatchSchedule {
    /// The batch of every step is `global`.
    pub fn constant(global: u64) -> Self {
        Self {
            global,
            stages: vec![Stage {
                first_step: 0,
                batch: global,
                samples_before: 0,
            }],
        }
    }

    /// `global` reached from `start` by `increment`s over `samples` samples; `Err` says which rule of
    /// Megatron's the three numbers break.
    pub fn ramp(global: u64, [start, increment, samples]: [u64; 3]) -> Result<Self, String> {
        if start == 0 || increment == 0 || samples == 0 {
            return Err(format!(
                "[start, increment, samples] = [{start}, {increment}, {samples}]: each must be at least 1"
            ));
        }
        if start >= global {
            return Err(format!(
                "the ramp starts at {start} sequences, which is not below global_batch_size = {global}"
            ));
        }
        if !(global - start).is_multiple_of(increment) {
            return Err(format!(
                "global_batch_size - start = {global} - {start} = {} is not a multiple of the increment {increment}",
                global - start
            ));
        }
        let n = (global - start) / increment;
        // The increment a count of consumed samples has reached: floor(consumed / (samples / n)), in
        // integers (Megatron divides in floating point; the two agree but for rounding at the boundaries).
        let reached = |consumed: u64| -> u64 {
            if consumed > samples {
                n
            } else {
                ((consumed as u128 * n as u128) / samples as u128).min(n as u128) as u64
            }
        };
        let mut stages = Vec::new();
        let (mut step, mut consumed) = (0u64, 0u64);
        loop {
            let k = reached(consumed);
            let batch = start + k * increment;
            stages.push(Stage {
                first_step: step,
                batch,
                samples_before: consumed,
            });
            if k == n {
                break;
            }
            // The first count of samples that reaches increment k + 1 (or passes `samples`).
            let next = ((k as u128 + 1) * samples as u128).div_ceil(n as u128) as u64;
            let steps = (next - consumed).div_ceil(batch);
            step += steps;
            consumed += steps * batch;
        }
        Ok(Self { global, stages })
    }

    /// From the config's `global_batch_size` and `rampup_batch_size`.
    pub fn of(global: u64, rampup: Option<[u64; 3]>) -> Result<Self, String> {
        match rampup {
            None => Ok(Self::constant(global)),
            Some(r) => Self::ramp(global, r),
        }
    }

    /// The full global batch.
    pub fn global(&self) -> u64 {
        self.global
    }

    /// Whether the batch changes during the run.
    pub fn ramps(&self) -> bool {
        self.stages.len() > 1
    }

    fn stage(&self, step: u64) -> &Stage {
        let i = self.stages.partition_point(|s| s.first_step <= step);
        &self.stages[i.saturating_sub(1)]
    }

    /// Sequences in the global batch of `step` (0-based).
    pub fn batch_at(&self, step: u64) -> u64 {
        self.stage(step).batch
    }

    /// Sequences consumed by the steps before `step`.
    pub fn samples_before(&self, step: u64) -> u64 {
        let s = self.stage(step);
        s.samples_before + (step - s.first_step) * s.batch
    }

    /// The number of steps that consume at least `samples` sequences (the first step count whose samples
    /// reach it).
    pub fn steps_for(&self, samples: u64) -> u64 {
        let i = self.stages.partition_point(|s| s.samples_before < samples);
        let s = &self.stages[i.saturating_sub(1)];
        s.first_step + samples.saturating_sub(s.samples_before).div_ceil(s.batch)
    }

    /// The first step at the full batch.
    pub fn full_from(&self) -> u64 {
        self.stages.last().map_or(0, |s| s.first_step)
    }

    /// Each stage's (first step, batch), in order.
    pub fn stages(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.stages.iter().map(|s| (s.first_step, s.batch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Megatron's own arithmetic, step by step: `update_num_microbatches(consumed)` with its floating-point
    /// `rampup_samples_per_increment`, then `consumed += current_global_batch_size`.
    fn megatron(global: u64, [start, inc, samples]: [u64; 3], steps: u64) -> Vec<u64> {
        let per_increment = samples as f64 / ((global - start) / inc) as f64;
        let mut consumed = 0u64;
        (0..steps)
            .map(|_| {
                let batch = if consumed > samples {
                    global
                } else {
                    start + (consumed as f64 / per_increment) as u64 * inc
                };
                consumed += batch;
                batch
            })
            .collect()
    }

    #[test]
    fn batches_follow_megatrons_rampup_step_by_step() {
        for (global, ramp) in [
            (16, [4, 4, 100]),
            (16, [4, 4, 7]),
            (16, [2, 2, 1000]),
            (512, [32, 32, 10_000]),
            (2048, [192, 16, 9_765_625 / 100]), // BLOOM-176B's ramp, samples scaled down
            (12, [3, 3, 3]),
            (8, [4, 2, 1]),
        ] {
            let s = BatchSchedule::ramp(global, ramp).unwrap();
            let want = megatron(global, ramp, 2000);
            let mut consumed = 0;
            for (step, &b) in want.iter().enumerate() {
                let step = step as u64;
                assert_eq!(s.batch_at(step), b, "{global} {ramp:?} step {step}");
                assert_eq!(
                    s.samples_before(step),
                    consumed,
                    "{global} {ramp:?} step {step}"
                );
                assert_eq!(s.steps_for(consumed), step, "{global} {ramp:?} step {step}");
                if b > 1 {
                    assert_eq!(s.steps_for(consumed + 1), step + 1);
                }
                consumed += b;
            }
            assert!(s.ramps());
            assert_eq!(s.batch_at(s.full_from()), global);
            assert!(s.batch_at(s.full_from() - 1) < global);
        }
    }

    #[test]
    fn a_constant_batch_is_one_stage() {
        let s = BatchSchedule::of(480, None).unwrap();
        assert!(!s.ramps());
        assert_eq!((s.batch_at(7), s.samples_before(7)), (480, 3360));
        assert_eq!((s.steps_for(480), s.steps_for(481)), (1, 2));
        assert_eq!(s.steps_for(0), 0);
    }

    #[test]
    fn megatrons_rules_are_errors() {
        for (global, ramp, says) in [
            (16, [0, 4, 100], "at least 1"),
            (16, [16, 4, 100], "not below"),
            (16, [4, 5, 100], "not a multiple"),
        ] {
            let e = BatchSchedule::ramp(global, ramp).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
    }
}

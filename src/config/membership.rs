//! `[train.membership]`: workers that leave and come back during a run (churn), simulated exactly by
//! the local engine. A schedule of absences, or a seeded random process that makes one.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::error::Problem;
use super::tree::Node;
use super::validate::problem_at;

const KEY: &str = "train.membership";

/// Who is away when. Step numbers are the rows' (step k is the k-th optimizer step).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct MembershipConfig {
    /// Absences: worker `worker` trains step `from`, is away for steps `from + 1` to `until`, and trains
    /// again from step `until + 1` (without `until` it never comes back).
    pub absences: Vec<Absence>,
    /// A seeded random process instead of `absences`: every worker but 0 stays for an exponentially
    /// distributed number of steps with this mean, then is away for `down_steps` steps, and again.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub mean_steps_up: Option<f64>,
    /// Steps a worker of the random process stays away (required with `mean_steps_up`).
    #[schemars(range(min = 1))]
    pub down_steps: Option<u64>,
    /// Seed of the random process (default: train.seed).
    pub seed: Option<u64>,
    /// Workers slower than the others: each of their steps computes `slowdown` times as long.
    pub stragglers: Vec<Straggler>,
    /// The cluster profile (a name in config/clusters, or a file) that prices the simulated clock the
    /// rows log as `sim_s`: each worker's compute and communication on that cluster (default "local").
    pub cluster: Option<String>,
}

/// A worker slower than the others.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Straggler {
    pub worker: usize,
    /// Its compute time over the others' (3.0: three times as long).
    #[schemars(range(min = 1.0))]
    pub slowdown: f64,
}

/// One absence of one worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Absence {
    /// The worker (1 to workers - 1: worker 0 writes the run's logs and cannot leave).
    pub worker: usize,
    /// Its last step before it leaves.
    #[schemars(range(min = 1))]
    pub from: u64,
    /// Its last step away (absent: it never comes back).
    pub until: Option<u64>,
}

impl MembershipConfig {
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Whether the section asks for nothing: nobody leaves, nobody is slower, and no simulated clock.
    pub fn is_empty(&self) -> bool {
        self.absences.is_empty()
            && self.mean_steps_up.is_none()
            && self.stragglers.is_empty()
            && self.cluster.is_none()
    }

    /// The rules the schema cannot state, for `world` workers and a run of `n_steps` steps.
    pub fn problems(&self, doc: &Node, world: usize, n_steps: u64) -> Vec<Problem> {
        let mut out = Vec::new();
        let mut add = |path: String, msg: String| out.push(problem_at(doc, &path, msg));
        if self.mean_steps_up.is_some() && !self.absences.is_empty() {
            add(
                format!("{KEY}.mean_steps_up"),
                "give either absences or the random process (mean_steps_up, down_steps), not both"
                    .into(),
            );
        }
        if self.mean_steps_up.is_some() != self.down_steps.is_some() {
            add(
                format!("{KEY}.down_steps"),
                "the random process needs both mean_steps_up and down_steps (e.g. mean_steps_up = 500, \
                 down_steps = 50)"
                    .into(),
            );
        }
        if (!self.absences.is_empty() || self.mean_steps_up.is_some()) && world < 2 {
            add(
                KEY.into(),
                "with one worker nobody can leave: run 2 or more workers (--workers 8), or remove \
                 [train.membership]"
                    .into(),
            );
        }
        for i in 0..self.absences.len() {
            self.absence_problems(i, world, n_steps, &mut add);
        }
        for (i, st) in self.stragglers.iter().enumerate() {
            let earlier = self.stragglers[..i].iter().any(|o| o.worker == st.worker);
            if st.worker >= world || earlier {
                let what = if earlier {
                    "is listed twice"
                } else {
                    "does not exist"
                };
                add(
                    format!("{KEY}.stragglers[{i}].worker"),
                    format!(
                        "worker {} {what}: list each of workers 0 to {} once",
                        st.worker,
                        world.saturating_sub(1)
                    ),
                );
            }
        }
        out
    }

    /// The problems of absence `i`.
    fn absence_problems(
        &self,
        i: usize,
        world: usize,
        n_steps: u64,
        add: &mut dyn FnMut(String, String),
    ) {
        let a = &self.absences[i];
        let at = |k: &str| format!("{KEY}.absences[{i}].{k}");
        if a.worker == 0 || a.worker >= world {
            add(
                at("worker"),
                format!(
                    "worker {} cannot leave: the workers that can are 1 to {} (worker 0 writes the run's \
                     logs and checkpoints, so the world is never empty)",
                    a.worker,
                    world.saturating_sub(1)
                ),
            );
        }
        if a.from >= n_steps {
            add(
                at("from"),
                format!(
                    "from = {} is not before the run's last step {n_steps}: the worker would never leave",
                    a.from
                ),
            );
        }
        if let Some(u) = a.until.filter(|&u| u <= a.from) {
            add(
                at("until"),
                format!(
                    "until = {u} must be after from = {}: the last step away",
                    a.from
                ),
            );
        }
        let overlap = self.absences[..i].iter().position(|b| {
            b.worker == a.worker
                && a.from < b.until.unwrap_or(u64::MAX)
                && b.from < a.until.unwrap_or(u64::MAX)
        });
        if let Some(j) = overlap {
            add(
                at("from"),
                format!(
                    "worker {}'s absences {j} and {i} overlap: merge them into one",
                    a.worker
                ),
            );
        }
    }
}

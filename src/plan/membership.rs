//! The membership schedule a run follows: `[train.membership]` made into each worker's absences, as
//! half-open ranges of step indices (index s is the step the rows number s + 1). A pure function of the
//! config, so every worker, every resume and `check` see the same schedule.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::Distribution;

use crate::config::backend::Engine;
use crate::config::membership::MembershipConfig;
use crate::config::tree::Node;
use crate::config::{validate, Problem, Topology};
use crate::sync::plan::SyncPlan;

#[derive(Debug, Clone, PartialEq)]
pub struct Membership {
    /// Per worker, its absences [start, end) in step indices, in order and disjoint.
    away: Vec<Vec<(u64, u64)>>,
    /// Per worker, its compute time over the others' (1: not a straggler).
    pub slowdown: Vec<f64>,
    /// The cluster profile that prices the simulated clock.
    pub cluster: String,
}

impl Membership {
    /// The schedule of `cfg` for `world` workers and a run of `n_steps` steps; None when nobody leaves.
    pub fn of(cfg: &MembershipConfig, world: usize, n_steps: u64, seed: u64) -> Option<Self> {
        let mut away = vec![Vec::new(); world];
        for a in &cfg.absences {
            away[a.worker].push((a.from, a.until.unwrap_or(u64::MAX)));
        }
        if let (Some(mean), Some(down)) = (cfg.mean_steps_up, cfg.down_steps) {
            let exp = rand_distr::Exp::new(1.0 / mean).expect("mean_steps_up > 0 (validated)");
            for (w, spans) in away.iter_mut().enumerate().skip(1) {
                let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed.unwrap_or(seed));
                rng.set_stream(w as u64);
                let mut t = 0u64;
                loop {
                    let up: f64 = exp.sample(&mut rng);
                    let start = t.saturating_add((up.ceil() as u64).max(1));
                    if start >= n_steps {
                        break;
                    }
                    spans.push((start, start.saturating_add(down)));
                    t = start.saturating_add(down);
                }
            }
        }
        away.iter_mut().for_each(|s| s.sort_unstable());
        let mut slowdown = vec![1.0; world];
        for s in &cfg.stragglers {
            slowdown[s.worker] = s.slowdown;
        }
        let cluster = cfg.cluster.clone().unwrap_or_else(|| "local".into());
        (!cfg.is_empty()).then_some(Self {
            away,
            slowdown,
            cluster,
        })
    }

    pub fn world(&self) -> usize {
        self.away.len()
    }

    /// Whether `worker` takes part in step index `step`.
    pub fn present(&self, worker: usize, step: u64) -> bool {
        !self.away[worker]
            .iter()
            .any(|&(a, b)| (a..b).contains(&step))
    }

    /// The workers taking part in step index `step`, in order.
    pub fn members(&self, step: u64) -> Vec<usize> {
        (0..self.world())
            .filter(|&w| self.present(w, step))
            .collect()
    }

    /// The first step index from `step` on at which `worker` takes part, if it ever does again.
    pub fn back_at(&self, worker: usize, mut step: u64) -> Option<u64> {
        while let Some(&(_, end)) = self.away[worker]
            .iter()
            .find(|&&(a, b)| (a..b).contains(&step))
        {
            if end == u64::MAX {
                return None;
            }
            step = end;
        }
        Some(step)
    }

    /// The step indices below `n_steps` where the members change, with who leaves and who comes back.
    pub fn changes(&self, n_steps: u64) -> Vec<(u64, Vec<usize>, Vec<usize>)> {
        let mut at: Vec<u64> = self
            .away
            .iter()
            .flatten()
            .flat_map(|&(a, b)| [a, b])
            .filter(|&s| s > 0 && s < n_steps)
            .collect();
        at.sort_unstable();
        at.dedup();
        at.into_iter()
            .filter_map(|s| {
                let (before, after) = (self.members(s - 1), self.members(s));
                let left: Vec<usize> = before
                    .iter()
                    .filter(|w| !after.contains(w))
                    .copied()
                    .collect();
                let back: Vec<usize> = after
                    .iter()
                    .filter(|w| !before.contains(w))
                    .copied()
                    .collect();
                (!left.is_empty() || !back.is_empty()).then_some((s, left, back))
            })
            .collect()
    }
}

/// What membership needs of the run: the local engine, whose workers can leave a collective, and a
/// backend whose behaviour under churn is defined (see the README's "Workers that come and go").
pub(super) fn problems(doc: &Node, engine: Engine, sync: &SyncPlan) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut add = |path: &str, msg: String| out.push(validate::problem_at(doc, path, msg));
    let key = "train.membership";
    if engine != Engine::Local {
        add(
            key,
            format!(
                "membership events are simulated by the local engine (its workers leave and rejoin \
                 collectives exactly); the {engine:?} engine's ranks cannot leave a communicator (that \
                 needs a fault-tolerant MPI or NCCL's communicator shrink): set train.engine = \"local\""
            ),
        );
    }
    match sync {
        SyncPlan::Diloco { cfg, .. } if cfg.group_size > 1 => add(
            "train.diloco.group_size",
            "membership with hierarchical DiLoCo is not supported yet: a group that loses a member no \
             longer steps alike; set group_size = 1"
                .into(),
        ),
        SyncPlan::Diloco { cfg, .. } if cfg.eager => add(
            "train.diloco.eager",
            "membership with eager outer steps is not supported yet: the all-reduce in flight across \
             a change has no defined members; set eager = false"
                .into(),
        ),
        SyncPlan::Diloco { cfg, .. } if cfg.fragment_delay > 0 => add(
            "train.diloco.fragment_delay",
            "membership with fragments in flight across steps is not supported yet: set \
             fragment_delay = 0"
                .into(),
        ),
        SyncPlan::Gossip {
            topology: Topology::AlternatingExpRing,
            ..
        } => add(
            "train.topology",
            "alternating-exp-ring needs whole nodes, which a worker leaving breaks: use \"exp\", \
             \"ring\" or \"complete\""
                .into(),
        ),
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::membership::Absence;

    fn absence(worker: usize, from: u64, until: Option<u64>) -> Absence {
        Absence {
            worker,
            from,
            until,
        }
    }

    #[test]
    fn an_absence_spans_the_steps_after_from_through_until() {
        let cfg = MembershipConfig {
            absences: vec![absence(2, 3, Some(5)), absence(1, 4, None)],
            ..Default::default()
        };
        let m = Membership::of(&cfg, 4, 10, 0).unwrap();
        // Rows' steps 1..=3 are indices 0..=2: worker 2 trains them, misses indices 3 and 4.
        let present: Vec<bool> = (0..7).map(|s| m.present(2, s)).collect();
        assert_eq!(present, [true, true, true, false, false, true, true]);
        assert_eq!(m.members(4), vec![0, 3]);
        assert_eq!(m.back_at(2, 3), Some(5));
        assert_eq!(m.back_at(1, 6), None);
        assert_eq!(m.back_at(3, 6), Some(6));
        assert_eq!(
            m.changes(10),
            vec![
                (3, vec![2], vec![]),
                (4, vec![1], vec![]),
                (5, vec![], vec![2])
            ]
        );
        assert!(Membership::of(&MembershipConfig::default(), 4, 10, 0).is_none());
    }

    #[test]
    fn the_random_process_is_a_function_of_its_seed_and_spares_worker_0() {
        let cfg = MembershipConfig {
            mean_steps_up: Some(20.0),
            down_steps: Some(5),
            ..Default::default()
        };
        let a = Membership::of(&cfg, 8, 1000, 7).unwrap();
        assert_eq!(a, Membership::of(&cfg, 8, 1000, 7).unwrap());
        assert_ne!(a, Membership::of(&cfg, 8, 1000, 8).unwrap());
        assert!((0..1000).all(|s| a.present(0, s)));
        // Up ~20 steps, down 5: a worker is away about 5 / 25 of the time.
        let away = (1..8)
            .flat_map(|w| (0..1000).map(move |s| (w, s)))
            .filter(|&(w, s)| !a.present(w, s))
            .count() as f64
            / 7000.0;
        assert!((0.12..0.28).contains(&away), "{away}");
    }
}

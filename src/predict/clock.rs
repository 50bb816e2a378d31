//! The simulated clock of a run with stragglers or churn (`[train.membership]`): each worker's time on a
//! cluster, step by step, by the rules of the run's synchronisation. A worker's own step is the cluster's
//! time of the step (compute, update, compression, and what of its communication the step exposes) with
//! the compute times its slowdown. A collective that the step waits for ends no earlier than the last of
//! its group's members is done, so a synchronous step ends with its slowest member; one beside the compute
//! (overlapped gossip) waits only for its members' previous step, whose result it carries; a step
//! without collectives (DiLoCo between syncs) waits for nobody.

use super::Predictor;
use crate::sync::trace::{Collective, Overlap};

#[derive(Debug, Clone, PartialEq)]
pub struct Clock {
    /// Each worker's time (seconds since the run started), by its place in the whole world.
    pub t: Vec<f64>,
    slowdown: Vec<f64>,
}

impl Clock {
    pub fn new(slowdown: Vec<f64>) -> Self {
        Self {
            t: vec![0.0; slowdown.len()],
            slowdown,
        }
    }

    /// One step of the workers `present` (ids; a worker's rank in `described`'s groups is its position
    /// there), whose collectives are `described`.
    pub fn step(&mut self, p: &Predictor, present: &[usize], described: &[Collective]) {
        let start: Vec<f64> = present.iter().map(|&w| self.t[w]).collect();
        let mut secs = Vec::new();
        let done: Vec<f64> = present
            .iter()
            .zip(&start)
            .map(|(&w, s)| {
                let (own, each) = p.worker_step(described, self.slowdown[w]);
                secs = each;
                s + own
            })
            .collect();
        let mut end = done.clone();
        for (c, &t) in described.iter().zip(&secs) {
            for g in &c.groups {
                let ready = match c.overlap {
                    Overlap::Compute => g.iter().map(|&q| start[q]).fold(0.0, f64::max) + t,
                    Overlap::None | Overlap::Backward => {
                        g.iter().map(|&q| done[q]).fold(0.0, f64::max)
                    }
                };
                g.iter().for_each(|&q| end[q] = end[q].max(ready));
            }
        }
        for (q, &w) in present.iter().enumerate() {
            self.t[w] = end[q];
        }
    }

    /// Worker `joiner` comes back by copying `donor`'s state, a message that takes `seconds`: both are
    /// busy until it has arrived.
    pub fn rejoin(&mut self, joiner: usize, donor: usize, seconds: f64) {
        let at = self.t[donor].max(self.t[joiner]) + seconds;
        (self.t[joiner], self.t[donor]) = (at, at);
    }

    /// The time when every worker of `present` has done its last step.
    pub fn now(&self, present: &[usize]) -> f64 {
        present.iter().map(|&w| self.t[w]).fold(0.0, f64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::predict::profile;

    /// A run with `set` on `workers` workers of a100-ib100, and its step `step`'s collectives.
    fn run(workers: usize, set: &[&str], step: u64) -> (Predictor, Vec<Collective>) {
        let src = "[train]\nglobal_batch_size = 12\nn_steps = 100\n[train.lr_schedule]\nwarmup_steps = 1\n\
                   [model]\nn_layers = 2\nn_heads = 2\nn_embd = 64\nvocab_size = 128\n";
        let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        let launch = crate::plan::LaunchEnv {
            workers_flag: Some(workers),
            ..Default::default()
        };
        let loaded = crate::plan::load_str(std::path::Path::new("t.toml"), src, &set, &launch)
            .unwrap_or_else(|e| panic!("{e}"));
        let cluster = profile::load("a100-ib100").unwrap();
        let layout = crate::predict::layout(workers, None, &cluster.profile);
        let p = Predictor::new(&loaded, &cluster.profile, layout, None).unwrap();
        let described = crate::plan::described(&loaded.config, &loaded.plan)
            .unwrap()
            .step_comm(step);
        (p, described)
    }

    const SLOW: [f64; 4] = [1.0, 1.0, 3.0, 1.0];
    const ALL: [usize; 4] = [0, 1, 2, 3];

    #[test]
    fn a_synchronous_step_ends_with_its_slowest_member() {
        let (p, step) = run(4, &[], 3);
        assert!(!step.is_empty());
        let mut c = Clock::new(SLOW.to_vec());
        c.step(&p, &ALL, &step);
        let slowest = p.worker_step(&step, 3.0).0;
        assert!(slowest > p.worker_step(&step, 1.0).0);
        assert_eq!(c.t, vec![slowest; 4]);
        assert_eq!(c.now(&ALL), slowest);
        // Worker 2 away: the others step at their own pace, and its clock stands.
        let (_, three) = run(3, &[], 3);
        let mut c = Clock::new(SLOW.to_vec());
        c.step(&p, &[0, 1, 3], &three);
        assert_eq!(c.t[2], 0.0);
        assert_eq!(c.t[0], p.worker_step(&three, 1.0).0);
        c.rejoin(2, 1, 0.5);
        assert_eq!((c.t[2], c.t[1]), (c.t[0] + 0.5, c.t[0] + 0.5));
    }

    #[test]
    fn predict_prices_stragglers_by_the_same_clock() {
        let src = "[train]\nglobal_batch_size = 12\nn_steps = 50\n[train.lr_schedule]\nwarmup_steps = 1\n\
                   [train.membership]\nstragglers = [{ worker = 2, slowdown = 3.0 }]\n\
                   [model]\nn_layers = 2\nn_heads = 2\nn_embd = 64\nvocab_size = 128\n";
        let launch = crate::plan::LaunchEnv {
            workers_flag: Some(4),
            ..Default::default()
        };
        let loaded =
            crate::plan::load_str(std::path::Path::new("t.toml"), src, &[], &launch).unwrap();
        let cluster = profile::load("a100-ib100").unwrap();
        let layout = crate::predict::layout(4, None, &cluster.profile);
        let pred = crate::predict::predict(&loaded, &cluster, layout).unwrap();
        let (p, step) = run(4, &[], 3);
        let slowest = p.worker_step(&step, 3.0).0 * 1e3;
        assert!((pred.average.ms_per_step - slowest).abs() < 1e-9 * slowest);
        assert!(pred.stragglers.unwrap().contains("worker 2 x3"));
    }

    #[test]
    fn diloco_between_syncs_waits_for_nobody_and_its_sync_for_everybody() {
        let set = [
            "train.backend=\"diloco\"",
            "train.diloco={ sync_every = 8 }",
        ];
        let (p, inner) = run(4, &set, 3);
        let (_, sync) = run(4, &set, 7);
        assert!(inner.is_empty() && !sync.is_empty(), "{inner:?} {sync:?}");
        let mut c = Clock::new(SLOW.to_vec());
        for _ in 0..7 {
            c.step(&p, &ALL, &inner);
        }
        let own = |s: f64| p.worker_step(&[], s).0;
        assert!((c.t[0] - 7.0 * own(1.0)).abs() < 1e-12);
        assert!((c.t[2] - 7.0 * own(3.0)).abs() < 1e-12);
        c.step(&p, &ALL, &sync);
        let end = 7.0 * own(3.0) + p.worker_step(&sync, 3.0).0;
        assert!(c.t.iter().all(|&t| (t - end).abs() < 1e-12), "{:?}", c.t);
    }

    #[test]
    fn overlapped_gossip_waits_only_for_its_peers_previous_step() {
        let set = ["train.backend=\"decentdp\"", "train.topology=\"ring\""];
        let (p, step) = run(4, &set, 3);
        assert!(
            step.iter().all(|c| c.overlap == Overlap::Compute),
            "{step:?}"
        );
        let mut c = Clock::new(SLOW.to_vec());
        c.step(&p, &ALL, &step);
        // From a common start, nobody waits for a peer's compute of this step.
        for (w, s) in SLOW.iter().enumerate() {
            assert_eq!(c.t[w], p.worker_step(&step, *s).0, "worker {w}");
        }
        // The next round pairs the slow worker's peer with the slow worker's previous step.
        c.step(&p, &ALL, &step);
        assert!(c.t[0] < c.t[2]);
    }
}

//! A worker under `[train.membership]`: it leaves and comes back at the schedule's steps, and coming
//! back copies a live peer's state (torchft's live recovery). Every collective in between runs over the
//! workers present (see `comm::local::LocalComm::regroup`).

use anyhow::{bail, ensure, Result};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::{EvalSpec, Worker, DROPOUT_KEY};
use crate::comm::{pack_u64, unpack_u64, Communicator, Regroup};
use crate::config::CheckpointMode;
use crate::data::{Blend, Split};
use crate::model::Gpt;
use crate::optim::OptimState;
use crate::predict::{clock::Clock, Predictor};
use crate::sync::compress::{take, State};
use crate::sync::SyncBackend;
use crate::train::checkpoint;
use crate::train::compute::Compute;
use crate::train::console::Interval;
use crate::train::replica::Replica;
use crate::train::Setup;

/// Worker 0's simulated clock of a run with `[train.membership]`, priced on the schedule's cluster (the
/// run's world placed as the cluster's devices per node).
pub(super) fn clock(setup: &Setup, id: usize) -> Result<Option<Box<(Predictor, Clock)>>> {
    let Some(m) = setup.plan.membership.as_ref().filter(|_| id == 0) else {
        return Ok(None);
    };
    let cluster = crate::predict::profile::load(&m.cluster)?;
    let loaded = crate::plan::Loaded {
        path: setup.run_dir.join("config.toml"),
        config: setup.cfg.clone(),
        plan: setup.plan.clone(),
        notes: Vec::new(),
    };
    let layout = crate::predict::layout(setup.plan.world_size, None, &cluster.profile);
    let p = Predictor::new(&loaded, &cluster.profile, layout, None)?;
    Ok(Some(Box::new((p, Clock::new(m.slowdown.clone())))))
}

impl Worker<'_> {
    /// At construction: joins the members the run's first step continues from (a resumed run's
    /// checkpoint holds their state). Returns whether this worker is one of them; one that is not has no
    /// state in the checkpoint and comes back later.
    pub(super) fn join_schedule(&mut self) -> Result<bool> {
        let Some(m) = &self.setup.plan.membership else {
            return Ok(true);
        };
        let start = match &self.setup.source {
            Some((dir, CheckpointMode::Full)) => checkpoint::read_manifest(dir)?.step,
            _ => 0,
        };
        let members = m.members(start.saturating_sub(1));
        if members.len() == m.world() {
            return Ok(true);
        }
        let all: Vec<usize> = (0..m.world()).collect();
        let epoch = start.saturating_sub(1);
        if self.sync.comm_mut().regroup(epoch, &all, &members)? == Regroup::Member {
            self.sync.members_changed()?;
            return Ok(true);
        }
        self.progress.step = start;
        Ok(false)
    }

    /// At the start of each step: follows the schedule's change of members there, if any. Returns false
    /// when this worker's part is over (it left for good, or the run ended while it was away).
    pub(super) fn take_part(&mut self) -> Result<bool> {
        let (Some(m), s) = (&self.setup.plan.membership, self.progress.step) else {
            return Ok(true);
        };
        if s == 0 {
            return Ok(true);
        }
        let (before, after) = (m.members(s - 1), m.members(s));
        if !before.contains(&self.id) {
            return self.come_back(s);
        }
        if before == after {
            return Ok(true);
        }
        // Overlapped gossip finishes its round among the members that started it.
        if self.sync.has_pending() {
            self.sync.before_step_flat(self.replica.params_mut()?)?;
            self.model.load(self.replica.params())?;
        }
        match self.sync.comm_mut().regroup(s, &before, &after)? {
            Regroup::Member => {}
            Regroup::Away => return self.come_back(s),
            Regroup::Ended => return Ok(false),
        }
        self.sync.members_changed()?;
        self.recover(&before, &after)?;
        Ok(true)
    }

    /// Away at step index `s`: waits for the change of members that brings this worker back (false if
    /// none does before the run ends), then recovers.
    fn come_back(&mut self, s: u64) -> Result<bool> {
        let Some(m) = &self.setup.plan.membership else {
            bail!("internal error: away without a membership schedule");
        };
        let back = match m.back_at(self.id, s) {
            Some(b) if b < self.setup.cfg.train.n_steps => b,
            _ => return Ok(false),
        };
        let (before, after) = (m.members(back - 1), m.members(back));
        if self.sync.comm_mut().regroup(back, &before, &after)? != Regroup::Member {
            return Ok(false);
        }
        self.sync.members_changed()?;
        self.recover(&before, &after)?;
        Ok(true)
    }

    /// Live recovery at a change of members from `before` to `after`: each worker that came back copies,
    /// from the nearest member before it in `after` that stayed (its ring neighbour), that peer's
    /// parameters and optimizer, the backend's shared state and the run's counters. Every member calls
    /// it; what crosses the wire counts in the rows' bytes.
    fn recover(&mut self, before: &[usize], after: &[usize]) -> Result<()> {
        let pos = |id: usize| after.iter().position(|&w| w == id);
        let n = after.len();
        let donor = |q: usize| {
            (1..n)
                .map(|k| (q + n - k) % n)
                .find(|&d| before.contains(&after[d]))
        };
        let joined: Vec<usize> = (0..n).filter(|&q| !before.contains(&after[q])).collect();
        if joined.is_empty() {
            return Ok(());
        }
        let me = pos(self.id).expect("a member recovers");
        let serves: Vec<usize> = joined
            .iter()
            .copied()
            .filter(|&q| donor(q) == Some(me))
            .collect();
        let from = if joined.contains(&me) {
            self.since_log = Interval::new(self.sync.comm_stats());
            Some(donor(me).expect("someone stayed: worker 0 never leaves"))
        } else {
            None
        };
        let start = self.since_log.sync_start(self.sync.comm_stats());
        let msg = match serves.is_empty() {
            true => Vec::new(),
            false => encode(&self.recovery_state()?),
        };
        // The length first: the worker coming back cannot know the size of its peer's state.
        let mut len = [0.0f32; 2];
        let comm = self.sync.comm_mut();
        exchange_one(comm, &serves, &pack_u64(msg.len() as u64), from, &mut len)?;
        let mut got = vec![0.0f32; from.map_or(0, |_| unpack_u64(len) as usize)];
        exchange_one(comm, &serves, &msg, from, &mut got)?;
        if from.is_some() {
            self.recovered(decode(&got)?)?;
        }
        self.since_log.sync_end(start, self.sync.comm_stats());
        // The copy as a message of the size of this worker's own state, on the cluster's link.
        let bytes = match (self.clock.is_some(), msg.is_empty()) {
            (false, _) => 0.0,
            (true, false) => 4.0 * msg.len() as f64,
            (true, true) => 4.0 * encode(&self.recovery_state()?).len() as f64,
        };
        if let Some(c) = self.clock.as_mut() {
            let secs = c.0.profile.inter.message_seconds(bytes, 1);
            for &q in &joined {
                let d = donor(q).expect("someone stayed");
                c.1.rejoin(after[q], after[d], secs);
            }
        }
        Ok(())
    }

    /// What a worker coming back copies from this one.
    fn recovery_state(&self) -> Result<State> {
        let opt = self.replica.opt_view().to_state()?;
        let p = &self.progress;
        let mut s: State = vec![
            (
                "params".into(),
                self.replica.params().to_host()?.into_owned(),
            ),
            ("optim.step".into(), pack_u64(opt.step).to_vec()),
            (
                "progress".into(),
                [p.step, p.tokens]
                    .iter()
                    .flat_map(|&x| pack_u64(x))
                    .collect(),
            ),
        ];
        if let Some(best) = p.best_val_loss {
            s.push(("best_val_loss".into(), pack_u64(best.to_bits()).to_vec()));
        }
        s.extend(
            opt.buffers
                .into_iter()
                .map(|(n, b)| (format!("optim.{n}"), b)),
        );
        let shared = self.sync.recovery_state()?;
        s.extend(shared.into_iter().map(|(n, b)| (format!("sync.{n}"), b)));
        Ok(s)
    }

    /// Takes the peer's state (`recovery_state`) as this worker's own. The dropout stream restarts from
    /// the step, so that the run stays a function of its config.
    fn recovered(&mut self, mut state: State) -> Result<()> {
        let mut params = take(&mut state, "params", Some(self.model.params.numel))?;
        let words =
            |v: Vec<f32>| -> Vec<u64> { v.chunks(2).map(|c| unpack_u64([c[0], c[1]])).collect() };
        let step = words(take(&mut state, "optim.step", Some(2))?)[0];
        let progress = words(take(&mut state, "progress", Some(4))?);
        let best = state
            .iter()
            .any(|(n, _)| n == "best_val_loss")
            .then(|| take(&mut state, "best_val_loss", Some(2)))
            .transpose()?
            .map(|b| f64::from_bits(words(b)[0]));
        let (optim, shared): (State, State) = state
            .into_iter()
            .partition(|(n, _)| n.starts_with("optim."));
        let shared = shared
            .into_iter()
            .filter_map(|(n, b)| Some((n.strip_prefix("sync.")?.to_string(), b)))
            .collect();
        self.sync.recovered(shared, &mut params)?;
        let Replica::Own { params: mine, opt } = &mut self.replica else {
            bail!("internal error: a shared replica under a membership schedule");
        };
        let buffers = optim
            .into_iter()
            .map(|(n, b)| (n["optim.".len()..].to_string(), b))
            .collect();
        let name = opt.view().name.to_string();
        opt.load_state(OptimState {
            name,
            step,
            buffers,
        })?;
        *mine = self.model.place().from_host(params)?;
        self.model.load(self.replica.params())?;
        (self.progress.step, self.progress.tokens) = (progress[0], progress[1]);
        self.progress.best_val_loss = best;
        let t = &self.setup.cfg.train;
        self.dropout =
            ChaCha8Rng::seed_from_u64(t.seed ^ DROPOUT_KEY ^ self.progress.step.rotate_left(32));
        self.dropout.set_stream(self.id as u64);
        Ok(())
    }

    /// The loss and the backend's per-rank values averaged over the workers present, each over those
    /// that have it (a worker just back may not have a value of every kind yet).
    pub(super) fn means_of_present(
        &mut self,
        per_rank: [Option<f64>; 2],
    ) -> Result<(f64, [Option<f64>; 2])> {
        let mut sums = vec![self.since_log.mean_loss() as f32, 1.0];
        for v in per_rank {
            sums.extend([v.unwrap_or(0.0) as f32, v.map_or(0.0, |_| 1.0)]);
        }
        self.sync.comm_mut().all_reduce_sum(&mut sums)?;
        let mean =
            |i: usize| (sums[2 * i + 1] > 0.0).then(|| (sums[2 * i] / sums[2 * i + 1]) as f64);
        Ok((mean(0).unwrap_or(f64::NAN), [mean(1), mean(2)]))
    }

    /// Whether the workers present change at this step.
    pub(super) fn members_change(&self) -> bool {
        let s = self.progress.step;
        let m = self.setup.plan.membership.as_ref();
        s > 0 && m.is_some_and(|m| m.members(s - 1) != m.members(s))
    }

    /// Tokens of step index `step` over the workers that take part in it: each keeps its batch, so the
    /// global batch shrinks while workers are away.
    pub(super) fn step_tokens(&self, step: u64) -> u64 {
        let plan = &self.setup.plan;
        match &plan.membership {
            None => plan.tokens_at(step),
            Some(m) => plan.tokens_at(step) / plan.world_size as u64 * m.members(step).len() as u64,
        }
    }
}

/// `eval_shared` while workers are away: the present evaluate every slice of the batches between them
/// (position p takes slices p, p + m, ...), so the estimate covers the same windows as with everyone.
pub(super) fn eval_present(
    sync: &mut dyn SyncBackend,
    compute: &Compute,
    model: &Gpt,
    spec: &EvalSpec,
    weights: &[f32],
    data: &Blend,
    split: Split,
) -> Result<f64> {
    let (rank, m) = (sync.rank(), sync.world_size());
    let mine: Vec<usize> = (rank..spec.world).step_by(m).collect();
    let sum = compute.run(|scratch| {
        let mut sum = 0.0;
        for &r in &mine {
            sum += spec.rows(model, scratch, weights, data, split, r..r + 1)?;
        }
        anyhow::Ok(sum)
    })?;
    let mut acc = [sum as f32, mine.len() as f32];
    sync.comm_mut().all_reduce_sum(&mut acc)?;
    Ok((acc[0] / acc[1]) as f64)
}

/// One message to each rank of `to`, and with `from` one from that rank into `into`.
fn exchange_one(
    comm: &mut dyn Communicator,
    to: &[usize],
    msg: &[f32],
    from: Option<usize>,
    into: &mut [f32],
) -> Result<()> {
    let sends: Vec<(usize, &[f32])> = to.iter().map(|&r| (r, msg)).collect();
    let mut recvs: Vec<(usize, &mut [f32])> = from.map(|r| (r, into)).into_iter().collect();
    comm.exchange(&sends, &mut recvs)
}

/// Named buffers as one message: per buffer its name's length, its bytes, its length (two words) and
/// its values.
fn encode(state: &State) -> Vec<f32> {
    let mut out = Vec::new();
    for (name, data) in state {
        out.push(name.len() as f32);
        out.extend(name.bytes().map(f32::from));
        out.extend(pack_u64(data.len() as u64));
        out.extend_from_slice(data);
    }
    out
}

fn decode(mut buf: &[f32]) -> Result<State> {
    let mut out = Vec::new();
    while let Some(&n) = buf.first() {
        let n = n as usize;
        ensure!(
            buf.len() >= 3 + n,
            "internal error: a recovery message cut short"
        );
        let name: String = buf[1..=n].iter().map(|&b| b as u8 as char).collect();
        let len = unpack_u64([buf[1 + n], buf[2 + n]]) as usize;
        let rest = &buf[3 + n..];
        ensure!(
            rest.len() >= len,
            "internal error: a recovery message cut short"
        );
        out.push((name, rest[..len].to_vec()));
        buf = &rest[len..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovery_messages_decode_to_what_was_encoded() {
        let state: State = vec![
            ("params".into(), vec![1.0, -2.5, f32::MIN_POSITIVE]),
            ("optim.exp_avg".into(), Vec::new()),
            ("sync.diloco.syncs".into(), pack_u64(7).to_vec()),
        ];
        assert_eq!(decode(&encode(&state)).unwrap(), state);
        assert!(decode(&encode(&state)[..5]).is_err());
    }
}

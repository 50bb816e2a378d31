//! When the ranks stop. Each rank has its reasons (the run's end, a signal, a time limit, a non-finite
//! loss or gradient norm), and the ranks stop together at a vote that all-gathers every rank's. Votes
//! are held after the steps where the ranks meet anyway (log, evaluation and checkpoint steps, the last
//! step and the exit interval's) and in between about every `log.stop_check_secs` of training (every
//! step under `[train.membership]`, whose workers come and go at steps). Not every step: a vote is a
//! collective of every rank, at least one latency, which DiLoCo's inner steps and gossip's rounds among
//! neighbours otherwise never pay, and a global wait for the slowest rank.

use std::time::Instant;

use anyhow::{Context, Result};

use crate::comm::Communicator;

/// Why a rank wants to stop after a step, in rising priority: when ranks disagree, the highest wins. A
/// run that reached n_steps is finished whatever else happened; a signal beats the time limits; a
/// non-finite gradient norm or loss on any rank beats everything (its state is never saved), the loss
/// first: an all-reduce spreads one rank's NaN gradient to every rank, the loss names the rank it began on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Vote {
    Continue = 0,
    ExitInterval = 1,
    ExitDuration = 2,
    Signal = 3,
    Finished = 4,
    NonFiniteGradNorm = 5,
    NonFiniteLoss = 6,
}

impl Vote {
    const ALL: [Vote; 7] = [
        Vote::Continue,
        Vote::ExitInterval,
        Vote::ExitDuration,
        Vote::Signal,
        Vote::Finished,
        Vote::NonFiniteGradNorm,
        Vote::NonFiniteLoss,
    ];

    fn non_finite(self) -> bool {
        self >= Vote::NonFiniteGradNorm
    }
}

/// What a vote decided.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Outcome {
    pub vote: Vote,
    /// The rank whose vote won.
    pub rank: usize,
    /// A non-finite vote's step (steps done, as the rows count them) and value; else the vote's step, 0.
    pub step: u64,
    pub value: f64,
}

/// The most steps between two timed votes.
const MAX_GAP: u64 = 1 << 20;

/// One rank's side of the votes: what it saw since the last one and when the next timed one is held.
pub(super) struct Ballot {
    /// The first non-finite loss or gradient norm this rank saw: its vote, step and value.
    non_finite: Option<(Vote, u64, f64)>,
    /// The step after which the next timed vote is held (agreed at the last vote).
    next: u64,
    /// The step and time of the last vote (or of the start).
    last: (u64, Instant),
}

impl Ballot {
    /// Before the first step of this invocation (`step` steps done): the first vote follows its first
    /// step, whose pace sets the next one's.
    pub fn new(step: u64) -> Self {
        Self {
            non_finite: None,
            next: step + 1,
            last: (step, Instant::now()),
        }
    }

    /// Notes a step's loss and gradient norm (`step`: steps done, this one included).
    pub fn record(&mut self, step: u64, loss: f64, grad_norm: f64) {
        if self.non_finite.is_some() {
            return;
        }
        if !loss.is_finite() {
            self.non_finite = Some((Vote::NonFiniteLoss, step, loss));
        } else if !grad_norm.is_finite() {
            self.non_finite = Some((Vote::NonFiniteGradNorm, step, grad_norm));
        }
    }

    /// Whether the timed vote is due after `step`.
    pub fn due(&self, step: u64) -> bool {
        step >= self.next
    }

    /// The steps this rank proposes until the next timed vote: about `every_secs` at its pace since the
    /// last vote (at least 1).
    fn gap(&self, step: u64, every_secs: f64) -> u64 {
        let steps = step.saturating_sub(self.last.0).max(1);
        let per_step = self.last.1.elapsed().as_secs_f64() / steps as f64;
        let gap = (every_secs / per_step.max(1e-9)).floor();
        (gap as u64).clamp(1, MAX_GAP)
    }

    /// The vote after `step` (steps done): this rank's first non-finite value, else `stop`, against every
    /// rank's (one all-gather of [vote, value, steps since the value, proposed gap] per rank). The ranks
    /// hold the next timed vote after the smallest gap any of them proposed.
    pub fn agree(
        &mut self,
        stop: Vote,
        step: u64,
        every_secs: f64,
        comm: &mut dyn Communicator,
    ) -> Result<Outcome> {
        let mine = self.words(stop, step, every_secs);
        let mut all = vec![0.0f32; 4 * comm.world_size()];
        comm.all_gather(&mine, &mut all)?;
        self.settle(&all, step)
    }

    /// This rank's ballot after `step`, as `agree` sends it (a log step's row carries it instead).
    pub fn words(&self, stop: Vote, step: u64, every_secs: f64) -> [f32; 4] {
        let (vote, at, value) = self.non_finite.unwrap_or((stop, step, 0.0));
        [
            vote as u8 as f32,
            value as f32,
            step.saturating_sub(at) as f32,
            self.gap(step, every_secs) as f32,
        ]
    }

    /// The vote's outcome from every rank's `words`, by rank; the next timed vote is set from them.
    pub fn settle(&mut self, all: &[f32], step: u64) -> Result<Outcome> {
        let (outcome, gap) = decide(all, step)?;
        self.next = step + gap;
        self.last = (step, Instant::now());
        Ok(outcome)
    }
}

/// The outcome of the ballots after `step` (4 words per rank, by rank: vote, value, steps since the
/// value, proposed gap; small integers are exact in f32, NaN and infinities cross as they are), and the
/// gap to the next timed vote. A non-finite value wins, the earliest first, then the loss before the
/// gradient norm, then the lowest rank; otherwise the highest vote with the lowest rank that cast it.
fn decide(all: &[f32], step: u64) -> Result<(Outcome, u64)> {
    let mut ballots = Vec::with_capacity(all.len() / 4);
    for b in all.chunks_exact(4) {
        let vote = Vote::ALL
            .get(b[0] as usize)
            .copied()
            .with_context(|| format!("exit vote: a rank sent {}, not a vote", b[0]))?;
        ballots.push((vote, b[1] as f64, b[2] as u64, b[3] as u64));
    }
    let gap = ballots.iter().map(|b| b.3).min().unwrap_or(1).max(1);
    // The key that wins: the largest, and the first rank among equals.
    let key = |&(v, _, ago, _): &(Vote, f64, u64, u64)| match v.non_finite() {
        true => (1, ago, v),
        false => (0, 0, v),
    };
    let best = ballots
        .iter()
        .map(key)
        .max()
        .context("exit vote: no ranks")?;
    let rank = ballots.iter().position(|b| key(b) == best).unwrap_or(0);
    let (vote, value, ago, _) = ballots[rank];
    let outcome = Outcome {
        vote,
        rank,
        step: step.saturating_sub(ago),
        value,
    };
    Ok((outcome, gap))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's ballot after step 100, agreed over a group of 4 local ranks.
    fn agree(ballots: [Ballot; 4], stops: [Vote; 4]) -> Vec<(Outcome, u64)> {
        let ranks: Vec<_> = crate::comm::local::group(4, std::time::Duration::from_secs(10))
            .into_iter()
            .zip(ballots.into_iter().zip(stops))
            .map(|(mut c, (mut b, stop))| {
                std::thread::spawn(move || {
                    let out = b.agree(stop, 100, 0.0, &mut c).unwrap();
                    (out, b.next)
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn ballot(records: &[(u64, f64, f64)]) -> Ballot {
        let mut b = Ballot::new(90);
        records
            .iter()
            .for_each(|&(s, loss, norm)| b.record(s, loss, norm));
        b
    }

    /// The highest vote wins on every rank, with the lowest rank that cast it: a signal beats the time
    /// limits, the end of the run beats a signal.
    #[test]
    fn the_highest_vote_wins_on_every_rank() {
        let fine = || ballot(&[(95, 2.0, 1.0)]);
        let agreed = agree(
            [fine(), fine(), fine(), fine()],
            [
                Vote::Continue,
                Vote::Signal,
                Vote::ExitInterval,
                Vote::Signal,
            ],
        );
        let signal = Outcome {
            vote: Vote::Signal,
            rank: 1,
            step: 100,
            value: 0.0,
        };
        assert!(agreed.iter().all(|&(o, next)| o == signal && next == 101));
        assert!(Vote::Finished > Vote::Signal && Vote::Signal > Vote::ExitDuration);
        let mut solo = crate::comm::Solo;
        for v in Vote::ALL.into_iter().filter(|v| !v.non_finite()) {
            let o = Ballot::new(99).agree(v, 100, 0.0, &mut solo).unwrap();
            assert_eq!((o.vote, o.rank, o.step), (v, 0, 100));
        }
    }

    /// A non-finite value seen at any step since the last vote wins: the earliest, then the loss (the
    /// rank it began on) before the gradient norm an all-reduce spread, then the lowest rank; the
    /// outcome names its step and value, however many steps later the vote comes.
    #[test]
    fn the_earliest_non_finite_value_wins_with_its_step() {
        let agreed = agree(
            [
                ballot(&[(93, 2.0, f64::NAN), (94, f64::NAN, f64::NAN)]),
                ballot(&[(93, f64::INFINITY, 1.0)]),
                ballot(&[(93, f64::NAN, 1.0)]),
                ballot(&[(92, 2.0, 1.0), (96, f64::NAN, 1.0)]),
            ],
            [Vote::Finished; 4],
        );
        let (o, _) = agreed[0];
        assert_eq!((o.vote, o.rank, o.step), (Vote::NonFiniteLoss, 1, 93));
        assert_eq!(o.value, f64::INFINITY);
        assert!(agreed.iter().all(|&(x, _)| x == o));
        // Only gradient norms: the earliest one's rank.
        let agreed = agree(
            [
                ballot(&[(97, 2.0, f64::NAN)]),
                ballot(&[(91, 2.0, f64::NEG_INFINITY)]),
                ballot(&[]),
                ballot(&[(91, 2.0, f64::NAN)]),
            ],
            [Vote::Continue; 4],
        );
        let (o, _) = agreed[3];
        assert_eq!((o.vote, o.rank, o.step), (Vote::NonFiniteGradNorm, 1, 91));
        assert_eq!(o.value, f64::NEG_INFINITY);
    }

    /// The next timed vote follows the smallest gap proposed: about `every_secs` at the rank's pace since
    /// the last vote, at least one step, at most `MAX_GAP`.
    #[test]
    fn timed_votes_follow_the_slowest_pace() {
        let mut b = Ballot::new(0);
        b.last.1 = Instant::now() - std::time::Duration::from_secs(10);
        // 10 s (and a little) over 10 steps: about 1 s a step, so 5 steps for 5.5 s and one step for
        // anything under 2 s.
        assert_eq!(b.gap(10, 5.5), 5);
        assert_eq!(b.gap(10, 1.9), 1);
        assert_eq!(b.gap(10, 0.0), 1);
        assert_eq!(b.gap(10, 1e12), MAX_GAP);
        let words = |gaps: [f32; 3]| -> Vec<f32> {
            gaps.iter()
                .flat_map(|&g| [Vote::Continue as u8 as f32, 0.0, 0.0, g])
                .collect()
        };
        assert_eq!(decide(&words([7.0, 3.0, 9.0]), 50).unwrap().1, 3);
        assert!(!b.due(0) && b.due(1));
        assert!(decide(&[9.0, 0.0, 0.0, 1.0], 5).is_err());
    }
}

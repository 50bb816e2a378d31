//! CHOCO's channels: one per distinct group a rank meets over the cycle of rounds, with its public copies
//! and memory (see the module's doc).

use anyhow::{bail, Result};

use super::Codec;
use crate::kernels::{self, Lines};
use crate::sync::compress::{self, StateBuf};
use crate::sync::topology::Round;

/// One group a rank meets over the cycle of rounds, and the rank's state in it.
pub(super) struct Channel {
    pub(super) ranks: Vec<usize>,
    /// The weight of the rank itself and of each other member.
    pub(super) own: f32,
    pub(super) other: f32,
    /// This rank's public copy x_hat_{i,G} (none: zero, until the channel first meets; a described
    /// backend (`check`) allocates none), on the host or beside the parameters on the GPU.
    pub(super) hat: StateBuf,
    /// The memory s_{i,G} = sum_j w_ij x_hat_{j,G} (none: zero).
    pub(super) memory: StateBuf,
}

/// A rank's channels and which one each round uses (None: alone in that round).
pub struct Channels {
    pub(super) rank: usize,
    pub(super) numel: usize,
    pub(super) list: Vec<Channel>,
    pub(super) of_round: Vec<Option<usize>>,
}

impl Channels {
    pub fn new(rounds: &[Round], rank: usize, numel: usize) -> Result<Self> {
        let mut list: Vec<Channel> = Vec::new();
        let mut of_round = Vec::with_capacity(rounds.len());
        for (r, round) in rounds.iter().enumerate() {
            let Some(group) = round.iter().find(|g| g.ranks.contains(&rank)) else {
                bail!("rank {rank} is in no group of round {r}");
            };
            let g = group.ranks.len();
            if g < 2 {
                of_round.push(None);
                continue;
            }
            let (own, other) = (group.weight, (1.0 - group.weight) / (g - 1) as f64);
            let found = list.iter().position(|c| {
                c.ranks == group.ranks && c.own == own as f32 && c.other == other as f32
            });
            of_round.push(Some(found.unwrap_or_else(|| {
                list.push(Channel {
                    ranks: group.ranks.clone(),
                    own: own as f32,
                    other: other as f32,
                    hat: StateBuf::default(),
                    memory: StateBuf::default(),
                });
                list.len() - 1
            })));
        }
        Ok(Self {
            rank,
            numel,
            list,
            of_round,
        })
    }

    /// Distinct groups this rank meets (two model-sized buffers each).
    pub fn count(&self) -> usize {
        self.list.len()
    }

    /// The members of `round`'s channel (None: alone).
    pub(super) fn members(&self, round: usize) -> Option<&[usize]> {
        self.of_round[round].map(|c| &self.list[c].ranks[..])
    }

    /// This rank's message in `round`: Q(x - x_hat).
    pub(super) fn encode(
        &mut self,
        codec: &Codec,
        round: usize,
        x: &[f32],
        step: u64,
        msg: &mut Vec<f32>,
    ) {
        match self.of_round[round] {
            Some(c) => {
                let hat = self.list[c].hat.take_host(self.numel);
                codec.encode(x, &hat, step, self.rank, msg);
                self.list[c].hat.keep_host(hat);
            }
            None => msg.clear(),
        }
    }

    /// Adds the members' messages (`msg(position in the group)`) to the channel of `round`, then the
    /// consensus step x += gamma (s - x_hat). The dense formats take each span of every member's message
    /// in step and update x_hat, s and x there while it is in the core's caches: one pass over the three,
    /// with each entry's operations in the order of a pass per member and then the step's (the same
    /// bits). The sparse formats go tensor by tensor in the same way: each member's entries of the
    /// tensor, then the step over it, while its part of the three is in the core's caches.
    pub(super) fn absorb<'m>(
        &mut self,
        codec: &Codec,
        round: usize,
        step: u64,
        msg: impl Fn(usize) -> &'m [f32],
        x: &mut [f32],
        gamma: f32,
    ) {
        let rank = self.rank;
        self.step_in(round, |ch, hat, memory| {
            let weight = |j: usize| if j == rank { ch.own } else { ch.other };
            if !codec.sparse() {
                let msgs: Vec<&[f32]> = (0..ch.ranks.len()).map(&msg).collect();
                let ahead = [Lines::of(hat), Lines::of(memory), Lines::of(x)];
                codec.decode_dense_spans(&msgs, &ahead, |at, qs| {
                    let span = at..at + qs[0].len();
                    let (h, m) = (&mut hat[span.clone()], &mut memory[span.clone()]);
                    for (&j, q) in ch.ranks.iter().zip(qs) {
                        super::absorb_span((j == rank).then_some(&mut *h), m, q, weight(j));
                    }
                    kernels::choco_step(&mut x[span], m, h, gamma);
                });
                return;
            }
            // The step covers everything up to the end of each tensor (and the rest after the last),
            // so entries outside every tensor are stepped too, as a whole pass would.
            let mut stepped = 0;
            for (t, &(off, len)) in codec.tensors.iter().enumerate() {
                for (pos, &j) in ch.ranks.iter().enumerate() {
                    let (idx, vals) = codec.sparse_part(msg(pos), step, j, t);
                    let hat = (j == rank).then_some(&mut *hat);
                    kernels::choco_absorb(hat, memory, &idx, vals, off, weight(j));
                }
                let span = stepped..(off + len).max(stepped);
                kernels::choco_step(
                    &mut x[span.clone()],
                    &memory[span.clone()],
                    &hat[span],
                    gamma,
                );
                stepped = stepped.max(off + len);
            }
            kernels::choco_step(
                &mut x[stepped..],
                &memory[stepped..],
                &hat[stepped..],
                gamma,
            );
        });
    }

    /// `absorb` from the group's decoded messages, for the simulation: this rank's own `q` and the sum of
    /// all members' `sum` (dense). The memory gains w_other * sum + (w_own - w_other) * q and the public
    /// copy q, then the consensus step.
    pub(super) fn absorb_sum(
        &mut self,
        round: usize,
        q: &[f32],
        sum: &[f32],
        x: &mut [f32],
        gamma: f32,
    ) {
        self.step_in(round, |ch, hat, memory| {
            let (other, own) = (ch.other, ch.own - ch.other);
            for (((m, h), &s), &q) in memory.iter_mut().zip(hat.iter_mut()).zip(sum).zip(q) {
                *m += other * s + own * q;
                *h += q;
            }
            kernels::choco_step(x, memory, hat, gamma);
        });
    }

    /// With the channel of `round` (none: alone, nothing to do): `add` updates its public copy and
    /// memory on the host and takes the consensus step x += gamma (s - x_hat).
    fn step_in(&mut self, round: usize, add: impl FnOnce(&Channel, &mut [f32], &mut [f32])) {
        let Some(c) = self.of_round[round] else {
            return;
        };
        let ch = &mut self.list[c];
        let (mut hat, mut memory) = (
            ch.hat.take_host(self.numel),
            ch.memory.take_host(self.numel),
        );
        add(ch, &mut hat, &mut memory);
        ch.hat.keep_host(hat);
        ch.memory.keep_host(memory);
    }

    pub(super) fn state(&self) -> Result<compress::State> {
        let saved = |v: &StateBuf| -> Result<Vec<f32>> {
            Ok(v.to_host()?.unwrap_or_else(|| vec![0.0; self.numel]))
        };
        let mut state = Vec::with_capacity(2 * self.list.len());
        for (c, ch) in self.list.iter().enumerate() {
            state.push((format!("choco.hat.{c}"), saved(&ch.hat)?));
            state.push((format!("choco.memory.{c}"), saved(&ch.memory)?));
        }
        Ok(state)
    }

    pub(super) fn load_state(&mut self, state: &mut compress::State) -> Result<()> {
        for (c, ch) in self.list.iter_mut().enumerate() {
            let n = Some(self.numel);
            ch.hat
                .restore(compress::take(state, &format!("choco.hat.{c}"), n)?);
            ch.memory
                .restore(compress::take(state, &format!("choco.memory.{c}"), n)?);
        }
        Ok(())
    }
}

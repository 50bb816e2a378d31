//! CHOCO-SGD compressed gossip (Koloskova et al., 2019; epfml/ChocoSGD's `parallel_choco.py`), on every
//! gossip topology, time-varying ones included.
//!
//! CHOCO on a static graph: node i keeps a public copy x_hat_i, which every neighbour also knows, and the
//! memory s_i = sum_j w_ij x_hat_j. After its optimizer step it sends q_i = Q(x_i - x_hat_i), every
//! node adds what it receives (x_hat_i += q_i, s_i += sum_j w_ij q_j), and the consensus step is
//! x_i += gamma (s_i - x_hat_i). For a doubly stochastic W, sum_i (s_i - x_hat_i) = 0: the step keeps the
//! workers' average.
//!
//! Time-varying topologies (Decent-DP's rounds: ring's alternating pairs, exp's one peer per round,
//! alternating-exp-ring) break the "every neighbour knows x_hat_i" premise: a peer met every log2(n)
//! rounds cannot follow the q's sent to the others. The extension keeps one *channel* per distinct group a
//! rank belongs to over the cycle of rounds, with the public copy x_hat_{i,G} and the memory
//! s_{i,G} = sum_{j in G} w_ij x_hat_{j,G}. When G meets, each member sends q = Q(x_i - x_hat_{i,G}) to the
//! others, all of them update that channel, and x_i += gamma (s_{i,G} - x_hat_{i,G}). A channel's copies
//! change only when all its members hear it, so s_{i,G} is exactly the weighted sum of the members'
//! copies; each group's weights are doubly stochastic (w on the diagonal, (1 - w) / (|G| - 1) elsewhere), so
//! sum_{i in G} (s_{i,G} - x_hat_{i,G}) = 0 and every round keeps the average. With the identity
//! compressor x_hat_{i,G} = x_i after the exchange and the step is x_i + gamma (W x - x)_i: plain gossip
//! for gamma = 1. A static topology (complete; ring on two ranks) has one channel and is CHOCO exactly.
//! Memory: two model-sized buffers per channel: 2 for complete, 4 for ring, 2 log2(n) for exp, and
//! 2 (1 + log2(nodes)) for alternating-exp-ring.
//!
//! Compressors (per tensor, as the reference): top-k (values + indices on the wire), random-k (values
//! only: the indices come from a seed the receivers share), QSGD (the 2-norm and per entry a sign bit and
//! a level in 0..=s, bit-packed), sign (||x||_1 / d and one bit per entry).

use anyhow::{bail, Result};

mod channels;
mod codec;
#[cfg(test)]
mod tests;
mod tuning;

pub use channels::Channels;
pub use codec::{absorb_span, qsgd_bits, qsgd_tau, Codec};
#[cfg(feature = "cuda")]
use codec::{bucket_len, buckets};
pub use tuning::{
    consensus_growth, mean_of, random_vectors, tune_gamma, Simulation, TUNE_ITERS, TUNING_VERSION,
};

use super::compress;
use super::topology::Round;
use super::trace::{Collective, Op};
use super::{Metrics, SyncBackend};
use crate::comm::{all_reduce_bytes, pack_u64, unpack_u64, Communicator};
use crate::kernels::Segment;
#[cfg(feature = "cuda")]
use {
    crate::flat::{DeviceFlat, FlatMut},
    anyhow::Context,
};

/// The message compressor of compressed gossip.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Compressor {
    TopK {
        density: f64,
    },
    RandomK {
        density: f64,
    },
    /// One 2-norm per `bucket` consecutive entries of a tensor (0: per tensor).
    Qsgd {
        levels: u32,
        biased: bool,
        bucket: usize,
    },
    Sign,
}

impl Compressor {
    pub fn describe(&self) -> String {
        match self {
            Compressor::TopK { density } => format!("top-k density {density}"),
            Compressor::RandomK { density } => format!("random-k density {density}"),
            Compressor::Qsgd {
                levels,
                biased,
                bucket,
            } => format!(
                "qsgd {levels} levels ({} bits an entry), {}{}",
                qsgd_bits(*levels),
                match bucket {
                    0 => "one norm per tensor".to_string(),
                    b => format!("one norm per {b} entries"),
                },
                if *biased { ", rescaled" } else { ", unbiased" }
            ),
            Compressor::Sign => "sign (1 bit an entry)".into(),
        }
    }
}

/// Compressed gossip's settings in the plan: `gamma` resolved (given, CHOCO's default, or tuned).
#[derive(Debug, Clone, PartialEq)]
pub struct ChocoPlan {
    pub compressor: Compressor,
    pub gamma: f64,
    /// Whether `gamma` was tuned ("auto").
    pub tuned: bool,
    /// Draws random-k's indices and QSGD's rounding.
    pub seed: u64,
}

/// CHOCO's default consensus step (`--consensus_stepsize` of the reference).
pub const DEFAULT_GAMMA: f64 = 0.9;
/// The mix of a step whose message waits for the next step's `before_step` (overlap).
#[derive(Debug, Clone, Copy)]
struct Pending {
    round: usize,
    step: u64,
    sent: bool,
}

/// Compressed gossip (see the module's documentation).
pub struct Choco {
    comm: Box<dyn Communicator>,
    /// What the rounds were made from (see `Gossip`'s field).
    topology: Option<(crate::config::Topology, usize)>,
    rounds: Vec<Round>,
    overlap: bool,
    numel: usize,
    codec: Codec,
    gamma: f64,
    channels: Channels,
    msg: Vec<f32>,
    /// The group's messages, in group order.
    recv: Vec<f32>,
    pending: Option<Pending>,
    /// Bytes uncompressed gossip would have sent, and bytes sent, since the last metrics row.
    dense_bytes: u64,
    sent_bytes: u64,
    /// The message and the group's messages on the GPU (the device path), instead of `msg`, `recv`.
    #[cfg(feature = "cuda")]
    device_msg: Option<cudarc::driver::CudaSlice<f32>>,
    #[cfg(feature = "cuda")]
    device_recv: Option<cudarc::driver::CudaSlice<f32>>,
}

impl Choco {
    pub fn new(
        comm: Box<dyn Communicator>,
        rounds: Vec<Round>,
        overlap: bool,
        plan: &ChocoPlan,
        tensors: &[Segment],
    ) -> Result<Self> {
        let numel = tensors.iter().map(|t| t.len).sum();
        let channels = Channels::new(&rounds, comm.rank(), numel)?;
        Ok(Self {
            comm,
            topology: None,
            rounds,
            overlap,
            numel,
            codec: Codec::new(plan.compressor, tensors, plan.seed),
            gamma: plan.gamma,
            channels,
            msg: Vec::new(),
            recv: Vec::new(),
            pending: None,
            dense_bytes: 0,
            sent_bytes: 0,
            #[cfg(feature = "cuda")]
            device_msg: None,
            #[cfg(feature = "cuda")]
            device_recv: None,
        })
    }

    /// Compressed gossip over `topo` with `per_node` ranks per node.
    pub fn over(
        comm: Box<dyn Communicator>,
        (topo, per_node): (crate::config::Topology, usize),
        overlap: bool,
        plan: &ChocoPlan,
        tensors: &[Segment],
    ) -> Result<Self> {
        let rounds = super::topology::rounds(topo, comm.world_size(), per_node)?;
        let mut c = Self::new(comm, rounds, overlap, plan, tensors)?;
        c.topology = Some((topo, per_node));
        Ok(c)
    }

    fn round_of(&self, step: u64) -> usize {
        (step % self.rounds.len() as u64) as usize
    }

    /// Every rank's exchange of `round` (ranks alone in the round take part with nothing to send).
    fn send(&mut self, round: usize) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.device_msg.is_some() {
            return self.send_device(round);
        }
        #[cfg(feature = "cuda")]
        {
            self.device_recv = None;
        }
        let me = self.comm.rank();
        let members = self.channels.members(round).unwrap_or(&[]).to_vec();
        let words = self.msg.len();
        self.recv.resize(members.len() * words, 0.0);
        let sends: Vec<(usize, &[f32])> = members
            .iter()
            .filter(|&&j| j != me)
            .map(|&j| (j, &self.msg[..]))
            .collect();
        let mut recvs: Vec<(usize, &mut [f32])> = members
            .iter()
            .zip(self.recv.chunks_mut(words.max(1)))
            .filter(|(&j, _)| j != me)
            .map(|(&j, piece)| (j, piece))
            .collect();
        let before = self.comm.stats().bytes_sent;
        self.comm.exchange(&sends, &mut recvs)?;
        self.account(&members, before);
        Ok(())
    }

    /// With overlap (after the first step), the message of `round` waits to be sent by `communicate`
    /// and applied by the next step's `before_step`: true when it does.
    fn defer(&mut self, round: usize, step: u64) -> bool {
        let defer = self.overlap && step > 0;
        if defer {
            self.pending = Some(Pending {
                round,
                step,
                sent: false,
            });
        }
        defer
    }

    /// Counts a round's bytes: sent since `before`, and what uncompressed gossip would have sent.
    fn account(&mut self, members: &[usize], before: u64) {
        self.sent_bytes += self.comm.stats().bytes_sent - before;
        let me = self.comm.rank();
        if let Some(pos) = members.iter().position(|&j| j == me) {
            self.dense_bytes += all_reduce_bytes(self.numel, members.len(), pos);
        }
    }

    fn apply(&mut self, params: &mut [f32], round: usize, step: u64) {
        let me = self.comm.rank();
        let words = self.msg.len();
        let (msg, recv) = (&self.msg, &self.recv);
        let members = self.channels.members(round).unwrap_or(&[]).to_vec();
        let at = |pos: usize| -> &[f32] {
            if members[pos] == me {
                msg
            } else {
                &recv[pos * words..(pos + 1) * words]
            }
        };
        self.channels
            .absorb(&self.codec, round, step, at, params, self.gamma as f32);
    }
}

#[cfg(feature = "cuda")]
impl Choco {
    /// Whether parameters on the GPU stay there: with an engine with device collectives.
    fn on_device(&self) -> bool {
        self.comm.device_collectives()
    }

    /// This rank's message of `round` on the GPU: Q(x - x_hat) with the radix-select kernel (top-k) or
    /// the `gather` kernel at the shared indices (random-k).
    fn encode_device(&mut self, round: usize, x: &DeviceFlat, step: u64) -> Result<()> {
        self.msg.clear();
        self.device_msg = None;
        let Some(c) = self.channels.of_round[round] else {
            return Ok(());
        };
        let (k, s, codec) = (&x.kernels, x.kernels.stream(), &self.codec);
        let ch = &mut self.channels.list[c];
        let hat = ch.hat.take_device(self.numel, s)?;
        // u = -x_hat + x: the host's x - x_hat.
        let mut u = s.alloc_zeros::<f32>(self.numel)?;
        k.scaled_copy(&mut u.slice_mut(..), &hat.slice(..), -1.0)?;
        ch.hat.keep_device(hat);
        k.ef_accumulate(&mut u, &x.buf)?;
        let mut msg = s.alloc_zeros::<f32>(codec.words())?;
        // Random-k's index sets, kept for this rank's own absorb.
        codec.keep_drawn(step, self.comm.rank());
        // QSGD's ChaCha8 key of this rank and step (each tensor is a stream of it), uploaded once.
        let key = match codec.compressor {
            Compressor::Qsgd { .. } => Some(s.clone_htod(&codec.qsgd_key(step, self.comm.rank()))?),
            _ => None,
        };
        for (t, &(off, len)) in codec.tensors.iter().enumerate() {
            let (at, kk) = (codec.parts[t], codec.ks[t]);
            if matches!(codec.compressor, Compressor::TopK { .. }) {
                let (idx, vals) = k.top_k(&u.slice(off..off + len), kk, 0)?;
                s.memcpy_dtod(&vals.slice(..kk), &mut msg.slice_mut(at..at + kk))?;
                // SAFETY: u32 and f32 have the same size; the indices travel as f32 bits.
                let bits = unsafe { idx.transmute::<f32>(kk) }.context("index bits")?;
                s.memcpy_dtod(&bits, &mut msg.slice_mut(at + kk..at + 2 * kk))?;
            } else if matches!(codec.compressor, Compressor::RandomK { .. }) {
                let local = codec.random_indices(step, self.comm.rank(), t);
                let global: Vec<u32> = local.iter().map(|&i| i + off as u32).collect();
                let mut vals = s.alloc_zeros::<f32>(kk)?;
                // SAFETY: random_indices draws indices below len, so off + i is inside u (the codec's
                // tensors tile the model, u's length).
                unsafe { k.gather(&u, &s.clone_htod(&global)?, &mut vals) }?;
                s.memcpy_dtod(&vals, &mut msg.slice_mut(at..at + kk))?;
            } else if let Compressor::Qsgd { levels, bucket, .. } = codec.compressor {
                let key = key.as_ref().context("the QSGD key, set above")?;
                let nb = buckets(len, bucket).len();
                let mut part = msg.slice_mut(at..codec.parts[t + 1]);
                let (mut norms, mut codes) = part.split_at_mut(nb);
                let u = u.slice(off..off + len);
                let bits = qsgd_bits(levels);
                let b = bucket_len(len, bucket);
                // SAFETY: the codec lays the tensor's message out as qsgd_encode writes it: one norm per
                // bucket of b (nb of them), then the codes of len entries at `bits` bits, until the next
                // tensor's part; the key is the codec's.
                unsafe {
                    k.qsgd_encode(&u, b, key, t as u64, levels, bits, &mut norms, &mut codes)
                }?;
            } else {
                let mut out = msg.slice_mut(at..codec.parts[t + 1]);
                // SAFETY: the codec's part of this tensor holds its sign message (scale and bits of len
                // entries).
                unsafe { k.sign_encode(&u.slice(off..off + len), &mut out) }?;
            }
        }
        self.device_msg = Some(msg);
        Ok(())
    }

    /// `send` of a message on the GPU: NCCL's send/recv on device buffers.
    fn send_device(&mut self, round: usize) -> Result<()> {
        let me = self.comm.rank();
        let members = self.channels.members(round).unwrap_or(&[]).to_vec();
        let Some(msg) = &self.device_msg else {
            bail!("internal error: no message on the GPU to send");
        };
        let words = msg.len();
        let mut recv = msg
            .stream()
            .alloc_zeros::<f32>((members.len() * words).max(1))?;
        let peers = members.iter().enumerate().filter(|&(_, &j)| j != me);
        let sends: Vec<_> = peers.clone().map(|(_, &j)| (j, 0..words)).collect();
        let recvs: Vec<_> = peers
            .map(|(pos, &j)| (j, pos * words..(pos + 1) * words))
            .collect();
        let before = self.comm.stats().bytes_sent;
        self.comm.exchange_device(msg, &sends, &mut recv, &recvs)?;
        self.account(&members, before);
        (self.device_recv, self.recv) = (Some(recv), Vec::new());
        Ok(())
    }

    /// `apply` on the GPU: each member's message into the channel (`choco_absorb`, in group order),
    /// then the consensus step (`choco_step`). A message or messages in host memory (a restored pending
    /// message, an exchange through host memory) go up first.
    fn apply_device(&mut self, x: &mut DeviceFlat, round: usize, step: u64) -> Result<()> {
        let Some(c) = self.channels.of_round[round] else {
            return Ok(());
        };
        let (k, s) = (x.kernels.clone(), x.kernels.stream().clone());
        let own = match self.device_msg.take() {
            Some(m) => m,
            None => s.clone_htod(&self.msg)?,
        };
        let recv = match self.device_recv.take() {
            Some(r) => r,
            None => s.clone_htod(&self.recv)?,
        };
        let (me, words, codec) = (self.comm.rank(), self.codec.words(), &self.codec);
        let ch = &mut self.channels.list[c];
        let mut hat = ch.hat.take_device(self.numel, &s)?;
        let mut memory = ch.memory.take_device(self.numel, &s)?;
        for (pos, &j) in ch.ranks.iter().enumerate() {
            let (mine, w) = if j == me {
                (true, ch.own)
            } else {
                (false, ch.other)
            };
            let m = if mine {
                own.slice(..)
            } else {
                recv.slice(pos * words..(pos + 1) * words)
            };
            let member = Member { rank: j, w, mine };
            absorb_device(&k, codec, (&mut hat, &mut memory), &m, member, step)?;
        }
        k.choco_step(&mut x.buf, &memory, &hat, self.gamma as f32)?;
        ch.hat.keep_device(hat);
        ch.memory.keep_device(memory);
        Ok(())
    }
}

/// A member of a channel whose message enters it: its rank, its weight, and whether it is this rank.
#[cfg(feature = "cuda")]
#[derive(Clone, Copy)]
struct Member {
    rank: usize,
    w: f32,
    mine: bool,
}

/// One member's message `m` into a channel's public copy and memory on the GPU, tensor by tensor (the
/// host path's `Channels::absorb`, kernel by kernel).
#[cfg(feature = "cuda")]
fn absorb_device(
    k: &crate::cuda::Kernels,
    codec: &Codec,
    (hat, memory): (
        &mut cudarc::driver::CudaSlice<f32>,
        &mut cudarc::driver::CudaSlice<f32>,
    ),
    m: &cudarc::driver::CudaView<f32>,
    Member { rank, w, mine }: Member,
    step: u64,
) -> Result<()> {
    let s = k.stream();
    for (t, &(off, len)) in codec.tensors.iter().enumerate() {
        let (at, kk) = (codec.parts[t], codec.ks[t]);
        let part = m.slice(at..codec.parts[t + 1]);
        match codec.compressor {
            Compressor::TopK { .. } | Compressor::RandomK { .. } => {
                let vals = m.slice(at..at + kk);
                let shared;
                let idx = if matches!(codec.compressor, Compressor::TopK { .. }) {
                    // SAFETY: the indices' bits, as `encode_device` packed them.
                    unsafe { m.slice(at + kk..at + 2 * kk).transmute::<u32>(kk) }
                        .context("index bits")?
                } else {
                    shared = s.clone_htod(&codec.random_indices(step, rank, t)[..])?;
                    shared.slice(..)
                };
                // SAFETY: the indices are below len: top_k's of the sender's len entries (the same
                // codec), or random_indices's; off + len is inside the channel (the codec's tensors
                // tile the model, the channel's length).
                unsafe { k.choco_absorb(hat, memory, &idx, &vals, off, w, mine) }?;
            }
            Compressor::Qsgd {
                levels,
                biased,
                bucket,
            } => {
                let ranges = buckets(len, bucket);
                let (norms, codes) = part.split_at(ranges.len());
                let b = bucket_len(len, bucket);
                let tau = qsgd_tau(levels, b.min(len), biased);
                let last = ranges.last().map_or(0, |r| r.len());
                let tau_last = qsgd_tau(levels, last, biased);
                // SAFETY: norms and codes are the part of a message that qsgd_encode wrote for this
                // tensor's len entries in buckets of b (the same codec on every rank).
                unsafe {
                    k.qsgd_absorb(
                        hat,
                        memory,
                        (off, len, b),
                        &norms,
                        &codes,
                        (levels, qsgd_bits(levels)),
                        (tau, tau_last),
                        (w, mine),
                    )
                }?;
            }
            Compressor::Sign => {
                // SAFETY: part is this tensor's sign message of len entries (sign_encode's, the same
                // codec on every rank).
                unsafe { k.sign_absorb(hat, memory, off, len, &part, w, mine) }?;
            }
        }
    }
    Ok(())
}

impl SyncBackend for Choco {
    fn name(&self) -> &'static str {
        "decentdp"
    }
    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }
    fn comm_mut(&mut self) -> &mut dyn Communicator {
        self.comm.as_mut()
    }
    /// Each group's members exchange their compressed messages (an all-gather within the group), when
    /// uncompressed gossip would all-reduce.
    fn step_comm(&self, step: u64) -> Vec<Collective> {
        let pieces = vec![self.codec.words() as u64];
        super::gossip_step_comm(&self.rounds, self.overlap, step, Op::AllGather { pieces })
    }
    fn has_pending(&self) -> bool {
        matches!(self.pending, Some(Pending { sent: false, .. }))
    }
    fn communicate(&mut self) -> Result<()> {
        if let Some(p @ Pending { sent: false, .. }) = self.pending {
            self.send(p.round)?;
            self.pending = Some(Pending { sent: true, ..p });
        }
        Ok(())
    }
    fn before_step(&mut self, params: &mut [f32]) -> Result<()> {
        self.communicate()?;
        if let Some(p) = self.pending.take() {
            self.apply(params, p.round, p.step);
        }
        Ok(())
    }
    /// q = Q(x - x_hat) for this step's channel; sent and applied now, or (overlap) by the next step.
    fn after_step(&mut self, params: &mut [f32], step: u64) -> Result<()> {
        let round = self.round_of(step);
        #[cfg(feature = "cuda")]
        {
            self.device_msg = None;
        }
        self.channels
            .encode(&self.codec, round, params, step, &mut self.msg);
        if self.defer(round, step) {
            return Ok(());
        }
        self.send(round)?;
        self.apply(params, round, step);
        Ok(())
    }
    /// On the GPU with a sparse compressor and device collectives, the parameters, public copies,
    /// memories and messages stay on the device; otherwise the host path runs on a copy.
    #[cfg(feature = "cuda")]
    fn before_step_flat(&mut self, params: FlatMut<'_>) -> Result<()> {
        match params {
            FlatMut::Cuda(d) if self.on_device() => {
                self.communicate()?;
                match self.pending.take() {
                    Some(p) => self.apply_device(d, p.round, p.step),
                    None => Ok(()),
                }
            }
            p => p.through_host(|p| self.before_step(p)),
        }
    }
    #[cfg(feature = "cuda")]
    fn after_step_flat(&mut self, params: FlatMut<'_>, step: u64) -> Result<()> {
        match params {
            FlatMut::Cuda(d) if self.on_device() => {
                let round = self.round_of(step);
                self.encode_device(round, d, step)?;
                if self.defer(round, step) {
                    return Ok(());
                }
                self.send(round)?;
                self.apply_device(d, round, step)
            }
            p => p.through_host(|p| self.after_step(p, step)),
        }
    }
    /// New rounds over the workers present, and fresh channels: the public copies restart at zero, as
    /// at step 0.
    fn members_changed(&mut self) -> Result<()> {
        self.rounds = super::rounds_over(self.topology, self.comm.world_size())?;
        self.channels = Channels::new(&self.rounds, self.comm.rank(), self.numel)?;
        Ok(())
    }
    /// The channels' public copies and memories, and a message that waits to be sent.
    fn state(&self) -> Result<compress::State> {
        let mut state = self.channels.state()?;
        if let Some(p @ Pending { sent: false, .. }) = self.pending {
            let [hi, lo] = pack_u64(p.step);
            #[cfg(feature = "cuda")]
            let msg = match &self.device_msg {
                Some(m) => m.stream().clone_dtoh(m)?,
                None => self.msg.clone(),
            };
            #[cfg(not(feature = "cuda"))]
            let msg = self.msg.clone();
            state.extend([
                ("choco.pending".into(), msg),
                ("choco.pending_round".into(), vec![p.round as f32]),
                ("choco.pending_step".into(), vec![hi, lo]),
            ]);
        }
        Ok(state)
    }
    fn load_state(&mut self, mut state: compress::State) -> Result<()> {
        self.pending = None;
        super::pending_of_the_other_kind(&state, "gossip.pending", "plain gossip")?;
        if !state.iter().any(|(n, _)| n.starts_with("choco.")) {
            // A checkpoint of uncompressed gossip: the public copies start at zero, as at step 0.
            self.channels = Channels::new(&self.rounds, self.comm.rank(), self.numel)?;
            return Ok(());
        }
        self.channels.load_state(&mut state)?;
        if state.iter().any(|(n, _)| n == "choco.pending") {
            let round = compress::take(&mut state, "choco.pending_round", Some(1))?[0] as usize;
            let step = compress::take(&mut state, "choco.pending_step", Some(2))?;
            if round >= self.rounds.len() {
                bail!(crate::error::BadInput(format!(
                    "checkpoint: pending gossip round {round}, but the topology has {} rounds",
                    self.rounds.len()
                )));
            }
            self.msg = compress::take(&mut state, "choco.pending", Some(self.codec.words()))?;
            #[cfg(feature = "cuda")]
            {
                self.device_msg = None;
            }
            self.pending = Some(Pending {
                round,
                step: unpack_u64([step[0], step[1]]),
                sent: false,
            });
        }
        Ok(())
    }
    fn take_metrics(&mut self) -> Metrics {
        let (dense, sent) = (
            std::mem::take(&mut self.dense_bytes),
            std::mem::take(&mut self.sent_bytes),
        );
        Metrics {
            compression_ratio: (sent > 0).then(|| dense as f64 / sent as f64),
            consensus_step: Some(self.gamma),
            ..Metrics::default()
        }
    }
}

/// What one rank holds (see `super::Footprint`): two model-sized buffers per channel and its last
/// message (the local engine's mailboxes keep one per peer); per step the members' messages and the
/// tensors' differences x - x_hat being compressed.
pub fn footprint(
    plan: &ChocoPlan,
    topology: crate::config::Topology,
    world: usize,
    ranks_per_node: usize,
    tensors: &[Segment],
) -> super::Footprint {
    let numel = tensors.iter().map(|t| t.len).sum::<usize>() as u64;
    let words = Codec::new(plan.compressor, tensors, plan.seed).words() as u64;
    let rounds = super::topology::rounds(topology, world, ranks_per_node).unwrap_or_default();
    let channels = Channels::new(&rounds, 0, 0).map_or(0, |c| c.count()) as u64;
    let group = rounds
        .iter()
        .flatten()
        .filter(|g| g.ranks.contains(&0))
        .map(|g| g.ranks.len() as u64)
        .max()
        .unwrap_or(1);
    super::Footprint {
        kept: 2 * channels * numel + group * words,
        during_step: group * words + numel,
    }
}

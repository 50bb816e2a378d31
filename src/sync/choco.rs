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
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::compress::{self, k_of, StateBuf, TensorView};
use super::topology::Round;
use super::trace::{Collective, Op};
use super::{Metrics, SyncBackend};
use crate::comm::{all_reduce_bytes, pack_u64, unpack_u64, Communicator};
use crate::kernels;
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

const RANDOMK_KEY: u64 = 0x0072_616e_646f_6d6b; // "randomk"
const QSGD_KEY: u64 = 0x7173_6764; // "qsgd"

/// SplitMix64 over the parts: one seed from several numbers.
fn mix(parts: &[u64]) -> u64 {
    parts.iter().fold(0x9e37_79b9_7f4a_7c15u64, |h, &p| {
        let mut z = (h ^ p).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}

/// Entries per QSGD norm in a tensor of `len` entries (`bucket` 0: the whole tensor).
fn bucket_len(len: usize, bucket: usize) -> usize {
    if bucket == 0 {
        len.max(1)
    } else {
        bucket
    }
}

/// The ranges of a tensor of `len` entries that share one QSGD norm.
fn buckets(len: usize, bucket: usize) -> Vec<std::ops::Range<usize>> {
    let b = bucket_len(len, bucket);
    (0..len).step_by(b).map(|s| s..(s + b).min(len)).collect()
}

/// QSGD's rescaling for `d` entries: tau = 1 + min(d / s^2, sqrt(d) / s) when biased (CHOCO's
/// "qsgd-biased"), else 1.
pub fn qsgd_tau(levels: u32, d: usize, biased: bool) -> f32 {
    if !biased {
        return 1.0;
    }
    let (s, d) = (levels as f32, d as f32);
    1.0 + (d / (s * s)).min(d.sqrt() / s)
}

/// Bits of one QSGD entry: a sign and a level in 0..=levels.
pub fn qsgd_bits(levels: u32) -> u32 {
    1 + (32 - levels.leading_zeros())
}

/// A compressor over a model's tensors: every rank's message has the same size, set by the tensors.
#[derive(Debug, Clone)]
pub struct Codec {
    compressor: Compressor,
    /// (offset, len) of each tensor in the flat parameters.
    tensors: Vec<(usize, usize)>,
    /// Where each tensor's part of a message starts (one more entry: the message's length).
    parts: Vec<usize>,
    /// Entries sent per tensor (top-k, random-k).
    ks: Vec<usize>,
    seed: u64,
}

impl Codec {
    pub fn new(compressor: Compressor, tensors: &[TensorView], seed: u64) -> Self {
        let tensors: Vec<(usize, usize)> = tensors.iter().map(|t| (t.offset, t.len)).collect();
        let ks: Vec<usize> = tensors
            .iter()
            .map(|&(_, len)| match compressor {
                Compressor::TopK { density } | Compressor::RandomK { density } => {
                    k_of(density, len)
                }
                _ => 0,
            })
            .collect();
        let mut parts = vec![0];
        for (&(_, len), &k) in tensors.iter().zip(&ks) {
            let words = match compressor {
                Compressor::TopK { .. } => 2 * k,
                Compressor::RandomK { .. } => k,
                Compressor::Qsgd { levels, bucket, .. } => {
                    buckets(len, bucket).len() + (len * qsgd_bits(levels) as usize).div_ceil(32)
                }
                Compressor::Sign => 1 + len.div_ceil(32),
            };
            parts.push(parts.last().copied().unwrap_or(0) + words);
        }
        Self {
            compressor,
            tensors,
            parts,
            ks,
            seed,
        }
    }

    /// f32 words of one message.
    pub fn words(&self) -> usize {
        self.parts.last().copied().unwrap_or(0)
    }

    fn rng(&self, key: u64, step: u64, rank: usize, tensor: usize) -> ChaCha8Rng {
        let mut rng = ChaCha8Rng::seed_from_u64(mix(&[self.seed, key, step, rank as u64]));
        rng.set_stream(tensor as u64);
        rng
    }

    /// Random-k's ascending indices of tensor `t` for `sender` at `step`.
    fn random_indices(&self, step: u64, sender: usize, t: usize) -> Vec<usize> {
        let (_, len) = self.tensors[t];
        let mut rng = self.rng(RANDOMK_KEY, step, sender, t);
        let mut idx = rand::seq::index::sample(&mut rng, len, self.ks[t]).into_vec();
        idx.sort_unstable();
        idx
    }

    /// Whether messages are sparse (indices and values: top-k, random-k).
    pub fn sparse(&self) -> bool {
        matches!(
            self.compressor,
            Compressor::TopK { .. } | Compressor::RandomK { .. }
        )
    }

    /// Tensor `t`'s part of a sparse message that `sender` sent at `step`: its indices (within the
    /// tensor, ascending) and values.
    fn sparse_part<'m>(
        &self,
        msg: &'m [f32],
        step: u64,
        sender: usize,
        t: usize,
    ) -> (Vec<u32>, &'m [f32]) {
        let (part, k) = (&msg[self.parts[t]..self.parts[t + 1]], self.ks[t]);
        match self.compressor {
            Compressor::TopK { .. } => (compress::f32_to_indices(&part[k..]), &part[..k]),
            _ => (self.random_indices_u32(step, sender, t), part),
        }
    }

    /// The key of QSGD's ChaCha8 streams for `rank` at `step` (the stream is the tensor's index), as the
    /// `qsgd_encode` kernel takes it.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn qsgd_key(&self, step: u64, rank: usize) -> [u32; 8] {
        let seed = self.rng(QSGD_KEY, step, rank, 0).get_seed();
        std::array::from_fn(|i| u32::from_le_bytes([0, 1, 2, 3].map(|j| seed[4 * i + j])))
    }

    fn random_indices_u32(&self, step: u64, sender: usize, t: usize) -> Vec<u32> {
        self.random_indices(step, sender, t)
            .into_iter()
            .map(|i| i as u32)
            .collect()
    }

    /// The message of Q(x - hat) that `rank` sends at `step`.
    pub fn encode(&self, x: &[f32], hat: &[f32], step: u64, rank: usize, msg: &mut Vec<f32>) {
        msg.clear();
        msg.resize(self.words(), 0.0);
        let mut outs = Vec::with_capacity(self.tensors.len());
        let mut rest = &mut msg[..];
        for w in self.parts.windows(2) {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(w[1] - w[0]);
            outs.push(head);
            rest = tail;
        }
        outs.into_iter().enumerate().for_each(|(t, out)| {
            let (off, len) = self.tensors[t];
            let u: Vec<f32> = x[off..off + len]
                .iter()
                .zip(&hat[off..off + len])
                .map(|(a, b)| a - b)
                .collect();
            self.encode_tensor(t, &u, step, rank, out);
        });
    }

    fn encode_tensor(&self, t: usize, u: &[f32], step: u64, rank: usize, out: &mut [f32]) {
        let len = u.len();
        match self.compressor {
            Compressor::TopK { .. } => {
                let k = self.ks[t];
                let (vals, idx) = out.split_at_mut(k);
                top_k(u, vals, idx);
            }
            Compressor::RandomK { .. } => {
                for (o, i) in out.iter_mut().zip(self.random_indices(step, rank, t)) {
                    *o = u[i];
                }
            }
            Compressor::Qsgd { levels, bucket, .. } => {
                let ranges = buckets(len, bucket);
                let (norms, codes) = out.split_at_mut(ranges.len());
                let (bits, s) = (qsgd_bits(levels), levels as f32);
                let mut rng = self.rng(QSGD_KEY, step, rank, t);
                let mut w = BitWriter::new(codes);
                for (norm_out, r) in norms.iter_mut().zip(ranges) {
                    let vals = &u[r];
                    // The f64 sum in the order of the `qsgd_encode` kernel's block.
                    let norm = kernels::block_strided_sum(vals, |v| (v as f64) * (v as f64));
                    let norm = norm.sqrt() as f32;
                    *norm_out = norm;
                    let usable = norm > 0.0 && norm.is_finite();
                    for &v in vals {
                        let lf = if usable { s * v.abs() / norm } else { 0.0 };
                        let lo = lf.floor();
                        let up = rng.random::<f32>() < lf - lo;
                        let level = ((lo as u32) + u32::from(up)).min(levels);
                        let neg = u32::from(v < 0.0);
                        w.put(level | neg << (bits - 1), bits);
                    }
                }
            }
            Compressor::Sign => {
                // ||u||_1 / len, the f64 sum in the order of the `sign_encode` kernel's block.
                let l1 = kernels::block_strided_sum(u, |v| v.abs() as f64);
                out[0] = (l1 / len.max(1) as f64) as f32;
                for (word, vals) in out[1..].iter_mut().zip(u.chunks(32)) {
                    let bits = vals
                        .iter()
                        .enumerate()
                        .fold(0u32, |b, (i, &v)| b | u32::from(v < 0.0) << i);
                    *word = f32::from_bits(bits);
                }
            }
        }
    }

    /// Calls `f(index, q)` for the entries of the message `msg` that `sender` sent at `step` (every entry
    /// for the dense formats), indices into the flat parameters, ascending within each tensor.
    pub fn decode(&self, msg: &[f32], step: u64, sender: usize, mut f: impl FnMut(usize, f32)) {
        for (t, &(off, len)) in self.tensors.iter().enumerate() {
            let part = &msg[self.parts[t]..self.parts[t + 1]];
            match self.compressor {
                Compressor::TopK { .. } => {
                    let (vals, idx) = part.split_at(self.ks[t]);
                    for (v, i) in vals.iter().zip(idx) {
                        f(off + i.to_bits() as usize, *v);
                    }
                }
                Compressor::RandomK { .. } => {
                    for (v, i) in part.iter().zip(self.random_indices(step, sender, t)) {
                        f(off + i, *v);
                    }
                }
                Compressor::Qsgd {
                    levels,
                    biased,
                    bucket,
                } => {
                    let ranges = buckets(len, bucket);
                    let (norms, codes) = part.split_at(ranges.len());
                    let bits = qsgd_bits(levels);
                    let mut r = BitReader::new(codes);
                    for (norm, range) in norms.iter().zip(ranges) {
                        let unit = norm / levels as f32 / qsgd_tau(levels, range.len(), biased);
                        for i in range {
                            let code = r.get(bits);
                            let level = (code & ((1 << (bits - 1)) - 1)) as f32;
                            let q = unit * level;
                            f(off + i, if code >> (bits - 1) == 1 { -q } else { q });
                        }
                    }
                }
                Compressor::Sign => {
                    let scale = part[0];
                    for (w, word) in part[1..].iter().enumerate() {
                        let bits = word.to_bits();
                        for i in 0..32.min(len - 32 * w) {
                            let q = if bits >> i & 1 == 1 { -scale } else { scale };
                            f(off + 32 * w + i, q);
                        }
                    }
                }
            }
        }
    }
}

/// The `vals.len()` entries of largest magnitude of `x`, ties towards lower indices, in index order, into
/// `vals` and (as u32 bit patterns) `idx`: the selection of `kernels::top_k` (the CUDA twin the reducers
/// run), computed the CPU's way, by one `select_nth_unstable` of the magnitudes' bits and one scan.
fn top_k(x: &[f32], vals: &mut [f32], idx: &mut [f32]) {
    let k = vals.len().min(x.len());
    if k == 0 {
        return;
    }
    let key = |v: f32| v.to_bits() & 0x7fff_ffff;
    let mut keys: Vec<u32> = x.iter().map(|&v| key(v)).collect();
    let n = keys.len();
    let (_, &mut t, above) = keys.select_nth_unstable(n - k);
    let mut ties = k - above.iter().filter(|&&a| a > t).count();
    let mut slot = 0;
    for (i, &v) in x.iter().enumerate() {
        let kv = key(v);
        if kv > t || (kv == t && ties > 0) {
            ties -= usize::from(kv == t);
            vals[slot] = v;
            idx[slot] = f32::from_bits(i as u32);
            slot += 1;
            if slot == k {
                break;
            }
        }
    }
}

/// Codes of a few bits packed into f32 words (as u32 bit patterns), lowest bits first.
struct BitWriter<'a> {
    out: &'a mut [f32],
    word: usize,
    acc: u64,
    used: u32,
}

impl<'a> BitWriter<'a> {
    fn new(out: &'a mut [f32]) -> Self {
        Self {
            out,
            word: 0,
            acc: 0,
            used: 0,
        }
    }

    fn put(&mut self, code: u32, bits: u32) {
        self.acc |= (code as u64) << self.used;
        self.used += bits;
        if self.used >= 32 {
            self.out[self.word] = f32::from_bits(self.acc as u32);
            self.word += 1;
            self.acc >>= 32;
            self.used -= 32;
        }
    }
}

impl Drop for BitWriter<'_> {
    fn drop(&mut self) {
        if self.used > 0 {
            self.out[self.word] = f32::from_bits(self.acc as u32);
        }
    }
}

struct BitReader<'a> {
    words: &'a [f32],
    word: usize,
    acc: u64,
    have: u32,
}

impl<'a> BitReader<'a> {
    fn new(words: &'a [f32]) -> Self {
        Self {
            words,
            word: 0,
            acc: 0,
            have: 0,
        }
    }

    fn get(&mut self, bits: u32) -> u32 {
        if self.have < bits {
            let w = self.words.get(self.word).map_or(0, |w| w.to_bits());
            self.acc |= (w as u64) << self.have;
            self.have += 32;
            self.word += 1;
        }
        let code = (self.acc & ((1u64 << bits) - 1)) as u32;
        self.acc >>= bits;
        self.have -= bits;
        code
    }
}

/// One group a rank meets over the cycle of rounds, and the rank's state in it.
struct Channel {
    ranks: Vec<usize>,
    /// The weight of the rank itself and of each other member.
    own: f32,
    other: f32,
    /// This rank's public copy x_hat_{i,G} (none: zero, until the channel first meets; a described
    /// backend (`check`) allocates none), on the host or beside the parameters on the GPU.
    hat: StateBuf,
    /// The memory s_{i,G} = sum_j w_ij x_hat_{j,G} (none: zero).
    memory: StateBuf,
}

/// A rank's channels and which one each round uses (None: alone in that round).
pub struct Channels {
    rank: usize,
    numel: usize,
    list: Vec<Channel>,
    of_round: Vec<Option<usize>>,
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
    fn members(&self, round: usize) -> Option<&[usize]> {
        self.of_round[round].map(|c| &self.list[c].ranks[..])
    }

    /// This rank's message in `round`: Q(x - x_hat).
    fn encode(&mut self, codec: &Codec, round: usize, x: &[f32], step: u64, msg: &mut Vec<f32>) {
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
    /// consensus step x += gamma (s - x_hat).
    fn absorb<'m>(
        &mut self,
        codec: &Codec,
        round: usize,
        step: u64,
        msg: impl Fn(usize) -> &'m [f32],
        x: &mut [f32],
        gamma: f32,
    ) {
        let Some(c) = self.of_round[round] else {
            return;
        };
        let ch = &mut self.list[c];
        let (mut hat, mut memory) = (
            ch.hat.take_host(self.numel),
            ch.memory.take_host(self.numel),
        );
        for (pos, &j) in ch.ranks.iter().enumerate() {
            let (mine, w) = if j == self.rank {
                (true, ch.own)
            } else {
                (false, ch.other)
            };
            if codec.sparse() {
                for (t, &(off, _)) in codec.tensors.iter().enumerate() {
                    let (idx, vals) = codec.sparse_part(msg(pos), step, j, t);
                    let hat = mine.then_some(&mut hat[..]);
                    kernels::choco_absorb(hat, &mut memory, &idx, vals, off, w);
                }
            } else if mine {
                codec.decode(msg(pos), step, j, |i, q| {
                    hat[i] += q;
                    memory[i] += w * q;
                });
            } else {
                codec.decode(msg(pos), step, j, |i, q| memory[i] += w * q);
            }
        }
        kernels::choco_step(x, &memory, &hat, gamma);
        ch.hat.keep_host(hat);
        ch.memory.keep_host(memory);
    }

    fn state(&self) -> Result<compress::State> {
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

    fn load_state(&mut self, state: &mut compress::State) -> Result<()> {
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
        tensors: &[TensorView],
    ) -> Result<Self> {
        let numel = tensors.iter().map(|t| t.len).sum();
        let channels = Channels::new(&rounds, comm.rank(), numel)?;
        Ok(Self {
            comm,
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
                let local = codec.random_indices_u32(step, self.comm.rank(), t);
                let global: Vec<u32> = local.iter().map(|&i| i + off as u32).collect();
                let mut vals = s.alloc_zeros::<f32>(kk)?;
                // SAFETY: random_indices_u32 draws indices below len, so off + i is inside u (the codec's
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
                            shared = s.clone_htod(&codec.random_indices_u32(step, j, t))?;
                            shared.slice(..)
                        };
                        // SAFETY: the indices are below len: top_k's of the sender's len entries (the same
                        // codec), or random_indices_u32's; off + len is inside the channel (the codec's
                        // tensors tile the model, the channel's length).
                        unsafe {
                            k.choco_absorb(&mut hat, &mut memory, &idx, &vals, off, w, mine)
                        }?;
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
                        // SAFETY: norms and codes are the part of a message that qsgd_encode wrote for
                        // this tensor's len entries in buckets of b (the same codec on every rank).
                        unsafe {
                            k.qsgd_absorb(
                                &mut hat,
                                &mut memory,
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
                        // SAFETY: part is this tensor's sign message of len entries (sign_encode's, the
                        // same codec on every rank).
                        unsafe { k.sign_absorb(&mut hat, &mut memory, off, len, &part, w, mine) }?;
                    }
                }
            }
        }
        k.choco_step(&mut x.buf, &memory, &hat, self.gamma as f32)?;
        ch.hat.keep_device(hat);
        ch.memory.keep_device(memory);
        Ok(())
    }
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
    tensors: &[TensorView],
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

/// All ranks' CHOCO consensus in one process (no communication, no gradients): the same channels,
/// codec and steps as the backend. For tuning gamma and for tests.
pub struct Simulation {
    pub rounds: Vec<Round>,
    pub codec: Codec,
    pub gamma: f32,
    pub nodes: Vec<Channels>,
}

impl Simulation {
    pub fn new(rounds: Vec<Round>, codec: Codec, gamma: f32, numel: usize) -> Result<Self> {
        let world = rounds
            .first()
            .map_or(0, |r| r.iter().map(|g| g.ranks.len()).sum());
        let nodes = (0..world)
            .map(|rank| Channels::new(&rounds, rank, numel))
            .collect::<Result<_>>()?;
        Ok(Self {
            rounds,
            codec,
            gamma,
            nodes,
        })
    }

    /// The consensus of step `step` on the ranks' vectors `xs`.
    pub fn step(&mut self, xs: &mut [Vec<f32>], step: u64) {
        let round = (step % self.rounds.len() as u64) as usize;
        let msgs: Vec<Vec<f32>> = self
            .nodes
            .iter_mut()
            .zip(xs.iter())
            .map(|(node, x)| {
                let mut m = Vec::new();
                node.encode(&self.codec, round, x, step, &mut m);
                m
            })
            .collect();
        for (node, x) in self.nodes.iter_mut().zip(xs.iter_mut()) {
            let members = node.members(round).unwrap_or(&[]).to_vec();
            node.absorb(
                &self.codec,
                round,
                step,
                |pos| &msgs[members[pos]][..],
                x,
                self.gamma,
            );
        }
    }

    /// CHOCO's tuning error: sum_i ||x_i - mean||^2 + sum over channels ||x_i - x_hat_{i,G}||^2.
    pub fn error(&self, xs: &[Vec<f32>]) -> f64 {
        let mean = mean_of(xs);
        let mut e = 0.0;
        for (node, x) in self.nodes.iter().zip(xs) {
            e += x
                .iter()
                .zip(&mean)
                .map(|(&a, &m)| (a as f64 - m).powi(2))
                .sum::<f64>();
            for ch in &node.list {
                // A channel that has not met yet holds zero.
                let hat = |i: usize| ch.hat.host().get(i).copied().unwrap_or(0.0) as f64;
                e += x
                    .iter()
                    .enumerate()
                    .map(|(i, &a)| (a as f64 - hat(i)).powi(2))
                    .sum::<f64>();
            }
        }
        e
    }
}

/// The element-wise mean of the ranks' vectors.
pub fn mean_of(xs: &[Vec<f32>]) -> Vec<f64> {
    let n = xs.len().max(1) as f64;
    let mut m = vec![0.0f64; xs.first().map_or(0, Vec::len)];
    for x in xs {
        m.iter_mut().zip(x).for_each(|(m, &v)| *m += v as f64);
    }
    m.iter_mut().for_each(|v| *v /= n);
    m
}

/// Standard normal vectors, one per rank, from `seed`.
pub fn random_vectors(world: usize, dim: usize, seed: u64) -> Vec<Vec<f32>> {
    use rand_distr::{Distribution, StandardNormal};
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..world)
        .map(|_| (0..dim).map(|_| StandardNormal.sample(&mut rng)).collect())
        .collect()
}

/// Iterations of the tuning simulation (the reference's `num_iters`).
pub const TUNE_ITERS: u64 = 1000;

/// Tunes gamma as CHOCO's `tune_consensus_stepsize.py`: the consensus alone on standard normal vectors
/// (one per rank; `dim` entries, smaller for large worlds to bound the work) with the run's rounds and
/// compressor, `TUNE_ITERS` steps for each gamma of a 20-point log grid over [1e-3, 1], and the gamma of
/// the lowest final error. Two changes for f32 arithmetic, which stops improving near 1e-10 of the start:
/// the consensus part of the error is measured from the current average (rounding moves the average a
/// little, whatever gamma does), and final errors below 1e-9 of the start are ties, broken by the sum of
/// the errors along the way (the fastest consensus wins). Deterministic: every rank gets the same value.
pub fn tune_gamma(rounds: &[Round], compressor: Compressor, seed: u64) -> Result<f64> {
    let world: usize = rounds
        .first()
        .map_or(1, |r| r.iter().map(|g| g.ranks.len()).sum());
    if world < 2 {
        return Ok(1.0);
    }
    // About 64k entries decoded per step: each rank decodes its group's messages.
    let group = rounds
        .iter()
        .flatten()
        .map(|g| g.ranks.len())
        .max()
        .unwrap_or(1);
    let dim = (64_000 / (world * group)).clamp(16, 1000);
    let tensors = TensorView::from_shapes(&[(1, dim, false)]);
    let codec = Codec::new(compressor, &tensors, seed);
    let x0 = random_vectors(world, dim, mix(&[seed, 0x7475_6e65]));
    let start = Simulation::new(rounds.to_vec(), codec.clone(), 0.0, dim)?.error(&x0);
    let grid: Vec<f64> = (0..20)
        .map(|i| 10f64.powf(-3.0 + 3.0 * i as f64 / 19.0))
        .collect();
    let scores: Vec<(f64, f64)> = grid
        .par_iter()
        .map(|&gamma| -> Result<(f64, f64)> {
            let mut sim = Simulation::new(rounds.to_vec(), codec.clone(), gamma as f32, dim)?;
            let mut xs = x0.clone();
            let mut area = 0.0;
            for step in 0..TUNE_ITERS {
                sim.step(&mut xs, step);
                if step % 10 == 9 {
                    area += sim.error(&xs);
                }
            }
            let finite = |e: f64| if e.is_finite() { e } else { f64::INFINITY };
            Ok((finite(sim.error(&xs)).max(1e-9 * start), finite(area)))
        })
        .collect::<Result<_>>()?;
    let best = (0..grid.len())
        .min_by(|&a, &b| {
            let (x, y) = (scores[a], scores[b]);
            x.0.total_cmp(&y.0).then(x.1.total_cmp(&y.1))
        })
        .unwrap_or(grid.len() - 1);
    Ok(grid[best])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Topology;
    use crate::kernels;
    use crate::sync::topology;

    const COMPRESSORS: [Compressor; 5] = [
        Compressor::TopK { density: 0.1 },
        Compressor::RandomK { density: 0.1 },
        Compressor::Qsgd {
            levels: 3,
            biased: true,
            bucket: 16,
        },
        Compressor::Qsgd {
            levels: 15,
            biased: false,
            bucket: 0,
        },
        Compressor::Sign,
    ];

    fn topologies() -> Vec<(&'static str, Vec<Round>)> {
        vec![
            (
                "complete",
                topology::rounds(Topology::Complete, 8, 8).unwrap(),
            ),
            ("ring", topology::rounds(Topology::Ring, 8, 8).unwrap()),
            ("exp", topology::rounds(Topology::Exp, 8, 8).unwrap()),
            (
                "alternating-exp-ring",
                topology::rounds(Topology::AlternatingExpRing, 8, 2).unwrap(),
            ),
        ]
    }

    fn shapes() -> Vec<TensorView> {
        TensorView::from_shapes(&[(7, 9, true), (1, 13, false), (3, 40, true)])
    }

    #[test]
    fn messages_decode_to_what_the_compressor_defines() {
        let tensors = shapes();
        let n: usize = tensors.iter().map(|t| t.len).sum();
        let x = &random_vectors(1, n, 5)[0];
        let zero = vec![0.0; n];
        for c in COMPRESSORS {
            let codec = Codec::new(c, &tensors, 11);
            let mut msg = Vec::new();
            codec.encode(x, &zero, 3, 2, &mut msg);
            assert_eq!(msg.len(), codec.words(), "{c:?}");
            let mut q = vec![0.0f32; n];
            let mut seen = 0;
            codec.decode(&msg, 3, 2, |i, v| {
                q[i] += v;
                seen += 1;
            });
            for t in &tensors {
                let (u, q) = (&x[t.range()], &q[t.range()]);
                let d = t.len as f32;
                match c {
                    Compressor::TopK { density } => {
                        let k = k_of(density, t.len);
                        let kept: Vec<usize> = (0..t.len).filter(|&i| q[i] != 0.0).collect();
                        assert_eq!(kept.len(), k);
                        let floor = kept.iter().map(|&i| u[i].abs()).fold(f32::MAX, f32::min);
                        for i in 0..t.len {
                            if q[i] != 0.0 {
                                assert_eq!(q[i], u[i]);
                            } else {
                                assert!(u[i].abs() <= floor);
                            }
                        }
                    }
                    Compressor::RandomK { density } => {
                        let kept = (0..t.len).filter(|&i| q[i] != 0.0).count();
                        assert_eq!(kept, k_of(density, t.len));
                        assert!((0..t.len).all(|i| q[i] == 0.0 || q[i] == u[i]));
                    }
                    Compressor::Qsgd {
                        levels,
                        biased,
                        bucket,
                    } => {
                        let s = levels as f32;
                        let b = if bucket == 0 { t.len } else { bucket };
                        for i in 0..t.len {
                            let r = (i / b * b)..((i / b + 1) * b).min(t.len);
                            let norm = u[r.clone()].iter().map(|v| v * v).sum::<f32>().sqrt();
                            let nb = r.len() as f32;
                            let tau = if biased {
                                1.0 + (nb / (s * s)).min(nb.sqrt() / s)
                            } else {
                                1.0
                            };
                            // |q| tau s / norm is the level: floor or ceil of s |u| / norm, same sign.
                            let level = q[i].abs() * tau * s / norm;
                            let lf = s * u[i].abs() / norm;
                            assert!((level - level.round()).abs() < 1e-3, "{c:?}: level {level}");
                            assert!(level.round() == lf.floor() || level.round() == lf.ceil());
                            assert!(q[i] == 0.0 || q[i].signum() == u[i].signum());
                        }
                    }
                    Compressor::Sign => {
                        let scale = u.iter().map(|v| v.abs()).sum::<f32>() / d;
                        for i in 0..t.len {
                            assert!((q[i].abs() - scale).abs() < 1e-6 * scale);
                            assert_eq!(q[i] < 0.0, u[i] < 0.0);
                        }
                    }
                }
            }
            // Random draws depend on the step and the sender.
            let mut other = Vec::new();
            codec.encode(x, &zero, 4, 2, &mut other);
            if matches!(c, Compressor::TopK { .. } | Compressor::Sign) {
                assert_eq!(msg, other, "{c:?}: deterministic");
            }
            assert!(seen > 0);
        }
    }

    #[test]
    fn top_k_selects_what_the_reducers_kernel_selects() {
        use rand::{Rng, SeedableRng};
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        for n in [1usize, 7, 100, 5000] {
            // Few distinct magnitudes: many ties.
            let x: Vec<f32> = (0..n)
                .map(|_| rng.random_range(-4i32..=4) as f32 * 0.5)
                .collect();
            for k in [1, n / 3 + 1, n] {
                let (mut want_i, mut want_v) = (Vec::new(), Vec::new());
                kernels::top_k(&x, k, 0, &mut want_i, &mut want_v);
                let (mut v, mut i) = (vec![0.0; k], vec![0.0; k]);
                top_k(&x, &mut v, &mut i);
                assert_eq!(v, want_v, "n {n} k {k}");
                assert_eq!(compress::f32_to_indices(&i), want_i, "n {n} k {k}");
            }
        }
    }

    #[test]
    fn unbiased_qsgd_is_unbiased() {
        let tensors = TensorView::from_shapes(&[(1, 50, false)]);
        let x = &random_vectors(1, 50, 9)[0];
        let zero = vec![0.0; 50];
        let codec = Codec::new(
            Compressor::Qsgd {
                levels: 2,
                biased: false,
                bucket: 0,
            },
            &tensors,
            1,
        );
        let mut mean = vec![0.0f64; 50];
        let draws = 4000;
        let mut msg = Vec::new();
        for step in 0..draws {
            codec.encode(x, &zero, step, 0, &mut msg);
            codec.decode(&msg, step, 0, |i, q| mean[i] += q as f64 / draws as f64);
        }
        let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt() as f64;
        for (m, &u) in mean.iter().zip(x) {
            // Each draw's spread is at most norm / s: 5 standard errors.
            assert!((m - u as f64).abs() < 5.0 * norm / 2.0 / (draws as f64).sqrt());
        }
    }

    #[test]
    fn the_consensus_keeps_the_average_on_every_topology_with_every_compressor() {
        let tensors = shapes();
        let n: usize = tensors.iter().map(|t| t.len).sum();
        for (name, rounds) in topologies() {
            for c in COMPRESSORS {
                let codec = Codec::new(c, &tensors, 3);
                let mut sim = Simulation::new(rounds.clone(), codec, 0.7, n).unwrap();
                let mut xs = random_vectors(8, n, 1);
                let before = mean_of(&xs);
                for step in 0..25 {
                    sim.step(&mut xs, step);
                }
                let after = mean_of(&xs);
                let drift = before
                    .iter()
                    .zip(&after)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f64::max);
                assert!(drift < 1e-5, "{name} {c:?}: the average moved by {drift}");
            }
        }
    }

    fn distance(xs: &[Vec<f32>]) -> f64 {
        let m = mean_of(xs);
        xs.iter()
            .map(|x| {
                x.iter()
                    .zip(&m)
                    .map(|(&a, &b)| (a as f64 - b).powi(2))
                    .sum::<f64>()
                    .sqrt()
            })
            .sum::<f64>()
            / xs.len() as f64
    }

    #[test]
    fn consensus_distance_shrinks_after_a_perturbation_with_every_compressor() {
        let tensors = shapes();
        let n: usize = tensors.iter().map(|t| t.len).sum();
        for (name, rounds) in topologies()
            .into_iter()
            .filter(|(n, _)| *n == "ring" || *n == "exp")
        {
            for c in COMPRESSORS {
                let gamma = tune_gamma(&rounds, c, 4).unwrap();
                let codec = Codec::new(c, &tensors, 3);
                let mut sim = Simulation::new(rounds.clone(), codec, gamma as f32, n).unwrap();
                // Equal replicas (after some public-copy traffic), then one is perturbed.
                let mut xs = vec![random_vectors(1, n, 2).remove(0); 8];
                for step in 0..50 {
                    sim.step(&mut xs, step);
                }
                for (v, p) in xs[3].iter_mut().zip(&random_vectors(1, n, 7)[0]) {
                    *v += p;
                }
                let start = distance(&xs);
                for step in 50..650 {
                    sim.step(&mut xs, step);
                }
                let end = distance(&xs);
                assert!(
                    end < 0.2 * start,
                    "{name} {c:?} (gamma {gamma}): consensus distance {start} -> {end}"
                );
            }
        }
    }

    #[test]
    fn with_every_entry_sent_and_gamma_one_the_consensus_is_plain_gossip() {
        let tensors = shapes();
        let n: usize = tensors.iter().map(|t| t.len).sum();
        for (name, rounds) in topologies() {
            let codec = Codec::new(Compressor::TopK { density: 1.0 }, &tensors, 3);
            let mut sim = Simulation::new(rounds.clone(), codec, 1.0, n).unwrap();
            let mut xs = random_vectors(8, n, 1);
            for step in 0..6 {
                let round = &rounds[step % rounds.len()];
                let w = topology::mixing_matrix(round, 8).unwrap();
                let want: Vec<Vec<f64>> = (0..8)
                    .map(|i| {
                        (0..n)
                            .map(|e| (0..8).map(|j| w[i][j] * xs[j][e] as f64).sum())
                            .collect()
                    })
                    .collect();
                sim.step(&mut xs, step as u64);
                for (x, y) in xs.iter().zip(&want) {
                    for (a, b) in x.iter().zip(y) {
                        assert!(
                            (*a as f64 - b).abs() < 1e-5,
                            "{name} step {step}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn channels_per_topology_are_the_groups_a_rank_meets() {
        let count = |topo, world, per_node| {
            let rounds = topology::rounds(topo, world, per_node).unwrap();
            Channels::new(&rounds, 0, 1).unwrap().count()
        };
        assert_eq!(count(Topology::Complete, 8, 8), 1);
        assert_eq!(count(Topology::Ring, 8, 8), 2);
        assert_eq!(count(Topology::Ring, 2, 2), 1);
        assert_eq!(count(Topology::Exp, 8, 8), 3);
        assert_eq!(count(Topology::Exp, 512, 512), 9);
        assert_eq!(count(Topology::AlternatingExpRing, 16, 4), 3);
    }

    #[test]
    fn tuning_is_deterministic_and_picks_a_small_step_for_aggressive_compression() {
        let rounds = topology::rounds(Topology::Ring, 8, 8).unwrap();
        let a = tune_gamma(&rounds, Compressor::TopK { density: 0.01 }, 1).unwrap();
        let b = tune_gamma(&rounds, Compressor::TopK { density: 0.01 }, 1).unwrap();
        assert_eq!(a, b);
        let dense = tune_gamma(&rounds, Compressor::TopK { density: 1.0 }, 1).unwrap();
        assert!(a < dense, "top-1% {a} vs every entry {dense}");
        assert!(dense > 0.5, "every entry sent: gamma {dense}");
    }
}

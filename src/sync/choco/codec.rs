//! CHOCO's messages: each compressor's encoding of a model's tensors (top-k, random-k, QSGD, sign),
//! their bit packing, and the seeds the receivers share.

use std::sync::{Arc, Mutex};

use multiversion::multiversion;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::Compressor;
use crate::kernels;
use crate::kernels::{Ask, Segment};
use crate::sync::bits::{self, BitReader, BitWriter};
use crate::sync::compress::k_of;

pub(super) const RANDOMK_KEY: u64 = 0x0072_616e_646f_6d6b; // "randomk"
pub(super) const QSGD_KEY: u64 = 0x7173_6764; // "qsgd"

/// SplitMix64 over the parts: one seed from several numbers.
pub(super) fn mix(parts: &[u64]) -> u64 {
    parts.iter().fold(0x9e37_79b9_7f4a_7c15u64, |h, &p| {
        let mut z = (h ^ p).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}

/// Entries per QSGD norm in a tensor of `len` entries (`bucket` 0: the whole tensor).
pub(super) fn bucket_len(len: usize, bucket: usize) -> usize {
    if bucket == 0 {
        len.max(1)
    } else {
        bucket
    }
}

/// The ranges of a tensor of `len` entries that share one QSGD norm.
pub(super) fn buckets(len: usize, bucket: usize) -> Vec<std::ops::Range<usize>> {
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

/// A tensor's indices in a sparse message: top-k's, read in place (sent as f32 bits), or random-k's,
/// drawn from the sender's seed.
pub(super) enum Indices<'m> {
    Sent(&'m [u32]),
    Drawn(Arc<[u32]>),
}

impl std::ops::Deref for Indices<'_> {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        match self {
            Indices::Sent(i) => i,
            Indices::Drawn(i) => i,
        }
    }
}

/// A compressor over a model's tensors: every rank's message has the same size, set by the tensors.
#[derive(Debug, Clone)]
pub struct Codec {
    pub(super) compressor: Compressor,
    /// (offset, len) of each tensor in the flat parameters.
    pub(super) tensors: Vec<(usize, usize)>,
    /// Where each tensor's part of a message starts (one more entry: the message's length).
    pub(super) parts: Vec<usize>,
    /// Entries sent per tensor (top-k, random-k).
    pub(super) ks: Vec<usize>,
    pub(super) seed: u64,
    /// Random-k's index sets of the message encoded last: its sender reads them back when it absorbs
    /// its own message, instead of drawing them again.
    drawn: Drawn,
}

/// Random-k's index sets (one per tensor) that `sender` drew at `step`.
#[derive(Debug, Default)]
struct Drawn(Mutex<Option<Sets>>);

/// (step, sender, a set per tensor).
type Sets = (u64, usize, Vec<Arc<[u32]>>);

/// A copy of a codec draws its own sets.
impl Clone for Drawn {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl Codec {
    pub fn new(compressor: Compressor, tensors: &[Segment], seed: u64) -> Self {
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
            drawn: Drawn::default(),
        }
    }

    /// f32 words of one message.
    pub fn words(&self) -> usize {
        self.parts.last().copied().unwrap_or(0)
    }

    pub(super) fn rng(&self, key: u64, step: u64, rank: usize, tensor: usize) -> ChaCha8Rng {
        let mut rng = ChaCha8Rng::seed_from_u64(mix(&[self.seed, key, step, rank as u64]));
        rng.set_stream(tensor as u64);
        rng
    }

    /// Random-k's ascending indices of tensor `t` for `sender` at `step`: those of the message encoded
    /// last where it is that one, else drawn.
    pub(super) fn random_indices(&self, step: u64, sender: usize, t: usize) -> Arc<[u32]> {
        if let Some((s, r, sets)) = &*self.drawn.0.lock().unwrap_or_else(|e| e.into_inner()) {
            if (*s, *r) == (step, sender) {
                return sets[t].clone();
            }
        }
        self.draw_indices(step, sender, t)
    }

    /// `random_indices`, drawn.
    fn draw_indices(&self, step: u64, sender: usize, t: usize) -> Arc<[u32]> {
        let (_, len) = self.tensors[t];
        sample_ascending(&mut self.rng(RANDOMK_KEY, step, sender, t), len, self.ks[t]).into()
    }

    /// Random-k: draws and keeps the index sets of `rank`'s message at `step` (`random_indices` then
    /// reads them back).
    pub(super) fn keep_drawn(&self, step: u64, rank: usize) {
        if matches!(self.compressor, Compressor::RandomK { .. }) {
            let sets = (0..self.tensors.len())
                .map(|t| self.draw_indices(step, rank, t))
                .collect();
            *self.drawn.0.lock().unwrap_or_else(|e| e.into_inner()) = Some((step, rank, sets));
        }
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
    pub(super) fn sparse_part<'m>(
        &self,
        msg: &'m [f32],
        step: u64,
        sender: usize,
        t: usize,
    ) -> (Indices<'m>, &'m [f32]) {
        let (part, k) = (&msg[self.parts[t]..self.parts[t + 1]], self.ks[t]);
        match self.compressor {
            Compressor::TopK { .. } => {
                (Indices::Sent(bytemuck::cast_slice(&part[k..])), &part[..k])
            }
            _ => (Indices::Drawn(self.random_indices(step, sender, t)), part),
        }
    }

    /// The key of QSGD's ChaCha8 streams for `rank` at `step` (the stream is the tensor's index), as the
    /// `qsgd_encode` kernel takes it.
    pub(super) fn qsgd_key(&self, step: u64, rank: usize) -> [u32; 8] {
        let seed = self.rng(QSGD_KEY, step, rank, 0).get_seed();
        std::array::from_fn(|i| u32::from_le_bytes([0, 1, 2, 3].map(|j| seed[4 * i + j])))
    }

    /// The message of Q(x - hat) that `rank` sends at `step`.
    pub fn encode(&self, x: &[f32], hat: &[f32], step: u64, rank: usize, msg: &mut Vec<f32>) {
        self.keep_drawn(step, rank);
        // Every word is written below: a buffer of the right length from the last step is used as it
        // is, not zeroed first (a pass over the message as long as the packing's).
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
            let (x, hat) = (&x[off..off + len], &hat[off..off + len]);
            self.encode_tensor(t, x, hat, step, rank, out);
        });
    }

    /// Tensor `t`'s part of the message of Q(x - hat), x and hat that tensor's entries.
    fn encode_tensor(
        &self,
        t: usize,
        x: &[f32],
        hat: &[f32],
        step: u64,
        rank: usize,
        out: &mut [f32],
    ) {
        match self.compressor {
            Compressor::TopK { .. } => {
                let k = self.ks[t];
                let (mut idx, mut vals) = (Vec::with_capacity(k), Vec::with_capacity(k));
                kernels::top_k_of_difference(x, hat, k, 0, &mut idx, &mut vals);
                out[..k].copy_from_slice(&vals);
                for (o, &i) in out[k..].iter_mut().zip(&idx) {
                    *o = f32::from_bits(i);
                }
            }
            // Only the sampled entries of x - hat.
            Compressor::RandomK { .. } => {
                for (o, &i) in out.iter_mut().zip(&*self.random_indices(step, rank, t)) {
                    let i = i as usize;
                    *o = x[i] - hat[i];
                }
            }
            Compressor::Qsgd { levels, bucket, .. } => {
                let mut words = kernels::ChaCha8::new(self.qsgd_key(step, rank), t as u64);
                qsgd_encode(x, hat, (levels, bucket), &mut words, out);
            }
            Compressor::Sign => sign_encode(x, hat, out),
        }
    }

    /// Calls `f(index, q)` for the entries of the message `msg` that `sender` sent at `step` (every entry
    /// for the dense formats), indices into the flat parameters, ascending within each tensor.
    pub fn decode(&self, msg: &[f32], step: u64, sender: usize, mut f: impl FnMut(usize, f32)) {
        self.decode_spans(msg, step, sender, &[], |at, q| {
            q.iter().enumerate().for_each(|(i, &q)| f(at + i, q));
        });
    }

    /// `decode` a span at a time: `f(at, q)` with the values q of the entries at.., in order within each
    /// tensor. Dense formats (QSGD, sign) give spans of up to `SPAN` entries, which the caller updates as
    /// slices (a loop that vectorizes, where a call per entry does not); sparse ones, each entry alone.
    pub fn decode_spans(
        &self,
        msg: &[f32],
        step: u64,
        sender: usize,
        ahead: &[kernels::Lines],
        mut f: impl FnMut(usize, &[f32]),
    ) {
        for (t, &(off, _)) in self.tensors.iter().enumerate() {
            let part = &msg[self.parts[t]..self.parts[t + 1]];
            match self.compressor {
                Compressor::TopK { .. } => {
                    let (vals, idx) = part.split_at(self.ks[t]);
                    for (v, i) in vals.iter().zip(idx) {
                        f(off + i.to_bits() as usize, std::slice::from_ref(v));
                    }
                }
                Compressor::RandomK { .. } => {
                    for (v, &i) in part.iter().zip(&*self.random_indices(step, sender, t)) {
                        let i = i as usize;
                        f(off + i, std::slice::from_ref(v));
                    }
                }
                Compressor::Qsgd { .. } | Compressor::Sign => {}
            }
        }
        if !self.sparse() {
            self.decode_dense_spans(&[msg], ahead, |at, qs| f(at, qs[0]));
        }
    }

    /// The dense formats' spans (QSGD, sign) of several messages in step: `f(at, qs)` with each message's
    /// values of the same span, in the order of `msgs`, so that a caller updates each span from all of
    /// them while it is in the core's caches. Spans of whole sign words, no longer than the longest tensor
    /// needs; nothing for the sparse formats. `ahead`: the buffers (indexed as the parameters) that `f`
    /// updates at each span, whose lines the decoding asks for while it computes the span's values.
    pub fn decode_dense_spans(
        &self,
        msgs: &[&[f32]],
        ahead: &[kernels::Lines],
        mut f: impl FnMut(usize, &[&[f32]]),
    ) {
        if self.sparse() {
            return;
        }
        let longest = self.tensors.iter().map(|&(_, len)| len).max().unwrap_or(0);
        let span = longest.next_multiple_of(32).clamp(32, SPAN);
        let mut bufs = vec![0.0f32; msgs.len().max(1) * span];
        let mut codes = vec![0u32; span];
        for (t, &(off, len)) in self.tensors.iter().enumerate() {
            for s in (0..len).step_by(span) {
                let n = span.min(len - s);
                for (i, (m, buf)) in msgs.iter().zip(bufs.chunks_mut(span)).enumerate() {
                    let part = &m[self.parts[t]..self.parts[t + 1]];
                    // The lines are asked for once, while the first message's values compute.
                    let ask = Ask {
                        lines: if i == 0 { ahead } else { &[] },
                        at: off + s,
                    };
                    self.dense_span(part, len, s, &mut codes, (&mut buf[..n], ask));
                }
                let qs: Vec<&[f32]> = bufs
                    .chunks(span)
                    .take(msgs.len())
                    .map(|b| &b[..n])
                    .collect();
                f(off + s, &qs);
            }
        }
    }

    /// Entries s..s + out.len() of a tensor of `len` entries, from its part of a dense message: QSGD's
    /// codes read from bit s x bits on (`codes` their scratch), each bucket's piece turned into values
    /// in a loop that vectorizes; sign's from word s / 32 on (s a whole number of words).
    fn dense_span(
        &self,
        part: &[f32],
        len: usize,
        s: usize,
        codes: &mut [u32],
        (out, ask): (&mut [f32], Ask),
    ) {
        match self.compressor {
            Compressor::Qsgd {
                levels,
                biased,
                bucket,
            } => {
                let (b, bits) = (bucket_len(len, bucket), qsgd_bits(levels));
                let (norms, packed) = part.split_at(len.div_ceil(b));
                let mut reader = BitReader::at(packed, s as u64 * bits as u64);
                let (mut at, end) = (s, s + out.len());
                while at < end {
                    let k = at / b;
                    let (upto, size) = (((k + 1) * b).min(end), b.min(len - k * b));
                    let unit = norms[k] / levels as f32 / qsgd_tau(levels, size, biased);
                    let c = &mut codes[..upto - at];
                    reader.get_all(bits, c);
                    let ask = Ask {
                        at: ask.at + at - s,
                        ..ask
                    };
                    qsgd_values(c, unit, bits, &mut out[at - s..upto - s], ask);
                    at = upto;
                }
            }
            Compressor::Sign => sign_values(&part[1 + s / 32..], part[0], out, ask),
            Compressor::TopK { .. } | Compressor::RandomK { .. } => {
                unreachable!("a sparse message has no dense spans")
            }
        }
    }
}

/// A decoded span into a channel: hat += q where the public copy is given (the message is the rank's
/// own), and memory += w q, in this core's vectors. The same operations in the same order as the
/// plain loop (no fused multiply-add), so the same bits.
#[multiversion(targets = "simd")]
pub fn absorb_span(hat: Option<&mut [f32]>, memory: &mut [f32], q: &[f32], w: f32) {
    match hat {
        Some(hat) => {
            for ((h, m), &q) in hat.iter_mut().zip(memory.iter_mut()).zip(q) {
                *h += q;
                *m += w * q;
            }
        }
        None => memory.iter_mut().zip(q).for_each(|(m, &q)| *m += w * q),
    }
}

/// k of the indices 0..len, every set of k equally likely (Floyd's algorithm: for j from len - k
/// on, a uniform t in 0..=j joins the set, or j where t is in it already), ascending: the set is a
/// bitmap of len bits, read back in order (`bits::positions`). The uniform draws take a 32-bit word
/// each, drawn in blocks (`below`, drawing again for the few it turns down).
pub(super) fn sample_ascending(rng: &mut ChaCha8Rng, len: usize, k: usize) -> Vec<u32> {
    assert!(k <= len && len <= 1 << 32, "{k} of {len} indices");
    const BLOCK: usize = 4096;
    let mut set = vec![0u64; len.div_ceil(64)];
    let mut words = vec![0u32; k.min(BLOCK)];
    for first in (len - k..len).step_by(BLOCK) {
        let words = &mut words[..BLOCK.min(len - first)];
        rng.fill(words);
        for (j, &word) in (first..).zip(words.iter()) {
            let range = j as u64 + 1;
            let t = below(word, range).unwrap_or_else(|| loop {
                if let Some(t) = below(rng.next_u32(), range) {
                    break t;
                }
            }) as usize;
            let pick = if set[t / 64] >> (t % 64) & 1 == 1 {
                j
            } else {
                t
            };
            set[pick / 64] |= 1 << (pick % 64);
        }
    }
    bits::positions(&set)
}

/// A uniform integer below `range` (1 to 2^32) from a uniform 32-bit word (Lemire's multiply and
/// shift): the high half of word * range, or None for the 2^32 mod range words that would make some
/// values likelier than others (then the caller draws again).
#[inline]
fn below(word: u32, range: u64) -> Option<u64> {
    below_of(word as u64, 32, range)
}

/// `below` for words of `bits` bits: every value in 0..range comes from floor(2^bits / range) words.
#[inline]
pub(super) fn below_of(word: u64, bits: u32, range: u64) -> Option<u64> {
    let m = word * range;
    let low = m & ((1 << bits) - 1);
    // 2^bits mod range, only worked out in the rare case it can matter.
    if low < range && low < ((1 << bits) - range) % range {
        return None;
    }
    Some(m >> bits)
}

/// Entries of a dense format's span in `Codec::decode_spans` (a whole number of sign words): a span's
/// codes and each message's values (4 KB each) stay in a 32 KB L1 beside the lines the caller updates.
/// Spans of 4096 made the decoding's side of `bench_reducers --only qsgd sign` an eighth slower on a
/// Zen 3 core; spans of 512 measured as 1024.
pub const SPAN: usize = 1024;

/// QSGD's values from their codes: unit times the level, negated where the sign bit is set (a flip of
/// the sign bit, which is what negation is).
#[multiversion(targets = "simd")]
fn qsgd_values(codes: &[u32], unit: f32, bits: u32, out: &mut [f32], ask: Ask) {
    let mask = (1u32 << (bits - 1)) - 1;
    let value = |o: &mut f32, c: u32| {
        let q = unit * (c & mask) as f32;
        *o = f32::from_bits(q.to_bits() ^ (c >> (bits - 1)) << 31);
    };
    // Whole groups of 16 (a fixed count the loop unrolls to whole vectors), then the rest.
    let (mut outs, mut groups) = (out.chunks_exact_mut(16), codes.chunks_exact(16));
    for (b, (out, codes)) in (&mut outs).zip(&mut groups).enumerate() {
        ask.lines.iter().for_each(|l| l.ask(ask.at + 16 * b));
        out.iter_mut().zip(codes).for_each(|(o, &c)| value(o, c));
    }
    let rest = outs.into_remainder().iter_mut();
    rest.zip(groups.remainder()).for_each(|(o, &c)| value(o, c));
}

/// Entries of x - hat formed at a time by the QSGD encoding: whole rows of the kernel's block.
const QSGD_CHUNK: usize = 16 * kernels::BLOCK;

// A word's halves are read as u16s in memory order, low half first.
const _: () = assert!(cfg!(target_endian = "little"));

/// QSGD's part of a message for u = x - hat: each bucket's l2 norm (the f64 sum in the order of the
/// `qsgd_encode` kernel's block), then every entry's sign and stochastically rounded level, packed. The
/// rounding draws 16 bits an entry: a bucket takes the next `len.div_ceil(2)` words of the tensor's
/// ChaCha8 stream (`stream`, at word 0), and its entry j reads word j / 2's low half where j is even,
/// its high half where j is odd, as the kernel does. u is formed a chunk at a time (twice for a bucket
/// longer than a chunk: once for its norm, once for its codes).
fn qsgd_encode(
    x: &[f32],
    hat: &[f32],
    (levels, bucket): (u32, usize),
    stream: &mut kernels::ChaCha8,
    out: &mut [f32],
) {
    let ranges = buckets(x.len(), bucket);
    let (norms, codes) = out.split_at_mut(ranges.len());
    let bits = qsgd_bits(levels);
    let mut w = BitWriter::new(codes);
    let n = x.len().min(QSGD_CHUNK);
    let (mut u, mut words, mut codes) = (vec![0.0f32; n], vec![0u32; n.div_ceil(2)], vec![0u32; n]);
    let tensor = [kernels::Lines::of(x), kernels::Lines::of(hat)];
    for (norm_out, range) in norms.iter_mut().zip(ranges) {
        let (x, hat) = (&x[range.clone()], &hat[range.clone()]);
        let mut lanes = [0.0f64; kernels::BLOCK];
        for (x, hat) in x.chunks(QSGD_CHUNK).zip(hat.chunks(QSGD_CHUNK)) {
            sub_squares(&mut lanes, x, hat, &mut u[..x.len()]);
        }
        let norm = lanes_sum(&mut lanes).sqrt() as f32;
        *norm_out = norm;
        let whole = x.len() <= QSGD_CHUNK;
        for (c, (x, hat)) in x.chunks(QSGD_CHUNK).zip(hat.chunks(QSGD_CHUNK)).enumerate() {
            let n = x.len();
            if !whole {
                sub(x, hat, &mut u[..n]);
            }
            // Chunks other than a bucket's last are of even length: the halves stay paired.
            let words = &mut words[..n.div_ceil(2)];
            stream.fill(words);
            let halves: &[u16] = bytemuck::cast_slice(words);
            // What is read next: the next bucket, or the next chunk of a bucket of several.
            let next = Ask {
                lines: &tensor,
                at: range.start + c * QSGD_CHUNK + n,
            };
            let codes = &mut codes[..n];
            qsgd_codes(&u[..n], &halves[..n], norm, (levels, bits), codes, next);
            w.put_all(codes, bits);
        }
    }
}

/// `kernels::block_sum` of a bucket's lanes, in this core's vectors: each bucket costs the tree's 255
/// additions, which in the encoder's baseline (SSE2) code took about 7% of a QSGD pass at buckets of
/// 512, and about 3% in AVX-512 (`perf`, examples/bench_reducers). Each level's additions are
/// independent: the same sums in the same order.
#[multiversion(targets = "simd")]
fn lanes_sum(lanes: &mut [f64; kernels::BLOCK]) -> f64 {
    kernels::block_sum(lanes)
}

/// u = x - hat.
#[multiversion(targets = "simd")]
fn sub(x: &[f32], hat: &[f32], u: &mut [f32]) {
    for ((u, &a), &b) in u.iter_mut().zip(x).zip(hat) {
        *u = a - b;
    }
}

/// u = x - hat, and the lanes' part of the f64 sum of squares of u (`kernels::block_strided_add`'s
/// order) in the same pass, in this core's vectors.
#[multiversion(targets = "simd")]
fn sub_squares(lanes: &mut [f64; kernels::BLOCK], x: &[f32], hat: &[f32], u: &mut [f32]) {
    let rows = u.chunks_mut(kernels::BLOCK).zip(x.chunks(kernels::BLOCK));
    for ((u, x), hat) in rows.zip(hat.chunks(kernels::BLOCK)) {
        for (((u, &a), &b), s) in u.iter_mut().zip(x).zip(hat).zip(lanes.iter_mut()) {
            *u = a - b;
            *s += (*u as f64) * (*u as f64);
        }
    }
}

/// 2^23, the f32 whose unit in the last place is 1.
const TWO_23: f32 = 8_388_608.0;

/// Each entry's QSGD code: its level, rounded up where the uniform from its 16 bits (a multiple of
/// 2^-16; rounding up is then biased by less than 2^-16 of a level) is below the level's fraction, and
/// its sign bit above.
#[multiversion(targets = "simd")]
fn qsgd_codes(
    u: &[f32],
    halves: &[u16],
    norm: f32,
    (levels, bits): (u32, u32),
    out: &mut [u32],
    next: Ask,
) {
    assert!(
        levels < 1 << 23,
        "QSGD levels {levels} (the config allows at most 65535)"
    );
    let s = levels as f32;
    let usable = norm > 0.0 && norm.is_finite();
    // One division per bucket: lf = |v| (s / norm).
    let per_unit = s / norm;
    // Whole groups of 16 (a fixed count the loop unrolls to whole vectors), then the rest.
    let (mut outs, mut us, mut hs) = (
        out.chunks_exact_mut(16),
        u.chunks_exact(16),
        halves.chunks_exact(16),
    );
    for (b, ((out, u), halves)) in (&mut outs).zip(&mut us).zip(&mut hs).enumerate() {
        // A line of each of x and hat that the pass reads next, per 16 entries coded: they arrive
        // while the codes compute, where asking for them all at once would stall the core until
        // its misses drained.
        next.lines.iter().for_each(|l| l.ask(next.at + 16 * b));
        qsgd_block(out, u, halves, (s, usable, per_unit), bits);
    }
    let (out, u, halves) = (outs.into_remainder(), us.remainder(), hs.remainder());
    qsgd_block(out, u, halves, (s, usable, per_unit), bits);
}

/// `qsgd_codes` of up to 16 entries (one vector), with the bucket's `(levels, usable, levels / norm)`.
#[inline(always)]
fn qsgd_block(
    out: &mut [u32],
    u: &[f32],
    halves: &[u16],
    (s, usable, per_unit): (f32, bool, f32),
    bits: u32,
) {
    for ((o, &v), &half) in out.iter_mut().zip(u).zip(halves) {
        let lf = if usable { v.abs() * per_unit } else { 0.0 };
        // lf >= 0 (infinite when |v| s / norm overflows) and s < 2^23, so m = min(lf, s) has an exact
        // floor (one instruction where the core has SSE4.1, as every clone but the baseline's does),
        // and a whole level in [0, 2^23) plus 2^23 has the level in its low bits. Float operations
        // only: the loop vectorizes, where conversions to integers (saturating, in Rust) do not.
        // The minima are compares (one vector instruction each, where `f32::min` also tests for NaN;
        // lf is never NaN, since a NaN or infinite entry leaves the norm unusable).
        let m = if lf < s { lf } else { s };
        let lo = m.floor();
        let r = half as f32 * (1.0 / 65_536.0);
        let up = lo + if r < lf - lo { 1.0 } else { 0.0 };
        let level = if up < s { up } else { s };
        let level = (level + TWO_23).to_bits() - TWO_23.to_bits();
        *o = level | u32::from(v < 0.0) << (bits - 1);
    }
}

/// Entries of x - hat formed at a time by `sign_encode`: whole rows of the kernel's block (for the sum's
/// order) and whole words of signs.
const SIGN_CHUNK: usize = 16 * kernels::BLOCK;

/// Sign's part of a message for u = x - hat: ||u||_1 / len (the f64 sum in the order of the
/// `sign_encode` kernel's block), then u < 0 as bits, 32 to a word. u is formed a chunk at a time, in a
/// buffer that stays in the core's cache, and never as a whole.
#[multiversion(targets = "simd")]
fn sign_encode(x: &[f32], hat: &[f32], out: &mut [f32]) {
    let mut lanes = [0.0f64; kernels::BLOCK];
    let mut buf = vec![0.0f32; x.len().min(SIGN_CHUNK)];
    let words = out[1..].chunks_mut(SIGN_CHUNK / 32);
    for ((x, hat), words) in x.chunks(SIGN_CHUNK).zip(hat.chunks(SIGN_CHUNK)).zip(words) {
        let u = &mut buf[..x.len()];
        sub(x, hat, u);
        kernels::block_strided_add(&mut lanes, u, |v| v.abs() as f64);
        for (word, vals) in words.iter_mut().zip(u.chunks(32)) {
            let bits = vals
                .iter()
                .enumerate()
                .fold(0u32, |b, (i, &v)| b | u32::from(v < 0.0) << i);
            *word = f32::from_bits(bits);
        }
    }
    out[0] = (kernels::block_sum(&mut lanes) / x.len().max(1) as f64) as f32;
}

/// The values of sign's entries from their words (bit set: -scale, else scale), into `out`.
#[multiversion(targets = "simd")]
fn sign_values(words: &[f32], scale: f32, out: &mut [f32], ask: Ask) {
    for (b, (o, w)) in out.chunks_mut(32).zip(words).enumerate() {
        for l in ask.lines {
            l.ask(ask.at + 32 * b);
            l.ask(ask.at + 32 * b + 16);
        }
        let bits = w.to_bits();
        for (i, o) in o.iter_mut().enumerate() {
            *o = if bits >> i & 1 == 1 { -scale } else { scale };
        }
    }
}

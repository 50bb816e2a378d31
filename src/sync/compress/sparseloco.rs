//! SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, arXiv 2508.15706): DiLoCo's pseudo-gradients
//! through chunk-wise top-k, with the sent values quantized to a few bits and an error feedback that
//! decays. Per sync, on each rank with pseudo-gradient delta:
//!
//! ```text
//! e    <- beta e + delta
//! sent  = Q(TopK(e))     in each chunk, the k = max(floor(density * chunk), 1) entries of largest |e|
//! e    <- e - sent       what was sent, as quantized, leaves the residual
//! mean  = 1/N sum_r sent_r   every rank's message all-gathered, summed in rank order, times 1 / N
//! ```
//!
//! DiLoCo's outer step then takes `mean`; the paper's outer SGD has no momentum, the decaying residual
//! stands in for it. A chunk is `chunk` consecutive entries of one tensor (the reference cuts matrices
//! into square blocks; either partition spreads the selection over the tensor).
//!
//! Q is the reference's statistical quantizer, per tensor over the values it sends: shift = their mean,
//! scale = 6 sigma / 2^bits, code = clamp(round((v - shift) / scale + 2^bits / 2), 0, 2^bits - 1), and a
//! code stands for the mean of the centered values that took it (a table of 2^bits floats per tensor
//! travels with the codes) plus the shift. With bits = 32 the values travel as f32, unquantized.
//!
//! On the wire, per rank, in f32 words: each tensor's shift and table (bits < 32), then one bit stream of
//! every chunk's entries, each its index inside the chunk (ceil(log2(chunk)) bits) and its code.

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::{k_of, per_tensor, Reducer, Report, Segment, State, StateBuf};
use crate::comm::{Communicator, Gathered};
use crate::config::backend::SparseLocoConfig;
use crate::kernels;
use crate::sync::bits::{BitReader, BitWriter};
use crate::sync::trace::{Collective, Op, Overlap};

/// The reference's quantization range: 6 standard deviations.
const RANGE_SIGMAS: f64 = 6.0;

pub struct SparseLoco {
    tensors: Vec<Segment>,
    cfg: SparseLocoConfig,
    residual: StateBuf,
    /// The last step's message and all-gather buffers, filled again (fresh ones would be mapped anew).
    send: Vec<f32>,
    gathered: Vec<f32>,
}

/// `len` consecutive entries from `start` of the flat buffer, of which `k` are sent.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Chunk {
    start: usize,
    len: usize,
    k: usize,
}

/// The encoding's input d (the pseudo-gradient): kept as it is, or zeroed chunk by chunk as it is read,
/// for a decoding that adds into zeros.
enum Input<'a> {
    Keep(&'a [f32]),
    Zero(&'a mut [f32]),
}

/// One tensor's part of a message: the flat indices sent (chunk by chunk, in index order), their codes,
/// the values the codes stand for, and the quantizer's shift and table.
struct Picked {
    idx: Vec<u32>,
    codes: Vec<u32>,
    values: Vec<f32>,
    shift: f32,
    table: Vec<f32>,
}

/// Picked entries ahead of the one being subtracted whose places in the error buffer `pick` asks the
/// core to fetch: the entries are scattered over the tensor, a cache miss each.
const AHEAD: usize = 16;

/// Bits that hold every index below `len`.
fn index_bits(len: usize) -> u32 {
    usize::BITS - len.saturating_sub(1).leading_zeros()
}

/// The reference's statistical quantizer of `vals` to `bits` (< 32): (shift, table, codes).
fn quantize(vals: &[f32], bits: u32) -> (f32, Vec<f32>, Vec<u32>) {
    let bins = 1usize << bits;
    let m = vals.len().max(1) as f64;
    let shift = (vals.iter().map(|&v| v as f64).sum::<f64>() / m) as f32;
    let squares: f64 = vals.iter().map(|&v| ((v - shift) as f64).powi(2)).sum();
    let sigma = if vals.len() > 1 {
        (squares / (m - 1.0)).sqrt()
    } else {
        0.0
    };
    let scale = match (RANGE_SIGMAS * sigma / bins as f64) as f32 {
        s if s.is_finite() && s > 0.0 => s,
        _ => 1.0,
    };
    let (offset, top) = ((bins / 2) as f32, (bins - 1) as f32);
    let codes: Vec<u32> = vals
        .iter()
        .map(|&v| ((v - shift) / scale + offset).round().clamp(0.0, top) as u32)
        .collect();
    let (mut sums, mut counts) = (vec![0.0f64; bins], vec![0u64; bins]);
    for (&v, &c) in vals.iter().zip(&codes) {
        sums[c as usize] += (v - shift) as f64;
        counts[c as usize] += 1;
    }
    let table = sums
        .iter()
        .zip(&counts)
        .map(|(&s, &c)| if c > 0 { (s / c as f64) as f32 } else { 0.0 })
        .collect();
    (shift, table, codes)
}

impl SparseLoco {
    pub fn new(tensors: Vec<Segment>, cfg: &SparseLocoConfig) -> Self {
        Self {
            tensors,
            cfg: cfg.clone(),
            residual: StateBuf::default(),
            send: Vec::new(),
            gathered: Vec::new(),
        }
    }

    fn numel(&self) -> usize {
        self.tensors.iter().map(|t| t.len).sum()
    }

    fn chunks(&self, t: &Segment) -> Vec<Chunk> {
        let c = self.cfg.chunk.max(1);
        (0..t.len.div_ceil(c))
            .map(|j| {
                let len = c.min(t.len - j * c);
                Chunk {
                    start: t.offset + j * c,
                    len,
                    k: k_of(self.cfg.density, len),
                }
            })
            .collect()
    }

    /// f32 words of each tensor's shift and table.
    fn table_words(&self) -> usize {
        match self.cfg.bits {
            32 => 0,
            b => 1 + (1 << b),
        }
    }

    /// Bits of one entry of tensor `t` in the stream: its index in the chunk, then its code.
    fn entry_bits(&self, t: &Segment) -> u64 {
        (index_bits(self.cfg.chunk.min(t.len)) + self.cfg.bits) as u64
    }

    /// f32 words of one rank's message (the same on every rank).
    fn words(&self) -> usize {
        let stream: u64 = self
            .tensors
            .iter()
            .map(|t| {
                let sent: usize = self.chunks(t).iter().map(|c| c.k).sum();
                sent as u64 * self.entry_bits(t)
            })
            .sum();
        self.tensors.len() * self.table_words() + stream.div_ceil(32) as usize
    }

    /// Tensor `t`'s entries of e = beta e + d (`e` and `d` the tensor's own entries), then its top
    /// entries, chunk by chunk, and their codes; what they stand for leaves `e`. Also the sum of squares
    /// of the accumulated `e` and what the sending took from it: the f64 sum over the picked entries of
    /// old² - new².
    fn pick(&self, t: &Segment, e: &mut [f32], d: Input<'_>, beta: f32) -> (Picked, f64, f64) {
        let (picked, acc) = self.select(t, e, d, beta);
        let mut removed = 0.0f64;
        for (j, (&i, &v)) in picked.idx.iter().zip(&picked.values).enumerate() {
            if let Some(&ahead) = picked.idx.get(j + AHEAD) {
                kernels::prefetch(e, ahead as usize - t.offset);
            }
            let e = &mut e[i as usize - t.offset];
            let old = *e as f64;
            *e -= v;
            removed += old * old - (*e as f64) * (*e as f64);
        }
        (picked, acc, removed)
    }

    /// `pick`'s accumulation, selection and quantization: each chunk of e = beta e + d accumulated (and
    /// its sum of squares taken) right before its selection reads it, while it is in the core's cache;
    /// d's chunk zeroed then, while it is there too, where the input asks for it.
    fn select(&self, t: &Segment, e: &mut [f32], mut d: Input<'_>, beta: f32) -> (Picked, f64) {
        let (mut idx, mut vals, mut acc) = (Vec::new(), Vec::new(), 0.0f64);
        for c in self.chunks(t) {
            let span = c.start - t.offset..c.start - t.offset + c.len;
            let e_span = &mut e[span.clone()];
            acc += match &mut d {
                Input::Keep(d) => kernels::decay_add_tile(&d[span], e_span, beta),
                Input::Zero(d) => {
                    let d = &mut d[span];
                    let sum = kernels::decay_add_tile(d, e_span, beta);
                    d.fill(0.0);
                    sum
                }
            };
            kernels::top_k(e_span, c.k, c.start as u32, &mut idx, &mut vals);
        }
        if self.cfg.bits == 32 {
            let codes = vals.iter().map(|v| v.to_bits()).collect();
            let picked = Picked {
                idx,
                codes,
                values: vals,
                shift: 0.0,
                table: Vec::new(),
            };
            return (picked, acc);
        }
        let (shift, table, codes) = quantize(&vals, self.cfg.bits);
        let values = codes.iter().map(|&c| table[c as usize] + shift).collect();
        let picked = Picked {
            idx,
            codes,
            values,
            shift,
            table,
        };
        (picked, acc)
    }

    /// This rank's message from e = beta e + d, which keeps what it did not send; returns the sum of
    /// squares of the accumulated `e` and what the sending took from it (`pick`'s, each added in tensor
    /// order).
    fn encode(&self, e: &mut [f32], d: Input<'_>, beta: f32, out: &mut [f32]) -> (f64, f64) {
        let ds: Vec<Input<'_>> = match d {
            Input::Keep(d) => self
                .tensors
                .iter()
                .map(|t| Input::Keep(&d[t.range()]))
                .collect(),
            Input::Zero(d) => per_tensor(d, &self.tensors)
                .into_iter()
                .map(Input::Zero)
                .collect(),
        };
        let tensors = self.tensors.par_iter().zip(per_tensor(e, &self.tensors));
        let picks: Vec<(Picked, f64, f64)> = tensors
            .zip(ds)
            .map(|((t, e), d)| self.pick(t, e, d, beta))
            .collect();
        let (acc, removed) = picks
            .iter()
            .fold((0.0, 0.0), |(a, r), p| (a + p.1, r + p.2));
        let picked: Vec<Picked> = picks.into_iter().map(|p| p.0).collect();
        let (head, stream) = out.split_at_mut(self.tensors.len() * self.table_words());
        let mut w = BitWriter::new(stream);
        for (i, (t, p)) in self.tensors.iter().zip(&picked).enumerate() {
            if !p.table.is_empty() {
                let h = &mut head[i * self.table_words()..(i + 1) * self.table_words()];
                h[0] = p.shift;
                h[1..].copy_from_slice(&p.table);
            }
            let bits = index_bits(self.cfg.chunk.min(t.len));
            let mut at = 0;
            for c in self.chunks(t) {
                for j in at..at + c.k {
                    w.put(p.idx[j] - c.start as u32, bits);
                    w.put(p.codes[j], self.cfg.bits);
                }
                at += c.k;
            }
        }
        (acc, removed)
    }

    /// Every tensor's chunks in order, each with its tensor and the first bit of its entries in a
    /// message's bit stream.
    fn stream_chunks(&self) -> Vec<(usize, Chunk, u64)> {
        let mut bit = 0u64;
        let mut out = Vec::new();
        for (i, t) in self.tensors.iter().enumerate() {
            let entry = self.entry_bits(t);
            for c in self.chunks(t) {
                out.push((i, c, bit));
                bit += c.k as u64 * entry;
            }
        }
        out
    }

    /// The mean of every rank's message into `grads`, which holds zeros in every chunk (`encode` left
    /// them, or the buffer is fresh). Where the ranks share memory,
    /// each decodes the chunks that start in its 1/N of the buffer and reads the others' parts in place
    /// (N messages decoded in all, not N^2); elsewhere every rank decodes every chunk.
    fn decode_into(
        &self,
        comm: &mut dyn Communicator,
        all: &Gathered,
        grads: &mut [f32],
    ) -> Result<()> {
        let (chunks, n, len) = (self.stream_chunks(), comm.world_size(), grads.len());
        if n < 2 || !comm.shares_memory() {
            return self.decode_mean(all, &chunks, grads, 0);
        }
        let me = comm.rank();
        let mine: Vec<_> = chunks
            .into_iter()
            .filter(|(_, c, _)| c.start * n / len == me)
            .collect();
        let base = mine.first().map_or(0, |(_, c, _)| c.start);
        let end = mine.last().map_or(base, |(_, c, _)| c.start + c.len);
        let mut part = vec![0.0f32; end - base];
        self.decode_mean(all, &mine, &mut part, base)?;
        let mut at = 0;
        for p in comm.share_parts(&part)?.iter() {
            let Some(to) = grads.get_mut(at..at + p.len()) else {
                bail!("internal error: SparseLoCo's decoded parts overrun its {len} entries");
            };
            to.copy_from_slice(p);
            at += p.len();
        }
        if at != len {
            bail!("internal error: SparseLoCo's decoded parts cover {at} of its {len} entries");
        }
        Ok(())
    }

    /// The mean of every rank's message (`all`) over `chunks` (`stream_chunks`' entries) into `out`, the
    /// flat entries from `base` on, which hold zeros there: chunk by chunk, each rank's values added in
    /// rank order, then times 1 / N at the entries some rank sent (a bit each marks them). The others
    /// keep the +0 that the scaling would leave, so the chunk is never read or written whole.
    fn decode_mean(
        &self,
        all: &Gathered,
        chunks: &[(usize, Chunk, u64)],
        out: &mut [f32],
        base: usize,
    ) -> Result<()> {
        let (n, tw) = (all.members(), self.table_words());
        let heads = self.tensors.len() * tw;
        let mut marks = vec![0u64; self.cfg.chunk.max(1).div_ceil(64)];
        for &(i, c, bit) in chunks {
            let bits = index_bits(self.cfg.chunk.min(self.tensors[i].len));
            let out = &mut out[c.start - base..][..c.len];
            for m in all.iter() {
                let mut r = BitReader::at(&m[heads..], bit);
                let table = (&m[i * tw..(i + 1) * tw], bits);
                self.decode_chunk(&c, table, &mut r, out, &mut marks)?;
            }
            match n > 1 {
                true => super::scale_marked(out, &mut marks, 1.0 / n as f32),
                false => marks.fill(0),
            }
        }
        Ok(())
    }

    /// Adds chunk `c`'s values of one rank's message (its tensor's shift and table `h`, indices of
    /// `bits`, its entries next in `r`) to `out`, the chunk's entries.
    fn decode_chunk(
        &self,
        c: &Chunk,
        (h, bits): (&[f32], u32),
        r: &mut BitReader,
        out: &mut [f32],
        marks: &mut [u64],
    ) -> Result<()> {
        for _ in 0..c.k {
            let (at, code) = (r.get(bits) as usize, r.get(self.cfg.bits));
            if at >= c.len || (!h.is_empty() && code as usize >= h.len() - 1) {
                bail!(
                    "internal error: a SparseLoCo message names entry {at} of a chunk of {}",
                    c.len
                );
            }
            marks[at / 64] |= 1 << (at % 64);
            out[at] += match h {
                [] => f32::from_bits(code),
                [shift, table @ ..] => table[code as usize] + shift,
            };
        }
        Ok(())
    }
}

impl Reducer for SparseLoco {
    fn reduce(
        &mut self,
        comm: &mut dyn Communicator,
        grads: &mut [f32],
        _step: u64,
    ) -> Result<Report> {
        let mut e = self.residual.take_host(grads.len());
        let beta = self.cfg.error_decay as f32;
        let words = self.words();
        // The message's bits are set into zeros.
        let mut send = std::mem::take(&mut self.send);
        send.clear();
        send.resize(words, 0.0);
        // e = beta e + d as it is encoded; the decoding then overwrites grads with the mean of what the
        // ranks sent. What stays in e: its sum of squares less the part the sent entries took (within
        // rounding of summing e again, a pass over the whole buffer this saves).
        // Where every rank decodes every chunk, the decoding adds into the zeros that the encoding
        // leaves in each chunk of d as it reads it; where the ranks share memory, each decodes its part
        // into a fresh buffer, and grads is overwritten whole.
        let d = match comm.world_size() < 2 || !comm.shares_memory() {
            true => Input::Zero(&mut *grads),
            false => Input::Keep(&*grads),
        };
        let (acc_squares, removed) = self.encode(&mut e, d, beta, &mut send);
        let lost = (acc_squares - removed).max(0.0).sqrt();
        let acc_norm = acc_squares.sqrt();
        let all = comm.all_gather_shared(&send, std::mem::take(&mut self.gathered))?;
        self.send = send;
        // The rank-ordered sum of the decoded messages, then times 1 / N (all_reduce_mean's order).
        self.decode_into(comm, &all, grads)?;
        self.gathered = all.into_spare();
        self.residual.keep_host(e);
        Ok(Report {
            error: Some(if acc_norm > 0.0 { lost / acc_norm } else { 0.0 }),
            ..Report::default()
        })
    }

    /// Every rank's message, all-gathered.
    fn step_comm(&self, world: usize, _step: u64) -> Vec<Collective> {
        let pieces = vec![self.words() as u64];
        vec![Collective::world(
            Op::AllGather { pieces },
            world,
            Overlap::None,
        )]
    }

    fn state(&self) -> Result<State> {
        self.residual.residual_state()
    }

    fn load_state(&mut self, state: State) -> Result<()> {
        self.residual.load_residual(state, self.numel())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Solo;
    use crate::optim::global_norm;

    fn cfg(density: f64, chunk: usize, bits: u32, error_decay: f64) -> SparseLocoConfig {
        SparseLocoConfig {
            density,
            chunk,
            bits,
            error_decay,
        }
    }

    fn grad(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * 0.618_034 + seed as f32 * 0.31).fract() - 0.5) * 1e-2)
            .collect()
    }

    #[test]
    fn index_bits_hold_every_index_of_a_chunk() {
        for (len, bits) in [
            (1, 0),
            (2, 1),
            (3, 2),
            (4, 2),
            (5, 3),
            (4096, 12),
            (4097, 13),
        ] {
            assert_eq!(index_bits(len), bits, "{len}");
        }
    }

    /// The quantizer's codes stand for the mean of the values that took them: the decoded values keep
    /// the sum of the input, and every code is in range.
    #[test]
    fn quantized_values_keep_the_sum_and_the_codes_fit() {
        let vals = grad(1000, 3);
        for bits in [2, 4, 8] {
            let (shift, table, codes) = quantize(&vals, bits);
            assert_eq!(table.len(), 1 << bits);
            assert!(codes.iter().all(|&c| c < 1 << bits));
            let sum: f64 = vals.iter().map(|&v| v as f64).sum();
            let decoded: f64 = codes
                .iter()
                .map(|&c| (table[c as usize] + shift) as f64)
                .sum();
            assert!(
                (sum - decoded).abs() < 1e-5,
                "{bits} bits: {sum} vs {decoded}"
            );
        }
    }

    /// One rank: what it applies plus what it keeps is what it accumulated, and the message has exactly
    /// the words the step's collective names.
    #[test]
    fn sent_plus_kept_is_the_accumulated_pseudo_gradient() {
        let tensors = Segment::from_shapes(&[(37, 1, false), (40, 30, true), (9, 70, true)]);
        let numel: usize = tensors.iter().map(|t| t.len).sum();
        for (bits, decay) in [(2, 0.95), (4, 0.5), (8, 1.0), (32, 0.95)] {
            let mut r = SparseLoco::new(tensors.clone(), &cfg(0.05, 64, bits, decay));
            let mut comm = Solo;
            let first = grad(numel, 1);
            let mut g = first.clone();
            let report = r.reduce(&mut comm, &mut g, 0).unwrap();
            let kept = r.residual.host().to_vec();
            // The error is ||kept|| / ||accumulated||, summed afresh here.
            let want = global_norm(&kept) / global_norm(&first);
            let got = report.error.unwrap();
            assert!(
                (got - want).abs() <= 1e-9 * want,
                "{bits}: error {got} for {want}"
            );
            for i in 0..numel {
                assert!(
                    (g[i] + kept[i] - first[i]).abs() < 1e-7,
                    "{bits}: entry {i}"
                );
            }
            let sent = g.iter().filter(|v| **v != 0.0).count();
            let k: usize = tensors.iter().flat_map(|t| r.chunks(t)).map(|c| c.k).sum();
            assert!(sent <= k && sent > k / 2, "{bits}: {sent} of {k}");
            // The next sync decays what was kept first.
            let second = grad(numel, 2);
            let mut g2 = second.clone();
            r.reduce(&mut comm, &mut g2, 1).unwrap();
            let kept2 = r.residual.host();
            for i in 0..numel {
                let acc = decay as f32 * kept[i] + second[i];
                assert!(
                    (g2[i] + kept2[i] - acc).abs() < 1e-7,
                    "{bits}: sync 2 entry {i}"
                );
            }
        }
    }

    /// Density 1 with 32-bit values sends everything exactly: the mean is the pseudo-gradient and
    /// nothing is kept, whatever the decay.
    #[test]
    fn everything_at_32_bits_is_the_plain_average() {
        let tensors = Segment::from_shapes(&[(5, 1, false), (17, 13, true)]);
        let numel: usize = tensors.iter().map(|t| t.len).sum();
        let mut r = SparseLoco::new(tensors, &cfg(1.0, 16, 32, 0.95));
        let first = grad(numel, 4);
        let mut g = first.clone();
        r.reduce(&mut Solo, &mut g, 0).unwrap();
        assert_eq!(g, first);
        assert!(r.residual.host().iter().all(|&x| x == 0.0));
    }

    /// Encoding with d zeroed as it is read sends the message that keeping d sends and leaves zeros in
    /// d; decoding into zeros gives, bit for bit, each chunk zeroed, every rank's values added in rank
    /// order and the whole chunk times 1 / N, at worlds of 1 to 6 whose ranks' indices overlap.
    #[test]
    fn decoding_is_the_rank_ordered_sum_times_one_over_n() {
        let tensors = Segment::from_shapes(&[(37, 1, false), (40, 30, true), (9, 70, true)]);
        let numel: usize = tensors.iter().map(|t| t.len).sum();
        for (n, bits) in [(1, 2), (2, 32), (3, 4), (6, 8)] {
            let c = cfg(0.2, 64, bits, 0.95);
            let r = SparseLoco::new(tensors.clone(), &c);
            let mut messages = Vec::new();
            for rank in 0..n {
                let g = grad(numel, 20 + rank as u32);
                let (mut kept, mut zeroed) = (vec![0.0f32; r.words()], vec![0.0f32; r.words()]);
                r.encode(&mut vec![0.0; numel], Input::Keep(&g), 0.95, &mut kept);
                let mut d = g.clone();
                r.encode(
                    &mut vec![0.0; numel],
                    Input::Zero(&mut d),
                    0.95,
                    &mut zeroed,
                );
                assert_eq!(bits_of(&kept), bits_of(&zeroed), "the same message");
                assert!(d.iter().all(|x| x.to_bits() == 0), "d left as +0");
                messages.extend(kept);
            }
            let all = Gathered::packed(messages, n);
            let mut got = vec![0.0f32; numel];
            r.decode_mean(&all, &r.stream_chunks(), &mut got, 0)
                .unwrap();
            let (mut want, mut marks) = (vec![f32::NAN; numel], vec![0u64; 1]);
            let tw = r.table_words();
            let heads = r.tensors.len() * tw;
            for (i, chunk, bit) in r.stream_chunks() {
                let out = &mut want[chunk.start..chunk.start + chunk.len];
                out.fill(0.0);
                let ib = index_bits(c.chunk.min(r.tensors[i].len));
                for m in all.iter() {
                    let mut rd = BitReader::at(&m[heads..], bit);
                    let h = (&m[i * tw..(i + 1) * tw], ib);
                    r.decode_chunk(&chunk, h, &mut rd, out, &mut marks).unwrap();
                }
                if n > 1 {
                    out.iter_mut().for_each(|v| *v *= 1.0 / n as f32);
                }
            }
            assert_eq!(bits_of(&got), bits_of(&want), "{n} ranks, {bits} bits");
            assert!(got.iter().any(|&v| v != 0.0));
        }
    }

    fn bits_of(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// On the local engine each rank decodes its part and reads the others': every rank gets, bit for
    /// bit, the mean that one rank decoding every message gets, with more ranks than some tensors have
    /// chunks, an odd chunk at each tensor's end and chunks that cross no part's edge; the bytes counted
    /// are the all-gather's alone.
    #[test]
    fn ranks_that_share_memory_decode_a_part_each_to_the_same_bits() {
        let tensors = Segment::from_shapes(&[(37, 1, false), (40, 30, true), (9, 70, true)]);
        let numel: usize = tensors.iter().map(|t| t.len).sum();
        for (n, bits) in [(2, 2), (5, 4), (7, 32), (40, 8)] {
            let c = cfg(0.05, 64, bits, 0.95);
            let grads: Vec<Vec<f32>> = (0..n).map(|r| grad(numel, 10 + r as u32)).collect();
            let messages: Vec<f32> = grads
                .iter()
                .flat_map(|g| {
                    let r = SparseLoco::new(tensors.clone(), &c);
                    let mut send = vec![0.0f32; r.words()];
                    // A first step's residual: zeros, into which the gradient accumulates.
                    r.encode(&mut vec![0.0; g.len()], Input::Keep(g), 0.95, &mut send);
                    send
                })
                .collect();
            let r = SparseLoco::new(tensors.clone(), &c);
            let mut want = vec![0.0f32; numel];
            let all = Gathered::packed(messages, n);
            r.decode_mean(&all, &r.stream_chunks(), &mut want, 0)
                .unwrap();
            let comms = crate::comm::local::group(n, std::time::Duration::from_secs(60));
            let got: Vec<(Vec<f32>, u64)> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .zip(&grads)
                    .map(|(mut comm, g)| {
                        let (tensors, c) = (tensors.clone(), c.clone());
                        s.spawn(move || {
                            let mut r = SparseLoco::new(tensors, &c);
                            let mut g = g.clone();
                            r.reduce(&mut comm, &mut g, 0).unwrap();
                            (g, comm.stats().bytes_sent)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let sent = (n as u64 - 1) * r.words() as u64 * 4;
            for (q, (g, bytes)) in got.iter().enumerate() {
                let same = g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{n} ranks, {bits} bits: rank {q}");
                assert_eq!(*bytes, sent, "{n} ranks: rank {q}");
            }
        }
    }
}

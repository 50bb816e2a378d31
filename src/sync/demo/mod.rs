//! DeMo (bloc97/DeMo `demo.py`): decoupled momentum with a DCT top-k exchange and a sign update.
//!
//! Per step and tensor: delta <- decay delta + lr g; the DCT-II (orthonormal) of delta in chunks (a
//! matrix in cr x cc blocks, a vector in chunks of c, each the largest divisor of its dimension that is
//! <= `chunk`); the `topk` largest coefficients of each chunk are kept and their inverse transform leaves
//! delta (error feedback stays local); every rank's (indices, values) are all-gathered; each coefficient
//! is the mean of the ranks that sent it (the reference's scatter_reduce "mean", include_self=False); the
//! inverse DCT of that is the direction, and the update is p <- p (1 - lr wd) - lr sign(direction): this
//! backend hands sign(direction) to the loop's SGD (`optim::Sgd`, decoupled weight decay), which is
//! why DeMo takes `train.optim.name = "sgd"` for its weight decay and no momentum of its own. The local
//! gradient is clipped to `train.grad_norm_clip` before it enters delta (the loop does not clip the sign).
//!
//! On the wire: `topk` values and `topk` indices per chunk, all-gathered, so the bytes grow with N.

use std::collections::HashMap;
use std::ops::Range;

use anyhow::Result;
use multiversion::multiversion;
use rayon::prelude::*;

use super::compress::{self, take, State};
use super::trace::{Collective, Op, Overlap};
use super::{Metrics, SyncBackend};
use crate::comm::{Communicator, Gathered, Parts};
use crate::config::backend::DemoConfig;
use crate::flat::{Flat, Place};
use crate::kernels;
use crate::kernels::Segment;
use crate::kernels::{with_sign_stream, SignStream};

mod dct;

use dct::{kept_inverse, mark, mark_words, sparse_inverse, transform, Dct};

/// How a step's gradient enters the momentum: delta = decay delta + lr (g clip), with clip the factor
/// of torch's clip_grad_norm_ (1 when the norm is within the limit: g clip is then g).
#[derive(Debug, Clone, Copy)]
struct Mix {
    decay: f32,
    lr: f32,
    clip: f32,
}

/// delta = decay delta + lr (g clip), entry by entry.
#[multiversion(targets = "simd")]
fn mix(m: Mix, delta: &mut [f32], g: &[f32]) {
    kernels::streamed(delta, g, |delta, g| {
        for (d, &g) in delta.iter_mut().zip(g) {
            *d = m.decay * *d + m.lr * (g * m.clip);
        }
    });
}

/// The fewest floats the transform's row passes work on side by side (`Layout::group`).
const LANES: usize = 64;

/// The chunk layout of one tensor viewed as rows x cols (a vector is 1 x len).
#[derive(Debug, Clone, Copy)]
struct Layout {
    offset: usize,
    rows: usize,
    cols: usize,
    cr: usize,
    cc: usize,
}

impl Layout {
    fn chunks(&self) -> usize {
        (self.rows / self.cr) * (self.cols / self.cc)
    }

    /// Chunks `j..j + g` of a band (`cr` rows of the tensor) into `block`: `cr` rows of `g cc`.
    #[inline(always)]
    fn gather(&self, band: &[f32], j: usize, g: usize, block: &mut [f32]) {
        let rows = block.chunks_exact_mut(g * self.cc);
        for (row, b) in band.chunks_exact(self.cols).zip(rows) {
            copy(b, &row[j * self.cc..(j + g) * self.cc]);
        }
    }

    /// Writes the signs of `block` to chunks `j..j + g` of a band (as `gather` reads them).
    #[inline(always)]
    fn scatter_signs(
        &self,
        s: &mut SignStream,
        band: &mut [f32],
        j: usize,
        g: usize,
        block: &[f32],
    ) {
        let rows = band.chunks_exact_mut(self.cols);
        for (row, b) in rows.zip(block.chunks_exact(g * self.cc)) {
            s.store(&mut row[j * self.cc..(j + g) * self.cc], b);
        }
    }

    /// Chunks `j..j + g` of a band minus `block` (as `gather` reads it), in place.
    #[inline(always)]
    fn subtract(&self, band: &mut [f32], j: usize, g: usize, block: &[f32]) {
        let rows = band.chunks_exact_mut(self.cols);
        for (row, b) in rows.zip(block.chunks_exact(g * self.cc)) {
            let row = &mut row[j * self.cc..(j + g) * self.cc];
            row.iter_mut().zip(b).for_each(|(x, s)| *x -= s);
        }
    }

    /// `block` (as `gather` reads it) back into chunks `j..j + g` of a band.
    #[inline(always)]
    fn put(&self, band: &mut [f32], j: usize, g: usize, block: &[f32]) {
        let rows = band.chunks_exact_mut(self.cols);
        for (row, b) in rows.zip(block.chunks_exact(g * self.cc)) {
            copy(&mut row[j * self.cc..(j + g) * self.cc], b);
        }
    }

    /// Where entry `i` of chunk `jc` (row by row) is in a block of `g` chunks side by side.
    #[inline(always)]
    fn at(&self, i: usize, jc: usize, g: usize) -> usize {
        (i / self.cc) * g * self.cc + jc * self.cc + i % self.cc
    }

    /// Chunk `jc` of a block of `g` chunks side by side into `out`, row by row.
    #[inline(always)]
    fn chunk(&self, block: &[f32], jc: usize, g: usize, out: &mut [f32]) {
        let rows = block.chunks_exact(g * self.cc);
        for (r, o) in rows.zip(out.chunks_exact_mut(self.cc)) {
            copy(o, &r[jc * self.cc..(jc + 1) * self.cc]);
        }
    }

    /// Chunks transformed together: the fewest whose rows (g cc) and transposed rows (g cr) hold
    /// `LANES` floats, so that the transform's row passes fill the vector unit (a chunk's side may be
    /// 29 or 1) while the block and its scratch stay small (a 64 x 64 chunk and its scratch: 32 KB).
    fn group(&self) -> usize {
        LANES.div_ceil(self.cc).max(LANES.div_ceil(self.cr))
    }

    /// Flat indices of chunk `c`, row by row.
    #[cfg(test)]
    fn indices(&self, c: usize) -> impl Iterator<Item = usize> + '_ {
        let per_row = self.cols / self.cc;
        let (bi, bj) = (c / per_row, c % per_row);
        (0..self.cr).flat_map(move |i| {
            let row = self.offset + (bi * self.cr + i) * self.cols + bj * self.cc;
            row..row + self.cc
        })
    }
}

/// o = i for the short rows of a chunk: 16 floats at a time as vector moves, where `copy_from_slice`
/// would call memcpy for each row.
#[inline(always)]
fn copy(o: &mut [f32], i: &[f32]) {
    assert_eq!(o.len(), i.len());
    let mut whole = o.chunks_exact_mut(16);
    for (o, i) in (&mut whole).zip(i.chunks_exact(16)) {
        o.copy_from_slice(i);
    }
    let tail = whole.into_remainder();
    let n = tail.len();
    tail.copy_from_slice(&i[i.len() - n..]);
}

/// Each layout's entries in `buf`, in layout order (layouts do not overlap).
fn disjoint_parts<'a>(layouts: &[Layout], mut buf: &'a mut [f32]) -> Result<Vec<&'a mut [f32]>> {
    let mut order: Vec<usize> = (0..layouts.len()).collect();
    order.sort_by_key(|&i| layouts[i].offset);
    let mut parts: Vec<Option<&mut [f32]>> = layouts.iter().map(|_| None).collect();
    let mut at = 0;
    for i in order {
        let (offset, len) = (layouts[i].offset, layouts[i].rows * layouts[i].cols);
        let rest = std::mem::take(&mut buf);
        anyhow::ensure!(
            offset >= at && offset + len <= at + rest.len(),
            "DeMo's tensors overlap or run past the {} parameters",
            at + rest.len()
        );
        let (part, tail) = rest[offset - at..].split_at_mut(len);
        (parts[i], buf, at) = (Some(part), tail, offset + len);
    }
    Ok(parts.into_iter().flatten().collect())
}

/// One row band of a tensor in a flat buffer: its entries, where its part of a message (`2 kept` words
/// per chunk) starts, and where the band starts in the flat buffer.
struct Band<'a> {
    l: Layout,
    buf: &'a mut [f32],
    at: usize,
    start: usize,
}

/// The largest divisor of `n` that is at most `max`.
fn divisor(n: usize, max: usize) -> usize {
    (1..=max.min(n).max(1))
        .rev()
        .find(|d| n.is_multiple_of(*d))
        .unwrap_or(1)
}

pub struct Demo {
    comm: Box<dyn Communicator>,
    cfg: DemoConfig,
    layouts: Vec<Layout>,
    dct: HashMap<usize, Dct>,
    /// The parts of a shared replica (`share_replica`): each rank decodes the bands that meet its own.
    shared: Option<Parts>,
    /// The momentum, beside the gradient (on the GPU with it); empty before the first step.
    delta: Flat,
    numel: usize,
    tally: compress::Tally,
    /// Clip of the local gradient (<= 0: none), and its norm before clipping at the last step.
    clip: f64,
    grad_norm: Option<f64>,
    /// The gradient's size (bytes) above which the decoding writes its signs past the caches
    /// (`STREAM_ABOVE`; the tests set 0 to take that path on small gradients).
    stream_above: usize,
    /// The last step's message and all-gather buffers, filled again (fresh ones would be mapped anew).
    send: Vec<f32>,
    gathered: Vec<f32>,
    /// The chunk table, the transforms' constants (`Dct::words`) and the kernels' scratch, once a GPU
    /// step has run.
    #[cfg(feature = "cuda")]
    device: Option<OnDevice>,
}

#[cfg(feature = "cuda")]
struct OnDevice {
    table: cudarc::driver::CudaSlice<u32>,
    dct: cudarc::driver::CudaSlice<f32>,
    scratch: cudarc::driver::CudaSlice<f32>,
    words: usize,
}

impl Demo {
    pub fn new(
        comm: Box<dyn Communicator>,
        cfg: DemoConfig,
        clip: f64,
        tensors: &[Segment],
    ) -> Self {
        let layouts: Vec<Layout> = tensors
            .iter()
            .map(|t| {
                let (rows, cols) = if t.matrix {
                    (t.rows, t.cols)
                } else {
                    (1, t.len)
                };
                Layout {
                    offset: t.offset,
                    rows,
                    cols,
                    cr: divisor(rows, cfg.chunk),
                    cc: divisor(cols, cfg.chunk),
                }
            })
            .collect();
        let mut dct = HashMap::new();
        for l in &layouts {
            for n in [l.cr, l.cc] {
                dct.entry(n).or_insert_with(|| Dct::new(n));
            }
        }
        let numel = tensors.iter().map(|t| t.len).sum();
        Self {
            comm,
            cfg,
            layouts,
            dct,
            shared: None,
            delta: Flat::Host(Vec::new()),
            numel,
            tally: compress::Tally::default(),
            clip,
            grad_norm: None,
            stream_above: STREAM_ABOVE,
            send: Vec::new(),
            gathered: Vec::new(),
            #[cfg(feature = "cuda")]
            device: None,
        }
    }

    /// Every chunk of every tensor, in flat order: (layout, chunk index).
    fn chunks(&self) -> Vec<(Layout, usize)> {
        self.layouts
            .iter()
            .flat_map(|l| (0..l.chunks()).map(move |c| (*l, c)))
            .collect()
    }

    /// Each tensor's row bands (`cr` rows: `cols / cc` chunks side by side, contiguous in the flat
    /// buffer), in chunk order.
    fn bands<'a>(&self, buf: &'a mut [f32]) -> Result<Vec<Band<'a>>> {
        let parts = disjoint_parts(&self.layouts, buf)?;
        let (mut out, mut at) = (Vec::new(), 0);
        for (l, part) in self.layouts.iter().zip(parts) {
            for (i, buf) in part.chunks_mut(l.cr * l.cols).enumerate() {
                let start = l.offset + i * l.cr * l.cols;
                out.push(Band {
                    l: *l,
                    buf,
                    at,
                    start,
                });
                at += self.band_words(l);
            }
        }
        Ok(out)
    }

    /// DeMo's transform alone, in place over a buffer laid out as the tensors: each chunk's 2-D DCT,
    /// then its inverse of every coefficient, in the groups of chunks the encoding transforms
    /// (`predict::codec` times it apart from the codec). The result is the input up to rounding.
    pub fn transform_round_trip(&self, buf: &mut [f32]) -> Result<()> {
        for Band { l, buf: band, .. } in self.bands(buf)? {
            let (da, db) = (&self.dct[&l.cr], &self.dct[&l.cc]);
            let (per, g) = (l.cols / l.cc, l.group());
            let size = l.cr * g * l.cc;
            let (mut block, mut spare) = (vec![0.0f32; size], vec![0.0f32; size]);
            for j0 in (0..per).step_by(g) {
                let gn = g.min(per - j0);
                let len = l.cr * gn * l.cc;
                let (block, spare) = (&mut block[..len], &mut spare[..len]);
                l.gather(band, j0, gn, block);
                transform(block, spare, da, db, gn, false);
                transform(block, spare, da, db, gn, true);
                l.put(band, j0, gn, block);
            }
        }
        Ok(())
    }

    /// Message words of one band of `l`.
    fn band_words(&self, l: &Layout) -> usize {
        2 * (l.cols / l.cc) * kept(self.cfg.topk, l)
    }

    /// Words of one rank's message.
    fn message_words(&self) -> usize {
        let k = |l: &Layout| 2 * l.chunks() * kept(self.cfg.topk, l);
        self.layouts.iter().map(k).sum()
    }

    /// Each chunk's message (its top-k DCT coefficients: indices as f32 bits, then values), in chunk
    /// order; what is not sent stays in `delta`.
    fn encode(
        &self,
        delta: &mut [f32],
        grads: &mut [f32],
        mix: Mix,
        send: &mut [f32],
    ) -> Result<()> {
        let bands = self.bands(delta)?;
        let grads = self.bands(grads)?;
        let mut rest = send;
        let mut msgs = Vec::with_capacity(bands.len());
        for b in &bands {
            let (m, tail) = std::mem::take(&mut rest).split_at_mut(self.band_words(&b.l));
            msgs.push(m);
            rest = tail;
        }
        // Every word of the message is written below: the bands' parts cover it.
        anyhow::ensure!(
            rest.is_empty(),
            "internal error: DeMo's bands leave {} message words",
            rest.len()
        );
        let (dct, topk) = (&self.dct, self.cfg.topk);
        bands
            .into_par_iter()
            .zip(grads)
            .zip(msgs)
            .for_each(|((b, g), msg)| encode_band(&b.l, (b.buf, g.buf), mix, msg, dct, topk));
        Ok(())
    }

    /// Each chunk's direction from every rank's message in `all`: the mean of each
    /// coefficient over the ranks that sent it, transformed back; its sign goes to `grads` (torch.sign:
    /// 0 stays 0). Only the bands that meet `only` where it is given (a shared replica's part: the rest
    /// is left as it is).
    fn decode(&self, grads: &mut [f32], all: &Gathered, only: Option<Range<usize>>) -> Result<()> {
        let (dct, topk) = (&self.dct, self.cfg.topk);
        let past = std::mem::size_of_val(grads) > self.stream_above;
        let meets = |b: &Band| {
            only.as_ref()
                .is_none_or(|r| b.start < r.end && r.start < b.start + b.buf.len())
        };
        let mut bands = self.bands(grads)?;
        bands.retain(meets);
        bands
            .into_par_iter()
            .for_each(|b| with_sign_stream(past, |s| decode_band(b, s, all, dct, topk)));
        Ok(())
    }

    /// The table of DeMo's kernels (`kernels::CHUNK_FIELDS` words per chunk, in `chunks()` order:
    /// tensor offset, columns, chunk rows and columns, first row and column, coefficients kept, message
    /// offset, offsets of the two transforms' constants, scratch offset), the constants it names
    /// (`Dct::words`), and the message's length.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn table(&self) -> (Vec<u32>, Vec<f32>, usize) {
        let mut sizes: Vec<usize> = self.dct.keys().copied().collect();
        sizes.sort_unstable();
        let (mut dct, mut at) = (Vec::new(), HashMap::new());
        for n in sizes {
            at.insert(n, dct.len());
            dct.extend(self.dct[&n].words());
        }
        let (mut table, mut msg) = (Vec::new(), 0);
        for (l, c) in self.chunks() {
            let per_row = l.cols / l.cc;
            let (bi, bj) = (c / per_row, c % per_row);
            let k = kept(self.cfg.topk, &l);
            let scratch = l.offset + c * l.cr * l.cc;
            let fields = [
                l.offset,
                l.cols,
                l.cr,
                l.cc,
                bi * l.cr,
                bj * l.cc,
                k,
                msg,
                at[&l.cr],
                at[&l.cc],
                scratch,
            ];
            table.extend(fields.map(|x| x as u32));
            msg += 2 * k;
        }
        (table, dct, msg)
    }
}

#[cfg(feature = "cuda")]
impl Demo {
    /// `reduce_grads` on the GPU: the clipping, the momentum, the chunks' compression and decompression
    /// as kernels (`demo_encode`, `demo_decode`: the host path is their twin) and NCCL's all-gather.
    fn reduce_device(&mut self, d: &mut crate::flat::DeviceFlat, lr: f64) -> Result<()> {
        let (k, s) = (d.kernels.clone(), d.kernels.stream().clone());
        let (numel, place) = (d.buf.len(), Place::Cuda(k.clone()));
        match self.delta.len() == numel {
            true => self.delta.move_to(&place)?,
            false => self.delta = place.zeros(numel)?,
        }
        if self.device.is_none() {
            let (table, dct, words) = self.table();
            self.device = Some(OnDevice {
                table: s.clone_htod(&table)?,
                dct: s.clone_htod(&dct)?,
                scratch: s.alloc_zeros::<f32>(2 * numel)?,
                words,
            });
        }
        let (Flat::Cuda(delta), Some(dev)) = (&mut self.delta, &mut self.device) else {
            anyhow::bail!(crate::flat::MIXED);
        };
        let norm = k.sum_squares(&d.buf)?.sqrt();
        self.grad_norm = Some(norm);
        let c = crate::optim::clip_factor(norm, self.clip);
        if c < 1.0 {
            k.scale(&mut d.buf, c)?;
        }
        // delta = decay delta + (lr g) (the `mix` kernel): the twin's sum, in the other order.
        let mut lg = s.alloc_zeros::<f32>(numel)?;
        k.scaled_copy(&mut lg.slice_mut(..), &d.buf.slice(..), lr as f32)?;
        k.mix(
            &mut delta.buf.slice_mut(..),
            &lg.slice(..),
            self.cfg.decay as f32,
        )?;
        let mut send = s.alloc_zeros::<f32>(dev.words)?;
        // SAFETY: dev's table, transforms and scratch are this backend's layout of the model (numel
        // floats, delta's and the gradient's length), and send holds its dev.words message words.
        unsafe {
            k.demo_encode(
                &mut delta.buf,
                &dev.table,
                &dev.dct,
                &mut dev.scratch,
                &mut send,
            )
        }?;
        let (n, rank) = (self.comm.world_size(), self.comm.rank());
        let before = self.comm.stats();
        let mut all = s.alloc_zeros::<f32>(dev.words * n)?;
        self.comm.all_gather_device(&send.slice(..), &mut all)?;
        let after = self.comm.stats();
        // SAFETY: as for the encoding; all holds n messages of that layout (the all-gather's).
        unsafe { k.demo_decode(&all, n, &dev.table, &dev.dct, &mut dev.scratch, &mut d.buf) }?;
        let report = compress::Report::default();
        self.tally
            .add(self.numel, n, rank, &before, &after, &report);
        Ok(())
    }
}

/// One band's directions from the messages in `all`, `Layout::group` chunks at a
/// time: each coefficient's mean over the ranks that sent it, transformed back (the sent entries
/// marked, as sparse rows where `sparse_decode` takes them), its sign to the band.
#[multiversion(targets = "simd")]
fn decode_band(
    b: Band,
    s: &mut SignStream,
    all: &Gathered,
    dct: &HashMap<usize, Dct>,
    topk: usize,
) {
    let (l, k) = (b.l, kept(topk, &b.l));
    let (per, g) = (l.cols / l.cc, l.group());
    let size = l.cr * g * l.cc;
    // count is back to zeros after each group: the mean resets the entries it divides.
    let (mut sum, mut count, mut spare) = (vec![0.0f32; size], vec![0u32; size], vec![0.0; size]);
    let mut marks = vec![0u64; mark_words(l.cr, g * l.cc)];
    for j0 in (0..per).step_by(g) {
        let gn = g.min(per - j0);
        let len = l.cr * gn * l.cc;
        let (sum, spare) = (&mut sum[..len], &mut spare[..len]);
        let marks = &mut marks[..mark_words(l.cr, gn * l.cc)];
        sum.fill(0.0);
        marks.fill(0);
        let messages = |jc: usize| {
            let at = b.at + 2 * k * (j0 + jc);
            all.iter().map(move |m| &m[at..][..2 * k])
        };
        for jc in 0..gn {
            for m in messages(jc) {
                for (i, &v) in m[..k].iter().zip(&m[k..]) {
                    let o = l.at(i.to_bits() as usize, jc, gn);
                    (sum[o], count[o]) = (sum[o] + v, count[o] + 1);
                    mark(marks, o, gn * l.cc);
                }
            }
        }
        // The mean of the entries sent; the others keep the fill's +0.
        for jc in 0..gn {
            for m in messages(jc) {
                for i in &m[..k] {
                    let o = l.at(i.to_bits() as usize, jc, gn);
                    if count[o] > 0 {
                        (sum[o], count[o]) = (sum[o] / count[o] as f32, 0);
                    }
                }
            }
        }
        let (da, db) = (&dct[&l.cr], &dct[&l.cc]);
        match sparse_decode(all.members(), k, l.cr) {
            true => {
                let dir = sparse_inverse(sum, spare, da, db, gn, marks);
                l.scatter_signs(s, b.buf, j0, gn, dir);
            }
            false => {
                transform(sum, spare, da, db, gn, true);
                l.scatter_signs(s, b.buf, j0, gn, sum);
            }
        }
    }
}

/// Whether the decoding inverts a chunk's mean coefficients as sparse rows (`sparse_inverse`) rather
/// than through the full transform: when the `ranks` messages of `k` coefficients can fill at most
/// `SPARSE_ROWS` entries per row of the chunk's `r` on average, where the sparse sum costs less than
/// the rows' transform and its two transposes. The kernels' `demo_decode` takes the same choice.
fn sparse_decode(ranks: usize, k: usize, r: usize) -> bool {
    ranks * k <= SPARSE_ROWS * r
}

/// The most coefficients per row, on average, that the decoding inverts as a sparse sum.
const SPARSE_ROWS: usize = 4;

/// One band's chunks, `Layout::group` at a time: the momentum `band` updated with the gradient's band
/// (`Mix`; in one pass over the contiguous band, which then stays in the core's cache for the chunks'
/// strided reads), then each chunk's top-k DCT coefficients into its part of `msg` ([indices as f32
/// bits | values]); what is not sent stays in the band.
#[multiversion(targets = "simd")]
fn encode_band(
    l: &Layout,
    (band, grad): (&mut [f32], &[f32]),
    mix: Mix,
    msg: &mut [f32],
    dct: &HashMap<usize, Dct>,
    topk: usize,
) {
    let (da, db, k) = (&dct[&l.cr], &dct[&l.cc], kept(topk, l));
    let (per, g) = (l.cols / l.cc, l.group());
    let (mut idx, mut val) = (Vec::with_capacity(k), Vec::with_capacity(k));
    // Buffers for a group of chunks, and one chunk's coefficients, reused group after group.
    let size = l.cr * g * l.cc;
    let (mut coef, mut sent, mut spare) = (vec![0.0f32; size], vec![0.0; size], vec![0.0; size]);
    let mut one = vec![0.0f32; l.cr * l.cc];
    self::mix(mix, band, grad);
    for j0 in (0..per).step_by(g) {
        let gn = g.min(per - j0);
        let len = l.cr * gn * l.cc;
        let (coef, sent, spare) = (&mut coef[..len], &mut sent[..len], &mut spare[..len]);
        l.gather(band, j0, gn, coef);
        transform(coef, spare, da, db, gn, false);
        for jc in 0..gn {
            idx.clear();
            val.clear();
            // A block of one chunk is the chunk, row by row.
            let chunk = match gn {
                1 => &coef[..],
                _ => {
                    l.chunk(coef, jc, gn, &mut one);
                    &one[..]
                }
            };
            kernels::top_k(chunk, k, 0, &mut idx, &mut val);
            let (mi, mv) = msg[2 * k * (j0 + jc)..][..2 * k].split_at_mut(k);
            mi.iter_mut()
                .zip(&idx)
                .for_each(|(o, i)| *o = f32::from_bits(*i));
            mv.copy_from_slice(&val);
        }
        let group = &msg[2 * k * j0..2 * k * (j0 + gn)];
        let sent = kept_inverse(sent, spare, da, db, gn, group, k);
        l.subtract(band, j0, gn, sent);
    }
}

/// The size of a gradient (bytes) above which the decoding writes its signs past the caches: one that
/// large is out of them by the time the optimizer reads it, and one that fits is read from them there.
const STREAM_ABOVE: usize = 64 << 20;

/// Coefficients kept per chunk of layout `l`.
fn kept(topk: usize, l: &Layout) -> usize {
    topk.min(l.cr * l.cc)
}

impl SyncBackend for Demo {
    fn name(&self) -> &'static str {
        "demo"
    }
    /// Every rank's (indices, values) of its chunks' top-k DCT coefficients, all-gathered.
    fn step_comm(&self, _step: u64) -> Vec<Collective> {
        let words: usize = self
            .layouts
            .iter()
            .map(|l| 2 * l.chunks() * kept(self.cfg.topk, l))
            .sum();
        let op = Op::AllGather {
            pieces: vec![words as u64],
        };
        vec![Collective::world(op, self.world_size(), Overlap::None)]
    }
    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }
    fn comm_mut(&mut self) -> &mut dyn Communicator {
        self.comm.as_mut()
    }
    fn reduce_grads(&mut self, grads: &mut [f32], _step: u64, lr: f64) -> Result<()> {
        self.delta.move_to(&Place::Host)?;
        let mut delta = match std::mem::replace(&mut self.delta, Flat::Host(Vec::new())) {
            Flat::Host(d) if d.len() == grads.len() => d,
            // Read before it is written (the mix), so with its pages mapped: `flat::mapped_zeros`.
            _ => crate::flat::mapped_zeros(grads.len()),
        };
        // The local gradient is clipped as torch's clip_grad_norm_ before the optimizer step would (by
        // its factor as it enters delta; `grads` is left as it is); the sign direction that leaves this
        // function is not.
        let norm = crate::optim::global_norm(grads);
        self.grad_norm = Some(norm);
        let mix = Mix {
            decay: self.cfg.decay as f32,
            lr: lr as f32,
            clip: crate::optim::clip_factor(norm, self.clip),
        };
        // delta = decay delta + lr g, then each chunk's kept coefficients, and the delta left behind.
        let mut send = std::mem::take(&mut self.send);
        send.resize(self.message_words(), 0.0);
        self.encode(&mut delta, grads, mix, &mut send)?;
        self.delta = Flat::Host(delta);
        // Every rank's coefficients, then each chunk's mean over the ranks that sent a coefficient.
        let (n, rank) = (self.comm.world_size(), self.comm.rank());
        let before = self.comm.stats();
        let all = self
            .comm
            .all_gather_shared(&send, std::mem::take(&mut self.gathered))?;
        self.send = send;
        let after = self.comm.stats();
        let only = self.shared.filter(|_| n > 1).map(|p| p.of(rank));
        self.decode(grads, &all, only)?;
        self.gathered = all.into_spare();
        let report = compress::Report::default();
        self.tally
            .add(self.numel, n, rank, &before, &after, &report);
        Ok(())
    }
    /// The update reads each rank's part of the direction alone: the bands that meet it are decoded.
    fn share_replica(&mut self, parts: Parts) {
        self.shared = Some(parts);
    }
    #[cfg(feature = "cuda")]
    fn reduce_flat(&mut self, grads: crate::flat::FlatMut<'_>, step: u64, lr: f64) -> Result<()> {
        use crate::flat::FlatMut;
        match grads {
            FlatMut::Cuda(d) if self.comm.device_collectives() => self.reduce_device(d, lr),
            g => g.through_host(|g| self.reduce_grads(g, step, lr)),
        }
    }
    fn take_metrics(&mut self) -> Metrics {
        self.tally.take()
    }
    fn clipped_grad_norm(&self) -> Option<f64> {
        self.grad_norm
    }
    /// The momentum is the worker's own: it restarts at zero.
    fn recovered(&mut self, _state: State, _params: &mut [f32]) -> Result<()> {
        self.load_state(Vec::new())
    }
    fn state(&self) -> Result<State> {
        if self.delta.is_empty() {
            return Ok(Vec::new());
        }
        Ok(vec![(
            "demo.delta".into(),
            self.delta.to_host()?.into_owned(),
        )])
    }
    fn load_state(&mut self, mut state: State) -> Result<()> {
        self.delta = Flat::Host(if state.is_empty() {
            Vec::new()
        } else {
            take(&mut state, "demo.delta", Some(self.numel))?
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::dct::transformed;
    use super::*;

    /// The kernels `demo_encode` and `demo_decode` (run on the host by `kernels::emulate`, one block per
    /// chunk of the table, as `crate::cuda` launches them) give the host path's message, left-over
    /// momentum and signs bit for bit: chunks of 64 x 64, odd and thin shapes, a vector, two ranks'
    /// messages whose kept coefficients overlap in part.
    #[test]
    fn the_kernels_encode_and_decode_as_the_host() {
        use crate::kernels::emulate::{Arg, Emulator, Source};
        use rand::{Rng, SeedableRng};
        let Some(e) = Emulator::get(Source::Reducers) else {
            return;
        };
        let tensors = Segment::from_shapes(&[
            (128, 64, true),
            (29, 70, true),
            (200, 1, false),
            (3, 5, true),
        ]);
        let n: usize = tensors.iter().map(|t| t.len).sum();
        let demo = Demo::new(
            Box::new(crate::comm::Solo),
            DemoConfig::default(),
            0.0,
            &tensors,
        );
        let (table, dct, words) = demo.table();
        let chunks = (table.len() / kernels::CHUNK_FIELDS) as u32;
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        let mut all = Vec::new();
        for rank in 0..2 {
            let mut delta: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            if rank == 1 {
                delta.iter_mut().step_by(3).for_each(|d| *d *= 0.5);
            }
            let mut args = [
                Arg::F32s(delta.clone()),
                Arg::U32s(table.clone()),
                Arg::F32s(dct.clone()),
                Arg::F32s(vec![0.0; 2 * n]),
                Arg::U32(n as u32),
                Arg::F32s(vec![0.0; words]),
            ];
            e.launch("demo_encode", (chunks, 1), &mut args);
            let msg = demo.encode_as_is(&mut delta);
            assert_eq!(bits(args[5].f32s()), bits(&msg), "rank {rank}: the message");
            assert_eq!(
                bits(args[0].f32s()),
                bits(&delta),
                "rank {rank}: what delta keeps"
            );
            all.extend(msg);
        }
        let mut grads = vec![f32::NAN; n];
        demo.decode(&mut grads, &Gathered::packed(all.clone(), 2), None)
            .unwrap();
        let mut args = [
            Arg::F32s(all),
            Arg::U32(words as u32),
            Arg::U32(2),
            Arg::U32s(table),
            Arg::F32s(dct),
            Arg::F32s(vec![0.0; 2 * n]),
            Arg::U32(n as u32),
            Arg::F32s(vec![f32::NAN; n]),
        ];
        e.launch("demo_decode", (chunks, 1), &mut args);
        assert_eq!(bits(args[7].f32s()), bits(&grads), "the signs");
        let all = Gathered::packed(args[0].f32s().to_vec(), 2);
        for (at, want) in chunk_directions(&demo, &all) {
            let got = &args[5].f32s()[at..][..want.len()];
            assert_eq!(
                bits(got),
                bits(&want),
                "the direction at {at} of the scratch"
            );
        }
    }

    /// Each chunk's direction before its sign as the host decodes it from `all` (each coefficient's mean
    /// over the ranks that sent it, inverted as sparse rows or by the full transform as `sparse_decode`
    /// chooses), and where `demo_decode` leaves it in its scratch: the sum's region, or the count's for
    /// sparse rows. The signs alone would hide the kernel taking the other inverse (they differ in
    /// rounding only).
    fn chunk_directions(demo: &Demo, all: &Gathered) -> Vec<(usize, Vec<f32>)> {
        let (table, _, _) = demo.table();
        let fields = table.chunks_exact(kernels::CHUNK_FIELDS);
        let mut out = Vec::new();
        for ((l, _), f) in demo.chunks().into_iter().zip(fields) {
            let (k, msg, scratch) = (kept(demo.cfg.topk, &l), f[7] as usize, f[10] as usize);
            let (mut sum, mut count) = (vec![0.0f32; l.cr * l.cc], vec![0u32; l.cr * l.cc]);
            for m in all.iter() {
                for (i, &v) in m[msg..][..k].iter().zip(&m[msg + k..][..k]) {
                    let i = i.to_bits() as usize;
                    (sum[i], count[i]) = (sum[i] + v, count[i] + 1);
                }
            }
            let mean: Vec<f32> = sum
                .iter()
                .zip(&count)
                .map(|(&s, &c)| if c > 0 { s / c as f32 } else { 0.0 })
                .collect();
            let (da, db) = (&demo.dct[&l.cr], &demo.dct[&l.cc]);
            out.push(match sparse_decode(all.members(), k, l.cr) {
                true => (
                    demo.numel + scratch,
                    super::dct::kept_inverted(&mean, da, db),
                ),
                false => (scratch, transformed(&mean, da, db, 1, true)),
            });
        }
        out
    }

    impl Demo {
        /// `encode` of a momentum as it is (a zero gradient mixed in at lr 0 adds +0), into a message
        /// buffer of NaNs: a word it left unwritten would show (steps reuse the last step's buffer).
        fn encode_as_is(&self, delta: &mut [f32]) -> Vec<f32> {
            let mut zero = vec![0.0; delta.len()];
            let mix = Mix {
                decay: 1.0,
                lr: 0.0,
                clip: 1.0,
            };
            let mut send = vec![f32::NAN; self.message_words()];
            self.encode(delta, &mut zero, mix, &mut send).unwrap();
            send
        }
    }

    /// The gradient enters the momentum as torch's clip_grad_norm_ leaves it: `reduce_grads` with a
    /// clip that bites, over two steps, gives the message, the momentum left and the signs of the clip
    /// in place followed by delta = decay delta + lr g, bit for bit.
    #[test]
    fn the_momentum_takes_the_gradient_as_clip_grad_norm_leaves_it() {
        use rand::{Rng, SeedableRng};
        let tensors = Segment::from_shapes(&[(64, 96, true), (70, 1, false)]);
        let n = 64 * 96 + 70;
        let mut demo = Demo::new(
            Box::new(crate::comm::Solo),
            DemoConfig::default(),
            0.5,
            &tensors,
        );
        let reference = Demo::new(
            Box::new(crate::comm::Solo),
            DemoConfig::default(),
            0.0,
            &tensors,
        );
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
        let (decay, lr) = (DemoConfig::default().decay as f32, 0.01f32);
        let mut delta = vec![0.0f32; n];
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for step in 0..2 {
            let g: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let mut out = g.clone();
            demo.reduce_grads(&mut out, step, lr as f64).unwrap();
            let mut clipped = g.clone();
            let norm = crate::optim::clip_grad_norm(&mut clipped, 0.5);
            assert!(norm > 1.0, "the clip bites");
            assert_eq!(demo.clipped_grad_norm(), Some(norm));
            delta
                .iter_mut()
                .zip(&clipped)
                .for_each(|(d, g)| *d = decay * *d + lr * g);
            let msg = reference.encode_as_is(&mut delta);
            let mut dir = vec![f32::NAN; n];
            let msg = Gathered::packed(msg, 1);
            reference.decode(&mut dir, &msg, None).unwrap();
            assert_eq!(bits(&out), bits(&dir), "step {step}: the signs");
            let left = demo.delta.to_host().unwrap().into_owned();
            assert_eq!(bits(&left), bits(&delta), "step {step}: the momentum left");
        }
    }

    /// Minor page faults of the calling thread so far.
    #[cfg(target_os = "linux")]
    fn thread_faults() -> i64 {
        let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage fills the struct it is given (zeroed, so initialized either way).
        unsafe {
            libc::getrusage(libc::RUSAGE_THREAD, u.as_mut_ptr());
            u.assume_init().ru_minflt
        }
    }

    /// The momentum that the first step creates is read before it is written (the mix), so its pages
    /// are mapped as it is allocated (`flat::mapped_zeros`): the first step faults once per page of it,
    /// where fresh zeros would fault twice (the shared zero page, then its copy, whose flush of every
    /// core's TLB was most of a 512-worker first step). The steps run on a pool of one thread, whose
    /// faults are all of theirs; the momentum (42 MB) is above glibc's largest mmap threshold, so it is
    /// fresh from the OS.
    #[test]
    #[cfg(target_os = "linux")]
    fn the_first_step_maps_the_momentum_once_per_page() {
        let tensors =
            Segment::from_shapes(&[(2048, 2048, true), (2048, 2048, true), (1024, 2048, true)]);
        let n: usize = tensors.iter().map(|t| t.len).sum();
        let g: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
        let (mut g0, mut g1) = (g.clone(), g);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let (first, second) = pool.install(|| {
            let comm = Box::new(crate::comm::Solo);
            let mut demo = Demo::new(comm, DemoConfig::default(), 0.0, &tensors);
            let mut faults_of_step = |g: &mut [f32], step| {
                let before = thread_faults();
                demo.reduce_grads(g, step, 1e-3).unwrap();
                thread_faults() - before
            };
            (faults_of_step(&mut g0, 0), faults_of_step(&mut g1, 1))
        });
        // SAFETY: sysconf only reads a setting.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as i64;
        let pages = 4 * n as i64 / page;
        assert!(
            first - second < pages + pages / 2,
            "the first step faulted {first} times, the second {second}; the momentum has {pages} pages"
        );
    }

    /// With every coefficient kept and one worker nothing is dropped: the direction is the momentum
    /// itself, so the update is sign-SGD on delta = decay delta + lr g, and delta is spent each step.
    #[test]
    fn keeping_every_coefficient_on_one_worker_is_sign_sgd_on_the_momentum() {
        use rand::{Rng, SeedableRng};
        let tensors = Segment::from_shapes(&[(8, 1, false), (16, 12, true), (6, 10, true)]);
        let cfg = DemoConfig {
            decay: 0.9,
            topk: 16 * 16,
            chunk: 16,
        };
        let mut demo = Demo::new(Box::new(crate::comm::Solo), cfg, 0.0, &tensors);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        let n = 8 + 16 * 12 + 60;
        for step in 0..5 {
            let g: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let mut out = g.clone();
            demo.reduce_grads(&mut out, step, 0.01).unwrap();
            // The reference momentum: what was left (nothing, up to rounding) decayed, plus lr g.
            for (i, (&o, &gi)) in out.iter().zip(&g).enumerate() {
                let want = gi.signum();
                assert!(
                    o == want || gi.abs() < 1e-4,
                    "step {step} entry {i}: {o} vs sign({gi})"
                );
            }
            let left = demo
                .delta
                .to_host()
                .unwrap()
                .iter()
                .fold(0.0f32, |m, x| m.max(x.abs()));
            assert!(left < 1e-7, "step {step}: delta not spent ({left})");
        }
    }

    /// The branchless sign: +1, -1, and +0 for either zero, as torch.sign; +0 for NaN, as the sign with
    /// branches gave.
    #[test]
    fn sign_is_torch_sign() {
        let cases = [
            (2.5f32, 1.0f32),
            (-1e-30, -1.0),
            (f32::MIN_POSITIVE / 4.0, 1.0),
            (f32::INFINITY, 1.0),
            (f32::NEG_INFINITY, -1.0),
            (0.0, 0.0),
            (-0.0, 0.0),
            (f32::NAN, 0.0),
        ];
        for (x, want) in cases {
            assert_eq!(
                crate::kernels::sign(x).to_bits(),
                want.to_bits(),
                "sign({x})"
            );
        }
    }

    #[test]
    fn chunks_tile_each_tensor() {
        assert_eq!(
            (divisor(768, 64), divisor(50257, 64), divisor(7, 64)),
            (64, 29, 7)
        );
        let l = Layout {
            offset: 10,
            rows: 6,
            cols: 8,
            cr: 3,
            cc: 4,
        };
        let mut all: Vec<usize> = (0..l.chunks()).flat_map(|c| l.indices(c)).collect();
        all.sort();
        assert_eq!(all, (10..58).collect::<Vec<_>>());
    }

    /// The transform's round trip is each chunk's `transformed` forward and back, bit for bit (each lane
    /// of a group computes its own vector), and the input up to rounding; chunk sides of 64, 60, 58, 7, 1.
    #[test]
    fn the_transforms_round_trip_is_each_chunks_forward_and_inverse() {
        let tensors = Segment::from_shapes(&[
            (128, 192, true),
            (58, 64, true),
            (7, 128, true),
            (128, 1, false),
            (300, 1, false),
        ]);
        let demo = Demo::new(
            Box::new(crate::comm::Solo),
            DemoConfig::default(),
            0.0,
            &tensors,
        );
        let x: Vec<f32> = (0..demo.numel)
            .map(|i| ((i as f64 * 0.618_034).fract() - 0.5) as f32)
            .collect();
        let mut got = x.clone();
        demo.transform_round_trip(&mut got).unwrap();
        for (l, c) in demo.chunks() {
            let at: Vec<usize> = l.indices(c).collect();
            let chunk: Vec<f32> = at.iter().map(|&i| x[i]).collect();
            let (da, db) = (&demo.dct[&l.cr], &demo.dct[&l.cc]);
            let back = transformed(&transformed(&chunk, da, db, 1, false), da, db, 1, true);
            let mine: Vec<f32> = at.iter().map(|&i| got[i]).collect();
            assert_eq!(
                bits(&mine),
                bits(&back),
                "chunk {c} of {}x{}",
                l.rows,
                l.cols
            );
        }
        let worst = x
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst < 1e-5, "the round trip moved an entry by {worst}");
        assert_ne!(bits(&got), bits(&x), "a round trip rounds some entries");
    }

    /// The reference encoding and decoding, chunk by chunk through `Layout::indices`: the transform
    /// (held to the exact DCT and to the kernels' order in `dct`), the top-k by a full sort (ties to
    /// the lower index, in index order), the mean of each coefficient over the ranks that sent it, its
    /// inverse through `kept_inverse` of the nonzero means where the decoding takes sparse rows.
    fn reference(demo: &Demo, deltas: &mut [Vec<f32>]) -> (Vec<Vec<f32>>, Vec<f32>) {
        let mut msgs = vec![Vec::new(); deltas.len()];
        let mut dir = vec![0.0f32; demo.numel];
        for (l, c) in demo.chunks() {
            let (da, db, k) = (&demo.dct[&l.cr], &demo.dct[&l.cc], kept(demo.cfg.topk, &l));
            let at: Vec<usize> = l.indices(c).collect();
            let (mut sum, mut count) = (vec![0.0f32; at.len()], vec![0u32; at.len()]);
            for (delta, msg) in deltas.iter_mut().zip(&mut msgs) {
                let block: Vec<f32> = at.iter().map(|&i| delta[i]).collect();
                let coef = transformed(&block, da, db, 1, false);
                let mut order: Vec<usize> = (0..coef.len()).collect();
                order.sort_by_key(|&i| (std::cmp::Reverse(coef[i].abs().to_bits()), i));
                order.truncate(k);
                order.sort_unstable();
                for &i in &order {
                    (sum[i], count[i]) = (sum[i] + coef[i], count[i] + 1);
                }
                let mut m: Vec<f32> = order.iter().map(|&i| f32::from_bits(i as u32)).collect();
                m.extend(order.iter().map(|&i| coef[i]));
                let (mut sent, mut q) = (vec![f32::NAN; at.len()], vec![0.0; at.len()]);
                let sent = kept_inverse(&mut sent, &mut q, da, db, 1, &m, k);
                for (j, &i) in at.iter().enumerate() {
                    delta[i] = block[j] - sent[j];
                }
                msg.extend(m);
            }
            let mean: Vec<f32> = sum
                .iter()
                .zip(&count)
                .map(|(&s, &n)| if n > 0 { s / n as f32 } else { 0.0 })
                .collect();
            let d = match sparse_decode(deltas.len(), k, l.cr) {
                true => super::dct::kept_inverted(&mean, da, db),
                false => transformed(&mean, da, db, 1, true),
            };
            for (j, &i) in at.iter().enumerate() {
                dir[i] = if d[j] > 0.0 {
                    1.0
                } else if d[j] < 0.0 {
                    -1.0
                } else {
                    0.0
                };
            }
        }
        (msgs, dir)
    }

    /// The banded, parallel encoding and decoding (chunks read and written in place) equal the
    /// reference chunk by chunk, bit for bit: messages, the momentum left behind and the sign
    /// direction from three ranks' messages, on shapes with full and partial chunks.
    #[test]
    fn the_banded_encoding_and_decoding_equal_the_chunkwise_reference_bit_for_bit() {
        use rand::{Rng, SeedableRng};
        let tensors = Segment::from_shapes(&[
            (128, 192, true),
            (777, 1, false),
            (50, 129, true),
            (64, 64, true),
        ]);
        for (topk, chunk) in [(32, 64), (7, 16), (300, 64)] {
            let cfg = DemoConfig {
                topk,
                chunk,
                ..DemoConfig::default()
            };
            let mut demo = Demo::new(Box::new(crate::comm::Solo), cfg, 0.0, &tensors);
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(topk as u64);
            let mut deltas: Vec<Vec<f32>> = (0..3)
                .map(|_| {
                    (0..demo.numel)
                        .map(|_| rng.random_range(-1.0f32..1.0))
                        .collect()
                })
                .collect();
            deltas[1][5] = 0.0;
            let mut fast_deltas = deltas.clone();
            let (want_msgs, want_dir) = reference(&demo, &mut deltas);
            let mut all = Vec::new();
            for (delta, want) in fast_deltas.iter_mut().zip(&want_msgs) {
                let msg = demo.encode_as_is(delta);
                assert_eq!(
                    bits(&msg),
                    bits(want),
                    "messages, topk {topk}, chunk {chunk}"
                );
                all.extend(msg);
            }
            for (fast, slow) in fast_deltas.iter().zip(&deltas) {
                assert_eq!(
                    bits(fast),
                    bits(slow),
                    "momentum left, topk {topk}, chunk {chunk}"
                );
            }
            let all = Gathered::packed(all, 3);
            // The signs with plain stores, then past the caches (non-temporal where the CPU can).
            for stream_above in [STREAM_ABOVE, 0] {
                demo.stream_above = stream_above;
                let mut dir = vec![f32::NAN; demo.numel];
                demo.decode(&mut dir, &all, None).unwrap();
                assert_eq!(
                    bits(&dir),
                    bits(&want_dir),
                    "direction, topk {topk}, chunk {chunk}, streamed {}",
                    stream_above == 0
                );
                shared_decoding_matches(&demo, &all, &want_dir);
            }
        }
    }

    /// On a shared replica each of three ranks decodes the bands that meet its part: there, the
    /// direction of the whole decoding bit for bit; the bands that do not are left as they were.
    fn shared_decoding_matches(demo: &Demo, all: &Gathered, want: &[f32]) {
        let parts = Parts {
            len: demo.numel,
            n: 3,
            tile: 100,
        };
        for rank in 0..3 {
            let r = parts.of(rank);
            let mut dir = vec![f32::NAN; demo.numel];
            demo.decode(&mut dir, all, Some(r.clone())).unwrap();
            assert_eq!(bits(&dir[r.clone()]), bits(&want[r.clone()]), "rank {rank}");
            let left = dir.iter().filter(|d| d.is_nan()).count();
            assert!(
                left > 0 && dir[r].iter().all(|d| !d.is_nan()),
                "rank {rank}: {left}"
            );
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    /// The kernels' chunk table addresses what the host path does: each chunk's entries in the order
    /// of `Layout::indices`, message offsets where the host packs each chunk's [indices | values], the
    /// transforms' constants of its sizes, and scratch parts that tile the flat buffer.
    #[test]
    fn the_kernels_chunk_table_addresses_the_host_paths_chunks() {
        use crate::kernels::CHUNK_FIELDS;
        let tensors = Segment::from_shapes(&[(6, 8, true), (10, 1, false), (5, 12, true)]);
        let cfg = DemoConfig {
            topk: 5,
            chunk: 4,
            ..DemoConfig::default()
        };
        let demo = Demo::new(Box::new(crate::comm::Solo), cfg, 0.0, &tensors);
        let (table, dct, words) = demo.table();
        let chunks = demo.chunks();
        assert_eq!(table.len(), chunks.len() * CHUNK_FIELDS);
        let (mut msg, mut scratch) = (0, Vec::new());
        for (row, (l, c)) in table.chunks(CHUNK_FIELDS).zip(&chunks) {
            let f = |i: usize| row[i] as usize;
            let (base, cols, cr, cc, row0, col0, k) = (f(0), f(1), f(2), f(3), f(4), f(5), f(6));
            let at: Vec<usize> = (0..cr * cc)
                .map(|o| base + (row0 + o / cc) * cols + col0 + o % cc)
                .collect();
            assert_eq!(at, l.indices(*c).collect::<Vec<_>>());
            assert_eq!((k, f(7)), (kept(5, l), msg));
            msg += 2 * k;
            for (at, n) in [(f(8), cr), (f(9), cc)] {
                let words = Dct::new(n).words();
                assert_eq!(&dct[at..at + words.len()], &words[..]);
            }
            scratch.extend(f(10)..f(10) + cr * cc);
        }
        assert_eq!(words, msg);
        scratch.sort_unstable();
        assert_eq!(scratch, (0..demo.numel).collect::<Vec<_>>());
    }
}

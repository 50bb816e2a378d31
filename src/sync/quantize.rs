//! Quantized all-reduce of DiLoCo's pseudo-gradients (torchft's scheme): every rank quantizes its rows,
//! an all-to-all sends each row chunk to its owner, the owner dequantizes the N copies and averages them
//! in f32 (rank order), requantizes the mean, and an all-gather brings every chunk back. Each rank sends
//! 2 (N - 1) / N of the quantized payload, as a ring all-reduce does of the f32 one.
//!
//! Formats, row by row (a row is a matrix row, or a whole vector):
//! - bf16: round to nearest even; two values per wire word.
//! - fp8: e4m3 (the "fn" variant: no infinities, largest 448) after scaling the row so that its largest
//!   magnitude is 448, one f32 scale per row. Error: |x - q(x)| <= max(|x| 2^-4, scale 2^-10).
//! - uint8: 256 levels between the row's minimum and maximum (two f32 per row). Error <= (max - min) / 510.
//!
//! The wire carries bytes packed into f32 bit patterns (collectives move them, never add them), so the
//! communicator's byte counts are the true bytes sent.

use std::ops::Range;

use anyhow::Result;
use multiversion::multiversion;

use crate::comm::{chunk, Communicator};
use crate::config::backend::Quantize;
use crate::sync::trace::{Collective, Op, Overlap};

/// The largest finite e4m3 value.
const E4M3_MAX: f32 = 448.0;

/// The value of an e4m3 byte (sign, 4 exponent bits with bias 7, 3 mantissa bits; 0x7f/0xff are NaN),
/// computed from the bits rather than looked up, so that the decoding loop vectorizes (a table would be
/// a gather per byte): a normal code's exponent re-biased by 120 above its mantissa, a subnormal's
/// m x 2^-9 (exact), the NaN codes a quiet NaN, the sign on top.
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    let b = b as u32;
    let m = b & 0x7f;
    let normal = (m << 20) + (120 << 23);
    let subnormal = ((b & 7) as f32 * (1.0 / 512.0)).to_bits();
    let v = if m < 8 { subnormal } else { normal };
    let v = if m == 0x7f { 0x7fc0_0000 } else { v };
    f32::from_bits(v | (b & 0x80) << 24)
}

/// The smallest normal e4m3 magnitude, 2^-6.
const E4M3_MIN_NORMAL: f32 = 0.015625;

/// The nearest e4m3 byte (ties to even), saturating at +-448; NaN gives 0x7f. Every case is computed and
/// one is chosen, without branches, so that the encoding loop vectorizes.
#[inline(always)]
pub fn f32_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = bits & 0x7fff_ffff;
    let af = f32::from_bits(a);
    // Subnormal codes are multiples of 2^-9: the code is a x 2^9 (exact, below 8) rounded half to even,
    // by adding 2^23 (the sum's rounding is the hardware's, to nearest even), whose low mantissa bits
    // are then the integer; 8 is the smallest normal's code.
    const SHIFT: f32 = 8_388_608.0;
    let subnormal = (af * 512.0 + SHIFT).to_bits().wrapping_sub(SHIFT.to_bits());
    // Normal: the exponent re-biased above the top 3 mantissa bits, the 20 below them rounded half to
    // even by adding just under a half plus the kept last bit (a carry moves to the next exponent, as it
    // should; below 448 it never reaches 0x7f).
    let normal = ((a + 0x7_ffff + ((a >> 20) & 1)) >> 20).wrapping_sub(120 << 3);
    let magnitude = if af < E4M3_MIN_NORMAL {
        subnormal
    } else {
        normal
    };
    let magnitude = if af >= E4M3_MAX { 0x7e } else { magnitude };
    if a > 0x7f80_0000 {
        0x7f
    } else {
        sign | magnitude as u8
    }
}

/// `x.round().clamp(0.0, 255.0) as u8` for the x >= 0 (or NaN) of a uint8 row, without `round`'s
/// library call: the integer part, plus one where the fraction (exact below 2^23) is at least a half.
/// Every step is one a vector unit has (comparisons, truncation, and the integer read from the low
/// mantissa bits of level + 2^23, exact below 2^23), so that the encoding loop vectorizes.
#[inline(always)]
fn uint8_level(x: f32) -> u8 {
    const SHIFT: f32 = 8_388_608.0;
    let x = if x >= 0.0 { x } else { 0.0 };
    let x = if x < 256.0 { x } else { 256.0 };
    let t = x.trunc();
    let level = t + if x - t >= 0.5 { 1.0 } else { 0.0 };
    let level = if level < 255.0 { level } else { 255.0 };
    (level + SHIFT).to_bits().wrapping_sub(SHIFT.to_bits()) as u8
}

/// The bf16 bits of `x` (in the low half), as `half::bf16::from_f32`: round to nearest even, and a NaN
/// keeps its high bits with the quiet bit set. Branch-free, so that the encoding loop vectorizes.
#[inline(always)]
fn bf16_bits(x: f32) -> u32 {
    let b = x.to_bits();
    let up = u32::from(b & 0x8000 != 0 && b & 0x1_7fff != 0);
    let nan = b & 0x7fff_ffff > 0x7f80_0000;
    if nan {
        b >> 16 | 0x40
    } else {
        (b >> 16) + up
    }
}

/// The value of bf16 bits (the low 16 of `h`), as `half::bf16::to_f32`: a NaN gets the quiet bit.
#[inline(always)]
fn bf16_value(h: u32) -> f32 {
    let nan = h & 0x7fff > 0x7f80;
    f32::from_bits(if nan { (h | 0x40) << 16 } else { h << 16 })
}

/// Wire words of one row of `len` values.
pub fn row_words(q: Quantize, len: usize) -> usize {
    match q {
        Quantize::None => len,
        Quantize::Bf16 => len.div_ceil(2),
        Quantize::Fp8 => 1 + len.div_ceil(4),
        Quantize::Uint8 => 2 + len.div_ceil(4),
    }
}

/// Packs `f` of each value into f32 bit patterns, four bytes to a word (little-endian within the word; a
/// last partial word's high bytes are zero). The bytes are written in stream order, which on a
/// little-endian machine is the words' own memory order, so that the loop is a plain vectorizable map.
#[inline(always)]
fn pack(row: &[f32], f: impl Fn(f32) -> u8, out: &mut Vec<f32>) {
    let start = out.len();
    out.resize(start + row.len().div_ceil(4), 0.0);
    let words = &mut out[start..];
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(words);
    for (b, &x) in bytes.iter_mut().zip(row) {
        *b = f(x);
    }
    if cfg!(target_endian = "big") {
        words
            .iter_mut()
            .for_each(|w| *w = f32::from_bits(w.to_bits().swap_bytes()));
    }
}

/// `set(o, b)` for each output and its byte of `words` (as `pack` laid them out).
#[inline(always)]
fn unpack(words: &[f32], out: &mut [f32], set: impl Fn(&mut f32, u8)) {
    if cfg!(target_endian = "little") {
        let bytes: &[u8] = bytemuck::cast_slice(words);
        for (o, &b) in out.iter_mut().zip(bytes) {
            set(o, b);
        }
        return;
    }
    let bytes = words.iter().flat_map(|w| w.to_bits().to_le_bytes());
    for (o, b) in out.iter_mut().zip(bytes) {
        set(o, b);
    }
}

/// The larger of `m` and `x`, `m` where `x` is NaN: one vector instruction (`f32::max` is several, for
/// the case of a NaN `m`, which never arises here).
#[inline(always)]
fn max_of(m: f32, x: f32) -> f32 {
    if x > m {
        x
    } else {
        m
    }
}

/// The smaller of `m` and `x`, `m` where `x` is NaN (as `max_of`).
#[inline(always)]
fn min_of(m: f32, x: f32) -> f32 {
    if x < m {
        x
    } else {
        m
    }
}

/// Lanes of the reductions below: two 512-bit registers' worth, so that a 256- or 512-bit unit keeps
/// several independent chains of comparisons in flight.
const LANES: usize = 32;

/// The largest magnitude of `row` (NaNs left out; 0 for an empty row), in `LANES` lanes so that it
/// vectorizes: the maximum of any grouping is the same.
#[inline(always)]
fn max_abs(row: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let blocks = row.chunks_exact(LANES);
    let rest = blocks
        .remainder()
        .iter()
        .fold(0.0, |m, x| max_of(m, x.abs()));
    for b in blocks {
        for (l, x) in lanes.iter_mut().zip(b) {
            *l = max_of(*l, x.abs());
        }
    }
    lanes.into_iter().fold(rest, max_of)
}

/// The smallest and largest values of `row` (NaNs left out; (f32::MAX, f32::MIN) for none), in `LANES`
/// lanes. Only the sign of a zero extreme may depend on the grouping, and no decoded value depends on it.
#[inline(always)]
fn min_max(row: &[f32]) -> (f32, f32) {
    let (mut lo, mut hi) = ([f32::MAX; LANES], [f32::MIN; LANES]);
    let blocks = row.chunks_exact(LANES);
    let rest = blocks.remainder().iter();
    let rest = rest.fold((f32::MAX, f32::MIN), |(a, b), &x| {
        (min_of(a, x), max_of(b, x))
    });
    for b in blocks {
        for (l, &x) in lo.iter_mut().zip(b) {
            *l = min_of(*l, x);
        }
        for (h, &x) in hi.iter_mut().zip(b) {
            *h = max_of(*h, x);
        }
    }
    (
        lo.into_iter().fold(rest.0, min_of),
        hi.into_iter().fold(rest.1, max_of),
    )
}

/// Appends the encoding of `row` to `out`.
#[multiversion(targets = "simd")]
pub fn encode(q: Quantize, row: &[f32], out: &mut Vec<f32>) {
    match q {
        Quantize::None => out.extend_from_slice(row),
        Quantize::Bf16 => {
            let start = out.len();
            out.resize(start + row.len().div_ceil(2), 0.0);
            let words = &mut out[start..];
            let pairs = row.chunks_exact(2);
            if let [last] = pairs.remainder() {
                words[words.len() - 1] = f32::from_bits(bf16_bits(*last));
            }
            for (w, p) in words.iter_mut().zip(pairs) {
                *w = f32::from_bits(bf16_bits(p[0]) | bf16_bits(p[1]) << 16);
            }
        }
        Quantize::Fp8 => {
            let max = max_abs(row);
            let scale = if max > 0.0 { max / E4M3_MAX } else { 1.0 };
            out.push(scale);
            pack(row, |x| f32_to_e4m3(x / scale), out);
        }
        Quantize::Uint8 => {
            let (min, max) = min_max(row);
            let (min, max) = if row.is_empty() {
                (0.0, 0.0)
            } else {
                (min, max)
            };
            let scale = if max > min { (max - min) / 255.0 } else { 1.0 };
            out.extend([min, scale]);
            pack(row, |x| uint8_level((x - min) / scale), out);
        }
    }
}

/// Decodes one row of `out.len()` values from `words` (its `row_words` words).
#[multiversion(targets = "simd")]
pub fn decode(q: Quantize, words: &[f32], out: &mut [f32]) {
    decode_with(q, words, out, |o, v| *o = v);
}

/// Adds the decoding of one row to `out`, as `decode` decodes it.
#[multiversion(targets = "simd")]
fn decode_add(q: Quantize, words: &[f32], out: &mut [f32]) {
    decode_with(q, words, out, |o, v| *o += v);
}

/// Decodes one row as `decode` does, handing each output and its value to `set` (to assign or add).
#[inline(always)]
fn decode_with(q: Quantize, words: &[f32], out: &mut [f32], set: impl Fn(&mut f32, f32)) {
    match q {
        Quantize::None => out.iter_mut().zip(words).for_each(|(o, &v)| set(o, v)),
        Quantize::Bf16 => {
            let last = words.get(out.len() / 2).map(|w| w.to_bits() & 0xffff);
            let mut pairs = out.chunks_exact_mut(2);
            for (o, w) in (&mut pairs).zip(words) {
                let w = w.to_bits();
                set(&mut o[0], bf16_value(w & 0xffff));
                set(&mut o[1], bf16_value(w >> 16));
            }
            if let ([o], Some(h)) = (pairs.into_remainder(), last) {
                set(o, bf16_value(h));
            }
        }
        Quantize::Fp8 => {
            let scale = words[0];
            unpack(&words[1..], out, |o, b| set(o, e4m3_to_f32(b) * scale));
        }
        Quantize::Uint8 => {
            let (min, scale) = (words[0], words[1]);
            unpack(&words[2..], out, |o, b| set(o, min + b as f32 * scale));
        }
    }
}

/// Appends the encoding of `rows` of `buf`, concatenated, to `out`.
fn encode_rows(q: Quantize, buf: &[f32], rows: &[Range<usize>], out: &mut Vec<f32>) {
    out.reserve(rows.iter().map(|r| row_words(q, r.len())).sum());
    for r in rows {
        encode(q, &buf[r.clone()], out);
    }
}

/// The quantize kernels' table of `rows`: per row its start in the buffer, its length and its first
/// wire word (the rows' encodings concatenated in order, as `encode_rows` writes them); and the words of
/// them all.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn row_table(q: Quantize, rows: &[Range<usize>]) -> (Vec<u32>, usize) {
    let mut table = Vec::with_capacity(3 * rows.len());
    let mut word = 0;
    for r in rows {
        table.extend([r.start, r.len(), word].map(|x| x as u32));
        word += row_words(q, r.len());
    }
    (table, word)
}

/// Decodes the concatenated encoding of `rows` into `buf`.
fn decode_rows(q: Quantize, words: &[f32], rows: &[Range<usize>], buf: &mut [f32]) {
    let mut at = 0;
    for r in rows {
        let n = row_words(q, r.len());
        decode(q, &words[at..at + n], &mut buf[r.clone()]);
        at += n;
    }
}

/// One exchange round: `send(r)` goes to every other rank r, and `recv[r]` (sized by the caller) receives
/// rank r's message; this rank's own slot is left as it is.
fn all_to_all<'a>(
    comm: &mut dyn Communicator,
    send: impl Fn(usize) -> &'a [f32],
    recv: &mut [Vec<f32>],
) -> Result<()> {
    let (n, me) = (comm.world_size(), comm.rank());
    if n == 1 {
        return Ok(());
    }
    let sends: Vec<(usize, &[f32])> = (0..n).filter(|&r| r != me).map(|r| (r, send(r))).collect();
    let mut recvs: Vec<(usize, &mut [f32])> = recv
        .iter_mut()
        .enumerate()
        .filter(|(r, _)| *r != me)
        .map(|(r, c)| (r, &mut c[..]))
        .collect();
    comm.exchange(&sends, &mut recvs)
}

/// The two exchanges of [`all_reduce_mean`] over `world` ranks: every rank sends each owner its encoded
/// rows (a reduce-scatter), then each owner its requantized mean to all (an all-gather).
pub fn collectives(
    rows: &[Range<usize>],
    q: Quantize,
    world: usize,
    overlap: Overlap,
) -> Vec<Collective> {
    let pieces: Vec<u64> = (0..world)
        .map(|c| {
            rows[chunk(rows.len(), world, c)]
                .iter()
                .map(|r| row_words(q, r.len()) as u64)
                .sum()
        })
        .collect();
    vec![
        Collective::world(
            Op::ReduceScatter {
                pieces: pieces.clone(),
            },
            world,
            overlap,
        ),
        Collective::world(Op::AllGather { pieces }, world, overlap),
    ]
}

/// The message buffers of [`all_reduce_mean`], kept from one call to the next: a fresh buffer of a
/// model's size costs its page faults on every call (most of the codec's time on a CPU).
#[derive(Default)]
pub struct Scratch {
    /// This rank's encoding of each owner's rows.
    encoded: Vec<Vec<f32>>,
    /// Every other rank's encoding of my rows.
    copies: Vec<Vec<f32>>,
    /// My rows' mean, requantized.
    requantized: Vec<f32>,
    /// Every other owner's requantized mean.
    chunks: Vec<Vec<f32>>,
}

/// Sizes `bufs` to `n` buffers of `len(r)` words each (contents left to be overwritten).
fn size_buffers(bufs: &mut Vec<Vec<f32>>, n: usize, len: impl Fn(usize) -> usize) {
    bufs.resize_with(n, Vec::new);
    for (r, b) in bufs.iter_mut().enumerate() {
        b.resize(len(r), 0.0);
    }
}

/// The mean over ranks of `buf`, in place, through `q` on the wire; `rows` tile `buf` (in order).
/// `scratch` keeps the messages' buffers for the next call.
pub fn all_reduce_mean(
    comm: &mut dyn Communicator,
    buf: &mut [f32],
    rows: &[Range<usize>],
    q: Quantize,
    scratch: &mut Scratch,
) -> Result<()> {
    let (n, me) = (comm.world_size(), comm.rank());
    let Scratch {
        encoded,
        copies,
        requantized,
        chunks,
    } = scratch;
    // Row chunk c belongs to rank c.
    let owned: Vec<&[Range<usize>]> = (0..n).map(|c| &rows[chunk(rows.len(), n, c)]).collect();
    let words = |rs: &[Range<usize>]| rs.iter().map(|r| row_words(q, r.len())).sum::<usize>();
    // Every rank's copy of my rows arrives; mine is quantized like theirs, so every rank's share weighs
    // the same.
    encoded.resize_with(n, Vec::new);
    for (e, rs) in encoded.iter_mut().zip(&owned) {
        e.clear();
        encode_rows(q, buf, rs, e);
    }
    size_buffers(copies, n, |r| if r == me { 0 } else { words(owned[me]) });
    all_to_all(comm, |r| &encoded[r], copies)?;
    // The owner's mean in f32, rank order, requantized, and decoded as every other rank will decode it,
    // a row at a time (while it is in cache). My rows are one span of `buf`, which is encoded already.
    let inv = 1.0 / n as f32;
    requantized.clear();
    let mut at = 0;
    for row in owned[me] {
        let (w, mean) = (row_words(q, row.len()), &mut buf[row.clone()]);
        for (r, copy) in copies.iter().enumerate() {
            let copy = if r == me { &encoded[me] } else { copy };
            match r {
                0 => decode(q, &copy[at..at + w], mean),
                _ => decode_add(q, &copy[at..at + w], mean),
            }
        }
        mean.iter_mut().for_each(|x| *x *= inv);
        encode(q, mean, requantized);
        decode(q, &requantized[at..], mean);
        at += w;
    }
    // All-gather the requantized chunks, and decode the others' (mine are decoded above).
    size_buffers(chunks, n, |c| if c == me { 0 } else { words(owned[c]) });
    all_to_all(comm, |_| requantized, chunks)?;
    for (c, words) in chunks.iter().enumerate().filter(|&(c, _)| c != me) {
        decode_rows(q, words, owned[c], buf);
    }
    Ok(())
}

/// `all_reduce_mean` of a buffer on the GPU, with the engine's device collectives: the same steps, the
/// quantizers as the `quantize_rows` / `dequantize_rows` kernels (whose twins are `encode` and `decode`),
/// the exchanges as NCCL send/recv on device buffers.
#[cfg(feature = "cuda")]
pub fn all_reduce_mean_device(
    comm: &mut dyn Communicator,
    d: &mut crate::flat::DeviceFlat,
    rows: &[Range<usize>],
    q: Quantize,
) -> Result<()> {
    let mode = match q {
        Quantize::None => return crate::comm::all_reduce_mean_device(comm, &mut d.buf, &d.kernels),
        Quantize::Bf16 => 1,
        Quantize::Fp8 => 2,
        Quantize::Uint8 => 3,
    };
    let (n, me) = (comm.world_size(), comm.rank());
    let (k, s) = (d.kernels.clone(), d.kernels.stream().clone());
    // Every row's wire words, in row order: chunk c's rows (rank c owns them) are words[at[c]..at[c + 1]].
    let owned: Vec<Range<usize>> = (0..n).map(|c| chunk(rows.len(), n, c)).collect();
    let (table, total) = row_table(q, rows);
    let at: Vec<usize> = owned
        .iter()
        .map(|o| table.get(3 * o.start + 2).map_or(total, |&w| w as usize))
        .chain([total])
        .collect();
    let table = s.clone_htod(&table)?;
    let mut encoded = s.alloc_zeros::<f32>(total.max(1))?;
    // SAFETY: the table's rows tile d.buf (rows of the flat buffer) and their words end at `total`,
    // encoded's length.
    unsafe { k.quantize_rows(&d.buf.slice(..), &table, mode, &mut encoded) }?;
    // Every rank's copy of my rows, slot r for rank r (mine: my own encoding).
    let mine = at[me]..at[me + 1];
    let m = mine.len();
    let mut copies = s.alloc_zeros::<f32>((n * m).max(1))?;
    let others: Vec<usize> = (0..n).filter(|&r| r != me).collect();
    let sends: Vec<_> = others.iter().map(|&r| (r, at[r]..at[r + 1])).collect();
    let recvs: Vec<_> = others.iter().map(|&r| (r, r * m..(r + 1) * m)).collect();
    comm.exchange_device(&encoded, &sends, &mut copies, &recvs)?;
    s.memcpy_dtod(
        &encoded.slice(mine.clone()),
        &mut copies.slice_mut(me * m..(me + 1) * m),
    )?;
    let requantized = owner_mean(&k, (&copies, n, m), &rows[owned[me].clone()], (q, mode))?;
    let mut gathered = s.alloc_zeros::<f32>(total.max(1))?;
    s.memcpy_dtod(&requantized.slice(..m), &mut gathered.slice_mut(mine))?;
    let sends: Vec<_> = others.iter().map(|&r| (r, 0..m)).collect();
    let recvs: Vec<_> = others.iter().map(|&r| (r, at[r]..at[r + 1])).collect();
    comm.exchange_device(&requantized, &sends, &mut gathered, &recvs)?;
    // SAFETY: as for the encoding: gathered holds `total` words in the table's layout.
    unsafe { k.dequantize_rows(&gathered.slice(..), &table, mode, &mut d.buf.slice_mut(..)) }
}

/// The owner's part of the quantized all-reduce on the GPU: the mean of every rank's copy of my rows in
/// f32, rank order (the first copy decoded in place, the others added), times 1 / N, over the elements of
/// my rows; requantized into their m wire words (`copies` holds n copies of m words).
#[cfg(feature = "cuda")]
fn owner_mean(
    k: &crate::cuda::Kernels,
    (copies, n, m): (&cudarc::driver::CudaSlice<f32>, usize, usize),
    my_rows: &[Range<usize>],
    (q, mode): (Quantize, u32),
) -> Result<cudarc::driver::CudaSlice<f32>> {
    let s = k.stream();
    let span = my_rows.first().map_or(0, |r| r.start)..my_rows.last().map_or(0, |r| r.end);
    let mut local = Vec::with_capacity(3 * my_rows.len());
    let mut w = 0;
    for r in my_rows {
        local.extend([r.start - span.start, r.len(), w].map(|x| x as u32));
        w += row_words(q, r.len());
    }
    let local = s.clone_htod(&local)?;
    let mut mean = s.alloc_zeros::<f32>(span.len().max(1))?;
    let mut scratch = s.alloc_zeros::<f32>(span.len().max(1))?;
    for r in 0..n {
        let copy = copies.slice(r * m..(r + 1) * m);
        let target = if r == 0 { &mut mean } else { &mut scratch };
        // SAFETY: `local` lays my rows out from span.start (target's length is span.len()) and their
        // words from 0 (a copy holds m of them).
        unsafe { k.dequantize_rows(&copy, &local, mode, &mut target.slice_mut(..)) }?;
        if r > 0 {
            k.ef_accumulate(&mut mean, &scratch)?;
        }
    }
    k.scale(&mut mean, 1.0 / n as f32)?;
    let mut requantized = s.alloc_zeros::<f32>(m.max(1))?;
    // SAFETY: as above, mean holding span.len() floats and requantized m words.
    unsafe { k.quantize_rows(&mean.slice(..), &local, mode, &mut requantized) }?;
    Ok(requantized)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The row kernels (`quantize_rows`, `dequantize_rows`, run on the host by `kernels::emulate`, one
    /// block per row as `crate::cuda` launches them) write and read the host codec's words bit for bit,
    /// in each mode: rows longer than a block, short and empty ones, a constant row, zeros of both
    /// signs, values past fp8's range and a NaN.
    #[test]
    fn the_row_kernels_are_the_codec() {
        use crate::kernels::emulate::{Arg, Emulator, Source};
        let Some(e) = Emulator::get(Source::Reducers) else {
            return;
        };
        let lens = [1000, 1, 3, 0, 257, 64, 5];
        let mut buf: Vec<f32> = lens
            .iter()
            .enumerate()
            .flat_map(|(i, &n)| row(i as u64, n, [1.0, 1e-3, 600.0][i % 3]))
            .collect();
        buf[10] = -0.0;
        buf[11] = 0.0;
        buf[12] = 1e6;
        buf[1001] = f32::NAN;
        let (mut rows, mut at) = (Vec::new(), 0);
        for n in lens {
            rows.push(at..at + n);
            at += n;
        }
        // A constant row (uint8's min = max).
        buf[rows[5].clone()].fill(0.5);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (q, mode) in [
            (Quantize::Bf16, 1),
            (Quantize::Fp8, 2),
            (Quantize::Uint8, 3),
        ] {
            let (table, total) = row_table(q, &rows);
            let mut want = Vec::new();
            encode_rows(q, &buf, &rows, &mut want);
            let grid = (rows.len() as u32, 1);
            let mut args = [
                Arg::F32s(buf.clone()),
                Arg::U32s(table.clone()),
                Arg::U32(mode),
                Arg::F32s(vec![0.0; total]),
            ];
            e.launch("quantize_rows", grid, &mut args);
            assert_eq!(bits(args[3].f32s()), bits(&want), "{q:?}: the words");
            let mut back = vec![f32::NAN; buf.len()];
            decode_rows(q, &want, &rows, &mut back);
            let mut args = [
                Arg::F32s(want),
                Arg::U32s(table),
                Arg::U32(mode),
                Arg::F32s(vec![f32::NAN; buf.len()]),
            ];
            e.launch("dequantize_rows", grid, &mut args);
            assert_eq!(bits(args[3].f32s()), bits(&back), "{q:?}: decoded");
        }
    }

    fn row(seed: u64, len: usize, spread: f32) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..len)
            .map(|_| rng.random_range(-1.0f32..1.0) * spread)
            .collect()
    }

    fn round_trip(q: Quantize, x: &[f32]) -> Vec<f32> {
        let mut w = Vec::new();
        encode(q, x, &mut w);
        assert_eq!(w.len(), row_words(q, x.len()));
        let mut out = vec![0.0; x.len()];
        decode(q, &w, &mut out);
        out
    }

    /// The nearest e4m3 byte by binary search over the codes' values (ties to even): the definition
    /// `f32_to_e4m3` is checked against.
    fn e4m3_by_search(x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let a = x.abs();
        if a.is_nan() {
            return 0x7f;
        }
        if a >= E4M3_MAX {
            return sign | 0x7e;
        }
        let (mut lo, mut hi) = (0u8, 0x7eu8);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if e4m3_to_f32(mid) <= a {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let (dl, dh) = (a - e4m3_to_f32(lo), e4m3_to_f32(hi) - a);
        sign | if dl < dh || (dl == dh && lo % 2 == 0) {
            lo
        } else {
            hi
        }
    }

    /// The value of an e4m3 byte by its definition, sign x (1 + m/8) 2^(e-7), subnormals m/8 2^-6.
    fn e4m3_by_definition(b: u8) -> f32 {
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let (e, m) = (((b >> 3) & 0xf) as i32, (b & 7) as f32);
        let mag = if e == 0 {
            m / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f32.powi(e - 7)
        };
        sign * mag
    }

    /// The bit-level conversions equal the definitions: every code's value, and the nearest code of
    /// every code's value, the midpoints between codes and their neighbours one and two ulps away,
    /// and a million random floats of both signs across the range (and past it).
    #[test]
    fn e4m3_conversions_equal_their_definitions() {
        for b in 0..=255u8 {
            let (x, want) = (e4m3_to_f32(b), e4m3_by_definition(b));
            match b & 0x7f == 0x7f {
                true => assert_eq!(x.to_bits(), (b as u32 & 0x80) << 24 | 0x7fc0_0000),
                false => assert_eq!(x.to_bits(), want.to_bits(), "{b:#x}"),
            }
        }
        let mut probes: Vec<f32> = vec![
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            -f32::INFINITY,
            1e-30,
            1e6,
        ];
        for b in 0..0x7eu8 {
            let (lo, hi) = (e4m3_to_f32(b), e4m3_to_f32(b + 1));
            for x in [lo, (lo + hi) / 2.0] {
                for d in -2i32..=2 {
                    probes.push(f32::from_bits((x.to_bits() as i32 + d).max(0) as u32));
                }
            }
        }
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(3);
        for _ in 0..1_000_000 {
            let e = rand::Rng::random_range(&mut rng, -14.0f32..10.0);
            let s = if rand::Rng::random::<bool>(&mut rng) {
                1.0
            } else {
                -1.0
            };
            probes.push(s * 2f32.powf(e));
        }
        for x in probes.iter().flat_map(|&x| [x, -x]) {
            assert_eq!(
                f32_to_e4m3(x),
                e4m3_by_search(x),
                "{x:e} ({:#x})",
                x.to_bits()
            );
        }
    }

    /// The wire layout (which the GPU kernels share): fp8 is the row's scale, then its codes four to a
    /// word, little-endian, a last partial word padded with zeros; uint8 the minimum and the step first.
    #[test]
    fn bytes_pack_four_to_a_little_endian_word() {
        let row = [448.0f32, -448.0, 1.0, 0.0, 2.0];
        let mut out = Vec::new();
        encode(Quantize::Fp8, &row, &mut out);
        let codes: Vec<u32> = row.iter().map(|&x| f32_to_e4m3(x) as u32).collect();
        let words: Vec<u32> = out[1..].iter().map(|w| w.to_bits()).collect();
        assert_eq!(out[0], 1.0);
        assert_eq!(
            words,
            [
                codes[0] | codes[1] << 8 | codes[2] << 16 | codes[3] << 24,
                codes[4]
            ]
        );
        let mut back = [0.0f32; 5];
        decode(Quantize::Fp8, &out, &mut back);
        assert_eq!(back, row);
        let (mut u, mut back) = (Vec::new(), [0.0f32; 5]);
        encode(Quantize::Uint8, &[0.0, 255.0, 1.0, 2.0, 3.0], &mut u);
        assert_eq!(
            (u[0], u[1], u[2].to_bits(), u[3].to_bits()),
            (0.0, 1.0, 0x0201_ff00, 3)
        );
        decode(Quantize::Uint8, &u, &mut back);
        assert_eq!(back, [0.0, 255.0, 1.0, 2.0, 3.0]);
    }

    /// bf16 both ways equals the `half` crate on every high half with the low halves that decide the
    /// rounding (NaNs included), and through the wire format on rows of odd and even lengths.
    #[test]
    fn bf16_conversions_equal_the_half_crates_on_every_rounding_case() {
        for h in 0..=0xffffu32 {
            let want = half::bf16::from_bits(h as u16).to_f32().to_bits();
            assert_eq!(bf16_value(h).to_bits(), want, "bits {h:#06x}");
            for low in [0, 1, 0x7fff, 0x8000, 0x8001, 0xbfff, 0xc000, 0xffff] {
                let x = f32::from_bits(h << 16 | low);
                let want = half::bf16::from_f32(x).to_bits() as u32;
                assert_eq!(bf16_bits(x), want, "{:#010x}", x.to_bits());
            }
        }
        // Rows of odd and even lengths, through the wire format.
        for len in [0, 1, 2, 7, 64] {
            let x = row(len as u64, len, 3.0);
            let want: Vec<f32> = x
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect();
            assert_eq!(round_trip(Quantize::Bf16, &x), want);
        }
    }

    /// uint8's level equals rounding half away from zero and clamping, on halves, their neighbours,
    /// the range's ends and past them.
    #[test]
    fn uint8_levels_round_half_away_from_zero() {
        let mut xs = vec![
            0.0f32,
            -0.0,
            255.0,
            255.5,
            256.0,
            1e9,
            f32::INFINITY,
            f32::NAN,
            0.49999997,
        ];
        for k in 0..300 {
            let half = k as f32 + 0.5;
            for d in -2i32..=2 {
                xs.push(f32::from_bits((half.to_bits() as i32 + d) as u32));
            }
        }
        for x in xs {
            assert_eq!(uint8_level(x), x.round().clamp(0.0, 255.0) as u8, "{x}");
        }
    }

    #[test]
    fn e4m3_codes_round_trip_and_round_to_nearest() {
        for b in 0..=255u8 {
            let x = e4m3_to_f32(b);
            if !x.is_nan() {
                assert_eq!(f32_to_e4m3(x), b, "{b:#x} = {x}");
            }
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(f32_to_e4m3(1e6), 0x7e);
        // 1.0625 lies halfway between 1.0 (mantissa 0, even) and 1.125: ties go to even.
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.0625)), 1.0);
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.1)), 1.125);
    }

    /// A row's encoding as written before it was vectorized: one value at a time, the extremes by a
    /// serial fold, bytes packed word by word, e4m3 bytes by binary search.
    fn encode_by_reference(q: Quantize, row: &[f32]) -> Vec<f32> {
        let word = |c: &[u8]| {
            let w = c.iter().rev().fold(0u32, |w, &b| w << 8 | b as u32);
            f32::from_bits(w)
        };
        let packed = |f: &dyn Fn(f32) -> u8| {
            let bytes: Vec<u8> = row.iter().map(|&x| f(x)).collect();
            bytes.chunks(4).map(word).collect::<Vec<f32>>()
        };
        match q {
            Quantize::None => row.to_vec(),
            Quantize::Bf16 => row
                .chunks(2)
                .map(|p| {
                    let h: Vec<u32> = p
                        .iter()
                        .map(|&x| half::bf16::from_f32(x).to_bits() as u32)
                        .collect();
                    f32::from_bits(h[0] | h.get(1).map_or(0, |h| h << 16))
                })
                .collect(),
            Quantize::Fp8 => {
                let max = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let scale = if max > 0.0 { max / E4M3_MAX } else { 1.0 };
                let mut w = vec![scale];
                w.extend(packed(&|x| e4m3_by_search(x / scale)));
                w
            }
            Quantize::Uint8 => {
                let min = row.iter().fold(f32::MAX, |m, &x| m.min(x));
                let max = row.iter().fold(f32::MIN, |m, &x| m.max(x));
                let (min, max) = if row.is_empty() {
                    (0.0, 0.0)
                } else {
                    (min, max)
                };
                let scale = if max > min { (max - min) / 255.0 } else { 1.0 };
                let level = |x: f32| ((x - min) / scale).round().clamp(0.0, 255.0) as u8;
                let mut w = vec![min, scale];
                w.extend(packed(&level));
                w
            }
        }
    }

    /// A row's decoding, one value at a time from the definitions (`e4m3_by_definition`, `half`).
    fn decode_by_reference(q: Quantize, words: &[f32], len: usize) -> Vec<f32> {
        let byte = |i: usize, w: &[f32]| (w[i / 4].to_bits() >> (8 * (i % 4))) as u8;
        (0..len)
            .map(|i| match q {
                Quantize::None => words[i],
                Quantize::Bf16 => {
                    let h = (words[i / 2].to_bits() >> (16 * (i % 2))) as u16;
                    half::bf16::from_bits(h).to_f32()
                }
                Quantize::Fp8 => match byte(i, &words[1..]) {
                    b if b & 0x7f == 0x7f => f32::NAN,
                    b => e4m3_by_definition(b) * words[0],
                },
                Quantize::Uint8 => words[0] + byte(i, &words[2..]) as f32 * words[1],
            })
            .collect()
    }

    /// Rows of every length up to 40 and around a GPT-2 row's 768, spread over 40 binary orders of
    /// magnitude, with zeros of both signs, halves between uint8 levels, infinities and NaNs dropped in.
    fn probe_rows() -> Vec<Vec<f32>> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        let lens = (0..=40).chain([767, 768, 769, 3072]);
        let specials = [
            0.0,
            -0.0,
            0.5,
            254.5,
            f32::INFINITY,
            -f32::INFINITY,
            f32::NAN,
        ];
        let mut rows = Vec::new();
        for (k, len) in lens.enumerate() {
            for special in [false, true] {
                let e = rng.random_range(-30.0f32..10.0);
                let mut r = row(k as u64, len, 2f32.powf(e));
                if special && len > 0 {
                    for _ in 0..3 {
                        let at = rng.random_range(0..len);
                        r[at] = specials[rng.random_range(0..specials.len())];
                    }
                }
                rows.push(r);
            }
        }
        rows.push((0..256).map(|i| i as f32 - 0.5).collect());
        rows.push(vec![-0.0, 0.0, -0.0, 0.0, 0.0, -0.0, 0.0, -0.0, 0.0]);
        rows
    }

    /// The vectorized encoding and decoding (the widest this machine runs) equal the value-at-a-time
    /// reference, bit for bit: every word (NaNs as NaNs; uint8's minimum, where it is a zero, by value,
    /// as its sign depends on the order the extremes are taken in and no decoded value depends on it).
    #[test]
    fn vectorized_codecs_equal_the_value_at_a_time_reference() {
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        for q in [Quantize::Bf16, Quantize::Fp8, Quantize::Uint8] {
            for r in probe_rows() {
                let mut got = Vec::new();
                encode(q, &r, &mut got);
                let want = encode_by_reference(q, &r);
                assert_eq!(got.len(), want.len(), "{q:?} len {}", r.len());
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    let zero_min = q == Quantize::Uint8 && i == 0 && g == 0.0 && w == 0.0;
                    assert!(
                        same(g, w) || zero_min,
                        "{q:?} {r:?}: word {i} {g:e} != {w:e}"
                    );
                }
                let want = decode_by_reference(q, &got, r.len());
                let mut out = vec![7.0f32; r.len()];
                decode(q, &got, &mut out);
                let mut sum = r.clone();
                decode_add(q, &got, &mut sum);
                for i in 0..r.len() {
                    assert!(same(out[i], want[i]), "{q:?} {r:?}: value {i}");
                    assert!(same(sum[i], r[i] + want[i]), "{q:?} {r:?}: sum {i}");
                }
            }
        }
    }

    #[test]
    fn round_trips_stay_within_their_stated_error() {
        for (seed, len, spread) in [(1, 1, 1.0), (2, 7, 1e-3), (3, 64, 5.0), (4, 1000, 1e4)] {
            let x = row(seed, len, spread);
            assert_eq!(round_trip(Quantize::None, &x), x);
            let max = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let (lo, hi) = x
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
            for (q, bound) in [
                (Quantize::Bf16, None),
                (Quantize::Fp8, Some(max / E4M3_MAX * 2f32.powi(-10))),
                (Quantize::Uint8, Some((hi - lo) / 510.0)),
            ] {
                for (a, b) in x.iter().zip(round_trip(q, &x)) {
                    let err = (a - b).abs();
                    let ok = match (q, bound) {
                        (Quantize::Bf16, _) => err <= a.abs() * 2f32.powi(-8),
                        (Quantize::Fp8, Some(floor)) => {
                            err <= (a.abs() * 2f32.powi(-4)).max(floor) * 1.0001
                        }
                        (_, Some(b)) => err <= b * 1.0001 + 1e-7 * a.abs(),
                        _ => unreachable!(),
                    };
                    assert!(ok, "{q:?} len {len}: {a} -> {b} (error {err})");
                }
            }
        }
        // A constant row and an empty one survive uint8 and fp8.
        assert_eq!(round_trip(Quantize::Uint8, &[3.5; 5]), vec![3.5; 5]);
        assert_eq!(round_trip(Quantize::Fp8, &[0.0; 3]), vec![0.0; 3]);
        assert!(round_trip(Quantize::Uint8, &[]).is_empty());
    }

    #[test]
    fn quantized_mean_is_the_mean_of_the_quantized_rows_on_every_rank() {
        let (n, len) = (3usize, 23usize);
        let rows: Vec<Range<usize>> = vec![0..5, 5..6, 6..16, 16..23];
        for q in [
            Quantize::None,
            Quantize::Bf16,
            Quantize::Fp8,
            Quantize::Uint8,
        ] {
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| row(10 + r as u64, len, 2.0)).collect();
            let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
                let hs: Vec<_> = crate::comm::local::group(n, std::time::Duration::from_secs(10))
                    .into_iter()
                    .map(|mut c| {
                        let (rows, mut buf) = (&rows, inputs[c.rank()].clone());
                        s.spawn(move || {
                            all_reduce_mean(&mut c, &mut buf, rows, q, &mut Scratch::default())
                                .unwrap();
                            buf
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for o in &outs[1..] {
                assert_eq!(o, &outs[0], "{q:?}: ranks disagree");
            }
            // The oracle: quantize each rank's rows, average in rank order, quantize the mean.
            let mut want = vec![0.0f32; len];
            for (r, x) in inputs.iter().enumerate() {
                for rw in &rows {
                    let d = round_trip(q, &x[rw.clone()]);
                    for (w, v) in want[rw.clone()].iter_mut().zip(d) {
                        *w = if r == 0 { v } else { *w + v };
                    }
                }
            }
            want.iter_mut().for_each(|w| *w *= 1.0 / n as f32);
            for rw in &rows {
                let d = round_trip(q, &want[rw.clone()]);
                want[rw.clone()].copy_from_slice(&d);
            }
            assert_eq!(outs[0], want, "{q:?}");
            if q == Quantize::None {
                // f32 on the wire: the plain all-reduce's result, bit for bit.
                let plain: Vec<Vec<f32>> = std::thread::scope(|s| {
                    let hs: Vec<_> =
                        crate::comm::local::group(n, std::time::Duration::from_secs(10))
                            .into_iter()
                            .map(|mut c| {
                                let mut buf = inputs[c.rank()].clone();
                                s.spawn(move || {
                                    crate::comm::all_reduce_mean(&mut c, &mut buf).unwrap();
                                    buf
                                })
                            })
                            .collect();
                    hs.into_iter().map(|h| h.join().unwrap()).collect()
                });
                assert_eq!(outs[0], plain[0]);
            }
        }
    }
}

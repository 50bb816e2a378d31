//! CPU twins of the CUDA kernels in `kernels/reducers.cu`. Each function here implements its kernel's
//! algorithm with the same blocking and the same order of floating-point operations, so a kernel and its twin
//! agree bit for bit (the kernels are compiled with `-fmad=false`). The compressed reducers run on these
//! twins on CPU; the property tests below pin their behaviour; the tests run each kernel's own source on the
//! host against its twin (`emulate`); the GPU self-test (`scripts/gpu/selftest.py`) compares every kernel
//! with its twin on a GPU. The host-side steps between kernel launches (the digit search of the radix select,
//! the scan of the tile counts) are shared with the CUDA launchers in `crate::cuda`.

pub mod amx;
mod chacha;
mod compact;
#[cfg(test)]
pub(crate) mod emulate;
pub mod gemm;
pub mod model;
pub mod optim;
mod segment;
mod stream;
pub use stream::{sign, with_sign_stream, SignStream};
pub mod thin;
mod transpose;

pub use chacha::{chacha8_word, ChaCha8};
pub use segment::Segment;
pub use transpose::transpose;

use anyhow::{ensure, Result};
use compact::{candidates, difference_candidates, take};
use rayon::prelude::*;

/// Threads per block; also the 256 buckets of an 8-bit radix digit (`BLOCK` in reducers.cu).
pub const BLOCK: usize = 256;
/// Elements per block of the selection kernels (`TILE` in reducers.cu).
pub const TILE: usize = 4096;
/// Grid-stride kernels stop growing the grid here (enough blocks to fill an H100 several times).
pub const MAX_BLOCKS: usize = 4096;

/// Blocks of a grid-stride kernel over `n` elements: one thread each, up to `MAX_BLOCKS` blocks.
pub fn per_element_blocks(n: usize) -> usize {
    n.div_ceil(BLOCK).clamp(1, MAX_BLOCKS)
}

/// u32 words per chunk in the table of DeMo's kernels (`struct Chunk` in reducers.cu).
pub const CHUNK_FIELDS: usize = 11;

/// |v| as an order-preserving integer: the bits of a non-negative float sort like the float.
fn abs_key(v: f32) -> u32 {
    v.to_bits() & 0x7fff_ffff
}

/// The k largest keys: every key above `key`, and the first `ties` keys (in index order) equal to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Threshold {
    pub key: u32,
    pub ties: u32,
}

/// The radix select's search, digit by digit from the top (8 bits a pass): `histogram(prefix, mask,
/// shift)` counts the digit `(key >> shift) & 255` of the keys whose higher bits equal `prefix`; the
/// search walks the buckets from the top until it has `k` keys. Needs 1 <= k <= the number of keys.
pub fn radix_threshold(
    k: usize,
    mut histogram: impl FnMut(u32, u32, u32) -> Result<[u32; BLOCK]>,
) -> Result<Threshold> {
    ensure!(k > 0, "radix select of zero entries");
    let (mut need, mut prefix, mut mask) = (k as u64, 0u32, 0u32);
    for shift in [24u32, 16, 8, 0] {
        let h = histogram(prefix, mask, shift)?;
        let mut d = BLOCK - 1;
        while (h[d] as u64) < need {
            need -= h[d] as u64;
            ensure!(
                d > 0,
                "radix select: the histogram holds fewer than {k} keys"
            );
            d -= 1;
        }
        prefix |= (d as u32) << shift;
        mask |= 255 << shift;
    }
    Ok(Threshold {
        key: prefix,
        ties: need as u32,
    })
}

/// Twin of `radix_histogram`.
pub fn radix_histogram(x: &[f32], prefix: u32, mask: u32, shift: u32) -> [u32; BLOCK] {
    let mut h = [0u32; BLOCK];
    for &v in x {
        let k = abs_key(v);
        if k & mask == prefix {
            h[((k >> shift) & 255) as usize] += 1;
        }
    }
    h
}

/// Twin of `select_count`: per tile, the keys above the threshold and the keys equal to it.
pub fn select_count(x: &[f32], thresh: u32) -> (Vec<u32>, Vec<u32>) {
    x.par_chunks(TILE)
        .map(|tile| {
            tile.iter().fold((0u32, 0u32), |(a, e), &v| {
                let k = abs_key(v);
                (a + u32::from(k > thresh), e + u32::from(k == thresh))
            })
        })
        .unzip()
}

/// Exclusive prefix sums (the host step between `select_count` and `select_write`).
pub fn exclusive_scan(counts: &[u32]) -> Vec<u32> {
    let mut run = 0u32;
    counts
        .iter()
        .map(|&c| {
            let before = run;
            run += c;
            before
        })
        .collect()
}

/// Twin of `select_write`: entry i is selected when its key is above the threshold, or equal to it and
/// among the first `ties` equal keys; it goes to slot above_before(i) + min(equal_before(i), ties).
pub fn select_write(
    x: &[f32],
    t: Threshold,
    above_off: &[u32],
    equal_off: &[u32],
    base: u32,
    out_idx: &mut [u32],
    out_val: &mut [f32],
) {
    // Tile j fills the slots from its first selected entry's to the next tile's: split the outputs so
    // that the tiles write in parallel.
    let first = |j: usize| (above_off[j] + equal_off[j].min(t.ties)) as usize;
    let mut parts = Vec::with_capacity(above_off.len());
    let (mut idx_rest, mut val_rest) = (out_idx, out_val);
    for j in 0..above_off.len() {
        let end = if j + 1 < above_off.len() {
            first(j + 1)
        } else {
            first(j) + idx_rest.len()
        };
        let len = end - first(j);
        let (i, ir) = std::mem::take(&mut idx_rest).split_at_mut(len);
        let (v, vr) = std::mem::take(&mut val_rest).split_at_mut(len);
        (idx_rest, val_rest) = (ir, vr);
        parts.push((j, i, v));
    }
    parts.into_par_iter().for_each(|(j, idx, val)| {
        let (mut pa, mut pe, mut slot) = (above_off[j], equal_off[j], 0);
        let start = j * TILE;
        for (i, &v) in x[start..(start + TILE).min(x.len())].iter().enumerate() {
            let k = abs_key(v);
            let take = k > t.key || (k == t.key && pe < t.ties);
            if take {
                debug_assert_eq!(
                    (pa + pe.min(t.ties)) as usize,
                    first(j) + slot,
                    "slot order"
                );
                idx[slot] = base + (start + i) as u32;
                val[slot] = v;
                slot += 1;
            }
            pa += u32::from(k > t.key);
            pe += u32::from(k == t.key);
        }
    });
}

/// The `k` entries of largest magnitude of `x` (ties towards lower indices), in index order, appended
/// to `idx` as `base + i` and to `val`: the radix select of the threshold, then the compaction. No sort.
/// A small `k` of a long `x` goes through `top_k_of_candidates` (one pass over `x`), a short `x` through
/// `top_k_short`; the same entries.
pub fn top_k(x: &[f32], k: usize, base: u32, idx: &mut Vec<u32>, val: &mut Vec<f32>) {
    let k = k.min(x.len());
    if k == 0 || top_k_of_candidates(x, k, base, idx, val) {
        return;
    }
    if x.len() <= SHORT {
        return top_k_short(x, k, base, idx, val);
    }
    let t = radix_threshold(k, |p, m, s| Ok(radix_histogram(x, p, m, s)))
        .expect("the histograms of a slice count every key");
    let (above, equal) = select_count(x, t.key);
    let (above_off, equal_off) = (exclusive_scan(&above), exclusive_scan(&equal));
    let start = idx.len();
    idx.resize(start + k, 0);
    val.resize(start + k, 0.0);
    select_write(
        x,
        t,
        &above_off,
        &equal_off,
        base,
        &mut idx[start..],
        &mut val[start..],
    );
}

/// Inputs up to this length (a DeMo chunk: 4096) are selected by `top_k_short`: the radix select's
/// four 256-bin histograms and scans, its tiles and their scans cost more than such an input.
const SHORT: usize = 1 << 15;

/// Floors `top_k_short` tries, a power of two apart, before it leaves the input to `top_k_by_select`.
const FLOORS: u32 = 8;

/// `top_k` on one core, in a few vectorized passes: a floor that a little over k keys reach (from a
/// sample of `x`, `sampled_floor`; where the sample's floor lets fewer than k through, or `x` is too short
/// to sample, the largest power of two that at least k keys reach, `power_floor`, else
/// `top_k_by_select`), the entries reaching it (`candidates`, in index order), the threshold among them
/// (`threshold`), and the selection (`take`). `top_k` itself for short inputs, and DeMo's
/// chunks.
#[multiversion::multiversion(targets = "simd")]
pub fn top_k_short(x: &[f32], k: usize, base: u32, idx: &mut Vec<u32>, val: &mut Vec<f32>) {
    let k = k.min(x.len());
    if k == 0 {
        return;
    }
    let sampled = sampled_floor(x.len(), k, |i| x[i])
        .map(|floor| candidates(x, 0, floor))
        .filter(|(i, _)| i.len() >= k);
    let (cand_i, cand_v) = match sampled {
        Some(c) => c,
        None => match power_floor(x, k) {
            Some(floor) => candidates(x, 0, floor),
            None => return top_k_by_select(x, k, base, idx, val),
        },
    };
    take_top_k(&cand_i, &cand_v, k, base, idx, val);
}

/// `top_k_short` of the difference x - hat (entry by entry, the f32 subtraction `x[i] - hat[i]`), the
/// same entries, without writing the difference out: the sample and the candidates form it as they read
/// x and hat (`difference_candidates`). CHOCO's encoding of x - x_hat, which runs on every worker at once
/// and selects a tenth of each tensor. Where the sample's floor does not serve, the difference is formed
/// whole and goes to `top_k_short`.
pub fn top_k_of_difference(
    x: &[f32],
    hat: &[f32],
    k: usize,
    base: u32,
    idx: &mut Vec<u32>,
    val: &mut Vec<f32>,
) {
    assert_eq!(x.len(), hat.len(), "x - hat of unequal lengths");
    let k = k.min(x.len());
    if k == 0 {
        return;
    }
    let sampled = sampled_floor(x.len(), k, |i| x[i] - hat[i])
        .map(|floor| difference_candidates(x, hat, 0, floor))
        .filter(|(i, _)| i.len() >= k);
    match sampled {
        Some((cand_i, cand_v)) => take_top_k(&cand_i, &cand_v, k, base, idx, val),
        None => {
            let diff: Vec<f32> = x.iter().zip(hat).map(|(a, b)| a - b).collect();
            top_k_short(&diff, k, base, idx, val);
        }
    }
}

/// The k largest of at least k candidates that hold an input's k largest (in index order), appended:
/// the `threshold` of their keys, then `take`.
fn take_top_k(
    cand_i: &[u32],
    cand_v: &[f32],
    k: usize,
    base: u32,
    idx: &mut Vec<u32>,
    val: &mut Vec<f32>,
) {
    let mut keys: Vec<u32> = cand_v.iter().map(|&v| abs_key(v)).collect();
    let t = threshold(&mut keys, k);
    take(cand_i, cand_v, t, k, base, idx, val);
}

/// Up to this many keys (256 KB, a core's L2), `threshold` counts bit by bit; past it the counting
/// passes cost more than `select_nth_unstable`'s partitions.
const BITWISE_KEYS: usize = 1 << 16;

/// A key that the k largest of `keys` reach and no other key does, where ties at the k-th largest
/// allow one; else the k-th largest itself (1 <= k <= keys.len(); `keys` may be reordered). Either way
/// the keys above it, then the first of those equal to it, are the k largest, which is all `take` and
/// a sample's floor ask of it. Up to `BITWISE_KEYS` keys it is built from the top bit down: t keeps each
/// bit with which at least k keys still reach it, and stops where exactly k do (a DeMo chunk's sample of
/// 256 keys and its few hundred candidates: under half the time of `select_nth_unstable`); past that,
/// the k-th largest by `select_nth_unstable`.
fn threshold(keys: &mut [u32], k: usize) -> u32 {
    let n = keys.len();
    assert!(1 <= k && k <= n, "the {k} largest of {n} keys");
    if n > BITWISE_KEYS {
        return *keys.select_nth_unstable(n - k).1;
    }
    threshold_bitwise(keys, k)
}

/// `threshold` bit by bit. The count of keys reaching t only falls as t grows, so without an exact k
/// on the way t ends at the largest value that k keys reach: the k-th largest key.
#[multiversion::multiversion(targets = "simd")]
fn threshold_bitwise(keys: &[u32], k: usize) -> u32 {
    let mut t = 0u32;
    for bit in (0..32).rev() {
        let c = t | 1 << bit;
        let reach = keys.iter().map(|&x| u32::from(x >= c)).sum::<u32>() as usize;
        if reach >= k {
            t = c;
            if reach == k {
                break;
            }
        }
    }
    t
}

/// A key that about k + 3 standard deviations of the sample's count of the `n` entries' keys reach
/// (`value(i)`: entry i), from `sampled_key` over up to `SAMPLES` keys. None for fewer than 4096
/// entries, or a k too close to their number.
fn sampled_floor(n: usize, k: usize, value: impl Fn(usize) -> f32) -> Option<u32> {
    if n < 4096 {
        return None;
    }
    let samples = (n / 16).min(SAMPLES);
    let expected = k as f64 * samples as f64 / n as f64;
    let at = (expected + 3.0 * expected.sqrt() + 8.0) as usize;
    if at >= samples {
        return None;
    }
    Some(sampled_key(n, samples, at, value))
}

/// The key with `at` keys above it among `samples` keys of the `n` entries (`value(i)`: entry i), one
/// from each of `samples` equal spans at a pseudo-random place in it (an evenly strided sample aliases
/// with a matrix's rows or any other period of the data). `at < samples <= n`.
fn sampled_key(n: usize, samples: usize, at: usize, value: impl Fn(usize) -> f32) -> u32 {
    let stride = n / samples;
    let mut sample: Vec<u32> = (0..samples)
        .map(|i| abs_key(value(sample_at(i, stride))))
        .collect();
    threshold(&mut sample, at + 1)
}

/// The largest power of two that at least k of `x`'s keys reach, counted from the largest key's
/// exponent down, at most `FLOORS` tries.
#[multiversion::multiversion(targets = "simd")]
fn power_floor(x: &[f32], k: usize) -> Option<u32> {
    let top = x.iter().fold(0u32, |m, &v| m.max(abs_key(v))) >> 23;
    let reaching = |floor: u32| {
        x.iter()
            .map(|&v| u32::from(abs_key(v) >= floor))
            .sum::<u32>()
    };
    (0..FLOORS.min(top + 1))
        .map(|e| (top - e) << 23)
        .find(|&f| reaching(f) as usize >= k)
}

/// `top_k`'s entries on one core, without its parallel passes: the threshold key by one
/// `select_nth_unstable` of the keys, then one scan taking the keys above it and the first of those
/// equal to it, in index order (the reference the faster selections are held to, and
/// `top_k_short`'s fallback).
pub fn top_k_by_select(x: &[f32], k: usize, base: u32, idx: &mut Vec<u32>, val: &mut Vec<f32>) {
    let k = k.min(x.len());
    if k == 0 {
        return;
    }
    let mut keys: Vec<u32> = x.iter().map(|&v| abs_key(v)).collect();
    let n = keys.len();
    let (_, &mut t, above) = keys.select_nth_unstable(n - k);
    let mut ties = k - above.iter().filter(|&&a| a > t).count();
    for (i, &v) in x.iter().enumerate() {
        let key = abs_key(v);
        if key > t || (key == t && ties > 0) {
            ties -= usize::from(key == t);
            idx.push(base + i as u32);
            val.push(v);
        }
    }
}

/// Keys sampled from `x` to place the candidates' threshold.
const SAMPLES: usize = 2048;

/// Where sample `i` is taken: a pseudo-random place (a Fibonacci hash of i) in the i-th span of `stride`.
fn sample_at(i: usize, stride: usize) -> usize {
    let h = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32;
    i * stride + h as usize % stride
}

/// `top_k` on the host for a `k` below a sixteenth of a long `x`, in one pass over it: a key that about
/// 1.5 k keys reach, from a sample of `x`; every entry reaching it, with its index (the
/// candidates); the threshold of `radix_threshold` over the candidates' keys, which hold the k largest
/// of `x` when there are k of them, so it is `x`'s; then the selection in index order. False (nothing
/// appended) where it does not apply, or the sample's key let fewer than k through or too many.
fn top_k_of_candidates(
    x: &[f32],
    k: usize,
    base: u32,
    idx: &mut Vec<u32>,
    val: &mut Vec<f32>,
) -> bool {
    if x.len() < 16 * SAMPLES || 16 * k > x.len() {
        return false;
    }
    let at = (k * SAMPLES / x.len() * 3 / 2 + 16).min(SAMPLES - 1);
    let floor = sampled_key(x.len(), SAMPLES, at, |i| x[i]);
    // Past 4 k + SAMPLES candidates (ties at the sample's key, or a sample far off) the full selection
    // runs instead: it is then the cheaper one.
    let cap = 4 * k + SAMPLES;
    let spans: Vec<(Vec<u32>, Vec<f32>)> = x
        .par_chunks(1 << 16)
        .enumerate()
        .map(|(s, span)| candidates(span, s << 16, floor))
        .collect();
    let total: usize = spans.iter().map(|(i, _)| i.len()).sum();
    if total < k || total > cap {
        return false;
    }
    let (mut cand_i, mut cand_v) = (Vec::with_capacity(total), Vec::with_capacity(total));
    for (i, v) in &spans {
        cand_i.extend_from_slice(i);
        cand_v.extend_from_slice(v);
    }
    let t = radix_threshold(k, |p, m, s| Ok(radix_histogram(&cand_v, p, m, s)))
        .expect("the histograms of a slice count every key");
    take(&cand_i, &cand_v, t.key, k, base, idx, val);
    true
}

/// Twin of `gather`: out[j] = x[idx[j]].
pub fn gather(x: &[f32], idx: &[u32], out: &mut [f32]) {
    out.iter_mut()
        .zip(idx)
        .for_each(|(o, &i)| *o = x[i as usize]);
}

/// Twin of `gather_clear`, the error-feedback split: out[j] = acc[idx[j]] is sent and leaves the
/// accumulator, so the sent values plus what stays equal the accumulator exactly.
pub fn gather_clear(acc: &mut [f32], idx: &[u32], out: &mut [f32]) {
    out.iter_mut().zip(idx).for_each(|(o, &i)| {
        *o = acc[i as usize];
        acc[i as usize] = 0.0;
    });
}

/// Twin of `scatter`: dense[idx[j]] = vals[j].
pub fn scatter(dense: &mut [f32], idx: &[u32], vals: &[f32]) {
    idx.iter()
        .zip(vals)
        .for_each(|(&i, &v)| dense[i as usize] = v);
}

/// Twin of `scatter_add`: dense[idx[j]] += vals[j].
pub fn scatter_add(dense: &mut [f32], idx: &[u32], vals: &[f32]) {
    idx.iter()
        .zip(vals)
        .for_each(|(&i, &v)| dense[i as usize] += v);
}

/// A hint to the core to fetch the cache line of `x[at]` (nothing where `at` is past the end): for
/// scattered reads whose places are known ahead of them. Its own intrinsic on the slice's pointer, not
/// `Lines::ask`'s on an address made an integer: through that, PowerSGD's thin products (which call
/// this in their inner loops) fell from 2.3 to 1.5 GB/s.
#[inline(always)]
pub fn prefetch(x: &[f32], at: usize) {
    #[cfg(target_arch = "x86_64")]
    if at < x.len() {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: the address is within x, and a prefetch only hints; it neither reads into the
        // program nor faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(x.as_ptr().add(at).cast()) };
    }
}

/// Where a buffer lies, to ask for its lines while others hold it borrowed (the address alone: it
/// borrows nothing, and a request for a line changes nothing a program can read).
#[derive(Debug, Clone, Copy)]
pub struct Lines {
    addr: usize,
    len: usize,
}

impl Lines {
    pub fn of(x: &[f32]) -> Self {
        Self {
            addr: x.as_ptr() as usize,
            len: x.len(),
        }
    }

    /// Asks for the line of entry `at` (nothing past the end), as `prefetch`.
    #[inline(always)]
    pub fn ask(&self, at: usize) {
        #[cfg(target_arch = "x86_64")]
        if at < self.len {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            // SAFETY: a prefetch only hints: it neither reads into the program nor faults, whatever
            // the address (here that of entry `at` of the buffer).
            unsafe { _mm_prefetch::<_MM_HINT_T0>((self.addr + 4 * at) as *const i8) };
        }
    }
}

/// Lines to ask for while a pass computes from other data: at the pass's entry i, entry `at + i` of each
/// of `lines` (one request of each per 16 entries), so that what is read next arrives meanwhile. Asked
/// for all at once they would stall the core until its misses drained.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub lines: &'a [Lines],
    pub at: usize,
}

/// How far ahead of its loads a streaming loop asks for the lines it will read (entries): `streamed`,
/// top-k's selection, PowerSGD's thin products.
pub const STREAM_AHEAD: usize = 1024;

/// `f` over x and y side by side, 16 entries at a time, each time first asking for the lines
/// `STREAM_AHEAD` entries on: for a pass whose loads the core would otherwise wait on.
#[inline(always)]
pub fn streamed(x: &mut [f32], y: &[f32], f: impl Fn(&mut [f32], &[f32])) {
    assert_eq!(x.len(), y.len(), "streamed over unequal buffers");
    ahead(x, [Lines::of(y)], |x, at| f(x, &y[at..][..x.len()]));
}

/// `f(part, at)` over `x` 16 entries at a time (`part` = x[at..at + 16]), each time first asking for
/// the lines `STREAM_AHEAD` entries on in `x` and in `others` (read or written beside it, from the
/// same entry on): for the element-wise passes over data that has left the core's caches, whose loads
/// the hardware prefetcher (which starts again at each 4 KB page) leaves the core waiting on.
#[inline(always)]
pub fn ahead<const N: usize>(x: &mut [f32], others: [Lines; N], f: impl FnMut(&mut [f32], usize)) {
    ahead_by::<16, N>(x, others, f)
}

/// `ahead` in parts of W entries (a multiple of 16): before each part's `f`, the W / 16 lines that
/// the part's entries `STREAM_AHEAD` on span are asked for, in x and in `others`.
#[inline(always)]
pub fn ahead_by<const W: usize, const N: usize>(
    x: &mut [f32],
    others: [Lines; N],
    mut f: impl FnMut(&mut [f32], usize),
) {
    const { assert!(W > 0 && W.is_multiple_of(16)) };
    let lines = Lines::of(x);
    for (i, part) in x.chunks_mut(W).enumerate() {
        let at = W * i;
        for next in (at + STREAM_AHEAD..at + W + STREAM_AHEAD).step_by(16) {
            lines.ask(next);
            others.iter().for_each(|l| l.ask(next));
        }
        f(part, at);
    }
}

/// Twin of `ef_accumulate`: acc += g.
pub fn ef_accumulate(acc: &mut [f32], g: &[f32]) {
    acc.par_chunks_mut(1 << 14)
        .zip(g.par_chunks(1 << 14))
        .for_each(|(a, b)| add_to(a, b));
}

/// a += b, entry by entry, in the widest vectors this processor has.
#[multiversion::multiversion(targets = "simd")]
pub fn add_to(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(a, &b)| *a += b);
}

/// a -= b, entry by entry, in the widest vectors this processor has.
#[multiversion::multiversion(targets = "simd")]
pub fn subtract_from(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(a, &b)| *a -= b);
}

/// x *= s, entry by entry, in the widest vectors this processor has.
#[multiversion::multiversion(targets = "simd")]
pub fn scale_by(x: &mut [f32], s: f32) {
    x.iter_mut().for_each(|v| *v *= s);
}

/// `ef_accumulate` (with `feedback`), then `kept = acc`; returns `sum_squares(acc)` (the same tiles and
/// order): one pass over the data instead of three.
pub fn ef_accumulate_keep(acc: &mut [f32], kept: &mut [f32], feedback: bool) -> f64 {
    by_tiles(acc, kept, |a, k| ef_keep_tile(a, k, feedback))
}

/// `ef_accumulate_keep` that moves the sum instead of copying it: `kept = acc + kept` (`kept = acc`
/// without `feedback`) and `acc = 0`; returns the sum of squares of the new `kept` (the same tiles and
/// order as `ef_accumulate_keep`, so the same value).
pub fn ef_accumulate_move(acc: &mut [f32], kept: &mut [f32], feedback: bool) -> f64 {
    by_tiles(acc, kept, |a, k| ef_move_tile(a, k, feedback))
}

/// `tile` over the `TILE`-long tiles of `acc` and `kept` side by side, in parallel; its sums of squares
/// added in order (`optim::sum_squares`'s tiles and order).
fn by_tiles(
    acc: &mut [f32],
    kept: &mut [f32],
    tile: impl Fn(&mut [f32], &mut [f32]) -> f64 + Sync + Send,
) -> f64 {
    let tiles = acc.par_chunks_mut(TILE).zip(kept.par_chunks_mut(TILE));
    optim::add_in_order(tiles.with_min_len(16).map(|(a, k)| tile(a, k)))
}

/// `kept = decay kept + acc` over a slice (a SparseLoCo chunk); returns the sum of squares of the new
/// `kept` as `optim::tile_sum_squares` gives it: one pass where the update and the norm took two.
#[multiversion::multiversion(targets = "simd")]
pub fn decay_add_tile(a: &[f32], k: &mut [f32], decay: f32) -> f64 {
    k.iter_mut()
        .zip(a.iter())
        .for_each(|(k, &a)| *k = decay * *k + a);
    optim::tile_sum_squares(k)
}

/// One tile of `ef_accumulate_move`.
#[multiversion::multiversion(targets = "simd")]
fn ef_move_tile(a: &mut [f32], k: &mut [f32], feedback: bool) -> f64 {
    match feedback {
        true => k.iter_mut().zip(a.iter()).for_each(|(k, &a)| *k += a),
        false => k.copy_from_slice(a),
    }
    a.fill(0.0);
    optim::tile_sum_squares(k)
}

/// One tile of `ef_accumulate_keep`.
#[multiversion::multiversion(targets = "simd")]
fn ef_keep_tile(a: &mut [f32], k: &mut [f32], feedback: bool) -> f64 {
    if feedback {
        a.iter_mut().zip(k.iter()).for_each(|(a, &k)| *a += k);
    }
    k.copy_from_slice(a);
    optim::tile_sum_squares(a)
}

/// Twin of `scale`: x *= s.
pub fn scale(x: &mut [f32], s: f32) {
    x.par_chunks_mut(1 << 14).for_each(|x| scale_by(x, s));
}

/// Twin of `mix`: x = own * x + b.
#[inline(always)]
pub fn mix(x: &mut [f32], b: &[f32], own: f32) {
    x.iter_mut().zip(b).for_each(|(x, b)| *x = own * *x + b);
}

/// Twin of `scaled_copy`: dst = src * s.
#[inline(always)]
pub fn scaled_copy(dst: &mut [f32], src: &[f32], s: f32) {
    dst.iter_mut().zip(src).for_each(|(d, x)| *d = x * s);
}

/// Twin of `choco_absorb`: one member's sparse message into a channel (its public copy `hat` only when
/// the member is this rank). The lines of the entry `ABSORB_AHEAD` on are asked for before each entry
/// is added: the entries are scattered over model-sized buffers that many workers' buffers have pushed
/// out of the caches, and each addition waited on its loads.
pub fn choco_absorb(
    hat: Option<&mut [f32]>,
    memory: &mut [f32],
    idx: &[u32],
    vals: &[f32],
    off: usize,
    w: f32,
) {
    let ahead = |n: usize| idx.get(n + ABSORB_AHEAD).map(|&i| off + i as usize);
    match hat {
        Some(hat) => idx.iter().zip(vals).enumerate().for_each(|(n, (&i, &q))| {
            if let Some(a) = ahead(n) {
                prefetch(hat, a);
                prefetch(memory, a);
            }
            let i = off + i as usize;
            hat[i] += q;
            memory[i] += w * q;
        }),
        None => idx.iter().zip(vals).enumerate().for_each(|(n, (&i, &q))| {
            if let Some(a) = ahead(n) {
                prefetch(memory, a);
            }
            memory[off + i as usize] += w * q
        }),
    }
}

/// Entries ahead whose lines `choco_absorb` asks for.
const ABSORB_AHEAD: usize = 32;

/// Twin of `choco_step`: x += gamma (s - hat).
#[multiversion::multiversion(targets = "simd")]
pub fn choco_step(x: &mut [f32], s: &[f32], hat: &[f32], gamma: f32) {
    x.iter_mut()
        .zip(s.iter().zip(hat))
        .for_each(|(x, (s, h))| *x += gamma * (s - h));
}

/// Twin of an f64 sum over one block with reducers.cu's `block_sum`: thread t's terms `term(x[i])` for
/// i = t, t + BLOCK, ... in order, then the tree over the BLOCK partial sums.
pub fn block_strided_sum(x: &[f32], term: impl Fn(f32) -> f64) -> f64 {
    let mut sh = [0.0f64; BLOCK];
    block_strided_add(&mut sh, x, term);
    block_sum(&mut sh)
}

/// The lanes' part of `block_strided_sum`, for x given in pieces: each piece but the last a whole number
/// of BLOCK rows, so that lane t still adds x[t], x[t + BLOCK], ... in order.
#[inline(always)]
pub fn block_strided_add(sh: &mut [f64; BLOCK], x: &[f32], term: impl Fn(f32) -> f64) {
    // Row by row over x (one read of it, not one per thread): each lane still adds its terms in order.
    for row in x.chunks(BLOCK) {
        for (s, &v) in sh.iter_mut().zip(row) {
            *s += term(v);
        }
    }
}

/// Twin of `block_sum` (and of `sum_squares`'s tree in f64): the tree over the N (BLOCK there) partial
/// sums, by halves (stride N / 2, ..., 1).
#[inline(always)]
pub(crate) fn block_sum<T: Copy + std::ops::AddAssign, const N: usize>(sh: &mut [T; N]) -> T {
    let mut s = N / 2;
    while s > 0 {
        for t in 0..s {
            sh[t] += sh[t + s];
        }
        s /= 2;
    }
    sh[0]
}

/// Twin of `gram_schmidt`: PowerSGD's orthogonalization of the columns of row-major `rows x cols`
/// matrices stored back to back (PyTorch's `_orthogonalize_gram_schmidt`: each column divided by
/// norm + eps, a zero column stays zero, then removed from the later columns). Partial sums per "thread"
/// t over the rows t, t + BLOCK, ..., then the block tree, as the kernel.
pub fn gram_schmidt(p: &mut [f32], rows: usize, cols: usize, eps: f32) {
    if rows * cols == 0 {
        return;
    }
    p.par_chunks_mut(rows * cols).for_each(|a| {
        let mut sh = [0.0f32; BLOCK];
        let mut sum = |f: &dyn Fn(usize) -> f32| {
            for (t, s) in sh.iter_mut().enumerate() {
                *s = (t..rows).step_by(BLOCK).fold(0.0f32, |acc, r| acc + f(r));
            }
            block_sum(&mut sh)
        };
        for i in 0..cols {
            let d = sum(&|r| {
                let v = a[r * cols + i];
                v * v
            })
            .sqrt()
                + eps;
            if d > 0.0 {
                (0..rows).for_each(|r| a[r * cols + i] /= d);
            }
            for c in i + 1..cols {
                let dot = sum(&|r| a[r * cols + i] * a[r * cols + c]);
                (0..rows).for_each(|r| a[r * cols + c] -= dot * a[r * cols + i]);
            }
        }
    });
}

#[cfg(test)]
mod tests {

    /// `top_k_short` (and `top_k_of_difference`) where its sample misleads: the sampled places hold the
    /// largest keys, so the sample's floor lets fewer than k through, and where it lets nearly everything
    /// through (zeros at the sampled places); both give the exact top k, as do the fallbacks of a
    /// sample-less length.
    #[test]
    fn top_k_short_is_exact_when_its_sample_misleads() {
        let n = 1 << 16;
        let samples = (n / 16).min(super::SAMPLES);
        let places: Vec<usize> = (0..samples)
            .map(|i| super::sample_at(i, n / samples))
            .collect();
        for (at_places, elsewhere) in [(2.0f32, 1.0f32), (0.0, 1.0)] {
            let mut x: Vec<f32> = (0..n).map(|i| elsewhere + (i % 97) as f32 * 1e-3).collect();
            places.iter().for_each(|&p| x[p] = at_places);
            for k in [1, 100, samples + 1, 6000, n / 2] {
                let want: Vec<u32> = naive_top_k(&x, k).iter().map(|i| 3 + i).collect();
                for select in [super::top_k_short, of_difference] {
                    let (mut idx, mut val) = (Vec::new(), Vec::new());
                    select(&x, k, 3, &mut idx, &mut val);
                    assert_eq!(idx, want, "k {k}, sampled places {at_places}");
                }
            }
        }
    }

    /// `threshold` lets the k largest keys through and no other where ties allow, else it is the k-th
    /// largest key, as sorting them says: bit by bit (short inputs) and by partition (long ones), on
    /// keys with many ties, spread ones, 0, u32::MAX, every k of short inputs.
    #[test]
    fn threshold_lets_exactly_the_k_largest_keys_through() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for n in [1, 2, 17, 256, 1000, super::BITWISE_KEYS + 5] {
            for spread in [3u32, 1 << 20, u32::MAX] {
                let keys: Vec<u32> = (0..n).map(|_| rng.random_range(0..=spread)).collect();
                let mut sorted = keys.clone();
                sorted.sort_unstable_by(|a, b| b.cmp(a));
                let ks: Vec<usize> = match n {
                    n if n <= 256 => (1..=n).collect(),
                    n => vec![1, 2, 33, n / 2, n - 1, n],
                };
                for k in ks {
                    let t = super::threshold(&mut keys.clone(), k);
                    let reach = keys.iter().filter(|&&x| x >= t).count();
                    let kth = sorted[k - 1];
                    let tied = k < n && sorted[k] == kth;
                    let case = format!("n {n}, keys up to {spread}, k {k}: t {t}, k-th {kth}");
                    assert!(t <= kth, "{case}");
                    match tied {
                        true => assert_eq!(t, kth, "{case}"),
                        false => assert_eq!(reach, k, "{case}"),
                    }
                }
            }
        }
    }

    /// The fused passes are error feedback (or its decay), a copy (or a move) and the sum of squares, bit
    /// for bit.
    #[test]
    fn ef_accumulate_keep_is_ef_accumulate_a_copy_and_the_sum_of_squares() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for n in [0, 5, TILE + 3, 40 * TILE + 17] {
            let g: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let r: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            for feedback in [false, true] {
                let mut want = g.clone();
                if feedback {
                    super::ef_accumulate(&mut want, &r);
                }
                let (mut got, mut kept) = (g.clone(), r.clone());
                let sum = super::ef_accumulate_keep(&mut got, &mut kept, feedback);
                assert_eq!(sum.to_bits(), super::optim::sum_squares(&want).to_bits());
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!((bits(&got), bits(&kept)), (bits(&want), bits(&want)));
                // A move: `want` into `kept`, its sum of squares returned, zeros left behind.
                let moves = |want: &[f32], step: &dyn Fn(&mut [f32], &mut [f32]) -> f64| {
                    let (mut moved, mut into) = (g.clone(), r.clone());
                    let sum = step(&mut moved, &mut into);
                    assert_eq!(sum.to_bits(), super::optim::sum_squares(want).to_bits());
                    assert_eq!(bits(&moved), bits(&vec![0.0; n]));
                    assert_eq!(bits(&into), bits(want));
                };
                moves(&want, &|a, k| super::ef_accumulate_move(a, k, feedback));
                // The decay, a slice at a time (SparseLoCo's chunks): kept = decay kept + acc, as the
                // loop wrote it, and the slice's sum of squares as `tile_sum_squares` gives it.
                let decay = if feedback { 0.95 } else { 0.0 };
                let want: Vec<f32> = r.iter().zip(&g).map(|(&k, &a)| decay * k + a).collect();
                let mut into = r.clone();
                let slices = g
                    .chunks(1000)
                    .zip(into.chunks_mut(1000))
                    .zip(want.chunks(1000));
                for ((a, k), w) in slices {
                    let sum = super::decay_add_tile(a, k, decay);
                    assert_eq!(sum.to_bits(), super::optim::tile_sum_squares(w).to_bits());
                }
                assert_eq!(bits(&into), bits(&want));
            }
        }
    }

    /// The strided block sum is a sum: exact on integers, and the order the kernel's threads use (each
    /// lane's terms in index order, then the tree: here against the lanes summed one at a time).
    #[test]
    fn block_strided_sum_adds_every_term() {
        let x: Vec<f32> = (0..1000).map(|i| (i % 7) as f32 - 3.0).collect();
        let want: f64 = x.iter().map(|&v| (v as f64).abs()).sum();
        assert_eq!(block_strided_sum(&x, |v| (v as f64).abs()), want);
        assert_eq!(block_strided_sum(&[], |v| v as f64), 0.0);
        let y: Vec<f32> = (0..70_001)
            .map(|i| ((i as f32) * 0.7548).sin() * 1e3)
            .collect();
        let mut lanes = [0.0f64; BLOCK];
        for (t, s) in lanes.iter_mut().enumerate() {
            *s = y
                .iter()
                .skip(t)
                .step_by(BLOCK)
                .fold(0.0, |a, &v| a + (v as f64).powi(2));
        }
        let term = |v: f32| (v as f64).powi(2);
        assert_eq!(
            block_strided_sum(&y, term).to_bits(),
            block_sum(&mut lanes).to_bits()
        );
    }

    use super::*;
    use proptest::prelude::*;

    /// Large values exactly where the sample looks: its key lets too few through, and the full path
    /// selects instead; the same entries either way.
    #[test]
    fn a_sample_that_lets_too_few_or_too_many_through_falls_back_to_the_full_selection() {
        let len = 16 * SAMPLES * 2;
        let stride = len / SAMPLES;
        let mut x: Vec<f32> = (0..len).map(|i| (i % 7) as f32 * 1e-3).collect();
        for i in 0..SAMPLES {
            x[sample_at(i, stride)] = 1.0;
        }
        let k = 2 * SAMPLES;
        let (mut idx, mut val) = (Vec::new(), Vec::new());
        assert!(!top_k_of_candidates(&x, k, 0, &mut idx, &mut val));
        assert!(idx.is_empty() && val.is_empty());
        top_k(&x, k, 0, &mut idx, &mut val);
        assert_eq!(idx, naive_top_k(&x, k));
        // All ties: every key reaches the sample's.
        let x = vec![-0.5f32; len];
        let (mut idx, mut val) = (Vec::new(), Vec::new());
        assert!(!top_k_of_candidates(&x, 100, 0, &mut idx, &mut val));
        top_k(&x, 100, 0, &mut idx, &mut val);
        assert_eq!(idx, (0..100).collect::<Vec<u32>>());
    }

    /// The exact top-k set by a full sort (|x| descending, then index ascending), in index order.
    fn naive_top_k(x: &[f32], k: usize) -> Vec<u32> {
        let mut order: Vec<u32> = (0..x.len() as u32).collect();
        order.sort_by(|&a, &b| {
            x[b as usize]
                .abs()
                .total_cmp(&x[a as usize].abs())
                .then(a.cmp(&b))
        });
        let mut top = order[..k.min(x.len())].to_vec();
        top.sort_unstable();
        top
    }

    /// `top_k_of_difference` of an x and a hat whose difference is `d`, bit for bit: hat a pattern of
    /// values where d + hat - hat gives d back, else zero (and x = d).
    fn of_difference(d: &[f32], k: usize, base: u32, idx: &mut Vec<u32>, val: &mut Vec<f32>) {
        let (x, hat): (Vec<f32>, Vec<f32>) = d
            .iter()
            .enumerate()
            .map(|(i, &d)| {
                let h = (i % 17) as f32 * 0.5 - 4.0;
                match ((d + h) - h).to_bits() == d.to_bits() {
                    true => (d + h, h),
                    false => (d, 0.0),
                }
            })
            .unzip();
        top_k_of_difference(&x, &hat, k, base, idx, val);
    }

    /// Values with many ties (a few levels, both signs, zeros of both signs) or spread out.
    fn values() -> impl Strategy<Value = Vec<f32>> {
        prop_oneof![
            prop::collection::vec((-4i32..5).prop_map(|l| l as f32 * 0.25), 0..9000),
            prop::collection::vec(-1e3f32..1e3, 0..9000),
            prop::collection::vec(
                prop_oneof![Just(0.0f32), Just(-0.0), Just(1e-30), Just(-3.5)],
                1..5000
            ),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn selection_is_the_exact_top_k_set_with_ties_to_lower_indices(
            x in values(), frac in 0.0f64..1.2, base in 0u32..1000
        ) {
            let k = (frac * x.len() as f64) as usize;
            let want: Vec<u32> = naive_top_k(&x, k).iter().map(|i| base + i).collect();
            for select in [top_k, top_k_by_select, top_k_short, of_difference] {
                let (mut idx, mut val) = (vec![7], vec![7.0]);
                select(&x, k, base, &mut idx, &mut val);
                prop_assert_eq!(&idx[1..], &want[..]);
                for (i, v) in idx[1..].iter().zip(&val[1..]) {
                    prop_assert_eq!(v.to_bits(), x[(i - base) as usize].to_bits());
                }
            }
        }

        #[test]
        fn long_inputs_select_through_candidates_the_exact_top_k(
            levels in 1i32..2000, seed in any::<u64>(), frac in 0.0f64..0.12, len in 32768usize..70000
        ) {
            // Few levels (many ties at the threshold) to many; clustered runs defeat the even sample.
            use rand::{Rng, SeedableRng};
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let x: Vec<f32> = (0..len)
                .map(|i| {
                    let l = rng.random_range(-levels..=levels) as f32;
                    if (i / 4096) % 3 == 0 { l * 1e-3 } else { l }
                })
                .collect();
            let k = (frac * len as f64) as usize;
            let want: Vec<u32> = naive_top_k(&x, k).iter().map(|i| 5 + i).collect();
            // top_k_short and top_k_of_difference: CHOCO's selections, on tensors of any length.
            for select in [top_k, top_k_short, of_difference] {
                let (mut idx, mut val) = (Vec::new(), Vec::new());
                select(&x, k, 5, &mut idx, &mut val);
                prop_assert_eq!(&idx, &want);
                for (i, v) in idx.iter().zip(&val) {
                    prop_assert_eq!(v.to_bits(), x[(i - 5) as usize].to_bits());
                }
            }
        }

        #[test]
        fn gather_and_scatter_round_trip_and_the_error_feedback_split_is_exact(
            x in prop::collection::vec(-10f32..10.0, 1..3000), frac in 0.0f64..1.0
        ) {
            let k = (frac * x.len() as f64) as usize;
            let (mut idx, mut val) = (Vec::new(), Vec::new());
            top_k(&x, k, 0, &mut idx, &mut val);
            let mut got = vec![0.0; k];
            gather(&x, &idx, &mut got);
            prop_assert_eq!(&got, &val);
            // Scatter into zeros gives x on the selection and zero elsewhere.
            let mut dense = vec![0.0; x.len()];
            scatter_add(&mut dense, &idx, &got);
            let mut put = vec![0.0; x.len()];
            scatter(&mut put, &idx, &got);
            prop_assert_eq!(&put, &dense);
            let mut acc = x.clone();
            let mut sent = vec![0.0; k];
            gather_clear(&mut acc, &idx, &mut sent);
            for i in 0..x.len() {
                let selected = idx.binary_search(&(i as u32)).is_ok();
                prop_assert_eq!(dense[i], if selected { x[i] } else { 0.0 });
                prop_assert_eq!(acc[i], if selected { 0.0 } else { x[i] });
                // What was sent plus what stayed is the accumulator, bit for bit.
                prop_assert_eq!((dense[i] + acc[i]).to_bits(), x[i].to_bits());
            }
        }

        #[test]
        fn gram_schmidt_gives_orthonormal_columns_spanning_the_input(
            rows in 1usize..1200, cols in 1usize..9, seed in 0u64..1000, eps in prop_oneof![Just(0.0f32), Just(1e-8)]
        ) {
            prop_assume!(rows >= cols);
            use rand::{Rng, SeedableRng};
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let m = 2;
            let input: Vec<f32> = (0..m * rows * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let mut q = input.clone();
            gram_schmidt(&mut q, rows, cols, eps);
            for (a, q) in input.chunks(rows * cols).zip(q.chunks(rows * cols)) {
                let dot = |x: &[f32], i: usize, y: &[f32], j: usize| -> f64 {
                    (0..rows).map(|r| x[r * cols + i] as f64 * y[r * cols + j] as f64).sum()
                };
                for i in 0..cols {
                    for j in 0..cols {
                        let want = if i == j { 1.0 } else { 0.0 };
                        prop_assert!((dot(q, i, q, j) - want).abs() < 1e-4, "q^T q [{i},{j}] = {}", dot(q, i, q, j));
                        // Column j of the input lies in the span of q_0..q_j: R = Q^T A is upper triangular.
                        if i > j {
                            let scale = dot(a, j, a, j).sqrt();
                            prop_assert!(dot(q, i, a, j).abs() < 1e-4 * scale.max(1.0));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn error_feedback_conserves_mass_over_steps() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let n = 5000;
        let (mut acc, mut sent_total, mut grad_total) =
            (vec![0.0f32; n], vec![0.0f64; n], vec![0.0f64; n]);
        for _ in 0..40 {
            let g: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            g.iter()
                .zip(&mut grad_total)
                .for_each(|(g, t)| *t += *g as f64);
            ef_accumulate(&mut acc, &g);
            let (mut idx, mut val) = (Vec::new(), Vec::new());
            top_k(&acc, 50, 0, &mut idx, &mut val);
            let mut sent = vec![0.0; idx.len()];
            gather_clear(&mut acc, &idx, &mut sent);
            idx.iter()
                .zip(&sent)
                .for_each(|(&i, &v)| sent_total[i as usize] += v as f64);
        }
        // Sum of what was sent plus the residual equals the sum of the gradients (f32 rounding only).
        for i in 0..n {
            let err = (sent_total[i] + acc[i] as f64 - grad_total[i]).abs();
            assert!(err < 1e-4, "entry {i}: off by {err}");
        }
    }

    proptest! {
        /// Gossip's twins are their formulas, element by element, in f32.
        #[test]
        fn mix_and_scaled_copy_are_their_formulas(
            x in prop::collection::vec(-1e3f32..1e3, 0..500), own in -2f32..2.0, s in -2f32..2.0
        ) {
            let b: Vec<f32> = x.iter().map(|v| v * 0.5 - 1.0).collect();
            let mut m = x.clone();
            mix(&mut m, &b, own);
            let mut c = vec![0.0; x.len()];
            scaled_copy(&mut c, &x, s);
            for i in 0..x.len() {
                prop_assert_eq!(m[i].to_bits(), (own * x[i] + b[i]).to_bits());
                prop_assert_eq!(c[i].to_bits(), (x[i] * s).to_bits());
            }
        }
    }

    #[test]
    fn zero_columns_stay_zero() {
        let mut p = vec![0.0f32; 12];
        p[1] = 2.0;
        gram_schmidt(&mut p, 4, 3, 0.0);
        assert!(p.iter().all(|v| v.is_finite()));
        assert_eq!(p[1], 1.0);
    }

    #[test]
    fn the_constants_are_the_kernels() {
        let src = include_str!("../../kernels/reducers.cu");
        for (name, value) in [("BLOCK", BLOCK), ("TILE", TILE)] {
            let line = format!("#define {name} {value} ");
            assert!(src.contains(&line), "reducers.cu lacks `{line}`");
        }
        for kernel in [
            "radix_histogram",
            "select_count",
            "select_write",
            "gather",
            "gather_clear",
            "scatter_add",
            "scatter",
            "ef_accumulate",
            "scale",
            "gram_schmidt",
            "mix",
            "scaled_copy",
        ] {
            assert!(src.contains(&format!("__global__ void {kernel}(")));
        }
    }
}

//! CPU twins of the optimizer kernels in `kernels/optim.cu`: the same operations in the same order per
//! element (the update kernels), and the same blocking of the f64 sum of squares behind every global norm,
//! so that a kernel and its twin agree bit for bit. The optimizers in `crate::optim` run these twins on
//! CPU; the coefficients of a step are computed once on the host (`AdamWStep`, `AccumStep`) for both.

use std::ops::Range;

use rayon::prelude::*;

use super::Segment;

/// Elements per block of `sum_squares` (`TILE` in optim.cu).
pub const TILE: usize = 4096;
// Threads per block (`BLOCK` in optim.cu and reducers.cu).
use super::BLOCK;

/// The segment table of the update kernels: (offset, length, decays) per parameter, as u32.
pub fn segment_table(segments: &[Segment]) -> anyhow::Result<Vec<u32>> {
    let mut t = Vec::with_capacity(3 * segments.len());
    for s in segments {
        let end = u32::try_from(s.offset + s.len).map_err(|_| {
            anyhow::anyhow!(
                "a model of more than {} parameters does not fit the optimizer kernels' 32-bit indices",
                u32::MAX
            )
        })?;
        t.extend([end - s.len as u32, s.len as u32, u32::from(s.decays())]);
    }
    Ok(t)
}

/// The grid of the update kernels over `segments`: one block row per segment (blockIdx.y), its
/// grid-stride loop over up to a quarter of `MAX_BLOCKS` blocks of the longest.
pub fn segment_grid(segments: &[Segment]) -> (usize, usize) {
    let longest = segments.iter().map(|s| s.len).max().unwrap_or(0);
    (
        longest.div_ceil(BLOCK).clamp(1, super::MAX_BLOCKS / 4),
        segments.len().max(1),
    )
}

/// The weight decay factor 1 - lr wd of a decaying segment, in f32 as the kernels take it.
pub fn decay_factor(lr: f64, wd: f64) -> f32 {
    (1.0 - lr * wd) as f32
}

/// One AdamW step's coefficients (torch.optim.AdamW, single-tensor): bias corrections of step `t`, and
/// `grad_scale`, the clipping's factor on the gradient (1: none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub grad_scale: f32,
    pub decay: f32,
    pub one_minus_b1: f32,
    pub b2: f32,
    pub one_minus_b2: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
    pub step_size: f32,
}

impl AdamWStep {
    pub fn new(betas: [f64; 2], eps: f64, wd: f64, lr: f64, t: u64) -> Self {
        let [b1, b2] = betas;
        let bc1 = 1.0 - b1.powi(t as i32);
        let bc2_sqrt = (1.0 - b2.powi(t as i32)).sqrt();
        Self {
            grad_scale: 1.0,
            decay: decay_factor(lr, wd),
            one_minus_b1: (1.0 - b1) as f32,
            b2: b2 as f32,
            one_minus_b2: (1.0 - b2) as f32,
            bc2_sqrt: bc2_sqrt as f32,
            eps: eps as f32,
            step_size: (lr / bc1) as f32,
        }
    }
}

/// Twin of `adamw`: decoupled weight decay first, exp_avg.lerp_(g, 1 - b1),
/// exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2), p -= step_size (m / (sqrt(v) / bc2_sqrt + eps)).
pub fn adamw(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    segments: &[Segment],
    c: &AdamWStep,
) {
    adamw_mixed(p, g, m, v, segments, c, None)
}

/// `adamw` with gossip's mix around it (`Mixing`), a tile at a time while the tile is in cache: each
/// element's operations are the mix's, the update's and the scaled copy's, in that order. The parts of
/// the parameters go to the current rayon pool's threads (`in_parts`).
pub fn adamw_mixed(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    segments: &[Segment],
    c: &AdamWStep,
    mixing: Option<&mut Mixing>,
) {
    let (weights, buf) = Mixing::split(mixing);
    in_parts([p, m, v, buf], g, segments, |[p, m, v, buf], g, segs| {
        let mut mixing = weights.map(|w| w.over(buf));
        adamw_part(p, g, m, v, segs, c, mixing.as_mut())
    })
}

#[multiversion::multiversion(targets = "simd")]
fn adamw_part(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    segments: &[Segment],
    c: &AdamWStep,
    mut mixing: Option<&mut Mixing>,
) {
    for (s, r) in tiles(segments) {
        let (p, g, m, v) = (
            &mut p[r.clone()],
            &g[r.clone()],
            &mut m[r.clone()],
            &mut v[r.clone()],
        );
        if let Some(x) = mixing.as_deref_mut() {
            x.before(p, r.start);
        }
        for i in 0..p.len() {
            let pi = if s.decays() { p[i] * c.decay } else { p[i] };
            let gi = g[i] * c.grad_scale;
            m[i] += (gi - m[i]) * c.one_minus_b1;
            v[i] = v[i] * c.b2 + c.one_minus_b2 * gi * gi;
            let denom = v[i].sqrt() / c.bc2_sqrt + c.eps;
            p[i] = pi - c.step_size * (m[i] / denom);
        }
        if let Some(x) = mixing.as_deref_mut() {
            x.after(p, r.start);
        }
    }
}

/// The fewest elements that `in_parts` hands to one task: 16 tiles, 256 KiB of each buffer.
const PART: usize = 16 * TILE;

/// `update` over the parameters, as parts in parallel on the current rayon pool's threads (up to four
/// parts a thread, each of whole tiles and at least `PART` elements), or in one call where the pool has
/// one thread or the parameters are fewer. A part gets its range of each of `bufs` (each as long as the
/// parameters, or empty: it stays empty) and of `g`, and `segments` cut to it (`Segment::cut`, offsets
/// from the part's start). The updates are element-wise, so every element goes through the operations
/// of the single pass: the same bits on any number of threads.
fn in_parts<const N: usize>(
    bufs: [&mut [f32]; N],
    g: &[f32],
    segments: &[Segment],
    update: impl Fn([&mut [f32]; N], &[f32], &[Segment]) + Sync,
) {
    let threads = rayon::current_num_threads();
    let parts = (g.len() / PART).min(4 * threads);
    if threads < 2 || parts < 2 {
        return update(bufs, g, segments);
    }
    let size = g.len().div_ceil(parts).next_multiple_of(TILE);
    let mut rest = bufs;
    let work: Vec<_> = (0..g.len())
        .step_by(size)
        .map(|start| {
            let r = start..(start + size).min(g.len());
            let part: [&mut [f32]; N] = std::array::from_fn(|i| {
                let b = std::mem::take(&mut rest[i]);
                if b.is_empty() {
                    return b;
                }
                let (head, tail) = b.split_at_mut(r.len());
                rest[i] = tail;
                head
            });
            (part, &g[r.clone()], Segment::cut(segments, r))
        })
        .collect();
    work.into_par_iter()
        .for_each(|(part, g, segs)| update(part, g, &segs));
}

/// The segments' elements in tiles of at most `TILE`, each with its segment.
fn tiles(segments: &[Segment]) -> impl Iterator<Item = (&Segment, Range<usize>)> {
    segments.iter().flat_map(|s| {
        (s.offset..s.offset + s.len)
            .step_by(TILE)
            .map(move |a| (s, a..(a + TILE).min(s.offset + s.len)))
    })
}

/// Gossip's element-wise mix folded into an optimizer's pass over the parameters (see
/// `crate::optim::Optimizer::step_mixed`): x <- own x + buf before the update (the `mix` kernel's twin)
/// where `own` is given, buf <- x other after it (`scaled_copy`'s) where `other` is. `buf`
/// is the whole flat buffer, as long as the parameters.
pub struct Mixing<'a> {
    pub buf: &'a mut [f32],
    pub own: Option<f32>,
    pub other: Option<f32>,
}

/// A step's mixing weights without the buffer (`Mixing`'s `own` and `other`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fold {
    pub own: Option<f32>,
    pub other: Option<f32>,
}

impl Fold {
    /// The mix of these weights over `buf`.
    pub fn over(self, buf: &mut [f32]) -> Mixing<'_> {
        Mixing {
            buf,
            own: self.own,
            other: self.other,
        }
    }
}

impl Mixing<'_> {
    /// The weights and the buffer of an optional mix (an empty buffer without one), for `in_parts`.
    fn split<'b>(mixing: Option<&'b mut Mixing<'_>>) -> (Option<Fold>, &'b mut [f32]) {
        match mixing {
            Some(x) => {
                let weights = Fold {
                    own: x.own,
                    other: x.other,
                };
                (Some(weights), &mut *x.buf)
            }
            None => (None, &mut []),
        }
    }

    /// The mix of `x`, the parameters from `at` on.
    #[inline(always)]
    pub fn before(&mut self, x: &mut [f32], at: usize) {
        if let Some(own) = self.own {
            super::mix(x, &self.buf[at..at + x.len()], own);
        }
    }

    /// The scaled copy of `x`, the parameters from `at` on.
    #[inline(always)]
    pub fn after(&mut self, x: &[f32], at: usize) {
        if let Some(other) = self.other {
            super::scaled_copy(&mut self.buf[at..at + x.len()], x, other);
        }
    }

    /// Whether `segments` cover all `n` parameters, in order (then a pass over them mixes every one).
    pub fn covers(segments: &[Segment], n: usize) -> bool {
        let mut at = 0;
        for s in segments {
            if s.offset != at {
                return false;
            }
            at += s.len;
        }
        at == n
    }
}

/// One AccumAdamW step's coefficients: bias corrections counted in commits (every `k` steps), and the
/// clipping's factor on the gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AccumStep {
    pub grad_scale: f32,
    pub decay: f32,
    pub one_minus_b1: f32,
    pub one_minus_b2: f32,
    pub b1: f32,
    pub b2: f32,
    pub inv_k: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
    pub step_size: f32,
    pub commit: bool,
}

impl AccumStep {
    pub fn new(betas: [f64; 2], eps: f64, wd: f64, k: u64, lr: f64, t: u64) -> Self {
        let [b1, b2] = betas;
        let c = t.div_ceil(k) as i32;
        let bc1 = 1.0 - b1.powi(c);
        Self {
            grad_scale: 1.0,
            decay: decay_factor(lr, wd),
            one_minus_b1: (1.0 - b1) as f32,
            one_minus_b2: (1.0 - b2) as f32,
            b1: b1 as f32,
            b2: b2 as f32,
            inv_k: 1.0 / k as f32,
            bc2_sqrt: (1.0 - b2.powi(c)).sqrt() as f32,
            eps: eps as f32,
            step_size: (lr / bc1) as f32,
            commit: t.is_multiple_of(k),
        }
    }
}

/// Twin of `accum_adamw`: the look-ahead step from the committed moments (stored pre-multiplied by the
/// betas, as Decent-DP's), the running mean `acc` of the gradients, and the commit every k-th step.
pub fn accum_adamw(
    p: &mut [f32],
    g: &[f32],
    sm: &mut [f32],
    sv: &mut [f32],
    acc: &mut [f32],
    segments: &[Segment],
    c: &AccumStep,
) {
    accum_adamw_mixed(p, g, [sm, sv, acc], segments, c, None)
}

/// `accum_adamw` with gossip's mix around it, as `adamw_mixed`; `state` is [sm, sv, acc].
pub fn accum_adamw_mixed(
    p: &mut [f32],
    g: &[f32],
    state: [&mut [f32]; 3],
    segments: &[Segment],
    c: &AccumStep,
    mixing: Option<&mut Mixing>,
) {
    let (weights, buf) = Mixing::split(mixing);
    let [sm, sv, acc] = state;
    in_parts(
        [p, sm, sv, acc, buf],
        g,
        segments,
        |[p, sm, sv, acc, buf], g, segs| {
            let mut mixing = weights.map(|w| w.over(buf));
            accum_adamw_part(p, g, [sm, sv, acc], segs, c, mixing.as_mut())
        },
    )
}

#[multiversion::multiversion(targets = "simd")]
fn accum_adamw_part(
    p: &mut [f32],
    g: &[f32],
    state: [&mut [f32]; 3],
    segments: &[Segment],
    c: &AccumStep,
    mut mixing: Option<&mut Mixing>,
) {
    let [sm, sv, acc] = state;
    for (s, r) in tiles(segments) {
        let (p, g) = (&mut p[r.clone()], &g[r.clone()]);
        let (sm, sv, acc) = (&mut sm[r.clone()], &mut sv[r.clone()], &mut acc[r.clone()]);
        if let Some(x) = mixing.as_deref_mut() {
            x.before(p, r.start);
        }
        for i in 0..p.len() {
            let pi = if s.decays() { p[i] * c.decay } else { p[i] };
            let gi = g[i] * c.grad_scale;
            let a = acc[i] + gi * c.inv_k;
            let m = sm[i] + c.one_minus_b1 * gi;
            let v = sv[i] + c.one_minus_b2 * gi * gi;
            p[i] = pi - c.step_size * m / (v.sqrt() / c.bc2_sqrt + c.eps);
            if c.commit {
                sm[i] = c.b1 * (sm[i] + c.one_minus_b1 * a);
                sv[i] = c.b2 * (sv[i] + c.one_minus_b2 * a * a);
                acc[i] = 0.0;
            } else {
                acc[i] = a;
            }
        }
        if let Some(x) = mixing.as_deref_mut() {
            x.after(p, r.start);
        }
    }
}

/// Twin of `sgd`: p = p (1 - lr wd) - lr (g grad_scale), the decay on decaying segments; in parts on
/// the current pool's threads (`in_parts`).
pub fn sgd(p: &mut [f32], g: &[f32], segments: &[Segment], wd: f64, lr: f64, grad_scale: f32) {
    in_parts([p], g, segments, |[p], g, segs| {
        sgd_part(p, g, segs, wd, lr, grad_scale)
    })
}

#[multiversion::multiversion(targets = "simd")]
fn sgd_part(p: &mut [f32], g: &[f32], segments: &[Segment], wd: f64, lr: f64, grad_scale: f32) {
    let (decay, lr32) = (decay_factor(lr, wd), lr as f32);
    for s in segments {
        let r = s.offset..s.offset + s.len;
        for (p, g) in p[r.clone()].iter_mut().zip(&g[r]) {
            let pi = if s.decays() { *p * decay } else { *p };
            *p = pi - lr32 * (g * grad_scale);
        }
    }
}

/// Torch's SGD hyperparameters of one step (see `momentum_sgd`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdStep {
    pub wd: f32,
    pub momentum: f32,
    pub lr: f32,
    pub nesterov: bool,
    /// Whether the momentum buffer is still unset (torch's first step).
    pub first: bool,
    /// The clipping's factor on the gradient (1: none).
    pub grad_scale: f32,
}

/// Twin of `momentum_sgd` (torch.optim.SGD, foreach=False): g' = g + wd p (decaying segments); with a
/// momentum buffer (non-empty `buf`), b = g' at the first step, then b = mu b + g', and the direction is
/// g' + mu b with Nesterov, else b; without one, g'; p -= lr d. In parts on the current pool's threads
/// (`in_parts`).
pub fn momentum_sgd(p: &mut [f32], g: &[f32], buf: &mut [f32], segments: &[Segment], c: &SgdStep) {
    in_parts([p, buf], g, segments, |[p, buf], g, segs| {
        momentum_sgd_part(p, g, buf, segs, c)
    })
}

#[multiversion::multiversion(targets = "simd")]
fn momentum_sgd_part(p: &mut [f32], g: &[f32], buf: &mut [f32], segments: &[Segment], c: &SgdStep) {
    for s in segments {
        let r = s.offset..s.offset + s.len;
        let wd = if s.decays() { c.wd } else { 0.0 };
        let (p, g) = (&mut p[r.clone()], &g[r.clone()]);
        if buf.is_empty() {
            for (p, &g) in p.iter_mut().zip(g) {
                let g = g * c.grad_scale;
                let g = if wd != 0.0 { g + wd * *p } else { g };
                *p -= c.lr * g;
            }
            continue;
        }
        for ((p, &g), b) in p.iter_mut().zip(g).zip(&mut buf[r]) {
            let g = g * c.grad_scale;
            let g = if wd != 0.0 { g + wd * *p } else { g };
            *b = if c.first { g } else { c.momentum * *b + g };
            let d = if c.nesterov { g + c.momentum * *b } else { *b };
            *p -= c.lr * d;
        }
    }
}

/// Twin of `sum_squares`: the f64 sum of squares of one tile (each square is exact in f64). "Thread" t
/// adds the elements t, t + BLOCK, ... in order; then the tree over the BLOCK partial sums.
#[multiversion::multiversion(targets = "simd")]
pub fn tile_sum_squares(tile: &[f32]) -> f64 {
    let mut sh = [0.0f64; BLOCK];
    // Row by row over the tile, so that the lanes' additions vectorize; each lane keeps its own order.
    for row in tile.chunks(BLOCK) {
        for (s, &x) in sh.iter_mut().zip(row) {
            let v = x as f64;
            *s += v * v;
        }
    }
    super::block_sum(&mut sh)
}

/// The sum of squares of `x` as the kernel and its host step compute it: per tile (`tile_sum_squares`,
/// the tiles in parallel), then the tiles' sums added in order.
pub fn sum_squares(x: &[f32]) -> f64 {
    add_in_order(x.par_chunks(TILE).with_min_len(16).map(tile_sum_squares))
}

/// out = x - g and, with `measure`, the sums of squares of out and of x as `sum_squares` gives them (the
/// same tiles, added in the same order): one pass over the three buffers.
pub fn difference(out: &mut [f32], x: &[f32], g: &[f32], measure: bool) -> Option<(f64, f64)> {
    assert!(
        out.len() == x.len() && x.len() == g.len(),
        "difference of unequal buffers"
    );
    let tiles = out
        .par_chunks_mut(TILE)
        .zip(x.par_chunks(TILE))
        .zip(g.par_chunks(TILE));
    let sums: Vec<(f64, f64)> = tiles
        .with_min_len(16)
        .map(|((o, x), g)| {
            o.iter_mut()
                .zip(x)
                .zip(g)
                .for_each(|((o, &x), &g)| *o = x - g);
            match measure {
                true => (tile_sum_squares(o), tile_sum_squares(x)),
                false => (0.0, 0.0),
            }
        })
        .collect();
    measure.then(|| add_pairs_in_order(sums))
}

/// `difference` in place, with g written as it goes: `fill(range, tile)` writes each tile of g (the
/// entries `range` of g) right before the tile is subtracted from x while both are in the core's first
/// cache. x = x - g and, with `measure`, the sums of squares of the new x and of the old, bit for bit
/// those `difference` gives for out = x - g on the g that the fills write (the same tiles, added in the
/// same order): one pass over two buffers instead of three, and no pass of its own for g's producer.
pub fn fill_subtract(
    x: &mut [f32],
    g: &mut [f32],
    measure: bool,
    fill: impl Fn(Range<usize>, &mut [f32]) + Sync,
) -> Option<(f64, f64)> {
    assert!(x.len() == g.len(), "difference of unequal buffers");
    let tiles = x.par_chunks_mut(TILE).zip(g.par_chunks_mut(TILE));
    let sums: Vec<(f64, f64)> = tiles
        .enumerate()
        .with_min_len(16)
        .map(|(i, (x, g))| {
            fill(i * TILE..i * TILE + g.len(), g);
            subtract_one(x, g, measure)
        })
        .collect();
    measure.then(|| add_pairs_in_order(sums))
}

/// One tile of `fill_subtract`: with `measure` its sums of squares after and before, else (0, 0).
fn subtract_one(x: &mut [f32], g: &[f32], measure: bool) -> (f64, f64) {
    match measure {
        true => subtract_tile(x, g),
        false => {
            super::subtract_from(x, g);
            (0.0, 0.0)
        }
    }
}

/// Pairs of tiles' sums added in the tiles' order.
fn add_pairs_in_order(sums: Vec<(f64, f64)>) -> (f64, f64) {
    sums.into_iter()
        .fold((0.0, 0.0), |(a, b), (c, d)| (a + c, b + d))
}

/// One tile of `fill_subtract` with `measure`: x -= g, and the sums of squares of the new x and of the old, each
/// lane's terms in `tile_sum_squares`'s order, formed in the same pass as the subtraction.
#[multiversion::multiversion(targets = "simd")]
fn subtract_tile(x: &mut [f32], g: &[f32]) -> (f64, f64) {
    let (mut after, mut before) = ([0.0f64; BLOCK], [0.0f64; BLOCK]);
    for (row, g) in x.chunks_mut(BLOCK).zip(g.chunks(BLOCK)) {
        let lanes = after.iter_mut().zip(before.iter_mut());
        for ((x, &g), (a, b)) in row.iter_mut().zip(g).zip(lanes) {
            let old = *x as f64;
            *b += old * old;
            *x -= g;
            let new = *x as f64;
            *a += new * new;
        }
    }
    (super::block_sum(&mut after), super::block_sum(&mut before))
}

/// Tiles' sums, computed in parallel, added in the tiles' order (the host step of every sum of squares).
pub fn add_in_order(tiles: impl IndexedParallelIterator<Item = f64>) -> f64 {
    let sums: Vec<f64> = tiles.collect();
    sums.into_iter().fold(0.0, |a, b| a + b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Buffers over segments that decay and that do not, longer and shorter than a block, and the
    /// update kernels of optim.cu run on the host (`kernels::emulate`) with `segment_grid`'s grid.
    struct Updates {
        segs: Vec<Segment>,
        /// p, g, m (or a momentum buffer), v, an accumulator.
        x: [Vec<f32>; 5],
        e: &'static crate::kernels::emulate::Emulator,
    }

    impl Updates {
        fn new() -> Option<Self> {
            use crate::kernels::emulate::{Emulator, Source};
            let shapes = [
                (30, 20, true),
                (7, 1, false),
                (1500, 1, false),
                (3, 9, true),
            ];
            let segs = Segment::from_shapes(&shapes);
            let n: usize = segs.iter().map(|s| s.len).sum();
            let ranges = [
                (-2.0, 2.0),
                (-1.0, 1.0),
                (-0.1, 0.1),
                (0.0, 0.01),
                (-0.1, 0.1),
            ];
            let mut seed = 0;
            let x = ranges.map(|(lo, hi)| {
                seed += 1;
                vals(n, seed, lo, hi)
            });
            Some(Self {
                segs,
                x,
                e: Emulator::get(Source::Optim)?,
            })
        }

        /// The kernel's buffers after it ran on `args` (the segment table goes in at `table`), as bits.
        fn run(&self, name: &str, mut args: Vec<Arg>, table: usize) -> Vec<Vec<u32>> {
            args.insert(table, Arg::U32s(segment_table(&self.segs).unwrap()));
            let (x, y) = segment_grid(&self.segs);
            self.e.launch(name, (x as u32, y as u32), &mut args);
            let floats = args.into_iter().filter(|a| matches!(a, Arg::F32s(_)));
            floats.map(|a| bits(a.f32s())).collect()
        }
    }

    use crate::kernels::emulate::Arg;

    fn f(x: &[f32]) -> Arg {
        Arg::F32s(x.to_vec())
    }

    /// `adamw` and `accum_adamw` (committing and not) give their twins' parameters and moments bit for
    /// bit, with a clipping factor.
    #[test]
    fn the_adam_kernels_are_their_twins() {
        let Some(u) = Updates::new() else {
            return;
        };
        let [p, g, m, v, acc] = &u.x;
        let mut c = AdamWStep::new([0.9, 0.95], 1e-8, 0.1, 6e-4, 3);
        c.grad_scale = 0.7;
        let (mut pw, mut mw, mut vw) = (p.clone(), m.clone(), v.clone());
        adamw(&mut pw, g, &mut mw, &mut vw, &u.segs, &c);
        let k = [
            c.decay,
            c.one_minus_b1,
            c.b2,
            c.one_minus_b2,
            c.bc2_sqrt,
            c.eps,
        ];
        let args = [
            vec![f(p), f(g), f(m), f(v)],
            floats(&k),
            floats(&[c.step_size, 0.7]),
        ];
        let want = [&pw, g, &mw, &vw].map(|x| bits(x)).to_vec();
        assert_eq!(u.run("adamw", args.concat(), 4), want, "adamw");
        for t in [4, 6] {
            let mut c = AccumStep::new([0.9, 0.95], 1e-8, 0.1, 3, 6e-4, t);
            c.grad_scale = 0.7;
            let (mut pw, mut mw, mut vw, mut aw) = (p.clone(), m.clone(), v.clone(), acc.clone());
            accum_adamw(&mut pw, g, &mut mw, &mut vw, &mut aw, &u.segs, &c);
            let k = [c.decay, c.one_minus_b1, c.one_minus_b2, c.b1, c.b2, c.inv_k];
            let k2 = [c.bc2_sqrt, c.eps, c.step_size];
            let tail = vec![Arg::U32(c.commit.into()), Arg::F32(0.7)];
            let args = [
                vec![f(p), f(g), f(m), f(v), f(acc)],
                floats(&k),
                floats(&k2),
                tail,
            ];
            let want = [&pw, g, &mw, &vw, &aw].map(|x| bits(x)).to_vec();
            assert_eq!(u.run("accum_adamw", args.concat(), 5), want, "step {t}");
        }
    }

    /// `sgd` and `momentum_sgd` (first step, later, Nesterov, and without a buffer) give their twins'
    /// parameters and buffers bit for bit, with a clipping factor.
    #[test]
    fn the_sgd_kernels_are_their_twins() {
        let Some(u) = Updates::new() else {
            return;
        };
        let [p, g, m, ..] = &u.x;
        let mut pw = p.clone();
        sgd(&mut pw, g, &u.segs, 0.1, 6e-4, 0.7);
        let args = [
            vec![f(p), f(g)],
            floats(&[decay_factor(6e-4, 0.1), 6e-4, 0.7]),
        ];
        assert_eq!(u.run("sgd", args.concat(), 2), [bits(&pw), bits(g)], "sgd");
        let flag = |b: bool| Arg::U32(b.into());
        for (c, has_buf) in sgd_cases() {
            let (first, nesterov) = (c.first, c.nesterov);
            let (mut pw, mut bw) = (p.clone(), if has_buf { m.clone() } else { Vec::new() });
            momentum_sgd(&mut pw, g, &mut bw, &u.segs, &c);
            let buf = if has_buf { bw.clone() } else { vec![0.0] };
            let args = [
                vec![f(p), f(g), f(if has_buf { m } else { &buf }), flag(has_buf)],
                floats(&[c.wd, c.momentum, c.lr]),
                vec![flag(first), flag(nesterov), Arg::F32(0.5)],
            ];
            let want = vec![bits(&pw), bits(g), bits(&buf)];
            assert_eq!(
                u.run("momentum_sgd", args.concat(), 4),
                want,
                "{c:?}, buffer {has_buf}"
            );
        }
    }

    fn floats(k: &[f32]) -> Vec<crate::kernels::emulate::Arg> {
        k.iter()
            .map(|&x| crate::kernels::emulate::Arg::F32(x))
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// `difference` is x - g (as -g + x, the two steps it replaces) and `sum_squares` of it and of x,
    /// bit for bit, with zeros of both signs, infinities and NaNs among the values; `fill_subtract`, in place,
    /// gives the same bits and sums.
    #[test]
    fn difference_is_the_negated_copy_plus_x_and_its_sums_of_squares() {
        for n in [0, 1, TILE - 1, TILE, 16 * TILE + 5, 300_001] {
            let (mut x, mut g) = (vals(n, 1, -3.0, 3.0), vals(n, 2, -3.0, 3.0));
            for (i, (a, b)) in [
                (0.0, 0.0),
                (-0.0, 0.0),
                (f32::INFINITY, 1.0),
                (f32::NAN, 2.0),
            ]
            .into_iter()
            .enumerate()
            {
                if 7 * i < n {
                    (x[7 * i], g[7 * i]) = (a, b);
                }
            }
            let mut want = vec![0.0f32; n];
            crate::kernels::scaled_copy(&mut want, &g, -1.0);
            want.iter_mut().zip(&x).for_each(|(w, &x)| *w += x);
            let mut got = vec![f32::NAN; n];
            let sums = difference(&mut got, &x, &g, true).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{n}");
            let want_sums = (sum_squares(&want), sum_squares(&x));
            assert_eq!(sums.0.to_bits(), want_sums.0.to_bits(), "{n}");
            assert_eq!(sums.1.to_bits(), want_sums.1.to_bits(), "{n}");
            assert_eq!(difference(&mut got, &x, &g, false), None);
            assert_eq!(bits(&got), bits(&want));
            // In place, g written tile by tile as the subtraction reaches it.
            for measure in [true, false] {
                let (mut inplace, mut filled) = (x.clone(), vec![f32::NAN; n]);
                let sums_filled = fill_subtract(&mut inplace, &mut filled, measure, |r, tile| {
                    tile.copy_from_slice(&g[r])
                });
                assert_eq!(bits(&inplace), bits(&want), "{n}");
                assert_eq!(bits(&filled), bits(&g), "{n}");
                let want_sums = measure.then_some((sums.0.to_bits(), sums.1.to_bits()));
                assert_eq!(
                    sums_filled.map(|s| (s.0.to_bits(), s.1.to_bits())),
                    want_sums
                );
            }
        }
    }

    /// A flat buffer cut into segments of random lengths, alternating decay.
    fn layout() -> impl Strategy<Value = Vec<Segment>> {
        prop::collection::vec((0usize..300, any::<bool>()), 1..8).prop_map(Segment::end_to_end)
    }

    fn numel(segs: &[Segment]) -> usize {
        segs.last().map_or(0, |s| s.offset + s.len)
    }

    fn vals(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(lo..hi)).collect()
    }

    fn close(a: f32, b: f64, tol: f64) -> bool {
        (a as f64 - b).abs() <= tol * (1.0 + b.abs())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// AdamW against its textbook form in f64 (Loshchilov & Hutter with torch's eps placement):
        /// p (1 - lr wd) - lr / bc1 * m / (sqrt(v / bc2) + eps), over several steps.
        #[test]
        fn adamw_follows_the_reference_update(segs in layout(), seed in 0u64..1000, lr in 1e-4f64..1e-1, wd in 0.0f64..0.2) {
            let n = numel(&segs);
            let (betas, eps) = ([0.9, 0.95], 1e-8);
            let mut p = vals(n, seed, -1.0, 1.0);
            let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
            let mut rp: Vec<f64> = p.iter().map(|&x| x as f64).collect();
            let (mut rm, mut rv) = (vec![0.0f64; n], vec![0.0f64; n]);
            for t in 1..=5u64 {
                let g = vals(n, seed + t, -1.0, 1.0);
                adamw(&mut p, &g, &mut m, &mut v, &segs, &AdamWStep::new(betas, eps, wd, lr, t));
                for s in &segs {
                    for i in s.offset..s.offset + s.len {
                        let gi = g[i] as f64;
                        if s.decays() { rp[i] *= 1.0 - lr * wd; }
                        rm[i] = betas[0] * rm[i] + (1.0 - betas[0]) * gi;
                        rv[i] = betas[1] * rv[i] + (1.0 - betas[1]) * gi * gi;
                        let (bc1, bc2) = (1.0 - betas[0].powi(t as i32), 1.0 - betas[1].powi(t as i32));
                        rp[i] -= lr / bc1 * rm[i] / ((rv[i] / bc2).sqrt() + eps);
                    }
                }
            }
            for i in 0..n {
                prop_assert!(close(p[i], rp[i], 1e-5), "p[{i}] = {} vs {}", p[i], rp[i]);
            }
        }

        /// AccumAdamW against Decent-DP's update written out in f64: moments committed every k steps
        /// from the mean gradient, look-ahead moments from the committed ones in between.
        #[test]
        fn accum_adamw_follows_the_reference_update(segs in layout(), seed in 0u64..1000, k in 1u64..4, lr in 1e-4f64..1e-1, wd in 0.0f64..0.2) {
            let n = numel(&segs);
            let (betas, eps) = ([0.9, 0.99], 1e-8);
            let mut p = vals(n, seed, -1.0, 1.0);
            let (mut sm, mut sv, mut acc) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
            let mut rp: Vec<f64> = p.iter().map(|&x| x as f64).collect();
            // Reference: unscaled committed moments M, V and the gradient sum of the window.
            let (mut rm, mut rv, mut rsum) = (vec![0.0f64; n], vec![0.0f64; n], vec![0.0f64; n]);
            for t in 1..=7u64 {
                let g = vals(n, seed + t, -1.0, 1.0);
                accum_adamw(&mut p, &g, &mut sm, &mut sv, &mut acc, &segs, &AccumStep::new(betas, eps, wd, k, lr, t));
                let c = t.div_ceil(k) as i32;
                for s in &segs {
                    for i in s.offset..s.offset + s.len {
                        let gi = g[i] as f64;
                        if s.decays() { rp[i] *= 1.0 - lr * wd; }
                        let m = betas[0] * rm[i] + (1.0 - betas[0]) * gi;
                        let v = betas[1] * rv[i] + (1.0 - betas[1]) * gi * gi;
                        let (bc1, bc2) = (1.0 - betas[0].powi(c), 1.0 - betas[1].powi(c));
                        rp[i] -= lr / bc1 * m / (v.sqrt() / bc2.sqrt() + eps);
                        rsum[i] += gi;
                        if t % k == 0 {
                            let mean = rsum[i] / k as f64;
                            rm[i] = betas[0] * rm[i] + (1.0 - betas[0]) * mean;
                            rv[i] = betas[1] * rv[i] + (1.0 - betas[1]) * mean * mean;
                            rsum[i] = 0.0;
                        }
                    }
                }
            }
            for i in 0..n {
                prop_assert!(close(p[i], rp[i], 1e-4), "p[{i}] = {} vs {}", p[i], rp[i]);
            }
        }

        /// AdamW and AccumAdamW with gossip's mix folded in, tile by tile, leave the parameters, state and
        /// send buffer that the mix, the update and the scaled copy leave one after the other, bit for
        /// bit: with and without each half of the mix, over segments longer than a tile.
        #[test]
        fn the_folded_mix_gives_the_passes_bits(lens in prop::collection::vec((0usize..9000, any::<bool>()), 1..4), seed in 0u64..1000, own in prop::option::of(0.1f32..0.9), other in prop::option::of(0.1f32..0.9), t in 1u64..4) {
            let segs = Segment::end_to_end(lens);
            let n = numel(&segs);
            let fold = Fold { own, other };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let start = |k: u64| [vals(n, seed + k, -1.0, 1.0), vals(n, seed + 9, 0.0, 1.0), vals(n, seed + 5, 0.0, 1e-2), vals(n, seed + 6, -1.0, 1.0)];
            let g = vals(n, seed + 7, -1.0, 1.0);
            let c = AdamWStep { grad_scale: 0.7, ..AdamWStep::new([0.9, 0.95], 1e-8, 0.1, 1e-2, t) };
            // [p, m, v, buf], folded and in passes.
            let [mut p, mut m, mut v, mut b] = start(0);
            adamw_mixed(&mut p, &g, &mut m, &mut v, &segs, &c, Some(&mut fold.over(&mut b)));
            let [mut q, mut m2, mut v2, mut b2] = start(0);
            fold.over(&mut b2).before(&mut q, 0);
            adamw(&mut q, &g, &mut m2, &mut v2, &segs, &c);
            fold.over(&mut b2).after(&q, 0);
            prop_assert_eq!(bits(&p), bits(&q));
            prop_assert_eq!((bits(&m), bits(&v), bits(&b)), (bits(&m2), bits(&v2), bits(&b2)));
            for k in [1, 2] {
                let c = AccumStep { grad_scale: 0.7, ..AccumStep::new([0.9, 0.99], 1e-8, 0.1, k, 1e-2, t) };
                let [mut p, mut sm, mut sv, mut b] = start(k);
                let mut acc = vals(n, seed + 8, -0.1, 0.1);
                accum_adamw_mixed(&mut p, &g, [&mut sm, &mut sv, &mut acc], &segs, &c, Some(&mut fold.over(&mut b)));
                let [mut q, mut sm2, mut sv2, mut b2] = start(k);
                let mut acc2 = vals(n, seed + 8, -0.1, 0.1);
                fold.over(&mut b2).before(&mut q, 0);
                accum_adamw(&mut q, &g, &mut sm2, &mut sv2, &mut acc2, &segs, &c);
                fold.over(&mut b2).after(&q, 0);
                prop_assert_eq!(bits(&p), bits(&q));
                prop_assert_eq!((bits(&sm), bits(&sv), bits(&acc), bits(&b)), (bits(&sm2), bits(&sv2), bits(&acc2), bits(&b2)));
            }
        }

        /// Torch's SGD (heavy ball and Nesterov, coupled weight decay) and SGD with decoupled decay,
        /// against their recurrences in f64.
        #[test]
        fn sgd_variants_follow_their_recurrences(segs in layout(), seed in 0u64..1000, mu in prop_oneof![Just(0.0f32), 0.1f32..0.95], nesterov in any::<bool>(), wd in 0.0f32..0.1) {
            let n = numel(&segs);
            let lr = 0.05f32;
            let mut p = vals(n, seed, -1.0, 1.0);
            let mut q = p.clone();
            let mut buf = if mu > 0.0 { vec![0.0f32; n] } else { Vec::new() };
            let mut rp: Vec<f64> = p.iter().map(|&x| x as f64).collect();
            let mut rq = rp.clone();
            let mut rb = vec![0.0f64; n];
            for t in 0..4 {
                let g = vals(n, seed + 10 + t, -1.0, 1.0);
                let c = SgdStep { wd, momentum: mu, lr, nesterov, first: t == 0, grad_scale: 1.0 };
                momentum_sgd(&mut p, &g, &mut buf, &segs, &c);
                sgd(&mut q, &g, &segs, wd as f64, lr as f64, 1.0);
                for s in &segs {
                    for i in s.offset..s.offset + s.len {
                        let (mu, lr) = (mu as f64, lr as f64);
                        let wd = if s.decays() { wd as f64 } else { 0.0 };
                        let gi = g[i] as f64 + wd * rp[i];
                        rb[i] = if t == 0 { gi } else { mu * rb[i] + gi };
                        let d = if mu == 0.0 { gi } else if nesterov { gi + mu * rb[i] } else { rb[i] };
                        rp[i] -= lr * d;
                        rq[i] = rq[i] * (1.0 - lr * wd) - lr * g[i] as f64;
                    }
                }
            }
            for i in 0..n {
                prop_assert!(close(p[i], rp[i], 1e-5), "momentum p[{i}] = {} vs {}", p[i], rp[i]);
                prop_assert!(close(q[i], rq[i], 1e-5), "decoupled p[{i}] = {} vs {}", q[i], rq[i]);
            }
        }

        /// The blocked f64 sum of squares is the sum of squares (to f64 rounding), at any length.
        #[test]
        fn sum_squares_is_the_sum_of_squares(n in 0usize..20_000, seed in 0u64..1000, scale in prop_oneof![Just(1.0f32), Just(1e-20), Just(1e18)]) {
            let x: Vec<f32> = vals(n, seed, -1.0, 1.0).iter().map(|v| v * scale).collect();
            // Neumaier's compensated sum: exact to about one rounding.
            let (mut want, mut comp) = (0.0f64, 0.0f64);
            for &v in &x {
                let sq = (v as f64) * (v as f64);
                let t = want + sq;
                comp += if want.abs() >= sq { (want - t) + sq } else { (sq - t) + want };
                want = t;
            }
            let want = want + comp;
            let got = sum_squares(&x);
            // Blocked: 16 additions per lane, 8 in the tree, then one per tile.
            let bound = (24.0 + x.len().div_ceil(TILE) as f64) * f64::EPSILON * want;
            prop_assert!((got - want).abs() <= bound, "{got} vs {want}");
        }
    }

    /// The folded mix reaches every parameter only where the segments cover them all, in order.
    #[test]
    fn a_fold_needs_segments_that_cover_the_parameters() {
        let segs = Segment::end_to_end([(5, true), (0, false), (7, false)]);
        assert!(Mixing::covers(&segs, 12));
        assert!(!Mixing::covers(&segs, 13));
        assert!(!Mixing::covers(&segs[1..], 12));
        assert!(!Mixing::covers(&[segs[2], segs[0]], 12));
        assert!(Mixing::covers(&[], 0));
    }

    /// Momentum SGD's steps, each with whether it keeps a buffer: its first step, Nesterov's, and one
    /// without a buffer.
    fn sgd_cases() -> [(SgdStep, bool); 3] {
        [
            (true, false, true),
            (false, true, true),
            (false, false, false),
        ]
        .map(|(first, nesterov, buf)| {
            let c = SgdStep {
                wd: 0.01,
                momentum: 0.9,
                lr: 0.7,
                nesterov,
                first,
                grad_scale: 0.5,
            };
            (c, buf)
        })
    }

    /// Parameters of 5 parts and a bit, in segments with gaps between them (as a shard's may have),
    /// one longer than a part and one that is not a matrix (no decay).
    fn gapped() -> (Vec<Segment>, usize) {
        let segs = vec![
            Segment::flat(3, 2 * PART + 77, true),
            Segment::flat(2 * PART + 100, 900, false),
            Segment::flat(2 * PART + 1000, 3 * PART, true),
        ];
        (segs, 5 * PART + 1321)
    }

    fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
        pool.expect("a test pool").install(f)
    }

    /// A pool of several threads cuts the parameters into parts of whole tiles, each with the segments'
    /// pieces inside it counted from its start; a pool of one thread, or fewer elements than two parts,
    /// make one call over everything.
    #[test]
    fn in_parts_cuts_whole_tiles_and_the_segments_with_them() {
        let (segs, n) = gapped();
        let calls = |threads: usize, n: usize| {
            let seen = std::sync::Mutex::new(Vec::new());
            let (mut p, g) = (vec![0.0f32; n], vec![0.0f32; n]);
            in_pool(threads, || {
                in_parts([&mut p[..], &mut []], &g, &segs, |[p, e], g, s| {
                    assert!(e.is_empty() && g.len() == p.len());
                    seen.lock()
                        .unwrap()
                        .push((p.as_ptr() as usize, p.len(), s.to_vec()));
                })
            });
            let mut seen = seen.into_inner().unwrap();
            seen.sort_by_key(|c| c.0);
            (p.as_ptr() as usize, seen)
        };
        let (base, parts) = calls(3, n);
        assert!(
            parts.len() > 1 && parts.len() <= 12,
            "{} parts",
            parts.len()
        );
        let mut start = 0;
        for (i, (addr, len, cut)) in parts.iter().enumerate() {
            assert_eq!(
                (addr - base) / 4,
                start,
                "part {i} starts where the last ended"
            );
            assert!(i + 1 == parts.len() || len % TILE == 0, "part {i}: {len}");
            assert_eq!(*cut, Segment::cut(&segs, start..start + len));
            start += len;
        }
        assert_eq!(start, n);
        for (threads, n) in [(1, n), (3, 2 * PART - 1)] {
            let (_, one) = calls(threads, n);
            assert_eq!(one.len(), 1);
            assert_eq!(one[0].2, segs);
        }
    }

    /// Every update in parts on 3 threads leaves the bits of its single pass on 1 thread: AdamW with each
    /// half of the mix, AccumAdamW committing and not, SGD, and momentum SGD without a buffer, at its
    /// first step, and with Nesterov.
    #[test]
    fn the_updates_in_parts_give_the_single_passs_bits() {
        let (segs, n) = gapped();
        let g = vals(n, 7, -1.0, 1.0);
        let start = || [0, 1, 2, 3].map(|k| vals(n, k, if k == 2 { 0.0 } else { -1.0 }, 1.0));
        let run = |threads: usize, update: &(dyn Fn(&mut [Vec<f32>; 4]) + Sync)| {
            let mut bufs = start();
            in_pool(threads, || update(&mut bufs));
            bufs.map(|b| bits(&b))
        };
        let same = |what: &str, update: &(dyn Fn(&mut [Vec<f32>; 4]) + Sync)| {
            assert_eq!(run(1, update), run(3, update), "{what}");
        };
        let c = AdamWStep {
            grad_scale: 0.7,
            ..AdamWStep::new([0.9, 0.95], 1e-8, 0.1, 1e-2, 3)
        };
        for (own, other) in [
            (None, None),
            (Some(0.5), None),
            (None, Some(0.25)),
            (Some(0.5), Some(0.5)),
        ] {
            same("adamw", &|[p, m, v, b]| {
                let mut mix = Fold { own, other }.over(b);
                adamw_mixed(p, &g, m, v, &segs, &c, own.or(other).map(|_| &mut mix));
            });
        }
        for (k, t) in [(2, 3), (2, 4)] {
            let c = AccumStep {
                grad_scale: 0.7,
                ..AccumStep::new([0.9, 0.99], 1e-8, 0.1, k, 1e-2, t)
            };
            let fold = Fold {
                own: Some(0.5),
                other: Some(0.5),
            };
            same("accum_adamw", &|[p, sm, sv, acc]| {
                let mut b = vals(n, 9, -1.0, 1.0);
                accum_adamw_mixed(
                    p,
                    &g,
                    [sm, sv, acc],
                    &segs,
                    &c,
                    Some(&mut fold.over(&mut b)),
                );
                p.iter_mut().zip(&b).for_each(|(p, b)| *p += b);
            });
        }
        same("sgd", &|[p, ..]| sgd(p, &g, &segs, 0.1, 1e-2, 0.7));
        for (c, buf) in sgd_cases() {
            same("momentum_sgd", &|[p, b, ..]| {
                momentum_sgd(p, &g, if buf { b } else { &mut [] }, &segs, &c)
            });
        }
    }

    /// The tiles summed in parallel give the tiles' sums added one after the other, bit for bit.
    #[test]
    fn the_parallel_sum_of_squares_adds_the_tiles_in_order() {
        for n in [0, 1, TILE - 1, TILE, 16 * TILE + 5, 300_001] {
            let x = vals(n, n as u64, -3.0, 3.0);
            let serial = x.chunks(TILE).map(tile_sum_squares).fold(0.0, |a, b| a + b);
            assert_eq!(sum_squares(&x).to_bits(), serial.to_bits(), "{n}");
        }
    }

    #[test]
    fn the_constants_and_kernels_are_the_cuda_files() {
        let src = include_str!("../../kernels/optim.cu");
        for (name, value) in [("BLOCK", BLOCK), ("TILE", TILE)] {
            let line = format!("#define {name} {value} ");
            assert!(src.contains(&line), "optim.cu lacks `{line}`");
        }
        for kernel in ["adamw", "accum_adamw", "sgd", "momentum_sgd", "sum_squares"] {
            assert!(src.contains(&format!("__global__ void {kernel}(")));
        }
    }

    #[test]
    fn the_segment_table_holds_offset_length_and_decay() {
        let segs = [Segment::flat(0, 3, true), Segment::flat(3, 2, false)];
        assert_eq!(segment_table(&segs).unwrap(), vec![0, 3, 1, 3, 2, 0]);
        let huge = [Segment::flat(u32::MAX as usize, 2, true)];
        assert!(segment_table(&huge).is_err());
    }
}

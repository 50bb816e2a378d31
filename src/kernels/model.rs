//! CPU twins of kernels/model.cu: the causal softmax of attention scores and its backward, row by row
//! over a contiguous (.., T, T) buffer (the query at i = row mod T keeps the keys j <= i); the
//! cross-entropy of logits with their targets and its backward, row by row over (rows, vocab); the layer
//! norm and its backward over (rows, c). Each row sums in the kernels' order: BLOCK strided partial sums,
//! then a tree over them; a column sums its rows in blocks of `LN_ROWS` in order, then the blocks in
//! order.

use rayon::prelude::*;

use super::BLOCK;

/// The sum of `n` terms in the kernel's order: term j goes to partial j mod BLOCK in order of j, then
/// the partials add over a tree (stride BLOCK / 2, ..., 1).
fn block_sum(n: usize, term: impl Fn(usize) -> f32) -> f32 {
    let mut sh = [0f32; BLOCK];
    for (lane, s) in sh.iter_mut().enumerate().take(n) {
        *s = (lane..n).step_by(BLOCK).fold(0.0, |a, j| a + term(j));
    }
    super::block_sum(&mut sh)
}

/// Checks that `len` values are whole (.., t, t) rows.
fn rows_of(len: usize, t: usize) -> usize {
    assert!(
        t > 0 && len.is_multiple_of(t * t),
        "internal error: {len} values are not (.., {t}, {t})"
    );
    len / t
}

/// `causal_softmax` of model.cu: y = softmax(s scale) over each row, keys after the query masked (0).
pub fn causal_softmax(s: &[f32], y: &mut [f32], t: usize, scale: f32) {
    rows_of(s.len(), t);
    assert_eq!(
        s.len(),
        y.len(),
        "internal error: softmax of unequal buffers"
    );
    y.par_chunks_mut(t)
        .zip(s.par_chunks(t))
        .enumerate()
        .for_each(|(r, (o, x))| {
            let n = r % t + 1;
            let m = x[..n]
                .iter()
                .fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
            for (o, &v) in o[..n].iter_mut().zip(&x[..n]) {
                *o = (v * scale - m).exp();
            }
            let sum = block_sum(n, |j| o[j]);
            o[..n].iter_mut().for_each(|v| *v /= sum);
            o[n..].fill(0.0);
        });
}

/// `causal_softmax_backward` of model.cu: from y (the forward's output) and g (the gradient at y),
/// dx = scale (y (g - sum(g y))) over each row's kept keys, 0 after the query.
pub fn causal_softmax_backward(y: &[f32], g: &[f32], dx: &mut [f32], t: usize, scale: f32) {
    rows_of(y.len(), t);
    assert!(
        y.len() == g.len() && y.len() == dx.len(),
        "internal error: softmax backward of unequal buffers"
    );
    dx.par_chunks_mut(t)
        .zip(y.par_chunks(t).zip(g.par_chunks(t)))
        .enumerate()
        .for_each(|(r, (o, (y, g)))| {
            let n = r % t + 1;
            let d = block_sum(n, |j| g[j] * y[j]);
            for j in 0..n {
                o[j] = scale * (y[j] * (g[j] - d));
            }
            o[n..].fill(0.0);
        });
}

/// The row's largest logit m and sum of exp(x_j - m), in the kernels' order (`logit_stats`).
fn logit_stats(x: &[f32]) -> (f32, f32) {
    let m = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    (m, block_sum(x.len(), |j| (x[j] - m).exp()))
}

/// Checks that `len` values are whole rows of `v` and that there is one target a row.
fn check_logits(len: usize, v: usize, targets: usize) {
    assert!(
        v > 0 && len == targets * v,
        "internal error: {len} logits are not {targets} rows of {v}"
    );
}

/// `cross_entropy` of model.cu: each row's loss = ln(sum_j exp(x_j - m)) - (x_y - m) against its target
/// y, NaN where the target is not below v.
pub fn cross_entropy(x: &[f32], y: &[u32], loss: &mut [f32], v: usize) {
    check_logits(x.len(), v, y.len());
    assert_eq!(y.len(), loss.len(), "internal error: a loss a row");
    loss.par_iter_mut()
        .zip(x.par_chunks(v).zip(y.par_iter()))
        .for_each(|(l, (xr, &target))| {
            let (m, sum) = logit_stats(xr);
            *l = match xr.get(target as usize) {
                Some(&xt) => sum.ln() - (xt - m),
                None => f32::NAN,
            };
        });
}

/// `cross_entropy_backward` of model.cu: from g (the gradient at each row's loss), dx_j = g (p_j - [j =
/// y]), p the row's softmax.
pub fn cross_entropy_backward(x: &[f32], y: &[u32], g: &[f32], dx: &mut [f32], v: usize) {
    check_logits(x.len(), v, y.len());
    assert!(
        g.len() == y.len() && dx.len() == x.len(),
        "internal error: cross-entropy backward of unequal buffers"
    );
    dx.par_chunks_mut(v)
        .zip(x.par_chunks(v).zip(y.par_iter().zip(g.par_iter())))
        .for_each(|(o, (xr, (&target, &gr)))| {
            let (m, sum) = logit_stats(xr);
            for (j, (o, &xj)) in o.iter_mut().zip(xr).enumerate() {
                let p = (xj - m).exp() / sum;
                *o = gr * if j == target as usize { p - 1.0 } else { p };
            }
        });
}

/// Rows per block of the layer norm's column sums (`ROWS` in model.cu).
pub const LN_ROWS: usize = 64;

/// The row's mean and standard deviation sqrt(var + eps), in the kernels' order (`row_stats`).
fn row_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let c = x.len();
    let mean = block_sum(c, |j| x[j]) / c as f32;
    let var = block_sum(c, |j| (x[j] - mean) * (x[j] - mean)) / c as f32;
    (mean, (var + eps).sqrt())
}

/// `layer_norm` of model.cu: y = (x - mean) / sd w + b over each row of c.
pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], y: &mut [f32], c: usize, eps: f32) {
    assert!(
        c > 0 && x.len().is_multiple_of(c) && y.len() == x.len() && w.len() == c && b.len() == c,
        "internal error: layer norm of {} values in rows of {c}",
        x.len()
    );
    y.par_chunks_mut(c).zip(x.par_chunks(c)).for_each(|(y, x)| {
        let (mean, sd) = row_stats(x, eps);
        for j in 0..c {
            y[j] = (x[j] - mean) / sd * w[j] + b[j];
        }
    });
}

/// `layer_norm_backward` of model.cu: the gradient at x from g, the gradient at y; each row's mean and
/// sd into `stats` (two a row).
pub fn layer_norm_backward(
    (x, w, g): (&[f32], &[f32], &[f32]),
    dx: &mut [f32],
    stats: &mut [f32],
    c: usize,
    eps: f32,
) {
    assert!(
        c > 0 && x.len().is_multiple_of(c) && g.len() == x.len() && dx.len() == x.len(),
        "internal error: layer norm backward of {} values in rows of {c}",
        x.len()
    );
    assert!(w.len() == c && stats.len() == 2 * (x.len() / c));
    dx.par_chunks_mut(c)
        .zip(x.par_chunks(c).zip(g.par_chunks(c)))
        .zip(stats.par_chunks_mut(2))
        .for_each(|((dx, (x, g)), st)| {
            let (mean, sd) = row_stats(x, eps);
            let a = block_sum(c, |j| g[j] * w[j]) / c as f32;
            let bm = block_sum(c, |j| g[j] * w[j] * ((x[j] - mean) / sd)) / c as f32;
            for j in 0..c {
                let xh = (x[j] - mean) / sd;
                dx[j] = (g[j] * w[j] - a - xh * bm) / sd;
            }
            st.copy_from_slice(&[mean, sd]);
        });
}

/// `layer_norm_columns` and `layer_norm_column_sums` of model.cu: the gradients at w and b, each column's
/// sum over the rows of g (x - mean) / sd and of g, in blocks of `LN_ROWS` rows.
pub fn layer_norm_columns(x: &[f32], g: &[f32], stats: &[f32], c: usize) -> (Vec<f32>, Vec<f32>) {
    assert!(c > 0 && g.len() == x.len() && stats.len() == 2 * (x.len() / c));
    let partial: Vec<(Vec<f32>, Vec<f32>)> = x
        .par_chunks(c * LN_ROWS)
        .zip(g.par_chunks(c * LN_ROWS))
        .zip(stats.par_chunks(2 * LN_ROWS))
        .map(|((x, g), st)| {
            let (mut dw, mut db) = (vec![0f32; c], vec![0f32; c]);
            for ((x, g), st) in x.chunks(c).zip(g.chunks(c)).zip(st.chunks(2)) {
                for j in 0..c {
                    dw[j] += g[j] * ((x[j] - st[0]) / st[1]);
                    db[j] += g[j];
                }
            }
            (dw, db)
        })
        .collect();
    let (mut dw, mut db) = (vec![0f32; c], vec![0f32; c]);
    for (pw, pb) in &partial {
        dw.iter_mut().zip(pw).for_each(|(a, b)| *a += b);
        db.iter_mut().zip(pb).for_each(|(a, b)| *a += b);
    }
    (dw, db)
}

/// Twin of `permute_heads`: between the attention's rows (B T, C) and heads (B, nh, T, hs), C = nh hs,
/// entry (b t, h hs + d) of the rows being entry (b, h, t, d) of the heads; `to_heads` writes the heads
/// from the rows, else the rows from the heads. A copy of each run of hs entries.
pub fn permute_heads(src: &[f32], dst: &mut [f32], t: usize, nh: usize, hs: usize, to_heads: bool) {
    let c = nh * hs;
    assert!(
        c > 0 && t > 0 && src.len() == dst.len() && src.len().is_multiple_of(t * c),
        "internal error: {} values permuted between rows of {c} and {nh} heads over {t} positions",
        src.len()
    );
    for (row, at) in (0..src.len()).step_by(c).enumerate() {
        let (b, tt) = (row / t, row % t);
        for h in 0..nh {
            let (i, j) = (at + h * hs, ((b * nh + h) * t + tt) * hs);
            match to_heads {
                true => dst[j..j + hs].copy_from_slice(&src[i..i + hs]),
                false => dst[i..i + hs].copy_from_slice(&src[j..j + hs]),
            }
        }
    }
}

/// The positions of a batch's tokens grouped by token, for the embedding's backward: `order` the
/// positions sorted by token (each token's in position order), `starts` where each token's run begins in
/// it (one more entry: its length), `tokens` the token of each run, ascending.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRuns {
    pub order: Vec<u32>,
    pub starts: Vec<u32>,
    pub tokens: Vec<u32>,
}

impl TokenRuns {
    pub fn new(ids: &[u32]) -> Self {
        let mut order: Vec<u32> = (0..ids.len() as u32).collect();
        order.sort_by_key(|&p| ids[p as usize]); // stable: each token's positions stay in order
        let (mut starts, mut tokens) = (Vec::new(), Vec::new());
        for (k, &p) in order.iter().enumerate() {
            if tokens.last() != Some(&ids[p as usize]) {
                starts.push(k as u32);
                tokens.push(ids[p as usize]);
            }
        }
        starts.push(order.len() as u32);
        Self {
            order,
            starts,
            tokens,
        }
    }
}

/// Twin of `embedding`: row r of `out` is row ids[r] of the table `w` (rows of c).
pub fn embedding(w: &[f32], ids: &[u32], out: &mut [f32], c: usize) {
    for (o, &id) in out.chunks_exact_mut(c).zip(ids) {
        o.copy_from_slice(&w[id as usize * c..][..c]);
    }
}

/// Twin of `embedding_backward`: each token's row of `dw` is the sum, from +0 and in position order, of
/// the rows of g (rows of c) at its positions; the other rows are left as they are.
pub fn embedding_backward(g: &[f32], runs: &TokenRuns, dw: &mut [f32], c: usize) {
    for (s, &token) in runs.tokens.iter().enumerate() {
        let row = &mut dw[token as usize * c..][..c];
        row.fill(0.0);
        let positions = &runs.order[runs.starts[s] as usize..runs.starts[s + 1] as usize];
        for &p in positions {
            for (d, &v) in row.iter_mut().zip(&g[p as usize * c..][..c]) {
                *d += v;
            }
        }
    }
}

/// Twin of `bias_add`: y = x + b over rows of b's length.
pub fn bias_add(x: &[f32], b: &[f32], y: &mut [f32]) {
    for (y, x) in y.chunks_mut(b.len()).zip(x.chunks(b.len())) {
        y.iter_mut()
            .zip(x.iter().zip(b))
            .for_each(|(y, (x, b))| *y = x + b);
    }
}

/// Twin of `column_partials` and `column_totals`: each column's sum over the rows of g (rows of n), in
/// blocks of `LN_ROWS` rows (each block's rows in order, from +0), then the blocks' sums in order.
pub fn column_sums(g: &[f32], n: usize) -> Vec<f32> {
    let partial: Vec<Vec<f32>> = g
        .par_chunks(n * LN_ROWS)
        .map(|block| {
            let mut s = vec![0f32; n];
            for row in block.chunks(n) {
                s.iter_mut().zip(row).for_each(|(a, b)| *a += b);
            }
            s
        })
        .collect();
    let mut total = vec![0f32; n];
    for p in &partial {
        total.iter_mut().zip(p).for_each(|(a, b)| *a += b);
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::emulate::{Arg, Emulator, Source};
    use proptest::prelude::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Scores of `rows` (.., t, t) rows spread over +-`range`.
    fn scores(len: usize, seed: u64, range: f32) -> Vec<f32> {
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed);
        (0..len)
            .map(|_| rand::Rng::random_range(&mut rng, -range..range))
            .collect()
    }

    /// The softmax by definition in f64: each row's kept keys, masked ones 0.
    fn reference(s: &[f32], t: usize, scale: f32) -> Vec<f64> {
        let mut out = vec![0.0; s.len()];
        for (r, (o, x)) in out.chunks_mut(t).zip(s.chunks(t)).enumerate() {
            let n = r % t + 1;
            let z: Vec<f64> = x[..n].iter().map(|&v| v as f64 * scale as f64).collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = z.iter().map(|v| (v - m).exp()).sum();
            for (o, v) in o.iter_mut().zip(&z) {
                *o = (v - m).exp() / sum;
            }
        }
        out
    }

    proptest! {
        /// Each row is a distribution over the keys up to its query (the rest 0), equal to the softmax
        /// computed by definition in f64 within f32 rounding; rows longer than a block included.
        #[test]
        fn the_twin_is_the_masked_softmax(t in 1usize..600, heads in 1usize..3, seed in 0u64..1000) {
            let s = scores(heads * t * t, seed, 8.0);
            let mut y = vec![f32::NAN; s.len()];
            causal_softmax(&s, &mut y, t, 0.3);
            for (got, want) in y.iter().zip(reference(&s, t, 0.3)) {
                prop_assert!((*got as f64 - want).abs() <= 1e-6 * want.max(1e-3), "{got} vs {want}");
            }
        }
    }

    /// The backward is the softmax's Jacobian applied to g: each row's dx against central differences
    /// of sum(g y) in f64.
    #[test]
    fn the_backward_is_the_softmax_gradient() {
        let (t, scale) = (37, 0.4);
        let s = scores(2 * t * t, 7, 3.0);
        let g = scores(s.len(), 8, 1.0);
        let mut y = vec![0.0; s.len()];
        causal_softmax(&s, &mut y, t, scale);
        let mut dx = vec![f32::NAN; s.len()];
        causal_softmax_backward(&y, &g, &mut dx, t, scale);
        let objective = |s: &[f32]| -> f64 {
            let y = reference(s, t, scale);
            y.iter().zip(&g).map(|(y, &g)| y * g as f64).sum()
        };
        for at in [
            0,
            t,
            5 * t + 3,
            t * t + 36 * t + 20,
            2 * t * t - 1,
            2 * t * t - t,
        ] {
            let h = 1e-2f32;
            let (mut up, mut down) = (s.clone(), s.clone());
            up[at] += h;
            down[at] -= h;
            let fd = (objective(&up) - objective(&down)) / (2.0 * h as f64);
            assert!(
                (dx[at] as f64 - fd).abs() < 1e-4,
                "at {at}: {} vs {fd}",
                dx[at]
            );
        }
    }

    /// Each row's loss is -log softmax(x)_y computed in f64 (to f32 rounding), rows longer than a block
    /// and a vocabulary that is not a multiple of it included; a target past the vocabulary gives NaN.
    #[test]
    fn the_cross_entropy_twin_is_minus_the_log_softmax_of_the_target() {
        let (rows, v) = (7, 1000);
        let x = scores(rows * v, 3, 20.0);
        let mut y: Vec<u32> = (0..rows as u32).map(|r| (r * 389) % v as u32).collect();
        y[6] = v as u32;
        let mut loss = vec![0.0; rows];
        cross_entropy(&x, &y, &mut loss, v);
        for r in 0..6 {
            let xr: Vec<f64> = x[r * v..(r + 1) * v].iter().map(|&a| a as f64).collect();
            let m = xr.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + xr.iter().map(|a| (a - m).exp()).sum::<f64>().ln();
            let want = lse - xr[y[r] as usize];
            assert!(
                (loss[r] as f64 - want).abs() < 1e-5 * want.abs().max(1.0),
                "row {r}: {} vs {want}",
                loss[r]
            );
        }
        assert!(
            loss[6].is_nan(),
            "a target past the vocabulary: {}",
            loss[6]
        );
    }

    /// The layer norm in f64 by definition: (x - mean) / sqrt(var + eps) w + b over rows of c.
    fn layer_norm_f64(x: &[f64], w: &[f64], b: &[f64], c: usize, eps: f64) -> Vec<f64> {
        let mut y = vec![0.0; x.len()];
        for (y, x) in y.chunks_mut(c).zip(x.chunks(c)) {
            let mean = x.iter().sum::<f64>() / c as f64;
            let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / c as f64;
            for j in 0..c {
                y[j] = (x[j] - mean) / (var + eps).sqrt() * w[j] + b[j];
            }
        }
        y
    }

    /// The forward is the layer norm by definition (to f32 rounding); the backward's dx, dw and db are
    /// the central differences of sum(y G) in f64, at entries spread over the rows and columns, more
    /// rows than a block of the column sums.
    #[test]
    fn the_layer_norm_twins_are_its_value_and_gradient() {
        let (rows, c, eps) = (150, 300, 1e-5);
        let (x, w, b) = (
            scores(rows * c, 1, 2.0),
            scores(c, 2, 1.5),
            scores(c, 3, 0.5),
        );
        let g = scores(rows * c, 4, 1.0);
        let f64s = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<_>>();
        let mut y = vec![0.0; x.len()];
        layer_norm(&x, &w, &b, &mut y, c, eps);
        let want = layer_norm_f64(&f64s(&x), &f64s(&w), &f64s(&b), c, eps as f64);
        for (got, want) in y.iter().zip(&want) {
            assert!(
                (*got as f64 - want).abs() < 2e-6 * want.abs().max(1.0),
                "{got} vs {want}"
            );
        }
        let (mut dx, mut stats) = (vec![0.0; x.len()], vec![0.0; 2 * rows]);
        layer_norm_backward((&x, &w, &g), &mut dx, &mut stats, c, eps);
        let (dw, db) = layer_norm_columns(&x, &g, &stats, c);
        let objective = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
            let y = layer_norm_f64(x, w, b, c, eps as f64);
            y.iter().zip(&g).map(|(y, &g)| y * g as f64).sum()
        };
        let (x64, w64, b64) = (f64s(&x), f64s(&w), f64s(&b));
        let fd = |which: usize, at: usize| {
            let h = 1e-4;
            let mut args = [x64.clone(), w64.clone(), b64.clone()];
            args[which][at] += h;
            let up = objective(&args[0], &args[1], &args[2]);
            args[which][at] -= 2.0 * h;
            (up - objective(&args[0], &args[1], &args[2])) / (2.0 * h)
        };
        for at in [0, 299, 301, 64 * c + 17, rows * c - 1] {
            assert!(
                (dx[at] as f64 - fd(0, at)).abs() < 1e-4,
                "dx at {at}: {} vs {}",
                dx[at],
                fd(0, at)
            );
        }
        for at in [0, 150, 299] {
            assert!(
                (dw[at] as f64 - fd(1, at)).abs() < 1e-3,
                "dw at {at}: {} vs {}",
                dw[at],
                fd(1, at)
            );
            assert!(
                (db[at] as f64 - fd(2, at)).abs() < 1e-3,
                "db at {at}: {} vs {}",
                db[at],
                fd(2, at)
            );
        }
    }

    /// The layer norm's four kernels, run on the host with the launcher's grids, give their twins' bits:
    /// rows narrower and wider than a block, a last block of the column sums that is partly empty.
    #[test]
    fn the_layer_norm_kernels_are_their_twins() {
        let Some(e) = Emulator::get(Source::Model) else {
            return;
        };
        for (rows, c) in [(1, 1), (3, 100), (130, 300)] {
            let (x, w, b) = (
                scores(rows * c, 5, 3.0),
                scores(c, 6, 1.0),
                scores(c, 7, 1.0),
            );
            let g = scores(rows * c, 8, 1.0);
            let mut y = vec![0.0; x.len()];
            layer_norm(&x, &w, &b, &mut y, c, 1e-5);
            let (mut dx, mut stats) = (vec![0.0; x.len()], vec![0.0; 2 * rows]);
            layer_norm_backward((&x, &w, &g), &mut dx, &mut stats, c, 1e-5);
            let (dw, db) = layer_norm_columns(&x, &g, &stats, c);
            let nan = |n: usize| Arg::F32s(vec![f32::NAN; n]);
            let (f, u) = (
                |v: &[f32]| Arg::F32s(v.to_vec()),
                |n: usize| Arg::U32(n as u32),
            );
            let mut args = [f(&x), f(&w), f(&b), nan(x.len()), u(c), Arg::F32(1e-5)];
            e.launch("layer_norm", (rows as u32, 1), &mut args);
            assert_eq!(bits(args[3].f32s()), bits(&y), "layer norm, {rows} x {c}");
            let mut args = [
                f(&x),
                f(&w),
                f(&g),
                nan(x.len()),
                nan(2 * rows),
                u(c),
                Arg::F32(1e-5),
            ];
            e.launch("layer_norm_backward", (rows as u32, 1), &mut args);
            assert_eq!(bits(args[3].f32s()), bits(&dx), "backward, {rows} x {c}");
            assert_eq!(
                bits(args[4].f32s()),
                bits(&stats),
                "row statistics, {rows} x {c}"
            );
            let blocks = rows.div_ceil(LN_ROWS);
            let grid = (blocks as u32, c.div_ceil(BLOCK) as u32);
            let mut args = [f(&x), f(&g), f(&stats), nan(2 * blocks * c), u(rows), u(c)];
            e.launch("layer_norm_columns", grid, &mut args);
            let partial = args[3].f32s().to_vec();
            let mut args = [f(&partial), nan(2 * c), u(blocks), u(c)];
            e.launch(
                "layer_norm_column_sums",
                (c.div_ceil(BLOCK) as u32, 1),
                &mut args,
            );
            assert_eq!(
                bits(args[1].f32s()),
                bits(&[dw, db].concat()),
                "dw, db, {rows} x {c}"
            );
        }
    }

    /// The softmax and cross-entropy kernels, run on the host with one block a row, give their twins'
    /// bits: rows shorter and longer than a block, several heads, targets past the vocabulary (NaN
    /// losses) among them.
    #[test]
    fn the_softmax_and_cross_entropy_kernels_are_their_twins() {
        let Some(e) = Emulator::get(Source::Model) else {
            return;
        };
        for (t, heads, scale) in [(1, 1, 1.0), (5, 3, 0.125), (300, 1, 0.3)] {
            let s = scores(heads * t * t, t as u64, 6.0);
            let g = scores(s.len(), t as u64 + 1, 1.0);
            let (mut y, mut dx) = (vec![0.0; s.len()], vec![0.0; s.len()]);
            causal_softmax(&s, &mut y, t, scale);
            causal_softmax_backward(&y, &g, &mut dx, t, scale);
            let rows = (heads * t) as u32;
            let nan = vec![f32::NAN; s.len()];
            let mut args = [
                Arg::F32s(s.clone()),
                Arg::F32s(nan.clone()),
                Arg::U32(t as u32),
                Arg::F32(scale),
            ];
            e.launch("causal_softmax", (rows, 1), &mut args);
            assert_eq!(bits(args[1].f32s()), bits(&y), "softmax, t = {t}");
            let mut args = [
                Arg::F32s(y),
                Arg::F32s(g),
                Arg::F32s(nan),
                Arg::U32(t as u32),
                Arg::F32(scale),
            ];
            e.launch("causal_softmax_backward", (rows, 1), &mut args);
            assert_eq!(bits(args[2].f32s()), bits(&dx), "backward, t = {t}");
        }
        for (rows, v) in [(1, 1), (3, 200), (4, 1031)] {
            let x = scores(rows * v, v as u64, 15.0);
            // The last row's target is past the vocabulary where there are several.
            let y: Vec<u32> = (0..rows)
                .map(|r| if r > 0 && r == rows - 1 { v } else { r * 97 % v } as u32)
                .collect();
            let g = scores(rows, 5, 2.0);
            let (mut loss, mut dx) = (vec![0.0; rows], vec![0.0; x.len()]);
            cross_entropy(&x, &y, &mut loss, v);
            cross_entropy_backward(&x, &y, &g, &mut dx, v);
            let mut args = [
                Arg::F32s(x.clone()),
                Arg::U32s(y.clone()),
                Arg::F32s(vec![0.0; rows]),
                Arg::U32(v as u32),
            ];
            e.launch("cross_entropy", (rows as u32, 1), &mut args);
            assert_eq!(bits(args[2].f32s()), bits(&loss), "cross-entropy, v = {v}");
            let mut args = [
                Arg::F32s(x),
                Arg::U32s(y),
                Arg::F32s(g),
                Arg::F32s(vec![f32::NAN; rows * v]),
                Arg::U32(v as u32),
            ];
            e.launch("cross_entropy_backward", (rows as u32, 1), &mut args);
            assert_eq!(
                bits(args[3].f32s()),
                bits(&dx),
                "cross-entropy backward, v = {v}"
            );
        }
    }
}

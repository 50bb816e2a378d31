//! CPU twins of kernels/model.cu: the causal softmax of attention scores and its backward, row by row
//! over a contiguous (.., T, T) buffer (the query at i = row mod T keeps the keys j <= i), and the
//! cross-entropy of logits with their targets and its backward, row by row over (rows, vocab). Each row
//! sums in the kernels' order: BLOCK strided partial sums, then a tree over them.

use rayon::prelude::*;

use super::BLOCK;

/// The sum of `n` terms in the kernel's order: term j goes to partial j mod BLOCK in order of j, then
/// the partials add over a tree (stride BLOCK / 2, ..., 1).
fn block_sum(n: usize, term: impl Fn(usize) -> f32) -> f32 {
    let mut sh = [0f32; BLOCK];
    for (lane, s) in sh.iter_mut().enumerate().take(n) {
        *s = (lane..n).step_by(BLOCK).fold(0.0, |a, j| a + term(j));
    }
    let mut k = BLOCK / 2;
    while k > 0 {
        for lane in 0..k {
            sh[lane] += sh[lane + k];
        }
        k /= 2;
    }
    sh[0]
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

    /// The four kernels, run on the host with one block a row, give their twins' bits: rows shorter and
    /// longer than a block, several heads, targets past the vocabulary (NaN losses) among them.
    #[test]
    fn the_model_kernels_are_their_twins() {
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

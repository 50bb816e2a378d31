use super::*;
use crate::config::ModelConfig;
use crate::model::matmul::{mm, to_bf16, Bf16Path};
use crate::model::ops::{gelu_erf_and_grad, row_max, GELU_FORMS, ROWS};
use candle_core::{Device, Tensor};
use gemm::Parallelism;
use rand::SeedableRng;
use rayon::prelude::*;

/// A model with perturbed parameters (nanoGPT's zero biases and unit gains hide errors by symmetry).
fn model(
    bias: bool,
    activation: Activation,
    dropout: f64,
    layers: usize,
    c: usize,
    heads: usize,
) -> Gpt {
    let cfg = ModelConfig {
        n_layers: layers,
        n_heads: heads,
        n_embd: c,
        dropout,
        vocab_size: 29,
        bias,
        activation,
    };
    let m = Gpt::new(&cfg, 16, 3, &Device::Cpu)
        .unwrap()
        .graph()
        .unwrap();
    super::super::gpt::perturb(&m, 0.2);
    m
}

fn tokens(n: usize, mul: u32, v: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * mul + 3) % v).collect()
}

/// candle's loss and flat gradient (scaled) of one batch.
fn reference(
    m: &Gpt,
    x: &[u32],
    y: &[u32],
    b: usize,
    t: usize,
    rng: Option<&mut ChaCha8Rng>,
    scale: f64,
) -> (f32, Vec<f32>) {
    let xt = Tensor::from_slice(x, (b, t), &Device::Cpu).unwrap();
    let yt = Tensor::from_slice(y, (b, t), &Device::Cpu).unwrap();
    let loss = m.loss(&xt, &yt, rng).unwrap();
    let mut g = vec![0.0f32; m.params.numel];
    m.params
        .accumulate_grads(
            &(&loss * scale).unwrap().backward().unwrap(),
            (&mut g).into(),
        )
        .unwrap();
    (loss.to_scalar::<f32>().unwrap(), g)
}

/// The loss and every gradient match candle's autograd: bias on and off, both GELUs, dropout on, a
/// sequence shorter than the context, head sizes that do and do not fill a SIMD register.
#[test]
fn loss_and_gradients_match_candle_autograd() {
    let cases = [
        (true, Activation::Gelu, 0.0, 2, 16, 2, 3, 9),
        (false, Activation::GeluTanh, 0.0, 2, 16, 4, 2, 16),
        (true, Activation::GeluTanh, 0.25, 2, 24, 3, 2, 7),
        (false, Activation::Gelu, 0.0, 3, 64, 2, 4, 16),
    ];
    for (bias, act, dropout, layers, c, heads, b, t) in cases {
        let m = model(bias, act, dropout, layers, c, heads);
        let x = tokens(b * t, 7, 29);
        let y = tokens(b * t, 5, 29);
        let mut rng_ref = ChaCha8Rng::seed_from_u64(4);
        let (loss_ref, g_ref) = reference(&m, &x, &y, b, t, Some(&mut rng_ref), 0.5);
        let cpu = CpuGpt::new(&m).unwrap();
        let mut scratch = Scratch::default();
        // Gradients accumulate: start from a non-zero buffer.
        let mut g = vec![1.0f32; m.params.numel];
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let loss = cpu
            .loss_and_grads(
                &mut scratch,
                &m.params.to_flat().unwrap(),
                &x,
                &y,
                b,
                t,
                Some(&mut rng),
                0.5,
                &mut g,
            )
            .unwrap();
        let case = format!("bias {bias} {act:?} dropout {dropout} C {c} H {heads} B {b} T {t}");
        assert!(
            (loss - loss_ref).abs() <= 1e-5 * loss_ref,
            "{case}: loss {loss} vs {loss_ref}"
        );
        let scale = g_ref.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for p in &m.params.params {
            for i in p.offset..p.offset + p.len {
                let (a, r) = (g[i] - 1.0, g_ref[i]);
                assert!(
                    (a - r).abs() <= 2e-4 * scale + 1e-4 * r.abs(),
                    "{case}: {}[{}]: {a} vs {r}",
                    p.name,
                    i - p.offset
                );
            }
        }
        // The RNG moved on as candle's did (same number of draws).
        assert_eq!(
            rng.random::<u64>(),
            rng_ref.random::<u64>(),
            "{case}: dropout draws"
        );
        // The forward-only loss (no dropout) is candle's eval loss.
        let (eval_ref, _) = reference(&m, &x, &y, b, t, None, 1.0);
        let eval = cpu
            .loss(&mut scratch, &m.params.to_flat().unwrap(), &x, &y, b, t)
            .unwrap();
        assert!(
            (eval - eval_ref).abs() <= 1e-5 * eval_ref,
            "{case}: eval {eval} vs {eval_ref}"
        );
    }
}

/// `scratch_bytes` (what `check` budgets per compute slot) is what a forward/backward allocates, in
/// either precision (bf16 products store some outputs in bf16), and a scratch moves between models,
/// shapes and precisions.
#[test]
fn scratch_bytes_is_the_size_of_the_buffers_a_step_allocates() {
    let mut scratch = Scratch::default();
    let cases = [
        (2, 16, 2, 3, 5, 0.0),
        (1, 8, 4, 2, 16, 0.1),
        (1, 9, 3, 1, 3, 0.0),
    ];
    let precs = [Precision::F32, Precision::Bf16, Precision::F32];
    for ((layers, c, heads, b, t, dropout), prec) in
        cases.into_iter().flat_map(|k| precs.map(|p| (k, p)))
    {
        let m = model(true, Activation::Gelu, dropout, layers, c, heads);
        let mut cpu = CpuGpt::new(&m).unwrap();
        cpu.set_precision(prec, Bf16Path::detect());
        let (x, y) = (tokens(b * t, 5, 29), tokens(b * t, 7, 29));
        let mut g = vec![0.0f32; m.params.numel];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        cpu.loss_and_grads(
            &mut scratch,
            &m.params.to_flat().unwrap(),
            &x,
            &y,
            b,
            t,
            Some(&mut rng),
            1.0,
            &mut g,
        )
        .unwrap();
        let a = &scratch.acts;
        let f32s = [
            &a.res, &a.res2, &a.xn1, &a.xn2, &a.qkv, &a.att, &a.atty, &a.fc, &a.gelu, &a.xf,
            &a.logits, &a.lse, &a.masks, &a.dres, &a.dc, &a.dc2, &a.d4c, &a.dqkv, &a.dyh,
        ];
        let stats = a.stats1.len() + a.stats2.len() + a.statsf.len();
        let held = 4 * f32s.iter().map(|v| v.len()).sum::<usize>() + 8 * stats;
        let want = scratch_bytes(layers, c, heads, 29, b, t, dropout > 0.0, prec);
        assert_eq!(held as u64, want, "{prec:?} c {c}");
    }
}

/// `matmul::bf16_bytes` (what `check` adds per compute slot under `train.amp`) bounds the operand
/// buffers of a step's bf16 products, within a factor of two.
#[test]
fn bf16_bytes_bounds_the_buffers_of_a_step() {
    for path in Bf16Path::available() {
        for (c, heads, vocab, b, t) in [(16, 2, 29, 3, 5), (32, 4, 300, 2, 16)] {
            let cfg = ModelConfig {
                vocab_size: vocab,
                ..model(true, Activation::Gelu, 0.0, 2, c, heads).cfg
            };
            let m = Gpt::new(&cfg, 16, 1, &Device::Cpu).unwrap();
            let mut cpu = CpuGpt::new(&m).unwrap();
            cpu.set_precision(Precision::Bf16, path);
            let (x, y) = (
                tokens(b * t, 5, vocab as u32),
                tokens(b * t, 7, vocab as u32),
            );
            let mut g = vec![0.0f32; m.params.numel];
            let mut scratch = Scratch::default();
            let w = m.initial_weights();
            cpu.loss_and_grads(&mut scratch, &w, &x, &y, b, t, None, 1.0, &mut g)
                .unwrap();
            let held = scratch.bf16.borrow().bytes() as u64;
            let bound = crate::model::matmul::bf16_bytes(path, b * t, c, vocab);
            assert!(
                held <= bound && 2 * held >= bound,
                "{path:?} c {c} vocab {vocab}: {held} bytes held, {bound} estimated"
            );
        }
    }
}

/// Under bf16 products, the outputs that only they read (the LayerNorms', the attention's and the
/// GELU's) are stored in bf16: the loss, every gradient and the eval loss are, bit for bit, those of
/// storing them in f32 and rounding them as they are packed, on every path, with dropout and bias or
/// without, for both GELUs and over widths that end mid-pair and mid-tile.
#[test]
fn outputs_stored_in_bf16_change_no_bit() {
    for path in Bf16Path::available() {
        for (bias, act, dropout, c, heads) in [
            (true, Activation::Gelu, 0.1, 48, 4),
            (false, Activation::GeluTanh, 0.0, 18, 3),
        ] {
            let m = model(bias, act, dropout, 2, c, heads);
            let (b, t) = (3, 16);
            let (x, y) = (tokens(b * t, 5, 29), tokens(b * t, 7, 29));
            let w = m.params.to_flat().unwrap();
            let run = |half: bool| {
                let mut cpu = CpuGpt::new(&m).unwrap();
                cpu.set_precision(Precision::Bf16, path);
                cpu.half_acts = half;
                let mut scratch = Scratch::default();
                let mut g = vec![0.0f32; m.params.numel];
                let mut rng = ChaCha8Rng::seed_from_u64(3);
                let loss = cpu
                    .loss_and_grads(&mut scratch, &w, &x, &y, b, t, Some(&mut rng), 1.0, &mut g)
                    .unwrap();
                let eval = cpu.loss(&mut scratch, &w, &x, &y, b, t).unwrap();
                assert_eq!(scratch.acts.half, half);
                let mut bits = vec![loss.to_bits(), eval.to_bits()];
                bits.extend(g.iter().map(|v| v.to_bits()));
                bits
            };
            assert!(run(true) == run(false), "{path} c {c} {act:?}");
        }
    }
}

/// The logits of each sequence's last position (what sampling reads) are candle's forward's, for
/// full and shorter sequences, with and without bias.
#[test]
fn last_logits_match_the_graph() {
    for (bias, b, t) in [(true, 2, 16), (false, 3, 5)] {
        let m = model(bias, Activation::GeluTanh, 0.0, 2, 16, 2);
        let cpu = CpuGpt::new(&m).unwrap();
        let x = tokens(b * t, 7, 29);
        let mut scratch = Scratch::default();
        let flat = m.params.to_flat().unwrap();
        let got = cpu.last_logits(&mut scratch, &flat, &x, b, t).unwrap();
        let xt = Tensor::from_slice(&x, (b, t), &Device::Cpu).unwrap();
        let all = m.forward(&xt, None).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(got.len(), b * 29);
        for (s, row) in got.chunks(29).enumerate() {
            let want = &all[s * t + t - 1];
            for (g, w) in row.iter().zip(want) {
                assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{g} vs {w}");
            }
        }
    }
}

/// The unblocked causal attention (full T x T products, then the mask): the oracle of the blocked one.
/// Causal self-attention of qkv (n, 3C: q | k | v, heads side by side) into y (n, C), saving the
/// probabilities (B, H, T, T; zero above the diagonal). One task per sequence.
fn full_attention_forward(
    qkv: &[f32],
    att: &mut [f32],
    y: &mut [f32],
    t: usize,
    c: usize,
    h: usize,
) {
    let hs = c / h;
    let scale = 1.0 / (hs as f32).sqrt();
    att.par_chunks_mut(h * t * t)
        .zip(y.par_chunks_mut(t * c))
        .zip(qkv.par_chunks(t * 3 * c))
        .for_each(|((att, y), qkv)| {
            for hd in 0..h {
                let q = M::strided(&qkv[hd * hs..], t, hs, 3 * c);
                let k = M::strided(&qkv[c + hd * hs..], t, hs, 3 * c);
                let v = M::strided(&qkv[2 * c + hd * hs..], t, hs, 3 * c);
                let pr = &mut att[hd * t * t..][..t * t];
                mm(pr, t, q, k.t(), false, scale, Parallelism::None);
                for (i, row) in pr.chunks_mut(t).enumerate() {
                    let (keep, masked) = row.split_at_mut(i + 1);
                    let max = row_max(keep);
                    // The exponentials in a loop of their own (it vectorizes), then their sum in order.
                    keep.iter_mut()
                        .for_each(|s| *s = crate::model::ops::exp(*s - max));
                    let inv = 1.0 / keep.iter().sum::<f32>();
                    keep.iter_mut().for_each(|s| *s *= inv);
                    masked.iter_mut().for_each(|s| *s = 0.0);
                }
                mm(
                    &mut y[hd * hs..],
                    c,
                    M::new(pr, t, t),
                    v,
                    false,
                    1.0,
                    Parallelism::None,
                );
            }
        });
}

/// Backward of `attention_forward` given dy (n, C): dqkv (n, 3C) is overwritten.
#[allow(clippy::too_many_arguments)]
fn full_attention_backward(
    qkv: &[f32],
    att: &[f32],
    dy: &[f32],
    dqkv: &mut [f32],
    t: usize,
    c: usize,
    h: usize,
) {
    let hs = c / h;
    let scale = 1.0 / (hs as f32).sqrt();
    dqkv.par_chunks_mut(t * 3 * c)
        .zip(att.par_chunks(h * t * t))
        .zip(dy.par_chunks(t * c))
        .zip(qkv.par_chunks(t * 3 * c))
        .for_each(|(((dqkv, att), dy), qkv)| {
            let mut ds = vec![0.0f32; t * t];
            for hd in 0..h {
                let q = M::strided(&qkv[hd * hs..], t, hs, 3 * c);
                let k = M::strided(&qkv[c + hd * hs..], t, hs, 3 * c);
                let v = M::strided(&qkv[2 * c + hd * hs..], t, hs, 3 * c);
                let dyh = M::strided(&dy[hd * hs..], t, hs, c);
                let pr = &att[hd * t * t..][..t * t];
                // dP = dy v^T; dv = P^T dy.
                mm(&mut ds, t, dyh, v.t(), false, 1.0, Parallelism::None);
                mm(
                    &mut dqkv[2 * c + hd * hs..],
                    3 * c,
                    M::new(pr, t, t).t(),
                    dyh,
                    false,
                    1.0,
                    Parallelism::None,
                );
                // dS = P (dP - rowsum(P dP)); zero where P is.
                for (i, (ds, pr)) in ds.chunks_mut(t).zip(pr.chunks(t)).enumerate() {
                    // P is zero above the diagonal: those terms would add zeros to this serial sum.
                    let dot: f32 = ds[..=i].iter().zip(pr).map(|(d, p)| d * p).sum();
                    ds.iter_mut()
                        .zip(pr)
                        .for_each(|(d, &p)| *d = p * (*d - dot));
                }
                // S = scale q k^T: dq = scale dS k, dk = scale dS^T q.
                let dsm = M::new(&ds, t, t);
                mm(
                    &mut dqkv[hd * hs..],
                    3 * c,
                    dsm,
                    k,
                    false,
                    scale,
                    Parallelism::None,
                );
                mm(
                    &mut dqkv[c + hd * hs..],
                    3 * c,
                    dsm.t(),
                    q,
                    false,
                    scale,
                    Parallelism::None,
                );
            }
        });
}

/// The blocked attention computes what the full T x T products give, forward and backward: the blocks
/// only leave out products with the zeros above the diagonal. Bit for bit up to one block (the same
/// products); beyond it gemm may pick other kernels for a block's few rows (its last bits), so within
/// 1e-5 of the largest value. Lengths below, at and across block boundaries; one thread or several.
#[test]
fn blocked_attention_equals_the_full_products() {
    use rand::Rng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let (b, c, h) = (2, 24, 3);
    let b1 = ATT_BLOCK;
    for t in [
        1,
        5,
        b1 - 1,
        b1,
        b1 + 1,
        b1 + 3,
        b1 + 8,
        2 * b1 + 1,
        3 * b1 + 2,
        4 * b1,
    ] {
        let mut rand =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
        let (qkv, dy) = (rand(b * t * 3 * c), rand(b * t * c));
        let run = |blocked: bool| {
            if blocked {
                let pool = HeadPool::default();
                return attention_run(&qkv, &dy, b, Att { t, c, h, amp: None }, &pool);
            }
            let mut att = vec![f32::NAN; b * h * t * t];
            let mut y = vec![f32::NAN; b * t * c];
            let mut dqkv = vec![f32::NAN; b * t * 3 * c];
            full_attention_forward(&qkv, &mut att, &mut y, t, c, h);
            full_attention_backward(&qkv, &att, &dy, &mut dqkv, t, c, h);
            [att, y, dqkv]
        };
        let (blocked, full) = (run(true), run(false));
        // A task per head: the same bits whatever the threads that take them.
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        assert!(
            one.install(|| run(true)) == blocked,
            "T = {t}: one thread differs"
        );
        for (what, (x, want)) in ["probabilities", "output", "gradient"]
            .iter()
            .zip(blocked.iter().zip(&full))
        {
            if t <= ATT_BLOCK {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(bits(x) == bits(want), "{what}, T = {t}: not bit for bit");
            }
            let top = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let worst = x
                .iter()
                .zip(want)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                worst <= 1e-5 * top,
                "{what}, T = {t}: off by {worst} (largest {top})"
            );
        }
    }
}

/// Attention's forward and backward (probabilities, output, gradient) in `s`'s precision.
/// `pool` holds the tasks' scratch, as the activations' does in training.
fn attention_run(qkv: &[f32], dy: &[f32], b: usize, s: Att, pool: &HeadPool) -> [Vec<f32>; 3] {
    let (t, c, h) = (s.t, s.c, s.h);
    let mut att = vec![f32::NAN; b * h * t * t];
    let mut y = vec![f32::NAN; b * t * c];
    let mut dqkv = vec![f32::NAN; b * t * 3 * c];
    let mut heads = vec![f32::NAN; 3 * b * t * c];
    let out = ActMut::F32(&mut y);
    attention_forward(qkv, &mut att, out, &mut heads[..b * t * c], pool, s);
    attention_backward(
        (qkv, &att, dy),
        (ActMut::F32(&mut dqkv), None),
        &mut heads,
        pool,
        s,
    );
    [att, y, dqkv]
}

/// The largest difference between `x` and `want` over the largest magnitude of `want`.
fn relative_gap(x: &[f32], want: &[f32]) -> f32 {
    let top = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let worst = x
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    worst / top
}

/// Under `train.amp` the attention's products take bf16 operands with f32 sums, as the linear layers'
/// do: on every path this CPU has, the emulated path's results (the same products, summed in another
/// order: within 1e-4 of the largest value), and near the f32 attention (bf16's 8 bits: within 3e-2)
/// but not equal to it. Lengths inside one block and across several.
#[test]
fn bf16_attention_is_the_f32_products_of_rounded_operands() {
    use rand::Rng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let (b, c, h) = (2, 48, 3);
    for t in [5, 3 * ATT_BLOCK + 2] {
        let mut rand =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
        let (qkv, dy) = (rand(b * t * 3 * c), rand(b * t * c));
        let s = |amp| Att { t, c, h, amp };
        let pool = HeadPool::default();
        let f32_run = attention_run(&qkv, &dy, b, s(None), &pool);
        let emulated = attention_run(&qkv, &dy, b, s(Some(Bf16Path::EMULATED)), &pool);
        for (what, (x, want)) in ["probabilities", "output", "gradient"]
            .iter()
            .zip(emulated.iter().zip(&f32_run))
        {
            let gap = relative_gap(x, want);
            assert!(
                gap > 0.0 && gap <= 3e-2,
                "{what}, T = {t}: bf16 vs f32 {gap}"
            );
        }
        for path in Bf16Path::available()
            .into_iter()
            .filter(|p| p.is_hardware())
        {
            let hw = attention_run(&qkv, &dy, b, s(Some(path)), &pool);
            for (what, (x, want)) in ["probabilities", "output", "gradient"]
                .iter()
                .zip(hw.iter().zip(&emulated))
            {
                let gap = relative_gap(x, want);
                assert!(gap <= 1e-4, "{what}, T = {t}: {path} vs emulated {gap}");
            }
        }
    }
}

/// The tasks' scratch kept from call to call (`HeadPool`) holds what the last calls left: longer and
/// shorter sequences, other precisions. Each call gives the bits a fresh pool gives, on every path.
#[test]
fn attention_scratch_kept_between_calls_changes_no_bit() {
    use rand::Rng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let (b, c, h) = (2, 48, 3);
    let mut paths: Vec<Option<Bf16Path>> = vec![None];
    paths.extend(Bf16Path::available().into_iter().map(Some));
    let kept = HeadPool::default();
    for t in [3 * ATT_BLOCK + 2, 7, 2 * ATT_BLOCK, 1] {
        let mut rand =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
        let (qkv, dy) = (rand(b * t * 3 * c), rand(b * t * c));
        for &amp in paths.iter().chain(paths.iter().rev()) {
            let s = Att { t, c, h, amp };
            let fresh = attention_run(&qkv, &dy, b, s, &HeadPool::default());
            let again = attention_run(&qkv, &dy, b, s, &kept);
            let bits = |r: &[Vec<f32>; 3]| {
                r.iter()
                    .flat_map(|v| v.iter().map(|x| x.to_bits()))
                    .collect::<Vec<_>>()
            };
            assert!(bits(&again) == bits(&fresh), "T = {t}, {amp:?}: differs");
        }
    }
}

#[test]
fn bad_tokens_and_shapes_are_errors() {
    let m = model(false, Activation::Gelu, 0.0, 1, 8, 2);
    let cpu = CpuGpt::new(&m).unwrap();
    let mut scratch = Scratch::default();
    let e = cpu
        .loss(
            &mut scratch,
            &m.params.to_flat().unwrap(),
            &[1, 29],
            &[1, 2],
            1,
            2,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("outside the vocabulary of 29"), "{e}");
    let e = cpu
        .loss(
            &mut scratch,
            &m.params.to_flat().unwrap(),
            &[1; 17],
            &[1; 17],
            1,
            17,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("longer than the model's context of 16"), "{e}");
}

/// A pass called from a thread outside any pool runs on a thread of the global pool (its parallel ops
/// then stay inside the pool), and one called from a pool's thread stays on that thread.
#[test]
fn passes_run_inside_the_pool() {
    let outside = std::thread::spawn(|| in_pool(rayon::current_thread_index))
        .join()
        .unwrap();
    assert!(outside.is_some(), "ran outside the pool");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    pool.install(|| {
        let here = std::thread::current().id();
        assert_eq!(in_pool(|| std::thread::current().id()), here);
    });
}

/// The element-wise passes that ask for their lines ahead (`add`, `mul`, `map`, `map_with_grad`,
/// `scale_by`) equal one plain loop over the entries, bit for bit, over lengths that end mid-vector,
/// mid-line and past a parallel task's chunk.
#[test]
fn element_wise_passes_asking_ahead_equal_plain_loops() {
    use rand::Rng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(41);
    use crate::model::ops::CHUNK;
    for n in [1, 15, 17, 1000, CHUNK - 3, 2 * CHUNK + 1029] {
        let mut r = |_| rng.random_range(-4.0f32..4.0);
        let (a, b): (Vec<f32>, Vec<f32>) =
            ((0..n).map(&mut r).collect(), (0..n).map(&mut r).collect());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let plain = |f: &dyn Fn(f32, f32) -> f32| -> Vec<u32> {
            bits(&a.iter().zip(&b).map(|(&a, &b)| f(a, b)).collect::<Vec<_>>())
        };
        let mut out = vec![f32::NAN; n];
        layers::add(&mut out, &a, &b);
        assert_eq!(bits(&out), plain(&|a, b| a + b), "add, {n}");
        layers::mul(&mut out, &a, &b);
        assert_eq!(bits(&out), plain(&|a, b| a * b), "mul, {n}");
        layers::map(ActMut::F32(&mut out), &a, gelu_tanh);
        assert_eq!(bits(&out), plain(&|a, _| gelu_tanh(a)), "map, {n}");
        for (form, strip, pair) in GELU_FORMS {
            let mut x = a.clone();
            layers::map_with_grad(ActMut::F32(&mut out), &mut x, strip);
            assert_eq!(bits(&out), plain(&|a, _| pair(a).0), "{form} value, {n}");
            assert_eq!(bits(&x), plain(&|a, _| pair(a).1), "{form} derivative, {n}");
        }
        // Into bf16: the values rounded as each path's products round them.
        for path in Bf16Path::available() {
            let rounded = |v: &[f32]| {
                let mut h = vec![0u16; v.len()];
                to_bf16(path, v, &mut h);
                h
            };
            let mut half = vec![0u16; n];
            layers::map(ActMut::Bf16(&mut half, path), &a, gelu_tanh);
            let want: Vec<f32> = a.iter().map(|&a| gelu_tanh(a)).collect();
            assert_eq!(half, rounded(&want), "map into bf16, {n}, {path}");
            let mut x = a.clone();
            layers::map_with_grad(ActMut::Bf16(&mut half, path), &mut x, gelu_erf_strip);
            let want: Vec<f32> = a.iter().map(|&a| gelu_erf_and_grad(a).0).collect();
            assert_eq!(half, rounded(&want), "value into bf16, {n}, {path}");
            assert_eq!(
                bits(&x),
                plain(&|a, _| gelu_erf_and_grad(a).1),
                "derivative beside bf16, {n}, {path}"
            );
        }
        let mut g = a.clone();
        layers::scale_by(&mut g, &b);
        assert_eq!(bits(&g), plain(&|a, b| a * b), "scale_by, {n}");
    }
}

/// `layers::causal_sums` (the softmax's and its backward's row sums, rows interleaved) gives each row's
/// own serial sum (`Iterator::sum` over its causal terms) bit for bit, for every group size and start.
#[test]
fn causal_sums_are_each_rows_serial_sum() {
    use rand::Rng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let t = 70;
    let x: Vec<f32> = (0..ROWS * t)
        .map(|_| rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-3..4)))
        .collect();
    for i0 in [0, 1, 5, 16, 61] {
        for k in 1..=ROWS {
            let got = layers::causal_sums(k, i0, |r, j| x[r * t + j]);
            for r in 0..k {
                let want: f32 = x[r * t..][..=i0 + r].iter().sum();
                assert_eq!(got[r].to_bits(), want.to_bits(), "row {r} of {k} from {i0}");
            }
        }
    }
}

//! The fused ops against candle's composed forms, and the GELU and heads kernels against their twins.

use super::gelu::Gelu;
use super::*;
use candle_core::{Device, Var, D};

/// candle's composed form: scale, add the causal mask, softmax.
fn composed(s: &Tensor, scale: f64) -> Tensor {
    let t = s.dim(D::Minus1).unwrap();
    let mask: Vec<f32> = (0..t * t)
        .map(|k| {
            if k % t > k / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), s.device()).unwrap();
    candle_nn::ops::softmax(
        &(s * scale).unwrap().broadcast_add(&mask).unwrap(),
        D::Minus1,
    )
    .unwrap()
}

/// The op and candle's composed softmax agree, forward and in the gradient of a weighted sum of the
/// output (to f32 rounding: their sums add in different orders), on a non-contiguous input.
#[test]
fn the_op_is_candles_composed_masked_softmax_forward_and_backward() {
    let (b, h, t, scale) = (2, 3, 45, 0.125);
    let dev = Device::Cpu;
    let s = Var::from_tensor(&(Tensor::randn(0f32, 3.0, (b, h, t, t), &dev).unwrap())).unwrap();
    let w = Tensor::randn(0f32, 1.0, (b, h, t, t), &dev).unwrap();
    let st = s.as_tensor().transpose(2, 3).unwrap();
    let ours = causal_softmax(&st, scale as f32, &Place::Host).unwrap();
    let theirs = composed(&st, scale);
    let diff = |a: &Tensor, b: &Tensor| -> f32 {
        let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
        d.max(0).unwrap().to_scalar().unwrap()
    };
    assert!(
        diff(&ours, &theirs) < 1e-6,
        "forward: {}",
        diff(&ours, &theirs)
    );
    let grad = |y: &Tensor| (y * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let (go, gt) = (grad(&ours), grad(&theirs));
    let (go, gt) = (go.get(&s).unwrap(), gt.get(&s).unwrap());
    assert!(diff(go, gt) < 1e-6, "backward: {}", diff(go, gt));
    let zero = (go.abs().unwrap().sum_all().unwrap())
        .to_scalar::<f32>()
        .unwrap();
    assert!(zero > 0.1, "a gradient flows ({zero})");
}

/// The op's mean and candle's cross-entropy (log-softmax, gather, mean) agree in the loss and its
/// gradient (to f32 rounding), on non-contiguous logits.
#[test]
fn the_op_is_candles_cross_entropy_forward_and_backward() {
    let (rows, v) = (37, 301);
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::randn(0f32, 4.0, (v, rows), &dev).unwrap()).unwrap();
    let y: Vec<u32> = (0..rows as u32).map(|r| r * 131 % v as u32).collect();
    let y = Tensor::from_vec(y, rows, &dev).unwrap();
    let xt = x.as_tensor().t().unwrap();
    let ours = cross_entropy(&xt, &y, &Place::Host)
        .unwrap()
        .mean_all()
        .unwrap();
    let theirs = candle_nn::loss::cross_entropy(&xt, &y).unwrap();
    let (a, b) = (
        ours.to_scalar::<f32>().unwrap(),
        theirs.to_scalar::<f32>().unwrap(),
    );
    assert!((a - b).abs() < 1e-5 * b.abs(), "loss: {a} vs {b}");
    let (go, gt) = (ours.backward().unwrap(), theirs.backward().unwrap());
    let (go, gt) = (go.get(&x).unwrap(), gt.get(&x).unwrap());
    let d = (go - gt).unwrap().abs().unwrap().flatten_all().unwrap();
    let d: f32 = d.max(0).unwrap().to_scalar().unwrap();
    assert!(d < 1e-7, "gradient: {d}");
    let norm: f32 = go.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
    assert!(norm > 1e-3, "a gradient flows ({norm})");
}

/// The op and candle's composed layer norm (as the model built it before) agree, forward and in the
/// gradients at x, w and b (to f32 rounding), on a non-contiguous input of more rows than a block of
/// the column sums.
#[test]
fn the_op_is_candles_composed_layer_norm_forward_and_backward() {
    let (rows, c) = (130, 40);
    let dev = Device::Cpu;
    let randn = |shape: &[usize], s: f32| {
        Var::from_tensor(&Tensor::randn(0f32, s, shape, &dev).unwrap()).unwrap()
    };
    let (x, w, b) = (randn(&[c, rows], 2.0), randn(&[c], 1.0), randn(&[c], 1.0));
    let up = Tensor::randn(0f32, 1.0, (rows, c), &dev).unwrap();
    let xt = x.as_tensor().t().unwrap();
    let ours = layer_norm(&xt, &w, &b, 1e-5, &Place::Host).unwrap();
    let mean = xt.mean_keepdim(D::Minus1).unwrap();
    let xc = xt.broadcast_sub(&mean).unwrap();
    let var = xc.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let xn = xc
        .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
        .unwrap();
    let theirs = xn.broadcast_mul(&w).unwrap().broadcast_add(&b).unwrap();
    let diff = |a: &Tensor, b: &Tensor| -> f32 {
        let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
        d.max(0).unwrap().to_scalar().unwrap()
    };
    assert!(
        diff(&ours, &theirs) < 1e-5,
        "forward: {}",
        diff(&ours, &theirs)
    );
    let grad = |y: &Tensor| (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
    let (go, gt) = (grad(&ours), grad(&theirs));
    for (v, what, tol) in [(&x, "x", 1e-5), (&w, "w", 1e-4), (&b, "b", 1e-4)] {
        let (a, e) = (go.get(v).unwrap(), gt.get(v).unwrap());
        assert!(diff(a, e) < tol, "gradient at {what}: {}", diff(a, e));
        let norm: f32 = a.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        assert!(norm > 1e-3, "a gradient flows to {what} ({norm})");
    }
}

/// Values over GELU's whole range: both tails (where exp saturates), the middle, and zero.
fn gelu_inputs() -> Vec<f32> {
    let mut x: Vec<f32> = (0..4000).map(|i| (i as f32 - 2000.0) * 0.005).collect();
    x.extend([0.0, -0.0, 1e-30, -60.0, 60.0, 9.0, -9.0, 3.3e-3]);
    x
}

/// Both forms of the op follow candle's GELU (erf and tanh forms) forward and in the gradient, to the
/// CPU engine's polynomial erf and exp (1e-6).
#[test]
fn the_gelu_op_follows_candles_gelu_forward_and_backward() {
    let dev = Device::Cpu;
    let xs = gelu_inputs();
    let x = Var::from_vec(xs.clone(), xs.len(), &dev).unwrap();
    let up = Tensor::randn(0f32, 1.0, xs.len(), &dev).unwrap();
    for tanh_form in [false, true] {
        let ours = gelu(&x, tanh_form, &Place::Host).unwrap();
        let theirs = if tanh_form {
            x.gelu().unwrap()
        } else {
            x.gelu_erf().unwrap()
        };
        let d = |a: &Tensor, b: &Tensor| -> f32 {
            (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar()
                .unwrap()
        };
        assert!(
            d(&ours, &theirs) < 1e-6,
            "forward, tanh {tanh_form}: {}",
            d(&ours, &theirs)
        );
        let grad = |y: &Tensor| (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let (go, gt) = (grad(&ours), grad(&theirs));
        let (go, gt) = (go.get(&x).unwrap(), gt.get(&x).unwrap());
        assert!(
            d(go, gt) < 1e-5,
            "backward, tanh {tanh_form}: {}",
            d(go, gt)
        );
    }
}

/// The GELU kernels, run on the host with their launcher's grid, give the CPU engine's floats bit for
/// bit (`ops`), in both forms.
#[test]
fn the_gelu_kernels_are_the_cpu_engines_gelu() {
    use crate::kernels::emulate::{per_element, Arg, Emulator, Source};
    let Some(e) = Emulator::get(Source::Model) else {
        return;
    };
    let x = gelu_inputs();
    let g: Vec<f32> = (0..x.len()).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for tanh_form in [false, true] {
        let op = Gelu {
            tanh_form,
            place: Place::Host,
        };
        let y: Vec<f32> = x.iter().map(|&v| op.at(v).0).collect();
        let dx: Vec<f32> = x.iter().zip(&g).map(|(&v, &g)| g * op.at(v).1).collect();
        let (n, form) = (Arg::U32(x.len() as u32), Arg::U32(tanh_form as u32));
        let mut args = [
            Arg::F32s(x.clone()),
            Arg::F32s(vec![f32::NAN; x.len()]),
            n.clone(),
            form.clone(),
        ];
        e.launch("gelu", per_element(x.len()), &mut args);
        assert_eq!(bits(args[1].f32s()), bits(&y), "forward, tanh {tanh_form}");
        let nan = Arg::F32s(vec![f32::NAN; x.len()]);
        let mut args = [Arg::F32s(x.clone()), Arg::F32s(g.clone()), nan, n, form];
        e.launch("gelu_backward", per_element(x.len()), &mut args);
        assert_eq!(
            bits(args[2].f32s()),
            bits(&dx),
            "backward, tanh {tanh_form}"
        );
    }
}

/// A tensor's values as bits.
fn tensor_bits(v: &Tensor) -> Vec<u32> {
    let v = v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

/// `to_heads` and `from_heads` are candle's reshape, transpose and contiguous, forward and in the
/// gradient, bit for bit (a permutation moves values, it computes none), on a non-contiguous input; and
/// `from_heads` undoes `to_heads`.
#[test]
fn the_heads_ops_are_candles_reshape_and_transpose_forward_and_backward() {
    let (b, t, nh, hs) = (2, 5, 3, 7);
    let (c, dev) = (nh * hs, Device::Cpu);
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (c, b * t), &dev).unwrap()).unwrap();
    let up = Tensor::randn(0f32, 1.0, (b, nh, t, hs), &dev).unwrap();
    let xt = x.as_tensor().t().unwrap();
    let ours = to_heads(&xt, t, nh, &Place::Host).unwrap();
    let theirs = xt.reshape((b, t, nh, hs)).unwrap().transpose(1, 2).unwrap();
    let bits = tensor_bits;
    assert_eq!(bits(&ours), bits(&theirs.contiguous().unwrap()), "forward");
    let back = from_heads(&ours, &Place::Host).unwrap();
    assert_eq!(back.dims(), [b * t, c]);
    assert_eq!(bits(&back), bits(&xt.contiguous().unwrap()), "inverse");
    let grad = |y: &Tensor| (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
    let (go, gt) = (grad(&ours), grad(&theirs));
    assert_eq!(
        bits(go.get(&x).unwrap()),
        bits(gt.get(&x).unwrap()),
        "to_heads' gradient"
    );
    let (go, gt) = (
        grad(&to_heads(&back, t, nh, &Place::Host).unwrap()),
        grad(&theirs),
    );
    assert_eq!(
        bits(go.get(&x).unwrap()),
        bits(gt.get(&x).unwrap()),
        "from_heads' gradient"
    );
}

/// The permutation's kernel, run on the host with its launcher's grid, writes what its twin writes, both
/// ways, and the twin is the permutation entry for entry.
#[test]
fn the_heads_kernel_is_its_twin() {
    use crate::kernels::emulate::{per_element, Arg, Emulator, Source};
    let Some(e) = Emulator::get(Source::Model) else {
        return;
    };
    let (b, t, nh, hs) = (3, 11, 4, 9);
    let n = b * t * nh * hs;
    let src: Vec<f32> = (0..n).map(|i| i as f32).collect();
    for to_heads in [true, false] {
        let mut want = vec![f32::NAN; n];
        twin::permute_heads(&src, &mut want, t, nh, hs, to_heads);
        for (i, (bt, col)) in (0..b * t)
            .flat_map(|r| (0..nh * hs).map(move |c| (r, c)))
            .enumerate()
        {
            let j = ((bt / t * nh + col / hs) * t + bt % t) * hs + col % hs;
            let (from, to) = if to_heads { (i, j) } else { (j, i) };
            assert_eq!(want[to], src[from], "to_heads {to_heads}: entry {i}");
        }
        let u = |v: usize| Arg::U32(v as u32);
        let mut args = [
            Arg::F32s(src.clone()),
            Arg::F32s(vec![f32::NAN; n]),
            u(n),
            u(t),
            u(nh),
            u(hs),
            u(to_heads as usize),
        ];
        e.launch("permute_heads", per_element(n), &mut args);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(args[1].f32s()), bits(&want), "to_heads {to_heads}");
    }
}

/// Token ids with repeats, in no order, and tokens of the table no position has.
fn embedding_ids() -> Vec<u32> {
    (0..97u32)
        .map(|i| i * 37 % 23 + (i % 5 == 0) as u32 * 40)
        .collect()
}

/// The embedding op is candle's `index_select`, forward and in the gradient at the table (candle's
/// `index_add` on the CPU adds each position's row in position order, as the op does), bit for bit.
#[test]
fn the_embedding_op_is_candles_index_select_forward_and_backward() {
    let (v, c, dev) = (70, 13, Device::Cpu);
    let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (v, c), &dev).unwrap()).unwrap();
    let ids = embedding_ids();
    let up = Tensor::randn(0f32, 1.0, (ids.len(), c), &dev).unwrap();
    let ours = embedding(&w, &ids, &Place::Host).unwrap();
    let idt = Tensor::from_vec(ids.clone(), ids.len(), &dev).unwrap();
    let theirs = w.index_select(&idt, 0).unwrap();
    let bits = tensor_bits;
    assert_eq!(bits(&ours), bits(&theirs), "forward");
    let grad = |y: &Tensor| (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
    let (go, gt) = (grad(&ours), grad(&theirs));
    assert_eq!(
        bits(go.get(&w).unwrap()),
        bits(gt.get(&w).unwrap()),
        "gradient"
    );
    assert!(
        embedding(&w, &[3, 70], &Place::Host).is_err(),
        "an id past the table"
    );
}

/// The embedding's kernels, run on the host with their launchers' grids, write what their twins write:
/// the rows of the table forward; backward each token's row of the gradient (the others left as the
/// zeros they were), bit for bit.
#[test]
fn the_embedding_kernels_are_their_twins() {
    use crate::kernels::emulate::{per_element, Arg, Emulator, Source};
    let Some(e) = Emulator::get(Source::Model) else {
        return;
    };
    let (v, c, ids) = (70, 300, embedding_ids());
    let n = ids.len() * c;
    let w: Vec<f32> = (0..v * c).map(|i| (i as f32 * 0.37).sin()).collect();
    let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut want = vec![0.0f32; n];
    twin::embedding(&w, &ids, &mut want, c);
    let u = |x: usize| Arg::U32(x as u32);
    let mut args = [
        Arg::F32s(w.clone()),
        Arg::U32s(ids.clone()),
        Arg::F32s(vec![f32::NAN; n]),
        u(n),
        u(c),
    ];
    e.launch("embedding", per_element(n), &mut args);
    assert_eq!(bits(args[2].f32s()), bits(&want), "forward");
    let runs = twin::TokenRuns::new(&ids);
    let mut want = vec![0.0f32; v * c];
    twin::embedding_backward(&g, &runs, &mut want, c);
    let mut args = [
        Arg::F32s(g),
        Arg::U32s(runs.order.clone()),
        Arg::U32s(runs.starts.clone()),
        Arg::U32s(runs.tokens.clone()),
        Arg::F32s(vec![0.0; v * c]),
        u(c),
    ];
    e.launch(
        "embedding_backward",
        (runs.tokens.len() as u32, 1),
        &mut args,
    );
    assert_eq!(bits(args[4].f32s()), bits(&want), "backward");
}

/// The bias op is candle's broadcast add: the same values bit for bit, the same gradient at x (the
/// upstream gradient itself), and at b each column's sum: the sums add in blocks of rows, so each is
/// held to the f64 sum within the bound of any order of f32 additions (rows x eps x the sum of
/// magnitudes), as candle's is; on more rows than a block of the column sums.
#[test]
fn the_bias_op_is_candles_broadcast_add_forward_and_backward() {
    let (rows, n, dev) = (150, 37, Device::Cpu);
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, rows), &dev).unwrap()).unwrap();
    let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, n, &dev).unwrap()).unwrap();
    let up = Tensor::randn(0f32, 1.0, (rows, n), &dev).unwrap();
    let xt = x.as_tensor().t().unwrap();
    let ours = bias_add(&xt, &b, &Place::Host).unwrap();
    let theirs = xt.broadcast_add(&b).unwrap();
    let bits = tensor_bits;
    assert_eq!(bits(&ours), bits(&theirs), "forward");
    let grad = |y: &Tensor| (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
    let (go, gt) = (grad(&ours), grad(&theirs));
    assert_eq!(
        bits(go.get(&x).unwrap()),
        bits(gt.get(&x).unwrap()),
        "gradient at x"
    );
    let up = up.to_vec2::<f32>().unwrap();
    for (who, g) in [("ours", go), ("candle's", gt)] {
        let g = g.get(&b).unwrap().to_vec1::<f32>().unwrap();
        for (j, &got) in g.iter().enumerate() {
            let exact: f64 = up.iter().map(|r| r[j] as f64).sum();
            let size: f64 = up.iter().map(|r| r[j].abs() as f64).sum();
            let bound = rows as f64 * f32::EPSILON as f64 * size;
            let off = (got as f64 - exact).abs();
            assert!(
                off <= bound,
                "{who} gradient at b[{j}]: off by {off} (bound {bound})"
            );
        }
    }
}

/// The bias kernels, run on the host with their launchers' grids, write what their twins write, bit
/// for bit: the sums over a last, partial block of rows and columns past a block of threads.
#[test]
fn the_bias_kernels_are_their_twins() {
    use crate::kernels::emulate::{per_element, Arg, Emulator, Source};
    use crate::kernels::{model::LN_ROWS, BLOCK};
    let Some(e) = Emulator::get(Source::Model) else {
        return;
    };
    let (rows, n) = (2 * LN_ROWS + 5, BLOCK + 3);
    let x: Vec<f32> = (0..rows * n).map(|i| (i as f32 * 0.37).sin()).collect();
    let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut want = vec![0.0f32; x.len()];
    twin::bias_add(&x, &b, &mut want);
    let u = |v: usize| Arg::U32(v as u32);
    let nan = |len: usize| Arg::F32s(vec![f32::NAN; len]);
    let mut args = [
        Arg::F32s(x.clone()),
        Arg::F32s(b),
        nan(x.len()),
        u(x.len()),
        u(n),
    ];
    e.launch("bias_add", per_element(x.len()), &mut args);
    assert_eq!(bits(args[2].f32s()), bits(&want), "forward");
    let blocks = rows.div_ceil(LN_ROWS);
    let mut args = [Arg::F32s(x.clone()), nan(blocks * n), u(rows), u(n)];
    let columns = n.div_ceil(BLOCK) as u32;
    e.launch("column_partials", (blocks as u32, columns), &mut args);
    let mut args = [args[1].clone(), nan(n), u(blocks), u(n)];
    e.launch("column_totals", (columns, 1), &mut args);
    assert_eq!(
        bits(args[1].f32s()),
        bits(&twin::column_sums(&x, n)),
        "column sums"
    );
}

/// Scores that are not (.., T, T) f32, logits and targets of other shapes or types, and a gain and
/// bias that do not fit the rows, are refused with an error, not a panic.
#[test]
fn other_shapes_are_refused() {
    let dev = Device::Cpu;
    for s in [
        Tensor::zeros((2, 3), DType::F32, &dev).unwrap(),
        Tensor::zeros(4, DType::F32, &dev).unwrap(),
        Tensor::zeros((3, 3), DType::BF16, &dev).unwrap(),
    ] {
        assert!(causal_softmax(&s, 1.0, &Place::Host).is_err());
    }
    let y = Tensor::zeros(2, DType::U32, &dev).unwrap();
    let logits = Tensor::zeros((2, 5), DType::F32, &dev).unwrap();
    assert!(cross_entropy(&logits, &y, &Place::Host).is_ok());
    assert!(cross_entropy(&logits, &y.to_dtype(DType::F32).unwrap(), &Place::Host).is_err());
    assert!(cross_entropy(&logits.t().unwrap(), &y, &Place::Host).is_err());
    let w = Tensor::zeros(5, DType::F32, &dev).unwrap();
    assert!(layer_norm(&logits, &w, &w, 1e-5, &Place::Host).is_ok());
    assert!(layer_norm(&logits, &w.narrow(0, 0, 4).unwrap(), &w, 1e-5, &Place::Host).is_err());
    assert!(layer_norm(&logits.t().unwrap(), &w, &w, 1e-5, &Place::Host).is_err());
    let rows = Tensor::zeros((6, 4), DType::F32, &dev).unwrap();
    assert!(to_heads(&rows, 3, 2, &Place::Host).is_ok());
    assert!(to_heads(&rows, 4, 2, &Place::Host).is_err());
    assert!(to_heads(&rows, 3, 3, &Place::Host).is_err());
    assert!(to_heads(&rows.to_dtype(DType::BF16).unwrap(), 3, 2, &Place::Host).is_err());
    assert!(from_heads(&rows, &Place::Host).is_err());
    let bias = Tensor::zeros(4, DType::F32, &dev).unwrap();
    assert!(bias_add(&rows, &bias, &Place::Host).is_ok());
    assert!(bias_add(&rows.t().unwrap(), &bias, &Place::Host).is_err());
    assert!(bias_add(&rows, &rows, &Place::Host).is_err());
}

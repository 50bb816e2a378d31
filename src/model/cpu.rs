//! The model's CPU engine: GPT-2's forward and backward written out by hand over the flat parameter
//! and gradient buffers, as llm.c does. On CPU, candle's autograd spends most of a small model's step
//! outside the matmuls: every gradient starts as a zeroed tensor that the first contribution is added
//! to, every op allocates, and its element-wise kernels run on a thread pool of their own beside
//! rayon's. Here the matmuls go straight to gemm (the kernels candle's CPU backend uses), activations
//! live in buffers kept across steps, gradients accumulate in place into the flat buffer the reducers
//! and the optimizer read, and everything runs on the worker's rayon pool.
//!
//! It computes what `Gpt` (candle) computes, dropout masks included (drawn from the same RNG in the
//! same order); tests check the loss and every gradient against candle's autograd.

use anyhow::{bail, ensure, Result};
use gemm::Parallelism;
use multiversion::multiversion;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::matmul::{mm, Bf16Buffers, Bf16Path, Precision, Products, M};
use super::ops::{
    gelu_erf, gelu_erf_grad, gelu_tanh, gelu_tanh_grad, row_max, row_sums_of, rows_lse,
    rows_per_task, rows_stats, CHUNK, ROWS,
};
use super::{Gpt, ParamSet};
use crate::config::Activation;
use std::cell::RefCell;

const LN_EPS: f32 = 1e-5;

/// One parameter: its place in the flat weights and gradient.
#[derive(Debug, Clone, Copy)]
struct Slot {
    off: usize,
    len: usize,
}

impl Slot {
    fn of<'g>(&self, grads: &'g mut [f32]) -> &'g mut [f32] {
        &mut grads[self.off..][..self.len]
    }
}

/// The parameters' values for one forward/backward (the caller's flat weights, name order), and the
/// products of the linear layers and lm head that read them.
struct Params<'a> {
    w: &'a [f32],
    mm: Products<'a>,
}

impl Params<'_> {
    fn get(&self, s: Slot) -> &[f32] {
        &self.w[s.off..][..s.len]
    }
}

/// A Linear's weight [out, in] and bias.
#[derive(Debug, Clone, Copy)]
struct Linear {
    w: Slot,
    b: Option<Slot>,
    out: usize,
    inp: usize,
}

/// A LayerNorm's gain and bias.
#[derive(Debug, Clone, Copy)]
struct Norm {
    w: Slot,
    b: Option<Slot>,
}

#[derive(Debug, Clone, Copy)]
struct Layer {
    ln1: Norm,
    attn: Linear,
    proj: Linear,
    ln2: Norm,
    fc: Linear,
    mproj: Linear,
}

/// Saved activations of one forward (per layer, stacked) and the backward's scratch; kept across steps
/// and reallocated only when the model or batch shape changes.
#[derive(Default)]
struct Acts {
    /// The model's layers, width, heads and vocabulary the buffers are sized for.
    dims: (usize, usize, usize, usize),
    b: usize,
    t: usize,
    /// Residual stream entering each layer, and entering the final LayerNorm (L + 1) x N x C.
    res: Vec<f32>,
    /// Residual stream after each layer's attention.
    res2: Vec<f32>,
    xn1: Vec<f32>,
    xn2: Vec<f32>,
    /// Row mean and 1/std of the LayerNorms (ln1, ln2 per layer, then ln_f).
    stats1: Vec<(f32, f32)>,
    stats2: Vec<(f32, f32)>,
    statsf: Vec<(f32, f32)>,
    qkv: Vec<f32>,
    /// Attention probabilities, B x H x T x T per layer.
    att: Vec<f32>,
    atty: Vec<f32>,
    fc: Vec<f32>,
    gelu: Vec<f32>,
    xf: Vec<f32>,
    /// Logits, overwritten by their gradient in the backward.
    logits: Vec<f32>,
    lse: Vec<f32>,
    /// Dropout scale factors (0 or 1/(1-p)) of the 2L + 1 dropout sites, when dropout is on.
    masks: Vec<f32>,
    /// Whether the last forward applied dropout.
    dropped: bool,
    /// Backward scratch.
    dres: Vec<f32>,
    dc: Vec<f32>,
    dc2: Vec<f32>,
    d4c: Vec<f32>,
    dqkv: Vec<f32>,
}

/// The memory one forward/backward works in: the activations it saves and the backward's scratch. It
/// belongs to whoever computes, not to the model: N workers on C cores need only C of them (see
/// `train::compute`), and it is reused across steps (resized only when the shapes change).
#[derive(Default)]
pub struct Scratch {
    acts: Acts,
    /// The operands of the bf16 products (`train.amp`).
    bf16: RefCell<Bf16Buffers>,
}

/// The lengths of a Scratch's buffers for a model (layers, width, heads, vocabulary) and a b x t batch:
/// f32 buffers in `Acts` field order (res .. dqkv), then the three (mean, 1/std) buffers.
fn sizes(dims: (usize, usize, usize, usize), b: usize, t: usize, dropout: bool) -> [usize; 21] {
    let (l, c, h, v) = dims;
    let n = b * t;
    let nc = n * c;
    let masks = if dropout { (2 * l + 1) * nc } else { 0 };
    [
        (l + 1) * nc,      // res
        l * nc,            // res2
        l * nc,            // xn1
        l * nc,            // xn2
        l * 3 * nc,        // qkv
        l * b * h * t * t, // att
        l * nc,            // atty
        l * 4 * nc,        // fc
        l * 4 * nc,        // gelu
        nc,                // xf
        n * v,             // logits
        n,                 // lse
        masks,             // masks
        nc,                // dres
        nc,                // dc
        nc,                // dc2
        4 * nc,            // d4c
        3 * nc,            // dqkv
        l * n,             // stats1
        l * n,             // stats2
        n,                 // statsf
    ]
}

/// Bytes of the Scratch of one forward/backward of a b x t batch through a model of `n_layers` x
/// `n_embd` with `n_heads` heads and `vocab` tokens.
pub fn scratch_bytes(
    n_layers: usize,
    n_embd: usize,
    n_heads: usize,
    vocab: usize,
    b: usize,
    t: usize,
    dropout: bool,
) -> u64 {
    let s = sizes((n_layers, n_embd, n_heads, vocab), b, t, dropout);
    let (f32s, stats) = s.split_at(18);
    (4 * f32s.iter().sum::<usize>() + 8 * stats.iter().sum::<usize>()) as u64
}

/// The CPU engine of one model: its parameter layout (the values come with each call).
pub struct CpuGpt {
    n_layers: usize,
    c: usize,
    heads: usize,
    vocab: usize,
    context: usize,
    dropout: f64,
    activation: Activation,
    numel: usize,
    wte: Slot,
    wpe: Slot,
    layers: Vec<Layer>,
    lnf: Norm,
    /// The precision of the linear layers' and lm head's matmuls, and how this CPU runs bf16 ones.
    prec: Precision,
    bf16: Bf16Path,
}

/// Dropout at the residual stream's sites in forward order (the embeddings', then each block's two),
/// each site's mask kept in `masks` for the backward; off without an RNG.
struct Dropout<'r> {
    rng: Option<&'r mut ChaCha8Rng>,
    p: f64,
    site: usize,
}

impl Dropout<'_> {
    fn apply(&mut self, buf: &mut [f32], masks: &mut [f32]) {
        if let Some(rng) = self.rng.as_deref_mut() {
            let keep = (1.0 / (1.0 - self.p)) as f32;
            let mask = &mut masks[self.site * buf.len()..][..buf.len()];
            for (m, v) in mask.iter_mut().zip(buf.iter_mut()) {
                *m = if rng.random::<f64>() < self.p {
                    0.0
                } else {
                    keep
                };
                *v *= *m;
            }
        }
        self.site += 1;
    }
}

impl CpuGpt {
    /// The engine for `model`'s configuration and parameter layout.
    pub fn new(model: &Gpt) -> Result<Self> {
        let cfg = &model.cfg;
        let ps = &model.params;
        let c = cfg.n_embd;
        let off = |name: &str, len: usize| -> Result<Slot> { slot(ps, name, len) };
        let opt = |name: &str, len: usize| -> Result<Option<Slot>> {
            if cfg.bias {
                Ok(Some(slot(ps, name, len)?))
            } else {
                Ok(None)
            }
        };
        let norm = |p: &str| -> Result<Norm> {
            Ok(Norm {
                w: off(&format!("{p}.weight"), c)?,
                b: opt(&format!("{p}.bias"), c)?,
            })
        };
        let linear = |p: &str, out: usize, inp: usize| -> Result<Linear> {
            Ok(Linear {
                w: off(&format!("{p}.weight"), out * inp)?,
                b: opt(&format!("{p}.bias"), out)?,
                out,
                inp,
            })
        };
        let layers = (0..cfg.n_layers)
            .map(|i| {
                let h = format!("transformer.h.{i}");
                Ok(Layer {
                    ln1: norm(&format!("{h}.ln_1"))?,
                    attn: linear(&format!("{h}.attn.c_attn"), 3 * c, c)?,
                    proj: linear(&format!("{h}.attn.c_proj"), c, c)?,
                    ln2: norm(&format!("{h}.ln_2"))?,
                    fc: linear(&format!("{h}.mlp.c_fc"), 4 * c, c)?,
                    mproj: linear(&format!("{h}.mlp.c_proj"), c, 4 * c)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            n_layers: cfg.n_layers,
            c,
            heads: cfg.n_heads,
            vocab: cfg.vocab_size,
            context: model.context_length,
            dropout: cfg.dropout,
            activation: cfg.activation,
            numel: ps.numel,
            wte: off("transformer.wte.weight", cfg.vocab_size * c)?,
            wpe: off("transformer.wpe.weight", model.context_length * c)?,
            layers,
            lnf: norm("transformer.ln_f")?,
            prec: Precision::F32,
            bf16: Bf16Path::detect(),
        })
    }

    /// The precision of the linear layers' and lm head's matmuls, and how bf16 ones run.
    pub fn set_precision(&mut self, prec: Precision, bf16: Bf16Path) {
        self.prec = prec;
        self.bf16 = bf16;
    }

    /// The weights as the engine reads them: `weights` must hold every parameter (flat, name order).
    fn params<'w>(&self, weights: &'w [f32], bufs: &'w RefCell<Bf16Buffers>) -> Result<Params<'w>> {
        ensure!(
            weights.len() == self.numel,
            "{} weights for a model of {} parameters",
            weights.len(),
            self.numel
        );
        Ok(Params {
            w: weights,
            mm: Products {
                prec: self.prec,
                path: self.bf16,
                bufs,
            },
        })
    }

    /// Mean cross-entropy of next tokens `y` after `x` (both b x t, row-major) with `weights`.
    pub fn loss(
        &self,
        scratch: &mut Scratch,
        weights: &[f32],
        x: &[u32],
        y: &[u32],
        b: usize,
        t: usize,
    ) -> Result<f32> {
        let p = self.params(weights, &scratch.bf16)?;
        self.forward(&mut scratch.acts, &p, x, y, b, t, None)
    }

    /// The loss of one micro-batch, and `scale` times its gradient added into `grads` (flat order).
    /// `dropout` draws the masks when the model has dropout > 0.
    #[allow(clippy::too_many_arguments)]
    pub fn loss_and_grads(
        &self,
        scratch: &mut Scratch,
        weights: &[f32],
        x: &[u32],
        y: &[u32],
        b: usize,
        t: usize,
        dropout: Option<&mut ChaCha8Rng>,
        scale: f32,
        grads: &mut [f32],
    ) -> Result<f32> {
        ensure!(
            grads.len() == self.numel,
            "gradient buffer of {} values for {} parameters",
            grads.len(),
            self.numel
        );
        let p = self.params(weights, &scratch.bf16)?;
        let loss = self.forward(&mut scratch.acts, &p, x, y, b, t, dropout)?;
        self.backward(&mut scratch.acts, &p, x, y, scale, grads);
        Ok(loss)
    }

    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        a: &mut Acts,
        p: &Params,
        x: &[u32],
        y: &[u32],
        b: usize,
        t: usize,
        dropout: Option<&mut ChaCha8Rng>,
    ) -> Result<f32> {
        ensure!(
            y.len() == x.len(),
            "{} targets for {} tokens",
            y.len(),
            x.len()
        );
        self.check_tokens(y)?;
        self.hidden(a, p, x, b, t, dropout)?;
        let (c, v, n) = (self.c, self.vocab, b * t);
        let wte = M::new(p.get(self.wte), v, c);
        p.mm.mm(&mut a.logits, v, M::new(&a.xf, n, c), wte.t(), false);
        Ok(cross_entropy(&a.logits, &mut a.lse, y, v))
    }

    /// The logits of the last position of each of the b sequences of `x` (b x t tokens), (b, vocab) in
    /// order: what sampling needs, without the other positions' logits.
    pub fn last_logits(
        &self,
        scratch: &mut Scratch,
        weights: &[f32],
        x: &[u32],
        b: usize,
        t: usize,
    ) -> Result<Vec<f32>> {
        let p = self.params(weights, &scratch.bf16)?;
        let a = &mut scratch.acts;
        self.hidden(a, &p, x, b, t, None)?;
        let (c, v) = (self.c, self.vocab);
        let wte = M::new(p.get(self.wte), v, c);
        let mut out = vec![0.0f32; b * v];
        for (s, o) in out.chunks_mut(v).enumerate() {
            let last = &a.xf[(s * t + t - 1) * c..][..c];
            p.mm.mm(o, v, M::new(last, 1, c), wte.t(), false);
        }
        Ok(out)
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if let Some(&bad) = tokens.iter().find(|&&v| v as usize >= self.vocab) {
            bail!("token {bad} is outside the vocabulary of {}", self.vocab);
        }
        Ok(())
    }

    /// The forward pass up to the final LayerNorm (`a.xf`), keeping what the backward needs.
    fn hidden(
        &self,
        a: &mut Acts,
        p: &Params,
        x: &[u32],
        b: usize,
        t: usize,
        dropout: Option<&mut ChaCha8Rng>,
    ) -> Result<()> {
        ensure!(
            x.len() == b * t,
            "batch of {} tokens for shape {b} x {t}",
            x.len()
        );
        ensure!(
            t <= self.context,
            "sequence of {t} tokens is longer than the model's context of {}",
            self.context
        );
        self.check_tokens(x)?;
        let mut drop = Dropout {
            rng: if self.dropout > 0.0 { dropout } else { None },
            p: self.dropout,
            site: 0,
        };
        self.shape(a, b, t, drop.rng.is_some());
        let (c, l_n) = (self.c, self.n_layers);
        let nc = b * t * c;
        // Embeddings.
        let (wte, wpe) = (p.get(self.wte), p.get(self.wpe));
        for (i, row) in a.res[..nc].chunks_mut(c).enumerate() {
            let (tok, pos) = (x[i] as usize, i % t);
            for ((r, &e), &q) in row
                .iter_mut()
                .zip(&wte[tok * c..][..c])
                .zip(&wpe[pos * c..][..c])
            {
                *r = e + q;
            }
        }
        drop.apply(&mut a.res[..nc], &mut a.masks);
        for (l, layer) in self.layers.iter().enumerate() {
            self.block_forward(a, p, l, layer, &mut drop);
        }
        let res_f = &a.res[l_n * nc..][..nc];
        layer_norm(res_f, p, self.lnf, c, &mut a.xf, &mut a.statsf);
        Ok(())
    }

    /// Block `l`: res2 = res_l + dropout(attention(ln1(res_l)) Wproj^T), res_{l+1} = res2 +
    /// dropout(gelu(ln2(res2) Wfc^T) Wmproj^T), keeping every activation the backward reads.
    fn block_forward(&self, a: &mut Acts, p: &Params, l: usize, layer: &Layer, drop: &mut Dropout) {
        let (c, h, b, t) = (self.c, self.heads, a.b, a.t);
        let n = b * t;
        let nc = n * c;
        let (res_in, res_rest) = a.res[l * nc..].split_at_mut(nc);
        let res2 = &mut a.res2[l * nc..][..nc];
        let xn1 = &mut a.xn1[l * nc..][..nc];
        layer_norm(res_in, p, layer.ln1, c, xn1, &mut a.stats1[l * n..][..n]);
        let qkv = &mut a.qkv[l * 3 * nc..][..3 * nc];
        linear(p, layer.attn, xn1, n, qkv);
        let att = &mut a.att[l * b * h * t * t..][..b * h * t * t];
        let atty = &mut a.atty[l * nc..][..nc];
        attention_forward(qkv, att, atty, t, c, h);
        linear(p, layer.proj, atty, n, &mut a.dc[..nc]);
        drop.apply(&mut a.dc[..nc], &mut a.masks);
        add(res2, res_in, &a.dc[..nc]);
        let xn2 = &mut a.xn2[l * nc..][..nc];
        layer_norm(res2, p, layer.ln2, c, xn2, &mut a.stats2[l * n..][..n]);
        let fc = &mut a.fc[l * 4 * nc..][..4 * nc];
        linear(p, layer.fc, xn2, n, fc);
        let g = &mut a.gelu[l * 4 * nc..][..4 * nc];
        match self.activation {
            Activation::Gelu => map(g, fc, gelu_erf),
            Activation::GeluTanh => map(g, fc, gelu_tanh),
        }
        linear(p, layer.mproj, g, n, &mut a.dc[..nc]);
        drop.apply(&mut a.dc[..nc], &mut a.masks);
        add(&mut res_rest[..nc], res2, &a.dc[..nc]);
    }

    /// Resizes the activation buffers for this model and a b x t batch (a no-op when nothing changed).
    fn shape(&self, a: &mut Acts, b: usize, t: usize, dropout: bool) {
        let (c, l, h, v) = (self.c, self.n_layers, self.heads, self.vocab);
        a.dropped = dropout;
        let masks = if dropout { (2 * l + 1) * b * t * c } else { 0 };
        let dims = (l, c, h, v);
        if a.dims == dims && a.b == b && a.t == t && a.masks.len() >= masks {
            return;
        }
        let [res, res2, xn1, xn2, qkv, att, atty, fc, gelu, xf, logits, lse, masks, dres, dc, dc2, d4c, dqkv, stats1, stats2, statsf] =
            sizes(dims, b, t, dropout);
        let z = |len: usize| vec![0.0f32; len];
        let s = |len: usize| vec![(0.0f32, 0.0f32); len];
        *a = Acts {
            dims,
            b,
            t,
            res: z(res),
            res2: z(res2),
            xn1: z(xn1),
            xn2: z(xn2),
            stats1: s(stats1),
            stats2: s(stats2),
            statsf: s(statsf),
            qkv: z(qkv),
            att: z(att),
            atty: z(atty),
            fc: z(fc),
            gelu: z(gelu),
            xf: z(xf),
            logits: z(logits),
            lse: z(lse),
            masks: z(masks),
            dropped: dropout,
            dres: z(dres),
            dc: z(dc),
            dc2: z(dc2),
            d4c: z(d4c),
            dqkv: z(dqkv),
        };
    }

    /// Backward of the last `forward`, adding scale * gradients into `grads`.
    fn backward(
        &self,
        a: &mut Acts,
        p: &Params,
        x: &[u32],
        y: &[u32],
        scale: f32,
        grads: &mut [f32],
    ) {
        self.head_backward(a, p, y, scale, grads);
        for (l, layer) in self.layers.iter().enumerate().rev() {
            self.mlp_backward(a, p, l, layer, grads);
            self.attention_block_backward(a, p, l, layer, grads);
        }
        self.embedding_backward(a, x, grads);
    }

    /// The lm head (tied to wte: dwte += dlogits^T xf, dxf = dlogits wte) and the final LayerNorm, from
    /// the cross-entropy: leaves the residual stream's gradient in `a.dres`.
    fn head_backward(&self, a: &mut Acts, p: &Params, y: &[u32], scale: f32, grads: &mut [f32]) {
        let (c, v) = (self.c, self.vocab);
        let n = a.b * a.t;
        let nc = n * c;
        cross_entropy_backward(&mut a.logits, &a.lse, y, v, scale / n as f32);
        let dlogits = M::new(&a.logits, n, v);
        p.mm.mm(
            self.wte.of(grads),
            c,
            dlogits.t(),
            M::new(&a.xf, n, c),
            true,
        );
        p.mm.mm(&mut a.dc, c, dlogits, M::new(p.get(self.wte), v, c), false);
        a.dres.iter_mut().for_each(|d| *d = 0.0);
        let l_n = self.n_layers;
        layer_norm_backward(
            &a.res[l_n * nc..][..nc],
            p,
            self.lnf,
            c,
            &a.statsf,
            &a.dc,
            &mut a.dres,
            grads,
        );
    }

    /// Block `l`'s MLP: res_{l+1} = res2 + dropout(gelu(xn2 Wfc^T) Wmproj^T); adds into `a.dres` the
    /// gradient through it (dres then holds res2's).
    fn mlp_backward(&self, a: &mut Acts, p: &Params, l: usize, layer: &Layer, grads: &mut [f32]) {
        let (c, n) = (self.c, a.b * a.t);
        let nc = n * c;
        let dm: &[f32] = if a.dropped {
            mul(&mut a.dc, &a.dres, &a.masks[(2 * l + 2) * nc..][..nc]);
            &a.dc
        } else {
            &a.dres
        };
        let gelu = &a.gelu[l * 4 * nc..][..4 * nc];
        linear_backward(p, grads, layer.mproj, dm, gelu, n, &mut a.d4c);
        let fc = &a.fc[l * 4 * nc..][..4 * nc];
        match self.activation {
            Activation::Gelu => map_mul(&mut a.d4c, fc, gelu_erf_grad),
            Activation::GeluTanh => map_mul(&mut a.d4c, fc, gelu_tanh_grad),
        }
        let xn2 = &a.xn2[l * nc..][..nc];
        linear_backward(p, grads, layer.fc, &a.d4c, xn2, n, &mut a.dc2);
        let (res2, stats2) = (&a.res2[l * nc..][..nc], &a.stats2[l * n..][..n]);
        layer_norm_backward(res2, p, layer.ln2, c, stats2, &a.dc2, &mut a.dres, grads);
    }

    /// Block `l`'s attention: res2 = res_l + dropout(attention(xn1 Wattn^T) Wproj^T); adds into `a.dres`
    /// the gradient through it (dres then holds res_l's).
    fn attention_block_backward(
        &self,
        a: &mut Acts,
        p: &Params,
        l: usize,
        layer: &Layer,
        grads: &mut [f32],
    ) {
        let (c, h, t) = (self.c, self.heads, a.t);
        let (b, n) = (a.b, a.b * a.t);
        let nc = n * c;
        let da: &[f32] = if a.dropped {
            mul(&mut a.dc, &a.dres, &a.masks[(2 * l + 1) * nc..][..nc]);
            &a.dc
        } else {
            &a.dres
        };
        let atty = &a.atty[l * nc..][..nc];
        linear_backward(p, grads, layer.proj, da, atty, n, &mut a.dc2);
        let qkv = &a.qkv[l * 3 * nc..][..3 * nc];
        let att = &a.att[l * b * h * t * t..][..b * h * t * t];
        attention_backward(qkv, att, &a.dc2, &mut a.dqkv, t, c, h);
        let xn1 = &a.xn1[l * nc..][..nc];
        linear_backward(p, grads, layer.attn, &a.dqkv, xn1, n, &mut a.dc2);
        let (res_l, stats1) = (&a.res[l * nc..][..nc], &a.stats1[l * n..][..n]);
        layer_norm_backward(res_l, p, layer.ln1, c, stats1, &a.dc2, &mut a.dres, grads);
    }

    /// The embeddings: res_0 = dropout(wte[x] + wpe[pos]).
    fn embedding_backward(&self, a: &mut Acts, x: &[u32], grads: &mut [f32]) {
        let (c, t) = (self.c, a.t);
        let nc = a.b * t * c;
        if a.dropped {
            a.dres
                .iter_mut()
                .zip(&a.masks[..nc])
                .for_each(|(d, m)| *d *= m);
        }
        for (i, row) in a.dres.chunks(c).enumerate() {
            let dwte = &mut self.wte.of(grads)[x[i] as usize * c..][..c];
            dwte.iter_mut().zip(row).for_each(|(g, d)| *g += d);
        }
        for (i, row) in a.dres.chunks(c).enumerate() {
            let dwpe = &mut self.wpe.of(grads)[(i % t) * c..][..c];
            dwpe.iter_mut().zip(row).for_each(|(g, d)| *g += d);
        }
    }
}

impl std::fmt::Debug for CpuGpt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CpuGpt {{ layers: {}, width: {} }}",
            self.n_layers, self.c
        )
    }
}

/// Mean cross-entropy of the rows of `logits` (width v) against `y`, saving each row's log-sum-exp; per
/// task sums in f64 added in task order (deterministic for any thread count).
#[multiversion(targets = "simd")]
fn cross_entropy(logits: &[f32], lse_out: &mut [f32], y: &[u32], v: usize) -> f32 {
    let n = y.len();
    // At least ROWS rows per task, so that wide rows (GPT-2's 50304) interleave too.
    let per = rows_per_task(n, v).max(ROWS);
    let sums: Vec<f64> = logits
        .par_chunks(per * v)
        .zip(lse_out.par_chunks_mut(per))
        .zip(y.par_chunks(per))
        .map(|((z, lse_out), y)| {
            // The rows' log-sum-exps ROWS at a time (their serial sums interleaved), the rest one by one.
            let full = lse_out.len() / ROWS * ROWS;
            for (z, o) in z.chunks(ROWS * v).zip(lse_out[..full].chunks_mut(ROWS)) {
                o.copy_from_slice(&rows_lse::<ROWS>(z, v));
            }
            for (z, o) in z[full * v..].chunks(v).zip(&mut lse_out[full..]) {
                *o = rows_lse::<1>(z, v)[0];
            }
            z.chunks(v)
                .zip(lse_out.iter())
                .zip(y)
                .map(|((row, &o), &target)| (o - row[target as usize]) as f64)
                .sum::<f64>()
        })
        .collect();
    (sums.iter().sum::<f64>() / n as f64) as f32
}

/// d loss / d logits = k (softmax - onehot), in place, from the rows' log-sum-exp.
#[multiversion(targets = "simd")]
fn cross_entropy_backward(logits: &mut [f32], lse: &[f32], y: &[u32], v: usize, k: f32) {
    let per = rows_per_task(y.len(), v);
    logits
        .par_chunks_mut(per * v)
        .zip(lse.par_chunks(per))
        .zip(y.par_chunks(per))
        .for_each(|((z, lse), y)| {
            for ((row, &l), &target) in z.chunks_mut(v).zip(lse).zip(y) {
                row.iter_mut()
                    .for_each(|z| *z = k * super::ops::exp(*z - l));
                row[target as usize] -= k;
            }
        });
}

fn slot(ps: &ParamSet, name: &str, len: usize) -> Result<Slot> {
    let idx = ps
        .params
        .binary_search_by(|p| p.name.as_str().cmp(name))
        .map_err(|_| anyhow::anyhow!("no parameter named {name}"))?;
    let param = &ps.params[idx];
    ensure!(
        param.len == len,
        "parameter {name}: {} values, expected {len}",
        param.len
    );
    Ok(Slot {
        off: param.offset,
        len,
    })
}

/// out = x W^T + b for x (n, in).
#[multiversion(targets = "simd")]
fn linear(p: &Params, lin: Linear, x: &[f32], n: usize, out: &mut [f32]) {
    let w = M::new(p.get(lin.w), lin.out, lin.inp);
    let acc = match lin.b {
        Some(b) => {
            let bias = p.get(b);
            out.par_chunks_mut(lin.out * rows_per_task(n, lin.out))
                .for_each(|rows| {
                    rows.chunks_mut(lin.out)
                        .for_each(|r| r.copy_from_slice(bias))
                });
            true
        }
        None => false,
    };
    p.mm.mm(out, lin.out, M::new(x, n, lin.inp), w.t(), acc);
}

/// Backward of `linear` given dy (n, out) and its input x (n, in): dW += dy^T x, db += column sums of
/// dy, dx = dy W.
fn linear_backward(
    p: &Params,
    grads: &mut [f32],
    lin: Linear,
    dy: &[f32],
    x: &[f32],
    n: usize,
    dx: &mut [f32],
) {
    let dy_m = M::new(dy, n, lin.out);
    p.mm.mm(
        lin.w.of(grads),
        lin.inp,
        dy_m.t(),
        M::new(x, n, lin.inp),
        true,
    );
    if let Some(b) = lin.b {
        column_sums_into(b.of(grads), dy, lin.out);
    }
    let w = M::new(p.get(lin.w), lin.out, lin.inp);
    p.mm.mm(dx, lin.inp, dy_m, w, false);
}

/// acc[j] += sum over rows of m[., j], with per-task partial sums added in task order (the result does
/// not depend on the thread count).
#[multiversion(targets = "simd")]
fn column_sums_into(acc: &mut [f32], m: &[f32], cols: usize) {
    let per = rows_per_task(m.len() / cols, cols);
    let partial: Vec<Vec<f32>> = m
        .par_chunks(per * cols)
        .map(|rows| {
            let mut s = vec![0.0f32; cols];
            for r in rows.chunks(cols) {
                s.iter_mut().zip(r).for_each(|(s, v)| *s += v);
            }
            s
        })
        .collect();
    for s in partial {
        acc.iter_mut().zip(&s).for_each(|(a, v)| *a += v);
    }
}

/// LayerNorm of the rows of x (width c) into y, saving each row's (mean, 1/std).
#[multiversion(targets = "simd")]
fn layer_norm(
    x: &[f32],
    p: &Params,
    norm: Norm,
    c: usize,
    y: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    let w = p.get(norm.w);
    let bias = norm.b.map(|b| p.get(b));
    let per = rows_per_task(stats.len(), c);
    y.par_chunks_mut(per * c)
        .zip(x.par_chunks(per * c))
        .zip(stats.par_chunks_mut(per))
        .for_each(|((y, x), st)| {
            // The rows' statistics ROWS at a time (their serial sums interleaved), the rest one by one.
            let full = st.len() / ROWS * ROWS;
            for (x, st) in x.chunks(ROWS * c).zip(st[..full].chunks_mut(ROWS)) {
                st.copy_from_slice(&rows_stats::<ROWS>(x, c, LN_EPS));
            }
            for (x, st) in x[full * c..].chunks(c).zip(&mut st[full..]) {
                *st = rows_stats::<1>(x, c, LN_EPS)[0];
            }
            for ((y, x), &(mean, rstd)) in y.chunks_mut(c).zip(x.chunks(c)).zip(st.iter()) {
                for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                    *y = (x - mean) * rstd * w;
                }
                if let Some(bias) = bias {
                    y.iter_mut().zip(bias).for_each(|(y, b)| *y += b);
                }
            }
        });
}

/// Backward of `layer_norm`: dx += rstd (g w - mean(g w) - xhat mean(g w xhat)), dw += sum g xhat,
/// db += sum g.
#[allow(clippy::too_many_arguments)]
#[multiversion(targets = "simd")]
fn layer_norm_backward(
    x: &[f32],
    p: &Params,
    norm: Norm,
    c: usize,
    stats: &[(f32, f32)],
    g: &[f32],
    dx: &mut [f32],
    grads: &mut [f32],
) {
    let w = p.get(norm.w);
    let per = rows_per_task(stats.len(), c);
    let partial: Vec<Vec<f32>> = dx
        .par_chunks_mut(per * c)
        .zip(x.par_chunks(per * c))
        .zip(g.par_chunks(per * c))
        .zip(stats.par_chunks(per))
        .map(|(((dx, x), g), st)| {
            // dw then db of this task's rows.
            let mut dwb = vec![0.0f32; 2 * c];
            let (dw, db) = dwb.split_at_mut(c);
            let mut xhat = vec![0.0f32; ROWS * c];
            // ROWS rows at a time (their serial sums interleaved; the last group may be shorter).
            let groups = dx
                .chunks_mut(ROWS * c)
                .zip(x.chunks(ROWS * c))
                .zip(g.chunks(ROWS * c))
                .zip(st.chunks(ROWS));
            for (((dx, x), g), st) in groups {
                // The column-wise part row by row (it vectorizes), then the two serial sums of each row.
                for (r, &(mean, rstd)) in st.iter().enumerate() {
                    let (x, g) = (&x[r * c..][..c], &g[r * c..][..c]);
                    let xhat = &mut xhat[r * c..][..c];
                    let cols = xhat
                        .iter_mut()
                        .zip(x)
                        .zip(g)
                        .zip(dw.iter_mut().zip(db.iter_mut()));
                    for (((xh, &x), &g), (dw, db)) in cols {
                        *xh = (x - mean) * rstd;
                        *dw += g * *xh;
                        *db += g;
                    }
                }
                let (k, n) = (st.len(), c as f32);
                let gw = |r: usize, i: usize| g[r * c + i] * w[i];
                let m1 = row_sums_of(k, c, 0.0, gw);
                let m2 = row_sums_of(k, c, 0.0, |r, i| gw(r, i) * xhat[r * c + i]);
                for (r, &(_, rstd)) in st.iter().enumerate() {
                    let (m1, m2) = (m1[r] / n, m2[r] / n);
                    let (dx, g) = (&mut dx[r * c..][..c], &g[r * c..][..c]);
                    let xhat = &xhat[r * c..][..c];
                    for (((dx, &g), &w), &xh) in dx.iter_mut().zip(g).zip(w).zip(xhat) {
                        *dx += rstd * (g * w - m1 - xh * m2);
                    }
                }
            }
            dwb
        })
        .collect();
    for dwb in partial {
        let (dw, db) = dwb.split_at(c);
        norm.w
            .of(grads)
            .iter_mut()
            .zip(dw)
            .for_each(|(a, v)| *a += v);
        if let Some(b) = norm.b {
            b.of(grads).iter_mut().zip(db).for_each(|(a, v)| *a += v);
        }
    }
}

/// Rows per block of causal attention: a block of queries meets only the keys up to its last row, so the
/// products above the diagonal's blocks are never computed (at T = 256, 5/8 of the full T x T work).
const ATT_BLOCK: usize = 64;

/// The row blocks `r0..r1` of a T x T attention matrix.
fn att_blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t)
        .step_by(ATT_BLOCK)
        .map(move |r0| (r0, (r0 + ATT_BLOCK).min(t)))
}

/// Causal self-attention of qkv (n, 3C: q | k | v, heads side by side) into y (n, C), saving the
/// probabilities (B, H, T, T; zero above the diagonal). One task per sequence; per head, one block of
/// `ATT_BLOCK` query rows at a time against the keys and values up to the block's last row.
#[multiversion(targets = "simd")]
fn attention_forward(qkv: &[f32], att: &mut [f32], y: &mut [f32], t: usize, c: usize, h: usize) {
    let hs = c / h;
    let scale = 1.0 / (hs as f32).sqrt();
    att.par_chunks_mut(h * t * t)
        .zip(y.par_chunks_mut(t * c))
        .zip(qkv.par_chunks(t * 3 * c))
        .for_each(|((att, y), qkv)| {
            for hd in 0..h {
                for (r0, r1) in att_blocks(t) {
                    let q = M::strided(&qkv[r0 * 3 * c + hd * hs..], r1 - r0, hs, 3 * c);
                    let k = M::strided(&qkv[c + hd * hs..], r1, hs, 3 * c);
                    let v = M::strided(&qkv[2 * c + hd * hs..], r1, hs, 3 * c);
                    let pr = &mut att[hd * t * t + r0 * t..][..(r1 - r0) * t];
                    mm(pr, t, q, k.t(), false, scale, Parallelism::None);
                    for (i, row) in (r0..).zip(pr.chunks_mut(t)) {
                        let (keep, masked) = row.split_at_mut(i + 1);
                        let max = row_max(keep);
                        // The exponentials in a loop of their own (it vectorizes), then their sum in order.
                        keep.iter_mut().for_each(|s| *s = super::ops::exp(*s - max));
                        let inv = 1.0 / keep.iter().sum::<f32>();
                        keep.iter_mut().for_each(|s| *s *= inv);
                        masked.iter_mut().for_each(|s| *s = 0.0);
                    }
                    mm(
                        &mut y[r0 * c + hd * hs..],
                        c,
                        M::strided(pr, r1 - r0, r1, t),
                        v,
                        false,
                        1.0,
                        Parallelism::None,
                    );
                }
            }
        });
}

/// Backward of `attention_forward` given dy (n, C): dqkv (n, 3C) is overwritten. Blocked as the forward:
/// a row block of dP, dS and dq reaches the block's last column; a column block of dv and dk starts at
/// the block's first row (P and dS are zero above the diagonal).
#[allow(clippy::too_many_arguments)]
#[multiversion(targets = "simd")]
fn attention_backward(
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
                let pr = &att[hd * t * t..][..t * t];
                let q_from =
                    |r0: usize| M::strided(&qkv[r0 * 3 * c + hd * hs..], t - r0, hs, 3 * c);
                let dy_from = |r0: usize| M::strided(&dy[r0 * c + hd * hs..], t - r0, hs, c);
                for (r0, r1) in att_blocks(t) {
                    // dP = dy v^T, then dS = P (dP - rowsum(P dP)), zero where P is.
                    let v = M::strided(&qkv[2 * c + hd * hs..], r1, hs, 3 * c);
                    let dyh = M::strided(&dy[r0 * c + hd * hs..], r1 - r0, hs, c);
                    let dsb = &mut ds[r0 * t..][..(r1 - r0) * t];
                    mm(dsb, t, dyh, v.t(), false, 1.0, Parallelism::None);
                    for (i, (ds, pr)) in (r0..).zip(dsb.chunks_mut(t).zip(pr[r0 * t..].chunks(t))) {
                        // P is zero above the diagonal: those terms would add zeros to this serial sum.
                        let dot: f32 = ds[..=i].iter().zip(pr).map(|(d, p)| d * p).sum();
                        ds[..r1]
                            .iter_mut()
                            .zip(pr)
                            .for_each(|(d, &p)| *d = p * (*d - dot));
                    }
                    // S = scale q k^T: dq = scale dS k over the keys up to the block's last row.
                    let k = M::strided(&qkv[c + hd * hs..], r1, hs, 3 * c);
                    mm(
                        &mut dqkv[r0 * 3 * c + hd * hs..],
                        3 * c,
                        M::strided(&ds[r0 * t..], r1 - r0, r1, t),
                        k,
                        false,
                        scale,
                        Parallelism::None,
                    );
                }
                for (c0, c1) in att_blocks(t) {
                    // dv = P^T dy and dk = scale dS^T q, over the rows from the block's first on.
                    let pcol = M::strided(&pr[c0 * t + c0..], t - c0, c1 - c0, t);
                    mm(
                        &mut dqkv[c0 * 3 * c + 2 * c + hd * hs..],
                        3 * c,
                        pcol.t(),
                        dy_from(c0),
                        false,
                        1.0,
                        Parallelism::None,
                    );
                    let dscol = M::strided(&ds[c0 * t + c0..], t - c0, c1 - c0, t);
                    mm(
                        &mut dqkv[c0 * 3 * c + c + hd * hs..],
                        3 * c,
                        dscol.t(),
                        q_from(c0),
                        false,
                        scale,
                        Parallelism::None,
                    );
                }
            }
        });
}

/// out = a + b.
#[multiversion(targets = "simd")]
fn add(out: &mut [f32], a: &[f32], b: &[f32]) {
    out.iter_mut()
        .zip(a)
        .zip(b)
        .for_each(|((o, a), b)| *o = a + b);
}

/// out = a * b.
#[multiversion(targets = "simd")]
fn mul(out: &mut [f32], a: &[f32], b: &[f32]) {
    out.iter_mut()
        .zip(a)
        .zip(b)
        .for_each(|((o, a), b)| *o = a * b);
}

/// out = f(x), in parallel chunks.
#[multiversion(targets = "simd")]
fn map(out: &mut [f32], x: &[f32], f: impl Fn(f32) -> f32 + Sync) {
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(o, x)| o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x)));
}

/// g *= f(x), in parallel chunks.
#[multiversion(targets = "simd")]
fn map_mul(g: &mut [f32], x: &[f32], f: impl Fn(f32) -> f32 + Sync) {
    g.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(g, x)| g.iter_mut().zip(x).for_each(|(g, &x)| *g *= f(x)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use candle_core::{Device, Tensor};
    use rand::SeedableRng;

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

    /// `scratch_bytes` (what `check` budgets per compute slot) is what a forward/backward allocates, and
    /// a scratch moves between models and shapes.
    #[test]
    fn scratch_bytes_is_the_size_of_the_buffers_a_step_allocates() {
        let mut scratch = Scratch::default();
        for (layers, c, heads, b, t, dropout) in [(2, 16, 2, 3, 5, 0.0), (1, 8, 4, 2, 16, 0.1)] {
            let m = model(true, Activation::Gelu, dropout, layers, c, heads);
            let cpu = CpuGpt::new(&m).unwrap();
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
                &a.logits, &a.lse, &a.masks, &a.dres, &a.dc, &a.dc2, &a.d4c, &a.dqkv,
            ];
            let stats = a.stats1.len() + a.stats2.len() + a.statsf.len();
            let held = 4 * f32s.iter().map(|v| v.len()).sum::<usize>() + 8 * stats;
            let want = scratch_bytes(layers, c, heads, 29, b, t, dropout > 0.0);
            assert_eq!(held as u64, want);
        }
    }

    /// `matmul::bf16_bytes` (what `check` adds per compute slot under `train.amp`) bounds the operand
    /// buffers of a step's bf16 products, within a factor of two.
    #[test]
    fn bf16_bytes_bounds_the_buffers_of_a_step() {
        let mut paths = vec![Bf16Path::EMULATED];
        if Bf16Path::detect().is_avx512() {
            paths.push(Bf16Path::detect());
        }
        for path in paths {
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
    /// 1e-5 of the largest value. Lengths below, at and across block boundaries.
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
                let mut att = vec![f32::NAN; b * h * t * t];
                let mut y = vec![f32::NAN; b * t * c];
                let mut dqkv = vec![f32::NAN; b * t * 3 * c];
                if blocked {
                    attention_forward(&qkv, &mut att, &mut y, t, c, h);
                    attention_backward(&qkv, &att, &dy, &mut dqkv, t, c, h);
                } else {
                    full_attention_forward(&qkv, &mut att, &mut y, t, c, h);
                    full_attention_backward(&qkv, &att, &dy, &mut dqkv, t, c, h);
                }
                [att, y, dqkv]
            };
            let (blocked, full) = (run(true), run(false));
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
}

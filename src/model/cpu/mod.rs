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
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::matmul::{Bf16Buffers, Bf16Path, Precision, Products, M};
use super::ops::{gelu_erf, gelu_erf_strip, gelu_tanh, gelu_tanh_strip};
use super::{Gpt, ParamSet};
use crate::config::Activation;
use std::cell::RefCell;

const LN_EPS: f32 = 1e-5;

mod layers;
use layers::*;

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
    /// Whether the outputs that only the products read (xn1, xn2, atty, gelu) are stored in bf16, two to
    /// each f32 of their buffers (`Products::stores_bf16`; see `saved`).
    half: bool,
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
    /// The QKV layer's dy; empty with `half`, where `dyh` holds it.
    dqkv: Vec<f32>,
    /// With `half`, the gradients that only the products read (the fc layer's and the QKV layer's dy)
    /// in bf16, two to an f32; empty otherwise.
    dyh: Vec<f32>,
    /// The attention's tasks' scratch (not `heads`, the heads' rows laid out in `dc` and `d4c`).
    head_pool: HeadPool,
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
/// f32 buffers in `Acts` field order (res .. dyh), then the three (mean, 1/std) buffers.
/// With `half`, xn1, xn2, atty and gelu hold bf16 values, two to an f32.
fn sizes(
    dims: (usize, usize, usize, usize),
    b: usize,
    t: usize,
    dropout: bool,
    half: bool,
) -> [usize; 22] {
    let (l, c, h, v) = dims;
    let n = b * t;
    let nc = n * c;
    let masks = if dropout { (2 * l + 1) * nc } else { 0 };
    let saved = |len: usize| if half { len.div_ceil(2) } else { len };
    [
        (l + 1) * nc,                  // res
        l * nc,                        // res2
        saved(l * nc),                 // xn1
        saved(l * nc),                 // xn2
        l * 3 * nc,                    // qkv
        l * b * h * t * t,             // att
        saved(l * nc),                 // atty
        l * 4 * nc,                    // fc
        saved(l * 4 * nc),             // gelu
        nc,                            // xf
        n * v,                         // logits
        n,                             // lse
        masks,                         // masks
        nc,                            // dres
        nc,                            // dc
        nc,                            // dc2
        4 * nc,                        // d4c
        if half { 0 } else { 3 * nc }, // dqkv
        if half { 2 * nc } else { 0 }, // dyh
        l * n,                         // stats1
        l * n,                         // stats2
        n,                             // statsf
    ]
}

/// Bytes of the Scratch of one forward/backward of a b x t batch through a model of `n_layers` x
/// `n_embd` with `n_heads` heads and `vocab` tokens, its products in `prec`.
#[allow(clippy::too_many_arguments)]
pub fn scratch_bytes(
    n_layers: usize,
    n_embd: usize,
    n_heads: usize,
    vocab: usize,
    b: usize,
    t: usize,
    dropout: bool,
    prec: Precision,
) -> u64 {
    let half = prec == Precision::Bf16;
    let s = sizes((n_layers, n_embd, n_heads, vocab), b, t, dropout, half);
    let (f32s, stats) = s.split_at(19);
    (4 * f32s.iter().sum::<usize>() + 8 * stats.iter().sum::<usize>()) as u64
}

/// Layer `l`'s `len` values of a buffer of outputs that only the products read, as stored (bf16 two
/// to an f32 when `half`).
fn saved(buf: &[f32], half: bool, l: usize, len: usize) -> Act<'_> {
    match half {
        true => Act::Bf16(&bytemuck::cast_slice(buf)[l * len..][..len]),
        false => Act::F32(&buf[l * len..][..len]),
    }
}

/// `saved` to write, rounded as `p`'s products round their operands.
fn saved_mut<'a>(buf: &'a mut [f32], p: &Params, l: usize, len: usize) -> ActMut<'a> {
    match p.mm.stores_bf16() {
        true => ActMut::Bf16(
            &mut bytemuck::cast_slice_mut(buf)[l * len..][..len],
            p.mm.path,
        ),
        false => ActMut::F32(&mut buf[l * len..][..len]),
    }
}

/// Runs `f` on a thread of the current rayon pool (in place when the caller is one of its threads).
/// Called from outside any pool (a single worker computes on its own thread), each of a pass's parallel
/// ops would hand its work to the global pool and sleep until it ends: a futex wake and sleep per op,
/// about 5% of a small model's step. Entering the pool once per pass keeps the ops inside it.
fn in_pool<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    rayon::scope(|_| f())
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
    /// Whether the outputs that only bf16 products read are stored in bf16 (`Acts::half`): always but
    /// in the tests that compare both.
    half_acts: bool,
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
            half_acts: true,
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
                half: self.half_acts,
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
        in_pool(move || {
            let p = self.params(weights, &scratch.bf16)?;
            self.forward(&mut scratch.acts, &p, x, y, b, t, None, false)
        })
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
        in_pool(move || {
            let p = self.params(weights, &scratch.bf16)?;
            let loss = self.forward(&mut scratch.acts, &p, x, y, b, t, dropout, true)?;
            self.backward(&mut scratch.acts, &p, x, y, scale, grads);
            Ok(loss)
        })
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
        backward: bool,
    ) -> Result<f32> {
        ensure!(
            y.len() == x.len(),
            "{} targets for {} tokens",
            y.len(),
            x.len()
        );
        self.check_tokens(y)?;
        self.hidden(a, p, x, b, t, dropout, backward)?;
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
        in_pool(move || {
            let p = self.params(weights, &scratch.bf16)?;
            let a = &mut scratch.acts;
            self.hidden(a, &p, x, b, t, None, false)?;
            let (c, v) = (self.c, self.vocab);
            let wte = M::new(p.get(self.wte), v, c);
            let mut out = vec![0.0f32; b * v];
            for (s, o) in out.chunks_mut(v).enumerate() {
                let last = &a.xf[(s * t + t - 1) * c..][..c];
                p.mm.mm(o, v, M::new(last, 1, c), wte.t(), false);
            }
            Ok(out)
        })
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if let Some(&bad) = tokens.iter().find(|&&v| v as usize >= self.vocab) {
            bail!("token {bad} is outside the vocabulary of {}", self.vocab);
        }
        Ok(())
    }

    /// The forward pass up to the final LayerNorm (`a.xf`), keeping what the backward needs (with
    /// `backward`, the GELUs' derivatives in place of their inputs).
    #[allow(clippy::too_many_arguments)]
    fn hidden(
        &self,
        a: &mut Acts,
        p: &Params,
        x: &[u32],
        b: usize,
        t: usize,
        dropout: Option<&mut ChaCha8Rng>,
        backward: bool,
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
        self.shape(a, b, t, drop.rng.is_some(), p.mm.stores_bf16());
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
            self.block_forward(a, p, (l, layer), &mut drop, backward);
        }
        let res_f = &a.res[l_n * nc..][..nc];
        layer_norm(res_f, p, self.lnf, c, ActMut::F32(&mut a.xf), &mut a.statsf);
        Ok(())
    }

    /// Block `l`: res2 = res_l + dropout(attention(ln1(res_l)) Wproj^T), res_{l+1} = res2 +
    /// dropout(gelu(ln2(res2) Wfc^T) Wmproj^T), keeping every activation the backward reads. With
    /// `backward`, `a.fc` keeps the GELU's derivative at its inputs instead of the inputs (the backward
    /// reads nothing else of them): erf-GELU's value and derivative share their erf.
    fn block_forward(
        &self,
        a: &mut Acts,
        p: &Params,
        (l, layer): (usize, &Layer),
        drop: &mut Dropout,
        backward: bool,
    ) {
        let (c, h, b, t) = (self.c, self.heads, a.b, a.t);
        let n = b * t;
        let nc = n * c;
        let (res_in, res_rest) = a.res[l * nc..].split_at_mut(nc);
        let res2 = &mut a.res2[l * nc..][..nc];
        let xn1 = saved_mut(&mut a.xn1, p, l, nc);
        layer_norm(res_in, p, layer.ln1, c, xn1, &mut a.stats1[l * n..][..n]);
        let qkv = &mut a.qkv[l * 3 * nc..][..3 * nc];
        linear(p, layer.attn, saved(&a.xn1, a.half, l, nc), n, qkv);
        let att = &mut a.att[l * b * h * t * t..][..b * h * t * t];
        // dc is free until the projection's output: the heads' rows are laid out there first.
        attention_forward(
            qkv,
            att,
            saved_mut(&mut a.atty, p, l, nc),
            &mut a.dc[..nc],
            &a.head_pool,
            self.att(p, t),
        );
        linear(
            p,
            layer.proj,
            saved(&a.atty, a.half, l, nc),
            n,
            &mut a.dc[..nc],
        );
        drop.apply(&mut a.dc[..nc], &mut a.masks);
        add(res2, res_in, &a.dc[..nc]);
        let xn2 = saved_mut(&mut a.xn2, p, l, nc);
        layer_norm(res2, p, layer.ln2, c, xn2, &mut a.stats2[l * n..][..n]);
        let fc = &mut a.fc[l * 4 * nc..][..4 * nc];
        linear(p, layer.fc, saved(&a.xn2, a.half, l, nc), n, fc);
        let g = saved_mut(&mut a.gelu, p, l, 4 * nc);
        match (self.activation, backward) {
            (Activation::Gelu, false) => map(g, fc, gelu_erf),
            (Activation::GeluTanh, false) => map(g, fc, gelu_tanh),
            (Activation::Gelu, true) => map_with_grad(g, fc, gelu_erf_strip),
            (Activation::GeluTanh, true) => map_with_grad(g, fc, gelu_tanh_strip),
        }
        let g = saved(&a.gelu, a.half, l, 4 * nc);
        linear(p, layer.mproj, g, n, &mut a.dc[..nc]);
        drop.apply(&mut a.dc[..nc], &mut a.masks);
        add(&mut res_rest[..nc], res2, &a.dc[..nc]);
    }

    /// The attention's shape over sequences of `t`, in the products' precision.
    fn att(&self, p: &Params, t: usize) -> Att {
        let amp = (p.mm.prec == Precision::Bf16).then_some(p.mm.path);
        Att {
            t,
            c: self.c,
            h: self.heads,
            amp,
        }
    }

    /// Resizes the activation buffers for this model and a b x t batch (a no-op when nothing changed).
    /// With `half`, the outputs that only the products read are stored in bf16 (`Acts::half`).
    fn shape(&self, a: &mut Acts, b: usize, t: usize, dropout: bool, half: bool) {
        let (c, l, h, v) = (self.c, self.n_layers, self.heads, self.vocab);
        a.dropped = dropout;
        let masks = if dropout { (2 * l + 1) * b * t * c } else { 0 };
        let dims = (l, c, h, v);
        if a.dims == dims && a.b == b && a.t == t && a.masks.len() >= masks && a.half == half {
            return;
        }
        let [res, res2, xn1, xn2, qkv, att, atty, fc, gelu, xf, logits, lse, masks, dres, dc, dc2, d4c, dqkv, dyh, stats1, stats2, statsf] =
            sizes(dims, b, t, dropout, half);
        let z = |len: usize| vec![0.0f32; len];
        let s = |len: usize| vec![(0.0f32, 0.0f32); len];
        *a = Acts {
            dims,
            b,
            t,
            half,
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
            dyh: z(dyh),
            head_pool: HeadPool::default(),
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
        let gelu = saved(&a.gelu, a.half, l, 4 * nc);
        linear_backward(p, grads, layer.mproj, Act::F32(dm), gelu, n, &mut a.d4c);
        // The GELU's derivative at its inputs, which the forward kept in `fc`.
        let fc = &a.fc[l * 4 * nc..][..4 * nc];
        let dy = match p.mm.stores_bf16() {
            true => {
                let (d4c, out) = (&a.d4c, saved_mut(&mut a.dyh, p, 0, 4 * nc));
                let db = layer.fc.b.map(|b| b.of(grads));
                scaled_rows(out, db, (d4c, fc), 4 * c);
                saved(&a.dyh, true, 0, 4 * nc)
            }
            false => {
                scale_by(&mut a.d4c, fc);
                Act::F32(&a.d4c)
            }
        };
        let xn2 = saved(&a.xn2, a.half, l, nc);
        linear_backward(p, grads, layer.fc, dy, xn2, n, &mut a.dc2);
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
        let atty = saved(&a.atty, a.half, l, nc);
        linear_backward(p, grads, layer.proj, Act::F32(da), atty, n, &mut a.dc2);
        let qkv = &a.qkv[l * 3 * nc..][..3 * nc];
        let att = &a.att[l * b * h * t * t..][..b * h * t * t];
        // d4c is the MLP's scratch, free here.
        let heads = &mut a.d4c[..3 * nc];
        // Stored in bf16, dqkv's column sums (the bias's gradient) are added as it is laid out.
        let half = p.mm.stores_bf16();
        let (dqkv, db) = match half {
            true => (
                saved_mut(&mut a.dyh, p, 0, 3 * nc),
                layer.attn.b.map(|b| b.of(grads)),
            ),
            false => (ActMut::F32(&mut a.dqkv), None),
        };
        attention_backward(
            (qkv, att, &a.dc2),
            (dqkv, db),
            heads,
            &a.head_pool,
            self.att(p, t),
        );
        let dy = match half {
            true => saved(&a.dyh, true, 0, 3 * nc),
            false => Act::F32(&a.dqkv),
        };
        let xn1 = saved(&a.xn1, a.half, l, nc);
        linear_backward(p, grads, layer.attn, dy, xn1, n, &mut a.dc2);
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

/// Parameter `name`'s place in the flat buffers, checked to hold `len` values.
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

#[cfg(test)]
mod tests;

//! nanoGPT's GPT-2 in candle: token + position embeddings, pre-LayerNorm blocks with causal
//! self-attention and a GELU MLP, final LayerNorm, and an lm head tied to the token embedding.
//!
//! Parameter names and layout follow Hugging Face's GPT2LMHeadModel, except that the four projection
//! matrices are stored as nn.Linear ([out, in], as nanoGPT); checkpoints transpose them to HF's Conv1D
//! orientation ([in, out]). Every op used here has a backward: candle's fused layer_norm and
//! softmax_last_dim do not, and a model built on them trains silently wrong; the layer norm, the
//! attention's causal softmax, the GELU and the cross-entropy are ops of our own with their backward
//! (`super::fused`), one kernel each way on a GPU (three for the layer norm's backward).
//!
//! Training and evaluation on CPU run on the hand-written engine of `cpu` (same function, tested against
//! this graph); the graph runs on GPUs, and serves generation and the tests as the reference.

use anyhow::{Context, Result};
use candle_core::{DType, Device, IndexOp, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use super::cpu::{CpuGpt, Scratch};
use super::matmul::{Bf16Path, Precision};
use super::params::ParamSet;
use crate::config::ModelConfig;
use crate::data::Batch;
use crate::flat::{FlatMut, FlatRef, Place};

const LN_EPS: f32 = 1e-5;

/// The model: hyper-parameters, context length and parameters. On the CPU engine `params` is the layout
/// alone and every computation takes the flat weights it computes with; candle's graph (GPUs, `graph()`)
/// computes with its tensors, set by `load`.
#[derive(Debug)]
pub struct Gpt {
    pub cfg: ModelConfig,
    pub context_length: usize,
    pub params: ParamSet,
    /// The seed of the initial weights (`initial_weights`).
    seed: u64,
    device: Device,
    /// The CPU engine (on CPU), or None: candle's graph and autograd.
    cpu: Option<CpuGpt>,
    /// The dtype of the matmuls: F32, or BF16 for mixed precision (inputs rounded to bf16, products
    /// accumulated in f32 by the GEMM and returned as f32; parameters and everything else stay f32).
    matmul_dtype: DType,
    /// Where the training state's flat buffers go: the host, or the model's GPU (with the kernels on
    /// candle's stream, so that they run in order with the model's own).
    place: Place,
}

/// HF GPT-2 parameter names of the four projections that HF stores transposed (Conv1D).
pub fn is_conv1d(name: &str) -> bool {
    name.ends_with("attn.c_attn.weight")
        || name.ends_with("attn.c_proj.weight")
        || name.ends_with("mlp.c_fc.weight")
        || name.ends_with("mlp.c_proj.weight")
}

/// How a parameter starts (nanoGPT's init).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Normal(f64),
    Ones,
    Zeros,
}

/// The parameters of a model, in initialisation order: (HF name, shape, init). N(0, 0.02) weights and
/// embeddings, residual projections N(0, 0.02 / sqrt(2 n_layers)), zero biases, unit LayerNorm gains.
/// Shapes alone describe a model's communication without allocating it (`nanodist predict`).
pub fn layout(cfg: &ModelConfig, context_length: usize) -> Vec<(String, Vec<usize>, Init)> {
    let (c, v, l) = (cfg.n_embd, cfg.vocab_size, cfg.n_layers);
    let proj_std = 0.02 / (2.0 * l as f64).sqrt();
    let mut items = vec![
        (
            "transformer.wte.weight".into(),
            vec![v, c],
            Init::Normal(0.02),
        ),
        (
            "transformer.wpe.weight".into(),
            vec![context_length, c],
            Init::Normal(0.02),
        ),
    ];
    let ln = |items: &mut Vec<_>, prefix: String| {
        items.push((format!("{prefix}.weight"), vec![c], Init::Ones));
        if cfg.bias {
            items.push((format!("{prefix}.bias"), vec![c], Init::Zeros));
        }
    };
    for i in 0..l {
        let h = format!("transformer.h.{i}");
        ln(&mut items, format!("{h}.ln_1"));
        ln(&mut items, format!("{h}.ln_2"));
        let linears = [
            ("attn.c_attn", 3 * c, c, 0.02),
            ("attn.c_proj", c, c, proj_std),
            ("mlp.c_fc", 4 * c, c, 0.02),
            ("mlp.c_proj", c, 4 * c, proj_std),
        ];
        for (name, out, inp, std) in linears {
            items.push((
                format!("{h}.{name}.weight"),
                vec![out, inp],
                Init::Normal(std),
            ));
            if cfg.bias {
                items.push((format!("{h}.{name}.bias"), vec![out], Init::Zeros));
            }
        }
    }
    ln(&mut items, "transformer.ln_f".into());
    items
}

/// nanoGPT's initial values of every parameter of [`layout`], drawn from `seed`: (name, values, shape).
fn initial_items(
    cfg: &ModelConfig,
    context_length: usize,
    seed: u64,
) -> Vec<(String, Vec<f32>, Vec<usize>)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // Values in layout order: the random draws follow wte, wpe, then each block's matrices.
    layout(cfg, context_length)
        .into_iter()
        .map(|(name, shape, init)| {
            let n = shape.iter().product();
            let values = match init {
                Init::Normal(std) => {
                    let dist = Normal::new(0.0f32, std as f32).expect("positive std");
                    (0..n).map(|_| dist.sample(&mut rng)).collect()
                }
                Init::Ones => vec![1.0f32; n],
                Init::Zeros => vec![0.0f32; n],
            };
            (name, values, shape)
        })
        .collect()
}

/// Host buffers for a model on the CPU; on a GPU, buffers there with the kernels on candle's stream.
fn place_of(device: &Device) -> Result<Place> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => Ok(Place::Cuda(std::sync::Arc::new(
            crate::cuda::Kernels::for_candle(d)?,
        ))),
        _ => Ok(Place::Host),
    }
}

impl Gpt {
    /// A model (nanoGPT's init, see [`layout`], deterministic in `seed`): on CPU the CPU engine, which
    /// holds no weights (`initial_weights` gives them); elsewhere candle's graph with its tensors.
    pub fn new(
        cfg: &ModelConfig,
        context_length: usize,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        let params = if device.is_cpu() {
            let shapes = layout(cfg, context_length)
                .into_iter()
                .map(|(name, shape, _)| (name, shape))
                .collect();
            ParamSet::layout(shapes)
        } else {
            ParamSet::new(initial_items(cfg, context_length, seed), device)?
        };
        let mut gpt = Self {
            cfg: cfg.clone(),
            context_length,
            params,
            seed,
            device: device.clone(),
            cpu: None,
            matmul_dtype: DType::F32,
            place: place_of(device)?,
        };
        if device.is_cpu() {
            gpt.cpu = Some(CpuGpt::new(&gpt)?);
        }
        Ok(gpt)
    }

    /// Where the flat buffers of a worker of this model live (see `crate::flat`).
    pub fn place(&self) -> &Place {
        &self.place
    }

    /// The initial weights, flat in name order (the values `new` drew, drawn again).
    pub fn initial_weights(&self) -> Vec<f32> {
        let mut items = initial_items(&self.cfg, self.context_length, self.seed);
        items.sort_by(|a, b| a.0.cmp(&b.0));
        // Sized once: a collected Vec could keep up to twice the model's size as spare capacity.
        let mut flat = Vec::with_capacity(self.params.numel);
        for (_, v, _) in items {
            flat.extend_from_slice(&v);
        }
        flat
    }

    /// Makes `weights` (flat, name order) the ones candle's graph computes with; the CPU engine takes
    /// them with each call instead, and only checks their length here.
    pub fn load(&self, weights: FlatRef<'_>) -> Result<()> {
        if self.cpu.is_some() {
            anyhow::ensure!(
                weights.len() == self.params.numel,
                "{} weights for a model of {} parameters",
                weights.len(),
                self.params.numel
            );
            return Ok(());
        }
        match weights {
            FlatRef::Host(w) => self.params.set_flat(w),
            #[cfg(feature = "cuda")]
            FlatRef::Cuda(d) => self.params.set_flat_device(d),
        }
    }

    /// Mixed precision: candle's graph casts every matmul to bf16 (`on`); the CPU engine runs its linear
    /// layers, attention products and lm head in `cpu` (the plan's decision: bf16 only where that is
    /// faster than f32), by AMX tiles or vdpbf16ps where this CPU has them, else by bf16-rounded operands
    /// in the f32 gemm.
    pub fn with_amp(mut self, on: bool, cpu: Precision) -> Self {
        self.matmul_dtype = if on { DType::BF16 } else { DType::F32 };
        if let Some(engine) = &mut self.cpu {
            engine.set_precision(cpu, Bf16Path::detect());
        }
        self
    }

    /// a b in the model's matmul dtype, returned as f32 (backward flows through the casts).
    fn mm(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let d = self.matmul_dtype;
        if d == DType::F32 {
            return Ok(a.matmul(b)?);
        }
        Ok(a.to_dtype(d)?
            .matmul(&b.to_dtype(d)?)?
            .to_dtype(DType::F32)?)
    }

    /// The same model on candle's graph and autograd even on CPU (the reference of the CPU engine, and
    /// generation), with tensors holding the initial weights.
    pub fn graph(mut self) -> Result<Self> {
        if self.cpu.take().is_some() {
            let items = initial_items(&self.cfg, self.context_length, self.seed);
            self.params = ParamSet::new(items, &self.device)?;
        }
        Ok(self)
    }

    /// The loss of `batch`, and `scale` times its gradient added into `grads` (flat, name order).
    /// `dropout` draws the dropout masks when the model has dropout > 0. The CPU engine computes with
    /// `weights` in `scratch`; the graph with the weights last `load`ed, in its own tensors, and adds
    /// into `grads` where they live (host or GPU).
    #[allow(clippy::too_many_arguments)]
    pub fn loss_and_grads(
        &self,
        scratch: &mut Scratch,
        weights: FlatRef<'_>,
        batch: &Batch,
        dropout: Option<&mut ChaCha8Rng>,
        scale: f32,
        grads: FlatMut<'_>,
    ) -> Result<f32> {
        if let Some(cpu) = &self.cpu {
            let (weights, grads) = match (weights, grads) {
                (FlatRef::Host(w), FlatMut::Host(g)) => (w, g),
                #[cfg(feature = "cuda")]
                _ => anyhow::bail!("internal error: the CPU engine computes on host buffers"),
            };
            return cpu.loss_and_grads(
                scratch, weights, &batch.x, &batch.y, batch.b, batch.t, dropout, scale, grads,
            );
        }
        let (x, y) = self.batch_tensors(batch)?;
        let loss = self.loss(&x, &y, dropout)?;
        let g = (&loss * scale as f64)?.backward()?;
        self.params.accumulate_grads(&g, grads)?;
        Ok(loss.to_scalar::<f32>()?)
    }

    /// The loss of `batch` (no dropout): on the CPU engine with `weights`, in `scratch`; on the graph with
    /// the weights last `load`ed.
    pub fn batch_loss(&self, scratch: &mut Scratch, weights: &[f32], batch: &Batch) -> Result<f32> {
        if let Some(cpu) = &self.cpu {
            return cpu.loss(scratch, weights, &batch.x, &batch.y, batch.b, batch.t);
        }
        let (x, y) = self.batch_tensors(batch)?;
        Ok(self.loss(&x, &y, None)?.to_scalar::<f32>()?)
    }

    /// The logits of the last position of each of the b sequences of `x` (b x t tokens), (b, vocab) in
    /// order: on the CPU engine with `weights`, in `scratch`; on the graph with the weights last `load`ed.
    pub fn last_logits(
        &self,
        scratch: &mut Scratch,
        weights: &[f32],
        x: &[u32],
        b: usize,
        t: usize,
    ) -> Result<Vec<f32>> {
        if let Some(cpu) = &self.cpu {
            return cpu.last_logits(scratch, weights, x, b, t);
        }
        let xt = Tensor::from_slice(x, (b, t), &self.device)?;
        let logits = self.forward(&xt, None)?;
        let rows: Vec<Tensor> = (0..b)
            .map(|s| logits.i(s * t + t - 1))
            .collect::<candle_core::Result<_>>()?;
        Ok(Tensor::cat(&rows, 0)?.to_vec1::<f32>()?)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    fn p(&self, name: &str) -> Result<&Tensor> {
        self.params.get(name)
    }

    fn bias(&self, name: &str) -> Option<&Tensor> {
        if self.cfg.bias {
            self.params.get(name).ok()
        } else {
            None
        }
    }

    /// y = x W^T (+ b) for x of shape (N, in).
    fn linear(&self, x: &Tensor, prefix: &str) -> Result<Tensor> {
        let w = self.p(&format!("{prefix}.weight"))?;
        let y = self.mm(x, &w.t()?)?;
        match self.bias(&format!("{prefix}.bias")) {
            Some(b) => super::fused::bias_add(&y, b, &self.place),
            None => Ok(y),
        }
    }

    /// The output rows from..from + n of linear layer `prefix`: x W[from..from + n]^T (+ those entries of
    /// its bias).
    fn linear_rows(&self, x: &Tensor, prefix: &str, from: usize, n: usize) -> Result<Tensor> {
        let w = self.p(&format!("{prefix}.weight"))?.narrow(0, from, n)?;
        let y = self.mm(x, &w.t()?)?;
        match self.bias(&format!("{prefix}.bias")) {
            Some(b) => super::fused::bias_add(&y, &b.narrow(0, from, n)?, &self.place),
            None => Ok(y),
        }
    }

    /// LayerNorm over the last dim (a zero bias where the model has none).
    fn layer_norm(&self, x: &Tensor, prefix: &str) -> Result<Tensor> {
        let w = self.p(&format!("{prefix}.weight"))?;
        let zero;
        let b = match self.bias(&format!("{prefix}.bias")) {
            Some(b) => b,
            None => {
                zero = w.zeros_like()?;
                &zero
            }
        };
        super::fused::layer_norm(x, w, b, LN_EPS, &self.place)
    }

    /// Causal self-attention of x (B T, C). The queries, keys and values are c_attn's three parts (C
    /// rows of its weight and entries of its bias each), each as (B, nh, T, hs) heads: candle's narrow of
    /// one (B T, 3 C) product would take its gradient back through a model-wide zero fill, cat and add
    /// per part, where the weight's parts take that path at the weight's size.
    fn attention(&self, x: &Tensor, t: usize, prefix: &str) -> Result<Tensor> {
        let (c, nh) = (self.cfg.n_embd, self.cfg.n_heads);
        let hs = c / nh;
        let heads = |part: usize| -> Result<Tensor> {
            let rows = self.linear_rows(x, &format!("{prefix}.c_attn"), part * c, c)?;
            super::fused::to_heads(&rows, t, nh, &self.place)
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let scale = 1.0 / (hs as f32).sqrt();
        let scores = self.mm(&q, &k.t()?)?; // (B, nh, T, T)
        let att = super::fused::causal_softmax(&scores, scale, &self.place)?;
        let y = self.mm(&att, &v)?; // (B, nh, T, hs)
        let y = super::fused::from_heads(&y, &self.place)?; // (B T, C)
        self.linear(&y, &format!("{prefix}.c_proj"))
    }

    fn mlp(&self, x: &Tensor, prefix: &str) -> Result<Tensor> {
        let h = self.linear(x, &format!("{prefix}.c_fc"))?;
        let tanh_form = self.cfg.activation == crate::config::Activation::GeluTanh;
        let h = super::fused::gelu(&h, tanh_form, &self.place)?;
        self.linear(&h, &format!("{prefix}.c_proj"))
    }

    /// Logits (B*T, vocab) for token ids `x` of shape (B, T). `dropout` draws its masks from `rng`
    /// when the model trains with dropout > 0.
    pub fn forward(&self, x: &Tensor, mut dropout: Option<&mut ChaCha8Rng>) -> Result<Tensor> {
        let (_, t) = x.dims2()?;
        let mut h = self.embed(x, &mut dropout)?;
        for i in 0..self.cfg.n_layers {
            h = self.block(&h, i, t, &mut dropout)?;
        }
        self.head(&h)
    }

    /// Token + position embeddings (B*T, C), with dropout.
    fn embed(&self, x: &Tensor, dropout: &mut Option<&mut ChaCha8Rng>) -> Result<Tensor> {
        let (b, t) = x.dims2()?;
        anyhow::ensure!(
            t <= self.context_length,
            "sequence of {t} tokens is longer than the model's context of {}",
            self.context_length
        );
        let c = self.cfg.n_embd;
        let wte = self.p("transformer.wte.weight")?;
        // The ids on the host: the backward groups the positions by token (a copy of B T ids).
        let ids = x.flatten_all()?.to_vec1::<u32>()?;
        let tok = super::fused::embedding(wte, &ids, &self.place)?; // (B*T, C)
        let pos = self.p("transformer.wpe.weight")?.narrow(0, 0, t)?;
        // The positions' rows added to each sequence's: a bias over rows of t c.
        let h =
            super::fused::bias_add(&tok.reshape((b, t * c))?, &pos.flatten_all()?, &self.place)?
                .reshape((b * t, c))?;
        self.drop(h, dropout)
    }

    fn drop(&self, h: Tensor, dropout: &mut Option<&mut ChaCha8Rng>) -> Result<Tensor> {
        match dropout.as_deref_mut() {
            Some(rng) if self.cfg.dropout > 0.0 => dropout_mask(&h, self.cfg.dropout, rng),
            _ => Ok(h),
        }
    }

    /// Block `i`: h + attn(ln_1(h)), then + mlp(ln_2(.)), each branch with dropout.
    fn block(
        &self,
        h: &Tensor,
        i: usize,
        t: usize,
        dropout: &mut Option<&mut ChaCha8Rng>,
    ) -> Result<Tensor> {
        let pre = format!("transformer.h.{i}");
        let a = self.attention(
            &self.layer_norm(h, &format!("{pre}.ln_1"))?,
            t,
            &format!("{pre}.attn"),
        )?;
        let h = (h + self.drop(a, dropout)?)?;
        let m = self.mlp(
            &self.layer_norm(&h, &format!("{pre}.ln_2"))?,
            &format!("{pre}.mlp"),
        )?;
        Ok((h + self.drop(m, dropout)?)?)
    }

    /// The final LayerNorm and the lm head tied to the token embedding: logits (B*T, vocab).
    fn head(&self, h: &Tensor) -> Result<Tensor> {
        let h = self.layer_norm(h, "transformer.ln_f")?;
        self.mm(&h, &self.p("transformer.wte.weight")?.t()?)
    }

    /// Mean cross-entropy of next-token targets `y` (B, T).
    pub fn loss(&self, x: &Tensor, y: &Tensor, dropout: Option<&mut ChaCha8Rng>) -> Result<Tensor> {
        let logits = self.forward(x, dropout)?;
        self.cross_entropy(&logits, y)
    }

    fn cross_entropy(&self, logits: &Tensor, y: &Tensor) -> Result<Tensor> {
        let rows = super::fused::cross_entropy(logits, &y.flatten_all()?, &self.place)?;
        Ok(rows.mean_all()?)
    }

    /// `loss_and_grads` on candle's graph in stages, as DDP's overlap needs: the head, then the blocks
    /// from the last to the first, then the embeddings, each stage's backward from the gradient at its
    /// output. After each stage, `ready` gets `grads` and the flat range of the parameters whose
    /// gradient is then complete (ln_f; block i; wte and wpe, wte's head share included), every
    /// parameter once, so that a backend can start reducing it while the next stage computes.
    #[allow(clippy::too_many_arguments)]
    pub fn loss_and_grads_staged(
        &self,
        batch: &Batch,
        mut dropout: Option<&mut ChaCha8Rng>,
        scale: f32,
        mut grads: FlatMut<'_>,
        ready: &mut dyn FnMut(FlatMut<'_>, std::ops::Range<usize>) -> Result<()>,
    ) -> Result<f32> {
        anyhow::ensure!(
            self.cpu.is_none(),
            "internal error: the staged backward runs on candle's graph"
        );
        let (x, y) = self.batch_tensors(batch)?;
        let (_, t) = x.dims2()?;
        // Each stage's input is a leaf (a detached copy as a Var), so that each backward stops there.
        let leaf = |h: &Tensor| candle_core::Var::from_tensor(&h.detach());
        let h0 = self.embed(&x, &mut dropout)?;
        let (mut inputs, mut outputs) = (vec![leaf(&h0)?], Vec::new());
        for i in 0..self.cfg.n_layers {
            let h = self.block(inputs[i].as_tensor(), i, t, &mut dropout)?;
            inputs.push(leaf(&h)?);
            outputs.push(h);
        }
        let top = inputs.last().expect("the embedding's leaf");
        let loss = self.cross_entropy(&self.head(top.as_tensor())?, &y)?;
        let g = (&loss * scale as f64)?.backward()?;
        self.params.accumulate_grads(&g, grads.reborrow())?;
        ready(grads.reborrow(), self.params.range_of("transformer.ln_f.")?)?;
        let grad_of = |g: &candle_core::backprop::GradStore, v: &candle_core::Var| {
            g.get(v.as_tensor())
                .cloned()
                .context("internal error: a stage's input has no gradient")
        };
        let mut up = grad_of(&g, top)?;
        for i in (0..self.cfg.n_layers).rev() {
            // d/dh sum(h * up) = up: the backward of block i from the gradient at its output.
            let g = (&outputs[i] * &up)?.sum_all()?.backward()?;
            self.params.accumulate_grads(&g, grads.reborrow())?;
            ready(
                grads.reborrow(),
                self.params.range_of(&format!("transformer.h.{i}."))?,
            )?;
            up = grad_of(&g, &inputs[i])?;
        }
        let g = (&h0 * &up)?.sum_all()?.backward()?;
        self.params.accumulate_grads(&g, grads.reborrow())?;
        for emb in ["transformer.wpe.", "transformer.wte."] {
            ready(grads.reborrow(), self.params.range_of(emb)?)?;
        }
        Ok(loss.to_scalar::<f32>()?)
    }

    /// Builds (x, y) tensors from a sampled batch.
    pub fn batch_tensors(&self, batch: &crate::data::Batch) -> Result<(Tensor, Tensor)> {
        let x = Tensor::from_slice(&batch.x, (batch.b, batch.t), &self.device)?;
        let y = Tensor::from_slice(&batch.y, (batch.b, batch.t), &self.device)?;
        Ok((x, y))
    }
}

/// Inverted dropout with a seeded mask (candle's dropout draws from an unseeded RNG).
fn dropout_mask(x: &Tensor, p: f64, rng: &mut ChaCha8Rng) -> Result<Tensor> {
    use rand::Rng;
    let scale = (1.0 / (1.0 - p)) as f32;
    let mask: Vec<f32> = (0..x.elem_count())
        .map(|_| if rng.random::<f64>() < p { 0.0 } else { scale })
        .collect();
    let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(DType::F32)?;
    Ok(x.mul(&mask)?)
}

/// The initial weights plus N(0, std) noise, loaded into `m` and returned: with nanoGPT's zero biases and
/// unit gains some gradients vanish by symmetry, and tests want non-trivial weights.
#[cfg(test)]
pub(crate) fn perturb(m: &Gpt, std: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let dist = Normal::new(0.0f32, std).expect("positive std");
    let flat: Vec<f32> = m
        .initial_weights()
        .iter()
        .map(|v| v + dist.sample(&mut rng))
        .collect();
    m.load((&flat).into()).expect("parameters");
    flat
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Activation;

    fn tiny(bias: bool, activation: Activation) -> Gpt {
        let cfg = ModelConfig {
            n_layers: 2,
            n_heads: 2,
            n_embd: 8,
            dropout: 0.0,
            vocab_size: 11,
            bias,
            activation,
        };
        Gpt::new(&cfg, 6, 3, &Device::Cpu).unwrap()
    }

    fn batch(m: &Gpt) -> (Tensor, Tensor) {
        let x: Vec<u32> = (0..12).map(|i| (i * 7 % 11) as u32).collect();
        let y: Vec<u32> = (0..12).map(|i| (i * 5 % 11) as u32).collect();
        (
            Tensor::from_vec(x, (2, 6), m.device()).unwrap(),
            Tensor::from_vec(y, (2, 6), m.device()).unwrap(),
        )
    }

    fn perturb(m: &Gpt) -> Vec<f32> {
        super::perturb(m, 0.3)
    }

    #[test]
    fn every_parameter_gets_a_finite_nonzero_gradient() {
        for (bias, act) in [(true, Activation::Gelu), (false, Activation::GeluTanh)] {
            let m = tiny(bias, act).graph().unwrap();
            perturb(&m);
            let (x, y) = batch(&m);
            let grads = m.loss(&x, &y, None).unwrap().backward().unwrap();
            for p in &m.params.params {
                let g = grads
                    .get(p.var.as_ref().unwrap().as_tensor())
                    .unwrap_or_else(|| panic!("{} has no gradient", p.name));
                let v = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(
                    v.iter().all(|x| x.is_finite()),
                    "{}: non-finite gradient",
                    p.name
                );
                assert!(v.iter().any(|x| *x != 0.0), "{}: all-zero gradient", p.name);
            }
        }
    }

    /// DDP's staged backward gives the monolithic backward's loss and gradient (to f32 rounding: sums
    /// meet in another order), with dropout; each range it reports is complete when reported, and the
    /// ranges cover every parameter once, the last block first.
    #[test]
    fn the_staged_backward_is_the_backward_and_reports_each_range_once_complete() {
        for (bias, dropout) in [(true, 0.0), (false, 0.2)] {
            let mut m = tiny(bias, Activation::Gelu);
            m.cfg.dropout = dropout;
            let m = m.graph().unwrap();
            let base = perturb(&m);
            let x: Vec<u32> = (0..12).map(|i| (i * 7 % 11) as u32).collect();
            let y: Vec<u32> = (0..12).map(|i| (i * 5 % 11) as u32).collect();
            let batch = Batch { b: 2, t: 6, x, y };
            let rng = || ChaCha8Rng::seed_from_u64(5);
            let mut want = vec![0.0f32; m.params.numel];
            let (mut r1, mut r2) = (rng(), rng());
            let loss = m
                .loss_and_grads(
                    &mut Scratch::default(),
                    (&base).into(),
                    &batch,
                    Some(&mut r1),
                    0.5,
                    (&mut want).into(),
                )
                .unwrap();
            let mut got = vec![0.0f32; m.params.numel];
            let mut seen = Vec::new();
            let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * (1.0 + b.abs());
            let staged = m
                .loss_and_grads_staged(
                    &batch,
                    Some(&mut r2),
                    0.5,
                    (&mut got).into(),
                    &mut |g, r| {
                        let g = g.as_ref().to_host().unwrap();
                        for i in r.clone() {
                            assert!(
                                close(g[i], want[i]),
                                "{i} in {r:?}: {} vs {}",
                                g[i],
                                want[i]
                            );
                        }
                        seen.push(r);
                        Ok(())
                    },
                )
                .unwrap();
            assert!(close(staged, loss), "{staged} vs {loss}");
            let mut covered = vec![0u8; m.params.numel];
            seen.iter()
                .flat_map(|r| r.clone())
                .for_each(|i| covered[i] += 1);
            assert!(covered.iter().all(|&c| c == 1), "{seen:?}");
            let last_block = m.params.range_of("transformer.h.1.").unwrap();
            assert_eq!((seen.len(), &seen[1]), (5, &last_block));
        }
    }

    /// Both the CPU engine and candle's graph.
    #[test]
    fn gradients_match_finite_differences() {
        for m in [
            tiny(true, Activation::Gelu),
            tiny(true, Activation::Gelu).graph().unwrap(),
        ] {
            let base = perturb(&m);
            let x: Vec<u32> = (0..12).map(|i| (i * 7 % 11) as u32).collect();
            let y: Vec<u32> = (0..12).map(|i| (i * 5 % 11) as u32).collect();
            let batch = Batch { b: 2, t: 6, x, y };
            let mut flat_g = vec![0.0f32; m.params.numel];
            m.loss_and_grads(
                &mut Scratch::default(),
                (&base).into(),
                &batch,
                None,
                1.0,
                (&mut flat_g).into(),
            )
            .unwrap();
            let loss_at = |flat: &[f32]| -> f64 {
                m.load(flat.into()).unwrap();
                m.batch_loss(&mut Scratch::default(), flat, &batch).unwrap() as f64
            };
            let eps = 1e-2f32;
            let mut checked = 0;
            // A few coordinates of every parameter tensor.
            for p in &m.params.params {
                for k in [0, p.len / 2, p.len - 1] {
                    let i = p.offset + k;
                    let mut plus = base.clone();
                    plus[i] += eps;
                    let mut minus = base.clone();
                    minus[i] -= eps;
                    let fd = (loss_at(&plus) - loss_at(&minus)) / (2.0 * eps as f64);
                    let an = flat_g[i] as f64;
                    let tol = 2e-3 + 2e-2 * an.abs().max(fd.abs());
                    assert!(
                        (fd - an).abs() < tol,
                        "{}[{k}]: finite difference {fd}, backward {an}",
                        p.name
                    );
                    checked += 1;
                }
            }
            assert!(checked >= 3 * m.params.params.len());
        }
    }

    #[test]
    fn init_is_deterministic_and_scaled_like_nanogpt() {
        let a = tiny(true, Activation::Gelu).initial_weights();
        let b = tiny(true, Activation::Gelu).initial_weights();
        assert_eq!(a, b);
        // The graph's tensors start from the same weights.
        let g = tiny(true, Activation::Gelu).graph().unwrap();
        assert_eq!(g.params.to_flat().unwrap(), a);
        let cfg = ModelConfig {
            n_layers: 8,
            n_embd: 64,
            n_heads: 4,
            vocab_size: 512,
            ..ModelConfig::default()
        };
        let m = Gpt::new(&cfg, 32, 1, &Device::Cpu)
            .unwrap()
            .graph()
            .unwrap();
        let std = |name: &str| {
            let v = m
                .params
                .get(name)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
        };
        assert!((std("transformer.wte.weight") - 0.02).abs() < 0.001);
        let proj = 0.02 / 16f64.sqrt();
        assert!((std("transformer.h.3.mlp.c_proj.weight") - proj).abs() < 0.0005);
        assert!((std("transformer.h.3.attn.c_attn.weight") - 0.02).abs() < 0.001);
    }

    /// Losses of `steps` AdamW steps of a fixed-seed run of `cfg` on a fixed synthetic sequence.
    fn adamw_losses(cfg: &ModelConfig, steps: u32, prepare: impl Fn(Gpt) -> Gpt) -> Vec<f32> {
        let m = prepare(Gpt::new(cfg, 12, 5, &Device::Cpu).unwrap());
        let segments = m.params.segments();
        let mut opt = crate::optim::build(
            &crate::config::OptimConfig::default(),
            segments,
            &[],
            m.params.numel,
            &crate::flat::Place::Host,
        )
        .unwrap();
        let mut flat = m.initial_weights();
        let mut grads = vec![0.0f32; m.params.numel];
        let mut scratch = Scratch::default();
        let v = cfg.vocab_size as u32;
        (0..steps)
            .map(|step| {
                let x: Vec<u32> = (0..48).map(|i| (i * 7 + step * 3) % v).collect();
                let y: Vec<u32> = x.iter().map(|t| (t * 3 + 1) % v).collect();
                let batch = Batch { b: 4, t: 12, x, y };
                grads.iter_mut().for_each(|g| *g = 0.0);
                let loss = m
                    .loss_and_grads(
                        &mut scratch,
                        (&flat).into(),
                        &batch,
                        None,
                        1.0,
                        (&mut grads).into(),
                    )
                    .unwrap();
                opt.step((&mut flat).into(), (&grads).into(), 3e-3).unwrap();
                m.load((&flat).into()).unwrap();
                loss
            })
            .collect()
    }

    fn small(act: Activation) -> ModelConfig {
        ModelConfig {
            n_layers: 2,
            n_heads: 2,
            n_embd: 16,
            dropout: 0.0,
            vocab_size: 23,
            bias: true,
            activation: act,
        }
    }

    /// The parity oracle: 50 AdamW steps of a fixed-seed run on the CPU engine match the same run
    /// on candle's graph within 1e-4 relative, step by step.
    #[test]
    fn fifty_training_steps_on_the_cpu_engine_match_candle_autograd() {
        for act in [Activation::Gelu, Activation::GeluTanh] {
            let engine = adamw_losses(&small(act), 50, |m| m);
            let reference = adamw_losses(&small(act), 50, |m| m.graph().unwrap());
            for (i, (a, b)) in engine.iter().zip(&reference).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs(),
                    "{act:?} step {i}: {a} vs {b}"
                );
            }
            assert!(engine[49] < engine[0] - 0.5, "it learns: {engine:?}");
        }
    }

    /// The amp test's bound: each step's loss within 2% of the f32 run's, not all equal, and learning.
    fn follows_within_2_percent(amp: &[f32], f32_run: &[f32]) {
        let mut differs = false;
        for (i, (a, b)) in amp.iter().zip(f32_run).enumerate() {
            assert!(
                (a - b).abs() <= 0.02 * b.abs(),
                "step {i}: amp {a} vs f32 {b}"
            );
            differs |= a != b;
        }
        assert!(differs, "bf16 matmuls changed nothing");
        let last = amp.len() - 1;
        assert!(amp[last] < amp[0] - 0.5, "it learns: {amp:?}");
    }

    /// Mixed precision (bf16 matmuls, f32 master weights and optimizer): on CPU candle rounds the inputs
    /// to bf16 and multiplies in f32, as a bf16 GEMM with f32 accumulation does on a GPU. The loss curve
    /// follows the f32 one within bf16 noise, and is not the f32 curve (the casts are real).
    #[test]
    fn bf16_matmuls_follow_the_f32_loss_curve() {
        let cfg = small(Activation::GeluTanh);
        let f32_run = adamw_losses(&cfg, 40, |m| m.graph().unwrap());
        let amp = adamw_losses(&cfg, 40, |m| {
            m.graph().unwrap().with_amp(true, Precision::F32)
        });
        follows_within_2_percent(&amp, &f32_run);
    }

    /// The mixed-precision oracle on the CPU engine (bf16 linear layers and lm head): its loss
    /// curve follows the f32 engine's within the 2% of the graph's amp test, and is not the f32 curve.
    /// Where the CPU has AVX512-BF16 (and AMX), its vdpbf16ps (and AMX) products and the emulated ones
    /// (operands rounded, f32 gemm) give the same curve but for the order of the sums.
    #[test]
    fn bf16_matmuls_on_the_cpu_engine_follow_the_f32_loss_curve() {
        let cfg = small(Activation::GeluTanh);
        let f32_run = adamw_losses(&cfg, 40, |m| m);
        let path = |p| {
            move |m: Gpt| {
                let mut m = m.with_amp(true, Precision::Bf16);
                m.cpu.as_mut().unwrap().set_precision(Precision::Bf16, p);
                m
            }
        };
        let emulated = adamw_losses(&cfg, 40, path(Bf16Path::EMULATED));
        follows_within_2_percent(&emulated, &f32_run);
        for hw in Bf16Path::available()
            .into_iter()
            .filter(|p| p.is_hardware())
        {
            let amp = adamw_losses(&cfg, 40, path(hw));
            for (i, (a, b)) in amp.iter().zip(&emulated).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-3 * b.abs(),
                    "step {i}: {hw} {a} vs emulated {b}"
                );
            }
        }
    }
}

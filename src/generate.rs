//! Using a trained model: `nanodist eval` (loss and perplexity on a file) and `nanodist sample`.

use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::Device;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::bad_input;
use crate::config::{self, Config, ConfigError};
use crate::data::{open_source, TokenFile, Tokenizer};
use crate::model::Gpt;
use crate::train::checkpoint;

/// A model restored from a checkpoint, with its config and tokenizer.
pub struct Trained {
    pub dir: PathBuf,
    /// The weights file read and the step it was saved at.
    pub weights: PathBuf,
    pub step: u64,
    pub config: Config,
    /// The model on the CPU engine, and its weights (flat, name order).
    pub model: Gpt,
    pub flat: Vec<f32>,
    tokenizer: Option<Tokenizer>,
}

impl Trained {
    /// The training data's tokenizer (needed for text in and out).
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().ok_or_else(|| {
            bad_input!(
                "{}: the checkpoint does not record its tokenizer (its data had no meta.json); \
                 use a token file",
                self.dir.display()
            )
        })
    }
}

/// The model of `ckpt`: a checkpoint directory, a run directory (its newest valid checkpoint) or a weights
/// file such as a run's `best_model.safetensors` (config and tokenizer from its run's newest checkpoint).
pub fn load(ckpt: &Path) -> Result<Trained> {
    let file = ckpt.is_file().then(|| ckpt.to_path_buf());
    if file.is_some() && ckpt.extension().is_none_or(|e| e != "safetensors") {
        return Err(bad_input!(
            "{}: not a weights file; give a run directory (log/NAME, its newest checkpoint), a checkpoint \
             directory (log/NAME/checkpoints/step_N) or a .safetensors file (log/NAME/best_model.safetensors)",
            ckpt.display()
        ));
    }
    let run = match &file {
        Some(f) => f.parent().map_or(PathBuf::from("."), Path::to_path_buf),
        None => ckpt.to_path_buf(),
    };
    let dir = checkpoint::require(&run)?;
    let manifest = checkpoint::verify(&dir)?;
    let (config, _) = config::parse(&manifest.config, &[]).map_err(|problems| ConfigError {
        file: dir.join("manifest.json").display().to_string(),
        problems,
    })?;
    let model = Gpt::new(&config.model, config.train.context_length, 0, &Device::Cpu)?;
    // The model file holds the replicas' average (identical replicas for all-reduce).
    let weights = file.unwrap_or_else(|| dir.join("model.safetensors"));
    let (flat, step) = checkpoint::read_hf_weights(&weights, &model)?;
    let step = step.unwrap_or(manifest.step);
    tracing::info!("loaded {} (step {step})", weights.display());
    let tokenizer = manifest.tokenizer;
    Ok(Trained {
        dir,
        weights,
        step,
        config,
        model,
        flat,
        tokenizer,
    })
}

/// Result of `eval`.
#[derive(Debug, Clone)]
pub struct EvalResult {
    pub loss: f64,
    pub tokens: usize,
    pub windows: usize,
    pub context: usize,
}

/// Mean next-token loss over consecutive windows of the file (every token after the first is predicted
/// once, with up to context_length - 1 tokens of context).
pub fn eval_file(
    ckpt: &Path,
    data: &Path,
    batch_size: usize,
    max_tokens: Option<usize>,
) -> Result<EvalResult> {
    let tr = load(ckpt)?;
    let t = tr.model.context_length;
    let is_tokens = data.extension().is_some_and(|e| e == "bin" || e == "idx")
        || PathBuf::from(format!("{}.idx", data.display())).is_file();
    let tokens: Vec<u32> = if is_tokens {
        let f: TokenFile = open_source(data, false)?;
        crate::data::source::check_vocab(&f, tr.config.model.vocab_size)?;
        let mut v = vec![0; f.len()];
        f.read(0, &mut v);
        v
    } else {
        if data.is_dir() {
            return Err(bad_input!(
                "{}: is a directory; --data takes a token file (.bin, or a Megatron prefix with .bin and .idx) \
                 or a UTF-8 text file",
                data.display()
            ));
        }
        let text = std::fs::read_to_string(data)
            .map_err(|e| bad_input!("--data {}: {e}", crate::error::absolute(data).display()))?;
        tr.tokenizer()?
            .encode_document(&text)
            .map_err(|e| bad_input!("{}:{e:#}", data.display()))?
    };
    let n = max_tokens.map_or(tokens.len(), |m| m.min(tokens.len()));
    if n < 2 {
        return Err(bad_input!(
            "{}: fewer than 2 tokens to evaluate",
            data.display()
        ));
    }
    // Windows of up to t + 1 tokens, overlapping by one, so each target is predicted once; the full
    // windows go `batch_size` to a forward pass, the shorter last one alone.
    let starts: Vec<usize> = (0..n - 1).step_by(t).collect();
    let (mut total, mut count) = (0.0f64, 0usize);
    let mut scratch = crate::model::Scratch::default();
    let window = |s: usize, len: usize| (&tokens[s..s + len], &tokens[s + 1..s + 1 + len]);
    let (full, last): (Vec<usize>, Vec<usize>) = starts.iter().partition(|&&s| s + t < n);
    let batches = full.chunks(batch_size.max(1)).map(|c| (c, t));
    for (chunk, len) in batches.chain(last.chunks(1).map(|c| (c, n - 1 - c[0]))) {
        let mut batch = crate::data::Batch {
            b: chunk.len(),
            t: len,
            x: Vec::with_capacity(chunk.len() * len),
            y: Vec::with_capacity(chunk.len() * len),
        };
        for &s in chunk {
            let (x, y) = window(s, len);
            batch.x.extend_from_slice(x);
            batch.y.extend_from_slice(y);
        }
        total += tr.model.batch_loss(&mut scratch, &tr.flat, &batch)? as f64
            * (chunk.len() * len) as f64;
        count += chunk.len() * len;
    }
    Ok(EvalResult {
        loss: total / count as f64,
        tokens: count,
        windows: starts.len(),
        context: t,
    })
}
#[derive(Debug, Clone, Copy)]
pub struct SampleOptions {
    pub max_new_tokens: usize,
    pub temperature: f64,
    pub top_k: usize,
    pub seed: u64,
}

/// The prompt followed by `max_new_tokens` sampled tokens, decoded.
pub fn sample(ckpt: &Path, prompt: &str, o: &SampleOptions) -> Result<String> {
    if o.temperature < 0.0 || o.temperature.is_nan() {
        return Err(bad_input!(
            "--temperature must be >= 0 (0: greedy), found {}",
            o.temperature
        ));
    }
    let tr = load(ckpt)?;
    let tokenizer = tr.tokenizer()?;
    let mut ids = tokenizer
        .encode(prompt)
        .map_err(|e| bad_input!("--prompt: {e}"))?;
    if ids.is_empty() {
        ids.push(tokenizer.eot());
    }
    let mut rng = ChaCha8Rng::seed_from_u64(o.seed);
    let vocab = tokenizer.vocab_size();
    let t = tr.model.context_length;
    // Generation runs on the CPU engine, as nanoGPT's does: the whole (cropped) context a token at a time.
    let mut scratch = crate::model::Scratch::default();
    for _ in 0..o.max_new_tokens {
        let ctx = &ids[ids.len().saturating_sub(t)..];
        let logits = tr
            .model
            .last_logits(&mut scratch, &tr.flat, ctx, 1, ctx.len())?;
        // Padded vocabulary entries beyond the tokenizer's are never sampled.
        if o.temperature == 0.0 {
            // Greedy: the most likely token (the lowest id among equals).
            let best =
                logits[..vocab]
                    .iter()
                    .enumerate()
                    .fold(
                        (0, f32::NEG_INFINITY),
                        |b, (i, &l)| if l > b.1 { (i, l) } else { b },
                    );
            ids.push(best.0 as u32);
            continue;
        }
        let mut scored: Vec<(usize, f64)> = logits[..vocab]
            .iter()
            .enumerate()
            .map(|(i, &l)| (i, l as f64 / o.temperature))
            .collect();
        if o.top_k > 0 && o.top_k < scored.len() {
            scored.select_nth_unstable_by(o.top_k - 1, |a, b| b.1.total_cmp(&a.1));
            scored.truncate(o.top_k);
        }
        let max = scored.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scored.iter().map(|s| (s.1 - max).exp()).collect();
        let mut u = rng.random::<f64>() * weights.iter().sum::<f64>();
        let mut pick = scored[scored.len() - 1].0;
        for (s, w) in scored.iter().zip(&weights) {
            if u < *w {
                pick = s.0;
                break;
            }
            u -= w;
        }
        ids.push(pick as u32);
    }
    tokenizer.decode(&ids)
}

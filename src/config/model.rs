//! `[model]`: the GPT-2 architecture (nanoGPT's `GPTConfig`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The GPT architecture. Defaults are GPT-2 small (124M) with nanoGPT's padded vocabulary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Number of transformer blocks.
    #[schemars(range(min = 1, max = 1024))]
    pub n_layers: usize,
    /// Attention heads per block; must divide `n_embd`.
    #[schemars(range(min = 1, max = 1024))]
    pub n_heads: usize,
    /// Width of the residual stream.
    #[schemars(range(min = 1, max = 65536))]
    pub n_embd: usize,
    /// Dropout probability on attention, residual and embedding outputs (0 disables it).
    #[schemars(range(min = 0.0, max = 1.0))]
    pub dropout: f64,
    /// Vocabulary size of the embedding (GPT-2's 50257 padded to 50304, a multiple of 64, for speed).
    /// Must be at least the tokenizer's vocabulary.
    #[schemars(range(min = 1, max = 65536))]
    pub vocab_size: usize,
    /// Use biases in Linear and LayerNorm layers (GPT-2: true; nanoGPT recommends false: a bit better and faster).
    pub bias: bool,
    /// MLP activation: "gelu" is exact erf-GELU (nanoGPT's `nn.GELU()`), "gelu_tanh" the tanh approximation
    /// of the original GPT-2 ("gelu_new" in Hugging Face).
    pub activation: Activation,
}

/// The MLP non-linearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Activation {
    /// Exact GELU, x * Phi(x) (erf form), as torch.nn.GELU().
    #[serde(rename = "gelu")]
    Gelu,
    /// Tanh approximation of GELU, as the original GPT-2.
    #[serde(rename = "gelu_tanh")]
    GeluTanh,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            n_layers: 12,
            n_heads: 12,
            n_embd: 768,
            dropout: 0.0,
            vocab_size: 50304,
            bias: false,
            activation: Activation::Gelu,
        }
    }
}

impl ModelConfig {
    /// Number of trainable parameters for a context of `context_length` positions (embeddings included;
    /// the lm head is tied to the token embedding and counted once).
    pub fn n_params(&self, context_length: usize) -> u64 {
        // Validated sizes keep these products far below u64::MAX (n_embd <= 2^16, n_layers <= 2^10).
        let (c, l, v, t) = (
            self.n_embd as u64,
            self.n_layers as u64,
            self.vocab_size as u64,
            context_length as u64,
        );
        let b = u64::from(self.bias);
        // LayerNorm: weight (+ bias). Attention: qkv (3C x C) + proj (C x C). MLP: 4C x C twice.
        let ln = c + b * c;
        let attn = 3 * c * c + 3 * c * b + c * c + c * b;
        let mlp = 4 * c * c + 4 * c * b + 4 * c * c + c * b;
        v * c + t * c + l * (2 * ln + attn + mlp) + ln
    }

    /// Training FLOPs per token (forward + backward), PaLM appendix B / nanoGPT's `estimate_mfu`:
    /// 6 N for the matmuls with the non-embedding parameters plus 12 L C T for attention.
    pub fn flops_per_token(&self, context_length: usize) -> u64 {
        let n = self.n_params(context_length) - (context_length * self.n_embd) as u64;
        6 * n + 12 * (self.n_layers * self.n_embd * context_length) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_parameter_count_matches_nanogpt() {
        // nanoGPT reports 123.69M non-embedding... with wpe counted: GPT-2 small, bias=True, vocab 50257
        // is 124,439,808 parameters (HF GPT2LMHeadModel, lm head tied).
        let m = ModelConfig {
            bias: true,
            vocab_size: 50257,
            ..ModelConfig::default()
        };
        assert_eq!(m.n_params(1024), 124_439_808);
    }
}

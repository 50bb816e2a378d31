//! Token data: tokenizers, `prepare`, file formats, sources, samplers and their prefetching.

pub mod cache;
pub mod format;
pub mod prefetch;
pub mod prepare;
pub mod sampler;
pub mod source;
pub mod tokenizer;

pub use format::TokenFile;
pub use prepare::{prepare, Meta, OutputFormat, PrepareOptions, TokenizerKind};
pub use sampler::{eval_batch, Batch, Sampler, View};
pub use source::{open_source, Blend, Split};
pub use tokenizer::Tokenizer;

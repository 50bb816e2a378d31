//! Token sources read by training: nanoGPT files, Megatron datasets and weighted blends of them.

use std::path::{Path, PathBuf};

use anyhow::Result;

use super::format::TokenFile;
use crate::bad_input;
use crate::config::{Config, DataSource};

/// Which split of the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    Val,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Val => "val",
        }
    }
}

/// Several token files sampled with relative weights.
#[derive(Debug)]
pub struct Blend {
    pub files: Vec<TokenFile>,
    /// Cumulative normalised weights (last = 1).
    cumulative: Vec<f64>,
}

impl Blend {
    /// Opens the sources of `split` named by the config (default: data_dir/{train,val}.bin), checks that
    /// each holds at least one sample of `sample_len` tokens (context + 1) and that every token fits
    /// `vocab_size`.
    pub fn open(cfg: &Config, split: Split, sample_len: usize, vocab_size: usize) -> Result<Self> {
        let listed = match split {
            Split::Train => &cfg.train_data,
            Split::Val => &cfg.val_data,
        };
        let sources: Vec<DataSource> = if listed.is_empty() {
            vec![DataSource {
                path: Path::new(&cfg.data_dir)
                    .join(format!("{}.bin", split.name()))
                    .display()
                    .to_string(),
                weight: 1.0,
            }]
        } else {
            listed.clone()
        };
        let mut files = Vec::new();
        for s in &sources {
            let f = open_source(Path::new(&s.path), cfg.in_memory)?;
            if f.len() < sample_len {
                return Err(bad_input!(
                    "{}: {} tokens, fewer than one training sample of context_length + 1 = {sample_len}",
                    f.path().display(),
                    f.len()
                ));
            }
            f.check_vocab(vocab_size)?;
            files.push(f);
        }
        let weights: Vec<f64> = sources.iter().map(|s| s.weight).collect();
        Ok(Self::from_files(files, &weights))
    }

    /// A blend of already opened files with relative `weights`.
    pub fn from_files(files: Vec<TokenFile>, weights: &[f64]) -> Self {
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cumulative = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        Self { files, cumulative }
    }

    /// A blend of already opened files (tests, eval of one file).
    pub fn single(file: TokenFile) -> Self {
        Self {
            files: vec![file],
            cumulative: vec![1.0],
        }
    }

    /// The sources' cumulative normalised weights.
    pub fn cumulative(&self) -> &[f64] {
        &self.cumulative
    }

    pub fn total_tokens(&self) -> usize {
        self.files.iter().map(TokenFile::len).sum()
    }
}

/// Opens one source: a nanoGPT `.bin`, or a Megatron dataset given as `<prefix>`, `<prefix>.bin` or
/// `<prefix>.idx` (recognised by the `.idx` beside it).
pub fn open_source(path: &Path, in_memory: bool) -> Result<TokenFile> {
    let s = path.to_string_lossy();
    let prefix = s
        .strip_suffix(".bin")
        .or_else(|| s.strip_suffix(".idx"))
        .unwrap_or(&s);
    let idx = PathBuf::from(format!("{prefix}.idx"));
    if idx.is_file() {
        return TokenFile::open_megatron(Path::new(prefix), in_memory);
    }
    if path.is_file() && s.ends_with(".bin") {
        return TokenFile::open_nanogpt(path, in_memory);
    }
    Err(bad_input!(
        "{}: no token data there: expected a nanoGPT .bin file or a Megatron prefix with .bin and .idx \
         (make one with `nanodist prepare`)",
        crate::error::absolute(path).display()
    ))
}

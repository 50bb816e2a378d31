//! Token sources read by training: nanoGPT files, Megatron datasets and weighted blends of them.

use std::path::{Path, PathBuf};

use anyhow::Result;
use serde::{Deserialize, Serialize};

use super::cache;
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
            check_vocab(&f, vocab_size)?;
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

/// Checks every token of `f` against the vocabulary. The file's token range comes from nanodist's cache
/// when this file was scanned before (the same path, size, modification time and inode), else from a
/// scan of the whole file, then cached: a 9-billion-token dataset is read once, not at every start.
pub fn check_vocab(f: &TokenFile, vocab_size: usize) -> Result<()> {
    f.check_vocab(vocab_size, token_range_in(cache::dir().as_deref(), f))
}

#[derive(Serialize, Deserialize)]
struct Range {
    min: i64,
    max: i64,
    /// Seconds the scan took.
    scan_s: f64,
}

/// What a file's scanned range depends on: its contents, as its metadata names them (None: no metadata).
fn range_key(f: &TokenFile) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let path = std::fs::canonicalize(f.path()).ok()?;
    let m = std::fs::metadata(&path).ok()?;
    Some(format!(
        "token range v1; {}; {} bytes; modified {}.{:09}; inode {}:{}; {} tokens",
        path.display(),
        m.len(),
        m.mtime(),
        m.mtime_nsec(),
        m.dev(),
        m.ino(),
        f.len()
    ))
}

/// The smallest and largest token of `f`: cached in `dir`, else scanned (and cached there).
fn token_range_in(dir: Option<&Path>, f: &TokenFile) -> (i64, i64) {
    let key = range_key(f);
    let file = dir
        .zip(key.as_deref())
        .map(|(d, k)| cache::file_of(d, "token-range", k));
    if let Some(r) = file
        .as_deref()
        .zip(key.as_deref())
        .and_then(|(p, k)| cache::get::<Range>(p, k))
    {
        return (r.min, r.max);
    }
    let began = std::time::Instant::now();
    let (min, max) = f.extremes();
    let scan_s = began.elapsed().as_secs_f64();
    tracing::debug!(
        "{}: tokens {min}..={max}, scanned in {scan_s:.2} s",
        f.path().display()
    );
    if let (Some(p), Some(k)) = (file, key) {
        if let Err(e) = cache::put(&p, &k, &Range { min, max, scan_s }) {
            tracing::debug!("{}'s token range not cached: {e:#}", f.path().display());
        }
    }
    (min, max)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A file's range is scanned once, then read from the cache (a planted answer is what comes back);
    /// a file rewritten since (its size and modification time) is scanned again; no folder: scanned.
    #[test]
    fn a_files_token_range_is_scanned_once_then_cached_until_the_file_changes() {
        let dir = tempfile::tempdir().unwrap();
        let (cache_dir, p) = (dir.path().join("cache"), dir.path().join("t.bin"));
        let write = |tokens: &[u16]| {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            std::fs::write(&p, bytes).unwrap();
            TokenFile::open_nanogpt(&p, false).unwrap()
        };
        let f = write(&[3, 9, 4]);
        let range = |f: &TokenFile| token_range_in(Some(&cache_dir), f);
        assert_eq!(range(&f), (3, 9));
        let key = range_key(&f).unwrap();
        let file = cache::file_of(&cache_dir, "token-range", &key);
        let planted = Range {
            min: 1,
            max: 2,
            scan_s: 0.0,
        };
        cache::put(&file, &key, &planted).unwrap();
        assert_eq!(range(&f), (1, 2), "read from the cache, not scanned");
        let f = write(&[3, 9, 4, 700]);
        assert_eq!(range(&f), (3, 700), "a changed file is scanned again");
        assert_eq!(token_range_in(None, &f), (3, 700));
        assert!(f.check_vocab(700, range(&f)).is_err());
    }
}

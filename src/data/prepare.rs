//! `nanodist prepare`: text, directories of text and JSONL into nanoGPT (and optionally Megatron) token
//! files plus `meta.json`. Documents stream through in chunks that are tokenized in parallel; output is
//! deterministic for a given seed and input order, whatever the thread count.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::format::{commit, tmp_path, write_atomic, Dtype, MegatronIndex};
use super::tokenizer::Tokenizer;
use crate::bad_input;

/// Which tokenizer `prepare` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TokenizerKind {
    /// GPT-2 BPE (tiktoken r50k_base).
    Gpt2,
    /// One token per character (tiny demos).
    Char,
}

/// Which files `prepare` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// train.bin / val.bin (uint16, EOT after each document).
    Nanogpt,
    /// train_text_document.{bin,idx} / val_text_document.{bin,idx}.
    Megatron,
    /// Both.
    Both,
}

#[derive(Debug, Clone)]
pub struct PrepareOptions {
    pub inputs: Vec<PathBuf>,
    pub output: PathBuf,
    pub tokenizer: TokenizerKind,
    pub val_fraction: f64,
    pub seed: u64,
    pub format: OutputFormat,
    pub json_key: String,
    pub threads: Option<usize>,
    pub progress: bool,
}

/// Token counts of one split.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SplitStats {
    pub tokens: u64,
    pub documents: u64,
}

/// `meta.json`: what a prepared directory holds and how it was made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    pub format: String,
    pub version: u32,
    pub tokenizer: Tokenizer,
    pub vocab_size: usize,
    pub eot: u32,
    pub dtype: String,
    pub train: SplitStats,
    pub val: SplitStats,
    /// "documents" (whole documents drawn into val with probability val_fraction) or "tokens" (too few
    /// documents: the last val_fraction of the token stream).
    pub split: String,
    pub val_fraction: f64,
    pub seed: u64,
    pub sources: Vec<String>,
    pub input_bytes: u64,
    pub files: Vec<String>,
}

impl Meta {
    pub fn read(dir: &Path) -> Result<Self> {
        let p = dir.join("meta.json");
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text)
            .map_err(|e| bad_input!("{}: not a nanodist meta.json: {e}", p.display()))
    }
}

/// What happened, for the console and benchmarks.
#[derive(Debug, Clone)]
pub struct PrepareReport {
    pub meta: Meta,
    pub seconds: f64,
}

impl PrepareReport {
    pub fn mb_per_s(&self) -> f64 {
        self.meta.input_bytes as f64 / 1e6 / self.seconds.max(1e-9)
    }
}

/// Every input file, directories expanded recursively in sorted order (hidden entries skipped).
pub fn list_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("listing {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                !p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
            })
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, out)?;
            } else {
                out.push(p);
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    for input in inputs {
        if input.is_dir() {
            walk(input, &mut out)?;
        } else if input.is_file() {
            out.push(input.clone());
        } else {
            return Err(bad_input!(
                "--input {}: no such file or directory",
                input.display()
            ));
        }
    }
    if out.is_empty() {
        return Err(bad_input!("no input files found in {:?}", inputs));
    }
    Ok(out)
}

/// The text field `key` of the JSON object on one line of a JSONL file (`at` names the line).
fn json_text(line: &str, key: &str, at: &str) -> Result<String> {
    let v: serde_json::Value =
        serde_json::from_str(line).map_err(|e| bad_input!("{at}: not a JSON object: {e}"))?;
    match v.get(key) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        other => Err(bad_input!(
            "{at}: expected a string field {key:?} (set it with --json-key), found {}",
            other.map_or("no such field".to_string(), |o| o
                .to_string()
                .chars()
                .take(40)
                .collect())
        )),
    }
}

/// Streams documents: a text file is one document, a `.jsonl` line is one (its `json_key` string), and
/// so is a parquet row (its `json_key` column).
struct Documents {
    files: std::vec::IntoIter<PathBuf>,
    json_key: String,
    current: Option<(PathBuf, usize, std::io::Lines<BufReader<File>>)>,
    #[cfg(feature = "parquet")]
    rows: Option<(PathBuf, usize, parquet::record::reader::RowIter<'static>)>,
}

impl Documents {
    fn new(files: Vec<PathBuf>, json_key: &str) -> Self {
        Self {
            files: files.into_iter(),
            json_key: json_key.to_string(),
            current: None,
            #[cfg(feature = "parquet")]
            rows: None,
        }
    }

    fn next_doc(&mut self) -> Result<Option<String>> {
        loop {
            #[cfg(feature = "parquet")]
            if let Some((path, row_no, rows)) = &mut self.rows {
                match rows.next() {
                    Some(row) => {
                        *row_no += 1;
                        let row =
                            row.map_err(|e| bad_input!("{}: row {row_no}: {e}", path.display()))?;
                        return parquet_text(&row, &self.json_key)
                            .map(Some)
                            .map_err(|m| bad_input!("{}: row {row_no}: {m}", path.display()));
                    }
                    None => self.rows = None,
                }
            }
            if let Some((path, line_no, lines)) = &mut self.current {
                match lines.next() {
                    Some(line) => {
                        *line_no += 1;
                        let line = line.with_context(|| format!("reading {}", path.display()))?;
                        if line.trim().is_empty() {
                            continue;
                        }
                        let at = format!("{}:{line_no}", path.display());
                        return json_text(&line, &self.json_key, &at).map(Some);
                    }
                    None => self.current = None,
                }
            }
            let Some(path) = self.files.next() else {
                return Ok(None);
            };
            if let Some(text) = self.open(path)? {
                return Ok(Some(text));
            }
        }
    }

    /// Starts reading `path`: JSONL and parquet files line by line or row by row (None: read on); any
    /// other file is one document, its whole text.
    fn open(&mut self, path: PathBuf) -> Result<Option<String>> {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        match ext {
            "jsonl" | "ndjson" => {
                let f = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
                self.current = Some((path, 0, BufReader::new(f).lines()));
                Ok(None)
            }
            #[cfg(feature = "parquet")]
            "parquet" => {
                let f = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
                let reader = parquet::file::reader::SerializedFileReader::new(f)
                    .map_err(|e| bad_input!("{}: not a parquet file: {e}", path.display()))?;
                self.rows = Some((path, 0, reader.into_iter()));
                Ok(None)
            }
            #[cfg(not(feature = "parquet"))]
            "parquet" => Err(bad_input!(
                "{}: this nanodist was built without the `parquet` feature; rebuild with \
                 `cargo build --release --features parquet`",
                path.display()
            )),
            _ => {
                let bytes =
                    std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
                let text = String::from_utf8(bytes).map_err(|e| {
                    bad_input!(
                        "{}: not UTF-8 text (invalid byte at offset {})",
                        path.display(),
                        e.utf8_error().valid_up_to()
                    )
                })?;
                Ok(Some(text))
            }
        }
    }

    /// The next chunk of documents, about `budget` bytes (at least one document).
    fn next_chunk(&mut self, budget: usize) -> Result<Vec<String>> {
        let mut chunk = Vec::new();
        let mut bytes = 0;
        while bytes < budget {
            match self.next_doc()? {
                Some(d) => {
                    bytes += d.len();
                    chunk.push(d);
                }
                None => break,
            }
        }
        Ok(chunk)
    }
}

/// The text of column `key` in a parquet row.
#[cfg(feature = "parquet")]
fn parquet_text(row: &parquet::record::Row, key: &str) -> std::result::Result<String, String> {
    use parquet::record::Field;
    let names: Vec<&String> = row.get_column_iter().map(|(n, _)| n).collect();
    match row.get_column_iter().find(|(n, _)| *n == key) {
        Some((_, Field::Str(s))) => Ok(s.clone()),
        Some((_, other)) => Err(format!("column {key:?} is not a string: {other}")),
        None => Err(format!(
            "no column {key:?} (set it with --json-key); columns: {names:?}"
        )),
    }
}

/// One output split being written.
struct SplitWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: BufWriter<File>,
    doc_lengths: Vec<u32>,
    stats: SplitStats,
}

impl SplitWriter {
    fn create(path: PathBuf) -> Result<Self> {
        let tmp = tmp_path(&path);
        // Read access too: a token split reads the tail back.
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        Ok(Self {
            path,
            tmp,
            out: BufWriter::with_capacity(1 << 20, f),
            doc_lengths: Vec::new(),
            stats: SplitStats::default(),
        })
    }

    fn push(&mut self, ids: &[u32]) -> Result<()> {
        let bytes: Vec<u8> = ids.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect();
        self.out.write_all(&bytes)?;
        self.doc_lengths.push(ids.len() as u32);
        self.stats.tokens += ids.len() as u64;
        self.stats.documents += 1;
        Ok(())
    }

    /// Flushes and syncs the temporary file; returns it opened for reading and writing.
    fn finish(self) -> Result<Split> {
        let file = self
            .out
            .into_inner()
            .map_err(|e| anyhow::anyhow!("flushing {}: {}", self.tmp.display(), e.error()))?;
        file.sync_all()?;
        Ok(Split {
            path: self.path,
            tmp: self.tmp,
            file,
            doc_lengths: self.doc_lengths,
            stats: self.stats,
        })
    }
}

/// A written split: its final path, the temporary file holding its tokens, each document's length.
struct Split {
    path: PathBuf,
    tmp: PathBuf,
    file: File,
    doc_lengths: Vec<u32>,
    stats: SplitStats,
}

/// Bytes of input tokenized at a time (in parallel).
const CHUNK_BYTES: usize = 8 << 20;

/// Tokenizes the inputs and writes the output directory.
pub fn prepare(opts: &PrepareOptions) -> Result<PrepareReport> {
    if !(0.0..1.0).contains(&opts.val_fraction) {
        return Err(bad_input!(
            "--val-fraction {}: expected a fraction in [0, 1)",
            opts.val_fraction
        ));
    }
    let files = list_files(&opts.inputs)?;
    let input_bytes: u64 = files
        .iter()
        .map(|f| f.metadata().map_or(0, |m| m.len()))
        .sum();
    std::fs::create_dir_all(&opts.output)
        .with_context(|| format!("creating {}", opts.output.display()))?;
    let start = Instant::now();
    let tokenizer = match opts.tokenizer {
        TokenizerKind::Gpt2 => Tokenizer::Gpt2,
        TokenizerKind::Char => char_vocabulary(&files, &opts.json_key)?,
    };
    if tokenizer.vocab_size() > u16::MAX as usize + 1 {
        return Err(bad_input!(
            "the {} tokenizer has {} tokens; uint16 token files hold at most 65536",
            tokenizer.name(),
            tokenizer.vocab_size()
        ));
    }
    let (mut train, mut val) = tokenize(opts, &files, &tokenizer, input_bytes)?;
    let mut split = "documents";
    if val.stats.documents == 0 && opts.val_fraction > 0.0 {
        split = "tokens";
        split_tokens(&mut train, &mut val, opts.val_fraction)?;
    }
    let (train_stats, val_stats) = (train.stats.clone(), val.stats.clone());
    let written = write_splits(opts, [train, val])?;
    let meta = Meta {
        format: "nanodist-tokens".into(),
        version: 1,
        vocab_size: tokenizer.vocab_size(),
        eot: tokenizer.eot(),
        tokenizer,
        dtype: "uint16".into(),
        train: train_stats,
        val: val_stats,
        split: split.into(),
        val_fraction: opts.val_fraction,
        seed: opts.seed,
        sources: opts
            .inputs
            .iter()
            .map(|p| p.display().to_string())
            .collect(),
        input_bytes,
        files: written,
    };
    write_atomic(
        &opts.output.join("meta.json"),
        (serde_json::to_string_pretty(&meta)? + "\n").as_bytes(),
    )?;
    Ok(PrepareReport {
        meta,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The character tokenizer of the corpus: every character it holds (one pass over the inputs).
fn char_vocabulary(files: &[PathBuf], json_key: &str) -> Result<Tokenizer> {
    let mut docs = Documents::new(files.to_vec(), json_key);
    let mut set = std::collections::BTreeSet::new();
    loop {
        let chunk = docs.next_chunk(CHUNK_BYTES)?;
        if chunk.is_empty() {
            break;
        }
        for d in &chunk {
            set.extend(d.chars());
        }
    }
    Ok(Tokenizer::Char {
        chars: set.into_iter().collect(),
    })
}

/// Every document tokenized (in parallel, chunk by chunk) into the train or the val split, by one seeded
/// draw per document in input order, so the split depends on neither threads nor chunking.
fn tokenize(
    opts: &PrepareOptions,
    files: &[PathBuf],
    tokenizer: &Tokenizer,
    input_bytes: u64,
) -> Result<(Split, Split)> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads.unwrap_or(0))
        .build()
        .context("building the tokenizer thread pool")?;
    let bar = progress_bar(opts.progress, input_bytes);
    let mut split_rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let mut train = SplitWriter::create(opts.output.join("train.bin"))?;
    let mut val = SplitWriter::create(opts.output.join("val.bin"))?;
    let mut docs = Documents::new(files.to_vec(), &opts.json_key);
    loop {
        let chunk = docs.next_chunk(CHUNK_BYTES)?;
        if chunk.is_empty() {
            break;
        }
        let encoded: Vec<Vec<u32>> = pool.install(|| {
            chunk
                .par_iter()
                .map(|d| tokenizer.encode_document(d))
                .collect::<Result<_>>()
        })?;
        for ids in &encoded {
            let to_val = split_rng.random::<f64>() < opts.val_fraction;
            if to_val { &mut val } else { &mut train }.push(ids)?;
        }
        bar.inc(chunk.iter().map(|d| d.len() as u64).sum());
    }
    bar.finish_and_clear();
    Ok((train.finish()?, val.finish()?))
}

/// Too few documents for a document split: the last `fraction` of the train token stream moves to val
/// (one document there; the cut shortens or drops the last documents of train).
fn split_tokens(train: &mut Split, val: &mut Split, fraction: f64) -> Result<()> {
    let n_val = ((train.stats.tokens as f64 * fraction).ceil() as u64).max(1);
    if n_val >= train.stats.tokens {
        return Err(bad_input!(
            "the inputs hold only {} tokens: too few to split into train and val",
            train.stats.tokens
        ));
    }
    let keep = train.stats.tokens - n_val;
    train.file.seek(SeekFrom::Start(keep * 2))?;
    let mut tail = Vec::new();
    train.file.read_to_end(&mut tail)?;
    val.file.write_all(&tail)?;
    val.file.sync_all()?;
    train.file.set_len(keep * 2)?;
    train.file.sync_all()?;
    let mut remaining = n_val;
    while remaining > 0 {
        let last = train.doc_lengths.last_mut().map_or(0, |l| *l as u64);
        if last <= remaining {
            train.doc_lengths.pop();
            remaining -= last;
        } else {
            if let Some(l) = train.doc_lengths.last_mut() {
                *l -= remaining as u32;
            }
            remaining = 0;
        }
    }
    val.doc_lengths = vec![n_val as u32];
    train.stats = SplitStats {
        tokens: keep,
        documents: train.doc_lengths.len() as u64,
    };
    val.stats = SplitStats {
        tokens: n_val,
        documents: 1,
    };
    Ok(())
}

/// Each split committed in the asked formats (nanoGPT's .bin, Megatron's .bin/.idx); the files written.
fn write_splits(opts: &PrepareOptions, splits: [Split; 2]) -> Result<Vec<String>> {
    let mut written = Vec::new();
    for Split {
        path,
        tmp,
        file,
        doc_lengths,
        ..
    } in splits
    {
        drop(file);
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        if matches!(opts.format, OutputFormat::Megatron | OutputFormat::Both) {
            // With EOT after each document the Megatron .bin is byte-identical to nanoGPT's file.
            let prefix = opts.output.join(format!("{stem}_text_document"));
            let bin = prefix.with_extension("bin");
            let bin_tmp = tmp_path(&bin);
            std::fs::copy(&tmp, &bin_tmp).with_context(|| format!("writing {}", bin.display()))?;
            File::open(&bin_tmp)?.sync_all()?;
            commit(&bin_tmp, &bin)?;
            let idx = prefix.with_extension("idx");
            write_atomic(
                &idx,
                &MegatronIndex::for_documents(Dtype::U16, &doc_lengths).to_bytes(),
            )?;
            written.push(bin.display().to_string());
            written.push(idx.display().to_string());
        }
        if matches!(opts.format, OutputFormat::Nanogpt | OutputFormat::Both) {
            commit(&tmp, &path)?;
            written.push(path.display().to_string());
        } else {
            std::fs::remove_file(&tmp)?;
        }
    }
    Ok(written)
}

fn progress_bar(enabled: bool, total: u64) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !enabled || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "tokenizing {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style);
    }
    bar
}

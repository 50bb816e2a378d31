//! Token file formats: nanoGPT's headerless uint16 `.bin` and Megatron-LM's indexed dataset
//! (`.bin` + `.idx`). Files are memory-mapped (or read into RAM) and validated before use: a corrupt or
//! truncated file is an error naming the file, never garbage tokens.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use memmap2::Mmap;
use rayon::prelude::*;

use crate::bad_input;

/// Element type of a token file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    U8,
    I8,
    I16,
    I32,
    I64,
    U16,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::U8 | Dtype::I8 => 1,
            Dtype::I16 | Dtype::U16 => 2,
            Dtype::I32 => 4,
            Dtype::I64 => 8,
        }
    }

    /// Megatron's dtype codes (`indexed_dataset.py`); float codes are not token types.
    fn from_megatron(code: u8) -> Option<Self> {
        Some(match code {
            1 => Dtype::U8,
            2 => Dtype::I8,
            3 => Dtype::I16,
            4 => Dtype::I32,
            5 => Dtype::I64,
            8 => Dtype::U16,
            _ => return None,
        })
    }

    fn megatron_code(self) -> u8 {
        match self {
            Dtype::U8 => 1,
            Dtype::I8 => 2,
            Dtype::I16 => 3,
            Dtype::I32 => 4,
            Dtype::I64 => 5,
            Dtype::U16 => 8,
        }
    }

    /// The smallest and largest of the little-endian elements in `bytes`.
    fn extremes(self, bytes: &[u8]) -> (i64, i64) {
        match self {
            Dtype::U8 => fold(bytes, u8::from_le_bytes, (u8::MAX, u8::MIN)),
            Dtype::I8 => fold(bytes, i8::from_le_bytes, (i8::MAX, i8::MIN)),
            Dtype::I16 => fold(bytes, i16::from_le_bytes, (i16::MAX, i16::MIN)),
            Dtype::U16 => fold(bytes, u16::from_le_bytes, (u16::MAX, u16::MIN)),
            Dtype::I32 => fold(bytes, i32::from_le_bytes, (i32::MAX, i32::MIN)),
            Dtype::I64 => fold(bytes, i64::from_le_bytes, (i64::MAX, i64::MIN)),
        }
    }

    /// Decodes element `i` of little-endian `bytes` (element by element: the data may be misaligned).
    #[inline]
    fn get(self, bytes: &[u8], i: usize) -> i64 {
        let s = self.size();
        let b = &bytes[i * s..(i + 1) * s];
        match self {
            Dtype::U8 => b[0] as i64,
            Dtype::I8 => b[0] as i8 as i64,
            Dtype::I16 => i16::from_le_bytes([b[0], b[1]]) as i64,
            Dtype::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
            Dtype::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            Dtype::I64 => i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
        }
    }
}

/// The smallest and largest of the `S`-byte elements of `bytes`, decoded by `get`, from `empty` (the
/// type's largest and smallest values): a loop the compiler vectorizes.
fn fold<const S: usize, T>(bytes: &[u8], get: fn([u8; S]) -> T, empty: (T, T)) -> (i64, i64)
where
    T: Ord + Copy + Into<i64>,
{
    let (lo, hi) = bytes
        .chunks_exact(S)
        .map(|c| get(c.try_into().expect("S bytes")))
        .fold(empty, |(lo, hi), t| (lo.min(t), hi.max(t)));
    (lo.into(), hi.into())
}

/// File bytes, mapped or owned.
enum Bytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn open(path: &Path, in_memory: bool) -> Result<Self> {
        if in_memory {
            return Ok(Bytes::Owned(
                std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
            ));
        }
        let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        if f.metadata()?.len() == 0 {
            return Ok(Bytes::Owned(Vec::new()));
        }
        // SAFETY: the mapping is read-only; token files are not modified while training reads them
        // (prepare writes to a temporary file and renames it into place).
        let m = unsafe { Mmap::map(&f) }.with_context(|| format!("mapping {}", path.display()))?;
        Ok(Bytes::Mapped(m))
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A flat stream of tokens: a nanoGPT file, or the `.bin` of a Megatron dataset (documents back to back).
pub struct TokenFile {
    path: PathBuf,
    bytes: Bytes,
    dtype: Dtype,
    len: usize,
    /// Document boundaries (token offsets, starting with 0 and ending with len) when the format has them.
    pub documents: Option<Vec<u64>>,
}

impl std::fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenFile({}, {} tokens)", self.path.display(), self.len)
    }
}

impl TokenFile {
    /// Opens a nanoGPT `.bin`: raw little-endian uint16, no header.
    pub fn open_nanogpt(path: &Path, in_memory: bool) -> Result<Self> {
        let bytes = Bytes::open(path, in_memory)?;
        let n = bytes.as_slice().len();
        if n % 2 != 0 {
            return Err(bad_input!(
                "{}: {n} bytes is an odd byte count; a nanoGPT token file holds uint16 tokens (truncated file?)",
                path.display()
            ));
        }
        Ok(Self {
            path: path.to_path_buf(),
            bytes,
            dtype: Dtype::U16,
            len: n / 2,
            documents: None,
        })
    }

    /// Opens a Megatron indexed dataset `<prefix>.bin` + `<prefix>.idx`, validating the index against the data.
    pub fn open_megatron(prefix: &Path, in_memory: bool) -> Result<Self> {
        let idx_path = with_ext(prefix, "idx");
        let bin_path = with_ext(prefix, "bin");
        let idx =
            std::fs::read(&idx_path).with_context(|| format!("reading {}", idx_path.display()))?;
        let index =
            MegatronIndex::parse(&idx).map_err(|m| bad_input!("{}: {m}", idx_path.display()))?;
        let bytes = Bytes::open(&bin_path, in_memory)?;
        let size = index.dtype.size() as u64;
        let total: u64 = index.lengths.iter().map(|&l| l as u64).sum();
        let bin_len = bytes.as_slice().len() as u64;
        if bin_len != total * size {
            return Err(bad_input!(
                "{}: {bin_len} bytes, but {} says {total} tokens of {size} byte(s) = {} bytes (truncated or mismatched pair?)",
                bin_path.display(),
                idx_path.display(),
                total * size
            ));
        }
        let mut bounds = Vec::with_capacity(index.doc_idx.len());
        let mut starts = Vec::with_capacity(index.lengths.len() + 1);
        let mut acc = 0u64;
        for (i, &l) in index.lengths.iter().enumerate() {
            if index.pointers[i] as u64 != acc * size {
                return Err(bad_input!(
                    "{}: sequence {i} starts at byte {} but the lengths before it end at byte {}",
                    idx_path.display(),
                    index.pointers[i],
                    acc * size
                ));
            }
            starts.push(acc);
            acc += l as u64;
        }
        starts.push(acc);
        for &d in &index.doc_idx {
            bounds.push(starts[d as usize]);
        }
        Ok(Self {
            path: bin_path,
            bytes,
            dtype: index.dtype,
            len: total as usize,
            documents: Some(bounds),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies tokens `[start, start + out.len())` into `out`.
    pub fn read(&self, start: usize, out: &mut [u32]) {
        let bytes = self.bytes.as_slice();
        if self.dtype == Dtype::U16 {
            let src = &bytes[start * 2..(start + out.len()) * 2];
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = u16::from_le_bytes([c[0], c[1]]) as u32;
            }
        } else {
            for (k, o) in out.iter_mut().enumerate() {
                *o = self.dtype.get(bytes, start + k) as u32;
            }
        }
    }

    /// The smallest and largest token (in parallel, a megabyte of tokens at a time).
    pub fn extremes(&self) -> (i64, i64) {
        let s = self.dtype.size();
        self.bytes.as_slice()[..self.len * s]
            .par_chunks((1 << 20) * s)
            .map(|c| self.dtype.extremes(c))
            .reduce(|| (i64::MAX, i64::MIN), |a, b| (a.0.min(b.0), a.1.max(b.1)))
    }

    /// Checks the tokens against the vocabulary, given their `extremes`; names the first bad position.
    pub fn check_vocab(&self, vocab_size: usize, (lo, hi): (i64, i64)) -> Result<()> {
        if self.len == 0 || (lo >= 0 && (hi as u64) < vocab_size as u64) {
            return Ok(());
        }
        let bytes = self.bytes.as_slice();
        const CHUNK: usize = 1 << 20;
        let bad = (0..self.len.div_ceil(CHUNK))
            .into_par_iter()
            .find_map_first(|c| {
                let end = ((c + 1) * CHUNK).min(self.len);
                (c * CHUNK..end).find_map(|i| {
                    let t = self.dtype.get(bytes, i);
                    (t < 0 || t as u64 >= vocab_size as u64).then_some((i, t))
                })
            });
        match bad {
            Some((i, t)) => Err(bad_input!(
                "{}: token {t} at position {i} is outside the model's vocabulary (model.vocab_size = {vocab_size})",
                self.path.display()
            )),
            None => Ok(()),
        }
    }
}

fn with_ext(prefix: &Path, ext: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(".");
    s.push(ext);
    PathBuf::from(s)
}

const MEGATRON_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";

/// The parsed `.idx` of a Megatron indexed dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct MegatronIndex {
    pub dtype: Dtype,
    pub lengths: Vec<i32>,
    pub pointers: Vec<i64>,
    pub doc_idx: Vec<i64>,
}

impl MegatronIndex {
    /// Parses and validates an index (layout in the project notes: header at 0..34, then the arrays).
    pub fn parse(b: &[u8]) -> std::result::Result<Self, String> {
        if b.starts_with(b"TNTIDX") {
            return Err(
                "legacy Megatron index format (TNTIDX) is not supported; re-run Megatron's \
                        preprocess_data.py to write the MMIDIDX format"
                    .into(),
            );
        }
        if b.len() < 34 || &b[..9] != MEGATRON_MAGIC {
            return Err(format!(
                "not a Megatron index: expected magic MMIDIDX\\x00\\x00 and a 34-byte header, found {} bytes starting {:?}",
                b.len(),
                String::from_utf8_lossy(&b[..b.len().min(9)])
            ));
        }
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
        let version = u64_at(9);
        if version != 1 {
            return Err(format!("index version {version}, only version 1 is known"));
        }
        let dtype = Dtype::from_megatron(b[17]).ok_or_else(|| {
            format!(
                "dtype code {} is not an integer token type (allowed: 1-5, 8)",
                b[17]
            )
        })?;
        let (s, d) = (u64_at(18), u64_at(26));
        let expected = 34u128 + 12 * s as u128 + 8 * d as u128;
        let actual = b.len() as u128;
        // Multimodal indexes append one mode byte per sequence.
        if actual != expected && actual != expected + s as u128 {
            return Err(format!(
                "{actual} bytes, but a header with {s} sequences and {d} doc_idx entries needs {expected} bytes (truncated?)"
            ));
        }
        let (s, d) = (s as usize, d as usize);
        let lengths: Vec<i32> = (0..s)
            .map(|i| i32::from_le_bytes(b[34 + 4 * i..38 + 4 * i].try_into().unwrap_or_default()))
            .collect();
        let p0 = 34 + 4 * s;
        let pointers: Vec<i64> = (0..s)
            .map(|i| {
                i64::from_le_bytes(b[p0 + 8 * i..p0 + 8 * i + 8].try_into().unwrap_or_default())
            })
            .collect();
        let d0 = p0 + 8 * s;
        let doc_idx: Vec<i64> = (0..d)
            .map(|i| {
                i64::from_le_bytes(b[d0 + 8 * i..d0 + 8 * i + 8].try_into().unwrap_or_default())
            })
            .collect();
        if let Some(i) = lengths.iter().position(|&l| l < 0) {
            return Err(format!("sequence {i} has negative length {}", lengths[i]));
        }
        if d == 0
            || doc_idx[0] != 0
            || doc_idx[d - 1] != s as i64
            || doc_idx.windows(2).any(|w| w[0] > w[1])
        {
            return Err(format!(
                "doc_idx must rise from 0 to the sequence count {s}; found {:?}..{:?}",
                doc_idx.first(),
                doc_idx.last()
            ));
        }
        Ok(Self {
            dtype,
            lengths,
            pointers,
            doc_idx,
        })
    }

    /// An index for one sequence per document, as `preprocess_data.py` writes it.
    pub fn for_documents(dtype: Dtype, doc_lengths: &[u32]) -> Self {
        let mut pointers = Vec::with_capacity(doc_lengths.len());
        let mut acc = 0i64;
        for &l in doc_lengths {
            pointers.push(acc);
            acc += l as i64 * dtype.size() as i64;
        }
        Self {
            dtype,
            lengths: doc_lengths.iter().map(|&l| l as i32).collect(),
            pointers,
            doc_idx: (0..=doc_lengths.len() as i64).collect(),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(34 + 12 * self.lengths.len() + 8 * self.doc_idx.len());
        b.extend_from_slice(MEGATRON_MAGIC);
        b.extend_from_slice(&1u64.to_le_bytes());
        b.push(self.dtype.megatron_code());
        b.extend_from_slice(&(self.lengths.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.doc_idx.len() as u64).to_le_bytes());
        self.lengths
            .iter()
            .for_each(|x| b.extend_from_slice(&x.to_le_bytes()));
        self.pointers
            .iter()
            .for_each(|x| b.extend_from_slice(&x.to_le_bytes()));
        self.doc_idx
            .iter()
            .for_each(|x| b.extend_from_slice(&x.to_le_bytes()));
        b
    }
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_path(path);
    {
        let mut f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(bytes)
            .with_context(|| format!("writing {}", tmp.display()))?;
        f.sync_all()?;
    }
    commit(&tmp, path)
}

/// The temporary name under which `path` is written before [`commit`].
pub fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".tmp{}", std::process::id()));
    PathBuf::from(s)
}

/// Renames a fully written temporary file into place and syncs the directory entry.
pub fn commit(tmp: &Path, path: &Path) -> Result<()> {
    std::fs::rename(tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized extremes of every token type equal the element-at-a-time decoding's, on bytes that
    /// hold each type's extreme values.
    #[test]
    fn extremes_are_the_element_at_a_time_minimum_and_maximum() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut bytes: Vec<u8> = (0..4099)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        bytes[8..16].copy_from_slice(&[0xff; 8]);
        bytes[24..32].copy_from_slice(&[0x7f, 0xff, 0x80, 0, 0x80, 0, 0, 0x80]);
        for dtype in [
            Dtype::U8,
            Dtype::I8,
            Dtype::I16,
            Dtype::U16,
            Dtype::I32,
            Dtype::I64,
        ] {
            for len in [0, 1, 7, 4099 / dtype.size()] {
                let b = &bytes[..len * dtype.size()];
                let want = (0..len)
                    .map(|i| dtype.get(b, i))
                    .fold((i64::MAX, i64::MIN), |(lo, hi), t| (lo.min(t), hi.max(t)));
                let want = if len == 0 { dtype.extremes(&[]) } else { want };
                assert_eq!(dtype.extremes(b), want, "{dtype:?}, {len} tokens");
            }
        }
    }

    #[test]
    fn megatron_index_round_trips() {
        let idx = MegatronIndex::for_documents(Dtype::U16, &[3, 1, 4]);
        let bytes = idx.to_bytes();
        assert_eq!(bytes.len(), 34 + 12 * 3 + 8 * 4);
        assert_eq!(MegatronIndex::parse(&bytes).unwrap(), idx);
    }

    #[test]
    fn corrupt_indexes_are_rejected_with_reasons() {
        let good = MegatronIndex::for_documents(Dtype::U16, &[3, 1, 4]).to_bytes();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"TNTIDX\x00\x00".to_vec(), "legacy"),
            (b"GARBAGE".to_vec(), "not a Megatron index"),
            (good[..good.len() - 3].to_vec(), "truncated"),
            (
                {
                    let mut b = good.clone();
                    b[9] = 2;
                    b
                },
                "version 2",
            ),
            (
                {
                    let mut b = good.clone();
                    b[17] = 7;
                    b
                },
                "dtype code 7",
            ),
            (
                {
                    let mut b = good.clone();
                    b[34] = 0xff;
                    b[37] = 0xff;
                    b
                },
                "negative length",
            ),
            (
                {
                    let mut b = good.clone();
                    let n = b.len();
                    b[n - 8] = 9;
                    b
                },
                "doc_idx",
            ),
        ];
        for (bytes, why) in cases {
            let err = MegatronIndex::parse(&bytes).unwrap_err();
            assert!(err.contains(why), "{why}: {err}");
        }
    }
}

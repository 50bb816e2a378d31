//! Checkpoints: `checkpoints/step_NNNNNNNN/` with the model in Hugging Face GPT-2 layout
//! (`model.safetensors` + `config.json`; the average of the replicas), one `rank_R.safetensors` per rank
//! (its parameters, optimizer buffers, and RNG position in the metadata), and `manifest.json`
//! (step, the resolved config, and the SHA-256 of every file). A checkpoint is written under a
//! temporary name, every file fsynced, then renamed into place: a crash leaves either the complete new
//! checkpoint or none, and the previous one intact. Loading verifies the checksums and falls back to the
//! previous checkpoint when the newest is damaged.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use safetensors::tensor::Dtype as StDtype;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::bad_input;
use crate::data::format::{commit, tmp_path};
use crate::flat::FlatRef;
use crate::model::gpt::is_conv1d;
use crate::model::Gpt;
use crate::optim::OptimState;

/// What a checkpoint is: step, counters, the resolved config, and the checksum of every file. The
/// per-rank state (parameters, optimizer buffers, dropout RNG position) is in `rank_R.safetensors`; the data
/// position is the step itself (see `data::sampler`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub step: u64,
    pub tokens: u64,
    pub world_size: usize,
    pub elapsed_s: f64,
    pub best_val_loss: Option<f64>,
    /// The resolved config TOML of the run that wrote it.
    pub config: String,
    /// The tokenizer of the training data (for `sample` and `eval` on raw text).
    #[serde(default)]
    pub tokenizer: Option<crate::data::Tokenizer>,
    /// SHA-256 of each file in the directory.
    pub files: BTreeMap<String, String>,
    /// The config of every segment of the run (a resume with `--allow-config-change` starts a new one).
    #[serde(default)]
    pub segments: Vec<ConfigSegment>,
    /// What the run decided from its machine (the CPU precision under `train.amp`): a resume keeps it.
    #[serde(default)]
    pub decisions: Option<crate::plan::Decisions>,
}

/// Part of a run trained under one config: from step `from_step` on, `config` (resolved TOML).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigSegment {
    pub from_step: u64,
    pub config: String,
}

/// The segments of a run that continues `before` (none: a new run) at `step` under `config`.
pub fn continue_segments(
    before: Option<&Manifest>,
    step: u64,
    config: &crate::config::Config,
) -> Vec<ConfigSegment> {
    let toml = config.to_toml();
    let mut segments = match before {
        Some(m) if m.segments.is_empty() => vec![ConfigSegment {
            from_step: 0,
            config: m.config.clone(),
        }],
        Some(m) => m.segments.clone(),
        None => Vec::new(),
    };
    if segments.last().is_none_or(|s| s.config != toml) {
        segments.push(ConfigSegment {
            from_step: step,
            config: toml,
        });
    }
    segments
}

impl Manifest {
    /// The manifest of a checkpoint of `config` at `progress` (file checksums are added by `save`).
    pub fn new(
        progress: &Progress,
        world_size: usize,
        config: &crate::config::Config,
        tokenizer: Option<crate::data::Tokenizer>,
        segments: Vec<ConfigSegment>,
        decisions: crate::plan::Decisions,
    ) -> Self {
        Self {
            format: "nanodist-checkpoint".into(),
            version: 1,
            step: progress.step,
            tokens: progress.tokens,
            world_size,
            elapsed_s: progress.elapsed_s,
            best_val_loss: progress.best_val_loss,
            config: config.to_toml(),
            tokenizer,
            files: Default::default(),
            segments,
            decisions: Some(decisions),
        }
    }
}

/// Where a run stands: the counters a checkpoint records and a resume restores.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Progress {
    pub step: u64,
    pub tokens: u64,
    /// Training seconds of every invocation before this one.
    pub elapsed_s: f64,
    pub best_val_loss: Option<f64>,
}

impl Progress {
    fn of(m: &Manifest) -> Self {
        Self {
            step: m.step,
            tokens: m.tokens,
            elapsed_s: m.elapsed_s,
            best_val_loss: m.best_val_loss,
        }
    }
}

/// One rank's share of a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct RankState {
    pub params: Vec<f32>,
    pub optimizer: OptimState,
    /// The sync backend's state (compressed reducers), tensors `reducer.<name>`.
    pub reducer: crate::sync::compress::State,
    pub meta: RankMeta,
}

/// One rank's share of a checkpoint as `write_rank` writes it: borrowed from the running worker, so that
/// a checkpoint holds no second copy of the parameters or the optimizer's buffers.
pub struct RankView<'a> {
    pub params: FlatRef<'a>,
    pub optimizer: crate::optim::OptimView<'a>,
    pub reducer: crate::sync::compress::State,
    pub meta: RankMeta,
}

impl<'a> RankView<'a> {
    /// Rank `rank`'s state: its parameters, optimizer and reducer state, the position of its dropout
    /// RNG and the training loss summed since the last metrics row.
    pub fn new(
        rank: usize,
        params: FlatRef<'a>,
        optimizer: crate::optim::OptimView<'a>,
        reducer: crate::sync::compress::State,
        dropout_word_pos: u128,
        loss_since_log: (f64, u64),
    ) -> Self {
        let meta = RankMeta {
            rank,
            dropout_word_pos: [(dropout_word_pos >> 64) as u64, dropout_word_pos as u64],
            loss_since_log,
            // The metadata's copy: name and step (the buffers are tensors of their own).
            optimizer: optimizer.header(),
            sim_clock: None,
        };
        Self {
            params,
            optimizer,
            reducer,
            meta,
        }
    }
}

/// The small part of a rank's state, stored as JSON in its safetensors metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankMeta {
    pub rank: usize,
    pub dropout_word_pos: [u64; 2],
    /// Training loss summed over the steps since the last metrics row, and their count: the next row's
    /// mean then covers the same steps whether or not the run stopped in between.
    #[serde(alias = "loss_window")]
    pub loss_since_log: (f64, u64),
    pub optimizer: OptimState,
    /// Worker 0 of a run with `[train.membership]`: every worker's simulated clock (`predict::clock`),
    /// as f64 bit patterns (JSON's decimals need not read back to the same bits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sim_clock: Option<Vec<u64>>,
}

impl RankMeta {
    /// The dropout RNG's word position.
    pub fn dropout_pos(&self) -> u128 {
        let [hi, lo] = self.dropout_word_pos;
        ((hi as u128) << 64) | lo as u128
    }
}

/// A checkpoint read back for one rank.
pub struct Restored {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub state: RankState,
}

impl Restored {
    pub fn progress(&self) -> Progress {
        Progress::of(&self.manifest)
    }
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a file, read in a stream (a checkpoint's files are as large as the model).
fn sha256_file(path: &Path) -> Result<(String, u64)> {
    let mut f = File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut h = Sha256::new();
    let n = std::io::copy(&mut f, &mut h).with_context(|| format!("reading {}", path.display()))?;
    Ok((hex(&h.finalize()), n))
}

/// A writer that hashes what it passes on: a file's SHA-256 as it is written, without reading it back.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A tensor's values as a file is written from them: borrowed in place, or made one tensor at a time.
enum Values<'a> {
    Slice(&'a [f32]),
    /// A row-major rows x cols matrix, written transposed (cols x rows).
    Transposed(&'a [f32], usize, usize),
    Zeros(usize),
}

impl Values<'_> {
    fn len(&self) -> usize {
        match self {
            Values::Slice(v) => v.len(),
            Values::Transposed(v, ..) => v.len(),
            Values::Zeros(n) => *n,
        }
    }

    /// The values, in `buf` where they have to be made.
    fn get<'b>(&'b self, buf: &'b mut Vec<f32>) -> &'b [f32] {
        match *self {
            Values::Slice(v) => v,
            Values::Transposed(v, rows, cols) => {
                buf.clear();
                buf.resize(v.len(), 0.0);
                for r in 0..rows {
                    for c in 0..cols {
                        buf[c * rows + r] = v[r * cols + c];
                    }
                }
                buf
            }
            Values::Zeros(n) => {
                buf.clear();
                buf.resize(n, 0.0);
                buf
            }
        }
    }
}

/// The model's weights in HF GPT-2 layout: Conv1D matrices transposed to [in, out], zero biases when the
/// model has none (HF GPT-2 always has them).
fn hf_tensors<'a>(model: &Gpt, flat: &'a [f32]) -> Vec<(String, Values<'a>, Vec<usize>)> {
    let mut out = Vec::new();
    for p in &model.params.params {
        let v = &flat[p.offset..p.offset + p.len];
        if is_conv1d(&p.name) {
            let (rows, cols) = (p.shape[0], p.shape[1]);
            out.push((
                p.name.clone(),
                Values::Transposed(v, rows, cols),
                vec![cols, rows],
            ));
        } else {
            out.push((p.name.clone(), Values::Slice(v), p.shape.clone()));
        }
        if !model.cfg.bias {
            if let Some(prefix) = p.name.strip_suffix(".weight") {
                if prefix.contains(".ln_") || prefix.ends_with("ln_f") || is_conv1d(&p.name) {
                    let n = if is_conv1d(&p.name) {
                        p.shape[0]
                    } else {
                        p.len
                    };
                    out.push((format!("{prefix}.bias"), Values::Zeros(n), vec![n]));
                }
            }
        }
    }
    out
}

/// Writes `tensors` (name, values, shape) as safetensors to `path` and fsyncs it, streaming from the
/// buffers (a tensor that has to be made, transposed or zero, is made alone); returns the file's SHA-256,
/// hashed as it is written. The header is written here
/// rather than by the safetensors crate, whose metadata map is a `HashMap` serialized in random order:
/// identical states must give identical files (checksums compare). Tensors are laid out in name order
/// (all f32, so this is the order the crate itself would use), and `meta` and the header's keys are
/// sorted; the crate reads the file back (`restore`, the tests).
fn write_safetensors(
    path: &Path,
    tensors: &[(String, Values, Vec<usize>)],
    meta: BTreeMap<String, String>,
) -> Result<String> {
    let mut order: Vec<&(String, Values, Vec<usize>)> = tensors.iter().collect();
    order.sort_by(|a, b| a.0.cmp(&b.0));
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::to_value(&meta)?);
    let mut offset = 0usize;
    for (name, data, shape) in &order {
        let end = offset + 4 * data.len();
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    // serde_json's map is ordered by key (no `preserve_order`), so the header text is deterministic.
    let mut text = serde_json::to_vec(&serde_json::Value::Object(header))?;
    // The data starts 8-byte aligned: pad the header with spaces, as the format allows.
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let write = || -> std::io::Result<String> {
        let mut f = std::io::BufWriter::new(Hashing {
            inner: File::create(path)?,
            hash: Sha256::new(),
        });
        f.write_all(&(text.len() as u64).to_le_bytes())?;
        f.write_all(&text)?;
        let mut buf = Vec::new();
        for (_, values, _) in &order {
            let data = values.get(&mut buf);
            if cfg!(target_endian = "little") {
                f.write_all(bytemuck::cast_slice(data))?;
            } else {
                for x in data.iter() {
                    f.write_all(&x.to_le_bytes())?;
                }
            }
        }
        let Hashing { inner, hash } = f.into_inner().map_err(|e| e.into_error())?;
        inner.sync_all()?;
        Ok(hex(&hash.finalize()))
    };
    write().with_context(|| format!("writing {}", path.display()))
}

/// The model's weights in HF layout, written to `path` (not atomically; see `save_weights`); returns the
/// file's SHA-256.
fn write_hf_weights(path: &Path, model: &Gpt, flat: &[f32], step: u64) -> Result<String> {
    let meta = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("step".to_string(), step.to_string()),
    ]);
    write_safetensors(path, &hf_tensors(model, flat), meta)
}

/// HF `config.json` for the model.
fn hf_config(model: &Gpt) -> serde_json::Value {
    let c = &model.cfg;
    serde_json::json!({
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_embd": c.n_embd,
        "n_layer": c.n_layers,
        "n_head": c.n_heads,
        "n_positions": model.context_length,
        "n_ctx": model.context_length,
        "vocab_size": c.vocab_size,
        "layer_norm_epsilon": 1e-5,
        "activation_function": match c.activation {
            crate::config::Activation::Gelu => "gelu",
            crate::config::Activation::GeluTanh => "gelu_new",
        },
        "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
        "tie_word_embeddings": true,
    })
}

/// Writes one rank's state file of a checkpoint; returns its SHA-256.
pub fn write_rank(path: &Path, state: &RankView) -> Result<String> {
    // Host buffers are written in place; GPU buffers through a host copy.
    let params = state.params.to_host()?;
    let optim = state
        .optimizer
        .buffers
        .iter()
        .map(|&(n, b)| Ok((n, b.to_host()?)))
        .collect::<Result<Vec<_>>>()?;
    let mut tensors = vec![(
        "params".to_string(),
        Values::Slice(&params),
        vec![params.len()],
    )];
    for (n, b) in &optim {
        tensors.push((format!("optim.{n}"), Values::Slice(b), vec![b.len()]));
    }
    for (n, b) in &state.reducer {
        tensors.push((format!("reducer.{n}"), Values::Slice(b), vec![b.len()]));
    }
    let st_meta = BTreeMap::from([("nanodist".to_string(), serde_json::to_string(&state.meta)?)]);
    write_safetensors(path, &tensors, st_meta)
}

/// Writes the model alone (best_model.safetensors), atomically.
pub fn save_weights(path: &Path, model: &Gpt, flat: &[f32], step: u64) -> Result<()> {
    let tmp = tmp_path(path);
    write_hf_weights(&tmp, model, flat, step)?;
    commit(&tmp, path)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    Ok(())
}

/// Saves a checkpoint into `ckpt_dir/step_NNNNNNNN`, keeping only the newest `keep`. Every rank calls it
/// at the same step: each writes its own `rank_R.safetensors` (`write_rank` with the backend and the
/// file's path, returning the file's SHA-256; see `write_rank`), so that a rank's copy of its state exists
/// only while it writes it, and leaves the checksum beside it; rank 0 then writes the model (`avg`: the
/// replicas' average, in HF layout), writes the manifest with every file's checksum and renames the
/// directory into place. Returns the directory.
pub fn save(
    sync: &mut dyn crate::sync::SyncBackend,
    ckpt_dir: &Path,
    model: &Gpt,
    write_rank: impl FnOnce(&dyn crate::sync::SyncBackend, &Path) -> Result<String>,
    avg: &[f32],
    mut manifest: Manifest,
    keep: usize,
) -> Result<PathBuf> {
    // Files by the worker's place in the whole world: a worker away (`train.membership`) has none.
    let (rank, root) = (sync.comm().id(), sync.rank() == 0);
    let name = format!("step_{:08}", manifest.step);
    let dest = ckpt_dir.join(&name);
    let tmp = ckpt_dir.join(format!(".{name}.tmp"));
    if root {
        std::fs::create_dir_all(ckpt_dir)
            .with_context(|| format!("creating {}", ckpt_dir.display()))?;
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)?; // left by a save that was killed
        }
        std::fs::create_dir_all(&tmp)?;
    }
    sync.barrier()?;
    let sum = write_rank(&*sync, &tmp.join(format!("rank_{rank}.safetensors")))?;
    // The checksum travels to rank 0 beside the file (hashed as it was written: rank 0 reads no rank's
    // file back, which on a shared filesystem would move every rank's state through one node).
    let side = tmp.join(format!("rank_{rank}.sha256"));
    std::fs::write(&side, sum).with_context(|| format!("writing {}", side.display()))?;
    sync.barrier()?;
    if root {
        let sum = write_hf_weights(&tmp.join("model.safetensors"), model, avg, manifest.step)?;
        manifest.files.insert("model.safetensors".into(), sum);
        let config = serde_json::to_vec_pretty(&hf_config(model))?;
        write_synced(&tmp.join("config.json"), &config)?;
        manifest
            .files
            .insert("config.json".into(), hex(&Sha256::digest(&config)));
        for r in sync.comm().ids() {
            manifest
                .files
                .insert(format!("rank_{r}.safetensors"), take_checksum(&tmp, r)?);
        }
        write_synced(
            &tmp.join("manifest.json"),
            &serde_json::to_vec_pretty(&manifest)?,
        )?;
        if let Ok(d) = File::open(&tmp) {
            let _ = d.sync_all();
        }
        if dest.exists() {
            std::fs::remove_dir_all(&dest)?; // an earlier save of this very step
        }
        commit(&tmp, &dest)?;
        for old in list(ckpt_dir).into_iter().skip(keep.max(1)) {
            let _ = std::fs::remove_dir_all(old);
        }
    }
    sync.barrier()?;
    Ok(dest)
}

/// Rank `r`'s checksum, left beside its file in the checkpoint being written (`save`), read and removed.
fn take_checksum(tmp: &Path, r: usize) -> Result<String> {
    let side = tmp.join(format!("rank_{r}.sha256"));
    let sum =
        std::fs::read_to_string(&side).with_context(|| format!("reading {}", side.display()))?;
    ensure!(
        sum.len() == 64 && sum.bytes().all(|b| b.is_ascii_hexdigit()),
        "{}: not a SHA-256 checksum",
        side.display()
    );
    std::fs::remove_file(&side).with_context(|| format!("removing {}", side.display()))?;
    Ok(sum)
}

/// Checkpoint directories under `ckpt_dir`, newest first.
pub fn list(ckpt_dir: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<(u64, PathBuf)> = std::fs::read_dir(ckpt_dir)
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let p = e.ok()?.path();
            let step = p
                .file_name()?
                .to_str()?
                .strip_prefix("step_")?
                .parse()
                .ok()?;
            p.is_dir().then_some((step, p))
        })
        .collect();
    dirs.sort_by_key(|d| std::cmp::Reverse(d.0));
    dirs.into_iter().map(|(_, p)| p).collect()
}

/// Reads and checks every file's checksum; returns the manifest.
pub fn verify(dir: &Path) -> Result<Manifest> {
    let manifest = read_manifest(dir)?;
    for (file, want) in &manifest.files {
        let p = dir.join(file);
        let (got, len) = sha256_file(&p)?;
        if &got != want {
            return Err(bad_input!(
                "{}: checksum mismatch ({len} bytes; sha256 {got}, manifest says {want}): truncated or corrupt",
                p.display()
            ));
        }
    }
    Ok(manifest)
}

/// Reads a checkpoint's manifest (without checking the files: see `verify`).
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let mpath = dir.join("manifest.json");
    let text = std::fs::read(&mpath).with_context(|| format!("reading {}", mpath.display()))?;
    let manifest: Manifest = serde_json::from_slice(&text)
        .map_err(|e| bad_input!("{}: not a nanodist manifest: {e}", mpath.display()))?;
    if manifest.format != "nanodist-checkpoint" || manifest.version != 1 {
        return Err(bad_input!(
            "{}: unknown checkpoint format {} v{}",
            mpath.display(),
            manifest.format,
            manifest.version
        ));
    }
    Ok(manifest)
}

/// Reads HF GPT-2 layout weights (`model.safetensors`, `best_model.safetensors`) into the model's
/// flat order, checking names, dtypes and shapes against the model; also the step they were saved at,
/// from the file's metadata (when it says).
pub fn read_hf_weights(path: &Path, model: &Gpt) -> Result<(Vec<f32>, Option<u64>)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let step = safetensors::SafeTensors::read_metadata(&bytes)
        .ok()
        .and_then(|(_, h)| h.metadata().as_ref()?.get("step")?.parse().ok());
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad_input!("{}: {e}", path.display()))?;
    let mut flat = vec![0.0f32; model.params.numel];
    for p in &model.params.params {
        let t = st.tensor(&p.name).map_err(|_| {
            bad_input!(
                "{} has no tensor {} (a different architecture?)",
                path.display(),
                p.name
            )
        })?;
        let want: Vec<usize> = if is_conv1d(&p.name) {
            vec![p.shape[1], p.shape[0]]
        } else {
            p.shape.clone()
        };
        if t.dtype() != StDtype::F32 || t.shape() != want.as_slice() {
            return Err(bad_input!(
                "{}: {} is {:?} {:?}, the config's model needs F32 {want:?}",
                path.display(),
                p.name,
                t.dtype(),
                t.shape()
            ));
        }
        let v = bytes_f32(t.data());
        let dst = &mut flat[p.offset..p.offset + p.len];
        if is_conv1d(&p.name) {
            let (rows, cols) = (p.shape[0], p.shape[1]);
            for r in 0..rows {
                for c in 0..cols {
                    dst[r * cols + c] = v[c * rows + r];
                }
            }
        } else {
            dst.copy_from_slice(&v);
        }
    }
    Ok((flat, step))
}

/// Reads rank `rank`'s state from a checkpoint written by the same world size (verified by the
/// preflight's `find_latest` / `require`; the rank file is read whole, so its own structure is checked).
pub fn restore(dir: &Path, model: &Gpt, rank: usize, world: usize) -> Result<Restored> {
    let manifest = read_manifest(dir)?;
    if manifest.world_size != world {
        return Err(bad_input!(
            "{}: written by {} rank(s), this run has {world}; an exact resume needs the same world size \
             (to start from its weights instead, set checkpoint = \"{}\" and checkpoint_mode = \"weights\" in a new run)",
            dir.display(),
            manifest.world_size,
            dir.display()
        ));
    }
    let path = dir.join(format!("rank_{rank}.safetensors"));
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| bad_input!("{}: {e}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad_input!("{}: {e}", path.display()))?;
    let meta: RankMeta = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get("nanodist"))
        .and_then(|j| serde_json::from_str(j).ok())
        .ok_or_else(|| bad_input!("{}: no nanodist rank metadata", path.display()))?;
    let params = bytes_f32(
        st.tensor("params")
            .map_err(|e| bad_input!("{}: {e}", path.display()))?
            .data(),
    );
    if params.len() != model.params.numel {
        return Err(bad_input!(
            "{}: {} parameters, the config's model has {}",
            path.display(),
            params.len(),
            model.params.numel
        ));
    }
    let mut optimizer = meta.optimizer.clone();
    optimizer.buffers = st
        .tensors()
        .into_iter()
        .filter_map(|(n, t)| Some((n.strip_prefix("optim.")?.to_string(), bytes_f32(t.data()))))
        .collect();
    let reducer = st
        .tensors()
        .into_iter()
        .filter_map(|(n, t)| Some((n.strip_prefix("reducer.")?.to_string(), bytes_f32(t.data()))))
        .collect();
    Ok(Restored {
        dir: dir.to_path_buf(),
        manifest,
        state: RankState {
            params,
            optimizer,
            reducer,
            meta,
        },
    })
}

/// The checkpoint to start from: `path` may be a checkpoint directory, a run directory, or a
/// `checkpoints/` directory; damaged checkpoints are skipped (with a warning) for the previous one.
pub fn find_latest(path: &Path) -> Result<Option<PathBuf>> {
    if path.join("manifest.json").is_file() {
        verify(path)?;
        return Ok(Some(path.to_path_buf()));
    }
    let dir = if path.join("checkpoints").is_dir() {
        path.join("checkpoints")
    } else {
        path.to_path_buf()
    };
    for cand in list(&dir) {
        match verify(&cand) {
            Ok(_) => return Ok(Some(cand)),
            Err(e) => tracing::warn!("skipping damaged checkpoint {}: {e:#}", cand.display()),
        }
    }
    Ok(None)
}

/// Checks that `path` names something a checkpoint can be read from; where it does not, says what is
/// there instead (the checkpoints beside a missing one, the runs in a log directory).
pub fn require(path: &Path) -> Result<PathBuf> {
    if !path.exists() {
        bail!(crate::error::BadInput(format!(
            "checkpoint {}: no such file or directory{}",
            path.display(),
            checkpoints_beside(path)
        )));
    }
    find_latest(path)?.ok_or_else(|| {
        bad_input!(
            "{}: no valid checkpoint found there{}",
            path.display(),
            runs_hint(path)
        )
    })
}

/// The checkpoints in the directory of a missing `path`, oldest first ("" when there are none).
fn checkpoints_beside(path: &Path) -> String {
    let Some(parent) = path.parent() else {
        return String::new();
    };
    let names: Vec<String> = list(parent)
        .iter()
        .rev()
        .filter_map(|p| Some(p.file_name()?.to_string_lossy().into_owned()))
        .collect();
    match names.is_empty() {
        true => String::new(),
        false => format!(
            "; {} holds {} (or give the run directory for its newest)",
            parent.display(),
            names.join(", ")
        ),
    }
}

/// The run directories in `dir` (those with checkpoints or metrics), by name.
pub fn runs_in(dir: &Path) -> Vec<String> {
    let mut runs: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let p = e.ok()?.path();
            let run = p.join("checkpoints").is_dir() || p.join("metrics.jsonl").is_file();
            run.then(|| p.file_name().map(|n| n.to_string_lossy().into_owned()))?
        })
        .collect();
    runs.sort();
    runs
}

/// For a directory of runs (a `log_dir`): "name one", with the runs it holds ("" for anything else).
pub fn runs_hint(dir: &Path) -> String {
    let runs = runs_in(dir);
    match runs.first() {
        None => String::new(),
        Some(first) => format!(
            "; it is a directory of runs: name one, e.g. {} (runs there: {})",
            dir.join(first).display(),
            runs.join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same tensors and metadata give the same bytes (the safetensors crate's metadata map is a
    /// HashMap: its order changes from one map to the next), and the crate reads them back.
    #[test]
    fn safetensors_files_are_deterministic_and_readable() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (vec![1.0f32, -2.5, 3.25], vec![0.5f32; 7]);
        let tensors = vec![
            ("zeta".to_string(), Values::Slice(&a), vec![3]),
            ("alpha".to_string(), Values::Slice(&b), vec![7]),
        ];
        let meta: BTreeMap<String, String> = (0..12)
            .map(|i| (format!("key{i}"), format!("value {i}")))
            .collect();
        let paths = [
            dir.path().join("1.safetensors"),
            dir.path().join("2.safetensors"),
        ];
        for p in &paths {
            let sum = write_safetensors(p, &tensors, meta.clone()).unwrap();
            assert_eq!(
                sum,
                sha256_file(p).unwrap().0,
                "the checksum of the bytes written"
            );
        }
        let bytes = std::fs::read(&paths[0]).unwrap();
        assert_eq!(bytes, std::fs::read(&paths[1]).unwrap());
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!((8 + header_len) % 8, 0, "data starts 8-byte aligned");
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let got = header.metadata().clone().unwrap();
        assert_eq!(got.len(), 12);
        assert!(meta.iter().all(|(k, v)| got.get(k) == Some(v)));
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(bytes_f32(st.tensor("zeta").unwrap().data()), a);
        assert_eq!(bytes_f32(st.tensor("alpha").unwrap().data()), b);
        assert_eq!(st.tensor("alpha").unwrap().shape(), &[7]);
    }
}

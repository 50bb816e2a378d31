//! Weights & Biases without a Rust SDK: W&B's own offline run directory, written record by record, which
//! `wandb sync DIR` uploads later (compute nodes without internet) and `wandb beta sync --live DIR`
//! streams while it grows. Format (checked against wandb 0.17 to 0.31): a LevelDB-style log of 32 KiB
//! blocks holding CRC-32-framed chunks, each whole record one `wandb_internal.Record` protobuf.
//! Sequence: run (with the resolved config), one history record per logged step followed by a summary
//! of the latest values, and always an exit record (on drop without `finish`, exit code 1).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use prost::Message;

const BLOCK: usize = 32 * 1024;
const HEADER: usize = 7;
const FULL: u8 = 1;
const FIRST: u8 = 2;
const MIDDLE: u8 = 3;
const LAST: u8 = 4;

/// The `.wandb` file: a 7-byte header, then records framed into blocks.
pub struct Store<W: Write> {
    out: W,
    /// Bytes used in the current block.
    used: usize,
}

impl<W: Write> Store<W> {
    pub fn new(mut out: W) -> Result<Self> {
        out.write_all(b":W&B")?;
        out.write_all(&0xBEE1u16.to_le_bytes())?;
        out.write_all(&[0])?;
        Ok(Self { out, used: 7 })
    }

    /// Appends one record: chunks never cross a block end; a block with fewer than 7 bytes left is
    /// zero-filled; big records are split FIRST, MIDDLE..., LAST.
    pub fn append(&mut self, data: &[u8]) -> Result<()> {
        let mut left = data;
        let mut first = true;
        loop {
            let space = BLOCK - self.used;
            if space < HEADER {
                self.out.write_all(&[0u8; HEADER][..space])?;
                self.used = 0;
                continue;
            }
            let n = left.len().min(space - HEADER);
            let end = n == left.len();
            let kind = match (first, end) {
                (true, true) => FULL,
                (true, false) => FIRST,
                (false, true) => LAST,
                (false, false) => MIDDLE,
            };
            let mut crc = crc32fast::Hasher::new();
            crc.update(&[kind]);
            crc.update(&left[..n]);
            self.out.write_all(&crc.finalize().to_le_bytes())?;
            self.out.write_all(&(n as u16).to_le_bytes())?;
            self.out.write_all(&[kind])?;
            self.out.write_all(&left[..n])?;
            self.used += HEADER + n;
            left = &left[n..];
            first = false;
            if end {
                return Ok(());
            }
        }
    }

    pub fn flush(&mut self) -> Result<()> {
        Ok(self.out.flush()?)
    }

    pub fn into_inner(self) -> W {
        self.out
    }
}

// The subset of wandb_internal.proto that an offline run needs (field numbers as in wandb v4..v7).

#[derive(Clone, PartialEq, Message)]
pub struct Record {
    #[prost(int64, tag = "1")]
    pub num: i64,
    #[prost(oneof = "RecordType", tags = "2, 3, 5, 17, 18, 20")]
    pub record_type: Option<RecordType>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum RecordType {
    #[prost(message, tag = "2")]
    History(HistoryRecord),
    #[prost(message, tag = "3")]
    Summary(SummaryRecord),
    #[prost(message, tag = "5")]
    Config(ConfigRecord),
    #[prost(message, tag = "17")]
    Run(RunRecord),
    #[prost(message, tag = "18")]
    Exit(RunExitRecord),
    #[prost(message, tag = "20")]
    Final(FinalRecord),
}

#[derive(Clone, PartialEq, Message)]
pub struct RunRecord {
    #[prost(string, tag = "1")]
    pub run_id: String,
    #[prost(string, tag = "2")]
    pub entity: String,
    #[prost(string, tag = "3")]
    pub project: String,
    #[prost(message, optional, tag = "4")]
    pub config: Option<ConfigRecord>,
    #[prost(string, tag = "6")]
    pub run_group: String,
    #[prost(string, tag = "7")]
    pub job_type: String,
    #[prost(string, tag = "8")]
    pub display_name: String,
    #[prost(string, tag = "9")]
    pub notes: String,
    #[prost(string, repeated, tag = "10")]
    pub tags: Vec<String>,
    #[prost(message, optional, tag = "17")]
    pub start_time: Option<Timestamp>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Timestamp {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

#[derive(Clone, PartialEq, Message)]
pub struct Item {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "16")]
    pub value_json: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct ConfigRecord {
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<Item>,
}

#[derive(Clone, PartialEq, Message)]
pub struct HistoryStep {
    #[prost(int64, tag = "1")]
    pub num: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct HistoryRecord {
    #[prost(message, repeated, tag = "1")]
    pub item: Vec<Item>,
    #[prost(message, optional, tag = "2")]
    pub step: Option<HistoryStep>,
}

#[derive(Clone, PartialEq, Message)]
pub struct SummaryRecord {
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<Item>,
}

#[derive(Clone, PartialEq, Message)]
pub struct RunExitRecord {
    #[prost(int32, tag = "1")]
    pub exit_code: i32,
    #[prost(int32, tag = "2")]
    pub runtime: i32,
}

#[derive(Clone, PartialEq, Message)]
pub struct FinalRecord {}

/// How a run is logged, from `[log]` and the W&B environment variables.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub mode: Mode,
    pub project: String,
    pub entity: String,
    pub name: String,
    pub group: String,
    pub tags: Vec<String>,
    /// Parent of the `wandb/` directory.
    pub dir: PathBuf,
    pub run_id: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Offline,
    Online,
    Disabled,
}

impl Settings {
    /// `[log]` keys, overridden by WANDB_MODE, WANDB_DIR, WANDB_PROJECT, WANDB_ENTITY, WANDB_RUN_ID,
    /// WANDB_NAME, WANDB_RUN_GROUP, WANDB_TAGS (comma-separated), as the Python SDK reads them.
    pub fn resolve(log: &crate::config::log::LogConfig, run_dir: &Path) -> Result<Self> {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        use crate::config::log::WandbMode;
        let mode = match env("WANDB_MODE").as_deref() {
            None => match log.wandb_mode {
                WandbMode::Offline => Mode::Offline,
                WandbMode::Online => Mode::Online,
                WandbMode::Disabled => Mode::Disabled,
            },
            Some("offline" | "dryrun") => Mode::Offline,
            Some("online" | "run") => Mode::Online,
            Some("disabled") => Mode::Disabled,
            Some(other) => {
                return Err(crate::bad_input!(
                    "WANDB_MODE={other:?}: expected \"offline\", \"online\" or \"disabled\""
                ))
            }
        };
        Ok(Self {
            mode,
            project: env("WANDB_PROJECT").unwrap_or_else(|| log.wandb_project.clone()),
            entity: env("WANDB_ENTITY")
                .or_else(|| log.wandb_entity.clone())
                .unwrap_or_default(),
            name: env("WANDB_NAME")
                .or_else(|| log.wandb_run_name.clone())
                .unwrap_or_else(|| {
                    run_dir
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default()
                }),
            group: env("WANDB_RUN_GROUP")
                .or_else(|| log.wandb_group.clone())
                .unwrap_or_default(),
            tags: env("WANDB_TAGS")
                .map(|t| {
                    t.split(',')
                        .map(|s| s.trim().to_string())
                        .filter(|s| !s.is_empty())
                        .collect()
                })
                .unwrap_or_else(|| log.wandb_tags.clone()),
            dir: env("WANDB_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| run_dir.to_path_buf()),
            run_id: env("WANDB_RUN_ID"),
        })
    }
}

/// An open offline run.
pub struct Run {
    store: Option<Store<BufWriter<File>>>,
    pub dir: PathBuf,
    pub run_id: String,
    num: i64,
    started: Instant,
    summary: BTreeMap<String, String>,
    live: Option<std::process::Child>,
}

/// 8 characters of [a-z0-9], as W&B's run ids.
fn new_run_id() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..8)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// JSON text for W&B: non-finite numbers as NaN / Infinity / -Infinity.
fn value_json(v: &serde_json::Value) -> String {
    v.to_string()
}

fn number_json(x: f64) -> String {
    if x.is_nan() {
        "NaN".into()
    } else if x.is_infinite() {
        if x > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else {
        serde_json::Value::from(x).to_string()
    }
}

impl Run {
    /// Starts (or, when `run_dir` remembers a run id, continues) the run: writes the run record with
    /// the config. The run id is kept in `run_dir/wandb-run-id` so that a resumed job logs to the same run.
    pub fn start(s: &Settings, run_dir: &Path, config: &serde_json::Value) -> Result<Option<Self>> {
        if s.mode == Mode::Disabled {
            return Ok(None);
        }
        let id_file = run_dir.join("wandb-run-id");
        let run_id = match (&s.run_id, std::fs::read_to_string(&id_file)) {
            (Some(id), _) => id.clone(),
            (None, Ok(id)) if !id.trim().is_empty() => id.trim().to_string(),
            _ => new_run_id(),
        };
        crate::data::format::write_atomic(&id_file, run_id.as_bytes())?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        // offline-run-YYYYMMDD_HHMMSS-<id>; a resumed segment started in the same second takes the next one.
        let name = |t: SystemTime| {
            let stamp = humantime::format_rfc3339_seconds(t).to_string();
            let ymd: String = stamp[..19]
                .chars()
                .filter(|c| c.is_ascii_digit() || *c == 'T')
                .collect();
            format!("offline-run-{}-{run_id}", ymd.replace('T', "_"))
        };
        let base = s.dir.join("wandb");
        let mut t = SystemTime::now();
        while base.join(name(t)).exists() {
            t += std::time::Duration::from_secs(1);
        }
        let dir = base.join(name(t));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(format!("run-{run_id}.wandb"));
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut run = Self {
            store: Some(Store::new(BufWriter::new(file))?),
            dir,
            run_id: run_id.clone(),
            num: 0,
            started: Instant::now(),
            summary: BTreeMap::new(),
            live: None,
        };
        let items = match config {
            serde_json::Value::Object(m) => m
                .iter()
                .map(|(k, v)| Item {
                    key: k.clone(),
                    value_json: value_json(v),
                })
                .collect(),
            _ => Vec::new(),
        };
        run.write(RecordType::Run(RunRecord {
            run_id,
            entity: s.entity.clone(),
            project: s.project.clone(),
            config: Some(ConfigRecord { update: items }),
            run_group: s.group.clone(),
            job_type: "train".into(),
            display_name: s.name.clone(),
            notes: String::new(),
            tags: s.tags.clone(),
            start_time: Some(Timestamp {
                seconds: now.as_secs() as i64,
                nanos: now.subsec_nanos() as i32,
            }),
        }))?;
        if s.mode == Mode::Online {
            run.live = spawn_live_sync(&run.dir);
        }
        Ok(Some(run))
    }

    fn write(&mut self, r: RecordType) -> Result<()> {
        self.num += 1;
        let rec = Record {
            num: self.num,
            record_type: Some(r),
        };
        if let Some(store) = self.store.as_mut() {
            store.append(&rec.encode_to_vec())?;
            store.flush()?;
        }
        Ok(())
    }

    /// One history record for `step` with every number of `row` (plus _step, _timestamp, _runtime),
    /// then a summary record with the latest value of every metric.
    pub fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let mut items: Vec<Item> = vec![
            Item {
                key: "_step".into(),
                value_json: step.to_string(),
            },
            Item {
                key: "_timestamp".into(),
                value_json: number_json(now),
            },
            Item {
                key: "_runtime".into(),
                value_json: number_json(self.started.elapsed().as_secs_f64()),
            },
        ];
        for (k, v) in metrics {
            let j = number_json(*v);
            self.summary.insert(k.clone(), j.clone());
            items.push(Item {
                key: k.clone(),
                value_json: j,
            });
        }
        self.summary.insert("_step".into(), step.to_string());
        self.write(RecordType::History(HistoryRecord {
            item: items,
            step: Some(HistoryStep { num: step as i64 }),
        }))?;
        let update = self
            .summary
            .iter()
            .map(|(k, v)| Item {
                key: k.clone(),
                value_json: v.clone(),
            })
            .collect();
        self.write(RecordType::Summary(SummaryRecord { update }))
    }

    /// The exit record (and the final record); says how the run reached W&B: streamed (the live sync
    /// exited successfully), or written offline with the command that uploads it.
    pub fn finish(mut self, exit_code: i32) -> Result<()> {
        self.close(exit_code)?;
        let upload = format!("upload it with: wandb sync {}", self.dir.display());
        match self.live.take().map(|mut c| c.wait()) {
            Some(Ok(status)) if status.success() => tracing::info!(
                "wandb: run {} streamed by `wandb beta sync --live`",
                self.run_id
            ),
            Some(Ok(status)) => tracing::warn!(
                "wandb: the live sync (`wandb beta sync --live`) failed ({status}); the run is written offline, {upload}"
            ),
            Some(Err(e)) => tracing::warn!(
                "wandb: could not wait for the live sync ({e}); the run is written offline, {upload}"
            ),
            None => tracing::info!("wandb: offline run written; {upload}"),
        }
        Ok(())
    }

    fn close(&mut self, exit_code: i32) -> Result<()> {
        if self.store.is_none() {
            return Ok(());
        }
        let runtime = self.started.elapsed().as_secs() as i32;
        self.write(RecordType::Exit(RunExitRecord { exit_code, runtime }))?;
        self.write(RecordType::Final(FinalRecord {}))?;
        if let Some(store) = self.store.take() {
            let file = store
                .into_inner()
                .into_inner()
                .map_err(|e| e.into_error())?;
            file.sync_all()?;
        }
        Ok(())
    }
}

impl Drop for Run {
    /// A run dropped without `finish` ended by an error or a panic: record exit code 1.
    fn drop(&mut self) {
        let _ = self.close(1);
        if let Some(mut child) = self.live.take() {
            let _ = child.wait();
        }
    }
}

/// `wandb beta sync --live DIR` in the background, when the wandb CLI is installed and its `beta sync`
/// has `--live` (asked with a dry call to its help: wandb 0.22 has `beta sync` without it); otherwise the
/// run is written offline and `finish` prints how to upload it.
fn spawn_live_sync(dir: &Path) -> Option<std::process::Child> {
    let help = std::process::Command::new("wandb")
        .args(["beta", "sync", "--help"])
        .output();
    let why = match help {
        Err(_) => "the wandb CLI is not on PATH (pip install wandb)".to_string(),
        Ok(out) if !String::from_utf8_lossy(&out.stdout).contains("--live") => format!(
            "this wandb CLI's `beta sync` has no --live option ({}; wandb >= 0.23 streams)",
            if out.status.success() {
                "its help does not list it".to_string()
            } else {
                format!("`wandb beta sync --help` failed: {}", out.status)
            }
        ),
        Ok(_) => {
            match std::process::Command::new("wandb")
                .args(["beta", "sync", "--live"])
                .arg(dir)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
            {
                Ok(child) => return Some(child),
                Err(e) => format!("`wandb beta sync --live` did not start: {e}"),
            }
        }
    };
    tracing::warn!("wandb: mode online, but {why}; writing the run offline");
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads the framing back: (records, chunk types) and checks every CRC.
    fn read(bytes: &[u8]) -> Vec<Vec<u8>> {
        assert_eq!(&bytes[..7], b":W&B\xe1\xbe\x00");
        let (mut pos, mut out, mut cur) = (7usize, Vec::new(), Vec::new());
        while pos < bytes.len() {
            let left = BLOCK - pos % BLOCK;
            if left < HEADER {
                assert!(bytes[pos..pos + left].iter().all(|&b| b == 0));
                pos += left;
                continue;
            }
            let crc = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap());
            let len = u16::from_le_bytes([bytes[pos + 4], bytes[pos + 5]]) as usize;
            let kind = bytes[pos + 6];
            let data = &bytes[pos + 7..pos + 7 + len];
            assert!(
                pos % BLOCK + 7 + len <= BLOCK,
                "a chunk crosses a block end"
            );
            let mut h = crc32fast::Hasher::new();
            h.update(&[kind]);
            h.update(data);
            assert_eq!(h.finalize(), crc);
            cur.extend_from_slice(data);
            if kind == FULL || kind == LAST {
                out.push(std::mem::take(&mut cur));
            }
            pos += 7 + len;
        }
        out
    }

    #[test]
    fn crc_check_value() {
        assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn framing_at_every_block_remainder_and_across_blocks() {
        // Fill so that 0..=8 bytes remain in the first block, then write a small and a huge record.
        for remainder in 0..=8usize {
            let mut s = Store::new(Vec::new()).unwrap();
            let first = BLOCK - 7 - HEADER - remainder;
            let a = vec![1u8; first];
            let b: Vec<u8> = (0..100).map(|i| i as u8).collect();
            let c: Vec<u8> = (0..3 * BLOCK + 5).map(|i| (i * 7) as u8).collect();
            for r in [&a, &b, &c] {
                s.append(r).unwrap();
            }
            let bytes = s.into_inner();
            assert_eq!(read(&bytes), vec![a, b, c], "remainder {remainder}");
        }
    }

    #[test]
    fn run_records_decode() {
        let d = tempfile::tempdir().unwrap();
        let s = Settings {
            mode: Mode::Offline,
            project: "p".into(),
            entity: String::new(),
            name: "n".into(),
            group: String::new(),
            tags: vec!["t".into()],
            dir: d.path().into(),
            run_id: Some("abcd1234".into()),
        };
        let mut run = Run::start(&s, d.path(), &serde_json::json!({"train": {"seed": 1}}))
            .unwrap()
            .unwrap();
        run.log(10, &[("loss".into(), 2.5), ("bad".into(), f64::NAN)])
            .unwrap();
        let dir = run.dir.clone();
        run.finish(0).unwrap();
        let bytes = std::fs::read(dir.join("run-abcd1234.wandb")).unwrap();
        let recs: Vec<Record> = read(&bytes)
            .iter()
            .map(|b| Record::decode(&b[..]).unwrap())
            .collect();
        assert!(matches!(&recs[0].record_type, Some(RecordType::Run(r)) if r.run_id == "abcd1234"));
        let Some(RecordType::History(h)) = &recs[1].record_type else {
            panic!("history")
        };
        assert!(h
            .item
            .iter()
            .any(|i| i.key == "bad" && i.value_json == "NaN"));
        assert!(matches!(&recs[3].record_type, Some(RecordType::Exit(e)) if e.exit_code == 0));
        assert!(dir
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("offline-run-"));
    }
}

//! TensorBoard scalars as TFRecord event files in `<run>/tb/`: each record is u64le length, masked
//! CRC-32C of the length, the serialized `Event`, masked CRC-32C of the data. The first event carries
//! the file version; each scalar is an `Event{wall_time, step, summary{value{tag, simple_value}}}`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use prost::Message;

#[derive(Clone, PartialEq, Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    pub what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Value {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, tag = "2")]
    pub simple_value: f32,
}

/// The TensorBoard tag of a metrics row's key, grouped as its dashboard shows them: `val/...` (evaluation),
/// `comm/...` (what the synchronisation sent, how long it took, and what it did to the replicas or the
/// gradient) and `train/...` (the rest): `val_loss` -> `val/loss`, `comm_bytes` -> `comm/bytes`,
/// `consensus_distance` -> `comm/consensus_distance`, `train_loss` -> `train/loss`.
pub fn tag(key: &str) -> String {
    const COMM: [&str; 9] = [
        "sync_ms",
        "consensus_distance",
        "pseudo_grad_norm",
        "outer_lr",
        "compression_ratio",
        "compression_error",
        "topk_overlap",
        "compressed_fraction",
        "consensus_step",
    ];
    if let Some(rest) = key.strip_prefix("val_") {
        format!("val/{rest}")
    } else if key == "eval_train_loss" {
        "val/train_loss".into()
    } else if let Some(rest) = key.strip_prefix("comm_") {
        format!("comm/{rest}")
    } else if COMM.contains(&key) {
        format!("comm/{key}")
    } else {
        format!("train/{}", key.strip_prefix("train_").unwrap_or(key))
    }
}

/// TFRecord's masked CRC-32C.
pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xA282_EAD8)
}

pub struct EventWriter {
    out: BufWriter<File>,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

impl EventWriter {
    /// A new event file in `dir` (TensorBoard reads every file of the directory, so a resumed run adds one).
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
        // events.out.tfevents.<seconds>.<host>.<pid>[.<n>]: never reuse a file of an earlier segment.
        let stem = format!(
            "events.out.tfevents.{}.{host}.{}",
            now() as u64,
            std::process::id()
        );
        let mut path = dir.join(&stem);
        let mut n = 1;
        while path.exists() {
            path = dir.join(format!("{stem}.{n}"));
            n += 1;
        }
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = Self {
            out: BufWriter::new(file),
        };
        w.record(&Event {
            wall_time: now(),
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        })?;
        Ok(w)
    }

    fn record(&mut self, e: &Event) -> Result<()> {
        let data = e.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(&data)?;
        self.out.write_all(&masked_crc(&data).to_le_bytes())?;
        Ok(())
    }

    /// One event with all `scalars` of `step`; flushed so that a live TensorBoard sees it.
    pub fn scalars(&mut self, step: u64, scalars: &[(String, f64)]) -> Result<()> {
        let value = scalars
            .iter()
            .map(|(tag, v)| Value {
                tag: tag.clone(),
                simple_value: *v as f32,
            })
            .collect();
        self.record(&Event {
            wall_time: now(),
            step: step as i64,
            what: Some(What::Summary(Summary { value })),
        })?;
        Ok(self.out.flush()?)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn crc32c_check_value() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }
}

//! CHOCO's tuned consensus step (`consensus_step = "auto"`), cached on disk: tuning simulates the whole
//! world's consensus (seconds at hundreds of ranks), and its answer depends only on the rounds, the
//! compressor, the seed and the tuning's own version, kept in nanodist's cache folder (`data::cache`).
//! Without a cache folder, or when it cannot be written, every run tunes.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::data::cache;
use crate::sync::choco::{tune_gamma, Compressor, TUNE_ITERS, TUNING_VERSION};
use crate::sync::topology::Round;

#[derive(Serialize, Deserialize)]
struct Entry {
    /// For reading; `bits` is the value (JSON's decimal does not round-trip every f64 here).
    gamma: f64,
    bits: u64,
    /// Seconds the tuning took when it ran.
    tuning_s: f64,
}

/// What identifies a tuning's answer: everything it reads.
fn key(rounds: &[Round], compressor: Compressor, seed: u64) -> String {
    let world: usize = rounds
        .first()
        .map_or(0, |r| r.iter().map(|g| g.ranks.len()).sum());
    let shape = Sha256::digest(format!("{rounds:?}").as_bytes());
    let hex: String = shape[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "tuning v{TUNING_VERSION}, {TUNE_ITERS} iterations; {world} ranks, {} rounds {hex}; \
         {compressor:?}; seed {seed}",
        rounds.len()
    )
}

fn file_of(dir: &Path, key: &str) -> PathBuf {
    cache::file_of(dir, "choco-gamma", key)
}

fn read(path: &Path, key: &str) -> Option<Entry> {
    cache::get::<Entry>(path, key)
        .map(|e| Entry {
            gamma: f64::from_bits(e.bits),
            ..e
        })
        .filter(|e| e.gamma.is_finite() && e.gamma > 0.0)
}

/// The tuned gamma for `rounds` and `compressor`: from the cache, else tuned (and cached).
pub fn tuned(rounds: &[Round], compressor: Compressor, seed: u64) -> Result<f64> {
    tuned_in(cache::dir().as_deref(), rounds, compressor, seed)
}

/// `tuned` with the cache in `dir` (none: tuned every time).
fn tuned_in(
    dir: Option<&Path>,
    rounds: &[Round],
    compressor: Compressor,
    seed: u64,
) -> Result<f64> {
    let key = key(rounds, compressor, seed);
    let path = dir.map(|d| file_of(d, &key));
    if let Some(e) = path.as_deref().and_then(|p| read(p, &key)) {
        tracing::debug!(
            "consensus step {:.4} from the cache (tuned in {:.1} s)",
            e.gamma,
            e.tuning_s
        );
        return Ok(e.gamma);
    }
    let began = Instant::now();
    let gamma = tune_gamma(rounds, compressor, seed)?;
    let tuning_s = began.elapsed().as_secs_f64();
    let Some(path) = path else {
        return Ok(gamma);
    };
    let entry = Entry {
        gamma,
        bits: gamma.to_bits(),
        tuning_s,
    };
    let written = cache::put(&path, &key, &entry);
    match written {
        Ok(()) => tracing::info!(
            "consensus step {gamma:.4} tuned in {tuning_s:.1} s, cached in {}",
            path.display()
        ),
        Err(e) => {
            tracing::warn!("consensus step {gamma:.4} tuned in {tuning_s:.1} s; not cached ({e:#})")
        }
    }
    Ok(gamma)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Topology;
    use crate::sync::topology;

    #[test]
    fn keys_differ_in_every_input_they_name() {
        let ring = topology::rounds(Topology::Ring, 8, 8).unwrap();
        let exp = topology::rounds(Topology::Exp, 8, 8).unwrap();
        let c = Compressor::TopK { density: 0.05 };
        let base = key(&ring, c, 3);
        assert_ne!(base, key(&exp, c, 3));
        assert_ne!(
            base,
            key(&topology::rounds(Topology::Ring, 16, 16).unwrap(), c, 3)
        );
        assert_ne!(base, key(&ring, Compressor::TopK { density: 0.1 }, 3));
        assert_ne!(base, key(&ring, Compressor::Sign, 3));
        assert_ne!(base, key(&ring, c, 4));
        assert_eq!(base, key(&ring.clone(), c, 3));
    }

    #[test]
    fn an_answer_is_cached_read_back_and_tuned_again_when_damaged_or_foreign() {
        let dir = tempfile::tempdir().unwrap();
        let rounds = topology::rounds(Topology::Ring, 8, 8).unwrap();
        let c = Compressor::TopK { density: 0.05 };
        let (key, file) = (key(&rounds, c, 3), file_of(dir.path(), &key(&rounds, c, 3)));
        let tuned = || tuned_in(Some(dir.path()), &rounds, c, 3).unwrap();
        let want = tune_gamma(&rounds, c, 3).unwrap();
        assert_eq!(tuned(), want);
        assert_eq!(read(&file, &key).map(|e| e.gamma), Some(want));
        // A planted answer is what the cache returns (it is read, not tuned again).
        let planted = |key: &str, gamma: f64| {
            let e = Entry {
                gamma,
                bits: gamma.to_bits(),
                tuning_s: 0.0,
            };
            cache::put(&file, key, &e).unwrap();
        };
        planted(&key, 0.123);
        assert_eq!(tuned(), 0.123);
        std::fs::write(&file, b"{ not json").unwrap();
        assert_eq!(tuned(), want);
        planted("another key", 0.5);
        assert_eq!(tuned(), want);
        planted(&key, f64::NAN);
        assert_eq!(tuned(), want);
        assert_eq!(read(&file, &key).map(|e| e.gamma), Some(want));
        // No directory: tuned, nothing written.
        assert_eq!(tuned_in(None, &rounds, c, 3).unwrap(), want);
    }
}

//! nanodist's cache folder: answers that take seconds to compute and depend only on what their key names
//! (a data file's token range, CHOCO's tuned consensus step, the CPU's bf16 rate). The folder is
//! `$NANODIST_CACHE_DIR`, else `$XDG_CACHE_HOME/nanodist`, else `~/.cache/nanodist`. One small JSON file
//! per answer, named by a hash of its key and holding the key itself: a file that is missing, unreadable
//! or of another key is computed again and rewritten (atomically: the ranks of a job may write it at
//! once). A cache that cannot be written is only a cache: the answer is computed every time.

use std::path::{Path, PathBuf};

use anyhow::Result;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The cache folder (see the module's doc), if any.
pub fn dir() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("NANODIST_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("nanodist")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("nanodist")))
}

/// The file of the answer to `key` under `dir`, in the subfolder `kind`.
pub fn file_of(dir: &Path, kind: &str, key: &str) -> PathBuf {
    let h = Sha256::digest(key.as_bytes());
    let hex: String = h[..8].iter().map(|b| format!("{b:02x}")).collect();
    dir.join(kind).join(format!("{hex}.json"))
}

#[derive(Serialize, Deserialize)]
struct Entry<T> {
    key: String,
    #[serde(flatten)]
    value: T,
}

/// The answer to `key` stored in `file`, when the file holds one for this key.
pub fn get<T: DeserializeOwned>(file: &Path, key: &str) -> Option<T> {
    let text = std::fs::read_to_string(file).ok()?;
    serde_json::from_str::<Entry<T>>(&text)
        .ok()
        .filter(|e| e.key == key)
        .map(|e| e.value)
}

/// Stores `value` as the answer to `key` in `file` (atomically), making its folder.
pub fn put<T: Serialize>(file: &Path, key: &str, value: &T) -> Result<()> {
    std::fs::create_dir_all(file.parent().unwrap_or(Path::new(".")))?;
    let entry = Entry {
        key: key.to_string(),
        value,
    };
    super::format::write_atomic(file, &serde_json::to_vec_pretty(&entry)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Answer {
        x: u64,
    }

    #[test]
    fn an_answer_is_read_back_only_under_its_own_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = file_of(dir.path(), "kind", "k1");
        assert_ne!(file, file_of(dir.path(), "kind", "k2"));
        assert_eq!(get::<Answer>(&file, "k1"), None, "nothing stored yet");
        put(&file, "k1", &Answer { x: 7 }).unwrap();
        assert_eq!(get::<Answer>(&file, "k1"), Some(Answer { x: 7 }));
        assert_eq!(get::<Answer>(&file, "k2"), None, "another key");
        std::fs::write(&file, b"{ not json").unwrap();
        assert_eq!(get::<Answer>(&file, "k1"), None, "damaged");
    }
}

//! The run directory's lock: one training job at a time writes a run directory. Rank 0 of a job holds
//! `<run dir>/train.lock` for the whole run, by two means:
//! - an exclusive `flock` on the file: the kernel (or the NFS lock manager) holds it while the process
//!   lives and drops it when the process dies, so a second job on the same host (or on a shared file
//!   system with working locks) is refused, and a dead holder's lock is free;
//! - the file names the holder (host, PID, Slurm job, since when) and its modification time is a
//!   heartbeat, touched every `HEARTBEAT`: where a file system does not enforce locks across nodes (a
//!   Slurm requeue racing a job that still runs on another node), a holder on another host whose
//!   heartbeat is younger than `STALE` still holds the directory.
//!
//! A lock left by a process that is gone (same host: no such PID, or its flock released; another host:
//! heartbeat older than `STALE`) is taken over with a warning. The file is removed when the run ends.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::bad_input;

/// How often the holder touches the lock file.
pub const HEARTBEAT: Duration = Duration::from_secs(10);
/// A holder on another host whose heartbeat is older than this is gone.
pub const STALE: Duration = Duration::from_secs(60);

/// Who holds a run directory (the lock file's contents).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Holder {
    pub host: String,
    pub pid: u32,
    /// Seconds since the Unix epoch when it took the lock.
    pub since: u64,
    /// Its Slurm job, if any.
    pub job: Option<String>,
}

impl Holder {
    fn me() -> Self {
        Holder {
            host: host_name(),
            pid: std::process::id(),
            since: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            job: std::env::var("SLURM_JOB_ID").ok(),
        }
    }

    fn describe(&self) -> String {
        let since = SystemTime::UNIX_EPOCH + Duration::from_secs(self.since);
        format!(
            "PID {} on host {}{} since {}",
            self.pid,
            self.host,
            self.job
                .as_ref()
                .map_or(String::new(), |j| format!(" (Slurm job {j})")),
            humantime::format_rfc3339_seconds(since)
        )
    }
}

/// This machine's host name (the kernel's, as `hostname` prints it).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "unknown-host".into())
}

/// The held lock; dropping it stops the heartbeat and removes the file.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
    file: File,
    stop: Arc<AtomicBool>,
    heartbeat: Option<std::thread::JoinHandle<()>>,
}

impl RunLock {
    /// Takes `run_dir`'s lock (creating the directory), or says who holds it (bad input: exit 2).
    pub fn acquire(run_dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(run_dir)
            .with_context(|| format!("creating {}", run_dir.display()))?;
        let path = run_dir.join("train.lock");
        // The file may be removed between our open and our lock by the holder's end; then retry once.
        for _ in 0..3 {
            if let Some(lock) = Self::try_acquire(&path)? {
                return Ok(lock);
            }
        }
        anyhow::bail!(
            "{}: the lock file kept changing under this process",
            path.display()
        )
    }

    fn try_acquire(path: &Path) -> Result<Option<Self>> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        let mut text = String::new();
        let _ = file.read_to_string(&mut text);
        let holder: Option<Holder> = serde_json::from_str(&text).ok();
        let locked = match file.try_lock() {
            Ok(()) => true,
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(in_use(path, holder.as_ref(), "it holds the lock"));
            }
            // A file system without locks: the holder's PID and heartbeat decide alone.
            Err(std::fs::TryLockError::Error(e)) => {
                tracing::warn!(
                    "{}: this file system does not lock files ({e}); the holder's PID and heartbeat decide",
                    path.display()
                );
                false
            }
        };
        if !same_file(path, &file) {
            return Ok(None);
        }
        let age = file
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .unwrap_or_default();
        if let Some(h) = holder.as_ref().filter(|h| h.pid != std::process::id()) {
            let here = h.host == host_name();
            let alive = if here {
                !locked && Path::new(&format!("/proc/{}", h.pid)).exists()
            } else {
                age < STALE
            };
            if alive {
                let why = match here {
                    true => "its process is running".to_string(),
                    false => format!("its heartbeat is {} s old", age.as_secs()),
                };
                return Err(in_use(path, Some(h), &why));
            }
            tracing::warn!(
                "{}: taking over the lock of {}, which is gone ({})",
                path.display(),
                h.describe(),
                match here {
                    true => "no such process holds it on this host".to_string(),
                    false => format!("no heartbeat for {} s", age.as_secs()),
                }
            );
        }
        let me = Holder::me();
        file.set_len(0)?;
        file.rewind()?;
        file.write_all(serde_json::to_string(&me)?.as_bytes())?;
        file.sync_all()?;
        let stop = Arc::new(AtomicBool::new(false));
        let heartbeat = Some(beat(file.try_clone()?, Arc::clone(&stop)));
        Ok(Some(RunLock {
            path: path.to_path_buf(),
            file,
            stop,
            heartbeat,
        }))
    }
}

/// Touches the lock file's modification time every `HEARTBEAT` until `stop`.
fn beat(file: File, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let tick = Duration::from_millis(200);
        let mut since = std::time::Instant::now();
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(tick);
            if since.elapsed() >= HEARTBEAT {
                let _ = file.set_modified(SystemTime::now());
                since = std::time::Instant::now();
            }
        }
    })
}

/// Whether `path` still names the open `file` (the same inode).
fn same_file(path: &Path, file: &File) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(path), file.metadata()) {
        (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
        _ => false,
    }
}

fn in_use(path: &Path, holder: Option<&Holder>, why: &str) -> anyhow::Error {
    let dir = path.parent().unwrap_or(path);
    bad_input!(
        "the run directory {} is in use by {} ({why}; {}): wait for it to end, stop it, or train into \
         another directory (`train --fresh`, or another log.run_name)",
        dir.display(),
        holder.map_or("another process".into(), Holder::describe),
        path.display()
    )
}

impl Drop for RunLock {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.heartbeat.take() {
            let _ = h.join();
        }
        // Removed while still locked: a process that opened the old file sees it is gone and retries.
        let _ = std::fs::remove_file(&self.path);
        let _ = self.file.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_holder(dir: &Path, h: &Holder, age: Duration) {
        let path = dir.join("train.lock");
        std::fs::write(&path, serde_json::to_string(h).unwrap()).unwrap();
        let f = File::options().write(true).open(&path).unwrap();
        f.set_modified(SystemTime::now() - age).unwrap();
    }

    #[test]
    fn a_held_directory_is_refused_naming_its_holder_and_freed_at_drop() {
        let d = tempfile::tempdir().unwrap();
        let lock = RunLock::acquire(d.path()).unwrap();
        let err = RunLock::acquire(d.path()).unwrap_err().to_string();
        let me = format!("PID {} on host {}", std::process::id(), host_name());
        assert!(
            err.contains(&me) && err.contains("it holds the lock"),
            "{err}"
        );
        assert!(crate::error::exit_code(&RunLock::acquire(d.path()).unwrap_err()) == 2);
        drop(lock);
        assert!(!d.path().join("train.lock").exists());
        RunLock::acquire(d.path()).unwrap();
    }

    #[test]
    fn a_dead_holder_is_taken_over_and_a_live_one_elsewhere_is_not() {
        let d = tempfile::tempdir().unwrap();
        // A process of this host that is gone (no flock, no such PID).
        let dead = Holder {
            host: host_name(),
            pid: u32::MAX - 1,
            since: 0,
            job: None,
        };
        write_holder(d.path(), &dead, Duration::ZERO);
        drop(RunLock::acquire(d.path()).unwrap());
        // Another host with a fresh heartbeat holds it; with a stale one it is gone.
        let other = Holder {
            host: "node-elsewhere".into(),
            pid: 4242,
            since: 1_700_000_000,
            job: Some("77".into()),
        };
        write_holder(d.path(), &other, Duration::from_secs(5));
        let err = RunLock::acquire(d.path()).unwrap_err().to_string();
        assert!(
            err.contains(
                "PID 4242 on host node-elsewhere (Slurm job 77) since 2023-11-14T22:13:20Z"
            ) && err.contains("heartbeat is 5 s old"),
            "{err}"
        );
        write_holder(d.path(), &other, STALE + Duration::from_secs(1));
        let lock = RunLock::acquire(d.path()).unwrap();
        let text = std::fs::read_to_string(d.path().join("train.lock")).unwrap();
        let now: Holder = serde_json::from_str(&text).unwrap();
        assert_eq!((now.pid, now.host), (std::process::id(), host_name()));
        drop(lock);
    }
}

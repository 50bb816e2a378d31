//! When this process started, for "from the command to the first step" (`startup_s` in the metrics).

use std::sync::OnceLock;
use std::time::{Duration, Instant};

static START: OnceLock<Instant> = OnceLock::new();

/// Marks now as the process's start; `main` calls it first. Later calls keep the first mark.
pub fn mark_process_start() {
    START.get_or_init(Instant::now);
}

/// Time since `mark_process_start` (a library caller that never marked: since the first call here).
pub fn since_process_start() -> Duration {
    START.get_or_init(Instant::now).elapsed()
}

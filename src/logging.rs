//! The one path for diagnostics: a `tracing` subscriber writing timestamped lines to stderr (batch logs
//! get times), level from `NANODIST_LOG`, else `RUST_LOG`, else info for nanodist and warnings for the
//! libraries. Results (plans, tables, the training log's lines) go to stdout, not through here.

use tracing_subscriber::EnvFilter;

/// Installs the subscriber once per process (later calls do nothing).
pub fn init() {
    let filter = ["NANODIST_LOG", "RUST_LOG"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.trim().is_empty()))
        .unwrap_or_else(|| "warn,nanodist=info".into());
    let filter = EnvFilter::try_new(&filter).unwrap_or_else(|e| {
        eprintln!("NANODIST_LOG / RUST_LOG {filter:?}: {e}; using the default levels");
        EnvFilter::new("warn,nanodist=info")
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(false)
        .try_init();
}

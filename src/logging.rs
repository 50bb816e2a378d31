//! The one path for diagnostics: a `tracing` subscriber writing timestamped lines to stderr (batch logs
//! get times) in the training log's format, level from `NANODIST_LOG`, else `RUST_LOG`, else info for nanodist and warnings for the
//! libraries. Results (plans, tables, the training log's lines) go to stdout, not through here.

use std::fmt;

use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// One line format for every console line: the decentralized GPT-2 runner's `[HH:MM:SS  INFO] `, which
/// the training log's own lines use too (`train::console`).
struct RunnerFormat;

impl<S, N> FormatEvent<S, N> for RunnerFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let now = chrono::Local::now().format("%H:%M:%S");
        write!(writer, "[{now} {:>5}] ", event.metadata().level())?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

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
        .with_ansi(false)
        .event_format(RunnerFormat)
        .try_init();
}

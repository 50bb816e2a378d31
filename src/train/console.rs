//! What a run shows while it trains: the console (a progress bar on a terminal, plain lines in batch
//! logs) and the counters of each metrics row.

use std::io::IsTerminal;
use std::time::Instant;

use super::checkpoint::Progress;
use crate::comm::CommStats;
use crate::metrics::Row;

/// ", comm 4.873 MB/step (18% of the time)" for a row whose `steps` communicated, else "".
fn comm(r: &Row, steps: u64) -> String {
    if r.comm_bytes == 0 {
        return String::new();
    }
    format!(
        ", comm {:.3} MB/step ({:.0}% of the time)",
        r.comm_bytes as f64 / 1e6 / steps.max(1) as f64,
        r.comm_frac * 100.0
    )
}

/// Counters since the last metrics row.
pub(super) struct Interval {
    start: Instant,
    /// Steps timed in this process (throughput), and their tokens.
    pub steps: u64,
    tokens: u64,
    /// Steps whose loss is in `loss_sum` (restored across a resume).
    pub loss_steps: u64,
    pub loss_sum: f64,
    /// The communicator's totals at the start of the interval.
    pub comm: CommStats,
    /// Bookkeeping traffic within the interval (not the algorithm's): left out of the row.
    control: CommStats,
    /// Seconds the sync backend's hooks computed outside collectives (compression, mixing).
    sync_seconds: f64,
    /// Seconds the worker waited for its training batches.
    pub data_seconds: f64,
    /// Seconds its forward and backward passes ran beside collectives (None: none did).
    pub overlap_compute_seconds: Option<f64>,
}

impl Interval {
    pub fn new(comm: CommStats) -> Self {
        Self {
            start: Instant::now(),
            steps: 0,
            tokens: 0,
            loss_steps: 0,
            loss_sum: 0.0,
            comm,
            control: CommStats::default(),
            sync_seconds: 0.0,
            data_seconds: 0.0,
            overlap_compute_seconds: None,
        }
    }

    /// Marks the start of a sync backend hook.
    pub fn sync_start(&self, comm: CommStats) -> (Instant, f64) {
        (Instant::now(), comm.seconds)
    }

    /// Adds the hook's time outside collectives since `sync_start`.
    pub fn sync_end(&mut self, (start, comm_secs): (Instant, f64), comm: CommStats) {
        let inside = comm.seconds - comm_secs;
        self.sync_seconds += (start.elapsed().as_secs_f64() - inside).max(0.0);
    }

    /// Seconds of the interval so far outside every collective (the algorithm's and the bookkeeping's,
    /// `comm` being the communicator's totals now): the compute, the sync backend's own included.
    pub fn busy_seconds(&self, comm: &CommStats) -> f64 {
        let inside = comm.seconds - self.comm.seconds;
        (self.start.elapsed().as_secs_f64() - inside).max(0.0)
    }

    /// Seconds the sync backend's hooks computed outside collectives in the interval so far (`sync_ms`).
    pub fn sync_seconds(&self) -> f64 {
        self.sync_seconds
    }

    /// Leaves the traffic between `before` and `after` out of the row.
    pub fn exclude(&mut self, before: &CommStats, after: &CommStats) {
        self.control.bytes_sent += after.bytes_sent - before.bytes_sent;
        self.control.seconds += after.seconds - before.seconds;
    }

    /// One more step, with its training loss and its global batch's tokens.
    pub fn add_step(&mut self, loss: f64, tokens: u64) {
        self.steps += 1;
        self.tokens += tokens;
        self.loss_steps += 1;
        self.loss_sum += loss;
    }

    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.loss_steps as f64
    }

    /// The metrics row at the interval's end (evaluation and compression fields are added by the caller).
    pub fn row(
        &self,
        progress: &Progress,
        lr: f64,
        train_loss: f64,
        grad_norm: f64,
        comm: CommStats,
    ) -> Row {
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        let comm_s = comm.seconds - self.comm.seconds - self.control.seconds;
        Row {
            step: progress.step,
            tokens: progress.tokens,
            lr,
            train_loss,
            grad_norm,
            tokens_per_s: self.tokens as f64 / secs,
            ms_per_step: secs * 1e3 / self.steps as f64,
            comm_bytes: comm.bytes_sent - self.comm.bytes_sent - self.control.bytes_sent,
            comm_ms: comm_s * 1e3,
            comm_frac: comm_s / secs,
            sync_ms: self.sync_seconds * 1e3,
            data_ms: self.data_seconds * 1e3,
            overlap_compute_ms: self.overlap_compute_seconds.map(|s| s * 1e3),
            ..Row::default()
        }
    }
}

/// Console output: a progress bar on a terminal, plain lines otherwise (sbatch logs). Every line is
/// prefixed as the decentralized GPT-2 runner's logger writes it, `[HH:MM:SS  INFO] `, and also appended to
/// the run's `train.log` (rank 0), so scripts that parse that runner's log read nanodist's.
pub(super) struct Console {
    bar: Option<indicatif::ProgressBar>,
    n_steps: u64,
    silent: bool,
    log: Option<std::cell::RefCell<std::fs::File>>,
    /// What the rows' MFU is a fraction of ("of an A100's bf16 peak").
    pub mfu_label: String,
}

/// The runner's logging prefix (Python logging, `[%(asctime)s %(levelname)5s] ` with `%H:%M:%S`).
fn prefixed(line: &str) -> String {
    format!("[{}  INFO] {line}", chrono::Local::now().format("%H:%M:%S"))
}

impl Console {
    /// Only rank 0 prints; other ranks get a silent console.
    pub fn new(n_steps: u64, start: u64, root: bool) -> Self {
        if !root {
            return Self {
                bar: None,
                n_steps,
                silent: true,
                log: None,
                mfu_label: String::new(),
            };
        }
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(n_steps);
            if let Ok(style) =
                indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} eta {eta}")
            {
                bar.set_style(style);
            }
            bar.set_position(start);
            bar
        });
        Self {
            bar,
            n_steps,
            silent: false,
            log: None,
            mfu_label: String::new(),
        }
    }

    /// Appends the console's lines to `path` (a resumed run continues its file).
    pub fn log_to(&mut self, path: &std::path::Path) -> anyhow::Result<()> {
        if self.silent {
            return Ok(());
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))?;
        self.log = Some(std::cell::RefCell::new(file));
        Ok(())
    }

    /// One line: above the progress bar, or on stdout; and into train.log.
    pub fn line(&self, text: &str) {
        if self.silent {
            return;
        }
        let line = prefixed(text);
        match &self.bar {
            Some(bar) => bar.println(&line),
            None => println!("{line}"),
        }
        self.append(&line);
    }

    /// Appends a prefixed line to train.log; the log is a copy of the console, so a full disk must not
    /// stop training.
    fn append(&self, line: &str) {
        if let Some(log) = &self.log {
            use std::io::Write;
            let _ = writeln!(log.borrow_mut(), "{line}");
        }
    }

    /// A metrics row that covers `steps` steps.
    pub fn progress(&self, r: &Row, steps: u64) {
        if self.silent {
            return;
        }
        let msg = format!(
            "loss {:.4} lr {:.2e} {:.0} tok/s{}",
            r.train_loss,
            r.lr,
            r.tokens_per_s,
            comm(r, steps)
        );
        match &self.bar {
            Some(bar) => {
                bar.set_position(r.step);
                bar.set_message(msg);
            }
            None => self.line(&format!(
                "step {}/{} | {msg} | {:.1} ms/step",
                r.step, self.n_steps, r.ms_per_step
            )),
        }
    }

    /// The evaluation of `r` (train time `secs` over `steps` steps since the last one; the row covers
    /// `row_steps`): the seed runner's line, exactly in its format, then on a line of its own the figures it
    /// does not print (throughput, MFU, the synchronisation's).
    pub fn eval_line(&self, r: &Row, secs: f64, steps: u64, row_steps: u64) {
        let (val, train) = (
            r.val_loss.unwrap_or(f64::NAN),
            r.eval_train_loss.unwrap_or(f64::NAN),
        );
        // The evaluation before training has trained nothing.
        let (secs, ms) = match steps {
            0 => (0.0, 0.0),
            n => (secs, secs * 1e3 / n as f64),
        };
        self.line(&format!(
            "Step {}, Val loss: {val:.6}, Train loss: {train:.6}, Train time: {secs:.3} s ({ms:.3} ms/step), \
             Total train time: {:.3} s",
            r.step, r.elapsed_s,
        ));
        let mut extra = Vec::new();
        if r.tokens_per_s > 0.0 {
            extra.push(format!("{:.0} tokens/s", r.tokens_per_s));
        }
        if let Some(m) = r.mfu {
            extra.push(format!("MFU {:.2}% {}", m * 100.0, self.mfu_label));
        }
        if let Some(d) = r.consensus_distance {
            extra.push(format!("consensus distance {d:.4e}"));
        }
        if let Some(c) = r.compression_ratio {
            extra.push(format!("compression ratio {c:.1}x"));
        }
        if let Some(v) = r.val_loss_local {
            extra.push(format!("own-replica val loss {v:.4}"));
        }
        if let Some(c) = comm(r, row_steps).strip_prefix(", ") {
            extra.push(c.to_string());
        }
        if !extra.is_empty() {
            self.line(&format!("Step {}: {}", r.step, extra.join(", ")));
        }
        if let Some(bar) = &self.bar {
            bar.set_position(r.step);
        }
    }

    /// A diagnostic line: through the log (stderr, timestamped), above the progress bar if there is one,
    /// and into train.log.
    pub fn note(&self, line: &str) {
        if self.silent {
            return;
        }
        match &self.bar {
            Some(bar) => bar.suspend(|| tracing::info!("{line}")),
            None => tracing::info!("{line}"),
        }
        self.append(&prefixed(line));
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

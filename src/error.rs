//! Error classes that decide the exit code: bad input (2), a training state that became non-finite (3),
//! other failures (1).

/// Bad input from the user (flags, data files, checkpoints): exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadInput(pub String);

/// Builds a [`BadInput`] error from format arguments.
#[macro_export]
macro_rules! bad_input {
    ($($arg:tt)*) => { anyhow::Error::new($crate::error::BadInput(format!($($arg)*))) };
}

/// A rank's loss or gradient norm became NaN or infinite: every rank stopped at the next vote (see
/// `train::worker::vote`) without saving anything after the last checkpoint (exit code 3).
#[derive(Debug, thiserror::Error)]
#[error(
    "step {step}: rank {rank}'s {what} is {value}; every rank stopped at step {stopped} and nothing after \
     the last checkpoint was saved{resume}"
)]
pub struct NonFinite {
    /// The step (steps done) where the value appeared.
    pub step: u64,
    /// The step where the ranks agreed to stop (the same or later).
    pub stopped: u64,
    pub rank: usize,
    /// "train loss" or "gradient norm".
    pub what: &'static str,
    pub value: f64,
    /// How to go on: "; resume from ... (the last checkpoint)" or "; no checkpoint was saved before it".
    pub resume: String,
}

/// Exit code for an error chain: 2 when any cause is bad input or a config error, 3 when the training
/// state became non-finite, else 1.
pub fn exit_code(err: &anyhow::Error) -> i32 {
    let has = |f: &dyn Fn(&(dyn std::error::Error + 'static)) -> bool| err.chain().any(f);
    if has(&|e| e.is::<BadInput>() || e.is::<crate::config::ConfigError>()) {
        2
    } else if has(&|e| e.is::<NonFinite>()) {
        3
    } else {
        1
    }
}

/// `p` made absolute against the current directory, lexically (no links resolved, "." parts dropped):
/// messages name the path that was really tried.
pub fn absolute(p: &std::path::Path) -> std::path::PathBuf {
    if p.is_absolute() {
        return p.to_path_buf();
    }
    match std::env::current_dir() {
        Ok(cwd) => cwd.join(p).components().collect(),
        Err(_) => p.to_path_buf(),
    }
}

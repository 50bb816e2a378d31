//! Error classes that decide the exit code: bad input (2) versus failures (1).

/// Bad input from the user (flags, data files, checkpoints): exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadInput(pub String);

/// Builds a [`BadInput`] error from format arguments.
#[macro_export]
macro_rules! bad_input {
    ($($arg:tt)*) => { anyhow::Error::new($crate::error::BadInput(format!($($arg)*))) };
}

/// Exit code for an error chain: 2 when any cause is bad input or a config error, else 1.
pub fn exit_code(err: &anyhow::Error) -> i32 {
    let bad = err.chain().any(|e| {
        e.downcast_ref::<BadInput>().is_some()
            || e.downcast_ref::<crate::config::ConfigError>().is_some()
    });
    if bad {
        2
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

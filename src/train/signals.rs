//! SIGTERM, SIGUSR1 and SIGINT request a checkpoint and a clean exit at the next step boundary
//! (`sbatch --signal=B:USR1@120`, Slurm's SIGTERM before a kill, Ctrl-C).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Result;
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};

/// Set to the number of the first signal received (0: none).
#[derive(Clone)]
pub struct StopFlag(Arc<AtomicUsize>);

impl StopFlag {
    pub fn install() -> Result<Self> {
        let flag = Arc::new(AtomicUsize::new(0));
        for sig in [SIGTERM, SIGUSR1, SIGINT] {
            // The handler only stores the number; the loop saves and exits at the next step boundary.
            signal_hook::flag::register_usize(sig, Arc::clone(&flag), sig as usize)?;
        }
        Ok(Self(flag))
    }

    pub fn received(&self) -> Option<&'static str> {
        match self.0.load(Ordering::Relaxed) as i32 {
            0 => None,
            SIGTERM => Some("SIGTERM"),
            SIGUSR1 => Some("SIGUSR1"),
            SIGINT => Some("SIGINT"),
            _ => Some("a signal"),
        }
    }
}

//! Tests that launch jobs of several processes — `mpirun`, a single-node Slurm, the netlab's hosts in network
//! namespaces — and the timing-bound tests among them (`predict` against measured `mpirun` runs, Slurm time
//! limits, all-reduce against DiLoCo on a shaped link). Their jobs use the whole machine and several hold
//! timings, so this binary runs its tests one at a time (`turn`), and `cargo test` runs it apart from the
//! in-process tests (`tests/it`).

#[path = "../common/mod.rs"]
mod common;

mod mpi;
mod netlab;
mod predict_validation;
mod slurm;

use std::sync::{Mutex, MutexGuard};

/// This binary's turn: held for the whole of a test that launches a job, so that no job shares the cores
/// with another test's (a test that failed while holding it leaves it usable).
pub fn turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

//! The compute slots of a process: where workers run their forward/backward passes.
//!
//! N local workers on C cores cannot compute more than C at a time, so the memory of computing belongs
//! to the cores, not to the workers: a `Compute` holds C / threads slots, each a thread pool of `threads`
//! threads and a `Scratch` (the activations of one forward/backward). A worker borrows a slot for each
//! computation and gives it back before it communicates, so a worker never holds a slot while it waits
//! for another, and the other workers' waits cost no memory. A single worker (one process of an MPI or
//! NCCL job, or a run with one worker) has one slot that computes on the calling thread, in the
//! process's rayon pool.
//!
//! Results do not depend on which slot computes: every slot has the same number of threads, and the CPU
//! engine's reductions are ordered by task, not by thread (tests/it/distributed.rs checks 64 workers
//! against the rows of the engine that gave every worker its own pool and buffers).

use std::sync::{Condvar, Mutex};

use anyhow::{Context, Result};

use crate::model::Scratch;

struct Slot {
    pool: Option<rayon::ThreadPool>,
    scratch: Scratch,
}

pub(crate) struct Compute {
    free: Mutex<Vec<Slot>>,
    returned: Condvar,
}

impl Compute {
    /// One slot that computes on the calling thread (its process's rayon pool).
    pub fn here() -> Self {
        Self::of(vec![Slot {
            pool: None,
            scratch: Scratch::default(),
        }])
    }

    /// `slots` slots of `threads` threads each, for the workers of the local engine.
    pub fn pools(slots: usize, threads: usize) -> Result<Self> {
        let slots = (0..slots.max(1))
            .map(|i| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(move |t| format!("compute-{i}.{t}"))
                    .build()
                    .context("starting a compute thread pool")?;
                Ok(Slot {
                    pool: Some(pool),
                    scratch: Scratch::default(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::of(slots))
    }

    fn of(slots: Vec<Slot>) -> Self {
        Self {
            free: Mutex::new(slots),
            returned: Condvar::new(),
        }
    }

    /// Runs `f` in a free slot (waiting for one), on the slot's threads, with its scratch memory. `f`
    /// must not communicate: a worker waiting in a collective while it holds a slot could keep the
    /// workers it waits for from computing.
    pub fn run<T: Send>(&self, f: impl FnOnce(&mut Scratch) -> T + Send) -> T {
        let mut lease = self.hold();
        let s = lease.slot.as_mut().expect("a leased slot");
        match &s.pool {
            Some(pool) => {
                let scratch = &mut s.scratch;
                pool.install(|| f(scratch))
            }
            None => f(&mut s.scratch),
        }
    }

    /// Waits for a free slot and holds it (without computing in it) until the lease is dropped: for work
    /// on the calling thread whose transient memory should, like computing, be bounded by the slots
    /// (a checkpoint's copy of a rank's state).
    pub fn hold(&self) -> Lease<'_> {
        Lease {
            compute: self,
            slot: Some(self.take()),
        }
    }

    fn take(&self) -> Slot {
        // A panic inside `f` returns the slot through `Lease::drop`; the list itself stays consistent.
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(slot) = free.pop() {
                return slot;
            }
            free = self.returned.wait(free).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// A borrowed slot, returned when dropped (also when the computation panics).
pub(crate) struct Lease<'c> {
    compute: &'c Compute,
    slot: Option<Slot>,
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            let mut free = self.compute.free.lock().unwrap_or_else(|p| p.into_inner());
            free.push(slot);
            self.compute.returned.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn no_more_computations_run_at_once_than_there_are_slots_and_each_has_its_threads() {
        let compute = Compute::pools(2, 3).unwrap();
        let (now, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
        std::thread::scope(|s| {
            for _ in 0..16 {
                s.spawn(|| {
                    compute.run(|_| {
                        let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(n, Ordering::SeqCst);
                        assert_eq!(rayon::current_num_threads(), 3);
                        std::thread::sleep(std::time::Duration::from_millis(5));
                        now.fetch_sub(1, Ordering::SeqCst);
                    })
                });
            }
        });
        assert_eq!(most.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_computation_that_panics_gives_its_slot_back() {
        let compute = Compute::pools(1, 1).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            compute.run(|_| panic!("boom"))
        }));
        assert!(r.is_err());
        assert_eq!(compute.run(|_| 7), 7);
    }
}

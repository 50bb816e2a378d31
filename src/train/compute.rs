//! The compute slots of a process: where workers run their forward/backward passes and their optimizer
//! updates (whose kernels cut the parameters into parts for the slot's threads).
//!
//! N local workers on C cores cannot compute more than C at a time, so the memory of computing belongs
//! to the cores, not to the workers: a `Compute` holds C / threads slots, each a thread pool of `threads`
//! threads and a `Scratch` (the activations of one forward/backward). A worker borrows a slot for each
//! computation and gives it back before it communicates, so a worker never holds a slot while it waits
//! for another, and the other workers' waits cost no memory. A single worker (one process of an MPI or
//! NCCL job, or a run with one worker) has one slot that computes in the process's rayon pool (a GPU's
//! work on the calling thread, which holds its context).
//!
//! While a slot computes on the CPU, its pool's other threads wait for its parallel work awake
//! (`busy`), as OpenMP's threads spin between parallel regions, rather than asleep in the kernel.
//!
//! Results do not depend on which slot computes: every slot has the same number of threads, and the CPU
//! engine's reductions are ordered by task, not by thread (tests/it/distributed.rs checks 64 workers
//! against the rows of the engine that gave every worker its own pool and buffers).

use std::sync::atomic::{AtomicBool, Ordering};
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
    /// The model computes on the CPU: while a slot computes, its other threads wait for its parallel
    /// work awake (`busy`). A GPU's host threads sleep instead.
    awake: bool,
}

impl Compute {
    /// One slot that computes in its process's rayon pool; `awake`: the model computes on the CPU.
    pub fn here(awake: bool) -> Self {
        let slot = Slot {
            pool: None,
            scratch: Scratch::default(),
        };
        Self::of(vec![slot], awake)
    }

    /// `slots` slots of `threads` threads each, for the workers of the local engine; `awake` as `here`.
    pub fn pools(slots: usize, threads: usize, awake: bool) -> Result<Self> {
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
        Ok(Self::of(slots, awake))
    }

    fn of(slots: Vec<Slot>, awake: bool) -> Self {
        Self {
            free: Mutex::new(slots),
            returned: Condvar::new(),
            awake,
        }
    }

    /// Runs `f` in a free slot (waiting for one), on the slot's threads, with its scratch memory. `f`
    /// must not communicate: a worker waiting in a collective while it holds a slot could keep the
    /// workers it waits for from computing.
    pub fn run<T: Send>(&self, f: impl FnOnce(&mut Scratch) -> T + Send) -> T {
        let mut lease = self.hold();
        let s = lease.slot.as_mut().expect("a leased slot");
        let scratch = &mut s.scratch;
        // A slot's own pool computes nothing else.
        let own = AtomicBool::new(false);
        match (&s.pool, self.awake) {
            (Some(pool), awake) => pool.install(|| busy(awake.then_some(&own), || f(scratch))),
            // `busy` enters the process's pool (a scope); a GPU's work stays on the thread that holds
            // its context.
            (None, awake) => busy(awake.then_some(&GLOBAL_SPINS), || f(scratch)),
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

/// Whether a computation's threads spin in the process's rayon pool: one computation at a time does
/// (two trainings in one process, as the tests run them, share that pool; see `busy`).
static GLOBAL_SPINS: AtomicBool = AtomicBool::new(false);

/// Sets its flag when dropped: on return and on unwinding alike.
struct SetOnDrop<'a>(&'a AtomicBool, bool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(self.1, Ordering::Release);
    }
}

/// `f`. Where `token` (the current rayon pool's) is given and free, `f` runs on a thread of that pool
/// (a scope enters it) and the pool's other threads meanwhile wait for `f`'s parallel work spinning on
/// `rayon::yield_now`, not asleep: a parallel operation wakes a sleeping thread through the kernel,
/// and on nanoGPT's CPU config, whose operations are small, that cost a tenth of the step. The spinners
/// are spawned before `f` pushes work and thieves take the oldest job first, so that `f` never waits
/// for a job below a spinner on a thread's stack; the token keeps a second computation in the same
/// pool from spinning meanwhile.
fn busy<T: Send>(token: Option<&AtomicBool>, f: impl FnOnce() -> T + Send) -> T {
    let acquired = |t: &&AtomicBool| {
        t.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    };
    let Some(token) = token.filter(acquired) else {
        return f();
    };
    // Released once the scope has waited for every spinner.
    let _release = SetOnDrop(token, false);
    let done = AtomicBool::new(false);
    let spin = || {
        while !done.load(Ordering::Acquire) {
            if rayon::yield_now() != Some(rayon::Yield::Executed) {
                std::thread::yield_now();
            }
        }
    };
    rayon::scope(|s| {
        for _ in 1..rayon::current_num_threads() {
            s.spawn(|_| spin());
        }
        let _stop = SetOnDrop(&done, true);
        f()
    })
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
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn no_more_computations_run_at_once_than_there_are_slots_and_each_has_its_threads() {
        let compute = Compute::pools(2, 3, true).unwrap();
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
        for threads in [1, 3] {
            let compute = Compute::pools(1, threads, true).unwrap();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                compute.run(|_| panic!("boom"))
            }));
            assert!(r.is_err());
            assert_eq!(compute.run(|_| 7), 7);
        }
        let here = Compute::here(true);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            here.run(|_| panic!("boom"))
        }));
        assert!(r.is_err());
    }

    /// The slot's other threads, spinning while a computation runs, take its parallel work (nested
    /// too) and stop when it returns: its results are those of the plain loop, on every thread count.
    #[test]
    fn parallel_work_in_a_slot_completes_on_its_threads() {
        use rayon::prelude::*;
        let work = || {
            (0..64u64)
                .into_par_iter()
                .map(|i| (0..1000u64).into_par_iter().map(|j| i * j % 7).sum::<u64>())
                .collect::<Vec<_>>()
        };
        let want: Vec<u64> = (0..64u64)
            .map(|i| (0..1000u64).map(|j| i * j % 7).sum())
            .collect();
        for threads in [1, 2, 3] {
            let compute = Compute::pools(1, threads, true).unwrap();
            let seen = Mutex::new(std::collections::HashSet::new());
            let got = compute.run(|_| {
                (0..256).into_par_iter().for_each(|_| {
                    let id = std::thread::current().id();
                    seen.lock().unwrap().insert(id);
                    std::thread::sleep(std::time::Duration::from_micros(200));
                });
                work()
            });
            assert_eq!(got, want, "{threads} threads");
            let used = seen.into_inner().unwrap().len();
            assert!(used >= 1 && used <= threads, "{used} of {threads} threads");
            assert_eq!(compute.run(|_| 7), 7);
        }
        assert_eq!(Compute::here(true).run(|_| work()), want);
    }

    /// Computations of several trainings at once in the process's pool (as the tests run them), one of
    /// them with spinners at a time, all finish with the plain loop's results (a watchdog fails the
    /// test where they would hang).
    #[test]
    fn computations_sharing_the_process_pool_all_finish() {
        use rayon::prelude::*;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            std::thread::scope(|s| {
                for t in 0..4u64 {
                    s.spawn(move || {
                        let compute = Compute::here(true);
                        for round in 0..50u64 {
                            let got: u64 = compute.run(|_| {
                                (0..64u64)
                                    .into_par_iter()
                                    .map(|i| {
                                        (0..64u64).into_par_iter().map(|j| i ^ j ^ t).sum::<u64>()
                                    })
                                    .sum()
                            });
                            let want: u64 = (0..64u64)
                                .flat_map(|i| (0..64u64).map(move |j| i ^ j ^ t))
                                .sum();
                            assert_eq!(got, want, "training {t}, round {round}");
                        }
                    });
                }
            });
            tx.send(()).unwrap();
        });
        rx.recv_timeout(std::time::Duration::from_secs(120))
            .expect("the computations finished");
    }
}

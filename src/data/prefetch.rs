//! The next step's batches, sampled on a loader thread while the step computes.
//!
//! A batch is a pure function of the seed, the worker's view, the step and its rows (see `sampler`), so
//! the batches a loader samples ahead are the ones the step would sample itself, bit for bit. A request
//! the loader did not foresee (the first step, a step after a restore, a changed accumulation) is sampled
//! on the spot, as is every request without a loader (`prefetch = false`), and one the loader has not
//! begun when the step asks for it (the loader's thread may wait for a core while the workers compute).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use super::sampler::{Batch, Sampler};
use super::source::Blend;

/// The batches of one optimizer step of one worker: rows `first_rows[m]..first_rows[m] + b` of step
/// `step`'s global batch for micro-step m, each a sequence of `t` tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rows {
    pub step: u64,
    pub first_rows: Vec<u64>,
    pub b: usize,
    pub t: usize,
}

/// Batches and the windows they drew from each source.
type Sampled = (Vec<Batch>, Vec<u64>);

/// One worker's batches, each step's sampled ahead on `loader` when there is one.
pub struct Prefetch<'a> {
    data: Arc<Blend>,
    sampler: Sampler,
    loader: Option<&'a rayon::ThreadPool>,
    pending: Option<Pending>,
}

/// Rows given to the loader: whichever of the loader and `take` sets `started` first samples them.
struct Pending {
    rows: Rows,
    started: Arc<AtomicBool>,
    done: mpsc::Receiver<Sampled>,
}

impl<'a> Prefetch<'a> {
    pub fn new(data: Arc<Blend>, sampler: Sampler, loader: Option<&'a rayon::ThreadPool>) -> Self {
        Self {
            data,
            sampler,
            loader,
            pending: None,
        }
    }

    /// The batches of `rows`: the loader's when it sampled or is sampling these rows, else sampled now (a
    /// loader job not yet started is taken back, not waited for).
    pub fn take(&mut self, rows: &Rows) -> Vec<Batch> {
        if let Some(job) = self.pending.take() {
            // A loader job that failed drops its sender: the rows are sampled here instead.
            if job.rows == *rows && job.started.swap(true, Ordering::AcqRel) {
                if let Ok((batches, counts)) = job.done.recv() {
                    self.sampler.add_counts(&counts);
                    return batches;
                }
            }
            job.started.store(true, Ordering::Release);
        }
        sample(&mut self.sampler, &self.data, rows)
    }

    /// Starts sampling `rows` on the loader (without one, nothing: `take` samples them).
    pub fn ahead(&mut self, rows: Rows) {
        let Some(loader) = self.loader else { return };
        let (tx, done) = mpsc::sync_channel(1);
        let (data, mut sampler) = (Arc::clone(&self.data), self.sampler.clone());
        sampler.take_counts();
        let (job, started) = (rows.clone(), Arc::new(AtomicBool::new(false)));
        let claimed = Arc::clone(&started);
        loader.spawn(move || {
            if !claimed.swap(true, Ordering::AcqRel) {
                let batches = sample(&mut sampler, &data, &job);
                let _ = tx.send((batches, sampler.take_counts()));
            }
        });
        self.pending = Some(Pending {
            rows,
            started,
            done,
        });
    }

    /// Windows drawn from each source by the batches taken since the last call.
    pub fn take_counts(&mut self) -> Vec<u64> {
        self.sampler.take_counts()
    }
}

/// The loader of a process: one thread that samples every worker's next batches.
pub fn loader() -> std::io::Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .thread_name(|_| "loader".into())
        .build()
        .map_err(std::io::Error::other)
}

fn sample(sampler: &mut Sampler, data: &Blend, rows: &Rows) -> Vec<Batch> {
    rows.first_rows
        .iter()
        .map(|&first| sampler.batch(data, rows.step, first, rows.b, rows.t))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::format::TokenFile;
    use crate::data::sampler::View;

    /// Prefetched batches are the ones sampled in place: sampled by the loader and waited for, taken back
    /// from a loader that had not begun, or not foreseen; with the same counts. Without a loader every
    /// request is sampled in place.
    #[test]
    fn prefetched_batches_are_the_batches_sampled_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        let bytes: Vec<u8> = (0..5000u16)
            .flat_map(|i| (i * 7 % 5000).to_le_bytes())
            .collect();
        std::fs::write(&p, bytes).unwrap();
        let data = Arc::new(Blend::single(TokenFile::open_nanogpt(&p, false).unwrap()));
        let sampler = Sampler::new(42, View::whole(&data));
        let rows = |step: u64, micro: u64| Rows {
            step,
            first_rows: (0..micro).map(|m| m * 8 + 2).collect(),
            b: 2,
            t: 16,
        };
        let want = |r: &Rows| sample(&mut sampler.clone(), &data, r);
        let pool = loader().unwrap();
        for loader in [Some(&pool), None] {
            let mut p = Prefetch::new(Arc::clone(&data), sampler.clone(), loader);
            assert_eq!(p.take(&rows(0, 1)), want(&rows(0, 1)), "first step");
            p.ahead(rows(1, 3));
            if loader.is_some() {
                let job = p.pending.as_ref().unwrap();
                while !job.started.load(Ordering::Acquire) {
                    std::thread::yield_now();
                }
            }
            assert_eq!(p.take(&rows(1, 3)), want(&rows(1, 3)), "sampled ahead");
            // The loader busy: the job has not begun when the step asks for its rows.
            let (hold, held) = mpsc::channel::<()>();
            pool.spawn(move || held.recv().unwrap_or_default());
            p.ahead(rows(2, 2));
            assert_eq!(p.take(&rows(2, 2)), want(&rows(2, 2)), "taken back");
            hold.send(()).unwrap();
            p.ahead(rows(3, 1));
            assert_eq!(p.take(&rows(7, 2)), want(&rows(7, 2)), "not foreseen");
            assert_eq!(p.take(&rows(3, 1)), want(&rows(3, 1)), "no longer pending");
            assert_eq!(
                p.take_counts(),
                vec![18],
                "the windows of the batches taken"
            );
        }
    }
}

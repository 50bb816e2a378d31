//! The `local` engine: N workers as threads of one process, exchanging through shared memory.
//!
//! Reductions (all-reduce, group all-reduce) copy nothing: each rank publishes where its buffer is, sums
//! its own chunk of every member's buffer into its buffer (reduce-scatter), then copies the other chunks
//! from their owners (all-gather), with a barrier between the phases: O(len) work and no extra memory per
//! rank at any world size. Elements are added in the group's rank order on every rank, so all ranks get
//! bit-identical results and runs are reproducible. The other collectives deposit this rank's buffer in
//! its slot, wait at a barrier, read the slots, and wait again before the slots are reused;
//! `all_gather_shared` posts a shared copy of the message and waits once, and the ranks read the posts in
//! place. Barriers time out and name the ranks that never arrived; a worker that fails marks the group
//! failed so the others stop at once instead of waiting for the timeout.

use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::{all_reduce_bytes, check_gather, chunk, CommStats, Communicator, Gathered, Regroup};

struct Barrier {
    generation: u64,
    arrived: Vec<bool>,
    count: usize,
    failed: Option<(usize, String)>,
    /// The ranks that take part in collectives (all of them, unless a membership schedule sent some
    /// away): a barrier waits for these.
    members: Vec<usize>,
    /// The members from the barrier that completes next, and the step index they start at
    /// (`LocalComm::regroup`).
    next: Option<(u64, Vec<usize>)>,
    /// The step index of the last change of members.
    epoch: u64,
    /// The run ended: ranks waiting to come back stop waiting.
    ended: bool,
}

/// A rank's buffer during a reduction: published before its first barrier, read by the other members
/// until its last (see `LocalComm::reduce`).
#[derive(Clone, Copy)]
struct View {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: a View is dereferenced only inside the reduction that published it, between its barriers, while
// its owner is inside the same reduction and touches its buffer only through this pointer; the chunks
// written and read in each phase are disjoint (see `LocalComm::reduce`).
unsafe impl Send for View {}

/// Elements summed at a time in a reduction (a 16 kB accumulator on the stack).
const BLOCK: usize = 4096;

/// How many members ahead a reduction asks the cache for the block it will read next: with hundreds of
/// workers every member's buffer is in memory, not cache, and its few kB per block are too short a run
/// for the hardware prefetcher to find in time.
const PREFETCH_AHEAD: usize = 2;

/// Phase 2 of `reduce`: chunk `mine` of every member's buffer summed in member order, block by block,
/// times `scale`, into chunk `mine` of this rank's buffer at `ptr`.
fn sum_chunk(views: &[View], mine: std::ops::Range<usize>, ptr: *mut f32, scale: Option<f32>) {
    let mut acc = [0.0f32; BLOCK];
    for start in mine.clone().step_by(BLOCK) {
        let n = BLOCK.min(mine.end - start);
        let acc = &mut acc[..n];
        for (j, v) in views.iter().enumerate() {
            if let Some(next) = views.get(j + PREFETCH_AHEAD) {
                // SAFETY: in bounds, as `src` below.
                prefetch(unsafe { next.ptr.add(start) }, n);
            }
            // SAFETY: in bounds (every length is the same, checked in `publish`); chunk `mine` of each
            // buffer is written by nobody during this phase but by this rank below, after these reads.
            let src = unsafe { std::slice::from_raw_parts(v.ptr.add(start), n) };
            if j == 0 {
                acc.copy_from_slice(src);
            } else {
                crate::kernels::add_to(acc, src);
            }
        }
        if let Some(s) = scale {
            crate::kernels::scale_by(acc, s);
        }
        // SAFETY: this rank's own buffer, chunk `mine`, which nobody else touches in this phase.
        unsafe { std::slice::from_raw_parts_mut(ptr.add(start), n) }.copy_from_slice(acc);
    }
}

/// Asks the cache for the `n` values at `p` (a hint: no effect on results).
#[inline(always)]
fn prefetch(p: *const f32, n: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..n).step_by(16) {
        // SAFETY: prefetching never faults; the caller keeps `p + line` inside one buffer anyway.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                p.add(line) as *const i8
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, n);
}

struct Shared {
    n: usize,
    timeout: Duration,
    barrier: Mutex<Barrier>,
    cv: Condvar,
    views: Vec<Mutex<View>>,
    slots: Vec<RwLock<Vec<f32>>>,
    /// Each rank's messages of `all_gather_shared`, by the parity of the barrier generation they were
    /// posted in, tagged with it: a rank posts its next one in the next generation at the earliest, into
    /// the other place, and the one after that only once every member has passed the barrier after
    /// which it read this one.
    posted: Vec<[Mutex<Posted>; 2]>,
    /// Point-to-point mailboxes, index src * n + dst.
    mail: Vec<Mutex<Vec<f32>>>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Barrier> {
        // A panicking worker poisons the mutex; the state itself stays consistent, so keep using it.
        self.barrier.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait(&self, rank: usize) -> Result<()> {
        let mut b = self.lock();
        if let Some((r, why)) = &b.failed {
            bail!("rank {r} failed: {why}");
        }
        let gen = b.generation;
        b.arrived[rank] = true;
        b.count += 1;
        if b.count == b.members.len() {
            b.count = 0;
            b.arrived.iter_mut().for_each(|a| *a = false);
            b.generation += 1;
            if let Some((epoch, members)) = b.next.take() {
                (b.epoch, b.members) = (epoch, members);
            }
            self.cv.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + self.timeout;
        while b.generation == gen {
            if let Some((r, why)) = &b.failed {
                bail!("rank {r} failed: {why}");
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<usize> = b
                    .members
                    .iter()
                    .copied()
                    .filter(|&r| !b.arrived[r])
                    .collect();
                bail!(
                    "rank {rank}: timed out after {:.0} s waiting for rank(s) {missing:?} in a collective \
                     (train.comm_timeout_secs)",
                    self.timeout.as_secs_f64()
                );
            }
            b = self
                .cv
                .wait_timeout(b, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }

    /// Waits, without a timeout (the members' own collectives time out), until the members change at
    /// step index `epoch` or later, or the run ends (false) or fails.
    fn wait_for_epoch(&self, epoch: u64) -> Result<bool> {
        let mut b = self.lock();
        loop {
            if let Some((r, why)) = &b.failed {
                bail!("rank {r} failed: {why}");
            }
            if b.epoch >= epoch {
                return Ok(true);
            }
            if b.ended {
                return Ok(false);
            }
            b = self
                .cv
                .wait_timeout(b, Duration::from_secs(1))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A message of `all_gather_shared` and the barrier generation it was posted in.
type Posted = (u64, Arc<[f32]>);

/// One rank's handle on a local group. Its rank is its position among the members that take part now
/// (all ranks, unless a membership schedule sent some away), its id its place in the whole group.
pub struct LocalComm {
    id: usize,
    shared: Arc<Shared>,
    stats: CommStats,
    /// The members taking part now (ids, in order), and this rank's position among them.
    members: Vec<usize>,
    pos: usize,
}

/// Creates the N communicators of a local group (hand one to each worker thread).
pub fn group(n: usize, timeout: Duration) -> Vec<LocalComm> {
    let shared = Arc::new(Shared {
        n,
        timeout,
        barrier: Mutex::new(Barrier {
            generation: 0,
            arrived: vec![false; n],
            count: 0,
            failed: None,
            members: (0..n).collect(),
            next: None,
            epoch: 0,
            ended: false,
        }),
        cv: Condvar::new(),
        views: (0..n)
            .map(|_| {
                Mutex::new(View {
                    ptr: std::ptr::null_mut(),
                    len: 0,
                })
            })
            .collect(),
        slots: (0..n).map(|_| RwLock::new(Vec::new())).collect(),
        posted: (0..n)
            .map(|_| [(); 2].map(|_| Mutex::new((u64::MAX, Arc::from(Vec::new())))))
            .collect(),
        mail: (0..n * n).map(|_| Mutex::new(Vec::new())).collect(),
    });
    (0..n)
        .map(|rank| LocalComm {
            id: rank,
            shared: Arc::clone(&shared),
            stats: CommStats::default(),
            members: (0..n).collect(),
            pos: rank,
        })
        .collect()
}

/// A handle that can mark a rank failed after its communicator moved into the worker.
pub struct Failer {
    rank: usize,
    shared: Arc<Shared>,
}

impl Failer {
    pub fn fail(&self, why: &str) {
        let mut b = self.shared.lock();
        if b.failed.is_none() {
            b.failed = Some((self.rank, why.to_string()));
        }
        self.shared.cv.notify_all();
    }
}

impl LocalComm {
    /// Posts `send` for the barrier this rank waits at next, then takes the members' posts of it, in
    /// member order (`what` names the collective in errors).
    fn post_and_take(&mut self, send: &[f32], what: &str) -> Result<Vec<Arc<[f32]>>> {
        let me = self.id;
        // The generation the next barrier completes: it cannot complete before this rank arrives.
        let generation = self.shared.lock().generation;
        let place = (generation % 2) as usize;
        *self.shared.posted[me][place]
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = (generation, Arc::from(send));
        self.shared.wait(me)?;
        let take = |q: usize, r: usize| {
            let (posted_in, msg) = self.shared.posted[r][place]
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            match posted_in == generation {
                true => Ok(msg),
                false => Err(anyhow::anyhow!(
                    "rank {}: {what}, where rank {q} reached the barrier by another collective",
                    self.pos
                )),
            }
        };
        self.members
            .iter()
            .enumerate()
            .map(|(q, &r)| take(q, r))
            .collect()
    }

    pub fn failer(&self) -> Failer {
        Failer {
            rank: self.id,
            shared: Arc::clone(&self.shared),
        }
    }

    /// Marks this rank failed: every other rank's next or current collective returns an error naming it.
    pub fn fail(&self, why: &str) {
        self.failer().fail(why);
    }

    fn deposit(&self, buf: &[f32]) {
        let mut slot = self.shared.slots[self.id]
            .write()
            .unwrap_or_else(|p| p.into_inner());
        slot.clear();
        slot.extend_from_slice(buf);
    }

    /// Sums the slots of `ranks` (in the given order) into `buf`.
    fn sum_slots(&self, ranks: &[usize], buf: &mut [f32]) {
        let guards: Vec<_> = ranks
            .iter()
            .map(|&r| {
                self.shared.slots[r]
                    .read()
                    .unwrap_or_else(|p| p.into_inner())
            })
            .collect();
        buf.copy_from_slice(&guards[0][..buf.len()]);
        for g in &guards[1..] {
            crate::kernels::add_to(buf, &g[..buf.len()]);
        }
    }

    /// `buf` summed over the members of `group` (in the group's order), times `scale` when given, in place
    /// on every member; only in the member's own chunk without `gather`.
    ///
    /// Phase 1: every member publishes a pointer to its buffer (barrier). Phase 2: the member at position
    /// p sums chunk p (`part(p)`; the chunks cover the buffer) of every member's buffer, block by block,
    /// and writes it into chunk p of its own (barrier). Phase 3, with `gather`: it copies every other
    /// chunk q from member q's buffer, where it is final (barrier). In phase 2 a buffer's chunk p is
    /// written by its owner alone and read by nobody else; in phase 3 chunk q is only read; the barriers
    /// order the phases. The owner reaches its buffer only through the published pointer until the last
    /// barrier, after which nobody else does.
    fn reduce(
        &self,
        buf: &mut [f32],
        group: &[usize],
        scale: Option<f32>,
        part: &dyn Fn(usize) -> std::ops::Range<usize>,
        gather: bool,
    ) -> Result<()> {
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        let (pos, views) = self.publish(View { ptr, len }, group)?;
        sum_chunk(&views, part(pos), ptr, scale);
        self.shared.wait(self.id)?;
        if !gather {
            return Ok(());
        }
        for (q, v) in views.iter().enumerate().filter(|&(q, _)| q != pos) {
            let theirs = part(q);
            if let Some(ahead) =
                (q + PREFETCH_AHEAD < group.len()).then(|| part(q + PREFETCH_AHEAD))
            {
                // SAFETY: in bounds: a chunk of this rank's own buffer.
                prefetch(unsafe { ptr.add(ahead.start) }, ahead.len());
            }
            // SAFETY: member q's chunk q is final and only read in this phase; this rank writes its own
            // chunk q, which nobody reads in this phase.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    v.ptr.add(theirs.start),
                    ptr.add(theirs.start),
                    theirs.len(),
                )
            };
        }
        self.shared.wait(self.id)?;
        Ok(())
    }

    /// Phase 1 of `reduce`: publishes this rank's buffer and, after the barrier, reads the group's; its
    /// position in the group and the members' buffers. Every member sees the same lengths, so all of
    /// them fail together on a mismatch.
    fn publish(&self, mine: View, group: &[usize]) -> Result<(usize, Vec<View>)> {
        let me = self.id;
        let Some(pos) = group.iter().position(|&r| r == me) else {
            bail!("rank {me}: reduction over {group:?}, which does not include it");
        };
        *self.shared.views[me]
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = mine;
        self.shared.wait(me)?;
        let views: Vec<View> = group
            .iter()
            .map(|&r| {
                *self.shared.views[r]
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
            })
            .collect();
        if let Some((r, v)) = group.iter().zip(&views).find(|(_, v)| v.len != mine.len) {
            bail!(
                "rank {me}: all-reduce of {} values, rank {r} reduces {} (ranks must reduce the same length)",
                mine.len,
                v.len
            );
        }
        Ok((pos, views))
    }

    /// All-reduce over every rank, times `scale` when given; with `part`, the reduce-scatter into the
    /// ranks' parts alone (`reduce_scatter_shared`). Counts what the MPI engine's reduce-scatter +
    /// all-gather sends from this rank.
    fn all_reduce(
        &mut self,
        buf: &mut [f32],
        scale: Option<f32>,
        part: Option<&dyn Fn(usize) -> std::ops::Range<usize>>,
    ) -> Result<()> {
        let start = Instant::now();
        let (n, len) = (self.members.len(), buf.len());
        let all = self.members.clone();
        let even = |q| chunk(len, n, q);
        self.reduce(buf, &all, scale, part.unwrap_or(&even), part.is_none())?;
        self.account(all_reduce_bytes(len, n, self.pos), start);
        Ok(())
    }

    /// The ids of the members at positions `group`.
    fn ids_of(&self, group: &[usize]) -> Vec<usize> {
        group.iter().map(|&p| self.members[p]).collect()
    }

    /// The members change at step index `epoch`, from `before` to `after` (ids, in order). Every rank
    /// of `before` calls it: they meet at a barrier whose completion installs `after`; those of `after`
    /// then take part in its collectives. A rank of `after` alone (one coming back) calls it too: it
    /// waits, without a timeout, until the others reach that change, or the run ends.
    pub fn regroup(&mut self, epoch: u64, before: &[usize], after: &[usize]) -> Result<Regroup> {
        let me = self.id;
        if before.contains(&me) {
            self.shared.lock().next = Some((epoch, after.to_vec()));
            self.shared.wait(me)?;
        } else if !self.shared.wait_for_epoch(epoch)? {
            return Ok(Regroup::Ended);
        }
        match after.iter().position(|&r| r == me) {
            Some(pos) => {
                (self.members, self.pos) = (after.to_vec(), pos);
                Ok(Regroup::Member)
            }
            None => Ok(Regroup::Away),
        }
    }

    /// The run ended: ranks waiting in `regroup` to come back return `Regroup::Ended`.
    pub fn end(&self) {
        self.shared.lock().ended = true;
        self.shared.cv.notify_all();
    }

    fn account(&mut self, bytes: u64, start: Instant) {
        self.stats.bytes_sent += bytes;
        self.stats.seconds += start.elapsed().as_secs_f64();
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.pos
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn id(&self) -> usize {
        self.id
    }

    fn ids(&self) -> Vec<usize> {
        self.members.clone()
    }

    fn regroup(&mut self, epoch: u64, before: &[usize], after: &[usize]) -> Result<Regroup> {
        LocalComm::regroup(self, epoch, before, after)
    }

    fn end(&mut self) {
        LocalComm::end(self)
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()> {
        self.all_reduce(buf, None, None)
    }

    fn all_reduce_sum_scaled(&mut self, buf: &mut [f32], scale: f32) -> Result<()> {
        self.all_reduce(buf, Some(scale), None)
    }

    fn reduce_scatter_shared(
        &mut self,
        buf: &mut [f32],
        part: &dyn Fn(usize) -> std::ops::Range<usize>,
        scale: f32,
    ) -> Result<()> {
        self.all_reduce(buf, Some(scale), Some(part))
    }

    fn group_all_reduce_sum(&mut self, buf: &mut [f32], group: &[usize]) -> Result<()> {
        let (start, len) = (Instant::now(), buf.len());
        let ids = self.ids_of(group);
        self.reduce(buf, &ids, None, &|q| chunk(len, group.len(), q), true)?;
        // What the MPI engine's reduce-scatter + all-gather within the group sends from this rank.
        let pos = group.iter().position(|&r| r == self.pos).unwrap_or(0);
        self.account(all_reduce_bytes(buf.len(), group.len(), pos), start);
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        let start = Instant::now();
        let (me, root_id) = (self.id, self.members[root]);
        if me == root_id {
            self.deposit(buf);
        }
        self.shared.wait(me)?;
        if me != root_id {
            self.sum_slots(&[root_id], buf);
        }
        self.shared.wait(me)?;
        let sent = if me == root_id {
            (self.members.len() as u64 - 1) * buf.len() as u64 * 4
        } else {
            0
        };
        self.account(sent, start);
        Ok(())
    }

    fn all_gather(&mut self, send: &[f32], out: &mut [f32]) -> Result<()> {
        let n = self.members.len();
        check_gather(send, out, n)?;
        let start = Instant::now();
        self.deposit(send);
        self.shared.wait(self.id)?;
        if !send.is_empty() {
            for (&r, piece) in self.members.iter().zip(out.chunks_mut(send.len())) {
                self.sum_slots(&[r], piece);
            }
        }
        self.shared.wait(self.id)?;
        self.account((n as u64 - 1) * send.len() as u64 * 4, start);
        Ok(())
    }

    /// Posts `send` for the barrier this rank waits at next, then takes the members' posts of it: one
    /// barrier, and no copy beyond the post.
    fn all_gather_shared(&mut self, send: &[f32], _spare: Vec<f32>) -> Result<Gathered> {
        let start = Instant::now();
        let msgs = self.post_and_take(send, "all-gather")?;
        if let Some((q, msg)) = msgs.iter().enumerate().find(|(_, m)| m.len() != send.len()) {
            bail!(
                "rank {}: all-gather of {} values, rank {q} sent {} (ranks must gather the same length)",
                self.pos,
                send.len(),
                msg.len()
            );
        }
        self.account((msgs.len() as u64 - 1) * send.len() as u64 * 4, start);
        Ok(Gathered::shared(msgs))
    }

    fn shares_memory(&self) -> bool {
        true
    }

    fn share_parts(&mut self, part: &[f32]) -> Result<Gathered> {
        Ok(Gathered::shared(
            self.post_and_take(part, "sharing of parts")?,
        ))
    }

    fn exchange(
        &mut self,
        sends: &[(usize, &[f32])],
        recvs: &mut [(usize, &mut [f32])],
    ) -> Result<()> {
        let (n, me) = (self.shared.n, self.id);
        let start = Instant::now();
        for (dst, buf) in sends {
            let mut m = self.shared.mail[me * n + self.members[*dst]]
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            m.clear();
            m.extend_from_slice(buf);
        }
        self.shared.wait(me)?;
        for (src, buf) in recvs.iter_mut() {
            let m = self.shared.mail[self.members[*src] * n + me]
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if m.len() != buf.len() {
                bail!(
                    "rank {}: exchange expected {} values from rank {src}, it sent {}",
                    self.pos,
                    buf.len(),
                    m.len()
                );
            }
            buf.copy_from_slice(&m);
        }
        self.shared.wait(me)?;
        self.account(sends.iter().map(|(_, b)| b.len() as u64 * 4).sum(), start);
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        self.shared.wait(self.id)
    }

    fn stats(&self) -> CommStats {
        self.stats.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_is_the_rank_ordered_sum_on_every_rank() {
        let comms = group(4, Duration::from_secs(10));
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let r = c.rank() as f32;
                        let mut buf = vec![r + 0.1, 1e8 * (r - 1.5), 1.0];
                        c.all_reduce_sum(&mut buf).unwrap();
                        let mut grp = vec![r];
                        let peers = if c.rank() % 2 == 0 {
                            [c.rank(), c.rank() + 1]
                        } else {
                            [c.rank() - 1, c.rank()]
                        };
                        c.group_all_reduce_sum(&mut grp, &peers).unwrap();
                        buf.extend(grp);
                        buf
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want = ((0.1f32 + 1.1) + 2.1) + 3.1;
        for (rank, r) in results.iter().enumerate() {
            assert_eq!(r[..3], results[0][..3], "bit-identical on every rank");
            assert_eq!(r[0], want);
            assert_eq!(r[2], 4.0);
            assert_eq!(r[3], if rank < 2 { 1.0 } else { 5.0 });
        }
    }

    /// Rank q's message of round r: its length is the round's, its words name q and r.
    fn message(q: usize, r: usize) -> Vec<f32> {
        (0..1 + r % 3)
            .map(|i| (1000 * q + 10 * r + i) as f32)
            .collect()
    }

    /// Back-to-back shared all-gathers, ranks running ahead of each other and holding the last round's
    /// messages into the next: every rank reads every member's message of the round it asked for, the
    /// same as `all_gather` writes, and counts the same bytes.
    #[test]
    fn shared_all_gathers_give_each_round_its_own_messages_while_ranks_run_ahead() {
        let n = 5;
        let comms = group(n, Duration::from_secs(30));
        std::thread::scope(|s| {
            for mut c in comms {
                s.spawn(move || {
                    let me = c.rank();
                    let mut last: Option<(usize, Gathered)> = None;
                    for r in 0..300 {
                        if (r + me) % 7 == 0 {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                        let now = (r, c.all_gather_shared(&message(me, r), Vec::new()).unwrap());
                        for (rr, g) in last.iter().chain([&now]) {
                            assert_eq!(g.members(), n);
                            for q in 0..n {
                                assert_eq!(
                                    g.msg(q),
                                    message(q, *rr),
                                    "rank {me}, round {r}: {q}'s"
                                );
                            }
                        }
                        last = Some(now);
                    }
                    let sent = c.stats().bytes_sent;
                    let mut out = vec![0.0; 3 * n];
                    c.all_gather(&message(me, 2), &mut out).unwrap();
                    let packed = Gathered::packed(out, n);
                    let shared = c.all_gather_shared(&message(me, 2), Vec::new()).unwrap();
                    assert!(packed.iter().eq(shared.iter()), "rank {me}");
                    let (once, twice) = (c.stats().bytes_sent - sent, 2 * (n as u64 - 1) * 12);
                    assert_eq!(
                        once, twice,
                        "rank {me}: bytes of one all_gather and one shared"
                    );
                });
            }
        });
    }

    /// Shared parts of lengths that differ by rank and round, between shared all-gathers, ranks running
    /// ahead: every rank reads every member's part of the round it asked for, and the parts count no
    /// bytes.
    #[test]
    fn shared_parts_of_any_length_interleave_with_all_gathers_and_count_nothing() {
        let n = 4;
        let part = |q: usize, r: usize| vec![(q * 1000 + r) as f32; (q + r) % 3];
        std::thread::scope(|s| {
            for mut c in group(n, Duration::from_secs(30)) {
                s.spawn(move || {
                    let me = c.rank();
                    assert!(c.shares_memory());
                    for r in 0..200 {
                        if (r + me) % 5 == 0 {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                        let sent = c.stats().bytes_sent;
                        let parts = c.share_parts(&part(me, r)).unwrap();
                        assert_eq!(c.stats().bytes_sent, sent, "rank {me}, round {r}");
                        let gathered = c.all_gather_shared(&message(me, r), Vec::new()).unwrap();
                        for q in 0..n {
                            assert_eq!(parts.msg(q), part(q, r), "rank {me}, round {r}: {q}'s");
                            assert_eq!(gathered.msg(q), message(q, r), "rank {me}, round {r}");
                        }
                    }
                });
            }
        });
    }

    #[test]
    fn a_shared_all_gather_of_unequal_lengths_fails_on_every_rank() {
        let comms = group(3, Duration::from_secs(10));
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let send = vec![1.0; if c.rank() == 1 { 2 } else { 3 }];
                        format!(
                            "{:#}",
                            c.all_gather_shared(&send, Vec::new()).err().unwrap()
                        )
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(
            errs.iter()
                .all(|e| e.contains("rank 1 sent 2") || e.contains("all-gather of 2 values")),
            "{errs:?}"
        );
    }

    #[test]
    fn a_missing_rank_times_out_with_its_name_and_a_failed_rank_stops_the_others() {
        let mut comms = group(3, Duration::from_millis(300));
        let c2 = comms.pop().unwrap();
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|mut c| s.spawn(move || c.barrier().unwrap_err().to_string()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(
            errs.iter()
                .all(|e| e.contains("[2]") && e.contains("timed out")),
            "{errs:?}"
        );

        let mut comms = group(2, Duration::from_secs(60));
        let c1 = comms.pop().unwrap();
        let mut c0 = comms.pop().unwrap();
        let start = Instant::now();
        let err = std::thread::scope(|s| {
            let h = s.spawn(move || c0.barrier().unwrap_err().to_string());
            std::thread::sleep(Duration::from_millis(50));
            c1.fail("out of memory");
            h.join().unwrap()
        });
        assert!(err.contains("rank 1 failed: out of memory"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(5));
        drop(c2);
    }
}

//! The `nccl` engine: one process per GPU, collectives through NCCL (cudarc's `nccl` module) on a CUDA
//! stream of their own, so that the gossip of step t runs beside the compute of step t + 1 on candle's
//! stream. The dense all-reduce of gradients on the GPU runs on the gradient buffer itself
//! (`all_reduce_sum_device`); the other collectives take host buffers, which this engine stages through
//! device buffers that it keeps between calls. The world all-reduce is NCCL's; group sums (gossip) and
//! `exchange` are grouped ncclSend/ncclRecv (group start/end), the group sum through the same
//! reduce-scatter + all-gather as the MPI engine. Each call waits at most `comm_timeout_secs` for the
//! stream and then fails naming the operation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut};
use cudarc::nccl::{result as nccl, Comm, Id, ReduceOp};

use super::{all_reduce_bytes, check_gather, chunk, group_sum, CommStats, Communicator};

pub struct NcclComm {
    rank: usize,
    n: usize,
    comm: Comm,
    stream: Arc<CudaStream>,
    timeout: Duration,
    /// Device staging buffers, grown on demand and kept: [0] all-reduce / all-gather input, [1] output,
    /// then one per message of an exchange.
    staging: Vec<CudaSlice<f32>>,
    scratch: Vec<f32>,
    stats: CommStats,
    /// When the first device collective not yet waited for was enqueued.
    device_since: Option<Instant>,
    /// Kernels on this engine's stream (the additions of the group sum).
    kernels: crate::cuda::Kernels,
}

fn nccl_err(e: nccl::NcclError) -> anyhow::Error {
    anyhow::anyhow!("NCCL: {e:?}")
}

impl NcclComm {
    /// Rank `rank` of `n` on GPU `ordinal`; `share_id` carries rank 0's NCCL id (128 bytes) to every
    /// rank (MPI broadcast or TCP, see `bootstrap`).
    pub fn init(
        rank: usize,
        n: usize,
        ordinal: usize,
        timeout: Duration,
        share_id: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<Self> {
        let ctx = CudaContext::new(ordinal).with_context(|| format!("opening GPU {ordinal}"))?;
        let stream = ctx.new_stream()?;
        let mut bytes = [0u8; 128];
        if rank == 0 {
            let id = Id::new().map_err(nccl_err)?;
            id.internal()
                .iter()
                .zip(&mut bytes)
                .for_each(|(&c, b)| *b = c as u8);
        }
        share_id(&mut bytes)?;
        let mut internal = [0 as core::ffi::c_char; 128];
        internal
            .iter_mut()
            .zip(&bytes)
            .for_each(|(c, &b)| *c = b as core::ffi::c_char);
        let comm =
            Comm::from_rank(stream.clone(), rank, n, Id::uninit(internal)).map_err(nccl_err)?;
        Ok(Self {
            rank,
            n,
            comm,
            timeout,
            staging: Vec::new(),
            scratch: Vec::new(),
            stats: CommStats::default(),
            device_since: None,
            kernels: crate::cuda::Kernels::new(stream.clone())?,
            stream,
        })
    }

    /// Staging buffer `i` with room for `len` values.
    fn staging(&mut self, i: usize, len: usize) -> Result<()> {
        while self.staging.len() <= i {
            self.staging.push(self.stream.alloc_zeros::<f32>(1)?);
        }
        if self.staging[i].len() < len {
            self.staging[i] = self.stream.alloc_zeros::<f32>(len)?;
        }
        Ok(())
    }

    /// Orders this engine's stream after the work queued so far on `streams` (the callers' buffers'):
    /// a collective must not read a buffer before the kernels that write it have run, nor write one that
    /// the stream-ordered allocator has not handed out yet. cudarc's events do this only for buffers that
    /// it tracks; the gradient buffer is not tracked (`Place::zeros_for_collectives`).
    fn after(&self, streams: &[&Arc<CudaStream>]) -> Result<()> {
        for (i, s) in streams.iter().enumerate() {
            if !streams[..i].iter().any(|o| Arc::ptr_eq(o, s)) {
                self.stream.wait(&s.record_event(None)?)?;
            }
        }
        Ok(())
    }

    /// Waits for the stream's work, at most the timeout; `op` names the call in the error.
    fn wait(&self, op: &str) -> Result<()> {
        let done = self.stream.record_event(None)?;
        let deadline = Instant::now() + self.timeout;
        while !done.try_is_complete()? {
            if Instant::now() > deadline {
                bail!(
                    "rank {}: timed out after {:?} in NCCL {op} (a peer died or hangs)",
                    self.rank,
                    self.timeout
                );
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    fn account(&mut self, bytes: u64, start: Instant) {
        self.stats.bytes_sent += bytes;
        self.stats.seconds += start.elapsed().as_secs_f64();
    }

    /// Grouped send/recv through staging buffers 2.. (one per message); returns the bytes sent.
    fn exchange_raw(
        &mut self,
        sends: &[(usize, &[f32])],
        recvs: &mut [(usize, &mut [f32])],
    ) -> Result<u64> {
        let first_recv = 2 + sends.len();
        for (i, (_, buf)) in sends.iter().enumerate() {
            self.staging(2 + i, buf.len())?;
            let mut dst = self.staging[2 + i].slice_mut(..buf.len());
            self.stream.memcpy_htod(*buf, &mut dst)?;
        }
        for (j, (_, buf)) in recvs.iter().enumerate() {
            self.staging(first_recv + j, buf.len())?;
        }
        {
            let (send_bufs, recv_bufs) = self.staging[2..].split_at_mut(sends.len());
            nccl::group_start().map_err(nccl_err)?;
            for ((peer, buf), dev) in sends.iter().zip(send_bufs.iter()) {
                self.comm
                    .send(&dev.slice(..buf.len()), *peer as i32)
                    .map_err(nccl_err)?;
            }
            for ((peer, buf), dev) in recvs.iter().zip(recv_bufs.iter_mut()) {
                self.comm
                    .recv(&mut dev.slice_mut(..buf.len()), *peer as i32)
                    .map_err(nccl_err)?;
            }
            nccl::group_end().map_err(nccl_err)?;
        }
        for (j, (_, buf)) in recvs.iter_mut().enumerate() {
            let len = buf.len();
            self.stream
                .memcpy_dtoh(&self.staging[first_recv + j].slice(..len), *buf)?;
        }
        self.wait("send/recv")?;
        Ok(sends.iter().map(|(_, b)| b.len() as u64 * 4).sum())
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.n
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()> {
        if self.n == 1 {
            return Ok(());
        }
        let start = Instant::now();
        self.staging(0, buf.len())?;
        let mut dev = self.staging[0].slice_mut(..buf.len());
        self.stream.memcpy_htod(&*buf, &mut dev)?;
        self.comm
            .all_reduce_in_place(&mut dev, &ReduceOp::Sum)
            .map_err(nccl_err)?;
        self.stream.memcpy_dtoh(&dev, buf)?;
        self.wait("all_reduce")?;
        self.account(all_reduce_bytes(buf.len(), self.n, self.rank), start);
        Ok(())
    }

    fn group_all_reduce_sum(&mut self, buf: &mut [f32], group: &[usize]) -> Result<()> {
        if !group.contains(&self.rank) {
            bail!(
                "rank {} called a group all-reduce for group {group:?} without being in it",
                self.rank
            );
        }
        let start = Instant::now();
        let mut scratch = std::mem::take(&mut self.scratch);
        let rank = self.rank;
        let bytes = group_sum(rank, buf, group, &mut scratch, &mut |s, r| {
            self.exchange_raw(s, r)
        });
        self.scratch = scratch;
        self.account(bytes?, start);
        Ok(())
    }

    fn all_gather(&mut self, send: &[f32], out: &mut [f32]) -> Result<()> {
        check_gather(send, out, self.n)?;
        let start = Instant::now();
        self.staging(0, send.len())?;
        self.staging(1, out.len())?;
        let (input, output) = self.staging.split_at_mut(1);
        let mut src = input[0].slice_mut(..send.len());
        self.stream.memcpy_htod(send, &mut src)?;
        let mut dst = output[0].slice_mut(..out.len());
        self.comm.all_gather(&src, &mut dst).map_err(nccl_err)?;
        self.stream.memcpy_dtoh(&dst, out)?;
        self.wait("all_gather")?;
        self.account(4 * (send.len() * (self.n - 1)) as u64, start);
        Ok(())
    }

    fn exchange(
        &mut self,
        sends: &[(usize, &[f32])],
        recvs: &mut [(usize, &mut [f32])],
    ) -> Result<()> {
        let start = Instant::now();
        let bytes = self.exchange_raw(sends, recvs)?;
        self.account(bytes, start);
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        let start = Instant::now();
        self.staging(0, buf.len())?;
        let mut dev = self.staging[0].slice_mut(..buf.len());
        self.stream.memcpy_htod(&*buf, &mut dev)?;
        self.comm
            .broadcast_in_place(&mut dev, root as i32)
            .map_err(nccl_err)?;
        self.stream.memcpy_dtoh(&dev, buf)?;
        self.wait("broadcast")?;
        let sent = if self.rank == root { self.n - 1 } else { 0 };
        self.account(4 * (buf.len() * sent) as u64, start);
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        let mut token = [0.0f32];
        let stats = self.stats.clone();
        self.all_reduce_sum(&mut token)?;
        // A barrier moves no payload: keep only its time.
        let seconds = self.stats.seconds;
        self.stats = CommStats { seconds, ..stats };
        Ok(())
    }

    fn stats(&self) -> CommStats {
        self.stats.clone()
    }

    fn device_collectives(&self) -> bool {
        true
    }

    /// NCCL's all-reduce on the buffer itself, on this engine's stream, ordered after the work queued on
    /// `after` by an event (the gradient buffer is outside cudarc's automatic tracking: see
    /// `Place::zeros_for_collectives`); counted when enqueued, timed by `finish_device`.
    fn all_reduce_sum_device(
        &mut self,
        buf: &mut CudaViewMut<f32>,
        after: &CudaStream,
    ) -> Result<()> {
        if self.n == 1 {
            return Ok(());
        }
        self.device_since.get_or_insert_with(Instant::now);
        self.stream.wait(&after.record_event(None)?)?;
        self.comm
            .all_reduce_in_place(buf, &ReduceOp::Sum)
            .map_err(nccl_err)?;
        self.stats.bytes_sent += all_reduce_bytes(buf.len(), self.n, self.rank);
        Ok(())
    }

    /// The group sum of `group_sum` (the MPI engine's and the host path's order: a reduce-scatter in
    /// which member i owns chunk i and adds the members' copies in group order, then an all-gather), on
    /// the buffer itself: grouped ncclSend/ncclRecv into device scratch, the additions by the `add_at`
    /// kernel, all on this engine's stream.
    fn exchange_device(
        &mut self,
        send: &CudaSlice<f32>,
        sends: &[(usize, std::ops::Range<usize>)],
        recv: &mut CudaSlice<f32>,
        recvs: &[(usize, std::ops::Range<usize>)],
    ) -> Result<()> {
        let outside = |(peer, r): &&(usize, std::ops::Range<usize>), len: usize| {
            r.end > len || *peer >= self.n
        };
        if let Some((peer, r)) = sends
            .iter()
            .find(|x| outside(x, send.len()))
            .or_else(|| recvs.iter().find(|x| outside(x, recv.len())))
        {
            bail!("exchange: {r:?} with rank {peer} is outside the buffers or the world");
        }
        let start = Instant::now();
        self.after(&[send.stream(), recv.stream()])?;
        nccl::group_start().map_err(nccl_err)?;
        for (peer, r) in sends {
            self.comm
                .send(&send.slice(r.clone()), *peer as i32)
                .map_err(nccl_err)?;
        }
        for (peer, r) in recvs {
            self.comm
                .recv(&mut recv.slice_mut(r.clone()), *peer as i32)
                .map_err(nccl_err)?;
        }
        nccl::group_end().map_err(nccl_err)?;
        self.wait("send/recv")?;
        self.account(
            4 * sends.iter().map(|(_, r)| r.len() as u64).sum::<u64>(),
            start,
        );
        Ok(())
    }

    fn group_all_reduce_sum_device(
        &mut self,
        buf: &mut CudaSlice<f32>,
        group: &[usize],
    ) -> Result<()> {
        let Some(me) = group.iter().position(|&r| r == self.rank) else {
            bail!(
                "rank {} called a group all-reduce for group {group:?} without being in it",
                self.rank
            );
        };
        let (g, len) = (group.len(), buf.len());
        if g == 1 {
            return Ok(());
        }
        let start = Instant::now();
        self.after(&[buf.stream()])?;
        let mine = chunk(len, g, me);
        let m = mine.len();
        self.staging(0, m * g)?;
        self.staging(1, m.max(1))?;
        let others = || (0..g).filter(move |&i| i != me);
        // Reduce-scatter: member i's copy of my chunk into scratch slot i.
        let mut bytes = 0u64;
        nccl::group_start().map_err(nccl_err)?;
        for i in others() {
            let c = chunk(len, g, i);
            bytes += 4 * c.len() as u64;
            self.comm
                .send(&buf.slice(c), group[i] as i32)
                .map_err(nccl_err)?;
        }
        for i in others() {
            let mut slot = self.staging[0].slice_mut(i * m..(i + 1) * m);
            self.comm
                .recv(&mut slot, group[i] as i32)
                .map_err(nccl_err)?;
        }
        nccl::group_end().map_err(nccl_err)?;
        // ((x0 + x1) + x2) + ... in group order, my own copy in slot `me`.
        let s = self.stream.clone();
        s.memcpy_dtod(
            &buf.slice(mine.clone()),
            &mut self.staging[0].slice_mut(me * m..(me + 1) * m),
        )?;
        s.memcpy_dtod(
            &self.staging[0].slice(..m),
            &mut buf.slice_mut(mine.clone()),
        )?;
        for i in 1..g {
            let part = self.staging[0].slice(i * m..(i + 1) * m);
            self.kernels.add_at(buf, mine.start, &part)?;
        }
        // All-gather the reduced chunks.
        s.memcpy_dtod(
            &buf.slice(mine.clone()),
            &mut self.staging[1].slice_mut(..m),
        )?;
        nccl::group_start().map_err(nccl_err)?;
        for i in others() {
            bytes += 4 * m as u64;
            self.comm
                .send(&self.staging[1].slice(..m), group[i] as i32)
                .map_err(nccl_err)?;
        }
        for i in others() {
            self.comm
                .recv(&mut buf.slice_mut(chunk(len, g, i)), group[i] as i32)
                .map_err(nccl_err)?;
        }
        nccl::group_end().map_err(nccl_err)?;
        self.wait("group all-reduce")?;
        self.account(bytes, start);
        Ok(())
    }

    fn all_gather_device(&mut self, send: &CudaView<f32>, out: &mut CudaSlice<f32>) -> Result<()> {
        if out.len() != self.n * send.len() {
            bail!(
                "all_gather: output holds {} values, expected world size {} x {}",
                out.len(),
                self.n,
                send.len()
            );
        }
        let start = Instant::now();
        self.after(&[out.stream()])?;
        self.comm.all_gather(send, out).map_err(nccl_err)?;
        self.wait("all_gather")?;
        self.account(4 * (send.len() * (self.n - 1)) as u64, start);
        Ok(())
    }

    fn finish_device(&mut self, before: &CudaStream) -> Result<()> {
        let Some(start) = self.device_since.take() else {
            return Ok(());
        };
        self.wait("all_reduce")?;
        before.wait(&self.stream.record_event(None)?)?;
        self.stats.seconds += start.elapsed().as_secs_f64();
        Ok(())
    }
}

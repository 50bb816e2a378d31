//! Communicators: the only code that touches a transport. The training loop and the sync backends see
//! this trait alone, so engines (threads, MPI, NCCL) plug in without changing callers.

pub mod bootstrap;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;

use anyhow::Result;

use crate::flat::FlatMut;

/// Bytes this rank sent and seconds it spent in collectives, totals since the communicator started.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommStats {
    pub bytes_sent: u64,
    pub seconds: f64,
}

/// A u64 carried in two f32 bit patterns (high word first), for collectives and checkpoints that move
/// bytes and do no arithmetic on them (broadcast, all-gather, safetensors buffers).
pub fn pack_u64(x: u64) -> [f32; 2] {
    [f32::from_bits((x >> 32) as u32), f32::from_bits(x as u32)]
}

/// The u64 of `pack_u64`.
pub fn unpack_u64([hi, lo]: [f32; 2]) -> u64 {
    ((hi.to_bits() as u64) << 32) | lo.to_bits() as u64
}

/// Open MPI settings nanodist runs with, as the environment variables Open MPI reads at MPI_Init.
///
/// `btl_tcp_flags` without `put`: past 192 kB, Open MPI's TCP transport moves a message by emulated RDMA
/// writes that the receiver requests piece by piece, on the connection that carries its own data. In a
/// pair's exchange (a 2-rank all-reduce, a gossip pair) each side's requests then queue behind its
/// outgoing data: between two hosts at 50 Mbit/s, the quick-start model's 3.25 MB exchange took 0.55 s
/// in some steps and up to 1.1 s in others, by chance. Without `put` the sender streams after one
/// handshake, and every step took 0.59-0.66 s.
pub const OPEN_MPI_DEFAULTS: [(&str, &str); 1] = [(
    "OMPI_MCA_btl_tcp_flags",
    "send,inplace,need-ack,need-csum,hetero-rdma",
)];

/// The `OPEN_MPI_DEFAULTS` to set, given which variables the environment already `has`: a value there
/// (`mpirun --mca btl_tcp_flags ...` puts it there) wins.
pub fn open_mpi_defaults(has: impl Fn(&str) -> bool) -> Vec<(&'static str, &'static str)> {
    OPEN_MPI_DEFAULTS
        .into_iter()
        .filter(|(key, _)| !has(key))
        .collect()
}

/// Chunk c of a buffer of `len` elements split over `n` ranks (the first `len % n` chunks are one longer).
pub fn chunk(len: usize, n: usize, c: usize) -> std::ops::Range<usize> {
    let (base, extra) = (len / n, len % n);
    let start = c * base + c.min(extra);
    start..start + base + usize::from(c < extra)
}

/// How the workers of a shared replica (`train::replica`) divide the flat buffers: whole tiles of
/// `tile` elements, rank r of n owning tiles [r T / n, (r + 1) T / n) of the T tiles.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Parts {
    pub len: usize,
    pub n: usize,
    pub tile: usize,
}

impl Parts {
    pub fn tiles(&self) -> usize {
        self.len.div_ceil(self.tile)
    }

    /// Rank `rank`'s tiles.
    pub fn tiles_of(&self, rank: usize) -> std::ops::Range<usize> {
        let t = self.tiles();
        t * rank / self.n..t * (rank + 1) / self.n
    }

    /// Rank `rank`'s elements.
    pub fn of(&self, rank: usize) -> std::ops::Range<usize> {
        let t = self.tiles_of(rank);
        (t.start * self.tile).min(self.len)..(t.end * self.tile).min(self.len)
    }
}

/// Bytes the member at position `rank` of `n` sends in an all-reduce of `len` f32 by reduce-scatter +
/// all-gather (the bandwidth of a ring all-reduce, 2 (N - 1) / N of the buffer): every chunk but its own,
/// then its own to N - 1 peers.
pub fn all_reduce_bytes(len: usize, n: usize, rank: usize) -> u64 {
    let mine = chunk(len, n, rank).len();
    4 * ((len - mine) + (n - 1) * mine) as u64
}

/// Element-wise mean over all ranks, in place: the rank-ordered sum, then times 1 / N.
pub fn all_reduce_mean(comm: &mut dyn Communicator, buf: &mut [f32]) -> Result<()> {
    let n = comm.world_size();
    if n > 1 {
        comm.all_reduce_sum_scaled(buf, 1.0 / n as f32)?;
    }
    Ok(())
}

/// `all_reduce_mean` of a flat buffer wherever it lives: on the GPU with the engine's device
/// collectives, otherwise through host memory.
pub fn all_reduce_mean_flat(comm: &mut dyn Communicator, buf: FlatMut<'_>) -> Result<()> {
    match buf {
        #[cfg(feature = "cuda")]
        FlatMut::Cuda(d) if comm.device_collectives() => {
            all_reduce_mean_device(comm, &mut d.buf, &d.kernels)
        }
        b => b.through_host(|h| all_reduce_mean(comm, h)),
    }
}

/// `all_reduce_sum` of a flat buffer wherever it lives (as `all_reduce_mean_flat`).
pub fn all_reduce_sum_flat(comm: &mut dyn Communicator, buf: FlatMut<'_>) -> Result<()> {
    match buf {
        #[cfg(feature = "cuda")]
        FlatMut::Cuda(d) if comm.device_collectives() => {
            if comm.world_size() > 1 && !d.buf.is_empty() {
                comm.all_reduce_sum_device(&mut d.buf.slice_mut(..), d.kernels.stream())?;
                comm.finish_device(d.kernels.stream())?;
            }
            Ok(())
        }
        b => b.through_host(|h| comm.all_reduce_sum(h)),
    }
}

/// `all_reduce_mean` of a GPU buffer, in place on the device (engines with `device_collectives`): the
/// rank-ordered sum, then times 1 / N (the `scale` kernel), as on the host.
#[cfg(feature = "cuda")]
pub fn all_reduce_mean_device(
    comm: &mut dyn Communicator,
    buf: &mut cudarc::driver::CudaSlice<f32>,
    kernels: &crate::cuda::Kernels,
) -> Result<()> {
    let n = comm.world_size();
    if n > 1 && !buf.is_empty() {
        comm.all_reduce_sum_device(&mut buf.slice_mut(..), kernels.stream())?;
        comm.finish_device(kernels.stream())?;
        kernels.scale(buf, 1.0 / n as f32)?;
    }
    Ok(())
}

/// Every member's message of an all-gather, in rank order (`Communicator::all_gather_shared`): one
/// buffer of this rank's, or the members' own messages where the engine shares them.
pub struct Gathered(Messages);

enum Messages {
    /// `n` messages end to end.
    Packed { all: Vec<f32>, n: usize },
    /// Each member's message as it posted it (the local engine).
    Shared(Vec<std::sync::Arc<[f32]>>),
}

impl Gathered {
    /// `n` messages of equal length end to end in `all`.
    pub fn packed(all: Vec<f32>, n: usize) -> Self {
        assert!(
            n > 0 && all.len().is_multiple_of(n),
            "{} values are not {n} equal messages",
            all.len()
        );
        Self(Messages::Packed { all, n })
    }

    /// The members' messages as they posted them (of equal length for an all-gather), shared.
    pub fn shared(msgs: Vec<std::sync::Arc<[f32]>>) -> Self {
        Self(Messages::Shared(msgs))
    }

    /// How many members sent a message.
    pub fn members(&self) -> usize {
        match &self.0 {
            Messages::Packed { n, .. } => *n,
            Messages::Shared(m) => m.len(),
        }
    }

    /// Member `q`'s message.
    pub fn msg(&self, q: usize) -> &[f32] {
        match &self.0 {
            Messages::Packed { all, n } => {
                let len = all.len() / n;
                &all[q * len..][..len]
            }
            Messages::Shared(m) => &m[q],
        }
    }

    /// The messages in rank order.
    pub fn iter(&self) -> impl Iterator<Item = &[f32]> + '_ {
        (0..self.members()).map(|q| self.msg(q))
    }

    /// This rank's buffer, for the next all-gather to fill (`Communicator::all_gather_shared`'s
    /// `spare`); empty where the engine shared the messages.
    pub fn into_spare(self) -> Vec<f32> {
        match self.0 {
            Messages::Packed { all, .. } => all,
            Messages::Shared(_) => Vec::new(),
        }
    }
}

/// The output of an all-gather holds world size x the input.
fn check_gather(send: &[f32], out: &[f32], n: usize) -> Result<()> {
    if out.len() != n * send.len() {
        anyhow::bail!(
            "all_gather: output holds {} values, expected world size {n} x {}",
            out.len(),
            send.len()
        );
    }
    Ok(())
}

/// `count` consecutive pieces of `len` elements at the front of `buf` (empty pieces included, so that
/// zero-length messages are still matched).
#[cfg(any(feature = "mpi", feature = "cuda"))]
pub(crate) fn pieces(buf: &mut [f32], count: usize, len: usize) -> Vec<&mut [f32]> {
    let mut out = Vec::with_capacity(count);
    let mut tail = buf;
    for _ in 0..count {
        let (head, t) = std::mem::take(&mut tail).split_at_mut(len);
        out.push(head);
        tail = t;
    }
    out
}

/// Grouped point-to-point messages of an engine: sends `sends[i].1` to rank `sends[i].0`, receives from
/// `recvs[j].0` into `recvs[j].1`; returns the bytes sent.
#[cfg(any(feature = "mpi", feature = "cuda"))]
pub(crate) type Exchange<'a> =
    dyn FnMut(&[(usize, &[f32])], &mut [(usize, &mut [f32])]) -> Result<u64> + 'a;

/// Sum over the ranks of `group` (in group order), in place, for engines built on point-to-point
/// messages (MPI, NCCL groups): a reduce-scatter in which the member at position i owns chunk i and adds
/// the members' copies of it in group order, then an all-gather of the reduced chunks; a pair exchanges
/// whole buffers at once (`pair_sum`). Each member sends 2 (g - 1) / g of the buffer, as a ring
/// all-reduce; returns the bytes this rank sent. The sums equal the local engine's bit for bit.
#[cfg(any(feature = "mpi", feature = "cuda"))]
pub(crate) fn group_sum(
    rank: usize,
    buf: &mut [f32],
    group: &[usize],
    scratch: &mut Vec<f32>,
    exchange: &mut Exchange<'_>,
) -> Result<u64> {
    let (g, len) = (group.len(), buf.len());
    let Some(me) = group.iter().position(|&r| r == rank) else {
        return Ok(0);
    };
    if g == 1 {
        return Ok(0);
    }
    if g == 2 {
        return pair_sum(buf, group[1 - me], scratch, exchange);
    }
    let mine = chunk(len, g, me);
    // Reduce-scatter: receive every member's copy of my chunk.
    scratch.resize(mine.len() * g, 0.0);
    let mut bytes = {
        let sends: Vec<(usize, &[f32])> = (0..g)
            .filter(|&i| i != me)
            .map(|i| (group[i], &buf[chunk(len, g, i)]))
            .collect();
        let mut recvs: Vec<(usize, &mut [f32])> = pieces(scratch, g, mine.len())
            .into_iter()
            .enumerate()
            .filter(|(i, _)| *i != me)
            .map(|(i, piece)| (group[i], piece))
            .collect();
        exchange(&sends, &mut recvs)?
    };
    // Group-ordered sum, as the local engine: ((x0 + x1) + x2) + ...
    scratch[me * mine.len()..(me + 1) * mine.len()].copy_from_slice(&buf[mine.clone()]);
    let out = &mut buf[mine.clone()];
    out.copy_from_slice(&scratch[..mine.len()]);
    for i in 1..g {
        let src = &scratch[i * mine.len()..(i + 1) * mine.len()];
        out.iter_mut().zip(src).for_each(|(o, s)| *o += s);
    }
    // All-gather the reduced chunks.
    let reduced = buf[mine.clone()].to_vec();
    let mut rest: Vec<(usize, &mut [f32])> = Vec::with_capacity(g - 1);
    let mut tail: &mut [f32] = buf;
    for (i, &member) in group.iter().enumerate() {
        let (head, t) = std::mem::take(&mut tail).split_at_mut(chunk(len, g, i).len());
        tail = t;
        if i != me {
            rest.push((member, head));
        }
    }
    let sends: Vec<(usize, &[f32])> = (0..g)
        .filter(|&i| i != me)
        .map(|i| (group[i], &reduced[..]))
        .collect();
    bytes += exchange(&sends, &mut rest)?;
    Ok(bytes)
}

/// A pair's sum in one exchange: each member sends its whole buffer (the bytes of a reduce-scatter and
/// an all-gather, in one round trip instead of two) and adds the other's. Addition commutes, so both
/// members hold x0 + x1, the sum in group order.
#[cfg(any(feature = "mpi", feature = "cuda"))]
fn pair_sum(
    buf: &mut [f32],
    peer: usize,
    scratch: &mut Vec<f32>,
    exchange: &mut Exchange<'_>,
) -> Result<u64> {
    scratch.resize(buf.len(), 0.0);
    let bytes = exchange(&[(peer, &buf[..])], &mut [(peer, &mut scratch[..])])?;
    buf.iter_mut()
        .zip(scratch.iter())
        .for_each(|(b, s)| *b += s);
    Ok(bytes)
}

/// Where a rank stands after a change of members (`Communicator::regroup`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Regroup {
    /// It takes part in the collectives of the new members.
    Member,
    /// It is away until it regroups again.
    Away,
    /// The run ended while it waited to come back.
    Ended,
}

/// Collectives are called by every rank in the same order. Engines count the bytes each rank sends.
pub trait Communicator {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// This rank's place in the whole world: its rank, unless some ranks are away (the local engine's
    /// membership schedule), when `rank` is its position among those present.
    fn id(&self) -> usize {
        self.rank()
    }
    /// The ids of the ranks taking part now, in rank order.
    fn ids(&self) -> Vec<usize> {
        (0..self.world_size()).collect()
    }
    /// The ranks taking part change at step index `epoch` from the ids `before` to `after`: every rank
    /// of either calls it (see `local::LocalComm::regroup`). Only the local engine's ranks leave and come
    /// back.
    fn regroup(&mut self, _epoch: u64, _before: &[usize], _after: &[usize]) -> Result<Regroup> {
        anyhow::bail!("internal error: only the local engine's workers leave and come back")
    }
    /// The run ended: ranks waiting to come back stop waiting.
    fn end(&mut self) {}
    /// Element-wise sum over all ranks, in place.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()>;
    /// The sum over all ranks times `scale` (the mean, with 1 / N), in place: each element's sum, then
    /// its product with `scale`. The local engine multiplies while it reduces (one pass over the buffer
    /// less); the others reduce, then scale.
    fn all_reduce_sum_scaled(&mut self, buf: &mut [f32], scale: f32) -> Result<()> {
        self.all_reduce_sum(buf)?;
        buf.iter_mut().for_each(|x| *x *= scale);
        Ok(())
    }
    /// The all-reduce of a replica the ranks share (the local engine's, see `train::replica`): each
    /// rank's elements `part(rank)` of `buf` (the parts cover `buf`) become the sum over all ranks times
    /// `scale`, the rest of its `buf` stays as it was. The all-reduce's all-gather is left out because the
    /// update that follows reads each part on its owner alone; the bytes counted are the all-reduce's.
    fn reduce_scatter_shared(
        &mut self,
        _buf: &mut [f32],
        _part: &dyn Fn(usize) -> std::ops::Range<usize>,
        _scale: f32,
    ) -> Result<()> {
        anyhow::bail!("internal error: only the local engine's workers share a replica")
    }
    /// Sum over the ranks of `group` (this rank among them), in place. Every rank calls it in the same
    /// round, each with its own group; groups of one round are disjoint (gossip mixing).
    fn group_all_reduce_sum(&mut self, buf: &mut [f32], group: &[usize]) -> Result<()>;
    /// Concatenation of every rank's `send` (all the same length), in rank order, into `out`.
    fn all_gather(&mut self, send: &[f32], out: &mut [f32]) -> Result<()>;
    /// Every rank's `send` (all the same length), in rank order, where the engine may share the messages
    /// instead of copying them into a buffer of this rank's: the local engine's N ranks then hold N
    /// messages, not N^2 (each rank decodes what it needs from them). The same bytes on the wire as
    /// `all_gather`. The messages land in `spare` (the last all-gather's buffer, `Gathered::into_spare`),
    /// grown where it is too small: a fresh buffer each step would be mapped anew each step.
    fn all_gather_shared(&mut self, send: &[f32], spare: Vec<f32>) -> Result<Gathered> {
        let n = self.world_size();
        let mut all = spare;
        all.resize(send.len() * n, 0.0);
        self.all_gather(send, &mut all)?;
        Ok(Gathered::packed(all, n))
    }
    /// Whether the ranks share one address space (the local engine's threads): `share_parts` then hands
    /// each rank the others' parts in place.
    fn shares_memory(&self) -> bool {
        false
    }
    /// Where `shares_memory`: every member's `part` (of any length) in rank order, read in place, at one
    /// barrier. Nothing is counted as sent: nothing crosses a wire. Ranks split work whose result each of
    /// them needs (each computes a part, then all read every part).
    fn share_parts(&mut self, _part: &[f32]) -> Result<Gathered> {
        anyhow::bail!("internal error: share_parts on an engine whose ranks do not share memory")
    }
    /// Grouped point-to-point: sends `sends[i].1` to rank `sends[i].0` and receives from rank `recvs[j].0`
    /// into `recvs[j].1`, all in one call (the shape of NCCL's group start/end). Every rank calls it in
    /// the same round, with or without peers; the sizes of matching sends and receives agree.
    fn exchange(
        &mut self,
        sends: &[(usize, &[f32])],
        recvs: &mut [(usize, &mut [f32])],
    ) -> Result<()>;
    /// Copies `root`'s buffer to every rank.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()>;
    fn barrier(&mut self) -> Result<()>;
    /// Totals since the start.
    fn stats(&self) -> CommStats;
    /// Whether this engine runs collectives on GPU buffers (NCCL), so that callers need no host copy.
    #[cfg(feature = "cuda")]
    fn device_collectives(&self) -> bool {
        false
    }
    /// Enqueues `all_reduce_sum` of a GPU buffer, in place on the device, after the work queued so far
    /// on stream `after` (engines with `device_collectives`); `finish_device` waits for it.
    #[cfg(feature = "cuda")]
    fn all_reduce_sum_device(
        &mut self,
        _buf: &mut cudarc::driver::CudaViewMut<f32>,
        _after: &cudarc::driver::CudaStream,
    ) -> Result<()> {
        anyhow::bail!("internal error: this engine has no collectives on GPU buffers")
    }
    /// `exchange` on GPU buffers (engines with `device_collectives`): sends send[range] to each peer of
    /// `sends` and receives from each peer of `recvs` into recv[range], as one group of point-to-point
    /// calls; done when it returns.
    #[cfg(feature = "cuda")]
    fn exchange_device(
        &mut self,
        _send: &cudarc::driver::CudaSlice<f32>,
        _sends: &[(usize, std::ops::Range<usize>)],
        _recv: &mut cudarc::driver::CudaSlice<f32>,
        _recvs: &[(usize, std::ops::Range<usize>)],
    ) -> Result<()> {
        anyhow::bail!("internal error: this engine has no collectives on GPU buffers")
    }
    /// `group_all_reduce_sum` of a GPU buffer, in place on the device (engines with
    /// `device_collectives`), done when it returns.
    #[cfg(feature = "cuda")]
    fn group_all_reduce_sum_device(
        &mut self,
        _buf: &mut cudarc::driver::CudaSlice<f32>,
        _group: &[usize],
    ) -> Result<()> {
        anyhow::bail!("internal error: this engine has no collectives on GPU buffers")
    }
    /// `all_gather` of GPU buffers on the device (engines with `device_collectives`), done when it
    /// returns.
    #[cfg(feature = "cuda")]
    fn all_gather_device(
        &mut self,
        _send: &cudarc::driver::CudaView<f32>,
        _out: &mut cudarc::driver::CudaSlice<f32>,
    ) -> Result<()> {
        anyhow::bail!("internal error: this engine has no collectives on GPU buffers")
    }
    /// Waits for the collectives enqueued on the device (at most the engine's timeout), and makes the
    /// work queued next on stream `before` wait for them too.
    #[cfg(feature = "cuda")]
    fn finish_device(&mut self, _before: &cudarc::driver::CudaStream) -> Result<()> {
        Ok(())
    }
}

/// World size 1: every collective is the identity and nothing crosses a wire.
#[derive(Debug, Default)]
pub struct Solo;

impl Communicator for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&mut self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn group_all_reduce_sum(&mut self, _buf: &mut [f32], _group: &[usize]) -> Result<()> {
        Ok(())
    }
    fn all_gather(&mut self, send: &[f32], out: &mut [f32]) -> Result<()> {
        check_gather(send, out, 1)?;
        out.copy_from_slice(send);
        Ok(())
    }
    fn exchange(
        &mut self,
        sends: &[(usize, &[f32])],
        recvs: &mut [(usize, &mut [f32])],
    ) -> Result<()> {
        if !sends.is_empty() || !recvs.is_empty() {
            anyhow::bail!("exchange with peers in a world of one rank");
        }
        Ok(())
    }
    fn broadcast(&mut self, _buf: &mut [f32], _root: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&mut self) -> Result<()> {
        Ok(())
    }
    fn stats(&self) -> CommStats {
        CommStats::default()
    }
}

/// A rank's place in a world that never runs: backends built on it describe their communication
/// (`SyncBackend::step_comm`, for `nanodist predict`) and refuse to communicate.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub rank: usize,
    pub world: usize,
}

impl Shape {
    fn refuse<T>(&self) -> Result<T> {
        anyhow::bail!(
            "internal error: a described world (rank {} of {}) cannot communicate",
            self.rank,
            self.world
        )
    }
}

impl Communicator for Shape {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_reduce_sum(&mut self, _buf: &mut [f32]) -> Result<()> {
        self.refuse()
    }
    fn group_all_reduce_sum(&mut self, _buf: &mut [f32], _group: &[usize]) -> Result<()> {
        self.refuse()
    }
    fn all_gather(&mut self, _send: &[f32], _out: &mut [f32]) -> Result<()> {
        self.refuse()
    }
    fn exchange(
        &mut self,
        _sends: &[(usize, &[f32])],
        _recvs: &mut [(usize, &mut [f32])],
    ) -> Result<()> {
        self.refuse()
    }
    fn broadcast(&mut self, _buf: &mut [f32], _root: usize) -> Result<()> {
        self.refuse()
    }
    fn barrier(&mut self) -> Result<()> {
        self.refuse()
    }
    fn stats(&self) -> CommStats {
        CommStats::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_mpi_defaults_fill_in_only_what_the_environment_lacks() {
        let all = open_mpi_defaults(|_| false);
        assert_eq!(all, OPEN_MPI_DEFAULTS.to_vec());
        assert!(all.iter().all(|(k, _)| k.starts_with("OMPI_MCA_")));
        assert!(open_mpi_defaults(|k| k == "OMPI_MCA_btl_tcp_flags").is_empty());
    }

    #[test]
    fn u64_survives_packing_into_f32_bit_patterns() {
        for x in [
            0,
            1,
            0xffff,
            1 << 48,
            0x7fc0_0001_7f80_0001,
            u64::MAX,
            1_763_900_000,
        ] {
            assert_eq!(unpack_u64(pack_u64(x)), x);
        }
    }

    /// A pair sums in one exchange of whole buffers, sending the ring volume, and both members hold
    /// x0 + x1 bit for bit (values whose sum rounds).
    #[cfg(any(feature = "mpi", feature = "cuda"))]
    #[test]
    fn a_pair_sums_in_one_exchange_to_the_group_ordered_sum() {
        let len = 1001;
        let x: [Vec<f32>; 2] =
            [0, 1].map(|r| (0..len).map(|i| 0.1 + (i * 7 + r) as f32 * 1e-7).collect());
        let want: Vec<u32> = (0..len).map(|i| (x[0][i] + x[1][i]).to_bits()).collect();
        let group = [4, 9];
        for me in 0..2 {
            let (mut buf, mut scratch, mut calls) = (x[me].clone(), Vec::new(), 0);
            let bytes = group_sum(group[me], &mut buf, &group, &mut scratch, &mut |s, r| {
                calls += 1;
                assert_eq!(
                    (s.len(), r.len(), s[0].0, r[0].0),
                    (1, 1, group[1 - me], group[1 - me])
                );
                r[0].1.copy_from_slice(&x[1 - me]);
                Ok(s[0].1.len() as u64 * 4)
            })
            .unwrap();
            assert_eq!((calls, bytes), (1, all_reduce_bytes(len, 2, me)));
            assert_eq!(buf.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
        }
    }

    #[test]
    fn chunks_tile_the_buffer_and_all_reduce_bytes_are_the_ring_volume() {
        for len in [0, 1, 5, 7, 64, 1001] {
            for n in 1..9 {
                let mut next = 0;
                for c in 0..n {
                    let r = chunk(len, n, c);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
                if len % n == 0 {
                    assert_eq!(
                        all_reduce_bytes(len, n, 0),
                        (2 * (n - 1) * len * 4 / n) as u64
                    );
                }
            }
        }
    }
}

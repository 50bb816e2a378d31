//! Communicators: the only code that touches a transport. The training loop and the sync backends see
//! this trait alone, so engines (threads, MPI, NCCL) plug in without changing callers.

pub mod local;

use anyhow::Result;

/// Bytes and time spent in collectives, per operation kind.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommStats {
    pub bytes_sent: u64,
    pub seconds: f64,
    pub calls: u64,
}

pub trait Communicator: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Element-wise sum over all ranks, in place.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()>;
    /// Sum over the ranks of `group` (this rank among them), in place. Every rank calls it in the same
    /// round, each with its own group; groups of one round are disjoint (gossip mixing).
    fn group_all_reduce_sum(&mut self, buf: &mut [f32], group: &[usize]) -> Result<()>;
    /// Copies `root`'s buffer to every rank.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()>;
    fn barrier(&mut self) -> Result<()>;
    /// Totals since the start.
    fn stats(&self) -> CommStats;
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

//! Sync backends: where the algorithms differ. Hooks: reduce gradients before the optimizer step
//! (allreduce, compressed reducers), mix parameters after it (gossip).

use anyhow::Result;

use crate::bad_input;
use crate::comm::{CommStats, Communicator, Solo};
use crate::config::{Backend, Config, Engine, Plan};

pub trait SyncBackend: Send {
    fn name(&self) -> &'static str;
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Turns this worker's gradient into the gradient of the update (e.g. the average over workers).
    fn reduce_grads(&mut self, grads: &mut [f32]) -> Result<()>;
    /// Runs after the optimizer step (gossip mixes parameters here); allreduce has nothing to do.
    fn after_step(&mut self, params: &mut [f32], step: u64) -> Result<()>;
    /// Mean over workers of a few scalars (losses for logging).
    fn mean_scalars(&mut self, xs: &mut [f32]) -> Result<()>;
    fn comm_stats(&self) -> CommStats;
}

/// Data parallel by gradient averaging, as PyTorch DDP: buckets of the name-ordered flat gradient are
/// summed by all-reduce and divided by the world size.
pub struct AllReduce {
    comm: Box<dyn Communicator>,
    bucket_elems: usize,
}

impl AllReduce {
    pub fn new(comm: Box<dyn Communicator>, bucket_mb: f64) -> Self {
        let bucket_elems = ((bucket_mb * 1e6 / 4.0) as usize).max(1);
        Self { comm, bucket_elems }
    }
}

impl SyncBackend for AllReduce {
    fn name(&self) -> &'static str {
        "pytorchddp"
    }
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }
    fn reduce_grads(&mut self, grads: &mut [f32]) -> Result<()> {
        let n = self.comm.world_size();
        if n == 1 {
            return Ok(());
        }
        for bucket in grads.chunks_mut(self.bucket_elems) {
            self.comm.all_reduce_sum(bucket)?;
        }
        let inv = 1.0 / n as f32;
        grads.iter_mut().for_each(|g| *g *= inv);
        Ok(())
    }
    fn after_step(&mut self, _params: &mut [f32], _step: u64) -> Result<()> {
        Ok(())
    }
    fn mean_scalars(&mut self, xs: &mut [f32]) -> Result<()> {
        self.comm.all_reduce_sum(xs)?;
        let inv = 1.0 / self.comm.world_size() as f32;
        xs.iter_mut().for_each(|x| *x *= inv);
        Ok(())
    }
    fn comm_stats(&self) -> CommStats {
        self.comm.stats()
    }
}

/// The backend this build can run for `plan`, or a clear error naming what exists.
pub fn build(cfg: &Config, plan: &Plan) -> Result<Box<dyn SyncBackend>> {
    const DONE: &str =
        "implemented so far: backend \"pytorchddp\" with engine \"local\" and one worker";
    if plan.engine != Engine::Local {
        return Err(bad_input!(
            "train.engine = {:?} is validated but not implemented in this build; {DONE}",
            plan.engine.name()
        ));
    }
    if let Some(c) = &cfg.train.compression {
        return Err(bad_input!(
            "train.compression {:?} is validated but not implemented yet; {DONE}",
            c.name()
        ));
    }
    match plan.backend {
        Backend::PytorchDdp if plan.world_size == 1 => Ok(Box::new(AllReduce::new(
            Box::new(Solo),
            cfg.train.bucket_size_mb.unwrap_or(25.0),
        ))),
        Backend::PytorchDdp => Err(bad_input!(
            "{} local workers: multi-worker engines are not implemented yet; {DONE}",
            plan.world_size
        )),
        Backend::DecentDp => Err(bad_input!(
            "backend \"decentdp\" is validated but not implemented yet; {DONE}"
        )),
    }
}

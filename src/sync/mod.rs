//! Sync backends: where the algorithms differ. Hooks: reduce gradients before the optimizer step
//! (allreduce, compressed reducers, DeMo), mix or sync parameters after it (gossip, DiLoCo, SPARTA), and
//! the model to evaluate and checkpoint (the replicas' average, or DiLoCo's global model).

pub mod bits;
pub mod choco;
pub mod compress;
pub mod demo;
pub mod diloco;
pub mod plan;
pub mod quantize;
pub mod sparta;
pub mod topology;
pub mod trace;

use anyhow::Result;

use crate::comm::{all_reduce_mean, CommStats, Communicator, Parts};
use crate::flat::{Flat, FlatMut, FlatRef, Place};
use crate::kernels::optim::Fold;
use plan::SyncPlan;
use topology::Round;
use trace::{Collective, Op, Overlap};

pub trait SyncBackend {
    fn name(&self) -> &'static str;
    /// The transport this backend runs on.
    fn comm(&self) -> &dyn Communicator;
    fn comm_mut(&mut self) -> &mut dyn Communicator;
    fn rank(&self) -> usize {
        self.comm().rank()
    }
    /// The collectives this backend runs in step `step` (from its forward pass to its next), as data: what
    /// the engines count in `comm_bytes` and what `nanodist predict` prices. Bookkeeping (loss means,
    /// evaluation, votes, checkpoints) is not part of it.
    fn step_comm(&self, step: u64) -> Vec<Collective>;
    fn world_size(&self) -> usize {
        self.comm().world_size()
    }
    /// Turns this worker's gradient of step `step` (learning rate `lr`) into the gradient of the update
    /// (e.g. the average over workers, a compressed approximation of it, or DeMo's sign direction).
    /// Backends that leave gradients local (gossip, DiLoCo, SPARTA) keep this default.
    fn reduce_grads(&mut self, _grads: &mut [f32], _step: u64, _lr: f64) -> Result<()> {
        Ok(())
    }
    /// The workers share one replica divided into `parts` (the local engine, see `train::replica`),
    /// whose update reads each rank's part of the reduced gradient alone: the backend may leave the rest
    /// of the rank's gradient unreduced (the dense all-reduce and DeMo do; the others reduce it all).
    fn share_replica(&mut self, _parts: Parts) {}
    /// `reduce_grads` on the gradient wherever it lives: on the GPU through a host copy, unless the
    /// backend reduces there itself (the dense all-reduce on an engine with device collectives).
    fn reduce_flat(&mut self, grads: FlatMut<'_>, step: u64, lr: f64) -> Result<()> {
        grads.through_host(|g| self.reduce_grads(g, step, lr))
    }
    /// DDP's overlap of the backward: whether this backend reduces ranges of the gradient `grads` while
    /// the backward runs (the dense all-reduce on an engine with device collectives). The loop then runs
    /// the step's last micro-step as the staged backward and calls `grads_ready` with each range of the
    /// gradient as soon as it is complete; `reduce_flat` finishes what they started.
    fn overlaps_backward(&self, _grads: FlatRef<'_>) -> bool {
        false
    }
    /// A range of the gradient is complete (see `overlaps_backward`).
    fn grads_ready(&mut self, _grads: FlatMut<'_>, _range: std::ops::Range<usize>) -> Result<()> {
        Ok(())
    }
    /// Runs after the optimizer step of step `step` (gossip mixes parameters here, DiLoCo and SPARTA
    /// sync them); gradient-reducing backends keep this default. The loop calls this and `before_step`
    /// (on the GPU, through a host copy of the parameters) only where the replicas differ
    /// (`SyncPlan::replicas_stay_equal`).
    fn after_step(&mut self, _params: &mut [f32], _step: u64) -> Result<()> {
        Ok(())
    }
    /// Whether communication started by `after_step` waits to be run by `communicate`.
    fn has_pending(&self) -> bool {
        false
    }
    /// Runs the pending communication. The loop calls it on its own thread while another thread computes
    /// the next gradient (overlapped gossip).
    fn communicate(&mut self) -> Result<()> {
        Ok(())
    }
    /// Runs before the optimizer step: completes pending communication and applies it (overlapped
    /// gossip puts the mixed parameters in place here).
    fn before_step(&mut self, _params: &mut [f32]) -> Result<()> {
        Ok(())
    }
    /// `before_step` and `after_step` on the parameters wherever they live, as the loop calls them: on the
    /// GPU through a host copy, unless the backend mixes there itself (gossip).
    fn before_step_flat(&mut self, params: FlatMut<'_>) -> Result<()> {
        params.through_host(|p| self.before_step(p))
    }
    fn after_step_flat(&mut self, params: FlatMut<'_>, step: u64) -> Result<()> {
        params.through_host(|p| self.after_step(p, step))
    }
    /// The mix of step `step` for the optimizer to fold into its pass over host parameters (gossip:
    /// `Optimizer::step_mixed`, over `fold_buffer`), in place of the element-wise work of
    /// `before_step_flat` and `after_step_flat`; the loop then calls `after_fold` instead of
    /// `after_step_flat`. None: the hooks do it (the default).
    fn fold_mix(&mut self, _step: u64) -> Result<Option<Fold>> {
        Ok(None)
    }
    /// The buffer `fold_mix`'s weights mix with (host memory, as long as the parameters).
    fn fold_buffer(&mut self) -> Result<&mut [f32]> {
        anyhow::bail!(
            "internal error: {} folds no mix into the update",
            self.name()
        )
    }
    /// After an update that folded `fold_mix`'s mix: the rest of `after_step_flat` (the send, and
    /// without overlap the mix of its sum).
    fn after_fold(&mut self, _params: FlatMut<'_>, _step: u64) -> Result<()> {
        Ok(())
    }
    /// Mean over workers of a few scalars (losses for logging).
    fn mean_scalars(&mut self, xs: &mut [f32]) -> Result<()> {
        all_reduce_mean(self.comm_mut(), xs)
    }
    /// The model to evaluate and checkpoint: the global average of the replicas (DiLoCo: its global
    /// model), computed into `avg`, or `params` itself where that is the model (one worker: no copy).
    /// Also the consensus distance (mean over ranks of ||x_i - avg||; the loop reports it where the
    /// replicas differ between syncs). Replicas themselves are left as they are.
    fn average<'a>(
        &mut self,
        params: &'a [f32],
        avg: &'a mut Vec<f32>,
    ) -> Result<(&'a [f32], Option<f64>)> {
        average_with(self.comm_mut(), params, avg).map(|(m, d)| (m, Some(d)))
    }
    fn barrier(&mut self) -> Result<()> {
        self.comm_mut().barrier()
    }
    fn comm_stats(&self) -> CommStats {
        self.comm().stats()
    }
    /// The ranks taking part changed (the communicator regrouped, see `train.membership`): rebuild what
    /// depends on who they are (gossip's rounds; CHOCO restarts its channels). Nothing is pending.
    fn members_changed(&mut self) -> Result<()> {
        Ok(())
    }
    /// Live recovery (torchft's): what a worker that comes back copies from a live peer besides the
    /// peer's parameters and optimizer: the backend's state that every worker holds alike (DiLoCo's
    /// global model and outer state).
    fn recovery_state(&self) -> Result<compress::State> {
        Ok(Vec::new())
    }
    /// Live recovery on the worker that came back: `state` is the peer's `recovery_state`, `params` hold
    /// the peer's parameters. What is the worker's own (DeMo's momentum) restarts.
    fn recovered(&mut self, _state: compress::State, _params: &mut [f32]) -> Result<()> {
        Ok(())
    }
    /// State to checkpoint (a compressed reducer's residuals, masks, factors); empty for the others.
    fn state(&self) -> Result<compress::State> {
        Ok(Vec::new())
    }
    fn load_state(&mut self, _state: compress::State) -> Result<()> {
        Ok(())
    }
    /// The backend's metrics since the last call. `pseudo_grad_norm` and `consensus_distance` are this
    /// rank's values; the loop averages them over the ranks.
    fn take_metrics(&mut self) -> Metrics {
        Metrics::default()
    }
    /// The gradient norm before clipping, when the reducer clipped (Radius with correction); the training
    /// loop clips otherwise.
    fn clipped_grad_norm(&self) -> Option<f64> {
        None
    }
}

/// What a backend reports into the metrics rows (None: not measured by this backend).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    pub compression_ratio: Option<f64>,
    pub compression_error: Option<f64>,
    pub topk_overlap: Option<f64>,
    pub compressed_fraction: Option<f64>,
    /// DiLoCo: ||delta|| of this rank's pseudo-gradient at the last sync.
    pub pseudo_grad_norm: Option<f64>,
    /// DiLoCo: the outer learning rate of the last sync.
    pub outer_lr: Option<f64>,
    /// DiLoCo: this rank's distance from the average just before the last sync.
    pub consensus_distance: Option<f64>,
    /// Compressed gossip: the consensus step gamma.
    pub consensus_step: Option<f64>,
}

fn average_with<'a>(
    comm: &mut dyn Communicator,
    params: &'a [f32],
    avg: &'a mut Vec<f32>,
) -> Result<(&'a [f32], f64)> {
    let n = comm.world_size();
    if n == 1 {
        return Ok((params, 0.0));
    }
    avg.clear();
    avg.extend_from_slice(params);
    all_reduce_mean(comm, avg)?;
    let mut dist = [params
        .iter()
        .zip(avg.iter())
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum::<f64>()
        .sqrt() as f32];
    comm.all_reduce_sum(&mut dist)?;
    Ok((avg, dist[0] as f64 / n as f64))
}

/// Data parallel by gradient averaging, as PyTorch DDP: buckets of the name-ordered flat gradient are
/// summed by all-reduce and divided by the world size.
pub struct AllReduce {
    comm: Box<dyn Communicator>,
    bucket_elems: usize,
    numel: usize,
    /// The parts of a shared replica: each rank reduces its own part alone (`share_replica`).
    shared: Option<Parts>,
    /// DDP's overlap on the GPU: per bucket, the elements of this step's gradient not yet ready (None
    /// before the backward's first ready range); a bucket's all-reduce starts when it reaches 0.
    #[cfg(feature = "cuda")]
    waiting: Option<Vec<usize>>,
}

impl AllReduce {
    pub fn new(comm: Box<dyn Communicator>, bucket_elems: usize, numel: usize) -> Self {
        Self {
            comm,
            bucket_elems: bucket_elems.max(1),
            numel,
            shared: None,
            #[cfg(feature = "cuda")]
            waiting: None,
        }
    }

    fn buckets(&self) -> usize {
        self.numel.div_ceil(self.bucket_elems)
    }

    /// The flat range of bucket `b` (the buckets of `reduce_grads` and `step_comm`).
    fn bucket(&self, b: usize) -> std::ops::Range<usize> {
        b * self.bucket_elems..((b + 1) * self.bucket_elems).min(self.numel)
    }

    /// Enqueues the all-reduce (sum) of bucket `b` of a GPU gradient on the engine's stream, after the
    /// work already queued on the model's stream.
    #[cfg(feature = "cuda")]
    fn start_bucket(&mut self, d: &mut crate::flat::DeviceFlat, b: usize) -> Result<()> {
        let mut bucket = d.buf.slice_mut(self.bucket(b));
        self.comm
            .all_reduce_sum_device(&mut bucket, d.kernels.stream())
    }
}

impl SyncBackend for AllReduce {
    fn name(&self) -> &'static str {
        "pytorchddp"
    }
    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }
    fn comm_mut(&mut self) -> &mut dyn Communicator {
        self.comm.as_mut()
    }
    /// One all-reduce per bucket; each may overlap the backward pass (DDP): on the GPU with NCCL a bucket
    /// starts as soon as the staged backward completes it; the CPU engines reduce after the backward.
    fn step_comm(&self, _step: u64) -> Vec<Collective> {
        let n = self.world_size();
        (0..self.buckets())
            .map(|b| {
                let words = self.bucket(b).len() as u64;
                Collective::world(Op::AllReduce { words }, n, Overlap::Backward)
            })
            .collect()
    }
    fn reduce_grads(&mut self, grads: &mut [f32], _step: u64, _lr: f64) -> Result<()> {
        let n = self.world_size();
        for (b, bucket) in grads.chunks_mut(self.bucket_elems).enumerate() {
            match self.shared {
                // Each rank's part of the bucket, counted from the bucket's start.
                Some(parts) if n > 1 => {
                    let r = self.bucket(b);
                    let part = |q: usize| {
                        let p = parts.of(q);
                        let clamp = |x: usize| x.clamp(r.start, r.end) - r.start;
                        clamp(p.start)..clamp(p.end)
                    };
                    self.comm
                        .reduce_scatter_shared(bucket, &part, 1.0 / n as f32)?;
                }
                _ => all_reduce_mean(self.comm.as_mut(), bucket)?,
            }
        }
        Ok(())
    }
    fn share_replica(&mut self, parts: Parts) {
        self.shared = Some(parts);
    }
    /// On the GPU with an engine that has device collectives (NCCL): the buckets' sums on the device
    /// (started during the backward when it overlaps, see `grads_ready`), then one scaling by 1 / N (the
    /// host path's arithmetic: the sum, then times 1 / N).
    fn reduce_flat(&mut self, grads: FlatMut<'_>, step: u64, lr: f64) -> Result<()> {
        #[cfg(feature = "cuda")]
        let grads = match grads {
            FlatMut::Cuda(d) if self.comm.device_collectives() => {
                let n = self.comm.world_size();
                if n == 1 {
                    return Ok(());
                }
                // Without the overlap every bucket starts here; with it, any the backward left.
                let waiting = self.waiting.take();
                for b in 0..self.buckets() {
                    if waiting.as_ref().is_none_or(|w| w[b] > 0) {
                        self.start_bucket(d, b)?;
                    }
                }
                self.comm.finish_device(d.kernels.stream())?;
                return d.kernels.scale(&mut d.buf, 1.0 / n as f32);
            }
            g => g,
        };
        grads.through_host(|g| self.reduce_grads(g, step, lr))
    }
    #[cfg(feature = "cuda")]
    fn overlaps_backward(&self, grads: FlatRef<'_>) -> bool {
        matches!(grads, FlatRef::Cuda(_))
            && self.comm.device_collectives()
            && self.comm.world_size() > 1
    }
    /// Counts the range's elements off their buckets and starts the all-reduce of each bucket that is
    /// complete, on the engine's stream (DDP's overlap: buckets in the order they become ready).
    #[cfg(feature = "cuda")]
    fn grads_ready(&mut self, grads: FlatMut<'_>, range: std::ops::Range<usize>) -> Result<()> {
        let FlatMut::Cuda(d) = grads else {
            anyhow::bail!("internal error: the overlapped all-reduce runs on GPU buffers");
        };
        if self.waiting.is_none() {
            self.waiting = Some((0..self.buckets()).map(|b| self.bucket(b).len()).collect());
        }
        if range.is_empty() {
            return Ok(());
        }
        for b in range.start / self.bucket_elems..=(range.end - 1) / self.bucket_elems {
            let part = self.bucket(b);
            let overlap = part.end.min(range.end) - part.start.max(range.start);
            let waiting = self.waiting.as_mut().expect("set above");
            waiting[b] -= overlap;
            if waiting[b] == 0 {
                self.start_bucket(d, b)?;
            }
        }
        Ok(())
    }
}

/// Decentralized data parallel (Decent-DP): each worker steps on its own gradient, then mixes its
/// parameters with the group of this step's round of the topology.
///
/// With `overlap`, the mix of step t runs while step t+1 computes its gradient (Decent-DP's default):
/// `after_step` only fills the send buffer, `communicate` runs the group all-reduce beside the
/// forward/backward, and `before_step` puts the mixed parameters in place before the update. The
/// gradient of step t+1 is therefore taken at the unmixed parameters: x_{t+1} = W_{t-1} x_t - lr u(g(x_t))
/// instead of x_{t+1} = W_t (x_t - lr u(g(x_t))). As in the reference, step 0 mixes synchronously.
pub struct Gossip {
    comm: Box<dyn Communicator>,
    /// The topology and ranks per node the rounds were made from, to remake them when the members
    /// change (None: rounds given as they are).
    topology: Option<(crate::config::Topology, usize)>,
    rounds: Vec<Round>,
    overlap: bool,
    numel: usize,
    /// The send buffer, where the parameters are: this rank's scaled copy, then the group's sum.
    buf: Flat,
    /// Overlap: the round whose send buffer waits in `buf`, and whether its all-reduce has run.
    pending: Option<(usize, bool)>,
}

impl Gossip {
    pub fn new(
        comm: Box<dyn Communicator>,
        rounds: Vec<Round>,
        overlap: bool,
        numel: usize,
    ) -> Self {
        Self {
            comm,
            topology: None,
            rounds,
            overlap,
            numel,
            buf: Flat::Host(Vec::new()),
            pending: None,
        }
    }

    /// Gossip over `topo` with `per_node` ranks per node.
    pub fn over(
        comm: Box<dyn Communicator>,
        (topo, per_node): (crate::config::Topology, usize),
        overlap: bool,
        numel: usize,
    ) -> Result<Self> {
        let rounds = topology::rounds(topo, comm.world_size(), per_node)?;
        let mut g = Self::new(comm, rounds, overlap, numel);
        g.topology = Some((topo, per_node));
        Ok(g)
    }

    /// This rank's group in `round` and the two mixing weights: (members, own, other), where
    /// x_i <- own * x_i + sum_{j in group} other * x_j.
    fn weights(&self, round: usize) -> Result<(&[usize], f32, f32)> {
        let group = self.group(round)?;
        let (own, other) = group.mix_weights();
        Ok((&group.ranks, own, other))
    }

    /// The round of step `step`.
    fn round(&self, step: u64) -> usize {
        (step % self.rounds.len() as u64) as usize
    }

    /// This rank's group in `round`.
    fn group(&self, round: usize) -> Result<&topology::Group> {
        let rank = self.comm.rank();
        let Some(group) = self.rounds[round].iter().find(|g| g.ranks.contains(&rank)) else {
            anyhow::bail!("rank {rank} is in no group of round {round}");
        };
        Ok(group)
    }

    /// The synchronous mix of a group whose mix is the sum alone (`Group::sums_in_place`): the
    /// parameters scaled by `other` and summed over the group in place, without the send buffer. The
    /// same bits as `prepare`, `send` and `apply`, whose 0 * x + s is s.
    fn mix_in_place(&mut self, x: &mut [f32], round: usize) -> Result<()> {
        let (group, _, other) = self.weights(round)?;
        let group = group.to_vec();
        crate::kernels::scale(x, other);
        self.comm.group_all_reduce_sum(x, &group)
    }

    /// Fills the send buffer with other * x for `round` (where x is; the `scaled_copy` kernel or its twin).
    fn prepare(&mut self, params: FlatRef<'_>, round: usize) -> Result<()> {
        let (_, _, other) = self.weights(round)?;
        if !self.buf.beside(params) {
            self.buf = params.place().zeros(params.len())?;
        }
        self.buf.as_mut().assign_scaled(params, other)
    }

    /// The group all-reduce of the send buffer: on the device where the engine has device
    /// collectives, else through host memory. A rank alone in its group sends nothing; it still takes
    /// part in the round where others do (the local engine's rounds are barriers of every rank), as
    /// after a change of members (`rounds_over`).
    fn send(&mut self, round: usize) -> Result<()> {
        let group = self.weights(round)?.0.to_vec();
        if group.len() == 1 && self.rounds[round].len() == 1 {
            return Ok(());
        }
        let comm = self.comm.as_mut();
        match self.buf.as_mut() {
            #[cfg(feature = "cuda")]
            FlatMut::Cuda(d) if comm.device_collectives() => {
                comm.group_all_reduce_sum_device(&mut d.buf, &group)
            }
            b => b.through_host(|b| comm.group_all_reduce_sum(b, &group)),
        }
    }

    /// x <- own * x + the group's sum in the buffer (the `mix` kernel or its twin). A buffer restored
    /// from a checkpoint is in host memory; it joins the parameters first.
    fn apply(&mut self, mut params: FlatMut<'_>, round: usize) -> Result<()> {
        let (group, own, _) = self.weights(round)?;
        if group.len() == 1 {
            return Ok(());
        }
        if !self.buf.beside(params.as_ref()) {
            let host = self.buf.to_host()?.into_owned();
            self.buf = params.as_ref().place().from_host(host)?;
        }
        params.mix(self.buf.as_ref(), own)
    }
}

impl SyncBackend for Gossip {
    fn name(&self) -> &'static str {
        "decentdp"
    }
    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }
    fn comm_mut(&mut self) -> &mut dyn Communicator {
        self.comm.as_mut()
    }
    /// The group all-reduce of the round's parameters.
    fn step_comm(&self, step: u64) -> Vec<Collective> {
        let words = self.numel as u64;
        gossip_step_comm(&self.rounds, self.overlap, step, Op::AllReduce { words })
    }
    fn has_pending(&self) -> bool {
        matches!(self.pending, Some((_, false)))
    }
    fn members_changed(&mut self) -> Result<()> {
        self.rounds = rounds_over(self.topology, self.comm.world_size())?;
        Ok(())
    }
    fn communicate(&mut self) -> Result<()> {
        if let Some((round, false)) = self.pending {
            self.send(round)?;
            self.pending = Some((round, true));
        }
        Ok(())
    }
    fn before_step(&mut self, params: &mut [f32]) -> Result<()> {
        self.before_step_flat(params.into())
    }
    fn after_step(&mut self, params: &mut [f32], step: u64) -> Result<()> {
        self.after_step_flat(params.into(), step)
    }
    fn before_step_flat(&mut self, params: FlatMut<'_>) -> Result<()> {
        self.communicate()?;
        if let Some((round, _)) = self.pending.take() {
            self.apply(params, round)?;
        }
        Ok(())
    }
    /// x_i <- w x_i + (1 - w) / (|R| - 1) * sum_{j != i} x_j, computed as Decent-DP does: the group
    /// sums x_j (1 - w) / (|R| - 1) over all members, and the local copy is scaled by w - (1 - w) / (|R| - 1).
    fn after_step_flat(&mut self, params: FlatMut<'_>, step: u64) -> Result<()> {
        let round = self.round(step);
        let in_place = !self.overlap && self.group(round)?.sums_in_place();
        let params = match params {
            FlatMut::Host(x) if in_place => return self.mix_in_place(x, round),
            params => params,
        };
        self.prepare(params.as_ref(), round)?;
        if self.overlap && step > 0 {
            self.pending = Some((round, false));
            return Ok(());
        }
        self.send(round)?;
        self.apply(params, round)
    }
    /// The pending round's sum mixed in before the update and this round's scaled copy made after it,
    /// where the parameters are on the host (where `after_step_flat` would sum in place, the hooks run).
    fn fold_mix(&mut self, step: u64) -> Result<Option<Fold>> {
        let round = self.round(step);
        if !self.overlap && self.group(round)?.sums_in_place() {
            return Ok(None);
        }
        self.communicate()?;
        let own = match self.pending.take() {
            Some((r, _)) => self
                .weights(r)
                .map(|(g, own, _)| (g.len() > 1).then_some(own))?,
            None => None,
        };
        if !matches!(&self.buf, Flat::Host(b) if b.len() == self.numel) {
            anyhow::ensure!(
                own.is_none(),
                "internal error: a pending gossip round without its send buffer in host memory"
            );
            self.buf = Place::Host.zeros(self.numel)?;
        }
        let other = Some(self.weights(round)?.2);
        Ok(Some(Fold { own, other }))
    }
    fn fold_buffer(&mut self) -> Result<&mut [f32]> {
        self.buf.host_mut()
    }
    fn after_fold(&mut self, params: FlatMut<'_>, step: u64) -> Result<()> {
        let round = self.round(step);
        if self.overlap && step > 0 {
            self.pending = Some((round, false));
            return Ok(());
        }
        self.send(round)?;
        self.apply(params, round)
    }
    /// A pending mix is saved as it waits: its send buffer and round (not yet sent), so a resumed run
    /// sends exactly what the uninterrupted one sends.
    fn state(&self) -> Result<compress::State> {
        Ok(match self.pending {
            Some((round, false)) => vec![
                ("gossip.pending".into(), self.buf.to_host()?.into_owned()),
                ("gossip.pending_round".into(), vec![round as f32]),
            ],
            _ => Vec::new(),
        })
    }
    /// A checkpoint without a pending mix (a synchronous run, or compressed gossip's channels, which
    /// plain gossip does not need) starts with nothing pending; compressed gossip's pending message
    /// cannot be sent by plain gossip.
    fn load_state(&mut self, mut state: compress::State) -> Result<()> {
        self.pending = None;
        pending_of_the_other_kind(&state, "choco.pending", "compressed gossip (CHOCO)")?;
        if !state.iter().any(|(n, _)| n == "gossip.pending") {
            return Ok(());
        }
        let round = compress::take(&mut state, "gossip.pending_round", Some(1))?[0] as usize;
        if round >= self.rounds.len() {
            anyhow::bail!(crate::error::BadInput(format!(
                "checkpoint: pending gossip round {round}, but the topology has {} rounds",
                self.rounds.len()
            )));
        }
        self.buf = Flat::Host(compress::take(&mut state, "gossip.pending", None)?);
        self.pending = Some((round, false));
        Ok(())
    }
}

/// The rounds of a gossip made from `topology` over `world` present workers (`topology::rounds_over`).
fn rounds_over(
    topology: Option<(crate::config::Topology, usize)>,
    world: usize,
) -> Result<Vec<Round>> {
    let Some((topo, per_node)) = topology else {
        anyhow::bail!("internal error: gossip over given rounds cannot follow a change of members");
    };
    topology::rounds_over(topo, world, per_node)
}

/// Refuses a checkpoint whose overlapped gossip left a message of the other kind (plain or compressed)
/// in flight: this backend cannot send it, and dropping it would change the run.
fn pending_of_the_other_kind(state: &compress::State, key: &str, kind: &str) -> Result<()> {
    if state.iter().any(|(n, _)| n == key) {
        anyhow::bail!(crate::error::BadInput(format!(
            "checkpoint: its overlapped {kind} left a message in flight, which this run's gossip cannot \
             send; resume with the checkpoint's own [train.compression] setting, or switch from a \
             checkpoint of a synchronous run (train.overlap = false)"
        )));
    }
    Ok(())
}

/// The collectives of step `step` of a gossip over `rounds` whose mix runs `op` in each round's groups:
/// synchronous, or with `overlap` the previous step's mix, run beside this step's forward and backward
/// (step 0 mixes synchronously, so step 1 has nothing to send).
fn gossip_step_comm(rounds: &[Round], overlap: bool, step: u64, op: Op) -> Vec<Collective> {
    let mix = |step: u64, overlap| Collective {
        op: op.clone(),
        groups: rounds[(step % rounds.len() as u64) as usize]
            .iter()
            .map(|g| g.ranks.clone())
            .collect(),
        overlap,
    };
    match (overlap, step) {
        (false, _) | (true, 0) => vec![mix(step, Overlap::None)],
        (true, 1) => Vec::new(),
        (true, _) => vec![mix(step - 1, Overlap::Compute)],
    }
}

/// Gradient averaging through a compressed reducer (top-k, Radius, PowerSGD).
pub struct Compressed {
    comm: Box<dyn Communicator>,
    reducer: Box<dyn compress::Reducer>,
    tally: compress::Tally,
    clipped_norm: Option<f64>,
}

impl Compressed {
    pub fn new(comm: Box<dyn Communicator>, reducer: Box<dyn compress::Reducer>) -> Self {
        Self {
            comm,
            reducer,
            tally: compress::Tally::default(),
            clipped_norm: None,
        }
    }
}

impl SyncBackend for Compressed {
    fn name(&self) -> &'static str {
        "pytorchddp"
    }
    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }
    fn comm_mut(&mut self) -> &mut dyn Communicator {
        self.comm.as_mut()
    }
    fn step_comm(&self, step: u64) -> Vec<Collective> {
        self.reducer.step_comm(self.world_size(), step)
    }
    fn reduce_grads(&mut self, grads: &mut [f32], step: u64, lr: f64) -> Result<()> {
        self.reduce_flat(grads.into(), step, lr)
    }
    /// The reducer on the gradient where it lives (see `compress::Reducer::reduce_flat`).
    fn reduce_flat(&mut self, grads: FlatMut<'_>, step: u64, _lr: f64) -> Result<()> {
        let before = self.comm.stats();
        let len = grads.as_ref().len();
        let report = self.reducer.reduce_flat(self.comm.as_mut(), grads, step)?;
        self.clipped_norm = report.grad_norm;
        let (n, rank) = (self.comm.world_size(), self.comm.rank());
        self.tally
            .add(len, n, rank, &before, &self.comm.stats(), &report);
        Ok(())
    }
    fn state(&self) -> Result<compress::State> {
        self.reducer.state()
    }
    fn load_state(&mut self, state: compress::State) -> Result<()> {
        self.reducer.load_state(state)
    }
    /// The reducer's state that every rank holds alike (`Reducer::shared_state`).
    fn recovery_state(&self) -> Result<compress::State> {
        self.reducer.shared_state()
    }
    /// The peer's shared reducer state; this rank's error feedback restarts at zero.
    fn recovered(&mut self, state: compress::State, _params: &mut [f32]) -> Result<()> {
        self.reducer.rejoined(state)
    }
    fn take_metrics(&mut self) -> Metrics {
        self.tally.take()
    }
    fn clipped_grad_norm(&self) -> Option<f64> {
        self.clipped_norm
    }
    /// The reducer may decode this rank's part of the gradient alone (`Reducer::decode_part`).
    fn share_replica(&mut self, parts: Parts) {
        if self.comm.world_size() > 1 {
            self.reducer.decode_part(parts.of(self.comm.rank()));
        }
    }
}

/// The planned backend over `comm`.
pub fn build(
    plan: &SyncPlan,
    comm: Box<dyn Communicator>,
    tensors: Vec<crate::kernels::Segment>,
) -> Result<Box<dyn SyncBackend>> {
    let numel = tensors.iter().map(|t| t.len).sum();
    Ok(match plan {
        SyncPlan::AllReduce { bucket_elems } => {
            Box::new(AllReduce::new(comm, *bucket_elems, numel))
        }
        SyncPlan::Compressed(r) => Box::new(Compressed::new(comm, compress::build(r, tensors))),
        SyncPlan::Gossip {
            topology,
            overlap,
            ranks_per_node,
            choco,
        } => {
            let topology = (*topology, *ranks_per_node);
            match choco {
                Some(c) => Box::new(choco::Choco::over(comm, topology, *overlap, c, &tensors)?),
                None => Box::new(Gossip::over(comm, topology, *overlap, numel)?),
            }
        }
        SyncPlan::Diloco { cfg, reducer } => {
            let reducer = reducer
                .as_ref()
                .map(|r| compress::build(r, tensors.clone()));
            Box::new(diloco::Diloco::new(comm, cfg.clone(), tensors, reducer)?)
        }
        SyncPlan::Sparta { p, seed } => Box::new(sparta::Sparta::new(comm, *p, *seed, numel)),
        SyncPlan::Demo { cfg, clip, .. } => {
            Box::new(demo::Demo::new(comm, cfg.clone(), *clip, &tensors))
        }
    })
}

/// What one worker's backend holds, in f32 values, for a model of `numel` parameters on `world` workers:
/// `kept` for the whole run (residuals, send buffers, DiLoCo's global model), `during_step` at most
/// beside it while a step runs (gathered messages, copies that live for one reduction). With `shared`
/// (the local engine) the workers' all-gathers share their messages (`Communicator::all_gather_shared`).
/// Bounds, not exact counts where the size depends on the data (top-k's and Radius's selections count
/// every tensor as a matrix); `tests/memory.rs` holds them to what the backends allocate.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Footprint {
    pub kept: u64,
    pub during_step: u64,
}

pub fn footprint(
    plan: &SyncPlan,
    tensors: &[crate::kernels::Segment],
    world: u64,
    shared: bool,
) -> Footprint {
    let numel = tensors.iter().map(|t| t.len as u64).sum::<u64>();
    let part = |f: f64| (f * numel as f64).ceil() as u64;
    match plan {
        SyncPlan::AllReduce { .. } => Footprint::default(),
        // The send buffer of the mix (overlap keeps it between steps), which a synchronous mix whose
        // groups sum in place does without.
        SyncPlan::Gossip {
            topology,
            overlap,
            ranks_per_node,
            choco: None,
        } => {
            let in_place = topology::rounds(*topology, world as usize, *ranks_per_node)
                .is_ok_and(|r| r.iter().flatten().all(topology::Group::sums_in_place));
            Footprint {
                kept: if *overlap || !in_place { numel } else { 0 },
                during_step: 0,
            }
        }
        SyncPlan::Gossip {
            topology,
            ranks_per_node,
            choco: Some(c),
            ..
        } => choco::footprint(c, *topology, world as usize, *ranks_per_node, tensors),
        SyncPlan::Compressed(r) => reducer_footprint(r, numel, world, shared),
        SyncPlan::Diloco { cfg, reducer } => {
            let r = reducer.as_ref().map_or_else(Footprint::default, |r| {
                reducer_footprint(r, numel, world, shared)
            });
            let momentum = if cfg.outer_momentum > 0.0 { numel } else { 0 };
            // The global model and momentum; a sync's pseudo-gradient, its local copy, and the delayed
            // fragment in flight.
            Footprint {
                kept: numel + momentum + r.kept + numel.div_ceil(cfg.fragments.max(1)),
                during_step: 2 * numel + r.during_step,
            }
        }
        // The step's indices and values (their buffers are kept for the next step) and the message.
        SyncPlan::Sparta { p, .. } => Footprint {
            kept: 2 * part(*p),
            during_step: 2 * part(*p),
        },
        // The momentum; per step the chunks' residuals and transforms; the coefficients all-gathered.
        SyncPlan::Demo { cfg, .. } => {
            let chunk = (cfg.chunk * cfg.chunk) as u64;
            let g = gathered(2 * numel.div_ceil(chunk) * cfg.topk as u64, world, shared);
            Footprint {
                kept: numel + g.kept,
                during_step: 4 * numel + g.during_step,
            }
        }
    }
}

/// An all-gather of `words` per rank: the local engine's posts of a worker's last two messages, kept
/// (each rank reads the others' in place), else during the step every rank's copy; and the send buffer.
fn gathered(words: u64, world: u64, shared: bool) -> Footprint {
    match shared {
        true => Footprint {
            kept: 2 * words,
            during_step: words,
        },
        false => Footprint {
            kept: 0,
            during_step: words * (world + 1),
        },
    }
}

fn reducer_footprint(
    r: &crate::sync::plan::ReducerPlan,
    numel: u64,
    world: u64,
    shared: bool,
) -> Footprint {
    use crate::sync::plan::ReducerPlan;
    let part = |f: f64| (f * numel as f64).ceil() as u64;
    match r {
        // The residual; per step the selection (indices, values); its message all-gathered.
        ReducerPlan::TopK(c) => {
            let k = part(c.density);
            let g = gathered(2 * k, world, shared);
            Footprint {
                kept: if c.error_feedback_on() { numel } else { 0 } + g.kept,
                during_step: 2 * k + g.during_step + numel / 8,
            }
        }
        // The residual, the mask and the kept core (u32 each), Adam's moments with correction; per step
        // the masked values.
        ReducerPlan::Radius { cfg, correction } => {
            let mask = part((cfg.density * (2 * cfg.range + 1) as f64).min(1.0));
            let adam = if correction.is_some() { 2 * numel } else { 0 };
            Footprint {
                kept: numel + mask + part(cfg.density) + adam,
                during_step: mask + numel / 8,
            }
        }
        // The error, which holds the step's input, and the factors P, Q (rank x (rows + cols) per matrix,
        // below 2 rank sqrt-ish: bounded by the parameters); per step the factors' all-reduce buffers and,
        // without error feedback, rank 0's copy of the input and its difference for the measure.
        ReducerPlan::PowerSgd { cfg, .. } => Footprint {
            kept: if cfg.error_feedback { numel } else { 0 } + part(0.25).min(numel),
            during_step: if cfg.error_feedback { 0 } else { 2 * numel } + part(0.25).min(numel),
        },
        // The residual; per sync the selection (indices, values); its message (at most two words an
        // entry) all-gathered.
        ReducerPlan::SparseLoco(c) => {
            let k = part(c.density);
            let g = gathered(2 * k, world, shared);
            Footprint {
                kept: numel + g.kept,
                during_step: 2 * k + g.during_step,
            }
        }
    }
}

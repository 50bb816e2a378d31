//! Where a worker's parameters and optimizer live.
//!
//! Every engine gives each worker its own (`Replica::Own`). On the local engine, a backend whose replicas
//! stay equal (all-reduce, the compressed reducers, DeMo: every rank applies the same update to the same
//! parameters) would keep W identical copies, and W workers would each run the same update over the whole
//! model: at hundreds of workers that is most of the memory and of the memory traffic of a step. There,
//! the workers share one replica (`Replica::Shared`), and each updates its own range of it, as ZeRO-1
//! partitions the optimizer; the all-gather that follows ZeRO-1's update is free, since the workers read
//! the same memory. Results are those of W copies bit for bit: the optimizers' updates are element-wise
//! (`Optimizer::step_shard`), and the clipping's norm is the same f64 sum, its tiles' sums computed by
//! the tiles' owners and added in order by every worker. The replicas' average, which evaluations and
//! checkpoints use, is made once too, with the all-reduce's arithmetic (`Replica::average`).
//!
//! The shared buffers are written only between barriers: the members' ranges during the update, which
//! starts after the backend's reduction (whose barriers every member passes after its backward) and ends
//! with a barrier of its own, before any member reads the parameters again.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::{bail, Result};

use super::compute::Compute;
use crate::comm::Parts;
use crate::flat::{Flat, FlatMut, FlatRef};
use crate::kernels::optim::{tile_sum_squares, Mixing, TILE};
use crate::kernels::Segment;
use crate::optim::Shard;
use crate::optim::{OptimView, Optimizer};
use crate::sync::SyncBackend;

pub(crate) enum Replica {
    Own {
        params: Flat,
        opt: Box<dyn Optimizer>,
    },
    Shared(Member),
}

/// The one replica of a local run whose replicas stay equal.
pub(crate) struct Shared {
    /// Owns the parameters; read and written through `params` alone.
    _params: Vec<f32>,
    params: *mut f32,
    numel: usize,
    /// The replicas' average for evaluations and checkpoints (owned by `_avg`), made by `Replica::average`.
    _avg: Vec<f32>,
    avg: *mut f32,
    world: usize,
    /// Owns the optimizer's buffers, read and written through `state` alone (its settings are read).
    opt: Box<dyn Optimizer>,
    state: Vec<*mut f32>,
    segments: Vec<Segment>,
    /// The f64 sums of squares of the gradient's tiles (`kernels::optim::sum_squares`), as bits, each
    /// written by its owner.
    tile_sums: Vec<AtomicU64>,
    /// The optimizer's step count when the replica was made (its members count on from it).
    t: u64,
}

// SAFETY: the buffers behind the pointers are owned by the struct and live as long as it; every access
// follows the phases of the module's doc: reads by all members, or writes of disjoint ranges, separated
// by barriers. The optimizer is only read (`step_shard` reads its settings, `view` its names).
unsafe impl Send for Shared {}
// SAFETY: as for Send.
unsafe impl Sync for Shared {}

/// Where the local engine's workers meet their shared replica (one per run).
#[derive(Default)]
pub(crate) struct Slot(OnceLock<Arc<Shared>>);

/// A worker's handle on the shared replica: the range it updates.
pub(crate) struct Member {
    shared: Arc<Shared>,
    /// Its tiles of the sum of squares, and the elements they cover.
    tiles: Range<usize>,
    range: Range<usize>,
    /// The parameters' segments cut to `range`.
    segs: Vec<Segment>,
    /// The optimizer's step count (the shared optimizer's own is the one it was given).
    t: u64,
}

/// How the members of a shared replica of `numel` values divide it: whole tiles of the sum of squares.
pub(crate) fn parts(numel: usize, world: usize) -> Parts {
    Parts {
        len: numel,
        n: world,
        tile: TILE,
    }
}

/// Whether the workers of `plan` share one replica: on the local engine, with more than one worker on
/// the CPU, when the backend's replicas stay equal.
pub(crate) fn shared_by(
    plan: &crate::plan::Plan,
    optim: &crate::config::OptimConfig,
    cuda: bool,
) -> bool {
    matches!(
        plan.engine,
        crate::config::Engine::Local | crate::config::Engine::Auto
    ) && plan.world_size > 1
        && !cuda
        && plan.sync.replicas_stay_equal()
        && plan.membership.is_none()
        && crate::optim::elementwise(optim, plan.sync.plain_sgd_in_loop())
}

impl Replica {
    /// Makes this replica the run's shared one (rank 0, before the others join with `Slot::member`).
    pub fn share(self, slot: &Slot, parts: Parts, segments: &[Segment]) -> Result<Self> {
        let Replica::Own { params, opt } = self else {
            return Ok(self);
        };
        let t = opt.view().step;
        if slot
            .0
            .set(Arc::new(Shared::new(params, opt, segments, t, parts.n)?))
            .is_err()
        {
            bail!("internal error: a second shared replica");
        }
        slot.member(0, parts, segments)?
            .ok_or_else(|| anyhow::anyhow!("internal error: the shared replica was not kept"))
    }

    pub fn params(&self) -> FlatRef<'_> {
        match self {
            Replica::Own { params, .. } => params.as_ref(),
            // SAFETY: read between the updates (see the module's doc).
            Replica::Shared(m) => FlatRef::Host(unsafe { m.shared.params() }),
        }
    }

    /// The parameters for the backends' hooks around the update (their replicas differ: never shared).
    pub fn params_mut(&mut self) -> Result<FlatMut<'_>> {
        match self {
            Replica::Own { params, .. } => Ok(params.as_mut()),
            Replica::Shared(_) => {
                bail!("internal error: a backend changed the parameters of a shared replica")
            }
        }
    }

    /// The global norm of the reduced gradient. On a shared replica each member reads its own tiles of
    /// `grads` alone: the part the backend reduced on it (the dense all-reduce reduces nothing else).
    pub fn grad_norm(&self, grads: FlatRef<'_>, sync: &mut dyn SyncBackend) -> Result<f64> {
        let Replica::Shared(m) = self else {
            return crate::optim::norm(grads);
        };
        // Shared replicas are on the host: the gradient is borrowed, not copied.
        let g = grads.to_host()?;
        let s = &m.shared;
        for tile in m.tiles.clone() {
            let part = &g[tile * TILE..((tile + 1) * TILE).min(s.numel)];
            s.tile_sums[tile].store(tile_sum_squares(part).to_bits(), Ordering::Relaxed);
        }
        // The barrier orders the owners' stores before every member's loads.
        sync.barrier()?;
        let sum = s
            .tile_sums
            .iter()
            .map(|b| f64::from_bits(b.load(Ordering::Relaxed)))
            .fold(0.0, |a, b| a + b);
        Ok(sum.sqrt())
    }

    /// The optimizer's step with the gradient times `grad_scale`, in a compute slot (on its threads):
    /// on a shared replica, this member's range, then a barrier (outside the slot).
    pub fn step(
        &mut self,
        grads: FlatRef<'_>,
        (lr, grad_scale): (f64, f32),
        sync: &mut dyn SyncBackend,
        compute: &Compute,
    ) -> Result<()> {
        let m = match self {
            Replica::Own { params, opt } => {
                let params = params.as_mut();
                return compute.run(|_| opt.step_scaled(params, grads, lr, grad_scale));
            }
            Replica::Shared(m) => m,
        };
        // Shared replicas are on the host: the gradient is borrowed, not copied.
        let g = grads.to_host()?;
        m.t += 1;
        let (s, r) = (&m.shared, m.range.clone());
        // SAFETY: this member's range alone, which no other member touches during the update; nobody
        // reads the parameters or the state until the barrier below.
        let shard = unsafe {
            Shard {
                segs: &m.segs,
                params: std::slice::from_raw_parts_mut(s.params.add(r.start), r.len()),
                grads: &g[r.clone()],
                state: s
                    .state
                    .iter()
                    .map(|&b| std::slice::from_raw_parts_mut(b.add(r.start), r.len()))
                    .collect(),
            }
        };
        let t = m.t;
        compute.run(|_| s.opt.step_shard(shard, t, lr, grad_scale))?;
        sync.barrier()
    }

    /// Whether the parameters are this worker's own, in host memory: where an update can fold gossip's
    /// mix (`step_mixed`).
    pub fn own_on_host(&self) -> bool {
        matches!(
            self,
            Replica::Own {
                params: Flat::Host(_),
                ..
            }
        )
    }

    /// `step` with gossip's mix folded into the optimizer's pass (`Optimizer::step_mixed`), on a replica
    /// of this worker's own in host memory (`own_on_host`), in a compute slot.
    pub fn step_mixed(
        &mut self,
        grads: FlatRef<'_>,
        (lr, grad_scale): (f64, f32),
        mixing: Mixing<'_>,
        compute: &Compute,
    ) -> Result<()> {
        let Replica::Own {
            params: Flat::Host(params),
            opt,
        } = self
        else {
            bail!(
                "internal error: gossip's mix folded into the update of a shared or device replica"
            )
        };
        let g = grads.to_host()?;
        compute.run(|_| opt.step_mixed(params, &g, (lr, grad_scale), mixing))
    }

    /// The model to evaluate and checkpoint: the backend's average of the replicas (`params` is this
    /// worker's). On a shared replica, the values that average gave W equal copies, made once: each
    /// member's part is the first copy plus each other in turn, times 1 / W, as the local all-reduce adds
    /// them. Between barriers: the first waits until nobody reads the last average, the second until the
    /// new one is whole; a worker reads it until its next call.
    pub fn average<'a>(
        &'a self,
        sync: &mut dyn SyncBackend,
        params: &'a [f32],
        avg: &'a mut Vec<f32>,
    ) -> Result<(&'a [f32], Option<f64>)> {
        let Replica::Shared(m) = self else {
            return sync.average(params, avg);
        };
        let (s, r) = (&m.shared, m.range.clone());
        sync.barrier()?;
        let scale = 1.0 / s.world as f32;
        // SAFETY: this member's part of the average, which nobody reads until the barrier below.
        let part = unsafe { std::slice::from_raw_parts_mut(s.avg.add(r.start), r.len()) };
        for (a, &x) in part.iter_mut().zip(&params[r]) {
            let mut sum = x;
            for _ in 1..s.world {
                sum += x;
            }
            *a = sum * scale;
        }
        sync.barrier()?;
        // SAFETY: whole, and written again only after every member's next first barrier.
        Ok((unsafe { std::slice::from_raw_parts(s.avg, s.numel) }, None))
    }

    /// The optimizer's state in place, for a checkpoint.
    pub fn opt_view(&self) -> OptimView<'_> {
        match self {
            Replica::Own { opt, .. } => opt.view(),
            Replica::Shared(m) => {
                let view = m.shared.opt.view();
                let n = m.shared.numel;
                OptimView {
                    name: view.name,
                    step: m.t,
                    buffers: view
                        .buffers
                        .iter()
                        .zip(&m.shared.state)
                        .map(|(&(name, _), &b)| {
                            // SAFETY: each state buffer holds `numel` floats owned by the replica, and
                            // this reads it between the updates (no member writes it meanwhile).
                            let state = unsafe { std::slice::from_raw_parts(b, n) };
                            (name, FlatRef::Host(state))
                        })
                        .collect(),
                }
            }
        }
    }
}

impl Slot {
    /// Rank `rank`'s handle on the shared replica, once rank 0 has made it.
    pub fn member(
        &self,
        rank: usize,
        parts: Parts,
        segments: &[Segment],
    ) -> Result<Option<Replica>> {
        let Some(shared) = self.0.get() else {
            return Ok(None);
        };
        if parts.len != shared.numel || parts.tile != TILE || segments != shared.segments {
            bail!(
                "internal error: parts {parts:?} of a replica of {} values",
                shared.numel
            );
        }
        let (tiles, range) = (parts.tiles_of(rank), parts.of(rank));
        Ok(Some(Replica::Shared(Member {
            segs: Segment::cut(&shared.segments, range.clone()),
            shared: Arc::clone(shared),
            tiles,
            range,
            t: shared.t,
        })))
    }
}

impl Shared {
    fn new(
        params: Flat,
        mut opt: Box<dyn Optimizer>,
        segments: &[Segment],
        t: u64,
        world: usize,
    ) -> Result<Self> {
        let mut params = params.into_host_vec()?;
        let numel = params.len();
        let state = opt
            .host_state_mut()?
            .into_iter()
            .map(|b| b.as_mut_ptr())
            .collect();
        let mut avg = vec![0.0; numel];
        Ok(Self {
            params: params.as_mut_ptr(),
            _params: params,
            avg: avg.as_mut_ptr(),
            _avg: avg,
            world,
            numel,
            opt,
            state,
            segments: segments.to_vec(),
            tile_sums: (0..numel.div_ceil(TILE))
                .map(|_| AtomicU64::new(0))
                .collect(),
            t,
        })
    }

    /// # Safety
    /// Only between the updates (see the module's doc).
    unsafe fn params(&self) -> &[f32] {
        // SAFETY: `params` points at `_params`'s `numel` floats, which live as long as self; the caller
        // reads between the updates, when no member writes them.
        unsafe { std::slice::from_raw_parts(self.params, self.numel) }
    }
}

/// nanoGPT's initial weights, drawn once for all the workers of a local run (each drew them itself: at
/// 512 workers that was most of the start), until `release` (every worker has built its replica by its
/// first metrics row). A worker built after that draws its own; a process of one worker never shares.
#[derive(Default)]
pub(crate) struct Initial(std::sync::Mutex<InitialState>);

#[derive(Default)]
enum InitialState {
    #[default]
    Unset,
    Drawn(Arc<Vec<f32>>),
    Released,
}

impl Initial {
    /// The initial weights of `model`: the drawn ones when `shared` (the local engine's workers), else
    /// drawn for this caller alone.
    pub(crate) fn weights(&self, model: &crate::model::Gpt, shared: bool) -> Vec<f32> {
        if !shared {
            return model.initial_weights();
        }
        let mut state = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match &*state {
            InitialState::Drawn(w) => w.to_vec(),
            InitialState::Released => model.initial_weights(),
            InitialState::Unset => {
                let w = Arc::new(model.initial_weights());
                *state = InitialState::Drawn(Arc::clone(&w));
                w.to_vec()
            }
        }
    }

    /// Frees the drawn weights.
    pub(crate) fn release(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = InitialState::Released;
    }
}

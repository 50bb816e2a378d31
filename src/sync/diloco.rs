//! DiLoCo and Streaming DiLoCo (torchft's `local_sgd.py`). Each worker steps `train.optim` alone; every
//! H / F steps one of the model's F fragments syncs, so each fragment syncs every H steps. At a sync, the
//! fragment's pseudo-gradient delta = backup - local (it points like a gradient) is averaged over the
//! workers (f32, quantized, or through a compressed reducer), the outer optimizer (SGD with momentum,
//! Nesterov) steps the backup with it, and the worker continues from (1 - alpha) backup + alpha local.
//!
//! With `fragment_delay` tau > 0 the fragment's delta is taken tau steps before its sync point and its
//! all-reduce runs beside the next step's computation (the loop's `communicate`); the result waits,
//! averaged, until the sync point. F = 1, tau = 0, alpha = 0 is DiLoCo; outer lr 1 and momentum 0 is
//! LocalSGD.
//!
//! A compressed reducer (`[train.compression]`, F = 1) reduces the pseudo-gradient instead of the
//! all-reduce. Its error feedback then carries what one sync did not send into the next sync's
//! pseudo-gradient: the residual is part of the delta that was not averaged yet, so nothing of the
//! workers' progress is dropped, only delayed by H steps. Its step counter counts syncs.
//!
//! Hierarchical DiLoCo (`group_size` G > 1; torchft issue 171, Prime's data parallel inside a node and
//! DiLoCo across): G consecutive ranks form a group that all-reduces its gradients every step, so its
//! members step alike; the pseudo-gradient average over all ranks is then the average over the groups.
//! G = 1 is DiLoCo; G = world with outer lr 1 and momentum 0 is data-parallel training.
//!
//! Eager outer steps (`eager`, Kale, Douillard, Donchev 2025, arXiv 2502.12996, its "eager updates"): at
//! sync t each worker takes its pseudo-gradient delta_t, starts its all-reduce, which runs beside the
//! computation of the next inner step (cut into `eager_pieces` pieces, beside the next steps one a step),
//! and steps its own outer model at once with the proxy
//! `mean_{t-1} + (delta_t - delta_{t-1}) / N`: its own share of sync t and the others' shares of sync
//! t - 1, whose average has arrived by then. Every worker's delta enters each outer model once, the
//! others' one period late. The outer models (and momenta) differ between workers by their own last
//! shares; evaluation and checkpoints take their mean.
//!
//! Fragments are contiguous ranges of the name-ordered flat buffer cut on row boundaries (a row: one row
//! of a matrix, or a whole vector), of about numel / F values each.

use std::ops::Range;

use anyhow::{bail, Result};

use super::compress::{self, take, Reducer, State};
use super::trace::{Collective, Op, Overlap};
use super::{Metrics, SyncBackend};
use crate::comm::{all_reduce_mean, all_reduce_mean_flat, pack_u64, unpack_u64, Communicator};
use crate::config::backend::{DilocoConfig, Quantize};
use crate::flat::{Flat, FlatMut, FlatRef, Place};
use crate::kernels::optim as kernels;
use crate::kernels::Segment;
use crate::optim::norm;

/// The prefix of the compressed reducer's buffers in DiLoCo's state.
const REDUCER: &str = "compress.";

struct Fragment {
    range: Range<usize>,
    /// Quantization rows, relative to the fragment's start.
    rows: Vec<Range<usize>>,
}

/// A fragment's pseudo-gradient between the start of its all-reduce and its sync point.
struct InFlight {
    fragment: usize,
    /// Inner steps done at the sync point.
    sync_at: u64,
    delta: Flat,
    /// Pieces of `delta` averaged so far (of `Diloco::pieces`).
    done: u64,
}

pub struct Diloco {
    comm: Box<dyn Communicator>,
    cfg: DilocoConfig,
    fragments: Vec<Fragment>,
    reducer: Option<Box<dyn Reducer>>,
    tally: compress::Tally,
    /// The global model (outer parameters) and the outer momentum (empty without momentum),
    /// whole-model buffers beside the parameters: on the GPU with them.
    backup: Flat,
    momentum: Flat,
    /// Outer steps taken per fragment.
    outer_steps: Vec<u64>,
    inflight: Option<InFlight>,
    /// Fragment syncs so far (the reducer's step).
    syncs: u64,
    /// Eager: this rank's own pseudo-gradient of the last sync (empty before the first).
    previous: Flat,
    /// This rank's pseudo-gradient norm and distance from the average at the last sync, until logged.
    pending: Option<(f64, f64)>,
    /// The quantized all-reduce's message buffers, kept across syncs.
    scratch: super::quantize::Scratch,
}

/// Rows of the flat buffer: one per matrix row, one per vector.
pub(crate) fn rows_of(tensors: &[Segment]) -> Vec<Range<usize>> {
    let mut rows = Vec::new();
    for t in tensors {
        if t.matrix {
            rows.extend((0..t.rows).map(|r| t.offset + r * t.cols..t.offset + (r + 1) * t.cols));
        } else {
            rows.push(t.range());
        }
    }
    rows
}

/// `count` fragments of `rows`, cut where the running size first reaches each multiple of numel / count.
fn split(rows: &[Range<usize>], count: usize) -> Result<Vec<Fragment>> {
    if rows.len() < count {
        bail!(crate::error::BadInput(format!(
            "train.diloco.fragments = {count}: the model has only {} rows to split",
            rows.len()
        )));
    }
    let numel = rows.last().map_or(0, |r| r.end);
    let mut out: Vec<Fragment> = Vec::new();
    let mut current: Vec<Range<usize>> = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        current.push(r.clone());
        let done = out.len() + 1;
        // Cut at the target size, but leave a row for every fragment still to come.
        let target = r.end * count >= numel * done && done < count;
        let must = rows.len() - i - 1 == count - done;
        if (target || must) && done < count {
            out.push(fragment(std::mem::take(&mut current)));
        }
    }
    out.push(fragment(current));
    Ok(out)
}

fn fragment(rows: Vec<Range<usize>>) -> Fragment {
    let start = rows.first().map_or(0, |r| r.start);
    let end = rows.last().map_or(start, |r| r.end);
    Fragment {
        range: start..end,
        rows: rows
            .iter()
            .map(|r| r.start - start..r.end - start)
            .collect(),
    }
}

impl Diloco {
    pub fn new(
        comm: Box<dyn Communicator>,
        cfg: DilocoConfig,
        tensors: Vec<Segment>,
        reducer: Option<Box<dyn Reducer>>,
    ) -> Result<Self> {
        let fragments = split(&rows_of(&tensors), cfg.fragments as usize)?;
        Ok(Self {
            comm,
            outer_steps: vec![0; fragments.len()],
            fragments,
            cfg,
            reducer,
            tally: compress::Tally::default(),
            backup: Flat::Host(Vec::new()),
            momentum: Flat::Host(Vec::new()),
            inflight: None,
            syncs: 0,
            previous: Flat::Host(Vec::new()),
            pending: None,
            scratch: Default::default(),
        })
    }

    /// Steps between two fragment syncs.
    fn period(&self) -> u64 {
        self.cfg.sync_every / self.cfg.fragments
    }

    /// The fragment whose pseudo-gradient is averaged for the sync point `at` (inner steps done).
    fn fragment_at(&self, at: u64) -> Option<usize> {
        (at > 0 && at.is_multiple_of(self.period()))
            .then(|| ((at / self.period() - 1) % self.cfg.fragments) as usize)
    }

    /// Averages `delta` (this rank's pseudo-gradient of `fragment`) over the workers, in place.
    fn reduce(&mut self, fragment: usize, delta: &mut Flat) -> Result<()> {
        let (len, place) = (delta.len(), delta.place());
        let mut local = place.zeros(len)?;
        local.as_mut().copy_from(0, delta.as_ref(), 0..len)?;
        let before = self.comm.stats();
        let (n, rank) = (self.comm.world_size(), self.comm.rank());
        let comm = self.comm.as_mut();
        let report = match (&mut self.reducer, self.cfg.quantize) {
            (Some(r), _) => r.reduce_flat(comm, delta.as_mut(), self.syncs)?,
            (None, Quantize::None) => {
                all_reduce_mean_flat(comm, delta.as_mut())?;
                compress::Report::default()
            }
            (None, q) => {
                let rows = &self.fragments[fragment].rows;
                match delta.as_mut() {
                    #[cfg(feature = "cuda")]
                    FlatMut::Cuda(d) if comm.device_collectives() => {
                        super::quantize::all_reduce_mean_device(comm, d, rows, q)?
                    }
                    d => d.through_host(|d| {
                        super::quantize::all_reduce_mean(comm, d, rows, q, &mut self.scratch)
                    })?,
                }
                compress::Report::default()
            }
        };
        self.syncs += 1;
        if self.reducer.is_some() || self.cfg.quantize != Quantize::None {
            self.tally
                .add(len, n, rank, &before, &self.comm.stats(), &report);
        }
        let local_norm = norm(local.as_ref())?;
        // The distance from the average: || -local + mean || (the `mix` kernel), which is || local - mean ||.
        local.as_mut().mix(delta.as_ref(), -1.0)?;
        self.pending = Some((local_norm, norm(local.as_ref())?));
        Ok(())
    }

    /// Pieces an in-flight pseudo-gradient of `len` values is averaged in, one beside each step: eager
    /// f32 all-reduces are spread over `eager_pieces` (default 1) steps after the sync; the rest go whole.
    fn pieces(&self, len: usize) -> u64 {
        let plain = self.reducer.is_none() && self.cfg.quantize == Quantize::None;
        match self.cfg.eager && plain {
            true => self.cfg.eager_pieces.unwrap_or(1).min(len as u64).max(1),
            false => 1,
        }
    }

    /// Averages the next piece of the pseudo-gradient in flight (all of it when it goes whole).
    fn reduce_piece(&mut self, f: &mut InFlight) -> Result<()> {
        let (len, pieces) = (f.delta.len(), self.pieces(f.delta.len()));
        if pieces == 1 {
            self.reduce(f.fragment, &mut f.delta)?;
            f.done = 1;
            return Ok(());
        }
        let r = crate::comm::chunk(len, pieces as usize, f.done as usize);
        let mut piece = f.delta.place().zeros(r.len())?;
        piece.as_mut().copy_from(0, f.delta.as_ref(), r.clone())?;
        all_reduce_mean_flat(self.comm.as_mut(), piece.as_mut())?;
        f.delta
            .as_mut()
            .copy_from(r.start, piece.as_ref(), 0..r.len())?;
        f.done += 1;
        if f.done == pieces {
            // The whole average is in: this rank's distance from it (its own delta is `previous`).
            self.syncs += 1;
            let mut local = f.delta.place().zeros(len)?;
            local
                .as_mut()
                .copy_from(0, self.previous.as_ref(), 0..len)?;
            let local_norm = norm(local.as_ref())?;
            local.as_mut().mix(f.delta.as_ref(), -1.0)?;
            self.pending = Some((local_norm, norm(local.as_ref())?));
        }
        Ok(())
    }

    /// The outer step of `fragment` with the averaged pseudo-gradient, then the worker's parameters.
    fn apply(&mut self, fragment: usize, mean: FlatRef<'_>, params: FlatMut<'_>) -> Result<()> {
        let r = self.fragments[fragment].range.clone();
        let first = self.outer_steps[fragment] == 0;
        self.outer_steps[fragment] += 1;
        let c = &self.cfg;
        let step = kernels::SgdStep {
            wd: 0.0,
            momentum: c.outer_momentum as f32,
            lr: c.outer_lr as f32,
            nesterov: c.nesterov,
            first,
            grad_scale: 1.0,
        };
        let whole = [Segment::flat(0, r.len(), false)];
        let alpha = c.fragment_alpha as f32;
        match (&mut self.backup, &mut self.momentum, mean, params) {
            (Flat::Host(b), Flat::Host(m), FlatRef::Host(mean), FlatMut::Host(p)) => {
                let buf = if m.is_empty() {
                    &mut []
                } else {
                    &mut m[r.clone()]
                };
                kernels::momentum_sgd(&mut b[r.clone()], mean, buf, &whole, &step);
                if alpha == 0.0 {
                    p[r.clone()].copy_from_slice(&b[r]);
                } else {
                    for (p, b) in p[r.clone()].iter_mut().zip(&b[r]) {
                        *p = (1.0 - alpha) * b + alpha * *p;
                    }
                }
            }
            #[cfg(feature = "cuda")]
            (Flat::Cuda(b), m, FlatRef::Cuda(mean), FlatMut::Cuda(p)) => {
                let k = b.kernels.clone();
                let s = k.stream();
                let mut buf = match m {
                    m if m.is_empty() => None,
                    Flat::Cuda(m) => Some(m.buf.slice_mut(r.clone())),
                    Flat::Host(_) => bail!(crate::flat::MIXED),
                };
                let segs = k.segments(&whole)?;
                let (mut br, mean) = (b.buf.slice_mut(r.clone()), mean.buf.slice(..));
                k.momentum_sgd(&mut br, &mean, buf.as_mut(), &segs, &step)?;
                if alpha == 0.0 {
                    s.memcpy_dtod(&b.buf.slice(r.clone()), &mut p.buf.slice_mut(r))?;
                } else {
                    // alpha p + ((1 - alpha) b) (the `mix` kernel): the host's sum, in the other order.
                    let mut scaled = s.alloc_zeros::<f32>(r.len())?;
                    let b = b.buf.slice(r.clone());
                    k.scaled_copy(&mut scaled.slice_mut(..), &b, 1.0 - alpha)?;
                    k.mix(&mut p.buf.slice_mut(r), &scaled.slice(..), alpha)?;
                }
            }
            #[cfg(feature = "cuda")]
            _ => bail!(crate::flat::MIXED),
        }
        Ok(())
    }

    /// This rank's pseudo-gradient of `fragment`: backup - local.
    fn delta(&self, fragment: usize, params: FlatRef<'_>) -> Result<Flat> {
        let r = self.fragments[fragment].range.clone();
        match (&self.backup, params) {
            (Flat::Host(b), FlatRef::Host(p)) => Ok(Flat::Host(
                b[r.clone()].iter().zip(&p[r]).map(|(b, p)| b - p).collect(),
            )),
            #[cfg(feature = "cuda")]
            (Flat::Cuda(b), FlatRef::Cuda(p)) => {
                // -local + backup (the `mix` kernel), which is backup - local exactly.
                let s = b.kernels.stream();
                let mut d = s.alloc_zeros::<f32>(r.len())?;
                s.memcpy_dtod(&p.buf.slice(r.clone()), &mut d)?;
                b.kernels.mix(&mut d.slice_mut(..), &b.buf.slice(r), -1.0)?;
                Ok(Flat::Cuda(crate::flat::DeviceFlat {
                    buf: d,
                    kernels: b.kernels.clone(),
                }))
            }
            #[cfg(feature = "cuda")]
            _ => bail!(crate::flat::MIXED),
        }
    }

    /// Eager: step `step` averages piece `step mod H` of the last sync's pseudo-gradient, beside its
    /// computation (all of it in the step after the sync when it goes in one piece).
    fn eager_comm(&self, step: u64) -> Vec<Collective> {
        let (h, n) = (self.cfg.sync_every, self.world_size());
        let (sync, piece) = (step - step % h, step % h);
        let len = self.fragments[0].range.len();
        let pieces = self.pieces(len);
        if sync == 0 || piece >= pieces {
            return Vec::new();
        }
        let overlap = Overlap::Compute;
        match (&self.reducer, self.cfg.quantize) {
            (None, Quantize::None) => {
                let words = crate::comm::chunk(len, pieces as usize, piece as usize).len() as u64;
                vec![Collective::world(Op::AllReduce { words }, n, overlap)]
            }
            (Some(r), _) => r
                .step_comm(n, sync / h - 1)
                .into_iter()
                .map(|c| Collective { overlap, ..c })
                .collect(),
            (None, q) => super::quantize::collectives(&self.fragments[0].rows, q, n, overlap),
        }
    }

    /// An eager sync point (see the module's doc): the proxy step, then this sync's all-reduce in flight.
    fn eager_sync(&mut self, mut params: FlatMut<'_>, done: u64) -> Result<()> {
        let place = params.as_ref().place();
        self.settle(&place)?;
        let mean = match self.inflight.take() {
            Some(mut f) if f.sync_at == done => {
                while f.done < self.pieces(f.delta.len()) {
                    self.reduce_piece(&mut f)?;
                }
                Some(f.delta)
            }
            other => {
                self.inflight = other;
                None
            }
        };
        let delta = self.delta(0, params.as_ref())?;
        let n = delta.len();
        // (delta - previous) / N + mean: the `mix` kernel twice (x <- own x + b).
        let mut proxy = place.zeros(n)?;
        if self.previous.is_empty() {
            proxy.as_mut().copy_from(0, delta.as_ref(), 0..n)?;
        } else {
            proxy.as_mut().copy_from(0, self.previous.as_ref(), 0..n)?;
            proxy.as_mut().mix(delta.as_ref(), -1.0)?;
        }
        let mean = match mean {
            Some(m) => m,
            None => place.zeros(n)?,
        };
        proxy
            .as_mut()
            .mix(mean.as_ref(), 1.0 / self.comm.world_size() as f32)?;
        self.apply(0, proxy.as_ref(), params.reborrow())?;
        let mut inflight = place.zeros(n)?;
        inflight.as_mut().copy_from(0, delta.as_ref(), 0..n)?;
        self.inflight = Some(InFlight {
            fragment: 0,
            sync_at: done + self.cfg.sync_every,
            delta: inflight,
            done: 0,
        });
        self.previous = delta;
        Ok(())
    }

    /// The sync's collectives of step `step` (see `step_comm`).
    fn sync_comm(&self, step: u64) -> Vec<Collective> {
        let (delay, n) = (self.cfg.fragment_delay, self.world_size());
        if self.cfg.eager {
            return self.eager_comm(step);
        }
        let (at, overlap) = match delay {
            0 => (step + 1, Overlap::None),
            d => (step + d, Overlap::Compute),
        };
        let Some(f) = self.fragment_at(at) else {
            return Vec::new();
        };
        let fragment = &self.fragments[f];
        match (&self.reducer, self.cfg.quantize) {
            (Some(r), _) => r
                .step_comm(n, at / self.period() - 1)
                .into_iter()
                .map(|c| Collective { overlap, ..c })
                .collect(),
            (None, Quantize::None) => {
                let words = fragment.range.len() as u64;
                vec![Collective::world(Op::AllReduce { words }, n, overlap)]
            }
            (None, q) => super::quantize::collectives(&fragment.rows, q, n, overlap),
        }
    }

    /// The ranks of this rank's group (hierarchical DiLoCo): `group_size` consecutive ranks.
    fn group(&self) -> Vec<usize> {
        let g = self.cfg.group_size as usize;
        let first = self.comm.rank() / g * g;
        (first..first + g).collect()
    }

    /// Every group's gradient all-reduce of a step (hierarchical DiLoCo), none with groups of one.
    fn group_comm(&self) -> Vec<Collective> {
        let (g, n) = (self.cfg.group_size as usize, self.world_size());
        if g == 1 {
            return Vec::new();
        }
        let words = self.fragments.last().map_or(0, |f| f.range.end) as u64;
        vec![Collective {
            op: Op::AllReduce { words },
            groups: (0..n / g).map(|k| (k * g..(k + 1) * g).collect()).collect(),
            overlap: Overlap::None,
        }]
    }

    /// Moves the state beside the parameters (a restored state is in host memory).
    fn settle(&mut self, place: &Place) -> Result<()> {
        self.backup.move_to(place)?;
        self.momentum.move_to(place)?;
        self.previous.move_to(place)?;
        if let Some(f) = &mut self.inflight {
            f.delta.move_to(place)?;
        }
        Ok(())
    }
}

impl SyncBackend for Diloco {
    fn name(&self) -> &'static str {
        "diloco"
    }
    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }
    fn comm_mut(&mut self) -> &mut dyn Communicator {
        self.comm.as_mut()
    }
    /// The groups' gradient all-reduce (hierarchical DiLoCo), then a fragment's pseudo-gradient
    /// averaged at its sync point: in the step that reaches it, or with `fragment_delay` d in the step d
    /// before it (eager: after it), beside that step's forward and backward pass.
    fn step_comm(&self, step: u64) -> Vec<Collective> {
        let mut out = self.group_comm();
        out.extend(self.sync_comm(step));
        out
    }
    fn has_pending(&self) -> bool {
        self.inflight
            .as_ref()
            .is_some_and(|f| f.done < self.pieces(f.delta.len()))
    }
    fn communicate(&mut self) -> Result<()> {
        if let Some(mut f) = self.inflight.take() {
            if f.done < self.pieces(f.delta.len()) {
                self.reduce_piece(&mut f)?;
            }
            self.inflight = Some(f);
        }
        Ok(())
    }
    /// Hierarchical DiLoCo: the mean gradient of this rank's group (its members then step alike).
    fn reduce_grads(&mut self, grads: &mut [f32], _step: u64, _lr: f64) -> Result<()> {
        let g = self.cfg.group_size as usize;
        if g > 1 {
            let group = self.group();
            self.comm.group_all_reduce_sum(grads, &group)?;
            crate::kernels::scale(grads, 1.0 / g as f32);
        }
        Ok(())
    }
    fn before_step(&mut self, params: &mut [f32]) -> Result<()> {
        self.before_step_flat(params.into())
    }
    fn after_step(&mut self, params: &mut [f32], step: u64) -> Result<()> {
        self.after_step_flat(params.into(), step)
    }
    /// The global model starts as the initial parameters (a resume restores it), beside them.
    fn before_step_flat(&mut self, params: FlatMut<'_>) -> Result<()> {
        if self.backup.is_empty() {
            let (place, n) = (params.as_ref().place(), params.as_ref().len());
            self.backup = place.zeros(n)?;
            self.backup.as_mut().copy_from(0, params.as_ref(), 0..n)?;
            let momentum = if self.cfg.outer_momentum > 0.0 { n } else { 0 };
            self.momentum = place.zeros(momentum)?;
        }
        Ok(())
    }
    /// Acts only at sync points (and at the step a delayed fragment's delta is taken).
    fn after_step_flat(&mut self, mut params: FlatMut<'_>, step: u64) -> Result<()> {
        let done = step + 1;
        if self.cfg.eager {
            return match self.fragment_at(done) {
                Some(_) => self.eager_sync(params, done),
                None => Ok(()),
            };
        }
        let at = done + self.cfg.fragment_delay;
        let arrives = self.inflight.as_ref().is_some_and(|f| f.sync_at == done);
        let leaves = self.fragment_at(at);
        if !arrives && leaves.is_none() {
            return Ok(());
        }
        self.settle(&params.as_ref().place())?;
        if arrives {
            self.communicate()?;
            if let Some(f) = self.inflight.take() {
                self.apply(f.fragment, f.delta.as_ref(), params.reborrow())?;
            }
        }
        if let Some(fragment) = leaves {
            let mut delta = self.delta(fragment, params.as_ref())?;
            if at == done {
                self.reduce(fragment, &mut delta)?;
                self.apply(fragment, delta.as_ref(), params)?;
            } else {
                self.inflight = Some(InFlight {
                    fragment,
                    sync_at: at,
                    delta,
                    done: 0,
                });
            }
        }
        Ok(())
    }
    /// Evaluation and checkpoints use the global model.
    fn average<'a>(
        &mut self,
        params: &'a [f32],
        avg: &'a mut Vec<f32>,
    ) -> Result<(&'a [f32], Option<f64>)> {
        if self.backup.is_empty() {
            return Ok((params, None));
        }
        avg.clear();
        avg.extend_from_slice(&self.backup.to_host()?);
        if self.cfg.eager && self.comm.world_size() > 1 {
            // The workers' outer models differ by their own last shares: their mean.
            all_reduce_mean(self.comm.as_mut(), avg)?;
        }
        Ok((avg, None))
    }
    fn take_metrics(&mut self) -> Metrics {
        let mut m = self.tally.take();
        if let Some((norm, distance)) = self.pending.take() {
            m.pseudo_grad_norm = Some(norm);
            m.consensus_distance = Some(distance);
            m.outer_lr = Some(self.cfg.outer_lr);
        }
        m
    }
    /// The global model and the outer state: what every worker holds alike.
    fn recovery_state(&self) -> Result<State> {
        const GLOBAL: [&str; 4] = [
            "diloco.backup",
            "diloco.momentum",
            "diloco.outer_steps",
            "diloco.syncs",
        ];
        let mut s = self.state()?;
        s.retain(|(n, _)| GLOBAL.contains(&n.as_str()));
        if let Some(r) = self.reducer.as_ref().filter(|_| !s.is_empty()) {
            let shared = r.shared_state()?.into_iter();
            s.extend(shared.map(|(n, b)| (format!("{REDUCER}{n}"), b)));
        }
        Ok(s)
    }
    /// The worker continues from the global model; its reducer takes the peer's shared state, and its
    /// own error feedback restarts at zero (`Reducer::rejoined`).
    fn recovered(&mut self, state: State, params: &mut [f32]) -> Result<()> {
        if state.is_empty() {
            return Ok(());
        }
        let (shared, global): (State, State) =
            state.into_iter().partition(|(n, _)| n.starts_with(REDUCER));
        self.load_state(global)?;
        if let Some(r) = &mut self.reducer {
            let shared = shared.into_iter();
            r.rejoined(
                shared
                    .map(|(n, b)| (n[REDUCER.len()..].to_string(), b))
                    .collect(),
            )?;
        }
        params.copy_from_slice(&self.backup.to_host()?);
        Ok(())
    }
    fn state(&self) -> Result<State> {
        if self.backup.is_empty() {
            return Ok(Vec::new());
        }
        let host = |f: &Flat| -> Result<Vec<f32>> { Ok(f.to_host()?.into_owned()) };
        let mut s: State = vec![("diloco.backup".into(), host(&self.backup)?)];
        if !self.momentum.is_empty() {
            s.push(("diloco.momentum".into(), host(&self.momentum)?));
        }
        let words = |xs: &[u64]| xs.iter().flat_map(|&x| pack_u64(x)).collect::<Vec<f32>>();
        s.push(("diloco.outer_steps".into(), words(&self.outer_steps)));
        s.push(("diloco.syncs".into(), words(&[self.syncs])));
        if let Some(f) = &self.inflight {
            let meta = [f.fragment as u64, f.sync_at, f.done];
            s.push(("diloco.inflight".into(), host(&f.delta)?));
            s.push(("diloco.inflight_meta".into(), words(&meta)));
        }
        if !self.previous.is_empty() {
            s.push(("diloco.eager_previous".into(), host(&self.previous)?));
        }
        if let Some((norm, distance)) = self.pending {
            s.push((
                "diloco.pending_metrics".into(),
                words(&[norm.to_bits(), distance.to_bits()]),
            ));
        }
        if let Some(r) = &self.reducer {
            s.extend(
                r.state()?
                    .into_iter()
                    .map(|(n, b)| (format!("{REDUCER}{n}"), b)),
            );
        }
        Ok(s)
    }
    fn load_state(&mut self, mut state: State) -> Result<()> {
        let numel = self.fragments.last().map_or(0, |f| f.range.end);
        let (inner, rest): (State, State) = std::mem::take(&mut state)
            .into_iter()
            .partition(|(n, _)| n.starts_with(REDUCER));
        state = rest;
        if let Some(r) = &mut self.reducer {
            let inner = inner
                .into_iter()
                .map(|(n, b)| (n[REDUCER.len()..].to_string(), b))
                .collect();
            r.load_state(inner)?;
        }
        if state.is_empty() {
            return Ok(());
        }
        let u64s =
            |v: Vec<f32>| -> Vec<u64> { v.chunks(2).map(|c| unpack_u64([c[0], c[1]])).collect() };
        self.backup = Flat::Host(take(&mut state, "diloco.backup", Some(numel))?);
        self.momentum = Flat::Host(if self.cfg.outer_momentum > 0.0 {
            take(&mut state, "diloco.momentum", Some(numel))?
        } else {
            Vec::new()
        });
        let f = self.fragments.len();
        self.outer_steps = u64s(take(&mut state, "diloco.outer_steps", Some(2 * f))?);
        self.syncs = u64s(take(&mut state, "diloco.syncs", Some(2))?)[0];
        self.inflight = None;
        if state.iter().any(|(n, _)| n == "diloco.inflight") {
            let meta = u64s(take(&mut state, "diloco.inflight_meta", Some(6))?);
            let fragment = meta[0] as usize;
            let Some(fr) = self.fragments.get(fragment) else {
                bail!(crate::error::BadInput(format!(
                    "checkpoint: DiLoCo fragment {fragment} in flight, but the run has {f} fragments"
                )));
            };
            let delta = Flat::Host(take(&mut state, "diloco.inflight", Some(fr.range.len()))?);
            self.inflight = Some(InFlight {
                fragment,
                sync_at: meta[1],
                delta,
                done: meta[2],
            });
        }
        self.previous = Flat::Host(
            match state.iter().any(|(n, _)| n == "diloco.eager_previous") {
                true => take(&mut state, "diloco.eager_previous", Some(numel))?,
                false => Vec::new(),
            },
        );
        self.pending = None;
        if state.iter().any(|(n, _)| n == "diloco.pending_metrics") {
            let m = u64s(take(&mut state, "diloco.pending_metrics", Some(4))?);
            self.pending = Some((f64::from_bits(m[0]), f64::from_bits(m[1])));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_tile_the_buffer_on_row_boundaries() {
        let tensors =
            Segment::from_shapes(&[(7, 1, false), (12, 9, true), (6, 20, true), (5, 1, false)]);
        let rows = rows_of(&tensors);
        let numel: usize = tensors.iter().map(|t| t.len).sum();
        for count in 1..=8 {
            let f = split(&rows, count).unwrap();
            assert_eq!(f.len(), count);
            assert_eq!(f[0].range.start, 0);
            assert_eq!(f.last().unwrap().range.end, numel);
            for w in f.windows(2) {
                assert_eq!(w[0].range.end, w[1].range.start);
                assert!(!w[0].range.is_empty());
            }
            for fr in &f {
                assert_eq!(fr.rows.last().unwrap().end, fr.range.len());
            }
        }
        assert!(split(&rows, rows.len() + 1).is_err());
    }

    /// An inner step of rank m: a pull towards its own target (the ranks disagree).
    fn inner(m: usize, s: u64, x: &mut [f64]) {
        for (i, v) in x.iter_mut().enumerate() {
            let target = (m as f64 + 1.0) * ((i as f64 + 0.3 * s as f64).sin());
            *v += 0.2 * (target - *v);
        }
    }

    /// Eager DiLoCo's defining recurrence, in f64: at each sync every rank steps its own outer model
    /// with mean_{t-1} + (delta_t - delta_{t-1}) / N (outer SGD without momentum) and restarts from it.
    fn eager_reference(n: usize, h: u64, steps: u64, lr: f64, x0: &[f64]) -> Vec<Vec<f64>> {
        let len = x0.len();
        let (mut theta, mut x) = (vec![x0.to_vec(); n], vec![x0.to_vec(); n]);
        let (mut prev, mut mean) = (vec![vec![0.0; len]; n], vec![0.0; len]);
        for s in 0..steps {
            (0..n).for_each(|m| inner(m, s, &mut x[m]));
            if (s + 1) % h != 0 {
                continue;
            }
            let delta: Vec<Vec<f64>> = (0..n)
                .map(|m| (0..len).map(|i| theta[m][i] - x[m][i]).collect())
                .collect();
            for m in 0..n {
                for i in 0..len {
                    theta[m][i] -= lr * (mean[i] + (delta[m][i] - prev[m][i]) / n as f64);
                }
                x[m] = theta[m].clone();
            }
            mean = (0..len)
                .map(|i| delta.iter().map(|d| d[i]).sum::<f64>() / n as f64)
                .collect();
            prev = delta;
        }
        x
    }

    /// Eager DiLoCo (H = 1, and H = 3 with its all-reduce spread over the three steps after a sync) on
    /// the local engine follows the recurrence, and each step sends what `step_comm` says.
    #[test]
    fn eager_outer_steps_follow_their_recurrence() {
        let tensors = Segment::from_shapes(&[(3, 4, true), (5, 1, false)]);
        let len: usize = tensors.iter().map(|t| t.len).sum();
        let x0: Vec<f64> = (0..len).map(|i| (i as f64 * 0.37).cos()).collect();
        let (n, steps, lr) = (3, 12, 1.0);
        for h in [1, 3] {
            let want = eager_reference(n, h, steps, lr, &x0);
            let comms = crate::comm::local::group(n, std::time::Duration::from_secs(20));
            let got: Vec<Vec<f32>> = std::thread::scope(|sc| {
                let jobs: Vec<_> = comms
                    .into_iter()
                    .enumerate()
                    .map(|(m, comm)| {
                        let (tensors, x0) = (tensors.clone(), &x0);
                        sc.spawn(move || {
                            let cfg = DilocoConfig {
                                sync_every: h,
                                outer_lr: lr,
                                outer_momentum: 0.0,
                                nesterov: false,
                                eager: true,
                                eager_pieces: Some(h),
                                ..DilocoConfig::default()
                            };
                            let mut d = Diloco::new(Box::new(comm), cfg, tensors, None).unwrap();
                            let mut x: Vec<f32> = x0.iter().map(|&v| v as f32).collect();
                            for s in 0..steps {
                                d.before_step(&mut x).unwrap();
                                let (want, before) = (d.step_comm(s), d.comm().stats().bytes_sent);
                                if d.has_pending() {
                                    d.communicate().unwrap();
                                }
                                let mut v: Vec<f64> = x.iter().map(|&v| v as f64).collect();
                                inner(m, s, &mut v);
                                x = v.iter().map(|&v| v as f32).collect();
                                d.after_step(&mut x, s).unwrap();
                                let sent = d.comm().stats().bytes_sent - before;
                                assert_eq!(sent, crate::sync::trace::sent_by(&want, m), "step {s}");
                            }
                            x
                        })
                    })
                    .collect();
                jobs.into_iter().map(|j| j.join().unwrap()).collect()
            });
            for m in 0..n {
                for i in 0..len {
                    let (g, w) = (got[m][i] as f64, want[m][i]);
                    assert!(
                        (g - w).abs() < 1e-5 * (1.0 + w.abs()),
                        "H {h} rank {m} [{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }
}

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
//! Fragments are contiguous ranges of the name-ordered flat buffer cut on row boundaries (a row: one row
//! of a matrix, or a whole vector), of about numel / F values each.

use std::ops::Range;

use anyhow::{bail, Result};

use super::compress::{self, take, Reducer, State};
use super::trace::{Collective, Op, Overlap};
use super::{Metrics, SyncBackend};
use crate::comm::{all_reduce_mean_flat, pack_u64, unpack_u64, Communicator};
use crate::config::backend::{DilocoConfig, Quantize};
use crate::flat::{Flat, FlatMut, FlatRef, Place};
use crate::kernels::optim as kernels;
use crate::kernels::Segment;
use crate::optim::norm;

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
    reduced: bool,
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
    /// This rank's pseudo-gradient norm and distance from the average at the last sync, until logged.
    pending: Option<(f64, f64)>,
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
            pending: None,
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
                    d => d.through_host(|d| super::quantize::all_reduce_mean(comm, d, rows, q))?,
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

    /// Moves the state beside the parameters (a restored state is in host memory).
    fn settle(&mut self, place: &Place) -> Result<()> {
        self.backup.move_to(place)?;
        self.momentum.move_to(place)?;
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
    /// A fragment's pseudo-gradient averaged at its sync point: in the step that reaches it, or with
    /// `fragment_delay` d in the step d before it, beside that step's forward and backward pass.
    fn step_comm(&self, step: u64) -> Vec<Collective> {
        let (delay, n) = (self.cfg.fragment_delay, self.world_size());
        let at = if delay == 0 { step + 1 } else { step + delay };
        let Some(f) = self.fragment_at(at) else {
            return Vec::new();
        };
        let overlap = if delay == 0 {
            Overlap::None
        } else {
            Overlap::Compute
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
    fn has_pending(&self) -> bool {
        self.inflight.as_ref().is_some_and(|f| !f.reduced)
    }
    fn communicate(&mut self) -> Result<()> {
        if let Some(mut f) = self.inflight.take() {
            if !f.reduced {
                self.reduce(f.fragment, &mut f.delta)?;
                f.reduced = true;
            }
            self.inflight = Some(f);
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
                    reduced: false,
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
        Ok(s)
    }
    /// The worker continues from the global model.
    fn recovered(&mut self, state: State, params: &mut [f32]) -> Result<()> {
        if state.is_empty() {
            return Ok(());
        }
        self.load_state(state)?;
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
            let meta = [f.fragment as u64, f.sync_at, f.reduced as u64];
            s.push(("diloco.inflight".into(), host(&f.delta)?));
            s.push(("diloco.inflight_meta".into(), words(&meta)));
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
                    .map(|(n, b)| (format!("compress.{n}"), b)),
            );
        }
        Ok(s)
    }
    fn load_state(&mut self, mut state: State) -> Result<()> {
        let numel = self.fragments.last().map_or(0, |f| f.range.end);
        let (inner, rest): (State, State) = std::mem::take(&mut state)
            .into_iter()
            .partition(|(n, _)| n.starts_with("compress."));
        state = rest;
        if let Some(r) = &mut self.reducer {
            let inner = inner
                .into_iter()
                .map(|(n, b)| (n["compress.".len()..].to_string(), b))
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
                reduced: meta[2] != 0,
            });
        }
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
}

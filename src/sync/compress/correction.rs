//! Radius's "correction" mode: the reducer runs Adam itself (lr = 1, no weight decay) on the reduced
//! gradient and hands the Adam direction to a plain SGD outer optimizer (`optim::Sgd`, which applies the
//! learning rate and decoupled weight decay); gradient clipping moves into the reducer, before Adam.
//!
//! The Adam here is `optim::AdamW` itself, stepped with lr = 1 on a zero buffer: the buffer then holds
//! minus the direction m̂ / (sqrt(v̂) + eps). Its moments see the reduced gradient, zero outside the mask,
//! so the momentum of unselected coordinates keeps decaying. With SGD applying p (1 - lr wd) - lr d this is
//! AdamW's update on the reduced gradient, so both modes train the same model up to float rounding
//! (tests/it/compression.rs checks it); a checkpoint moves between them with its Adam state (`carry_over`).

use anyhow::Result;

use super::{Reducer, Report, State};
use crate::comm::Communicator;
use crate::flat::{Flat, FlatMut, Place};
use crate::kernels::Segment;
use crate::optim::{self, OptimState, Optimizer};

/// The Adam state's buffers in the reducer state are `correction.<AdamW buffer name>` (the rest of the
/// state is the inner reducer's), with its step count packed by `comm::pack_u64` in `T`.
const PREFIX: &str = "correction.";
const T: &str = "correction.step";

pub struct Corrected {
    inner: Box<dyn Reducer>,
    adam: Box<dyn Optimizer>,
    betas: [f64; 2],
    eps: f64,
    clip: f64,
    numel: usize,
    /// Adam's output buffer, beside the gradient (and Adam's moments with it).
    direction: Flat,
}

impl Corrected {
    /// `inner` reduces; Adam with `betas` and `eps` (the config's AdamW) runs on its output, clipped to
    /// global norm `clip` (<= 0: no clipping).
    pub fn new(
        inner: Box<dyn Reducer>,
        numel: usize,
        betas: [f64; 2],
        eps: f64,
        clip: f64,
    ) -> Self {
        Self {
            inner,
            adam: adam(numel, betas, eps, &Place::Host)
                .expect("host buffers: building cannot fail"),
            betas,
            eps,
            clip,
            numel,
            direction: Flat::Host(Vec::new()),
        }
    }
}

fn adam(numel: usize, betas: [f64; 2], eps: f64, place: &Place) -> Result<Box<dyn Optimizer>> {
    let cfg = crate::config::OptimConfig::AdamW(crate::config::AdamWConfig {
        betas,
        eps,
        weight_decay: 0.0,
    });
    let all = Segment::flat(0, numel, false);
    optim::build(&cfg, vec![all], &[], numel, place)
}

impl Reducer for Corrected {
    fn reduce(
        &mut self,
        comm: &mut dyn Communicator,
        grads: &mut [f32],
        step: u64,
    ) -> Result<Report> {
        self.reduce_flat(comm, grads.into(), step)
    }

    /// The inner reduction, then Adam on its clipped output (clipping's factor applied as Adam reads
    /// the gradient, as the loop's optimizer does), wherever the gradient lives: Adam's moments and its
    /// output move beside it (with their state) the first time.
    fn reduce_flat(
        &mut self,
        comm: &mut dyn Communicator,
        mut grads: FlatMut<'_>,
        step: u64,
    ) -> Result<Report> {
        let mut report = self.inner.reduce_flat(comm, grads.reborrow(), step)?;
        let norm = optim::norm(grads.as_ref())?;
        report.grad_norm = Some(norm);
        if !self.direction.beside(grads.as_ref()) {
            let place = grads.as_ref().place();
            let mut moved = adam(self.numel, self.betas, self.eps, &place)?;
            moved.load_state(self.adam.state()?)?;
            (self.adam, self.direction) = (moved, place.zeros(self.numel)?);
        }
        self.direction.as_mut().fill_zero()?;
        let clip = optim::clip_factor(norm, self.clip);
        self.adam
            .step_scaled(self.direction.as_mut(), grads.as_ref(), 1.0, clip)?;
        grads.assign_scaled(self.direction.as_ref(), -1.0)?;
        Ok(report)
    }

    fn step_comm(&self, world: usize, step: u64) -> Vec<crate::sync::trace::Collective> {
        self.inner.step_comm(world, step)
    }

    fn state(&self) -> Result<State> {
        let mut state = self.inner.state()?;
        push_adam(&mut state, self.adam.state()?);
        Ok(state)
    }

    fn load_state(&mut self, state: State) -> Result<()> {
        let rest = self.load_adam(state)?;
        self.inner.load_state(rest)
    }

    /// The inner reducer's shared part and Adam, which every rank steps alike on the reduced gradient.
    fn shared_state(&self) -> Result<State> {
        let mut state = self.inner.shared_state()?;
        push_adam(&mut state, self.adam.state()?);
        Ok(state)
    }

    fn rejoined(&mut self, shared: State) -> Result<()> {
        let rest = self.load_adam(shared)?;
        self.inner.rejoined(rest)
    }
}

impl Corrected {
    /// Adam's part of `state` (none: a fresh Adam); returns the rest, the inner reducer's.
    fn load_adam(&mut self, state: State) -> Result<State> {
        let (saved, rest) = split_adam(state)?;
        match saved {
            Some(s) => self.adam.load_state(s)?,
            None => self.adam = adam(self.numel, self.betas, self.eps, &self.direction.place())?,
        }
        Ok(rest)
    }
}

/// Appends an AdamW state (step and moments) to a reducer state.
fn push_adam(state: &mut State, adam: OptimState) {
    state.push((T.into(), crate::comm::pack_u64(adam.step).to_vec()));
    for (name, b) in adam.buffers {
        state.push((format!("{PREFIX}{name}"), b));
    }
}

/// Splits the Adam buffers of `push_adam` out of a reducer state, as an AdamW optimizer state (None when
/// there are none), and the rest.
fn split_adam(state: State) -> Result<(Option<OptimState>, State)> {
    let (saved, rest): (State, State) = state.into_iter().partition(|(n, _)| n.starts_with(PREFIX));
    if saved.is_empty() {
        return Ok((None, rest));
    }
    let mut adam = OptimState {
        name: "adamw".into(),
        step: 0,
        buffers: Vec::new(),
    };
    let mut step = None;
    for (n, b) in saved {
        if n == T && b.len() == 2 {
            step = Some(crate::comm::unpack_u64([b[0], b[1]]));
        } else if let Some(name) = n.strip_prefix(PREFIX) {
            adam.buffers.push((name.to_string(), b));
        }
    }
    let Some(step) = step else {
        anyhow::bail!(crate::error::BadInput(format!(
            "checkpoint: the reducer state has Adam moments but no valid {T}"
        )));
    };
    adam.step = step;
    Ok((Some(adam), rest))
}

/// Moves a checkpoint's Adam state to where this run keeps it: into the reducer state when the run uses
/// correction and the checkpoint holds an AdamW optimizer (a dense or plain-mode run), back into an
/// AdamW optimizer state when the run does not and the checkpoint used correction. Returns the
/// (optimizer, reducer) states to load.
pub fn carry_over(
    correction: bool,
    opt: OptimState,
    reducer: State,
) -> Result<(OptimState, State)> {
    let has = reducer.iter().any(|(n, _)| n == T);
    if correction && opt.name == "adamw" && !has {
        let (step, mut reducer) = (opt.step, reducer);
        push_adam(&mut reducer, opt);
        return Ok((optim::Sgd::state_at(step), reducer));
    }
    if !correction && opt.name == "sgd" && has {
        let (adam, rest) = split_adam(reducer)?;
        return Ok((adam.unwrap_or(opt), rest));
    }
    Ok((opt, reducer))
}

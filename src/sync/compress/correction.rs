//! Radius's "correction" mode: the reducer runs Adam itself (lr = 1, no weight decay) on the reduced
//! gradient and hands the Adam direction to a plain SGD outer optimizer (`optim::Sgd`, which applies the
//! learning rate and decoupled weight decay); gradient clipping moves into the reducer, before Adam.
//!
//! The Adam here is `optim::AdamW` itself, stepped with lr = 1 on a zero buffer: the buffer then holds
//! minus the direction m̂ / (sqrt(v̂) + eps). Its moments see the reduced gradient, zero outside the mask,
//! so the momentum of unselected coordinates keeps decaying. With SGD applying p (1 - lr wd) - lr d this is
//! AdamW's update on the reduced gradient, so both modes train the same model up to float rounding
//! (tests/compression.rs checks it); a checkpoint moves between them with its Adam state (`carry_over`).

use anyhow::Result;

use super::{take, Reducer, Report, State};
use crate::comm::Communicator;
use crate::optim::{self, OptimState, Optimizer, Segment};

/// The Adam state's buffer names in the reducer state (the rest of the state is the inner reducer's).
const M: &str = "correction.exp_avg";
const V: &str = "correction.exp_avg_sq";
/// Adam's step count, as three 16-bit pieces (exact in f32).
const T: &str = "correction.step";

pub struct Corrected {
    inner: Box<dyn Reducer>,
    adam: Box<dyn Optimizer>,
    betas: [f64; 2],
    eps: f64,
    clip: f64,
    numel: usize,
    direction: Vec<f32>,
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
            adam: adam(numel, betas, eps),
            betas,
            eps,
            clip,
            numel,
            direction: Vec::new(),
        }
    }
}

fn adam(numel: usize, betas: [f64; 2], eps: f64) -> Box<dyn Optimizer> {
    let cfg = crate::config::OptimConfig::AdamW(crate::config::AdamWConfig {
        betas,
        eps,
        weight_decay: 0.0,
    });
    let all = Segment {
        offset: 0,
        len: numel,
        decay: false,
    };
    optim::build(&cfg, vec![all], numel)
}

impl Reducer for Corrected {
    fn reduce(
        &mut self,
        comm: &mut dyn Communicator,
        grads: &mut [f32],
        step: u64,
    ) -> Result<Report> {
        let mut report = self.inner.reduce(comm, grads, step)?;
        report.grad_norm = Some(optim::clip_grad_norm(grads, self.clip));
        self.direction.clear();
        self.direction.resize(grads.len(), 0.0);
        self.adam.step(&mut self.direction, grads, 1.0);
        for (g, d) in grads.iter_mut().zip(&self.direction) {
            *g = -d;
        }
        Ok(report)
    }

    fn state(&self) -> State {
        let mut state = self.inner.state();
        push_adam(&mut state, self.adam.state());
        state
    }

    fn load_state(&mut self, mut state: State) -> Result<()> {
        if state.iter().any(|(n, _)| n == T) {
            let adam = OptimState {
                name: "adamw".into(),
                step: decode_step(&take(&mut state, T, Some(3))?),
                buffers: vec![
                    ("exp_avg".into(), take(&mut state, M, Some(self.numel))?),
                    ("exp_avg_sq".into(), take(&mut state, V, Some(self.numel))?),
                ],
            };
            self.adam.load_state(adam)?;
        } else {
            self.adam = adam(self.numel, self.betas, self.eps);
        }
        self.inner.load_state(state)
    }
}

/// Appends an AdamW state (step and moments) to a reducer state.
fn push_adam(state: &mut State, adam: OptimState) {
    let t = adam.step;
    let step = vec![
        (t >> 32) as f32,
        ((t >> 16) & 0xffff) as f32,
        (t & 0xffff) as f32,
    ];
    state.push((T.into(), step));
    for (name, b) in adam.buffers {
        state.push((format!("correction.{name}"), b));
    }
}

fn decode_step(t: &[f32]) -> u64 {
    t.iter().fold(0u64, |acc, &x| (acc << 16) | x as u64)
}

/// Moves a checkpoint's Adam state to where this run keeps it: into the reducer state when the run uses
/// correction and the checkpoint holds an AdamW optimizer (a dense or plain-mode run), back into an
/// AdamW optimizer state when the run does not and the checkpoint used correction. Returns the
/// (optimizer, reducer) states to load.
pub fn carry_over(correction: bool, opt: OptimState, mut reducer: State) -> (OptimState, State) {
    let has = reducer.iter().any(|(n, _)| n == T);
    if correction && opt.name == "adamw" && !has {
        let step = opt.step;
        push_adam(&mut reducer, opt);
        return (optim::Sgd::state_at(step), reducer);
    }
    if !correction && opt.name == "sgd" && has {
        let (adam, rest): (State, State) = reducer
            .into_iter()
            .partition(|(n, _)| n.starts_with("correction."));
        let mut adam_state = OptimState {
            name: "adamw".into(),
            step: opt.step,
            buffers: Vec::new(),
        };
        for (n, b) in adam {
            match n.strip_prefix("correction.") {
                Some("step") => adam_state.step = decode_step(&b),
                Some(name) => adam_state.buffers.push((name.to_string(), b)),
                None => {}
            }
        }
        return (adam_state, rest);
    }
    (opt, reducer)
}

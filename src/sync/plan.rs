//! How the workers synchronise, resolved: the backend's variant with every default and cross-field rule
//! applied (by `crate::plan`, once). `sync::build` turns it into the backend; nothing else reads the
//! config's backend keys.

use super::choco::ChocoPlan;
use crate::config::backend::{
    Backend, DemoConfig, DilocoConfig, PowerSgdConfig, RadiusConfig, SparseLocoConfig, TopKConfig,
    Topology,
};

/// How the workers synchronise (see the module's doc).
#[derive(Debug, Clone, PartialEq)]
pub enum SyncPlan {
    /// Gradient averaging by all-reduce in buckets of `bucket_elems` floats (PyTorch DDP).
    AllReduce { bucket_elems: usize },
    /// Parameter gossip over `topology` for `ranks_per_node` ranks to a node (Decent-DP).
    Gossip {
        topology: Topology,
        overlap: bool,
        ranks_per_node: usize,
        /// CHOCO-SGD compressed gossip (`[train.compression]` under decentdp).
        choco: Option<ChocoPlan>,
    },
    /// Gradient averaging through a compressed reducer.
    Compressed(ReducerPlan),
    /// DiLoCo / Streaming DiLoCo; `reducer` compresses the pseudo-gradients.
    Diloco {
        cfg: DilocoConfig,
        reducer: Option<ReducerPlan>,
    },
    /// SPARTA: a fraction `p` of the entries averaged after every step, masks drawn from `seed`.
    Sparta { p: f64, seed: u64 },
    /// DeMo; the loop's SGD applies its sign direction with decoupled `weight_decay`. The local gradient
    /// is clipped to `clip` before it enters the momentum (the sign is not clipped).
    Demo {
        cfg: DemoConfig,
        weight_decay: f64,
        clip: f64,
    },
}

/// A compressed reducer with its settings.
#[derive(Debug, Clone, PartialEq)]
pub enum ReducerPlan {
    TopK(TopKConfig),
    /// Radius stable top-k; `correction` runs Adam inside the reducer (see `sync::compress::correction`).
    Radius {
        cfg: RadiusConfig,
        correction: Option<Correction>,
    },
    /// PowerSGD; `seed` draws the initial factors.
    PowerSgd {
        cfg: PowerSgdConfig,
        seed: u64,
    },
    /// SparseLoCo (DiLoCo's pseudo-gradients only).
    SparseLoco(SparseLocoConfig),
}

/// Radius's correction mode: Adam with the run's AdamW betas and eps, clipping to `clip` inside the reducer;
/// the loop's SGD applies AdamW's `weight_decay`.
#[derive(Debug, Clone, PartialEq)]
pub struct Correction {
    pub betas: [f64; 2],
    pub eps: f64,
    pub clip: f64,
    pub weight_decay: f64,
}

impl SyncPlan {
    /// The backend's name as the config spells it.
    pub fn backend_name(&self) -> &'static str {
        match self {
            SyncPlan::AllReduce { .. } | SyncPlan::Compressed(_) => Backend::PytorchDdp.name(),
            SyncPlan::Gossip { .. } => Backend::DecentDp.name(),
            SyncPlan::Diloco { .. } => Backend::Diloco.name(),
            SyncPlan::Sparta { .. } => Backend::Sparta.name(),
            SyncPlan::Demo { .. } => Backend::Demo.name(),
        }
    }

    /// The decoupled weight decay of a plain SGD that the loop steps instead of `train.optim`'s update:
    /// Radius's correction runs Adam inside the reducer, DeMo computes its own direction.
    pub fn plain_sgd_in_loop(&self) -> Option<f64> {
        match self {
            SyncPlan::Demo { weight_decay, .. } => Some(*weight_decay),
            SyncPlan::Compressed(ReducerPlan::Radius {
                correction: Some(c),
                ..
            }) => Some(c.weight_decay),
            _ => None,
        }
    }

    /// Whether every rank applies the same update to the same parameters, so that the replicas stay equal:
    /// the gradient-reducing backends. Then the local engine keeps one replica (`train::replica`), the
    /// loop skips the backend's parameter hooks (`SyncBackend::before_step`, `after_step`), and there is
    /// no consensus distance to report. Stated here alone: the backends do not restate it.
    pub fn replicas_stay_equal(&self) -> bool {
        matches!(
            self,
            SyncPlan::AllReduce { .. } | SyncPlan::Compressed(_) | SyncPlan::Demo { .. }
        )
    }

    /// Whether Adam runs inside the reducer (its state then travels with the reducer's).
    pub fn adam_in_reducer(&self) -> bool {
        matches!(
            self,
            SyncPlan::Compressed(ReducerPlan::Radius {
                correction: Some(_),
                ..
            })
        )
    }

    /// One line for `check` and the start of a run.
    pub fn describe(&self) -> String {
        match self {
            SyncPlan::AllReduce { bucket_elems } => {
                format!(
                    "all-reduce in buckets of {:.1} MB",
                    *bucket_elems as f64 * 4.0 / 1e6
                )
            }
            SyncPlan::Gossip {
                topology,
                overlap,
                ranks_per_node,
                choco,
            } => format!(
                "gossip over {:?}, {ranks_per_node} rank(s) per node, {}{}",
                topology.name(),
                if *overlap {
                    "overlapped with the next step (Decent-DP's; overlap = false: synchronous)"
                } else {
                    "synchronous"
                },
                choco.as_ref().map_or(String::new(), |c| format!(
                    ", CHOCO compressed: {}, consensus step {}",
                    c.compressor.describe(),
                    if c.tuned {
                        format!("{:.4} (auto: tuned on the consensus of random vectors)", c.gamma)
                    } else {
                        c.gamma.to_string()
                    }
                ))
            ),
            SyncPlan::Diloco { cfg, reducer } => format!(
                "diloco: sync every {} steps, outer SGD lr {} momentum {}{}, {} fragment(s){}, quantize {}{}",
                cfg.sync_every,
                cfg.outer_lr,
                cfg.outer_momentum,
                if cfg.nesterov { " (Nesterov)" } else { "" },
                cfg.fragments,
                if cfg.fragments > 1 {
                    format!(" (delay {}, alpha {})", cfg.fragment_delay, cfg.fragment_alpha)
                } else {
                    String::new()
                },
                cfg.quantize.name(),
                reducer
                    .as_ref()
                    .map_or(String::new(), |r| format!(", pseudo-gradients by {}", r.describe()))
            ) + &diloco_extras(cfg),
            SyncPlan::Sparta { p, .. } => {
                format!("sparta: average a fraction {p} of the parameters after every step")
            }
            SyncPlan::Demo {
                cfg, weight_decay, ..
            } => format!(
                "demo: decay {}, top {} DCT coefficients per chunk of {}, sign update with SGD \
                 (lr schedule, decoupled weight decay {weight_decay})",
                cfg.decay, cfg.topk, cfg.chunk
            ),
            SyncPlan::Compressed(r) => r.describe(),
        }
    }
}

/// Eager outer steps and hierarchical groups, as `describe` says them.
fn diloco_extras(cfg: &DilocoConfig) -> String {
    let mut s = String::new();
    if cfg.eager {
        let pieces = cfg.eager_pieces.unwrap_or(1);
        s +=
            &format!(", eager outer steps (all-reduce in {pieces} piece(s) beside the next steps)");
    }
    if cfg.group_size > 1 {
        s += &format!(
            ", groups of {} ranks all-reducing gradients every step",
            cfg.group_size
        );
    }
    s
}

impl ReducerPlan {
    fn describe(&self) -> String {
        match self {
            ReducerPlan::TopK(k) => format!(
                "top-k density {}, error feedback {}",
                k.density,
                k.error_feedback_on()
            ),
            ReducerPlan::Radius { cfg, correction } => format!(
                "radius density {}, interval {}, dense until step {}{}",
                cfg.density,
                cfg.interval,
                cfg.threshold,
                if correction.is_some() {
                    ", correction"
                } else {
                    ""
                }
            ),
            ReducerPlan::PowerSgd { cfg, .. } => format!(
                "powersgd rank {}, dense until step {}{}",
                cfg.rank,
                cfg.start_iter,
                if cfg.single_allreduce {
                    ", one all-reduce per step"
                } else {
                    ""
                }
            ),
            ReducerPlan::SparseLoco(c) => format!(
                "sparseloco density {} per chunk of {}, {}-bit values, error-feedback decay {}",
                c.density, c.chunk, c.bits, c.error_decay
            ),
        }
    }
}

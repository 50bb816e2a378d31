//! nanodist: declarative GPT pre-training experiments with allreduce, gossip and compressed data
//! parallelism, on Candle.
// Every unsafe operation sits in an `unsafe` block of its own with a `// SAFETY:` comment, inside unsafe
// functions too.
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod comm;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod device;
pub mod error;
pub mod flat;
pub mod generate;
pub mod kernels;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod netlab;
pub mod optim;
pub mod plan;
pub mod predict;
pub mod report;
pub mod slurm;
pub mod sync;
pub mod train;
pub mod units;

//! nanodist: declarative GPT pre-training experiments with allreduce, gossip and compressed data
//! parallelism, on Candle.

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
pub mod optim;
pub mod plan;
pub mod predict;
pub mod report;
pub mod slurm;
pub mod sync;
pub mod train;
pub mod units;

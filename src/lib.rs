//! nanodist: declarative GPT pre-training experiments with allreduce, gossip and compressed data
//! parallelism, on Candle.

pub mod config;
pub mod data;
pub mod error;

//! The integration tests that train in this process or run the `nanodist` binary on small configs: one test
//! binary (each links Candle), a module per subject. Jobs across processes and the timing-bound tests are
//! in `tests/cluster`; the memory estimate (its own global allocator) in `tests/memory.rs`; the GPU kernels
//! in `tests/gpu.rs`.

#[path = "../common/mod.rs"]
mod common;

mod choco;
mod churn;
mod cli;
mod compression;
mod config_errors;
mod config_files;
mod data;
mod distributed;
mod experiments;
mod lowcomm;
mod predict;
mod readme;
mod report;
mod tokenizer;
mod torch_parity;
mod tracking;
mod train;

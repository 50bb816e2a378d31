//! The GPT model and its parameters.

pub mod cpu;
pub mod fused;
pub mod gpt;
pub mod matmul;
pub mod ops;
pub mod params;

pub use cpu::Scratch;
pub use gpt::Gpt;
pub use params::{Param, ParamSet};

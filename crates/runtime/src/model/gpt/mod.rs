//! pipewright's GPT family: its layer blocks, rules and costs, and its Hugging Face form (with its own PyTorch code).

mod blocks;
mod costs;
pub mod hf;
mod rules;

pub use blocks::*;

//! pipewright's GPT family: its layer blocks, rules and costs (no Hugging Face form).

mod blocks;
mod costs;
pub mod hf;
mod rules;

pub use blocks::*;

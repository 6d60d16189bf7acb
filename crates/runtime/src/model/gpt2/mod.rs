//! The GPT-2 family: its layer blocks and its Hugging Face form.

mod blocks;
pub mod hf;
mod rules;

pub use blocks::*;

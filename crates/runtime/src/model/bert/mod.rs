//! The BERT family: its layer blocks and its Hugging Face form.

mod blocks;
mod costs;
pub mod hf;
mod rules;

pub use blocks::*;

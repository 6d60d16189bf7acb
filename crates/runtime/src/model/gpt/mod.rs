//! pipewright's GPT family. Its blocks are the model's defaults in `model/mod.rs`.

mod costs;
pub mod hf;
mod rules;

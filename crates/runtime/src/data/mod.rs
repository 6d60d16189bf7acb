//! The data wing: the one place that opens data. [`source::open`] turns a recorded
//! [`source::DataSource`] into a [`corpus::Corpus`] that fits the model; the rest are its
//! readers (records, examples, token shards, SQuAD), the tokenizers and the batch sampler.

pub mod corpus;
pub mod error;
pub mod examples;
pub mod records;
pub mod shards;
pub mod source;
pub mod squad;
pub mod tokenizer;
pub mod tokenizer_json;
pub mod tokens;

pub use corpus::*;
pub use error::{Error, Field};

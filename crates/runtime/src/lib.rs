//! pipewright-runtime: trains a real model from a Plan IR with burn.

pub mod backend;
pub mod data;
pub mod exec;
pub mod model;
pub mod profile;
pub mod train;
pub mod transport;

pub use burn;

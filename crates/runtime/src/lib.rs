//! pipewright-runtime: trains a real model from a Plan IR with burn.

pub mod backend;
pub mod batch;
pub mod cache;
pub mod data;
pub mod error;
pub mod exec;
pub mod grads;
pub mod guard;
pub mod kernels;
pub mod machine;
pub mod model;
pub mod profile;
pub mod train;
pub mod transport;

pub use burn;

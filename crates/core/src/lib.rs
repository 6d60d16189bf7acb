//! pipewright-core: plain data and pure functions for pipeline-parallel training.
//!
//! Profiles and clusters describe the work; schedule generators produce a [`ir::Plan`]; the
//! validator checks it; the simulator predicts its time and memory; timelines draw it.

pub mod cluster;
pub mod elastic;
pub mod error;
pub mod freeze;
pub mod fuzz;
pub mod ir;
pub mod partition;
pub mod planner;
pub mod profile;
pub mod rng;
pub mod schedule;
pub mod sim;
pub mod skip;
pub mod skipplan;
pub mod timeline;
pub mod validate;
pub mod zbauto;

pub use error::{Error, Result};

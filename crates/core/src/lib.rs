//! pipewright-core: plain data and pure functions for pipeline-parallel training.
//!
//! Layers, lowest first (each uses only those above it in this list):
//! - `error`, `inputs`, `rng`, `limits`: leaves (`inputs` checks and remembers the files read).
//! - `profile`, `cluster`: what the work costs and where it runs.
//! - `plan`: the IR ([`plan::ir::Plan`]), its schedule kind and its validator.
//! - `schedule`: closed-form and list-scheduled generators (GPipe, 1F1B, interleaved, ZB).
//! - `sim`: the simulator and timelines.
//! - `search`: partitioner, zb-auto's order search, SkipPipe's rules and routes.
//! - `job`: the one function from a job spec to a validated plan, and the planner over specs.
//! - `policy`: freeze and elastic decisions during training.

pub mod cluster;
pub mod error;
pub mod fuzz;
pub mod inputs;
pub mod job;
pub mod limits;
pub mod plan;
pub mod policy;
pub mod profile;
pub mod rng;
pub mod schedule;
pub mod search;
pub mod sim;

pub use error::{Error, Result};

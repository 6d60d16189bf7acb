//! Training a whole-job plan: configuration, the pipelined trainer, the single-worker reference
//! trainer and checkpoints, one file each.

mod checkpoint;
mod config;
mod plain;
pub mod store;
mod trainer;

pub use checkpoint::{checkpoint_config, Resumed};
pub use config::TrainConfig;
pub use plain::PlainTrainer;
pub use trainer::{describe, ReplanReport, StepReport, Trainer};

//! Training a whole-job plan: configuration, the pipelined trainer, the run around it (step
//! loop, cadences, resume, freezing), the single-worker reference trainer and checkpoints.

mod checkpoint;
mod config;
pub mod freeze;
mod layers;
mod plain;
pub mod run;
mod settings;
pub mod store;
pub mod tensorboard;
mod tied;
mod trainer;
pub mod writers;

pub use crate::data::source::DataSource;
pub use checkpoint::{checkpoint_config, checkpoint_run_settings, Resumed};
pub use config::{LrSchedule, PlanIn, SkipPlanned, SkipSearch, TrainConfig};
pub use freeze::{FreezeController, FreezeSettings};
pub use layers::{hf_layers, hf_params, hf_start};
pub use plain::PlainTrainer;
pub use run::{Checkpointing, RunConfig, RunSink, RunStart, RunSummary, StepRow, TrainingRun};
pub use settings::{DeviceKind, ElasticBatch, Metric, RunSettings, TransportKind};
pub use trainer::{describe, BatchGradients, ReplanReport, StepReport, Trainer, Validation};
pub use writers::{Fanout, MetricsFile, TensorBoard};

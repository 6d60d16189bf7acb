//! `train` and `profile`: run a plan on the real model, and measure the model's layers.

mod args;
mod command;
mod profile;
mod settings;
mod sink;

pub use args::TrainArgs;
pub use command::cmd_train;
pub(crate) use command::progress_bar;
pub use profile::ProfileArgs;
pub use profile::{cmd_profile, model_to_measure, profile_summary};

//! Errors of the runtime: each names what is wrong and where.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Settings, or a plan, that this model cannot train with.
    #[error("{0}")]
    Config(String),
    /// A checkpoint that cannot be written or read.
    #[error("{}: {msg}", path.display())]
    Checkpoint { path: PathBuf, msg: String },
    /// A fresh run's checkpoint directory holds an earlier run's checkpoints (the newest at
    /// `step`): the run must resume it, overwrite it, or take another directory.
    #[error("{}: holds an earlier run's checkpoints (the newest at step {step}); resume that run, overwrite its checkpoints, or choose another directory", dir.display())]
    EarlierRun { dir: PathBuf, step: u64 },
    /// A plan, profile or cluster error from core, kept typed (the CLI names its flag).
    #[error(transparent)]
    Core(#[from] pipewright_core::Error),
    /// A model that cannot be built, loaded, or given this data.
    #[error(transparent)]
    Model(#[from] crate::model::error::Error),
    /// Data that cannot be read, or does not fit the run.
    #[error(transparent)]
    Data(#[from] crate::data::Error),
    /// A worker failed during a step.
    #[error(transparent)]
    Exec(#[from] crate::exec::ExecError),
    /// A file the run writes (metrics, traces) cannot be written.
    #[error("{what}: {err}")]
    Io { what: String, err: std::io::Error },
    /// A worker failed during optimizer step `step` (counted from 1).
    #[error("step {step}: {exec}")]
    Step {
        step: u64,
        exec: crate::exec::ExecError,
    },
}

impl Error {
    pub fn checkpoint(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.into(),
            msg: msg.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

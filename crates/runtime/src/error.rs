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
    /// A plan, profile or cluster error from core, kept typed (the CLI names its flag).
    #[error(transparent)]
    Core(#[from] pipewright_core::Error),
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

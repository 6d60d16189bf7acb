//! Errors of the core crate: every one names what is wrong and where.

use thiserror::Error;

/// A part of a job's shape. Library messages name it in words; each command names it by its
/// own flag (`train --replicas` is `skip-plan --data-nodes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// Stages (workers) per pipeline.
    Depth,
    /// Stage chunks per worker.
    Chunks,
    /// Data-parallel replicas; SkipPipe's data nodes.
    Replicas,
    /// Micro-batches per replica.
    Microbatches,
    /// Stages each micro-batch skips.
    Skip,
    /// Micro-batches per iteration over all replicas.
    GlobalBatch,
}

impl Field {
    pub fn name(self) -> &'static str {
        match self {
            Field::Depth => "stages",
            Field::Chunks => "chunks per worker",
            Field::Replicas => "replicas",
            Field::Microbatches => "micro-batches",
            Field::Skip => "skipped stages",
            Field::GlobalBatch => "global batch",
        }
    }
}

#[derive(Debug, Error, Clone, PartialEq)]
pub enum Error {
    /// A value of the job's shape that cannot work: `field` was `value`.
    #[error("{} {value}: {msg}", field.name())]
    Shape {
        field: Field,
        value: String,
        msg: String,
    },
    /// A profile, cluster or plan file is malformed or inconsistent.
    #[error("{file}: {msg}")]
    Input { file: String, msg: String },
    /// A schedule generator was asked for something it cannot build.
    #[error("{0}")]
    Schedule(String),
    /// A plan breaks a rule; the message names worker, position and action.
    #[error("{0}")]
    Invalid(String),
    /// No partition or plan fits the constraints.
    #[error("{0}")]
    Infeasible(String),
    /// A fault of pipewright itself (a generated plan that breaks a rule, a simulation that
    /// cannot finish a valid plan), not of the input.
    #[error("internal error: {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn shape(field: Field, value: impl ToString, msg: impl Into<String>) -> Self {
        Error::Shape {
            field,
            value: value.to_string(),
            msg: msg.into(),
        }
    }

    pub fn input(file: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Input {
            file: file.into(),
            msg: msg.into(),
        }
    }
}

/// Parse TOML into `T`, turning the parser's multi-line report into one line with
/// line and column.
pub fn parse_toml<T: serde::de::DeserializeOwned>(file: &str, text: &str) -> Result<T> {
    toml::from_str(text).map_err(|e| {
        let msg = e.message().trim().replace('\n', " ");
        match e.span() {
            Some(span) => {
                let (line, col) = line_col(text, span.start);
                Error::input(file, format!("line {line}, column {col}: {msg}"))
            }
            None => Error::input(file, msg),
        }
    })
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

/// Read a file, naming it in the error.
pub fn read_file(path: &std::path::Path) -> Result<String> {
    let name = || path.display().to_string();
    // A FIFO or device would block the read (or never end): only regular files are read.
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => {
            return Err(Error::input(
                name(),
                "cannot read: not a regular file (a directory, FIFO or device)",
            ))
        }
        _ => {}
    }
    std::fs::read_to_string(path).map_err(|e| Error::input(name(), format!("cannot read: {e}")))
}

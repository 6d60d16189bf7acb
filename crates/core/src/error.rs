//! Errors of the core crate: every one names what is wrong and where.

use thiserror::Error;

/// A part of a job's shape. Library messages name it in words; each command names it by its
/// own flag (`elastic-sim` calls replicas `--pipelines`).
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
    toml::from_str(text).map_err(|e| located(file, text, e))
}

/// Parse TOML whose table `key` (if present) is a `B` and whose other keys are an `A`; errors
/// in either name the line and column, as [`parse_toml`]'s do.
pub fn parse_toml_split<A, B>(file: &str, text: &str, key: &str) -> Result<(A, Option<B>)>
where
    A: serde::de::DeserializeOwned,
    B: serde::de::DeserializeOwned,
{
    use serde::Deserialize;
    use toml::de::{DeTable, Deserializer};
    let err = |e| located(file, text, e);
    let mut rest = DeTable::parse(text).map_err(err)?;
    let span = rest.span();
    let found = rest.get_ref().keys().find(|k| k.get_ref() == key).cloned();
    let mut part = DeTable::new();
    if let Some(k) = found {
        let v = rest.get_mut().remove(&k).expect("the key was just found");
        part.insert(k, v);
    }
    let a = A::deserialize(Deserializer::from(rest)).map_err(err)?;
    #[derive(Deserialize)]
    struct Part<B> {
        #[serde(rename = "part")]
        inner: Option<B>,
    }
    // The part under a fixed name, so that `B` keeps its own field names in errors.
    let part: DeTable = part
        .into_iter()
        .map(|(k, v)| (toml::Spanned::new(k.span(), "part".into()), v))
        .collect();
    let b =
        Part::<B>::deserialize(Deserializer::from(toml::Spanned::new(span, part))).map_err(err)?;
    Ok((a, b.inner))
}

/// A parser error as one line, with the line and column where it has a place.
fn located(file: &str, text: &str, e: toml::de::Error) -> Error {
    let msg = e.message().trim().replace('\n', " ");
    match e.span() {
        Some(span) => {
            let (line, col) = line_col(text, span.start);
            Error::input(file, format!("line {line}, column {col}: {msg}"))
        }
        None => Error::input(file, msg),
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

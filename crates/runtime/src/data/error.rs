//! Errors of the data wing. Each names the file and record; one a setting caused names the
//! setting as a [`Field`], which each front end spells its own way (the CLI as its flag).

/// A data setting, named in words here; the CLI names its flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// The training data's path.
    Data,
    /// The held-out data's path.
    ValData,
    /// The share of the data held out.
    ValFraction,
    /// What the model learns from the data.
    Task,
    /// The record field that holds a text.
    TextField,
    /// The record field that holds a label.
    LabelField,
    /// Tokens per shard file.
    ShardTokens,
}

impl Field {
    pub fn name(self) -> &'static str {
        match self {
            Field::Data => "data",
            Field::ValData => "validation data",
            Field::ValFraction => "validation fraction",
            Field::Task => "task",
            Field::TextField => "text field",
            Field::LabelField => "label field",
            Field::ShardTokens => "tokens per shard",
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Data that cannot be read, or is not what its form or the model needs; the message names
    /// the file and, where there is one, the record.
    #[error("{0}")]
    Input(String),
    /// A record or header lacks the field that `field` names.
    #[error("{at}: no \"{name}\" {kind}")]
    NoField {
        at: String,
        field: Field,
        name: String,
        /// "field", "column", "string field": what the reader looked for.
        kind: &'static str,
    },
    /// A setting that cannot work: `field` was `value`.
    #[error("{} {value}: {msg}", field.name())]
    Setting {
        field: Field,
        value: String,
        msg: String,
    },
    /// The model cannot learn this data (a head or vocabulary that does not fit it).
    #[error(transparent)]
    Model(#[from] crate::model::error::Error),
    /// A fault of pipewright itself, not of the data.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Helpers of the data wing build their messages as text: all of them describe the input.
impl From<String> for Error {
    fn from(msg: String) -> Self {
        Error::Input(msg)
    }
}

impl From<&str> for Error {
    fn from(msg: &str) -> Self {
        Error::Input(msg.into())
    }
}

impl From<pipewright_core::Error> for Error {
    fn from(e: pipewright_core::Error) -> Self {
        match e {
            pipewright_core::Error::Internal(m) => Error::Internal(m),
            e => Error::Input(e.to_string()),
        }
    }
}

impl Error {
    pub fn setting(field: Field, value: impl ToString, msg: impl Into<String>) -> Self {
        Error::Setting {
            field,
            value: value.to_string(),
            msg: msg.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

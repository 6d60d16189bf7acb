//! Errors of the model wing: what is wrong, and whether the config, the weights, the data the
//! model is asked to learn, or one input is at fault.

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A model config (its values, or a Hugging Face config.json) that cannot work; the
    /// message names the key.
    #[error("{0}")]
    Config(String),
    /// A model that cannot learn this data: it lacks the head the task needs, or room in its
    /// vocabulary or head for the data's ids or classes.
    #[error("{0}")]
    Mismatch(String),
    /// Weight files that cannot be read, or tensors that do not fit the model.
    #[error("{0}")]
    Weights(String),
    /// One input a model cannot take (a stage given tokens for hidden states, a prompt past
    /// the model's positions).
    #[error("{0}")]
    Input(String),
}

/// A config's checks build their messages as text.
impl From<String> for Error {
    fn from(msg: String) -> Self {
        Error::Config(msg)
    }
}

impl From<&str> for Error {
    fn from(msg: &str) -> Self {
        Error::Config(msg.into())
    }
}

pub type Result<T> = std::result::Result<T, Error>;

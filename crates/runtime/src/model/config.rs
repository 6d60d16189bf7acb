//! The model's shape: which family of transformer and its sizes. The one place that knows
//! how a family's settings default, what is refused, and what each layer block costs.

use super::error::Error;
use super::Family;
use serde::{Deserialize, Serialize};

/// What the last layer block predicts, when it is not the next token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskHead {
    /// One of `classes` per sequence (from the first token).
    Classify { classes: usize },
    /// An answer span: start and end logits over the positions.
    Span,
}

impl std::fmt::Display for TaskHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TaskHead::Classify { classes } => write!(f, "classification ({classes} classes)"),
            TaskHead::Span => f.write_str("answer-span"),
        }
    }
}

/// Llama 3's rescaling of rotary frequencies for long contexts (`rope_scaling` with
/// `rope_type = "llama3"` in a Hugging Face config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// Model shape. Byte-level training data needs a vocabulary of at least 256.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab: usize,
    pub d_model: usize,
    pub heads: usize,
    pub layers: usize,
    /// Training (and default evaluation) sequence length.
    pub seq_len: usize,
    /// Key/value heads (grouped-query attention, llama); default `heads`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<usize>,
    /// MLP hidden width; default 4 d_model (gpt), required for llama.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ffn: Option<usize>,
    /// Rotary base (llama); default 10000.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<Llama3Scaling>,
    /// Normalisation epsilon; default 1e-5.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub norm_eps: Option<f64>,
    /// Longest sequence the model takes (llama's `max_position_embeddings`); default seq_len.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_positions: Option<usize>,
    /// The LM head shares the token embedding's matrix (llama; gpt's head is its own).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub tie_embeddings: bool,
    /// A task head instead of the LM head (bert).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head: Option<TaskHead>,
    /// Token types (BERT's segments); default 2.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub type_vocab: Option<usize>,
    /// Image side in pixels (vit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<usize>,
    /// Patch side in pixels (vit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patch: Option<usize>,
    /// Colour channels (vit); default 3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub channels: Option<usize>,
    /// A classifier's class names, by index (from named labels, or a Hugging Face config's
    /// `id2label`); empty: numbered classes.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub labels: Vec<String>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            family: Family::Gpt,
            vocab: 256,
            d_model: 64,
            heads: 4,
            layers: 4,
            seq_len: 64,
            kv_heads: None,
            ffn: None,
            rope_theta: None,
            rope_scaling: None,
            norm_eps: None,
            max_positions: None,
            tie_embeddings: false,
            head: None,
            type_vocab: None,
            image: None,
            patch: None,
            channels: None,
            labels: Vec::new(),
        }
    }
}

impl ModelConfig {
    /// Layer blocks a plan can cut: embedding, the transformer blocks, the head.
    pub fn num_blocks(&self) -> usize {
        self.layers.saturating_add(2)
    }
    /// Classes of a classification head (0 without one).
    pub fn classes(&self) -> usize {
        match self.head {
            Some(TaskHead::Classify { classes }) => classes,
            _ => 0,
        }
    }

    /// This model with `head` in place of its own (a fine-tune for another task). A task head
    /// is untied: only an LM head shares the embedding's matrix.
    pub fn with_head(&self, head: Option<TaskHead>) -> ModelConfig {
        let mut m = self.clone();
        if head.is_some() {
            m.tie_embeddings = false;
        }
        m.head = head;
        m
    }

    pub fn kv_heads(&self) -> usize {
        self.kv_heads.unwrap_or(self.heads)
    }
    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads.max(1)
    }
    pub fn ffn(&self) -> usize {
        self.ffn.unwrap_or(self.d_model.saturating_mul(4))
    }
    pub fn rope_theta(&self) -> f64 {
        self.rope_theta.unwrap_or(10000.0)
    }
    pub fn norm_eps(&self) -> f64 {
        self.norm_eps.unwrap_or(1e-5)
    }
    pub fn image(&self) -> usize {
        self.image.unwrap_or(224)
    }
    pub fn patch(&self) -> usize {
        self.patch.unwrap_or(16).max(1)
    }
    pub fn channels(&self) -> usize {
        self.channels.unwrap_or(3)
    }
    /// Patches of an image (vit): the sequence is these and the class token.
    pub fn patches(&self) -> usize {
        (self.image() / self.patch()).saturating_pow(2)
    }
    pub fn type_vocab(&self) -> usize {
        self.type_vocab.unwrap_or(2)
    }
    pub fn max_positions(&self) -> usize {
        self.max_positions.unwrap_or(self.seq_len)
    }

    /// Do the two describe the same parameters (a checkpoint of one loads into the other)?
    /// Only gpt's learned positions make the sequence length part of the weights.
    pub fn same_parameters(&self, other: &ModelConfig) -> bool {
        match self.family {
            Family::Gpt => self == other,
            _ => {
                let at = |m: &ModelConfig| ModelConfig {
                    seq_len: 0,
                    labels: Vec::new(),
                    ..m.clone()
                };
                at(self) == at(other)
            }
        }
    }

    /// Can this model learn labelled examples of `classes` classes over `ids` token ids? It
    /// needs a classification head with room for every class, and the vocabulary.
    pub fn check_examples(&self, what: &str, ids: usize, classes: usize) -> Result<(), Error> {
        match self.head {
            Some(TaskHead::Classify { classes: c }) if c >= classes => {}
            Some(TaskHead::Classify { classes: c }) => {
                return Err(Error::Mismatch(format!(
                    "{what}: labels of {classes} classes, but the model's head has {c}"
                )))
            }
            _ => {
                return Err(Error::Mismatch(format!(
                    "{what}: labelled examples need a classification head; this {} model {} (train it for the classify task)",
                    self.family.name(),
                    self.head.map_or("predicts the next token".into(), |h| format!("has an {h} head"))
                )))
            }
        }
        if self.vocab < ids {
            return Err(Error::Mismatch(format!(
                "{what}: its tokens take {ids} ids, more than the model's vocabulary of {}",
                self.vocab
            )));
        }
        Ok(())
    }

    /// Can this model learn answer spans over `ids` token ids? It needs an answer-span head.
    pub fn check_spans(&self, what: &str, ids: usize) -> Result<(), Error> {
        if self.head != Some(TaskHead::Span) {
            return Err(Error::Mismatch(format!(
                "{what}: questions with answer spans need an answer-span head (bert, `BertForQuestionAnswering`); this {} model has {}",
                self.family.name(),
                self.head.map_or("an LM head".into(), |h| format!("a {h} head"))
            )));
        }
        match self.vocab < ids {
            true => Err(Error::Mismatch(format!(
                "{what}: its tokens take {ids} ids, more than the model's vocabulary of {}",
                self.vocab
            ))),
            false => Ok(()),
        }
    }

    /// Can this model learn from text (next-token prediction over bytes or token ids)? Not
    /// with a task head, nor with a vocabulary smaller than the 256 byte values.
    pub fn check_text(&self, what: &str, ids: usize) -> Result<(), Error> {
        if let Some(head) = self.head {
            return Err(Error::Mismatch(format!(
                "{what}: a {} model's {head} head learns from labelled examples, not from text (train it for the classify task on labelled data)",
                self.family.name()
            )));
        }
        if self.vocab < ids {
            return Err(Error::Mismatch(format!(
                "{what}: its tokens take {ids} ids (256 for bytes), more than the model's vocabulary of {}",
                self.vocab
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Training FLOPs per token, counted by hand for two shapes: 6 x (the blocks' products,
    /// attention's two T x d products per token and layer, and the head's product).
    #[test]
    fn training_flops_per_token_count_every_product() {
        let gpt = ModelConfig::default(); // d 64, 4 layers, seq 64, vocab 256
        let block = 12.0 * 64.0 * 64.0 + 2.0 * 64.0 * 64.0;
        assert_eq!(
            gpt.train_flops_per_token(),
            6.0 * (4.0 * block + 64.0 * 256.0)
        );
        // examples/llama_bench.toml: d 256, 8 heads of 32, 4 KV heads, SwiGLU 704, seq 128.
        let llama = ModelConfig {
            family: Family::Llama,
            d_model: 256,
            heads: 8,
            kv_heads: Some(4),
            ffn: Some(704),
            layers: 8,
            seq_len: 128,
            ..ModelConfig::default()
        };
        let q_o = 2.0 * 256.0 * 256.0;
        let k_v = 2.0 * 256.0 * 128.0;
        let mlp = 3.0 * 256.0 * 704.0;
        let attention = 2.0 * 128.0 * 256.0;
        let want = 6.0 * (8.0 * (q_o + k_v + mlp + attention) + 256.0 * 256.0);
        assert_eq!(llama.train_flops_per_token(), want);
        assert_eq!(want, 38_928_384.0);
    }
}

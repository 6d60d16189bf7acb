//! What a model family registers once ([`super::registry`]): its Hugging Face `model_type`,
//! its config reader and writer, and where Hugging Face names put its parameters.

use super::error::Error;
use super::{Family, ModelConfig};
use serde_json::Value;

/// Where a family's Hugging Face names put each layer block's parameters: the prefixes of the
/// embedding and of block N, the head's parameters that sit inside the base model (and the
/// prefix they take), and field renames (burn's LayerNorm `gamma`/`beta` are torch's
/// `weight`/`bias`; Rust cannot name a field `self`).
pub struct Layout {
    pub embed: &'static str,
    pub block: &'static str,
    pub base: &'static str,
    pub head_in_base: &'static [&'static str],
    pub renames: &'static [(&'static str, &'static str)],
}

pub const NORMS: [(&str, &str); 2] = [(".gamma", ".weight"), (".beta", ".bias")];

/// A family's entry in the registry.
pub struct Spec {
    pub family: Family,
    /// Its Hugging Face `model_type`.
    pub hf_type: Option<&'static str>,
    /// The model a Hugging Face `config.json` (parsed) describes; errors name the key.
    pub from_hf: fn(&Value) -> Result<ModelConfig, Error>,
    /// The `config.json` of a model (what `from_pretrained` needs).
    pub to_hf: fn(&ModelConfig) -> Result<Value, Error>,
    /// The family's own shape rules, after those every family shares (`ModelConfig::check`).
    pub check: fn(&ModelConfig) -> Result<(), String>,
    /// Parameters of the embedding, of a block and of the head (None on overflow).
    pub layer_params: fn(&ModelConfig) -> Option<(usize, usize, usize)>,
    /// Multiply-adds per token of a block's matrices.
    pub block_flops: fn(&ModelConfig) -> f64,
    /// A short name for profiles and logs.
    pub describe: fn(&ModelConfig) -> String,
    pub layout: Layout,
    /// The Hugging Face name of the token embedding (a tied head's matrix).
    pub embedding: &'static str,
    /// The family has no LM head: it is trained for a task only, and its bare encoder
    /// (`BertModel`, `ViTModel`) gets the task's head fresh.
    pub task_only: bool,
    /// Python files (name, text) written beside the model for transformers to load it with
    /// `trust_remote_code=True`: for a family no transformers class computes.
    pub code: &'static [(&'static str, &'static str)],
}

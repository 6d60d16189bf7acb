//! pipewright's own GPT has no Hugging Face form: its checkpoints keep its own names.

use crate::model::error::Error;
use crate::model::spec::Spec;
use crate::model::{Family, ModelConfig};
use serde_json::Value;

pub const SPEC: Spec = Spec {
    family: Family::Gpt,
    hf_type: None,
    from_hf: no_config,
    to_hf: no_hf_config,
    check: super::rules::check,
    layer_params: super::costs::layer_params,
    block_flops: super::costs::block_flops,
    describe: super::costs::describe,
    layout: crate::model::llama::hf::LAYOUT,
    embedding: crate::model::llama::hf::EMBEDDING,
    task_only: false,
};

/// Never called: the registry finds families by their `model_type`, and gpt has none.
fn no_config(_: &Value) -> Result<ModelConfig, Error> {
    Err("gpt is pipewright's own, not a Hugging Face model_type".into())
}

fn no_hf_config(_: &ModelConfig) -> Result<Value, Error> {
    Err(
        "the gpt family is pipewright's own and has no Hugging Face layout \
         (use llama, gpt2, bert or vit)"
            .into(),
    )
}

//! BERT in Hugging Face form: its `config.json` read and written, and where its names put
//! each parameter.

use crate::model::error::Error;
use crate::model::hf_json::*;
use crate::model::spec::{Layout, Spec, NORMS};
use crate::model::{Family, ModelConfig, TaskHead};
use serde_json::{json, Value};

pub const SPEC: Spec = Spec {
    family: Family::Bert,
    hf_type: Some("bert"),
    from_hf: bert_config,
    to_hf: bert_to_hf,
    check: super::rules::check,
    layer_params: super::costs::layer_params,
    block_flops: crate::model::parts::biased_block_flops,
    describe: super::costs::describe,
    layout: Layout {
        embed: "bert.embeddings.",
        block: "bert.encoder.layer.",
        base: "bert.",
        head_in_base: &["pooler."],
        renames: &[
            NORMS[0],
            NORMS[1],
            ("self_attn.", "self."),
            ("layer_norm.", "LayerNorm."),
        ],
    },
    embedding: "model.embed_tokens.weight",
    task_only: true,
    code: &[],
};

/// BERT's task head from `architectures`: sequence classification (`num_labels`, or the size
/// of `id2label`) or extractive question answering; none for the bare encoder (`BertModel`),
/// which the task gives a fresh one.
fn bert_head(v: &Value) -> Result<Option<TaskHead>, String> {
    match architecture(v).unwrap_or("") {
        "BertForSequenceClassification" => Ok(Some(TaskHead::Classify {
            classes: num_labels(v)?,
        })),
        "BertForQuestionAnswering" => Ok(Some(TaskHead::Span)),
        "BertModel" => Ok(None),
        other => Err(format!(
            "architectures [\"{other}\"] is not supported for bert (supported: BertForSequenceClassification, BertForQuestionAnswering, and the bare BertModel)"
        )),
    }
}

fn bert_config(v: &Value) -> Result<ModelConfig, Error> {
    refuse_unless(v, "hidden_act", |x| x == "gelu")?;
    refuse_unless(v, "position_embedding_type", |x| x == "absolute")?;
    refuse_unless(v, "is_decoder", |x| x == false)?;
    let positions = need(v, "max_position_embeddings")?;
    Ok(ModelConfig {
        family: Family::Bert,
        vocab: need(v, "vocab_size")?,
        d_model: need(v, "hidden_size")?,
        heads: need(v, "num_attention_heads")?,
        layers: need(v, "num_hidden_layers")?,
        seq_len: positions.clamp(1, 64),
        ffn: Some(need(v, "intermediate_size")?),
        norm_eps: Some(f64_field(v, "layer_norm_eps")?.unwrap_or(1e-12)),
        max_positions: Some(positions),
        head: bert_head(v)?,
        type_vocab: Some(usize_field(v, "type_vocab_size")?.unwrap_or(2)),
        ..ModelConfig::default()
    })
}

fn bert_to_hf(cfg: &ModelConfig) -> Result<Value, Error> {
    let mut v = json!({
        "model_type": "bert",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "intermediate_size": cfg.ffn(),
        "max_position_embeddings": cfg.max_positions(),
        "type_vocab_size": cfg.type_vocab(),
        "layer_norm_eps": cfg.norm_eps(),
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
        // pipewright trains without dropout.
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "torch_dtype": "float32",
    });
    match cfg.head {
        Some(TaskHead::Classify { classes }) => {
            v["architectures"] = json!(["BertForSequenceClassification"]);
            label_fields(&mut v, classes, &cfg.labels);
        }
        _ => v["architectures"] = json!(["BertForQuestionAnswering"]),
    }
    Ok(v)
}

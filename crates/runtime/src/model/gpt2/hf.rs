//! GPT-2 in Hugging Face form: its `config.json` read and written, and where its names put
//! each parameter.

use crate::model::error::Error;
use crate::model::hf_json::*;
use crate::model::spec::{Layout, Spec, NORMS};
use crate::model::{Family, ModelConfig};
use serde_json::{json, Value};

pub const SPEC: Spec = Spec {
    family: Family::Gpt2,
    hf_type: Some("gpt2"),
    from_hf: gpt2_config,
    to_hf: gpt2_to_hf,
    check: super::rules::check,
    layer_params: super::costs::layer_params,
    block_flops: crate::model::parts::biased_block_flops,
    describe: super::costs::describe,
    layout: Layout {
        embed: "transformer.",
        block: "transformer.h.",
        base: "transformer.",
        head_in_base: &["ln_f."],
        renames: &NORMS,
    },
    embedding: "transformer.wte.weight",
    task_only: false,
    code: &[],
};

fn gpt2_config(v: &Value) -> Result<ModelConfig, Error> {
    refuse_unless(v, "activation_function", |x| {
        x == "gelu_new" || x == "gelu_pytorch_tanh"
    })?;
    refuse_unless(v, "scale_attn_weights", |x| x == true)?;
    refuse_unless(v, "scale_attn_by_inverse_layer_idx", |x| x == false)?;
    refuse_unless(v, "add_cross_attention", |x| x == false)?;
    let d = need(v, "n_embd")?;
    let positions = need(v, "n_positions")?;
    Ok(ModelConfig {
        family: Family::Gpt2,
        vocab: need(v, "vocab_size")?,
        d_model: d,
        heads: need(v, "n_head")?,
        layers: need(v, "n_layer")?,
        seq_len: positions.clamp(1, 64),
        ffn: Some(usize_field(v, "n_inner")?.unwrap_or(d.saturating_mul(4))),
        norm_eps: f64_field(v, "layer_norm_epsilon")?,
        max_positions: Some(positions),
        tie_embeddings: bool_field(v, "tie_word_embeddings", true)?,
        ..ModelConfig::default()
    }
    .with_head(causal_head(v, "gpt2")?))
}

fn gpt2_to_hf(cfg: &ModelConfig) -> Result<Value, Error> {
    let mut v = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab,
        "n_embd": cfg.d_model,
        "n_layer": cfg.layers,
        "n_head": cfg.heads,
        "n_positions": cfg.max_positions(),
        "n_inner": cfg.ffn(),
        "layer_norm_epsilon": cfg.norm_eps(),
        "activation_function": "gelu_new",
        "tie_word_embeddings": cfg.tie_embeddings,
        // pipewright trains without dropout.
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
        "torch_dtype": "float32",
    });
    if cfg.head.is_some() {
        v["architectures"] = json!(["GPT2ForSequenceClassification"]);
        label_fields(&mut v, cfg.classes(), &cfg.labels);
    }
    Ok(v)
}

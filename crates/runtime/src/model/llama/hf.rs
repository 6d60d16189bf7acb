//! LLaMA in Hugging Face form: its `config.json` read and written, and where its names put
//! each parameter.

use crate::model::error::Error;
use crate::model::hf_json::*;
use crate::model::spec::{Layout, Spec};
use crate::model::{Family, Llama3Scaling, ModelConfig};
use serde_json::{json, Value};

pub const SPEC: Spec = Spec {
    family: Family::Llama,
    hf_type: Some("llama"),
    from_hf: llama_config,
    to_hf: llama_to_hf,
    check: super::rules::check,
    layer_params: super::costs::layer_params,
    block_flops: super::costs::block_flops,
    describe: super::costs::describe,
    layout: LAYOUT,
    embedding: EMBEDDING,
    task_only: false,
    code: &[],
};

/// `LlamaForCausalLM`'s names (pipewright's GPT keeps them too).
pub const LAYOUT: Layout = Layout {
    embed: "model.",
    block: "model.layers.",
    base: "model.",
    head_in_base: &["norm."],
    renames: &[],
};

pub const EMBEDDING: &str = "model.embed_tokens.weight";

fn llama_config(v: &Value) -> Result<ModelConfig, Error> {
    refuse_unless(v, "hidden_act", |x| x == "silu")?;
    refuse_unless(v, "attention_bias", |x| x == false)?;
    refuse_unless(v, "mlp_bias", |x| x == false)?;
    refuse_unless(v, "pretraining_tp", |x| x == 1)?;
    let (d, heads) = (need(v, "hidden_size")?, need(v, "num_attention_heads")?);
    if let Some(hd) = usize_field(v, "head_dim")? {
        if heads == 0 || hd.checked_mul(heads) != Some(d) {
            return Err(format!(
                "head_dim {hd} x num_attention_heads {heads} must equal hidden_size {d}"
            )
            .into());
        }
    }
    // transformers 5 keeps theta and scaling in rope_parameters; older configs use
    // rope_theta and rope_scaling.
    let rope = v.get("rope_parameters").filter(|x| !x.is_null());
    let scaling = match rope {
        Some(r) => Some(("rope_parameters", r)),
        None => v.get("rope_scaling").map(|s| ("rope_scaling", s)),
    }
    .filter(|(_, x)| !x.is_null());
    let theta = match rope {
        Some(r) => f64_field(r, "rope_theta")?,
        None => f64_field(v, "rope_theta")?,
    };
    let max_positions = usize_field(v, "max_position_embeddings")?;
    Ok(ModelConfig {
        family: Family::Llama,
        vocab: need(v, "vocab_size")?,
        d_model: d,
        heads,
        layers: need(v, "num_hidden_layers")?,
        seq_len: max_positions.unwrap_or(64).clamp(1, 64),
        kv_heads: usize_field(v, "num_key_value_heads")?,
        ffn: Some(need(v, "intermediate_size")?),
        rope_theta: theta,
        rope_scaling: scaling
            .map(|(key, s)| rope_scaling(key, s))
            .transpose()?
            .flatten(),
        norm_eps: f64_field(v, "rms_norm_eps")?,
        max_positions,
        tie_embeddings: bool_field(v, "tie_word_embeddings", false)?,
        ..ModelConfig::default()
    }
    .with_head(causal_head(v, "llama")?))
}

/// `None` for plain rotary positions; llama3 scaling; anything else refused by name.
fn rope_scaling(key: &str, s: &Value) -> Result<Option<Llama3Scaling>, String> {
    if !s.is_object() {
        return Err(format!(
            "{key} must be an object (or null), found {}",
            kind_of(s)
        ));
    }
    let kind = match s.get("rope_type").or(s.get("type")) {
        None | Some(Value::Null) => "default",
        Some(Value::String(k)) => k.as_str(),
        Some(x) => return Err(format!("rope_type must be a string, found {x}")),
    };
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let num = |k: &str| f64_field(s, k)?.ok_or_else(|| format!("rope {k} is missing"));
            Ok(Some(Llama3Scaling {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: need(s, "original_max_position_embeddings")?,
            }))
        }
        other => Err(format!(
            "rope scaling type \"{other}\" is not supported (supported: default, llama3)"
        )),
    }
}

fn llama_to_hf(cfg: &ModelConfig) -> Result<Value, Error> {
    let mut rope = json!({"rope_type": "default", "rope_theta": cfg.rope_theta()});
    if let Some(s) = &cfg.rope_scaling {
        rope = json!({"rope_type": "llama3", "rope_theta": cfg.rope_theta(),
            "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings});
    }
    let mut v = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn(),
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads(),
        "head_dim": cfg.head_dim(),
        "max_position_embeddings": cfg.max_positions(),
        "rms_norm_eps": cfg.norm_eps(),
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope.clone(),
        // What transformers before version 5 reads.
        "rope_theta": cfg.rope_theta(),
        "torch_dtype": "float32",
    });
    if cfg.rope_scaling.is_some() {
        v["rope_scaling"] = rope;
    }
    if cfg.head.is_some() {
        v["architectures"] = json!(["LlamaForSequenceClassification"]);
        label_fields(&mut v, cfg.classes(), &cfg.labels);
    }
    Ok(v)
}

//! ViT in Hugging Face form: its `config.json` read and written, and where its names put
//! each parameter.

use crate::model::error::Error;
use crate::model::hf_json::*;
use crate::model::spec::{Layout, Spec, NORMS};
use crate::model::{Family, ModelConfig, TaskHead};
use serde_json::{json, Value};

pub const SPEC: Spec = Spec {
    family: Family::Vit,
    hf_type: Some("vit"),
    from_hf: vit_config,
    to_hf: vit_to_hf,
    check: super::rules::check,
    layer_params: super::costs::layer_params,
    block_flops: crate::model::parts::biased_block_flops,
    describe: super::costs::describe,
    layout: Layout {
        embed: "vit.embeddings.",
        block: "vit.encoder.layer.",
        base: "vit.",
        head_in_base: &["layernorm."],
        renames: &NORMS,
    },
    embedding: "model.embed_tokens.weight",
    task_only: true,
    code: &[],
};

fn vit_config(v: &Value) -> Result<ModelConfig, Error> {
    refuse_unless(v, "hidden_act", |x| x == "gelu")?;
    refuse_unless(v, "qkv_bias", |x| x == true)?;
    // The bare encoder (`ViTModel`) has no head: the task gives it a fresh one.
    let head = match architecture(v) {
        None | Some("ViTForImageClassification") => Some(TaskHead::Classify {
            classes: num_labels(v)?,
        }),
        Some("ViTModel") => None,
        Some(other) => {
            return Err(format!(
                "architectures [{other:?}] is not supported for vit (supported: ViTForImageClassification, and the bare ViTModel)"
            )
            .into())
        }
    };
    let (image, patch) = (need(v, "image_size")?, need(v, "patch_size")?);
    if patch == 0 || image % patch != 0 {
        return Err(format!(
            "image_size {image} is not a whole number of patch_size {patch} patches"
        )
        .into());
    }
    Ok(ModelConfig {
        family: Family::Vit,
        vocab: 1,
        d_model: need(v, "hidden_size")?,
        heads: need(v, "num_attention_heads")?,
        layers: need(v, "num_hidden_layers")?,
        // Saturated: check() then refuses the image by name.
        seq_len: (image / patch).saturating_pow(2).saturating_add(1),
        ffn: Some(need(v, "intermediate_size")?),
        norm_eps: Some(f64_field(v, "layer_norm_eps")?.unwrap_or(1e-12)),
        head,
        image: Some(image),
        patch: Some(patch),
        channels: Some(usize_field(v, "num_channels")?.unwrap_or(3)),
        ..ModelConfig::default()
    })
}

fn vit_to_hf(cfg: &ModelConfig) -> Result<Value, Error> {
    let mut v = json!({
        "architectures": ["ViTForImageClassification"],
        "model_type": "vit",
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "intermediate_size": cfg.ffn(),
        "image_size": cfg.image(),
        "patch_size": cfg.patch(),
        "num_channels": cfg.channels(),
        "layer_norm_eps": cfg.norm_eps(),
        "hidden_act": "gelu",
        "qkv_bias": true,
        // pipewright trains without dropout.
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "torch_dtype": "float32",
    });
    label_fields(&mut v, cfg.classes(), &cfg.labels);
    Ok(v)
}

//! pipewright's own GPT in Hugging Face form. No transformers class computes it (its LM head
//! is untied and has a bias), so the exported directory carries its own PyTorch code
//! (`modeling_pipewright_gpt.py`), which transformers loads with `trust_remote_code=True`.
//! Its module names are the checkpoint's: `embeddings.tok`, `blocks.N.q`, `ln`, `out`.

use crate::model::error::Error;
use crate::model::hf_json::*;
use crate::model::spec::{Layout, Spec, NORMS};
use crate::model::{Family, ModelConfig};
use serde_json::{json, Value};

pub const HF_TYPE: &str = "pipewright_gpt";

/// The kernels' LayerNorm epsilon ([`crate::kernels::LN_EPS`]), the only one gpt's blocks take.
const EPS: f64 = 1e-5;

pub const SPEC: Spec = Spec {
    family: Family::Gpt,
    hf_type: Some(HF_TYPE),
    from_hf: gpt_config,
    to_hf: gpt_to_hf,
    check: super::rules::check,
    layer_params: super::costs::layer_params,
    block_flops: super::costs::block_flops,
    describe: super::costs::describe,
    layout: Layout {
        embed: "embeddings.",
        block: "blocks.",
        base: "",
        head_in_base: &[],
        renames: &NORMS,
    },
    embedding: "embeddings.tok.weight",
    task_only: false,
    code: &[
        (
            "configuration_pipewright_gpt.py",
            include_str!("configuration_pipewright_gpt.py"),
        ),
        (
            "modeling_pipewright_gpt.py",
            include_str!("modeling_pipewright_gpt.py"),
        ),
    ],
};

fn gpt_config(v: &Value) -> Result<ModelConfig, Error> {
    refuse_unless(v, "tie_word_embeddings", |x| x == false)?;
    refuse_unless(v, "layer_norm_eps", |x| {
        x.as_f64().is_some_and(|e| (e - EPS).abs() < 1e-12)
    })?;
    let d = need(v, "hidden_size")?;
    refuse_unless(v, "intermediate_size", |x| x.as_u64() == Some(4 * d as u64))?;
    // Learned positions: their table's length is the model's sequence length.
    Ok(ModelConfig {
        family: Family::Gpt,
        vocab: need(v, "vocab_size")?,
        d_model: d,
        heads: need(v, "num_attention_heads")?,
        layers: need(v, "num_hidden_layers")?,
        seq_len: need(v, "max_position_embeddings")?,
        ..ModelConfig::default()
    }
    .with_head(causal_head(v, HF_TYPE)?))
}

fn gpt_to_hf(cfg: &ModelConfig) -> Result<Value, Error> {
    Ok(json!({
        "architectures": ["PipewrightGptForCausalLM"],
        "model_type": HF_TYPE,
        "auto_map": {
            "AutoConfig": "configuration_pipewright_gpt.PipewrightGptConfig",
            "AutoModelForCausalLM": "modeling_pipewright_gpt.PipewrightGptForCausalLM",
        },
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "intermediate_size": 4 * cfg.d_model,
        "max_position_embeddings": cfg.seq_len,
        "layer_norm_eps": EPS,
        "tie_word_embeddings": false,
        // The code recomputes the whole prefix for each new token (no KV cache).
        "use_cache": false,
        "torch_dtype": "float32",
    }))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_written_epsilon_is_the_kernels() {
        assert_eq!(super::EPS as f32, crate::kernels::LN_EPS);
    }
}

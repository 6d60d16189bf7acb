//! pipewright's GPT's own shape rules (after those every family shares).

use crate::model::ModelConfig;

pub(crate) fn check(m: &ModelConfig) -> Result<(), String> {
    let llama_only = [
        ("kv_heads", m.kv_heads.is_some()),
        ("rope_theta", m.rope_theta.is_some()),
        ("rope_scaling", m.rope_scaling.is_some()),
        ("tie_embeddings", m.tie_embeddings),
    ];
    if let Some((name, _)) = llama_only.iter().find(|(_, set)| *set) {
        return Err(format!(
            "{name} is a llama setting; the gpt family does not take it (set family = \"llama\")"
        ));
    }
    if m.ffn.is_some_and(|f| f != 4 * m.d_model) {
        return Err(format!(
            "ffn {} : the gpt family's MLP is 4 d_model = {} wide",
            m.ffn.unwrap_or(0),
            4 * m.d_model
        ));
    }
    Ok(())
}

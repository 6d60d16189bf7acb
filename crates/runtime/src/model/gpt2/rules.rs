//! GPT-2's own shape rules (after those every family shares).

use crate::model::ModelConfig;

pub(crate) fn check(m: &ModelConfig) -> Result<(), String> {
    if m.kv_heads.is_some_and(|k| k != m.heads) || m.rope_theta.is_some() {
        return Err("gpt2 has neither grouped-query attention nor rotary positions".into());
    }
    if m.ffn() == 0 {
        return Err("ffn (n_inner) must be positive".into());
    }
    if m.norm_eps
        .is_some_and(|e| (e - crate::kernels::LN_EPS as f64).abs() > 1e-12)
    {
        return Err(format!(
            "layer_norm_epsilon {} is not supported (pipewright's LayerNorm uses {})",
            m.norm_eps(),
            crate::kernels::LN_EPS
        ));
    }
    Ok(())
}

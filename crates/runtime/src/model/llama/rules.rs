//! LLaMA's own shape rules (after those every family shares).

use crate::model::ModelConfig;

pub(crate) fn check(m: &ModelConfig) -> Result<(), String> {
    let kv = m.kv_heads();
    if kv == 0 || !m.heads.is_multiple_of(kv) {
        return Err(format!(
            "kv_heads {kv} must divide heads {} (grouped-query attention)",
            m.heads
        ));
    }
    if !m.head_dim().is_multiple_of(2) {
        return Err(format!(
            "head dimension {} (d_model / heads) must be even for rotary positions",
            m.head_dim()
        ));
    }
    if m.ffn() == 0 {
        return Err("ffn (intermediate_size) must be positive".into());
    }
    if !(m.rope_theta().is_finite() && m.rope_theta() > 1.0) {
        return Err(format!("rope_theta {} must be > 1", m.rope_theta()));
    }
    if !(m.norm_eps().is_finite() && m.norm_eps() > 0.0) {
        return Err(format!("norm_eps {} must be > 0", m.norm_eps()));
    }
    if let Some(s) = &m.rope_scaling {
        let ok = s.factor.is_finite()
            && s.factor >= 1.0
            && s.low_freq_factor > 0.0
            && s.high_freq_factor > s.low_freq_factor
            && s.original_max_position_embeddings > 0;
        if !ok {
            return Err(format!(
                "rope_scaling (llama3) with factor {}, low_freq_factor {}, high_freq_factor {}, original_max_position_embeddings {}: needs factor >= 1, 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0",
                s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings
            ));
        }
    }
    Ok(())
}

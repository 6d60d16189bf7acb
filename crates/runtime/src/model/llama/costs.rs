//! LLaMA: its parameters and work per layer block, and its short name.

use crate::model::ModelConfig;

/// Parameters of the embedding, of a block and of the head (None on overflow).
pub(crate) fn layer_params(m: &ModelConfig) -> Option<(usize, usize, usize)> {
    let d = m.d_model;
    let kv = m.kv_heads().checked_mul(m.head_dim())?;
    let attn = d.checked_mul(2 * d)?.checked_add(d.checked_mul(2 * kv)?)?;
    let mlp = d.checked_mul(m.ffn())?.checked_mul(3)?;
    let block = attn.checked_add(mlp)?.checked_add(2 * d)?;
    let head = m.out_width().checked_mul(d)?.checked_add(d)?;
    Some((m.vocab.checked_mul(d)?, block, head))
}

/// Multiply-adds per token of a block's matrices.
pub(crate) fn block_flops(m: &ModelConfig) -> f64 {
    let d = m.d_model as f64;
    let kv = (m.kv_heads() * m.head_dim()) as f64;
    2.0 * d * d + 2.0 * d * kv + 3.0 * d * m.ffn() as f64
}

pub(crate) fn describe(m: &ModelConfig) -> String {
    format!(
        "llama d{}-l{}-h{}-kv{}-f{}-s{}",
        m.d_model,
        m.layers,
        m.heads,
        m.kv_heads(),
        m.ffn(),
        m.seq_len
    )
}

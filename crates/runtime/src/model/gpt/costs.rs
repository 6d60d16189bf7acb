//! pipewright's GPT: its parameters and work per layer block, and its short name.

use crate::model::ModelConfig;

/// Parameters of the embedding, of a block and of the head (None on overflow).
pub(crate) fn layer_params(m: &ModelConfig) -> Option<(usize, usize, usize)> {
    let d = m.d_model;
    Some((
        m.vocab.checked_add(m.seq_len)?.checked_mul(d)?,
        (12 * d).checked_mul(d)?.checked_add(13 * d)?,
        d.checked_mul(m.vocab)?.checked_add(m.vocab + 2 * d)?,
    ))
}

/// Multiply-adds per token of a block's matrices.
pub(crate) fn block_flops(m: &ModelConfig) -> f64 {
    let d = m.d_model as f64;
    12.0 * d * d
}

pub(crate) fn describe(m: &ModelConfig) -> String {
    format!(
        "gpt d{}-l{}-h{}-s{}",
        m.d_model, m.layers, m.heads, m.seq_len
    )
}

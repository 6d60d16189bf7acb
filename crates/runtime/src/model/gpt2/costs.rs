//! GPT-2: its parameters and work per layer block, and its short name.

use crate::model::parts::biased_block_params;
use crate::model::ModelConfig;

/// Parameters of the embedding, of a block and of the head (None on overflow).
pub(crate) fn layer_params(m: &ModelConfig) -> Option<(usize, usize, usize)> {
    let d = m.d_model;
    Some((
        m.vocab.checked_add(m.max_positions())?.checked_mul(d)?,
        biased_block_params(m)?,
        m.out_width().checked_mul(d)?.checked_add(2 * d)?,
    ))
}

pub(crate) fn describe(m: &ModelConfig) -> String {
    format!(
        "gpt2 d{}-l{}-h{}-f{}-s{}",
        m.d_model,
        m.layers,
        m.heads,
        m.ffn(),
        m.seq_len
    )
}

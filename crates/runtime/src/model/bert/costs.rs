//! BERT: its parameters per layer block, and its short name.

use crate::model::parts::biased_block_params;
use crate::model::{ModelConfig, TaskHead};

/// Parameters of the embeddings, of a block and of the head (None on overflow).
pub(crate) fn layer_params(m: &ModelConfig) -> Option<(usize, usize, usize)> {
    let d = m.d_model;
    let rows = m
        .vocab
        .checked_add(m.max_positions())?
        .checked_add(m.type_vocab())?;
    let head = match m.head {
        Some(TaskHead::Classify { classes }) => {
            d.checked_mul(d + classes)?.checked_add(d + classes)?
        }
        _ => 3 * d + 2,
    };
    Some((
        rows.checked_mul(d)?.checked_add(2 * d)?,
        biased_block_params(m)?,
        head,
    ))
}

pub(crate) fn describe(m: &ModelConfig) -> String {
    format!(
        "bert d{}-l{}-h{}-f{}-s{} {}",
        m.d_model,
        m.layers,
        m.heads,
        m.ffn(),
        m.seq_len,
        m.head.map_or(String::new(), |h| h.to_string())
    )
}

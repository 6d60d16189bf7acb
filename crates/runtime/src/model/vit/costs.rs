//! ViT: its parameters per layer block, and its short name.

use crate::model::parts::biased_block_params;
use crate::model::ModelConfig;

/// Parameters of the patch embedding, of a block and of the head (None on overflow).
pub(crate) fn layer_params(m: &ModelConfig) -> Option<(usize, usize, usize)> {
    let d = m.d_model;
    let pixels = m
        .channels()
        .checked_mul(m.patch().checked_mul(m.patch())?)?;
    let emb = pixels
        .checked_add(m.patches())?
        .checked_add(3)?
        .checked_mul(d)?;
    let classes = m.classes();
    let head = d.checked_mul(classes)?.checked_add(classes + 2 * d)?;
    Some((emb, biased_block_params(m)?, head))
}

pub(crate) fn describe(m: &ModelConfig) -> String {
    format!(
        "vit d{}-l{}-h{}-f{} image {} patch {}",
        m.d_model,
        m.layers,
        m.heads,
        m.ffn(),
        m.image(),
        m.patch()
    )
}

//! What several families share: the post-LayerNorm and GPT-2 style block of attention and a
//! two-matrix MLP with biases (gpt2, bert, vit), counted once.

use super::ModelConfig;

/// Parameters of such a block (None on overflow).
pub(crate) fn biased_block_params(m: &ModelConfig) -> Option<usize> {
    let d = m.d_model;
    let attn = d.checked_mul(4 * d)?.checked_add(4 * d)?;
    let mlp = d.checked_mul(m.ffn())?.checked_mul(2)?;
    attn.checked_add(mlp)?.checked_add(m.ffn() + 5 * d)
}

/// Multiply-adds per token of such a block's matrices.
pub(crate) fn biased_block_flops(m: &ModelConfig) -> f64 {
    let d = m.d_model as f64;
    4.0 * d * d + 2.0 * d * m.ffn() as f64
}

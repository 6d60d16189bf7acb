//! ViT's own shape rules (after those every family shares).

use crate::model::{ModelConfig, TaskHead};

pub(crate) fn check(m: &ModelConfig) -> Result<(), String> {
    if !matches!(m.head, Some(TaskHead::Classify { classes }) if classes > 0) {
        return Err(
            "a vit model needs a classification head: head = { classify = { classes = N } }".into(),
        );
    }
    if !m.image().is_multiple_of(m.patch()) || m.channels() == 0 || m.ffn() == 0 {
        return Err(format!(
            "image {} must be a whole number of patches of {}, with channels and ffn positive",
            m.image(),
            m.patch()
        ));
    }
    if m.seq_len != m.patches() + 1 {
        return Err(format!(
            "seq_len {} must be the {} patches and the class token",
            m.seq_len,
            m.patches()
        ));
    }
    Ok(())
}

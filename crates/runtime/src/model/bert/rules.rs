//! BERT's own shape rules (after those every family shares).

use crate::model::ModelConfig;

pub(crate) fn check(m: &ModelConfig) -> Result<(), String> {
    match m.head {
        None => Err(
            "a bert model needs a task head: head = { classify = { classes = N } } or \"span\""
                .into(),
        ),
        _ if m.ffn() == 0 || m.type_vocab() == 0 => {
            Err("ffn (intermediate_size) and type_vocab must be positive".into())
        }
        _ if m.kv_heads.is_some_and(|k| k != m.heads) || m.rope_theta.is_some() => {
            Err("bert has neither grouped-query attention nor rotary positions".into())
        }
        _ => Ok(()),
    }
}

//! The rules a model config must keep: sizes every family bounds, the shape rules they share,
//! then the family's own (its registry entry's `check`).

use super::error::Error;
use super::registry;
use super::{Family, ModelConfig, TaskHead};

impl ModelConfig {
    /// Shape rules every family shares, then the family's own.
    pub fn check(&self) -> Result<(), Error> {
        self.check_sizes()?;
        if self.d_model == 0 || self.heads == 0 || !self.d_model.is_multiple_of(self.heads) {
            return Err(format!(
                "d_model {} must be a positive multiple of heads {}",
                self.d_model, self.heads
            )
            .into());
        }
        if self.seq_len == 0 || self.vocab == 0 {
            return Err("seq_len and vocab must be positive".into());
        }
        if self.seq_len > self.max_positions() {
            return Err(format!(
                "seq_len {} is longer than the model's {} positions (max_positions)",
                self.seq_len,
                self.max_positions()
            )
            .into());
        }
        (registry::spec(self.family).check)(self)?;
        match (self.family, self.head) {
            (Family::Gpt, Some(_)) => {
                return Err(
                    "pipewright's gpt predicts the next token only; a task head needs family llama, gpt2, bert or vit"
                        .into(),
                )
            }
            (Family::Llama | Family::Gpt2, Some(TaskHead::Span)) => {
                return Err(format!(
                    "an answer-span head is a bert setting; {} takes a classification head",
                    self.family.name()
                ).into())
            }
            (_, Some(TaskHead::Classify { classes: 0 })) => {
                return Err("a classification head needs at least 1 class".into())
            }
            (_, Some(_)) if self.tie_embeddings => {
                return Err(
                    "tie_embeddings ties the LM head to the embedding; a task head has none to tie"
                        .into(),
                )
            }
            _ => {}
        }
        let params = self.param_count();
        if params.is_none_or(|p| p > 1 << 34) {
            return Err(format!(
                "a {} model of d_model {}, {} layers, vocab {} has more than 2^34 parameters; this trainer holds them in memory",
                self.family.name(),
                self.d_model,
                self.layers,
                self.vocab
            ).into());
        }
        Ok(())
    }

    /// Every size within a bound far past any published model and small enough that each
    /// size derived from them (parameters, patches, bytes) fits in 64 bits: an image of 2^32
    /// pixels is refused here, naming the field, not wrapped to 0 patch pixels.
    fn check_sizes(&self) -> Result<(), String> {
        let original = self
            .rope_scaling
            .as_ref()
            .map(|s| s.original_max_position_embeddings);
        let sizes = [
            ("image", self.image, 1 << 16),
            ("patch", self.patch, 1 << 16),
            ("channels", self.channels, 1 << 12),
            ("vocab", Some(self.vocab), 1 << 24),
            ("d_model", Some(self.d_model), 1 << 20),
            ("heads", Some(self.heads), 1 << 16),
            ("kv_heads", self.kv_heads, 1 << 16),
            ("layers", Some(self.layers), 1 << 16),
            ("ffn", self.ffn, 1 << 24),
            ("max_positions", self.max_positions, 1 << 24),
            ("seq_len", Some(self.seq_len), 1 << 24),
            ("type_vocab", self.type_vocab, 1 << 16),
            ("classes", Some(self.classes()), 1 << 24),
            (
                "rope_scaling.original_max_position_embeddings",
                original,
                1 << 24,
            ),
        ];
        match sizes
            .into_iter()
            .find_map(|(name, v, max)| Some((name, v?, max)).filter(|(_, v, max)| v > max))
        {
            Some((name, v, max)) => Err(format!(
                "{name} {v} is past the largest pipewright takes ({max}): sizes derived from it would overflow"
            )),
            None => Ok(()),
        }
    }
}

//! What a model costs: its parameters, its FLOPs per token, and the cost profile `train` cuts
//! stages by before anything is measured. The shared parts are here; each family's counts are
//! its registry entry's.

use super::registry;
use super::{Family, ModelConfig, TaskHead};

impl ModelConfig {
    /// Values the head puts out per position: the vocabulary's logits, or a class's (read at
    /// one position per sequence), or an answer span's start and end.
    pub(crate) fn out_width(&self) -> usize {
        match self.head {
            None => self.vocab,
            Some(TaskHead::Classify { classes }) => classes,
            Some(TaskHead::Span) => 2,
        }
    }

    /// The head's multiply-adds per token: a classifier (and BERT's pooler) runs on one
    /// position of each sequence.
    fn head_flops(&self) -> f64 {
        let (d, t) = (self.d_model as f64, self.seq_len.max(1) as f64);
        match (self.head, self.family) {
            (Some(TaskHead::Classify { classes }), Family::Bert) => d * (d + classes as f64) / t,
            (Some(TaskHead::Classify { classes }), _) => d * (1.0 + classes as f64) / t,
            _ => d * self.out_width() as f64,
        }
    }

    /// Model FLOPs of one training token, forward and backward (3 x 2 x the multiply-adds of
    /// the blocks' and head's products and of attention over the whole sequence, as PaLM's
    /// MFU counts them; the embedding is a lookup). The work of the whole model, whatever is
    /// frozen or cached.
    pub fn train_flops_per_token(&self) -> f64 {
        let (d, t) = (self.d_model as f64, self.seq_len as f64);
        6.0 * (self.layers as f64 * ((registry::spec(self.family).block_flops)(self) + 2.0 * t * d)
            + self.head_flops())
    }

    /// All parameters (None on overflow).
    pub fn param_count(&self) -> Option<usize> {
        let (e, b, h) = (registry::spec(self.family).layer_params)(self)?;
        b.checked_mul(self.layers)?.checked_add(e)?.checked_add(h)
    }

    /// A cost model of the layer blocks without measuring (multiply-adds per token as the
    /// forward cost, in arbitrary units; backward 2x): what `train` cuts stages by when it is
    /// not given a plan. `pipewright profile` measures the real thing.
    pub fn cost_profile(&self, rows: usize) -> pipewright_core::profile::Profile {
        use pipewright_core::profile::{Layer, ModelInfo, Profile};
        let (d, t) = (self.d_model as f64, self.seq_len as f64);
        let tokens = (rows * self.seq_len) as u64;
        let (emb, block, head) =
            (registry::spec(self.family).layer_params)(self).unwrap_or((0, 0, 0));
        let layer = |i: usize| {
            let (flops, params, width) = match i {
                0 => (d, emb, self.d_model),
                i if i == self.layers + 1 => (self.head_flops(), head, self.out_width()),
                _ => (
                    (registry::spec(self.family).block_flops)(self) + 2.0 * t * d,
                    block,
                    self.d_model,
                ),
            };
            Layer {
                name: super::layer_name(i, self.layers),
                forward: flops * 1e-9,
                backward: None,
                weight_grad: None,
                input_grad: None,
                optimizer: None,
                params: 4 * params as u64,
                activation: 4 * tokens * width as u64,
            }
        };
        Profile {
            model: ModelInfo {
                name: format!("{} (cost model)", self.describe()),
            },
            layers: (0..self.num_blocks()).map(layer).collect(),
        }
    }

    /// A short name for profiles and logs.
    pub fn describe(&self) -> String {
        (registry::spec(self.family).describe)(self)
    }
}

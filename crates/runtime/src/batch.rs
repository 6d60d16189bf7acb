//! The micro-batch: what a worker's stage reads and the loss scores. A plain record shared by
//! the data wing, which fills it, and the model, which reads it.

/// One micro-batch: `rows` sequences of `seq_len` input bytes and their next bytes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MicroBatch {
    pub rows: usize,
    pub seq_len: usize,
    pub tokens: Vec<i64>,
    /// `rows x target_len` targets (a negative one: none there).
    pub targets: Vec<i64>,
    /// Targets per row: `seq_len` for language modelling (the next token at each position), 1
    /// for a class, 2 for an answer span's start and end.
    pub target_len: usize,
    /// BERT's segment of each token (empty: all 0).
    pub token_types: Vec<i64>,
    /// 1 for a real token, 0 for padding that attention must not see (empty: no padding).
    pub mask: Vec<i64>,
    /// Images instead of tokens (vit): `rows x c x h x w` values, and `[c, h, w]`.
    pub pixels: Vec<f32>,
    pub image: Option<[usize; 3]>,
    /// The sample number of each row under epoch sampling (empty for random windows):
    /// what the frozen-prefix cache keys on.
    pub samples: Vec<u64>,
    /// Not read: a micro-batch of text that no worker of this process runs (its tokens and
    /// targets stay empty; every one of its `rows x target_len` positions has a target).
    pub unread: bool,
}

impl MicroBatch {
    /// `values` (this micro-batch's tokens or targets) as a `[rows, seq_len]` tensor on the
    /// training device.
    pub fn ids(&self, values: &[i64]) -> burn::tensor::Tensor<2, burn::tensor::Int> {
        self.ids_on(values, &crate::backend::train_device())
    }

    /// The same on `device` (evaluation runs on the plain device).
    pub fn ids_on(
        &self,
        values: &[i64],
        device: &burn::tensor::Device,
    ) -> burn::tensor::Tensor<2, burn::tensor::Int> {
        burn::tensor::Tensor::from_data(
            burn::tensor::TensorData::new(values.to_vec(), [self.rows, self.seq_len]),
            device,
        )
    }
}

impl MicroBatch {
    /// A causal-LM batch as Hugging Face's models take one: `ids` of `rows x seq_len`, and
    /// position i's target is `labels[i + 1]` (labels default to the ids); the last position,
    /// and a negative label (-100), have no target.
    pub fn causal_lm(ids: &[i64], labels: Option<&[i64]>, rows: usize, seq_len: usize) -> Self {
        let labels = labels.unwrap_or(ids);
        let targets = labels
            .chunks(seq_len)
            .flat_map(|row| row[1..].iter().map(|&l| l.max(-100)).chain([-100]))
            .collect();
        MicroBatch {
            rows,
            seq_len,
            tokens: ids.to_vec(),
            targets,
            target_len: seq_len,
            ..MicroBatch::default()
        }
    }

    /// A batch for a task head: `ids`, `token_types` and `mask` (each empty or `rows x
    /// seq_len`) and `target_len` targets per row (a class: 1; an answer's start and end: 2).
    pub fn labelled(
        ids: &[i64],
        token_types: &[i64],
        mask: &[i64],
        targets: Vec<i64>,
        target_len: usize,
        seq_len: usize,
    ) -> Self {
        MicroBatch {
            rows: ids.len() / seq_len.max(1),
            seq_len,
            tokens: ids.to_vec(),
            targets,
            target_len,
            token_types: token_types.to_vec(),
            mask: mask.to_vec(),
            ..MicroBatch::default()
        }
    }

    /// A batch of images `[rows, c, h, w]` (`pixels`, row-major), one class target per row,
    /// for a model that reads `seq_len` positions (vit: its patches and the class token).
    pub fn images(pixels: Vec<f32>, image: [usize; 3], labels: Vec<i64>, seq_len: usize) -> Self {
        MicroBatch {
            rows: labels.len(),
            seq_len,
            targets: labels,
            target_len: 1,
            pixels,
            image: Some(image),
            ..MicroBatch::default()
        }
    }

    /// The micro-batch padded only to its longest row: positions past every row's last real
    /// token (by the mask) are cut off. Padding is masked in attention and never scored, so
    /// the loss and gradients are those of the padded batch; the work shrinks with it.
    pub fn trim_padding(mut self) -> MicroBatch {
        let t = self.seq_len;
        if self.mask.is_empty() || self.image.is_some() || t == 0 {
            return self;
        }
        let longest = self.mask.chunks(t).map(real_length).max().unwrap_or(1);
        if longest >= t {
            return self;
        }
        let cut = |v: &mut Vec<i64>| {
            if !v.is_empty() {
                *v = v
                    .chunks(t)
                    .flat_map(|row| row[..longest].to_vec())
                    .collect();
            }
        };
        cut(&mut self.tokens);
        cut(&mut self.mask);
        cut(&mut self.token_types);
        self.seq_len = longest;
        self
    }

    /// Rows `idx` of this micro-batch (in that order), with what each row carries: tokens,
    /// targets, token types, mask, pixels and sample numbers.
    pub fn rows_of(&self, idx: &[usize]) -> MicroBatch {
        let pick = |v: &[i64], per_row: usize| -> Vec<i64> {
            match v.is_empty() {
                true => Vec::new(),
                false => idx
                    .iter()
                    .flat_map(|&r| v[r * per_row..(r + 1) * per_row].iter().copied())
                    .collect(),
            }
        };
        let px = self.image.map_or(0, |[c, h, w]| c * h * w);
        MicroBatch {
            rows: idx.len(),
            seq_len: self.seq_len,
            tokens: pick(&self.tokens, self.seq_len),
            targets: pick(&self.targets, self.target_len),
            target_len: self.target_len,
            token_types: pick(&self.token_types, self.seq_len),
            mask: pick(&self.mask, self.seq_len),
            pixels: idx
                .iter()
                .flat_map(|&r| self.pixels[r * px..(r + 1) * px].iter().copied())
                .collect(),
            image: self.image,
            samples: match self.samples.is_empty() {
                true => Vec::new(),
                false => idx.iter().map(|&r| self.samples[r]).collect(),
            },
            unread: self.unread,
        }
    }

    /// The batch as `m` micro-batches of equal rows, in order.
    pub fn split(&self, m: usize) -> Result<Vec<MicroBatch>, SplitError> {
        if m == 0 || !self.rows.is_multiple_of(m) {
            return Err(SplitError {
                rows: self.rows,
                microbatches: m,
            });
        }
        let r = self.rows / m;
        let part = |v: &[i64], per_row: usize, i: usize| -> Vec<i64> {
            if v.is_empty() {
                return Vec::new();
            }
            v[i * r * per_row..(i + 1) * r * per_row].to_vec()
        };
        Ok((0..m)
            .map(|i| MicroBatch {
                rows: r,
                seq_len: self.seq_len,
                tokens: part(&self.tokens, self.seq_len, i),
                targets: part(&self.targets, self.target_len, i),
                target_len: self.target_len,
                token_types: part(&self.token_types, self.seq_len, i),
                mask: part(&self.mask, self.seq_len, i),
                pixels: match self.image {
                    Some([c, h, w]) => {
                        let n = r * c * h * w;
                        self.pixels[i * n..(i + 1) * n].to_vec()
                    }
                    None => Vec::new(),
                },
                image: self.image,
                samples: Vec::new(),
                unread: false,
            })
            .collect())
    }
}

/// A masked row's length up to its last real token (at least 1): where padding starts.
pub fn real_length(mask_row: &[i64]) -> usize {
    mask_row.iter().rposition(|&m| m != 0).map_or(1, |p| p + 1)
}

/// A batch whose rows do not divide into the micro-batches asked for.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{rows} rows do not split into {microbatches} micro-batches of equal size")]
pub struct SplitError {
    pub rows: usize,
    pub microbatches: usize,
}

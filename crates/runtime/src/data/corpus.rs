//! Training data: text (bytes, token ids or shards) for language modelling, or labelled
//! examples for a task head; and a built-in deterministic synthetic corpus with learnable
//! structure (so `pipewright train` works on a fresh machine).

use super::error::Result;
use super::examples::Examples;
use super::tokens::Tokens;
pub use crate::batch::MicroBatch;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A corpus split into training and held-out parts.
#[derive(Debug, Clone)]
pub struct Corpus {
    pub train: Part,
    pub val: Part,
    pub name: String,
    /// Ids its tokens may take: 256 for bytes, a tokenizer's vocabulary, or (shards) one more
    /// than the largest id they hold. A model's vocabulary must cover it.
    pub ids: usize,
}

/// One part of a corpus: text to model, or labelled examples.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Text(Tokens),
    Examples(Examples),
}

impl Part {
    /// Tokens of a text, examples of a task.
    pub fn len(&self) -> usize {
        match self {
            Part::Text(t) => t.len(),
            Part::Examples(e) => e.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The text (a task's examples have none).
    pub fn text(&self) -> Option<&Tokens> {
        match self {
            Part::Text(t) => Some(t),
            Part::Examples(_) => None,
        }
    }

    /// Fixed samples: non-overlapping windows of `seq_len` (and their next token) of a text,
    /// or the examples.
    pub fn samples(&self, seq_len: usize) -> usize {
        match self {
            Part::Text(t) => samples_in(t.len(), seq_len),
            Part::Examples(e) => e.len(),
        }
    }

    /// A micro-batch of the fixed samples `samples` (numbered as [`Part::samples`] counts).
    pub fn batch(&self, seq_len: usize, samples: Vec<u64>) -> MicroBatch {
        match self {
            Part::Text(t) => {
                let offsets: Vec<usize> = samples.iter().map(|&s| s as usize * seq_len).collect();
                window_batch(t, seq_len, &offsets, samples)
            }
            Part::Examples(e) => {
                let idx: Vec<usize> = samples.iter().map(|&s| s as usize).collect();
                let x = e.select(&idx);
                MicroBatch {
                    rows: samples.len(),
                    seq_len: e.seq_len,
                    tokens: x.tokens,
                    mask: x.mask,
                    targets: x.labels,
                    target_len: x.target_len.max(1),
                    token_types: x.token_types,
                    pixels: x.pixels,
                    image: x.image,
                    samples,
                    unread: false,
                }
                // Padded to its longest row only, not to the model's length.
                .trim_padding()
            }
        }
    }
}

/// The data's generator (order, windows, the synthetic corpus): SplitMix64, from core.
pub use pipewright_core::rng::SplitMix64 as Rng;

/// Sentences from a small grammar plus sums, e.g. "the red fox sees a small dog. 3+4=7."
pub fn synthetic_text(bytes: usize, seed: u64) -> String {
    const DET: [&str; 3] = ["the", "a", "every"];
    const ADJ: [&str; 6] = ["red", "small", "quick", "lazy", "old", "bright"];
    const NOUN: [&str; 6] = ["fox", "dog", "cat", "bird", "river", "tree"];
    const VERB: [&str; 5] = ["sees", "follows", "likes", "finds", "jumps over"];
    let mut r = Rng::new(seed);
    let mut s = String::with_capacity(bytes + 64);
    while s.len() < bytes {
        if r.below(4) == 0 {
            let (a, b) = (r.below(10), r.below(10));
            s += &format!("{a}+{b}={}. ", a + b);
        } else {
            let np = |r: &mut Rng| {
                format!(
                    "{} {} {}",
                    DET[r.below(3)],
                    ADJ[r.below(6)],
                    NOUN[r.below(6)]
                )
            };
            let (x, y) = (np(&mut r), np(&mut r));
            s += &format!("{x} {} {y}. ", VERB[r.below(5)]);
        }
    }
    s.truncate(bytes);
    s
}

/// A UTF-8 text file's contents. A FIFO or device would block the read: only regular files
/// are read.
fn read_text(path: &Path) -> Result<String> {
    super::records::regular(path)?;
    let bytes = std::fs::read(path)
        .map_err(|e| format!("{}: cannot read data file: {e}", path.display()))?;
    Ok(String::from_utf8(bytes).map_err(|e| format!("{}: not UTF-8 text: {e}", path.display()))?)
}

impl Corpus {
    /// The built-in corpus: 256 KiB of synthetic text, the last 10% held out.
    pub fn builtin() -> Self {
        Self::from_bytes(
            "built-in synthetic corpus",
            synthetic_text(256 * 1024, 7).into_bytes(),
        )
    }

    pub fn load(path: &Path) -> Result<Self> {
        let text = read_text(path)?;
        Ok(Self::from_bytes(
            &path.display().to_string(),
            text.into_bytes(),
        ))
    }

    /// A corpus of documents (each after the tokenizer's end-of-text token, where it has one),
    /// the last `val_fraction` of the tokens held out.
    pub fn from_documents(
        name: &str,
        docs: &[String],
        tok: &super::tokenizer::Tokenizer,
        val_fraction: f64,
    ) -> Result<Self> {
        let mut ids = Vec::new();
        for d in docs {
            ids.extend(tok.eot());
            ids.extend(tok.encode(d)?);
        }
        Ok(Self::split_tokens(
            name,
            Tokens::ids(ids),
            tok.vocab_size(),
            val_fraction,
        ))
    }

    /// The data at `path` to train on, and at `val` to validate with (each as
    /// [`Corpus::open`] reads it; `val`'s shards are held out whatever their names).
    pub fn open_with_val(
        path: &Path,
        val: &Path,
        tok: &super::tokenizer::Tokenizer,
    ) -> Result<Self> {
        let train = Self::open_split(path, tok, 0.0)?;
        let held = Self::open_split(val, tok, 1.0)?;
        Ok(Corpus {
            name: format!("{} (validation: {})", train.name, held.name),
            ids: train.ids.max(held.ids),
            train: train.train,
            val: match held.val.is_empty() {
                true => held.train,
                false => held.val,
            },
        })
    }

    /// The built-in corpus as `tok` reads it.
    pub fn builtin_with(tok: &super::tokenizer::Tokenizer) -> Result<Self> {
        if matches!(tok, super::tokenizer::Tokenizer::Bytes) {
            return Ok(Self::builtin());
        }
        let ids = tok.encode(&synthetic_text(256 * 1024, 7))?;
        let name = format!("built-in synthetic corpus ({} tokens)", tok.name());
        Ok(Self::from_tokens(&name, Tokens::ids(ids), tok.vocab_size()))
    }

    /// A corpus of `text` named `name` (the last 10% held out), for library users and tests.
    pub fn from_text(name: &str, text: &str) -> Self {
        Self::from_bytes(name, text.as_bytes().to_vec())
    }

    fn from_bytes(name: &str, bytes: Vec<u8>) -> Self {
        Self::from_tokens(name, Tokens::bytes(bytes), 256)
    }

    /// A corpus of `tokens` (ids below `ids`) named `name`, the last 10% held out.
    pub fn from_tokens(name: &str, tokens: Tokens, ids: usize) -> Self {
        Self::split_tokens(name, tokens, ids, 0.1)
    }

    /// The same with the last `val_fraction` (0..=1) held out.
    /// `ids` is what the tokenizer claims; the tokens' own largest id bounds it from below,
    /// so that no id past the model's vocabulary reaches a gather.
    fn split_tokens(name: &str, tokens: Tokens, ids: usize, val_fraction: f64) -> Self {
        let cut = tokens.len() - (tokens.len() as f64 * val_fraction) as usize;
        Corpus {
            ids: ids.max(tokens.id_bound()),
            train: Part::Text(tokens.slice(0..cut)),
            val: Part::Text(tokens.slice(cut..tokens.len())),
            name: name.into(),
        }
    }

    /// The data at `path` as `tok` sees it: a UTF-8 text file, a directory of them (`*.txt`,
    /// in name order), token shards (`*.bin`: llm.c's or nanoGPT's; those named `*val*` are
    /// the held-out part), or one shard.
    pub fn open(path: &Path, tok: &super::tokenizer::Tokenizer) -> Result<Self> {
        Self::open_split(path, tok, 0.1)
    }

    /// [`Corpus::open`] with the last `val_fraction` held out (where no shards are named for
    /// validation).
    pub fn open_split(
        path: &Path,
        tok: &super::tokenizer::Tokenizer,
        val_fraction: f64,
    ) -> Result<Self> {
        let name = path.display().to_string();
        if let Err(e) = std::fs::metadata(path) {
            return Err(format!("{name}: cannot read data file: {e}").into());
        }
        let listed = |ext: &str| -> Result<Vec<std::path::PathBuf>> {
            let mut v: Vec<_> = std::fs::read_dir(path)
                .map_err(|e| format!("{name}: cannot list: {e}"))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == ext))
                .collect();
            v.sort();
            Ok(v)
        };
        let (texts, shards) = if path.is_dir() {
            (listed("txt")?, listed("bin")?)
        } else if path.extension().is_some_and(|x| x == "bin") {
            (Vec::new(), vec![path.to_path_buf()])
        } else {
            (vec![path.to_path_buf()], Vec::new())
        };
        if !shards.is_empty() {
            if path.is_dir() {
                match super::shards::read_manifest(path)? {
                    Some(m) if !m.complete => return Err(format!(
                        "{name}: its tokenize has not finished ({} of {} files); run the same tokenize command again to resume it",
                        m.files_done,
                        m.settings.inputs.len()
                    ).into()),
                    _ => {}
                }
            }
            return Self::from_shards(&name, &shards, val_fraction);
        }
        if texts.is_empty() {
            return Err(format!("{name}: no .txt or .bin files").into());
        }
        if !path.is_dir() && matches!(tok, super::tokenizer::Tokenizer::Bytes) {
            let bytes = read_text(path)?.into_bytes();
            return Ok(Self::split_tokens(
                &name,
                Tokens::bytes(bytes),
                256,
                val_fraction,
            ));
        }
        if let Some(f) = texts.iter().find(|f| !f.is_file()) {
            return Err(format!(
                "{}: cannot read data file: not a regular file (a directory, FIFO or device)",
                f.display()
            )
            .into());
        }
        let ids = tok.encode_files(&texts, &|| {})?;
        let ids = Tokens::ids(ids);
        Ok(Self::split_tokens(
            &name,
            ids,
            tok.vocab_size(),
            val_fraction,
        ))
    }

    /// Shards, those named `*val*` held out (else the last `val_fraction`).
    fn from_shards(name: &str, shards: &[std::path::PathBuf], val_fraction: f64) -> Result<Self> {
        let is_val = |p: &std::path::PathBuf| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().contains("val"))
        };
        let (val, train): (Vec<_>, Vec<_>) = shards.iter().cloned().partition(is_val);
        let train_tokens = Tokens::shards(&train)?;
        Ok(match val.is_empty() {
            true => Self::split_tokens(name, train_tokens, 0, val_fraction),
            false => {
                let val = Tokens::shards(&val)?;
                Corpus {
                    ids: train_tokens.id_bound().max(val.id_bound()),
                    train: Part::Text(train_tokens),
                    val: Part::Text(val),
                    name: name.into(),
                }
            }
        })
    }

    /// A task's corpus: labelled examples for training and for validation, of a tokenizer
    /// with `ids` ids.
    pub fn examples(name: &str, train: Examples, val: Examples, ids: usize) -> Self {
        Corpus {
            train: Part::Examples(train),
            val: Part::Examples(val),
            name: name.into(),
            ids,
        }
    }

    /// A task's corpus from one set of examples: `val_fraction` of them, drawn by `seed`,
    /// held out (files are often sorted by label, so the tail would not do).
    pub fn examples_split(
        name: &str,
        all: &Examples,
        ids: usize,
        val_fraction: f64,
        seed: u64,
    ) -> Self {
        let mut order: Vec<usize> = (0..all.len()).collect();
        let mut r = Rng::new(seed ^ 0x5A11_DA7A);
        for i in (1..order.len()).rev() {
            order.swap(i, r.below(i + 1));
        }
        let held = (all.len() as f64 * val_fraction).round() as usize;
        let (val, train) = order.split_at(held);
        Self::examples(name, all.select(train), all.select(val), ids)
    }

    /// Classes the labels take (the largest + 1); 0 for text.
    pub fn classes(&self) -> usize {
        let most = |p: &Part| match p {
            Part::Examples(e) => e.labels.iter().max().map_or(0, |&m| m as usize + 1),
            Part::Text(_) => 0,
        };
        most(&self.train).max(most(&self.val))
    }

    /// Answer spans (question answering) to learn?
    pub fn is_span(&self) -> bool {
        matches!(&self.train, Part::Examples(e) if e.target_len == 2)
    }

    /// Labelled examples (a task) rather than text?
    pub fn is_task(&self) -> bool {
        matches!(self.train, Part::Examples(_))
    }

    /// Check the corpus is long enough for sequences of `seq_len`.
    pub fn check(&self, seq_len: usize) -> Result<()> {
        if let (Part::Examples(t), Part::Examples(v)) = (&self.train, &self.val) {
            return match (t.seq_len == seq_len, t.is_empty() || v.is_empty()) {
                (false, _) => Err(format!(
                    "{}: examples of {} tokens for a model of seq_len {seq_len}",
                    self.name, t.seq_len
                )
                .into()),
                (_, true) => Err(format!(
                    "{}: needs examples both to train on and to validate with",
                    self.name
                )
                .into()),
                _ => Ok(()),
            };
        }
        if self.val.len() <= seq_len + 1 || self.train.len() <= seq_len + 1 {
            return Err(format!(
                "{}: {} tokens is too short for sequences of {seq_len} (need more than {} in each of the train and held-out parts)",
                self.name,
                self.train.len() + self.val.len(),
                seq_len + 1
            ).into());
        }
        Ok(())
    }

    /// Cross-entropy (nats) of predicting held-out tokens (or a task's labels) from their
    /// training-set frequencies: the bar a model must clear to have learnt anything beyond
    /// frequencies.
    pub fn unigram_baseline(&self) -> f64 {
        // Streamed: a sharded corpus may be larger than memory.
        fn values(p: &Part) -> Box<dyn Iterator<Item = usize> + '_> {
            match p {
                Part::Text(t) => Box::new(t.iter().map(|x| x as usize)),
                Part::Examples(e) => Box::new(e.labels.iter().map(|&l| l as usize)),
            }
        }
        let bound = |p: &Part| match p {
            Part::Text(t) => 256.max(t.id_bound()),
            Part::Examples(e) => e.labels.iter().max().map_or(0, |&m| m as usize + 1),
        };
        let mut counts = vec![1.0f64; bound(&self.train).max(bound(&self.val))]; // add-one smoothing
        for b in values(&self.train) {
            counts[b] += 1.0;
        }
        let total: f64 = counts.iter().sum();
        let (mut sum, mut n) = (0.0, 0usize);
        for b in values(&self.val) {
            (sum, n) = (sum - (counts[b] / total).ln(), n + 1);
        }
        sum / n.max(1) as f64
    }
}

/// Micro-batch number `index` of optimizer step `step`: random windows of the text, the same
/// whichever worker or replica asks.
pub fn micro_batch(
    text: &Tokens,
    seq_len: usize,
    rows: usize,
    seed: u64,
    step: u64,
    index: u64,
) -> MicroBatch {
    let mut r =
        Rng::new(seed ^ step.wrapping_mul(0x1000_0000_01B3) ^ index.wrapping_mul(0x9E37_79B9));
    let offsets: Vec<usize> = (0..rows)
        .map(|_| r.below(text.len() - seq_len - 1))
        .collect();
    window_batch(text, seq_len, &offsets, Vec::new())
}

/// The windows of `seq_len` inputs (and their next bytes) at `offsets` of `text`.
fn window_batch(text: &Tokens, seq_len: usize, offsets: &[usize], samples: Vec<u64>) -> MicroBatch {
    let mut tokens = Vec::with_capacity(offsets.len() * seq_len);
    let mut targets = Vec::with_capacity(offsets.len() * seq_len);
    for &o in offsets {
        let w = text.window(o, seq_len + 1);
        tokens.extend_from_slice(&w[..seq_len]);
        targets.extend_from_slice(&w[1..]);
    }
    MicroBatch {
        rows: offsets.len(),
        seq_len,
        tokens,
        targets,
        target_len: seq_len,
        samples,
        ..MicroBatch::default()
    }
}

/// How a step's sequences are drawn from the training text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sampling {
    /// Random windows anywhere in the text, drawn afresh for every step.
    #[default]
    Windows,
    /// Epochs over fixed samples (the text cut into non-overlapping windows): every epoch a
    /// fresh permutation, every step the next global batch of it, so no sample repeats
    /// within an epoch whichever replica runs it. The frozen-prefix cache keys on samples.
    Epochs,
}

/// Samples of `seq_len` inputs (and their next bytes) in `text_len` bytes under
/// [`Sampling::Epochs`].
pub fn samples_in(text_len: usize, seq_len: usize) -> usize {
    text_len.saturating_sub(1) / seq_len.max(1)
}

/// Draws each step's micro-batches (the same whichever worker or replica asks).
#[derive(Debug, Clone)]
pub struct Sampler {
    pub sampling: Sampling,
    seq_len: usize,
    rows: usize,
    seed: u64,
    /// The epoch whose permutation `order` holds.
    epoch: Option<u64>,
    order: Vec<u64>,
    /// Where the next step starts, once known: (step, epoch, offset in the epoch's order).
    /// Steps of a constant batch need none; a batch that changed mid-run (the global batch
    /// scaled with replicas) continues from here, and checkpoints keep it.
    pos: Option<SamplerPos>,
    /// Group examples of similar length (see [`Sampler::bucketed`]).
    bucket: bool,
}

/// Steps' worth of an epoch's shuffled examples that `--bucket` sorts by length together:
/// micro-batches of like lengths, while which examples meet in a step stays random.
const BUCKET_STEPS: usize = 50;

/// Where step `step` starts in the epoch sampler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerPos {
    pub step: u64,
    pub epoch: u64,
    pub offset: usize,
}

impl Sampler {
    pub fn new(sampling: Sampling, seq_len: usize, rows: usize, seed: u64) -> Self {
        Sampler {
            sampling,
            seq_len,
            rows,
            seed,
            epoch: None,
            order: Vec::new(),
            pos: None,
            bucket: false,
        }
    }

    /// Examples grouped by length (`--bucket`): each run of 50 steps' examples of the
    /// epoch's permutation is sorted by length (stably), so that a micro-batch, padded to its
    /// longest row, holds little padding. Fixed by the seed; every example still comes once
    /// an epoch. A text's windows all have one length: nothing changes for them.
    pub fn bucketed(mut self, on: bool) -> Self {
        self.bucket = on;
        self
    }

    /// Where the next step starts (epoch sampling, after a step).
    pub fn position(&self) -> Option<SamplerPos> {
        self.pos
    }

    /// Continue from `pos` (a checkpoint's).
    pub fn set_position(&mut self, pos: Option<SamplerPos>) {
        self.pos = pos;
    }

    /// Steps in one epoch of `text` with `microbatches` micro-batches a step; an error naming
    /// the sizes when the text holds fewer samples than one step takes.
    /// (Random windows: the steps that draw as many bytes as the text holds.)
    pub fn steps_per_epoch(&self, data: &Part, microbatches: usize) -> Result<u64> {
        let n = data.samples(self.seq_len);
        let batch = microbatches.saturating_mul(self.rows).max(1);
        if self.windows(data) {
            return Ok((n / batch).max(1) as u64);
        }
        match (n / batch, data) {
            (0, Part::Text(_)) => Err(format!(
                "the training text holds {n} samples of {} tokens, fewer than one step's {batch} ({microbatches} micro-batches of {} sequences); use a longer text, fewer micro-batches or rows, or window sampling",
                self.seq_len + 1,
                self.rows
            ).into()),
            (0, Part::Examples(_)) => Err(format!(
                "{n} training examples are fewer than one step's {batch} ({microbatches} micro-batches of {}); use fewer micro-batches or rows",
                self.rows
            ).into()),
            (s, _) => Ok(s as u64),
        }
    }

    /// Random windows? Only of a text: a task's examples are always drawn in epochs.
    fn windows(&self, data: &Part) -> bool {
        self.sampling == Sampling::Windows && matches!(data, Part::Text(_))
    }

    /// The `microbatches` micro-batches of optimizer step `step` (numbered over the job).
    pub fn batches(
        &mut self,
        data: &Part,
        step: u64,
        microbatches: usize,
    ) -> Result<Vec<MicroBatch>> {
        self.batches_for(data, step, microbatches, &|_| true)
    }

    /// [`Sampler::batches`], reading only the micro-batches `need` names: a text's others are
    /// left [`MicroBatch::unread`] (with their sample numbers), so that each process reads
    /// only its own replicas' part of a memory-mapped corpus. The order and position are the
    /// same whatever is read.
    pub fn batches_for(
        &mut self,
        data: &Part,
        step: u64,
        microbatches: usize,
        need: &dyn Fn(usize) -> bool,
    ) -> Result<Vec<MicroBatch>> {
        let (seq_len, rows, seed) = (self.seq_len, self.rows, self.seed);
        let text = matches!(data, Part::Text(_));
        let unread = |samples: Vec<u64>| MicroBatch {
            rows,
            seq_len,
            target_len: seq_len,
            samples,
            unread: true,
            ..MicroBatch::default()
        };
        if let (true, Part::Text(text)) = (self.windows(data), data) {
            return Ok((0..microbatches)
                .map(|i| match need(i) {
                    true => micro_batch(text, seq_len, rows, seed, step, i as u64),
                    false => unread(Vec::new()),
                })
                .collect());
        }
        let per_epoch = self.steps_per_epoch(data, microbatches)?;
        let n = data.samples(seq_len);
        let batch = microbatches * rows;
        let (mut epoch, mut first) = match self.pos {
            Some(p) if p.step == step => (p.epoch, p.offset),
            _ => (step / per_epoch, (step % per_epoch) as usize * batch),
        };
        // The rest of an epoch too small for this step's batch is left out (and an offset from
        // a crafted checkpoint past the samples starts the next epoch, not a panic).
        if first.checked_add(batch).is_none_or(|end| end > n) {
            (epoch, first) = (epoch.saturating_add(1), 0);
        }
        self.pos = Some(SamplerPos {
            step: step + 1,
            epoch,
            offset: first + batch,
        });
        if self.epoch != Some(epoch) {
            // Fisher-Yates over every sample, seeded by the run's seed and the epoch.
            let mut r = Rng::new(seed ^ 0xE70C_5EED ^ epoch.wrapping_mul(0x2545_F491_4F6C_DD1D));
            self.order = (0..n as u64).collect();
            for i in (1..n).rev() {
                self.order.swap(i, r.below(i + 1));
            }
            if let (true, Part::Examples(e)) = (self.bucket, data) {
                let lens = e.lengths();
                for run in self.order.chunks_mut(batch * BUCKET_STEPS) {
                    run.sort_by_key(|&s| lens[s as usize]);
                }
            }
            self.epoch = Some(epoch);
        }
        Ok((0..microbatches)
            .map(|i| {
                let samples = self.order[first + i * rows..first + (i + 1) * rows].to_vec();
                match text && !need(i) {
                    true => unread(samples),
                    false => data.batch(seq_len, samples),
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_corpus_is_deterministic_and_learnable() {
        let a = Corpus::builtin();
        assert_eq!(a.train, Corpus::builtin().train);
        let base = a.unigram_baseline();
        assert!(base > 2.0 && base < 4.0, "unigram baseline {base}");
        let text = a.train.text().unwrap();
        let m = micro_batch(text, 16, 2, 1, 3, 4);
        assert_eq!(m, micro_batch(text, 16, 2, 1, 3, 4));
        assert_eq!(m.tokens[1..16], m.targets[..15]);
    }

    #[test]
    fn bucketed_epochs_visit_every_example_once_in_micro_batches_of_like_lengths() {
        use crate::data::examples::Examples;
        // 400 examples of 1 to 32 tokens.
        let mut e = Examples {
            seq_len: 32,
            target_len: 1,
            ..Examples::default()
        };
        for i in 0..400usize {
            let n = 1 + i * 13 % 32;
            e.tokens.extend((0..32).map(|p| (p < n) as i64));
            e.mask.extend((0..32).map(|p| (p < n) as i64));
            e.labels.push(0);
        }
        let data = Part::Examples(e);
        let positions = |bucket: bool| {
            let mut s = Sampler::new(Sampling::Epochs, 32, 2, 5).bucketed(bucket);
            let mut seen = Vec::new();
            let mut total = 0;
            for step in 0..50 {
                for mb in s.batches(&data, step, 4).unwrap() {
                    total += mb.rows * mb.seq_len;
                    seen.extend(mb.samples);
                }
            }
            seen.sort_unstable();
            assert_eq!(seen, (0..400).collect::<Vec<u64>>(), "bucket {bucket}");
            total
        };
        let (plain, bucketed) = (positions(false), positions(true));
        let Part::Examples(e) = &data else {
            unreachable!()
        };
        let real: usize = e.lengths().iter().sum();
        // Padding: under 2% of the real tokens bucketed, over 25% without.
        assert!(
            bucketed * 50 < real * 51 && plain * 4 > real * 5,
            "{bucketed} and {plain} positions for {real} tokens"
        );
        assert_eq!(bucketed, positions(true), "fixed by the seed");
    }

    #[test]
    fn epochs_visit_every_sample_once_whatever_the_step_shape() {
        let tokens = Tokens::bytes(synthetic_text(16 * 100 + 1, 3).into_bytes());
        let text = Part::Text(tokens.clone());
        let mut s = Sampler::new(Sampling::Epochs, 16, 3, 9);
        // 100 samples, 2 micro-batches of 3 a step: 16 steps an epoch, 4 samples left over.
        assert_eq!(s.steps_per_epoch(&text, 2), Ok(16));
        for epoch in 0..2u64 {
            let mut seen = std::collections::HashSet::new();
            for step in epoch * 16..(epoch + 1) * 16 {
                for m in s.batches(&text, step, 2).unwrap() {
                    for (r, &x) in m.samples.iter().enumerate() {
                        assert!(seen.insert(x), "sample {x} twice in epoch {epoch}");
                        let o = x as usize * 16;
                        let row = &m.tokens[r * 16..(r + 1) * 16];
                        assert_eq!(row, &tokens.window(o, 16)[..]);
                        assert_eq!(m.targets[r * 16 + 15], tokens.get(o + 16) as i64);
                    }
                }
            }
            assert_eq!(seen.len(), 96);
        }
        // Another epoch, another order; the same step, the same batches.
        let a = s.batches(&text, 0, 2).unwrap();
        assert_ne!(a[0].samples, s.batches(&text, 16, 2).unwrap()[0].samples);
        assert_eq!(
            a,
            Sampler::new(Sampling::Epochs, 16, 3, 9)
                .batches(&text, 0, 2)
                .unwrap()
        );
        assert!(s
            .steps_per_epoch(&text, 40)
            .unwrap_err()
            .to_string()
            .contains("fewer than one step"));
        // A batch that grows mid-epoch (2, then 4 micro-batches of 3) continues where the
        // epoch stood, still without repeats; a fresh sampler resumes from the position.
        let mut s = Sampler::new(Sampling::Epochs, 16, 3, 9);
        let mut seen = std::collections::HashSet::new();
        for step in 0..5 {
            for m in s.batches(&text, step, 2).unwrap() {
                seen.extend(m.samples);
            }
        }
        let pos = s.position();
        let mut resumed = Sampler::new(Sampling::Epochs, 16, 3, 9);
        resumed.set_position(pos);
        for step in 5..10 {
            let a = s.batches(&text, step, 4).unwrap();
            assert_eq!(a, resumed.batches(&text, step, 4).unwrap());
            for m in a {
                for x in m.samples {
                    assert!(seen.insert(x), "sample {x} twice at step {step}");
                }
            }
        }
        assert_eq!(seen.len(), 30 + 5 * 12);
        // A process that runs only the odd micro-batches reads only those: the same samples
        // in the same places, the others left unread, and the position unchanged.
        let mut odd = Sampler::new(Sampling::Epochs, 16, 3, 9);
        odd.set_position(pos);
        let mut all = Sampler::new(Sampling::Epochs, 16, 3, 9);
        all.set_position(pos);
        let part = odd.batches_for(&text, 5, 4, &|i| i % 2 == 1).unwrap();
        for (i, (p, a)) in part
            .iter()
            .zip(all.batches(&text, 5, 4).unwrap())
            .enumerate()
        {
            assert_eq!(p.samples, a.samples);
            assert_eq!(p.unread, i % 2 == 0);
            if p.unread {
                assert!(p.tokens.is_empty() && p.targets.is_empty());
            } else {
                assert_eq!(*p, a);
            }
        }
        assert_eq!(odd.position(), all.position());
        // 90 + 12 > 100: the next step starts the next epoch.
        assert_eq!(s.batches(&text, 10, 4).unwrap().len(), 4);
        assert_eq!(s.position().unwrap().epoch, 1);
        assert_eq!(s.position().unwrap().offset, 12);
    }
}

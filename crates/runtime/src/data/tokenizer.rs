//! Tokenizers: bytes (the default), GPT-2's and cl100k's BPE ranks embedded in `tiktoken-rs`,
//! or a Hugging Face `tokenizer.json` through the `tokenizers` crate (built pure Rust).

use super::error::{Error, Result};
use std::path::Path;

/// Byte tokens as text; an id past the bytes (a model of a larger vocabulary) as `<id>`.
fn bytes_text(ids: &[u32]) -> String {
    let mut out = String::new();
    let mut bytes = Vec::new();
    for &x in ids {
        if x < 256 {
            bytes.push(x as u8);
        } else {
            out.push_str(&String::from_utf8_lossy(&std::mem::take(&mut bytes)));
            out.push_str(&format!("<{x}>"));
        }
    }
    out + &String::from_utf8_lossy(&bytes)
}

pub enum Tokenizer {
    /// Each byte of the UTF-8 text is a token.
    Bytes,
    /// A BPE from `tiktoken-rs`: its name and vocabulary size (special tokens included).
    Bpe {
        name: &'static str,
        bpe: &'static tiktoken_rs::CoreBPE,
        vocab: usize,
    },
    /// A Hugging Face `tokenizer.json`, and one past its largest id (its ids may be sparse:
    /// the count of tokens is no bound).
    Hf {
        path: String,
        tok: Box<tokenizers::Tokenizer>,
        ids: usize,
    },
}

impl Tokenizer {
    /// `bytes`, `gpt2`, `cl100k`, a `tokenizer.json` file, or a directory holding one (a
    /// Hugging Face model directory).
    pub fn load(spec: &str) -> Result<Self> {
        match spec {
            "bytes" => return Ok(Tokenizer::Bytes),
            "gpt2" | "r50k" => {
                return Ok(Tokenizer::Bpe {
                    name: "gpt2",
                    bpe: tiktoken_rs::r50k_base_singleton(),
                    vocab: 50257,
                })
            }
            "cl100k" => {
                return Ok(Tokenizer::Bpe {
                    name: "cl100k",
                    bpe: tiktoken_rs::cl100k_base_singleton(),
                    vocab: 100277,
                })
            }
            _ => {}
        }
        let p = Path::new(spec);
        let file = if p.is_dir() {
            p.join("tokenizer.json")
        } else {
            p.to_path_buf()
        };
        if !file.is_file() {
            return Err(format!(
                "--tokenizer {spec}: not bytes, gpt2, cl100k, a tokenizer.json file or a directory with one"
            ).into());
        }
        let mut tok = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| format!("{}: not a Hugging Face tokenizer.json: {e}", file.display()))?;
        // A tokenizer.json may carry the padding and truncation it was last used with
        // (all-MiniLM-L6-v2's pads every text to 128 [PAD]s); transformers sets both per call
        // and so does pipewright (cut to the window, padded to the micro-batch, masked).
        tok.with_padding(None);
        tok.with_truncation(None)
            .map_err(|e| format!("{}: {e}", file.display()))?;
        let ids = tok
            .get_vocab(true)
            .values()
            .map(|&i| i as usize + 1)
            .max()
            .unwrap_or(0);
        Ok(Tokenizer::Hf {
            path: file.display().to_string(),
            tok: Box::new(tok),
            ids,
        })
    }

    /// The tokenizer of a model directory when it has one. A `tokenizer.json` that is there
    /// but not a regular file (a FIFO, a directory) is refused, not passed over: bytes in its
    /// place would train the model on ids it never saw.
    pub fn of_model_dir(dir: &Path) -> Option<Result<Self>> {
        let f = dir.join("tokenizer.json");
        if f.symlink_metadata().is_err() {
            return None;
        }
        Some(match pipewright_core::inputs::regular_file(&f) {
            Ok(_) => Self::load(&f.display().to_string()),
            Err(e) => Err(e.to_string().into()),
        })
    }

    /// The tokenizer a run reads with: `spec` when one is named, else that of the model
    /// directory it starts from, else bytes.
    pub fn for_run(spec: Option<&str>, model_dir: Option<&Path>) -> Result<Self> {
        match (spec, model_dir) {
            (Some(spec), _) => Self::load(spec),
            (None, Some(dir)) => Self::of_model_dir(dir).unwrap_or(Ok(Tokenizer::Bytes)),
            (None, None) => Ok(Tokenizer::Bytes),
        }
    }

    pub fn name(&self) -> String {
        match self {
            Tokenizer::Bytes => "bytes".into(),
            Tokenizer::Bpe { name, .. } => name.to_string(),
            Tokenizer::Hf { path, .. } => path.clone(),
        }
    }

    /// One past the largest id the tokenizer can produce (special tokens included): the rows
    /// an embedding needs for it.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::Bpe { vocab, .. } => *vocab,
            Tokenizer::Hf { ids, .. } => *ids,
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(match self {
            Tokenizer::Bytes => text.bytes().map(u32::from).collect(),
            Tokenizer::Bpe { bpe, .. } => bpe.encode_ordinary(text),
            Tokenizer::Hf { tok, path, .. } => tok
                .encode(text, false)
                .map_err(|e| format!("{path}: {e}"))?
                .get_ids()
                .to_vec(),
        })
    }

    /// One example's ids for a task, at most `max` of them, and whether the text was cut: as
    /// [`Tokenizer::encode`], with the special tokens a Hugging Face tokenizer adds around a
    /// sequence (BERT's [CLS] and [SEP]). A long text is cut before those are added, as
    /// transformers' `truncation=True` does, so a cut example still ends with [SEP].
    pub fn encode_example(&self, text: &str, max: usize) -> Result<(Vec<u32>, bool)> {
        let Tokenizer::Hf { tok, path, .. } = self else {
            let mut ids = self.encode(text)?;
            let cut = ids.len() > max;
            ids.truncate(max);
            return Ok((ids, cut));
        };
        let fail = |e: tokenizers::Error| Error::from(format!("{path}: {e}"));
        use tokenizers::PostProcessor;
        let added = tok
            .get_post_processor()
            .map_or(0, |p| p.added_tokens(false));
        let room = max.saturating_sub(added);
        let mut e = encode_head(tok, text, room).map_err(fail)?;
        let cut = e.len() > room;
        if cut {
            e.truncate(room, 0, tokenizers::TruncationDirection::Right);
        }
        let e = tok.post_process(e, None, true).map_err(fail)?;
        let mut ids = e.get_ids().to_vec();
        ids.truncate(max); // a window shorter than the special tokens themselves
        Ok((ids, cut))
    }

    /// A question and its context as one sequence: ids, segment ids (0: question, 1:
    /// context) and each token's byte range in the context (None for question and special
    /// tokens). A Hugging Face tokenizer adds its special tokens (BERT's [CLS] q [SEP] c [SEP]).
    #[allow(clippy::type_complexity)]
    pub fn encode_pair(
        &self,
        question: &str,
        context: &str,
    ) -> Result<(Vec<u32>, Vec<u32>, Vec<Option<(usize, usize)>>)> {
        if let Tokenizer::Hf { tok, path, .. } = self {
            let e = tok
                .encode((question, context), true)
                .map_err(|e| format!("{path}: {e}"))?;
            let offsets = e
                .get_sequence_ids()
                .into_iter()
                .zip(e.get_offsets())
                .map(|(s, &o)| (s == Some(1)).then_some(o))
                .collect();
            return Ok((e.get_ids().to_vec(), e.get_type_ids().to_vec(), offsets));
        }
        let (q, c) = (self.encode(question)?, self.encode(context)?);
        let mut offsets = vec![None; q.len()];
        let mut at = 0;
        for &id in &c {
            let len = match self {
                Tokenizer::Bpe { bpe, .. } => bpe.decode_bytes(&[id]).map_or(1, |b| b.len()),
                _ => 1,
            };
            offsets.push(Some((at, at + len)));
            at += len;
        }
        let types = [vec![0; q.len()], vec![1; c.len()]].concat();
        Ok(([q, c].concat(), types, offsets))
    }

    /// Text of `ids`; bytes that are not UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Bytes => Ok(bytes_text(ids)),
            Tokenizer::Bpe { bpe, name, .. } => bpe
                .decode_bytes(ids)
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .map_err(|e| format!("{name}: {e}").into()),
            Tokenizer::Hf { tok, path, .. } => {
                Ok(tok.decode(ids, false).map_err(|e| format!("{path}: {e}"))?)
            }
        }
    }

    /// The end-of-text token that separates documents, where the tokenizer has one (GPT-2's
    /// `<|endoftext|>`, as llm.c and nanoGPT put it before each document).
    pub fn eot(&self) -> Option<u32> {
        match self {
            Tokenizer::Bpe { name: "gpt2", .. } => Some(50256),
            Tokenizer::Bpe { name: "cl100k", .. } => Some(100257),
            _ => None,
        }
    }

    /// Every file's text as tokens, each file a document (after the end-of-text token where
    /// there is one), in the files' order; files are tokenized in parallel and `done` is called
    /// as each finishes.
    pub fn encode_files(
        &self,
        files: &[std::path::PathBuf],
        done: &(dyn Fn() + Sync),
    ) -> Result<Vec<u32>> {
        use rayon::prelude::*;
        let parts: Vec<Vec<u32>> = files
            .par_iter()
            .map(|f| {
                super::records::regular(f)?;
                let bytes =
                    std::fs::read(f).map_err(|e| format!("{}: cannot read: {e}", f.display()))?;
                let text = String::from_utf8(bytes)
                    .map_err(|e| format!("{}: not UTF-8 text: {e}", f.display()))?;
                let mut ids: Vec<u32> = self.eot().into_iter().collect();
                ids.extend(self.encode(&text)?);
                done();
                Ok(ids)
            })
            .collect::<Result<_>>()?;
        Ok(parts.concat())
    }

    /// Round trip check helper: `encode` then `decode` gives the text back (bytes and BPE).
    pub fn round_trips(&self, text: &str) -> Result<bool> {
        Ok(self.decode(&self.encode(text)?)? == text)
    }

    /// Refuse a model whose vocabulary cannot hold this tokenizer's ids.
    pub fn check_fits(&self, model_vocab: usize) -> Result<()> {
        if self.vocab_size() > model_vocab {
            return Err(format!(
                "tokenizer {}'s ids reach {}, past the model's vocabulary of {model_vocab} (its embedding's rows)",
                self.name(),
                self.vocab_size() - 1
            ).into());
        }
        Ok(())
    }
}

/// The encoding of `text`, or of a prefix of it that ends before whitespace and already gives
/// more than `room` tokens: the first `room` are then the whole text's (pre-tokenizers split
/// at whitespace, so no token spans the cut), and a 300 KB e-mail of which a window keeps 128
/// tokens is not tokenized whole.
fn encode_head(
    tok: &tokenizers::Tokenizer,
    text: &str,
    room: usize,
) -> tokenizers::Result<tokenizers::Encoding> {
    let mut at = room.saturating_add(16).saturating_mul(16);
    while at < text.len() {
        while !text.is_char_boundary(at) {
            at += 1;
        }
        let Some(cut) = text[at..].find(char::is_whitespace).map(|i| at + i) else {
            break;
        };
        let e = tok.encode(&text[..cut], false)?;
        if e.len() > room.saturating_add(8) {
            return Ok(e);
        }
        at = cut.saturating_mul(4);
    }
    tok.encode(text, false)
}

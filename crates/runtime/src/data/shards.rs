//! Text to token shards (llm.c's format), streaming and resumable: files are tokenized in
//! parallel a batch at a time and appended in order, full shards are written as they fill,
//! and after every batch a manifest (`tokenize.json`) records what is on disk and where each
//! stream's unwritten tokens begin. A run that stops anywhere resumes from there, and the
//! shards come out byte for byte as from an uninterrupted run.
//!
//! Validation holds out the last `val_fraction` of the input bytes: the documents after that
//! point, and the matching share of the tokens of the document it falls in (for one file:
//! its last `val_fraction` of tokens, as a whole-text split would).

use super::error::{Error, Result};
use super::tokenizer::Tokenizer;
use super::tokens::shard_bytes;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "tokenize.json";

/// One input file as the manifest records it, to notice a change before resuming.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Input {
    pub path: PathBuf,
    pub bytes: u64,
    pub modified_ns: u128,
}

impl Input {
    pub fn of(path: &Path) -> Result<Input> {
        let m = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let modified_ns = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        Ok(Input {
            path: path.to_path_buf(),
            bytes: m.len(),
            modified_ns,
        })
    }
}

/// What to tokenize, and how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub tokenizer: String,
    pub inputs: Vec<Input>,
    /// JSONL or Parquet inputs: the field that holds each document's text.
    pub text_field: String,
    pub val_fraction: f64,
    pub shard_tokens: usize,
}

/// Where a stream's unwritten tokens begin: token `skip` of file `file`'s share for it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pos {
    pub file: usize,
    pub skip: usize,
}

/// The shards of one stream (train or val) on disk, and where its next tokens come from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stream {
    pub shards: Vec<usize>,
    pub from: Pos,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub settings: Settings,
    pub train: Stream,
    pub val: Stream,
    /// Files tokenized (their documents counted), and the documents in them.
    pub files_done: usize,
    pub documents: u64,
    pub complete: bool,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Every file tokenized: the manifest of the finished job, and whether this run resumed.
    Done { manifest: Manifest, resumed: bool },
    /// Stopped after the batches asked for (tests of resuming).
    Stopped,
}

/// A stream being filled: its manifest entry, and tokens not yet in a shard, each run of them
/// with the file and position in that file's share it came from.
struct Filling {
    kind: &'static str,
    stream: Stream,
    pending: VecDeque<(usize, usize, Vec<u32>)>,
    len: usize,
}

impl Filling {
    fn new(kind: &'static str, stream: Stream) -> Self {
        Filling {
            kind,
            stream,
            pending: VecDeque::new(),
            len: 0,
        }
    }

    /// File `file`'s share for this stream (`skip` of its tokens already in shards).
    fn push(&mut self, file: usize, ids: &[u32]) {
        let skip = match self.stream.from.file == file {
            true => self.stream.from.skip.min(ids.len()),
            false => 0,
        };
        if file >= self.stream.from.file && skip < ids.len() {
            self.len += ids.len() - skip;
            self.pending.push_back((file, skip, ids[skip..].to_vec()));
        }
    }

    /// Write every full shard (and with `all`, the rest); `next_file` is where the stream goes
    /// on when nothing is pending.
    fn flush(&mut self, dir: &Path, size: usize, all: bool, next_file: usize) -> Result<()> {
        while self.len >= size || (all && self.len > 0) {
            let n = size.min(self.len);
            let mut ids = Vec::with_capacity(n);
            while ids.len() < n {
                let (file, at, run) = self.pending.pop_front().expect("len counts pending");
                let take = (n - ids.len()).min(run.len());
                ids.extend_from_slice(&run[..take]);
                if take < run.len() {
                    self.pending
                        .push_front((file, at + take, run[take..].to_vec()));
                }
            }
            self.len -= n;
            let name = format!("{}_{:06}.bin", self.kind, self.stream.shards.len());
            write_atomic(&dir.join(name), &shard_bytes(&ids))?;
            self.stream.shards.push(n);
        }
        self.stream.from = match self.pending.front() {
            Some(&(file, skip, _)) => Pos { file, skip },
            // Nothing pending: on from the next file, unless a resume has not yet come back
            // to where this stream stood.
            None if next_file > self.stream.from.file => Pos {
                file: next_file,
                skip: 0,
            },
            None => self.stream.from,
        };
        Ok(())
    }
}

/// Write `bytes` to `path` whole or not at all (a temporary file renamed over it).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp~");
    let res = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    res.and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| format!("{}: cannot write: {e}", path.display()).into())
}

/// The documents of one input: a text file is one; JSONL and Parquet hold one per record.
fn documents(input: &Input, field: &str) -> Result<Vec<String>> {
    let path = &input.path;
    match path.extension().and_then(|x| x.to_str()) {
        Some("jsonl" | "parquet") => super::records::read_texts(path, field),
        _ => {
            super::records::regular(path)?;
            let bytes =
                std::fs::read(path).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
            let text = String::from_utf8(bytes)
                .map_err(|e| format!("{}: not UTF-8 text: {e}", path.display()))?;
            Ok(vec![text])
        }
    }
}

/// One file's tokens: each document after the end-of-text token where there is one.
fn file_tokens(tok: &Tokenizer, input: &Input, field: &str) -> Result<(Vec<u32>, u64)> {
    let docs = documents(input, field)?;
    let mut ids = Vec::new();
    for d in &docs {
        ids.extend(tok.eot());
        ids.extend(
            tok.encode(d)
                .map_err(|e| format!("{}: {e}", input.path.display()))?,
        );
    }
    Ok((ids, docs.len() as u64))
}

/// The manifest in `out`, if there is one.
pub fn read_manifest(out: &Path) -> Result<Option<Manifest>> {
    let path = out.join(MANIFEST);
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| format!("{}: not a tokenize manifest: {e}", path.display()).into()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: cannot read: {e}", path.display()).into()),
    }
}

/// Tokenize `settings.inputs` into shards in `out` (which exists), resuming what a manifest
/// there recorded for the same settings; `batch_bytes` of input are tokenized in parallel at
/// a time, `progress` gets the input bytes done, and `stop_after` batches end the run early.
pub fn run(
    settings: &Settings,
    tok: &Tokenizer,
    out: &Path,
    batch_bytes: u64,
    progress: &(dyn Fn(u64) + Sync),
    stop_after: Option<usize>,
) -> Result<Outcome> {
    let previous = read_manifest(out)?;
    let resumed = previous.is_some();
    let mut m = match previous {
        Some(m) if m.settings == *settings => m,
        Some(m) => return Err(mismatch(out, &m.settings, settings)),
        None => Manifest {
            settings: settings.clone(),
            train: Stream::default(),
            val: Stream::default(),
            files_done: 0,
            documents: 0,
            complete: false,
        },
    };
    if m.complete {
        return Ok(Outcome::Done {
            manifest: m,
            resumed,
        });
    }
    if !resumed {
        // Before the first shard: a run killed inside its first batch leaves shards that an
        // unfinished manifest claims (so training refuses them and a rerun resumes), never
        // shards without one.
        write_manifest(out, &m)?;
    }
    let inputs = &settings.inputs;
    let total: u64 = inputs.iter().map(|i| i.bytes).sum();
    let boundary = total - (total as f64 * settings.val_fraction) as u64;
    let starts: Vec<u64> = inputs
        .iter()
        .scan(0, |s, i| {
            *s += i.bytes;
            Some(*s - i.bytes)
        })
        .collect();
    let mut train = Filling::new("train", m.train.clone());
    let mut val = Filling::new("val", m.val.clone());
    let mut next = train.stream.from.file.min(val.stream.from.file);
    if next >= inputs.len() {
        return Err(format!(
            "{}: says the run stopped at file {next} of {}, yet not complete; remove the directory and tokenize again",
            out.join(MANIFEST).display(),
            inputs.len()
        ).into());
    }
    progress(starts.get(next).copied().unwrap_or(total));
    let mut batches = 0;
    while next < inputs.len() {
        let mut end = next + 1;
        let mut bytes = inputs[next].bytes;
        while end < inputs.len() && bytes + inputs[end].bytes <= batch_bytes {
            bytes += inputs[end].bytes;
            end += 1;
        }
        use rayon::prelude::*;
        let done: Vec<(Vec<u32>, u64)> = inputs[next..end]
            .par_iter()
            .map(|i| file_tokens(tok, i, &settings.text_field))
            .collect::<Result<_>>()?;
        for (k, (ids, docs)) in done.into_iter().enumerate() {
            let f = next + k;
            let (s, b) = (starts[f], inputs[f].bytes);
            // Tokens before the held-out point train; the rest validate.
            let cut = match (s + b <= boundary, s >= boundary) {
                (true, _) => ids.len(),
                (_, true) => 0,
                _ => (ids.len() as f64 * (boundary - s) as f64 / b as f64).round() as usize,
            };
            train.push(f, &ids[..cut]);
            val.push(f, &ids[cut..]);
            if f >= m.files_done {
                m.documents += docs;
            }
        }
        next = end;
        let last = next == inputs.len();
        train.flush(out, settings.shard_tokens, last, next)?;
        val.flush(out, settings.shard_tokens, last, next)?;
        (m.train, m.val, m.complete) = (train.stream.clone(), val.stream.clone(), last);
        m.files_done = m.files_done.max(next);
        write_manifest(out, &m)?;
        progress(starts.get(next).copied().unwrap_or(total));
        batches += 1;
        if stop_after.is_some_and(|n| batches >= n) && !last {
            return Ok(Outcome::Stopped);
        }
    }
    Ok(Outcome::Done {
        manifest: m,
        resumed,
    })
}

fn write_manifest(out: &Path, m: &Manifest) -> Result<()> {
    let json = serde_json::to_string_pretty(m).expect("a manifest serialises");
    write_atomic(&out.join(MANIFEST), json.as_bytes())
}

/// Why `out`'s manifest cannot be resumed with `now`.
fn mismatch(out: &Path, was: &Settings, now: &Settings) -> Error {
    let what = if was.tokenizer != now.tokenizer {
        format!("tokenizer {} (now {})", was.tokenizer, now.tokenizer)
    } else if was.inputs.len() != now.inputs.len() {
        format!(
            "{} input files (now {})",
            was.inputs.len(),
            now.inputs.len()
        )
    } else if let Some((a, _)) = was.inputs.iter().zip(&now.inputs).find(|(a, b)| a != b) {
        format!("{} as it was then (it has changed since)", a.path.display())
    } else {
        format!(
            "validation fraction {}, {} tokens per shard, text field {:?}",
            was.val_fraction, was.shard_tokens, was.text_field
        )
    };
    Error::Input(format!(
        "{}: holds a tokenize of other settings: {what}; remove the directory or choose another",
        out.display()
    ))
}

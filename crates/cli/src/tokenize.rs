//! `tokenize`: text to token shards, once, for many runs.

use crate::BadInput;
use anyhow::Result;
use clap::Args;
use pipewright_runtime::data::shards::{
    self as shardwriter, read_manifest, Input, Outcome, Settings, MANIFEST,
};
use pipewright_runtime::data::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct TokenizeArgs {
    /// A UTF-8 text file (one document), a JSONL or Parquet file (one document per record),
    /// or a directory of them (in name order).
    #[arg(long)]
    data: PathBuf,
    /// JSONL and Parquet inputs: the field holding each document's text.
    #[arg(long, default_value = "text")]
    text_field: String,
    /// bytes, gpt2, cl100k, or a tokenizer.json (or a directory with one); default: the one
    /// the shards in --out were written with, else bytes (as `train`).
    #[arg(long)]
    tokenizer: Option<String>,
    /// Directory to write the shards into (created if missing): `train_000000.bin`, ... and
    /// `val_000000.bin`, ... in llm.c's format, which `train --data DIR` reads, and a
    /// manifest, tokenize.json. Run the same command again to resume a run that stopped.
    #[arg(long)]
    out: PathBuf,
    /// Fraction held out for validation: the last documents, by input bytes (of one file,
    /// its last tokens).
    #[arg(long, default_value_t = 0.1)]
    val_fraction: f64,
    /// Tokens per training shard.
    #[arg(long, default_value_t = 100_000_000)]
    shard_tokens: usize,
}

/// The input files of `--data`: the file, or a directory's `.txt`, `.jsonl` and `.parquet`
/// files in name order.
fn input_files(data: &Path) -> Result<Vec<PathBuf>> {
    let bad = |m: String| BadInput(format!("--data {}: {m}", data.display()));
    let files: Vec<PathBuf> = if data.is_dir() {
        let mut v: Vec<PathBuf> = std::fs::read_dir(data)
            .map_err(|e| bad(format!("cannot list: {e}")))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.is_file()
                    && p.extension()
                        .is_some_and(|x| x == "txt" || x == "jsonl" || x == "parquet")
            })
            .collect();
        v.sort();
        v
    } else if data.is_file() {
        vec![data.to_path_buf()]
    } else {
        return Err(bad("not a regular file or a directory".into()).into());
    };
    if files.is_empty() {
        return Err(bad("no .txt, .jsonl or .parquet files".into()).into());
    }
    Ok(files)
}

/// Input bytes tokenized in parallel at a time (and between two manifest updates).
const BATCH_BYTES: u64 = 64 << 20;

pub fn cmd_tokenize(a: TokenizeArgs) -> Result<()> {
    if !(0.0..1.0).contains(&a.val_fraction) || a.shard_tokens == 0 {
        return Err(BadInput(format!(
            "--val-fraction {} must be in [0, 1) and --shard-tokens {} positive",
            a.val_fraction, a.shard_tokens
        ))
        .into());
    }
    let spec = match &a.tokenizer {
        Some(t) => t.clone(),
        None => read_manifest(&a.out)
            .ok()
            .flatten()
            .map_or_else(|| "bytes".to_string(), |m| m.settings.tokenizer),
    };
    let tok = Tokenizer::load(&spec)?;
    let inputs = input_files(&a.data)?
        .iter()
        .map(|p| Input::of(p))
        .collect::<Result<Vec<_>, _>>()?;
    if inputs.iter().all(|i| i.bytes == 0) {
        return Err(BadInput(format!("--data {}: no text to tokenize", a.data.display())).into());
    }
    crate::files::output_dir(&a.out)?;
    let _lock = lock(&a.out)?;
    let manifest = read_manifest(&a.out)?;
    if manifest.is_none() && holds_shards(&a.out) {
        return Err(BadInput(format!(
            "--out {}: already holds .bin shards (and no {MANIFEST} to resume); remove them or choose another directory",
            a.out.display()
        ))
        .into());
    }
    let settings = Settings {
        tokenizer: tok.name(),
        inputs,
        text_field: a.text_field.clone(),
        val_fraction: a.val_fraction,
        shard_tokens: a.shard_tokens,
    };
    let was_complete = manifest
        .as_ref()
        .is_some_and(|m| m.complete && m.settings == settings);
    let total = settings.inputs.iter().map(|i| i.bytes).sum();
    let bar = crate::train::progress_bar(total, "bytes tokenized");
    let done = shardwriter::run(
        &settings,
        &tok,
        &a.out,
        BATCH_BYTES,
        &|b| bar.set_position(b),
        None,
    )?;
    bar.finish_and_clear();
    let Outcome::Done {
        manifest: m,
        resumed,
    } = done
    else {
        unreachable!("runs to the end without stop_after")
    };
    report(&a, &tok, &m, &settings, was_complete, resumed)
}

/// The summary line; or, when the documents held no text (only end-of-text markers), the shards
/// removed and an error.
fn report(
    a: &TokenizeArgs,
    tok: &Tokenizer,
    m: &shardwriter::Manifest,
    settings: &Settings,
    was_complete: bool,
    resumed: bool,
) -> Result<()> {
    let (train, val) = (
        m.train.shards.iter().sum::<usize>(),
        m.val.shards.iter().sum::<usize>(),
    );
    if (train + val) as u64 <= m.documents * u64::from(tok.eot().is_some()) {
        for (kind, s) in [("train", &m.train), ("val", &m.val)] {
            for k in 0..s.shards.len() {
                let _ = std::fs::remove_file(a.out.join(format!("{kind}_{k:06}.bin")));
            }
        }
        let _ = std::fs::remove_file(a.out.join(MANIFEST));
        return Err(BadInput(format!("--data {}: no text to tokenize", a.data.display())).into());
    }
    println!(
        "tokenized {} file(s), {} document(s), with {}: {} tokens (train {train}, val {val}) in {} shard(s) in {}{}",
        settings.inputs.len(),
        m.documents,
        tok.name(),
        train + val,
        m.train.shards.len() + m.val.shards.len(),
        a.out.display(),
        match (was_complete, resumed) {
            (true, _) => " (already complete: nothing to do)",
            (false, true) => " (resumed: the earlier run's shards kept)",
            _ => "",
        }
    );
    Ok(())
}

fn holds_shards(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|d| {
        d.flatten()
            .any(|e| e.path().extension().is_some_and(|x| x == "bin"))
    })
}

/// An exclusive lock on `out` while shards are written: a second tokenize into the same
/// directory is refused (the lock goes with the process, even when it is killed).
fn lock(out: &Path) -> Result<std::fs::File> {
    let path = out.join(".tokenize.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| BadInput(format!("{}: cannot open: {e}", path.display())))?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(_) => Err(BadInput(format!(
            "--out {}: another pipewright tokenize is writing there",
            out.display()
        ))
        .into()),
    }
}

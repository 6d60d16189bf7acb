//! `tokenize`: text to token shards, once, for many runs.

use crate::files::check_output;
use crate::BadInput;
use anyhow::Result;
use clap::Args;
use pipewright_runtime::tokenizer::Tokenizer;
use pipewright_runtime::tokens::shard_bytes;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct TokenizeArgs {
    /// A UTF-8 text file, or a directory of `*.txt` files (each a document, in name order).
    #[arg(long)]
    data: PathBuf,
    /// bytes, gpt2, cl100k, or a tokenizer.json (or a directory with one).
    #[arg(long, default_value = "gpt2")]
    tokenizer: String,
    /// Directory to write the shards into (created if missing): `val_000000.bin` and
    /// `train_000000.bin`, ... in llm.c's format, which `train --data DIR` reads.
    #[arg(long)]
    out: PathBuf,
    /// Fraction of the tokens (the last ones) held out for validation.
    #[arg(long, default_value_t = 0.1)]
    val_fraction: f64,
    /// Tokens per training shard.
    #[arg(long, default_value_t = 100_000_000)]
    shard_tokens: usize,
}

/// The text files of `--data`.
fn text_files(data: &Path) -> Result<Vec<PathBuf>> {
    let bad = |m: String| BadInput(format!("--data {}: {m}", data.display()));
    let files: Vec<PathBuf> = if data.is_dir() {
        let mut v: Vec<PathBuf> = std::fs::read_dir(data)
            .map_err(|e| bad(format!("cannot list: {e}")))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "txt"))
            .collect();
        v.sort();
        v
    } else if data.is_file() {
        vec![data.to_path_buf()]
    } else {
        return Err(bad("not a regular file or a directory".into()).into());
    };
    if files.is_empty() {
        return Err(bad("no .txt files".into()).into());
    }
    Ok(files)
}

pub fn cmd_tokenize(a: TokenizeArgs) -> Result<()> {
    if !(0.0..1.0).contains(&a.val_fraction) || a.shard_tokens == 0 {
        return Err(BadInput(format!(
            "--val-fraction {} must be in [0, 1) and --shard-tokens {} positive",
            a.val_fraction, a.shard_tokens
        ))
        .into());
    }
    let tok = Tokenizer::load(&a.tokenizer).map_err(BadInput)?;
    let files = text_files(&a.data)?;
    if a.out.exists() && !a.out.is_dir() {
        crate::files::output_dir(&a.out)?; // names the path that is in the way
    }
    if std::fs::read_dir(&a.out).is_ok_and(|d| {
        d.flatten()
            .any(|e| e.path().extension().is_some_and(|x| x == "bin"))
    }) {
        return Err(BadInput(format!(
            "--out {}: already holds .bin shards; remove them or choose another directory",
            a.out.display()
        ))
        .into());
    }
    let bar = crate::train::progress_bar(files.len() as u64, "files tokenized");
    let ids = tok.encode_files(&files, &|| bar.inc(1)).map_err(BadInput)?;
    bar.finish_and_clear();
    // Only end-of-text markers (one per file) means there was no text.
    if ids.len() <= files.len() * usize::from(tok.eot().is_some()) {
        return Err(BadInput(format!("--data {}: no text to tokenize", a.data.display())).into());
    }
    crate::files::output_dir(&a.out)?;
    let val = (ids.len() as f64 * a.val_fraction) as usize;
    let (train, held) = ids.split_at(ids.len() - val);
    let mut written = Vec::new();
    if !held.is_empty() {
        written.push(write_shard(&a.out, "val_000000.bin", held)?);
    }
    for (i, part) in train.chunks(a.shard_tokens).enumerate() {
        written.push(write_shard(&a.out, &format!("train_{i:06}.bin"), part)?);
    }
    println!(
        "tokenized {} file(s) with {}: {} tokens (train {}, val {}) in {} shard(s) in {}",
        files.len(),
        tok.name(),
        ids.len(),
        train.len(),
        held.len(),
        written.len(),
        a.out.display()
    );
    Ok(())
}

/// One shard, written whole or not at all.
fn write_shard(dir: &Path, name: &str, ids: &[u32]) -> Result<PathBuf> {
    let path = dir.join(name);
    check_output(&path)?;
    let bytes = shard_bytes(ids);
    crate::files::write_with(&path, |w| w.write_all(&bytes))?;
    Ok(path)
}

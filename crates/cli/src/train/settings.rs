//! The `[run]` table of a `train --config` file, and a resume's settings: the runtime's
//! typed [`RunSettings`] (every `train` setting that is not part of the model, batch, optimizer
//! or data), one key per flag, named as the flag (`--eval-every` is `eval_every`). A flag given
//! on the command line wins over its key; `--print-config` writes the table back, every key
//! filled, and checkpoints keep it.

use super::args::TrainArgs;
use crate::BadInput;
use anyhow::Result;
use pipewright_runtime::train::{ElasticBatch, RunSettings};

/// The flags that shape the generated plan: a plan file cannot go with them, and a resume
/// that names them leaves the checkpoint's plan behind.
const SHAPE: [&str; 6] = [
    "schedule",
    "stages",
    "chunks",
    "replicas",
    "microbatches",
    "global_batch",
];

/// Take each of `from`'s `keys` whose flag was not given on the command line.
fn fill(run: &mut RunSettings, from: &RunSettings, keys: &[&str], given: &[String]) {
    let keys: Vec<&str> = keys
        .iter()
        .copied()
        .filter(|k| !given.iter().any(|g| g == k))
        .collect();
    run.take(from, &keys);
}

/// Fill the flags not given on the command line from `--config`'s `[run]` table, then check
/// what clap would have refused as a flag (and the flags' own pairings, now that a key may
/// stand for a flag).
pub fn apply(mut a: TrainArgs) -> Result<TrainArgs> {
    if let Some(f) = a.config.clone() {
        let text = pipewright_core::inputs::read_file(&f)?;
        let name = f.display().to_string();
        // Typed, so that a wrong key or value is named with its line; then which keys it sets.
        let split = pipewright_core::error::parse_toml_split::<toml::Table, RunSettings>;
        if let (_, Some(table)) = split(&name, &text, "run")? {
            let (_, keys) = pipewright_core::error::parse_toml_split::<toml::Table, toml::Table>(
                &name, &text, "run",
            )?;
            let keys: Vec<&str> = keys.iter().flatten().map(|(k, _)| k.as_str()).collect();
            fill(&mut a.run, &table, &keys, &a.given);
        }
    } else if a.run.resume {
        if let Some((kept, keys)) = from_checkpoint(&a) {
            fill(&mut a.run, &kept, &keys, &a.given);
        }
    }
    let bad = |m: &str| Err(BadInput(m.into()).into());
    let given = |flags: &[&'static str]| -> Option<&'static str> {
        flags
            .iter()
            .find(|f| a.given.iter().any(|g| g == *f))
            .copied()
    };
    if let (Some(_), Some(f)) = (&a.run.plan, given(&SHAPE)) {
        return bad(&format!(
            "--{} cannot change a plan file's plan (plan in --config's [run]): drop one",
            f.replace('_', "-")
        ));
    }
    if a.run.skip.is_some() && (a.run.plan.is_some() || given(&["schedule", "chunks"]).is_some()) {
        return bad("skip (--skip) takes its plan from the skip-plan scheduler: drop plan, --schedule and --chunks");
    }
    if a.run.skip.is_some() && a.run.elastic {
        return bad("skip (--skip) and elastic (--elastic) cannot go together");
    }
    a.run.compare_sim |= a.run.compare_svg.is_some();
    let cache = a.run.cache_budget.is_some();
    if !cache && (a.run.cache_f16 || a.run.cache_dir.is_some()) {
        return bad("cache_f16 (--cache-f16) and cache_dir (--cache-dir) need cache_budget (--cache-budget)");
    }
    if a.run.log_every == 0 {
        return bad("log_every (--log-every) must be at least 1");
    }
    // Of two keys that cannot go together, a flag given on the command line wins (clap
    // refuses both as flags); from files alone, they are refused.
    let flag = |f: &str| a.given.iter().any(|g| g == f);
    if a.run.no_checkpoint && a.run.checkpoint_every > 0 {
        match (flag("no_checkpoint"), flag("checkpoint_every")) {
            (true, _) => a.run.checkpoint_every = 0,
            (false, true) => a.run.no_checkpoint = false,
            _ => return bad("no_checkpoint and checkpoint_every cannot go together"),
        }
    }
    if a.run.resume && a.run.overwrite {
        match (flag("resume"), flag("overwrite")) {
            (true, _) => a.run.overwrite = false,
            (false, true) => a.run.resume = false,
            _ => return bad("resume and overwrite cannot go together"),
        }
    }
    if !a.run.elastic && a.run.elastic_batch != ElasticBatch::Keep {
        return bad("elastic_batch (--elastic-batch) needs elastic (--elastic)");
    }
    Ok(a)
}

/// A resume without `--config` continues with the settings the checkpoint's run had (its
/// `[run]` table, as `train` keeps it in checkpoints), less those that name this invocation:
/// resume, overwrite, no_checkpoint and checkpoint_dir, and its plan when flags name another. An unreadable checkpoint is the
/// resume's to report; a table this version does not know is passed over.
fn from_checkpoint(a: &TrainArgs) -> Option<(RunSettings, Vec<&'static str>)> {
    let kept = pipewright_runtime::train::checkpoint_run_settings(&a.checkpoint_dir()).ok()??;
    // A resume may run under another plan: one named by flags replaces the checkpoint's plan
    // file, skip and switches.
    let replanned = a
        .given
        .iter()
        .any(|g| ["plan", "skip"].contains(&g.as_str()) || SHAPE.contains(&g.as_str()));
    let mut leave = vec!["resume", "overwrite", "no_checkpoint", "checkpoint_dir"];
    if replanned {
        leave.extend(["plan", "skip", "switch_plan"]);
    }
    let keys = RunSettings::KEYS
        .iter()
        .copied()
        .filter(|k| !leave.contains(k))
        .collect();
    Some((kept, keys))
}

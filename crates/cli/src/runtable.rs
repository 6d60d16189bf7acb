//! The `[run]` table of a `train --config` file: every `train` setting that is not part of
//! the model, batch, optimizer or data (those are `TrainConfig`'s keys and `[model]`/`[data]`),
//! one key per flag, named as the flag (`--eval-every` is `eval_every`). A flag given on the
//! command line wins over its key; `--print-config` writes the table back, every key filled.

use crate::freeze::ElasticBatch;
use crate::train::{DeviceArg, TrainArgs, TransportKind};
use crate::BadInput;
use anyhow::Result;
use pipewright_core::policy::freeze::FreezeMode;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// A setting as `TrainArgs` holds it: a plain value with a default, or an optional one.
trait Setting {
    type Value: Clone;
    fn put(&mut self, v: Self::Value);
    fn value(&self) -> Option<Self::Value>;
}

impl<T: Clone> Setting for Option<T> {
    type Value = T;
    fn put(&mut self, v: T) {
        *self = Some(v);
    }
    fn value(&self) -> Option<T> {
        self.clone()
    }
}

macro_rules! plain_setting {
    ($($t:ty),*) => {$(
        impl Setting for $t {
            type Value = $t;
            fn put(&mut self, v: $t) {
                *self = v;
            }
            fn value(&self) -> Option<$t> {
                Some(self.clone())
            }
        }
    )*};
}
plain_setting!(
    u64,
    usize,
    f64,
    bool,
    Vec<String>,
    TransportKind,
    DeviceArg,
    FreezeMode,
    ElasticBatch
);

/// Declares the table's keys and where each lives in `TrainArgs` (field path); the key is the
/// last field's name, which is also clap's id for the flag.
macro_rules! run_table {
    ($($key:ident: $t:ty = $($path:ident).+;)*) => {
        /// See the module's doc.
        #[derive(Debug, Default, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct RunTable {
            $(
                #[serde(default, skip_serializing_if = "Option::is_none")]
                $key: Option<$t>,
            )*
        }

        impl RunTable {
            /// Set each flag that was not given on the command line from its key.
            fn fill(self, a: &mut TrainArgs) {
                $(
                    if let Some(v) = self.$key {
                        if !a.given.iter().any(|g| g == stringify!($key)) {
                            a.$($path).+.put(v);
                        }
                    }
                )*
            }

            /// The run's settings as resolved: every key that has a value.
            pub fn of(a: &TrainArgs) -> Self {
                RunTable { $($key: a.$($path).+.value(),)* }
            }
        }
    };
}

run_table! {
    plan: PathBuf = plan;
    skip: f64 = skip;
    cluster: PathBuf = cluster;
    switch_plan: Vec<String> = switch_plan;
    transport: TransportKind = transport;
    device: DeviceArg = device;
    gpus_per_node: usize = gpus_per_node;
    peer_timeout: f64 = peer_timeout;
    startup_timeout: f64 = startup_timeout;
    global_batch: usize = global_batch;
    eval_every: u64 = eval_every;
    eval_batches: usize = eval_batches;
    checkpoint_dir: PathBuf = checkpoint_dir;
    checkpoint_every: u64 = checkpoint_every;
    no_checkpoint: bool = no_checkpoint;
    keep: usize = keep;
    resume: bool = resume;
    overwrite: bool = overwrite;
    metrics: PathBuf = metrics;
    tensorboard: PathBuf = tensorboard;
    log_every: u64 = log_every;
    trace: PathBuf = trace;
    svg: PathBuf = svg;
    compare_sim: bool = compare_sim;
    compare_svg: PathBuf = compare_svg;
    freeze: FreezeMode = freeze.freeze;
    freeze_every: u64 = freeze.freeze_every;
    freeze_alpha: f64 = freeze.freeze_alpha;
    freeze_threshold: f64 = freeze.freeze_threshold;
    freeze_percentile: f64 = freeze.freeze_percentile;
    freeze_window: usize = freeze.freeze_window;
    max_frozen: f64 = freeze.max_frozen;
    elastic: bool = freeze.elastic;
    elastic_batch: ElasticBatch = freeze.elastic_batch;
    cache_budget: u64 = freeze.cache_budget;
    cache_f16: bool = freeze.cache_f16;
    cache_dir: PathBuf = freeze.cache_dir;
}

/// Fill the flags not given on the command line from `--config`'s `[run]` table, then check
/// what clap would have refused as a flag (and the flags' own pairings, now that a key may
/// stand for a flag).
pub fn apply(mut a: TrainArgs) -> Result<TrainArgs> {
    if let Some(f) = a.config.clone() {
        let text = pipewright_core::inputs::read_file(&f)?;
        let name = f.display().to_string();
        let (_, table) =
            pipewright_core::error::parse_toml_split::<toml::Table, RunTable>(&name, &text, "run")?;
        if let Some(t) = table {
            t.fill(&mut a);
        }
    } else if a.resume {
        if let Some(t) = from_checkpoint(&a) {
            t.fill(&mut a);
        }
    }
    let bad = |m: &str| Err(BadInput(m.into()).into());
    let given = |flags: &[&'static str]| -> Option<&'static str> {
        flags
            .iter()
            .find(|f| a.given.iter().any(|g| g == *f))
            .copied()
    };
    let shape = [
        "schedule",
        "stages",
        "chunks",
        "replicas",
        "microbatches",
        "global_batch",
    ];
    if let (Some(_), Some(f)) = (&a.plan, given(&shape)) {
        return bad(&format!(
            "--{} cannot change a plan file's plan (plan in --config's [run]): drop one",
            f.replace('_', "-")
        ));
    }
    if a.skip.is_some() && (a.plan.is_some() || given(&["schedule", "chunks"]).is_some()) {
        return bad("skip (--skip) takes its plan from the skip-plan scheduler: drop plan, --schedule and --chunks");
    }
    if a.skip.is_some() && a.freeze.elastic {
        return bad("skip (--skip) and elastic (--elastic) cannot go together");
    }
    a.compare_sim |= a.compare_svg.is_some();
    let cache = a.freeze.cache_budget.is_some();
    if !cache && (a.freeze.cache_f16 || a.freeze.cache_dir.is_some()) {
        return bad("cache_f16 (--cache-f16) and cache_dir (--cache-dir) need cache_budget (--cache-budget)");
    }
    if a.log_every == 0 {
        return bad("log_every (--log-every) must be at least 1");
    }
    // Of two keys that cannot go together, a flag given on the command line wins (clap
    // refuses both as flags); from files alone, they are refused.
    let flag = |f: &str| a.given.iter().any(|g| g == f);
    if a.no_checkpoint && a.checkpoint_every > 0 {
        match (flag("no_checkpoint"), flag("checkpoint_every")) {
            (true, _) => a.checkpoint_every = 0,
            (false, true) => a.no_checkpoint = false,
            _ => return bad("no_checkpoint and checkpoint_every cannot go together"),
        }
    }
    if a.resume && a.overwrite {
        match (flag("resume"), flag("overwrite")) {
            (true, _) => a.overwrite = false,
            (false, true) => a.resume = false,
            _ => return bad("resume and overwrite cannot go together"),
        }
    }
    if !a.freeze.elastic && a.freeze.elastic_batch != ElasticBatch::Keep {
        return bad("elastic_batch (--elastic-batch) needs elastic (--elastic)");
    }
    Ok(a)
}

/// A resume without `--config` continues with the settings the checkpoint's run had (its
/// `[run]` table, as `train` keeps it in checkpoints), less those that name this invocation:
/// resume, overwrite, no_checkpoint and checkpoint_dir, and its plan when flags name another. An unreadable checkpoint is the
/// resume's to report; a table this version does not know is passed over.
fn from_checkpoint(a: &TrainArgs) -> Option<RunTable> {
    let v = pipewright_runtime::train::checkpoint_run_settings(&a.checkpoint_dir()).ok()??;
    let mut t: RunTable = serde_json::from_value(v).ok()?;
    (t.resume, t.overwrite, t.no_checkpoint, t.checkpoint_dir) = (None, None, None, None);
    // A resume may run under another plan: one named by flags replaces the checkpoint's plan
    // file, skip and switches.
    let shape = [
        "plan",
        "skip",
        "schedule",
        "stages",
        "chunks",
        "replicas",
        "microbatches",
        "global_batch",
    ];
    if a.given.iter().any(|g| shape.contains(&g.as_str())) {
        (t.plan, t.skip, t.switch_plan) = (None, None, None);
    }
    Some(t)
}

//! The run's own settings, besides the model, batch and optimizer ([`super::TrainConfig`]):
//! the plan's source, transport and device, evaluation, checkpoints, metrics, freezing and
//! caching. One typed record: the command line's flags (with the `clap` feature), the `[run]`
//! table of a configuration file, what `--print-config` prints and what a checkpoint keeps for
//! its resume.

use pipewright_core::policy::freeze::{FreezeMode, FreezePolicy};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// How the plan's workers run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// Processes when the plan has several workers and MPI can start them (pipewright runs
    /// itself under `mpirun`, or joins the job a launcher started); threads otherwise.
    Auto,
    /// One process, a thread per worker (and emulated links).
    Threads,
    /// One process per worker, started by `mpirun -np WORKERS` or `srun`: rank r runs worker r.
    Mpi,
}

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// The CPU, with pipewright's fused kernels (BLAS products, causal attention, norms).
    Cpu,
    /// A GPU through burn's wgpu backend (Vulkan; Mesa's lavapipe runs it on the CPU):
    /// burn's own operations.
    Wgpu,
}

/// What an elastic re-plan does with the global batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum ElasticBatch {
    Keep,
    Scale,
}

/// A validation metric, and which way is better.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum Metric {
    /// The held-out loss: lower is better.
    ValLoss,
    /// A task's held-out accuracy (QA: exact match): higher is better.
    Accuracy,
    /// A task's held-out F1: higher is better.
    F1,
}

impl Metric {
    /// As the metrics rows and the flag name it.
    pub fn name(self) -> &'static str {
        match self {
            Metric::ValLoss => "val-loss",
            Metric::Accuracy => "accuracy",
            Metric::F1 => "f1",
        }
    }

    /// Is `new` strictly better than `old`?
    pub fn better(self, new: f64, old: f64) -> bool {
        match self {
            Metric::ValLoss => new < old,
            Metric::Accuracy | Metric::F1 => new > old,
        }
    }
}

/// Declares [`RunSettings`] once, and from the same field list what a merge needs: every key,
/// and taking the named keys' values from another record.
macro_rules! run_settings {
    ($(#[$m:meta])* pub struct $name:ident { $($(#[$fm:meta])* pub $f:ident: $t:ty,)* }) => {
        $(#[$m])*
        pub struct $name { $($(#[$fm])* pub $f: $t,)* }

        impl $name {
            /// Every key, in order (a key is its field's, and its flag's, name).
            pub const KEYS: &[&str] = &[$(stringify!($f)),*];

            /// Take the value of each key in `keys` from `from` (a configuration's table, a
            /// resumed checkpoint's record), leaving the others as they are.
            pub fn take(&mut self, from: &$name, keys: &[&str]) {
                $(if keys.contains(&stringify!($f)) {
                    self.$f = from.$f.clone();
                })*
            }
        }
    };
}

run_settings! {
/// See the module's doc. Each field is named as its flag (`--eval-every` is `eval_every`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
#[serde(deny_unknown_fields, default)]
pub struct RunSettings {
    /// Whole-job plan file (from `plan --out`, `schedule --format json`, or by hand).
    #[cfg_attr(feature = "clap", arg(long, conflicts_with_all = ["schedule", "stages", "chunks", "replicas", "microbatches"]))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<PathBuf>,
    /// SkipPipe: each micro-batch skips this many of the --stages model stages (a count, or
    /// a fraction below 1: 0.25 of 4 = 1). The plan comes from the skip-plan scheduler:
    /// --replicas data nodes (embedding and head), the other devices of --cluster (default
    /// stages x replicas identical ones) as pools for the other stages, --microbatches per
    /// data node. --skip 0 gives the full pipeline on the same layout.
    #[cfg_attr(feature = "clap", arg(long, conflicts_with_all = ["plan", "schedule", "chunks", "elastic"]))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skip: Option<f64>,
    /// Emulate this cluster's links between workers (each worker on the plan's device for it).
    #[cfg_attr(feature = "clap", arg(long))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<PathBuf>,
    /// Switch to another whole-job plan after step STEP (STEP:FILE; repeatable): parameters
    /// and optimizer state move in memory to the new plan's workers.
    #[cfg_attr(feature = "clap", arg(long, value_name = "STEP:FILE"))]
    pub switch_plan: Vec<String>,
    /// How the workers run: `auto` starts one process per worker under `mpirun` (faster:
    /// threads share one autodiff lock), `threads` keeps them in this process, `mpi` joins a job
    /// launched with `mpirun -np WORKERS` or `srun`.
    #[cfg_attr(feature = "clap", arg(long, value_enum, default_value_t = RunSettings::default().transport))]
    pub transport: TransportKind,
    /// Where each worker runs the model: the CPU, or a GPU through wgpu (every worker process
    /// or thread on wgpu's default device unless --gpus-per-node spreads the processes).
    #[cfg_attr(feature = "clap", arg(long, value_enum, default_value_t = RunSettings::default().device))]
    pub device: DeviceKind,
    /// With --device wgpu and worker processes: the GPUs of each node; the rank with local
    /// rank r (Open MPI's, MPICH's or Slurm's count on its node) uses discrete GPU r mod N.
    /// Without it every process uses wgpu's default device (`CUBECL_WGPU_DEFAULT_DEVICE`
    /// chooses another).
    #[cfg_attr(feature = "clap", arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..4096)))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpus_per_node: Option<usize>,
    /// Seconds a worker waits for a peer's message before it gives up and names the peer.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunSettings::default().peer_timeout))]
    pub peer_timeout: f64,
    /// Seconds a worker waits for a peer during a first step (of the run, or after a plan
    /// switch), which compiles kernels, autotunes and faults memory in: on a GPU, or beside a
    /// busy CPU, far longer than a later step.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunSettings::default().startup_timeout))]
    pub startup_timeout: f64,
    /// Micro-batches per step over all replicas (the global batch, in micro-batches of
    /// --micro-batch-size sequences): sets --microbatches to this over --replicas.
    #[cfg_attr(feature = "clap", arg(long, conflicts_with_all = ["microbatches", "plan"]))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub global_batch: Option<usize>,
    /// Validate every N steps (and before the first and after the last).
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunSettings::default().eval_every))]
    pub eval_every: u64,
    /// Held-out micro-batches of a text per validation (a task scores every held-out
    /// example).
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunSettings::default().eval_batches))]
    pub eval_batches: usize,
    /// Keep the checkpoint of the best validation by this metric (val-loss: lowest; accuracy,
    /// f1: highest) in CHECKPOINT_DIR/best, beside the last.
    #[cfg_attr(feature = "clap", arg(long, value_enum))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keep_best: Option<Metric>,
    /// Stop after N validations in a row that do not improve on the best (by --keep-best's
    /// metric, else the validation loss); the last checkpoint is written as usual.
    #[cfg_attr(feature = "clap", arg(long, value_parser = clap::value_parser!(u64).range(1..)))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub early_stop: Option<u64>,
    /// Directory for checkpoints [default: checkpoints]. A directory given here that holds
    /// an earlier run's checkpoints is refused without --resume or --overwrite; the default
    /// one is a scratch place: a fresh run replaces what an earlier run left there, and says so.
    #[cfg_attr(feature = "clap", arg(long))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Write a checkpoint every N steps (0: only at the end).
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunSettings::default().checkpoint_every))]
    pub checkpoint_every: u64,
    /// Do not write checkpoints.
    #[cfg_attr(feature = "clap", arg(long, conflicts_with = "checkpoint_every"))]
    pub no_checkpoint: bool,
    /// Checkpoints to keep in --checkpoint-dir (the newest).
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunSettings::default().keep))]
    pub keep: usize,
    /// Continue from the latest checkpoint in --checkpoint-dir (under this run's plan, which
    /// may differ from the one that wrote it).
    #[cfg_attr(feature = "clap", arg(long))]
    pub resume: bool,
    /// Start afresh in a --checkpoint-dir that holds an earlier run's checkpoints: they are
    /// removed first (without this or --resume, such a directory is refused).
    #[cfg_attr(feature = "clap", arg(long, conflicts_with = "resume"))]
    pub overwrite: bool,
    /// Write metrics as JSON lines.
    #[cfg_attr(feature = "clap", arg(long))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Option<PathBuf>,
    /// Also write the metrics as TensorBoard event files into this directory (`tensorboard
    /// --logdir DIR` shows them).
    #[cfg_attr(feature = "clap", arg(long))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensorboard: Option<PathBuf>,
    /// Without a terminal (nohup, Slurm, CI), a timestamped log line every N steps (and the
    /// last); on a terminal the progress bar shows the same.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunSettings::default().log_every, value_parser = clap::value_parser!(u64).range(1..)))]
    pub log_every: u64,
    /// Write the last step's measured timeline as a Chrome trace (the whole run's with
    /// --elastic).
    #[cfg_attr(feature = "clap", arg(long))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<PathBuf>,
    /// Write the same measured timeline as an SVG Gantt chart.
    #[cfg_attr(feature = "clap", arg(long))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub svg: Option<PathBuf>,
    /// After training, profile the model and print simulated vs measured iteration time of the
    /// same plan (needs at least 3 steps in this run).
    #[cfg_attr(feature = "clap", arg(long))]
    pub compare_sim: bool,
    /// With the comparison (implies --compare-sim), draw the simulated iteration above the
    /// last measured step on one time scale, as an SVG.
    #[cfg_attr(feature = "clap", arg(long, value_name = "SVG"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compare_svg: Option<PathBuf>,
    /// Freeze converged layer blocks: `adaptive` (a front prefix whose gradient norms
    /// settled), `schedule` (the released rule, L (1 - (1 - alpha)^e) after decision e),
    /// `critical` (the settled blocks whose freezing shortens the simulated iteration: a prefix
    /// whole, others by their weight gradients only) or `off`.
    #[cfg_attr(feature = "clap", arg(long, value_enum, default_value_t = RunSettings::default().freeze))]
    pub freeze: FreezeMode,
    /// Steps between freeze decisions (default: a tenth of an epoch, at least 10 steps).
    #[cfg_attr(feature = "clap", arg(long))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub freeze_every: Option<u64>,
    /// Fraction of the still-training prefix that may freeze at one decision (adaptive), or
    /// the schedule's rate.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunSettings::default().freeze_alpha))]
    pub freeze_alpha: f64,
    /// Relative change of a layer's gradient norm below which it has settled (adaptive).
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunSettings::default().freeze_threshold))]
    pub freeze_threshold: f64,
    /// Or below this percentile of the changes of all layers still training (adaptive; 0:
    /// the threshold only). 50, the median, is the released code's rule.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunSettings::default().freeze_percentile))]
    pub freeze_percentile: f64,
    /// Decisions over which a layer must stay settled (adaptive).
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunSettings::default().freeze_window))]
    pub freeze_window: usize,
    /// Most of the freezable layer blocks (all but the head) that may ever freeze.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunSettings::default().max_frozen))]
    pub max_frozen: f64,
    /// Fraction of the run's steps before which nothing freezes (adaptive, critical; the
    /// gradient norms are still recorded).
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunSettings::default().freeze_start))]
    pub freeze_start: f64,
    /// On each freeze change, re-cut the training layers over the fastest depth that fits
    /// each worker's memory (as the starting plan uses it) and turn freed workers into more
    /// data-parallel replicas, at the same global batch.
    #[cfg_attr(feature = "clap", arg(long))]
    pub elastic: bool,
    /// With --elastic: `keep` the global batch (more replicas, fewer micro-batches each) or
    /// `scale` it (every replica keeps its micro-batches; the learning rate grows with the
    /// batch, the linear scaling rule).
    #[cfg_attr(feature = "clap", arg(long, value_enum, default_value_t = RunSettings::default().elastic_batch, requires = "elastic"))]
    pub elastic_batch: ElasticBatch,
    /// AutoCache: keep the frozen prefix's output for each training sample, up to this many
    /// bytes in memory (suffixes K, M, G: powers of 1024), the rest in a spill file; later
    /// epochs skip the frozen layers. Implies --sampling epochs.
    #[cfg_attr(feature = "clap", arg(long, value_name = "BYTES", value_parser = parse_bytes))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_budget: Option<u64>,
    /// Keep cached activations as f16 (half the bytes; the frozen output is rounded).
    #[cfg_attr(feature = "clap", arg(long, requires = "cache_budget"))]
    pub cache_f16: bool,
    /// Directory for the cache's spill file (deleted when the run ends; default: the system's
    /// temporary directory).
    #[cfg_attr(feature = "clap", arg(long, requires = "cache_budget"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
}
}

impl Default for RunSettings {
    fn default() -> Self {
        RunSettings {
            plan: Default::default(),
            skip: Default::default(),
            cluster: Default::default(),
            switch_plan: Default::default(),
            transport: TransportKind::Auto,
            device: DeviceKind::Cpu,
            gpus_per_node: Default::default(),
            peer_timeout: 60.0,
            startup_timeout: 600.0,
            global_batch: Default::default(),
            eval_every: 10,
            eval_batches: 8,
            keep_best: Default::default(),
            early_stop: Default::default(),
            checkpoint_dir: Default::default(),
            checkpoint_every: 0,
            no_checkpoint: Default::default(),
            keep: 3,
            resume: Default::default(),
            overwrite: Default::default(),
            metrics: Default::default(),
            tensorboard: Default::default(),
            log_every: 10,
            trace: Default::default(),
            svg: Default::default(),
            compare_sim: Default::default(),
            compare_svg: Default::default(),
            freeze: FreezeMode::Off,
            freeze_every: Default::default(),
            freeze_alpha: 0.3,
            freeze_threshold: 0.1,
            freeze_percentile: 50.0,
            freeze_window: 2,
            max_frozen: 0.8,
            freeze_start: FreezePolicy::default().start,
            elastic: Default::default(),
            elastic_batch: ElasticBatch::Keep,
            cache_budget: Default::default(),
            cache_f16: Default::default(),
            cache_dir: Default::default(),
        }
    }
}

/// `123`, `64K`, `512M`, `2G` (powers of 1024): the command line's byte counts.
#[cfg(feature = "clap")]
fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                _ => return Err(format!("{s:?}: expected bytes, e.g. 1000000, 512M or 2G")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| {
            format!("{s:?}: expected bytes, e.g. 1000000, 512M or 2G (at most 2^64 - 1)")
        })
}

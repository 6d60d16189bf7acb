//! `train`'s flags: what a run is asked for, before any file is read.

use clap::Args;
use pipewright_core::schedule::ScheduleKind;
use pipewright_runtime::train::TrainConfig;
use std::path::PathBuf;

/// How the plan's workers run.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// Processes when the plan has several workers and MPI can start them (pipewright runs
    /// itself under `mpirun`, or joins the job a launcher started); threads otherwise.
    Auto,
    /// One process, a thread per worker (and `--cluster`'s emulated links).
    Threads,
    /// One process per worker, started by `mpirun -np WORKERS` or `srun`: rank r runs worker r.
    Mpi,
}

/// Where `train` runs the model (`--device`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum DeviceArg {
    /// The CPU, with pipewright's fused kernels (BLAS products, causal attention, norms).
    Cpu,
    /// A GPU through burn's wgpu backend (Vulkan; Mesa's lavapipe runs it on the CPU):
    /// burn's own operations.
    Wgpu,
}

/// A flag's help with its default, read from [`TrainConfig::default`] (the one place that
/// decides it; a `--config` file's value stands where the flag is not given).
fn dflt<T: std::fmt::Display>(what: &str, field: impl Fn(&TrainConfig) -> T) -> String {
    format!("{what} [default: {}]", field(&TrainConfig::default()))
}

impl TrainArgs {
    /// `--checkpoint-dir`, or the default one (the one place that names it).
    pub(crate) fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("checkpoints"))
    }
}

#[derive(Args)]
pub struct TrainArgs {
    /// TOML with any TrainConfig fields (model, schedule, stages, ...); flags override it.
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// Print the resolved settings (the config file with the flags over it, every default
    /// filled in) as TOML that `--config` takes back, and exit.
    #[arg(long)]
    pub(crate) print_config: bool,
    /// Whole-job plan file (from `plan --out`, `schedule --format json`, or by hand).
    #[arg(long, conflicts_with_all = ["schedule", "stages", "chunks", "replicas", "microbatches"])]
    pub(crate) plan: Option<PathBuf>,
    #[arg(long, value_enum, help = dflt("Pipeline schedule of the generated plan", |c| c.schedule))]
    pub(crate) schedule: Option<ScheduleKind>,
    #[arg(long, help = dflt("Pipeline depth P of the generated plan (workers per pipeline)", |c| c.stages))]
    pub(crate) stages: Option<usize>,
    #[arg(long, help = dflt("Stage chunks per worker (interleaved; zbv uses 2)", |c| c.chunks))]
    pub(crate) chunks: Option<usize>,
    #[arg(long, help = dflt("Data-parallel replicas D of the generated plan", |c| c.replicas))]
    pub(crate) replicas: Option<usize>,
    #[arg(long, help = dflt("Micro-batches M of each replica per step (the global batch is M x D micro-batches)", |c| c.microbatches))]
    pub(crate) microbatches: Option<usize>,
    /// Micro-batches per step over all replicas (the global batch, in micro-batches of
    /// --micro-batch-size sequences): sets --microbatches to this over --replicas.
    #[arg(long, conflicts_with_all = ["microbatches", "plan"])]
    pub(crate) global_batch: Option<usize>,
    #[arg(long, visible_alias = "micro-batch-size", help = dflt("Sequences per micro-batch", |c| c.rows))]
    pub(crate) rows: Option<usize>,
    #[arg(long, help = dflt("Optimizer steps (in all, counting those before a --resume)", |c| c.steps))]
    pub(crate) steps: Option<u64>,
    #[arg(long, help = dflt("Peak learning rate (linear warmup, then cosine down to --min-lr)", |c| c.lr))]
    pub(crate) lr: Option<f64>,
    #[arg(long, help = dflt("Learning rate at the last step", |c| c.min_lr))]
    pub(crate) min_lr: Option<f64>,
    #[arg(long, help = dflt("Warmup steps", |c| c.warmup))]
    pub(crate) warmup: Option<u64>,
    #[arg(long, help = dflt("AdamW weight decay", |c| c.weight_decay))]
    pub(crate) weight_decay: Option<f32>,
    #[arg(long, help = dflt("Global gradient-norm clip", |c| c.clip))]
    pub(crate) clip: Option<f32>,
    #[arg(long, help = dflt("Seed of the weights and the data order", |c| c.seed))]
    pub(crate) seed: Option<u64>,
    #[command(flatten)]
    pub(crate) data: crate::data::DataArgs,
    /// Write metrics as JSON lines.
    #[arg(long)]
    pub(crate) metrics: Option<PathBuf>,
    /// Also write the metrics as TensorBoard event files into this directory (`tensorboard
    /// --logdir DIR` shows them).
    #[arg(long)]
    pub(crate) tensorboard: Option<PathBuf>,
    /// Validate every N steps (and before the first and after the last).
    #[arg(long, default_value_t = 10)]
    pub(crate) eval_every: u64,
    /// Held-out micro-batches of a text per validation (a task scores every held-out
    /// example).
    #[arg(long, default_value_t = 8)]
    pub(crate) eval_batches: usize,
    /// Directory for checkpoints [default: checkpoints]. A directory given here that holds
    /// an earlier run's checkpoints is refused without --resume or --overwrite; the default
    /// one is a scratch place: a fresh run replaces what an earlier run left there, and says so.
    #[arg(long)]
    pub(crate) checkpoint_dir: Option<PathBuf>,
    /// Write a checkpoint every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    pub(crate) checkpoint_every: u64,
    /// Do not write checkpoints.
    #[arg(long, conflicts_with = "checkpoint_every")]
    pub(crate) no_checkpoint: bool,
    /// Checkpoints to keep in --checkpoint-dir (the newest).
    #[arg(long, default_value_t = 3)]
    pub(crate) keep: usize,
    /// Continue from the latest checkpoint in --checkpoint-dir (under this run's plan, which
    /// may differ from the one that wrote it).
    #[arg(long)]
    pub(crate) resume: bool,
    /// Start afresh in a --checkpoint-dir that holds an earlier run's checkpoints: they are
    /// removed first (without this or --resume, such a directory is refused).
    #[arg(long, conflicts_with = "resume")]
    pub(crate) overwrite: bool,
    /// Write the last step's measured timeline as a Chrome trace (the whole run's with
    /// --elastic).
    #[arg(long)]
    pub(crate) trace: Option<PathBuf>,
    /// Write the same measured timeline as an SVG Gantt chart.
    #[arg(long)]
    pub(crate) svg: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) model: crate::model::ModelArgs,
    /// How text becomes tokens: bytes (default), gpt2, cl100k, or a tokenizer.json (or a
    /// directory with one); default with --model DIR: its tokenizer.json if it has one.
    #[arg(long)]
    pub(crate) tokenizer: Option<String>,
    #[arg(long, help = dflt("Model width", |c| c.model.d_model))]
    pub(crate) d_model: Option<usize>,
    #[arg(long, help = dflt("Transformer blocks (the model has these plus the embedding and the head as layer blocks)", |c| c.model.layers))]
    pub(crate) layers: Option<usize>,
    #[arg(long, help = dflt("Attention heads", |c| c.model.heads))]
    pub(crate) heads: Option<usize>,
    #[arg(long, help = dflt("Sequence length", |c| c.model.seq_len))]
    pub(crate) seq_len: Option<usize>,
    /// Emulate this cluster's links between workers (each worker on the plan's device for it).
    #[arg(long)]
    pub(crate) cluster: Option<PathBuf>,
    /// SkipPipe: each micro-batch skips this many of the --stages model stages (a count, or
    /// a fraction below 1: 0.25 of 4 = 1). The plan comes from the skip-plan scheduler:
    /// --replicas data nodes (embedding and head), the other devices of --cluster (default
    /// stages x replicas identical ones) as pools for the other stages, --microbatches per
    /// data node. --skip 0 gives the full pipeline on the same layout.
    #[arg(long, conflicts_with_all = ["plan", "schedule", "chunks", "elastic"])]
    pub(crate) skip: Option<f64>,
    /// Switch to another whole-job plan after step STEP (STEP:FILE; repeatable): parameters
    /// and optimizer state move in memory to the new plan's workers.
    #[arg(long, value_name = "STEP:FILE")]
    pub(crate) switch_plan: Vec<String>,
    /// After training, profile the model and print simulated vs measured iteration time of the
    /// same plan (needs at least 3 steps in this run).
    #[arg(long)]
    pub(crate) compare_sim: bool,
    /// With the comparison (implies --compare-sim), draw the simulated iteration above the
    /// last measured step on one time scale, as an SVG.
    #[arg(long, value_name = "SVG")]
    pub(crate) compare_svg: Option<PathBuf>,
    /// How the workers run: `auto` starts one process per worker under `mpirun` (faster:
    /// threads share one autodiff lock), `threads` keeps them in this process, `mpi` joins a job
    /// launched with `mpirun -np WORKERS` or `srun`.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) transport: TransportKind,
    /// Where each worker runs the model: the CPU, or a GPU through wgpu (every worker process
    /// or thread on wgpu's default device unless --gpus-per-node spreads the processes).
    #[arg(long, value_enum, default_value = "cpu")]
    pub(crate) device: DeviceArg,
    /// With --device wgpu and worker processes: the GPUs of each node; the rank with local
    /// rank r (Open MPI's, MPICH's or Slurm's count on its node) uses discrete GPU r mod N.
    /// Without it every process uses wgpu's default device (`CUBECL_WGPU_DEFAULT_DEVICE`
    /// chooses another).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..4096))]
    pub(crate) gpus_per_node: Option<usize>,
    /// Seconds a worker waits for a peer's message before it gives up and names the peer.
    #[arg(long, default_value_t = 60.0)]
    pub(crate) peer_timeout: f64,
    /// Seconds a worker waits for a peer during a first step (of the run, or after a plan
    /// switch), which compiles kernels, autotunes and faults memory in: on a GPU, or beside a
    /// busy CPU, far longer than a later step.
    #[arg(long, default_value_t = 600.0)]
    pub(crate) startup_timeout: f64,
    /// Without a terminal (nohup, Slurm, CI), a timestamped log line every N steps (and the
    /// last); on a terminal the progress bar shows the same.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) log_every: u64,
    /// How steps draw sequences: random windows of the text, or epochs over fixed samples
    /// (each sample once an epoch; what --cache-budget keys on).
    #[arg(long, value_enum)]
    pub(crate) sampling: Option<SamplingArg>,
    #[command(flatten)]
    pub(crate) freeze: crate::freeze::FreezeArgs,
    /// The flags given on the command line (clap's ids): `--config`'s `[run]` keys fill the
    /// others.
    #[arg(skip)]
    pub(crate) given: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum SamplingArg {
    Windows,
    Epochs,
}

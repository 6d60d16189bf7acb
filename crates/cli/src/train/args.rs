//! `train`'s flags: what a run is asked for, before any file is read.

use clap::Args;
use pipewright_core::schedule::ScheduleKind;
use pipewright_runtime::train::RunSettings;
use pipewright_runtime::train::TrainConfig;
use std::path::PathBuf;

/// A flag's help with its default, read from [`TrainConfig::default`] (the one place that
/// decides it; a `--config` file's value stands where the flag is not given).
fn dflt<T: std::fmt::Display>(what: &str, field: impl Fn(&TrainConfig) -> T) -> String {
    format!("{what} [default: {}]", field(&TrainConfig::default()))
}

impl TrainArgs {
    /// `--checkpoint-dir`, or the default one (the one place that names it).
    pub(crate) fn checkpoint_dir(&self) -> PathBuf {
        self.run
            .checkpoint_dir
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
    #[arg(long, value_enum, help = dflt("Pipeline schedule of the generated plan", |c| c.schedule))]
    pub(crate) schedule: Option<ScheduleKind>,
    #[arg(long, help = dflt("Pipeline depth P of the generated plan (workers per pipeline)", |c| c.stages))]
    pub(crate) stages: Option<usize>,
    /// Stage chunks per worker (default: the schedule's: 2 for interleaved and zbv, else 1).
    #[arg(long)]
    pub(crate) chunks: Option<usize>,
    #[arg(long, help = dflt("Data-parallel replicas D of the generated plan", |c| c.replicas))]
    pub(crate) replicas: Option<usize>,
    #[arg(long, help = dflt("Micro-batches M of each replica per step (the global batch is M x D micro-batches)", |c| c.microbatches))]
    pub(crate) microbatches: Option<usize>,
    #[arg(long, visible_alias = "micro-batch-size", help = dflt("Sequences per micro-batch", |c| c.rows))]
    pub(crate) rows: Option<usize>,
    #[arg(long, help = dflt("Optimizer steps (in all, counting those before a --resume)", |c| c.steps))]
    pub(crate) steps: Option<u64>,
    /// Train for N epochs of the training data (the steps follow from the data, the
    /// micro-batches and the rows; the header says how many).
    #[arg(long, conflicts_with = "steps", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) epochs: Option<u64>,
    #[arg(long, help = dflt("Peak learning rate (linear warmup, then down to --min-lr along --lr-schedule)", |c| c.lr))]
    pub(crate) lr: Option<f64>,
    #[arg(long, value_enum, help = dflt("How the learning rate falls after the warmup", |c| format!("{:?}", c.lr_schedule).to_lowercase()))]
    pub(crate) lr_schedule: Option<pipewright_runtime::train::LrSchedule>,
    #[arg(long, help = dflt("Learning rate at the last step (a --lr below it alone: a tenth of that)", |c| c.min_lr))]
    pub(crate) min_lr: Option<f64>,
    #[arg(long, help = dflt("Warmup steps", |c| c.warmup))]
    pub(crate) warmup: Option<u64>,
    /// Warmup as a fraction of the steps, in [0, 1) (Hugging Face's warmup_ratio).
    #[arg(long, conflicts_with = "warmup")]
    pub(crate) warmup_ratio: Option<f64>,
    #[arg(long, help = dflt("AdamW weight decay", |c| c.weight_decay))]
    pub(crate) weight_decay: Option<f32>,
    #[arg(long, help = dflt("Global gradient-norm clip", |c| c.clip))]
    pub(crate) clip: Option<f32>,
    #[arg(long, help = dflt("Seed of the weights and the data order", |c| c.seed))]
    pub(crate) seed: Option<u64>,
    #[command(flatten)]
    pub(crate) data: crate::data::DataArgs,
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
    /// How steps draw sequences: random windows of the text, or epochs over fixed samples
    /// (each sample once an epoch; what --cache-budget keys on).
    #[arg(long, value_enum)]
    pub(crate) sampling: Option<SamplingArg>,
    /// Group a task's examples by length within an epoch (fixed by --seed), so that each
    /// micro-batch, padded to its longest row, holds little padding.
    #[arg(long)]
    pub(crate) bucket: bool,
    #[command(flatten)]
    pub(crate) run: RunSettings,
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

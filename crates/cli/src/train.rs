//! `train` and `profile`: run a plan on the real model, and measure the model's layers.

use crate::files::{check_output, load_valid_plan, write_file, write_with};
use crate::BadInput;
use anyhow::Result;
use clap::Args;
use pipewright_core::cluster::Cluster;
use pipewright_core::job::{JobSpec, Routes, SkipRoutes};
use pipewright_core::plan::ir::Plan;
use pipewright_core::schedule::ScheduleKind;
use pipewright_core::sim::devices_for_plan;
use pipewright_runtime::data::Sampling;
use pipewright_runtime::model::ModelConfig;
use pipewright_runtime::train::run::SimComparison;
use pipewright_runtime::train::{
    Checkpointing, RunConfig, RunSink, RunStart, RunSummary, StepRow, TrainConfig, Trainer,
    TrainingRun,
};
use std::path::{Path, PathBuf};
#[cfg(feature = "mpi")]
use std::sync::Arc;
use std::time::Duration;

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

/// This process's device: with `--gpus-per-node N`, the launcher's local rank r (Open MPI's,
/// MPICH's or Slurm's; 0 outside a launcher) takes discrete GPU r mod N, as torchrun gives
/// local rank r `cuda:r`.
fn device_choice(a: &TrainArgs) -> Result<pipewright_runtime::backend::DeviceChoice> {
    use pipewright_runtime::backend::DeviceChoice;
    match (a.device, a.gpus_per_node) {
        (DeviceArg::Cpu, None) => Ok(DeviceChoice::Cpu),
        (DeviceArg::Cpu, Some(_)) => {
            Err(BadInput("--gpus-per-node places ranks on GPUs: it needs --device wgpu".into()).into())
        }
        (_, Some(n)) if !(1..4096).contains(&n) => Err(BadInput(format!(
            "gpus_per_node is {n}: it must be at least 1 and below 4096"
        ))
        .into()),
        (DeviceArg::Wgpu, Some(n)) if n > 1 && a.transport == TransportKind::Threads => Err(BadInput(format!(
            "--gpus-per-node {n}: threads share one process's device; worker processes (--transport auto or mpi) take one GPU each"
        ))
        .into()),
        (DeviceArg::Wgpu, n) => Ok(DeviceChoice::Wgpu(
            n.map(|n| crate::ranks::local_rank().unwrap_or(0) % n),
        )),
    }
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
    sampling: Option<SamplingArg>,
    #[command(flatten)]
    pub(crate) freeze: crate::freeze::FreezeArgs,
    /// The flags given on the command line (clap's ids): `--config`'s `[run]` keys fill the
    /// others.
    #[arg(skip)]
    pub(crate) given: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SamplingArg {
    Windows,
    Epochs,
}

#[derive(Args)]
pub struct ProfileArgs {
    /// The model to measure (default: the train default).
    #[command(flatten)]
    model: crate::model::ModelArgs,
    /// Sequence length (default: the model's).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 4)]
    rows: usize,
    /// Timed repetitions per layer (median).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Output file.
    #[arg(long, default_value = "profile.toml")]
    out: PathBuf,
    /// Instead of a profile, print where a transformer block's time goes: each op alone,
    /// forward and forward + backward, beside the whole block.
    #[arg(long)]
    ops: bool,
}

/// The model `profile` (and `plan --model`) measures: the flags' model at `seq_len`, checked
/// with the same limits as training it in micro-batches of `rows`.
pub fn model_to_measure(
    m: &crate::model::ModelArgs,
    seq_len: Option<usize>,
    rows: usize,
    repeats: usize,
) -> Result<ModelConfig> {
    let mut model = m.resolve()?.map_or_else(ModelConfig::default, |c| c.config);
    if let Some(t) = seq_len {
        model.seq_len = t;
    }
    model.check().map_err(BadInput)?;
    if rows == 0 || repeats == 0 || repeats > 1000 {
        return Err(BadInput(format!(
            "--rows must be at least 1 and --repeats between 1 and 1000 (got {rows} and {repeats})"
        ))
        .into());
    }
    TrainConfig {
        model: model.clone(),
        rows,
        ..TrainConfig::default()
    }
    .check()
    .map_err(|e| BadInput(format!("--rows {rows}: {e}")))?;
    Ok(model)
}

pub fn cmd_profile(a: ProfileArgs) -> Result<()> {
    let model = model_to_measure(&a.model, a.seq_len, a.rows, a.repeats)?;
    if a.ops {
        use pipewright_runtime::model::Family;
        if !matches!(model.family, Family::Gpt | Family::Llama) {
            return Err(BadInput(format!(
                "--ops breaks down the gpt and llama families' blocks; a {} block is measured whole by profile without --ops",
                model.family.name()
            ))
            .into());
        }
        print_ops(&model, a.rows, a.repeats);
        return Ok(());
    }
    let prof = pipewright_runtime::profile::profile_model(&model, a.rows, a.repeats, 42);
    write_file(&a.out, &prof.to_toml())?;
    println!("{}", profile_summary(&prof, a.rows));
    Ok(())
}

/// A measured profile in one line: its layer blocks and their summed times.
pub fn profile_summary(prof: &pipewright_core::profile::Profile, rows: usize) -> String {
    let (f, b): (f64, f64) = prof
        .layers
        .iter()
        .fold((0.0, 0.0), |(f, b), l| (f + l.forward, b + l.backward()));
    format!(
        "{} layer blocks; forward {f:.4} s, backward {b:.4} s per micro-batch of {rows} sequences",
        prof.layers.len()
    )
}

/// `profile --ops`: where a transformer block's time goes, op by op, beside the whole block
/// and the alternatives measured but not used.
fn print_ops(model: &ModelConfig, rows: usize, repeats: usize) {
    use pipewright_runtime::profile;
    let ops = match model.family {
        pipewright_runtime::model::Family::Llama => {
            profile::llama::op_breakdown(model, rows, repeats)
        }
        _ => profile::op_breakdown(model, rows, repeats),
    };
    let parts = &ops.ops;
    let sum = parts.iter().fold((0.0, 0.0), |(f, b), o| {
        (f + o.forward, b + o.forward_backward)
    });
    println!(
        "one transformer block (d_model {}, {} heads, seq {}), micro-batch of {} sequences; median of {}:",
        model.d_model, model.heads, model.seq_len, rows, repeats
    );
    println!(
        "{:<38} {:>5} {:>12} {:>14} {:>7}",
        "op (timed alone)", "times", "forward ms", "fwd + bwd ms", "share"
    );
    let row = |name: &str, count: String, f: f64, b: f64| {
        println!(
            "{name:<38} {count:>5} {:>12.3} {:>14.3} {:>6.1}%",
            f * 1e3,
            b * 1e3,
            100.0 * b / sum.1
        )
    };
    for o in parts {
        row(o.name, o.count.to_string(), o.forward, o.forward_backward);
    }
    row("sum of the ops", String::new(), sum.0, sum.1);
    let w = &ops.whole;
    row(
        "whole block, run as one",
        String::new(),
        w.forward,
        w.forward_backward,
    );
    println!(
        "alternatives (measured, not used), beside the fwd + bwd time of what they would replace:"
    );
    for alt in &ops.alternatives {
        let replaced: f64 = alt
            .replaces
            .iter()
            .filter_map(|(name, part)| {
                parts
                    .iter()
                    .find(|o| o.name == *name)
                    .map(|o| o.forward_backward * part)
            })
            .sum();
        let what: Vec<String> = alt
            .replaces
            .iter()
            .map(|(name, part)| {
                if *part < 1.0 {
                    format!("{:.2} of {name}", part)
                } else {
                    name.to_string()
                }
            })
            .collect();
        println!(
            "{:<38} {:>5} {:>12.3} {:>14.3}  vs {:.3} ms ({}): {:.2}x",
            alt.op.name,
            "",
            alt.op.forward * 1e3,
            alt.op.forward_backward * 1e3,
            replaced * 1e3,
            what.join(" + "),
            alt.op.forward_backward / replaced
        );
    }
}

/// The settings a run starts from: the config file; with --resume and no config file, the
/// checkpoint's own (so a resume needs no flags repeated); else the defaults.
fn base_config(a: &TrainArgs) -> Result<TrainConfig> {
    Ok(match &a.config {
        Some(f) => {
            let text = pipewright_core::error::read_file(f)?;
            let name = f.display().to_string();
            // The [run] table is the runtable module's.
            pipewright_core::error::parse_toml_split::<TrainConfig, toml::Table>(
                &name, &text, "run",
            )?
            .0
        }
        // An unreadable checkpoint is the resume's to report.
        None if a.resume => pipewright_runtime::train::checkpoint_config(&a.checkpoint_dir())
            .map(|(cfg, _, _)| cfg)
            .unwrap_or_default(),
        None => TrainConfig::default(),
    })
}

/// What the flags changed of the checkpoint's settings on a resume, as `field old -> new`.
fn resume_changes(base: &TrainConfig, cfg: &TrainConfig) -> Vec<String> {
    let flat = |c: &TrainConfig| -> Vec<(String, String)> {
        let v = serde_json::to_value(c).unwrap_or_default();
        let mut out = Vec::new();
        for (k, x) in v.as_object().into_iter().flatten() {
            match x.as_object() {
                Some(inner) => out.extend(
                    inner
                        .iter()
                        .map(|(k2, y)| (format!("{k}.{k2}"), y.to_string())),
                ),
                None => out.push((k.clone(), x.to_string())),
            }
        }
        out
    };
    let (was, now) = (flat(base), flat(cfg));
    now.iter()
        .filter_map(|(k, v)| {
            let old = was
                .iter()
                .find(|(k2, _)| k2 == k)
                .map_or("none", |(_, o)| o.as_str());
            (old != v).then(|| format!("{k} {old} -> {v}"))
        })
        .collect()
}

/// On a resume without --config: that the checkpoint's settings are used, and what the flags
/// changed of them.
fn resume_note(a: &TrainArgs, cfg: &TrainConfig) -> Result<Option<String>> {
    if !a.resume || a.config.is_some() {
        return Ok(None);
    }
    let changes = resume_changes(&base_config(a)?, cfg);
    Ok(Some(match changes.is_empty() {
        true => "with the checkpoint's settings".into(),
        false => format!(
            "with the checkpoint's settings; changed by flags: {}",
            changes.join(", ")
        ),
    }))
}

/// The run's settings: the config file (or a resumed checkpoint's), then the flags over it.
fn config(a: &TrainArgs) -> Result<TrainConfig> {
    let mut cfg = base_config(a)?;
    macro_rules! set {
        ($($f:ident),*) => { $(if let Some(v) = a.$f.clone() { cfg.$f = v; })* };
    }
    set!(
        schedule,
        stages,
        chunks,
        replicas,
        microbatches,
        rows,
        steps,
        lr,
        min_lr,
        warmup,
        weight_decay,
        clip,
        seed
    );
    if let Some(g) = a.global_batch {
        if g == 0 || g % cfg.replicas != 0 {
            return Err(BadInput(format!(
                "--global-batch {g}: expected a positive multiple of the {} replicas (each replica runs global batch / replicas micro-batches)",
                cfg.replicas
            ))
            .into());
        }
        cfg.microbatches = g / cfg.replicas;
    }
    if let Some(chosen) = a.model.resolve()? {
        if chosen.weights.is_some() && (a.d_model, a.layers, a.heads) != (None, None, None) {
            return Err(BadInput(
                "--d-model, --layers and --heads cannot reshape a pretrained --model".into(),
            )
            .into());
        }
        (cfg.model, cfg.pretrained) = (chosen.config, chosen.weights);
    }
    if let Some(t) = &a.tokenizer {
        cfg.tokenizer = Some(t.clone());
    }
    // --data and its companions, else the configuration file's [data].
    let data = a.data.resolve(cfg.data.as_ref())?;
    cfg.data = data.source();
    macro_rules! set_model {
        ($($f:ident),*) => { $(if let Some(v) = a.$f { cfg.model.$f = v; })* };
    }
    set_model!(d_model, layers, heads, seq_len);
    match (a.sampling, a.freeze.cache_budget.is_some()) {
        (Some(SamplingArg::Windows), _) if data.task != crate::data::Task::Lm => {
            return Err(BadInput(
                "--sampling windows draws windows of a text; a task's examples are each drawn once an epoch (leave --sampling out)"
                    .into(),
            )
            .into())
        }
        (Some(SamplingArg::Windows), true) => {
            return Err(BadInput(
                "--cache-budget keys cached activations by sample: it needs --sampling epochs"
                    .into(),
            )
            .into())
        }
        (Some(SamplingArg::Windows), false) => cfg.sampling = Sampling::Windows,
        (Some(SamplingArg::Epochs), _) | (None, true) => cfg.sampling = Sampling::Epochs,
        (None, false) => {}
    }
    if a.chunks.is_none() && a.schedule.is_some() {
        cfg.chunks = cfg.schedule.default_chunks();
    }
    if a.eval_every == 0 || a.eval_batches == 0 {
        return Err(BadInput("--eval-every and --eval-batches must be at least 1".into()).into());
    }
    cfg.check()?;
    Ok(cfg)
}

/// A progress bar of `len` steps on a terminal (hidden otherwise: logs stay clean).
pub(crate) fn progress_bar(len: u64, what: &str) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} ETA {eta}")
            .expect("template"),
    );
    bar.set_message(what.to_string());
    bar
}

/// This process's part in an MPI job, once MPI is up.
#[cfg(feature = "mpi")]
type Procs = Option<Arc<pipewright_runtime::transport::mpi::Mpi>>;
#[cfg(not(feature = "mpi"))]
type Procs = Option<std::convert::Infallible>;

/// Start MPI if asked (before anything that may fail, so errors can be printed by rank 0 only).
fn start_transport(a: &TrainArgs) -> Result<Procs> {
    for (flag, secs) in [
        ("--peer-timeout", a.peer_timeout),
        ("--startup-timeout", a.startup_timeout),
    ] {
        if !(secs.is_finite() && secs > 0.0 && secs <= 1e6) {
            return Err(BadInput(format!(
                "{flag} {secs:?}: expected seconds between 0 and 1000000"
            ))
            .into());
        }
    }
    pipewright_runtime::transport::set_startup_timeout(Duration::from_secs_f64(a.startup_timeout));
    let launched = crate::ranks::launcher_tasks().is_some();
    if a.transport == TransportKind::Auto && !launched {
        return Ok(None);
    }
    if a.transport == TransportKind::Threads {
        // Started as one of several tasks, each would train the whole plan alone, on the same
        // files: refused (by task 0 only, so the message comes once).
        if let Some((who, n, me)) = crate::ranks::launcher_tasks() {
            crate::ranks::set_rank(me);
            return Err(BadInput(format!(
                "this process is one of {n} tasks that {who} started; with --transport threads each would train the whole plan alone: add --transport mpi (or start one task)"
            ))
            .into());
        }
        return Ok(None);
    }
    crate::ranks::check_slurm_pmix().map_err(BadInput)?;
    #[cfg(feature = "mpi")]
    {
        let m =
            pipewright_runtime::transport::mpi::Mpi::start(Duration::from_secs_f64(a.peer_timeout))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        crate::ranks::set_rank(m.world().rank);
        crate::ranks::watch_signals(m.world().rank);
        crate::launch::share_cores();
        crate::launch::join_lending();
        if m.world().rank == 0 {
            crate::ranks::warn_oversubscribed();
        }
        Ok(Some(Arc::new(m)))
    }
    #[cfg(not(feature = "mpi"))]
    Err(BadInput(
        "--transport mpi: this pipewright was built without MPI (cargo feature `mpi`; scripts/install-deps installs Open MPI)".into(),
    )
    .into())
}

/// Under `--transport auto`, a plan of several workers starts again as one process per worker
/// (this returns only if it stays in this process). `--cluster` emulates links between threads,
/// and `--switch-plan` may change the worker count: both stay threads.
fn as_processes(a: &TrainArgs, cfg: &TrainConfig) -> Result<()> {
    if a.cluster.is_some() || !a.switch_plan.is_empty() {
        return Ok(());
    }
    let workers = train_plan(a, cfg)?.num_workers();
    if workers < 2 {
        return Ok(());
    }
    let why = crate::launch::why_threads().unwrap_or_else(|| crate::launch::relaunch(workers));
    eprintln!(
        "note: the {workers} workers run as threads in this process, which is slower than processes: {why}"
    );
    Ok(())
}

/// `train`, and when it fails (a worker or peer failed, a write failed: not bad input, which
/// writes nothing) its last error also in `last-error.txt` beside the checkpoints: a batch job's
/// log may be gone, the checkpoints are not.
pub fn cmd_train(a: TrainArgs) -> Result<()> {
    let a = crate::runtable::apply(a)?;
    let dir = (!a.no_checkpoint).then(|| a.checkpoint_dir());
    let r = train(a);
    if let (Err(e), Some(dir)) = (&r, dir) {
        // The root says why the run failed; another rank whose own step failed says so too
        // (under mpirun the root, waiting for it, is then stopped before it could).
        let root = crate::ranks::RANK.get().is_none_or(|&r| r == 0);
        let own = !e.chain().any(|c| {
            matches!(
                c.downcast_ref::<pipewright_runtime::exec::ExecError>(),
                Some(pipewright_runtime::exec::ExecError::Transport(_))
            ) || c.is::<pipewright_runtime::transport::TransportError>()
        });
        let failure = crate::error::exit_code(e) == 1;
        if (root || own) && failure && dir.is_dir() {
            let line = format!(
                "{} {}\n",
                crate::log::now(),
                crate::error::message(e, crate::error::Flags::Pipeline)
            );
            // Whole or not at all: written aside, then renamed over the last one.
            let tmp = dir.join(format!(".last-error.{}", std::process::id()));
            if std::fs::write(&tmp, line).is_ok() {
                let _ = std::fs::rename(&tmp, dir.join("last-error.txt"));
            }
        }
    }
    r
}

fn train(a: TrainArgs) -> Result<()> {
    if a.print_config {
        #[derive(serde::Serialize)]
        struct Run {
            run: crate::runtable::RunTable,
        }
        let run = Run {
            run: crate::runtable::RunTable::of(&a),
        };
        print!(
            "{}\n{}",
            toml::to_string(&config(&a)?)?,
            toml::to_string(&run)?
        );
        return Ok(());
    }
    // Before MPI starts: a stop request mpirun passes on must find the handler.
    crate::ranks::stop_on_signals();
    crate::launch::mark_started();
    pipewright_runtime::backend::choose_device(device_choice(&a)?).map_err(BadInput)?;
    let procs = start_transport(&a)?;
    let mut cfg = config(&a)?;
    if procs.is_none() && a.transport == TransportKind::Auto {
        as_processes(&a, &cfg)?;
    }
    // After the relaunch, so that a launcher process holds no GPU context while its workers
    // train; the ranks agree on a failure with the plan's checks (none waits for a peer).
    let started = start_device(&a);
    let data = a.data.resolve(cfg.data.as_ref())?;
    let corpus = crate::data::corpus(&data, &mut cfg)?;
    let checked = started.and_then(|()| check_flags(&a, &cfg, procs.is_some()));
    let plan = agree(&procs, checked.and_then(|()| train_plan(&a, &cfg)))?;
    let links = links(&a, &plan)?;
    let run_cfg = run_config(&a, &cfg, links.as_ref())?;
    let mut trainer = trainer(&procs, cfg, plan, links, &run_cfg, a.peer_timeout)?;
    trainer.run_settings = Some(serde_json::to_value(crate::runtable::RunTable::of(&a))?);
    let mut run = TrainingRun::new(trainer, corpus, run_cfg)?;
    let mut sink = Progress::new(&a, run.trainer.is_root());
    if procs.is_none() {
        use pipewright_runtime::machine::{blas_lib, env_switch};
        if let (_, Some(note)) = env_switch(blas_lib::SPLIT_VAR) {
            eprintln!("{note}: products are split as by default");
        }
        sink.placement =
            blas_lib::split_note().map(|n| format!("workers: threads of this process; {n}"));
    }
    #[cfg(feature = "mpi")]
    if let Some(m) = procs.as_ref().filter(|_| run.trainer.is_root()) {
        sink.placement = Some(crate::launch::placement_note(m.world().size));
    }
    let summary = run.run(&mut sink)?;
    // The root reports before MPI finishes: the run is done and checkpointed, and a peer that
    // never finishes must not hold its summary back.
    let reported = match run.trainer.is_root() {
        true => report(&a, &mut run, &summary),
        false => Ok(()),
    };
    #[cfg(feature = "mpi")]
    if let (Some(m), Ok(())) = (&procs, &reported) {
        crate::ranks::finish_within(m, Duration::from_secs_f64(a.peer_timeout));
    }
    reported
}

/// Starts `--device wgpu`'s device (the CPU needs no start), or says plainly why it did not.
fn start_device(a: &TrainArgs) -> Result<()> {
    if a.device != DeviceArg::Wgpu {
        return Ok(());
    }
    pipewright_runtime::backend::start_device().map_err(|e| {
        BadInput(format!(
            "--device wgpu: {e} (a GPU needs its Vulkan driver; Debian's mesa-vulkan-drivers has lavapipe, a Vulkan device on the CPU; --gpus-per-node asks for discrete GPUs, which lavapipe is not)"
        ))
        .into()
    })
}

/// Flag values no run can use, named by their flags (the runtime checks them too, by its
/// own names).
fn check_flags(a: &TrainArgs, cfg: &TrainConfig, mpi: bool) -> Result<()> {
    let bad = |m: &str| Err(BadInput(m.into()).into());
    if a.compare_sim && cfg.steps < 3 {
        return bad("--compare-sim needs at least 3 steps (the first two are left out as warm-up)");
    }
    if a.keep == 0 {
        return bad("--keep must be at least 1");
    }
    if a.cluster.is_some() && mpi {
        return bad("--cluster emulates links between threads; over MPI the network is real (drop --cluster)");
    }
    if !a.switch_plan.is_empty() && a.freeze.elastic {
        return bad(
            "--switch-plan and --elastic both change the plan during the run: use one of them",
        );
    }
    for f in a
        .metrics
        .iter()
        .chain(&a.trace)
        .chain(&a.svg)
        .chain(&a.compare_svg)
    {
        check_output(f)?;
    }
    if let Some(d) = a
        .tensorboard
        .as_ref()
        .filter(|_| crate::ranks::RANK.get().is_none_or(|&r| r == 0))
    {
        check_writable_dir("--tensorboard", d)?;
    }
    if !a.no_checkpoint && crate::ranks::RANK.get().is_none_or(|&r| r == 0) {
        check_writable_dir("--checkpoint-dir", &a.checkpoint_dir())?;
        note_replaced(a);
    }
    Ok(())
}

/// The plan to train: a plan file, SkipPipe routes, or the schedule flags' pipeline.
fn train_plan(a: &TrainArgs, cfg: &TrainConfig) -> Result<Plan> {
    match (&a.plan, a.skip) {
        (Some(f), _) => {
            let plan = load_valid_plan(f)?;
            cfg.check_plan(&plan)
                .map_err(|e| BadInput(format!("{}: {e}", f.display())))?;
            Ok(plan)
        }
        (None, Some(k)) => skip_train_plan(cfg, k, a.cluster.as_deref()),
        (None, None) => Ok(cfg.plan()?),
    }
}

/// Over MPI every rank trains rank 0's plan: a plan searched under a time limit (`--skip`'s
/// routes) can differ between ranks that ran the search at different speeds, and ranks with
/// different plans would wait on each other's collectives for ever.
/// A rank 0 whose checks failed sends nothing: every rank then ends with it (rank 0 says why)
/// instead of waiting for it in this collective until the launcher kills them.
fn agree(procs: &Procs, plan: Result<Plan>) -> Result<Plan> {
    let Some(m) = procs else {
        return plan;
    };
    #[cfg(feature = "mpi")]
    {
        use pipewright_runtime::transport::Transport;
        let rank = m.world().rank;
        let part = match (rank, &plan) {
            (0, Ok(p)) => p.to_json().into_bytes(),
            _ => Vec::new(),
        };
        let parts = m
            .all_gather(rank, part)
            .map_err(|e| anyhow::anyhow!("agreeing on rank 0's plan: {e}"))?;
        let plan = plan?;
        if rank == 0 {
            return Ok(plan);
        }
        if parts[0].is_empty() {
            return Err(BadInput("rank 0 refused this run (its message says why)".into()).into());
        }
        let text = String::from_utf8_lossy(&parts[0]);
        Ok(Plan::from_json("rank 0's plan", &text)?)
    }
    #[cfg(not(feature = "mpi"))]
    match *m {}
}

/// `--cluster`'s devices for the plan's workers, whose links the threads emulate.
fn links(a: &TrainArgs, plan: &Plan) -> Result<Option<Cluster>> {
    let Some(f) = &a.cluster else {
        return Ok(None);
    };
    let c = Cluster::load(f)?;
    devices_for_plan(plan, &c).map_err(|e| BadInput(format!("{}: {e}", f.display())))?;
    Ok(Some(c))
}

/// What the run does around its steps, from the flags.
fn run_config(a: &TrainArgs, cfg: &TrainConfig, links: Option<&Cluster>) -> Result<RunConfig> {
    if a.eval_every == 0 || a.eval_batches == 0 {
        return Err(BadInput("--eval-every and --eval-batches must be at least 1".into()).into());
    }
    Ok(RunConfig {
        eval_every: a.eval_every,
        eval_batches: a.eval_batches,
        checkpoints: (!a.no_checkpoint).then(|| Checkpointing {
            dir: a.checkpoint_dir(),
            every: a.checkpoint_every,
            keep: a.keep,
            overwrite: a.overwrite || (a.checkpoint_dir.is_none() && !a.resume),
        }),
        resume_from: a.resume.then(|| a.checkpoint_dir()),
        resume_note: resume_note(a, cfg)?,
        switches: switches(a, cfg, links)?,
        freeze: a.freeze.settings()?,
        cache: a.freeze.cache()?,
        compare_sim: a.compare_sim,
        trace: a.trace.is_some() || a.svg.is_some() || a.compare_svg.is_some(),
        stop: Some(&crate::ranks::STOP_REQUESTED),
    })
}

/// `--switch-plan STEP:FILE`s, each plan loaded and checked against the run.
fn switches(a: &TrainArgs, cfg: &TrainConfig, links: Option<&Cluster>) -> Result<Vec<(u64, Plan)>> {
    let mut out = Vec::new();
    for s in &a.switch_plan {
        let bad = || {
            BadInput(format!(
                "--switch-plan {s:?}: expected STEP:FILE, e.g. 20:deeper.json"
            ))
        };
        let (step, file) = s.split_once(':').ok_or_else(bad)?;
        let step: u64 = step.parse().map_err(|_| bad())?;
        let file = PathBuf::from(file);
        let next = load_valid_plan(&file)?;
        let named = |e: String| BadInput(format!("{}: {e}", file.display()));
        cfg.check_plan(&next).map_err(|e| named(e.to_string()))?;
        if let Some(c) = links {
            devices_for_plan(&next, c).map_err(|e| named(e.to_string()))?;
        }
        if step == 0 || step >= cfg.steps {
            return Err(BadInput(format!(
                "--switch-plan {s:?}: step {step} is not between 1 and {} (the run's last step is {})",
                cfg.steps.saturating_sub(1),
                cfg.steps
            ))
            .into());
        }
        out.push((step, next));
    }
    Ok(out)
}

/// The trainer: threads in this process, or this rank's worker of an MPI job.
fn trainer(
    procs: &Procs,
    cfg: TrainConfig,
    plan: Plan,
    links: Option<Cluster>,
    run: &RunConfig,
    peer_timeout: f64,
) -> Result<Trainer> {
    let Some(m) = procs else {
        let timeout = Duration::from_secs_f64(peer_timeout);
        return Ok(Trainer::in_process(cfg, plan, links, timeout)?);
    };
    #[cfg(feature = "mpi")]
    {
        let w = m.world();
        if w.size != plan.num_workers() {
            // The fix in the launcher's own words: srun's task count, else mpirun's.
            let srun = std::env::var_os("SLURM_STEP_NUM_TASKS").is_some();
            let launch = if srun { "srun -n" } else { "mpirun -np" };
            return Err(BadInput(format!(
                "the plan has {} workers but MPI started {} ranks: launch with `{launch} {}`",
                plan.num_workers(),
                w.size,
                plan.num_workers()
            ))
            .into());
        }
        if let Some((step, next)) = run.switches.iter().find(|(_, p)| p.num_workers() != w.size) {
            return Err(BadInput(format!(
                "--switch-plan at step {step}: that plan has {} workers, this MPI job {} ranks (a re-plan keeps the processes)",
                next.num_workers(),
                w.size
            ))
            .into());
        }
        let t: Arc<dyn pipewright_runtime::transport::Transport> = m.clone();
        Ok(Trainer::distributed(cfg, plan, w.rank, t)?)
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = run;
        match *m {}
    }
}

/// The CLI's sink: the log on stderr, a progress bar on a terminal, and the metrics file.
struct Progress {
    bar: indicatif::ProgressBar,
    metrics_path: Option<PathBuf>,
    metrics: Option<std::io::BufWriter<std::fs::File>>,
    /// `--tensorboard`'s directory (the root only), and its event file once the run starts.
    tensorboard_dir: Option<PathBuf>,
    tensorboard: Option<crate::tensorboard::EventFile>,
    /// Log lines every this many steps, when stderr is no terminal (the root only).
    log_every: Option<u64>,
    /// How the workers run: the processes' placement (the root of an MPI job), or who splits
    /// the products of in-process workers.
    placement: Option<String>,
}

impl Progress {
    fn new(a: &TrainArgs, root: bool) -> Self {
        use std::io::IsTerminal;
        // A rank pipewright started writes to mpirun, which passes its bytes on to the
        // terminal the command was run from: it draws the bar there as that command would.
        let terminal = std::io::stderr().is_terminal() || crate::launch::on_terminal();
        let bar = match (root, terminal) {
            (false, _) => indicatif::ProgressBar::hidden(),
            (true, true) if !std::io::stderr().is_terminal() => {
                indicatif::ProgressBar::with_draw_target(
                    Some(0),
                    indicatif::ProgressDrawTarget::term_like(Box::new(console::Term::stderr())),
                )
            }
            (true, _) => indicatif::ProgressBar::new(0),
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} ETA {eta}")
                .expect("template"),
        );
        Progress {
            bar,
            metrics_path: a.metrics.clone().filter(|_| root),
            metrics: None,
            tensorboard_dir: a.tensorboard.clone().filter(|_| root),
            tensorboard: None,
            log_every: (root && !terminal).then_some(a.log_every),
            placement: None,
        }
    }

    fn emit(&mut self, row: serde_json::Value) -> pipewright_runtime::error::Result<()> {
        if let Some(m) = self.metrics.as_mut() {
            use std::io::Write;
            writeln!(m, "{row}")
                .and_then(|_| m.flush())
                .map_err(|e| self.metrics_error(e))?;
        }
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.write_row(&row).map_err(|e| tb_error(tb.path(), e))?;
        }
        Ok(())
    }

    fn metrics_error(&self, e: std::io::Error) -> pipewright_runtime::error::Error {
        let path = self.metrics_path.as_ref().expect("metrics open");
        pipewright_runtime::error::Error::Io {
            what: format!("cannot write {}", path.display()),
            err: e,
        }
    }
}

/// A TensorBoard event file that cannot be written, named.
fn tb_error(path: &Path, err: std::io::Error) -> pipewright_runtime::error::Error {
    pipewright_runtime::error::Error::Io {
        what: format!("cannot write {}", path.display()),
        err,
    }
}

impl RunSink for Progress {
    fn start(&mut self, s: &RunStart) -> pipewright_runtime::error::Result<()> {
        eprintln!("{}", s.header);
        if let Some(p) = &self.placement {
            eprintln!("{p}");
        }
        if let Some(f) = self.metrics_path.clone() {
            if let Some(step) = s.resumed {
                // A resumed run continues the same metrics file from its step.
                cut_metrics(&f, step).map_err(|e| self.metrics_error(e))?;
            }
            let file = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(s.resumed.is_some())
                .truncate(s.resumed.is_none())
                .open(&f);
            self.metrics = Some(std::io::BufWriter::new(
                file.map_err(|e| self.metrics_error(e))?,
            ));
        }
        if let Some(d) = &self.tensorboard_dir {
            let f = crate::tensorboard::EventFile::create(d).map_err(|e| tb_error(d, e))?;
            self.tensorboard = Some(f);
        }
        if s.resumed.is_none() {
            self.emit(s.to_json())?;
        }
        self.bar.set_length(s.steps);
        self.bar.set_position(s.step);
        Ok(())
    }

    fn note(&mut self, text: &str) {
        // A finished bar stays as it is: suspending it would draw it again below the note.
        match self.bar.is_finished() {
            true => eprintln!("{text}"),
            false => self.bar.suspend(|| eprintln!("{text}")),
        }
    }

    fn step(&mut self, row: &StepRow) -> pipewright_runtime::error::Result<()> {
        self.emit(row.to_json())?;
        let acc = row
            .last_accuracy
            .map_or(String::new(), |a| format!(" acc {a:.3}"));
        self.bar.set_message(format!(
            "loss {:.3} val {:.3}{acc} {:.0} tok/s",
            row.report.loss,
            row.last_val,
            row.tokens_per_s()
        ));
        self.bar.inc(1);
        if row.report.step == row.steps {
            self.bar.finish();
            // The bar leaves the cursor at its line's end: what follows starts a line of its own.
            if !self.bar.is_hidden() {
                eprintln!();
            }
        }
        let step = row.report.step;
        if self
            .log_every
            .is_some_and(|n| step.is_multiple_of(n) || step == row.steps)
        {
            crate::log::eprint_line(&crate::log::step_line(row));
        }
        Ok(())
    }
}

/// What the root prints and writes once training is done.
fn report(a: &TrainArgs, run: &mut TrainingRun, s: &RunSummary) -> Result<()> {
    if let (Some(f), Some(tl)) = (&a.trace, &s.timeline) {
        write_with(f, |mut w| tl.write_chrome_trace(&mut w))?;
    }
    if let (Some(f), Some(tl)) = (&a.svg, &s.timeline) {
        let title = format!(
            "measured: {}",
            pipewright_runtime::train::describe(&run.trainer.plan)
        );
        write_with(f, |w| w.write_all(tl.to_svg(&title).as_bytes()))?;
    }
    if let Some(c) = &s.cache {
        println!(
            "frozen-prefix cache: {} rows read back, {} extended by newly frozen layers, {} computed; {:.1} MiB in memory, {:.1} MiB spilled",
            c.hits,
            c.extended,
            c.misses,
            c.memory_bytes as f64 / (1u64 << 20) as f64,
            c.disk_bytes as f64 / (1u64 << 20) as f64
        );
        if c.not_kept > 0 {
            println!(
                "frozen-prefix cache: the spill file's disk filled up; {} outputs were not kept, and their samples ran the frozen layers again",
                c.not_kept
            );
        }
    }
    let (base, base_name) = run.baseline();
    match (s.first_accuracy, s.last_accuracy) {
        (Some(a0), Some(a1)) if s.last_f1.is_some() => println!(
            "val loss {:.4} -> {:.4}, exact match {:.3} -> {:.3}, F1 {:.3} ({base_name} {base:.4}) after {} steps",
            s.first_val, s.last_val, a0, a1, s.last_f1.unwrap_or(0.0), s.step
        ),
        (Some(a0), Some(a1)) => println!(
            "val loss {:.4} -> {:.4}, accuracy {:.3} -> {:.3} ({base_name} {base:.4}) after {} steps",
            s.first_val, s.last_val, a0, a1, s.step
        ),
        _ => println!(
            "val loss {:.4} -> {:.4} (perplexity {:.2}; {base_name} {base:.4}) after {} steps",
            s.first_val,
            s.last_val,
            s.last_val.exp(),
            s.step
        ),
    }
    if a.compare_sim {
        if s.steps_run < 3 {
            return Err(BadInput(format!(
                "--compare-sim: this run took {} steps after resuming; it needs at least 3",
                s.steps_run
            ))
            .into());
        }
        let c = run.sim_comparison()?;
        print_sim_comparison(&c);
        if let (Some(f), Some(tl)) = (&a.compare_svg, &s.timeline) {
            let plan = pipewright_runtime::train::describe(&run.trainer.plan);
            let titles = [
                format!("simulated iteration {:.4} s: {plan}", c.simulated),
                format!("measured: last step, {:.4} s", tl.makespan()),
            ];
            let svg = pipewright_core::sim::timeline::Timeline::compare_svg(
                &c.timeline,
                tl,
                [&titles[0], &titles[1]],
            );
            write_file(f, &svg)?;
        }
    }
    Ok(())
}

/// The simulated iteration beside the measured one, and each stage's costs beside its
/// measured actions (where the difference comes from).
fn print_sim_comparison(c: &SimComparison) {
    println!(
        "iteration time: simulated {:.4} s, measured {:.4} s (median of {} steps), measured/simulated {:.2}",
        c.simulated, c.measured, c.measured_steps, c.measured / c.simulated
    );
    let ms = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{:.1}", 1e3 * v));
    for (s, st) in c.stages.iter().enumerate() {
        let (sim, m) = (st.simulated, st.measured);
        println!(
            "  stage {s}: ms simulated / measured (median action): F {:.1} / {}, BW {:.1} / {}, B {:.1} / {}, W {:.1} / {}",
            1e3 * sim[0], ms(m[0]), 1e3 * sim[1], ms(m[1]), 1e3 * sim[2], ms(m[2]), 1e3 * sim[3], ms(m[3]),
        );
    }
    if let Some(own) = c.own_devices {
        println!(
            "  simulated with the workers' compute serialised, as in-process workers run it (see crates/runtime/src/backend.rs); with a device each: {:.4} s (measured/simulated {:.2}), what --transport mpi gets",
            own, c.measured / own
        );
    }
}

/// The SkipPipe plan of `train --skip`: the model's own cost profile, the cluster (or
/// stages x replicas identical devices), a short deterministic search.
fn skip_train_plan(cfg: &TrainConfig, skip: f64, cluster: Option<&Path>) -> Result<Plan> {
    let skip = crate::skip::skip_count(skip, cfg.stages)?;
    if cfg.replicas == 0 || cfg.microbatches == 0 {
        return Err(BadInput(
            "--skip: --replicas (data nodes) and --microbatches must be at least 1".into(),
        )
        .into());
    }
    let cluster = cluster.map(Cluster::load).transpose()?;
    let profile = cfg.model.cost_profile(cfg.rows);
    let spec = JobSpec {
        cluster: cluster.as_ref(),
        routes: Routes::Skip(SkipRoutes {
            skip,
            max_swaps: 1,
            moves: 2000,
            time_limit: Duration::from_secs(30),
            seed: cfg.seed,
            mechanics: Default::default(),
            max_node_load: None,
            // SkipPipe's cost model prices geo-distributed routes, not these local ones.
            polish_moves: 0,
        }),
        ..cfg.job_spec(&profile)
    };
    let r = pipewright_core::job::build_skip(&spec)?;
    if r.time_limit_hit {
        eprintln!(
            "note: the route search stopped at its 30 s cap after {} moves: this plan depends on the machine's speed",
            r.moves
        );
    }
    cfg.check_plan(&r.plan)?;
    Ok(r.plan)
}

/// Create `dir` if needed and make sure files can be written there, before any training.
/// A fresh run in the default checkpoint directory replaces an earlier run's checkpoints:
/// said once, before they go.
fn note_replaced(a: &TrainArgs) {
    if a.checkpoint_dir.is_some() || a.resume {
        return;
    }
    let dir = a.checkpoint_dir();
    if let Some(((step, _), _)) = pipewright_runtime::train::store::list(&dir).last() {
        eprintln!(
            "note: replacing the checkpoints an earlier run left in {} (the newest at step {step}); --checkpoint-dir keeps runs apart",
            dir.display()
        );
    }
}

fn check_writable_dir(flag: &str, dir: &Path) -> Result<()> {
    let bad =
        |e: std::io::Error| BadInput(format!("{flag} {}: cannot write there: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(bad)?;
    let probe = dir.join(format!(".write-test-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(bad)?;
    std::fs::remove_file(&probe).map_err(bad)?;
    Ok(())
}

/// A resumed run continues the metrics file from the resumed step: rows of later steps (from
/// the run that was cut short) are dropped, so no step appears twice.
fn cut_metrics(f: &Path, step: u64) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(f) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                .is_some_and(|s| s <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let tmp = f.with_extension("tmp~");
    std::fs::write(&tmp, kept).and_then(|_| std::fs::rename(&tmp, f))
}

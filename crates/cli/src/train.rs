//! `train` and `profile`: run a plan on the real model, and measure the model's layers.

use crate::{check_output, load_valid_plan, write_file, write_with, BadInput};
use anyhow::{anyhow, Context, Result};
use clap::Args;
use pipewright_core::cluster::Cluster;
use pipewright_core::ir::Op;
use pipewright_core::profile::Profile;
use pipewright_core::schedule::ScheduleKind;
use pipewright_core::sim::{devices_for_plan, simulate, simulate_with, SimOptions, SimSetup};
use pipewright_runtime::data::{Corpus, Sampling};
use pipewright_runtime::model::GptConfig;
use pipewright_runtime::profile::median;
use pipewright_runtime::train::{TrainConfig, Trainer};
use serde_json::json;
use std::path::PathBuf;
#[cfg(feature = "mpi")]
use std::sync::Arc;
use std::time::Duration;

/// How the plan's workers run.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportKind {
    /// One process, a thread per worker.
    Threads,
    /// One process per worker, started by `mpirun -np WORKERS` or `srun`: rank r runs worker r.
    Mpi,
}

#[derive(Args)]
pub struct TrainArgs {
    /// TOML with any TrainConfig fields (model, schedule, stages, ...); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Whole-job plan file (from `plan --out`, `schedule --format json`, or by hand).
    #[arg(long, conflicts_with_all = ["schedule", "stages", "chunks", "replicas", "microbatches"])]
    plan: Option<PathBuf>,
    /// Pipeline schedule of the generated plan.
    #[arg(long, value_enum)]
    schedule: Option<ScheduleKind>,
    /// Pipeline depth P of the generated plan (workers per pipeline).
    #[arg(long)]
    stages: Option<usize>,
    /// Stage chunks per worker (interleaved; zbv uses 2).
    #[arg(long)]
    chunks: Option<usize>,
    /// Data-parallel replicas D of the generated plan.
    #[arg(long)]
    replicas: Option<usize>,
    /// Micro-batches M per replica per step of the generated plan.
    #[arg(long)]
    microbatches: Option<usize>,
    /// Sequences per micro-batch.
    #[arg(long)]
    rows: Option<usize>,
    /// Optimizer steps (in all, counting those before a --resume).
    #[arg(long)]
    steps: Option<u64>,
    /// Peak learning rate (warmup, then cosine).
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long)]
    seed: Option<u64>,
    /// UTF-8 text file to learn (default: the built-in synthetic corpus).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Write metrics as JSON lines.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Validate every N steps (and before the first and after the last).
    #[arg(long, default_value_t = 10)]
    eval_every: u64,
    /// Held-out micro-batches per validation.
    #[arg(long, default_value_t = 8)]
    eval_batches: usize,
    /// Directory for checkpoints.
    #[arg(long, default_value = "checkpoints")]
    checkpoint_dir: PathBuf,
    /// Write a checkpoint every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
    /// Do not write checkpoints.
    #[arg(long, conflicts_with = "checkpoint_every")]
    no_checkpoint: bool,
    /// Checkpoints to keep in --checkpoint-dir (the newest).
    #[arg(long, default_value_t = 3)]
    keep: usize,
    /// Continue from the latest checkpoint in --checkpoint-dir (under this run's plan, which
    /// may differ from the one that wrote it).
    #[arg(long)]
    resume: bool,
    /// Write the last step's measured timeline as a Chrome trace.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Model width.
    #[arg(long)]
    d_model: Option<usize>,
    /// Transformer blocks (the model has these plus the embedding and the head as layer blocks).
    #[arg(long)]
    layers: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Sequence length.
    #[arg(long)]
    seq_len: Option<usize>,
    /// Emulate this cluster's links between workers (each worker on the plan's device for it).
    #[arg(long)]
    cluster: Option<PathBuf>,
    /// SkipPipe: each micro-batch skips this many of the --stages model stages (a count, or
    /// a fraction below 1: 0.25 of 4 = 1). The plan comes from the skip-plan scheduler:
    /// --replicas data nodes (embedding and head), the other devices of --cluster (default
    /// stages x replicas identical ones) as pools for the other stages, --microbatches per
    /// data node. --skip 0 gives the full pipeline on the same layout.
    #[arg(long, conflicts_with_all = ["plan", "schedule", "chunks", "elastic"])]
    skip: Option<f64>,
    /// Switch to another whole-job plan after step STEP (STEP:FILE; repeatable): parameters
    /// and optimizer state move in memory to the new plan's workers.
    #[arg(long, value_name = "STEP:FILE")]
    switch_plan: Vec<String>,
    /// After training, profile the model and print simulated vs measured iteration time of the
    /// same plan (needs at least 3 steps in this run).
    #[arg(long)]
    compare_sim: bool,
    /// Threads in this process, or MPI processes (launch with `mpirun -np WORKERS`).
    #[arg(long, value_enum, default_value = "threads")]
    transport: TransportKind,
    /// Seconds a worker waits for a peer's message before it gives up and names the peer.
    #[arg(long, default_value_t = 60.0)]
    peer_timeout: f64,
    /// How steps draw sequences: random windows of the text, or epochs over fixed samples
    /// (each sample once an epoch; what --cache-budget keys on).
    #[arg(long, value_enum)]
    sampling: Option<SamplingArg>,
    #[command(flatten)]
    freeze: crate::freeze::FreezeArgs,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SamplingArg {
    Windows,
    Epochs,
}

#[derive(Args)]
pub struct ProfileArgs {
    /// Model TOML (vocab, d_model, heads, layers, seq_len); default: the train default.
    #[arg(long)]
    model: Option<PathBuf>,
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

pub fn cmd_profile(a: ProfileArgs) -> Result<()> {
    let model = match &a.model {
        Some(f) => {
            let text = std::fs::read_to_string(f)
                .map_err(|e| BadInput(format!("{}: cannot read: {e}", f.display())))?;
            pipewright_core::error::parse_toml::<GptConfig>(&f.display().to_string(), &text)?
        }
        None => GptConfig::default(),
    };
    model.check().map_err(BadInput)?;
    if a.rows == 0 || a.repeats == 0 || a.repeats > 1000 {
        return Err(BadInput(format!(
            "--rows must be at least 1 and --repeats between 1 and 1000 (got {} and {})",
            a.rows, a.repeats
        ))
        .into());
    }
    // The same size limits as training the model.
    TrainConfig {
        model: model.clone(),
        rows: a.rows,
        ..TrainConfig::default()
    }
    .check()
    .map_err(|e| BadInput(format!("--rows {}: {e}", a.rows)))?;
    if a.ops {
        let ops = pipewright_runtime::profile::op_breakdown(&model, a.rows, a.repeats);
        let parts = &ops.ops;
        let sum = parts.iter().fold((0.0, 0.0), |(f, b), o| {
            (f + o.forward, b + o.forward_backward)
        });
        println!(
            "one transformer block (d_model {}, {} heads, seq {}), micro-batch of {} sequences; median of {}:",
            model.d_model, model.heads, model.seq_len, a.rows, a.repeats
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
        println!("alternatives (measured, not used), beside the fwd + bwd time of what they would replace:");
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
                        format!("{part} of {name}")
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
        return Ok(());
    }
    let prof = pipewright_runtime::profile::profile_model(&model, a.rows, a.repeats, 42);
    write_file(&a.out, &prof.to_toml())?;
    let (f, b): (f64, f64) = prof
        .layers
        .iter()
        .fold((0.0, 0.0), |(f, b), l| (f + l.forward, b + l.backward()));
    println!(
        "{} layer blocks; forward {:.4} s, backward {:.4} s per micro-batch of {} sequences",
        prof.layers.len(),
        f,
        b,
        a.rows
    );
    Ok(())
}

/// The run's settings: the config file, then the flags over it.
fn config(a: &TrainArgs) -> Result<TrainConfig> {
    let mut cfg = match &a.config {
        Some(f) => {
            let text = std::fs::read_to_string(f)
                .map_err(|e| BadInput(format!("{}: cannot read: {e}", f.display())))?;
            pipewright_core::error::parse_toml::<TrainConfig>(&f.display().to_string(), &text)?
        }
        None => TrainConfig::default(),
    };
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
        seed
    );
    macro_rules! set_model {
        ($($f:ident),*) => { $(if let Some(v) = a.$f { cfg.model.$f = v; })* };
    }
    set_model!(d_model, layers, heads, seq_len);
    match (a.sampling, a.freeze.cache_budget.is_some()) {
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

/// This process's part in an MPI job, once MPI is up.
#[cfg(feature = "mpi")]
type Procs = Option<Arc<pipewright_runtime::mpi::Mpi>>;
#[cfg(not(feature = "mpi"))]
type Procs = Option<std::convert::Infallible>;

/// Start MPI if asked (before anything that may fail, so errors can be printed by rank 0 only).
fn start_transport(a: &TrainArgs) -> Result<Procs> {
    if !(a.peer_timeout.is_finite() && a.peer_timeout > 0.0 && a.peer_timeout <= 1e6) {
        return Err(BadInput(format!(
            "--peer-timeout {:?}: expected seconds between 0 and 1000000",
            a.peer_timeout
        ))
        .into());
    }
    if a.transport == TransportKind::Threads {
        return Ok(None);
    }
    #[cfg(feature = "mpi")]
    {
        let m = pipewright_runtime::mpi::Mpi::start(Duration::from_secs_f64(a.peer_timeout))
            .map_err(|e| anyhow!("{e}"))?;
        crate::set_rank(m.world().rank);
        crate::watch_signals(m.world().rank);
        Ok(Some(Arc::new(m)))
    }
    #[cfg(not(feature = "mpi"))]
    Err(BadInput(
        "--transport mpi: this pipewright was built without MPI (cargo feature `mpi`; scripts/install-deps installs Open MPI)".into(),
    )
    .into())
}

pub fn cmd_train(a: TrainArgs) -> Result<()> {
    let procs = start_transport(&a)?;
    let cfg = config(&a)?;
    let plan = match &a.plan {
        Some(f) => {
            let plan = load_valid_plan(f)?;
            cfg.check_plan(&plan)
                .map_err(|e| BadInput(format!("{}: {e}", f.display())))?;
            plan
        }
        None => match a.skip {
            Some(k) => skip_train_plan(&cfg, k, a.cluster.as_deref())?,
            None => cfg.plan()?,
        },
    };
    let corpus = match &a.data {
        Some(f) => Corpus::load(f).map_err(BadInput)?,
        None => Corpus::builtin(),
    };
    corpus.check(cfg.model.seq_len).map_err(BadInput)?;
    let epoch_steps = cfg
        .sampler()
        .steps_per_epoch(&corpus.train, plan.num_microbatches)
        .map_err(|e| BadInput(format!("{}: {e}", corpus.name)))?;
    let links = match &a.cluster {
        Some(_) if procs.is_some() => {
            return Err(BadInput(
                "--cluster emulates links between threads; over MPI the network is real (drop --cluster)".into(),
            )
            .into())
        }
        Some(f) => {
            let c = Cluster::load(f)?;
            devices_for_plan(&plan, &c).map_err(|e| BadInput(format!("{}: {e}", f.display())))?;
            Some(c)
        }
        None => None,
    };
    if a.compare_sim && cfg.steps < 3 {
        return Err(BadInput(
            "--compare-sim needs at least 3 steps (the first two are left out as warm-up)".into(),
        )
        .into());
    }
    for f in a.metrics.iter().chain(&a.trace) {
        check_output(f)?;
    }
    if a.keep == 0 {
        return Err(BadInput("--keep must be at least 1".into()).into());
    }
    if !a.no_checkpoint && procs.as_ref().is_none_or(is_rank0) {
        check_writable_dir(&a.checkpoint_dir)?;
    }
    let mut switches = Vec::new();
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
        cfg.check_plan(&next)
            .map_err(|e| BadInput(format!("{}: {e}", file.display())))?;
        if let Some(c) = &links {
            devices_for_plan(&next, c).map_err(|e| BadInput(format!("{}: {e}", file.display())))?;
        }
        if step == 0 || step >= cfg.steps {
            return Err(BadInput(format!(
                "--switch-plan {s:?}: step {step} is not between 1 and {} (the run's last step is {})",
                cfg.steps.saturating_sub(1),
                cfg.steps
            ))
            .into());
        }
        switches.push((step, next));
    }
    let mut trainer = match &procs {
        None => Trainer::in_process(
            cfg.clone(),
            plan,
            links.clone(),
            Duration::from_secs_f64(a.peer_timeout),
        )?,
        #[cfg(feature = "mpi")]
        Some(m) => {
            let w = m.world();
            if w.size != plan.num_workers() {
                return Err(BadInput(format!(
                    "the plan has {} workers but MPI started {} ranks: launch with `mpirun -np {}`",
                    plan.num_workers(),
                    w.size,
                    plan.num_workers()
                ))
                .into());
            }
            if let Some((step, next)) = switches.iter().find(|(_, p)| p.num_workers() != w.size) {
                return Err(BadInput(format!(
                    "--switch-plan at step {step}: that plan has {} workers, this MPI job {} ranks (a re-plan keeps the processes)",
                    next.num_workers(),
                    w.size
                ))
                .into());
            }
            let t: Arc<dyn pipewright_runtime::transport::Transport> = m.clone();
            Trainer::distributed(cfg.clone(), plan, w.rank, t)?
        }
        #[cfg(not(feature = "mpi"))]
        Some(never) => match *never {},
    };
    let root = trainer.is_root();
    // Only rank 0 speaks, writes metrics and checkpoints.
    macro_rules! say {
        ($($t:tt)*) => { if root { eprintln!($($t)*); } };
    }
    trainer.keep_checkpoints = a.keep;
    let mut resumed = None;
    if a.resume {
        let r = trainer.load_checkpoint(&a.checkpoint_dir)?;
        if let Some(why) = &r.fallback {
            say!("warning: {why}; resuming from the newest checkpoint that verifies");
        }
        say!("resumed from {} at step {}", r.path.display(), r.step);
        if let (Some(f), true) = (&a.metrics, root) {
            cut_metrics(f, r.step)?;
        }
        resumed = Some(r);
    }
    let mut freezer = crate::freeze::Controller::new(
        &a.freeze,
        &trainer,
        links.as_ref(),
        epoch_steps,
        procs.is_some(),
    )?;
    trainer.set_cache(a.freeze.cache()?)?;
    if let (Some(f), Some(r)) = (freezer.as_mut(), &resumed) {
        if let Some(msg) = f.resumed(&mut trainer, r.step, r.frozen)? {
            say!("{msg}");
        }
    }
    let baseline = corpus.unigram_baseline();
    say!(
        "training gpt ({} layer blocks, d_model {}) on {}: {}; {} steps{}; unigram baseline {:.3}",
        cfg.model.num_blocks(),
        cfg.model.d_model,
        corpus.name,
        pipewright_runtime::train::describe(&trainer.plan),
        cfg.steps,
        match cfg.sampling {
            Sampling::Epochs => format!(" in epochs of {epoch_steps}"),
            Sampling::Windows => String::new(),
        },
        baseline
    );
    let mut metrics = match &a.metrics {
        Some(f) if root => Some(std::io::BufWriter::new(
            // A resumed run continues the same metrics file.
            std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(a.resume)
                .truncate(!a.resume)
                .open(f)
                .with_context(|| format!("cannot write {}", f.display()))?,
        )),
        _ => None,
    };
    let mut emit = |row: serde_json::Value| -> Result<()> {
        if let Some(m) = metrics.as_mut() {
            use std::io::Write;
            writeln!(m, "{row}")?;
            m.flush()?;
        }
        Ok(())
    };
    let first_val = trainer.evaluate(&corpus, a.eval_batches)?;
    if !a.resume {
        emit(
            json!({"step": trainer.step, "loss": null, "val_loss": first_val, "val_perplexity": first_val.exp(), "tokens_per_s": null}),
        )?;
    }
    let bar = if root {
        indicatif::ProgressBar::new(cfg.steps)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} ETA {eta}")
            .expect("template"),
    );
    bar.set_position(trainer.step);
    let mut last = None;
    // With freezing, --trace covers the whole run (up to a size cap) with the transitions
    // marked, so re-plans show in the timeline.
    let mut whole = freezer.is_some().then(|| WholeRun {
        clock: std::time::Instant::now(),
        actions: Vec::new(),
        marks: Vec::new(),
        workers: trainer.plan.num_workers(),
    });
    let mut step_seconds = Vec::new();
    // --compare-sim's profile, one pass after each step: a machine's speed drifts with other
    // load, and a profile taken only after training could see a different machine. Every rank
    // takes it (the root's is used): a rank left idle while the root profiled ran its first
    // actions of the next step 20-30% slower (F 58 and BW 110 ms against 43 and 85 later, from
    // `--trace`, 2 MPI processes), which made the measured steps slower than training without
    // --compare-sim.
    let mut profiler = a
        .compare_sim
        .then(|| pipewright_runtime::profile::Profiler::new(&cfg.model, cfg.rows, cfg.seed));
    // And the measured actions after warm-up, by stage and op, to compare with its costs.
    let mut action_seconds = ActionSeconds::new();
    let mut last_val = first_val;
    while trainer.step < cfg.steps {
        let r = trainer
            .train_step(&corpus)
            .map_err(|e| anyhow!("step {}: {e}", trainer.step + 1))?;
        let tps = r.tokens as f64 / r.seconds;
        let val = if r.step % a.eval_every == 0 || r.step == cfg.steps {
            Some(trainer.evaluate(&corpus, a.eval_batches)?)
        } else {
            None
        };
        if let Some(v) = val {
            last_val = v;
        }
        let (stages, replicas) = shape(&trainer.plan);
        emit(
            json!({"step": r.step, "loss": r.loss, "val_loss": val, "val_perplexity": val.map(f64::exp), "tokens_per_s": tps, "samples_per_s": (trainer.plan.num_microbatches * cfg.rows) as f64 / r.seconds, "lr": r.lr, "grad_norm": r.grad_norm, "busy": r.busy, "seconds": r.seconds, "frozen_layers": trainer.frozen(), "stages": stages, "replicas": replicas, "cache": trainer.cache_stats().map(|c| json!({"hits": c.hits, "extended": c.extended, "misses": c.misses, "memory_bytes": c.memory_bytes, "disk_bytes": c.disk_bytes}))}),
        )?;
        bar.set_message(format!(
            "loss {:.3} val {:.3} {:.0} tok/s",
            r.loss, last_val, tps
        ));
        bar.inc(1);
        if !a.no_checkpoint
            && a.checkpoint_every > 0
            && r.step % a.checkpoint_every == 0
            && r.step < cfg.steps
        {
            trainer.save_checkpoint(&a.checkpoint_dir)?;
        }
        step_seconds.push(r.seconds);
        if let Some(p) = profiler.as_mut() {
            bar.suspend(|| p.sample());
            if step_seconds.len() > 2 {
                for t in &r.actions {
                    action_seconds
                        .entry((t.action.stage, t.action.op))
                        .or_default()
                        .push(t.end - t.start);
                }
            }
        }
        if let Some(w) = whole.as_mut() {
            w.step(&r);
        }
        if let Some(f) = freezer.as_mut() {
            if let Some(msg) = f.after_step(&mut trainer, &r)? {
                bar.suspend(|| say!("{msg}"));
                if let Some(w) = whole.as_mut() {
                    w.mark(msg.lines().next().unwrap_or(""), trainer.plan.num_workers());
                }
            }
        }
        for (_, next) in switches.iter().filter(|(at, _)| *at == r.step) {
            let rep = trainer.replan(next.clone())?;
            if let Some(w) = whole.as_mut() {
                w.mark(
                    &format!("step {}: re-planned", r.step),
                    trainer.plan.num_workers(),
                );
            }
            bar.suspend(|| {
                say!(
                    "step {}: re-planned in {:.3} s\n  before: {}\n  after:  {}",
                    r.step,
                    rep.seconds,
                    rep.before,
                    rep.after
                )
            });
        }
        last = Some(r);
    }
    bar.finish();
    if !a.no_checkpoint {
        let p = trainer.save_checkpoint(&a.checkpoint_dir)?;
        say!("checkpoint: {}", p.display());
    }
    #[cfg(feature = "mpi")]
    if let Some(m) = &procs {
        m.finish();
    }
    if !root {
        return Ok(());
    }
    if let (Some(f), Some(r)) = (&a.trace, &last) {
        let mut tl = trainer.timeline(r);
        if let Some(w) = whole {
            tl.worker_names = (0..w.workers).map(|i| format!("worker {i}")).collect();
            tl.actions = w.actions;
            tl.marks = w.marks;
        }
        write_with(f, |mut w| tl.write_chrome_trace(&mut w))?;
    }
    if let Some(c) = trainer.cache_stats() {
        println!(
            "frozen-prefix cache: {} rows read back, {} extended by newly frozen layers, {} computed; {:.1} MB in memory, {:.1} MB spilled",
            c.hits,
            c.extended,
            c.misses,
            c.memory_bytes as f64 / 1e6,
            c.disk_bytes as f64 / 1e6
        );
    }
    println!(
        "val loss {:.4} -> {:.4} (perplexity {:.2}; unigram baseline {:.4}) after {} steps",
        first_val,
        last_val,
        last_val.exp(),
        baseline,
        trainer.step
    );
    if a.compare_sim {
        if step_seconds.len() < 3 {
            return Err(BadInput(format!(
                "--compare-sim: this run took {} steps after resuming; it needs at least 3",
                step_seconds.len()
            ))
            .into());
        }
        let mut profiler = profiler.expect("profiled on the root");
        // At least 5 passes after the first.
        while profiler.passes() < 6 {
            profiler.sample();
        }
        compare_sim(
            &trainer,
            &profiler.profile(),
            &action_seconds,
            links.as_ref(),
            &step_seconds,
            procs.is_none(),
        )?;
    }
    Ok(())
}

/// The measured actions of every step of a run, on one clock, and its transitions.
struct WholeRun {
    clock: std::time::Instant,
    actions: Vec<pipewright_core::timeline::TimedAction>,
    marks: Vec<(f64, String)>,
    /// The most workers any plan of the run had.
    workers: usize,
}

impl WholeRun {
    /// Actions kept at most (about 100 bytes each in the trace).
    const CAP: usize = 2_000_000;

    fn step(&mut self, r: &pipewright_runtime::train::StepReport) {
        let offset = self.clock.elapsed().as_secs_f64() - r.seconds;
        let room = Self::CAP.saturating_sub(self.actions.len());
        self.actions.extend(r.actions.iter().take(room).map(|a| {
            let mut a = *a;
            a.start += offset;
            a.end += offset;
            a
        }));
    }

    fn mark(&mut self, label: &str, workers: usize) {
        self.marks
            .push((self.clock.elapsed().as_secs_f64(), label.to_string()));
        self.workers = self.workers.max(workers);
    }
}

/// Pipeline depth (stages) and replicas (the most hosts of a stage) of `plan`.
fn shape(plan: &pipewright_core::ir::Plan) -> (usize, usize) {
    let replicas = plan.stages.iter().map(|s| s.hosts.len()).max().unwrap_or(1);
    (plan.num_stages(), replicas)
}

/// The SkipPipe plan of `train --skip`: the model's own cost profile, the cluster (or
/// stages x replicas identical devices), a short deterministic search.
fn skip_train_plan(
    cfg: &TrainConfig,
    skip: f64,
    cluster: Option<&std::path::Path>,
) -> Result<pipewright_core::ir::Plan> {
    use pipewright_core::skipplan::{skip_plan, SkipSetup};
    let skip = crate::skip::skip_count(skip, cfg.stages)?;
    if cfg.replicas == 0 || cfg.microbatches == 0 {
        return Err(BadInput(
            "--skip: --replicas (data nodes) and --microbatches must be at least 1".into(),
        )
        .into());
    }
    let cluster = match cluster {
        Some(f) => Cluster::load(f)?,
        None => Cluster::uniform(cfg.stages.saturating_mul(cfg.replicas).min(1 << 16)),
    };
    let setup = SkipSetup {
        stages: cfg.stages,
        skip,
        data_nodes: cfg.replicas,
        microbatches: cfg.microbatches,
        max_swaps: 1,
        moves: 2000,
        time_limit: Duration::from_secs(30),
        seed: cfg.seed,
    };
    let r = skip_plan(&cfg.model.cost_profile(cfg.rows), &cluster, &setup)
        .map_err(|e| BadInput(e.to_string()))?;
    cfg.check_plan(&r.plan)?;
    Ok(r.plan)
}

/// Create `dir` if needed and make sure files can be written there, before any training.
fn check_writable_dir(dir: &std::path::Path) -> Result<()> {
    let bad = |e: std::io::Error| {
        BadInput(format!(
            "--checkpoint-dir {}: cannot write there: {e}",
            dir.display()
        ))
    };
    std::fs::create_dir_all(dir).map_err(bad)?;
    let probe = dir.join(format!(".write-test-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(bad)?;
    std::fs::remove_file(&probe).map_err(bad)?;
    Ok(())
}

/// A resumed run continues the metrics file from the resumed step: rows of later steps (from
/// the run that was cut short) are dropped, so no step appears twice.
fn cut_metrics(f: &std::path::Path, step: u64) -> Result<()> {
    let text = match std::fs::read_to_string(f) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(BadInput(format!("{}: cannot read: {e}", f.display())).into()),
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
    std::fs::write(&tmp, kept)
        .and_then(|_| std::fs::rename(&tmp, f))
        .with_context(|| format!("cannot rewrite {}", f.display()))
}

#[cfg(feature = "mpi")]
fn is_rank0(m: &Arc<pipewright_runtime::mpi::Mpi>) -> bool {
    m.world().rank == 0
}
#[cfg(not(feature = "mpi"))]
fn is_rank0(never: &std::convert::Infallible) -> bool {
    match *never {}
}

/// Measured action durations (seconds) by stage and op.
type ActionSeconds = std::collections::HashMap<(usize, Op), Vec<f64>>;

/// Simulate the trained plan on the profile measured during the run and print it beside the
/// measured iteration time, with each stage's costs beside its measured actions.
fn compare_sim(
    trainer: &Trainer,
    profile: &Profile,
    actions: &ActionSeconds,
    links: Option<&Cluster>,
    step_seconds: &[f64],
    threads: bool,
) -> Result<()> {
    let plan = &trainer.plan;
    let stages = profile.stage_costs(&plan.layers_per_stage());
    let cl = match links {
        Some(c) => devices_for_plan(plan, c)?,
        None => Cluster::uniform(plan.num_workers()),
    };
    let setup = SimSetup {
        plan,
        stages: &stages,
        cluster: &cl,
    };
    // In-process workers serialise their compute (burn's autodiff lock): simulate that.
    let shared = threads && plan.num_workers() > 1;
    let r = simulate_with(
        &setup,
        SimOptions {
            shared_compute: shared,
        },
    )?;
    let measured = &step_seconds[2..];
    let m = median(measured.to_vec());
    println!(
        "iteration time: simulated {:.4} s, measured {:.4} s (median of {} steps), measured/simulated {:.2}",
        r.iteration_time, m, measured.len(), m / r.iteration_time
    );
    // Where the difference comes from: each stage's costs beside its measured actions.
    let ms = |op: Op, s: usize| {
        actions.get(&(s, op)).map_or("-".to_string(), |v| {
            format!("{:.1}", 1e3 * median(v.clone()))
        })
    };
    for (s, c) in stages.iter().enumerate() {
        println!(
            "  stage {s}: ms simulated / measured (median action): F {:.1} / {}, BW {:.1} / {}, B {:.1} / {}, W {:.1} / {}",
            1e3 * c.forward,
            ms(Op::F, s),
            1e3 * c.full_backward(),
            ms(Op::BW, s),
            1e3 * c.backward_input,
            ms(Op::B, s),
            1e3 * c.backward_weight,
            ms(Op::W, s),
        );
    }
    if shared {
        let own = simulate(&setup)?;
        println!(
            "  simulated with the workers' compute serialised, as in-process workers run it (see crates/runtime/src/backend.rs); with a device each: {:.4} s (measured/simulated {:.2}), what --transport mpi gets",
            own.iteration_time, m / own.iteration_time
        );
    }
    Ok(())
}

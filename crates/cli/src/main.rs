//! `pipewright`: plan, simulate and run pipeline-parallel training.

use anyhow::{anyhow, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use pipewright_core::cluster::Cluster;
use pipewright_core::ir::Plan;
use pipewright_core::partition::{partition, split_for_plan, Objective, PartitionProblem};
use pipewright_core::planner::{search, Layout};
use pipewright_core::profile::{Profile, StageCost};
use pipewright_core::schedule::{generate, ScheduleKind};
use pipewright_core::sim::{check_memory, memory_peaks, simulate, SimSetup};
use pipewright_core::validate::validate;
use serde_json::json;
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(
    name = "pipewright",
    version,
    about = "Plan, simulate and run pipeline-parallel training of transformers."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a schedule and print it as a grid (step x worker), JSON or CSV.
    Schedule {
        #[command(flatten)]
        sched: SchedArgs,
        #[arg(long, value_enum, default_value = "grid")]
        format: Format,
    },
    /// Simulate a schedule on uniform costs or a profile + cluster: time, bubble, memory, links.
    Simulate(SimulateArgs),
    /// Cut a profile's layers into K stages and assign devices, minimising the bottleneck stage.
    Partition(PartitionArgs),
    /// Search depth, replicas, micro-batches, schedule and layout for a model on a cluster.
    Plan(PlanArgs),
    /// Train a GPT-style byte-level model with a pipeline plan (built-in corpus by default).
    Train(Box<TrainArgs>),
    /// Measure each layer block of the model on this machine and write a profile TOML.
    Profile(ProfileArgs),
    /// Check a plan file (JSON or CSV as written by `schedule`) and say what is wrong, if anything.
    Validate {
        /// Plan file (.json or .csv).
        file: PathBuf,
    },
}

#[derive(Args)]
struct PartitionArgs {
    /// Model profile TOML.
    #[arg(long)]
    profile: PathBuf,
    /// Number of stages K.
    #[arg(long)]
    stages: usize,
    /// Cluster TOML; without it, K identical devices joined by free links.
    #[arg(long)]
    cluster: Option<PathBuf>,
    /// Schedule whose in-flight activations count against device memory.
    #[arg(long, value_enum, default_value = "1f1b")]
    schedule: Kind,
    /// Micro-batches per iteration (default K).
    #[arg(long)]
    microbatches: Option<usize>,
    /// time: forward+backward on the device plus sending the cut; params: parameter bytes.
    #[arg(long, value_enum, default_value = "time")]
    objective: ObjectiveArg,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct TrainArgs {
    /// TOML with any TrainConfig fields (model, schedule, stages, ...); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Pipeline schedule (gpipe, 1f1b, interleaved, zbh1, zbv).
    #[arg(long)]
    schedule: Option<String>,
    /// Pipeline depth P (workers per pipeline).
    #[arg(long)]
    stages: Option<usize>,
    /// Stage chunks per worker (interleaved).
    #[arg(long)]
    chunks: Option<usize>,
    /// Data-parallel replicas D.
    #[arg(long)]
    replicas: Option<usize>,
    /// Micro-batches M per replica per step.
    #[arg(long)]
    microbatches: Option<usize>,
    /// Sequences per micro-batch.
    #[arg(long)]
    rows: Option<usize>,
    /// Optimizer steps.
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
    #[arg(long)]
    no_checkpoint: bool,
    /// Continue from the latest checkpoint in --checkpoint-dir.
    #[arg(long)]
    resume: bool,
    /// Write the last step's measured timeline as a Chrome trace.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Model width.
    #[arg(long)]
    d_model: Option<usize>,
    /// Transformer blocks.
    #[arg(long)]
    layers: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Sequence length.
    #[arg(long)]
    seq_len: Option<usize>,
    /// Emulate this cluster's links between workers (worker r on device r).
    #[arg(long)]
    cluster: Option<PathBuf>,
    /// After training, profile the model and print simulated vs measured iteration time.
    #[arg(long)]
    compare_sim: bool,
}

#[derive(Args)]
struct ProfileArgs {
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
}

#[derive(Args)]
struct PlanArgs {
    /// Model profile TOML.
    #[arg(long)]
    profile: PathBuf,
    /// Cluster TOML.
    #[arg(long)]
    cluster: PathBuf,
    /// Micro-batches per iteration over all replicas (profile micro-batch units).
    #[arg(long, default_value_t = 64)]
    global_batch: usize,
    /// Rows to print.
    #[arg(long, default_value_t = 8)]
    top: usize,
    /// Print JSON (all candidates, best first).
    #[arg(long)]
    json: bool,
    /// Write the winner's timeline (first replica) as SVG.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Write the winner's timeline (first replica) as a Chrome trace.
    #[arg(long)]
    trace: Option<PathBuf>,
}

#[derive(Copy, Clone, ValueEnum)]
enum ObjectiveArg {
    Time,
    Params,
}

#[derive(Copy, Clone, ValueEnum)]
enum Format {
    Grid,
    Json,
    Csv,
}

#[derive(Copy, Clone, ValueEnum)]
enum Kind {
    Gpipe,
    #[value(name = "1f1b")]
    OneFOneB,
    Interleaved,
    Zbh1,
    Zbv,
}

impl From<Kind> for ScheduleKind {
    fn from(k: Kind) -> Self {
        match k {
            Kind::Gpipe => ScheduleKind::GPipe,
            Kind::OneFOneB => ScheduleKind::OneFOneB,
            Kind::Interleaved => ScheduleKind::Interleaved,
            Kind::Zbh1 => ScheduleKind::ZbH1,
            Kind::Zbv => ScheduleKind::ZbV,
        }
    }
}

#[derive(Args)]
struct SchedArgs {
    /// Schedule to generate.
    #[arg(long, value_enum, default_value = "1f1b")]
    kind: Kind,
    /// Pipeline depth P: workers in the pipeline.
    #[arg(long, default_value_t = 4)]
    stages: usize,
    /// Micro-batches M per iteration.
    #[arg(long, default_value_t = 8)]
    microbatches: usize,
    /// Stage chunks per worker (interleaved: V, default 2; zbv: 2).
    #[arg(long)]
    chunks: Option<usize>,
}

impl SchedArgs {
    fn plan(&self) -> Result<Plan> {
        let kind: ScheduleKind = self.kind.into();
        let plan = generate(
            kind,
            self.stages,
            self.microbatches,
            self.chunks.unwrap_or(kind.default_chunks()),
        )?;
        validate(&plan).context("internal: generated plan does not validate")?;
        Ok(plan)
    }
}

#[derive(Args)]
struct SimulateArgs {
    #[command(flatten)]
    sched: SchedArgs,
    /// Forward cost per stage-chunk (uniform costs; default 1).
    #[arg(long, conflicts_with = "profile", allow_negative_numbers = true)]
    cost_f: Option<f64>,
    /// Input-gradient backward cost per stage-chunk (default 1).
    #[arg(long, conflicts_with = "profile", allow_negative_numbers = true)]
    cost_b: Option<f64>,
    /// Weight-gradient cost per stage-chunk (default 1); unsplit schedules run B+W as one.
    #[arg(long, conflicts_with = "profile", allow_negative_numbers = true)]
    cost_w: Option<f64>,
    /// Model profile TOML (FORMATS.md); layers are cut into stages by the exact partitioner.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Cluster TOML (FORMATS.md); worker i runs on the cluster's i-th device.
    #[arg(long, requires = "profile")]
    cluster: Option<PathBuf>,
    /// Simulate a plan file (JSON/CSV) instead of generating one.
    #[arg(long)]
    plan: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Write a Chrome trace (open in https://ui.perfetto.dev).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Write an SVG Gantt chart.
    #[arg(long)]
    svg: Option<PathBuf>,
}

/// Errors that are the user's input: exit 2.
#[derive(Debug)]
struct BadInput(String);
impl std::fmt::Display for BadInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for BadInput {}

fn main() {
    // Die quietly on a closed pipe (`pipewright ... | head`) like other command-line tools.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind::*;
            if matches!(
                e.kind(),
                DisplayHelp | DisplayVersion | DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                e.exit();
            }
            let text = e.to_string();
            let line: Vec<&str> = text
                .lines()
                .map(str::trim)
                .filter(|l| {
                    !l.is_empty()
                        && !l.starts_with("For more information")
                        && !l.starts_with("Usage:")
                })
                .collect();
            eprintln!("{} (see --help)", line.join(" "));
            std::process::exit(2);
        }
    };
    if let Err(e) = run(cli) {
        let bad = e
            .chain()
            .any(|c| c.is::<pipewright_core::Error>() || c.is::<BadInput>());
        eprintln!(
            "error: {}",
            e.chain()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(": ")
        );
        std::process::exit(if bad { 2 } else { 1 });
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Schedule { sched, format } => {
            let plan = sched.plan()?;
            match format {
                Format::Grid => print!("{}", plan.grid()),
                Format::Json => println!("{}", plan.to_json()),
                Format::Csv => print!("{}", plan.to_csv()),
            }
            Ok(())
        }
        Cmd::Simulate(a) => cmd_simulate(a),
        Cmd::Partition(a) => cmd_partition(a),
        Cmd::Plan(a) => cmd_plan(a),
        Cmd::Train(a) => cmd_train(*a),
        Cmd::Profile(a) => {
            let model = match &a.model {
                Some(f) => {
                    let text = std::fs::read_to_string(f)
                        .map_err(|e| BadInput(format!("{}: cannot read: {e}", f.display())))?;
                    pipewright_core::error::parse_toml::<pipewright_runtime::model::GptConfig>(
                        &f.display().to_string(),
                        &text,
                    )?
                }
                None => pipewright_runtime::model::GptConfig::default(),
            };
            model.check().map_err(BadInput)?;
            let prof =
                pipewright_runtime::profile::profile_model(&model, a.rows.max(1), a.repeats, 42);
            write_file(&a.out, &prof.to_toml())?;
            let (f, b): (f64, f64) = prof
                .layers
                .iter()
                .fold((0.0, 0.0), |(f, b), l| (f + l.forward, b + l.backward()));
            println!("{} layer blocks; forward {:.4} s, backward {:.4} s per micro-batch of {} sequences", prof.layers.len(), f, b, a.rows);
            Ok(())
        }
        Cmd::Validate { file } => {
            let plan = load_plan(&file)?;
            validate(&plan).map_err(|e| anyhow!(BadInput(format!("{}: {e}", file.display()))))?;
            println!(
                "{}: valid ({} workers, {} stages, {} micro-batches, {} actions)",
                file.display(),
                plan.num_workers(),
                plan.num_stages(),
                plan.num_microbatches,
                plan.workers.iter().map(Vec::len).sum::<usize>()
            );
            Ok(())
        }
    }
}

fn load_plan(file: &Path) -> Result<Plan> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| BadInput(format!("{}: cannot read: {e}", file.display())))?;
    let name = file.display().to_string();
    Ok(if file.extension().is_some_and(|e| e == "csv") {
        Plan::from_csv(&name, &text)?
    } else {
        Plan::from_json(&name, &text)?
    })
}

fn cmd_simulate(a: SimulateArgs) -> Result<()> {
    let plan = match &a.plan {
        Some(f) => {
            let p = load_plan(f)?;
            validate(&p).map_err(|e| BadInput(format!("{}: {e}", f.display())))?;
            p
        }
        None => a.sched.plan()?,
    };
    let p = plan.num_workers();
    for (flag, v) in [
        ("--cost-f", a.cost_f),
        ("--cost-b", a.cost_b),
        ("--cost-w", a.cost_w),
    ] {
        if let Some(v) = v {
            if !v.is_finite() || v < 0.0 {
                return Err(BadInput(format!("{flag} {v}: costs must be finite and >= 0")).into());
            }
        }
    }
    let (stages, cluster, split) = match &a.profile {
        Some(pf) => {
            let profile = Profile::load(pf)?;
            let cluster = match &a.cluster {
                Some(cf) => load_cluster_for(cf, p, "the plan")?,
                None => Cluster::uniform(p),
            };
            let (split, costs) = split_for_plan(&profile, &plan, &cluster)?;
            (costs, cluster, Some(split))
        }
        None => {
            let c = StageCost::uniform(
                a.cost_f.unwrap_or(1.0),
                a.cost_b.unwrap_or(1.0),
                a.cost_w.unwrap_or(1.0),
            );
            (vec![c; plan.num_stages()], Cluster::uniform(p), None)
        }
    };
    check_memory(&plan, &stages, &cluster)?;
    let r = simulate(&SimSetup {
        plan: &plan,
        stages: &stages,
        cluster: &cluster,
    })?;
    let title = format!(
        "{} | P={} M={} stages={} | makespan {:.4} | bubble {:.1}%",
        plan.kind,
        p,
        plan.num_microbatches,
        plan.num_stages(),
        r.makespan,
        100.0 * r.bubble_fraction
    );
    if let Some(f) = &a.trace {
        write_file(f, &r.timeline.to_chrome_trace())?;
    }
    if let Some(f) = &a.svg {
        write_file(f, &r.timeline.to_svg(&title))?;
    }
    if a.json {
        let mut j = serde_json::to_value(&r)?;
        j["schedule"] = json!(plan.kind);
        j["workers"] = json!(p);
        j["stages"] = json!(plan.num_stages());
        j["microbatches"] = json!(plan.num_microbatches);
        if let Some(s) = &split {
            j["layers_per_stage"] = json!(s.layers_per_stage);
        }
        println!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(());
    }
    println!("{title}");
    if let Some(s) = &split {
        println!("layers per stage: {:?}", s.layers_per_stage);
    }
    println!(
        "{:>7} {:>12} {:>8} {:>14} {:>16}",
        "worker", "busy", "util", "peak act", "peak act bytes"
    );
    for w in 0..p {
        println!(
            "{:>7} {:>12.4} {:>7.1}% {:>14} {:>16}",
            w,
            r.busy[w],
            100.0 * r.busy[w] / r.makespan.max(1e-12),
            r.peak_activations[w],
            r.peak_activation_bytes[w]
        );
    }
    for l in &r.links {
        println!(
            "link w{} -> w{}: {} bytes, busy {:.4}",
            l.from, l.to, l.bytes, l.busy
        );
    }
    let unit = r
        .timeline
        .actions
        .iter()
        .map(|x| x.end - x.start)
        .filter(|d| *d > 0.0)
        .fold(f64::INFINITY, f64::min);
    if unit.is_finite() && r.makespan / unit <= 160.0 {
        println!("\ntimeline (one column = {unit:.4}; F forward, B input grad, W weight grad, X full backward):");
        print!("{}", r.timeline.to_text(unit));
    }
    Ok(())
}

fn cmd_train(a: TrainArgs) -> Result<()> {
    use pipewright_runtime::data::Corpus;
    use pipewright_runtime::train::{TrainConfig, Trainer};
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
    if a.chunks.is_none() && a.config.is_none() {
        cfg.chunks = cfg.kind().map_err(BadInput)?.default_chunks();
    }
    let corpus = match &a.data {
        Some(f) => Corpus::load(f).map_err(BadInput)?,
        None => Corpus::builtin(),
    };
    corpus.check(cfg.model.seq_len).map_err(BadInput)?;
    let workers = cfg.replicas * cfg.stages;
    let cluster = match &a.cluster {
        Some(f) => Some(load_cluster_for(f, workers, "the run")?),
        None => None,
    };
    let transport: std::sync::Arc<dyn pipewright_runtime::transport::Transport> = match &cluster {
        Some(c) => pipewright_runtime::transport::InProcess::emulated(workers, c.clone()),
        None => pipewright_runtime::transport::InProcess::new(workers),
    };
    let mut trainer = Trainer::with_transport(cfg.clone(), transport).map_err(BadInput)?;
    if a.resume {
        trainer
            .load_checkpoint(&a.checkpoint_dir)
            .map_err(BadInput)?;
        eprintln!(
            "resumed from {} at step {}",
            a.checkpoint_dir.display(),
            trainer.step
        );
    }
    let baseline = corpus.unigram_baseline();
    eprintln!(
        "training gpt ({} blocks, d_model {}) on {}: {} x P={} (layer blocks per stage {:?}), D={}, M={}, {} steps; unigram baseline {:.3}", cfg.model.num_blocks(), cfg.model.d_model, corpus.name, cfg.schedule, cfg.stages, trainer.boundaries, cfg.replicas, cfg.microbatches, cfg.steps, baseline
    );
    let mut metrics = match &a.metrics {
        Some(f) => Some(std::io::BufWriter::new(
            // A resumed run continues the same metrics file.
            std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(a.resume)
                .truncate(!a.resume)
                .open(f)
                .with_context(|| format!("cannot write {}", f.display()))?,
        )),
        None => None,
    };
    let mut emit = |row: serde_json::Value| -> Result<()> {
        if let Some(m) = metrics.as_mut() {
            use std::io::Write;
            writeln!(m, "{row}")?;
            m.flush()?;
        }
        Ok(())
    };
    let first_val = trainer.evaluate(&corpus, a.eval_batches);
    emit(
        json!({"step": trainer.step, "loss": null, "val_loss": first_val, "val_perplexity": first_val.exp(), "tokens_per_s": null}),
    )?;
    let bar = indicatif::ProgressBar::new(cfg.steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} ETA {eta}")
            .expect("template"),
    );
    bar.set_position(trainer.step);
    let mut last = None;
    let mut step_seconds = Vec::new();
    let mut last_val = first_val;
    while trainer.step < cfg.steps {
        let r = trainer
            .train_step(&corpus)
            .map_err(|e| anyhow!("step {}: {e}", trainer.step + 1))?;
        let tps = r.tokens as f64 / r.seconds;
        let val = (r.step % a.eval_every.max(1) == 0 || r.step == cfg.steps)
            .then(|| trainer.evaluate(&corpus, a.eval_batches));
        if let Some(v) = val {
            last_val = v;
        }
        emit(
            json!({"step": r.step, "loss": r.loss, "val_loss": val, "val_perplexity": val.map(f64::exp), "tokens_per_s": tps, "lr": r.lr, "grad_norm": r.grad_norm, "busy": r.busy, "seconds": r.seconds}),
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
            trainer
                .save_checkpoint(&a.checkpoint_dir)
                .map_err(|e| anyhow!(e))?;
        }
        step_seconds.push(r.seconds);
        last = Some(r);
    }
    bar.finish();
    if !a.no_checkpoint {
        let p = trainer
            .save_checkpoint(&a.checkpoint_dir)
            .map_err(|e| anyhow!(e))?;
        eprintln!("checkpoint: {}", p.display());
    }
    if let (Some(f), Some(r)) = (&a.trace, &last) {
        write_file(f, &trainer.timeline(r).to_chrome_trace())?;
    }
    println!(
        "val loss {:.4} -> {:.4} (perplexity {:.2}; unigram baseline {:.4}) after {} steps",
        first_val,
        last_val,
        last_val.exp(),
        baseline,
        trainer.step
    );
    if a.compare_sim && step_seconds.len() > 2 {
        compare_sim(&trainer, cluster.as_ref(), &step_seconds)?;
    }
    Ok(())
}

/// Profile the model, simulate the same plan with the measured costs and print it beside the
/// measured iteration time.
fn compare_sim(
    trainer: &pipewright_runtime::train::Trainer,
    cluster: Option<&Cluster>,
    step_seconds: &[f64],
) -> Result<()> {
    let cfg = &trainer.cfg;
    let profile = pipewright_runtime::profile::profile_model(&cfg.model, cfg.rows, 5, cfg.seed);
    let stages = profile.stage_costs(&trainer.boundaries);
    let p = trainer.plan.num_workers();
    let cl = cluster.map_or_else(
        || Cluster::uniform(p),
        |c| c.subset(&(0..p).collect::<Vec<_>>()),
    );
    let r = simulate(&SimSetup {
        plan: &trainer.plan,
        stages: &stages,
        cluster: &cl,
    })?;
    let mut measured: Vec<f64> = step_seconds[2..].to_vec();
    measured.sort_by(f64::total_cmp);
    let m = measured[measured.len() / 2];
    let serial: f64 = r.busy.iter().sum();
    println!(
        "iteration time: simulated {:.4} s, measured {:.4} s (median of {} steps), measured/simulated {:.2}",
        r.makespan, m, measured.len(), m / r.makespan
    );
    println!(
        "  in-process workers serialise autodiff work (see crates/runtime/src/backend.rs); the compute-only bound for that is {:.4} s, measured/bound {:.2}",
        serial.max(r.makespan), m / serial.max(r.makespan)
    );
    Ok(())
}

fn cmd_plan(a: PlanArgs) -> Result<()> {
    let profile = Profile::load(&a.profile)?;
    let cluster = Cluster::load(&a.cluster)?;
    let t0 = std::time::Instant::now();
    let cands = search(&profile, &cluster, a.global_batch)?;
    let secs = t0.elapsed().as_secs_f64();
    let best = cands.first().filter(|c| c.iteration_time.is_some());
    if let Some(w) = best {
        let r = w.result.as_ref().expect("simulated");
        let title = format!(
            "plan: {} P={} x {} replicas, M={} | iteration {:.4} s | bubble {:.1}%",
            w.schedule,
            w.depth,
            w.replicas,
            w.microbatches,
            w.iteration_time.unwrap(),
            100.0 * w.bubble_fraction
        );
        if let Some(f) = &a.svg {
            write_file(f, &r.replicas[0].timeline.to_svg(&title))?;
        }
        if let Some(f) = &a.trace {
            write_file(f, &r.replicas[0].timeline.to_chrome_trace())?;
        }
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"candidates": cands, "search_seconds": secs}))?
        );
    } else {
        println!(
            "{} candidates for \"{}\" ({} layers) on {} devices, global batch {} micro-batches ({secs:.2} s)",
            cands.len(), profile.model.name, profile.layers.len(), cluster.len(), a.global_batch
        );
        println!(
            "{:>4} {:>5} {:>4} {:>4} {:>11} {:>14} {:>12} {:>7} {:>10}  lost because",
            "rank", "depth", "dp", "M", "schedule", "layout", "iteration s", "bubble", "peak GiB"
        );
        for (i, c) in cands.iter().take(a.top).enumerate() {
            let layout = match c.layout {
                Layout::PipelineMajor => "pipeline-major",
                Layout::ReplicaMajor => "replica-major",
            };
            let it = c
                .iteration_time
                .map_or("-".to_string(), |t| format!("{t:.4}"));
            println!(
                "{:>4} {:>5} {:>4} {:>4} {:>11} {:>14} {:>12} {:>6.1}% {:>10.2}  {}",
                i + 1,
                c.depth,
                c.replicas,
                c.microbatches,
                c.schedule,
                layout,
                it,
                100.0 * c.bubble_fraction,
                c.peak_memory_bytes as f64 / (1u64 << 30) as f64,
                if i == 0 && c.iteration_time.is_some() {
                    "winner"
                } else {
                    c.reason.as_str()
                }
            );
        }
        match best {
            Some(w) => println!(
                "winner: layers per stage {:?}; pipeline 0 on {}",
                w.layers_per_stage,
                w.devices[0].join(", ")
            ),
            None => {
                return Err(BadInput(format!(
                    "no candidate fits; the smallest: {}",
                    cands[0].reason
                ))
                .into())
            }
        }
    }
    Ok(())
}

fn cmd_partition(a: PartitionArgs) -> Result<()> {
    let profile = Profile::load(&a.profile)?;
    let cluster = match &a.cluster {
        Some(f) => Cluster::load(f)?,
        None => Cluster::uniform(a.stages.max(1)),
    };
    let kind: ScheduleKind = a.schedule.into();
    if kind.default_chunks() != 1 {
        return Err(BadInput(format!("partition places one stage per device; --schedule {kind} puts several on one (use gpipe, 1f1b or zbh1)")).into());
    }
    let m = a.microbatches.unwrap_or(a.stages);
    let in_flight = if a.stages == 0 {
        vec![]
    } else {
        let plan = generate(kind, a.stages, m, 1)?;
        memory_peaks(&plan, &vec![StageCost::default(); a.stages])
            .iter()
            .map(|p| p.microbatches)
            .collect()
    };
    let objective = match a.objective {
        ObjectiveArg::Time => Objective::Time,
        ObjectiveArg::Params => Objective::Params,
    };
    let r = partition(&PartitionProblem {
        profile: &profile,
        cluster: &cluster,
        stages: a.stages,
        objective,
        in_flight: in_flight.clone(),
    })?;
    let names: Vec<&str> = r
        .devices
        .iter()
        .map(|&d| cluster.devices[d].name.as_str())
        .collect();
    if a.json {
        let j = json!({
            "boundaries": r.split.layers_per_stage,
            "stage_cost": r.split.stage_cost,
            "bottleneck": r.split.bottleneck,
            "devices": names,
            "objective": match objective { Objective::Time => "time", Objective::Params => "params" },
            "exact": r.exact,
            "in_flight": in_flight,
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(());
    }
    let unit = if objective == Objective::Params {
        "bytes of parameters"
    } else {
        "s per micro-batch (forward + backward + send)"
    };
    println!(
        "{} layers of \"{}\" into {} stages; bottleneck {:.6} {unit}{}",
        profile.layers.len(),
        profile.model.name,
        a.stages,
        r.split.bottleneck,
        if r.exact {
            ""
        } else {
            " (heuristic device order: cluster too large for the exact search)"
        }
    );
    println!(
        "{:>6} {:>14} {:>18} {:>16}",
        "stage", "layers", "device", "cost"
    );
    let mut lo = 0;
    for (st, &n) in r.split.layers_per_stage.iter().enumerate() {
        let span = format!("{}..{} ({n})", lo, lo + n - 1);
        lo += n;
        let dev = if objective == Objective::Params {
            "-"
        } else {
            names[st]
        };
        println!(
            "{st:>6} {span:>14} {dev:>18} {:>16.6}",
            r.split.stage_cost[st]
        );
    }
    Ok(())
}

/// A cluster file's first `n` devices (worker i on device i), or an error if it has fewer.
fn load_cluster_for(path: &Path, n: usize, who: &str) -> Result<Cluster> {
    let c = Cluster::load(path)?;
    if c.len() < n {
        return Err(BadInput(format!(
            "{}: {} devices, but {who} needs {n} workers",
            path.display(),
            c.len()
        ))
        .into());
    }
    Ok(c.subset(&(0..n).collect::<Vec<_>>()))
}

/// Write via a temporary file and rename, so a failed write leaves no half file.
fn write_file(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp~");
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

//! `train`: run a plan on the real model.

use super::args::{SamplingArg, TrainArgs};
use super::sink::Progress;
use crate::files::{check_output, load_valid_plan, write_file, write_with};
use crate::BadInput;
use anyhow::Result;
use pipewright_core::cluster::Cluster;
use pipewright_core::plan::ir::Plan;
use pipewright_core::plan::validate::ValidPlan;
use pipewright_core::sim::devices_for_plan;
use pipewright_runtime::data::Sampling;
use pipewright_runtime::train::run::SimComparison;
use pipewright_runtime::train::{
    Checkpointing, PlanIn, RunConfig, RunSummary, TrainConfig, Trainer, TrainingRun,
};
use pipewright_runtime::train::{DeviceKind, TransportKind};
use std::path::{Path, PathBuf};
#[cfg(feature = "mpi")]
use std::sync::Arc;
use std::time::Duration;

/// This process's device: with `--gpus-per-node N`, the launcher's local rank r (Open MPI's,
/// MPICH's or Slurm's; 0 outside a launcher) takes discrete GPU r mod N, as torchrun gives
/// local rank r `cuda:r`.
fn device_choice(a: &TrainArgs) -> Result<pipewright_runtime::backend::DeviceChoice> {
    use pipewright_runtime::backend::DeviceChoice;
    match (a.run.device, a.run.gpus_per_node) {
        (DeviceKind::Cpu, None) => Ok(DeviceChoice::Cpu),
        (DeviceKind::Cpu, Some(_)) => {
            Err(BadInput("--gpus-per-node places ranks on GPUs: it needs --device wgpu".into()).into())
        }
        (_, Some(n)) if !(1..4096).contains(&n) => Err(BadInput(format!(
            "gpus_per_node is {n}: it must be at least 1 and below 4096"
        ))
        .into()),
        (DeviceKind::Wgpu, Some(n)) if n > 1 && a.run.transport == TransportKind::Threads => Err(BadInput(format!(
            "--gpus-per-node {n}: threads share one process's device; worker processes (--transport auto or mpi) take one GPU each"
        ))
        .into()),
        (DeviceKind::Wgpu, n) => Ok(DeviceChoice::Wgpu(
            n.map(|n| crate::ranks::local_rank().unwrap_or(0) % n),
        )),
    }
}

/// The settings a run starts from: the config file; with --resume and no config file, the
/// checkpoint's own (so a resume needs no flags repeated); else the defaults.
fn base_config(a: &TrainArgs) -> Result<TrainConfig> {
    Ok(match &a.config {
        Some(f) => {
            let text = pipewright_core::inputs::read_file(f)?;
            let name = f.display().to_string();
            // The [run] table is train::settings' (the runtime's RunSettings).
            pipewright_core::error::parse_toml_split::<TrainConfig, toml::Table>(
                &name, &text, "run",
            )?
            .0
        }
        // An unreadable checkpoint is the resume's to report.
        None if a.run.resume => pipewright_runtime::train::checkpoint_config(&a.checkpoint_dir())
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
    if !a.run.resume || a.config.is_some() {
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

/// A learning rate below the schedule's floor takes the floor down with it (to a tenth of it,
/// the defaults' ratio) unless --min-lr says otherwise: a fine-tune's --lr 5e-5 alone.
fn lower_lr_floor(a: &TrainArgs, cfg: &mut TrainConfig) {
    if a.lr.is_some() && a.min_lr.is_none() && cfg.min_lr > cfg.lr {
        cfg.min_lr = cfg.lr / 10.0;
    }
}

/// --epochs over --steps, --warmup-ratio over --warmup (and each the other way), and
/// --lr-schedule: one of each pair stays in the settings.
fn schedule_words(a: &TrainArgs, cfg: &mut TrainConfig) {
    if a.steps.is_some() {
        cfg.epochs = None;
    }
    if a.epochs.is_some() {
        cfg.epochs = a.epochs;
    }
    if a.warmup.is_some() {
        cfg.warmup_ratio = None;
    }
    if a.warmup_ratio.is_some() {
        cfg.warmup_ratio = a.warmup_ratio;
    }
    if let Some(s) = a.lr_schedule {
        cfg.lr_schedule = s;
    }
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
    lower_lr_floor(a, &mut cfg);
    schedule_words(a, &mut cfg);
    if let Some(g) = a.run.global_batch {
        if g == 0 || g % cfg.replicas != 0 {
            return Err(BadInput(format!(
                "--global-batch {g}: expected a positive multiple of the {} replicas (each replica runs global batch / replicas micro-batches)",
                cfg.replicas
            ))
            .into());
        }
        cfg.microbatches = g / cfg.replicas;
    }
    let chosen = a.model.resolve()?;
    // The built-in model, sized by nobody: not a --model, a configuration's or a checkpoint's.
    let unsized_model = chosen.is_none() && a.config.is_none() && !a.run.resume;
    if let Some(chosen) = chosen {
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
        // Its embedding takes the tokenizer's vocabulary (`train --tokenizer gpt2` trains a
        // GPT over GPT-2's tokens).
        if unsized_model {
            cfg.model.vocab = crate::model::tokenizer(&cfg)?.vocab_size();
        }
    }
    // --data and its companions, else the configuration file's [data].
    let data = a.data.resolve(cfg.data.as_ref());
    cfg.data = data.source();
    macro_rules! set_model {
        ($($f:ident),*) => { $(if let Some(v) = a.$f { cfg.model.$f = v; })* };
    }
    set_model!(d_model, layers, heads, seq_len);
    sampling(a, data.task, &mut cfg)?;
    if a.chunks.is_none() && a.schedule.is_some() {
        cfg.chunks = cfg.schedule.default_chunks();
    }
    if unsized_model && a.layers.is_none() && a.run.plan.is_none() {
        grow_to_the_plan(&mut cfg);
    }
    if a.run.eval_every == 0 || a.run.eval_batches == 0 {
        return Err(BadInput("--eval-every and --eval-batches must be at least 1".into()).into());
    }
    as_trained(&cfg)?.check()?;
    Ok(cfg)
}

/// The built-in model, sized by nobody, grows to give each chunk of a generated plan a layer
/// block: DualPipeV or ZB-V on 4 workers cut 8 stages, the built-in model has 6 blocks. Only
/// for the chunks: more workers than blocks stays an error, as does a model past 64 blocks.
/// Said once, by the process that speaks for the job.
fn grow_to_the_plan(cfg: &mut TrainConfig) {
    let stages = cfg.stages.saturating_mul(cfg.chunks);
    let blocks = cfg.model.num_blocks();
    if stages <= blocks || cfg.stages > blocks || stages > 66 {
        return;
    }
    let speaks = !crate::launch::launched() && crate::ranks::RANK.get().is_none_or(|&r| r == 0);
    if speaks {
        eprintln!(
            "the built-in model: {} transformer blocks instead of {}, so that each of the plan's {stages} stages ({} chunks on each of {} workers) holds a layer block (--layers sets them)",
            stages - 2,
            cfg.model.layers,
            cfg.chunks,
            cfg.stages
        );
    }
    cfg.model.layers = stages - 2;
}

/// How steps draw their data: `--sampling` (checked against the task and the cache) and
/// `--bucket` (a task's examples only).
fn sampling(a: &TrainArgs, task: crate::data::Task, cfg: &mut TrainConfig) -> Result<()> {
    match (a.sampling, a.run.cache_budget.is_some()) {
        (Some(SamplingArg::Windows), _) if task != crate::data::Task::Lm => {
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
    if a.bucket {
        if task == crate::data::Task::Lm {
            return Err(BadInput(
                "--bucket groups a task's examples by length; a text's windows all have --seq-len tokens (give --task classify or qa)".into(),
            )
            .into());
        }
        cfg.bucket = true;
    }
    Ok(())
}

/// `cfg` as it will train: a bare encoder (a `BertModel` directory: no head yet) with the
/// head its task gives it when the data opens. With no task (language modelling) a family that
/// has no LM head is refused here.
fn as_trained(cfg: &TrainConfig) -> Result<std::borrow::Cow<'_, TrainConfig>> {
    use pipewright_runtime::data::source::Task;
    use pipewright_runtime::model::{registry, TaskHead};
    let task = cfg.data.as_ref().map_or(Task::Lm, |d| d.task);
    let head = match (cfg.model.head, task) {
        (None, Task::Classify) => TaskHead::Classify { classes: 2 },
        (None, Task::Qa) => TaskHead::Span,
        (None, Task::Lm) if registry::spec(cfg.model.family).task_only => {
            return Err(BadInput(format!(
                "--model: this {} model has no task head and no LM head (a bare encoder); fine-tune it with --task classify or --task qa",
                cfg.model.family.name()
            ))
            .into())
        }
        _ => return Ok(std::borrow::Cow::Borrowed(cfg)),
    };
    let mut probe = cfg.clone();
    probe.model = probe.model.with_head(Some(head));
    Ok(std::borrow::Cow::Owned(probe))
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

/// Is this process the job's root: no MPI, or MPI's rank 0?
fn is_root(procs: &Procs) -> bool {
    #[cfg(feature = "mpi")]
    return procs.as_ref().is_none_or(|m| m.world().rank == 0);
    #[cfg(not(feature = "mpi"))]
    return procs.is_none();
}

/// Start MPI if asked (before anything that may fail, so errors can be printed by rank 0 only).
fn start_transport(a: &TrainArgs) -> Result<Procs> {
    for (flag, secs) in [
        ("--peer-timeout", a.run.peer_timeout),
        ("--startup-timeout", a.run.startup_timeout),
    ] {
        if !(secs.is_finite() && secs > 0.0 && secs <= 1e6) {
            return Err(BadInput(format!(
                "{flag} {secs:?}: expected seconds between 0 and 1000000"
            ))
            .into());
        }
    }
    pipewright_runtime::transport::set_startup_timeout(Duration::from_secs_f64(
        a.run.startup_timeout,
    ));
    let launched = crate::ranks::launcher_tasks().is_some();
    if a.run.transport == TransportKind::Auto && !launched {
        return Ok(None);
    }
    if a.run.transport == TransportKind::Threads {
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
        let m = pipewright_runtime::transport::mpi::Mpi::start(Duration::from_secs_f64(
            a.run.peer_timeout,
        ))
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
    if a.run.cluster.is_some() || !a.run.switch_plan.is_empty() {
        return Ok(());
    }
    let workers = worker_count(a, cfg)?;
    if workers < 2 {
        return Ok(());
    }
    let why = crate::launch::why_threads().unwrap_or_else(|| crate::launch::relaunch(workers));
    eprintln!(
        "note: the {workers} workers run as threads in this process, which is slower than processes: {why}"
    );
    Ok(())
}

/// What MKL would give an Intel CPU where it is not installed, with the command that installs it.
const MKL_HINT: &str = "MKL ran single-threaded products 24% faster than Debian's OpenBLAS on an Intel Xeon: `scripts/install-deps --mkl` installs it";

/// The workers of the plan to train, the job checked without building its plan: a plan
/// file's, else a worker per stage of each replica (the route search of `--skip` runs once,
/// in the job itself).
fn worker_count(a: &TrainArgs, cfg: &TrainConfig) -> Result<usize> {
    if a.run.plan.is_some() {
        return Ok(train_plan(a, cfg)?.0.num_workers());
    }
    let skip = a.run.skip.map(|k| skip_count(cfg, k)).transpose()?;
    // Skip routes on identical devices have the pipeline's workers (`--cluster` stays threads).
    as_trained(cfg)?
        .check_job(skip)?
        .ok_or_else(|| BadInput("--stages x --replicas is past the largest count".into()).into())
}

/// `train`, and when it fails (a worker or peer failed, a write failed: not bad input, which
/// writes nothing) its last error also in `last-error.txt` beside the checkpoints: a batch job's
/// log may be gone, the checkpoints are not.
pub fn cmd_train(a: TrainArgs) -> Result<()> {
    let a = super::settings::apply(a)?;
    let dir = (!a.run.no_checkpoint).then(|| a.checkpoint_dir());
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
        struct Run<'a> {
            run: &'a pipewright_runtime::train::RunSettings,
        }
        let run = Run { run: &a.run };
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
    pipewright_runtime::backend::choose_device(device_choice(&a)?).map_err(|e| BadInput(e.0))?;
    let procs = start_transport(&a)?;
    let mut cfg = config(&a)?;
    if procs.is_none() && a.run.transport == TransportKind::Auto {
        as_processes(&a, &cfg)?;
    }
    // After the relaunch, so that a launcher process holds no GPU context while its workers
    // train; the ranks agree on a failure with the plan's checks (none waits for a peer).
    let started = start_device(&a, is_root(&procs));
    let data = a.data.resolve(cfg.data.as_ref());
    let corpus = crate::data::corpus(&data, &mut cfg)?;
    let checked = started
        .and_then(|()| check_flags(&a, &cfg, procs.is_some()))
        .and_then(|()| fits_a_step(&a, &cfg, &corpus));
    let (plan, plan_note) = agree(&procs, checked, || train_plan(&a, &cfg))?;
    let links = links(&a, plan.plan())?;
    let run_cfg = run_config(&a, &cfg, links.as_ref())?;
    let mut trainer = trainer(&procs, cfg, plan, links, &run_cfg, a.run.peer_timeout)?;
    trainer.run_settings = Some(a.run.clone());
    let mut run = TrainingRun::new(trainer, corpus, run_cfg)?;
    let mut sink = Progress::new(&a, run.trainer.is_root());
    sink.plan_note = plan_note;
    if procs.is_none() {
        use pipewright_runtime::machine::{blas_lib, env_switch};
        if let (_, Some(note)) = env_switch(blas_lib::SPLIT_VAR) {
            eprintln!("{note}: products are split as by default");
        }
        // The library says how MKL would help in words; the command line names the script.
        let note = blas_lib::split_note().map(|n| n.replace(blas_lib::MKL_HINT, MKL_HINT));
        sink.placement = note.map(|n| format!("workers: threads of this process; {n}"));
    }
    #[cfg(feature = "mpi")]
    if let Some(m) = procs.as_ref().filter(|_| run.trainer.is_root()) {
        sink.placement = Some(crate::launch::placement_note(m.world().size));
    }
    if let Some(name) = pipewright_runtime::backend::device_name().filter(|_| run.trainer.is_root())
    {
        // In-process workers' CPU threading says nothing of a GPU run: the device line
        // replaces it; worker processes keep their placement line above it.
        let (line, first) = device_lines(&name);
        sink.placement = Some(match (sink.placement.take(), procs.is_some()) {
            (Some(workers), true) => format!("{workers}\n{line}"),
            _ => line,
        });
        sink.first_step = Some(first);
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
        crate::ranks::finish_within(m, Duration::from_secs_f64(a.run.peer_timeout));
    }
    reported
}

/// The run header's line for a wgpu device, and what its first step does (Mesa's lavapipe, a
/// Vulkan device on the CPU, names itself `llvmpipe`).
fn device_lines(name: &str) -> (String, String) {
    let lavapipe = name.contains("llvmpipe");
    let what = match lavapipe {
        true => "Mesa's lavapipe, a Vulkan device on the CPU: a correctness target, not a fast one",
        false => "through wgpu",
    };
    let line = format!("device: {name} ({what}); the model's operations run there, step 1 first compiles its shaders");
    let first = match lavapipe {
        true => "compiling shaders (about 100 s on lavapipe)",
        false => "compiling shaders",
    };
    (line, first.to_string())
}

/// A generated plan's step fits the data, checked before any collective: every rank finds the
/// same, and they agree on it with the plan (a rank that failed later, inside the run's set-up,
/// could leave a peer waiting in a collective it had finished). `TrainingRun::new` checks any
/// plan again.
fn fits_a_step(
    a: &TrainArgs,
    cfg: &TrainConfig,
    corpus: &pipewright_runtime::data::Corpus,
) -> Result<()> {
    if a.run.plan.is_some() || a.run.skip.is_some() {
        return Ok(());
    }
    let mbs = cfg.microbatches.saturating_mul(cfg.replicas);
    match cfg.sampler().steps_per_epoch(&corpus.train, mbs) {
        Ok(_) => Ok(()),
        Err(e) => Err(BadInput(format!("{}: {e}", corpus.name)).into()),
    }
}

/// Starts `--device wgpu`'s device (the CPU needs no start), or says plainly why it did not.
/// Without a desktop session Mesa's Vulkan drivers print `error: XDG_RUNTIME_DIR is invalid or
/// not set` as the device starts: the root says first that it is harmless.
fn start_device(a: &TrainArgs, root: bool) -> Result<()> {
    if a.run.device != DeviceKind::Wgpu {
        return Ok(());
    }
    if root && std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        eprintln!("starting the wgpu device: with no desktop session Mesa's Vulkan drivers print \"error: XDG_RUNTIME_DIR is invalid or not set\"; harmless, training opens no window");
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
    if a.run.compare_sim && cfg.steps < 3 {
        return bad("--compare-sim needs at least 3 steps (the first two are left out as warm-up)");
    }
    if a.run.keep == 0 {
        return bad("--keep must be at least 1");
    }
    if a.run.cluster.is_some() && mpi {
        return bad("--cluster emulates links between threads; over MPI the network is real (drop --cluster)");
    }
    if !a.run.switch_plan.is_empty() && a.run.elastic {
        return bad(
            "--switch-plan and --elastic both change the plan during the run: use one of them",
        );
    }
    for f in a
        .run
        .metrics
        .iter()
        .chain(&a.run.trace)
        .chain(&a.run.svg)
        .chain(&a.run.compare_svg)
    {
        check_output(f)?;
    }
    if let Some(d) = a
        .run
        .tensorboard
        .as_ref()
        .filter(|_| crate::ranks::RANK.get().is_none_or(|&r| r == 0))
    {
        check_writable_dir("--tensorboard", d)?;
    }
    if !a.run.no_checkpoint && crate::ranks::RANK.get().is_none_or(|&r| r == 0) {
        check_writable_dir("--checkpoint-dir", &a.checkpoint_dir())?;
        note_replaced(a);
    }
    Ok(())
}

/// The plan to train: a plan file, SkipPipe routes, or the schedule flags' pipeline.
/// The plan to train, and a line for the run header on how it was made (a route search).
fn train_plan(a: &TrainArgs, cfg: &TrainConfig) -> Result<(ValidPlan, Option<String>)> {
    match (&a.run.plan, a.run.skip) {
        (Some(f), _) => {
            let plan = load_valid_plan(f)?;
            cfg.check_plan(&plan)
                .map_err(|e| BadInput(format!("{}: {e}", f.display())))?;
            Ok((plan, None))
        }
        (None, Some(k)) => skip_train_plan(cfg, k, a.run.cluster.as_deref()),
        (None, None) => Ok((cfg.plan()?, None)),
    }
}

/// Only rank 0 builds the plan (a route search runs once per job, and a search stopped by
/// its time cap cannot differ between ranks); the others train the plan it sends. A rank 0
/// whose checks failed sends nothing: every rank then ends with it (rank 0 says why) instead
/// of waiting for it in this collective until the launcher kills them.
fn agree(
    procs: &Procs,
    checked: Result<()>,
    build: impl FnOnce() -> Result<(ValidPlan, Option<String>)>,
) -> Result<(PlanIn, Option<String>)> {
    let Some(m) = procs else {
        let (plan, note) = checked.and_then(|()| build())?;
        return Ok((plan.into(), note));
    };
    #[cfg(feature = "mpi")]
    {
        use pipewright_runtime::transport::Transport;
        let world = m.world();
        let (built, checked) = match world.rank {
            0 => (Some(checked.and_then(|()| build())), Ok(())),
            _ => (None, checked),
        };
        let part = match &built {
            Some(Ok((p, _))) => p.to_json().into_bytes(),
            _ => Vec::new(),
        };
        let parts = m
            .all_gather(world.rank, part)
            .map_err(|e| anyhow::anyhow!("agreeing on rank 0's plan: {e}"))?;
        if let Some(built) = built {
            let (plan, note) = built?;
            let note = note.map(|n| format!("{n}; sent to the other {} ranks", world.size - 1));
            return Ok((plan.into(), note));
        }
        checked?;
        if parts[0].is_empty() {
            return Err(BadInput("rank 0 refused this run (its message says why)".into()).into());
        }
        let text = String::from_utf8_lossy(&parts[0]);
        // Validated again here: it came over the wire.
        Ok((Plan::from_json("rank 0's plan", &text)?.into(), None))
    }
    #[cfg(not(feature = "mpi"))]
    match (*m, checked, build) {}
}

/// `--cluster`'s devices for the plan's workers, whose links the threads emulate.
fn links(a: &TrainArgs, plan: &Plan) -> Result<Option<Cluster>> {
    let Some(f) = &a.run.cluster else {
        return Ok(None);
    };
    let c = Cluster::load(f)?;
    devices_for_plan(plan, &c).map_err(|e| BadInput(format!("{}: {e}", f.display())))?;
    Ok(Some(c))
}

/// What the run does around its steps, from the flags.
fn run_config(a: &TrainArgs, cfg: &TrainConfig, links: Option<&Cluster>) -> Result<RunConfig> {
    if a.run.eval_every == 0 || a.run.eval_batches == 0 {
        return Err(BadInput("--eval-every and --eval-batches must be at least 1".into()).into());
    }
    Ok(RunConfig {
        eval_every: a.run.eval_every,
        eval_batches: a.run.eval_batches,
        checkpoints: (!a.run.no_checkpoint).then(|| Checkpointing {
            dir: a.checkpoint_dir(),
            every: a.run.checkpoint_every,
            keep: a.run.keep,
            overwrite: a.run.overwrite || (a.run.checkpoint_dir.is_none() && !a.run.resume),
        }),
        keep_best: a.run.keep_best,
        early_stop: a.run.early_stop,
        resume_from: a.run.resume.then(|| a.checkpoint_dir()),
        resume_note: resume_note(a, cfg)?,
        switches: switches(a, cfg, links)?,
        freeze: crate::freeze::settings(&a.run)?,
        cache: crate::freeze::cache(&a.run)?,
        compare_sim: a.run.compare_sim,
        trace: a.run.trace.is_some() || a.run.svg.is_some() || a.run.compare_svg.is_some(),
        stop: Some(&crate::ranks::STOP_REQUESTED),
    })
}

/// `--switch-plan STEP:FILE`s, each plan loaded and checked against the run.
fn switches(a: &TrainArgs, cfg: &TrainConfig, links: Option<&Cluster>) -> Result<Vec<(u64, Plan)>> {
    let mut out = Vec::new();
    for s in &a.run.switch_plan {
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
        // (With --epochs the last step is known only with the data: the run checks it then.)
        if step == 0 || (step >= cfg.steps && cfg.epochs.is_none()) {
            return Err(BadInput(format!(
                "--switch-plan {s:?}: step {step} is not between 1 and {} (the run's last step is {})",
                cfg.steps.saturating_sub(1),
                cfg.steps
            ))
            .into());
        }
        out.push((step, next.into_plan()));
    }
    Ok(out)
}

/// The trainer: threads in this process, or this rank's worker of an MPI job.
fn trainer(
    procs: &Procs,
    cfg: TrainConfig,
    plan: PlanIn,
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
        let workers = plan.plan().num_workers();
        if w.size != workers {
            // The fix in the launcher's own words: srun's task count, else mpirun's.
            let srun = std::env::var_os("SLURM_STEP_NUM_TASKS").is_some();
            let launch = if srun { "srun -n" } else { "mpirun -np" };
            return Err(BadInput(format!(
                "the plan has {workers} workers but MPI started {} ranks: launch with `{launch} {workers}`",
                w.size,
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

/// What the root prints and writes once training is done.
fn report(a: &TrainArgs, run: &mut TrainingRun, s: &RunSummary) -> Result<()> {
    if let (Some(f), Some(tl)) = (&a.run.trace, &s.timeline) {
        write_with(f, |mut w| tl.write_chrome_trace(&mut w))?;
    }
    if let (Some(f), Some(tl)) = (&a.run.svg, &s.timeline) {
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
    if a.run.compare_sim {
        if s.steps_run < 3 {
            return Err(BadInput(format!(
                "--compare-sim: this run took {} steps after resuming; it needs at least 3",
                s.steps_run
            ))
            .into());
        }
        let c = run.sim_comparison()?;
        print_sim_comparison(&c);
        if let (Some(f), Some(tl)) = (&a.run.compare_svg, &s.timeline) {
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
/// `--skip`'s stages skipped per micro-batch, with the sizes a skip job needs.
fn skip_count(cfg: &TrainConfig, skip: f64) -> Result<usize> {
    let skip = crate::skip::skip_count(skip, cfg.stages)?;
    if cfg.replicas == 0 || cfg.microbatches == 0 {
        return Err(BadInput(
            "--skip: --replicas (data nodes) and --microbatches must be at least 1".into(),
        )
        .into());
    }
    Ok(skip)
}

fn skip_train_plan(
    cfg: &TrainConfig,
    skip: f64,
    cluster: Option<&Path>,
) -> Result<(ValidPlan, Option<String>)> {
    let skip = skip_count(cfg, skip)?;
    let cluster = cluster.map(Cluster::load).transpose()?;
    let r = cfg.skip_plan(skip, cluster.as_ref())?;
    if r.time_limit_hit {
        eprintln!(
            "note: the route search stopped at its {} s cap after {} moves: this plan depends on the machine's speed",
            cfg.skip_search.time_limit, r.moves
        );
    }
    let note = format!(
        "routes: searched once, in this process ({} moves, {:.1} s)",
        r.moves, r.seconds
    );
    Ok((r.plan, Some(note)))
}

/// Create `dir` if needed and make sure files can be written there, before any training.
/// A fresh run in the default checkpoint directory replaces an earlier run's checkpoints:
/// said once, before they go.
fn note_replaced(a: &TrainArgs) {
    if a.run.checkpoint_dir.is_some() || a.run.resume {
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

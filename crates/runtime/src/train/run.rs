//! A training run as a library: the step loop with its cadences (evaluation, checkpoints,
//! metrics, freeze decisions), resume, plan switches and `--compare-sim`'s profiling, driven by
//! a [`RunConfig`] and reporting to a [`RunSink`]. The CLI is one user of it; `examples/` has
//! another.

use super::freeze::{FreezeController, FreezeSettings};
use super::settings::Metric;
use super::{describe, StepReport, Trainer, Validation};
use crate::cache::{CacheStats, PrefixCache};
use crate::data::{Corpus, Sampling};
use crate::error::{Error, Result};
use crate::profile::{median, Profiler};
use pipewright_core::cluster::Cluster;
use pipewright_core::plan::ir::{Op, Plan};
use pipewright_core::sim::timeline::{TimedAction, TimedSpan, Timeline};
use pipewright_core::sim::{devices_for_plan, simulate, simulate_with, SimOptions, SimSetup};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Where and how often checkpoints are written.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpointing {
    pub dir: PathBuf,
    /// Every this many steps (0: only at the end).
    pub every: u64,
    /// The newest checkpoints kept in `dir`.
    pub keep: usize,
    /// Remove the checkpoints already in `dir` (an earlier run's) before the first step.
    pub overwrite: bool,
}

/// A fresh run does not mix its checkpoints with an earlier run's: pruning by step would
/// delete some of each, and a later fallback could resume the other run.
fn fresh_dir(dir: &std::path::Path) -> Result<()> {
    match super::store::list(dir).last() {
        None => Ok(()),
        Some(((step, _), _)) => Err(Error::EarlierRun {
            dir: dir.to_path_buf(),
            step: *step,
        }),
    }
}

/// The root takes the checkpoint directory for this run (lock, then overwrite or check it is
/// fresh). Over MPI every rank learns whether that worked: a refused root exits with its
/// message, and the others exit with it instead of waiting for it in the first collective.
fn take_checkpoint_dir(
    trainer: &mut Trainer,
    cfg: &RunConfig,
) -> Result<Option<super::store::DirLock>> {
    let Some(c) = &cfg.checkpoints else {
        return Ok(None);
    };
    trainer.keep_checkpoints = c.keep;
    let taken = match trainer.is_root() {
        true => super::store::lock(&c.dir).and_then(|lock| {
            let best = c.dir.join(BEST_DIR);
            if cfg.keep_best.is_some() && best.symlink_metadata().is_ok_and(|m| !m.is_dir()) {
                return Err(Error::checkpoint(
                    &best,
                    "exists and is not a directory; it would keep the best validation's checkpoint",
                ));
            }
            if c.overwrite {
                super::store::remove_all(&c.dir)?;
            } else if cfg.resume_from.is_none() {
                fresh_dir(&c.dir)?;
            }
            Ok(Some(lock))
        }),
        false => Ok(None),
    };
    if trainer.is_distributed() && trainer.any(taken.is_err())? && taken.is_ok() {
        return Err(Error::checkpoint(
            &c.dir,
            "rank 0 refused this checkpoint directory (its message says why)",
        ));
    }
    taken
}

/// What a run does besides training steps.
#[derive(Clone)]
pub struct RunConfig {
    /// Validate every this many steps (and before the first and after the last).
    pub eval_every: u64,
    /// Held-out micro-batches per validation.
    pub eval_batches: usize,
    /// `None`: no checkpoints.
    pub checkpoints: Option<Checkpointing>,
    /// Keep the best validation's checkpoint by this metric in `checkpoints`' [`BEST_DIR`].
    pub keep_best: Option<Metric>,
    /// Stop after this many validations in a row without a better one.
    pub early_stop: Option<u64>,
    /// Continue from the newest checkpoint that verifies in this directory.
    pub resume_from: Option<PathBuf>,
    /// Said after a resume loads (for example which settings differ from the checkpoint's).
    pub resume_note: Option<String>,
    /// Switch to another plan after a step: (step, plan).
    pub switches: Vec<(u64, Plan)>,
    /// AutoFreeze (and AutoPipe + AutoDP when elastic); `None`: nothing freezes.
    pub freeze: Option<FreezeSettings>,
    /// AutoCache: the frozen prefix's outputs per sample (needs epoch sampling and `freeze`).
    pub cache: Option<Arc<PrefixCache>>,
    /// Profile the model after every step, for [`TrainingRun::sim_comparison`].
    pub compare_sim: bool,
    /// Keep the measured timeline: the last step's, or with freezing the whole run's.
    pub trace: bool,
    /// When this is set (a signal handler's flag: preemption), the run stops at the next step
    /// boundary, every process at the same one, and writes its checkpoint.
    pub stop: Option<&'static AtomicBool>,
}

impl Default for RunConfig {
    fn default() -> Self {
        let run = super::RunSettings::default();
        RunConfig {
            eval_every: run.eval_every,
            eval_batches: run.eval_batches,
            checkpoints: None,
            keep_best: None,
            early_stop: None,
            resume_from: None,
            resume_note: None,
            switches: Vec::new(),
            freeze: None,
            cache: None,
            compare_sim: false,
            trace: false,
            stop: None,
        }
    }
}

/// What a run reports, as it happens. Only the root process (rank 0) reports.
pub trait RunSink {
    /// Before the first step, after any resume.
    fn start(&mut self, _start: &RunStart) -> Result<()> {
        Ok(())
    }
    /// A line for the log: resume, freezing, re-plans, checkpoints, warnings.
    fn note(&mut self, _text: &str) {}
    /// After every step.
    fn step(&mut self, _row: &StepRow) -> Result<()> {
        Ok(())
    }
}

/// A sink that reports nothing.
pub struct Quiet;
impl RunSink for Quiet {}

/// The run as it starts.
#[derive(Debug, Clone)]
pub struct RunStart {
    /// One line: model, data, plan, steps.
    pub header: String,
    /// Steps already done (a resume's step, else 0) and in all.
    pub step: u64,
    pub steps: u64,
    /// Validation loss before the first step of this run (and a task's accuracy).
    pub val_loss: f64,
    pub accuracy: Option<f64>,
    pub f1: Option<f64>,
    /// The step a resume continued from.
    pub resumed: Option<u64>,
    /// The loss of the data's baseline (unigram, class prior, position prior), and its name.
    pub baseline: (f64, &'static str),
}

impl RunStart {
    /// The metrics row of the starting point (a fresh run's step 0).
    pub fn to_json(&self) -> Value {
        // A task's loss has no perplexity worth the name: it is left out.
        let ppl = self.accuracy.is_none().then(|| self.val_loss.exp());
        json!({"step": self.step, "loss": null, "val_loss": self.val_loss, "val_perplexity": ppl, "accuracy": self.accuracy, "f1": self.f1, "tokens_per_s": null, "baseline": self.baseline.0, "baseline_name": self.baseline.1})
    }
}

/// One step as the sinks see it.
pub struct StepRow<'a> {
    pub report: &'a StepReport,
    pub steps: u64,
    /// This step's validation loss (and a task's accuracy), if it validated.
    pub val_loss: Option<f64>,
    pub accuracy: Option<f64>,
    pub f1: Option<f64>,
    /// The latest validation loss, and accuracy.
    pub last_val: f64,
    pub last_accuracy: Option<f64>,
    pub samples_per_s: f64,
    pub frozen: usize,
    /// Layer blocks past the prefix frozen for their weights only (`--freeze critical`).
    pub weight_only: Vec<usize>,
    pub stages: usize,
    pub replicas: usize,
    pub cache: Option<CacheStats>,
    /// Model FLOPs utilisation: the model's FLOPs per second (see
    /// [`ModelConfig::train_flops_per_token`]) over the peak of the job's processes (each
    /// measured as rank 0's [`crate::kernels::measured_peak_flops`]); `None` where no
    /// peak was measured (non-root processes).
    pub mfu: Option<f64>,
}

impl StepRow<'_> {
    pub fn tokens_per_s(&self) -> f64 {
        self.report.tokens as f64 / self.report.seconds
    }

    /// The metrics row (JSON lines): the one place that names its fields.
    pub fn to_json(&self) -> Value {
        let r = self.report;
        json!({"step": r.step, "loss": r.loss, "val_loss": self.val_loss, "val_perplexity": self.val_loss.filter(|_| self.accuracy.is_none()).map(f64::exp), "accuracy": self.accuracy, "f1": self.f1, "tokens_per_s": self.tokens_per_s(), "samples_per_s": self.samples_per_s, "lr": r.lr, "grad_norm": r.grad_norm, "layer_grad_norms": r.layer_norms, "busy": r.busy, "seconds": r.seconds, "frozen_layers": self.frozen, "weight_only_frozen": self.weight_only, "mfu": self.mfu, "stages": self.stages, "replicas": self.replicas, "cache": self.cache.as_ref().map(|c| json!({"hits": c.hits, "extended": c.extended, "misses": c.misses, "memory_bytes": c.memory_bytes, "disk_bytes": c.disk_bytes, "not_kept": c.not_kept}))})
    }
}

/// How a run ended.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub first_val: f64,
    pub last_val: f64,
    /// A task's held-out accuracy at the start and at the end.
    pub first_accuracy: Option<f64>,
    pub last_accuracy: Option<f64>,
    /// An answer-span task's F1 at the end.
    pub last_f1: Option<f64>,
    /// Steps done in all.
    pub step: u64,
    /// Steps this run took (after any resume).
    pub steps_run: usize,
    pub checkpoint: Option<PathBuf>,
    pub cache: Option<CacheStats>,
    /// With [`RunConfig::trace`]: the last step's timeline, or the whole run's when freezing.
    pub timeline: Option<Timeline>,
    /// Stopped on request (see [`RunConfig::stop`]) before the configured steps.
    pub stopped: bool,
}

/// The measured actions of every step of a run, on one clock, and its transitions.
struct WholeRun {
    clock: Instant,
    actions: Vec<TimedAction>,
    spans: Vec<TimedSpan>,
    marks: Vec<(f64, String)>,
    /// The most workers any plan of the run had.
    workers: usize,
}

impl WholeRun {
    /// Actions kept at most (about 100 bytes each in a trace).
    const CAP: usize = 2_000_000;

    fn step(&mut self, r: &StepReport) {
        let offset = self.clock.elapsed().as_secs_f64() - r.seconds;
        let room = Self::CAP.saturating_sub(self.actions.len());
        self.actions.extend(r.actions.iter().take(room).map(|a| {
            let mut a = *a;
            a.start += offset;
            a.end += offset;
            a
        }));
        let room = Self::CAP.saturating_sub(self.spans.len());
        self.spans.extend(r.spans.iter().take(room).map(|s| {
            let mut s = *s;
            s.start += offset;
            s.end += offset;
            s
        }));
    }

    fn mark(&mut self, label: &str, workers: usize) {
        self.marks
            .push((self.clock.elapsed().as_secs_f64(), label.to_string()));
        self.workers = self.workers.max(workers);
    }
}

/// Measured action durations (seconds) by stage and op.
type ActionSeconds = HashMap<(usize, Op), Vec<f64>>;

/// A training run: a trainer, its data and what happens around its steps.
pub struct TrainingRun {
    pub trainer: Trainer,
    corpus: Corpus,
    cfg: RunConfig,
    freezer: Option<FreezeController>,
    epoch_steps: u64,
    whole: Option<WholeRun>,
    last: Option<StepReport>,
    step_seconds: Vec<f64>,
    /// `compare_sim`: a profile pass after each step (a machine's speed drifts with other load,
    /// and a profile taken only after training could see a different machine). Every rank takes
    /// it: a rank left idle meanwhile ran its next actions 20-30% slower.
    profiler: Option<Profiler>,
    /// And the measured actions after warm-up, to set beside the profile's costs.
    action_seconds: ActionSeconds,
    /// The best validation after a step so far, by the run's metric.
    best: Option<Best>,
    /// The checkpoint directory, held for this run (the root process's).
    _lock: Option<super::store::DirLock>,
}

/// The best validation so far: its value, its step, and validations since.
#[derive(Debug, Clone, Copy)]
struct Best {
    value: f64,
    step: u64,
    stale: u64,
}

pub use super::store::BEST_DIR;

impl TrainingRun {
    /// A run of `trainer` on `corpus`; every setting is checked here, before any step.
    pub fn new(mut trainer: Trainer, corpus: Corpus, cfg: RunConfig) -> Result<Self> {
        check_run(&trainer, &cfg)?;
        if let (Some(m @ (Metric::Accuracy | Metric::F1)), false) =
            (cfg.keep_best, corpus.is_task())
        {
            return Err(Error::Config(format!(
                "{}: a text has no {}; keep the best by val-loss",
                corpus.name,
                m.name()
            )));
        }
        let model = &trainer.cfg.model;
        corpus.check(model.seq_len)?;
        match (corpus.is_span(), corpus.is_task()) {
            (true, _) => model.check_spans(&corpus.name, corpus.ids),
            (false, true) => model.check_examples(&corpus.name, corpus.ids, corpus.classes()),
            _ => model.check_text(&corpus.name, corpus.ids),
        }?;
        let epoch_steps = trainer
            .cfg
            .sampler()
            .steps_per_epoch(&corpus.train, trainer.plan.num_microbatches)
            .map_err(|e| Error::Config(format!("{}: {e}", corpus.name)))?;
        trainer.cfg.resolve_epochs(epoch_steps)?;
        for (step, next) in &cfg.switches {
            check_switch(&trainer, *step, next)?;
        }
        let freezer = match &cfg.freeze {
            Some(f) => {
                let links = trainer.links().cloned();
                let mpi = trainer.is_distributed();
                Some(FreezeController::new(
                    f,
                    &trainer,
                    links.as_ref(),
                    epoch_steps,
                    mpi,
                )?)
            }
            None => None,
        };
        let lock = take_checkpoint_dir(&mut trainer, &cfg)?;
        trainer.set_cache(cfg.cache.clone())?;
        let profiler = cfg
            .compare_sim
            .then(|| Profiler::new(&trainer.cfg.model, trainer.cfg.rows, trainer.cfg.seed));
        Ok(TrainingRun {
            trainer,
            corpus,
            cfg,
            freezer,
            epoch_steps,
            whole: None,
            last: None,
            step_seconds: Vec::new(),
            profiler,
            action_seconds: ActionSeconds::new(),
            best: None,
            _lock: lock,
        })
    }

    /// Steps per epoch of the training data at this plan's micro-batches.
    pub fn epoch_steps(&self) -> u64 {
        self.epoch_steps
    }

    /// The unigram loss of the training data (a task's: of its labels): what a model that
    /// learnt nothing scores, and its name.
    pub fn baseline(&self) -> (f64, &'static str) {
        let name = match (self.corpus.is_span(), self.corpus.is_task()) {
            (true, _) => "position-prior baseline",
            (_, true) => "class-prior baseline",
            _ => "unigram baseline",
        };
        (self.corpus.unigram_baseline(), name)
    }

    /// Resume if asked, then train to the configured steps; write the final checkpoint.
    /// Across processes every rank calls it; only the root reports to `sink`.
    pub fn run(&mut self, sink: &mut dyn RunSink) -> Result<RunSummary> {
        let mut quiet = Quiet;
        let sink: &mut dyn RunSink = if self.trainer.is_root() {
            sink
        } else {
            &mut quiet
        };
        let resumed = self.resume(sink)?;
        // Every held-out example is scored; a large set takes a while before any output.
        if let (true, n @ 500..) = (self.corpus.is_task(), self.corpus.val.len()) {
            sink.note(&format!(
                "scoring the {n} held-out examples before the first step"
            ));
        }
        let first = self
            .trainer
            .validate(&self.corpus, self.cfg.eval_batches, &[])?;
        let baseline = self.baseline();
        sink.start(&RunStart {
            header: self.header(baseline),
            baseline,
            step: self.trainer.step,
            steps: self.trainer.cfg.steps,
            val_loss: first.loss,
            accuracy: first.accuracy,
            f1: first.f1,
            resumed,
        })?;
        self.whole = (self.cfg.trace && self.freezer.is_some()).then(|| WholeRun {
            clock: Instant::now(),
            actions: Vec::new(),
            spans: Vec::new(),
            marks: Vec::new(),
            workers: self.trainer.plan.num_workers(),
        });
        let mut last_val = first;
        let mut stopped = false;
        while self.trainer.step < self.trainer.cfg.steps {
            if self.stop_requested()? {
                stopped = true;
                sink.note(&format!(
                    "stopped on request at step {}: writing its checkpoint, from which a resume continues",
                    self.trainer.step
                ));
                break;
            }
            last_val = self.one_step(sink, last_val)?;
            if self.stale_enough() {
                let b = self.best.expect("a best validation before any is stale");
                let metric = self.cfg.keep_best.unwrap_or(Metric::ValLoss);
                sink.note(&format!(
                    "early stop at step {}: {} validations without a better {} than {:.4} (step {})",
                    self.trainer.step,
                    b.stale,
                    metric.name(),
                    b.value,
                    b.step
                ));
                break;
            }
        }
        let checkpoint = match &self.cfg.checkpoints {
            Some(c) => {
                let p = self.trainer.save_checkpoint(&c.dir)?;
                sink.note(&format!("checkpoint: {}", p.display()));
                Some(p)
            }
            None => None,
        };
        Ok(RunSummary {
            first_val: first.loss,
            last_val: last_val.loss,
            first_accuracy: first.accuracy,
            last_accuracy: last_val.accuracy,
            last_f1: last_val.f1,
            step: self.trainer.step,
            steps_run: self.step_seconds.len(),
            checkpoint,
            cache: self.trainer.cache_stats(),
            timeline: self.timeline(),
            stopped,
        })
    }

    /// Has any process been asked to stop? (Agreed by all, so they stop at the same step.)
    fn stop_requested(&self) -> Result<bool> {
        match self.cfg.stop {
            Some(flag) => self.trainer.any(flag.load(Ordering::SeqCst)),
            None => Ok(false),
        }
    }

    /// Load the newest checkpoint that verifies and re-apply its frozen prefix.
    fn resume(&mut self, sink: &mut dyn RunSink) -> Result<Option<u64>> {
        let Some(dir) = &self.cfg.resume_from else {
            return Ok(None);
        };
        let r = self.trainer.load_checkpoint(dir)?;
        let steps = self.trainer.cfg.steps;
        if r.step >= steps {
            return Err(Error::Config(format!(
                "{} is at step {}, at or past this run's last step {steps}: nothing to train, nothing written (ask for more steps)",
                r.path.display(),
                r.step
            )));
        }
        if let Some(why) = &r.fallback {
            sink.note(&format!(
                "warning: {why}; resuming from the newest checkpoint that verifies"
            ));
        }
        sink.note(&format!(
            "resumed from {} at step {}",
            r.path.display(),
            r.step
        ));
        if let Some(n) = &self.cfg.resume_note {
            sink.note(n);
        }
        match self.freezer.as_mut() {
            Some(f) => {
                if let Some(msg) = f.resumed(&mut self.trainer, r.step, r.frozen)? {
                    sink.note(&msg);
                }
            }
            // Without a freeze policy nothing freezes further, but what the checkpoint froze is
            // kept where this plan has room for it, and either way the run says which.
            None if r.frozen > 0 && self.trainer.frozen() == r.frozen => sink.note(&format!(
                "the checkpoint had {} frozen: they stay frozen",
                super::freeze::first_blocks(r.frozen)
            )),
            None if r.frozen > 0 => sink.note(&format!(
                "warning: the checkpoint had {} frozen, but stage 0 of this plan ({:?}) has no room for them with a training layer after; they train again",
                super::freeze::first_blocks(r.frozen),
                self.trainer.plan.layers_per_stage()
            )),
            None => {}
        }
        if !r.weight_only.is_empty() {
            sink.note(&format!(
                "the checkpoint had the weights of layer blocks {:?} frozen: they stay frozen",
                r.weight_only
            ));
        }
        Ok(Some(r.step))
    }

    fn header(&self, (base, base_name): (f64, &str)) -> String {
        let cfg = &self.trainer.cfg;
        format!(
            "training {}{} ({} layer blocks, d_model {}) on {}: {}; {} steps{}; {base_name} {base:.3}",
            cfg.model.family.name(),
            match &cfg.pretrained {
                Some(dir) => format!(" from {}", dir.display()),
                None => String::new(),
            },
            cfg.model.num_blocks(),
            cfg.model.d_model,
            self.corpus.name,
            describe(&self.trainer.plan),
            cfg.steps,
            match (cfg.epochs, cfg.sampling == Sampling::Epochs || self.corpus.is_task()) {
                (Some(1), _) => format!(" (1 epoch of {})", self.epoch_steps),
                (Some(e), _) => format!(" ({e} epochs of {})", self.epoch_steps),
                (None, true) => format!(" in epochs of {}", self.epoch_steps),
                (None, false) => String::new(),
            },
        ) + &self
            .trainer
            .start_note
            .as_ref()
            .map_or(String::new(), |n| format!("\n{n}"))
    }

    /// One step and what follows it: validation, metrics, checkpoint, profiling, freezing and
    /// plan switches. Returns the latest validation.
    fn one_step(&mut self, sink: &mut dyn RunSink, last_val: Validation) -> Result<Validation> {
        let steps = self.trainer.cfg.steps;
        let r = self
            .trainer
            .train_step(&self.corpus)
            .map_err(|e| Error::Step {
                step: self.trainer.step + 1,
                exec: e,
            })?;
        let val = if r.step % self.cfg.eval_every == 0 || r.step == steps {
            Some(
                self.trainer
                    .validate(&self.corpus, self.cfg.eval_batches, &[])?,
            )
        } else {
            None
        };
        let plan = &self.trainer.plan;
        sink.step(&StepRow {
            report: &r,
            steps,
            val_loss: val.map(|v| v.loss),
            accuracy: val.and_then(|v| v.accuracy),
            f1: val.and_then(|v| v.f1),
            last_val: val.unwrap_or(last_val).loss,
            last_accuracy: val.unwrap_or(last_val).accuracy,
            samples_per_s: (plan.num_microbatches * self.trainer.cfg.rows) as f64 / r.seconds,
            frozen: self.trainer.frozen(),
            weight_only: self.trainer.weight_only().to_vec(),
            stages: plan.num_stages(),
            replicas: plan.replicas(),
            cache: self.trainer.cache_stats(),
            mfu: self.mfu(&r),
        })?;
        if let Some(c) = &self.cfg.checkpoints {
            if c.every > 0 && r.step % c.every == 0 && r.step < steps {
                self.trainer.save_checkpoint(&c.dir)?;
            }
        }
        if let Some(v) = &val {
            self.track_best(sink, v, r.step)?;
        }
        self.step_seconds.push(r.seconds);
        self.profile_step(&r);
        if let Some(w) = self.whole.as_mut() {
            w.step(&r);
        }
        self.after_step(sink, &r)?;
        self.last = Some(r);
        Ok(val.unwrap_or(last_val))
    }

    /// After a validation: is it the best so far by the run's metric? Then keep its checkpoint
    /// (with `keep_best`). The root decides, as only it holds the held-out figures, and every
    /// rank follows: saving a checkpoint gathers the workers' state.
    fn track_best(&mut self, sink: &mut dyn RunSink, v: &Validation, step: u64) -> Result<()> {
        if self.cfg.keep_best.is_none() && self.cfg.early_stop.is_none() {
            return Ok(());
        }
        let metric = self.cfg.keep_best.unwrap_or(Metric::ValLoss);
        let value = match metric {
            Metric::ValLoss => Some(v.loss),
            Metric::Accuracy => v.accuracy,
            Metric::F1 => v.f1,
        }
        .filter(|x| !x.is_nan());
        let local = self.trainer.is_root()
            && value.is_some_and(|x| self.best.is_none_or(|b| metric.better(x, b.value)));
        if !self.trainer.any(local)? {
            if let Some(b) = self.best.as_mut() {
                b.stale += 1;
            }
            return Ok(());
        }
        let value = value.unwrap_or(f64::NAN); // other ranks: the root's figure is reported
        self.best = Some(Best {
            value,
            step,
            stale: 0,
        });
        if let (Some(_), Some(c)) = (self.cfg.keep_best, &self.cfg.checkpoints) {
            let p = self
                .trainer
                .save_checkpoint_keeping(&c.dir.join(BEST_DIR), 1)?;
            sink.note(&format!(
                "best {} so far, {value:.4} at step {step}: kept in {}",
                metric.name(),
                p.display()
            ));
        }
        Ok(())
    }

    /// Has the run gone `early_stop` validations without a better one?
    fn stale_enough(&self) -> bool {
        matches!((self.cfg.early_stop, self.best), (Some(n), Some(b)) if b.stale >= n)
    }

    /// The step's model FLOPs utilisation (see [`StepRow::mfu`]); root only.
    fn mfu(&self, r: &StepReport) -> Option<f64> {
        if !self.trainer.is_root() {
            return None;
        }
        let peak = crate::kernels::measured_peak_flops() * self.trainer.processes() as f64;
        let flops = self.trainer.cfg.model.train_flops_per_token() * r.tokens as f64;
        Some(flops / r.seconds / peak)
    }

    /// `compare_sim`: a profile pass, and the step's actions once past warm-up.
    fn profile_step(&mut self, r: &StepReport) {
        let Some(p) = self.profiler.as_mut() else {
            return;
        };
        // At the step's mean length: micro-batches are padded to their longest row only.
        let rows = (self.trainer.plan.num_microbatches * self.trainer.cfg.rows).max(1);
        p.set_len((r.tokens as f64 / rows as f64).round() as usize);
        p.sample();
        if self.step_seconds.len() > 2 {
            for t in &r.actions {
                self.action_seconds
                    .entry((t.action.stage, t.action.op))
                    .or_default()
                    .push(t.end - t.start);
            }
        }
    }

    /// Freeze decisions and plan switches due after step `r`.
    fn after_step(&mut self, sink: &mut dyn RunSink, r: &StepReport) -> Result<()> {
        if let Some(f) = self.freezer.as_mut() {
            if let Some(msg) = f.after_step(&mut self.trainer, r)? {
                sink.note(&msg);
                if let Some(w) = self.whole.as_mut() {
                    w.mark(
                        msg.lines().next().unwrap_or(""),
                        self.trainer.plan.num_workers(),
                    );
                }
            }
        }
        let due: Vec<Plan> = self
            .cfg
            .switches
            .iter()
            .filter(|(at, _)| *at == r.step)
            .map(|(_, p)| p.clone())
            .collect();
        for next in due {
            let rep = self.trainer.replan(next)?;
            if let Some(w) = self.whole.as_mut() {
                w.mark(
                    &format!("step {}: re-planned", r.step),
                    self.trainer.plan.num_workers(),
                );
            }
            sink.note(&format!(
                "step {}: re-planned in {:.3} s\n  before: {}\n  after:  {}",
                r.step, rep.seconds, rep.before, rep.after
            ));
        }
        Ok(())
    }

    /// The measured timeline the run kept (see [`RunConfig::trace`]).
    fn timeline(&mut self) -> Option<Timeline> {
        if !self.cfg.trace {
            return None;
        }
        let mut tl = self.trainer.timeline(self.last.as_ref()?);
        if let Some(w) = self.whole.take() {
            tl.worker_names = (0..w.workers).map(|i| format!("worker {i}")).collect();
            tl.actions = w.actions;
            tl.spans = w.spans;
            tl.marks = w.marks;
        }
        Some(tl)
    }

    /// `compare_sim`: the trained plan simulated on the profile measured during the run, beside
    /// the measured iteration time and actions. Needs 3 steps in this run (2 are warm-up).
    pub fn sim_comparison(&mut self) -> Result<SimComparison> {
        let Some(profiler) = self.profiler.as_mut() else {
            return Err(Error::Config(
                "the run did not profile (compare_sim is off)".into(),
            ));
        };
        if self.step_seconds.len() < 3 {
            return Err(Error::Config(format!(
                "comparing with the simulation needs 3 steps in this run; it took {} after resuming",
                self.step_seconds.len()
            )));
        }
        // At least 5 passes after the first.
        while profiler.passes() < 6 {
            profiler.sample();
        }
        let profile = profiler.profile();
        let plan = &self.trainer.plan;
        let stages = profile.stage_costs(&plan.layers_per_stage());
        let cl = match self.trainer.links() {
            Some(c) => devices_for_plan(plan, c)?,
            None => Cluster::uniform(plan.num_workers()),
        };
        let setup = SimSetup {
            plan,
            stages: &stages,
            cluster: &cl,
        };
        // In-process workers serialise their compute (burn's autodiff lock): simulate that.
        let shared = !self.trainer.is_distributed() && plan.num_workers() > 1;
        let sim = simulate_with(
            &setup,
            SimOptions {
                shared_compute: shared,
                ..SimOptions::default()
            },
        )?;
        let own = if shared {
            Some(simulate(&setup)?.iteration_time)
        } else {
            None
        };
        let measured = &self.step_seconds[2..];
        let ms = |op: Op, s: usize| self.action_seconds.get(&(s, op)).map(|v| median(v.clone()));
        let stage_rows = stages
            .iter()
            .enumerate()
            .map(|(s, c)| StageComparison {
                simulated: [
                    c.forward,
                    c.full_backward(),
                    c.backward_input,
                    c.backward_weight,
                ],
                measured: [ms(Op::F, s), ms(Op::BW, s), ms(Op::B, s), ms(Op::W, s)],
            })
            .collect();
        Ok(SimComparison {
            simulated: sim.iteration_time,
            measured: median(measured.to_vec()),
            measured_steps: measured.len(),
            shared_compute: shared,
            own_devices: own,
            stages: stage_rows,
            timeline: sim.timeline,
        })
    }
}

/// Simulated against measured, for one stage: F, BW, B, W seconds (measured: median action).
#[derive(Debug, Clone)]
pub struct StageComparison {
    pub simulated: [f64; 4],
    pub measured: [Option<f64>; 4],
}

/// The run's plan simulated on its own measured profile, beside the measured steps.
#[derive(Debug, Clone)]
pub struct SimComparison {
    pub simulated: f64,
    /// Median measured step (after 2 warm-up steps).
    pub measured: f64,
    pub measured_steps: usize,
    /// Simulated with the workers' compute serialised, as in-process workers run.
    pub shared_compute: bool,
    /// With a device each (what worker processes get), when `shared_compute`.
    pub own_devices: Option<f64>,
    pub stages: Vec<StageComparison>,
    /// The simulated iteration's timeline.
    pub timeline: Timeline,
}

/// Settings that no step can fix, refused before any work.
fn check_run(trainer: &Trainer, cfg: &RunConfig) -> Result<()> {
    let bad = |m: &str| Err(Error::Config(m.into()));
    if cfg.eval_every == 0 || cfg.eval_batches == 0 {
        return bad("evaluation every 0 steps, or on 0 batches: both must be at least 1");
    }
    if cfg.checkpoints.as_ref().is_some_and(|c| c.keep == 0) {
        return bad("checkpoints to keep must be at least 1");
    }
    if cfg.compare_sim && trainer.cfg.steps < 3 {
        return bad("comparing with the simulation needs at least 3 steps (the first two are left out as warm-up)");
    }
    if cfg.keep_best.is_some() && cfg.checkpoints.is_none() {
        return bad("keeping the best checkpoint needs checkpoints");
    }
    if cfg.cache.is_some() && cfg.freeze.is_none() {
        return bad("the frozen-prefix cache caches frozen layers: it needs a freeze policy");
    }
    if !cfg.switches.is_empty() && cfg.freeze.as_ref().is_some_and(|f| f.elastic) {
        return bad("plan switches and elastic re-planning both change the plan: use one of them");
    }
    Ok(())
}

/// Can the run switch to `next` after `step`?
fn check_switch(trainer: &Trainer, step: u64, next: &Plan) -> Result<()> {
    let steps = trainer.cfg.steps;
    if step == 0 || step >= steps {
        return Err(Error::Config(format!(
            "plan switch at step {step}: not between 1 and {} (the run's last step is {steps})",
            steps.saturating_sub(1)
        )));
    }
    trainer.cfg.check_plan(next)?;
    if let Some(c) = trainer.links() {
        devices_for_plan(next, c)?;
    }
    if trainer.is_distributed() && next.num_workers() != trainer.plan.num_workers() {
        return Err(Error::Config(format!(
            "plan switch at step {step}: that plan has {} workers, this job {} processes (a re-plan keeps the processes)",
            next.num_workers(),
            trainer.plan.num_workers()
        )));
    }
    Ok(())
}

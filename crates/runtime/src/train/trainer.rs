//! The pipelined trainer: a whole-job plan's workers over a transport, gradient accumulation,
//! all-reduce per stage group, global grad-norm clipping, AdamW with warmup + cosine LR, and
//! re-planning between steps. State is kept per layer block, so any plan can take it over.

use super::layers::{initial_state, LayerState};
use super::tied::Tied;
use super::{PlanIn, TrainConfig};
use crate::backend::{autodiff_lock, plain_device, settle};
use crate::batch::MicroBatch;
use crate::cache::{CacheStats, PrefixCache};
use crate::data::{micro_batch, Corpus, Part, Sampler, Sampling};
use crate::error::{Error, Result};
use crate::exec::{ExecError, HeldStage, StepInput, Worker, WorkerOutput};
use crate::grads::{clip_factor, flat_params, grads_params, squares};
use crate::model::{batch_input, batch_loss, fresh_copy, Ctx, LayerBlock, Stage};
use crate::transport::{InProcess, Transport, DEFAULT_TIMEOUT};
use burn::module::Module;
use pipewright_core::cluster::Cluster;
use pipewright_core::plan::ir::{Plan, RouteIndex, Topology};
use pipewright_core::sim::devices_for_plan;
use pipewright_core::sim::timeline::{SpanKind, TimedAction, TimedSpan, Timeline};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one optimizer step measured.
#[derive(Debug, Clone)]
pub struct StepReport {
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub seconds: f64,
    pub tokens: u64,
    /// Compute seconds per worker.
    pub busy: Vec<f64>,
    pub actions: Vec<TimedAction>,
    /// Measured sends, receive waits, the all-reduce and the optimizer step of each worker.
    pub spans: Vec<TimedSpan>,
    /// Gradient norm of each layer block (model order; 0 when frozen; the same on every
    /// process).
    pub layer_norms: Vec<f64>,
}

/// What a switch of plan did.
#[derive(Debug, Clone)]
pub struct ReplanReport {
    pub before: String,
    pub after: String,
    pub seconds: f64,
}

/// One line about a plan, for logs.
pub fn describe(plan: &Plan) -> String {
    let n = |k: usize, one: &str, many: &str| format!("{k} {}", if k == 1 { one } else { many });
    format!(
        "{} on {}: {} (layers {:?}), {} a step, replica groups of up to {}",
        plan.kind,
        n(plan.num_workers(), "worker", "workers"),
        n(plan.num_stages(), "stage", "stages"),
        plan.layers_per_stage(),
        n(plan.num_microbatches, "micro-batch", "micro-batches"),
        plan.replicas()
    )
}

/// Worker `rank`'s all-reduce (from `synced`) and optimizer step (from `optimizer`, until
/// now) on the step's clock.
fn sync_spans(rank: usize, clock: Instant, synced: f64, optimizer: f64) -> [TimedSpan; 2] {
    let span = |kind, start, end| TimedSpan {
        worker: rank,
        kind,
        stage: None,
        start,
        end,
        message: None,
    };
    [
        span(SpanKind::AllReduce, synced, optimizer),
        span(
            SpanKind::OptimizerStep,
            optimizer,
            clock.elapsed().as_secs_f64(),
        ),
    ]
}

/// A held-out micro-batch's task scores, summed over its rows: classes right (F1 0), or for
/// answer spans SQuAD's exact match and F1 of the best span of each row's start and end
/// logits; (0, 0) for text.
fn task_scores(corpus: &Corpus, mb: &MicroBatch, logits: burn::tensor::Tensor<3>) -> (f64, f64) {
    let Part::Examples(val) = &corpus.val else {
        return (0.0, 0.0);
    };
    if !corpus.is_span() {
        let guess = logits.argmax(2).into_data();
        let right = guess
            .iter::<i64>()
            .zip(&mb.targets)
            .filter(|(g, t)| g == *t);
        return (right.count() as f64, 0.0);
    }
    let v: Vec<f32> = logits.into_data().iter::<f32>().collect();
    let t = mb.seq_len;
    let mut sums = (0.0, 0.0);
    for (r, &s) in mb.samples.iter().enumerate() {
        let row = &v[r * 2 * t..(r + 1) * 2 * t];
        let span = &val.spans[s as usize];
        let guess = crate::data::squad::best_span(&row[..t], &row[t..], span);
        let (em, f) = crate::data::squad::score(&guess, &span.answers);
        sums = (sums.0 + em, sums.1 + f);
    }
    sums
}

/// Held-out figures: the loss, and a task's accuracy (the share of examples whose most likely
/// class is their label; for answer spans, SQuAD's exact match) and an answer span's F1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Validation {
    pub loss: f64,
    pub accuracy: Option<f64>,
    pub f1: Option<f64>,
}

pub struct Trainer {
    pub cfg: TrainConfig,
    pub plan: Plan,
    routes: RouteIndex,
    topo: Topology,
    /// `None`: every plan worker runs in this process, as a thread. `Some(r)`: this process is
    /// one of several (an MPI rank) and runs worker `r` only.
    rank: Option<usize>,
    /// The workers this process runs, in rank order.
    pub workers: Vec<Worker>,
    /// Emulated links (a cluster whose devices the plan's workers sit on), if any.
    links: Option<Cluster>,
    transport: Arc<dyn Transport>,
    /// How long an in-process worker waits for a peer.
    timeout: Duration,
    /// Layer blocks `0..frozen` are frozen (see [`Trainer::set_frozen`]).
    frozen: usize,
    /// Layer blocks past the prefix frozen for their weights only (see
    /// [`Trainer::set_weight_only`]).
    weight_only: Vec<usize>,
    /// Optimizer steps done.
    pub step: u64,
    /// Checkpoints kept in the directory (the newest ones).
    pub keep_checkpoints: usize,
    pub(crate) sampler: Sampler,
    /// The learning rate is the schedule's times this (AutoDP with a scaled global batch).
    lr_scale: f64,
    /// AutoCache: the frozen prefix's outputs per sample (see [`Trainer::set_cache`]).
    cache: Option<Arc<PrefixCache>>,
    /// Where the two copies of a tied embedding matrix live, if the model ties them.
    tied: Option<Tied>,
    /// The plan's workers when the run started: over MPI, the ranks.
    workers_at_start: usize,
    /// For the run header: which parts of pretrained weights' head start fresh.
    pub start_note: Option<String>,
    /// The run's own settings, written into checkpoints for a resume to take back.
    pub run_settings: Option<super::RunSettings>,
    /// The next step is a first one (of this trainer, or after a plan switch): its waits for
    /// peers are bounded by the startup timeout ([`crate::transport::Patience`]).
    first_step: bool,
}

impl Trainer {
    /// A trainer for `plan` (checked against the model), workers as threads in this process.
    pub fn new(cfg: TrainConfig, plan: impl Into<PlanIn>) -> Result<Self> {
        Self::with_links(cfg, plan, None)
    }

    /// The generated plan of `cfg`'s schedule flags.
    pub fn from_config(cfg: TrainConfig) -> Result<Self> {
        let plan = cfg.plan()?;
        Self::new(cfg, plan)
    }

    /// Like [`Trainer::new`], each message delayed as `links`' network would (worker `w` on the
    /// plan's device for `w`).
    pub fn with_links(
        cfg: TrainConfig,
        plan: impl Into<PlanIn>,
        links: Option<Cluster>,
    ) -> Result<Self> {
        Self::in_process(cfg, plan, links, DEFAULT_TIMEOUT)
    }

    /// Every worker a thread of this process; a worker waits at most `timeout` for a peer.
    /// Products then run on rayon's threads, the BLAS single-threaded, for the whole process
    /// ([`crate::machine::blas_lib::split_products`]).
    pub fn in_process(
        cfg: TrainConfig,
        plan: impl Into<PlanIn>,
        links: Option<Cluster>,
        timeout: Duration,
    ) -> Result<Self> {
        let plan = cfg.accept(plan)?;
        let transport = transport_for(&plan, links.as_ref(), timeout)?;
        crate::machine::blas_lib::split_products();
        Self::build(cfg, plan, None, links, transport, timeout)
    }

    /// This process runs worker `rank` of `plan`; the others run elsewhere (MPI ranks) and
    /// reach it through `transport`. Every rank calls this, and then the same methods in the
    /// same order: steps, evaluations, checkpoints and re-plans are collective.
    pub fn distributed(
        cfg: TrainConfig,
        plan: impl Into<PlanIn>,
        rank: usize,
        transport: Arc<dyn Transport>,
    ) -> Result<Self> {
        // Every rank holds the same plan: a refusal here is every rank's, and none waits in
        // `prepare` for one that left.
        let plan = cfg.accept(plan)?;
        if rank >= plan.num_workers() {
            return Err(Error::Config(format!(
                "rank {rank} has no worker in a plan of {} workers",
                plan.num_workers()
            )));
        }
        transport
            .prepare(&super::tied::groups(&cfg.model, &plan))
            .map_err(ExecError::from)?;
        Self::build(cfg, plan, Some(rank), None, transport, DEFAULT_TIMEOUT)
    }

    fn build(
        cfg: TrainConfig,
        plan: Plan,
        rank: Option<usize>,
        links: Option<Cluster>,
        transport: Arc<dyn Transport>,
        timeout: Duration,
    ) -> Result<Self> {
        cfg.check()?;
        let plan_workers = plan.num_workers();
        let (state, start_note) = initial_state(&cfg)?;
        let workers = build_workers(&plan, &state, rank);
        Ok(Trainer {
            sampler: cfg.sampler(),
            cache: None,
            lr_scale: 1.0,
            routes: RouteIndex::new(&plan),
            topo: Topology::new(&plan),
            tied: Tied::of(&cfg.model, &plan),
            cfg,
            plan,
            rank,
            workers,
            links,
            transport,
            timeout,
            frozen: 0,
            weight_only: Vec::new(),
            step: 0,
            keep_checkpoints: 3,
            start_note,
            workers_at_start: plan_workers,
            run_settings: None,
            first_step: true,
        })
    }

    /// Processes the job runs in: one, or one per worker of the plan it started with (MPI
    /// ranks).
    pub fn processes(&self) -> usize {
        match self.rank {
            None => 1,
            Some(_) => self.workers_at_start,
        }
    }

    /// Whether this process writes metrics, progress and checkpoints (rank 0, or the only
    /// process).
    pub fn is_root(&self) -> bool {
        self.rank.is_none_or(|r| r == 0)
    }

    /// Every layer block and its optimizer, in model order (from each stage's first host; all
    /// hosts agree after a step). Across processes every rank calls this: the stage leaders'
    /// layers are gathered to all.
    pub(crate) fn layer_state(&self) -> Result<Vec<LayerState>> {
        let Some(rank) = self.rank else {
            let mut out = Vec::with_capacity(self.plan.num_layers());
            for (s, group) in self.topo.groups.iter().enumerate() {
                let held = self.held(group[0], s);
                for (l, o) in held.module.layers.iter().zip(&held.optims) {
                    out.push((l.clone(), o.clone()));
                }
            }
            return Ok(out);
        };
        let mine: Vec<(usize, LayerState)> = self
            .workers
            .iter()
            .flat_map(|w| &w.stages)
            .filter(|h| self.topo.leads(rank, h.stage))
            .flat_map(|h| {
                h.module
                    .layers
                    .iter()
                    .zip(&h.optims)
                    .enumerate()
                    .map(|(k, (l, o))| (h.first_layer + k, (l.clone(), o.clone())))
            })
            .collect();
        let part = super::layers::encode_layers(&mine, self.cfg.model.layers)?;
        let parts = self
            .transport
            .all_gather(rank, part)
            .map_err(ExecError::from)?;
        super::layers::decode_layers(&parts, &self.cfg)
    }

    /// Put `state` (model order) onto this plan's workers.
    pub(crate) fn set_layer_state(&mut self, state: &[LayerState]) {
        self.workers = build_workers(&self.plan, state, self.rank);
        for w in &mut self.workers {
            w.frozen = self.frozen;
            w.weight_only = self.weight_only.clone();
        }
    }

    /// Whether the workers run in several processes (MPI ranks), this one being one of them.
    pub fn is_distributed(&self) -> bool {
        self.rank.is_some()
    }

    /// Whether any process says yes (`local` here). Every process calls it at the same point
    /// of the run; across processes it is one all-reduce, so all of them agree.
    pub fn any(&self, local: bool) -> Result<bool> {
        let Some(rank) = self.rank else {
            return Ok(local);
        };
        let mut v = [f32::from(u8::from(local))];
        self.transport
            .all_reduce(rank, &self.topo.everyone, &mut v)
            .map_err(ExecError::from)?;
        Ok(v[0] > 0.0)
    }

    /// The emulated links, if any (a cluster whose devices the plan's workers sit on).
    pub fn links(&self) -> Option<&Cluster> {
        self.links.as_ref()
    }

    /// Layer blocks frozen (a prefix of the model).
    pub fn frozen(&self) -> usize {
        self.frozen
    }

    /// Freeze layer blocks `0..k` (AutoFreeze): they keep their weights and optimizer state,
    /// run forward only outside autodiff, and leave the gradient norm and the all-reduce. The
    /// prefix must lie inside stage 0 with a training layer after it (re-plan first if not).
    pub fn set_frozen(&mut self, k: usize) -> Result<()> {
        check_frozen(&self.plan, k)?;
        if k > 0 && self.tied.is_some() {
            return Err(Error::Config(
                "freezing the embedding of a model with tied embeddings would leave its LM head's copy training alone; untie them (tie_word_embeddings = false) to freeze".into(),
            ));
        }
        self.frozen = k;
        self.weight_only.retain(|&b| b >= k);
        for w in &mut self.workers {
            w.frozen = k;
            w.weight_only = self.weight_only.clone();
        }
        Ok(())
    }

    /// Does the model keep one embedding matrix for its input and its LM head? (Then the
    /// embedding cannot freeze: the head's copy would train alone.)
    pub fn ties_embeddings(&self) -> bool {
        self.tied.is_some()
    }

    /// Layer blocks past the prefix frozen for their weights only.
    pub fn weight_only(&self) -> &[usize] {
        &self.weight_only
    }

    /// Freeze the weights of layer blocks `blocks` only (`--freeze critical`): they keep their
    /// weights and optimizer state and leave the gradient norm and the all-reduce, but still
    /// pass the input gradient back, wherever they sit in the pipeline; their backward skips
    /// the weight-gradient products. Blocks inside the frozen prefix are frozen whole already
    /// and dropped here; the last block (the head) always trains.
    pub fn set_weight_only(&mut self, blocks: &[usize]) -> Result<()> {
        let last = self.cfg.model.num_blocks() - 1;
        if let Some(b) = blocks.iter().find(|&&b| b >= last) {
            return Err(Error::Config(format!(
                "layer block {b} cannot be frozen: the model has {last} freezable blocks before its head (block {last})"
            )));
        }
        if self.tied.is_some() && blocks.contains(&0) {
            return Err(Error::Config(
                "freezing the embedding of a model with tied embeddings would leave its LM head's copy training alone; untie them (tie_word_embeddings = false) to freeze".into(),
            ));
        }
        let mut w: Vec<usize> = blocks
            .iter()
            .copied()
            .filter(|&b| b >= self.frozen)
            .collect();
        w.sort_unstable();
        w.dedup();
        for worker in &mut self.workers {
            worker.weight_only = w.clone();
        }
        self.weight_only = w;
        Ok(())
    }

    /// Cache the frozen prefix's output per sample (AutoCache); needs epoch sampling, whose
    /// samples the entries are keyed by.
    pub fn set_cache(&mut self, cache: Option<Arc<PrefixCache>>) -> Result<()> {
        if cache.is_some() && self.cfg.sampling != Sampling::Epochs {
            return Err(Error::Config(
                "the frozen-prefix cache needs sampling = \"epochs\" (fixed samples to key on)"
                    .into(),
            ));
        }
        self.cache = cache;
        Ok(())
    }

    /// Scale the learning rate by `x` from the next step (the linear scaling rule when the
    /// global batch grows with replicas).
    pub fn set_lr_scale(&mut self, x: f64) -> Result<()> {
        if !(x.is_finite() && x > 0.0) {
            return Err(Error::Config(format!(
                "learning-rate scale {x} must be finite and > 0"
            )));
        }
        self.lr_scale = x;
        Ok(())
    }

    /// What the cache holds and served so far.
    pub fn cache_stats(&self) -> Option<CacheStats> {
        self.cache.as_ref().map(|c| c.stats())
    }

    /// A stage as held by worker `w` (one this process runs).
    fn held(&self, w: usize, s: usize) -> &HeldStage {
        self.workers
            .iter()
            .find(|x| x.rank == w)
            .expect("a worker of this process")
            .stages
            .iter()
            .find(|h| h.stage == s)
            .expect("host holds its stage")
    }

    /// Switch to `plan` between steps: layers and their optimizer state move in memory to the
    /// workers the new plan puts them on (other depth, boundaries, replicas or schedule).
    pub fn replan(&mut self, plan: impl Into<PlanIn>) -> Result<ReplanReport> {
        let t0 = Instant::now();
        let plan = self.cfg.accept(plan)?;
        check_frozen(&plan, self.frozen)?;
        let state = self.layer_state()?;
        match self.rank {
            None => self.transport = transport_for(&plan, self.links.as_ref(), self.timeout)?,
            Some(r) => {
                if r >= plan.num_workers() {
                    return Err(Error::Config(format!(
                        "the new plan has {} workers; rank {r} would have none (a re-plan keeps the number of processes)",
                        plan.num_workers()
                    )));
                }
                self.transport
                    .prepare(&super::tied::groups(&self.cfg.model, &plan))
                    .map_err(ExecError::from)?;
            }
        }
        let before = describe(&self.plan);
        self.routes = RouteIndex::new(&plan);
        self.topo = Topology::new(&plan);
        self.tied = Tied::of(&self.cfg.model, &plan);
        self.plan = plan;
        self.set_layer_state(&state);
        self.first_step = true;
        Ok(ReplanReport {
            before,
            after: describe(&self.plan),
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// The micro-batches of `step`, numbered over the whole job.
    fn batches(
        &mut self,
        corpus: &Corpus,
        step: u64,
    ) -> std::result::Result<Vec<MicroBatch>, ExecError> {
        // Only the micro-batches this process's workers run are read.
        let mut need = vec![false; self.plan.num_microbatches];
        for w in &self.workers {
            for a in &self.plan.workers[w.rank] {
                need[a.mb] = true;
            }
        }
        self.sampler
            .batches_for(&corpus.train, step, self.plan.num_microbatches, &|i| {
                need[i]
            })
            .map_err(|e| ExecError::Plan {
                worker: 0,
                msg: e.to_string(),
            })
    }

    /// One optimizer step: every worker runs its actions in its own thread; each stage's
    /// gradients are all-reduced among its hosts, clipped by the global norm and applied with
    /// AdamW per layer block.
    pub fn train_step(&mut self, corpus: &Corpus) -> std::result::Result<StepReport, ExecError> {
        let n = self.plan.num_microbatches;
        let lr = self.cfg.lr_at(self.step) * self.lr_scale;
        let clip = self.cfg.clip;
        let batches = self.batches(corpus, self.step)?;
        self.transport.set_first_step(self.first_step);
        let clock = Instant::now();
        let (plan, routes, topo) = (&self.plan, &self.routes, &self.topo);
        let transport = self.transport.as_ref();
        let input = StepInput::new(&batches, self.cache.as_deref(), false);
        let tied = self.tied.as_ref();
        let last = self.cfg.model.num_blocks() - 1;
        let results = on_workers(&mut self.workers, transport, |worker| {
            let mut out = worker.run(plan, routes, transport, &input, clock)?;
            let synced = clock.elapsed().as_secs_f64();
            reduce_gradients(worker, &mut out, topo, transport)?;
            if let Some(t) = tied {
                t.sum(worker, &mut out, topo, transport)?;
            }
            let rank = worker.rank;
            let layer_sq = layer_squares(worker, &out, topo, tied, last);
            let sq: f32 = layer_sq.iter().map(|&(_, x)| x).sum();
            let layer_norms: Vec<(usize, f64)> = layer_sq
                .iter()
                .map(|&(i, x)| (i, (x as f64).sqrt()))
                .collect();
            let mut sums = [sq, out.loss_sum as f32];
            transport.all_reduce(rank, &topo.everyone, &mut sums)?;
            // The replicas' gradients and everyone's norm and loss: one all-reduce span.
            let optimizer = clock.elapsed().as_secs_f64();
            let norm = (sums[0] as f64).sqrt();
            apply_gradients(worker, &out.grads, lr, clip_factor(norm, clip));
            out.spans.extend(sync_spans(rank, clock, synced, optimizer));
            Ok((out, norm, sums[1] as f64, layer_norms))
        });
        let seconds = clock.elapsed().as_secs_f64();
        let mut busy = vec![0.0; self.plan.num_workers()];
        let (mut actions, mut spans) = (Vec::new(), Vec::new());
        let (mut norm, mut loss_total) = (0.0, 0.0);
        let mut layer_norms = vec![f64::NAN; self.plan.num_layers()];
        let mut first_err = None;
        for r in results {
            match r {
                Ok((out, g, l, ln)) => {
                    for (i, x) in ln {
                        if let Some(slot) = layer_norms.get_mut(i) {
                            *slot = x;
                        }
                    }
                    for a in &out.actions {
                        busy[a.worker] += a.end - a.start;
                    }
                    actions.extend(out.actions);
                    spans.extend(out.spans);
                    norm = g;
                    loss_total = l;
                }
                Err(e) => {
                    // Report the root cause, not the "aborted" echoes of other workers.
                    if first_err.is_none() || matches!(first_err, Some(ExecError::Transport(_))) {
                        first_err = Some(e);
                    }
                }
            }
        }
        if let Some(e) = first_err {
            // The transport is poisoned by the abort; a fresh one lets the caller carry on.
            if self.rank.is_none() {
                if let Ok(t) = transport_for(&self.plan, self.links.as_ref(), self.timeout) {
                    self.transport = t;
                }
            }
            return Err(e);
        }
        if let Some(rank) = self.rank {
            (actions, spans) = self.gather_timeline(rank, actions, spans, &mut layer_norms)?;
            busy.iter_mut().for_each(|b| *b = 0.0);
            for a in &actions {
                if let Some(b) = busy.get_mut(a.worker) {
                    *b += a.end - a.start;
                }
            }
        }
        let loss = loss_total / n as f64;
        if !loss.is_finite() {
            return Err(ExecError::NonFinite(loss));
        }
        self.step += 1;
        self.first_step = false;
        self.transport.set_first_step(false);
        // The positions the step ran: a micro-batch is padded to its longest row only.
        let tokens = batches.iter().map(|b| (b.rows * b.seq_len) as u64).sum();
        Ok(StepReport {
            step: self.step,
            loss,
            lr,
            grad_norm: norm,
            seconds,
            tokens,
            busy,
            actions,
            spans,
            layer_norms,
        })
    }

    /// Under MPI: every rank gets every rank's measured actions and spans (for metrics and
    /// traces) and the gradient norms of the layers it leads (so freeze decisions agree
    /// everywhere).
    fn gather_timeline(
        &self,
        rank: usize,
        actions: Vec<TimedAction>,
        spans: Vec<TimedSpan>,
        layer_norms: &mut [f64],
    ) -> std::result::Result<(Vec<TimedAction>, Vec<TimedSpan>), ExecError> {
        let norms: Vec<Option<f64>> = layer_norms
            .iter()
            .map(|x| (!x.is_nan()).then_some(*x))
            .collect();
        let mine = serde_json::to_vec(&(&actions, &spans, norms)).expect("actions serialise");
        let parts = self.transport.all_gather(rank, mine)?;
        let (mut actions, mut spans) = (Vec::new(), Vec::new());
        for p in parts {
            type Part = (Vec<TimedAction>, Vec<TimedSpan>, Vec<Option<f64>>);
            let (theirs, their_spans, norms): Part =
                serde_json::from_slice(&p).map_err(|e| ExecError::Plan {
                    worker: rank,
                    msg: format!("a peer's timeline does not parse: {e}"),
                })?;
            actions.extend(theirs);
            spans.extend(their_spans);
            for (slot, x) in layer_norms.iter_mut().zip(norms) {
                if let Some(x) = x {
                    *slot = x;
                }
            }
        }
        Ok((actions, spans))
    }

    /// One batch through this plan's forward and backward, exactly as a training step runs
    /// them, without the optimizer: each micro-batch's logits, the mean loss, and every layer
    /// block's gradient (model order, flat in parameter order; empty when frozen). In one
    /// process only: the logits stay with the workers that computed them.
    pub fn batch_gradients(
        &mut self,
        batches: &[MicroBatch],
    ) -> std::result::Result<BatchGradients, ExecError> {
        let n = self.plan.num_microbatches;
        if batches.len() != n || self.rank.is_some() {
            return Err(ExecError::Plan {
                worker: 0,
                msg: format!(
                    "batch_gradients takes the plan's {n} micro-batches in one process (got {})",
                    batches.len()
                ),
            });
        }
        let (plan, routes, topo) = (&self.plan, &self.routes, &self.topo);
        let transport = self.transport.as_ref();
        let input = StepInput::new(batches, None, true);
        let clock = Instant::now();
        let results = on_workers(&mut self.workers, transport, |worker| {
            let mut out = worker.run(plan, routes, transport, &input, clock)?;
            reduce_gradients(worker, &mut out, topo, transport)?;
            Ok(out)
        });
        let mut grads = vec![Vec::new(); self.plan.num_layers()];
        let (mut loss, mut logits) = (0.0, Vec::new());
        for (worker, out) in self.workers.iter().zip(results) {
            let out = out?;
            for (held, g) in worker.stages.iter().zip(out.grads) {
                if topo.leads(worker.rank, held.stage) {
                    for (k, layer) in g.into_iter().enumerate() {
                        grads[held.first_layer + k] = layer;
                    }
                }
            }
            loss += out.scaled_loss;
            logits.extend(out.logits);
        }
        logits.sort_by_key(|(mb, _)| *mb);
        Ok(BatchGradients {
            logits: logits
                .into_iter()
                .map(|(_, p)| (p.shape, p.values))
                .collect(),
            loss,
            grads,
        })
    }

    /// The model's layer blocks in model order (gathered from the workers).
    pub fn layer_blocks(&self) -> Result<Vec<LayerBlock>> {
        Ok(self.layer_state()?.into_iter().map(|(b, _)| b).collect())
    }

    /// Mean held-out loss over `batches` fixed micro-batches, through every layer in model
    /// order. Runs on `valid()` copies without autodiff, so it joins no worker's graph. Across
    /// processes every rank calls it (the layers are gathered first).
    pub fn evaluate(&self, corpus: &Corpus, batches: usize) -> Result<f64> {
        Ok(self.validate(corpus, batches, &[])?.loss)
    }

    /// [`Trainer::evaluate`] with the layer blocks `omit` left out (see
    /// [`Trainer::validate`]).
    pub fn evaluate_omitting(
        &self,
        corpus: &Corpus,
        batches: usize,
        omit: &[usize],
    ) -> Result<f64> {
        Ok(self.validate(corpus, batches, omit)?.loss)
    }

    /// The held-out micro-batches: `batches` fixed windows of a text, or every example of a
    /// task (in micro-batches of at least 32).
    fn held_out(&self, corpus: &Corpus, batches: usize) -> Vec<MicroBatch> {
        let (seq_len, rows) = (self.cfg.model.seq_len, self.cfg.rows);
        match &corpus.val {
            Part::Text(t) => (0..batches)
                .map(|i| micro_batch(t, seq_len, rows, self.cfg.seed, u64::MAX, i as u64))
                .collect(),
            Part::Examples(e) => {
                let ids: Vec<u64> = (0..e.len() as u64).collect();
                ids.chunks(rows.max(32))
                    .map(|c| corpus.val.batch(seq_len, c.to_vec()))
                    .collect()
            }
        }
    }

    /// Held-out loss (the mean over samples) and a task's accuracy, with the layer blocks
    /// `omit` (model indices) left out: their input passes on unchanged, as on a route that
    /// skips them (SkipPipe's skip-robust inference). The embedding and the head cannot be left
    /// out.
    pub fn validate(&self, corpus: &Corpus, batches: usize, omit: &[usize]) -> Result<Validation> {
        let last = self.cfg.model.num_blocks() - 1;
        if let Some(&i) = omit.iter().find(|&&i| i == 0 || i >= last) {
            return Err(Error::Config(format!(
                "layer block {i} cannot be left out (only transformer blocks 1..{last} can)"
            )));
        }
        let layers: Vec<LayerBlock> = self
            .layer_state()?
            .into_iter()
            .enumerate()
            .filter(|(i, _)| !omit.contains(i))
            .map(|(_, (l, _))| l)
            .collect();
        let _guard = autodiff_lock();
        let model = Stage { layers }.valid();
        let dev = plain_device();
        let (mut total, mut rows, mut right, mut f1) = (0.0, 0, 0.0, 0.0);
        for mb in self.held_out(corpus, batches) {
            let logits = model.forward_in(batch_input(&mb, &dev), &Ctx::of(&mb, &dev))?;
            let (r, f) = task_scores(corpus, &mb, logits.clone());
            (right, f1) = (right + r, f1 + f);
            total += batch_loss(logits, &mb).into_scalar::<f32>() as f64 * mb.rows as f64;
            rows += mb.rows;
        }
        let n = rows.max(1) as f64;
        Ok(Validation {
            loss: total / n,
            accuracy: corpus.is_task().then_some(right / n),
            f1: corpus.is_span().then_some(f1 / n),
        })
    }

    /// All parameters in model order, flattened (for comparisons).
    pub fn flat_params(&self) -> Result<Vec<f32>> {
        Ok(self
            .layer_state()?
            .into_iter()
            .flat_map(|(l, _)| flat_params(&l))
            .collect())
    }

    /// Optimizer state of every layer block in model order, as bytes (for comparisons).
    pub fn optimizer_bytes(&self) -> Result<Vec<Vec<u8>>> {
        Ok(self
            .layer_state()?
            .iter()
            .map(|(_, o)| o.into_bytes().expect("optimizer state serialises").to_vec())
            .collect())
    }

    /// The measured timeline of a step, in the simulator's format.
    pub fn timeline(&self, report: &StepReport) -> Timeline {
        Timeline {
            worker_names: (0..self.plan.num_workers())
                .map(|w| match (self.plan.devices.get(w), self.rank) {
                    (Some(d), _) => d.clone(),
                    (None, Some(_)) => format!("rank {w}"),
                    (None, None) => format!("thread {w}"),
                })
                .collect(),
            actions: report.actions.clone(),
            transfers: pipewright_core::sim::timeline::transfers_of(&report.spans),
            marks: Vec::new(),
            spans: report.spans.clone(),
            idle_devices: Vec::new(),
        }
    }
}

/// The in-process transport for a plan's workers, with emulated links if asked.
/// What [`Trainer::batch_gradients`] returns.
pub struct BatchGradients {
    /// Each micro-batch's logits: shape `[rows, seq_len, vocab]` and values.
    pub logits: Vec<(Vec<usize>, Vec<f32>)>,
    pub loss: f64,
    /// Per layer block, model order.
    pub grads: Vec<Vec<f32>>,
}

/// Each layer block's squared gradient norm, from its stage's first host; their sum is the
/// global one (each stage counted once, a tied matrix once: in the embedding), added in the
/// order `sum_squares` adds buffers. `last` is the model's last layer block.
fn layer_squares(
    worker: &Worker,
    out: &WorkerOutput,
    topo: &Topology,
    tied: Option<&Tied>,
    last: usize,
) -> Vec<(usize, f32)> {
    let counted = |i: usize, l: &[f32]| match tied {
        Some(t) if i == last => squares(&l[..l.len() - t.head_len()]),
        _ => squares(l),
    };
    worker
        .stages
        .iter()
        .zip(&out.grads)
        .filter(|(h, _)| topo.leads(worker.rank, h.stage))
        .flat_map(|(h, g)| {
            g.iter()
                .enumerate()
                .map(move |(k, l)| (h.first_layer + k, counted(h.first_layer + k, l)))
        })
        .collect()
}

/// Run `f` on every worker, each in its own thread; a worker that fails aborts the transport
/// so that its peers stop waiting for it.
fn on_workers<T: Send>(
    workers: &mut [Worker],
    transport: &dyn Transport,
    f: impl Fn(&mut Worker) -> std::result::Result<T, ExecError> + Sync,
) -> Vec<std::result::Result<T, ExecError>> {
    std::thread::scope(|sc| {
        let handles: Vec<_> = workers
            .iter_mut()
            .map(|worker| {
                let f = &f;
                sc.spawn(move || {
                    let r = f(worker).and_then(|x| {
                        settle().map_err(|e| ExecError::Plan {
                            worker: worker.rank,
                            msg: e.0,
                        })?;
                        Ok(x)
                    });
                    if r.is_err() {
                        transport.abort();
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("worker thread panicked"))
            .collect()
    })
}

/// Drop frozen layers' gradients (they have none to sum or step), then sum each stage's
/// gradients over its replica group, in one all-reduce per stage.
fn reduce_gradients(
    worker: &Worker,
    out: &mut WorkerOutput,
    topo: &Topology,
    transport: &dyn Transport,
) -> std::result::Result<(), ExecError> {
    for (held, g) in worker.stages.iter().zip(out.grads.iter_mut()) {
        for (k, layer) in g.iter_mut().enumerate() {
            if !worker.trains(held.first_layer + k) {
                layer.clear();
            }
        }
    }
    for (held, g) in worker.stages.iter().zip(out.grads.iter_mut()) {
        let group = &topo.groups[held.stage];
        if group.len() < 2 {
            continue;
        }
        let mut flat = g.concat();
        transport.all_reduce_gradients(worker.rank, group, &mut flat)?;
        let mut at = 0;
        for layer in g.iter_mut() {
            let n = layer.len();
            layer.copy_from_slice(&flat[at..at + n]);
            at += n;
        }
    }
    Ok(())
}

/// AdamW on each trainable layer block the worker holds, its gradients scaled by `factor`.
fn apply_gradients(worker: &mut Worker, grads: &[Vec<Vec<f32>>], lr: f64, factor: f32) {
    let trains: Vec<Vec<bool>> = worker
        .stages
        .iter()
        .map(|h| {
            (0..h.module.layers.len())
                .map(|k| worker.trains(h.first_layer + k))
                .collect()
        })
        .collect();
    let _guard = autodiff_lock();
    for ((held, g), trains) in worker.stages.iter_mut().zip(grads).zip(&trains) {
        let layers = std::mem::take(&mut held.module.layers);
        held.module.layers = layers
            .into_iter()
            .zip(g)
            .zip(held.optims.iter_mut())
            .enumerate()
            .map(|(k, ((layer, g), o))| {
                if !trains[k] {
                    return layer;
                }
                let gp = grads_params(&layer, g, factor);
                o.step(lr, layer, gp)
            })
            .collect();
    }
}

fn transport_for(
    plan: &Plan,
    links: Option<&Cluster>,
    timeout: Duration,
) -> Result<Arc<dyn Transport>> {
    let links = match links {
        Some(c) => Some(devices_for_plan(plan, c).map_err(Error::from)?),
        None => None,
    };
    if let Some(c) = &links {
        check_link_times(plan, c, timeout)?;
    }
    Ok(InProcess::emulated(plan.num_workers(), links, timeout))
}

/// Every emulated link a route uses delivers a message within the peer timeout, or the run is
/// refused before it starts (an infinite or huge link time would only time out mid-run).
fn check_link_times(plan: &Plan, cluster: &Cluster, timeout: Duration) -> Result<()> {
    for route in &plan.routes {
        for hop in route.windows(2) {
            let (a, b) = (hop[0].worker, hop[1].worker);
            let secs = cluster.transfer_time(a, b, 1);
            if !(secs.is_finite() && secs <= timeout.as_secs_f64()) {
                return Err(Error::Config(format!(
                    "the emulated link from worker {a} ({}) to worker {b} ({}) takes {secs} s per message, beyond the peer timeout of {} s: the run could not finish",
                    cluster.devices[a].name,
                    cluster.devices[b].name,
                    timeout.as_secs_f64()
                )));
            }
        }
    }
    Ok(())
}

/// Freshly initialised layer blocks (the model's seed) with fresh optimizers.
/// Can `plan` run with layer blocks `0..k` frozen? They must sit in stage 0 (whose input is
/// tokens) with at least one training layer after them.
fn check_frozen(plan: &Plan, k: usize) -> Result<()> {
    let first = plan.layers_per_stage().first().copied().unwrap_or(0);
    if k > pipewright_core::policy::freeze::max_frozen(plan) {
        return Err(Error::Config(format!(
            "{k} frozen layer blocks do not fit inside stage 0 ({first} layer blocks) with one that trains after them; re-plan so that stage 0 holds more"
        )));
    }
    Ok(())
}

/// Workers for `plan` (all, or only `rank`), each with copies of the layer blocks (and
/// optimizers) of the stages it hosts. Copies get their own autodiff leaves: replicas must not
/// share graph nodes.
fn build_workers(plan: &Plan, state: &[LayerState], rank: Option<usize>) -> Vec<Worker> {
    let ranges = plan.layer_ranges();
    let topo = Topology::new(plan);
    (0..plan.num_workers())
        .filter(|&w| rank.is_none_or(|r| r == w))
        .map(|w| Worker {
            rank: w,
            frozen: 0,
            weight_only: Vec::new(),
            stages: topo.held[w]
                .iter()
                .map(|&s| {
                    let r = ranges[s].clone();
                    HeldStage {
                        stage: s,
                        first_layer: r.start,
                        module: Stage {
                            layers: state[r.clone()]
                                .iter()
                                .map(|(l, _)| fresh_copy(l.clone()))
                                .collect(),
                        },
                        optims: state[r].iter().map(|(_, o)| o.clone()).collect(),
                    }
                })
                .collect(),
        })
        .collect()
}

//! Stage workers: each interprets its action list from the Plan IR. F receives an activation,
//! runs the stage forward keeping the graph, and sends the output on; BW receives the output's
//! gradient, backpropagates, sends the input gradient back and accumulates weight gradients.
//! The schedule lives in the plan only; nothing here knows GPipe from 1F1B.

use crate::backend::{autodiff_lock, plain_device, train_device};
use crate::batch::MicroBatch;
use crate::cache::PrefixCache;
use crate::grads::{add_grads, GradSource};
use crate::model::{batch_loss, Deferred, Stage, StageInput};
use crate::transport::{Kind, Payload, Tag, Transport, TransportError};
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::{Tensor, TensorData};
use pipewright_core::plan::ir::{Action, Hop, Op, Plan, RouteIndex};
use pipewright_core::sim::timeline::{Message, SpanKind, TimedAction, TimedSpan};
use std::collections::{HashMap, HashSet};
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("worker {worker}: {msg}")]
    Plan { worker: usize, msg: String },
    #[error(
        "loss is not finite ({0}) at this step: training diverged (lower the learning rate or check the data)"
    )]
    NonFinite(f64),
}

/// A stage held by a worker: its layer blocks as one module and one optimizer per block.
pub struct HeldStage {
    pub stage: usize,
    /// Model index of the stage's first layer block.
    pub first_layer: usize,
    pub module: Stage,
    /// AdamW per layer block, so optimizer state moves with its layer.
    pub optims: Vec<ModuleOptimizer>,
}

/// What every worker of a step reads.
pub struct StepInput<'a> {
    /// Micro-batch `m` of the job is `batches[m]`.
    pub batches: &'a [MicroBatch],
    /// What each micro-batch's mean loss is scaled by (see [`StepInput::new`]).
    pub scales: Vec<f32>,
    /// AutoCache for the frozen prefix's outputs, if on.
    pub cache: Option<&'a PrefixCache>,
    /// Keep each micro-batch's logits (`forward`'s output); training does not.
    pub keep_logits: bool,
}

impl<'a> StepInput<'a> {
    /// The input of a step on `batches`. Each micro-batch's mean loss is scaled so that the
    /// step's loss is the mean over every target of the batch: by 1 / micro-batches when every
    /// position has a target, else by its share of the batch's targets (Hugging Face's mean
    /// over labelled tokens). Counted once here, not at every forward.
    pub fn new(
        batches: &'a [MicroBatch],
        cache: Option<&'a PrefixCache>,
        keep_logits: bool,
    ) -> Self {
        let labelled = |b: &MicroBatch| match b.unread {
            true => b.rows * b.target_len,
            false => b.targets.iter().filter(|&&t| t >= 0).count(),
        };
        let scales = if batches.iter().all(|b| labelled(b) == b.rows * b.target_len) {
            vec![1.0 / batches.len().max(1) as f32; batches.len()]
        } else {
            let total = batches.iter().map(labelled).sum::<usize>().max(1) as f32;
            batches.iter().map(|b| labelled(b) as f32 / total).collect()
        };
        StepInput {
            batches,
            scales,
            cache,
            keep_logits,
        }
    }
}

/// One worker of the plan, with the stages it hosts.
pub struct Worker {
    /// The plan's worker index (the rank).
    pub rank: usize,
    pub stages: Vec<HeldStage>,
    /// Layer blocks `0..frozen` are frozen: they run forward only, outside autodiff (the
    /// trainer keeps the frozen prefix inside stage 0, whose input is tokens).
    pub frozen: usize,
    /// Layer blocks past the prefix frozen for their weights only (`--freeze critical`): their
    /// input gradient still flows to the blocks before them, but their weights take no part in
    /// autodiff, so no backward computes (or W defers) their weight gradients.
    pub weight_only: Vec<usize>,
}

impl Worker {
    /// Does layer block `layer` (model order) train: sum gradients and take optimizer steps?
    pub fn trains(&self, layer: usize) -> bool {
        layer >= self.frozen && !self.weight_only.contains(&layer)
    }
}

/// What one worker reports after an iteration's forward and backward.
pub struct WorkerOutput {
    /// Accumulated weight gradients per held stage, per layer block, flattened.
    pub grads: Vec<Vec<Vec<f32>>>,
    /// Sum of the (unscaled) mean losses of the micro-batches whose route ends here.
    pub loss_sum: f64,
    /// The same, each scaled by its [`StepInput::scales`].
    pub scaled_loss: f64,
    pub actions: Vec<TimedAction>,
    /// Measured sends and receive waits (the trainer adds the all-reduce and optimizer step).
    pub spans: Vec<TimedSpan>,
    /// (micro-batch, logits) where routes end here, with `keep_logits`.
    pub logits: Vec<(usize, Payload)>,
}

fn to_payload(t: &Tensor<3>) -> Payload {
    Payload {
        shape: t.dims().to_vec(),
        values: t.to_data().try_to_vec::<f32>().expect("f32 activations"),
    }
}

fn from_payload(p: Payload) -> Tensor<3> {
    Tensor::<3>::from_data(TensorData::new(p.values, p.shape), &train_device())
}

/// Kept between a stage's forward and its backward.
struct Saved {
    input: Option<Tensor<3>>,
    /// Linear-layer inputs whose weight gradients wait for W (split schedules only).
    deferred: Option<Deferred>,
    /// The stage output, or the scaled loss for the last stage on the route.
    output: Out,
}

enum Out {
    Hidden(Tensor<3>),
    Loss(Tensor<1>),
}

impl Worker {
    /// Run this worker's actions for one iteration on `input`; scaled losses make the
    /// accumulated gradients those of the mean loss. Split (B + W) or fused (BW) backward is decided
    /// per (stage, micro-batch): split where the plan gives this worker a W for it. With a
    /// `cache`, the frozen prefix's outputs come from (and go to) it.
    pub fn run(
        &self,
        plan: &Plan,
        routes: &RouteIndex,
        transport: &dyn Transport,
        input: &StepInput,
        clock: Instant,
    ) -> Result<WorkerOutput, ExecError> {
        let mut it = Iteration::new(self, plan, routes, transport, input, clock);
        for a in &plan.workers[self.rank] {
            // Receiving is waiting, not work: each action's clock starts after it.
            let start = match a.op {
                Op::F => it.forward(a)?,
                Op::B => it.backward_input(a)?,
                Op::W => it.backward_weight(a)?,
                Op::BW => it.backward(a)?,
            };
            it.actions.push(TimedAction {
                worker: self.rank,
                action: *a,
                start,
                end: clock.elapsed().as_secs_f64(),
            });
        }
        Ok(it.finish())
    }
}

/// A worker's state through one iteration: what each forward saved for its backward, what a
/// B deferred to its W, and the weight gradients so far. One method per action kind, as
/// torch.distributed.pipelining's stage has (`forward_one_chunk`, `backward_one_chunk`,
/// `backward_weight_one_chunk`); each returns when its compute started.
struct Iteration<'a> {
    worker: &'a Worker,
    plan: &'a Plan,
    routes: &'a RouteIndex,
    transport: &'a dyn Transport,
    input: &'a StepInput<'a>,
    clock: Instant,
    /// (stage, mb) whose backward is split into B and W on this worker.
    split: HashSet<(usize, usize)>,
    saved: HashMap<(usize, usize), Saved>,
    /// After B, before W: Linear inputs and output gradients of (stage, mb).
    waiting_w: HashMap<(usize, usize), Deferred>,
    grads: Vec<Vec<Vec<f32>>>,
    loss_sum: f64,
    scaled_loss: f64,
    actions: Vec<TimedAction>,
    spans: std::cell::RefCell<Vec<TimedSpan>>,
    logits: Vec<(usize, Payload)>,
    /// Each held stage as it runs when some of its blocks are frozen (once per iteration
    /// rather than per micro-batch); `None`: the held module as it is.
    frozen_split: Vec<Option<FrozenSplit>>,
}

impl<'a> Iteration<'a> {
    fn new(
        worker: &'a Worker,
        plan: &'a Plan,
        routes: &'a RouteIndex,
        transport: &'a dyn Transport,
        input: &'a StepInput<'a>,
        clock: Instant,
    ) -> Self {
        let mine = &plan.workers[worker.rank];
        Iteration {
            split: mine
                .iter()
                .filter(|a| a.op == Op::W)
                .map(|a| (a.stage, a.mb))
                .collect(),
            saved: HashMap::new(),
            waiting_w: HashMap::new(),
            grads: worker
                .stages
                .iter()
                .map(|h| vec![Vec::new(); h.module.layers.len()])
                .collect(),
            loss_sum: 0.0,
            scaled_loss: 0.0,
            actions: Vec::with_capacity(mine.len()),
            spans: std::cell::RefCell::new(Vec::with_capacity(2 * mine.len())),
            logits: Vec::new(),
            frozen_split: frozen_splits(worker),
            worker,
            plan,
            routes,
            transport,
            input,
            clock,
        }
    }

    fn bad(&self, msg: String) -> ExecError {
        ExecError::Plan {
            worker: self.worker.rank,
            msg,
        }
    }

    /// The slot of the held stage `a` runs on, and its micro-batch.
    fn locate(&self, a: &Action) -> Result<(usize, &'a MicroBatch), ExecError> {
        let slot = self
            .worker
            .stages
            .iter()
            .position(|h| h.stage == a.stage)
            .ok_or_else(|| self.bad(format!("{a} on a stage this worker does not hold")))?;
        let mb = self
            .input
            .batches
            .get(a.mb)
            .ok_or_else(|| self.bad(format!("{a}: no micro-batch {}", a.mb)))?;
        Ok((slot, mb))
    }

    /// Record a measured span of this worker from `start` (seconds on the step's clock), with
    /// the message a send or receive moved.
    fn span(&self, kind: SpanKind, stage: usize, start: f64, message: Option<Message>) {
        self.spans.borrow_mut().push(TimedSpan {
            worker: self.worker.rank,
            kind,
            stage: Some(stage),
            start,
            end: self.clock.elapsed().as_secs_f64(),
            message,
        });
    }

    fn recv(&self, from: usize, kind: Kind, a: &Action) -> Result<Payload, ExecError> {
        let tag = Tag {
            kind,
            stage: a.stage,
            mb: a.mb,
        };
        let start = self.clock.elapsed().as_secs_f64();
        let p = self.transport.recv(self.worker.rank, from, tag)?;
        let m = message(from, kind, a.mb, p.bytes());
        self.span(SpanKind::Receive, a.stage, start, Some(m));
        Ok(p)
    }

    fn send(&self, to: Hop, kind: Kind, mb: usize, t: &Tensor<3>) {
        let tag = Tag {
            kind,
            stage: to.stage,
            mb,
        };
        let start = self.clock.elapsed().as_secs_f64();
        let payload = to_payload(t);
        let m = message(to.worker, kind, mb, payload.bytes());
        self.transport
            .send(self.worker.rank, to.worker, tag, payload);
        self.span(SpanKind::Send, to.stage, start, Some(m));
    }

    /// F: receive the activation (or embed the tokens), run the stage keeping the graph, and
    /// send the output on, or take the loss where the route ends.
    fn forward(&mut self, a: &Action) -> Result<f64, ExecError> {
        let (slot, mb) = self.locate(a)?;
        let prev = self.routes.prev(self.plan, a.mb, a.stage);
        let next = self.routes.next(self.plan, a.mb, a.stage);
        let received = match prev {
            None => None,
            Some(p) => Some(self.recv(p.worker, Kind::Activation, a)?),
        };
        let _guard = autodiff_lock();
        let start = self.clock.elapsed().as_secs_f64();
        let input = received.map(|p| from_payload(p).require_grad());
        let (x, run) = self.stage_input(a, slot, mb, &input)?;
        let ctx = crate::model::Ctx::of(mb, &train_device());
        let mut deferred = self
            .split
            .contains(&(a.stage, a.mb))
            .then(Deferred::default);
        let y = match deferred.as_mut() {
            Some(d) => run.forward_split(x, &ctx, d),
            None => run.forward_in(x, &ctx),
        }
        .map_err(|e| self.bad(format!("{a}: {e}")))?;
        let output = match next {
            Some(n) => {
                self.send(n, Kind::Activation, a.mb, &y);
                Out::Hidden(y)
            }
            None if !self.worker.stages[slot].module.has_head() => {
                return Err(self.bad(format!(
                    "{a}: the route of mb {} ends at stage {}, which does not hold the head",
                    a.mb, a.stage
                )))
            }
            None => {
                if self.input.keep_logits {
                    self.logits.push((a.mb, to_payload(&y)));
                }
                let l = batch_loss(y, mb);
                let v = l.clone().into_scalar::<f32>() as f64;
                if !v.is_finite() {
                    return Err(ExecError::NonFinite(v));
                }
                let scale = self.input.scales[a.mb];
                self.loss_sum += v;
                self.scaled_loss += v * scale as f64;
                Out::Loss(l * scale)
            }
        };
        let saved = Saved {
            input,
            deferred,
            output,
        };
        self.saved.insert((a.stage, a.mb), saved);
        Ok(start)
    }

    /// What the stage's forward takes (tokens, the received activation, or the frozen prefix's
    /// output as a constant), and the module that runs on it.
    fn stage_input(
        &self,
        a: &Action,
        slot: usize,
        mb: &MicroBatch,
        input: &Option<Tensor<3>>,
    ) -> Result<(StageInput, &Stage), ExecError> {
        let held: &'a HeldStage = &self.worker.stages[slot];
        let stage = &held.module;
        let k = self
            .worker
            .frozen
            .saturating_sub(held.first_layer)
            .min(stage.layers.len());
        let split = self.frozen_split[slot].as_ref();
        let run = split.map_or(stage, |s| &s.run);
        match (input, k, split.and_then(|s| s.prefix.as_ref())) {
            (None, 0, _) => Ok((crate::model::batch_input(mb, &train_device()), run)),
            (Some(h), 0, _) => Ok((StageInput::Hidden(h.clone()), run)),
            (None, _, Some(pre)) => {
                // The frozen prefix: forward without autodiff (or read from the cache); its
                // output enters the graph as a constant.
                let h = match self.input.cache {
                    Some(c) => c
                        .prefix_output(pre, mb)
                        .map_err(|e| self.bad(format!("{a}: {e}")))?,
                    // With the micro-batch's padding mask and token types, as it trained.
                    None => pre
                        .forward_in(
                            crate::model::batch_input(mb, &plain_device()),
                            &crate::model::Ctx::of(mb, &plain_device()),
                        )
                        .map_err(|e| self.bad(format!("{a}: {e}")))?,
                };
                let h = Tensor::<3>::from_data(h.to_data(), &train_device());
                Ok((StageInput::Hidden(h), run))
            }
            _ => Err(self.bad(format!(
                "{a}: {k} frozen layer blocks of stage {} (the frozen prefix must stay inside stage 0, with a layer that trains after it)",
                a.stage
            ))),
        }
    }

    /// BW: the full backward of (stage, mb), every weight gradient included.
    fn backward(&mut self, a: &Action) -> Result<f64, ExecError> {
        self.backprop(a)
    }

    /// B: the input gradient, and every weight gradient but the Linear layers' (kept for W).
    fn backward_input(&mut self, a: &Action) -> Result<f64, ExecError> {
        self.backprop(a)
    }

    /// What B and BW share: receive the output's gradient, backpropagate, send the input
    /// gradient back, accumulate weight gradients; B keeps what its forward deferred for W.
    fn backprop(&mut self, a: &Action) -> Result<f64, ExecError> {
        let (slot, _) = self.locate(a)?;
        let prev = self.routes.prev(self.plan, a.mb, a.stage);
        let next = self.routes.next(self.plan, a.mb, a.stage);
        let s = self
            .saved
            .remove(&(a.stage, a.mb))
            .ok_or_else(|| self.bad(format!("{a} before its forward")))?;
        let received = match (&s.output, next) {
            (Out::Hidden(_), Some(n)) => Some(self.recv(n.worker, Kind::Gradient, a)?),
            _ => None,
        };
        let _guard = autodiff_lock();
        let start = self.clock.elapsed().as_secs_f64();
        let g = match (s.output, received.map(from_payload)) {
            (Out::Loss(l), _) => l.backward(),
            (Out::Hidden(y), Some(dy)) => (y * dy).sum().backward(),
            (Out::Hidden(_), None) => unreachable!("gradient received above"),
        };
        if let (Some(pv), Some(x)) = (prev, &s.input) {
            let dx = x
                .grad(&g)
                .ok_or_else(|| self.bad(format!("{a}: no input gradient")))?;
            self.send(pv, Kind::Gradient, a.mb, &dx);
        }
        self.accumulate(slot, &GradSource::Autodiff(&g));
        match (a.op, s.deferred) {
            (Op::B, Some(mut d)) => {
                d.keep(&g);
                self.waiting_w.insert((a.stage, a.mb), d);
            }
            (Op::B, None) => {
                return Err(self.bad(format!("{a}: forward did not defer weight gradients")))
            }
            (_, Some(_)) => {
                return Err(self.bad(format!("{a}: a fused backward after a split forward")))
            }
            _ => {}
        }
        Ok(start)
    }

    /// W: the Linear layers' weight gradients that B deferred.
    fn backward_weight(&mut self, a: &Action) -> Result<f64, ExecError> {
        let (slot, _) = self.locate(a)?;
        let d = self
            .waiting_w
            .remove(&(a.stage, a.mb))
            .ok_or_else(|| self.bad(format!("{a} before its B")))?;
        let _guard = autodiff_lock();
        let start = self.clock.elapsed().as_secs_f64();
        let w = d.weight_grads();
        self.accumulate(slot, &GradSource::Deferred(&w));
        Ok(start)
    }

    fn accumulate(&mut self, slot: usize, src: &GradSource) {
        let stage = &self.worker.stages[slot].module;
        for (layer, out) in stage.layers.iter().zip(self.grads[slot].iter_mut()) {
            add_grads(layer, src, out);
        }
    }

    fn finish(mut self) -> WorkerOutput {
        for (held, g) in self.worker.stages.iter().zip(self.grads.iter_mut()) {
            // A layer no micro-batch reached still has (zero) gradients of the right size.
            for (layer, out) in held.module.layers.iter().zip(g.iter_mut()) {
                out.resize(burn::module::Module::num_params(layer), 0.0);
            }
        }
        WorkerOutput {
            grads: self.grads,
            loss_sum: self.loss_sum,
            scaled_loss: self.scaled_loss,
            actions: self.actions,
            spans: self.spans.into_inner(),
            logits: self.logits,
        }
    }
}

/// A held stage with frozen blocks, as it runs: the frozen prefix as a non-autodiff copy (if
/// the stage holds one), and the layers after it, weight-only frozen ones without gradients.
struct FrozenSplit {
    prefix: Option<Stage>,
    run: Stage,
}

fn frozen_splits(worker: &Worker) -> Vec<Option<FrozenSplit>> {
    let _guard = autodiff_lock();
    worker
        .stages
        .iter()
        .map(|h| {
            let n = h.module.layers.len();
            let k = worker.frozen.saturating_sub(h.first_layer);
            let weight_only = (k..n).any(|j| worker.weight_only.contains(&(h.first_layer + j)));
            // A prefix covering the whole stage cannot run (`stage_input` refuses it).
            if k >= n || (k == 0 && !weight_only) {
                return None;
            }
            let prefix = (k > 0).then(|| Stage {
                layers: h.module.layers[..k].to_vec(),
            });
            let run = Stage {
                layers: (k..n)
                    .map(|j| {
                        let l = h.module.layers[j].clone();
                        match worker.weight_only.contains(&(h.first_layer + j)) {
                            true => burn::module::Module::no_grad(l),
                            false => l,
                        }
                    })
                    .collect(),
            };
            Some(FrozenSplit {
                prefix: prefix.map(|p| p.valid()),
                run,
            })
        })
        .collect()
}

/// What a send or receive moved, for the measured timeline's link tracks.
fn message(peer: usize, kind: Kind, mb: usize, bytes: u64) -> Message {
    Message {
        peer,
        mb,
        gradient: kind == Kind::Gradient,
        bytes,
    }
}

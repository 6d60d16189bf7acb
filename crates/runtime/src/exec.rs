//! Stage workers: each interprets its action list from the Plan IR. F receives an activation,
//! runs the stage forward keeping the graph, and sends the output on; BW receives the output's
//! gradient, backpropagates, sends the input gradient back and accumulates weight gradients.
//! The schedule lives in the plan only; nothing here knows GPipe from 1F1B.

use crate::backend::{autodiff_lock, plain_device, train_device};
use crate::cache::PrefixCache;
use crate::data::MicroBatch;
use crate::grads::{add_grads, GradSource};
use crate::model::{loss, Deferred, Stage, StageInput};
use crate::transport::{Kind, Payload, Tag, Transport, TransportError};
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::{Tensor, TensorData};
use pipewright_core::plan::ir::{Op, Plan, RouteIndex};
use pipewright_core::sim::timeline::TimedAction;
use std::collections::{HashMap, HashSet};
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("worker {worker}: {msg}")]
    Plan { worker: usize, msg: String },
    #[error(
        "loss is not finite ({0}) at this step: training diverged (lower --lr or check the data)"
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
    /// Each micro-batch's loss is scaled by this (1 / all micro-batches).
    pub scale: f32,
    /// AutoCache for the frozen prefix's outputs, if on.
    pub cache: Option<&'a PrefixCache>,
}

/// One worker of the plan, with the stages it hosts.
pub struct Worker {
    /// The plan's worker index (the rank).
    pub rank: usize,
    pub stages: Vec<HeldStage>,
    /// Layer blocks `0..frozen` are frozen: they run forward only, outside autodiff (the
    /// trainer keeps the frozen prefix inside stage 0, whose input is tokens).
    pub frozen: usize,
}

/// What one worker reports after an iteration's forward and backward.
pub struct WorkerOutput {
    /// Accumulated weight gradients per held stage, per layer block, flattened.
    pub grads: Vec<Vec<Vec<f32>>>,
    /// Sum of the (unscaled) mean losses of the micro-batches whose route ends here.
    pub loss_sum: f64,
    pub actions: Vec<TimedAction>,
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
        let (batches, scale, cache) = (input.batches, input.scale, input.cache);
        let mine = &plan.workers[self.rank];
        let split: HashSet<(usize, usize)> = mine
            .iter()
            .filter(|a| a.op == Op::W)
            .map(|a| (a.stage, a.mb))
            .collect();
        let mut saved: HashMap<(usize, usize), Saved> = HashMap::new();
        // After B, before W: Linear inputs and output gradients of (stage, mb).
        let mut waiting_w: HashMap<(usize, usize), Deferred> = HashMap::new();
        let mut grads: Vec<Vec<Vec<f32>>> = self
            .stages
            .iter()
            .map(|h| vec![Vec::new(); h.module.layers.len()])
            .collect();
        let mut loss_sum = 0.0;
        let mut actions = Vec::with_capacity(mine.len());
        // A held stage with a frozen prefix: that prefix without autodiff, and the layers after
        // it, split once per iteration rather than per micro-batch.
        let frozen_split: Vec<Option<(Stage, Stage)>> = {
            let _guard = autodiff_lock();
            self.stages
                .iter()
                .map(|h| {
                    let k = self.frozen.saturating_sub(h.first_layer);
                    (k > 0 && k < h.module.layers.len()).then(|| {
                        let pre = Stage {
                            layers: h.module.layers[..k].to_vec(),
                        };
                        let rest = Stage {
                            layers: h.module.layers[k..].to_vec(),
                        };
                        (pre.valid(), rest)
                    })
                })
                .collect()
        };
        let bad = |msg: String| ExecError::Plan {
            worker: self.rank,
            msg,
        };
        for a in mine {
            let slot = self
                .stages
                .iter()
                .position(|h| h.stage == a.stage)
                .ok_or_else(|| bad(format!("{a} on a stage this worker does not hold")))?;
            let stage = &self.stages[slot].module;
            let mb = batches
                .get(a.mb)
                .ok_or_else(|| bad(format!("{a}: no micro-batch {}", a.mb)))?;
            let prev = routes.prev(plan, a.mb, a.stage);
            let next = routes.next(plan, a.mb, a.stage);
            let recv_tag = |kind| Tag {
                kind,
                stage: a.stage,
                mb: a.mb,
            };
            // Receiving is waiting, not work: start the clock after it.
            match a.op {
                Op::F => {
                    let received = match prev {
                        None => None,
                        Some(p) => {
                            Some(transport.recv(self.rank, p.worker, recv_tag(Kind::Activation))?)
                        }
                    };
                    let _guard = autodiff_lock();
                    let start = clock.elapsed().as_secs_f64();
                    let input = received.map(|p| from_payload(p).require_grad());
                    let k = self
                        .frozen
                        .saturating_sub(self.stages[slot].first_layer)
                        .min(stage.layers.len());
                    let (x, rest) = match (&input, k, &frozen_split[slot]) {
                        (None, 0, _) => (StageInput::Tokens(mb.ids(&mb.tokens)), None),
                        (Some(h), 0, _) => (StageInput::Hidden(h.clone()), None),
                        (None, _, Some((pre, rest))) => {
                            // The frozen prefix: forward without autodiff (or read from the
                            // cache); its output enters the graph as a constant.
                            let h = match cache {
                                Some(c) => c
                                    .prefix_output(pre, mb)
                                    .map_err(|e| bad(format!("{a}: {e}")))?,
                                None => pre.forward(StageInput::Tokens(
                                    mb.ids_on(&mb.tokens, &plain_device()),
                                )),
                            };
                            let h = Tensor::<3>::from_data(h.to_data(), &train_device());
                            (StageInput::Hidden(h), Some(rest))
                        }
                        _ => {
                            return Err(bad(format!(
                                "{a}: {k} frozen layer blocks of stage {} (the frozen prefix must stay inside stage 0, with a layer that trains after it)",
                                a.stage
                            )))
                        }
                    };
                    let run = rest.unwrap_or(stage);
                    let mut deferred = split.contains(&(a.stage, a.mb)).then(Deferred::default);
                    let y = match deferred.as_mut() {
                        Some(d) => run.forward_split(x, d),
                        None => run.try_forward(x),
                    }
                    .map_err(|e| bad(format!("{a}: {e}")))?;
                    let output = match next {
                        Some(n) => {
                            transport.send(
                                self.rank,
                                n.worker,
                                Tag {
                                    kind: Kind::Activation,
                                    stage: n.stage,
                                    mb: a.mb,
                                },
                                to_payload(&y),
                            );
                            Out::Hidden(y)
                        }
                        None if !stage.has_head() => {
                            return Err(bad(format!(
                                "{a}: the route of mb {} ends at stage {}, which does not hold the head",
                                a.mb, a.stage
                            )))
                        }
                        None => {
                            let l = loss(y, mb.ids(&mb.targets));
                            let v = l.clone().into_scalar::<f32>() as f64;
                            if !v.is_finite() {
                                return Err(ExecError::NonFinite(v));
                            }
                            loss_sum += v;
                            Out::Loss(l * scale)
                        }
                    };
                    saved.insert(
                        (a.stage, a.mb),
                        Saved {
                            input,
                            deferred,
                            output,
                        },
                    );
                    actions.push(TimedAction {
                        worker: self.rank,
                        action: *a,
                        start,
                        end: clock.elapsed().as_secs_f64(),
                    });
                }
                Op::BW | Op::B => {
                    let s = saved
                        .remove(&(a.stage, a.mb))
                        .ok_or_else(|| bad(format!("{a} before its forward")))?;
                    let received = match (&s.output, next) {
                        (Out::Hidden(_), Some(n)) => {
                            Some(transport.recv(self.rank, n.worker, recv_tag(Kind::Gradient))?)
                        }
                        _ => None,
                    };
                    let _guard = autodiff_lock();
                    let start = clock.elapsed().as_secs_f64();
                    let dy = received.map(from_payload);
                    let g = match (s.output, dy) {
                        (Out::Loss(l), _) => l.backward(),
                        (Out::Hidden(y), Some(dy)) => (y * dy).sum().backward(),
                        (Out::Hidden(_), None) => unreachable!("gradient received above"),
                    };
                    if let (Some(pv), Some(x)) = (prev, &s.input) {
                        let dx = x
                            .grad(&g)
                            .ok_or_else(|| bad(format!("{a}: no input gradient")))?;
                        transport.send(
                            self.rank,
                            pv.worker,
                            Tag {
                                kind: Kind::Gradient,
                                stage: pv.stage,
                                mb: a.mb,
                            },
                            to_payload(&dx),
                        );
                    }
                    // BW: every weight gradient. B: all but the Linear layers' (deferred to W).
                    let src = GradSource::Autodiff(&g);
                    for (layer, out) in stage.layers.iter().zip(grads[slot].iter_mut()) {
                        add_grads(layer, &src, out);
                    }
                    match (a.op, s.deferred) {
                        (Op::B, Some(d)) => {
                            waiting_w.insert((a.stage, a.mb), d);
                        }
                        (Op::B, None) => {
                            return Err(bad(format!("{a}: forward did not defer weight gradients")))
                        }
                        (_, Some(_)) => {
                            return Err(bad(format!("{a}: a fused backward after a split forward")))
                        }
                        _ => {}
                    }
                    actions.push(TimedAction {
                        worker: self.rank,
                        action: *a,
                        start,
                        end: clock.elapsed().as_secs_f64(),
                    });
                }
                Op::W => {
                    let d = waiting_w
                        .remove(&(a.stage, a.mb))
                        .ok_or_else(|| bad(format!("{a} before its B")))?;
                    let _guard = autodiff_lock();
                    let start = clock.elapsed().as_secs_f64();
                    let w = d.weight_grads();
                    let src = GradSource::Deferred(&w);
                    for (layer, out) in stage.layers.iter().zip(grads[slot].iter_mut()) {
                        add_grads(layer, &src, out);
                    }
                    actions.push(TimedAction {
                        worker: self.rank,
                        action: *a,
                        start,
                        end: clock.elapsed().as_secs_f64(),
                    });
                }
            }
        }
        for (held, g) in self.stages.iter().zip(grads.iter_mut()) {
            // A layer no micro-batch reached still has (zero) gradients of the right size.
            for (layer, out) in held.module.layers.iter().zip(g.iter_mut()) {
                out.resize(burn::module::Module::num_params(layer), 0.0);
            }
        }
        Ok(WorkerOutput {
            grads,
            loss_sum,
            actions,
        })
    }
}

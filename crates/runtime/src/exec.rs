//! Stage workers: each interprets its action list from the Plan IR. F receives an activation,
//! runs the stage forward keeping the graph, and sends the output on; BW receives the output's
//! gradient, backpropagates, sends the input gradient back and accumulates weight gradients.
//! The schedule lives in the plan only; nothing here knows GPipe from 1F1B.

use crate::backend::{autodiff_lock, plain_device, train_device};
use crate::data::MicroBatch;
use crate::model::{loss, Deferred, Stage, StageInput};
use crate::transport::{Kind, Payload, Tag, Transport, TransportError};
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Tensor, TensorData};
use pipewright_core::ir::{Op, Plan, RouteIndex};
use pipewright_core::sim::TimedAction;
use std::collections::HashMap;
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

/// One pipeline worker of one replica, with the stages it holds.
pub struct Worker {
    /// Global rank: `replica * P + w`.
    pub rank: usize,
    pub replica: usize,
    /// Worker index within the pipeline (the plan's worker).
    pub w: usize,
    /// (stage index, module) for every stage placed on this worker.
    pub stages: Vec<(usize, Stage)>,
}

/// What one worker reports after an iteration's forward and backward.
pub struct WorkerOutput {
    /// Accumulated weight gradients per held stage, flattened in parameter order.
    pub grads: Vec<Vec<f32>>,
    /// Sum over this worker's last-stage micro-batches of their (unscaled) mean loss.
    pub loss_sum: f64,
    pub actions: Vec<TimedAction>,
}

/// Where parameter gradients come from: an autodiff backward, or a W step's deferred
/// Linear weight gradients (by parameter id).
pub enum GradSource<'a> {
    Autodiff(&'a Gradients),
    Deferred(&'a HashMap<ParamId, Vec<f32>>),
}

/// Flatten `module`'s parameter gradients from `src` into `out` (added), in visit order.
pub fn add_grads<M: Module>(module: &M, src: GradSource, out: &mut Vec<f32>) {
    struct V<'a> {
        src: GradSource<'a>,
        out: &'a mut Vec<f32>,
        pos: usize,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let t = p.val();
            let n = t.shape().num_elements();
            if self.out.len() < self.pos + n {
                self.out.resize(self.pos + n, 0.0);
            }
            let g = match &self.src {
                GradSource::Autodiff(grads) => t
                    .grad(grads)
                    .map(|g| g.into_data().try_into_vec::<f32>().expect("f32 gradients")),
                GradSource::Deferred(map) => map.get(&p.id).cloned(),
            };
            if let Some(g) = g {
                self.out[self.pos..self.pos + n]
                    .iter_mut()
                    .zip(g)
                    .for_each(|(o, x)| *o += x);
            }
            self.pos += n;
        }
    }
    module.visit(&mut V { src, out, pos: 0 });
}

/// Turn a flat gradient buffer (scaled by `scale`) back into burn's per-parameter gradients.
pub fn grads_params<M: Module>(module: &M, flat: &[f32], scale: f32) -> GradientsParams {
    struct V<'a> {
        flat: &'a [f32],
        scale: f32,
        pos: usize,
        out: GradientsParams,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let shape = p.val().shape();
            let n = shape.num_elements();
            let vals: Vec<f32> = self.flat[self.pos..self.pos + n]
                .iter()
                .map(|x| x * self.scale)
                .collect();
            self.out.register(
                p.id,
                Tensor::<D>::from_data(TensorData::new(vals, shape), &plain_device()),
            );
            self.pos += n;
        }
    }
    let mut v = V {
        flat,
        scale,
        pos: 0,
        out: GradientsParams::new(),
    };
    module.visit(&mut v);
    v.out
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
    /// Run this worker's actions for one iteration. `batches[m]` is micro-batch `m` of this
    /// replica; each micro-batch's loss is scaled by `scale` (1 / all micro-batches of all
    /// replicas) so accumulated gradients are those of the mean loss.
    pub fn run(
        &self,
        plan: &Plan,
        routes: &RouteIndex,
        transport: &dyn Transport,
        batches: &[MicroBatch],
        scale: f32,
        clock: Instant,
    ) -> Result<WorkerOutput, ExecError> {
        let p = plan.num_workers();
        let base = self.replica * p;
        let mut saved: HashMap<(usize, usize), Saved> = HashMap::new();
        // After B, before W: Linear inputs and output gradients of (stage, mb).
        let mut waiting_w: HashMap<(usize, usize), Deferred> = HashMap::new();
        let split = plan.splits_backward();
        let mut grads: Vec<Vec<f32>> = vec![Vec::new(); self.stages.len()];
        let mut loss_sum = 0.0;
        let mut actions = Vec::with_capacity(plan.workers[self.w].len());
        let bad = |msg: String| ExecError::Plan {
            worker: self.rank,
            msg,
        };
        for a in &plan.workers[self.w] {
            let slot = self
                .stages
                .iter()
                .position(|(s, _)| *s == a.stage)
                .ok_or_else(|| bad(format!("{a} on a stage this worker does not hold")))?;
            let stage = &self.stages[slot].1;
            let mb = &batches[a.mb];
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
                        Some(_) => Some(transport.recv(self.rank, recv_tag(Kind::Activation))?),
                    };
                    let _guard = autodiff_lock();
                    let start = clock.elapsed().as_secs_f64();
                    let input = received.map(|p| from_payload(p).require_grad());
                    let x = match &input {
                        None => StageInput::Tokens(mb.ids(&mb.tokens)),
                        Some(h) => StageInput::Hidden(h.clone()),
                    };
                    let mut deferred = split.then(Deferred::default);
                    let y = match deferred.as_mut() {
                        Some(d) => stage.forward_split(x, d),
                        None => stage.forward(x),
                    };
                    let output = match next {
                        Some(n) => {
                            transport.send(
                                self.rank,
                                base + plan.placement[n],
                                Tag {
                                    kind: Kind::Activation,
                                    stage: n,
                                    mb: a.mb,
                                },
                                to_payload(&y),
                            );
                            Out::Hidden(y)
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
                    let received = match &s.output {
                        Out::Hidden(_) => {
                            Some(transport.recv(self.rank, recv_tag(Kind::Gradient))?)
                        }
                        Out::Loss(_) => None,
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
                            base + plan.placement[pv],
                            Tag {
                                kind: Kind::Gradient,
                                stage: pv,
                                mb: a.mb,
                            },
                            to_payload(&dx),
                        );
                    }
                    // BW: every weight gradient. B: all but the Linear layers' (deferred to W).
                    add_grads(stage, GradSource::Autodiff(&g), &mut grads[slot]);
                    if a.op == Op::B {
                        let mut d = s.deferred.ok_or_else(|| {
                            bad(format!("{a}: forward did not defer weight gradients"))
                        })?;
                        d.take_output_grads(&g);
                        waiting_w.insert((a.stage, a.mb), d);
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
                    add_grads(
                        stage,
                        GradSource::Deferred(&d.weight_grads()),
                        &mut grads[slot],
                    );
                    actions.push(TimedAction {
                        worker: self.rank,
                        action: *a,
                        start,
                        end: clock.elapsed().as_secs_f64(),
                    });
                }
            }
        }
        for (slot, (_, stage)) in self.stages.iter().enumerate() {
            // A stage no micro-batch visited still has (zero) gradients of the right size.
            grads[slot].resize(stage.num_params(), 0.0);
        }
        Ok(WorkerOutput {
            grads,
            loss_sum,
            actions,
        })
    }
}

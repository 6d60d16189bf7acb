//! Plain single-worker training: the reference for exact-gradient tests. The whole model in one
//! thread; each micro-batch runs the layer sequence its route in the plan visits (skipped and
//! swapped stages included), and one backward covers all micro-batches at once.

use super::layers::{fresh_state, LayerState};
use super::TrainConfig;
use crate::batch::MicroBatch;
use crate::data::{Corpus, Sampler};
use crate::grads::{add_grads, clip_factor, flat_params, grads_params, sum_squares, GradSource};
use crate::model::{batch_loss, LayerBlock, Stage, StageInput};
use burn::tensor::Tensor;
use pipewright_core::plan::ir::Plan;

pub struct PlainTrainer {
    pub cfg: TrainConfig,
    /// Layer sequence of each micro-batch of a step (from the plan's routes).
    sequences: Vec<Vec<usize>>,
    state: Vec<LayerState>,
    pub step: u64,
    /// Layer blocks `0..frozen` take no optimizer step and leave the gradient norm.
    pub frozen: usize,
    /// So do these, though the backward still runs through them: the reference for weight-only
    /// freezing, which the pipeline does by dropping their weight gradients.
    pub weight_only: Vec<usize>,
    sampler: Sampler,
}

impl PlainTrainer {
    /// Train what `plan` trains (its routes' layer sequences), without pipelining.
    pub fn new(cfg: TrainConfig, plan: &Plan) -> Self {
        let ranges = plan.layer_ranges();
        let sequences = plan
            .routes
            .iter()
            .map(|r| r.iter().flat_map(|h| ranges[h.stage].clone()).collect())
            .collect();
        let state = fresh_state(&cfg);
        PlainTrainer {
            sampler: cfg.sampler(),
            cfg,
            sequences,
            state,
            step: 0,
            frozen: 0,
            weight_only: Vec::new(),
        }
    }

    fn trains(&self, i: usize) -> bool {
        i >= self.frozen && !self.weight_only.contains(&i)
    }

    /// The whole model as one stage (model order).
    pub fn model(&self) -> Stage {
        Stage {
            layers: self.state.iter().map(|(l, _)| l.clone()).collect(),
        }
    }

    pub fn flat_params(&self) -> Vec<f32> {
        self.state
            .iter()
            .flat_map(|(l, _)| flat_params(l))
            .collect()
    }

    /// One step; returns the mean loss over the step's micro-batches.
    pub fn train_step(&mut self, corpus: &Corpus) -> f64 {
        let n = self.sequences.len();
        let batches = self
            .sampler
            .batches(&corpus.train, self.step, n)
            .expect("the corpus holds a step of samples");
        let c = &self.cfg;
        // Micro-batches with the same layer sequence (and length) run as one batch.
        let mut groups: Vec<(Vec<usize>, Vec<usize>)> = Vec::new();
        for (mb, seq) in self.sequences.iter().enumerate() {
            let t = batches[mb].seq_len;
            match groups
                .iter_mut()
                .find(|(s, mbs)| s == seq && batches[mbs[0]].seq_len == t)
            {
                Some((_, mbs)) => mbs.push(mb),
                None => groups.push((seq.clone(), vec![mb])),
            }
        }
        let mut total: Option<Tensor<1>> = None;
        let mut value = 0.0;
        for (seq, mbs) in &groups {
            let parts: Vec<&MicroBatch> = mbs.iter().map(|&i| &batches[i]).collect();
            let cat = |f: fn(&MicroBatch) -> &Vec<i64>| -> Vec<i64> {
                parts.iter().flat_map(|m| f(m).iter().copied()).collect()
            };
            let all = MicroBatch {
                rows: parts.iter().map(|m| m.rows).sum(),
                seq_len: parts[0].seq_len,
                tokens: cat(|m| &m.tokens),
                targets: cat(|m| &m.targets),
                target_len: parts[0].target_len,
                token_types: cat(|m| &m.token_types),
                mask: cat(|m| &m.mask),
                ..MicroBatch::default()
            };
            let ctx = crate::model::Ctx::of(&all, &crate::backend::train_device());
            let mut x = StageInput::Tokens(all.ids(&all.tokens));
            for &i in seq {
                let stage = Stage {
                    layers: vec![self.state[i].0.clone()],
                };
                x = StageInput::Hidden(stage.forward_in(x, &ctx).expect("a layer sequence"));
            }
            let StageInput::Hidden(logits) = x else {
                unreachable!("routes are not empty")
            };
            // The group's mean loss stands for |group| micro-batches of the job's n.
            let l = batch_loss(logits, &all) * (mbs.len() as f32 / n as f32);
            value += l.clone().into_scalar::<f32>() as f64;
            total = Some(match total {
                Some(t) => t + l,
                None => l,
            });
        }
        let g = total.expect("at least one micro-batch").backward();
        let src = GradSource::Autodiff(&g);
        let flat: Vec<Vec<f32>> = self
            .state
            .iter()
            .enumerate()
            .map(|(i, (l, _))| {
                let mut f = Vec::new();
                if self.trains(i) {
                    add_grads(l, &src, &mut f);
                }
                f.resize(burn::module::Module::num_params(l), 0.0);
                f
            })
            .collect();
        let norm = (sum_squares(&flat) as f64).sqrt();
        let factor = clip_factor(norm, c.clip);
        let lr = c.lr_at(self.step);
        let state = std::mem::take(&mut self.state);
        self.state = state
            .into_iter()
            .zip(&flat)
            .enumerate()
            .map(|(i, ((l, mut o), g)): (usize, ((LayerBlock, _), _))| {
                if !self.trains(i) {
                    return (l, o);
                }
                let gp = grads_params(&l, g, factor);
                let l = o.step(lr, l, gp);
                (l, o)
            })
            .collect();
        self.step += 1;
        value
    }
}

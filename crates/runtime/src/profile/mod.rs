//! Measure each layer block on this machine: forward and backward time for one micro-batch,
//! parameter bytes and output bytes, as a profile `simulate`, `partition` and `plan` accept.

use crate::backend::train_device;
use crate::grads::{add_grads, grads_params, sum_squares, GradSource};
use crate::model::{loss, Deferred, Layers, ModelConfig, Stage, StageInput};
use burn::module::Module;
use burn::tensor::{Distribution, Int, Tensor, TensorData};
use pipewright_core::profile::{Layer, ModelInfo, Profile};
use std::time::Instant;

pub mod llama;

/// The middle value (the upper one of an even count), as every timing here reports.
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Time every layer block of `cfg` on micro-batches of `rows` sequences, `repeats` times each
/// (median): forward, the full (fused) backward, and a split backward's two parts as this
/// runtime runs them: B (input gradients, Linear weight gradients deferred) and W (the
/// deferred weight matmuls).
pub fn profile_model(cfg: &ModelConfig, rows: usize, repeats: usize, seed: u64) -> Profile {
    let mut p = Profiler::new(cfg, rows, seed);
    for _ in 0..repeats.max(1) + 1 {
        p.sample();
    }
    p.profile()
}

/// Each timing of one layer block, one entry per [`Profiler::sample`].
#[derive(Default)]
struct Samples {
    fwd: Vec<f64>,
    bwd: Vec<f64>,
    wgt: Vec<f64>,
    bsplit: Vec<f64>,
    opt: Vec<f64>,
}

/// A profile measured a pass at a time, so that passes can be spread over a training run
/// (`train --compare-sim` takes one after each step): on a machine whose speed drifts with
/// other load, the profile and the steps it is compared with then see the same machine.
pub struct Profiler {
    cfg: ModelConfig,
    rows: usize,
    /// Positions per row of the next passes (the model's length unless told otherwise).
    len: usize,
    layers: Layers,
    optims: Vec<burn::optim::ModuleOptimizer>,
    samples: Vec<Samples>,
}

impl Profiler {
    pub fn new(cfg: &ModelConfig, rows: usize, seed: u64) -> Self {
        let dev = train_device();
        let blocks = cfg.num_blocks();
        Profiler {
            cfg: cfg.clone(),
            rows,
            len: cfg.seq_len,
            layers: Layers::new(cfg, seed, &dev),
            optims: (0..blocks)
                .map(|_| {
                    burn::optim::AdamWConfig::new()
                        .with_weight_decay(0.01)
                        .init()
                })
                .collect(),
            samples: (0..blocks).map(|_| Samples::default()).collect(),
        }
    }

    /// Time the next passes at `len` positions per row (1 to the model's length): what the
    /// training steps ran, when micro-batches are padded only to their longest row.
    pub fn set_len(&mut self, len: usize) {
        self.len = len.clamp(1, self.cfg.seq_len.max(1));
    }

    /// Passes taken so far.
    pub fn passes(&self) -> usize {
        self.samples.first().map_or(0, |s| s.fwd.len())
    }

    /// One timing of every layer block: forward, fused backward, optimizer step, and a split
    /// backward's B and W. The layers run in the order a stage runs them in training: every
    /// forward, then every backward in reverse, then (split) every B in reverse, then every W;
    /// a layer's backward then finds its activations as far out of cache as in training,
    /// rather than straight after its own forward.
    pub fn sample(&mut self) {
        let dev = train_device();
        let (cfg, rows) = (&self.cfg, self.rows);
        let (t, d_model) = (self.len, cfg.d_model);
        let blocks = cfg.num_blocks();
        let stages: Vec<Stage> = (0..blocks).map(|i| self.layers.stage(i, i + 1)).collect();
        // Tokens for the embedding block, random hidden states for the others.
        let make_input = |i: usize| {
            if i == 0 {
                let toks: Vec<i64> = (0..rows * t).map(|k| (k * 7 % cfg.vocab) as i64).collect();
                StageInput::Tokens(Tensor::<2, Int>::from_data(
                    TensorData::new(toks, [rows, t]),
                    &dev,
                ))
            } else {
                StageInput::Hidden(
                    Tensor::<3>::random([rows, t, d_model], Distribution::Normal(0.0, 1.0), &dev)
                        .require_grad(),
                )
            }
        };
        // The output gradient arrives ready-made in training: drawn before the clock. The
        // last block's backward starts from the loss instead.
        let backward = |i: usize, y: Tensor<3>| {
            let seed = if i == blocks - 1 {
                // Targets of the head's own shape: a token per position, a class per row, or
                // an answer's start and end.
                let [b, n, v] = y.dims();
                let targets: Vec<i64> = (0..b * n).map(|k| (k * 3 % v) as i64).collect();
                let targets = Tensor::<2, Int>::from_data(TensorData::new(targets, [b, n]), &dev);
                let t1 = Instant::now();
                return (loss(y, targets), t1);
            } else {
                Tensor::<3>::random(y.dims(), Distribution::Normal(0.0, 1.0), &dev)
            };
            let t1 = Instant::now();
            ((y * seed).sum(), t1)
        };
        let mut outputs = Vec::with_capacity(blocks);
        for (i, stage) in stages.iter().enumerate() {
            let input = make_input(i);
            let t0 = Instant::now();
            let y = stage.forward(input);
            let _ = y.to_data(); // wait for the result
            self.samples[i].fwd.push(t0.elapsed().as_secs_f64());
            outputs.push(y);
        }
        let mut flats = vec![Vec::new(); blocks];
        for i in (0..blocks).rev() {
            let y = outputs.pop().expect("one output per block");
            let (root, t1) = backward(i, y);
            let grads = root.backward();
            // As a BW action does: accumulate the layer's weight gradients (flattened).
            add_grads(
                &stages[i].layers[0],
                &GradSource::Autodiff(&grads),
                &mut flats[i],
            );
            drop(grads);
            self.samples[i].bwd.push(t1.elapsed().as_secs_f64());
        }
        for (i, (stage, flat)) in stages.iter().zip(&flats).enumerate() {
            // The optimizer step the trainer takes over the layer: its share of the global
            // norm, the gradients back as parameters, AdamW.
            let t3 = Instant::now();
            let _ = sum_squares(std::iter::once(flat));
            let layer = stage.layers[0].clone();
            let gp = grads_params(&layer, flat, 1.0);
            let _ = self.optims[i].step(1e-3, layer, gp);
            self.samples[i].opt.push(t3.elapsed().as_secs_f64());
        }
        // The split backward: B accumulates the weight gradients that were not deferred, W
        // (after every B, as a zero-bubble schedule runs it later) the deferred ones.
        let mut split = Vec::with_capacity(blocks);
        for (i, stage) in stages.iter().enumerate() {
            let mut d = Deferred::default();
            let y = stage
                .forward_split(make_input(i), &crate::model::Ctx::default(), &mut d)
                .expect("one layer block, right input");
            split.push((y, d));
        }
        let mut deferred = Vec::with_capacity(blocks);
        for i in (0..blocks).rev() {
            let (y, d) = split.pop().expect("one output per block");
            let (root, t1) = backward(i, y);
            let g = root.backward();
            let mut flat = Vec::new();
            add_grads(&stages[i].layers[0], &GradSource::Autodiff(&g), &mut flat);
            self.samples[i].bsplit.push(t1.elapsed().as_secs_f64());
            deferred.push((i, d, flat));
        }
        for (i, d, mut flat) in deferred.into_iter().rev() {
            let t2 = Instant::now();
            let w = d.weight_grads();
            add_grads(&stages[i].layers[0], &GradSource::Deferred(&w), &mut flat);
            self.samples[i].wgt.push(t2.elapsed().as_secs_f64());
        }
    }

    /// The profile: each figure the median over the passes after the first (which warms
    /// caches and allocators; with a single pass, that one). Panics before any pass.
    pub fn profile(&self) -> Profile {
        let cfg = &self.cfg;
        let (rows, t, d_model) = (self.rows, cfg.seq_len, cfg.d_model);
        let blocks = cfg.num_blocks();
        let med = |xs: &[f64]| median(xs[1.min(xs.len() - 1)..].to_vec());
        let layers = (0..blocks)
            .map(|i| {
                let s = &self.samples[i];
                let name = match i {
                    0 => "embed".to_string(),
                    x if x == blocks - 1 => "head".to_string(),
                    x => format!("block{}", x - 1),
                };
                let out_width = if i == blocks - 1 { cfg.vocab } else { d_model };
                let backward = med(&s.bwd);
                Layer {
                    name,
                    forward: med(&s.fwd),
                    backward: Some(backward),
                    weight_grad: Some(med(&s.wgt).min(backward)),
                    input_grad: Some(med(&s.bsplit)),
                    optimizer: Some(med(&s.opt)),
                    params: 4 * self.layers.stage(i, i + 1).num_params() as u64,
                    activation: 4 * (rows * t * out_width) as u64,
                }
            })
            .collect();
        let name = format!("{} rows {rows} (measured)", cfg.describe());
        Profile {
            model: ModelInfo { name },
            layers,
        }
    }
}

/// One op of a transformer block at the model's shapes, timed alone (median of repeats).
#[derive(Debug, Clone)]
pub struct OpTime {
    pub name: &'static str,
    /// Times the op runs per block (its time below counts all of them).
    pub count: usize,
    pub forward: f64,
    /// Forward and backward of the op (input and weight gradients).
    pub forward_backward: f64,
}

impl OpTime {
    /// An op run `count` times per block, from one run's (forward, forward + backward) times.
    pub(crate) fn timed(name: &'static str, count: usize, (f, fb): (f64, f64)) -> Self {
        OpTime {
            name,
            count,
            forward: f * count as f64,
            forward_backward: fb * count as f64,
        }
    }
}

impl Alternative {
    /// Another way to compute `replaces` (op names with the fraction of each op's row).
    pub(crate) fn timed(
        name: &'static str,
        times: (f64, f64),
        replaces: Vec<(&'static str, f64)>,
    ) -> Self {
        Alternative {
            op: OpTime::timed(name, 1, times),
            replaces,
        }
    }
}

/// A transformer block's ops timed alone, the whole block, and alternatives the model could use
/// instead of some of its ops (measured so that the choice stays a measured one).
#[derive(Debug, Clone)]
pub struct OpBreakdown {
    pub ops: Vec<OpTime>,
    pub whole: OpTime,
    pub alternatives: Vec<Alternative>,
}

/// Another way to compute part of the block: its time, and the ops (by name, with the fraction
/// of each op's row) it would replace.
#[derive(Debug, Clone)]
pub struct Alternative {
    pub op: OpTime,
    pub replaces: Vec<(&'static str, f64)>,
}

/// Where a transformer block's time goes: each op of [`crate::model::Block`]'s forward at
/// the shapes of `cfg` with micro-batches of `rows` sequences, timed alone forward and
/// forward + backward, then the whole block the same way (the difference is what the ops
/// cost together beyond alone: graph bookkeeping, allocation, cache effects).
/// For the gpt family; [`llama::op_breakdown`] breaks down a LLaMA block.
pub fn op_breakdown(cfg: &ModelConfig, rows: usize, repeats: usize) -> OpBreakdown {
    let g = GptBlock::new(cfg, rows);
    let ops = g.ops(repeats);
    OpBreakdown {
        ops,
        whole: whole_block(cfg, &g.dev, repeats, || g.x3(g.d)),
        alternatives: g.alternatives(repeats),
    }
}

/// The first block of a model of `cfg`, timed as one op on inputs from `input` (the last row
/// of a breakdown, for every family).
fn whole_block(
    cfg: &ModelConfig,
    dev: &burn::tensor::Device,
    repeats: usize,
    input: impl Fn() -> Tensor<3>,
) -> OpTime {
    let layers = Layers::new(cfg, 1, dev);
    let block = layers.stage(1, 2);
    let times = time_op(repeats, input, |x| block.forward(StageInput::Hidden(x)));
    OpTime::timed("whole block", 1, times)
}

/// A GPT block's shapes at micro-batches of `b` sequences, its parameters, and random inputs.
struct GptBlock {
    b: usize,
    t: usize,
    d: usize,
    h: usize,
    dh: usize,
    scale: f32,
    dev: burn::tensor::Device,
    ln: burn::nn::LayerNorm,
    qkv: burn::nn::Linear,
    up: burn::nn::Linear,
    down: burn::nn::Linear,
}

impl GptBlock {
    fn new(cfg: &ModelConfig, rows: usize) -> Self {
        use burn::nn::{LayerNormConfig, LinearConfig};
        let dev = train_device();
        let (d, h) = (cfg.d_model, cfg.heads);
        GptBlock {
            b: rows,
            t: cfg.seq_len,
            d,
            h,
            dh: d / h,
            scale: 1.0 / ((d / h) as f32).sqrt(),
            ln: LayerNormConfig::new(d)
                .with_epsilon(crate::kernels::LN_EPS as f64)
                .init(&dev),
            qkv: LinearConfig::new(d, d).init(&dev),
            up: LinearConfig::new(d, 4 * d).init(&dev),
            down: LinearConfig::new(4 * d, d).init(&dev),
            dev,
        }
    }

    fn x3(&self, w: usize) -> Tensor<3> {
        let dims = [self.b, self.t, w];
        Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), &self.dev).require_grad()
    }

    /// Queries, keys and values split into heads.
    fn qkv_heads(&self) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
        let dims = [self.b, self.h, self.t, self.dh];
        let r =
            || Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), &self.dev).require_grad();
        (r(), r(), r())
    }

    fn lin(l: &burn::nn::Linear, x: Tensor<3>) -> Tensor<3> {
        crate::kernels::linear(x, l.weight.val(), l.bias.as_ref().map(|b| b.val()))
    }

    /// The block's ops, each timed alone, with how many times the block runs it.
    fn ops(&self, repeats: usize) -> Vec<OpTime> {
        use crate::kernels as k;
        let (b, t, d, h, dh, scale) = (self.b, self.t, self.d, self.h, self.dh, self.scale);
        let x3 = |w| self.x3(w);
        let mut out = Vec::new();
        let mut push = |name, count, times| out.push(OpTime::timed(name, count, times));
        let norm = time_op(repeats, || x3(d), |x| k::layer_norm(&self.ln, x));
        push("layer norm", 2, norm);
        let proj = time_op(repeats, || x3(d), |x| Self::lin(&self.qkv, x));
        push("q, k, v, o projections (d x d)", 4, proj);
        let split = |x: Tensor<3>| {
            x.reshape([b, t, h, dh])
                .swap_dims(1, 2)
                .swap_dims(1, 2)
                .reshape([b, t, d])
        };
        push(
            "head split and merge (reshape, swap)",
            4,
            time_op(repeats, || x3(d), split),
        );
        let att = time_op(
            repeats,
            || self.qkv_heads(),
            |(q, kk, v)| k::causal_attention(q, kk, v, scale).reshape([b, h * t, dh]),
        );
        push("causal attention (fused)", 1, att);
        push(
            "MLP up (d x 4d)",
            1,
            time_op(repeats, || x3(d), |x| Self::lin(&self.up, x)),
        );
        push("GELU", 1, time_op(repeats, || x3(4 * d), k::gelu));
        let down = time_op(repeats, || x3(4 * d), |x| Self::lin(&self.down, x));
        push("MLP down (4d x d)", 1, down);
        let adds = time_op(repeats, || (x3(d), x3(d)), |(x, y)| x + y);
        push("residual adds", 2, adds);
        out
    }

    /// burn's own ops for the same maths: what the kernels replaced, measured in the same run.
    fn alternatives(&self, repeats: usize) -> Vec<Alternative> {
        use crate::kernels as k;
        use burn::tensor::activation::{gelu, gelu_approximate};
        use burn::tensor::module::attention;
        use burn::tensor::ops::AttentionModuleOptions;
        let (b, t, d, h, dh, scale) = (self.b, self.t, self.d, self.h, self.dh, self.scale);
        let x3 = |w| self.x3(w);
        let qkv3 = burn::nn::LinearConfig::new(d, 3 * d).init(&self.dev);
        let alt = Alternative::timed;
        vec![
            alt(
                "burn LayerNorm",
                time_op(repeats, || x3(d), |x| self.ln.forward(x)),
                vec![("layer norm", 0.5)],
            ),
            alt(
                "burn Linear (flex GEMM), d x d",
                time_op(repeats, || x3(d), |x| self.qkv.forward(x)),
                vec![("q, k, v, o projections (d x d)", 0.25)],
            ),
            alt(
                "burn Linear (flex GEMM), d x 4d",
                time_op(repeats, || x3(d), |x| self.up.forward(x)),
                vec![("MLP up (d x 4d)", 1.0)],
            ),
            alt(
                "burn GELU (exact)",
                time_op(repeats, || x3(4 * d), gelu),
                vec![("GELU", 1.0)],
            ),
            alt(
                "burn GELU, tanh approximation",
                time_op(repeats, || x3(4 * d), gelu_approximate),
                vec![("GELU", 1.0)],
            ),
            // One d x 3d product, then q, k, v as slices of it (the adds stand for their three
            // uses).
            alt(
                "q, k, v as one d x 3d projection",
                time_op(
                    repeats,
                    || x3(d),
                    |x| {
                        let p = Self::lin(&qkv3, x).chunk(3, 2);
                        p[0].clone() + p[1].clone() + p[2].clone()
                    },
                ),
                vec![("q, k, v, o projections (d x d)", 0.75)],
            ),
            alt(
                "scores, causal softmax, x v as 3 ops",
                time_op(
                    repeats,
                    || self.qkv_heads(),
                    |(q, kk, v)| {
                        let w = k::causal_softmax(k::matmul(q, kk.swap_dims(2, 3)), scale);
                        k::matmul(w, v).reshape([b, h * t, dh])
                    },
                ),
                vec![("causal attention (fused)", 1.0)],
            ),
            alt(
                "burn's attention op (causal)",
                time_op(
                    repeats,
                    || self.qkv_heads(),
                    |(q, kk, v)| {
                        let options = AttentionModuleOptions {
                            scale: None,
                            softcap: None,
                            is_causal: true,
                        };
                        attention(q, kk, v, None, None, options).reshape([b, h * t, dh])
                    },
                ),
                vec![("causal attention (fused)", 1.0)],
            ),
        ]
    }
}

/// Time `f` (building its input with `input`) forward, then forward + backward: medians of
/// `repeats` after one left out.
fn time_op<I>(repeats: usize, input: impl Fn() -> I, f: impl Fn(I) -> Tensor<3>) -> (f64, f64) {
    let (mut fw, mut fb) = (Vec::new(), Vec::new());
    for _ in 0..repeats.max(1) + 1 {
        let x = input();
        let t0 = Instant::now();
        let _ = f(x).to_data();
        fw.push(t0.elapsed().as_secs_f64());
        let x = input();
        let t0 = Instant::now();
        let _ = f(x).sum().backward();
        fb.push(t0.elapsed().as_secs_f64());
    }
    fw.remove(0);
    fb.remove(0);
    (median(fw), median(fb))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Passes taken one at a time give one figure per field and layer block, the first pass
    /// left out; every figure is a real (positive) time, and B + W account for a split backward.
    #[test]
    fn profiler_passes_make_a_profile() {
        let cfg = ModelConfig {
            vocab: 32,
            d_model: 16,
            heads: 2,
            layers: 2,
            seq_len: 8,
            ..ModelConfig::default()
        };
        let mut p = Profiler::new(&cfg, 2, 7);
        assert_eq!(p.passes(), 0);
        for _ in 0..3 {
            p.sample();
        }
        assert_eq!(p.passes(), 3);
        let prof = p.profile();
        let names: Vec<&str> = prof.layers.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["embed", "block0", "block1", "head"]);
        for l in &prof.layers {
            assert!(l.forward > 0.0, "{}: forward {}", l.name, l.forward);
            let b = l.backward.expect("backward measured");
            assert!(b > 0.0 && l.input_grad.unwrap() > 0.0 && l.optimizer.unwrap() > 0.0);
            assert!(
                l.weight_grad.unwrap() <= b,
                "{}: W above the whole backward",
                l.name
            );
        }
        // The block's parameters: 4 d x d projections and the MLP (d x 4d, 4d x d) with biases,
        // two layer norms; as bytes.
        let d = 16u64;
        let block = 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d;
        assert_eq!(prof.layers[1].params, 4 * block);
        assert_eq!(prof.layers[1].activation, 4 * 2 * 8 * 16);
    }
}

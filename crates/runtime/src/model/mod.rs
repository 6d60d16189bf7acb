//! Transformers as a sequence of layer blocks that a plan cuts into stages: layer 0 = the
//! embedding, layers 1..=L = transformer blocks, layer L+1 = final norm + LM head. The family
//! ([`Family`]) decides what a block is: pipewright's GPT (here: learned positions,
//! pre-LayerNorm blocks of causal multi-head attention and a GELU MLP) or LLaMA
//! ([`llama`]).

use crate::kernels::{OutputGrad, LN_EPS};
use burn::module::{Module, ParamId};
use burn::nn::{LayerNorm, LayerNormConfig, Linear};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor};
use error::Error;

pub mod bert;
mod config;
mod costs;
pub mod error;
pub mod generate;
pub mod gpt;
pub use gpt::{Block, Embed, Head};
pub mod gpt2;
pub mod hf;
mod hf_json;
pub mod llama;
mod parts;
pub mod registry;
mod rules;
pub mod spec;
pub mod vit;
pub use config::{Llama3Scaling, ModelConfig, TaskHead};
pub(crate) mod layer;
pub use registry::{Family, LayerBlock};

/// The position of every token of `[b, t]` ids: `0..t` in each row.
pub(crate) fn positions(tokens: &Tensor<2, Int>) -> Tensor<2, Int> {
    let [b, t] = tokens.dims();
    Tensor::<1, Int>::arange(0..t as i64, &tokens.device())
        .reshape([1, t])
        .repeat_dim(0, b)
}

/// Weight gradients of Linear layers held back from the input-gradient backward (B) so that a
/// later W step computes them: for each Linear, its input and the slot its output gradient
/// is left in by B. `dW = x^T dy`, `db = sum(dy)` are exactly the products a fused backward
/// would have done.
#[derive(Default)]
pub struct Deferred {
    /// (weight id, bias id, layer input [rows, in] without autodiff, its output gradient).
    entries: Vec<(ParamId, Option<ParamId>, Tensor<2>, Dy)>,
}

/// A deferred Linear's output gradient: still to come from B, or kept from it.
enum Dy {
    Coming(OutputGrad),
    Kept(Box<Tensor<2>>),
}

impl Deferred {
    /// After B's backward (`grads`): keep the output gradients its probes received.
    pub fn keep(&mut self, grads: &burn::tensor::Gradients) {
        for e in &mut self.entries {
            if let Dy::Coming(OutputGrad::Probe(p)) = &e.3 {
                if let Some(dy) = p.grad(grads) {
                    e.3 = Dy::Kept(Box::new(dy));
                }
            }
        }
    }

    /// The W step: the Linear layers' weight and bias gradients, by parameter id. A layer
    /// whose output gradient never came (its output did not reach the loss) gets zeros.
    pub fn weight_grads(self) -> std::collections::HashMap<ParamId, Vec<f32>> {
        let mut out = std::collections::HashMap::new();
        for (w, b, x, dy) in self.entries {
            let dy = match dy {
                Dy::Kept(dy) => *dy,
                Dy::Coming(OutputGrad::Slot(slot)) => match slot.take() {
                    Some(d) => Tensor::<2>::from_data(d, &crate::backend::plain_device()),
                    None => continue,
                },
                Dy::Coming(OutputGrad::Probe(_)) => continue,
            };
            let dw = crate::kernels::matmul(x.transpose(), dy.clone());
            out.insert(w, dw.into_data().try_into_vec::<f32>().expect("f32"));
            if let Some(b) = b {
                out.insert(b, crate::kernels::bias_grad(&dy));
            }
        }
        out
    }
}

/// A Linear layer; with a `Deferred`, its weights take no part in autodiff (so the backward
/// skips their gradient products) and its output gradient is kept for the W step.
pub(crate) fn linear(l: &Linear, x: Tensor<3>, cap: &mut Option<&mut Deferred>) -> Tensor<3> {
    let (w, b) = (l.weight.val(), l.bias.as_ref().map(|b| b.val()));
    match cap {
        // A weight-only frozen layer (its weights outside autodiff) has no gradient to defer.
        _ if !w.is_require_grad() => crate::kernels::linear(x, w, b),
        None => crate::kernels::linear(x, w, b),
        Some(d) => {
            let [n, t, i] = x.dims();
            let x = x.reshape([n * t, i]);
            let o = w.dims()[1];
            let (y, dy) = crate::kernels::linear_deferred(x.clone(), w, b);
            let bias = l.bias.as_ref().map(|b| b.id);
            d.entries
                .push((l.weight.id, bias, x.without_autodiff(), Dy::Coming(dy)));
            y.reshape([n, t, o])
        }
    }
}

/// Mean cross-entropy of next-token prediction.
pub fn loss(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
    let logp = log_softmax(logits, 2);
    logp.gather(2, targets.unsqueeze_dim(2)).mean().neg()
}

/// Mean cross-entropy over a micro-batch's targets; a negative target (Hugging Face's -100:
/// no label there) is left out of the mean.
pub fn batch_loss(logits: Tensor<3>, mb: &crate::batch::MicroBatch) -> Tensor<1> {
    let device = logits.device();
    let shape = [mb.rows, mb.target_len];
    let ids =
        |v: Vec<i64>| Tensor::<2, Int>::from_data(burn::tensor::TensorData::new(v, shape), &device);
    if mb.targets.iter().all(|&t| t >= 0) {
        return loss(logits, ids(mb.targets.clone()));
    }
    let kept: Vec<f32> = mb.targets.iter().map(|&t| (t >= 0) as u8 as f32).collect();
    let count = kept.iter().sum::<f32>().max(1.0);
    let clamped: Vec<i64> = mb.targets.iter().map(|&t| t.max(0)).collect();
    let weights = Tensor::<2>::from_data(burn::tensor::TensorData::new(kept, shape), &device);
    let logp = log_softmax(logits, 2).gather(2, ids(clamped).unsqueeze_dim(2));
    (logp.squeeze_dim::<2>(2) * weights).sum().neg() / count
}

/// The whole model's layer blocks, in order; built once from a seed so that every way of
/// cutting it starts from the same weights.
#[derive(Module, Debug)]
pub struct Layers {
    pub blocks: Vec<LayerBlock>,
}

impl Layers {
    pub fn new(cfg: &ModelConfig, seed: u64, device: &Device) -> Self {
        device.seed(seed); // burn draws its initial values first; ours replace them below
        let blocks = LayerBlock::build(cfg, device);
        // burn's initialisers draw from a process-wide generator that other threads share, so
        // weights are set here from our own generator: GPT-2 style N(0, 0.02)-like uniform for
        // matrices, zero biases, norms' ones and zeros as built.
        let mut layers = Layers { blocks }.map(&mut Init {
            rng: pipewright_core::rng::SplitMix64::new(seed),
            seed,
            count: 0,
            path: Vec::new(),
        });
        if cfg.tie_embeddings {
            tie(&mut layers.blocks);
        }
        layers
    }

    /// Layer block `i` in model order (a clone that shares parameter ids with `self`).
    pub fn block(&self, i: usize) -> LayerBlock {
        self.blocks[i].clone()
    }

    /// All layer blocks in model order.
    pub fn into_blocks(self) -> Vec<LayerBlock> {
        self.blocks
    }

    /// Layer blocks `lo..hi` as one stage module (clones share parameter ids with `self`).
    pub fn stage(&self, lo: usize, hi: usize) -> Stage {
        Stage {
            layers: self.blocks[lo..hi].to_vec(),
        }
    }
}

/// A tied model's head starts as the embedding's matrix (transposed: burn's Linear keeps
/// `[in, out]`); training keeps the two equal (see `train::tied`).
fn tie(blocks: &mut [LayerBlock]) {
    let Some(w) = blocks.first().and_then(LayerBlock::token_embedding) else {
        return;
    };
    let [v, d] = w.dims();
    let vals = w.into_data().try_into_vec::<f32>().expect("f32 weights");
    let t = hf::transpose(&vals, v, d);
    let Some(head) = blocks.last_mut().and_then(LayerBlock::lm_head_mut) else {
        return;
    };
    let device = head.weight.val().device();
    head.weight = head.weight.clone().map(|_| {
        Tensor::<2>::from_data(burn::tensor::TensorData::new(t, [d, v]), &device).require_grad()
    });
}

/// A causal model's head: its final norm, then the LM head at every position, or a task's
/// `score` at each sequence's last token.
fn causal_head(
    x: Tensor<3>,
    norm: impl Fn(Tensor<3>) -> Tensor<3>,
    lm_head: &Option<Linear>,
    score: &Option<Linear>,
    ctx: &Ctx,
    cap: &mut Option<&mut Deferred>,
) -> Tensor<3> {
    match (score, lm_head) {
        (Some(s), _) => linear(s, norm(ctx.last_token(x)), cap),
        (None, Some(h)) => linear(h, norm(x), cap),
        (None, None) => unreachable!("a causal head is built with an LM head or a score"),
    }
}

/// A causal model's last linear: the LM head (over the vocabulary, no bias), or a task's
/// `score` (over the classes, no bias), as transformers builds them.
fn head_linears(cfg: &ModelConfig, device: &Device) -> (Option<Linear>, Option<Linear>) {
    let lin = |o: usize| {
        burn::nn::LinearConfig::new(cfg.d_model, o)
            .with_bias(false)
            .init(device)
    };
    match cfg.head {
        Some(_) => (None, Some(lin(cfg.classes()))),
        None => (Some(lin(cfg.vocab)), None),
    }
}

/// A LayerNorm of width `d` with the kernels' epsilon ([`LN_EPS`]).
pub(crate) fn layer_norm_of(d: usize, device: &Device) -> LayerNorm {
    LayerNormConfig::new(d)
        .with_epsilon(LN_EPS as f64)
        .init(device)
}

/// A copy with its own autodiff leaves. Clones share parameter nodes, and burn's autodiff merges
/// graphs that share nodes: two replicas training on clones in two threads would share (and
/// deadlock on) one graph. Parameter ids are kept.
pub fn fresh_copy<M: Module>(m: M) -> M {
    struct Fresh;
    impl burn::module::ModuleMapper for Fresh {
        fn map_float<const D: usize>(
            &mut self,
            p: burn::module::Param<Tensor<D>>,
        ) -> burn::module::Param<Tensor<D>> {
            p.map(|t| {
                let device = t.device();
                Tensor::<D>::from_data(t.into_data(), &device).require_grad()
            })
        }
    }
    m.map(&mut Fresh)
}

struct Init {
    rng: pipewright_core::rng::SplitMix64,
    seed: u64,
    count: u64,
    path: Vec<String>,
}

impl burn::module::ModuleMapper for Init {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(
        &mut self,
        p: burn::module::Param<Tensor<D>>,
    ) -> burn::module::Param<Tensor<D>> {
        // Ids are part of the model too: optimizer state in a checkpoint is keyed by them.
        self.count += 1;
        let id =
            burn::module::ParamId::from(self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ self.count);
        // Every family's norm modules: ln1, ln_f, norm, input_layernorm, layer_norm,
        // layernorm_before (ViT's, which a test of the name's end missed).
        let in_norm = self
            .path
            .iter()
            .any(|n| n.starts_with("ln") || n.contains("norm"));
        let (_, t, mapper) = p.consume();
        let (shape, device) = (t.shape(), t.device());
        let n = shape.num_elements();
        let a = 0.02f32 * 3f32.sqrt();
        let value = if in_norm {
            t
        } else {
            let vals: Vec<f32> = if D >= 2 {
                (0..n)
                    .map(|_| {
                        ((self.rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
                    })
                    .collect()
            } else {
                vec![0.0; n]
            };
            Tensor::<D>::from_data(burn::tensor::TensorData::new(vals, shape), &device)
                .require_grad()
        };
        burn::module::Param::from_mapped_value(id, value, mapper)
    }
}

/// What the first stage of a route takes from a micro-batch: its pixels (vit) or its tokens.
pub fn batch_input(mb: &crate::batch::MicroBatch, device: &Device) -> StageInput {
    match mb.image {
        Some([c, h, w]) => StageInput::Pixels(Tensor::<4>::from_data(
            burn::tensor::TensorData::new(mb.pixels.clone(), [mb.rows, c, h, w]),
            device,
        )),
        None => StageInput::Tokens(mb.ids_on(&mb.tokens, device)),
    }
}

/// What a micro-batch tells the layers besides their input: BERT's token types (for the
/// embedding) and its padding (for attention). Every stage builds it from the micro-batch
/// itself, so nothing more crosses the pipeline than hidden states.
#[derive(Default, Clone)]
pub struct Ctx {
    pub token_types: Option<Tensor<2, Int>>,
    /// Added to attention scores: `[b, 1, 1, t]`, 0 where a key is a token, `f32::MIN` where
    /// it is padding (as transformers' extended attention mask).
    pub mask: Option<Tensor<4>>,
    /// `[b, 1, t]`, 1 at each sequence's last token (the last the mask keeps): where a causal
    /// model's classifier reads (as transformers' `*ForSequenceClassification`). None: the
    /// last position.
    pub last: Option<Tensor<3>>,
}

impl Ctx {
    pub fn of(mb: &crate::batch::MicroBatch, device: &Device) -> Ctx {
        let (b, t) = (mb.rows, mb.seq_len);
        let token_types = (!mb.token_types.is_empty()).then(|| mb.ids_on(&mb.token_types, device));
        let mask = mb.mask.contains(&0).then(|| {
            let add: Vec<f32> = mb
                .mask
                .iter()
                .map(|&m| if m == 0 { f32::MIN } else { 0.0 })
                .collect();
            Tensor::<4>::from_data(burn::tensor::TensorData::new(add, [b, 1, 1, t]), device)
        });
        let last = mask.is_some().then(|| {
            let mut one_hot = vec![0f32; b * t];
            for (r, row) in mb.mask.chunks(t).enumerate() {
                let at = row.iter().rposition(|&m| m != 0).unwrap_or(t - 1);
                one_hot[r * t + at] = 1.0;
            }
            Tensor::<3>::from_data(burn::tensor::TensorData::new(one_hot, [b, 1, t]), device)
        });
        Ctx {
            token_types,
            mask,
            last,
        }
    }

    /// Each sequence's hidden state at its last token: `[b, t, d]` to `[b, 1, d]`.
    pub fn last_token(&self, x: Tensor<3>) -> Tensor<3> {
        match &self.last {
            Some(one_hot) => one_hot.clone().matmul(x),
            None => {
                let t = x.dims()[1];
                x.narrow(1, t - 1, 1)
            }
        }
    }
}

/// The checkpoint name of layer block `i` of a model with `layers` transformer blocks:
/// `embed`, `block.0` .. `block.{layers - 1}`, `head`.
pub fn layer_name(i: usize, layers: usize) -> String {
    match i {
        0 => "embed".into(),
        i if i == layers + 1 => "head".into(),
        i => format!("block.{}", i - 1),
    }
}

/// A contiguous run of layer blocks: what one stage of a plan runs.
#[derive(Module, Debug)]
pub struct Stage {
    pub layers: Vec<LayerBlock>,
}

/// What enters a stage: tokens (first stage) or hidden states.
pub enum StageInput {
    Tokens(Tensor<2, Int>),
    /// `[b, c, h, w]` images (vit).
    Pixels(Tensor<4>),
    Hidden(Tensor<3>),
}

impl Stage {
    /// Hidden states out, or logits if the stage holds the head.
    pub fn forward(&self, input: StageInput) -> Tensor<3> {
        self.forward_with(input, &Ctx::default(), &mut None)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`Stage::forward`], with a wrong input (tokens for a hidden-state layer, or the
    /// reverse) as an error rather than a panic: plans from files reach here.
    pub fn try_forward(&self, input: StageInput) -> Result<Tensor<3>, Error> {
        self.forward_with(input, &Ctx::default(), &mut None)
            .map_err(Error::Input)
    }

    /// [`Stage::try_forward`] with the micro-batch's context (token types, padding).
    pub fn forward_in(&self, input: StageInput, ctx: &Ctx) -> Result<Tensor<3>, Error> {
        self.forward_with(input, ctx, &mut None)
            .map_err(Error::Input)
    }

    /// Forward whose Linear weight gradients are deferred to a W step (see [`Deferred`]).
    pub fn forward_split(
        &self,
        input: StageInput,
        ctx: &Ctx,
        deferred: &mut Deferred,
    ) -> Result<Tensor<3>, Error> {
        self.forward_with(input, ctx, &mut Some(deferred))
            .map_err(Error::Input)
    }

    fn forward_with(
        &self,
        input: StageInput,
        ctx: &Ctx,
        cap: &mut Option<&mut Deferred>,
    ) -> Result<Tensor<3>, String> {
        let mut x = input;
        for l in &self.layers {
            x = StageInput::Hidden(l.forward_with(x, ctx, cap)?);
        }
        match x {
            StageInput::Hidden(h) => Ok(h),
            _ => Err("a stage without layers".into()),
        }
    }

    /// Does the stage end with the head (its output is logits)?
    pub fn has_head(&self) -> bool {
        self.layers.last().is_some_and(LayerBlock::is_head)
    }
}

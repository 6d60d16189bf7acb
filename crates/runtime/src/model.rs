//! A GPT-style decoder as a sequence of layer blocks that a plan cuts into stages:
//! layer 0 = token + position embedding, layers 1..=L = pre-LayerNorm transformer blocks
//! (causal multi-head attention, GELU MLP), layer L+1 = final norm + LM head.

use crate::kernels::{causal_attention, gelu, layer_norm, GradSlot, LN_EPS};
use burn::module::{Module, ParamId};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor};
use serde::{Deserialize, Serialize};

/// Model size. Vocabulary 256: bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    pub vocab: usize,
    pub d_model: usize,
    pub heads: usize,
    pub layers: usize,
    pub seq_len: usize,
}

impl Default for GptConfig {
    fn default() -> Self {
        GptConfig {
            vocab: 256,
            d_model: 64,
            heads: 4,
            layers: 4,
            seq_len: 64,
        }
    }
}

impl GptConfig {
    /// Layer blocks a plan can cut: embedding, the transformer blocks, the head.
    pub fn num_blocks(&self) -> usize {
        self.layers + 2
    }
    pub fn check(&self) -> Result<(), String> {
        if self.d_model == 0 || self.heads == 0 || !self.d_model.is_multiple_of(self.heads) {
            return Err(format!(
                "d_model {} must be a positive multiple of heads {}",
                self.d_model, self.heads
            ));
        }
        if self.seq_len == 0 {
            return Err("seq_len must be positive".into());
        }
        if self.vocab < 256 {
            return Err(format!(
                "vocab {} is smaller than the 256 byte values the data uses",
                self.vocab
            ));
        }
        // About 12 d^2 per block plus the embeddings and head: refuse what cannot be held.
        let params = self
            .d_model
            .checked_mul(self.d_model)
            .and_then(|d2| d2.checked_mul(12))
            .and_then(|b| b.checked_mul(self.layers))
            .and_then(|b| {
                let emb = (self.vocab.checked_add(self.seq_len)?).checked_mul(self.d_model)?;
                b.checked_add(emb.checked_mul(2)?)
            });
        if params.is_none_or(|p| p > 1 << 34) {
            return Err(format!(
                "a model of d_model {}, {} layers, vocab {}, seq_len {} has more than 2^34 parameters; this trainer holds them in memory",
                self.d_model, self.layers, self.vocab, self.seq_len
            ));
        }
        Ok(())
    }

    /// A cost model of the layer blocks without measuring (multiply-adds per token as the
    /// forward cost, in arbitrary units; backward 2x): what `train` cuts stages by when it is
    /// not given a plan. `pipewright profile` measures the real thing.
    pub fn cost_profile(&self, rows: usize) -> pipewright_core::profile::Profile {
        use pipewright_core::profile::{Layer, ModelInfo, Profile};
        let (d, t) = (self.d_model as f64, self.seq_len as f64);
        let tokens = (rows * self.seq_len) as u64;
        let layer = |i: usize| {
            let (flops, params, width) = match i {
                0 => (d, (self.vocab + self.seq_len) * self.d_model, self.d_model),
                i if i == self.layers + 1 => (
                    d * self.vocab as f64,
                    self.d_model * self.vocab + self.vocab + 2 * self.d_model,
                    self.vocab,
                ),
                _ => (
                    12.0 * d * d + 2.0 * t * d,
                    12 * self.d_model * self.d_model + 13 * self.d_model,
                    self.d_model,
                ),
            };
            Layer {
                name: layer_name(i, self.layers),
                forward: flops * 1e-9,
                backward: None,
                weight_grad: None,
                input_grad: None,
                optimizer: None,
                params: 4 * params as u64,
                activation: 4 * tokens * width as u64,
            }
        };
        Profile {
            model: ModelInfo {
                name: format!(
                    "gpt d{}-l{}-h{}-s{} (cost model)",
                    self.d_model, self.layers, self.heads, self.seq_len
                ),
            },
            layers: (0..self.num_blocks()).map(layer).collect(),
        }
    }
}

#[derive(Module, Debug)]
pub struct Embed {
    tok: Embedding,
    pos: Embedding,
}

impl Embed {
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = tokens.dims();
        let pos = Tensor::<1, Int>::arange(0..t as i64, &tokens.device())
            .reshape([1, t])
            .repeat_dim(0, b);
        self.tok.forward(tokens) + self.pos.forward(pos)
    }
}

#[derive(Module, Debug)]
pub struct Block {
    ln1: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ln2: LayerNorm,
    fc: Linear,
    proj: Linear,
    #[module(skip)]
    heads: usize,
}

impl Block {
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_with(x, &mut None)
    }

    fn forward_with(&self, x: Tensor<3>, cap: &mut Option<&mut Deferred>) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let (h, dh) = (self.heads, d / self.heads);
        let a = layer_norm(&self.ln1, x.clone());
        let split = |y: Tensor<3>| y.reshape([b, t, h, dh]).swap_dims(1, 2);
        let (q, k, v) = (
            split(linear(&self.q, a.clone(), cap)),
            split(linear(&self.k, a.clone(), cap)),
            split(linear(&self.v, a, cap)),
        );
        let scale = 1.0 / (dh as f32).sqrt();
        let att = causal_attention(q, k, v, scale)
            .swap_dims(1, 2)
            .reshape([b, t, d]);
        let x = x + linear(&self.o, att, cap);
        let hidden = gelu(linear(&self.fc, layer_norm(&self.ln2, x.clone()), cap));
        x + linear(&self.proj, hidden, cap)
    }
}

#[derive(Module, Debug)]
pub struct Head {
    ln: LayerNorm,
    out: Linear,
}

impl Head {
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_with(x, &mut None)
    }

    fn forward_with(&self, x: Tensor<3>, cap: &mut Option<&mut Deferred>) -> Tensor<3> {
        linear(&self.out, layer_norm(&self.ln, x), cap)
    }
}

/// Weight gradients of Linear layers held back from the input-gradient backward (B) so that a
/// later W step computes them: for each Linear, its input and the slot its output gradient
/// is left in by B. `dW = x^T dy`, `db = sum(dy)` are exactly the products a fused backward
/// would have done.
#[derive(Default)]
pub struct Deferred {
    /// (weight id, bias id, layer input [rows, in] without autodiff, output-gradient slot).
    entries: Vec<(ParamId, Option<ParamId>, Tensor<2>, GradSlot)>,
}

impl Deferred {
    /// The W step: the Linear layers' weight and bias gradients, by parameter id. A layer
    /// whose output gradient never came (its output did not reach the loss) gets zeros.
    pub fn weight_grads(self) -> std::collections::HashMap<ParamId, Vec<f32>> {
        let mut out = std::collections::HashMap::new();
        for (w, b, x, slot) in self.entries {
            let dy = match slot.take() {
                Some(d) => Tensor::<2>::from_data(d, &crate::backend::plain_device()),
                None => continue,
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
fn linear(l: &Linear, x: Tensor<3>, cap: &mut Option<&mut Deferred>) -> Tensor<3> {
    let (w, b) = (l.weight.val(), l.bias.as_ref().map(|b| b.val()));
    match cap {
        None => crate::kernels::linear(x, w, b),
        Some(d) => {
            let [n, t, i] = x.dims();
            let x = x.reshape([n * t, i]);
            let o = w.dims()[1];
            let (y, slot) = crate::kernels::linear_deferred(x.clone(), w, b);
            d.entries
                .push((l.weight.id, l.bias.as_ref().map(|b| b.id), x.detach(), slot));
            y.reshape([n, t, o])
        }
    }
}

/// Mean cross-entropy of next-byte prediction.
pub fn loss(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
    let logp = log_softmax(logits, 2);
    logp.gather(2, targets.unsqueeze_dim(2)).mean().neg()
}

/// The whole model's layer blocks, in order; built once from a seed so that every way of
/// cutting it starts from the same weights.
#[derive(Module, Debug)]
pub struct Layers {
    pub embed: Embed,
    pub blocks: Vec<Block>,
    pub head: Head,
}

impl Layers {
    pub fn new(cfg: &GptConfig, seed: u64, device: &Device) -> Self {
        device.seed(seed); // burn draws its initial values first; ours replace them below
        let d = cfg.d_model;
        let lin = |i: usize, o: usize| LinearConfig::new(i, o).init(device);
        let embed = Embed {
            tok: EmbeddingConfig::new(cfg.vocab, d).init(device),
            pos: EmbeddingConfig::new(cfg.seq_len, d).init(device),
        };
        let blocks = (0..cfg.layers)
            .map(|_| Block {
                ln1: LayerNormConfig::new(d)
                    .with_epsilon(LN_EPS as f64)
                    .init(device),
                q: lin(d, d),
                k: lin(d, d),
                v: lin(d, d),
                o: lin(d, d),
                ln2: LayerNormConfig::new(d)
                    .with_epsilon(LN_EPS as f64)
                    .init(device),
                fc: lin(d, 4 * d),
                proj: lin(4 * d, d),
                heads: cfg.heads,
            })
            .collect();
        let head = Head {
            ln: LayerNormConfig::new(d)
                .with_epsilon(LN_EPS as f64)
                .init(device),
            out: lin(d, cfg.vocab),
        };
        let layers = Layers {
            embed,
            blocks,
            head,
        };
        // burn's initialisers draw from a process-wide generator that other threads share, so
        // weights are set here from our own generator: GPT-2 style N(0, 0.02)-like uniform for
        // matrices, zero biases, LayerNorm's ones and zeros as burn made them.
        layers.map(&mut Init {
            rng: crate::data::Rng::new(seed),
            seed,
            count: 0,
            path: Vec::new(),
        })
    }

    /// Layer block `i` in model order (a clone that shares parameter ids with `self`).
    pub fn block(&self, i: usize) -> LayerBlock {
        let last = self.blocks.len() + 1;
        match i {
            0 => LayerBlock::Embed(self.embed.clone()),
            i if i == last => LayerBlock::Head(self.head.clone()),
            i => LayerBlock::Block(self.blocks[i - 1].clone()),
        }
    }

    /// All layer blocks in model order.
    pub fn into_blocks(self) -> Vec<LayerBlock> {
        std::iter::once(LayerBlock::Embed(self.embed))
            .chain(self.blocks.into_iter().map(LayerBlock::Block))
            .chain(std::iter::once(LayerBlock::Head(self.head)))
            .collect()
    }

    /// Layer blocks `lo..hi` as one stage module (clones share parameter ids with `self`).
    pub fn stage(&self, lo: usize, hi: usize) -> Stage {
        Stage {
            layers: (lo..hi).map(|i| self.block(i)).collect(),
        }
    }
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
    rng: crate::data::Rng,
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
        let in_norm = self.path.iter().any(|n| n.starts_with("ln"));
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

/// One layer block of the model: what a plan's stages are made of, and the unit that owns
/// parameters and optimizer state (so state survives any change of plan).
// A model has a few dozen of these; boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum LayerBlock {
    Embed(Embed),
    Block(Block),
    Head(Head),
}

impl LayerBlock {
    fn forward_with(
        &self,
        x: StageInput,
        cap: &mut Option<&mut Deferred>,
    ) -> Result<Tensor<3>, String> {
        Ok(match (self, x) {
            (LayerBlock::Embed(e), StageInput::Tokens(t)) => e.forward(t),
            (LayerBlock::Block(b), StageInput::Hidden(h)) => b.forward_with(h, cap),
            (LayerBlock::Head(h), StageInput::Hidden(x)) => h.forward_with(x, cap),
            (LayerBlock::Embed(_), StageInput::Hidden(_)) => {
                return Err(
                    "the embedding got hidden states (it must come first on a route)".into(),
                )
            }
            (_, StageInput::Tokens(_)) => {
                return Err(
                    "a layer after the embedding got tokens (routes start at the embedding)".into(),
                )
            }
        })
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
    Hidden(Tensor<3>),
}

impl Stage {
    /// Hidden states out, or logits if the stage holds the head.
    pub fn forward(&self, input: StageInput) -> Tensor<3> {
        self.forward_with(input, &mut None)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`Stage::forward`], with a wrong input (tokens for a hidden-state layer, or the
    /// reverse) as an error rather than a panic: plans from files reach here.
    pub fn try_forward(&self, input: StageInput) -> Result<Tensor<3>, String> {
        self.forward_with(input, &mut None)
    }

    /// Forward whose Linear weight gradients are deferred to a W step (see [`Deferred`]).
    pub fn forward_split(
        &self,
        input: StageInput,
        deferred: &mut Deferred,
    ) -> Result<Tensor<3>, String> {
        self.forward_with(input, &mut Some(deferred))
    }

    fn forward_with(
        &self,
        input: StageInput,
        cap: &mut Option<&mut Deferred>,
    ) -> Result<Tensor<3>, String> {
        let mut x = input;
        for l in &self.layers {
            x = StageInput::Hidden(l.forward_with(x, cap)?);
        }
        match x {
            StageInput::Hidden(h) => Ok(h),
            StageInput::Tokens(_) => Err("a stage without layers".into()),
        }
    }

    /// Does the stage end with the head (its output is logits)?
    pub fn has_head(&self) -> bool {
        matches!(self.layers.last(), Some(LayerBlock::Head(_)))
    }
}

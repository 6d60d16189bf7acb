//! BERT's layer blocks as Hugging Face's `BertForSequenceClassification` and
//! `BertForQuestionAnswering` lay them out: word, position and token-type embeddings with a
//! LayerNorm; post-LayerNorm bidirectional encoder blocks (padding masked); and a task head:
//! the pooler (tanh of the first token's projection) and a classifier, or start/end logits.
//! Field names follow HF's below the layer (`self_attn` is HF's `attention.self`, `layer_norm`
//! its `LayerNorm`).

use crate::kernels::{gelu, layer_norm_eps, matmul};
use crate::model::{linear, Ctx, Deferred, ModelConfig, TaskHead};
use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::{softmax, tanh};
use burn::tensor::{Device, Int, Tensor};

#[derive(Module, Debug)]
pub struct BertEmbed {
    pub word_embeddings: Embedding,
    pub position_embeddings: Embedding,
    pub token_type_embeddings: Embedding,
    pub layer_norm: LayerNorm,
    #[module(skip)]
    eps: f64,
}

#[derive(Module, Debug)]
pub struct BertSelf {
    pub query: Linear,
    pub key: Linear,
    pub value: Linear,
}

#[derive(Module, Debug)]
pub struct BertDenseNorm {
    pub dense: Linear,
    pub layer_norm: LayerNorm,
}

#[derive(Module, Debug)]
pub struct BertAttention {
    pub self_attn: BertSelf,
    pub output: BertDenseNorm,
}

#[derive(Module, Debug)]
pub struct BertDense {
    pub dense: Linear,
}

#[derive(Module, Debug)]
pub struct BertBlock {
    pub attention: BertAttention,
    pub intermediate: BertDense,
    pub output: BertDenseNorm,
    #[module(skip)]
    heads: usize,
    #[module(skip)]
    eps: f64,
}

/// The task head: a class per sequence, or an answer span's start and end.
#[derive(Module, Debug)]
pub struct BertHead {
    pub pooler: Option<BertDense>,
    pub classifier: Option<Linear>,
    pub qa_outputs: Option<Linear>,
}

impl BertEmbed {
    pub fn forward(&self, tokens: Tensor<2, Int>, ctx: &Ctx) -> Tensor<3> {
        let pos = crate::model::positions(&tokens);
        let types = ctx.token_types.clone().unwrap_or_else(|| pos.zeros_like());
        let x = self.word_embeddings.forward(tokens)
            + self.position_embeddings.forward(pos)
            + self.token_type_embeddings.forward(types);
        layer_norm_eps(&self.layer_norm, x, self.eps as f32)
    }
}

impl BertBlock {
    pub(crate) fn forward_with(
        &self,
        x: Tensor<3>,
        ctx: &Ctx,
        cap: &mut Option<&mut Deferred>,
    ) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let (h, eps) = (self.heads, self.eps as f32);
        let s = &self.attention.self_attn;
        let split = |y: Tensor<3>| y.reshape([b, t, h, d / h]).swap_dims(1, 2);
        let q = split(linear(&s.query, x.clone(), cap));
        let k = split(linear(&s.key, x.clone(), cap));
        let v = split(linear(&s.value, x.clone(), cap));
        let mut scores = matmul(q, k.swap_dims(2, 3)) * (1.0 / ((d / h) as f32).sqrt());
        if let Some(mask) = &ctx.mask {
            scores = scores + mask.clone();
        }
        let att = matmul(softmax(scores, 3), v)
            .swap_dims(1, 2)
            .reshape([b, t, d]);
        let o = &self.attention.output;
        let a = layer_norm_eps(&o.layer_norm, x + linear(&o.dense, att, cap), eps);
        let hidden = gelu(linear(&self.intermediate.dense, a.clone(), cap));
        let out = &self.output;
        layer_norm_eps(&out.layer_norm, a + linear(&out.dense, hidden, cap), eps)
    }
}

impl BertHead {
    /// `[b, 1, classes]` class logits, or `[b, 2, t]` start and end logits.
    pub(crate) fn forward_with(&self, x: Tensor<3>, cap: &mut Option<&mut Deferred>) -> Tensor<3> {
        if let Some(qa) = &self.qa_outputs {
            return linear(qa, x, cap).swap_dims(1, 2);
        }
        let (pooler, classifier) = (
            self.pooler
                .as_ref()
                .expect("a classification head has a pooler"),
            self.classifier.as_ref().expect("and a classifier"),
        );
        let first = x.narrow(1, 0, 1);
        linear(classifier, tanh(linear(&pooler.dense, first, cap)), cap)
    }
}

crate::model::layer::family_layer!(BertEmbed, BertBlock, BertHead);

impl crate::model::layer::FamilyLayer for Layer {
    fn forward_with(
        &self,
        x: crate::model::StageInput,
        ctx: &crate::model::Ctx,
        cap: &mut Option<&mut Deferred>,
    ) -> Result<Tensor<3>, String> {
        use crate::model::StageInput;
        Ok(match (self, x) {
            (Layer::Embed(e), StageInput::Tokens(t)) => e.forward(t, ctx),
            (Layer::Block(b), StageInput::Hidden(h)) => b.forward_with(h, ctx, cap),
            (Layer::Head(h), StageInput::Hidden(x)) => h.forward_with(x, cap),
            (l, x) => return Err(crate::model::layer::misplaced(l.is_embed(), &x)),
        })
    }
}

/// A fresh model's layer blocks (weights drawn later by the model's initialiser).
pub(crate) fn build(cfg: &ModelConfig, device: &Device) -> Vec<Layer> {
    use Layer as L;
    let (d, eps) = (cfg.d_model, cfg.norm_eps());
    let lin = |i: usize, o: usize| LinearConfig::new(i, o).init(device);
    let ln = || LayerNormConfig::new(d).with_epsilon(eps).init(device);
    let dense_norm = |i: usize| BertDenseNorm {
        dense: lin(i, d),
        layer_norm: ln(),
    };
    let embed = L::Embed(BertEmbed {
        word_embeddings: EmbeddingConfig::new(cfg.vocab, d).init(device),
        position_embeddings: EmbeddingConfig::new(cfg.max_positions(), d).init(device),
        token_type_embeddings: EmbeddingConfig::new(cfg.type_vocab(), d).init(device),
        layer_norm: ln(),
        eps,
    });
    let block = |_| {
        L::Block(BertBlock {
            attention: BertAttention {
                self_attn: BertSelf {
                    query: lin(d, d),
                    key: lin(d, d),
                    value: lin(d, d),
                },
                output: dense_norm(d),
            },
            intermediate: BertDense {
                dense: lin(d, cfg.ffn()),
            },
            output: dense_norm(cfg.ffn()),
            heads: cfg.heads,
            eps,
        })
    };
    let head = match cfg.head {
        Some(TaskHead::Span) => BertHead {
            pooler: None,
            classifier: None,
            qa_outputs: Some(lin(d, 2)),
        },
        Some(TaskHead::Classify { classes }) => BertHead {
            pooler: Some(BertDense { dense: lin(d, d) }),
            classifier: Some(lin(d, classes)),
            qa_outputs: None,
        },
        None => unreachable!("checked: a bert model has a task head"),
    };
    std::iter::once(embed)
        .chain((0..cfg.layers).map(block))
        .chain(std::iter::once(L::Head(head)))
        .collect()
}

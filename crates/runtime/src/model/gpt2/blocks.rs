//! GPT-2's layer blocks as Hugging Face's `GPT2LMHeadModel` lays them out: token and learned
//! position embeddings; pre-LayerNorm blocks whose attention projects q, k and v with one
//! fused `c_attn`, and whose MLP uses the tanh GELU (`gelu_new`); final LayerNorm and an LM
//! head tied to the token embedding. HF's `Conv1D` keeps weights `[in, out]`, as burn's Linear
//! does, so only the head (an `nn.Linear`) is stored transposed there.

use crate::kernels::{causal_attention, layer_norm};
use crate::model::{linear, Deferred, ModelConfig};
use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor};

#[derive(Module, Debug)]
pub struct Gpt2Embed {
    pub wte: Embedding,
    pub wpe: Embedding,
}

#[derive(Module, Debug)]
pub struct Gpt2Attention {
    pub c_attn: Linear,
    pub c_proj: Linear,
    #[module(skip)]
    heads: usize,
}

#[derive(Module, Debug)]
pub struct Gpt2Mlp {
    pub c_fc: Linear,
    pub c_proj: Linear,
}

#[derive(Module, Debug)]
pub struct Gpt2Block {
    pub ln_1: LayerNorm,
    pub attn: Gpt2Attention,
    pub ln_2: LayerNorm,
    pub mlp: Gpt2Mlp,
}

#[derive(Module, Debug)]
pub struct Gpt2Head {
    pub ln_f: LayerNorm,
    /// The LM head, or (`GPT2ForSequenceClassification`) `score`, read at each sequence's
    /// last token.
    pub lm_head: Option<Linear>,
    pub score: Option<Linear>,
}

impl Gpt2Embed {
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let pos = crate::model::positions(&tokens);
        self.wte.forward(tokens) + self.wpe.forward(pos)
    }
}

/// GELU's tanh approximation, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
fn gelu_new(x: Tensor<3>) -> Tensor<3> {
    let c = (2.0f32 / std::f32::consts::PI).sqrt();
    let inner = (x.clone() + x.clone().powi_scalar(3) * 0.044715) * c;
    x * (burn::tensor::activation::tanh(inner) + 1.0) * 0.5
}

impl Gpt2Block {
    pub(crate) fn forward_with(&self, x: Tensor<3>, cap: &mut Option<&mut Deferred>) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let h = self.attn.heads;
        let qkv = linear(&self.attn.c_attn, layer_norm(&self.ln_1, x.clone()), cap);
        let split = |i: usize| {
            qkv.clone()
                .narrow(2, i * d, d)
                .reshape([b, t, h, d / h])
                .swap_dims(1, 2)
        };
        let scale = 1.0 / ((d / h) as f32).sqrt();
        let att = causal_attention(split(0), split(1), split(2), scale)
            .swap_dims(1, 2)
            .reshape([b, t, d]);
        let x = x + linear(&self.attn.c_proj, att, cap);
        let m = &self.mlp;
        let hidden = gelu_new(linear(&m.c_fc, layer_norm(&self.ln_2, x.clone()), cap));
        x + linear(&m.c_proj, hidden, cap)
    }
}

impl Gpt2Head {
    pub(crate) fn forward_with(
        &self,
        x: Tensor<3>,
        ctx: &crate::model::Ctx,
        cap: &mut Option<&mut Deferred>,
    ) -> Tensor<3> {
        let norm = |x| layer_norm(&self.ln_f, x);
        crate::model::causal_head(x, norm, &self.lm_head, &self.score, ctx, cap)
    }
}

crate::model::layer::family_layer!(Gpt2Embed, Gpt2Block, Gpt2Head);

impl crate::model::layer::FamilyLayer for Layer {
    fn forward_with(
        &self,
        x: crate::model::StageInput,
        ctx: &crate::model::Ctx,
        cap: &mut Option<&mut Deferred>,
    ) -> Result<Tensor<3>, String> {
        use crate::model::StageInput;
        Ok(match (self, x) {
            (Layer::Embed(e), StageInput::Tokens(t)) => e.forward(t),
            (Layer::Block(b), StageInput::Hidden(h)) => b.forward_with(h, cap),
            (Layer::Head(h), StageInput::Hidden(x)) => h.forward_with(x, ctx, cap),
            (l, x) => return Err(crate::model::layer::misplaced(l.is_embed(), &x)),
        })
    }
    fn token_embedding(&self) -> Option<Tensor<2>> {
        match self {
            Layer::Embed(e) => Some(e.wte.weight.val()),
            _ => None,
        }
    }

    fn lm_head_mut(&mut self) -> Option<&mut burn::nn::Linear> {
        match self {
            Layer::Head(h) => h.lm_head.as_mut(),
            _ => None,
        }
    }
}

/// A fresh model's layer blocks (weights drawn later by the model's initialiser).
pub(crate) fn build(cfg: &ModelConfig, device: &Device) -> Vec<Layer> {
    use Layer as L;
    let d = cfg.d_model;
    let lin = |i: usize, o: usize| LinearConfig::new(i, o).init(device);
    let ln = || crate::model::layer_norm_of(d, device);
    let embed = L::Embed(Gpt2Embed {
        wte: EmbeddingConfig::new(cfg.vocab, d).init(device),
        wpe: EmbeddingConfig::new(cfg.max_positions(), d).init(device),
    });
    let block = |_| {
        L::Block(Gpt2Block {
            ln_1: ln(),
            attn: Gpt2Attention {
                c_attn: lin(d, 3 * d),
                c_proj: lin(d, d),
                heads: cfg.heads,
            },
            ln_2: ln(),
            mlp: Gpt2Mlp {
                c_fc: lin(d, cfg.ffn()),
                c_proj: lin(cfg.ffn(), d),
            },
        })
    };
    let (lm_head, score) = crate::model::head_linears(cfg, device);
    let head = L::Head(Gpt2Head {
        ln_f: ln(),
        lm_head,
        score,
    });
    std::iter::once(embed)
        .chain((0..cfg.layers).map(block))
        .chain(std::iter::once(head))
        .collect()
}

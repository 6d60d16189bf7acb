//! pipewright's GPT blocks: learned positions; pre-LayerNorm blocks of causal multi-head
//! attention and a GELU MLP; a final LayerNorm and the LM head.

use crate::kernels::{causal_attention, gelu, layer_norm};
use crate::model::{layer_norm_of, linear, positions, Deferred, ModelConfig};
use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor};

#[derive(Module, Debug)]
pub struct Embed {
    tok: Embedding,
    pos: Embedding,
}

impl Embed {
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let pos = positions(&tokens);
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

    pub(crate) fn forward_with(&self, x: Tensor<3>, cap: &mut Option<&mut Deferred>) -> Tensor<3> {
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

    pub(crate) fn forward_with(&self, x: Tensor<3>, cap: &mut Option<&mut Deferred>) -> Tensor<3> {
        linear(&self.out, layer_norm(&self.ln, x), cap)
    }
}

crate::model::layer::family_layer!(Embed, Block, Head);

impl crate::model::layer::FamilyLayer for Layer {
    fn forward_with(
        &self,
        x: crate::model::StageInput,
        _ctx: &crate::model::Ctx,
        cap: &mut Option<&mut Deferred>,
    ) -> Result<Tensor<3>, String> {
        use crate::model::StageInput;
        Ok(match (self, x) {
            (Layer::Embed(e), StageInput::Tokens(t)) => e.forward(t),
            (Layer::Block(b), StageInput::Hidden(h)) => b.forward_with(h, cap),
            (Layer::Head(h), StageInput::Hidden(x)) => h.forward_with(x, cap),
            (l, x) => return Err(crate::model::layer::misplaced(l.is_embed(), &x)),
        })
    }
}

pub(crate) fn build(cfg: &ModelConfig, device: &Device) -> Vec<Layer> {
    let d = cfg.d_model;
    let lin = |i: usize, o: usize| LinearConfig::new(i, o).init(device);
    let ln = || layer_norm_of(d, device);
    let embed = Embed {
        tok: EmbeddingConfig::new(cfg.vocab, d).init(device),
        pos: EmbeddingConfig::new(cfg.seq_len, d).init(device),
    };
    let block = |_| {
        Layer::Block(Block {
            ln1: ln(),
            q: lin(d, d),
            k: lin(d, d),
            v: lin(d, d),
            o: lin(d, d),
            ln2: ln(),
            fc: lin(d, 4 * d),
            proj: lin(4 * d, d),
            heads: cfg.heads,
        })
    };
    let head = Head {
        ln: ln(),
        out: lin(d, cfg.vocab),
    };
    std::iter::once(Layer::Embed(embed))
        .chain((0..cfg.layers).map(block))
        .chain(std::iter::once(Layer::Head(head)))
        .collect()
}

//! ViT's layer blocks as Hugging Face's `ViTForImageClassification` lays them out: patch
//! embedding (HF's stride-p convolution, here the same product over each flattened patch), a
//! class token and learned positions; pre-LayerNorm bidirectional encoder blocks; the final
//! LayerNorm and a classifier on the class token.

use crate::kernels::{gelu, layer_norm_eps, matmul};
use crate::model::{linear, Deferred, ModelConfig, TaskHead};
use burn::module::{Module, Param};
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::softmax;
use burn::tensor::{Device, Tensor};

#[derive(Module, Debug)]
pub struct VitPatches {
    /// HF's `projection` convolution `[d, c, p, p]` as a Linear `[c p p, d]`.
    pub projection: Linear,
}

#[derive(Module, Debug)]
pub struct VitEmbed {
    pub cls_token: Param<Tensor<3>>,
    pub position_embeddings: Param<Tensor<3>>,
    pub patch_embeddings: VitPatches,
    #[module(skip)]
    patch: usize,
}

#[derive(Module, Debug)]
pub struct VitSelf {
    pub query: Linear,
    pub key: Linear,
    pub value: Linear,
}

#[derive(Module, Debug)]
pub struct VitDense {
    pub dense: Linear,
}

#[derive(Module, Debug)]
pub struct VitAttention {
    pub attention: VitSelf,
    pub output: VitDense,
}

#[derive(Module, Debug)]
pub struct VitBlock {
    pub layernorm_before: LayerNorm,
    pub attention: VitAttention,
    pub layernorm_after: LayerNorm,
    pub intermediate: VitDense,
    pub output: VitDense,
    #[module(skip)]
    heads: usize,
    #[module(skip)]
    eps: f64,
}

#[derive(Module, Debug)]
pub struct VitHead {
    pub layernorm: LayerNorm,
    pub classifier: Linear,
    #[module(skip)]
    eps: f64,
}

impl VitEmbed {
    /// `[b, c, h, w]` pixels to `[b, 1 + patches, d]`: the class token, then each patch's
    /// projection (row-major over the patch grid), plus the learned positions.
    pub fn forward(&self, pixels: Tensor<4>) -> Tensor<3> {
        let [b, c, h, w] = pixels.dims();
        let p = self.patch;
        let (gh, gw) = (h / p, w / p);
        // [b, c, gh, p, gw, p] -> [b, gh, gw, c, p, p]: each patch's values in the convolution
        // weight's (channel, row, column) order.
        let patches = pixels
            .reshape([b * c * gh, p, gw, p])
            .swap_dims(1, 2)
            .reshape([b, c, gh * gw, p * p])
            .swap_dims(1, 2)
            .reshape([b, gh * gw, c * p * p]);
        let x = linear(&self.patch_embeddings.projection, patches, &mut None);
        let d = x.dims()[2];
        let cls = self.cls_token.val().expand([b, 1, d]);
        Tensor::cat(vec![cls, x], 1) + self.position_embeddings.val()
    }
}

impl VitBlock {
    pub(crate) fn forward_with(&self, x: Tensor<3>, cap: &mut Option<&mut Deferred>) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let (h, eps) = (self.heads, self.eps as f32);
        let a = layer_norm_eps(&self.layernorm_before, x.clone(), eps);
        let s = &self.attention.attention;
        let split = |y: Tensor<3>| y.reshape([b, t, h, d / h]).swap_dims(1, 2);
        let q = split(linear(&s.query, a.clone(), cap));
        let k = split(linear(&s.key, a.clone(), cap));
        let v = split(linear(&s.value, a, cap));
        let scores = matmul(q, k.swap_dims(2, 3)) * (1.0 / ((d / h) as f32).sqrt());
        let att = matmul(softmax(scores, 3), v)
            .swap_dims(1, 2)
            .reshape([b, t, d]);
        let x = x + linear(&self.attention.output.dense, att, cap);
        let m = layer_norm_eps(&self.layernorm_after, x.clone(), eps);
        let hidden = gelu(linear(&self.intermediate.dense, m, cap));
        x + linear(&self.output.dense, hidden, cap)
    }
}

impl VitHead {
    /// `[b, 1, classes]` from the class token.
    pub(crate) fn forward_with(&self, x: Tensor<3>, cap: &mut Option<&mut Deferred>) -> Tensor<3> {
        let x = layer_norm_eps(&self.layernorm, x, self.eps as f32);
        linear(&self.classifier, x.narrow(1, 0, 1), cap)
    }
}

crate::model::layer::family_layer!(VitEmbed, VitBlock, VitHead);

impl crate::model::layer::FamilyLayer for Layer {
    fn forward_with(
        &self,
        x: crate::model::StageInput,
        _ctx: &crate::model::Ctx,
        cap: &mut Option<&mut Deferred>,
    ) -> Result<Tensor<3>, String> {
        use crate::model::StageInput;
        Ok(match (self, x) {
            (Layer::Embed(e), StageInput::Pixels(p)) => e.forward(p),
            (Layer::Embed(_), _) => {
                return Err(
                    "the vit embedding takes pixels (pixel_values), and only first on a route"
                        .into(),
                )
            }
            (Layer::Block(b), StageInput::Hidden(h)) => b.forward_with(h, cap),
            (Layer::Head(h), StageInput::Hidden(x)) => h.forward_with(x, cap),
            (l, x) => return Err(crate::model::layer::misplaced(l.is_embed(), &x)),
        })
    }
}

/// A fresh model's layer blocks (weights drawn later by the model's initialiser).
pub(crate) fn build(cfg: &ModelConfig, device: &Device) -> Vec<Layer> {
    use Layer as L;
    let (d, eps) = (cfg.d_model, cfg.norm_eps());
    let (c, p) = (cfg.channels(), cfg.patch());
    let lin = |i: usize, o: usize| LinearConfig::new(i, o).init(device);
    let ln = || LayerNormConfig::new(d).with_epsilon(eps).init(device);
    let dense = |i: usize, o: usize| VitDense { dense: lin(i, o) };
    let embed = L::Embed(VitEmbed {
        cls_token: Param::from_tensor(Tensor::zeros([1, 1, d], device)),
        position_embeddings: Param::from_tensor(Tensor::zeros([1, cfg.patches() + 1, d], device)),
        patch_embeddings: VitPatches {
            projection: lin(c * p * p, d),
        },
        patch: p,
    });
    let block = |_| {
        L::Block(VitBlock {
            layernorm_before: ln(),
            attention: VitAttention {
                attention: VitSelf {
                    query: lin(d, d),
                    key: lin(d, d),
                    value: lin(d, d),
                },
                output: dense(d, d),
            },
            layernorm_after: ln(),
            intermediate: dense(d, cfg.ffn()),
            output: dense(cfg.ffn(), d),
            heads: cfg.heads,
            eps,
        })
    };
    let classes = match cfg.head {
        Some(TaskHead::Classify { classes }) => classes,
        _ => unreachable!("checked: a vit model has a classification head"),
    };
    let head = L::Head(VitHead {
        layernorm: ln(),
        classifier: lin(d, classes),
        eps,
    });
    std::iter::once(embed)
        .chain((0..cfg.layers).map(block))
        .chain(std::iter::once(head))
        .collect()
}

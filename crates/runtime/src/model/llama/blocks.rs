//! LLaMA's layer blocks, laid out as Hugging Face's `LlamaForCausalLM` names them (so a
//! checkpoint's tensor `block.3.self_attn.q_proj.weight` is HF's
//! `model.layers.3.self_attn.q_proj.weight`, transposed): token embedding; blocks of RMSNorm,
//! grouped-query attention with rotary positions, RMSNorm, SwiGLU MLP; final RMSNorm and LM
//! head. No biases.

use crate::kernels::causal_attention;
use crate::model::{linear, Deferred, ModelConfig};
use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};

/// `x / sqrt(mean(x^2) + eps) * weight`, over the last dimension.
#[derive(Module, Debug)]
pub struct RmsNorm {
    pub weight: Param<Tensor<1>>,
    #[module(skip)]
    eps: f64,
}

impl RmsNorm {
    fn new(d: usize, eps: f64, device: &Device) -> Self {
        RmsNorm {
            weight: Param::from_tensor(Tensor::ones([d], device)),
            eps,
        }
    }
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        crate::kernels::rms_norm(x, self.weight.val(), self.eps as f32)
    }
}

/// Rotary position embedding: the frequencies of each pair of a head's dimensions.
#[derive(Module, Debug)]
pub struct Rope {
    /// One inverse frequency per rotated pair (head_dim / 2 of them).
    #[module(skip)]
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Self {
        let dh = cfg.head_dim();
        let theta = cfg.rope_theta() as f32;
        // As transformers computes it, in f32: 1 / theta^(2i / dh).
        let mut inv: Vec<f32> = (0..dh / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / dh as f32))
            .collect();
        if let Some(s) = &cfg.rope_scaling {
            inv = llama3_scaled(&inv, s);
        }
        Rope { inv_freq: inv }
    }

    /// cos and sin tables `[t, dh / 2]` for positions `start..start + t` (the angle of pair
    /// i at position p is `p * inv_freq[i]`, in f32 as transformers computes it).
    fn tables(&self, start: usize, t: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let half = self.inv_freq.len();
        let angles =
            (start..start + t).flat_map(|p| self.inv_freq.iter().map(move |f| p as f32 * f));
        let (cos, sin): (Vec<f32>, Vec<f32>) = angles.map(|a| (a.cos(), a.sin())).unzip();
        let mk = |v| Tensor::<2>::from_data(TensorData::new(v, [t, half]), device);
        (mk(cos), mk(sin))
    }

    /// Rotate `[b, h, t, dh]` queries or keys at positions `start..`.
    pub fn apply(&self, x: Tensor<4>, start: usize) -> Tensor<4> {
        let t = x.dims()[2];
        let (cos, sin) = self.tables(start, t, &x.device());
        crate::kernels::rope(x, cos, sin)
    }
}

/// Llama 3's frequency rescaling: long wavelengths slowed by `factor`, short ones kept, a
/// smooth blend between (transformers' `rope_type = "llama3"`).
fn llama3_scaled(inv: &[f32], s: &crate::model::config::Llama3Scaling) -> Vec<f32> {
    let (factor, lo, hi) = (
        s.factor as f32,
        s.low_freq_factor as f32,
        s.high_freq_factor as f32,
    );
    let old = s.original_max_position_embeddings as f32;
    let (low_wavelen, high_wavelen) = (old / lo, old / hi);
    inv.iter()
        .map(|&f| {
            let wavelen = 2.0 * std::f32::consts::PI / f;
            if wavelen > low_wavelen {
                f / factor
            } else if wavelen < high_wavelen {
                f
            } else {
                let smooth = (old / wavelen - lo) / (hi - lo);
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect()
}

#[derive(Module, Debug)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    #[module(skip)]
    heads: usize,
    #[module(skip)]
    kv_heads: usize,
}

#[derive(Module, Debug)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

#[derive(Module, Debug)]
pub struct LlamaEmbed {
    pub embed_tokens: Embedding,
}

#[derive(Module, Debug)]
pub struct LlamaBlock {
    pub input_layernorm: RmsNorm,
    pub self_attn: Attention,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: Mlp,
    pub rope: Rope,
}

#[derive(Module, Debug)]
pub struct LlamaHead {
    pub norm: RmsNorm,
    /// The LM head, or (`LlamaForSequenceClassification`) `score`, read at each sequence's
    /// last token.
    pub lm_head: Option<Linear>,
    pub score: Option<Linear>,
}

/// One layer's keys and values so far (generation): `[b, kv_heads, t, dh]`.
pub type KvCache = Option<(Tensor<4>, Tensor<4>)>;

impl LlamaEmbed {
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.embed_tokens.forward(tokens)
    }
}

impl LlamaBlock {
    pub(crate) fn forward_with(&self, x: Tensor<3>, cap: &mut Option<&mut Deferred>) -> Tensor<3> {
        let a = self.input_layernorm.forward(x.clone());
        let x = x + self.attend(a, cap, 0, None);
        x.clone() + self.mlp(self.post_attention_layernorm.forward(x), cap)
    }

    /// The block on new positions `start..` with a cache of earlier keys and values
    /// (generation; no autodiff).
    pub fn forward_cached(&self, x: Tensor<3>, start: usize, cache: &mut KvCache) -> Tensor<3> {
        let a = self.input_layernorm.forward(x.clone());
        let x = x + self.attend(a, &mut None, start, Some(cache));
        x.clone() + self.mlp(self.post_attention_layernorm.forward(x), &mut None)
    }

    fn mlp(&self, a: Tensor<3>, cap: &mut Option<&mut Deferred>) -> Tensor<3> {
        let m = &self.mlp;
        let gate = linear(&m.gate_proj, a.clone(), cap);
        let up = linear(&m.up_proj, a, cap);
        linear(&m.down_proj, crate::kernels::swiglu(gate, up), cap)
    }

    fn attend(
        &self,
        a: Tensor<3>,
        cap: &mut Option<&mut Deferred>,
        start: usize,
        cache: Option<&mut KvCache>,
    ) -> Tensor<3> {
        let at = &self.self_attn;
        let [b, t, d] = a.dims();
        let (h, kvh) = (at.heads, at.kv_heads);
        let dh = d / h;
        let split = |y: Tensor<3>, n: usize| y.reshape([b, t, n, dh]).swap_dims(1, 2);
        let q = self
            .rope
            .apply(split(linear(&at.q_proj, a.clone(), cap), h), start);
        let mut k = self
            .rope
            .apply(split(linear(&at.k_proj, a.clone(), cap), kvh), start);
        let mut v = split(linear(&at.v_proj, a, cap), kvh);
        if let Some(cache) = cache {
            if let Some((ck, cv)) = cache.take() {
                k = Tensor::cat(vec![ck, k], 2);
                v = Tensor::cat(vec![cv, v], 2);
            }
            *cache = Some((k.clone(), v.clone()));
        }
        let scale = 1.0 / (dh as f32).sqrt();
        let att = if start == 0 {
            // Grouped-query attention: the kernel reads each key/value head for its queries.
            causal_attention(q, k, v, scale)
        } else {
            // New queries see every cached key: no mask among them beyond causality, which
            // a single new position (the generation step) has trivially.
            let (k, v) = (
                crate::kernels::repeat_kv(k, h / kvh),
                crate::kernels::repeat_kv(v, h / kvh),
            );
            cached_attention(q, k, v, scale)
        };
        let att = att.swap_dims(1, 2).reshape([b, t, d]);
        linear(&at.o_proj, att, cap)
    }
}

/// Queries at the newest positions against all keys, causal among the new ones.
fn cached_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, scale: f32) -> Tensor<4> {
    let (t, total) = (q.dims()[2], k.dims()[2]);
    let scores = q.matmul(k.swap_dims(2, 3)) * scale;
    let mask = Tensor::<2, burn::tensor::Bool>::tril_mask(
        [t, total],
        (total - t) as i64,
        &scores.device(),
    );
    let w = burn::tensor::activation::softmax(
        scores.mask_fill(mask.unsqueeze::<4>(), f32::NEG_INFINITY),
        3,
    );
    w.matmul(v)
}

impl LlamaHead {
    pub(crate) fn forward_with(
        &self,
        x: Tensor<3>,
        ctx: &crate::model::Ctx,
        cap: &mut Option<&mut Deferred>,
    ) -> Tensor<3> {
        let norm = |x| self.norm.forward(x);
        crate::model::causal_head(x, norm, &self.lm_head, &self.score, ctx, cap)
    }
}

crate::model::layer::family_layer!(LlamaEmbed, LlamaBlock, LlamaHead);

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
            Layer::Embed(e) => Some(e.embed_tokens.weight.val()),
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
    let (d, eps) = (cfg.d_model, cfg.norm_eps());
    let kv = cfg.kv_heads() * cfg.head_dim();
    let lin = |i: usize, o: usize| LinearConfig::new(i, o).with_bias(false).init(device);
    let embed = L::Embed(LlamaEmbed {
        embed_tokens: EmbeddingConfig::new(cfg.vocab, d).init(device),
    });
    let block = |_| {
        L::Block(LlamaBlock {
            input_layernorm: RmsNorm::new(d, eps, device),
            self_attn: Attention {
                q_proj: lin(d, d),
                k_proj: lin(d, kv),
                v_proj: lin(d, kv),
                o_proj: lin(d, d),
                heads: cfg.heads,
                kv_heads: cfg.kv_heads(),
            },
            post_attention_layernorm: RmsNorm::new(d, eps, device),
            mlp: Mlp {
                gate_proj: lin(d, cfg.ffn()),
                up_proj: lin(d, cfg.ffn()),
                down_proj: lin(cfg.ffn(), d),
            },
            rope: Rope::new(cfg),
        })
    };
    let (lm_head, score) = crate::model::head_linears(cfg, device);
    let head = L::Head(LlamaHead {
        norm: RmsNorm::new(d, eps, device),
        lm_head,
        score,
    });
    std::iter::once(embed)
        .chain((0..cfg.layers).map(block))
        .chain(std::iter::once(head))
        .collect()
}

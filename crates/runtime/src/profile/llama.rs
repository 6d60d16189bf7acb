//! Where a LLaMA block's time goes (`profile --ops` on a llama model): each op of
//! [`crate::model::llama`]'s block at the model's shapes, timed alone, the whole block, and
//! burn's own ops for what the fused kernels (RMSNorm, SwiGLU, rotary embedding) replace.

use super::{time_op, Alternative, OpBreakdown, OpTime};
use crate::backend::train_device;
use crate::kernels as k;
use crate::model::ModelConfig;
use burn::tensor::{Distribution, Tensor};

/// The LLaMA counterpart of [`super::op_breakdown`]: the same rows, the whole block last.
pub fn op_breakdown(cfg: &ModelConfig, rows: usize, repeats: usize) -> OpBreakdown {
    let shapes = Shapes::new(cfg, rows);
    let mut ops = attention_ops(&shapes, repeats);
    ops.extend(mlp_ops(&shapes, repeats));
    OpBreakdown {
        ops,
        whole: super::whole_block(cfg, &shapes.dev, repeats, || shapes.x3(cfg.d_model)),
        alternatives: burn_alternatives(cfg, rows, repeats),
    }
}

/// A block's shapes at micro-batches of `rows` sequences, and random inputs of them.
struct Shapes {
    b: usize,
    t: usize,
    d: usize,
    h: usize,
    kvh: usize,
    f: usize,
    dh: usize,
    eps: f32,
    dev: burn::tensor::Device,
}

impl Shapes {
    fn new(cfg: &ModelConfig, rows: usize) -> Self {
        Shapes {
            b: rows,
            t: cfg.seq_len,
            d: cfg.d_model,
            h: cfg.heads,
            kvh: cfg.kv_heads(),
            f: cfg.ffn(),
            dh: cfg.head_dim(),
            eps: cfg.norm_eps() as f32,
            dev: train_device(),
        }
    }
    fn x3(&self, w: usize) -> Tensor<3> {
        Tensor::<3>::random(
            [self.b, self.t, w],
            Distribution::Normal(0.0, 1.0),
            &self.dev,
        )
        .require_grad()
    }
    fn heads(&self, n: usize) -> Tensor<4> {
        let dims = [self.b, n, self.t, self.dh];
        Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), &self.dev).require_grad()
    }
    /// A parameter: it requires its gradient, as in the block, so the backward computes it.
    fn weight(&self, i: usize, o: usize) -> Tensor<2> {
        Tensor::<2>::random([i, o], Distribution::Normal(0.0, 1.0), &self.dev).require_grad()
    }
    /// `[b, n, t, dh]` heads as `[b, n * t, dh]`, for the timing's 3-D output.
    fn flat(&self, x: Tensor<4>) -> Tensor<3> {
        let n = x.dims()[1];
        x.reshape([self.b, n * self.t, self.dh])
    }
}

/// The attention half's ops: norm, projections, heads, rotary embedding, attention.
fn attention_ops(s: &Shapes, repeats: usize) -> Vec<OpTime> {
    let (b, t, d, h, kvh, dh) = (s.b, s.t, s.d, s.h, s.kvh, s.dh);
    let norm_w = Tensor::<1>::ones([d], &s.dev).require_grad();
    let (wq, wkv) = (s.weight(d, d), s.weight(d, kvh * dh));
    let angles = Tensor::<2>::random([t, dh / 2], Distribution::Uniform(0.0, 6.3), &s.dev);
    let (cos, sin) = (angles.clone().cos(), angles.sin());
    let scale = 1.0 / (dh as f32).sqrt();
    let op = OpTime::timed;
    vec![
        op(
            "RMSNorm (fused)",
            2,
            time_op(
                repeats,
                || s.x3(d),
                |x| k::rms_norm(x, norm_w.clone(), s.eps),
            ),
        ),
        op(
            "q, o projections (d x d)",
            2,
            time_op(repeats, || s.x3(d), |x| k::linear(x, wq.clone(), None)),
        ),
        op(
            "k, v projections (d x kv heads)",
            2,
            time_op(repeats, || s.x3(d), |x| k::linear(x, wkv.clone(), None)),
        ),
        op(
            "head split and merge (reshape, swap)",
            4,
            time_op(
                repeats,
                || s.x3(d),
                |x| {
                    let y = x.reshape([b, t, h, dh]).swap_dims(1, 2);
                    y.swap_dims(1, 2).reshape([b, t, d])
                },
            ),
        ),
        op(
            "rotary embedding, q and k (fused)",
            1,
            time_op(
                repeats,
                || (s.heads(h), s.heads(kvh)),
                |(q, kk)| {
                    let q = s.flat(k::rope(q, cos.clone(), sin.clone()));
                    let kk = s.flat(k::rope(kk, cos.clone(), sin.clone()));
                    Tensor::cat(vec![q, kk], 1)
                },
            ),
        ),
        op(
            "causal attention (fused, GQA in place)",
            1,
            time_op(
                repeats,
                || (s.heads(h), s.heads(kvh), s.heads(kvh)),
                |(q, kk, v)| s.flat(k::causal_attention(q, kk, v, scale)),
            ),
        ),
    ]
}

/// The MLP half's ops, and the residual adds of both halves.
fn mlp_ops(s: &Shapes, repeats: usize) -> Vec<OpTime> {
    let (d, f) = (s.d, s.f);
    let (wup, wdown) = (s.weight(d, f), s.weight(f, d));
    let op = OpTime::timed;
    vec![
        op(
            "gate, up projections (d x ffn)",
            2,
            time_op(repeats, || s.x3(d), |x| k::linear(x, wup.clone(), None)),
        ),
        op(
            "SwiGLU (fused)",
            1,
            time_op(repeats, || (s.x3(f), s.x3(f)), |(g, u)| k::swiglu(g, u)),
        ),
        op(
            "down projection (ffn x d)",
            1,
            time_op(repeats, || s.x3(f), |x| k::linear(x, wdown.clone(), None)),
        ),
        op(
            "residual adds",
            2,
            time_op(repeats, || (s.x3(d), s.x3(d)), |(x, y)| x + y),
        ),
    ]
}

/// burn's own ops for the maths the fused kernels do, measured at the same shapes.
fn burn_alternatives(cfg: &ModelConfig, rows: usize, repeats: usize) -> Vec<Alternative> {
    use burn::tensor::activation::silu;
    let dev = train_device();
    let (b, t, d, h, f) = (rows, cfg.seq_len, cfg.d_model, cfg.heads, cfg.ffn());
    let dh = cfg.head_dim();
    let eps = cfg.norm_eps();
    let normal = Distribution::Normal(0.0, 1.0);
    let x3 = |w: usize| Tensor::<3>::random([b, t, w], normal, &dev).require_grad();
    let norm_w = Tensor::<1>::ones([d], &dev).require_grad();
    let angles = Tensor::<2>::random([t, dh / 2], Distribution::Uniform(0.0, 6.3), &dev);
    let (cos, sin) = (
        angles.clone().cos().reshape([1, 1, t, dh / 2]),
        angles.sin().reshape([1, 1, t, dh / 2]),
    );
    let alt = Alternative::timed;
    vec![
        alt(
            "burn ops: x * rsqrt(mean(x^2) + eps) * w",
            time_op(
                repeats,
                || x3(d),
                |x| {
                    let r = (x.clone().powi_scalar(2).mean_dim(2) + eps).sqrt().recip();
                    x * r * norm_w.clone().reshape([1, 1, d])
                },
            ),
            vec![("RMSNorm (fused)", 0.5)],
        ),
        alt(
            "burn ops: silu(g) * u",
            time_op(repeats, || (x3(f), x3(f)), |(g, u)| silu(g) * u),
            vec![("SwiGLU (fused)", 1.0)],
        ),
        alt(
            "burn ops: rotate halves, q only",
            time_op(
                repeats,
                || Tensor::<4>::random([b, h, t, dh], normal, &dev).require_grad(),
                |x| {
                    let half = x.clone().chunk(2, 3);
                    let (x1, x2) = (half[0].clone(), half[1].clone());
                    let y1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
                    let y2 = x2 * cos.clone() + x1 * sin.clone();
                    Tensor::cat(vec![y1, y2], 3).reshape([b, h * t, dh])
                },
            ),
            vec![(
                "rotary embedding, q and k (fused)",
                h as f64 / (h + cfg.kv_heads()) as f64,
            )],
        ),
    ]
}

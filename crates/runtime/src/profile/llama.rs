//! Where a LLaMA block's time goes (`profile --ops` on a llama model): each op of
//! [`crate::model::llama`]'s block at the model's shapes, timed alone, the whole block, and
//! burn's own ops for what the fused kernels (RMSNorm, SwiGLU, rotary embedding) replace.

use super::{time_op, Alternative, OpBreakdown, OpTime};
use crate::backend::train_device;
use crate::kernels as k;
use crate::model::{Layers, ModelConfig, StageInput};
use burn::tensor::{Distribution, Tensor};

/// The LLaMA counterpart of [`super::op_breakdown`]: the same rows, the whole block last.
pub fn op_breakdown(cfg: &ModelConfig, rows: usize, repeats: usize) -> OpBreakdown {
    let dev = train_device();
    let (b, t, d, h, kvh, f) = (
        rows,
        cfg.seq_len,
        cfg.d_model,
        cfg.heads,
        cfg.kv_heads(),
        cfg.ffn(),
    );
    let dh = cfg.head_dim();
    let eps = cfg.norm_eps() as f32;
    let normal = Distribution::Normal(0.0, 1.0);
    let x3 = |w: usize| Tensor::<3>::random([b, t, w], normal, &dev).require_grad();
    let heads = |n: usize| Tensor::<4>::random([b, n, t, dh], normal, &dev).require_grad();
    // Parameters require their gradient, as in the block: the backward computes it.
    let weight = |i: usize, o: usize| Tensor::<2>::random([i, o], normal, &dev).require_grad();
    let norm_w = Tensor::<1>::ones([d], &dev).require_grad();
    let (wq, wkv, wup, wdown) = (
        weight(d, d),
        weight(d, kvh * dh),
        weight(d, f),
        weight(f, d),
    );
    let angles = Tensor::<2>::random([t, dh / 2], Distribution::Uniform(0.0, 6.3), &dev);
    let (cos, sin) = (angles.clone().cos(), angles.sin());
    let lin = |x: Tensor<3>, w: &Tensor<2>| k::linear(x, w.clone(), None);
    let flat = |x: Tensor<4>| {
        let n = x.dims()[1];
        x.reshape([b, n * t, dh])
    };
    let mut ops = Vec::new();
    let mut push = |name, count, (fw, fb): (f64, f64)| {
        ops.push(OpTime {
            name,
            count,
            forward: fw * count as f64,
            forward_backward: fb * count as f64,
        })
    };
    push(
        "RMSNorm (fused)",
        2,
        time_op(repeats, || x3(d), |x| k::rms_norm(x, norm_w.clone(), eps)),
    );
    push(
        "q, o projections (d x d)",
        2,
        time_op(repeats, || x3(d), |x| lin(x, &wq)),
    );
    push(
        "k, v projections (d x kv heads)",
        2,
        time_op(repeats, || x3(d), |x| lin(x, &wkv)),
    );
    push(
        "head split and merge (reshape, swap)",
        4,
        time_op(
            repeats,
            || x3(d),
            |x| {
                x.reshape([b, t, h, dh])
                    .swap_dims(1, 2)
                    .swap_dims(1, 2)
                    .reshape([b, t, d])
            },
        ),
    );
    push(
        "rotary embedding, q and k (fused)",
        1,
        time_op(
            repeats,
            || (heads(h), heads(kvh)),
            |(q, kk)| {
                let q = flat(k::rope(q, cos.clone(), sin.clone()));
                let kk = flat(k::rope(kk, cos.clone(), sin.clone()));
                Tensor::cat(vec![q, kk], 1)
            },
        ),
    );
    push(
        "k, v heads repeated for their queries",
        2,
        time_op(
            repeats,
            || heads(kvh),
            |x| {
                let n = h / kvh.max(1);
                flat(
                    x.unsqueeze_dim::<5>(2)
                        .repeat_dim(2, n)
                        .reshape([b, h, t, dh]),
                )
            },
        ),
    );
    let scale = 1.0 / (dh as f32).sqrt();
    push(
        "causal attention (fused)",
        1,
        time_op(
            repeats,
            || (heads(h), heads(h), heads(h)),
            |(q, kk, v)| flat(k::causal_attention(q, kk, v, scale)),
        ),
    );
    push(
        "gate, up projections (d x ffn)",
        2,
        time_op(repeats, || x3(d), |x| lin(x, &wup)),
    );
    push(
        "SwiGLU (fused)",
        1,
        time_op(repeats, || (x3(f), x3(f)), |(g, u)| k::swiglu(g, u)),
    );
    push(
        "down projection (ffn x d)",
        1,
        time_op(repeats, || x3(f), |x| lin(x, &wdown)),
    );
    push(
        "residual adds",
        2,
        time_op(repeats, || (x3(d), x3(d)), |(x, y)| x + y),
    );
    let layers = Layers::new(cfg, 1, &dev);
    let block = layers.stage(1, 2);
    let whole = time_op(repeats, || x3(d), |x| block.forward(StageInput::Hidden(x)));
    OpBreakdown {
        ops,
        whole: OpTime {
            name: "whole block",
            count: 1,
            forward: whole.0,
            forward_backward: whole.1,
        },
        alternatives: burn_alternatives(cfg, rows, repeats),
    }
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
    let alt = |name, (forward, forward_backward): (f64, f64), replaces| Alternative {
        op: OpTime {
            name,
            count: 1,
            forward,
            forward_backward,
        },
        replaces,
    };
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

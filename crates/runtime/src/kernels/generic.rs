//! The kernels' maths in burn's own operations, for devices without this project's CPU
//! kernels (wgpu): the same functions of the same inputs, differentiated by burn's autodiff.

use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{Bool, Tensor};

/// `x W + b` over the last dimension.
pub fn linear<const D: usize>(x: Tensor<D>, w: Tensor<2>, b: Option<Tensor<1>>) -> Tensor<D> {
    let y = x.matmul(w.unsqueeze::<D>());
    match b {
        Some(b) => y + b.unsqueeze::<D>(),
        None => y,
    }
}

/// Exact GELU, `x Phi(x)`.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    burn::tensor::activation::gelu(x)
}

/// The score a masked key gets.
const MASKED: f32 = -1.0e9;

/// Softmax of `scale * scores` over the last dimension, keys after the query masked out.
pub fn causal_softmax<const D: usize>(scores: Tensor<D>, scale: f32) -> Tensor<D> {
    let dims = scores.dims();
    let (t, keys) = (dims[D - 2], dims[D - 1]);
    // burn's tril_mask is true outside the lower triangle: the keys after each query.
    let mask = Tensor::<2, Bool>::tril_mask([t, keys], 0, &scores.device());
    // A large finite value rather than -inf: GPU shader compilers may assume finite floats.
    // Its weight is exactly 0 all the same (exp underflows).
    softmax(
        (scores * scale).mask_fill(mask.unsqueeze::<D>(), MASKED),
        D - 1,
    )
}

/// Causal attention of `[.., heads, t, dh]` queries and keys/values with `heads / g` heads,
/// each serving `g` consecutive query heads.
pub fn causal_attention<const D: usize>(
    q: Tensor<D>,
    k: Tensor<D>,
    v: Tensor<D>,
    scale: f32,
) -> Tensor<D> {
    let dims = q.dims();
    assert!(D >= 3, "causal_attention: [.., heads, t, dh] tensors");
    let (heads, t, dh) = (dims[D - 3], dims[D - 2], dims[D - 1]);
    let kv_heads = k.dims()[D - 3];
    let lead = dims[..D - 3].iter().product::<usize>();
    let grouped = |x: Tensor<D>| repeat_kv(x.reshape([lead, kv_heads, t, dh]), heads / kv_heads);
    let (k, v) = (grouped(k), grouped(v));
    let q = q.reshape([lead, heads, t, dh]);
    let w = causal_softmax(q.matmul(k.swap_dims(2, 3)), scale);
    w.matmul(v).reshape(dims)
}

/// Each key/value head repeated for the `n` query heads that share it: `[b, kvh, t, dh]` to
/// `[b, kvh * n, t, dh]`, head `j` serving query heads `j*n .. (j+1)*n`.
pub fn repeat_kv(x: Tensor<4>, n: usize) -> Tensor<4> {
    if n == 1 {
        return x;
    }
    let [b, kvh, t, dh] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .repeat_dim(2, n)
        .reshape([b, kvh * n, t, dh])
}

/// Layer normalisation over the last dimension (biased variance), then `* gamma + beta`.
pub fn layer_norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    eps: f32,
) -> Tensor<D> {
    let (var, mean) = x.clone().var_mean_bias(D - 1);
    (x - mean) / (var + eps).sqrt() * gamma.unsqueeze::<D>() + beta.unsqueeze::<D>()
}

/// RMSNorm over the last dimension, then `* w`.
pub fn rms_norm<const D: usize>(x: Tensor<D>, w: Tensor<1>, eps: f32) -> Tensor<D> {
    let ms = x.clone().powi_scalar(2).mean_dim(D - 1);
    x / (ms + eps).sqrt() * w.unsqueeze::<D>()
}

/// `silu(g) * u`.
pub fn swiglu<const D: usize>(g: Tensor<D>, u: Tensor<D>) -> Tensor<D> {
    g.clone() * sigmoid(g) * u
}

/// Each pair (i, i + dh/2) of `x [.., t, dh]` rotated by the angles whose cosines and sines
/// `cos`, `sin` `[t, dh / 2]` hold.
pub fn rope<const D: usize>(x: Tensor<D>, cos: Tensor<2>, sin: Tensor<2>) -> Tensor<D> {
    let half = cos.dims()[1];
    let (c, s) = (cos.unsqueeze::<D>(), sin.unsqueeze::<D>());
    let x1 = x.clone().narrow(D - 1, 0, half);
    let x2 = x.narrow(D - 1, half, half);
    let y1 = c.clone() * x1.clone() - s.clone() * x2.clone();
    let y2 = c * x2 + s * x1;
    Tensor::cat(vec![y1, y2], D - 1)
}

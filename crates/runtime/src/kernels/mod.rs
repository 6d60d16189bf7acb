//! The model's hot operations as burn backend extensions: our own CPU kernels for flex, with
//! their own backward under autodiff. Measured (`pipewright profile --ops`): flex's GEMM (the
//! `gemm` crate) ran the block's matmuls at 80-123 GFLOP/s on this project's 2-core machines,
//! where OpenBLAS's `sgemm` runs them at 200-250.
//!
//! Each operation computes the same maths as the burn composition it replaces (f32 throughout;
//! GELU's erf within 1.5e-7), checked against it in the tests below; the exact-gradient tests
//! run through them.

use crate::backend::fused_kernels;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{binary, unary, Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Backend, Dispatch, Flex};
use burn::tensor::{Tensor, TensorData};

mod attention;
mod blas;
pub use blas::measured_peak_flops;
mod cpu;
mod generic;
pub(crate) use generic::repeat_kv;
mod rmsnorm_swiglu_rope;

#[backend_extension(Flex, Autodiff)]
pub trait Kernels: Backend {
    /// `a [.., m, k] · b [.., k, n]` with the same leading (batch) dimensions; either operand
    /// may be a strided view (a transpose, heads split off a wider row) without a copy.
    fn matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `x [r, i] · w [i, o] + b [o]`: a Linear layer as one GEMM (the bias is its initial value).
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// [`Kernels::linear`] whose backward computes only the input gradient and leaves the
    /// output gradient in `slot` for a later weight-gradient (W) step. `w` and `b` take no part
    /// in autodiff; the one-value `anchor`, which requires a gradient, keeps the op in the
    /// graph when `x` does not (it receives none).
    fn linear_deferred(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        slot: GradSlot,
    ) -> FloatTensor<Self>;
    /// Exact GELU, `x Phi(x)`.
    fn gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Softmax over the last dimension of `scale * x` for `[.., t, t]` scores, keys after the
    /// query (column > row) masked out: causal attention weights.
    fn causal_softmax(x: FloatTensor<Self>, scale: f32) -> FloatTensor<Self>;
    /// Causal attention of `[.., t, dh]` queries, keys and values (any strides): `softmax(scale
    /// q k^T, keys after the query masked) v`, without the masked scores' products. Keys and
    /// values may have fewer heads (`[.., heads / g, t, dh]`): each then serves `g` consecutive
    /// query heads (grouped-query attention), read in place rather than repeated.
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self>;
    /// Layer normalisation over the last dimension, then `* gamma + beta`.
    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f32,
    ) -> FloatTensor<Self>;
    /// RMSNorm over the last dimension, then `* w`.
    fn rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f32) -> FloatTensor<Self>;
    /// `silu(g) * u`, element-wise.
    fn swiglu(g: FloatTensor<Self>, u: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Rotary position embedding of `[.., t, dh]` (any strides; the output is contiguous) by
    /// the angles whose cosines and sines `cos`, `sin` `[t, dh / 2]` hold (not differentiated).
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

impl Kernels for Flex {
    fn matmul(a: FlexTensor, b: FlexTensor) -> FlexTensor {
        blas::matmul(a, b)
    }

    fn linear(x: FlexTensor, w: FlexTensor, b: FlexTensor) -> FlexTensor {
        blas::linear(x, w, b)
    }

    fn linear_deferred(
        x: FlexTensor,
        w: FlexTensor,
        b: FlexTensor,
        _: FlexTensor,
        _: GradSlot,
    ) -> FlexTensor {
        blas::linear(x, w, b)
    }

    fn gelu(x: FlexTensor) -> FlexTensor {
        gelu_forward(x, false).0
    }

    fn causal_softmax(x: FlexTensor, scale: f32) -> FlexTensor {
        causal_softmax_forward(x, scale)
    }

    fn causal_attention(q: FlexTensor, k: FlexTensor, v: FlexTensor, scale: f32) -> FlexTensor {
        attention::forward(q, k, v, scale).0
    }

    fn layer_norm(x: FlexTensor, gamma: FlexTensor, beta: FlexTensor, eps: f32) -> FlexTensor {
        layer_norm_forward(x, gamma, beta, eps).0
    }

    fn rms_norm(x: FlexTensor, w: FlexTensor, eps: f32) -> FlexTensor {
        tensor(
            rmsnorm_swiglu_rope::rms_norm(&values(&x), &values(&w), eps).0,
            &x,
        )
    }

    fn swiglu(g: FlexTensor, u: FlexTensor) -> FlexTensor {
        tensor(rmsnorm_swiglu_rope::swiglu(&values(&g), &values(&u)), &g)
    }

    fn rope(x: FlexTensor, cos: FlexTensor, sin: FlexTensor) -> FlexTensor {
        rope_apply(&x, &cos, &sin, false)
    }
}

/// `x [.., t, dh]` rotated by the tables' angles (or back, with `inverse`).
fn rope_apply(x: &FlexTensor, cos: &FlexTensor, sin: &FlexTensor, inverse: bool) -> FlexTensor {
    let shape = x.layout().shape();
    let t = shape[shape.num_dims() - 2];
    tensor(
        rmsnorm_swiglu_rope::rope(&values(x), t, &values(cos), &values(sin), inverse),
        x,
    )
}

/// The values of `t` as one contiguous f32 slice (copying only if `t` is a strided view).
fn values(t: &FlexTensor) -> std::borrow::Cow<'_, [f32]> {
    match t.as_slice::<f32>() {
        Some(v) => std::borrow::Cow::Borrowed(v),
        None => std::borrow::Cow::Owned(t.to_contiguous().as_slice::<f32>().expect("f32").to_vec()),
    }
}

/// A tensor of `v` in `like`'s shape.
fn tensor(v: Vec<f32>, like: &FlexTensor) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(v, like.layout().shape().to_vec()))
}

/// The side of the square `[.., t, t]` score matrices.
fn square_rows(x: &FlexTensor) -> usize {
    let shape = x.layout().shape();
    let n = shape.num_dims();
    assert!(
        n >= 2 && shape[n - 1] == shape[n - 2],
        "causal_softmax: scores must be [.., t, t], got {shape:?}"
    );
    shape[n - 1]
}

fn gelu_forward(x: FlexTensor, slope: bool) -> (FlexTensor, Option<FlexTensor>) {
    let (y, d) = cpu::gelu(&values(&x), slope);
    (tensor(y, &x), d.map(|d| tensor(d, &x)))
}

fn causal_softmax_forward(x: FlexTensor, scale: f32) -> FlexTensor {
    tensor(cpu::causal_softmax(&values(&x), square_rows(&x), scale), &x)
}

fn causal_softmax_backward(y: &FlexTensor, dy: &FlexTensor, scale: f32) -> FlexTensor {
    tensor(
        cpu::causal_softmax_backward(&values(y), &values(dy), square_rows(y), scale),
        y,
    )
}

fn mul(a: &FlexTensor, b: &FlexTensor) -> FlexTensor {
    tensor(cpu::mul(&values(a), &values(b)), a)
}

/// `g · b^T`: the gradient of a product's left operand (a Linear layer's input gradient).
fn times_transposed(g: FlexTensor, b: FlexTensor) -> FlexTensor {
    Flex::matmul(g, Flex::float_transpose(b))
}

/// `a^T · g`: the gradient of a product's right operand (a Linear layer's weight gradient).
fn transposed_times(a: FlexTensor, g: FlexTensor) -> FlexTensor {
    Flex::matmul(Flex::float_transpose(a), g)
}

/// A bias gradient: the sums over the rows of `dy [rows, out]` (the same sums in the same
/// order whether the backward is fused or split into B and W).
pub fn bias_grad(dy: &Tensor<2>) -> Vec<f32> {
    let cols = dy.dims()[1];
    let d = dy.to_data();
    cpu::column_sums(d.as_slice::<f32>().expect("f32 gradients"), cols)
}

fn column_sums(t: &FlexTensor) -> FlexTensor {
    let cols = t.layout().shape()[1];
    FlexTensor::from_data(TensorData::new(cpu::column_sums(&values(t), cols), [cols]))
}

/// Layer norm forward: output, normalised input, and 1/std per row.
fn layer_norm_forward(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    eps: f32,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let (y, xh, rstd) = cpu::layer_norm(&values(&x), &values(&gamma), &values(&beta), eps);
    let rows = rstd.len();
    (
        tensor(y, &x),
        tensor(xh, &x),
        FlexTensor::from_data(TensorData::new(rstd, [rows])),
    )
}

fn layer_norm_backward(
    xhat: &FlexTensor,
    rstd: &FlexTensor,
    gamma: &FlexTensor,
    dy: &FlexTensor,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let (dx, dg, db) =
        cpu::layer_norm_backward(&values(xhat), &values(rstd), &values(gamma), &values(dy));
    (tensor(dx, xhat), tensor(dg, gamma), tensor(db, gamma))
}

/// One autodiff op's backward shell: a unit struct `$name` whose `Backward` over `$n` parents
/// keeps `$state` and runs `$body` with the op's `Ops` and the gradients (burn's boilerplate,
/// written once).
macro_rules! backward {
    ($name:ident, $n:literal, $state:ty, |$ops:ident, $grads:ident| $body:block) => {
        #[derive(Debug)]
        struct $name;

        impl Backward<Flex, $n> for $name {
            type State = $state;

            fn backward(
                self,
                $ops: Ops<Self::State, $n>,
                $grads: &mut Gradients,
                _: &mut Checkpointer,
            ) $body
        }
    };
}

impl<C: CheckpointStrategy> Kernels for Autodiff<Flex, C> {
    fn matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        backward!(
            MatMul,
            2,
            (Option<FlexTensor>, Option<FlexTensor>),
            |ops, grads| {
                let (a, b) = ops.state;
                binary::<Flex, _, _>(
                    ops.parents,
                    ops.node,
                    grads,
                    |g| times_transposed(g, b.expect("kept for da")),
                    |g| transposed_times(a.expect("kept for db"), g),
                );
            }
        );

        let (a_tracked, b_tracked) = (a.is_tracked(), b.is_tracked());
        match MatMul
            .prepare::<C>([a.node(), b.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                // da needs b, db needs a: keep only what a tracked input's gradient reads.
                let state = (
                    b_tracked.then(|| a.primitive().clone()),
                    a_tracked.then(|| b.primitive().clone()),
                );
                prep.finish(state, Flex::matmul(a.into_primitive(), b.into_primitive()))
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(Flex::matmul(a.into_primitive(), b.into_primitive()))
            }
        }
    }

    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        // State: The input (for dw) and the weight (for dx), each kept only if needed.
        backward!(
            Linear,
            3,
            (Option<FlexTensor>, Option<FlexTensor>),
            |ops, grads| {
                let (x, w) = ops.state;
                let dy = grads.consume::<Flex>(&ops.node);
                let [px, pw, pb] = ops.parents;
                if let Some(node) = px {
                    let dx = times_transposed(dy.clone(), w.expect("kept for dx"));
                    grads.register::<Flex>(node.id, dx);
                }
                if let Some(node) = pw {
                    let dw = transposed_times(x.expect("kept for dw"), dy.clone());
                    grads.register::<Flex>(node.id, dw);
                }
                if let Some(node) = pb {
                    grads.register::<Flex>(node.id, column_sums(&dy));
                }
            }
        );

        let (x_tracked, w_tracked) = (x.is_tracked(), w.is_tracked());
        match Linear
            .prepare::<C>([x.node(), w.node(), b.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = (
                    w_tracked.then(|| x.primitive().clone()),
                    x_tracked.then(|| w.primitive().clone()),
                );
                let y = Flex::linear(x.into_primitive(), w.into_primitive(), b.into_primitive());
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::linear(
                x.into_primitive(),
                w.into_primitive(),
                b.into_primitive(),
            )),
        }
    }

    fn linear_deferred(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        slot: GradSlot,
    ) -> FloatTensor<Self> {
        // State: The weight (for dx) and where dy goes.
        backward!(DeferredLinear, 4, (FlexTensor, GradSlot), |ops, grads| {
            let (w, slot) = ops.state;
            let dy = grads.consume::<Flex>(&ops.node);
            let [px, ..] = ops.parents;
            if let Some(node) = px {
                let dx = times_transposed(dy.clone(), w);
                grads.register::<Flex>(node.id, dx);
            }
            slot.put(dy.into_data());
        });

        let nodes = [x.node(), w.node(), b.node(), anchor.node()];
        let (w, b) = (w.into_primitive(), b.into_primitive());
        match DeferredLinear
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = Flex::linear(x.into_primitive(), w.clone(), b);
                prep.finish((w, slot), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::linear(x.into_primitive(), w, b)),
        }
    }

    fn gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        backward!(Gelu, 1, FlexTensor, |ops, grads| {
            let slope = ops.state;
            unary::<Flex, _>(ops.parents, ops.node, grads, |g| mul(&slope, &g));
        });

        match Gelu.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, slope) = gelu_forward(x.into_primitive(), true);
                prep.finish(slope.expect("asked for the slope"), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::gelu(x.into_primitive())),
        }
    }

    fn causal_softmax(x: FloatTensor<Self>, scale: f32) -> FloatTensor<Self> {
        backward!(Softmax, 1, (FlexTensor, f32), |ops, grads| {
            let (y, scale) = ops.state;
            unary::<Flex, _>(ops.parents, ops.node, grads, |g| {
                causal_softmax_backward(&y, &g, scale)
            });
        });

        match Softmax.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = causal_softmax_forward(x.into_primitive(), scale);
                prep.finish((y.clone(), scale), y)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(causal_softmax_forward(x.into_primitive(), scale))
            }
        }
    }

    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        // State: Queries, keys, values, the attention weights, the scale.
        backward!(
            Attention,
            3,
            (FlexTensor, FlexTensor, FlexTensor, FlexTensor, f32),
            |ops, grads| {
                let (q, k, v, weights, scale) = ops.state;
                let dy = grads.consume::<Flex>(&ops.node);
                let [dq, dk, dv] = attention::backward(q, k, v, &weights, dy, scale);
                let [pq, pk, pv] = ops.parents;
                for (parent, grad) in [(pq, dq), (pk, dk), (pv, dv)] {
                    if let Some(node) = parent {
                        grads.register::<Flex>(node.id, grad);
                    }
                }
            }
        );

        let nodes = [q.node(), k.node(), v.node()];
        match Attention.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
                let (y, weights) = attention::forward(q.clone(), k.clone(), v.clone(), scale);
                prep.finish((q, k, v, weights, scale), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::causal_attention(
                q.into_primitive(),
                k.into_primitive(),
                v.into_primitive(),
                scale,
            )),
        }
    }

    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f32,
    ) -> FloatTensor<Self> {
        // State: Normalised input, 1/std per row, gamma.
        backward!(
            LayerNorm,
            3,
            (FlexTensor, FlexTensor, FlexTensor),
            |ops, grads| {
                let (xhat, rstd, gamma) = ops.state;
                let dy = grads.consume::<Flex>(&ops.node);
                let (dx, dg, db) = layer_norm_backward(&xhat, &rstd, &gamma, &dy);
                let [px, pg, pb] = ops.parents;
                for (parent, grad) in [(px, dx), (pg, dg), (pb, db)] {
                    if let Some(node) = parent {
                        grads.register::<Flex>(node.id, grad);
                    }
                }
            }
        );

        let nodes = [x.node(), gamma.node(), beta.node()];
        match LayerNorm.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let g = gamma.into_primitive();
                let (y, xhat, rstd) =
                    layer_norm_forward(x.into_primitive(), g.clone(), beta.into_primitive(), eps);
                prep.finish((xhat, rstd, g), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::layer_norm(
                x.into_primitive(),
                gamma.into_primitive(),
                beta.into_primitive(),
                eps,
            )),
        }
    }

    fn rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        // State: Normalised input, 1/rms per row, the weight.
        backward!(
            RmsNorm,
            2,
            (FlexTensor, FlexTensor, FlexTensor),
            |ops, grads| {
                let (xh, rstd, w) = ops.state;
                let dy = grads.consume::<Flex>(&ops.node);
                let (dx, dw) = rmsnorm_swiglu_rope::rms_norm_backward(
                    &values(&xh),
                    &values(&rstd),
                    &values(&w),
                    &values(&dy),
                );
                let [px, pw] = ops.parents;
                if let Some(node) = px {
                    grads.register::<Flex>(node.id, tensor(dx, &xh));
                }
                if let Some(node) = pw {
                    grads.register::<Flex>(node.id, tensor(dw, &w));
                }
            }
        );

        match RmsNorm
            .prepare::<C>([x.node(), w.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (x, w) = (x.into_primitive(), w.into_primitive());
                let (y, xh, rstd) = rmsnorm_swiglu_rope::rms_norm(&values(&x), &values(&w), eps);
                let rows = rstd.len();
                let rstd = FlexTensor::from_data(TensorData::new(rstd, [rows]));
                prep.finish((tensor(xh, &x), rstd, w), tensor(y, &x))
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(Flex::rms_norm(x.into_primitive(), w.into_primitive(), eps))
            }
        }
    }

    fn swiglu(g: FloatTensor<Self>, u: FloatTensor<Self>) -> FloatTensor<Self> {
        backward!(SwiGlu, 2, (FlexTensor, FlexTensor), |ops, grads| {
            let (g, u) = ops.state;
            let dy = grads.consume::<Flex>(&ops.node);
            let (dg, du) =
                rmsnorm_swiglu_rope::swiglu_backward(&values(&g), &values(&u), &values(&dy));
            let [pg, pu] = ops.parents;
            for (parent, grad) in [(pg, dg), (pu, du)] {
                if let Some(node) = parent {
                    grads.register::<Flex>(node.id, tensor(grad, &g));
                }
            }
        });

        match SwiGlu
            .prepare::<C>([g.node(), u.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (g, u) = (g.into_primitive(), u.into_primitive());
                let y = Flex::swiglu(g.clone(), u.clone());
                prep.finish((g, u), y)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(Flex::swiglu(g.into_primitive(), u.into_primitive()))
            }
        }
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        backward!(Rope, 1, (FlexTensor, FlexTensor), |ops, grads| {
            let (cos, sin) = ops.state;
            unary::<Flex, _>(ops.parents, ops.node, grads, |g| {
                rope_apply(&g, &cos, &sin, true)
            });
        });

        let (cos, sin) = (cos.into_primitive(), sin.into_primitive());
        match Rope.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = Flex::rope(x.into_primitive(), cos.clone(), sin.clone());
                prep.finish((cos, sin), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::rope(x.into_primitive(), cos, sin)),
        }
    }
}

/// `a · b` with the same batch dimensions, on either device (with or without autodiff).
pub fn matmul<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    if !fused_kernels(&a.device()) {
        return a.matmul(b);
    }
    Tensor::from_dispatch(<Dispatch as Kernels>::matmul(
        a.into_dispatch(),
        b.into_dispatch(),
    ))
}

/// `x W + b` over all rows of `x [.., i]` as one GEMM.
pub fn linear<const D: usize>(x: Tensor<D>, w: Tensor<2>, b: Option<Tensor<1>>) -> Tensor<D> {
    if !fused_kernels(&x.device()) {
        return generic::linear(x, w, b);
    }
    let mut dims = x.dims();
    let i = dims[D - 1];
    let o = w.dims()[1];
    let rows = x.shape().num_elements() / i.max(1);
    let x = x.reshape([rows, i]);
    let y: Tensor<2> = match b {
        Some(b) => Tensor::from_dispatch(<Dispatch as Kernels>::linear(
            x.into_dispatch(),
            w.into_dispatch(),
            b.into_dispatch(),
        )),
        None => matmul(x, w),
    };
    dims[D - 1] = o;
    y.reshape(dims)
}

/// Where a deferred Linear's backward leaves its output gradient for the W step.
#[derive(Clone, Debug, Default)]
pub struct GradSlot(std::sync::Arc<std::sync::Mutex<Option<TensorData>>>);

impl GradSlot {
    fn put(&self, dy: TensorData) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(dy);
    }

    /// The output gradient the backward left, if it ran.
    pub fn take(&self) -> Option<TensorData> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Where a deferred Linear's output gradient comes from after B.
#[derive(Clone, Debug)]
pub enum OutputGrad {
    /// The CPU kernel's backward leaves it in the slot.
    Slot(GradSlot),
    /// Other devices: the output had this zero tensor added, a leaf that requires a gradient;
    /// its gradient after B is the output's gradient. (Boxed: a tensor is large.)
    Probe(Box<Tensor<2>>),
}

/// `x W + b` over all rows of `x [rows, i]`, with weight gradients deferred (see
/// [`Kernels::linear_deferred`]): the output and where its gradient will be found. On devices
/// without the CPU kernels, `W` and `b` are detached (burn's autodiff then computes only the
/// input gradient) and a zero probe carries the output gradient out of the backward.
pub fn linear_deferred(
    x: Tensor<2>,
    w: Tensor<2>,
    b: Option<Tensor<1>>,
) -> (Tensor<2>, OutputGrad) {
    let dev = x.device();
    if !fused_kernels(&dev) {
        let probe = Tensor::<2>::zeros([x.dims()[0], w.dims()[1]], &dev).require_grad();
        let y = generic::linear(x, w.detach(), b.map(|b| b.detach())) + probe.clone();
        return (y, OutputGrad::Probe(Box::new(probe)));
    }
    let b = b.unwrap_or_else(|| Tensor::zeros([w.dims()[1]], &dev));
    let anchor = Tensor::<1>::zeros([1], &dev).require_grad();
    let slot = GradSlot::default();
    let y = Tensor::from_dispatch(<Dispatch as Kernels>::linear_deferred(
        x.into_dispatch(),
        w.detach().into_dispatch(),
        b.detach().into_dispatch(),
        anchor.into_dispatch(),
        slot.clone(),
    ));
    (y, OutputGrad::Slot(slot))
}

/// Exact GELU (see [`Kernels::gelu`]).
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if !fused_kernels(&x.device()) {
        return generic::gelu(x);
    }
    Tensor::from_dispatch(<Dispatch as Kernels>::gelu(x.into_dispatch()))
}

/// Causal attention weights from `[.., t, t]` scores (see [`Kernels::causal_softmax`]).
pub fn causal_softmax<const D: usize>(scores: Tensor<D>, scale: f32) -> Tensor<D> {
    if !fused_kernels(&scores.device()) {
        return generic::causal_softmax(scores, scale);
    }
    Tensor::from_dispatch(<Dispatch as Kernels>::causal_softmax(
        scores.into_dispatch(),
        scale,
    ))
}

/// Causal attention of `[.., t, dh]` queries, keys and values, the keys and values possibly
/// with fewer heads (see [`Kernels::causal_attention`]).
pub fn causal_attention<const D: usize>(
    q: Tensor<D>,
    k: Tensor<D>,
    v: Tensor<D>,
    scale: f32,
) -> Tensor<D> {
    if !fused_kernels(&q.device()) {
        return generic::causal_attention(q, k, v, scale);
    }
    Tensor::from_dispatch(<Dispatch as Kernels>::causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        scale,
    ))
}

/// burn's `LayerNorm` forward as one kernel (its epsilon is [`LN_EPS`]).
pub fn layer_norm<const D: usize>(ln: &burn::nn::LayerNorm, x: Tensor<D>) -> Tensor<D> {
    layer_norm_eps(ln, x, LN_EPS)
}

/// RMSNorm of `x` with weight `w` (see [`Kernels::rms_norm`]).
pub fn rms_norm<const D: usize>(x: Tensor<D>, w: Tensor<1>, eps: f32) -> Tensor<D> {
    if !fused_kernels(&x.device()) {
        return generic::rms_norm(x, w, eps);
    }
    Tensor::from_dispatch(<Dispatch as Kernels>::rms_norm(
        x.into_dispatch(),
        w.into_dispatch(),
        eps,
    ))
}

/// `silu(g) * u` (see [`Kernels::swiglu`]).
pub fn swiglu<const D: usize>(g: Tensor<D>, u: Tensor<D>) -> Tensor<D> {
    if !fused_kernels(&g.device()) {
        return generic::swiglu(g, u);
    }
    Tensor::from_dispatch(<Dispatch as Kernels>::swiglu(
        g.into_dispatch(),
        u.into_dispatch(),
    ))
}

/// Rotary position embedding (see [`Kernels::rope`]); `cos` and `sin` are `[t, dh / 2]`.
pub fn rope<const D: usize>(x: Tensor<D>, cos: Tensor<2>, sin: Tensor<2>) -> Tensor<D> {
    if !fused_kernels(&x.device()) {
        return generic::rope(x, cos, sin);
    }
    Tensor::from_dispatch(<Dispatch as Kernels>::rope(
        x.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
    ))
}

/// [`layer_norm`] with another epsilon (BERT's 1e-12).
pub fn layer_norm_eps<const D: usize>(
    ln: &burn::nn::LayerNorm,
    x: Tensor<D>,
    eps: f32,
) -> Tensor<D> {
    let gamma = ln.gamma.val();
    let beta = match &ln.beta {
        Some(b) => b.val(),
        None => gamma.zeros_like(),
    };
    if !fused_kernels(&x.device()) {
        return generic::layer_norm(x, gamma, beta, eps);
    }
    Tensor::from_dispatch(<Dispatch as Kernels>::layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        eps,
    ))
}

/// The model's layer-norm epsilon (burn's `LayerNormConfig` default, set explicitly there).
pub const LN_EPS: f32 = 1e-5;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::train_device;
    use burn::tensor::{Distribution, Gradients as Grads};

    fn close<const D: usize>(ours: Tensor<D>, theirs: Tensor<D>, what: &str) {
        let (a, b) = (
            ours.into_data().try_to_vec::<f32>().unwrap(),
            theirs.into_data().try_to_vec::<f32>().unwrap(),
        );
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= 2e-5 * (1.0 + y.abs()),
                "{what}, element {i}: {x} vs {y}"
            );
        }
    }

    fn input<const D: usize>(dims: [usize; D], sd: f64) -> Tensor<D> {
        Tensor::<D>::random(dims, Distribution::Normal(0.0, sd), &train_device()).require_grad()
    }

    /// Ours against burn's composition: values, and the gradients of `sum(out * w)` by each
    /// input (one weight tensor `w` for both, so the upstream gradient is not all ones).
    fn same<const D: usize, const N: usize>(
        inputs: [Tensor<D>; N],
        ours: impl Fn(&[Tensor<D>; N]) -> Tensor<D>,
        theirs: impl Fn(&[Tensor<D>; N]) -> Tensor<D>,
        what: &str,
    ) {
        let (a, b) = (ours(&inputs), theirs(&inputs));
        let w = Tensor::<D>::random(a.dims(), Distribution::Default, &train_device());
        close(a.clone(), b.clone(), what);
        let ga: Grads = (a * w.clone()).sum().backward();
        let gb: Grads = (b * w).sum().backward();
        for (i, x) in inputs.iter().enumerate() {
            close(
                x.grad(&ga).unwrap(),
                x.grad(&gb).unwrap(),
                &format!("{what}: gradient {i}"),
            );
        }
    }

    #[test]
    fn matmul_matches_burn_with_transposed_views() {
        same(
            [input([5, 7], 1.0), input([3, 7], 1.0)],
            |[a, b]| matmul(a.clone(), b.clone().transpose()),
            |[a, b]| a.clone().matmul(b.clone().transpose()),
            "a b^T",
        );
        same(
            [input([7, 5], 1.0), input([7, 3], 1.0)],
            |[a, b]| matmul(a.clone().transpose(), b.clone()),
            |[a, b]| a.clone().transpose().matmul(b.clone()),
            "a^T b",
        );
    }

    #[test]
    fn matmul_with_an_empty_inner_dimension_is_zeros() {
        let dev = crate::backend::plain_device();
        let y = matmul(
            Tensor::<3>::zeros([2, 3, 0], &dev),
            Tensor::<3>::zeros([2, 0, 4], &dev),
        );
        assert_eq!(y.dims(), [2, 3, 4]);
        assert!(y.into_data().iter::<f32>().all(|v| v == 0.0));
    }

    #[test]
    fn batched_matmul_reads_split_heads_in_place() {
        // q [b, t, h, dh] seen as [b, h, t, dh]: rows strided by h * dh, as attention does.
        let heads = |x: &Tensor<4>| x.clone().swap_dims(1, 2);
        same(
            [input([2, 5, 3, 4], 1.0), input([2, 5, 3, 4], 1.0)],
            |[q, k]| matmul(heads(q), heads(k).swap_dims(2, 3)),
            |[q, k]| heads(q).matmul(heads(k).swap_dims(2, 3)),
            "q k^T",
        );
    }

    #[test]
    fn causal_attention_matches_its_composition() {
        // One tile and a ragged last one (t = 70 and 130 against tiles of 64), heads split off
        // a wider row as the model does, and a head width that is no multiple of a SIMD lane.
        for (t, dh) in [(5, 3), (70, 5), (130, 8)] {
            let heads = |x: &Tensor<4>| x.clone().swap_dims(1, 2);
            let scale = 1.0 / (dh as f32).sqrt();
            same(
                [
                    input([2, t, 3, dh], 1.0),
                    input([2, t, 3, dh], 1.0),
                    input([2, t, 3, dh], 1.0),
                ],
                |[q, k, v]| causal_attention(heads(q), heads(k), heads(v), scale),
                |[q, k, v]| {
                    let w = causal_softmax(heads(q).matmul(heads(k).swap_dims(2, 3)), scale);
                    w.matmul(heads(v))
                },
                &format!("attention, t = {t}"),
            );
        }
    }

    #[test]
    fn grouped_query_attention_matches_repeated_keys_and_values() {
        // 6 query heads over 2 and over 3 key/value heads, heads split off a wider row.
        for (t, kv) in [(5, 2), (70, 3)] {
            let dh = 4;
            let heads = |x: &Tensor<4>| x.clone().swap_dims(1, 2);
            let repeat = |x: Tensor<4>| {
                let [b, h, t, dh] = x.dims();
                x.unsqueeze_dim::<5>(2)
                    .repeat_dim(2, 6 / kv)
                    .reshape([b, h * (6 / kv), t, dh])
            };
            same(
                [
                    input([2, t, 6, dh], 1.0),
                    input([2, t, kv, dh], 1.0),
                    input([2, t, kv, dh], 1.0),
                ],
                |[q, k, v]| causal_attention(heads(q), heads(k), heads(v), 0.5),
                |[q, k, v]| {
                    let w = causal_softmax(heads(q).matmul(repeat(heads(k)).swap_dims(2, 3)), 0.5);
                    w.matmul(repeat(heads(v)))
                },
                &format!("grouped attention, t = {t}, {kv} key/value heads"),
            );
        }
    }

    #[test]
    fn causal_attention_of_nothing_is_empty() {
        for dims in [[1, 2, 0, 4], [1, 2, 3, 0], [0, 2, 3, 4]] {
            let [q, k, v] = [(); 3].map(|_| input(dims, 1.0));
            let y = causal_attention(q.clone(), k.clone(), v.clone(), 0.5);
            assert_eq!(y.dims(), dims);
            let g = y.sum().backward();
            for x in [q, k, v] {
                assert_eq!(x.grad(&g).map(|g| g.dims()), Some(dims));
            }
        }
    }

    #[test]
    fn linear_matches_burn_linear() {
        let dev = train_device();
        let w = input([6, 4], 1.0);
        let b = input([4], 1.0);
        let x = input([2, 3, 6], 1.0);
        let ours = linear(x.clone(), w.clone(), Some(b.clone()));
        let theirs = burn::tensor::module::linear(x.clone(), w.clone(), Some(b.clone()));
        close(ours.clone(), theirs.clone(), "linear");
        let up = Tensor::<3>::random([2, 3, 4], Distribution::Default, &dev);
        let ga = (ours * up.clone()).sum().backward();
        let gb = (theirs * up).sum().backward();
        close(x.grad(&ga).unwrap(), x.grad(&gb).unwrap(), "dx");
        close(w.grad(&ga).unwrap(), w.grad(&gb).unwrap(), "dw");
        close(b.grad(&ga).unwrap(), b.grad(&gb).unwrap(), "db");
    }

    #[test]
    fn gelu_matches_burn_exact_gelu() {
        same(
            [input([3, 700], 3.0)],
            |[x]| gelu(x.clone()),
            |[x]| burn::tensor::activation::gelu(x.clone()),
            "gelu",
        );
    }

    #[test]
    fn causal_softmax_matches_masked_softmax() {
        let t = 6;
        same(
            [input([2, 3, t, t], 2.0)],
            |[x]| causal_softmax(x.clone(), 0.7),
            |[x]| {
                let mask = Tensor::<2, burn::tensor::Bool>::tril_mask([t, t], 0, &x.device());
                let bias = Tensor::<2>::zeros([t, t], &x.device())
                    .mask_fill(mask, -1e9)
                    .reshape([1, 1, t, t]);
                burn::tensor::activation::softmax(x.clone() * 0.7 + bias, 3)
            },
            "causal softmax",
        );
    }

    #[test]
    fn layer_norm_matches_burn_layer_norm() {
        let dev = train_device();
        let mut ln = burn::nn::LayerNormConfig::new(8)
            .with_epsilon(LN_EPS as f64)
            .init(&dev);
        ln.gamma = ln.gamma.map(|_| input([8], 1.0));
        ln.beta = ln.beta.map(|b| b.map(|_| input([8], 1.0)));
        let (g, b) = (ln.gamma.val(), ln.beta.as_ref().unwrap().val());
        let x = input([4, 5, 8], 3.0);
        let ours = layer_norm(&ln, x.clone());
        let theirs = ln.forward(x.clone());
        close(ours.clone(), theirs.clone(), "layer norm");
        let w = Tensor::<3>::random([4, 5, 8], Distribution::Default, &dev);
        let ga = (ours * w.clone()).sum().backward();
        let gb = (theirs * w).sum().backward();
        close(x.grad(&ga).unwrap(), x.grad(&gb).unwrap(), "dx");
        close(g.grad(&ga).unwrap(), g.grad(&gb).unwrap(), "dgamma");
        close(b.grad(&ga).unwrap(), b.grad(&gb).unwrap(), "dbeta");
    }
}

//! The model's hot operations as burn backend extensions: our own CPU kernels for flex, with
//! their own backward under autodiff. Measured (`pipewright profile --ops`): flex's GEMM (the
//! `gemm` crate) ran the block's matmuls at 80-123 GFLOP/s on this project's 2-core machines,
//! where OpenBLAS's `sgemm` runs them at 200-250.
//!
//! Every operation here is an exact replacement of the burn composition it stands for (same
//! maths, f32 throughout); the exact-gradient tests run through them.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{binary, unary, Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Backend, Dispatch, Flex};
use burn::tensor::{DType, Tensor, TensorData};

#[backend_extension(Flex, Autodiff)]
pub trait Kernels: Backend {
    /// `a [.., m, k] · b [.., k, n]` with the same leading (batch) dimensions; either operand
    /// may be a strided view (a transpose, heads split off a wider row) without a copy.
    fn matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `x [r, i] · w [i, o] + b [o]`: a Linear layer as one GEMM (the bias is its initial value).
    fn linear(x: FloatTensor<Self>, w: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Exact GELU, `x Phi(x)`.
    fn gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Softmax over the last dimension of `scale * x` for `[.., t, t]` scores, keys after the
    /// query (column > row) masked out: causal attention weights.
    fn causal_softmax(x: FloatTensor<Self>, scale: f32) -> FloatTensor<Self>;
    /// Layer normalisation over the last dimension, then `* gamma + beta`.
    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f32,
    ) -> FloatTensor<Self>;
}

/// How BLAS reads a `rows x cols` matrix stored with strides `(sr, sc)`: as stored or as the
/// transpose of a stored matrix, with its leading dimension; `None` if it needs a copy first.
fn blas_view(rows: usize, cols: usize, sr: isize, sc: isize) -> Option<(cblas_sys::CBLAS_TRANSPOSE, usize)> {
    let (r, c) = (rows.max(1), cols.max(1));
    if sc == 1 && (rows == 1 || sr >= c as isize) {
        Some((cblas_sys::CblasNoTrans, if rows == 1 { c } else { sr as usize }))
    } else if sr == 1 && (cols == 1 || sc >= r as isize) {
        Some((cblas_sys::CblasTrans, if cols == 1 { r } else { sc as usize }))
    } else {
        None
    }
}

/// One operand of a (batched) product: its storage, how BLAS reads each matrix, and where
/// each batch's matrix starts.
struct Operand {
    t: FlexTensor,
    trans: cblas_sys::CBLAS_TRANSPOSE,
    ld: usize,
    starts: Vec<usize>,
}

impl Operand {
    fn new(t: FlexTensor) -> Self {
        let view = |t: &FlexTensor| {
            let (l, n) = (t.layout(), t.layout().num_dims());
            let s = l.strides();
            if s.iter().any(|&s| s < 0) {
                return None;
            }
            blas_view(l.shape()[n - 2], l.shape()[n - 1], s[n - 2], s[n - 1])
        };
        let t = if view(&t).is_some() { t } else { t.to_contiguous() };
        let (trans, ld) = view(&t).expect("a contiguous matrix is a BLAS view");
        let l = t.layout();
        let n = l.num_dims();
        let mut starts = vec![l.start_offset()];
        for d in 0..n - 2 {
            let stride = l.strides()[d] as usize;
            starts = starts
                .iter()
                .flat_map(|&s| (0..l.shape()[d]).map(move |i| s + i * stride))
                .collect();
        }
        Operand { t, trans, ld, starts }
    }

    /// The storage from batch `i`'s matrix on, checked to hold a `rows x cols` matrix.
    fn matrix(&self, i: usize, rows: usize, cols: usize) -> &[f32] {
        let data = &self.t.storage::<f32>()[self.starts[i]..];
        let (major, minor) = if matches!(self.trans, cblas_sys::CblasNoTrans) { (rows, cols) } else { (cols, rows) };
        if major > 0 && minor > 0 {
            assert!((major - 1) * self.ld + minor <= data.len(), "matrix beyond its storage");
        }
        data
    }
}

/// `out = a · b + beta * out` for one `m x k` by `k x n` matrix pair through OpenBLAS.
#[allow(clippy::too_many_arguments)]
fn sgemm(a: &Operand, ia: usize, b: &Operand, ib: usize, (m, k, n): (usize, usize, usize), beta: f32, out: &mut [f32]) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let (pa, pb) = (a.matrix(ia, m, k), b.matrix(ib, k, n));
    assert!(out.len() >= m * n, "output smaller than m x n");
    let dim = |x: usize| i32::try_from(x).expect("matrix dimension fits BLAS's int");
    // SAFETY: `matrix` checked that each slice holds its matrix at its leading dimension, and
    // `out` holds m x n row-major.
    unsafe {
        cblas_sys::cblas_sgemm(
            cblas_sys::CblasRowMajor,
            a.trans,
            b.trans,
            dim(m),
            dim(n),
            dim(k),
            1.0,
            pa.as_ptr(),
            dim(a.ld),
            pb.as_ptr(),
            dim(b.ld),
            beta,
            out.as_mut_ptr(),
            dim(n),
        );
    }
}

impl Kernels for Flex {
    fn matmul(a: FlexTensor, b: FlexTensor) -> FlexTensor {
        let (sa, sb) = (a.layout().shape().to_vec(), b.layout().shape().to_vec());
        let n = sa.len();
        if a.dtype() != DType::F32 || b.dtype() != DType::F32 || n < 2 || sb.len() != n || sa[..n - 2] != sb[..n - 2] {
            // Broadcast batches and other dtypes: burn's own product.
            return Flex::float_matmul(a, b);
        }
        let (m, k, k2, cols) = (sa[n - 2], sa[n - 1], sb[n - 2], sb[n - 1]);
        assert_eq!(k, k2, "matmul: inner dimensions {k} and {k2} differ");
        let batches: usize = sa[..n - 2].iter().product();
        let mut out = vec![0f32; batches * m * cols];
        let (a, b) = (Operand::new(a), Operand::new(b));
        if m * cols > 0 {
            for (i, out) in out.chunks_mut(m * cols).enumerate() {
                sgemm(&a, i, &b, i, (m, k, cols), 0.0, out);
            }
        }
        let mut shape = sa[..n - 2].to_vec();
        shape.extend([m, cols]);
        FlexTensor::from_data(TensorData::new(out, shape))
    }

    fn linear(x: FlexTensor, w: FlexTensor, b: FlexTensor) -> FlexTensor {
        let (r, o) = (x.layout().shape()[0], w.layout().shape()[1]);
        let bias = values(&b);
        assert_eq!(bias.len(), o, "linear: {o} outputs, {} bias values", bias.len());
        let mut out: Vec<f32> = Vec::with_capacity(r * o);
        for _ in 0..r {
            out.extend_from_slice(&bias);
        }
        let (k, k2) = (x.layout().shape()[1], w.layout().shape()[0]);
        assert_eq!(k, k2, "linear: input width {k}, weight rows {k2}");
        sgemm(&Operand::new(x), 0, &Operand::new(w), 0, (r, k, o), 1.0, &mut out);
        FlexTensor::from_data(TensorData::new(out, [r, o]))
    }

    fn gelu(x: FlexTensor) -> FlexTensor {
        gelu_forward(x, false).0
    }

    fn causal_softmax(x: FlexTensor, scale: f32) -> FlexTensor {
        causal_softmax_forward(x, scale)
    }

    fn layer_norm(x: FlexTensor, gamma: FlexTensor, beta: FlexTensor, eps: f32) -> FlexTensor {
        layer_norm_forward(x, gamma, beta, eps).0
    }
}

/// Element-wise work is split into chunks of this many values across rayon's threads.
const CHUNK: usize = 1 << 14;

/// The values of `t` as one contiguous f32 slice (copying only if `t` is a strided view).
fn values(t: &FlexTensor) -> std::borrow::Cow<'_, [f32]> {
    match t.as_slice::<f32>() {
        Some(v) => std::borrow::Cow::Borrowed(v),
        None => std::borrow::Cow::Owned(t.to_contiguous().as_slice::<f32>().expect("f32").to_vec()),
    }
}

fn tensor(v: Vec<f32>, like: &FlexTensor) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(v, like.layout().shape().to_vec()))
}

/// `e^x` in plain arithmetic that vectorises: Cody-Waite reduction to `2^n e^r`, |r| <= ln2/2,
/// then a degree-6 Taylor polynomial (relative error about 2e-7 over the f32 range).
#[inline(always)]
fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // Round to nearest by the 1.5 * 2^23 trick (no libm call, so the loop vectorises).
    let n = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r / 720.0)))));
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// GELU and its derivative at `x`. `erf` is Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7),
/// whose `e^{-z^2}` with `z = x / sqrt 2` is the Gaussian density's `e^{-x^2/2}` as well.
#[inline(always)]
fn gelu_and_slope(x: f32) -> (f32, f32) {
    let z = (x * std::f32::consts::FRAC_1_SQRT_2).abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let poly = t * (0.254_829_6 + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152 + t * 1.061_405_4))));
    let g = exp(-z * z);
    let erf_abs = 1.0 - poly * g;
    let erf = if x < 0.0 { -erf_abs } else { erf_abs };
    let cdf = 0.5 * (1.0 + erf);
    // d/dx x Phi(x) = Phi(x) + x phi(x), phi(x) = e^{-x^2/2} / sqrt(2 pi).
    (x * cdf, cdf + x * g * 0.398_942_3)
}

/// GELU of `x`; with `slope`, also its derivative at each value (what the backward multiplies
/// the output gradient by, so the backward is one pass).
fn gelu_forward(x: FlexTensor, slope: bool) -> (FlexTensor, Option<FlexTensor>) {
    use rayon::prelude::*;
    let v = values(&x);
    let mut y = vec![0f32; v.len()];
    let mut d = if slope { vec![0f32; v.len()] } else { Vec::new() };
    if slope {
        y.par_chunks_mut(CHUNK)
            .zip(d.par_chunks_mut(CHUNK))
            .zip(v.par_chunks(CHUNK))
            .for_each(|((y, d), x)| {
                for ((y, d), &x) in y.iter_mut().zip(d.iter_mut()).zip(x) {
                    (*y, *d) = gelu_and_slope(x);
                }
            });
    } else {
        y.par_chunks_mut(CHUNK)
            .zip(v.par_chunks(CHUNK))
            .for_each(|(y, x)| {
                for (y, &x) in y.iter_mut().zip(x) {
                    *y = gelu_and_slope(x).0;
                }
            });
    }
    let d = slope.then(|| tensor(d, &x));
    (tensor(y, &x), d)
}

/// Sums over the rows of a 2-D tensor (a bias gradient), in row order: deterministic.
fn column_sums(t: &FlexTensor) -> FlexTensor {
    let cols = t.layout().shape()[1];
    let v = values(t);
    let mut out = vec![0f32; cols];
    for row in v.chunks(cols.max(1)) {
        out.iter_mut().zip(row).for_each(|(o, v)| *o += v);
    }
    FlexTensor::from_data(TensorData::new(out, [cols]))
}

/// Element-wise product (the GELU backward: slope times output gradient).
fn mul(a: &FlexTensor, b: &FlexTensor) -> FlexTensor {
    use rayon::prelude::*;
    let (va, vb) = (values(a), values(b));
    let mut out = vec![0f32; va.len()];
    out.par_chunks_mut(CHUNK)
        .zip(va.par_chunks(CHUNK).zip(vb.par_chunks(CHUNK)))
        .for_each(|(o, (a, b))| {
            for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
                *o = a * b;
            }
        });
    tensor(out, a)
}

/// Rows of `t` values (the last dimension) and which query each row is (its index in the
/// second-to-last dimension).
fn square_rows(x: &FlexTensor) -> usize {
    let shape = x.layout().shape();
    let n = shape.num_dims();
    assert!(n >= 2 && shape[n - 1] == shape[n - 2], "causal_softmax: scores must be [.., t, t], got {shape:?}");
    shape[n - 1]
}

fn causal_softmax_forward(x: FlexTensor, scale: f32) -> FlexTensor {
    use rayon::prelude::*;
    let t = square_rows(&x);
    let v = values(&x);
    let mut y = vec![0f32; v.len()];
    if t > 0 {
        y.par_chunks_mut(t).zip(v.par_chunks(t)).enumerate().for_each(|(r, (y, x))| {
            let keys = r % t + 1;
            let m = x[..keys].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) * scale;
            let mut sum = 0.0;
            for (y, &x) in y[..keys].iter_mut().zip(&x[..keys]) {
                *y = exp(x * scale - m);
                sum += *y;
            }
            let inv = 1.0 / sum;
            y[..keys].iter_mut().for_each(|y| *y *= inv);
        });
    }
    tensor(y, &x)
}

/// `dx = scale * y * (dy - sum(dy * y))` row by row (masked entries have y = 0).
fn causal_softmax_backward(y: &FlexTensor, dy: &FlexTensor, scale: f32) -> FlexTensor {
    use rayon::prelude::*;
    let t = square_rows(y);
    let (vy, vg) = (values(y), values(dy));
    let mut dx = vec![0f32; vy.len()];
    if t > 0 {
        dx.par_chunks_mut(t)
            .zip(vy.par_chunks(t).zip(vg.par_chunks(t)))
            .enumerate()
            .for_each(|(r, (dx, (y, g)))| {
                let keys = r % t + 1;
                let dot: f32 = y[..keys].iter().zip(&g[..keys]).map(|(y, g)| y * g).sum();
                for ((dx, y), g) in dx[..keys].iter_mut().zip(&y[..keys]).zip(&g[..keys]) {
                    *dx = scale * y * (g - dot);
                }
            });
    }
    tensor(dx, y)
}

/// Layer norm forward; also returns the normalised input and each row's 1/std (the backward's
/// state).
fn layer_norm_forward(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    eps: f32,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    use rayon::prelude::*;
    let d = *x.layout().shape().last().expect("layer_norm: a tensor with dimensions");
    let (v, g, b) = (values(&x), values(&gamma), values(&beta));
    assert!(g.len() == d && b.len() == d, "layer_norm: gamma and beta must have {d} values");
    let rows = v.len() / d.max(1);
    let (mut y, mut xhat, mut rstd) = (vec![0f32; v.len()], vec![0f32; v.len()], vec![0f32; rows]);
    if d > 0 {
        y.par_chunks_mut(d)
            .zip(xhat.par_chunks_mut(d))
            .zip(rstd.par_iter_mut())
            .zip(v.par_chunks(d))
            .for_each(|(((y, xh), rs), x)| {
                let mean = x.iter().sum::<f32>() / d as f32;
                let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
                *rs = 1.0 / (var + eps).sqrt();
                for (((y, xh), x), (g, b)) in y.iter_mut().zip(xh.iter_mut()).zip(x).zip(g.iter().zip(b.iter())) {
                    *xh = (x - mean) * *rs;
                    *y = *xh * g + b;
                }
            });
    }
    let rows_shape: Vec<usize> = vec![rows];
    let rstd = FlexTensor::from_data(TensorData::new(rstd, rows_shape));
    (tensor(y, &x), tensor(xhat, &x), rstd)
}

/// Layer norm backward: `dx = rstd * (dxh - mean(dxh) - xh * mean(dxh * xh))` with
/// `dxh = dy * gamma`; `dgamma = sum over rows of dy * xh`, `dbeta = sum of dy`.
fn layer_norm_backward(
    xhat: &FlexTensor,
    rstd: &FlexTensor,
    gamma: &FlexTensor,
    dy: &FlexTensor,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    use rayon::prelude::*;
    let (xh, rs, g, gy) = (values(xhat), values(rstd), values(gamma), values(dy));
    let d = g.len();
    let mut dx = vec![0f32; xh.len()];
    dx.par_chunks_mut(d)
        .zip(xh.par_chunks(d).zip(gy.par_chunks(d)))
        .zip(rs.par_iter())
        .for_each(|((dx, (xh, gy)), rs)| {
            let (mut m1, mut m2) = (0f32, 0f32);
            for ((xh, gy), g) in xh.iter().zip(gy).zip(g.iter()) {
                let dxh = gy * g;
                m1 += dxh;
                m2 += dxh * xh;
            }
            let (m1, m2) = (m1 / d as f32, m2 / d as f32);
            for (((dx, xh), gy), g) in dx.iter_mut().zip(xh).zip(gy).zip(g.iter()) {
                *dx = rs * (gy * g - m1 - xh * m2);
            }
        });
    // Parameter gradients: column sums, accumulated over rows in a fixed order (deterministic).
    let (mut dg, mut db) = (vec![0f32; d], vec![0f32; d]);
    for (xh, gy) in xh.chunks(d).zip(gy.chunks(d)) {
        for (((dg, db), xh), gy) in dg.iter_mut().zip(db.iter_mut()).zip(xh).zip(gy) {
            *dg += gy * xh;
            *db += gy;
        }
    }
    (tensor(dx, xhat), tensor(dg, gamma), tensor(db, gamma))
}

impl<C: CheckpointStrategy> Kernels for Autodiff<Flex, C> {
    fn matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct MatMul;

        impl Backward<Flex, 2> for MatMul {
            type State = (Option<FlexTensor>, Option<FlexTensor>);

            fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
                let (a, b) = ops.state;
                binary::<Flex, _, _>(
                    ops.parents,
                    ops.node,
                    grads,
                    |g| Flex::matmul(g, Flex::float_transpose(b.expect("kept for da"))),
                    |g| Flex::matmul(Flex::float_transpose(a.expect("kept for db")), g),
                );
            }
        }

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

    fn linear(x: FloatTensor<Self>, w: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct Linear;

        impl Backward<Flex, 3> for Linear {
            /// The input (for dw) and the weight (for dx), each kept only if needed.
            type State = (Option<FlexTensor>, Option<FlexTensor>);

            fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
                let (x, w) = ops.state;
                let dy = grads.consume::<Flex>(&ops.node);
                let [px, pw, pb] = ops.parents;
                if let Some(node) = px {
                    let w = Flex::float_transpose(w.expect("kept for dx"));
                    grads.register::<Flex>(node.id, Flex::matmul(dy.clone(), w));
                }
                if let Some(node) = pw {
                    let x = Flex::float_transpose(x.expect("kept for dw"));
                    grads.register::<Flex>(node.id, Flex::matmul(x, dy.clone()));
                }
                if let Some(node) = pb {
                    grads.register::<Flex>(node.id, column_sums(&dy));
                }
            }
        }

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

    fn gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct Gelu;

        impl Backward<Flex, 1> for Gelu {
            type State = FlexTensor;

            fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
                let slope = ops.state;
                unary::<Flex, _>(ops.parents, ops.node, grads, |g| mul(&slope, &g));
            }
        }

        match Gelu.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, slope) = gelu_forward(x.into_primitive(), true);
                prep.finish(slope.expect("asked for the slope"), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::gelu(x.into_primitive())),
        }
    }

    fn causal_softmax(x: FloatTensor<Self>, scale: f32) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct Softmax;

        impl Backward<Flex, 1> for Softmax {
            type State = (FlexTensor, f32);

            fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
                let (y, scale) = ops.state;
                unary::<Flex, _>(ops.parents, ops.node, grads, |g| {
                    causal_softmax_backward(&y, &g, scale)
                });
            }
        }

        match Softmax.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = causal_softmax_forward(x.into_primitive(), scale);
                prep.finish((y.clone(), scale), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(causal_softmax_forward(x.into_primitive(), scale)),
        }
    }

    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f32,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LayerNorm;

        impl Backward<Flex, 3> for LayerNorm {
            /// Normalised input, 1/std per row, gamma.
            type State = (FlexTensor, FlexTensor, FlexTensor);

            fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
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
        }

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
}

/// `a · b` with the same batch dimensions, on either device (with or without autodiff).
pub fn matmul<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as Kernels>::matmul(
        a.into_dispatch(),
        b.into_dispatch(),
    ))
}

/// `x W + b` over all rows of `x [.., i]` as one GEMM.
pub fn linear<const D: usize>(x: Tensor<D>, w: Tensor<2>, b: Option<Tensor<1>>) -> Tensor<D> {
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

/// Exact GELU (see [`Kernels::gelu`]).
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as Kernels>::gelu(x.into_dispatch()))
}

/// Causal attention weights from `[.., t, t]` scores (see [`Kernels::causal_softmax`]).
pub fn causal_softmax<const D: usize>(scores: Tensor<D>, scale: f32) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as Kernels>::causal_softmax(
        scores.into_dispatch(),
        scale,
    ))
}

/// burn's `LayerNorm` forward as one kernel (its epsilon is [`LN_EPS`]).
pub fn layer_norm<const D: usize>(ln: &burn::nn::LayerNorm, x: Tensor<D>) -> Tensor<D> {
    let gamma = ln.gamma.val();
    let beta = match &ln.beta {
        Some(b) => b.val(),
        None => gamma.zeros_like(),
    };
    Tensor::from_dispatch(<Dispatch as Kernels>::layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        LN_EPS,
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
            assert!((x - y).abs() <= 2e-5 * (1.0 + y.abs()), "{what}, element {i}: {x} vs {y}");
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
            close(x.grad(&ga).unwrap(), x.grad(&gb).unwrap(), &format!("{what}: gradient {i}"));
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

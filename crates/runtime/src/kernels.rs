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
use burn::backend::autodiff::ops::{binary, Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Backend, Dispatch, Flex};
use burn::tensor::{DType, Tensor, TensorData};

#[backend_extension(Flex, Autodiff)]
pub trait Kernels: Backend {
    /// `a [m, k] · b [k, n]`; either operand may be a transposed view.
    fn matmul2d(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// A 2-D operand as BLAS takes it: row-major as stored, or the transpose of a stored matrix.
fn blas_operand(t: FlexTensor) -> (FlexTensor, cblas_sys::CBLAS_TRANSPOSE, usize) {
    let l = t.layout();
    let (r, c) = (l.shape()[0], l.shape()[1]);
    let s = l.strides();
    if l.is_contiguous() {
        (t, cblas_sys::CblasNoTrans, c.max(1))
    } else if s[0] == 1 && s[1] == r as isize && r > 0 {
        (t, cblas_sys::CblasTrans, r)
    } else {
        let t = t.to_contiguous();
        (t, cblas_sys::CblasNoTrans, c.max(1))
    }
}

impl Kernels for Flex {
    fn matmul2d(a: FlexTensor, b: FlexTensor) -> FlexTensor {
        if a.dtype() != DType::F32 || b.dtype() != DType::F32 {
            return Flex::float_matmul(a, b);
        }
        let (m, k) = (a.layout().shape()[0], a.layout().shape()[1]);
        let (k2, n) = (b.layout().shape()[0], b.layout().shape()[1]);
        assert_eq!(k, k2, "matmul2d: inner dimensions {k} and {k2} differ");
        let mut out = vec![0f32; m * n];
        if m > 0 && n > 0 && k > 0 {
            let (a, ta, lda) = blas_operand(a);
            let (b, tb, ldb) = blas_operand(b);
            let pa = &a.storage::<f32>()[a.layout().start_offset()..];
            let pb = &b.storage::<f32>()[b.layout().start_offset()..];
            let dim = |x: usize| i32::try_from(x).expect("matrix dimension fits BLAS's int");
            // SAFETY: the slices hold the m x k and k x n matrices at the given leading
            // dimensions (checked by blas_operand), and `out` holds m x n.
            unsafe {
                cblas_sys::cblas_sgemm(
                    cblas_sys::CblasRowMajor,
                    ta,
                    tb,
                    dim(m),
                    dim(n),
                    dim(k),
                    1.0,
                    pa.as_ptr(),
                    dim(lda),
                    pb.as_ptr(),
                    dim(ldb),
                    0.0,
                    out.as_mut_ptr(),
                    dim(n),
                );
            }
        }
        FlexTensor::from_data(TensorData::new(out, [m, n]))
    }
}

impl<B: Backend + Kernels, C: CheckpointStrategy> Kernels for Autodiff<B, C> {
    fn matmul2d(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct MatMul;

        impl<B: Backend + Kernels> Backward<B, 2> for MatMul {
            type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>);

            fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
                let (a, b) = ops.state;
                binary::<B, _, _>(
                    ops.parents,
                    ops.node,
                    grads,
                    |g| B::matmul2d(g, B::float_transpose(b.expect("kept for da"))),
                    |g| B::matmul2d(B::float_transpose(a.expect("kept for db")), g),
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
                prep.finish(state, B::matmul2d(a.into_primitive(), b.into_primitive()))
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::matmul2d(a.into_primitive(), b.into_primitive()))
            }
        }
    }
}

/// `a · b` for 2-D tensors, on either device (with or without autodiff).
pub fn matmul(a: Tensor<2>, b: Tensor<2>) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as Kernels>::matmul2d(
        a.into_dispatch(),
        b.into_dispatch(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{plain_device, train_device};

    fn close(a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "element {i}: {x} vs {y}");
        }
    }

    fn vals(t: Tensor<2>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().unwrap()
    }

    #[test]
    fn matmul_matches_burn_with_transposed_views_and_gradients() {
        let dev = train_device();
        let a0 = Tensor::<2>::random([5, 7], burn::tensor::Distribution::Default, &plain_device());
        let b0 = Tensor::<2>::random([3, 7], burn::tensor::Distribution::Default, &plain_device());
        let (a, b) = (
            Tensor::<2>::from_data(a0.into_data(), &dev).require_grad(),
            Tensor::<2>::from_data(b0.into_data(), &dev).require_grad(),
        );
        let ours = matmul(a.clone(), b.clone().transpose());
        let theirs = a.clone().matmul(b.clone().transpose());
        close(&vals(ours.clone()), &vals(theirs.clone()));
        let w = Tensor::<2>::random([5, 3], burn::tensor::Distribution::Default, &dev);
        let g1 = (ours * w.clone()).sum().backward();
        let g2 = (theirs * w).sum().backward();
        close(
            &a.grad(&g1).unwrap().into_data().to_vec::<f32>().unwrap(),
            &a.grad(&g2).unwrap().into_data().to_vec::<f32>().unwrap(),
        );
        close(
            &b.grad(&g1).unwrap().into_data().to_vec::<f32>().unwrap(),
            &b.grad(&g2).unwrap().into_data().to_vec::<f32>().unwrap(),
        );
    }
}

//! Matrix products through OpenBLAS's `cblas_sgemm` on flex tensors, reading strided views
//! (transposes, heads split off a wider row) in place.

use super::cpu::{assume_init, uninit};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::Flex;
use burn::tensor::{DType, TensorData};
use std::mem::MaybeUninit;

/// How BLAS reads a `rows x cols` matrix stored with strides `(sr, sc)`: as stored or as the
/// transpose of a stored matrix, with its leading dimension; `None` if it needs a copy first.
fn blas_view(
    rows: usize,
    cols: usize,
    sr: isize,
    sc: isize,
) -> Option<(cblas_sys::CBLAS_TRANSPOSE, usize)> {
    let (r, c) = (rows.max(1), cols.max(1));
    if sc == 1 && (rows == 1 || sr >= c as isize) {
        Some((
            cblas_sys::CblasNoTrans,
            if rows == 1 { c } else { sr as usize },
        ))
    } else if sr == 1 && (cols == 1 || sc >= r as isize) {
        Some((
            cblas_sys::CblasTrans,
            if cols == 1 { r } else { sc as usize },
        ))
    } else {
        None
    }
}

/// One operand of a (batched) product: its storage, how BLAS reads each matrix, and where
/// each batch's matrix starts.
pub(super) struct Operand {
    t: FlexTensor,
    trans: cblas_sys::CBLAS_TRANSPOSE,
    ld: usize,
    starts: Vec<usize>,
}

impl Operand {
    /// Batch `i`'s matrix.
    pub(super) fn view(&self, i: usize) -> View<'_> {
        View {
            data: &self.t.storage::<f32>()[self.starts[i]..],
            trans: !matches!(self.trans, cblas_sys::CblasNoTrans),
            ld: self.ld,
        }
    }

    pub(super) fn new(t: FlexTensor) -> Self {
        let view = |t: &FlexTensor| {
            let (l, n) = (t.layout(), t.layout().num_dims());
            let s = l.strides();
            if s.iter().any(|&s| s < 0) {
                return None;
            }
            blas_view(l.shape()[n - 2], l.shape()[n - 1], s[n - 2], s[n - 1])
        };
        let t = if view(&t).is_some() {
            t
        } else {
            t.to_contiguous()
        };
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
        Operand {
            t,
            trans,
            ld,
            starts,
        }
    }
}

/// A matrix as BLAS reads it: its storage from its first element on, whether that storage
/// holds its transpose, and the leading dimension.
#[derive(Clone, Copy)]
pub(super) struct View<'a> {
    data: &'a [f32],
    trans: bool,
    ld: usize,
}

impl<'a> View<'a> {
    /// A row-major matrix with rows `ld` apart.
    pub(super) fn rows(data: &'a [f32], ld: usize) -> Self {
        View {
            data,
            trans: false,
            ld,
        }
    }

    /// The matrix from its element `(row, col)` on.
    pub(super) fn at(self, row: usize, col: usize) -> Self {
        let off = if self.trans {
            col * self.ld + row
        } else {
            row * self.ld + col
        };
        View {
            data: &self.data[off..],
            ..self
        }
    }

    /// The transpose.
    pub(super) fn t(self) -> Self {
        View {
            trans: !self.trans,
            ..self
        }
    }

    /// The storage checked to hold a `rows x cols` matrix at this view's leading dimension.
    fn checked(&self, rows: usize, cols: usize) -> *const f32 {
        let (major, minor) = if self.trans {
            (cols, rows)
        } else {
            (rows, cols)
        };
        assert!(
            major == 0
                || minor == 0
                || ((major - 1) * self.ld + minor <= self.data.len() && minor <= self.ld),
            "matrix beyond its storage"
        );
        self.data.as_ptr()
    }
}

/// `out = a · b + beta * out` for an `m x k` view `a` and a `k x n` view `b`, `out` row-major
/// with rows `ldc` apart.
pub(super) fn gemm(
    a: View,
    b: View,
    (m, k, n): (usize, usize, usize),
    beta: f32,
    out: &mut [f32],
    ldc: usize,
) {
    if k == 0 {
        // An empty sum: `beta * out`, and 0 (not 0 times what was there) when beta is 0.
        for r in out.chunks_mut(ldc.max(1)).take(m) {
            r[..n]
                .iter_mut()
                .for_each(|x| *x = if beta == 0.0 { 0.0 } else { beta * *x });
        }
        return;
    }
    // SAFETY: `out` is initialised f32s, and BLAS writes f32s within the checked length.
    unsafe { call(a, b, (m, k, n), beta, (out.as_mut_ptr(), out.len(), ldc)) }
}

/// The one call into the chosen library's `cblas_sgemm` (k > 0): checks that each view holds
/// its matrix and that `out` holds `m` rows of `n` values `ldc` apart. Safety: `out` points to
/// `len` f32 slots that may be written.
unsafe fn call(
    a: View,
    b: View,
    (m, k, n): (usize, usize, usize),
    beta: f32,
    (out, len, ldc): (*mut f32, usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    let (pa, pb) = (a.checked(m, k), b.checked(k, n));
    assert!(
        (m - 1) * ldc + n <= len && n <= ldc,
        "output smaller than m x n"
    );
    let dim = |x: usize| i32::try_from(x).expect("matrix dimension fits BLAS's int");
    let tr = |t: bool| {
        if t {
            cblas_sys::CblasTrans
        } else {
            cblas_sys::CblasNoTrans
        }
    };
    // SAFETY: `checked` checked that each view holds its matrix at its leading dimension, and
    // the caller that `out` holds `len` writable slots, of which m rows of n at ldc are used.
    unsafe {
        crate::machine::blas_lib::sgemm()(
            cblas_sys::CblasRowMajor,
            tr(a.trans),
            tr(b.trans),
            dim(m),
            dim(n),
            dim(k),
            1.0,
            pa,
            dim(a.ld),
            pb,
            dim(b.ld),
            beta,
            out,
            dim(ldc),
        );
    }
}

/// `out = a · b + beta * out` for rows `row..row + m` of batch `ia`'s `k`-wide matrix `a` and
/// batch `ib`'s `k x n` matrix `b` (`out` row-major `m x n`; with k = 0 it is left as it is).
fn sgemm(
    (a, ia, row): (&Operand, usize, usize),
    (b, ib): (&Operand, usize),
    (m, k, n): (usize, usize, usize),
    beta: f32,
    out: &mut [MaybeUninit<f32>],
) {
    if k == 0 {
        return;
    }
    // SAFETY: BLAS writes f32s through the pointer, within the checked length.
    unsafe {
        call(
            a.view(ia).at(row, 0),
            b.view(ib),
            (m, k, n),
            beta,
            (out.as_mut_ptr().cast::<f32>(), out.len(), n),
        )
    }
}

/// Products at most this big (m x k x n) are small: a batch of them runs several at once.
const SMALL: usize = 1 << 22;

/// Products at least this big (m x k x n) are split with idle peers' cores
/// ([`crate::machine::lend`]): a part then takes 80 us or more, beside a helper's wake-up of tens. The
/// README's model (products of 4M multiply-adds) ran no faster lending at 2M (3 alternating
/// runs of 60 steps: 45,082-48,645 tokens/s lending, 44,813-50,875 not).
const LENT_SIZE: usize = 1 << 23;
/// Products at least this big (m x k x n) are split over rayon's threads where pipewright
/// took over the library's threading ([`crate::machine::blas_lib::split_products`]): a part then takes
/// 10 us or more, beside rayon's dispatch of a few.
const SPLIT_SIZE: usize = 1 << 20;
/// Each part of a split product has at least this many rows.
const LENT_ROWS: usize = 16;

/// An output shared by the parts of a product, each writing its own rows.
struct Rows(*mut MaybeUninit<f32>, usize);
// SAFETY: the parts write disjoint rows, and the lender waits for all of them.
unsafe impl Sync for Rows {}

impl Rows {
    /// `len` values from `start` on. Safety: no other part writes them meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn rows(&self, start: usize, len: usize) -> &mut [MaybeUninit<f32>] {
        assert!(start + len <= self.1, "rows beyond the output");
        // SAFETY: within the output (checked), and the caller's parts are disjoint.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// All the products of a batch into `out` (`m x n` each). A batch of small ones (attention's,
/// one per sequence and head) runs over rayon's threads with the library single-threaded
/// ([`crate::machine::blas_lib::single_threaded`]): 4-8% more tokens/s on 1 stage of gpt_bench
/// (steps alternating between the two ways in one run). Larger ones run one after the other:
/// split by rows over rayon's threads where pipewright took over the library's threading
/// ([`crate::machine::blas_lib::split_products`]; splitting by columns where the output is wider than
/// tall was no faster), over idle MPI peers' cores where lent ([`crate::machine::lend`]), else on the
/// library's own threads.
fn gemm_batches(
    a: &Operand,
    b: &Operand,
    (m, k, n): (usize, usize, usize),
    beta: f32,
    out: &mut [MaybeUninit<f32>],
) {
    if m * n == 0 {
        return;
    }
    let batches = out.len() / (m * n);
    if batches >= 2 && m * k * n <= SMALL && rayon::current_num_threads() > 1 {
        if let Some(_single) = crate::machine::blas_lib::single_threaded() {
            use rayon::prelude::*;
            out.par_chunks_mut(m * n)
                .enumerate()
                .for_each(|(i, o)| sgemm((a, i, 0), (b, i), (m, k, n), beta, o));
            return;
        }
    }
    let out = Rows(out.as_mut_ptr(), out.len());
    // Rows r0..r1 of every product: each part writes its own rows.
    let part = |r0: usize, r1: usize| {
        for i in 0..batches {
            // SAFETY: rows r0..r1 of product i, disjoint from every other part's.
            let o = unsafe { out.rows(i * m * n + r0 * n, (r1 - r0) * n) };
            sgemm((a, i, r0), (b, i), (r1 - r0, k, n), beta, o);
        }
    };
    let parts = crate::machine::blas_lib::split_threads();
    if parts > 1 && m * k * n >= SPLIT_SIZE && m >= parts * LENT_ROWS {
        use rayon::prelude::*;
        (0..parts)
            .into_par_iter()
            .for_each(|p| part(m * p / parts, m * (p + 1) / parts));
        return;
    }
    if m * k * n >= LENT_SIZE && crate::machine::lend::split_rows(&part, m, LENT_ROWS) {
        return;
    }
    part(0, m);
}

/// `a [.., m, k] · b [.., k, n]` (see [`super::Kernels::matmul`]).
pub fn matmul(a: FlexTensor, b: FlexTensor) -> FlexTensor {
    let (sa, sb) = (a.layout().shape().to_vec(), b.layout().shape().to_vec());
    let n = sa.len();
    if a.dtype() != DType::F32
        || b.dtype() != DType::F32
        || n < 2
        || sb.len() != n
        || sa[..n - 2] != sb[..n - 2]
    {
        // Broadcast batches and other dtypes: burn's own product.
        return Flex::float_matmul(a, b);
    }
    let (m, k, k2, cols) = (sa[n - 2], sa[n - 1], sb[n - 2], sb[n - 1]);
    assert_eq!(k, k2, "matmul: inner dimensions {k} and {k2} differ");
    let batches: usize = sa[..n - 2].iter().product();
    let len = batches * m * cols;
    if k == 0 {
        return FlexTensor::from_data(TensorData::new(vec![0f32; len], shape_of(&sa, m, cols)));
    }
    // No zero fill: with beta = 0 every product writes its whole output.
    let mut out = uninit(len);
    gemm_batches(
        &Operand::new(a),
        &Operand::new(b),
        (m, k, cols),
        0.0,
        &mut out,
    );
    // SAFETY: k > 0 and beta = 0, so each of the `batches` products wrote all of its m x cols
    // block of `out` (and with m * cols = 0 there is nothing to write).
    let out = unsafe { assume_init(out) };
    FlexTensor::from_data(TensorData::new(out, shape_of(&sa, m, cols)))
}

/// The shape of a product's output: `a`'s batch dimensions, then `m x n`.
fn shape_of(a: &[usize], m: usize, n: usize) -> Vec<usize> {
    let mut shape = a[..a.len() - 2].to_vec();
    shape.extend([m, n]);
    shape
}

/// `x [r, i] · w [i, o] + b [o]` (see [`super::Kernels::linear`]).
pub fn linear(x: FlexTensor, w: FlexTensor, b: FlexTensor) -> FlexTensor {
    let (r, o) = (x.layout().shape()[0], w.layout().shape()[1]);
    let bias = super::values(&b);
    assert_eq!(
        bias.len(),
        o,
        "linear: {o} outputs, {} bias values",
        bias.len()
    );
    let mut out: Vec<f32> = Vec::with_capacity(r * o);
    for _ in 0..r {
        out.extend_from_slice(&bias);
    }
    let (k, k2) = (x.layout().shape()[1], w.layout().shape()[0]);
    assert_eq!(k, k2, "linear: input width {k}, weight rows {k2}");
    // f32 to MaybeUninit<f32> only forgets that the bias values are initialised.
    let init: &mut [MaybeUninit<f32>] =
        // SAFETY: same layout, and every value stays initialised (sgemm writes f32s).
        unsafe { &mut *(out.as_mut_slice() as *mut [f32] as *mut [MaybeUninit<f32>]) };
    gemm_batches(&Operand::new(x), &Operand::new(w), (r, k, o), 1.0, init);
    FlexTensor::from_data(TensorData::new(out, [r, o]))
}

/// FLOP/s of this process's matrix products at their best: a 1024 x 1024 x 1024 product
/// through the BLAS in use, on its threads, the fastest of 3 (after one warm-up). Measured once
/// (about 0.1 s); the ceiling that model FLOPs utilisation (MFU) is reported against.
pub fn measured_peak_flops() -> f64 {
    static PEAK: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *PEAK.get_or_init(|| {
        const N: usize = 1024;
        let a: Vec<f32> = (0..N * N).map(|i| (i % 17) as f32 * 0.01).collect();
        let mut out = vec![0f32; N * N];
        let mut best = f64::INFINITY;
        for round in 0..4 {
            let t = std::time::Instant::now();
            gemm(
                View::rows(&a, N),
                View::rows(&a, N),
                (N, N, N),
                0.0,
                &mut out,
                N,
            );
            if round > 0 {
                best = best.min(t.elapsed().as_secs_f64());
            }
        }
        2.0 * (N * N * N) as f64 / best.max(1e-9)
    })
}

#[cfg(test)]
mod tests {
    /// A product split with an idle peer's cores equals the product run whole.
    #[test]
    fn a_product_lent_to_an_idle_peer_equals_the_whole() {
        let me = "kernels::blas::tests::a_product_lent_to_an_idle_peer_equals_the_whole";
        if let Some(passed) = crate::machine::blas_lib::rerun_on_chosen_kernels(me) {
            assert!(
                passed,
                "on the kernels pipewright chooses for this CPU (the run above)"
            );
            return;
        }
        let (_turn, peer) = crate::machine::lend::testing::peer();
        let dev = crate::backend::plain_device();
        let random = |shape: [usize; 2]| {
            burn::tensor::Tensor::<2>::random(shape, burn::tensor::Distribution::Default, &dev)
        };
        let (a, b) = (random([400, 200]), random([200, 200]));
        peer.set_idle(true);
        let split = crate::kernels::matmul(a.clone(), b.clone()).into_data();
        peer.set_idle(false);
        let whole = crate::kernels::matmul(a, b).into_data();
        assert_eq!(split, whole);
    }
}

//! The element-wise and row-wise loops of the kernels, over plain f32 slices. Each loop is
//! compiled for the common SIMD levels (AVX-512, AVX2 + FMA, ...) and picked at run time
//! (`multiversion`), and split across rayon's threads. Sums run in a fixed order, so results
//! do not depend on the thread count.

use multiversion::multiversion;
use rayon::prelude::*;
use std::mem::{ManuallyDrop, MaybeUninit};

/// Element-wise work goes to rayon's threads in chunks of this many values.
pub(super) const CHUNK: usize = 1 << 14;

/// `n` values to be written, without a zero fill first: outputs that a kernel writes whole
/// (these loops, and the products in blas.rs) skip the `memset` (3% of an MPI rank's time,
/// with the allocator reusing freed memory).
pub(super) fn uninit(n: usize) -> Vec<MaybeUninit<f32>> {
    let mut v = Vec::with_capacity(n);
    // SAFETY: MaybeUninit needs no initialisation.
    unsafe { v.set_len(n) };
    v
}

/// The values once written. Safety: every element of `v` has been written.
pub(super) unsafe fn assume_init(v: Vec<MaybeUninit<f32>>) -> Vec<f32> {
    let mut v = ManuallyDrop::new(v);
    // SAFETY: same layout, allocation and length; the caller vouches for the contents.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<f32>(), v.len(), v.capacity()) }
}

/// A written slice read back. Safety: every element of `v` has been written.
#[inline(always)]
unsafe fn written(v: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    // SAFETY: same layout; the caller vouches for the contents.
    unsafe { &mut *(v as *mut [MaybeUninit<f32>] as *mut [f32]) }
}

/// `e^x` in plain arithmetic that vectorises: Cody-Waite reduction to `2^n e^r`, |r| <= ln2/2,
/// then a degree-6 Taylor polynomial (relative error about 2e-7 over the f32 range).
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // Round to nearest by adding 1.5 * 2^23: `t`'s low mantissa bits then hold n itself, so
    // 2^n is a shift of them (no float-to-int conversion, which LLVM does not vectorise).
    let t = x * std::f32::consts::LOG2_E + 12_582_912.0;
    let n = t - 12_582_912.0;
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // bits(t) = 0x4B40_0000 + n, so (n + 127) << 23 is 2^n's bit pattern.
    p * f32::from_bits(t.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23)
}

/// GELU and its derivative at `x`. `erf` is Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7),
/// whose `e^{-z^2}` with `z = x / sqrt 2` is the Gaussian density's `e^{-x^2/2}` as well.
#[inline(always)]
fn gelu_and_slope(x: f32) -> (f32, f32) {
    let z = (x * std::f32::consts::FRAC_1_SQRT_2).abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152 + t * 1.061_405_4))));
    let g = exp(-z * z);
    let erf_abs = 1.0 - poly * g;
    let erf = if x < 0.0 { -erf_abs } else { erf_abs };
    let cdf = 0.5 * (1.0 + erf);
    // d/dx x Phi(x) = Phi(x) + x phi(x), phi(x) = e^{-x^2/2} / sqrt(2 pi).
    (x * cdf, cdf + x * g * 0.398_942_3)
}

/// A sum in 16 interleaved lanes (so it vectorises), combined in a fixed order.
#[inline(always)]
fn sum(v: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = v.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The largest value, in 16 lanes the same way (`f32::max` ignores NaN, as a fold would).
#[inline(always)]
fn max(v: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let chunks = v.chunks_exact(16);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    acc.iter().fold(tail, |m, &x| m.max(x))
}

/// `sum(a * b)` the same way.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (ca, cb) in ca.zip(cb) {
        for ((s, a), b) in acc.iter_mut().zip(ca).zip(cb) {
            *s += a * b;
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[multiversion(targets = "simd")]
fn gelu_chunk(x: &[f32], y: &mut [MaybeUninit<f32>]) {
    for (y, &x) in y.iter_mut().zip(x) {
        y.write(gelu_and_slope(x).0);
    }
}

#[multiversion(targets = "simd")]
fn gelu_slope_chunk(x: &[f32], y: &mut [MaybeUninit<f32>], d: &mut [MaybeUninit<f32>]) {
    for ((y, d), &x) in y.iter_mut().zip(d.iter_mut()).zip(x) {
        let (v, s) = gelu_and_slope(x);
        y.write(v);
        d.write(s);
    }
}

/// GELU of `x`; with `slope`, also its derivative at each value (what the backward multiplies
/// the output gradient by, so the backward is one pass).
pub fn gelu(x: &[f32], slope: bool) -> (Vec<f32>, Option<Vec<f32>>) {
    let mut y = uninit(x.len());
    if !slope {
        y.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(y, x)| gelu_chunk(x, y));
        // SAFETY: the chunks cover y, and gelu_chunk writes each of its values.
        return (unsafe { assume_init(y) }, None);
    }
    let mut d = uninit(x.len());
    y.par_chunks_mut(CHUNK)
        .zip(d.par_chunks_mut(CHUNK))
        .zip(x.par_chunks(CHUNK))
        .for_each(|((y, d), x)| gelu_slope_chunk(x, y, d));
    // SAFETY: as above, for y and d.
    unsafe { (assume_init(y), Some(assume_init(d))) }
}

#[multiversion(targets = "simd")]
fn mul_chunk(a: &[f32], b: &[f32], out: &mut [MaybeUninit<f32>]) {
    for ((o, a), b) in out.iter_mut().zip(a).zip(b) {
        o.write(a * b);
    }
}

/// Element-wise product.
pub fn mul(a: &[f32], b: &[f32]) -> Vec<f32> {
    assert_eq!(a.len(), b.len(), "mul: lengths differ");
    let mut out = uninit(a.len());
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(o, (a, b))| mul_chunk(a, b, o));
    // SAFETY: the chunks cover out (a and b have its length), and mul_chunk writes each value.
    unsafe { assume_init(out) }
}

#[multiversion(targets = "simd")]
pub(super) fn softmax_row(x: &[f32], y: &mut [f32], scale: f32) {
    let m = max(x) * scale;
    for (y, &x) in y.iter_mut().zip(x) {
        *y = exp(x * scale - m);
    }
    let inv = 1.0 / sum(y);
    y.iter_mut().for_each(|y| *y *= inv);
}

/// Softmax of `scale * x` over rows of `t` values where row `r` keeps its first `r % t + 1`
/// (the keys up to its query) and the rest are 0: causal attention weights.
pub fn causal_softmax(x: &[f32], t: usize, scale: f32) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    if t > 0 {
        y.par_chunks_mut(t)
            .zip(x.par_chunks(t))
            .enumerate()
            .for_each(|(r, (y, x))| {
                let keys = r % t + 1;
                softmax_row(&x[..keys], &mut y[..keys], scale);
            });
    }
    y
}

#[multiversion(targets = "simd")]
pub(super) fn softmax_backward_row(y: &[f32], g: &[f32], dx: &mut [f32], scale: f32) {
    let d = dot(y, g);
    for ((dx, y), g) in dx.iter_mut().zip(y).zip(g) {
        *dx = scale * y * (g - d);
    }
}

/// `dx = scale * y * (dy - sum(dy * y))` row by row (masked entries have y = 0, so dx = 0).
pub fn causal_softmax_backward(y: &[f32], dy: &[f32], t: usize, scale: f32) -> Vec<f32> {
    let mut dx = vec![0f32; y.len()];
    if t > 0 {
        dx.par_chunks_mut(t)
            .zip(y.par_chunks(t).zip(dy.par_chunks(t)))
            .enumerate()
            .for_each(|(r, (dx, (y, g)))| {
                let keys = r % t + 1;
                softmax_backward_row(&y[..keys], &g[..keys], &mut dx[..keys], scale);
            });
    }
    dx
}

#[multiversion(targets = "simd")]
fn layer_norm_row(
    x: &[f32],
    (g, b): (&[f32], &[f32]),
    y: &mut [MaybeUninit<f32>],
    xh: &mut [MaybeUninit<f32>],
    eps: f32,
) -> f32 {
    let n = x.len() as f32;
    let mean = sum(x) / n;
    for (xh, x) in xh.iter_mut().zip(x) {
        xh.write(x - mean);
    }
    // SAFETY: just written, all of it (xh and x have the same length).
    let xh = unsafe { written(xh) };
    let rstd = 1.0 / (dot(xh, xh) / n + eps).sqrt();
    for ((y, xh), (g, b)) in y.iter_mut().zip(xh.iter_mut()).zip(g.iter().zip(b)) {
        *xh *= rstd;
        y.write(*xh * g + b);
    }
    rstd
}

/// Layer norm over rows of `gamma.len()` values, then `* gamma + beta`; also returns the
/// normalised input and each row's 1/std (the backward's state).
pub fn layer_norm(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let d = gamma.len();
    assert_eq!(beta.len(), d, "layer_norm: gamma and beta lengths differ");
    let rows = x.len().checked_div(d).unwrap_or(0);
    if d == 0 {
        return (Vec::new(), Vec::new(), Vec::new());
    }
    assert!(
        x.len().is_multiple_of(d),
        "layer_norm: {} values are not rows of {d}",
        x.len()
    );
    let (mut y, mut xh, mut rstd) = (uninit(x.len()), uninit(x.len()), uninit(rows));
    y.par_chunks_mut(d)
        .zip(xh.par_chunks_mut(d))
        .zip(rstd.par_iter_mut())
        .zip(x.par_chunks(d))
        .for_each(|(((y, xh), rs), x)| {
            rs.write(layer_norm_row(x, (gamma, beta), y, xh, eps));
        });
    // SAFETY: whole rows cover y and xh, one rstd each, and layer_norm_row writes all of a row.
    unsafe { (assume_init(y), assume_init(xh), assume_init(rstd)) }
}

#[multiversion(targets = "simd")]
fn layer_norm_backward_row(
    xh: &[f32],
    dy: &[f32],
    g: &[f32],
    rstd: f32,
    dx: &mut [MaybeUninit<f32>],
) {
    let n = xh.len() as f32;
    // dxh = dy * gamma, kept in dx until the end.
    for ((dx, dy), g) in dx.iter_mut().zip(dy).zip(g) {
        dx.write(dy * g);
    }
    // SAFETY: just written, all of it (a row: dx, dy and gamma have the same length).
    let dx = unsafe { written(dx) };
    let (m1, m2) = (sum(dx) / n, dot(dx, xh) / n);
    for (dx, xh) in dx.iter_mut().zip(xh) {
        *dx = rstd * (*dx - m1 - xh * m2);
    }
}

#[multiversion(targets = "simd")]
fn add_rows(dg: &mut [f32], db: &mut [f32], xh: &[f32], dy: &[f32]) {
    for (((dg, db), xh), dy) in dg.iter_mut().zip(db.iter_mut()).zip(xh).zip(dy) {
        *dg += dy * xh;
        *db += dy;
    }
}

/// Layer norm backward: `dx = rstd * (dxh - mean(dxh) - xh * mean(dxh * xh))` with
/// `dxh = dy * gamma`; `dgamma` = column sums of `dy * xh`, `dbeta` = column sums of `dy`.
pub fn layer_norm_backward(
    xh: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let d = gamma.len();
    if d == 0 {
        return (Vec::new(), Vec::new(), Vec::new());
    }
    let rows = rstd.len();
    assert!(
        xh.len() == rows * d && dy.len() == rows * d,
        "layer_norm_backward: {} and {} values are not {rows} rows of {d}",
        xh.len(),
        dy.len()
    );
    let mut dx = uninit(xh.len());
    dx.par_chunks_mut(d)
        .zip(xh.par_chunks(d).zip(dy.par_chunks(d)))
        .zip(rstd.par_iter())
        .for_each(|((dx, (xh, dy)), &rs)| layer_norm_backward_row(xh, dy, gamma, rs, dx));
    // Row order, one thread: deterministic.
    let (mut dg, mut db) = (vec![0f32; d], vec![0f32; d]);
    for (xh, dy) in xh.chunks(d).zip(dy.chunks(d)) {
        add_rows(&mut dg, &mut db, xh, dy);
    }
    // SAFETY: the rows cover dx (checked above), and layer_norm_backward_row writes all of each.
    (unsafe { assume_init(dx) }, dg, db)
}

#[multiversion(targets = "simd")]
fn add_to(acc: &mut [f32], row: &[f32]) {
    for (a, v) in acc.iter_mut().zip(row) {
        *a += v;
    }
}

/// Sums over rows of `cols` values (a bias gradient), in row order.
pub fn column_sums(v: &[f32], cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; cols];
    if cols > 0 {
        for row in v.chunks(cols) {
            add_to(&mut out, row);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_matches_std_over_the_f32_range() {
        // Every 1/64 from -87 to 88: relative error against libm's expf.
        for i in 0..=(175 * 64) {
            let x = -87.0 + i as f32 / 64.0;
            let (ours, std) = (super::exp(x), x.exp());
            assert!(
                ((ours - std) / std).abs() < 5e-7,
                "exp({x}) = {ours}, libm {std}"
            );
        }
        // Beyond the clamp: no infinities or zeros, no NaN.
        assert!(super::exp(-1e4) > 0.0 && super::exp(1e4).is_finite());
    }

    #[test]
    fn max_takes_every_lane_and_the_tail() {
        for n in [1, 15, 16, 17, 33, 128] {
            for at in 0..n {
                let mut v = vec![-1.0f32; n];
                v[at] = 3.0;
                assert_eq!(super::max(&v), 3.0, "n {n}, largest at {at}");
            }
        }
        assert_eq!(super::max(&[]), f32::NEG_INFINITY);
    }
}

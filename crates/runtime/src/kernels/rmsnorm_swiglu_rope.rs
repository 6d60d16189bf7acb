//! RMSNorm, SwiGLU and rotary position embedding (LLaMA's ops) as element-wise and row-wise
//! loops over plain f32 slices, forward and backward. As in `cpu.rs`: compiled per SIMD level,
//! split over rayon's threads, sums in a fixed order.

use super::cpu::{assume_init, exp, uninit, CHUNK};
use multiversion::multiversion;
use rayon::prelude::*;
use std::mem::MaybeUninit;

#[multiversion(targets = "simd")]
fn rms_row(
    x: &[f32],
    w: &[f32],
    eps: f32,
    y: &mut [MaybeUninit<f32>],
    xh: &mut [MaybeUninit<f32>],
) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let rstd = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for (((y, xh), x), w) in y.iter_mut().zip(xh.iter_mut()).zip(x).zip(w) {
        let h = x * rstd;
        xh.write(h);
        y.write(h * w);
    }
    rstd
}

/// RMSNorm over rows of `w.len()` values: `y = x / sqrt(mean(x^2) + eps) * w`; also the
/// normalised rows and each row's 1/rms (the backward's state).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let d = w.len();
    assert!(
        d > 0 && x.len().is_multiple_of(d),
        "rms_norm: {} values are not rows of {d}",
        x.len()
    );
    let rows = x.len() / d;
    let (mut y, mut xh, mut rstd) = (uninit(x.len()), uninit(x.len()), uninit(rows));
    y.par_chunks_mut(d)
        .zip(xh.par_chunks_mut(d))
        .zip(rstd.par_iter_mut())
        .zip(x.par_chunks(d))
        .for_each(|(((y, xh), r), x)| {
            r.write(rms_row(x, w, eps, y, xh));
        });
    // SAFETY: whole rows cover y and xh, one rstd each; rms_row writes all of a row.
    unsafe { (assume_init(y), assume_init(xh), assume_init(rstd)) }
}

#[multiversion(targets = "simd")]
fn rms_backward_row(xh: &[f32], dy: &[f32], w: &[f32], rstd: f32, dx: &mut [MaybeUninit<f32>]) {
    let n = xh.len() as f32;
    let m: f32 = dy
        .iter()
        .zip(w)
        .zip(xh)
        .map(|((d, w), h)| d * w * h)
        .sum::<f32>()
        / n;
    for (((dx, dy), w), h) in dx.iter_mut().zip(dy).zip(w).zip(xh) {
        dx.write(rstd * (dy * w - h * m));
    }
}

#[multiversion(targets = "simd")]
fn add_products(acc: &mut [f32], a: &[f32], b: &[f32]) {
    for ((s, a), b) in acc.iter_mut().zip(a).zip(b) {
        *s += a * b;
    }
}

/// RMSNorm backward: `dx = rstd (dy w - xh mean(dy w xh))`, `dw` = column sums of `dy xh`.
pub fn rms_norm_backward(xh: &[f32], rstd: &[f32], w: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let d = w.len();
    assert!(
        xh.len() == rstd.len() * d && dy.len() == xh.len(),
        "rms_norm_backward: shapes"
    );
    let mut dx = uninit(xh.len());
    dx.par_chunks_mut(d)
        .zip(xh.par_chunks(d).zip(dy.par_chunks(d)))
        .zip(rstd.par_iter())
        .for_each(|((dx, (xh, dy)), &r)| rms_backward_row(xh, dy, w, r, dx));
    let mut dw = vec![0f32; d];
    for (xh, dy) in xh.chunks(d).zip(dy.chunks(d)) {
        add_products(&mut dw, xh, dy); // row order, one thread: deterministic
    }
    // SAFETY: the rows cover dx and rms_backward_row writes all of each.
    (unsafe { assume_init(dx) }, dw)
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

#[multiversion(targets = "simd")]
fn swiglu_chunk(g: &[f32], u: &[f32], y: &mut [MaybeUninit<f32>]) {
    for ((y, g), u) in y.iter_mut().zip(g).zip(u) {
        y.write(g * sigmoid(*g) * u);
    }
}

/// SwiGLU's gate: `silu(g) * u`.
pub fn swiglu(g: &[f32], u: &[f32]) -> Vec<f32> {
    assert_eq!(g.len(), u.len(), "swiglu: gate and up differ in length");
    let mut y = uninit(g.len());
    y.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
        .for_each(|(y, (g, u))| swiglu_chunk(g, u, y));
    // SAFETY: the chunks cover y and swiglu_chunk writes each value.
    unsafe { assume_init(y) }
}

#[multiversion(targets = "simd")]
fn swiglu_backward_chunk(
    g: &[f32],
    u: &[f32],
    dy: &[f32],
    dg: &mut [MaybeUninit<f32>],
    du: &mut [MaybeUninit<f32>],
) {
    for ((((dg, du), g), u), dy) in dg.iter_mut().zip(du.iter_mut()).zip(g).zip(u).zip(dy) {
        let s = sigmoid(*g);
        du.write(dy * g * s);
        dg.write(dy * u * s * (1.0 + g * (1.0 - s)));
    }
}

/// SwiGLU backward: `(dg, du)` from the inputs and the output gradient.
pub fn swiglu_backward(g: &[f32], u: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (mut dg, mut du) = (uninit(g.len()), uninit(g.len()));
    dg.par_chunks_mut(CHUNK)
        .zip(du.par_chunks_mut(CHUNK))
        .zip(
            g.par_chunks(CHUNK)
                .zip(u.par_chunks(CHUNK))
                .zip(dy.par_chunks(CHUNK)),
        )
        .for_each(|((dg, du), ((g, u), dy))| swiglu_backward_chunk(g, u, dy, dg, du));
    // SAFETY: the chunks cover dg and du and each value is written.
    unsafe { (assume_init(dg), assume_init(du)) }
}

#[multiversion(targets = "simd")]
fn rope_row(x: &[f32], cos: &[f32], sin: &[f32], sign: f32, y: &mut [MaybeUninit<f32>]) {
    let half = cos.len();
    let (x1, x2) = x.split_at(half);
    let (y1, y2) = y.split_at_mut(half);
    for i in 0..half {
        let (c, s) = (cos[i], sign * sin[i]);
        y1[i].write(c * x1[i] - s * x2[i]);
        y2[i].write(c * x2[i] + s * x1[i]);
    }
}

/// Rotary position embedding of rows of `2 cos.len() / t` values, row `r` at position
/// `r % t` (the rows of `[.., t, dh]`): each pair (i, i + dh/2) rotated by its angle; with
/// `inverse`, rotated back (the backward of a rotation is its inverse).
pub fn rope(x: &[f32], t: usize, cos: &[f32], sin: &[f32], inverse: bool) -> Vec<f32> {
    let half = cos.len() / t.max(1);
    let dh = 2 * half;
    assert!(
        dh > 0 && x.len().is_multiple_of(dh * t) && sin.len() == cos.len(),
        "rope: shapes"
    );
    let sign = if inverse { -1.0 } else { 1.0 };
    let mut y = uninit(x.len());
    y.par_chunks_mut(dh)
        .zip(x.par_chunks(dh))
        .enumerate()
        .for_each(|(r, (y, x))| {
            let p = r % t;
            rope_row(
                x,
                &cos[p * half..(p + 1) * half],
                &sin[p * half..(p + 1) * half],
                sign,
                y,
            )
        });
    // SAFETY: the rows cover y and rope_row writes all of each.
    unsafe { assume_init(y) }
}

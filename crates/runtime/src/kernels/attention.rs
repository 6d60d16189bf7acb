//! Causal attention as one op: for each sequence and head, the scores of the keys each query
//! may see, their causal softmax and the weighted sum of values; the backward likewise. The
//! queries go in tiles of [`TILE`] rows, and a tile's products stop at its last query's key,
//! so the block above the diagonal is never computed (at t = 128, 3 of 4 tiles: a quarter of
//! the products' work saved, more at longer t). Each head's `t x t` weights stay in cache from
//! one step to the next, and the heads run over rayon's threads with the library
//! single-threaded (see [`crate::machine::blas_lib::single_threaded`]).

use super::blas::{gemm, Operand, View};
use super::cpu::{softmax_backward_row, softmax_row};
use burn::backend::flex::FlexTensor;
use burn::tensor::TensorData;
use rayon::prelude::*;

/// Query rows per tile.
const TILE: usize = 64;

/// `(t, dh, heads, group)` of `[.., t, dh]` queries and of keys and values that are shaped
/// alike, or that have fewer heads (`[.., heads / group, t, dh]`, grouped-query attention):
/// query matrix `i` then reads key and value matrix `i / group`.
fn dims(q: &FlexTensor, k: &FlexTensor, v: &FlexTensor) -> (usize, usize, usize, usize) {
    let shape = q.layout().shape().to_vec();
    let n = shape.len();
    assert!(n >= 2, "attention: q must be [.., t, dh], got {shape:?}");
    let kv = k.layout().shape().to_vec();
    assert_eq!(
        v.layout().shape().to_vec(),
        kv,
        "attention: v has another shape than k"
    );
    let grouped = n >= 3
        && kv.len() == n
        && kv[..n - 3] == shape[..n - 3]
        && kv[n - 2..] == shape[n - 2..]
        && kv[n - 3] > 0
        && shape[n - 3] > 0
        && shape[n - 3].is_multiple_of(kv[n - 3]);
    assert!(
        kv == shape || grouped,
        "attention: k and v {kv:?} must be shaped as q {shape:?}, or have a head count that divides q's"
    );
    let group = if grouped { shape[n - 3] / kv[n - 3] } else { 1 };
    let (t, dh) = (shape[n - 2], shape[n - 1]);
    (t, dh, shape[..n - 2].iter().product(), group)
}

/// Some (holding the library single-threaded) when the heads should run over rayon's threads:
/// several heads and threads, and a library that can be made single-threaded.
fn parallel(heads: usize) -> Option<crate::machine::blas_lib::SingleThreaded> {
    (heads >= 2 && rayon::current_num_threads() > 1)
        .then(crate::machine::blas_lib::single_threaded)
        .flatten()
}

/// The query tiles: (first row, rows).
fn tiles(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t).step_by(TILE).map(move |r0| (r0, TILE.min(t - r0)))
}

/// Forward: the output `[.., t, dh]` and the attention weights `[.., t, t]` (0 above the
/// diagonal), which the backward reads.
pub fn forward(
    q: FlexTensor,
    k: FlexTensor,
    v: FlexTensor,
    scale: f32,
) -> (FlexTensor, FlexTensor) {
    let (t, dh, heads, group) = dims(&q, &k, &v);
    let shape = q.layout().shape().to_vec();
    let mut wshape = shape.clone();
    wshape[shape.len() - 1] = t;
    let mut out = vec![0f32; heads * t * dh];
    let mut weights = vec![0f32; heads * t * t];
    let tensor = |v, s| FlexTensor::from_data(TensorData::new(v, s));
    if out.is_empty() {
        // Nothing to attend with (weights unread: the gradients are empty too).
        return (tensor(out, shape), tensor(weights, wshape));
    }
    let (q, k, v) = (Operand::new(q), Operand::new(k), Operand::new(v));
    let head = |(i, (o, p)): (usize, (&mut [f32], &mut [f32]))| {
        let (q, k, v) = (q.view(i), k.view(i / group), v.view(i / group));
        let mut row = vec![0f32; t];
        for (r0, rows) in tiles(t) {
            let keys = r0 + rows;
            // Scores of this tile's queries against the keys up to its last query's.
            gemm(
                q.at(r0, 0),
                k.t(),
                (rows, dh, keys),
                0.0,
                &mut p[r0 * t..],
                t,
            );
            for r in r0..keys {
                let s = &mut p[r * t..r * t + keys];
                row[..=r].copy_from_slice(&s[..=r]);
                softmax_row(&row[..=r], &mut s[..=r], scale);
                // The tile's scores above the diagonal: masked.
                s[r + 1..].fill(0.0);
            }
            gemm(
                View::rows(&p[r0 * t..], t),
                v,
                (rows, keys, dh),
                0.0,
                &mut o[r0 * dh..],
                dh,
            );
        }
    };
    match parallel(heads) {
        Some(_single) => out
            .par_chunks_mut(t * dh)
            .zip(weights.par_chunks_mut(t * t))
            .enumerate()
            .for_each(head),
        None => out
            .chunks_mut(t * dh)
            .zip(weights.chunks_mut(t * t))
            .enumerate()
            .for_each(head),
    }
    (tensor(out, shape), tensor(weights, wshape))
}

/// One head's gradients of q, and of k and v, being written.
type Grads<'a> = (&'a mut [f32], (&'a mut [f32], &'a mut [f32]));

/// Backward: the gradients of q, k and v (each `[.., t, dh]`) from the output's `dy`, the
/// inputs and the forward's weights.
pub fn backward(
    q: FlexTensor,
    k: FlexTensor,
    v: FlexTensor,
    weights: &FlexTensor,
    dy: FlexTensor,
    scale: f32,
) -> [FlexTensor; 3] {
    let (t, dh, heads, group) = dims(&q, &k, &v);
    let shape = q.layout().shape().to_vec();
    let kv_shape = k.layout().shape().to_vec();
    let zeros = || vec![0f32; heads * t * dh];
    if heads * t * dh == 0 {
        let empty =
            |s: &Vec<usize>| FlexTensor::from_data(TensorData::new(Vec::<f32>::new(), s.clone()));
        return [empty(&shape), empty(&kv_shape), empty(&kv_shape)];
    }
    let (q, k, v, dy) = (
        Operand::new(q),
        Operand::new(k),
        Operand::new(v),
        Operand::new(dy),
    );
    let weights = super::values(weights);
    let [mut dq, mut dk, mut dv] = [(); 3].map(|_| zeros());
    let head = |(i, (dq, (dk, dv))): (usize, Grads)| {
        let (q, k, v, dy) = (q.view(i), k.view(i / group), v.view(i / group), dy.view(i));
        let p = &weights[i * t * t..(i + 1) * t * t];
        let (mut dp, mut ds) = (vec![0f32; t * t], vec![0f32; t * t]);
        for (r0, rows) in tiles(t) {
            let keys = r0 + rows;
            // dP = dY V^T on the tile's keys, then the softmax's backward into dS (the
            // gradient of the unscaled scores; 0 above the diagonal).
            gemm(
                dy.at(r0, 0),
                v.t(),
                (rows, dh, keys),
                0.0,
                &mut dp[r0 * t..],
                t,
            );
            for r in r0..keys {
                let at = r * t;
                softmax_backward_row(
                    &p[at..=at + r],
                    &dp[at..=at + r],
                    &mut ds[at..=at + r],
                    scale,
                );
            }
            // dQ = dS K.
            gemm(
                View::rows(&ds[r0 * t..], t),
                k,
                (rows, keys, dh),
                0.0,
                &mut dq[r0 * dh..],
                dh,
            );
        }
        for (c0, cols) in tiles(t) {
            // Key rows c0.. are seen by queries c0.. only: dK = dS^T Q, dV = P^T dY there.
            let below = t - c0;
            gemm(
                View::rows(&ds, t).at(c0, c0).t(),
                q.at(c0, 0),
                (cols, below, dh),
                0.0,
                &mut dk[c0 * dh..],
                dh,
            );
            gemm(
                View::rows(p, t).at(c0, c0).t(),
                dy.at(c0, 0),
                (cols, below, dh),
                0.0,
                &mut dv[c0 * dh..],
                dh,
            );
        }
    };
    let n = t * dh;
    match parallel(heads) {
        Some(_single) => dq
            .par_chunks_mut(n)
            .zip(dk.par_chunks_mut(n).zip(dv.par_chunks_mut(n)))
            .enumerate()
            .for_each(head),
        None => dq
            .chunks_mut(n)
            .zip(dk.chunks_mut(n).zip(dv.chunks_mut(n)))
            .enumerate()
            .for_each(head),
    }
    // Each key and value head's gradient: the sum over the query heads that read it.
    let (dk, dv) = (sum_groups(dk, group, n), sum_groups(dv, group, n));
    let tensor = |g, s: &Vec<usize>| FlexTensor::from_data(TensorData::new(g, s.clone()));
    [
        tensor(dq, &shape),
        tensor(dk, &kv_shape),
        tensor(dv, &kv_shape),
    ]
}

/// Consecutive runs of `group` blocks of `n` values summed into one block each.
fn sum_groups(g: Vec<f32>, group: usize, n: usize) -> Vec<f32> {
    if group == 1 {
        return g;
    }
    g.chunks(group * n)
        .flat_map(|run| {
            let mut sum = run[..n].to_vec();
            for block in run[n..].chunks(n) {
                sum.iter_mut().zip(block).for_each(|(s, x)| *s += x);
            }
            sum
        })
        .collect()
}

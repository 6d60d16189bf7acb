//! Gradients as flat `f32` buffers, one per layer block, in the module's parameter order:
//! what the transport reduces and the optimizer consumes. The one place that flattens.

use crate::backend::plain_device;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Tensor, TensorData};
use std::collections::HashMap;

/// Where parameter gradients come from: an autodiff backward, or a W step's deferred
/// Linear weight gradients (by parameter id).
pub enum GradSource<'a> {
    Autodiff(&'a Gradients),
    Deferred(&'a HashMap<ParamId, Vec<f32>>),
}

/// Flatten `module`'s parameter gradients from `src` into `out` (added), in visit order.
pub fn add_grads<M: Module>(module: &M, src: &GradSource, out: &mut Vec<f32>) {
    struct V<'a> {
        src: &'a GradSource<'a>,
        out: &'a mut Vec<f32>,
        pos: usize,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let t = p.val();
            let n = t.shape().num_elements();
            if self.out.len() < self.pos + n {
                self.out.resize(self.pos + n, 0.0);
            }
            let out = &mut self.out[self.pos..self.pos + n];
            let mut add = |g: &[f32]| out.iter_mut().zip(g).for_each(|(o, x)| *o += x);
            match self.src {
                // Read in place: `into_vec` would copy the values once more.
                GradSource::Autodiff(grads) => {
                    if let Some(g) = t.grad(grads) {
                        add(g.into_data().as_slice::<f32>().expect("f32 gradients"))
                    }
                }
                GradSource::Deferred(map) => {
                    if let Some(g) = map.get(&p.id) {
                        add(g)
                    }
                }
            }
            self.pos += n;
        }
    }
    module.visit(&mut V { src, out, pos: 0 });
}

/// Turn a flat gradient buffer (scaled by `scale`) back into burn's per-parameter gradients.
pub fn grads_params<M: Module>(module: &M, flat: &[f32], scale: f32) -> GradientsParams {
    struct V<'a> {
        flat: &'a [f32],
        scale: f32,
        pos: usize,
        out: GradientsParams,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let shape = p.val().shape();
            let n = shape.num_elements();
            let vals: Vec<f32> = self.flat[self.pos..self.pos + n]
                .iter()
                .map(|x| x * self.scale)
                .collect();
            self.out.register(
                p.id,
                Tensor::<D>::from_data(TensorData::new(vals, shape), &plain_device()),
            );
            self.pos += n;
        }
    }
    let mut v = V {
        flat,
        scale,
        pos: 0,
        out: GradientsParams::new(),
    };
    module.visit(&mut v);
    v.out
}

/// All parameter values of `m`, flattened in visit order (for comparisons).
pub fn flat_params<M: Module>(m: &M) -> Vec<f32> {
    struct V(Vec<f32>);
    impl ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0
                .extend(p.val().to_data().try_to_vec::<f32>().expect("f32"));
        }
    }
    let mut v = V(Vec::new());
    m.visit(&mut v);
    v.0
}

/// Sum of squares of gradient buffers (f64 inside, f32 out: what the all-reduce carries).
/// Plain and pipelined training share it so their clipping agrees.
pub fn sum_squares<'a>(grads: impl IntoIterator<Item = &'a Vec<f32>>) -> f32 {
    grads.into_iter().map(|g| squares(g)).sum()
}

/// One buffer's sum of squares, as [`sum_squares`] adds it.
pub fn squares(g: &[f32]) -> f32 {
    g.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() as f32
}

/// The factor global-norm clipping multiplies gradients by.
pub fn clip_factor(norm: f64, clip: f32) -> f32 {
    if norm > clip as f64 {
        clip / norm as f32
    } else {
        1.0
    }
}

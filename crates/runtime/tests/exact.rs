//! Exact gradients: pipelined, data-parallel training ends with the same parameters as plain
//! single-worker training on the same data and seeds.

use pipewright_runtime::data::Corpus;
use pipewright_runtime::model::GptConfig;
use pipewright_runtime::train::{PlainTrainer, TrainConfig, Trainer};

fn tiny(schedule: &str, p: usize, d: usize, m: usize) -> TrainConfig {
    TrainConfig {
        model: GptConfig {
            vocab: 256,
            d_model: 16,
            heads: 2,
            layers: 6,
            seq_len: 8,
        },
        schedule: schedule.into(),
        stages: p,
        chunks: if schedule == "interleaved" || schedule == "zbv" {
            2
        } else {
            1
        },
        replicas: d,
        microbatches: m,
        rows: 2,
        steps: 3,
        // A tight clip so clipping is exercised.
        clip: 0.5,
        lr: 3e-3,
        warmup: 1,
        ..TrainConfig::default()
    }
}

#[test]
fn pipelined_equals_plain_training() {
    let corpus = Corpus::builtin();
    let mut checked = 0;
    for schedule in ["gpipe", "1f1b", "interleaved", "zbh1", "zbv"] {
        for p in [1, 2, 4] {
            for d in [1, 2] {
                for m in [1, 4, 8] {
                    let cfg = tiny(schedule, p, d, m);
                    let Ok(mut pipe) = Trainer::new(cfg.clone()) else {
                        assert!(
                            schedule == "interleaved" && m % p != 0,
                            "{schedule} P={p} D={d} M={m} should be possible"
                        );
                        continue;
                    };
                    let mut plain = PlainTrainer::new(cfg);
                    for _ in 0..3 {
                        let a = pipe.train_step(&corpus).unwrap().loss;
                        let b = plain.train_step(&corpus);
                        assert!(
                            (a - b).abs() < 1e-5,
                            "{schedule} P={p} D={d} M={m}: loss {a} vs {b}"
                        );
                    }
                    let (x, y) = (
                        pipe.flat_params(),
                        pipewright_runtime::train::flat_params(plain.model()),
                    );
                    assert_eq!(x.len(), y.len());
                    let diff = x
                        .iter()
                        .zip(&y)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0f32, f32::max);
                    assert!(
                        diff <= 1e-5,
                        "{schedule} P={p} D={d} M={m}: max |diff| {diff}"
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 80, "only {checked} combinations ran");
}

#[test]
fn plain_training_is_deterministic() {
    let corpus = Corpus::builtin();
    let run = || {
        let mut t = PlainTrainer::new(tiny("1f1b", 1, 1, 4));
        for _ in 0..3 {
            t.train_step(&corpus);
        }
        pipewright_runtime::train::flat_params(t.model())
    };
    assert_eq!(run(), run());
}

#[test]
fn plan_larger_than_model_is_refused() {
    let e = Trainer::new(TrainConfig {
        stages: 9,
        ..tiny("1f1b", 9, 1, 9)
    })
    .err()
    .unwrap();
    assert!(e.contains("only 8 layer blocks"), "{e}");
}

/// The B/W split is real: B's backward yields no Linear weight gradients at all; W computes
/// them from the kept layer inputs and output gradients; together they equal the fused backward.
#[test]
fn split_backward_defers_linear_weight_gradients() {
    use pipewright_runtime::backend::train_device;
    use pipewright_runtime::burn::tensor::{Distribution, Tensor};
    use pipewright_runtime::exec::{add_grads, GradSource};
    use pipewright_runtime::model::{Deferred, Layers, StageInput};
    let cfg = tiny("zbh1", 1, 1, 1).model;
    let dev = train_device();
    let stage = Layers::new(&cfg, 3, &dev).stage(1, 3); // two transformer blocks
    let x = Tensor::<3>::random(
        [2, cfg.seq_len, cfg.d_model],
        Distribution::Normal(0.0, 1.0),
        &dev,
    );
    let dy = Tensor::<3>::random(
        [2, cfg.seq_len, cfg.d_model],
        Distribution::Normal(0.0, 1.0),
        &dev,
    );
    let xf = x.clone().require_grad();
    let g = (stage.forward(StageInput::Hidden(xf.clone())) * dy.clone())
        .sum()
        .backward();
    let mut fused = Vec::new();
    add_grads(&stage, GradSource::Autodiff(&g), &mut fused);
    let dx_fused = xf
        .grad(&g)
        .unwrap()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();

    let xs = x.require_grad();
    let mut d = Deferred::default();
    let g = (stage.forward_split(StageInput::Hidden(xs.clone()), &mut d) * dy)
        .sum()
        .backward();
    let mut b_part = Vec::new();
    add_grads(&stage, GradSource::Autodiff(&g), &mut b_part);
    let dx_split = xs
        .grad(&g)
        .unwrap()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    d.take_output_grads(&g);
    let mut w_part = vec![0.0; b_part.len()];
    add_grads(&stage, GradSource::Deferred(&d.weight_grads()), &mut w_part);

    let max = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    assert!(max(&dx_fused, &dx_split) < 1e-5, "input gradients differ");
    // B and W touch disjoint parameters, and the Linear weights (most of them) only in W.
    assert!(b_part
        .iter()
        .zip(&w_part)
        .all(|(b, w)| *b == 0.0 || *w == 0.0));
    let in_w = w_part.iter().filter(|w| **w != 0.0).count();
    assert!(
        in_w > fused.len() * 9 / 10,
        "W holds {in_w} of {} gradients",
        fused.len()
    );
    let sum: Vec<f32> = b_part.iter().zip(&w_part).map(|(b, w)| b + w).collect();
    assert!(max(&sum, &fused) < 1e-5, "B + W != fused backward");
}

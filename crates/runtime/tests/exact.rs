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
        chunks: if schedule == "interleaved" { 2 } else { 1 },
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
    for schedule in ["gpipe", "1f1b", "interleaved"] {
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
                        pipewright_runtime::train::flat_params(&plain.model),
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
    assert!(checked >= 40, "only {checked} combinations ran");
}

#[test]
fn plain_training_is_deterministic() {
    let corpus = Corpus::builtin();
    let run = || {
        let mut t = PlainTrainer::new(tiny("1f1b", 1, 1, 4));
        for _ in 0..3 {
            t.train_step(&corpus);
        }
        pipewright_runtime::train::flat_params(&t.model)
    };
    assert_eq!(run(), run());
}

#[test]
fn zero_bubble_is_refused_until_split() {
    let e = Trainer::new(tiny("zbh1", 2, 1, 4)).err().unwrap();
    assert!(e.contains("does not do yet"), "{e}");
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

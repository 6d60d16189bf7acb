//! Measure each layer block on this machine: forward and backward time for one micro-batch,
//! parameter bytes and output bytes, as a profile `simulate`, `partition` and `plan` accept.

use crate::backend::train_device;
use crate::model::{loss, GptConfig, Layers, Stage, StageInput};
use burn::module::Module;
use burn::tensor::{Distribution, Int, Tensor, TensorData};
use pipewright_core::profile::{Layer, ModelInfo, Profile};
use std::time::Instant;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Time every layer block of `cfg` on micro-batches of `rows` sequences, `repeats` times each
/// (median). The backward is the full backward (input and weight gradients): the runtime does
/// not split it, so `weight_grad` is left to the profile's default.
pub fn profile_model(cfg: &GptConfig, rows: usize, repeats: usize, seed: u64) -> Profile {
    let dev = train_device();
    let layers = Layers::new(cfg, seed, &dev);
    let (t, d) = (cfg.seq_len, cfg.d_model);
    let blocks = cfg.num_blocks();
    let mut out = Vec::with_capacity(blocks);
    for i in 0..blocks {
        let stage: Stage = layers.stage(i, i + 1);
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        for _ in 0..repeats.max(1) + 1 {
            let input = if i == 0 {
                let toks: Vec<i64> = (0..rows * t).map(|k| (k * 7 % cfg.vocab) as i64).collect();
                StageInput::Tokens(Tensor::<2, Int>::from_data(
                    TensorData::new(toks, [rows, t]),
                    &dev,
                ))
            } else {
                StageInput::Hidden(
                    Tensor::<3>::random([rows, t, d], Distribution::Normal(0.0, 1.0), &dev)
                        .require_grad(),
                )
            };
            let t0 = Instant::now();
            let y = stage.forward(input);
            let _ = y.to_data(); // wait for the result
            let f = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            let grads = if i == blocks - 1 {
                let targets: Vec<i64> = (0..rows * t).map(|k| (k * 3 % cfg.vocab) as i64).collect();
                loss(
                    y,
                    Tensor::<2, Int>::from_data(TensorData::new(targets, [rows, t]), &dev),
                )
                .backward()
            } else {
                let dy = Tensor::<3>::random(y.dims(), Distribution::Normal(0.0, 1.0), &dev);
                (y * dy).sum().backward()
            };
            drop(grads);
            let b = t1.elapsed().as_secs_f64();
            fwd.push(f);
            bwd.push(b);
        }
        // The first run warms caches and allocators; leave it out.
        fwd.remove(0);
        bwd.remove(0);
        let name = match i {
            0 => "embed".to_string(),
            x if x == blocks - 1 => "head".to_string(),
            x => format!("block{}", x - 1),
        };
        let out_width = if i == blocks - 1 { cfg.vocab } else { d };
        out.push(Layer {
            name,
            forward: median(fwd),
            backward: Some(median(bwd)),
            weight_grad: None,
            params: 4 * stage.num_params() as u64,
            activation: 4 * (rows * t * out_width) as u64,
        });
    }
    let name = format!(
        "gpt d{}-l{}-h{}-s{} rows {rows} (measured)",
        cfg.d_model, cfg.layers, cfg.heads, cfg.seq_len
    );
    Profile {
        model: ModelInfo { name },
        layers: out,
    }
}

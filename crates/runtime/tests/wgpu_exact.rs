//! Exact gradients on the wgpu device (in CI Mesa's lavapipe, a Vulkan device that runs on
//! the CPU): one batch through 1 stage, 2-stage 1F1B, 2-stage ZB-H1 (split backward) and 2
//! stages x 2 replicas, in threads, gives the logits, loss and every layer block's gradient of
//! the CPU device's single worker within 1e-4, for the GPT and for a tied LLaMA (RMSNorm,
//! RoPE, SwiGLU, grouped-query attention).
//!
//! The device is chosen once per process, so the CPU reference comes from this same test
//! program run again as a child with `--cpu-reference` (hence `harness = false`). Without a
//! Vulkan device the comparison is skipped, saying so, unless `PIPEWRIGHT_REQUIRE_WGPU` is set
//! (CI sets it).

use pipewright_runtime::backend::{choose_device, start_device, DeviceChoice};
use pipewright_runtime::data::MicroBatch;
use pipewright_runtime::model::{Family, ModelConfig};
use pipewright_runtime::train::{TrainConfig, Trainer};
use std::process::Command;

const ROWS: usize = 4;
const SEQ: usize = 8;

/// The two models: a GPT (untied) and a LLaMA with tied embeddings.
fn model(name: &str) -> ModelConfig {
    let gpt = ModelConfig {
        vocab: 256,
        d_model: 16,
        heads: 2,
        layers: 4,
        seq_len: SEQ,
        ..ModelConfig::default()
    };
    match name {
        "gpt" => gpt,
        _ => ModelConfig {
            family: Family::Llama,
            heads: 4,
            kv_heads: Some(2),
            ffn: Some(24),
            tie_embeddings: true,
            ..gpt
        },
    }
}

/// Logits, loss and layer gradients of one fixed batch under `schedule` on `stages` stages
/// and `replicas` replicas, flattened as (loss, logits..., gradients...).
fn batch_result(name: &str, schedule: &str, stages: usize, replicas: usize) -> Vec<f32> {
    let m = 4;
    let cfg = TrainConfig {
        model: model(name),
        schedule: schedule.parse().unwrap(),
        stages,
        replicas,
        // Per replica: every plan runs the same 4 micro-batches.
        microbatches: m / replicas,
        rows: ROWS / m,
        ..TrainConfig::default()
    };
    let mut t = Trainer::new(cfg.clone(), cfg.plan().unwrap()).unwrap();
    let ids: Vec<i64> = (0..ROWS * SEQ)
        .map(|i| ((i * 37 + 11) % 256) as i64)
        .collect();
    let batch = MicroBatch::causal_lm(&ids, None, ROWS, SEQ);
    let out = t.batch_gradients(&batch.split(m).unwrap()).unwrap();
    let mut flat = vec![out.loss as f32];
    flat.extend(out.logits.into_iter().flat_map(|(_, v)| v));
    flat.extend(out.grads.into_iter().flatten());
    flat
}

fn main() {
    if std::env::args().any(|a| a == "--cpu-reference") {
        choose_device(DeviceChoice::Cpu).unwrap();
        let r: Vec<Vec<f32>> = ["gpt", "llama"]
            .iter()
            .map(|n| batch_result(n, "1f1b", 1, 1))
            .collect();
        println!("{}", serde_json::to_string(&r).unwrap());
        return;
    }
    if std::env::args().any(|a| a == "--list") {
        println!("wgpu_gives_the_cpus_gradients: test");
        return;
    }
    choose_device(DeviceChoice::Wgpu(None)).unwrap();
    if let Err(e) = start_device() {
        assert!(
            std::env::var_os("PIPEWRIGHT_REQUIRE_WGPU").is_none(),
            "PIPEWRIGHT_REQUIRE_WGPU is set but {e}"
        );
        eprintln!("no wgpu device here, comparison skipped: {e}");
        return;
    }
    let me = std::env::current_exe().unwrap();
    let o = Command::new(me).arg("--cpu-reference").output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let reference: Vec<Vec<f32>> = serde_json::from_slice(&o.stdout).unwrap();
    let plans = [
        ("1f1b", 1, 1),
        ("1f1b", 2, 1),
        ("zbh1", 2, 1),
        ("zbh1", 2, 2),
    ];
    for (want, name) in reference.iter().zip(["gpt", "llama"]) {
        for (schedule, p, d) in plans {
            let got = batch_result(name, schedule, p, d);
            assert_eq!(got.len(), want.len(), "{name} {schedule} P={p} D={d}");
            let worst = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            println!("{name} {schedule} P={p} D={d}: max |wgpu - cpu| {worst:.1e}");
            assert!(
                worst <= 1e-4,
                "{name} {schedule} P={p} D={d}: max |diff| {worst}"
            );
        }
    }
    println!("test wgpu_gives_the_cpus_gradients ... ok");
}

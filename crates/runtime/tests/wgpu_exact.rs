//! Exact gradients on the wgpu device (in CI Mesa's lavapipe, a Vulkan device that runs on
//! the CPU): one batch through 1 stage, 2-stage 1F1B, 2-stage ZB-H1 (split backward) and 2
//! stages x 2 replicas, in threads, gives the logits, loss and every layer block's gradient of
//! the CPU device's single worker within 1e-4, for every model family: the GPT, a tied LLaMA
//! (RMSNorm, RoPE, SwiGLU, grouped-query attention), GPT-2, BERT with a class head and padded
//! rows, and ViT (the patch convolution). The Hugging Face families take the shapes of the
//! fixtures' configs, randomly initialised.
//!
//! The device is chosen once per process, so the CPU reference comes from this same test
//! program run again as a child with `--cpu-reference` (hence `harness = false`). Without a
//! Vulkan device the comparison is skipped, saying so, unless `PIPEWRIGHT_REQUIRE_WGPU` is set
//! (CI sets it).

use pipewright_runtime::backend::{choose_device, start_device, DeviceChoice};
use pipewright_runtime::data::MicroBatch;
use pipewright_runtime::model::hf::config_from_hf;
use pipewright_runtime::model::{Family, ModelConfig};
use pipewright_runtime::train::{TrainConfig, Trainer};
use std::process::Command;

const ROWS: usize = 4;
const SEQ: usize = 8;

const FAMILIES: [&str; 5] = ["gpt", "llama", "gpt2", "bert", "vit"];

/// A fixture's config.json as a model (random weights: no checkpoint is loaded).
fn hf_model(fixture: &str) -> ModelConfig {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(fixture)
        .join("config.json");
    config_from_hf(&std::fs::read_to_string(path).unwrap(), "config.json").unwrap()
}

/// Family `name`'s model and a fixed batch of `ROWS` rows for it.
fn model_and_batch(name: &str) -> (ModelConfig, MicroBatch) {
    let gpt = ModelConfig {
        vocab: 256,
        d_model: 16,
        heads: 2,
        layers: 4,
        seq_len: SEQ,
        ..ModelConfig::default()
    };
    let ids = |vocab: usize| -> Vec<i64> {
        (0..ROWS * SEQ)
            .map(|i| ((i * 37 + 11) % vocab) as i64)
            .collect()
    };
    match name {
        "gpt" => (gpt, MicroBatch::causal_lm(&ids(256), None, ROWS, SEQ)),
        "llama" => {
            let m = ModelConfig {
                family: Family::Llama,
                heads: 4,
                kv_heads: Some(2),
                ffn: Some(24),
                tie_embeddings: true,
                ..gpt
            };
            (m, MicroBatch::causal_lm(&ids(256), None, ROWS, SEQ))
        }
        "gpt2" => {
            let m = ModelConfig {
                seq_len: SEQ,
                ..hf_model("gpt2")
            };
            let b = MicroBatch::causal_lm(&ids(m.vocab), None, ROWS, SEQ);
            (m, b)
        }
        "bert" => {
            let m = ModelConfig {
                seq_len: SEQ,
                ..hf_model("bert-classify")
            };
            // Row r keeps its first SEQ - r positions; the rest are padding.
            let mask: Vec<i64> = (0..ROWS * SEQ)
                .map(|i| i64::from(i % SEQ < SEQ - i / SEQ))
                .collect();
            let types = vec![0; ROWS * SEQ];
            let labels = (0..ROWS as i64).map(|r| r % 3).collect();
            let b = MicroBatch::labelled(&ids(m.vocab), &types, &mask, labels, 1, SEQ);
            (m, b)
        }
        _ => {
            let m = hf_model("vit");
            let image = [3, 16, 16];
            let pixels = (0..ROWS * 3 * 16 * 16)
                .map(|i| ((i * 29 % 101) as f32 / 50.0) - 1.0)
                .collect();
            let labels = (0..ROWS as i64).map(|r| r % 3).collect();
            let b = MicroBatch::images(pixels, image, labels, m.seq_len);
            (m, b)
        }
    }
}

/// Logits, loss and layer gradients of family `name`'s batch under `schedule` on `stages`
/// stages and `replicas` replicas, flattened as (loss, logits..., gradients...).
fn batch_result(name: &str, schedule: &str, stages: usize, replicas: usize) -> Vec<f32> {
    let m = 4;
    let (model, batch) = model_and_batch(name);
    let cfg = TrainConfig {
        model,
        schedule: schedule.parse().unwrap(),
        stages,
        replicas,
        // Per replica: every plan runs the same 4 micro-batches.
        microbatches: m / replicas,
        rows: ROWS / m,
        ..TrainConfig::default()
    };
    let mut t = Trainer::new(cfg.clone(), cfg.plan().unwrap()).unwrap();
    let out = t.batch_gradients(&batch.split(m).unwrap()).unwrap();
    let mut flat = vec![out.loss as f32];
    flat.extend(out.logits.into_iter().flat_map(|(_, v)| v));
    flat.extend(out.grads.into_iter().flatten());
    flat
}

fn main() {
    if std::env::args().any(|a| a == "--cpu-reference") {
        choose_device(DeviceChoice::Cpu).unwrap();
        let r: Vec<Vec<f32>> = FAMILIES
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
    assert_eq!(reference.len(), FAMILIES.len());
    for (want, name) in reference.iter().zip(FAMILIES) {
        // The logits and gradients are not all zeros (a comparison of zeros proves nothing).
        assert!(want.iter().skip(1).any(|x| *x != 0.0), "{name}: all zeros");
        for (schedule, p, d) in plans {
            let got = batch_result(name, schedule, p, d);
            assert_eq!(got.len(), want.len(), "{name} {schedule} P={p} D={d}");
            let worst = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            println!(
                "{name} {schedule} P={p} D={d}: max |wgpu - cpu| {worst:.1e} (largest value {scale:.2})"
            );
            assert!(
                worst <= 1e-4,
                "{name} {schedule} P={p} D={d}: max |diff| {worst}"
            );
        }
    }
    println!("test wgpu_gives_the_cpus_gradients ... ok");
}

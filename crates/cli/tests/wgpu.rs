//! `train --device wgpu` on the machine's Vulkan device (in CI Mesa's lavapipe, a Vulkan
//! device that runs on the CPU): burn's own operations give the same losses as the CPU
//! device's fused kernels, step by step within 1e-3 over 10 steps, for the GPT on 1 stage and
//! on 2 stages of ZB-H1 (a split backward) in threads, and for a LLaMA (RMSNorm, RoPE, SwiGLU,
//! GQA) on 1 stage. A
//! machine without a Vulkan device skips the comparison (saying so) unless
//! `PIPEWRIGHT_REQUIRE_WGPU` is set, as CI sets it.

mod common;
use common::{fresh_dir, TINY};
use std::process::Command;

fn losses(device: &str, extra: &[&str], dir: &std::path::Path) -> Result<Vec<f64>, String> {
    let metrics = dir.join(format!("{device}-{}.jsonl", extra.len()));
    let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args([
            "train",
            "--device",
            device,
            "--transport",
            "threads",
            "--steps",
            "10",
        ])
        .args(["--no-checkpoint", "--log-every", "10", "--metrics"])
        .arg(&metrics)
        .args(extra)
        .output()
        .unwrap();
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    let text = std::fs::read_to_string(&metrics).unwrap();
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|r| r.get("loss").and_then(|x| x.as_f64()))
        .collect())
}

#[test]
fn wgpu_trains_with_the_cpus_losses() {
    let dir = fresh_dir("wgpu");
    let cfg = dir.join("llama.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let llama = cfg.to_str().unwrap();
    let mut gpt: Vec<&str> = TINY.to_vec();
    gpt.extend(["--stages", "1"]);
    let mut zb: Vec<&str> = TINY.to_vec();
    zb.extend(["--stages", "2", "--schedule", "zbh1"]);
    let runs: [Vec<&str>; 3] = [
        gpt,
        zb,
        vec!["--model-config", llama, "--seq-len", "16", "--stages", "1"],
    ];
    for extra in &runs {
        let cpu = losses("cpu", extra, &dir).unwrap_or_else(|e| panic!("cpu {extra:?}: {e}"));
        let gpu = match losses("wgpu", extra, &dir) {
            Ok(l) => l,
            Err(e)
                if e.contains("device did not start")
                    && std::env::var_os("PIPEWRIGHT_REQUIRE_WGPU").is_none() =>
            {
                eprintln!("no wgpu device here, comparison skipped: {e}");
                return;
            }
            Err(e) => panic!("wgpu {extra:?}: {e}"),
        };
        assert_eq!(cpu.len(), 10, "{extra:?}: {cpu:?}");
        assert_eq!(gpu.len(), 10, "{extra:?}: {gpu:?}");
        for (step, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
            assert!(
                (c - g).abs() <= 1e-3,
                "{extra:?} step {step}: cpu {c}, wgpu {g}"
            );
        }
        assert!(gpu[9] < gpu[0], "{extra:?}: it learns ({gpu:?})");
    }
}

/// `--gpus-per-node` places worker processes on GPUs: refused, with a message naming it,
/// on the CPU, with threads (one process, one device) and as 0 in a config's run table.
#[test]
fn gpus_per_node_is_checked() {
    let dir = fresh_dir("gpus-per-node");
    let cfg = dir.join("run.toml");
    std::fs::write(&cfg, "[run]\ndevice = \"wgpu\"\ngpus_per_node = 0\n").unwrap();
    let cfg = cfg.to_str().unwrap();
    let cases: [(&[&str], &str); 3] = [
        (&["--gpus-per-node", "2"], "needs --device wgpu"),
        (
            &[
                "--device",
                "wgpu",
                "--gpus-per-node",
                "2",
                "--transport",
                "threads",
            ],
            "threads share one process's device",
        ),
        (&["--config", cfg], "it must be at least 1 and below 4096"),
    ];
    for (flags, want) in cases {
        let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
            .arg("train")
            .args(flags)
            .args(["--steps", "1", "--no-checkpoint"])
            .args(TINY)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(want), "{flags:?}: {err}");
    }
}

/// A 2-stage wgpu run in worker processes beside a busy CPU: the first step compiles shaders
/// (on lavapipe, on the CPU; 25.7 s on the 2-core Xeon) for longer than the short peer timeout given here, and the run
/// still passes, as the startup timeout bounds the first step's waits.
#[test]
fn a_two_process_wgpu_run_beside_a_busy_cpu_waits_out_the_first_steps_compile() {
    let dir = fresh_dir("wgpu-busy");
    let busy = common::Busy::cores(2);
    let metrics = dir.join("m.jsonl");
    let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(["train", "--device", "wgpu", "--stages", "2", "--steps", "3"])
        .args([
            "--peer-timeout",
            "8",
            "--eval-batches",
            "1",
            "--no-checkpoint",
            "--metrics",
        ])
        .arg(&metrics)
        .args(TINY)
        .output()
        .unwrap();
    drop(busy);
    let err = String::from_utf8_lossy(&o.stderr);
    if !o.status.success()
        && err.contains("device did not start")
        && std::env::var_os("PIPEWRIGHT_REQUIRE_WGPU").is_none()
    {
        eprintln!("no wgpu device here, skipped: {err}");
        return;
    }
    assert!(o.status.success(), "{err}");
    let first: f64 = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|r| r["step"] == 1)
        .and_then(|r| r["seconds"].as_f64())
        .unwrap();
    eprintln!("first step {first:.1} s beside the busy CPU (peer timeout 8 s)");
}

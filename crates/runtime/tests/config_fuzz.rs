//! Train configs under mutation: a real config TOML with numbers replaced by edge values
//! (deterministic), through parsing, the settings check and plan generation. Each ends in a
//! value or an error, never a panic; whatever passes the check is small enough to allocate.

use pipewright_core::error::parse_toml;
use pipewright_core::fuzz::{mutate, number_spans};
use pipewright_core::rng::Lcg;
use pipewright_runtime::train::TrainConfig;

#[test]
fn mutated_train_configs_never_panic() {
    // Top-level keys first: the example ends in its [model] table.
    let base = "schedule = \"zbh1\"\nstages = 2\nreplicas = 2\nlr = 0.003\nmin_lr = 0.0003\nwarmup = 5\nclip = 1.0\nweight_decay = 0.01\nseed = 42\n".to_string()
        + &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/gpt_bench.toml"),
        )
        .unwrap();
    assert!(number_spans(&base).len() > 10);
    let mut rng = Lcg(11);
    let (mut parsed, mut accepted) = (0, 0);
    for _ in 0..2000 {
        let picks: Vec<(usize, usize)> = (0..1 + rng.below(3))
            .map(|_| (rng.below(1 << 20), rng.below(1 << 20)))
            .collect();
        let text = mutate(&base, &picks);
        let Ok(cfg) = parse_toml::<TrainConfig>("fuzz.toml", &text) else {
            continue;
        };
        parsed += 1;
        if cfg.check().is_ok() {
            accepted += 1;
            assert!(cfg.lr.is_finite() && cfg.lr > 0.0 && cfg.clip.is_finite());
            assert!(cfg.memory_estimate().is_some(), "{text}");
            let _ = cfg.plan();
        }
    }
    assert!(
        parsed > 500 && accepted > 100,
        "parsed {parsed}, accepted {accepted}"
    );
}

/// Hugging Face configs of every family with numbers replaced by edge values (2^32, 2^64 - 1,
/// 0, ...): each is a model or a one-line refusal, never a panic or a wrapped size; whatever
/// passes has a parameter count and layer blocks that fit.
#[test]
fn mutated_hugging_face_configs_of_every_family_never_panic() {
    use pipewright_runtime::model::hf::config_from_hf;
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf");
    let mut rng = Lcg(5);
    let (mut refused, mut accepted) = (0, 0);
    for family in ["llama-gqa", "gpt2", "bert-classify", "bert-qa", "vit"] {
        let base = std::fs::read_to_string(fixtures.join(family).join("config.json")).unwrap();
        assert!(number_spans(&base).len() > 5, "{family}");
        for _ in 0..400 {
            let picks: Vec<(usize, usize)> = (0..1 + rng.below(2))
                .map(|_| (rng.below(1 << 20), rng.below(1 << 20)))
                .collect();
            match config_from_hf(&mutate(&base, &picks), "config.json") {
                Ok(m) => {
                    accepted += 1;
                    assert!(m.param_count().is_some_and(|p| p <= 1 << 34), "{m:?}");
                    assert!(m.num_blocks() == m.layers + 2 && m.patches() < 1 << 32);
                }
                Err(e) => {
                    refused += 1;
                    // A config error, never a weights or input error.
                    assert!(
                        matches!(e, pipewright_runtime::model::error::Error::Config(_)),
                        "{e:?}"
                    );
                    let e = e.to_string();
                    assert!(e.starts_with("config.json: ") && !e.contains('\n'), "{e}");
                }
            }
        }
    }
    assert!(
        refused > 100 && accepted > 100,
        "refused {refused}, accepted {accepted}"
    );
    // The reviewers' case: 2^32-pixel images wrapped channels x patch x patch to 0.
    let vit = std::fs::read_to_string(fixtures.join("vit/config.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&vit).unwrap();
    let mut big = v.clone();
    big["image_size"] = serde_json::json!(1u64 << 32);
    big["patch_size"] = serde_json::json!(1u64 << 31);
    let e = config_from_hf(&big.to_string(), "config.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains("image 4294967296 is past the largest"), "{e}");
}

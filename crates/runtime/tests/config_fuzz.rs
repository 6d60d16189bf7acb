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

//! Train configs under mutation: a real config TOML with numbers replaced by edge values
//! (deterministic), through parsing, the settings check and plan generation. Each ends in a
//! value or an error, never a panic; whatever passes the check is small enough to allocate.

use pipewright_core::error::parse_toml;
use pipewright_runtime::train::TrainConfig;

const EDGES: [&str; 12] = [
    "0",
    "1",
    "-1",
    "2.5",
    "1e308",
    "nan",
    "inf",
    "4294967296",
    "9223372036854775807",
    "18446744073709551615",
    "100000000",
    "3",
];

#[test]
fn mutated_train_configs_never_panic() {
    // Top-level keys first: the example ends in its [model] table.
    let base = "schedule = \"zbh1\"\nstages = 2\nreplicas = 2\nlr = 0.003\nmin_lr = 0.0003\nwarmup = 5\nclip = 1.0\nweight_decay = 0.01\nseed = 42\n".to_string()
        + &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/gpt_bench.toml"),
        )
        .unwrap();
    let spans: Vec<(usize, usize)> = {
        let b = base.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            if b[i].is_ascii_digit() && (i == 0 || !b[i - 1].is_ascii_alphanumeric()) {
                let s = i;
                while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.') {
                    i += 1;
                }
                out.push((s, i));
            } else {
                i += 1;
            }
        }
        out
    };
    assert!(spans.len() > 10);
    let mut seed: u64 = 11;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize
    };
    let (mut parsed, mut accepted) = (0, 0);
    for _ in 0..2000 {
        let mut picks: Vec<(usize, usize)> = (0..1 + next() % 3)
            .map(|_| spans[next() % spans.len()])
            .collect();
        picks.sort_by_key(|p| std::cmp::Reverse(p.0));
        picks.dedup();
        let mut text = base.clone();
        for (s, t) in picks {
            text.replace_range(s..t, EDGES[next() % EDGES.len()]);
        }
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

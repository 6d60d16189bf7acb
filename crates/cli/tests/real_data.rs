//! The real data sets that `scripts/fetch-data` puts in data/ (run by `scripts/install-deps`,
//! which the test command runs first): the Brown Corpus as a 15-genre classification task and
//! as a language-modelling corpus, and scikit-learn's 8x8 digits as an image task for ViT.

mod common;
use common::fresh_dir;
use std::path::{Path, PathBuf};
use std::process::Command;

fn data(sub: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data")
        .join(sub);
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-data (scripts/install-deps runs it)",
        p.display()
    );
    p
}

fn ok(args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(args)
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "pipewright {args:?}: {all}");
    all
}

/// The number after `key` in `text` (its last occurrence).
fn figure(text: &str, key: &str) -> f64 {
    let at = text
        .rfind(key)
        .unwrap_or_else(|| panic!("{key:?} in {text}"))
        + key.len();
    let num: String = text[at..]
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    num.parse().unwrap_or_else(|_| panic!("{key:?} in {text}"))
}

const TINY_LLAMA: &str = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "vocab_size": 50257, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
  "rms_norm_eps": 1e-05, "tie_word_embeddings": true}"#;

/// Brown paragraphs by genre (15 named classes, whole documents held out), GPT-2 BPE, a
/// fresh LLaMA classifier over 2 stages: 60 steps bring the held-out loss below the class
/// prior's.
#[test]
fn brown_genres_are_learnt_by_a_llama_classifier() {
    let dir = fresh_dir("real-brown-genres");
    let config = dir.join("config.json");
    std::fs::write(&config, TINY_LLAMA).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let out = ok(&[
        "train",
        "--model-config",
        &s(&config),
        "--tokenizer",
        "gpt2",
        "--task",
        "classify",
        "--data",
        &s(&data("brown/genres-train.jsonl")),
        "--val-data",
        &s(&data("brown/genres-val.jsonl")),
        "--seq-len",
        "64",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--rows",
        "8",
        "--steps",
        "60",
        "--lr",
        "3e-3",
        "--no-checkpoint",
    ]);
    let (val, prior) = (figure(&out, "-> "), figure(&out, "class-prior baseline"));
    assert!(
        val < prior - 0.1,
        "val {val} against the prior's {prior}: {out}"
    );
    assert!(figure(&out, "accuracy 0.066 ->") > 0.15, "{out}");
}

/// The digits (1,797 8x8 grey images, a folder per class): a fresh ViT in a 2-stage pipeline
/// gets most of the held-out fifth right within 200 steps, and `eval` of its checkpoint
/// scores the same accuracy.
#[test]
fn digits_are_learnt_by_a_vit() {
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/vit_digits.json");
    let ck = fresh_dir("real-digits").join("ck");
    let (train, val) = (s(&data("digits/train")), s(&data("digits/val")));
    let task = ["--task", "classify", "--data", &train, "--val-data", &val];
    let out = ok(&[
        &["train", "--model-config", &s(&config)][..],
        &task,
        &[
            "--checkpoint-dir",
            &s(&ck),
            "--stages",
            "2",
            "--microbatches",
            "2",
        ],
        &["--rows", "16", "--steps", "200", "--lr", "1e-3"],
    ]
    .concat());
    let acc = figure(&out, "accuracy 0.058 ->");
    assert!(acc > 0.6, "{out}");
    let eval = ok(&[&["eval", "--checkpoint-dir", &s(&ck)][..], &task].concat());
    assert_eq!(figure(&eval, "accuracy"), acc, "{eval}");
}

/// The Brown documents tokenized to GPT-2 shards once, then a LLaMA learns from the shards.
#[test]
fn brown_text_tokenizes_to_shards_a_llama_learns_from() {
    let dir = fresh_dir("real-brown-lm");
    let (config, shards) = (dir.join("config.json"), dir.join("shards"));
    std::fs::write(&config, TINY_LLAMA).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let out = ok(&[
        "tokenize",
        "--data",
        &s(&data("brown/text")),
        "--tokenizer",
        "gpt2",
        "--out",
        &s(&shards),
    ]);
    let tokens = figure(&out, "tokens (train");
    assert!(tokens > 1.0e6 && out.contains("500 file(s)"), "{out}");
    let out = ok(&[
        "train",
        "--model-config",
        &s(&config),
        "--tokenizer",
        "gpt2",
        "--data",
        &s(&shards),
        "--seq-len",
        "32",
        "--rows",
        "4",
        "--microbatches",
        "2",
        "--steps",
        "30",
        "--eval-every",
        "30",
        "--eval-batches",
        "4",
        "--lr",
        "1e-2",
        "--no-checkpoint",
    ]);
    let (first, last) = (figure(&out, "val loss"), figure(&out, "-> "));
    assert!(last < first - 2.0, "val loss {first} -> {last}: {out}");
}

//! Hugging Face models through the command line: train a LLaMA from a config.json, export it,
//! forward and generate from the export and from the checkpoint alike; bad model directories
//! are refused with exit 2, naming what is wrong, and nothing is written.

mod common;
use common::fresh_dir;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn pw(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> String {
    let o = pw(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "pipewright {args:?}: {err}");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The llama fixture that transformers saved (GQA, untied).
fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../runtime/tests/fixtures/hf/llama-gqa")
}

type Tensors = HashMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>;

fn read(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn write(path: &Path, t: &Tensors) {
    let views: Vec<_> = t
        .iter()
        .map(|(n, (d, s, b))| {
            let v = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
            (n.clone(), v)
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn f32s(t: &Tensors, name: &str) -> Vec<f32> {
    t[name]
        .2
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A batch of token ids for models of `vocab` tokens.
fn ids_file(dir: &Path, vocab: i64) -> PathBuf {
    let ids: Vec<u8> = (0..32i64)
        .flat_map(|i| ((i * 7 + 3) % vocab).to_le_bytes())
        .collect();
    let p = dir.join("ids.safetensors");
    let t: Tensors = [(
        "input_ids".to_string(),
        (safetensors::Dtype::I64, vec![2, 16], ids),
    )]
    .into();
    write(&p, &t);
    p
}

/// pipewright's own GPT exports with the PyTorch code that transformers runs it with
/// (`trust_remote_code`; checked against that code in the runtime's `hf` tests), and the
/// export computes what the checkpoint does.
#[test]
fn gpt_exports_with_its_pytorch_code_and_runs_the_same_from_the_export() {
    let dir = fresh_dir("models-gpt-export");
    let (ck, hf) = (dir.join("ck"), dir.join("hf"));
    let (ck, hf_s) = (ck.to_str().unwrap(), hf.to_str().unwrap());
    let small = [
        "--d-model",
        "32",
        "--layers",
        "2",
        "--heads",
        "4",
        "--seq-len",
        "16",
    ];
    let train = [
        "train",
        "--steps",
        "2",
        "--eval-batches",
        "1",
        "--checkpoint-dir",
        ck,
    ];
    ok(&[&train[..], &small[..]].concat());
    let said = ok(&["export", "--checkpoint-dir", ck, "--out", hf_s]);
    assert!(said.contains("gpt model"), "{said}");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "pipewright_gpt");
    let code = config["auto_map"]["AutoModelForCausalLM"].as_str().unwrap();
    let file = format!("{}.py", code.split('.').next().unwrap());
    let text = std::fs::read_to_string(hf.join(&file)).unwrap();
    assert!(text.contains("class PipewrightGptForCausalLM"), "{file}");
    assert!(hf.join("configuration_pipewright_gpt.py").is_file());
    assert!(hf.join("generation_config.json").is_file());
    let ids = ids_file(&dir, 256);
    let (a, b) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    let from_ck = ["forward", "--checkpoint-dir", ck, "--input-ids"];
    ok(&[
        &from_ck[..],
        &[ids.to_str().unwrap(), "--out", a.to_str().unwrap()],
    ]
    .concat());
    let o = forward(&hf, &ids, &b);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let d = max_diff(&f32s(&read(&a), "logits"), &f32s(&read(&b), "logits"));
    assert!(
        d < 1e-5,
        "logits of the checkpoint and its export differ by {d}"
    );
}

#[test]
fn trained_llama_exports_and_runs_the_same_from_the_export_and_the_checkpoint() {
    let dir = fresh_dir("models-roundtrip");
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let (ck, hf) = (dir.join("ck"), dir.join("hf"));
    let (ck, hf, cfg) = (
        ck.to_str().unwrap(),
        hf.to_str().unwrap(),
        cfg.to_str().unwrap(),
    );
    ok(&[
        "train",
        "--model-config",
        cfg,
        "--stages",
        "2",
        "--steps",
        "4",
        "--seq-len",
        "16",
        "--checkpoint-dir",
        ck,
        "--eval-batches",
        "1",
    ]);
    ok(&["export", "--checkpoint-dir", ck, "--out", hf]);
    let ids = ids_file(&dir, 256);
    let ids = ids.to_str().unwrap();
    let (a, b) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    ok(&[
        "forward",
        "--checkpoint-dir",
        ck,
        "--input-ids",
        ids,
        "--out",
        a.to_str().unwrap(),
        "--grads",
        "--stages",
        "2",
        "--microbatches",
        "2",
    ]);
    ok(&[
        "forward",
        "--model",
        hf,
        "--input-ids",
        ids,
        "--out",
        b.to_str().unwrap(),
        "--grads",
    ]);
    let (a, b) = (read(&a), read(&b));
    let d = max_diff(&f32s(&a, "logits"), &f32s(&b, "logits"));
    assert!(
        d < 1e-5,
        "logits of the checkpoint and its export differ by {d}"
    );
    // Tied: one matrix, no head of its own, in the export and in the gradients.
    assert!(
        !a.contains_key("grad.lm_head.weight") && a.contains_key("grad.model.embed_tokens.weight")
    );
    for (k, _) in a.iter().filter(|(k, _)| k.starts_with("grad.")) {
        let g = max_diff(&f32s(&a, k), &f32s(&b, k));
        assert!(
            g < 1e-4,
            "{k}: 2 stages and 2 micro-batches vs 1 differ by {g}"
        );
    }
    let from_ck = ok(&[
        "generate",
        "--checkpoint-dir",
        ck,
        "--prompt",
        "ab",
        "--max-tokens",
        "6",
    ]);
    let from_hf = ok(&[
        "generate",
        "--model",
        hf,
        "--prompt",
        "ab",
        "--max-tokens",
        "6",
    ]);
    assert_eq!(from_ck, from_hf);
    assert!(
        from_ck.starts_with("ab") && from_ck.len() > 2,
        "{from_ck:?}"
    );
    // Asked past the model's 64 positions: it stops there and says so.
    let o = pw(&[
        "generate",
        "--model",
        hf,
        "--prompt",
        "ab",
        "--max-tokens",
        "100",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && err.contains("stopped after 62 of 100 new tokens"),
        "{err}"
    );
}

/// A copy of the fixture with `change` applied to its weights (and config).
fn damaged(tag: &str, change: impl FnOnce(&Path, &mut Tensors)) -> PathBuf {
    let dir = fresh_dir(tag).join("model");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixture().join("config.json"), dir.join("config.json")).unwrap();
    let mut t = read(&fixture().join("model.safetensors"));
    change(&dir, &mut t);
    if !t.is_empty() {
        write(&dir.join("model.safetensors"), &t);
    }
    dir
}

/// `forward --model model --input-ids ids --out out`.
fn forward(model: &Path, ids: &Path, out: &Path) -> Output {
    pw(&[
        "forward",
        "--model",
        model.to_str().unwrap(),
        "--input-ids",
        ids.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
}

/// `forward` on `model` fails with exit 2, naming `want`, and writes nothing.
fn refused(model: &Path, want: &str) {
    let out = model.parent().unwrap().join("out.safetensors");
    let ids = ids_file(model.parent().unwrap(), 96);
    let o = forward(model, &ids, &out);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{want}: {err}");
    assert!(err.contains(want), "expected {want:?} in: {err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(!out.exists(), "{want}: an output was written");
}

#[test]
fn bad_model_directories_are_refused_by_name() {
    let up = "model.layers.1.mlp.up_proj.weight";
    refused(&damaged("m-missing", |_, t| drop(t.remove(up))), up);
    refused(
        &damaged("m-extra", |_, t| {
            let x = t[up].clone();
            t.insert("model.layers.9.mlp.up_proj.weight".into(), x);
        }),
        "model.layers.9.mlp.up_proj.weight is not a parameter",
    );
    refused(
        &damaged("m-shape", |_, t| {
            let e = t.get_mut(up).unwrap();
            e.1 = vec![e.1[1], e.1[0]];
        }),
        "has shape [32, 48]; this model expects [48, 32]",
    );
    refused(
        &damaged("m-dtype", |_, t| {
            t.get_mut(up).unwrap().0 = safetensors::Dtype::I32
        }),
        "dtype I32 is not supported",
    );
    refused(
        &damaged("m-trunc", |dir, t| {
            write(&dir.join("model.safetensors"), t);
            let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
            std::fs::write(dir.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
            t.clear();
        }),
        "not a valid safetensors file",
    );
    refused(
        &damaged("m-shard", |dir, t| {
            let index =
                r#"{"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}"#;
            std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
            t.clear();
        }),
        "names shard model-00002-of-00002.safetensors, which is not a file",
    );
    refused(
        &damaged("m-arch", |dir, _| {
            let c = std::fs::read_to_string(dir.join("config.json")).unwrap();
            std::fs::write(
                dir.join("config.json"),
                c.replace("\"llama\"", "\"mistral\""),
            )
            .unwrap();
        }),
        "model_type \"mistral\" is not supported",
    );
    refused(
        &damaged("m-act", |dir, _| {
            let c = std::fs::read_to_string(dir.join("config.json")).unwrap();
            std::fs::write(dir.join("config.json"), c.replace("\"silu\"", "\"gelu\"")).unwrap();
        }),
        "hidden_act",
    );
    // A config.json given to --model instead of its directory.
    let dir = damaged("m-json", |_, _| {});
    refused(&dir.join("config.json"), "use --model-config");
}

/// Shards named by an index, and bf16 weights, load as one f32 model.
#[test]
fn sharded_bf16_weights_load() {
    let dir = damaged("m-bf16", |dir, t| {
        let mut shards: [Tensors; 2] = Default::default();
        let mut map = serde_json::Map::new();
        for (i, (n, (_, s, b))) in t.drain().enumerate() {
            let bf: Vec<u8> = b
                .chunks_exact(4)
                .flat_map(|c| {
                    half::bf16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes()
                })
                .collect();
            let file = format!("model-0000{}-of-00002.safetensors", i % 2 + 1);
            map.insert(n.clone(), serde_json::Value::String(file));
            shards[i % 2].insert(n, (safetensors::Dtype::BF16, s, bf));
        }
        for (i, s) in shards.iter().enumerate() {
            write(
                &dir.join(format!("model-0000{}-of-00002.safetensors", i + 1)),
                s,
            );
        }
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    });
    let ids = ids_file(dir.parent().unwrap(), 96);
    let (a, b) = (
        dir.parent().unwrap().join("a"),
        dir.parent().unwrap().join("b"),
    );
    for (m, out) in [(&dir, &a), (&fixture(), &b)] {
        let o = forward(m, &ids, out);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let d = max_diff(&f32s(&read(&a), "logits"), &f32s(&read(&b), "logits"));
    assert!(d > 0.0 && d < 0.05, "bf16 logits differ from f32 by {d}");
}

/// Where a directory holds both `model.safetensors` and a shard index, the single file is the
/// model, as transformers reads it; `export` will not write beside another model's shards.
#[test]
fn the_single_weights_file_wins_and_export_leaves_shards_alone() {
    let stale = r#"{"weight_map": {"model.norm.weight": "gone-00001-of-00001.safetensors"}}"#;
    let dir = damaged("m-both", |dir, _| {
        std::fs::write(dir.join("model.safetensors.index.json"), stale).unwrap();
    });
    let ids = ids_file(dir.parent().unwrap(), 96);
    let o = forward(&dir, &ids, &dir.parent().unwrap().join("o.safetensors"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let work = fresh_dir("m-export-over-shards");
    let cfg = work.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "vocab_size": 256, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16}"#,
    )
    .unwrap();
    let ck = work.join("ck");
    ok(&[
        "train",
        "--model-config",
        cfg.to_str().unwrap(),
        "--steps",
        "1",
        "--seq-len",
        "8",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--eval-batches",
        "1",
    ]);
    let o = pw(&[
        "export",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ]);
    exits_2_saying(&o, "already holds a model (config.json, model.safetensors, model.safetensors.index.json); pass --overwrite");
    assert_eq!(
        std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
        stale
    );
    // Asked to, it replaces the model whole: no stale index beside the new weights, the
    // directory's other files kept.
    std::fs::write(dir.join("README.md"), "mine\n").unwrap();
    let (ck_s, dir_s) = (ck.to_str().unwrap(), dir.to_str().unwrap());
    ok(&[
        "export",
        "--checkpoint-dir",
        ck_s,
        "--out",
        dir_s,
        "--overwrite",
    ]);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    // With the tokenizer the run read with (bytes, as a byte-level tokenizer.json) and a causal
    // model's generation_config.json.
    assert_eq!(
        names,
        [
            "README.md",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    assert!(std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .contains("\"hidden_size\": 16"));
    // Nothing left beside it.
    let stray: Vec<_> = std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("tmp~"))
        .collect();
    assert!(stray.is_empty(), "{stray:?}");
}

/// The bytes of a model directory's config and weights.
fn model_files(dir: &Path) -> (Vec<u8>, Vec<u8>) {
    let read = |n: &str| std::fs::read(dir.join(n)).unwrap_or_default();
    (read("config.json"), read("model.safetensors"))
}

/// `export` never replaces the model a run was fine-tuned from, --overwrite or not; and killed
/// at any moment while it replaces another model, it leaves the old model or the new one
/// whole, never a mix.
#[test]
fn export_keeps_its_source_and_a_kill_leaves_one_model_whole() {
    let work = fresh_dir("m-export-kill");
    // A base model of its own: a fresh LLaMA, exported.
    let cfg = work.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64}"#,
    )
    .unwrap();
    let (ck0, src) = (work.join("ck0"), work.join("base"));
    let tiny = ["--seq-len", "16", "--eval-batches", "1", "--steps", "1"];
    let ck0_s = ck0.to_str().unwrap();
    ok(&[
        &[
            "train",
            "--model-config",
            cfg.to_str().unwrap(),
            "--checkpoint-dir",
            ck0_s,
        ][..],
        &tiny,
    ]
    .concat());
    ok(&[
        "export",
        "--checkpoint-dir",
        ck0_s,
        "--out",
        src.to_str().unwrap(),
    ]);
    // Fine-tuned from it.
    let (ck, src_s) = (work.join("ck"), src.to_str().unwrap().to_string());
    let ck_s = ck.to_str().unwrap();
    ok(&[
        &["train", "--model", &src_s, "--checkpoint-dir", ck_s][..],
        &tiny,
    ]
    .concat());
    let before = model_files(&src);
    for extra in [&[][..], &["--overwrite"][..]] {
        let o = pw(&[
            &["export", "--checkpoint-dir", ck_s, "--out", &src_s][..],
            extra,
        ]
        .concat());
        exits_2_saying(&o, "the model this checkpoint's run was fine-tuned from");
        assert!(model_files(&src) == before, "the source model changed");
    }
    // A symlink to it is the same directory.
    let link = work.join("link");
    std::os::unix::fs::symlink(&src, &link).unwrap();
    let o = pw(&[
        "export",
        "--checkpoint-dir",
        ck_s,
        "--out",
        link.to_str().unwrap(),
        "--overwrite",
    ]);
    exits_2_saying(&o, "fine-tuned from");
    // Another model directory, replaced under kills at spread-out moments.
    kills_leave_one_model_whole(&work, &src, ck_s, &before);
}

/// Copies of the model in `src` (`before`, its files) replaced by `export --overwrite` of the
/// checkpoint `ck`, killed at 8 moments spread over an export's time: each copy ends as the
/// old model or the new one, never a mix.
fn kills_leave_one_model_whole(work: &Path, src: &Path, ck_s: &str, before: &(Vec<u8>, Vec<u8>)) {
    let other = work.join("other");
    let over_other = [
        "export",
        "--checkpoint-dir",
        ck_s,
        "--out",
        other.to_str().unwrap(),
        "--overwrite",
    ];
    let fresh = work.join("fresh");
    ok(&[
        "export",
        "--checkpoint-dir",
        ck_s,
        "--out",
        fresh.to_str().unwrap(),
    ]);
    let new = model_files(&fresh);
    assert!(new != *before);
    let t0 = std::time::Instant::now();
    ok(&[
        "export",
        "--checkpoint-dir",
        ck_s,
        "--out",
        work.join("timed").to_str().unwrap(),
    ]);
    let whole = t0.elapsed();
    let mut seen = (0, 0);
    for k in 0..8u32 {
        let _ = std::fs::remove_dir_all(&other);
        std::fs::create_dir_all(&other).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), other.join(f)).unwrap();
        }
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_pipewright"))
            .args(over_other)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(whole * k / 5);
        let _ = child.kill();
        let _ = child.wait();
        let now = model_files(&other);
        assert!(
            now == *before || now == new,
            "kill {k}: a mix of the old model and the new"
        );
        if now == new {
            seen.1 += 1
        } else {
            seen.0 += 1
        }
    }
    eprintln!(
        "kills that left the old model: {}, the new: {}",
        seen.0, seen.1
    );
    // Unkilled, the export over a copy ends as the new model. (Whether a kill at 1.4x the
    // timed export still comes before the end depends on the machine's load: not asserted.)
    ok(&over_other);
    assert!(model_files(&other) == new, "an unkilled export over a copy");
}

/// BERT and ViT through `forward`: segments and padding, or images, from the input file; class
/// or span logits and every gradient as transformers computed them; training a task head on
/// text and generating with it are refused.
#[test]
fn bert_forward_gives_transformers_outputs_and_text_tasks_are_refused() {
    let dir = fresh_dir("models-bert");
    for (name, keys) in [
        ("bert-classify", vec!["logits"]),
        ("bert-qa", vec!["start_logits", "end_logits"]),
        ("vit", vec!["logits"]),
    ] {
        let model = fixture().with_file_name(name);
        let out = dir.join(format!("{name}.safetensors"));
        ok(&[
            "forward",
            "--model",
            model.to_str().unwrap(),
            "--input-ids",
            model.join("inputs.safetensors").to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--grads",
            "--stages",
            "2",
            "--microbatches",
            "2",
        ]);
        let (got, want) = (read(&out), read(&model.join("expected.safetensors")));
        for k in keys.iter().chain(&["loss"]) {
            let d = max_diff(&f32s(&got, k), &f32s(&want, k));
            assert!(d < 1e-5, "{name} {k} differs by {d}");
        }
        let grads: Vec<_> = want.keys().filter(|k| k.starts_with("grad.")).collect();
        for k in &grads {
            let d = max_diff(&f32s(&got, k), &f32s(&want, k));
            assert!(d < 1e-5, "{name} {k} differs by {d}");
        }
    }
    let bert = fixture().with_file_name("bert-classify");
    let o = pw(&[
        "train",
        "--model",
        bert.to_str().unwrap(),
        "--steps",
        "1",
        "--no-checkpoint",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("labelled"), "{err}");
    let o = pw(&[
        "generate",
        "--model",
        bert.to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.code() == Some(2) && err.contains("causal language model"),
        "{err}"
    );
}

/// A command's failure with exit 2 and `want` in its message.
fn exits_2_saying(o: &Output, want: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.code() == Some(2) && err.contains(want), "{err}");
}

/// Six text documents under `dir` turned into GPT-2 token shards (returned); the same command
/// again has nothing to do, another tokenizer over the shards and an empty data set are refused.
fn gpt2_shards(dir: &Path) -> PathBuf {
    let docs = dir.join("docs");
    std::fs::create_dir_all(&docs).unwrap();
    for i in 0..6 {
        let text = format!("document {i}: the pipeline cuts the model into stages. ").repeat(200);
        std::fs::write(docs.join(format!("d{i}.txt")), text).unwrap();
    }
    let shards = dir.join("shards");
    let (docs, shards_s) = (docs.to_str().unwrap(), shards.to_str().unwrap());
    let tokenize = ["tokenize", "--data", docs, "--out", shards_s];
    let out = ok(&[&tokenize[..], &["--tokenizer", "gpt2"]].concat());
    assert!(out.contains("6 file(s), 6 document(s), with gpt2"), "{out}");
    assert!(shards.join("val_000000.bin").is_file() && shards.join("train_000000.bin").is_file());
    assert!(ok(&tokenize).contains("already complete"));
    let o = pw(&[&tokenize[..], &["--tokenizer", "bytes"]].concat());
    exits_2_saying(&o, "tokenizer gpt2 (now bytes)");
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let nowhere = dir.join("nowhere");
    let o = pw(&[
        "tokenize",
        "--data",
        empty.to_str().unwrap(),
        "--out",
        nowhere.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "an empty data set");
    assert!(
        !nowhere.exists(),
        "nothing is written for an empty data set"
    );
    shards
}

/// Text to GPT-2 tokens in shards, a LLaMA trained on them as a pipeline, and text generated
/// back with the checkpoint's tokenizer; a tokenizer larger than the model's vocabulary, and
/// shards of an unfinished tokenize, are refused.
#[test]
fn tokenize_then_train_on_shards_then_generate() {
    let dir = fresh_dir("models-shards");
    let shards = gpt2_shards(&dir);
    let shards_s = shards.to_str().unwrap();
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "vocab_size": 50257, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 64}"#,
    )
    .unwrap();
    let (cfg, ck) = (cfg.to_str().unwrap(), dir.join("ck"));
    let ck = ck.to_str().unwrap();
    let train = [
        "train",
        "--model-config",
        cfg,
        "--tokenizer",
        "gpt2",
        "--data",
        shards_s,
        "--stages",
        "2",
        "--steps",
        "3",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
        "--checkpoint-dir",
        ck,
    ];
    ok(&train);
    // Shards of a tokenize that has not finished are not trained on.
    let manifest = shards.join("tokenize.json");
    let done = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(
        &manifest,
        done.replace("\"complete\": true", "\"complete\": false"),
    )
    .unwrap();
    let o = pw(&[
        "train",
        "--model-config",
        cfg,
        "--tokenizer",
        "gpt2",
        "--data",
        shards_s,
        "--steps",
        "1",
    ]);
    exits_2_saying(&o, "has not finished");
    std::fs::write(&manifest, done).unwrap();
    let text = ok(&[
        "generate",
        "--checkpoint-dir",
        ck,
        "--prompt",
        "the pipeline",
        "--max-tokens",
        "4",
    ]);
    assert!(
        text.starts_with("the pipeline") && text.len() > "the pipeline".len(),
        "{text:?}"
    );
    let small = dir.join("small.json");
    std::fs::write(
        &small,
        std::fs::read_to_string(cfg)
            .unwrap()
            .replace("50257", "1000"),
    )
    .unwrap();
    let o = pw(&[
        "train",
        "--model-config",
        small.to_str().unwrap(),
        "--tokenizer",
        "gpt2",
        "--data",
        shards_s,
        "--steps",
        "1",
        "--no-checkpoint",
    ]);
    exits_2_saying(&o, "past the model's vocabulary of 1000");
}

/// Fine-tuning for a text task: a LLaMA given a classification head learns an easy two-class
/// task from JSONL as a 2-stage pipeline, reports accuracy, exports as
/// `LlamaForSequenceClassification` and trains on from the export; bad labelled data is named
/// with its line and exits 2.
#[test]
fn llama_learns_to_classify_text_and_exports_a_classifier() {
    let dir = fresh_dir("models-classify");
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    // Digits against letters, of varied lengths (so rows are padded differently).
    let rows = |n: usize, skip: usize| -> String {
        (skip..skip + n)
            .map(|i| {
                let (text, label) = match i % 2 {
                    0 => (
                        "0123456789".repeat(1 + i % 3)[..3 + i % 7].to_string(),
                        "digits",
                    ),
                    _ => (
                        "abcdefghij".repeat(1 + i % 3)[..3 + i % 7].to_string(),
                        "letters",
                    ),
                };
                format!("{{\"text\": \"{text}\", \"label\": \"{label}\"}}\n")
            })
            .collect()
    };
    let (train, val) = (dir.join("train.jsonl"), dir.join("val.jsonl"));
    std::fs::write(&train, rows(64, 0)).unwrap();
    std::fs::write(&val, rows(16, 64)).unwrap();
    let (ck, metrics, hf) = (dir.join("ck"), dir.join("m.jsonl"), dir.join("hf"));
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let args = [
        "train",
        "--task",
        "classify",
        "--data",
        &s(&train),
        "--val-data",
        &s(&val),
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--rows",
        "4",
        "--seq-len",
        "16",
        "--steps",
        "30",
        "--eval-every",
        "10",
        "--metrics",
        &s(&metrics),
        "--checkpoint-dir",
        &s(&ck),
    ];
    let out = ok(&[&args[..], &["--model-config", &s(&cfg)]].concat());
    assert!(out.contains("accuracy"), "{out}");
    let acc: Vec<f64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["accuracy"].as_f64())
        .collect();
    assert!(
        acc.len() >= 3 && acc[acc.len() - 1] == 1.0,
        "accuracy {acc:?}"
    );
    ok(&["export", "--checkpoint-dir", &s(&ck), "--out", &s(&hf)]);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "LlamaForSequenceClassification");
    assert_eq!(config["num_labels"], 2);
    // The named labels, in class order.
    assert_eq!(config["id2label"]["0"], "digits");
    assert_eq!(config["label2id"]["letters"], 1);
    let weights = read(&hf.join("model.safetensors"));
    assert_eq!(weights["score.weight"].1, vec![2, 32]);
    assert!(!weights.contains_key("lm_head.weight"));
    // The export trains on as the classifier it is.
    let hf_dir = s(&hf);
    let again = [
        &args[..7],
        &["--model", &hf_dir, "--steps", "2", "--no-checkpoint"],
    ]
    .concat();
    let out = ok(&again);
    assert!(out.contains("accuracy 1.000 ->"), "{out}");
    // Fine-tuned from the export with a checkpoint: `eval` scores the checkpoint's weights,
    // the run's own last validation, not the directory it started from.
    let (ck2, m2) = (dir.join("ck2"), dir.join("m2.jsonl"));
    let (ck2_s, m2_s) = (s(&ck2), s(&m2));
    let tuned = [
        &args[..7],
        &["--model", &hf_dir, "--steps", "4", "--eval-every", "4"],
        &["--checkpoint-dir", &ck2_s, "--metrics", &m2_s],
    ]
    .concat();
    ok(&tuned);
    let last_val = std::fs::read_to_string(&m2)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["val_loss"].as_f64())
        .next_back()
        .unwrap();
    let eval = |model: &[&str]| -> serde_json::Value {
        let out = ok(&[&["eval", "--checkpoint-dir", &ck2_s, "--json"], model].concat());
        serde_json::from_str(out.lines().last().unwrap()).unwrap()
    };
    let of_ck = eval(&[]);
    let of_start = eval(&[&["--model", &hf_dir][..], &args[1..7]].concat());
    let (got, start) = (
        of_ck["val_loss"].as_f64().unwrap(),
        of_start["val_loss"].as_f64().unwrap(),
    );
    assert!(
        (got - last_val).abs() <= 1e-6 * last_val.abs(),
        "eval of the checkpoint {got} against the run's last validation {last_val}"
    );
    assert!(
        (got - start).abs() > 1e-4,
        "4 steps left the loss at {start}: the test cannot tell"
    );
    assert!(
        of_ck["checkpoint"].as_str().unwrap().contains("ck2"),
        "{of_ck}"
    );
    // The same records' texts, as documents to model (--task lm); a missing field is named.
    let lm = [
        "train",
        "--data",
        &s(&train),
        "--val-data",
        &s(&val),
        "--model-config",
        &s(&cfg),
        "--seq-len",
        "16",
        "--steps",
        "2",
        "--no-checkpoint",
    ];
    let out = ok(&lm);
    assert!(out.contains("val loss"), "{out}");
    let o = pw(&[&lm[..], &["--text-field", "body"]].concat());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.code() == Some(2) && err.contains("train.jsonl:1: no \"body\""),
        "{err}"
    );
    // Bad labelled data: one line, exit 2, the file and line named.
    for (text, want) in [
        (
            "{\"text\": \"12\", \"label\": \"digits\"}\n{\"text\": \"ab\"\n",
            "val.jsonl:2: not a JSON object",
        ),
        (
            "{\"text\": \"12\", \"label\": \"numbers\"}\n",
            "val.jsonl:1: label \"numbers\" is outside the classes (digits, letters)",
        ),
    ] {
        std::fs::write(&val, text).unwrap();
        let o = pw(&[&args[..], &["--model-config", &s(&cfg)]].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(want), "{err}");
    }
    // --num-labels that disagrees with the data, and a class with no training examples.
    std::fs::write(&val, rows(16, 64)).unwrap();
    let o = pw(&[
        &args[..],
        &["--model-config", &s(&cfg), "--num-labels", "3"],
    ]
    .concat());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--num-labels 3 disagrees with")
            && err.contains("its labels make 2 classes (digits, letters)"),
        "{err}"
    );
    std::fs::write(
        &train,
        "{\"text\": \"12\", \"label\": 0}\n{\"text\": \"ab\", \"label\": 2}\n",
    )
    .unwrap();
    std::fs::write(&val, "{\"text\": \"12\", \"label\": 0}\n").unwrap();
    let o = pw(&[&args[..], &["--model-config", &s(&cfg)]].concat());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("train.jsonl: class 1 of 0-2 has no training examples"),
        "{err}"
    );
}

/// Images in a folder per class fine-tune the ViT fixture (3 classes) for a new 2-class task:
/// its classifier starts fresh, the rest loads; bright squares against dark ones are learnt as
/// a 2-stage pipeline. An image that does not decode is named, exit 2.
#[test]
fn vit_fine_tunes_on_image_folders() {
    let dir = fresh_dir("models-images");
    let (train, val) = (dir.join("train"), dir.join("val"));
    let mut n = 0u32;
    for (root, count) in [(&train, 24), (&val, 8)] {
        for (class, base) in [("bright", 190u8), ("dark", 40u8)] {
            std::fs::create_dir_all(root.join(class)).unwrap();
            for i in 0..count {
                n += 1;
                // Sizes vary (resized to 16 x 16), some grey: both are converted.
                let side = 12 + (i % 3) * 6;
                let px = |x: u32, y: u32| base.wrapping_add(((x * 7 + y * 13 + n) % 50) as u8);
                let path = root.join(class).join(format!("{i}.png"));
                if i % 4 == 0 {
                    image::GrayImage::from_fn(side, side, |x, y| image::Luma([px(x, y)]))
                        .save(&path)
                        .unwrap();
                } else {
                    image::RgbImage::from_fn(side, side, |x, y| {
                        image::Rgb([px(x, y), px(y, x), px(x + 1, y)])
                    })
                    .save(&path)
                    .unwrap();
                }
            }
        }
    }
    let vit = fixture().with_file_name("vit");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let metrics = dir.join("m.jsonl");
    let args = [
        "train",
        "--model",
        &s(&vit),
        "--task",
        "classify",
        "--data",
        &s(&train),
        "--val-data",
        &s(&val),
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--rows",
        "4",
        "--steps",
        "24",
        "--eval-every",
        "12",
        "--lr",
        "1e-2",
        "--no-checkpoint",
        "--metrics",
        &s(&metrics),
    ];
    let out = ok(&args);
    let acc: Vec<f64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["accuracy"].as_f64())
        .collect();
    assert!(acc.len() == 3 && acc[2] == 1.0, "accuracy {acc:?}: {out}");
    std::fs::write(val.join("dark").join("broken.png"), b"not a png").unwrap();
    let o = pw(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("broken.png: not an image that decodes"),
        "{err}"
    );
}

/// Extractive question answering: a fresh BERT with a Hugging Face tokenizer learns to point at
/// the colour word in short contexts (SQuAD-format JSON) as a 2-stage pipeline; validation
/// reports exact match and F1; an answer not where `answer_start` says is named, exit 2.
#[test]
fn bert_learns_answer_spans_from_squad_json() {
    let dir = fresh_dir("models-qa");
    let words = [
        "the", "quick", "fox", "jumps", "over", "lazy", "dog", "stage", "pipeline",
    ];
    let colours = ["red", "green", "blue", "black", "white"];
    let squad = |n: usize, seed: usize| -> String {
        let mut data = Vec::new();
        for i in 0..n {
            let k = seed + i;
            let mut ws: Vec<&str> = (0..5 + k % 6).map(|j| words[(k * 7 + j * 3) % 9]).collect();
            let at = k % (ws.len() + 1);
            let c = colours[(k * 3) % 5];
            ws.insert(at, c);
            let ctx = ws.join(" ");
            let start = ws[..at].iter().map(|w| w.len() + 1).sum::<usize>();
            data.push(
                serde_json::json!({"title": "t", "paragraphs": [{"context": ctx,
                "qas": [{"id": k.to_string(), "question": "which colour?",
                         "answers": [{"text": c, "answer_start": start}]}]}]}),
            );
        }
        serde_json::json!({ "data": data }).to_string()
    };
    let (train, val, cfg) = (
        dir.join("train.json"),
        dir.join("val.json"),
        dir.join("bert.json"),
    );
    std::fs::write(&train, squad(200, 0)).unwrap();
    std::fs::write(&val, squad(40, 1000)).unwrap();
    std::fs::write(
        &cfg,
        r#"{"model_type": "bert", "architectures": ["BertForQuestionAnswering"], "vocab_size": 300,
            "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 64, "max_position_embeddings": 64}"#,
    )
    .unwrap();
    let tok = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../runtime/tests/fixtures/tokenizer/tokenizer.json");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let metrics = dir.join("m.jsonl");
    let args = [
        "train",
        "--model-config",
        &s(&cfg),
        "--tokenizer",
        &s(&tok),
        "--task",
        "qa",
        "--data",
        &s(&train),
        "--val-data",
        &s(&val),
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--rows",
        "4",
        "--seq-len",
        "32",
        "--steps",
        "100",
        "--eval-every",
        "50",
        "--no-checkpoint",
        "--metrics",
        &s(&metrics),
    ];
    let out = ok(&args);
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|r: &serde_json::Value| r["f1"].is_number())
        .collect();
    let (em, f1) = (
        rows[2]["accuracy"].as_f64().unwrap(),
        rows[2]["f1"].as_f64().unwrap(),
    );
    assert!(rows.len() == 3 && rows[0]["accuracy"] == 0.0, "{rows:?}");
    assert!(em >= 0.4 && f1 >= em, "exact match {em}, F1 {f1}: {out}");
    // The first answer's start gains a leading digit: past where its answer is.
    let shifted = squad(3, 7).replacen("\"answer_start\":", "\"answer_start\":9", 1);
    std::fs::write(&val, shifted).unwrap();
    let o = pw(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("is not at character"), "{err}");
}

/// CIFAR-10's binary files train the ViT fixture (32 x 32 images resized to its 16), the
/// directory's `test_batch.bin` held out; a file of broken records is named, exit 2.
#[test]
fn vit_trains_on_cifar_binary_files() {
    let dir = fresh_dir("models-cifar");
    let record = |label: u8, bright: bool| -> Vec<u8> {
        let v = if bright { 220u8 } else { 30u8 };
        std::iter::once(label)
            .chain((0..3072).map(|i| v.wrapping_add((i % 17) as u8)))
            .collect()
    };
    let batch = |n: usize| -> Vec<u8> {
        (0..n)
            .flat_map(|i| record((i % 2) as u8, i % 2 == 1))
            .collect()
    };
    std::fs::write(dir.join("data_batch_1.bin"), batch(32)).unwrap();
    std::fs::write(dir.join("test_batch.bin"), batch(8)).unwrap();
    let vit = fixture().with_file_name("vit");
    let args = [
        "train",
        "--model",
        vit.to_str().unwrap(),
        "--task",
        "classify",
        "--data",
        dir.to_str().unwrap(),
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--rows",
        "4",
        "--steps",
        "16",
        "--lr",
        "1e-2",
        "--no-checkpoint",
    ];
    let out = ok(&args);
    assert!(out.contains("-> 1.000"), "{out}");
    std::fs::write(dir.join("data_batch_2.bin"), vec![0u8; 3000]).unwrap();
    let o = pw(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("data_batch_2.bin: 3000 bytes"), "{err}");
}

/// `plan --model DIR` measures the model here, then plans it as `plan --profile` does; a
/// profile and a model at once, or `--rows` without a model, are refused.
#[test]
fn plan_measures_a_hugging_face_model_directory() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cluster = root.join("examples/local4.toml");
    let cluster = cluster.to_str().unwrap();
    let model = fixture();
    let model = model.to_str().unwrap();
    let o = pw(&[
        "plan",
        "--model",
        model,
        "--cluster",
        cluster,
        "--global-batch",
        "4",
        "--rows",
        "1",
        "--json",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("measured") && err.contains("on this machine"),
        "{err}"
    );
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let best = &j["candidates"][0];
    assert!(best["iteration_time"].as_f64().unwrap() > 0.0, "{j}");
    for (args, want) in [
        (
            vec![
                "plan",
                "--model",
                model,
                "--profile",
                "p.toml",
                "--cluster",
                cluster,
            ],
            "cannot be used with",
        ),
        (
            vec![
                "plan",
                "--profile",
                "p.toml",
                "--rows",
                "2",
                "--cluster",
                cluster,
            ],
            "--model",
        ),
    ] {
        let o = pw(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// `profile --ops` breaks a LLaMA block into its ops (the fused RMSNorm, rotary embedding and
/// SwiGLU beside burn's own ops for the same maths); a family without a breakdown is refused.
#[test]
fn profile_ops_breaks_down_a_llama_block() {
    let model = fixture();
    let o = pw(&[
        "profile",
        "--ops",
        "--model",
        model.to_str().unwrap(),
        "--rows",
        "1",
        "--repeats",
        "1",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for op in [
        "RMSNorm (fused)",
        "rotary embedding, q and k (fused)",
        "causal attention (fused, GQA in place)",
        "head split and merge",
        "SwiGLU (fused)",
        "whole block, run as one",
        "burn ops: silu(g) * u",
    ] {
        assert!(out.contains(op), "{out}");
    }
    // Training reads grouped keys and values in place; no op repeats them.
    assert!(!out.contains("repeated"), "{out}");
    let vit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/vit_digits.json");
    let o = pw(&["profile", "--ops", "--model-config", vit.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("gpt and llama"), "{err}");
}

/// `profile` (and `plan --model`) measure a bare encoder, a `BertModel` directory with no task
/// head, with a 2-class classifier, and say so; they refused the directory before.
#[test]
fn profile_measures_a_bare_encoder_with_a_classifier() {
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../runtime/tests/fixtures/hf/bert-classify");
    let dir = fresh_dir("models-bare-bert");
    let bare = dir.join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    let tensors: Tensors = read(&src.join("model.safetensors"))
        .into_iter()
        .filter(|(n, _)| !n.starts_with("classifier."))
        .map(|(n, t)| (n.strip_prefix("bert.").unwrap_or(&n).to_string(), t))
        .collect();
    write(&bare.join("model.safetensors"), &tensors);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["architectures"] = serde_json::json!(["BertModel"]);
    std::fs::write(bare.join("config.json"), config.to_string()).unwrap();
    let out = dir.join("p.toml");
    let args = [
        "profile",
        "--model",
        bare.to_str().unwrap(),
        "--seq-len",
        "8",
    ];
    let o = pw(&[
        &args[..],
        &["--repeats", "1", "--out", out.to_str().unwrap()],
    ]
    .concat());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("a bare bert encoder: measured with a 2-class classification head"),
        "{err}"
    );
    let profile = std::fs::read_to_string(&out).unwrap();
    assert_eq!(profile.matches("[[layers]]").count(), 5, "{profile}");
}

//! Hugging Face models against transformers' own numbers: the fixtures under
//! `tests/fixtures/hf/` (made by `scripts/hf-fixtures`) hold tiny random models saved by
//! `save_pretrained`, a batch, and the logits, loss and every parameter's gradient that
//! transformers computed on it. Pipelining a model must change none of them.

use pipewright_runtime::data::MicroBatch;
use pipewright_runtime::model::generate::{generate, Sampling};
use pipewright_runtime::model::hf::config_from_hf;
use pipewright_runtime::model::Family;
use pipewright_runtime::train::{hf_layers, hf_params, TrainConfig, Trainer};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// 1 stage; 2 and 4 stages of 1F1B; ZB-H1's split backward: (schedule, stages, micro-batches).
const PIPELINES: [(&str, usize, usize); 4] = [
    ("1f1b", 1, 1),
    ("1f1b", 2, 2),
    ("1f1b", 4, 1),
    ("zbh1", 2, 2),
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// name -> (shape, values as f64) of a safetensors file (F32 and I64 tensors).
fn read(path: &Path) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            let vals = match v.dtype() {
                safetensors::Dtype::F32 => v
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
                    .collect(),
                safetensors::Dtype::I64 => v
                    .data()
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f64)
                    .collect(),
                d => panic!("{n}: dtype {d:?}"),
            };
            (n, (v.shape().to_vec(), vals))
        })
        .collect()
}

/// Largest |a - b| relative to the reference's largest value; a reference below 1e-3 in all
/// its values (a gradient that cancels to rounding noise, as the last LayerNorm's bias under
/// a span head: each row's logit gradients sum to zero) is compared absolutely, at 1e-7.
fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0.0, f64::max)
        / scale
}

/// `out`'s loss and every gradient (under Hugging Face names) against the fixture's.
fn same_loss_and_gradients(
    what: &str,
    model: &pipewright_runtime::model::ModelConfig,
    trainer: &Trainer,
    out: &pipewright_runtime::train::BatchGradients,
    expected: &HashMap<String, (Vec<usize>, Vec<f64>)>,
) {
    let want_loss = expected["loss"].1[0];
    assert!(
        (out.loss - want_loss).abs() < 1e-4,
        "{what}: loss {} vs {want_loss}",
        out.loss
    );
    let grads = hf_params(model, &trainer.layer_blocks().unwrap(), Some(&out.grads));
    let want = expected.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(grads.len(), want, "{what}: gradient count");
    for (n, shape, g) in grads {
        let (wshape, w) = &expected[&format!("grad.{n}")];
        assert_eq!(&shape, wshape, "{what}: {n} shape");
        let e = rel_err(&g, w);
        assert!(e < 1e-4, "{what}: gradient of {n} differs by {e:.2e}");
    }
}

/// Run the fixture's batch on `stages` stages of `schedule` with `m` micro-batches and check
/// logits, loss and every gradient against transformers'.
fn check(name: &str, schedule: &str, stages: usize, m: usize) {
    let dir = fixture(name);
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let mut model = config_from_hf(&text, "config.json").unwrap();
    let inputs = read(&dir.join("inputs.safetensors"));
    let expected = read(&dir.join("expected.safetensors"));
    let (shape, ids) = &inputs["input_ids"];
    let (rows, t) = (shape[0], shape[1]);
    if model.family != Family::Gpt {
        model.seq_len = t; // gpt's learned positions fix its table's length
    }
    let cfg = TrainConfig {
        model: model.clone(),
        schedule: schedule.parse().unwrap(),
        stages,
        microbatches: m,
        rows: rows / m,
        pretrained: Some(dir.clone()),
        ..TrainConfig::default()
    };
    let plan = cfg.plan().unwrap();
    let mut trainer = Trainer::new(cfg, plan).unwrap();
    let ids: Vec<i64> = ids.iter().map(|&x| x as i64).collect();
    let labels: Vec<i64> = inputs["labels"].1.iter().map(|&x| x as i64).collect();
    let batch = MicroBatch::causal_lm(&ids, Some(&labels), rows, t);
    let out = trainer.batch_gradients(&batch.split(m).unwrap()).unwrap();
    let what = format!("{name} {schedule} P={stages} M={m}");
    let logits: Vec<f32> = out.logits.iter().flat_map(|(_, v)| v.clone()).collect();
    let e = rel_err(&logits, &expected["logits"].1);
    assert!(e < 1e-4, "{what}: logits differ by {e:.2e}");
    same_loss_and_gradients(&what, &model, &trainer, &out, &expected);
}

#[test]
fn llama_gqa_matches_transformers_on_every_pipeline() {
    for (schedule, p, m) in [
        ("1f1b", 1, 1),
        ("1f1b", 2, 2),
        ("1f1b", 4, 2),
        ("zbh1", 2, 2),
    ] {
        check("llama-gqa", schedule, p, m);
    }
}

#[test]
fn llama_tied_with_llama3_rope_matches_transformers() {
    for (schedule, p, m) in [("1f1b", 1, 1), ("1f1b", 2, 1), ("zbh1", 4, 2)] {
        check("llama-tied-llama3", schedule, p, m);
    }
}

#[test]
fn gpt2_matches_transformers_on_every_pipeline() {
    for (schedule, p, m) in PIPELINES {
        check("gpt2", schedule, p, m);
    }
}

/// pipewright's own GPT against the PyTorch code `export` writes beside it.
#[test]
fn gpt_matches_its_exported_pytorch_code_on_every_pipeline() {
    for (schedule, p, m) in PIPELINES {
        check("pipewright-gpt", schedule, p, m);
    }
}

#[test]
fn greedy_generation_matches_transformers() {
    for name in ["llama-gqa", "llama-tied-llama3", "gpt2", "pipewright-gpt"] {
        let dir = fixture(name);
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let model = config_from_hf(&text, "config.json").unwrap();
        let blocks = hf_layers(&model, &dir, 1).unwrap();
        let inputs = read(&dir.join("inputs.safetensors"));
        let prompt: Vec<i64> = inputs["input_ids"].1[..4]
            .iter()
            .map(|&x| x as i64)
            .collect();
        let want: Vec<i64> = read(&dir.join("expected.safetensors"))["generated"]
            .1
            .iter()
            .map(|&x| x as i64)
            .collect();
        let greedy = Sampling {
            temperature: 0.0,
            top_k: 0,
            seed: 0,
        };
        let got = generate(&blocks, &prompt, want.len(), model.max_positions(), &greedy).unwrap();
        assert_eq!(got, want, "{name}: greedy tokens after {prompt:?}");
    }
}

/// A task fixture's batch (BERT's, or a causal model's with a classification head) through
/// `stages` stages: class logits, or start and end logits, the loss and every gradient as
/// transformers computed them (segments and padding included).
fn check_task(name: &str, schedule: &str, stages: usize, m: usize) {
    check_task_padded(name, schedule, stages, m, false);
}

/// [`check_task`], each micro-batch padded only to its longest row when `trim`.
fn check_task_padded(name: &str, schedule: &str, stages: usize, m: usize, trim: bool) {
    let dir = fixture(name);
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let mut model = config_from_hf(&text, "config.json").unwrap();
    let inputs = read(&dir.join("inputs.safetensors"));
    let expected = read(&dir.join("expected.safetensors"));
    let ints = |k: &str| -> Vec<i64> {
        inputs
            .get(k)
            .map_or(Vec::new(), |v| v.1.iter().map(|&x| x as i64).collect())
    };
    let (rows, t) = (inputs["input_ids"].0[0], inputs["input_ids"].0[1]);
    model.seq_len = t;
    let qa = inputs.contains_key("start_positions");
    let (targets, per_row) = if qa {
        let (s, e) = (ints("start_positions"), ints("end_positions"));
        (s.iter().zip(&e).flat_map(|(a, b)| [*a, *b]).collect(), 2)
    } else {
        (ints("labels"), 1)
    };
    let batch = MicroBatch::labelled(
        &ints("input_ids"),
        &ints("token_type_ids"),
        &ints("attention_mask"),
        targets,
        per_row,
        t,
    );
    let cfg = TrainConfig {
        model: model.clone(),
        schedule: schedule.parse().unwrap(),
        stages,
        microbatches: m,
        rows: rows / m,
        pretrained: Some(dir.clone()),
        ..TrainConfig::default()
    };
    let mut trainer = Trainer::new(cfg.clone(), cfg.plan().unwrap()).unwrap();
    let mut parts = batch.split(m).unwrap();
    if trim {
        parts = parts.into_iter().map(MicroBatch::trim_padding).collect();
        // A row per micro-batch: the fixture's second row (6 tokens of 8) is cut to 6.
        assert!(
            m < rows || parts.iter().any(|b| b.seq_len < t),
            "{name}: nothing cut"
        );
    }
    let out = trainer.batch_gradients(&parts).unwrap();
    let what = format!("{name} {schedule} P={stages} M={m} trimmed {trim}");
    let logits: Vec<f32> = out.logits.iter().flat_map(|(_, v)| v.clone()).collect();
    let outputs: Vec<(&str, Vec<f32>)> = if qa {
        let row = |k: usize| -> Vec<f32> {
            logits
                .chunks(2 * t)
                .flat_map(|r| r[k * t..(k + 1) * t].to_vec())
                .collect()
        };
        vec![("start_logits", row(0)), ("end_logits", row(1))]
    } else {
        vec![("logits", logits)]
    };
    for (k, v) in outputs {
        let e = rel_err(&v, &expected[k].1);
        assert!(e < 1e-4, "{what}: {k} differ by {e:.2e}");
    }
    same_loss_and_gradients(&what, &model, &trainer, &out, &expected);
}

#[test]
fn bert_classification_and_qa_match_transformers_on_every_pipeline() {
    for name in ["bert-classify", "bert-qa"] {
        for (schedule, p, m) in PIPELINES {
            check_task(name, schedule, p, m);
        }
    }
    // Micro-batches padded only to their longest row give transformers' logits, loss and
    // gradients on the batch padded to its full length (padding is masked, and a class is
    // read at [CLS]).
    for (schedule, p, m) in PIPELINES {
        check_task_padded("bert-classify", schedule, p, m, true);
    }
}

/// LLaMA and GPT-2 with a classification head (transformers' `*ForSequenceClassification`):
/// the class read at each row's last real token, on right-padded rows.
#[test]
fn causal_classifiers_match_transformers_on_every_pipeline() {
    for name in ["llama-classify", "gpt2-classify"] {
        for (schedule, p, m) in PIPELINES {
            check_task(name, schedule, p, m);
        }
    }
}

/// ViT: images through the patch embedding, class logits, loss and every gradient (the patch
/// convolution's included) as transformers computed them.
#[test]
fn vit_matches_transformers_on_every_pipeline() {
    let dir = fixture("vit");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let model = config_from_hf(&text, "config.json").unwrap();
    let inputs = read(&dir.join("inputs.safetensors"));
    let expected = read(&dir.join("expected.safetensors"));
    let (shape, pixels) = &inputs["pixel_values"];
    let labels: Vec<i64> = inputs["labels"].1.iter().map(|&x| x as i64).collect();
    let pixels: Vec<f32> = pixels.iter().map(|&x| x as f32).collect();
    let image = [shape[1], shape[2], shape[3]];
    let batch = MicroBatch::images(pixels, image, labels, model.seq_len);
    for (schedule, p, m) in PIPELINES {
        let what = format!("vit {schedule} P={p} M={m}");
        let cfg = TrainConfig {
            model: model.clone(),
            schedule: schedule.parse().unwrap(),
            stages: p,
            microbatches: m,
            rows: batch.rows / m,
            pretrained: Some(dir.clone()),
            ..TrainConfig::default()
        };
        let mut trainer = Trainer::new(cfg.clone(), cfg.plan().unwrap()).unwrap();
        let out = trainer.batch_gradients(&batch.split(m).unwrap()).unwrap();
        let logits: Vec<f32> = out.logits.iter().flat_map(|(_, v)| v.clone()).collect();
        let e = rel_err(&logits, &expected["logits"].1);
        assert!(e < 1e-4, "{what}: logits differ by {e:.2e}");
        same_loss_and_gradients(&what, &model, &trainer, &out, &expected);
    }
}

/// What `export` writes as config.json reads back as the same model, for every family.
#[test]
fn exported_configs_read_back_as_the_same_model() {
    use pipewright_runtime::model::hf::config_to_hf;
    for name in [
        "llama-gqa",
        "llama-tied-llama3",
        "gpt2",
        "bert-classify",
        "bert-qa",
        "vit",
        "llama-classify",
        "gpt2-classify",
        "pipewright-gpt",
    ] {
        let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
        let model = config_from_hf(&text, name).unwrap();
        let out = config_to_hf(&model).unwrap().to_string();
        let back = config_from_hf(&out, name).unwrap();
        assert!(
            model.same_parameters(&back) && model.head == back.head,
            "{name}: {model:?} became {back:?}"
        );
    }
}

/// A fresh model of every family starts with its norms at the identity (weights 1, biases 0),
/// as transformers initialises them: ViT's `layernorm_before`/`_after` once drew random
/// weights near zero, and a fresh ViT on the digits learnt at a third of the speed.
#[test]
fn fresh_models_start_with_identity_norms() {
    use pipewright_runtime::model::Layers;
    for name in ["llama-gqa", "gpt2", "bert-classify", "vit"] {
        let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
        let cfg = config_from_hf(&text, name).unwrap();
        let layers = Layers::new(&cfg, 7, &pipewright_runtime::backend::train_device());
        let params = hf_params(&cfg, &layers.blocks, None);
        let norms: Vec<_> = params
            .iter()
            .filter(|(n, ..)| n.to_lowercase().contains("norm") || n.contains("ln_"))
            .collect();
        assert!(norms.len() >= 2 * cfg.layers, "{name}: {norms:?}");
        for (n, _, v) in norms {
            let want = if n.ends_with("bias") { 0.0 } else { 1.0 };
            assert!(v.iter().all(|&x| x == want), "{name}: {n} starts at {v:?}");
        }
    }
}

/// A config field of the wrong JSON type is refused by name, not read as its default: a
/// `tie_word_embeddings = "yes"` once trained an untied model, and `rope_scaling = "x"` plain
/// rotary positions.
#[test]
fn ill_typed_config_fields_are_refused_by_name() {
    let text = std::fs::read_to_string(fixture("llama-gqa").join("config.json")).unwrap();
    let mut base: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut v = base.clone();
    v["rope_parameters"] = serde_json::json!("x");
    let err = config_from_hf(&v.to_string(), "c.json")
        .unwrap_err()
        .to_string();
    assert!(err.contains("rope_parameters must be an object"), "{err}");
    // Older configs: rope_theta and rope_scaling at the top level.
    base.as_object_mut().unwrap().remove("rope_parameters");
    for (key, value, says) in [
        (
            "tie_word_embeddings",
            serde_json::json!("yes"),
            "tie_word_embeddings must be true or false",
        ),
        (
            "rope_scaling",
            serde_json::json!("x"),
            "rope_scaling must be an object",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": 3}),
            "rope_type must be a string",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8}),
            "factor 0.5",
        ),
    ] {
        let mut v = base.clone();
        v[key] = value;
        let err = config_from_hf(&v.to_string(), "c.json")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("c.json: ") && err.contains(says),
            "{key}: {err}"
        );
    }
    let err = config_from_hf("[1, 2]", "c.json").unwrap_err().to_string();
    assert!(err.contains("found an array"), "{err}");
    let mut gpt2 = serde_json::from_str::<serde_json::Value>(
        &std::fs::read_to_string(fixture("gpt2").join("config.json")).unwrap(),
    )
    .unwrap();
    gpt2["tie_word_embeddings"] = serde_json::json!(1);
    let err = config_from_hf(&gpt2.to_string(), "c.json")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tie_word_embeddings must be true or false, found 1"),
        "{err}"
    );
}

/// A bare `BertModel` directory (names without `bert.`, an I64 `position_ids` buffer, no
/// classifier; the pooler kept or not) with the encoder of the `bert-classify` fixture.
fn bare_bert(with_pooler: bool) -> tempfile::TempDir {
    let src = fixture("bert-classify");
    let dir = tempfile::tempdir().unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["architectures"] = serde_json::json!(["BertModel"]);
    for k in ["id2label", "label2id"] {
        cfg.as_object_mut().unwrap().remove(k);
    }
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut kept: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n.starts_with("bert.") && (with_pooler || !n.contains("pooler")))
        .map(|(n, v)| (n["bert.".len()..].to_string(), v))
        .collect();
    let ids: Vec<u8> = (0..64i64).flat_map(|i| i.to_le_bytes()).collect();
    kept.push((
        "embeddings.position_ids".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![1, 64], &ids).unwrap(),
    ));
    let out = safetensors::serialize(kept, None).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), out).unwrap();
    dir
}

/// A bare encoder takes its task's head fresh from the seed (as transformers'
/// `BertForSequenceClassification.from_pretrained` of a `BertModel`: N(0, 0.02) matrices, zero
/// biases) and every encoder weight as saved; its pooler is pretrained when the directory
/// has one, else fresh too. The index buffer is passed over by name.
#[test]
fn a_bare_bert_gets_a_fresh_head_and_keeps_its_encoder() {
    use pipewright_runtime::model::TaskHead;
    let full = fixture("bert-classify");
    let text = std::fs::read_to_string(full.join("config.json")).unwrap();
    let reference = config_from_hf(&text, "bert-classify").unwrap();
    let want = hf_params(&reference, &hf_layers(&reference, &full, 1).unwrap(), None);
    for with_pooler in [true, false] {
        let dir = bare_bert(with_pooler);
        let text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
        let bare = config_from_hf(&text, "bare").unwrap();
        assert_eq!(bare.head, None, "a BertModel has no head");
        let model = bare.with_head(Some(TaskHead::Classify { classes: 5 }));
        let (blocks, fresh) = pipewright_runtime::train::hf_start(&model, dir.path(), 9).unwrap();
        let pooler = if with_pooler { 0 } else { 2 };
        assert_eq!(fresh.len(), 2 + pooler, "{fresh:?}");
        assert!(fresh.iter().all(|n| n.starts_with("head.")), "{fresh:?}");
        let got = hf_params(&model, &blocks, None);
        for (name, shape, v) in &got {
            let fresh_here = name.starts_with("classifier.")
                || (!with_pooler && name.starts_with("bert.pooler."));
            if fresh_here {
                if name.ends_with("bias") {
                    assert!(v.iter().all(|&x| x == 0.0), "{name}");
                } else {
                    let n = v.len() as f64;
                    let sd = (v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / n).sqrt();
                    assert!((0.012..0.028).contains(&sd), "{name}: std {sd}");
                }
                continue;
            }
            let (_, s, w) = want.iter().find(|(n, ..)| n == name).expect(name);
            assert_eq!((shape, v), (s, w), "{name} differs from the saved encoder");
        }
        assert_eq!(
            got.iter()
                .filter(|(n, ..)| n.starts_with("classifier."))
                .count(),
            2
        );
        // The same seed, the same head.
        let (again, _) = pipewright_runtime::train::hf_start(&model, dir.path(), 9).unwrap();
        assert_eq!(hf_params(&model, &again, None), got);
    }
}

/// A fresh head's spread: transformers' 0.02 by default, the config's when it is a number in
/// (0, 1], else refused by name (a negative one drew a head of std 1 and a loss of 9).
#[test]
fn initializer_range_is_read_checked() {
    use pipewright_runtime::model::hf::initializer_range;
    assert_eq!(initializer_range("{}", "c").unwrap(), 0.02);
    assert_eq!(
        initializer_range(r#"{"initializer_range": 0.05}"#, "c").unwrap(),
        0.05
    );
    for bad in ["-1", "0", "1e300", "\"x\""] {
        let e = initializer_range(&format!(r#"{{"initializer_range": {bad}}}"#), "c")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("c: initializer_range"), "{bad}: {e}");
    }
}

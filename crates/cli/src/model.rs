//! Models users bring: `--model DIR` / `--model-config FILE` on the commands that build a
//! model, and `export`, `forward` and `generate`.

use crate::files::{check_output, write_with};
use crate::BadInput;
use anyhow::{Context, Result};
use clap::Args;
use pipewright_core::schedule::ScheduleKind;
use pipewright_runtime::data::tokenizer::Tokenizer;
use pipewright_runtime::data::MicroBatch;
use pipewright_runtime::model::hf::{config_from_hf, config_to_hf};
use pipewright_runtime::model::{ModelConfig, TaskHead};
use pipewright_runtime::train::{checkpoint_config, hf_layers, hf_params, TrainConfig, Trainer};
use std::path::{Path, PathBuf};

/// The run's tokenizer: `cfg.tokenizer`, else the pretrained model directory's
/// tokenizer.json, else bytes.
pub fn tokenizer(cfg: &TrainConfig) -> Result<Tokenizer> {
    Ok(Tokenizer::for_run(
        cfg.tokenizer.as_deref(),
        cfg.pretrained.as_deref(),
    )?)
}

/// Which model: a Hugging Face directory, a Hugging Face config for fresh weights, or (no
/// flag) the command's default.
#[derive(Args, Clone, Default)]
pub struct ModelArgs {
    /// A Hugging Face model directory (config.json and model.safetensors or a sharded
    /// model.safetensors.index.json): its architecture and weights. A model TOML file
    /// (family, vocab, d_model, heads, layers, seq_len, ...) is taken too, or a run's
    /// configuration (what `train --config` takes) for its [model].
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// A fresh model (weights from --seed) of a Hugging Face config.json's architecture.
    #[arg(long, value_name = "FILE", conflicts_with = "model")]
    pub model_config: Option<PathBuf>,
}

/// A model chosen on the command line: its shape, and the directory of its weights if it
/// comes with them.
pub struct Chosen {
    pub config: ModelConfig,
    pub weights: Option<PathBuf>,
}

impl ModelArgs {
    /// The model these flags name, if they name one.
    pub fn resolve(&self) -> Result<Option<Chosen>> {
        if let Some(f) = &self.model_config {
            let text = pipewright_core::inputs::read_file(f)?;
            let config = config_from_hf(&text, &f.display().to_string())?;
            return Ok(Some(Chosen {
                config,
                weights: None,
            }));
        }
        let Some(p) = &self.model else {
            return Ok(None);
        };
        if p.is_dir() {
            let cj = p.join("config.json");
            let text = pipewright_core::inputs::read_file(&cj)?;
            let config = config_from_hf(&text, &cj.display().to_string())?;
            return Ok(Some(Chosen {
                config,
                weights: Some(p.clone()),
            }));
        }
        let text = pipewright_core::inputs::read_file(p)?;
        if text.trim_start().starts_with('{') {
            // A Hugging Face config.json alone: --model-config takes that.
            return Err(BadInput(format!(
                "--model {}: a JSON file; --model takes a Hugging Face model directory or a model TOML (for a config.json alone, use --model-config)",
                p.display()
            ))
            .into());
        }
        // A model table, or a whole run's configuration (`train --config`), whose [model] it is.
        let name = p.display().to_string();
        let whole = text.lines().any(|l| l.trim() == "[model]");
        let config = match whole {
            true => pipewright_core::error::parse_toml::<TrainConfig>(&name, &text)?.model,
            false => pipewright_core::error::parse_toml::<ModelConfig>(&name, &text)?,
        };
        config
            .check()
            .map_err(|e| BadInput(format!("{}: {e}", p.display())))?;
        Ok(Some(Chosen {
            config,
            weights: None,
        }))
    }
}

#[derive(Args)]
pub struct ExportArgs {
    /// Checkpoint directory of a `train` run (its newest checkpoint that verifies).
    #[arg(long, default_value = "checkpoints")]
    checkpoint_dir: PathBuf,
    /// Directory to write config.json and model.safetensors into (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// Replace the model a directory already holds (its weights, config and shards; its other
    /// files, a tokenizer say, stay). The directory the run read its weights from is never
    /// replaced.
    #[arg(long)]
    overwrite: bool,
}

/// Files of a Hugging Face model directory that describe its model: what `export` writes,
/// and what a model beside them would mix with.
fn is_model_file(name: &str) -> bool {
    name == "config.json"
        || name.ends_with(".safetensors")
        || name == "model.safetensors.index.json"
        || name.starts_with("pytorch_model")
}

/// Refuse an `export --out` that would replace what the user did not ask to: the model the
/// run was fine-tuned from, the checkpoint directory, or (without --overwrite) any model.
fn check_export_dir(a: &ExportArgs, source: Option<&Path>) -> Result<()> {
    let out = &a.out;
    let refuse = |why: String| -> Result<()> {
        Err(BadInput(format!("--out {}: {why}", out.display())).into())
    };
    if out.exists() && !out.is_dir() {
        return refuse("exists and is not a directory".into());
    }
    if let Some(src) = source.filter(|s| crate::files::same_file(s, out)) {
        return refuse(format!(
            "is {}, the model this checkpoint's run was fine-tuned from; export elsewhere (it is never replaced)",
            src.display()
        ));
    }
    let inside = |d: &Path| {
        let (o, d) = (out.canonicalize(), d.canonicalize());
        matches!((o, d), (Ok(o), Ok(d)) if o.starts_with(&d) || d.starts_with(&o))
    };
    if inside(&a.checkpoint_dir) {
        return refuse("holds, or is inside, the checkpoint directory; export elsewhere".into());
    }
    let Ok(entries) = std::fs::read_dir(out) else {
        return Ok(());
    };
    let mut model = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !e.file_type().is_ok_and(|t| t.is_file()) {
            return refuse(format!(
                "holds {name}, which is not a regular file; export into a new or empty directory"
            ));
        }
        if is_model_file(&name) {
            model.push(name);
        }
    }
    model.sort();
    match model.is_empty() || a.overwrite {
        true => Ok(()),
        false => refuse(format!(
            "already holds a model ({}); pass --overwrite to replace it, or export into a new directory",
            model.join(", ")
        )),
    }
}

/// Tokenizer files of a pretrained directory that describe how transformers sets its
/// tokenizer up (copied beside the run's tokenizer.json when the run read with that one).
const TOKENIZER_SIDE_FILES: &[&str] = &[
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
];

/// Files to write beside the model: (name, bytes).
type SideFiles = Vec<(String, Vec<u8>)>;

/// The files besides the model that `export` writes: the run's tokenizer as tokenizer.json
/// (with the pretrained directory's tokenizer_config.json and the like when the run used its
/// tokenizer, else a config naming the fast tokenizer), and generation_config.json for a
/// causal model. A tokenizer with no tokenizer.json (cl100k) is said in the note.
fn side_files(cfg: &TrainConfig, config: &serde_json::Value) -> Result<(SideFiles, String)> {
    // A tokenizer that cannot be read now (a model directory since moved) is no reason to
    // withhold the model: the note says so.
    let tok = match tokenizer(cfg) {
        Ok(t) => t,
        Err(e) => return Ok((Vec::new(), format!("; no tokenizer written ({e})"))),
    };
    let mut files = Vec::new();
    let note = match pipewright_runtime::data::tokenizer_json::tokenizer_json(&tok)? {
        None => format!(
            "; no tokenizer.json for {} (keep the tokenizer beside it)",
            tok.name()
        ),
        Some(json) => {
            files.push(("tokenizer.json".to_string(), json.into_bytes()));
            let from_dir = cfg
                .tokenizer
                .is_none()
                .then_some(cfg.pretrained.as_deref())
                .flatten();
            let side: Vec<_> = from_dir
                .map(|d| {
                    TOKENIZER_SIDE_FILES
                        .iter()
                        .map(|f| d.join(f))
                        .filter(|p| p.is_file())
                        .collect()
                })
                .unwrap_or_default();
            for p in &side {
                let bytes =
                    std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?;
                files.push((p.file_name().unwrap().to_string_lossy().into_owned(), bytes));
            }
            if side.is_empty() {
                let mut tc = serde_json::json!({
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "model_max_length": cfg.model.max_positions(),
                });
                if tok.eot().is_some() {
                    tc["eos_token"] = "<|endoftext|>".into();
                    tc["bos_token"] = "<|endoftext|>".into();
                }
                files.push((
                    "tokenizer_config.json".into(),
                    (serde_json::to_string_pretty(&tc)? + "\n").into_bytes(),
                ));
            }
            format!("; tokenizer {}", tok.name())
        }
    };
    let causal = config["architectures"].as_array().is_some_and(|a| {
        a.iter().any(|x| {
            x.as_str()
                .is_some_and(|n| n.ends_with("CausalLM") || n.ends_with("LMHeadModel"))
        })
    });
    if causal {
        let id = |k: &str| config.get(k).filter(|v| !v.is_null()).cloned();
        let eot = tok.eot().map(serde_json::Value::from);
        let gc = serde_json::json!({
            "bos_token_id": id("bos_token_id").or(eot.clone()),
            "eos_token_id": id("eos_token_id").or(eot),
            "max_length": cfg.model.max_positions(),
        });
        files.push((
            "generation_config.json".into(),
            (serde_json::to_string_pretty(&gc)? + "\n").into_bytes(),
        ));
    }
    Ok((files, note))
}

/// `export`: a checkpoint, whatever plan trained it, as a Hugging Face model directory.
pub fn cmd_export(a: ExportArgs) -> Result<()> {
    let (mut cfg, _, step) = checkpoint_config(&a.checkpoint_dir)?;
    let config = config_to_hf(&cfg.model)?;
    check_export_dir(&a, cfg.pretrained.as_deref())?;
    let (mut side, note) = side_files(&cfg, &config)?;
    let code = pipewright_runtime::model::hf::code_files(&cfg.model);
    side.extend(
        code.iter()
            .map(|(f, text)| (f.to_string(), text.as_bytes().to_vec())),
    );
    // The weights alone: one worker holds every layer block.
    (cfg.stages, cfg.replicas, cfg.chunks, cfg.pretrained) = (1, 1, 1, None);
    let plan = cfg.plan()?;
    let mut trainer = Trainer::new(cfg.clone(), plan)?;
    let loaded = trainer.load_checkpoint(&a.checkpoint_dir)?;
    let params = hf_params(&cfg.model, &trainer.layer_blocks()?, None);
    let n: usize = params.iter().map(|(_, _, v)| v.len()).sum();
    let text = serde_json::to_string_pretty(&config).expect("json") + "\n";
    // The model's files are written whole into a new directory that then takes --out's
    // place; the old directory's other files (a tokenizer, a README) are carried over.
    crate::files::replace_dir(
        &a.out,
        |name| !is_model_file(name) && !side.iter().any(|(f, _)| f == name),
        |dir| {
            let bytes = safetensors_bytes(
                &dir.join("model.safetensors"),
                params.into_iter().map(|(k, s, v)| (k, s, F32(v))).collect(),
            )?;
            std::fs::write(dir.join("model.safetensors"), bytes)?;
            std::fs::write(dir.join("config.json"), text)?;
            for (name, bytes) in &side {
                std::fs::write(dir.join(name), bytes)?;
            }
            Ok(())
        },
    )?;
    println!(
        "exported {} (step {step}): {} model, {n} parameters{note}, to {}",
        loaded.path.display(),
        cfg.model.family.name(),
        a.out.display()
    );
    Ok(())
}

/// Tensor values to write.
pub enum Values {
    F32(Vec<f32>),
}
use Values::F32;

/// Write named tensors as one safetensors file (atomically, as every output).
pub fn write_safetensors(path: &Path, tensors: Vec<(String, Vec<usize>, Values)>) -> Result<()> {
    let bytes = safetensors_bytes(path, tensors)?;
    write_with(path, |w| w.write_all(&bytes))
}

/// Named tensors as the bytes of a safetensors file (`path` names it in errors).
fn safetensors_bytes(path: &Path, tensors: Vec<(String, Vec<usize>, Values)>) -> Result<Vec<u8>> {
    let entries: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(k, s, v)| match v {
            F32(v) => (
                k,
                safetensors::Dtype::F32,
                s,
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
        })
        .collect();
    let views = entries
        .iter()
        .map(|(n, dt, shape, b)| {
            safetensors::tensor::TensorView::new(*dt, shape.clone(), b).map(|v| (n.clone(), v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    safetensors::serialize(views, None).map_err(|e| anyhow::anyhow!("{e}"))
}

#[derive(Args)]
pub struct ForwardArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Checkpoint directory of a `train` run (instead of --model).
    #[arg(long, conflicts_with_all = ["model", "model_config"])]
    checkpoint_dir: Option<PathBuf>,
    /// safetensors file with `input_ids` [batch, seq] (I64 or I32) and optionally `labels`
    /// (same shape; -100 leaves a position out of the loss; default: the input ids).
    #[arg(long, value_name = "FILE")]
    input_ids: PathBuf,
    /// safetensors file to write: `logits` [batch, seq, vocab], `loss`, and with --grads
    /// `grad.<Hugging Face name>` of every parameter.
    #[arg(long)]
    out: PathBuf,
    /// Also write every parameter's gradient of the loss.
    #[arg(long)]
    grads: bool,
    /// Pipeline depth of the plan the batch runs through.
    #[arg(long, default_value_t = 2)]
    stages: usize,
    /// Pipeline schedule.
    #[arg(long, value_enum, default_value = "1f1b")]
    schedule: ScheduleKind,
    /// Micro-batches the batch is split into (must divide its rows; default: one per row).
    #[arg(long)]
    microbatches: Option<usize>,
    /// Seed of fresh weights (with --model-config).
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

/// `forward`: one batch through a pipeline plan; logits, loss and gradients to a file.
pub fn cmd_forward(a: ForwardArgs) -> Result<()> {
    let (mut model, weights) = match (&a.checkpoint_dir, a.model.resolve()?) {
        (Some(dir), _) => (checkpoint_config(dir)?.0.model, None),
        (None, Some(c)) => (c.config, c.weights),
        (None, None) => {
            return Err(BadInput(
                "forward needs --model DIR, --model-config FILE or --checkpoint-dir DIR".into(),
            )
            .into())
        }
    };
    check_output(&a.out)?;
    let (batch, rows, t) = read_batch(&a.input_ids, &model)?;
    let no_targets = batch.targets.iter().all(|&x| x < 0);
    if t > model.max_positions() {
        return Err(BadInput(format!(
            "{}: sequences of {t} tokens; the model takes at most {}",
            a.input_ids.display(),
            model.max_positions()
        ))
        .into());
    }
    if model.family != pipewright_runtime::model::Family::Gpt {
        model.seq_len = t; // gpt's learned positions fix its length; rotary ones do not
    }
    let m = a.microbatches.unwrap_or(rows);
    let parts = batch
        .split(m)
        .map_err(|e| BadInput(format!("--microbatches {m}: {e}")))?;
    let cfg = TrainConfig {
        model: model.clone(),
        schedule: a.schedule,
        chunks: a.schedule.default_chunks(),
        stages: a.stages,
        microbatches: m,
        rows: rows / m,
        seed: a.seed,
        pretrained: weights,
        ..TrainConfig::default()
    };
    let plan = cfg.plan()?;
    let mut trainer = Trainer::new(cfg, plan)?;
    if let Some(dir) = &a.checkpoint_dir {
        trainer.load_checkpoint(dir)?;
    }
    let out = trainer.batch_gradients(&parts)?;
    let logits: Vec<f32> = out.logits.into_iter().flat_map(|(_, v)| v).collect();
    let mut tensors = head_outputs(&model, logits, rows, t);
    tensors.push(("loss".to_string(), vec![], F32(vec![out.loss as f32])));
    if a.grads {
        let blocks = trainer.layer_blocks()?;
        for (k, s, v) in hf_params(&model, &blocks, Some(&out.grads)) {
            tensors.push((format!("grad.{k}"), s, F32(v)));
        }
    }
    write_safetensors(&a.out, tensors)?;
    if no_targets {
        // transformers gives no loss (or NaN) here; say why ours is 0.
        println!(
            "note: {} has no targets (none given, or all -100), so the loss and every gradient are 0",
            a.input_ids.display()
        );
    }
    println!(
        "loss {:.6} over {rows} x {t} tokens on {} stage(s) ({}); wrote {}",
        out.loss,
        a.stages,
        a.schedule.name(),
        a.out.display()
    );
    Ok(())
}

/// A regular file's bytes (a FIFO or directory is refused, not waited on).
fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    let bad = |m: String| BadInput(format!("{}: {m}", path.display()));
    match pipewright_core::inputs::regular_file(path) {
        Ok(_) => Ok(std::fs::read(path).map_err(|e| bad(format!("cannot read: {e}")))?),
        Err(e) => Err(BadInput(e.to_string()).into()),
    }
}

/// The integer tensors of an input file (I64 or I32), by name.
type Ints = std::collections::HashMap<String, (Vec<usize>, Vec<i64>)>;

fn read_ints(path: &Path) -> Result<Ints> {
    let bytes = read_bytes(path)?;
    let bad = |m: String| BadInput(format!("{}: {m}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("not a valid safetensors file ({e})")))?;
    let mut out = Ints::new();
    for (name, v) in st.tensors() {
        let vals: Vec<i64> = match v.dtype() {
            safetensors::Dtype::F32 if name == "pixel_values" => continue,
            safetensors::Dtype::I64 => v
                .data()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect(),
            safetensors::Dtype::I32 => v
                .data()
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64)
                .collect(),
            d => {
                return Err(bad(format!(
                    "{name} has dtype {d:?}; I64 or I32 values are needed"
                ))
                .into())
            }
        };
        out.insert(name, (v.shape().to_vec(), vals));
    }
    Ok(out)
}

/// Tensor `name` of the input file with shape `shape`, each value in `ok` (named in errors by
/// `what`); `None` if the file has no such tensor.
fn checked(
    ints: &Ints,
    path: &Path,
    name: &str,
    shape: &[usize],
    ok: impl Fn(i64) -> bool,
    what: &str,
) -> Result<Option<Vec<i64>>> {
    let Some((s, v)) = ints.get(name) else {
        return Ok(None);
    };
    let bad = |m: String| BadInput(format!("{}: {name} {m}", path.display()));
    if s != shape {
        return Err(bad(format!("has shape {s:?}; {shape:?} is needed")).into());
    }
    if let Some(x) = v.iter().find(|&&x| !ok(x)) {
        return Err(bad(format!("holds {x}: {what}")).into());
    }
    Ok(Some(v.clone()))
}

/// The batch of a `--input-ids` file for `model`: ids, BERT's token types and padding, and
/// the targets its head learns (next tokens, a class per row, or an answer's start and end).
fn read_batch(path: &Path, model: &ModelConfig) -> Result<(MicroBatch, usize, usize)> {
    let ints = read_ints(path)?;
    let bad = |m: String| BadInput(format!("{}: {m}", path.display()));
    if model.family == pipewright_runtime::model::Family::Vit {
        return read_images(path, &ints, model);
    }
    let shape = ints
        .get("input_ids")
        .ok_or_else(|| bad("no input_ids tensor".into()))?
        .0
        .clone();
    let [rows, t] = shape[..] else {
        return Err(bad(format!(
            "input_ids has shape {shape:?}; [batch, seq] is needed"
        ))
        .into());
    };
    if rows == 0 || t < 2 {
        return Err(bad(format!(
            "input_ids has shape {shape:?}: needs a row of at least 2 tokens"
        ))
        .into());
    }
    let v = model.vocab as i64;
    let token = |x: i64| (0..v).contains(&x);
    let ids = checked(
        &ints,
        path,
        "input_ids",
        &shape,
        token,
        &format!("outside the vocabulary 0-{}", v.saturating_sub(1)),
    )?
    .expect("present");
    let bert = model.family == pipewright_runtime::model::Family::Bert;
    let types = checked(
        &ints,
        path,
        "token_type_ids",
        &shape,
        |x| (0..model.type_vocab() as i64).contains(&x),
        "outside the token types",
    )?;
    let mask = checked(
        &ints,
        path,
        "attention_mask",
        &shape,
        |x| x == 0 || x == 1,
        "a mask is 0 or 1",
    )?;
    if !bert && (types.is_some() || mask.as_ref().is_some_and(|m| m.contains(&0))) {
        return Err(bad(format!(
            "token_type_ids and padding are bert inputs; a {} model takes neither",
            model.family.name()
        ))
        .into());
    }
    let (types, mask) = (types.unwrap_or_default(), mask.unwrap_or_default());
    let batch = with_targets(&ints, path, model, (&ids, &types, &mask), (rows, t))?;
    Ok((batch, rows, t))
}

/// A ViT batch: `pixel_values` `[batch, channels, image, image]` (F32) and class `labels`.
fn read_images(
    path: &Path,
    ints: &Ints,
    model: &ModelConfig,
) -> Result<(MicroBatch, usize, usize)> {
    let bytes = read_bytes(path)?;
    let bad = |m: String| BadInput(format!("{}: {m}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("not a valid safetensors file ({e})")))?;
    let v = st
        .tensor("pixel_values")
        .map_err(|_| bad("no pixel_values tensor (a vit model takes images)".into()))?;
    let want = [model.channels(), model.image(), model.image()];
    let rows = v.shape().first().copied().unwrap_or(0);
    if v.dtype() != safetensors::Dtype::F32 || rows == 0 || v.shape()[1..] != want {
        return Err(bad(format!(
            "pixel_values is {:?} {:?}; [batch, {}, {}, {}] F32 is needed",
            v.dtype(),
            v.shape(),
            want[0],
            want[1],
            want[2]
        ))
        .into());
    }
    let pixels: Vec<f32> = v
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
    let classes = match model.head {
        Some(TaskHead::Classify { classes }) => classes as i64,
        _ => 0,
    };
    let labels = checked(
        ints,
        path,
        "labels",
        &[rows],
        |x| x == -100 || (0..classes).contains(&x),
        "a label is a class or -100",
    )?;
    let labels = labels.unwrap_or(vec![-100; rows]);
    Ok((
        MicroBatch::images(pixels, want, labels, model.seq_len),
        rows,
        model.seq_len,
    ))
}

/// The batch with the targets `model`'s head learns: next tokens (`labels` shifted, as
/// transformers does), a class per row (`labels`), or an answer's `start_positions` and
/// `end_positions`; none given: no target (-100).
fn with_targets(
    ints: &Ints,
    path: &Path,
    model: &ModelConfig,
    (ids, types, mask): (&[i64], &[i64], &[i64]),
    (rows, t): (usize, usize),
) -> Result<MicroBatch> {
    let (shape, v) = ([rows, t], model.vocab as i64);
    let label = |n: i64| move |x: i64| x == -100 || (0..n).contains(&x);
    Ok(match model.head {
        None => {
            let labels = checked(
                ints,
                path,
                "labels",
                &shape,
                label(v),
                "a label is a token id or -100",
            )?;
            MicroBatch::causal_lm(ids, labels.as_deref(), rows, t)
        }
        Some(TaskHead::Classify { classes }) => {
            let l = checked(
                ints,
                path,
                "labels",
                &[rows],
                label(classes as i64),
                "a label is a class or -100",
            )?;
            MicroBatch::labelled(ids, types, mask, l.unwrap_or(vec![-100; rows]), 1, t)
        }
        Some(TaskHead::Span) => {
            let pos = |n| {
                checked(
                    ints,
                    path,
                    n,
                    &[rows],
                    label(t as i64),
                    "a position is in the row or -100",
                )
            };
            let (s, e) = (pos("start_positions")?, pos("end_positions")?);
            let (s, e) = (s.unwrap_or(vec![-100; rows]), e.unwrap_or(vec![-100; rows]));
            let targets = s.iter().zip(&e).flat_map(|(a, b)| [*a, *b]).collect();
            MicroBatch::labelled(ids, types, mask, targets, 2, t)
        }
    })
}

/// What `forward` writes of the head's output: LM logits `[b, t, vocab]`, class logits
/// `[b, classes]`, or start and end logits `[b, t]` each.
fn head_outputs(
    model: &ModelConfig,
    logits: Vec<f32>,
    rows: usize,
    t: usize,
) -> Vec<(String, Vec<usize>, Values)> {
    match model.head {
        None => vec![("logits".into(), vec![rows, t, model.vocab], F32(logits))],
        Some(TaskHead::Classify { classes }) => {
            vec![("logits".into(), vec![rows, classes], F32(logits))]
        }
        Some(TaskHead::Span) => {
            let part = |k: usize| -> Vec<f32> {
                logits
                    .chunks(2 * t)
                    .flat_map(|r| r[k * t..(k + 1) * t].to_vec())
                    .collect()
            };
            vec![
                ("start_logits".into(), vec![rows, t], F32(part(0))),
                ("end_logits".into(), vec![rows, t], F32(part(1))),
            ]
        }
    }
}

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Checkpoint directory of a `train` run (instead of --model).
    #[arg(long, conflicts_with_all = ["model", "model_config"])]
    checkpoint_dir: Option<PathBuf>,
    /// Text to continue.
    #[arg(long)]
    prompt: String,
    /// How text becomes tokens (bytes, gpt2, cl100k, a tokenizer.json); default: the one
    /// the checkpoint was trained with, or the model directory's tokenizer.json, or bytes.
    #[arg(long)]
    tokenizer: Option<String>,
    /// New tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// 0: greedy (the most likely token each time); above 0: sample from softmax(logits / T).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// With --temperature: sample among the K most likely tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

/// `generate`: continue a prompt with a causal model.
pub fn cmd_generate(a: GenerateArgs) -> Result<()> {
    use pipewright_runtime::model::generate::{generate, Sampling};
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        return Err(BadInput(format!(
            "--temperature {}: must be a finite number >= 0",
            a.temperature
        ))
        .into());
    }
    let (model, blocks, spec) = generation_source(&a)?;
    if let Some(head) = model.head {
        return Err(BadInput(format!(
            "generate needs a causal language model (gpt, llama, gpt2); this {} model has {} {head} head",
            model.family.name(),
            if head.to_string().starts_with('a') { "an" } else { "a" }
        ))
        .into());
    }
    let tok = match a.tokenizer.as_ref().or(spec.as_ref()) {
        Some(s) => Tokenizer::load(s)?,
        None => Tokenizer::Bytes,
    };
    tok.check_fits(model.vocab)?;
    let prompt: Vec<i64> = tok.encode(&a.prompt)?.into_iter().map(i64::from).collect();
    let how = Sampling {
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
    };
    // gpt's learned positions end at seq_len; the others' at max_positions.
    let limit = match model.family {
        pipewright_runtime::model::Family::Gpt => model.seq_len,
        _ => model.max_positions(),
    };
    let new = generate(&blocks, &prompt, a.max_tokens, limit, &how)?;
    let ids: Vec<u32> = new.iter().map(|&x| x as u32).collect();
    println!("{}{}", a.prompt, tok.decode(&ids)?);
    if new.len() < a.max_tokens && prompt.len() + new.len() >= limit {
        eprintln!(
            "note: stopped after {} of {} new tokens: the model takes at most {limit} positions",
            new.len(),
            a.max_tokens
        );
    }
    Ok(())
}

/// The model to generate with, its layer blocks, and the tokenizer it was trained with (a
/// checkpoint's, or a model directory's tokenizer.json).
fn generation_source(
    a: &GenerateArgs,
) -> Result<(
    ModelConfig,
    Vec<pipewright_runtime::model::LayerBlock>,
    Option<String>,
)> {
    let dir_tokenizer = |d: &Path| {
        let f = d.join("tokenizer.json");
        f.is_file().then(|| f.display().to_string())
    };
    Ok(match (&a.checkpoint_dir, a.model.resolve()?) {
        (Some(dir), _) => checkpoint_blocks(dir)?,
        (None, Some(c)) => {
            let blocks = match &c.weights {
                Some(dir) => hf_layers(&c.config, dir, a.seed)?,
                None => pipewright_runtime::model::Layers::new(
                    &c.config,
                    a.seed,
                    &pipewright_runtime::backend::train_device(),
                )
                .into_blocks(),
            };
            let spec = c.weights.as_deref().and_then(dir_tokenizer);
            (c.config, blocks, spec)
        }
        (None, None) => checkpoint_blocks(Path::new("checkpoints"))?,
    })
}

/// The model of a checkpoint directory's newest checkpoint, whatever plan wrote it, and the
/// tokenizer it was trained with.
fn checkpoint_blocks(
    dir: &Path,
) -> Result<(
    ModelConfig,
    Vec<pipewright_runtime::model::LayerBlock>,
    Option<String>,
)> {
    let (mut cfg, _, _) = checkpoint_config(dir)?;
    (cfg.stages, cfg.replicas, cfg.chunks, cfg.pretrained) = (1, 1, 1, None);
    let plan = cfg.plan()?;
    let mut trainer = Trainer::new(cfg.clone(), plan)?;
    trainer.load_checkpoint(dir)?;
    Ok((cfg.model, trainer.layer_blocks()?, cfg.tokenizer))
}

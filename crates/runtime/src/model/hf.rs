//! Hugging Face model directories in and out: `config.json` to and from a [`ModelConfig`],
//! and weights (`model.safetensors`, or shards named by `model.safetensors.index.json`) to
//! and from the model's layer blocks, under the family's Hugging Face names and shapes.

use super::{Family, Llama3Scaling, ModelConfig, TaskHead};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// A tensor as f32 values with its shape.
#[derive(Debug, Clone)]
pub struct HfTensor {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// The model's settings from a Hugging Face `config.json` (its text; `what` names it in
/// errors). Every field that changes the computation is read; one pipewright cannot honour
/// is refused by name. `seq_len` is the training length: the model's positions, at most 64.
pub fn config_from_hf(text: &str, what: &str) -> Result<ModelConfig, String> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| format!("{what}: not a JSON config: {e}"))?;
    if !v.is_object() {
        return Err(format!(
            "{what}: not a JSON config: a config is an object of fields, found {}",
            kind_of(&v)
        ));
    }
    let family = match v.get("model_type").and_then(Value::as_str) {
        Some("llama") => Family::Llama,
        Some("gpt2") => Family::Gpt2,
        Some("bert") => Family::Bert,
        Some("vit") => Family::Vit,
        Some(other) => {
            return Err(format!(
            "{what}: model_type \"{other}\" is not supported (supported: llama, gpt2, bert, vit)"
        ))
        }
        None => return Err(format!("{what}: no model_type")),
    };
    let cfg = match family {
        Family::Llama => llama_config(&v).map_err(|e| format!("{what}: {e}"))?,
        Family::Gpt2 => gpt2_config(&v).map_err(|e| format!("{what}: {e}"))?,
        Family::Bert => bert_config(&v).map_err(|e| format!("{what}: {e}"))?,
        Family::Vit => vit_config(&v).map_err(|e| format!("{what}: {e}"))?,
        Family::Gpt => unreachable!("gpt is pipewright's own, not a Hugging Face model_type"),
    };
    cfg.check().map_err(|e| format!("{what}: {e}"))?;
    Ok(cfg)
}

fn usize_field(v: &Value, key: &str) -> Result<Option<usize>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| format!("{key} must be a non-negative integer, found {x}")),
    }
}

/// What a JSON value is, for messages.
fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A true/false field, `default` when absent or null.
fn bool_field(v: &Value, key: &str, default: bool) -> Result<bool, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_bool()
            .ok_or_else(|| format!("{key} must be true or false, found {x}")),
    }
}

fn need(v: &Value, key: &str) -> Result<usize, String> {
    usize_field(v, key)?.ok_or_else(|| format!("{key} is missing"))
}

fn f64_field(v: &Value, key: &str) -> Result<Option<f64>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("{key} must be a number, found {x}")),
    }
}

/// Refuse a field whose value would change the computation in a way not implemented.
fn refuse_unless(v: &Value, key: &str, ok: impl Fn(&Value) -> bool) -> Result<(), String> {
    match v.get(key) {
        Some(x) if !x.is_null() && !ok(x) => Err(format!(
            "{key} = {x} is not supported by pipewright's llama"
        )),
        _ => Ok(()),
    }
}

/// The task head a causal model's `architectures` names: none (`*ForCausalLM`, or none
/// given) or a classifier (`*ForSequenceClassification`).
fn causal_head(v: &Value, family: &str) -> Result<Option<TaskHead>, String> {
    match architecture(v) {
        Some(a) if a.ends_with("ForSequenceClassification") => Ok(Some(TaskHead::Classify {
            classes: num_labels(v)?,
        })),
        Some(a) if a.ends_with("ForCausalLM") || a.ends_with("LMHeadModel") || a.ends_with("Model") => Ok(None),
        None => Ok(None),
        Some(other) => Err(format!(
            "architectures [\"{other}\"] is not supported for {family} (supported: a causal LM or sequence classification)"
        )),
    }
}

/// transformers' label fields for a classifier of `classes`: the class names the model was
/// trained with, else transformers' `LABEL_i`.
fn label_fields(v: &mut Value, classes: usize, names: &[String]) {
    let name = |i: usize| match names.len() == classes {
        true => names[i].clone(),
        false => format!("LABEL_{i}"),
    };
    v["num_labels"] = json!(classes);
    v["id2label"] = (0..classes)
        .map(|i| (i.to_string(), json!(name(i))))
        .collect();
    v["label2id"] = (0..classes).map(|i| (name(i), json!(i))).collect();
}

fn llama_config(v: &Value) -> Result<ModelConfig, String> {
    refuse_unless(v, "hidden_act", |x| x == "silu")?;
    refuse_unless(v, "attention_bias", |x| x == false)?;
    refuse_unless(v, "mlp_bias", |x| x == false)?;
    refuse_unless(v, "pretraining_tp", |x| x == 1)?;
    let (d, heads) = (need(v, "hidden_size")?, need(v, "num_attention_heads")?);
    if let Some(hd) = usize_field(v, "head_dim")? {
        if heads == 0 || hd.checked_mul(heads) != Some(d) {
            return Err(format!(
                "head_dim {hd} x num_attention_heads {heads} must equal hidden_size {d}"
            ));
        }
    }
    // transformers 5 keeps theta and scaling in rope_parameters; older configs use
    // rope_theta and rope_scaling.
    let rope = v.get("rope_parameters").filter(|x| !x.is_null());
    let scaling = match rope {
        Some(r) => Some(("rope_parameters", r)),
        None => v.get("rope_scaling").map(|s| ("rope_scaling", s)),
    }
    .filter(|(_, x)| !x.is_null());
    let theta = match rope {
        Some(r) => f64_field(r, "rope_theta")?,
        None => f64_field(v, "rope_theta")?,
    };
    let max_positions = usize_field(v, "max_position_embeddings")?;
    Ok(ModelConfig {
        family: Family::Llama,
        vocab: need(v, "vocab_size")?,
        d_model: d,
        heads,
        layers: need(v, "num_hidden_layers")?,
        seq_len: max_positions.unwrap_or(64).clamp(1, 64),
        kv_heads: usize_field(v, "num_key_value_heads")?,
        ffn: Some(need(v, "intermediate_size")?),
        rope_theta: theta,
        rope_scaling: scaling
            .map(|(key, s)| rope_scaling(key, s))
            .transpose()?
            .flatten(),
        norm_eps: f64_field(v, "rms_norm_eps")?,
        max_positions,
        tie_embeddings: bool_field(v, "tie_word_embeddings", false)?,
        ..ModelConfig::default()
    }
    .with_head(causal_head(v, "llama")?))
}

/// BERT's task head from `architectures`: sequence classification (`num_labels`, or the size
/// of `id2label`) or extractive question answering.
fn bert_head(v: &Value) -> Result<TaskHead, String> {
    match architecture(v).unwrap_or("") {
        "BertForSequenceClassification" => Ok(TaskHead::Classify {
            classes: num_labels(v)?,
        }),
        "BertForQuestionAnswering" => Ok(TaskHead::Span),
        other => Err(format!(
            "architectures [\"{other}\"] is not supported for bert (supported: BertForSequenceClassification, BertForQuestionAnswering)"
        )),
    }
}

fn vit_config(v: &Value) -> Result<ModelConfig, String> {
    refuse_unless(v, "hidden_act", |x| x == "gelu")?;
    refuse_unless(v, "qkv_bias", |x| x == true)?;
    let arch = architecture(v);
    if arch.is_some_and(|a| a != "ViTForImageClassification") {
        return Err(format!(
            "architectures [{:?}] is not supported for vit (supported: ViTForImageClassification)",
            arch.unwrap_or("")
        ));
    }
    let classes = num_labels(v)?;
    let (image, patch) = (need(v, "image_size")?, need(v, "patch_size")?);
    if patch == 0 || image % patch != 0 {
        return Err(format!(
            "image_size {image} is not a whole number of patch_size {patch} patches"
        ));
    }
    Ok(ModelConfig {
        family: Family::Vit,
        vocab: 1,
        d_model: need(v, "hidden_size")?,
        heads: need(v, "num_attention_heads")?,
        layers: need(v, "num_hidden_layers")?,
        // Saturated: check() then refuses the image by name.
        seq_len: (image / patch).saturating_pow(2).saturating_add(1),
        ffn: Some(need(v, "intermediate_size")?),
        norm_eps: Some(f64_field(v, "layer_norm_eps")?.unwrap_or(1e-12)),
        head: Some(TaskHead::Classify { classes }),
        image: Some(image),
        patch: Some(patch),
        channels: Some(usize_field(v, "num_channels")?.unwrap_or(3)),
        ..ModelConfig::default()
    })
}

/// The first of `architectures`, which names the head.
fn architecture(v: &Value) -> Option<&str> {
    v.get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
}

/// Classes of a classification head: `num_labels`, or the size of `id2label`, else 2 (as
/// transformers defaults).
fn num_labels(v: &Value) -> Result<usize, String> {
    Ok(match usize_field(v, "num_labels")? {
        Some(n) => n,
        None => v
            .get("id2label")
            .and_then(Value::as_object)
            .map_or(2, |m| m.len()),
    })
}

fn bert_config(v: &Value) -> Result<ModelConfig, String> {
    refuse_unless(v, "hidden_act", |x| x == "gelu")?;
    refuse_unless(v, "position_embedding_type", |x| x == "absolute")?;
    refuse_unless(v, "is_decoder", |x| x == false)?;
    let positions = need(v, "max_position_embeddings")?;
    Ok(ModelConfig {
        family: Family::Bert,
        vocab: need(v, "vocab_size")?,
        d_model: need(v, "hidden_size")?,
        heads: need(v, "num_attention_heads")?,
        layers: need(v, "num_hidden_layers")?,
        seq_len: positions.clamp(1, 64),
        ffn: Some(need(v, "intermediate_size")?),
        norm_eps: Some(f64_field(v, "layer_norm_eps")?.unwrap_or(1e-12)),
        max_positions: Some(positions),
        head: Some(bert_head(v)?),
        type_vocab: Some(usize_field(v, "type_vocab_size")?.unwrap_or(2)),
        ..ModelConfig::default()
    })
}

fn gpt2_config(v: &Value) -> Result<ModelConfig, String> {
    refuse_unless(v, "activation_function", |x| {
        x == "gelu_new" || x == "gelu_pytorch_tanh"
    })?;
    refuse_unless(v, "scale_attn_weights", |x| x == true)?;
    refuse_unless(v, "scale_attn_by_inverse_layer_idx", |x| x == false)?;
    refuse_unless(v, "add_cross_attention", |x| x == false)?;
    let d = need(v, "n_embd")?;
    let positions = need(v, "n_positions")?;
    Ok(ModelConfig {
        family: Family::Gpt2,
        vocab: need(v, "vocab_size")?,
        d_model: d,
        heads: need(v, "n_head")?,
        layers: need(v, "n_layer")?,
        seq_len: positions.clamp(1, 64),
        ffn: Some(usize_field(v, "n_inner")?.unwrap_or(d.saturating_mul(4))),
        norm_eps: f64_field(v, "layer_norm_epsilon")?,
        max_positions: Some(positions),
        tie_embeddings: bool_field(v, "tie_word_embeddings", true)?,
        ..ModelConfig::default()
    }
    .with_head(causal_head(v, "gpt2")?))
}

/// `None` for plain rotary positions; llama3 scaling; anything else refused by name.
fn rope_scaling(key: &str, s: &Value) -> Result<Option<Llama3Scaling>, String> {
    if !s.is_object() {
        return Err(format!(
            "{key} must be an object (or null), found {}",
            kind_of(s)
        ));
    }
    let kind = match s.get("rope_type").or(s.get("type")) {
        None | Some(Value::Null) => "default",
        Some(Value::String(k)) => k.as_str(),
        Some(x) => return Err(format!("rope_type must be a string, found {x}")),
    };
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let num = |k: &str| f64_field(s, k)?.ok_or_else(|| format!("rope {k} is missing"));
            Ok(Some(Llama3Scaling {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: need(s, "original_max_position_embeddings")?,
            }))
        }
        other => Err(format!(
            "rope scaling type \"{other}\" is not supported (supported: default, llama3)"
        )),
    }
}

/// The Hugging Face `config.json` of a model (what `from_pretrained` needs).
pub fn config_to_hf(cfg: &ModelConfig) -> Result<Value, String> {
    match cfg.family {
        Family::Llama => llama_to_hf(cfg),
        Family::Gpt2 => gpt2_to_hf(cfg),
        Family::Bert => bert_to_hf(cfg),
        Family::Vit => vit_to_hf(cfg),
        Family::Gpt => Err(
            "the gpt family is pipewright's own and has no Hugging Face layout \
             (use llama, gpt2, bert or vit)"
                .into(),
        ),
    }
}

fn llama_to_hf(cfg: &ModelConfig) -> Result<Value, String> {
    let mut rope = json!({"rope_type": "default", "rope_theta": cfg.rope_theta()});
    if let Some(s) = &cfg.rope_scaling {
        rope = json!({"rope_type": "llama3", "rope_theta": cfg.rope_theta(),
            "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings});
    }
    let mut v = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn(),
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads(),
        "head_dim": cfg.head_dim(),
        "max_position_embeddings": cfg.max_positions(),
        "rms_norm_eps": cfg.norm_eps(),
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope.clone(),
        // What transformers before version 5 reads.
        "rope_theta": cfg.rope_theta(),
        "torch_dtype": "float32",
    });
    if cfg.rope_scaling.is_some() {
        v["rope_scaling"] = rope;
    }
    if cfg.head.is_some() {
        v["architectures"] = json!(["LlamaForSequenceClassification"]);
        label_fields(&mut v, cfg.classes(), &cfg.labels);
    }
    Ok(v)
}

fn gpt2_to_hf(cfg: &ModelConfig) -> Result<Value, String> {
    let mut v = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab,
        "n_embd": cfg.d_model,
        "n_layer": cfg.layers,
        "n_head": cfg.heads,
        "n_positions": cfg.max_positions(),
        "n_inner": cfg.ffn(),
        "layer_norm_epsilon": cfg.norm_eps(),
        "activation_function": "gelu_new",
        "tie_word_embeddings": cfg.tie_embeddings,
        // pipewright trains without dropout.
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
        "torch_dtype": "float32",
    });
    if cfg.head.is_some() {
        v["architectures"] = json!(["GPT2ForSequenceClassification"]);
        label_fields(&mut v, cfg.classes(), &cfg.labels);
    }
    Ok(v)
}

fn bert_to_hf(cfg: &ModelConfig) -> Result<Value, String> {
    let mut v = json!({
        "model_type": "bert",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "intermediate_size": cfg.ffn(),
        "max_position_embeddings": cfg.max_positions(),
        "type_vocab_size": cfg.type_vocab(),
        "layer_norm_eps": cfg.norm_eps(),
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
        // pipewright trains without dropout.
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "torch_dtype": "float32",
    });
    match cfg.head {
        Some(TaskHead::Classify { classes }) => {
            v["architectures"] = json!(["BertForSequenceClassification"]);
            label_fields(&mut v, classes, &cfg.labels);
        }
        _ => v["architectures"] = json!(["BertForQuestionAnswering"]),
    }
    Ok(v)
}

fn vit_to_hf(cfg: &ModelConfig) -> Result<Value, String> {
    let mut v = json!({
        "architectures": ["ViTForImageClassification"],
        "model_type": "vit",
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "intermediate_size": cfg.ffn(),
        "image_size": cfg.image(),
        "patch_size": cfg.patch(),
        "num_channels": cfg.channels(),
        "layer_norm_eps": cfg.norm_eps(),
        "hidden_act": "gelu",
        "qkv_bias": true,
        // pipewright trains without dropout.
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "torch_dtype": "float32",
    });
    label_fields(&mut v, cfg.classes(), &cfg.labels);
    Ok(v)
}

/// Where a family's Hugging Face names put each layer block's parameters: the prefixes of the
/// embedding and of block N, the head's parameters that sit inside the base model (and the
/// prefix they take), and field renames (burn's LayerNorm `gamma`/`beta` are torch's
/// `weight`/`bias`; Rust cannot name a field `self`).
struct Layout {
    embed: &'static str,
    block: &'static str,
    base: &'static str,
    head_in_base: &'static [&'static str],
    renames: &'static [(&'static str, &'static str)],
}

const NORMS: [(&str, &str); 2] = [(".gamma", ".weight"), (".beta", ".bias")];

fn layout(family: Family) -> Layout {
    match family {
        Family::Gpt2 => Layout {
            embed: "transformer.",
            block: "transformer.h.",
            base: "transformer.",
            head_in_base: &["ln_f."],
            renames: &NORMS,
        },
        Family::Bert => Layout {
            embed: "bert.embeddings.",
            block: "bert.encoder.layer.",
            base: "bert.",
            head_in_base: &["pooler."],
            renames: &[
                NORMS[0],
                NORMS[1],
                ("self_attn.", "self."),
                ("layer_norm.", "LayerNorm."),
            ],
        },
        Family::Vit => Layout {
            embed: "vit.embeddings.",
            block: "vit.encoder.layer.",
            base: "vit.",
            head_in_base: &["layernorm."],
            renames: &NORMS,
        },
        Family::Llama | Family::Gpt => Layout {
            embed: "model.",
            block: "model.layers.",
            base: "model.",
            head_in_base: &["norm."],
            renames: &[],
        },
    }
}

/// A checkpoint name (`embed.x`, `block.N.x`, `head.x`) as the family's Hugging Face name.
pub fn hf_name(cfg: &ModelConfig, name: &str) -> String {
    let l = layout(cfg.family);
    let name = l
        .renames
        .iter()
        .fold(name.to_string(), |n, (from, to)| n.replace(from, to));
    if let Some(rest) = name.strip_prefix("embed.") {
        format!("{}{rest}", l.embed)
    } else if let Some(rest) = name.strip_prefix("block.") {
        format!("{}{rest}", l.block)
    } else if let Some(rest) = name.strip_prefix("head.") {
        match l.head_in_base.iter().any(|p| rest.starts_with(p)) {
            true => format!("{}{rest}", l.base),
            false => rest.to_string(),
        }
    } else {
        name
    }
}

/// Is this parameter stored transposed in Hugging Face's layout? burn's Linear keeps
/// `[in, out]`, torch's `nn.Linear` `[out, in]` (GPT-2's `Conv1D` keeps `[in, out]` too);
/// embeddings and norms agree.
pub fn transposed(shape: &[usize], hf: &str) -> bool {
    let linear = shape.len() == 2
        && !hf.contains("embed_tokens")
        && !hf.contains("embeddings.")
        && (!hf.starts_with("transformer.") || hf == "lm_head.weight");
    linear || hf.ends_with("patch_embeddings.projection.weight")
}

/// The Hugging Face name of the token embedding (a tied head's matrix).
fn embedding_name(cfg: &ModelConfig) -> &'static str {
    match cfg.family {
        Family::Gpt2 => "transformer.wte.weight",
        _ => "model.embed_tokens.weight",
    }
}

/// `[r, c]` values as `[c, r]`.
pub fn transpose(values: &[f32], r: usize, c: usize) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    for i in 0..r {
        for j in 0..c {
            out[j * r + i] = values[i * c + j];
        }
    }
    out
}

/// The safetensors files of a model directory: `model.safetensors`, else the shards that
/// `model.safetensors.index.json` names (each once, in name order); the order transformers'
/// `from_pretrained` looks in.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    if single.is_file() {
        return Ok(vec![single]);
    }
    if index.is_file() {
        let text = read(&index)?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a JSON shard index: {e}", index.display()))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| format!("{}: no weight_map", index.display()))?;
        let mut files: Vec<String> = map
            .values()
            .map(|f| f.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| format!("{}: weight_map values must be file names", index.display()))?;
        files.sort();
        files.dedup();
        return files
            .into_iter()
            .map(|f| {
                let p = dir.join(&f);
                if f.contains('/') || f.contains("..") || !p.is_file() {
                    Err(format!(
                        "{}: names shard {f}, which is not a file in {}",
                        index.display(),
                        dir.display()
                    ))
                } else {
                    Ok(p)
                }
            })
            .collect();
    }
    Err(format!(
        "{}: no model.safetensors or model.safetensors.index.json",
        dir.display()
    ))
}

fn read(p: &Path) -> Result<String, String> {
    crate::labelled::regular(p)?;
    std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))
}

/// Every tensor of a model directory's weights as f32 (F16 and BF16 converted), by name.
pub fn read_weights(dir: &Path) -> Result<HashMap<String, HfTensor>, String> {
    let mut out = HashMap::new();
    for file in weight_files(dir)? {
        crate::labelled::regular(&file)?;
        let bytes = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let st = crate::guard::reader(&file, "safetensors file", || {
            safetensors::SafeTensors::deserialize(&bytes)
                .map_err(|e| format!("{}: not a valid safetensors file ({e})", file.display()))
        })?;
        for (name, view) in st.tensors() {
            let values = to_f32(view.dtype(), view.data())
                .map_err(|e| format!("{}: tensor {name}: {e}", file.display()))?;
            let shape = view.shape().to_vec();
            if out
                .insert(name.clone(), HfTensor { shape, values })
                .is_some()
            {
                return Err(format!(
                    "{}: tensor {name} is in more than one shard",
                    file.display()
                ));
            }
        }
    }
    Ok(out)
}

fn to_f32(dtype: safetensors::Dtype, data: &[u8]) -> Result<Vec<f32>, String> {
    use safetensors::Dtype;
    let two = |f: fn([u8; 2]) -> f32| data.chunks_exact(2).map(|b| f([b[0], b[1]])).collect();
    Ok(match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => two(|b| half::f16::from_le_bytes(b).to_f32()),
        Dtype::BF16 => two(|b| half::bf16::from_le_bytes(b).to_f32()),
        other => {
            return Err(format!(
                "dtype {other:?} is not supported (F32, F16 and BF16 are)"
            ))
        }
    })
}

/// Checkpoint-named tensors (as the model holds them) from Hugging Face ones: every parameter
/// `wanted` (checkpoint name, shape) found under its HF name with the HF shape; a tied model's
/// head takes the embedding's matrix. Missing, misshaped and left-over tensors are named.
///
/// With `new_head` (a fine-tune for another task than the checkpoint's) the head's parts
/// (`lm_head`, `score`, `classifier`, `qa_outputs`, BERT's pooler) are read where the
/// checkpoint has them in the shape wanted, else left out of the result for the caller to
/// start fresh; the checkpoint's other head parts are dropped, as transformers does.
pub fn from_hf(
    cfg: &ModelConfig,
    wanted: &[(String, Vec<usize>)],
    mut hf: HashMap<String, HfTensor>,
    new_head: bool,
) -> Result<BTreeMap<String, HfTensor>, String> {
    let mut out = BTreeMap::new();
    let embedding = hf.get(embedding_name(cfg)).cloned();
    let task_part = |k: &str| {
        new_head
            && [
                "lm_head.",
                "score.",
                "classifier.",
                "qa_outputs.",
                "bert.pooler.",
            ]
            .iter()
            .any(|p| k.starts_with(p))
    };
    for (name, shape) in wanted {
        let key = hf_name(cfg, name);
        let tied = cfg.tie_embeddings && key == "lm_head.weight";
        let t = if tied {
            embedding.clone()
        } else {
            hf.remove(&key)
        };
        let want_hf = hf_shape(cfg, shape, &key);
        // A new task's head takes what fits from the checkpoint; the rest starts fresh.
        if task_part(&key) && t.as_ref().is_none_or(|t| t.shape != want_hf) {
            continue;
        }
        let t = t.ok_or_else(|| format!("tensor {key} is missing (expected shape {want_hf:?})"))?;
        if t.shape != want_hf {
            return Err(format!(
                "tensor {key} has shape {:?}; this model expects {want_hf:?}",
                t.shape
            ));
        }
        let values = if transposed(shape, &key) {
            transpose(&t.values, shape[1], shape[0])
        } else {
            t.values
        };
        out.insert(
            name.clone(),
            HfTensor {
                shape: shape.clone(),
                values,
            },
        );
    }
    hf.retain(|k, _| !task_part(k));
    // transformers may save a tied head's matrix too; it must then equal the embedding.
    if cfg.tie_embeddings {
        hf.remove("lm_head.weight");
    }
    // Buffers, not parameters: rotary frequencies, GPT-2's causal masks.
    hf.retain(|k, _| {
        !(k.ends_with("rotary_emb.inv_freq")
            || k.ends_with("embeddings.position_ids")
            || k.ends_with("embeddings.token_type_ids")
            || k.ends_with(".attn.bias")
            || k.ends_with(".attn.masked_bias"))
    });
    if let Some(extra) = hf.keys().min() {
        return Err(format!(
            "tensor {extra} is not a parameter of this {} model ({} such tensors)",
            cfg.family.name(),
            hf.len()
        ));
    }
    Ok(out)
}

/// The Hugging Face shape of a parameter the model holds as `shape`: transposed for torch's
/// Linear, `[d, c, p, p]` for ViT's patch convolution (held as a `[c p p, d]` product).
fn hf_shape(cfg: &ModelConfig, shape: &[usize], key: &str) -> Vec<usize> {
    if key.ends_with("patch_embeddings.projection.weight") {
        return vec![shape[1], cfg.channels(), cfg.patch(), cfg.patch()];
    }
    if transposed(shape, key) {
        vec![shape[1], shape[0]]
    } else {
        shape.to_vec()
    }
}

/// Hugging Face-named tensors from checkpoint-named ones. A tied model writes no head: its
/// matrix is the embedding's; with `sum_tied` (gradients) the head's is added into it.
pub fn to_hf(
    cfg: &ModelConfig,
    params: Vec<(String, Vec<usize>, Vec<f32>)>,
    sum_tied: bool,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    if cfg.family == Family::Gpt {
        return params; // pipewright's own: its checkpoint names and layout
    }
    let mut out: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for (name, shape, values) in params {
        let key = hf_name(cfg, &name);
        let (shape, values) = if transposed(&shape, &key) {
            (
                hf_shape(cfg, &shape, &key),
                transpose(&values, shape[0], shape[1]),
            )
        } else {
            (shape, values)
        };
        if cfg.tie_embeddings && key == "lm_head.weight" {
            if sum_tied {
                if let Some(e) = out.iter_mut().find(|(k, ..)| k == embedding_name(cfg)) {
                    e.2.iter_mut().zip(&values).for_each(|(a, b)| *a += b);
                }
            }
            continue;
        }
        out.push((key, shape, values));
    }
    out
}

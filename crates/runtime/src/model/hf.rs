//! Hugging Face model directories in and out: `config.json` to and from a [`ModelConfig`],
//! and weights (`model.safetensors`, or shards named by `model.safetensors.index.json`) to
//! and from the model's layer blocks, under the family's Hugging Face names and shapes.

use super::error::Error;
use super::hf_json::kind_of;
use super::registry;
use super::ModelConfig;
use serde_json::Value;
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
pub fn config_from_hf(text: &str, what: &str) -> Result<ModelConfig, Error> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| format!("{what}: not a JSON config: {e}"))?;
    if !v.is_object() {
        return Err(format!(
            "{what}: not a JSON config: a config is an object of fields, found {}",
            kind_of(&v)
        )
        .into());
    }
    let spec = match v.get("model_type").and_then(Value::as_str) {
        Some(t) => registry::by_hf_type(t).ok_or_else(|| {
            format!(
                "{what}: model_type \"{t}\" is not supported (supported: {})",
                registry::hf_types().join(", ")
            )
        })?,
        None => return Err(format!("{what}: no model_type").into()),
    };
    let cfg = (spec.from_hf)(&v).map_err(|e| format!("{what}: {e}"))?;
    // A bare encoder has no head until its task gives it one: checked with one.
    let as_trained = match cfg.head {
        None if spec.task_only => cfg.with_head(Some(super::TaskHead::Span)),
        _ => cfg.clone(),
    };
    as_trained.check().map_err(|e| format!("{what}: {e}"))?;
    Ok(cfg)
}

/// The spread of a fresh head's matrices (`initializer_range`, default 0.02, as transformers):
/// a number in (0, 1], else refused by name (a negative one once drew a head of std 1).
pub fn initializer_range(text: &str, what: &str) -> Result<f64, Error> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| format!("{what}: not a JSON config: {e}"))?;
    match super::hf_json::f64_field(&v, "initializer_range").map_err(|e| format!("{what}: {e}"))? {
        None => Ok(0.02),
        Some(r) if r > 0.0 && r <= 1.0 => Ok(r),
        Some(r) => {
            Err(format!("{what}: initializer_range {r}: expected a number in (0, 1]").into())
        }
    }
}

/// The Hugging Face `config.json` of a model (what `from_pretrained` needs).
pub fn config_to_hf(cfg: &ModelConfig) -> Result<Value, Error> {
    (registry::spec(cfg.family).to_hf)(cfg)
}

/// The Python files a model's directory carries for transformers (`trust_remote_code`).
pub fn code_files(cfg: &ModelConfig) -> &'static [(&'static str, &'static str)] {
    registry::spec(cfg.family).code
}

/// A checkpoint name (`embed.x`, `block.N.x`, `head.x`) as the family's Hugging Face name.
pub fn hf_name(cfg: &ModelConfig, name: &str) -> String {
    let l = &registry::spec(cfg.family).layout;
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
    registry::spec(cfg.family).embedding
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
    pipewright_core::inputs::regular_file(p).map_err(|e| e.to_string())?;
    std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))
}

/// Every tensor of a model directory's weights as f32 (F16 and BF16 converted), by name.
pub fn read_weights(dir: &Path) -> Result<HashMap<String, HfTensor>, Error> {
    read_weight_files(dir).map_err(Error::Weights)
}

fn read_weight_files(dir: &Path) -> Result<HashMap<String, HfTensor>, String> {
    let mut out = HashMap::new();
    for file in weight_files(dir)? {
        pipewright_core::inputs::regular_file(&file).map_err(|e| e.to_string())?;
        let bytes = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let st = crate::guard::reader(&file, "safetensors file", || {
            safetensors::SafeTensors::deserialize(&bytes)
                .map_err(|e| format!("{}: not a valid safetensors file ({e})", file.display()))
        })?;
        for (name, view) in st.tensors() {
            // Index buffers, not parameters (transformers saves BERT's as I64).
            if name.ends_with("embeddings.position_ids")
                || name.ends_with("embeddings.token_type_ids")
            {
                continue;
            }
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
/// (`lm_head`, `score`, `classifier`, `qa_outputs`, BERT's and ViT's poolers) are read where the
/// checkpoint has them in the shape wanted, else left out of the result for the caller to
/// start fresh; the checkpoint's other head parts are dropped, as transformers does.
pub fn from_hf(
    cfg: &ModelConfig,
    wanted: &[(String, Vec<usize>)],
    hf: HashMap<String, HfTensor>,
    new_head: bool,
) -> Result<BTreeMap<String, HfTensor>, Error> {
    take_weights(cfg, wanted, hf, new_head).map_err(Error::Weights)
}

fn take_weights(
    cfg: &ModelConfig,
    wanted: &[(String, Vec<usize>)],
    mut hf: HashMap<String, HfTensor>,
    new_head: bool,
) -> Result<BTreeMap<String, HfTensor>, String> {
    let mut out = BTreeMap::new();
    // A bare model (`BertModel`, `LlamaModel`, ...) saves its names without the task model's
    // prefix (`bert.`, `model.`, ...).
    let base = registry::spec(cfg.family).layout.base;
    if !base.is_empty() && !hf.keys().any(|k| k.starts_with(base)) {
        hf = hf
            .into_iter()
            .map(|(k, t)| (format!("{base}{k}"), t))
            .collect();
    }
    let embedding = hf.get(embedding_name(cfg)).cloned();
    let task_part = |k: &str| {
        new_head
            && [
                "lm_head.",
                "score.",
                "classifier.",
                "qa_outputs.",
                "bert.pooler.",
                "vit.pooler.",
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

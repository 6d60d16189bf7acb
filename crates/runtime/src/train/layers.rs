//! Layer state, the unit that moves between plans, checkpoints and processes: a layer block
//! with its optimizer, fresh or as bytes (safetensors weights and the optimizer's record).

use super::TrainConfig;
use crate::backend::train_device;
use crate::error::{Error, Result};
use crate::model::{layer_name, LayerBlock, Layers};
use burn::module::{ModuleMapper, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, ModuleOptimizer};
use burn::tensor::{Tensor, TensorData};

/// A layer block with its optimizer: the unit of state that moves between plans.
pub(crate) type LayerState = (LayerBlock, ModuleOptimizer);

pub(crate) fn optimizer(cfg: &TrainConfig) -> ModuleOptimizer {
    AdamWConfig::new()
        .with_weight_decay(cfg.weight_decay)
        .init()
}

pub(crate) fn fresh_state(cfg: &TrainConfig) -> Vec<LayerState> {
    Layers::new(&cfg.model, cfg.seed, &train_device())
        .into_blocks()
        .into_iter()
        .map(|b| (b, optimizer(cfg)))
        .collect()
}

/// The state a run starts from: the pretrained weights of `cfg.pretrained` when it names a
/// Hugging Face directory, else fresh ones from the seed.
/// With pretrained weights, also a line for the run header on the parts that start fresh.
pub(crate) fn initial_state(cfg: &TrainConfig) -> Result<(Vec<LayerState>, Option<String>)> {
    let Some(dir) = &cfg.pretrained else {
        return Ok((fresh_state(cfg), None));
    };
    let (blocks, fresh) = hf_start(&cfg.model, dir, cfg.seed)?;
    let state = blocks.into_iter().map(|b| (b, optimizer(cfg))).collect();
    Ok((state, fresh_note(&cfg.model, dir, cfg.seed, &fresh)))
}

/// What of a task's head starts fresh, for the run header; BERT's pooler is said either way
/// (transformers' `BertForSequenceClassification` classifies [CLS] through it).
fn fresh_note(
    model: &crate::model::ModelConfig,
    dir: &std::path::Path,
    seed: u64,
    fresh: &[String],
) -> Option<String> {
    let head = model.head?;
    let (pooler, outs): (Vec<&String>, Vec<&String>) =
        fresh.iter().partition(|n| n.contains("pooler."));
    let mut parts: Vec<&str> = outs
        .iter()
        .map(|n| n.rsplit('.').nth(1).unwrap_or(n))
        .collect();
    parts.dedup();
    let mut note = match parts.is_empty() {
        true => format!("head: {head}, pretrained"),
        false => format!(
            "head: {head}, {} fresh from seed {seed} (as transformers: matrices from N(0, initializer_range), biases 0)",
            parts.join(", ")
        ),
    };
    if model.family == crate::model::Family::Bert {
        note += &match pooler.is_empty() {
            true => format!("; [CLS] pooler pretrained (from {})", dir.display()),
            false => format!("; [CLS] pooler fresh ({} has none)", dir.display()),
        };
    }
    Some(note)
}

/// The layer blocks of `model` with the weights of the Hugging Face directory `dir`.
pub fn hf_layers(
    model: &crate::model::ModelConfig,
    dir: &std::path::Path,
    seed: u64,
) -> std::result::Result<Vec<LayerBlock>, crate::model::error::Error> {
    hf_start(model, dir, seed).map(|(blocks, _)| blocks)
}

/// [`hf_layers`], and the checkpoint names of the parameters the directory did not have (a
/// new task's head), which start from `seed` as transformers starts them: matrices from
/// N(0, initializer_range), biases zero.
pub fn hf_start(
    model: &crate::model::ModelConfig,
    dir: &std::path::Path,
    seed: u64,
) -> std::result::Result<(Vec<LayerBlock>, Vec<String>), crate::model::error::Error> {
    use crate::model::error::Error as ModelError;
    let blocks = Layers::new(model, seed, &train_device()).into_blocks();
    let fresh = named_params(blocks.iter().enumerate(), model.layers);
    let wanted: Vec<_> = fresh
        .iter()
        .map(|(n, s, _)| (n.clone(), s.clone()))
        .collect();
    let text = std::fs::read_to_string(dir.join("config.json"))
        .map_err(|e| ModelError::Config(format!("{}: {e}", dir.join("config.json").display())))?;
    let saved = crate::model::hf::config_from_hf(&text, &dir.display().to_string())?;
    let std = crate::model::hf::initializer_range(&text, &dir.display().to_string())?;
    let mut rng = pipewright_core::rng::SplitMix64::new(seed ^ 0x6865_6164); // "head"
    let hf = crate::model::hf::read_weights(dir)?;
    let mut ours = crate::model::hf::from_hf(model, &wanted, hf, saved.head != model.head)
        .map_err(|e| ModelError::Weights(format!("{}: {e}", dir.display())))?;
    // A new task's output layer starts from the seed.
    let (mut entries, mut started) = (Vec::new(), Vec::new());
    for (n, shape, bytes) in fresh {
        let bytes = match ours.remove(&n) {
            Some(t) => t.values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            None if shape.len() == 2 => {
                started.push(n.clone());
                let count = shape.iter().product::<usize>();
                (0..count)
                    .flat_map(|_| ((normal(&mut rng) * std) as f32).to_le_bytes())
                    .collect()
            }
            None => {
                started.push(n.clone());
                bytes
            }
        };
        entries.push((n, safetensors::Dtype::F32, shape, bytes));
    }
    let bytes = to_safetensors(&entries).map_err(ModelError::Weights)?;
    let tensors = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| ModelError::Weights(e.to_string()))?;
    let blocks = blocks
        .into_iter()
        .enumerate()
        .map(|(i, b)| load_layer(b, &tensors, i, model.layers).map_err(ModelError::Weights))
        .collect::<std::result::Result<_, _>>()?;
    Ok((blocks, started))
}

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut pipewright_core::rng::SplitMix64) -> f64 {
    let u = |r: &mut pipewright_core::rng::SplitMix64| {
        ((r.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let (a, b) = (u(rng), u(rng));
    (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
}

/// The model's parameters under Hugging Face names and shapes (what `export` writes), or
/// with `grads` (flat, one per layer block, in parameter order) their gradients instead.
pub fn hf_params(
    model: &crate::model::ModelConfig,
    blocks: &[LayerBlock],
    grads: Option<&[Vec<f32>]>,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut params: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        let mut at = 0;
        for (n, shape, bytes) in named_params(std::iter::once((i, b)), model.layers) {
            let len = bytes.len() / 4;
            let v = match grads {
                Some(g) if g[i].len() >= at + len => g[i][at..at + len].to_vec(),
                Some(_) => vec![0.0; len], // a frozen layer block: no gradient
                None => bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            };
            at += len;
            params.push((n, shape, v));
        }
    }
    crate::model::hf::to_hf(model, params, grads.is_some())
}

/// (name, shape, values) of every parameter, names prefixed.
struct Named {
    prefix: String,
    path: Vec<String>,
    out: Vec<(String, Vec<usize>, Vec<f32>)>,
}
impl ModuleVisitor for Named {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        let t = p.val();
        self.out.push((
            format!("{}{}", self.prefix, self.path.join(".")),
            t.dims().to_vec(),
            t.to_data().try_to_vec::<f32>().expect("f32"),
        ));
    }
}

struct Load<'a> {
    tensors: &'a safetensors::SafeTensors<'a>,
    prefix: String,
    path: Vec<String>,
    error: Option<String>,
}
impl ModuleMapper for Load<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let name = format!("{}{}", self.prefix, self.path.join("."));
        let shape = p.val().dims().to_vec();
        match self.tensors.tensor(&name) {
            Ok(view)
                if view.shape() == shape.as_slice() && view.dtype() == safetensors::Dtype::F32 =>
            {
                let vals: Vec<f32> = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                p.map(|_| {
                    Tensor::<D>::from_data(TensorData::new(vals, shape), &train_device())
                        .require_grad()
                })
            }
            Ok(view) => {
                self.error.get_or_insert(format!(
                    "tensor {name}: shape {:?} {:?}, the model wants {shape:?} F32",
                    view.shape(),
                    view.dtype()
                ));
                p
            }
            Err(e) => {
                self.error.get_or_insert(format!("tensor {name}: {e}"));
                p
            }
        }
    }
}

/// (name, shape, little-endian f32 bytes) of every parameter of the given layers.
pub(super) fn named_params<'a>(
    layers: impl IntoIterator<Item = (usize, &'a LayerBlock)>,
    num_blocks: usize,
) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    let mut named = Named {
        prefix: String::new(),
        path: Vec::new(),
        out: Vec::new(),
    };
    for (i, block) in layers {
        named.prefix = format!("{}.", layer_name(i, num_blocks));
        block.visit_inner(&mut named);
    }
    named
        .out
        .into_iter()
        .map(|(n, shape, v)| (n, shape, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect()
}

/// Serialise tensors (name, dtype, shape, bytes) as safetensors.
pub(super) fn to_safetensors(
    entries: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)],
) -> std::result::Result<Vec<u8>, String> {
    let views = entries
        .iter()
        .map(|(n, dt, shape, b)| {
            safetensors::tensor::TensorView::new(*dt, shape.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| format!("tensor {n}: {e}"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    safetensors::serialize(views, None).map_err(|e| e.to_string())
}

/// Load layer `i` of the model into `template` from `tensors`.
pub(super) fn load_layer(
    template: LayerBlock,
    tensors: &safetensors::SafeTensors,
    i: usize,
    num_blocks: usize,
) -> std::result::Result<LayerBlock, String> {
    let mut l = Load {
        tensors,
        prefix: format!("{}.", layer_name(i, num_blocks)),
        path: Vec::new(),
        error: None,
    };
    let block = template.map_inner(&mut l);
    match l.error {
        Some(e) => Err(e),
        None => Ok(block),
    }
}

/// Some layers (model index, block, optimizer) as one safetensors blob: parameters by layer
/// name, optimizer state as `optimizer/<layer>` bytes. What processes exchange to move state.
pub(crate) fn encode_layers(layers: &[(usize, LayerState)], num_blocks: usize) -> Result<Vec<u8>> {
    let mut entries: Vec<_> = named_params(layers.iter().map(|(i, (b, _))| (*i, b)), num_blocks)
        .into_iter()
        .map(|(n, shape, b)| (n, safetensors::Dtype::F32, shape, b))
        .collect();
    for (i, (_, o)) in layers {
        let b = o
            .into_bytes()
            .map_err(|e| Error::Config(format!("optimizer state: {e:?}")))?
            .to_vec();
        entries.push((
            format!("optimizer/{}", layer_name(*i, num_blocks)),
            safetensors::Dtype::U8,
            vec![b.len()],
            b,
        ));
    }
    to_safetensors(&entries).map_err(Error::Config)
}

/// The whole model's state from blobs of [`encode_layers`] that together hold every layer.
pub(crate) fn decode_layers(parts: &[Vec<u8>], cfg: &TrainConfig) -> Result<Vec<LayerState>> {
    let bad = |m: String| Error::Config(format!("layer state from a peer: {m}"));
    let tensors = parts
        .iter()
        .map(|p| safetensors::SafeTensors::deserialize(p).map_err(|e| bad(e.to_string())))
        .collect::<Result<Vec<_>>>()?;
    let num_blocks = cfg.model.layers;
    fresh_state(cfg)
        .into_iter()
        .enumerate()
        .map(|(i, (template, _))| {
            let key = format!("optimizer/{}", layer_name(i, num_blocks));
            let (t, view) = tensors
                .iter()
                .find_map(|t| t.tensor(&key).ok().map(|v| (t, v)))
                .ok_or_else(|| bad(format!("no part holds {}", layer_name(i, num_blocks))))?;
            let block = load_layer(template, t, i, num_blocks).map_err(bad)?;
            let optim = optimizer(cfg)
                .from_bytes(burn::tensor::Bytes::from_bytes_vec(view.data().to_vec()))
                .map_err(|e| bad(format!("optimizer state: {e:?}")))?;
            Ok((block, optim))
        })
        .collect()
}

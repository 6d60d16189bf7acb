//! Checkpoints keyed by model layer: tensors named `embed.tok.weight`, `block.7.q.weight`,
//! `head.out.weight`; AdamW state per layer block (`optimizer/block.7.bin`). Nothing in them
//! depends on the plan, so a run resumes under any other plan (depth, boundaries, replicas,
//! schedule).

use super::store::{newest_verified, Writer};
use super::trainer::{fresh_state, optimizer, LayerState};
use super::{TrainConfig, Trainer};
use crate::backend::train_device;
use crate::data::SamplerPos;
use crate::error::{Error, Result};
use crate::model::{layer_name, LayerBlock};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData};
use pipewright_core::plan::ir::Plan;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Written as `state.json` next to the weights.
#[derive(Debug, Serialize, Deserialize)]
struct CheckpointState {
    step: u64,
    config: TrainConfig,
    /// The plan the run used (for the record; resuming may use another).
    plan: Plan,
    /// Layer blocks frozen (AutoFreeze) when it was written.
    #[serde(default)]
    frozen: usize,
    /// Where the epoch sampler's next step starts.
    #[serde(default)]
    sampler: Option<SamplerPos>,
}

/// Visit the module inside a layer block, so names start at the block's own fields.
fn visit_inner<V: ModuleVisitor>(b: &LayerBlock, v: &mut V) {
    match b {
        LayerBlock::Embed(m) => m.visit(v),
        LayerBlock::Block(m) => m.visit(v),
        LayerBlock::Head(m) => m.visit(v),
    }
}

fn map_inner<M: ModuleMapper>(b: LayerBlock, m: &mut M) -> LayerBlock {
    match b {
        LayerBlock::Embed(x) => LayerBlock::Embed(x.map(m)),
        LayerBlock::Block(x) => LayerBlock::Block(x.map(m)),
        LayerBlock::Head(x) => LayerBlock::Head(x.map(m)),
    }
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
fn named_params<'a>(
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
        visit_inner(block, &mut named);
    }
    named
        .out
        .into_iter()
        .map(|(n, shape, v)| (n, shape, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect()
}

/// Serialise tensors (name, dtype, shape, bytes) as safetensors.
fn to_safetensors(
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
fn load_layer(
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
    let block = map_inner(template, &mut l);
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

fn parse_state(ck: &Path, bytes: &[u8]) -> Result<CheckpointState> {
    serde_json::from_slice(bytes)
        .map_err(|e| Error::checkpoint(ck.join("state.json"), format!("state does not parse: {e}")))
}

/// The configuration, plan and step of the newest checkpoint in `dir` that verifies: what a
/// run that only reads the model (evaluation) needs to rebuild it.
pub fn checkpoint_config(dir: &Path) -> Result<(TrainConfig, Plan, u64)> {
    let (v, _) = newest_verified(dir)?;
    let bytes = v
        .files
        .get("state.json")
        .ok_or_else(|| Error::checkpoint(v.path.join("state.json"), "missing from the manifest"))?;
    let st = parse_state(&v.path, bytes)?;
    Ok((st.config, st.plan, st.step))
}

/// What a resume loaded.
#[derive(Debug, Clone)]
pub struct Resumed {
    pub path: PathBuf,
    pub step: u64,
    /// Why the checkpoint `latest` names was passed over for an older one, if it was.
    pub fallback: Option<String>,
    /// Layer blocks frozen when it was written (the trainer keeps them frozen when this
    /// run's plan has room for them in stage 0; else re-plan and call `set_frozen`).
    pub frozen: usize,
}

impl Trainer {
    /// Write a checkpoint into `dir` durably (see `store`): weights as safetensors, optimizer
    /// state per layer, JSON state, and a manifest of checksums; keep the newest
    /// `self.keep_checkpoints`. Across processes every rank calls it; rank 0 writes.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<PathBuf> {
        self.save_checkpoint_crashing(dir, None)
    }

    /// [`Trainer::save_checkpoint`], stopped after `crash_after` file-system operations as a
    /// kill would stop it (for crash tests).
    #[doc(hidden)]
    pub fn save_checkpoint_crashing(
        &self,
        dir: &Path,
        crash_after: Option<usize>,
    ) -> Result<PathBuf> {
        let state = self.layer_state()?;
        if !self.is_root() {
            return Ok(dir.join(format!("step-{:06}", self.step)));
        }
        let mut w = Writer::begin(dir, self.step, crash_after)?;
        let layers = self.cfg.model.layers;
        for (i, (_, optim)) in state.iter().enumerate() {
            let rel = format!("optimizer/{}.bin", layer_name(i, layers));
            let b = optim.into_bytes().map_err(|e| {
                Error::checkpoint(dir.join(&rel), format!("optimizer state: {e:?}"))
            })?;
            w.file(&rel, &b)?;
        }
        let entries: Vec<_> = named_params(state.iter().map(|(b, _)| b).enumerate(), layers)
            .into_iter()
            .map(|(n, shape, b)| (n, safetensors::Dtype::F32, shape, b))
            .collect();
        let bytes = to_safetensors(&entries).map_err(|e| Error::checkpoint(dir, e))?;
        w.file("weights.safetensors", &bytes)?;
        let st = CheckpointState {
            step: self.step,
            config: self.cfg.clone(),
            plan: self.plan.clone(),
            frozen: self.frozen(),
            sampler: self.sampler.position(),
        };
        w.file(
            "state.json",
            serde_json::to_string_pretty(&st).expect("state").as_bytes(),
        )?;
        w.finish(self.keep_checkpoints)
    }

    /// Load the newest checkpoint in `dir` that verifies (normally the one `latest` names):
    /// the same model is required; the plan, batch and optimizer settings may differ.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<Resumed> {
        let (v, fallback) = newest_verified(dir)?;
        let ck = v.path.clone();
        let get = |rel: &str| {
            v.files
                .get(rel)
                .ok_or_else(|| Error::checkpoint(ck.join(rel), "missing from the manifest"))
        };
        let state = parse_state(&ck, get("state.json")?)?;
        if state.config.model != self.cfg.model {
            return Err(Error::checkpoint(
                &ck,
                format!(
                    "checkpoint was written for a different model ({:?}); this run has {:?}",
                    state.config.model, self.cfg.model
                ),
            ));
        }
        let wpath = ck.join("weights.safetensors");
        let tensors = safetensors::SafeTensors::deserialize(get("weights.safetensors")?)
            .map_err(|e| Error::checkpoint(&wpath, format!("corrupt weights: {e}")))?;
        let layers = self.cfg.model.layers;
        let mut loaded: Vec<LayerState> = Vec::new();
        for (i, (block, _)) in fresh_state(&self.cfg).into_iter().enumerate() {
            let name = layer_name(i, layers);
            let block =
                load_layer(block, &tensors, i, layers).map_err(|e| Error::checkpoint(&wpath, e))?;
            let rel = format!("optimizer/{name}.bin");
            let optim = optimizer(&self.cfg)
                .from_bytes(burn::tensor::Bytes::from_bytes_vec(get(&rel)?.clone()))
                .map_err(|e| {
                    Error::checkpoint(ck.join(&rel), format!("corrupt optimizer state: {e:?}"))
                })?;
            loaded.push((block, optim));
        }
        self.set_layer_state(&loaded);
        self.step = state.step;
        self.sampler.set_position(state.sampler);
        // Frozen layers stay frozen where this plan allows it.
        if self.set_frozen(state.frozen).is_err() {
            self.set_frozen(0)?;
        }
        Ok(Resumed {
            path: ck,
            step: state.step,
            fallback,
            frozen: state.frozen,
        })
    }
}

//! Checkpoints keyed by model layer: tensors named `embed.tok.weight`, `block.7.q.weight`,
//! `head.out.weight`; AdamW state per layer block (`optimizer/block.7.bin`). Nothing in them
//! depends on the plan, so a run resumes under any other plan (depth, boundaries, replicas,
//! schedule).

use super::trainer::{optimizer, LayerState};
use super::{TrainConfig, Trainer};
use crate::backend::train_device;
use crate::error::{Error, Result};
use crate::model::{layer_name, LayerBlock};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData};
use pipewright_core::ir::Plan;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Written as `state.json` next to the weights.
#[derive(Debug, Serialize, Deserialize)]
struct CheckpointState {
    step: u64,
    config: TrainConfig,
    /// The plan the run used (for the record; resuming may use another).
    plan: Plan,
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

impl Trainer {
    /// Write `dir/step-NNNNNN/` (safetensors weights, optimizer state per layer, JSON state)
    /// through a temporary directory and a rename, then point `dir/latest` at it the same way.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<PathBuf> {
        let io = |p: &Path, e: std::io::Error| Error::checkpoint(p, e.to_string());
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let name = format!("step-{:06}", self.step);
        let tmp = dir.join(format!("{name}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(tmp.join("optimizer")).map_err(|e| io(&tmp, e))?;
        let layers = self.cfg.model.layers;
        let state = self.layer_state();
        let mut named = Named {
            prefix: String::new(),
            path: Vec::new(),
            out: Vec::new(),
        };
        for (i, (block, optim)) in state.iter().enumerate() {
            named.prefix = format!("{}.", layer_name(i, layers));
            visit_inner(block, &mut named);
            let f = tmp
                .join("optimizer")
                .join(format!("{}.bin", layer_name(i, layers)));
            let b = optim
                .into_bytes()
                .map_err(|e| Error::checkpoint(&f, format!("optimizer state: {e:?}")))?;
            std::fs::write(&f, &b[..]).map_err(|e| io(&f, e))?;
        }
        let bytes: Vec<Vec<u8>> = named
            .out
            .iter()
            .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = named
            .out
            .iter()
            .zip(&bytes)
            .map(|((n, shape, _), b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                        .expect("consistent view"),
                )
            })
            .collect();
        let wpath = tmp.join("weights.safetensors");
        safetensors::serialize_to_file(views, None, &wpath)
            .map_err(|e| Error::checkpoint(&wpath, e.to_string()))?;
        let st = CheckpointState {
            step: self.step,
            config: self.cfg.clone(),
            plan: self.plan.clone(),
        };
        let spath = tmp.join("state.json");
        std::fs::write(&spath, serde_json::to_string_pretty(&st).expect("state"))
            .map_err(|e| io(&spath, e))?;
        let fin = dir.join(&name);
        let _ = std::fs::remove_dir_all(&fin);
        std::fs::rename(&tmp, &fin).map_err(|e| io(&fin, e))?;
        let latest = dir.join("latest.tmp");
        std::fs::write(&latest, &name).map_err(|e| io(&latest, e))?;
        std::fs::rename(&latest, dir.join("latest")).map_err(|e| io(&latest, e))?;
        Ok(fin)
    }

    /// Load the checkpoint `dir/latest` into this trainer: the same model is required; the
    /// plan, batch and optimizer settings may differ.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let lp = dir.join("latest");
        let latest = std::fs::read_to_string(&lp)
            .map_err(|e| Error::checkpoint(&lp, format!("no checkpoint to resume ({e})")))?;
        let ck = dir.join(latest.trim());
        let spath = ck.join("state.json");
        let text = std::fs::read_to_string(&spath)
            .map_err(|e| Error::checkpoint(&spath, e.to_string()))?;
        let state: CheckpointState = serde_json::from_str(&text).map_err(|e| {
            Error::checkpoint(
                &spath,
                format!("corrupt state, or written by pipewright 0.1 (stage-keyed checkpoints cannot be resumed): {e}"),
            )
        })?;
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
        let raw = std::fs::read(&wpath).map_err(|e| Error::checkpoint(&wpath, e.to_string()))?;
        let tensors = safetensors::SafeTensors::deserialize(&raw)
            .map_err(|e| Error::checkpoint(&wpath, format!("corrupt weights: {e}")))?;
        let layers = self.cfg.model.layers;
        let mut loaded: Vec<LayerState> = Vec::new();
        for (i, (block, _)) in self.layer_state().into_iter().enumerate() {
            let name = layer_name(i, layers);
            let mut l = Load {
                tensors: &tensors,
                prefix: format!("{name}."),
                path: Vec::new(),
                error: None,
            };
            let block = map_inner(block, &mut l);
            if let Some(e) = l.error {
                return Err(Error::checkpoint(&wpath, e));
            }
            let f = ck.join("optimizer").join(format!("{name}.bin"));
            let b = std::fs::read(&f).map_err(|e| Error::checkpoint(&f, e.to_string()))?;
            let optim = optimizer(&self.cfg)
                .from_bytes(burn::tensor::Bytes::from_bytes_vec(b))
                .map_err(|e| Error::checkpoint(&f, format!("corrupt optimizer state: {e:?}")))?;
            loaded.push((block, optim));
        }
        self.set_layer_state(&loaded);
        self.step = state.step;
        Ok(())
    }
}

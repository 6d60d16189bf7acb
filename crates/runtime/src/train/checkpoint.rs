//! Checkpoints keyed by model layer: tensors named `embed.tok.weight`, `block.7.q.weight`,
//! `head.out.weight`; AdamW state per layer block (`optimizer/block.7.bin`). Nothing in them
//! depends on the plan, so a run resumes under any other plan (depth, boundaries, replicas,
//! schedule).

use super::layers::{fresh_state, load_layer, named_params, optimizer, to_safetensors, LayerState};
use super::store::{newest_verified, Writer};
use super::{RunSettings, TrainConfig, Trainer};
use crate::data::SamplerPos;
use crate::error::{Error, Result};
use crate::model::layer_name;
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
    /// Layer blocks frozen for their weights only (`--freeze critical`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    weight_only: Vec<usize>,
    /// Where the epoch sampler's next step starts.
    #[serde(default)]
    sampler: Option<SamplerPos>,
    /// The run's own settings, kept for its resume. A record this version cannot read (an
    /// older or newer one) is passed over: the resume then takes the command line's.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient"
    )]
    run: Option<RunSettings>,
}

fn lenient<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<RunSettings>, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    Ok(serde_json::from_value(v).ok())
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

/// The driving program's settings kept in the newest checkpoint that verifies in `dir` (see
/// [`Trainer::run_settings`]), if it kept any.
pub fn checkpoint_run_settings(dir: &Path) -> Result<Option<RunSettings>> {
    let (v, _) = newest_verified(dir)?;
    let bytes = v
        .files
        .get("state.json")
        .ok_or_else(|| Error::checkpoint(v.path.join("state.json"), "missing from the manifest"))?;
    Ok(parse_state(&v.path, bytes)?.run)
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
    /// Layer blocks frozen for their weights only (kept frozen on any plan).
    pub weight_only: Vec<usize>,
}

impl Trainer {
    /// Write a checkpoint into `dir` durably (see `store`): weights as safetensors, optimizer
    /// state per layer, JSON state, and a manifest of checksums; keep the newest
    /// `self.keep_checkpoints`. Across processes every rank calls it; rank 0 writes.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<PathBuf> {
        self.save_checkpoint_crashing(dir, None)
    }

    /// [`Trainer::save_checkpoint`] into `dir`, keeping the newest `keep` there (the best
    /// validation's directory keeps one).
    pub fn save_checkpoint_keeping(&mut self, dir: &Path, keep: usize) -> Result<PathBuf> {
        let all = std::mem::replace(&mut self.keep_checkpoints, keep);
        let saved = self.save_checkpoint(dir);
        self.keep_checkpoints = all;
        saved
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
            weight_only: self.weight_only().to_vec(),
            sampler: self.sampler.position(),
            run: self.run_settings.clone(),
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
        if !state.config.model.same_parameters(&self.cfg.model) {
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
        self.set_weight_only(&state.weight_only)
            .map_err(|e| Error::checkpoint(ck.join("state.json"), format!("weight_only: {e}")))?;
        Ok(Resumed {
            path: ck,
            step: state.step,
            fallback,
            frozen: state.frozen,
            weight_only: state.weight_only,
        })
    }
}

//! Training: a plan's workers over a transport, gradient accumulation, data-parallel
//! all-reduce, global grad-norm clipping, AdamW with warmup + cosine LR, checkpoints.

use crate::backend::train_device;
use crate::data::{micro_batch, Corpus, MicroBatch};
use crate::exec::{add_grads, grads_params, ExecError, GradSource, Worker, WorkerOutput};
use crate::model::{fresh_copy, loss, GptConfig, Layers, Stage, StageInput};
use crate::transport::{InProcess, Transport};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, ModuleOptimizer};
use burn::tensor::{Tensor, TensorData};
use pipewright_core::ir::{Plan, RouteIndex};
use pipewright_core::partition::min_max_split;
use pipewright_core::schedule::{generate, ScheduleKind};
use pipewright_core::sim::{TimedAction, Timeline};
use pipewright_core::validate::validate;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Everything that decides a training run (also written into checkpoints).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    pub model: GptConfig,
    pub schedule: String,
    /// Pipeline depth P.
    pub stages: usize,
    /// Stage chunks per worker (interleaved).
    pub chunks: usize,
    /// Data-parallel replicas D.
    pub replicas: usize,
    /// Micro-batches M per replica per step.
    pub microbatches: usize,
    /// Sequences per micro-batch.
    pub rows: usize,
    pub steps: u64,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup: u64,
    pub weight_decay: f32,
    /// Global gradient-norm clip.
    pub clip: f32,
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: GptConfig::default(),
            schedule: "1f1b".into(),
            stages: 2,
            chunks: 1,
            replicas: 1,
            microbatches: 4,
            rows: 4,
            steps: 60,
            lr: 3e-3,
            min_lr: 3e-4,
            warmup: 5,
            weight_decay: 0.01,
            clip: 1.0,
            seed: 42,
        }
    }
}

impl TrainConfig {
    /// Learning rate at `step`: linear warmup, then cosine down to `min_lr` at the last step.
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.steps.saturating_sub(self.warmup).max(1) as f64;
        let t = ((step - self.warmup) as f64 / span).min(1.0);
        self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + (std::f64::consts::PI * t).cos())
    }

    pub fn kind(&self) -> Result<ScheduleKind, String> {
        self.schedule
            .parse::<ScheduleKind>()
            .map_err(|e| e.to_string())
    }

    /// The plan this config trains with, checked against the model.
    pub fn plan(&self) -> Result<Plan, String> {
        self.model.check()?;
        let kind = self.kind()?;
        if self.replicas == 0 || self.rows == 0 {
            return Err("--replicas and rows per micro-batch must be at least 1".into());
        }
        let plan = generate(kind, self.stages, self.microbatches, self.chunks)
            .map_err(|e| e.to_string())?;
        if plan.num_stages() > self.model.num_blocks() {
            return Err(format!(
                "the plan has {} stages but the model has only {} layer blocks (embedding, {} transformer blocks, head)",
                plan.num_stages(),
                self.model.num_blocks(),
                self.model.layers
            ));
        }
        validate(&plan).map_err(|e| e.to_string())?;
        Ok(plan)
    }

    /// Layer blocks per stage: balanced by a rough cost (blocks 1, embedding and head by their
    /// matmul sizes), cut exactly by the partitioner.
    pub fn boundaries(&self, stages: usize) -> Vec<usize> {
        let m = &self.model;
        let block = 12.0 * (m.d_model * m.d_model) as f64;
        let mut cost = vec![0.05 * block];
        cost.extend(std::iter::repeat_n(block, m.layers));
        cost.push((m.d_model * m.vocab) as f64 + 0.05 * block);
        let pre = pipewright_core::partition::prefix(cost);
        min_max_split(m.num_blocks(), stages, |_, lo, hi| pre[hi] - pre[lo])
            .expect("stages <= blocks checked")
            .layers_per_stage
    }
}

/// What one optimizer step measured.
#[derive(Debug, Clone)]
pub struct StepReport {
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub seconds: f64,
    pub tokens: u64,
    /// Compute seconds per worker (rank order).
    pub busy: Vec<f64>,
    pub actions: Vec<TimedAction>,
}

pub struct Trainer {
    pub cfg: TrainConfig,
    pub plan: Plan,
    routes: RouteIndex,
    /// Layer blocks per stage.
    pub boundaries: Vec<usize>,
    /// `replicas * P` workers, rank order.
    pub workers: Vec<Worker>,
    optims: Vec<Vec<ModuleOptimizer>>,
    transport: Arc<dyn Transport>,
    /// Optimizer steps done.
    pub step: u64,
}

fn optimizer(cfg: &TrainConfig) -> ModuleOptimizer {
    AdamWConfig::new()
        .with_weight_decay(cfg.weight_decay)
        .init()
}

impl Trainer {
    pub fn new(cfg: TrainConfig) -> Result<Self, String> {
        let transport = InProcess::new(cfg.replicas * cfg.stages);
        Self::with_transport(cfg, transport)
    }

    pub fn with_transport(cfg: TrainConfig, transport: Arc<dyn Transport>) -> Result<Self, String> {
        let plan = cfg.plan()?;
        let boundaries = cfg.boundaries(plan.num_stages());
        let layers = Layers::new(&cfg.model, cfg.seed, &train_device());
        let mut starts = vec![0];
        for n in &boundaries {
            starts.push(starts.last().unwrap() + n);
        }
        let p = plan.num_workers();
        let mut workers = Vec::new();
        let mut optims = Vec::new();
        for r in 0..cfg.replicas {
            for w in 0..p {
                let stages: Vec<(usize, Stage)> = plan
                    .stages_of(w)
                    .into_iter()
                    .map(|s| (s, fresh_copy(layers.stage(starts[s], starts[s + 1]))))
                    .collect();
                optims.push(stages.iter().map(|_| optimizer(&cfg)).collect());
                workers.push(Worker {
                    rank: r * p + w,
                    replica: r,
                    w,
                    stages,
                });
            }
        }
        Ok(Trainer {
            routes: RouteIndex::new(&plan),
            cfg,
            plan,
            boundaries,
            workers,
            optims,
            transport,
            step: 0,
        })
    }

    /// Micro-batches of replica `r` for `step`.
    fn batches(&self, corpus: &Corpus, step: u64, r: usize) -> Vec<MicroBatch> {
        let m = self.cfg.microbatches;
        (0..m)
            .map(|i| {
                micro_batch(
                    &corpus.train,
                    self.cfg.model.seq_len,
                    self.cfg.rows,
                    self.cfg.seed,
                    step,
                    (r * m + i) as u64,
                )
            })
            .collect()
    }

    /// One optimizer step: every worker runs its actions in its own thread, then gradients are
    /// all-reduced across replicas, clipped by the global norm and applied with AdamW.
    pub fn train_step(&mut self, corpus: &Corpus) -> Result<StepReport, ExecError> {
        let (p, d, m) = (
            self.plan.num_workers(),
            self.cfg.replicas,
            self.cfg.microbatches,
        );
        let scale = 1.0 / (d * m) as f32;
        let lr = self.cfg.lr_at(self.step);
        let clip = self.cfg.clip;
        let batches: Vec<Vec<MicroBatch>> =
            (0..d).map(|r| self.batches(corpus, self.step, r)).collect();
        let clock = Instant::now();
        let (plan, routes, transport) = (&self.plan, &self.routes, self.transport.as_ref());
        let results: Vec<Result<(WorkerOutput, f64, f64), ExecError>> = std::thread::scope(|sc| {
            let handles: Vec<_> = self
                .workers
                .iter_mut()
                .zip(self.optims.iter_mut())
                .map(|(worker, optims)| {
                    let batches = &batches[worker.replica];
                    sc.spawn(move || {
                        let r = (|| {
                            let mut out =
                                worker.run(plan, routes, transport, batches, scale, clock)?;
                            // Data parallel: sum each stage's gradients over its replicas.
                            let dp: Vec<usize> = (0..d).map(|r| r * p + worker.w).collect();
                            for g in out.grads.iter_mut() {
                                transport.all_reduce(worker.rank, &dp, g)?;
                            }
                            // Global norm over all stages of the pipeline (replicas now agree).
                            let pipe: Vec<usize> = (0..p).map(|w| worker.replica * p + w).collect();
                            let mut sq = [sum_squares(&out.grads), out.loss_sum as f32];
                            transport.all_reduce(worker.rank, &pipe, &mut sq[..1])?;
                            let everyone: Vec<usize> = (0..d * p).collect();
                            transport.all_reduce(worker.rank, &everyone, &mut sq[1..])?;
                            let norm = (sq[0] as f64).sqrt();
                            let factor = if norm > clip as f64 {
                                clip / norm as f32
                            } else {
                                1.0
                            };
                            let _guard = crate::backend::autodiff_lock();
                            let stages = std::mem::take(&mut worker.stages);
                            worker.stages = stages
                                .into_iter()
                                .zip(out.grads.iter())
                                .zip(optims.iter_mut())
                                .map(|(((s, module), g), o)| {
                                    let gp = grads_params(&module, g, factor);
                                    (s, o.step(lr, module, gp))
                                })
                                .collect();
                            Ok((out, norm, sq[1] as f64))
                        })();
                        if r.is_err() {
                            transport.abort();
                        }
                        r
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("worker thread panicked"))
                .collect()
        });
        let seconds = clock.elapsed().as_secs_f64();
        let mut busy = vec![0.0; d * p];
        let mut actions = Vec::new();
        let (mut norm, mut loss_total) = (0.0, 0.0);
        let mut first_err = None;
        for r in results {
            match r {
                Ok((out, n, l)) => {
                    for a in &out.actions {
                        busy[a.worker] += a.end - a.start;
                    }
                    actions.extend(out.actions);
                    norm = n;
                    loss_total = l;
                }
                Err(e) => {
                    // Report the root cause, not the "aborted" echoes of other workers.
                    if first_err.is_none() || matches!(first_err, Some(ExecError::Transport(_))) {
                        first_err = Some(e);
                    }
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let loss = loss_total / (d * m) as f64;
        if !loss.is_finite() {
            return Err(ExecError::NonFinite(loss));
        }
        self.step += 1;
        let tokens = (d * m * self.cfg.rows * self.cfg.model.seq_len) as u64;
        Ok(StepReport {
            step: self.step,
            loss,
            lr,
            grad_norm: norm,
            seconds,
            tokens,
            busy,
            actions,
        })
    }

    /// Replica 0's stages in model order.
    fn stages_in_order(&self) -> Vec<&Stage> {
        let p = self.plan.num_workers();
        (0..self.plan.num_stages())
            .map(|s| {
                let w = &self.workers[self.plan.placement[s] % p];
                &w.stages
                    .iter()
                    .find(|(x, _)| *x == s)
                    .expect("stage placed")
                    .1
            })
            .collect()
    }

    /// Mean held-out loss over `batches` fixed micro-batches.
    pub fn evaluate(&self, corpus: &Corpus, batches: usize) -> f64 {
        let stages = self.stages_in_order();
        let mut total = 0.0;
        for i in 0..batches {
            let mb = micro_batch(
                &corpus.val,
                self.cfg.model.seq_len,
                self.cfg.rows,
                self.cfg.seed,
                u64::MAX,
                i as u64,
            );
            total += forward_loss(&stages, &mb);
        }
        total / batches as f64
    }

    /// All parameters of replica 0 in model order, flattened (for comparisons).
    pub fn flat_params(&self) -> Vec<f32> {
        self.stages_in_order()
            .iter()
            .flat_map(|s| flat_params(*s))
            .collect()
    }

    /// The measured timeline of a step, in the simulator's format.
    pub fn timeline(&self, report: &StepReport) -> Timeline {
        Timeline {
            worker_names: (0..self.workers.len())
                .map(|r| {
                    format!(
                        "replica {} worker {}",
                        r / self.plan.num_workers(),
                        r % self.plan.num_workers()
                    )
                })
                .collect(),
            actions: report.actions.clone(),
            transfers: Vec::new(),
        }
    }
}

/// Sum of squares of gradient buffers (f64 inside, f32 out: what the all-reduce carries).
/// Plain and pipelined training share it so their clipping agrees.
fn sum_squares(grads: &[Vec<f32>]) -> f32 {
    grads
        .iter()
        .map(|g| g.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() as f32)
        .sum()
}

fn forward_loss(stages: &[&Stage], mb: &MicroBatch) -> f64 {
    let toks = mb.ids(&mb.tokens);
    let tgts = mb.ids(&mb.targets);
    let mut x = stages[0].forward(StageInput::Tokens(toks));
    for s in &stages[1..] {
        x = s.forward(StageInput::Hidden(x));
    }
    loss(x, tgts).into_scalar::<f32>() as f64
}

pub fn flat_params<M: Module>(m: &M) -> Vec<f32> {
    struct V(Vec<f32>);
    impl ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0
                .extend(p.val().to_data().try_to_vec::<f32>().expect("f32"));
        }
    }
    let mut v = V(Vec::new());
    m.visit(&mut v);
    v.0
}

/// Plain single-worker training, the reference for exact-gradient tests: the whole model, one
/// forward and backward over all micro-batches of all replicas at once, same optimizer.
pub struct PlainTrainer {
    pub cfg: TrainConfig,
    model: Option<Stage>,
    optim: ModuleOptimizer,
    pub step: u64,
}

impl PlainTrainer {
    pub fn new(cfg: TrainConfig) -> Self {
        let layers = Layers::new(&cfg.model, cfg.seed, &train_device());
        let model = Some(layers.stage(0, cfg.model.num_blocks()));
        PlainTrainer {
            optim: optimizer(&cfg),
            cfg,
            model,
            step: 0,
        }
    }

    /// The whole model.
    pub fn model(&self) -> &Stage {
        self.model.as_ref().expect("model present between steps")
    }

    pub fn train_step(&mut self, corpus: &Corpus) -> f64 {
        let c = &self.cfg;
        let n = c.replicas * c.microbatches;
        let mbs: Vec<MicroBatch> = (0..n)
            .map(|i| {
                micro_batch(
                    &corpus.train,
                    c.model.seq_len,
                    c.rows,
                    c.seed,
                    self.step,
                    i as u64,
                )
            })
            .collect();
        let all = MicroBatch {
            rows: c.rows * n,
            seq_len: c.model.seq_len,
            tokens: mbs.iter().flat_map(|m| m.tokens.clone()).collect(),
            targets: mbs.iter().flat_map(|m| m.targets.clone()).collect(),
        };
        let toks = all.ids(&all.tokens);
        let tgts = all.ids(&all.targets);
        let l = loss(self.model().forward(StageInput::Tokens(toks)), tgts);
        let v = l.clone().into_scalar::<f32>() as f64;
        let g = l.backward();
        let mut flat = Vec::new();
        add_grads(self.model(), GradSource::Autodiff(&g), &mut flat);
        let norm = (sum_squares(std::slice::from_ref(&flat)) as f64).sqrt();
        let factor = if norm > c.clip as f64 {
            c.clip / norm as f32
        } else {
            1.0
        };
        let gp = grads_params(self.model(), &flat, factor);
        let lr = c.lr_at(self.step);
        let model = self.model.take().expect("model present between steps");
        self.model = Some(self.optim.step(lr, model, gp));
        self.step += 1;
        v
    }
}

// ---- checkpoints ----

/// State written next to the weights.
#[derive(Debug, Serialize, Deserialize)]
struct CheckpointState {
    step: u64,
    config: TrainConfig,
    boundaries: Vec<usize>,
}

struct Named(Vec<(String, Vec<usize>, Vec<f32>)>, Vec<String>);
impl ModuleVisitor for Named {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.1.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.1.pop();
    }
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        let t = p.val();
        self.0.push((
            self.1.join("."),
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
    /// Write `dir/step-NNNNNN/` (safetensors weights, optimizer state, JSON state) through a
    /// temporary directory and a rename, then point `dir/latest` at it the same way.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<PathBuf, String> {
        let io = |e: std::io::Error| format!("{}: {e}", dir.display());
        std::fs::create_dir_all(dir).map_err(io)?;
        let name = format!("step-{:06}", self.step);
        let tmp = dir.join(format!("{name}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(io)?;
        let mut named = Named(Vec::new(), Vec::new());
        for (s, stage) in self.stages_in_order().iter().enumerate() {
            let before = named.0.len();
            stage.visit(&mut named);
            for t in &mut named.0[before..] {
                t.0 = format!("stage{s}.{}", t.0);
            }
        }
        let bytes: Vec<Vec<u8>> = named
            .0
            .iter()
            .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = named
            .0
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
        safetensors::serialize_to_file(views, None, &tmp.join("weights.safetensors"))
            .map_err(|e| format!("{}: {e}", tmp.display()))?;
        let p = self.plan.num_workers();
        for (w, optims) in self.optims.iter().take(p).enumerate() {
            for (i, o) in optims.iter().enumerate() {
                let s = self.workers[w].stages[i].0;
                let b = o
                    .into_bytes()
                    .map_err(|e| format!("optimizer state of stage {s}: {e:?}"))?;
                std::fs::write(tmp.join(format!("optimizer-stage{s}.bin")), &b[..]).map_err(io)?;
            }
        }
        let state = CheckpointState {
            step: self.step,
            config: self.cfg.clone(),
            boundaries: self.boundaries.clone(),
        };
        std::fs::write(
            tmp.join("state.json"),
            serde_json::to_string_pretty(&state).expect("state"),
        )
        .map_err(io)?;
        let fin = dir.join(&name);
        let _ = std::fs::remove_dir_all(&fin);
        std::fs::rename(&tmp, &fin).map_err(io)?;
        std::fs::write(dir.join("latest.tmp"), &name).map_err(io)?;
        std::fs::rename(dir.join("latest.tmp"), dir.join("latest")).map_err(io)?;
        Ok(fin)
    }

    /// Load the checkpoint `dir/latest` into this trainer (same config required).
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<(), String> {
        let latest = std::fs::read_to_string(dir.join("latest")).map_err(|e| {
            format!(
                "{}: no checkpoint to resume ({e})",
                dir.join("latest").display()
            )
        })?;
        let ck = dir.join(latest.trim());
        let state: CheckpointState = serde_json::from_str(
            &std::fs::read_to_string(ck.join("state.json"))
                .map_err(|e| format!("{}: {e}", ck.join("state.json").display()))?,
        )
        .map_err(|e| format!("{}: corrupt state: {e}", ck.join("state.json").display()))?;
        let same = |a: &TrainConfig, b: &TrainConfig| {
            TrainConfig {
                steps: 0,
                ..a.clone()
            } == TrainConfig {
                steps: 0,
                ..b.clone()
            }
        };
        if !same(&state.config, &self.cfg) || state.boundaries != self.boundaries {
            return Err(format!("{}: checkpoint was written by a different model or plan; resume with the same settings (only --steps may change)", ck.display()));
        }
        let wpath = ck.join("weights.safetensors");
        let raw = std::fs::read(&wpath).map_err(|e| format!("{}: {e}", wpath.display()))?;
        let tensors = safetensors::SafeTensors::deserialize(&raw)
            .map_err(|e| format!("{}: corrupt weights: {e}", wpath.display()))?;
        let p = self.plan.num_workers();
        for worker in self.workers.iter_mut() {
            let stages = std::mem::take(&mut worker.stages);
            let mut loaded = Vec::new();
            for (s, module) in stages {
                let mut l = Load {
                    tensors: &tensors,
                    prefix: format!("stage{s}."),
                    path: Vec::new(),
                    error: None,
                };
                let m = module.map(&mut l);
                if let Some(e) = l.error {
                    return Err(format!("{}: {e}", wpath.display()));
                }
                loaded.push((s, m));
            }
            worker.stages = loaded;
        }
        for (rank, optims) in self.optims.iter_mut().enumerate() {
            let w = rank % p;
            for (i, o) in optims.iter_mut().enumerate() {
                let s = self.workers[w].stages[i].0;
                let f = ck.join(format!("optimizer-stage{s}.bin"));
                let b = std::fs::read(&f).map_err(|e| format!("{}: {e}", f.display()))?;
                let fresh = optimizer(&self.cfg);
                *o = fresh
                    .from_bytes(burn::tensor::Bytes::from_bytes_vec(b))
                    .map_err(|e| format!("{}: corrupt optimizer state: {e:?}", f.display()))?;
            }
        }
        self.step = state.step;
        Ok(())
    }
}

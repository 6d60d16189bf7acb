//! What decides a training run besides the plan: model, batch, optimizer, steps, seed; and
//! the plan `train` builds from flags when it is not given one.

use crate::data::source::DataSource;
use crate::data::{Sampler, Sampling};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use pipewright_core::cluster::Cluster;
use pipewright_core::job::{build, JobSpec, LayerCut, PipelineShape, Routes, SkipRoutes};
use pipewright_core::plan::ir::Plan;
use pipewright_core::plan::validate::{validate, ValidPlan};
use pipewright_core::plan::ScheduleKind;
use pipewright_core::profile::{Profile, STATE_COPIES};
use serde::{Deserialize, Serialize};

/// How the learning rate falls after the warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// Half a cosine from `lr` to `min_lr` (the default).
    #[default]
    Cosine,
    /// A straight line from `lr` to `min_lr`.
    Linear,
    /// `lr` throughout.
    Constant,
}

impl LrSchedule {
    fn is_cosine(&self) -> bool {
        *self == LrSchedule::Cosine
    }
}

/// Everything that decides a training run (also written into checkpoints).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    pub model: ModelConfig,
    /// Schedule of the generated plan (ignored with a plan file).
    pub schedule: ScheduleKind,
    /// Pipeline depth P of the generated plan.
    pub stages: usize,
    /// Stage chunks per worker (interleaved, zbv).
    pub chunks: usize,
    /// Data-parallel replicas D of the generated plan.
    pub replicas: usize,
    /// Micro-batches M per replica per step of the generated plan.
    pub microbatches: usize,
    /// Sequences per micro-batch.
    pub rows: usize,
    pub steps: u64,
    /// Train for this many epochs of the training data instead (`steps` follows once the
    /// data and the plan's micro-batches are known: [`TrainConfig::resolve_epochs`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epochs: Option<u64>,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup: u64,
    /// Warmup as a fraction of the steps instead of a count (Hugging Face's `warmup_ratio`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_ratio: Option<f64>,
    /// How the learning rate falls from `lr` to `min_lr` after the warmup.
    #[serde(skip_serializing_if = "LrSchedule::is_cosine")]
    pub lr_schedule: LrSchedule,
    pub weight_decay: f32,
    /// Global gradient-norm clip.
    pub clip: f32,
    pub seed: u64,
    /// How steps draw sequences from the training text: random windows, or epochs over fixed
    /// samples (needed by the frozen-prefix cache).
    pub sampling: Sampling,
    /// Group a task's examples by length within an epoch (`--bucket`; see
    /// [`Sampler::bucketed`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bucket: bool,
    /// A Hugging Face model directory whose weights the run starts from (fine-tuning);
    /// none: fresh weights from the seed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pretrained: Option<std::path::PathBuf>,
    /// The tokenizer the data was read with (`gpt2`, `cl100k`, a tokenizer.json); none:
    /// bytes. Kept in checkpoints so that `generate` reads and writes text the same way.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// The data the run learns from; none: the built-in corpus. Kept in checkpoints so that
    /// `eval` scores what was trained.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<DataSource>,
    /// How a SkipPipe plan's routes are searched (`skip_plan`).
    pub skip_search: SkipSearch,
}

/// The route search of a SkipPipe plan that training builds for itself: short, and
/// deterministic unless the time cap stops it first (then the plan depends on the machine).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SkipSearch {
    /// Local-search moves.
    pub moves: usize,
    /// Seconds the search may take at most.
    pub time_limit: f64,
}

impl Default for SkipSearch {
    fn default() -> Self {
        SkipSearch {
            moves: 2000,
            time_limit: 30.0,
        }
    }
}

/// A SkipPipe plan as training searched it, with what the search did.
pub struct SkipPlanned {
    pub plan: ValidPlan,
    pub moves: usize,
    pub seconds: f64,
    /// The time cap stopped the search before its moves: the plan depends on the machine.
    pub time_limit_hit: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: ModelConfig::default(),
            schedule: ScheduleKind::OneFOneB,
            stages: 2,
            chunks: 1,
            replicas: 1,
            microbatches: 4,
            rows: 4,
            steps: 60,
            epochs: None,
            lr: 3e-3,
            min_lr: 3e-4,
            warmup: 5,
            warmup_ratio: None,
            lr_schedule: LrSchedule::Cosine,
            weight_decay: 0.01,
            clip: 1.0,
            seed: 42,
            sampling: Sampling::Windows,
            bucket: false,
            pretrained: None,
            tokenizer: None,
            data: None,
            skip_search: SkipSearch::default(),
        }
    }
}

impl TrainConfig {
    /// Learning rate at `step`: linear warmup, then down to `min_lr` at the last step along
    /// the `lr_schedule` (a constant one stays at `lr`).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.steps.saturating_sub(self.warmup).max(1) as f64;
        let t = ((step - self.warmup) as f64 / span).min(1.0);
        let left = match self.lr_schedule {
            LrSchedule::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * t).cos()),
            LrSchedule::Linear => 1.0 - t,
            LrSchedule::Constant => 1.0,
        };
        self.min_lr + (self.lr - self.min_lr) * left
    }

    /// Fix `steps` from `epochs` and `warmup` from `warmup_ratio`, now that an epoch is known
    /// to take `epoch_steps` steps. Idempotent: a resumed run resolves to the same steps.
    pub fn resolve_epochs(&mut self, epoch_steps: u64) -> Result<()> {
        if let Some(e) = self.epochs {
            self.steps = e
                .checked_mul(epoch_steps)
                .filter(|&s| s > 0)
                .ok_or_else(|| {
                    Error::Config(format!(
                    "{e} epochs of {epoch_steps} steps: expected at least one step and at most 2^64"
                ))
                })?;
        }
        if let Some(r) = self.warmup_ratio {
            self.warmup = (r * self.steps as f64).ceil() as u64;
        }
        Ok(())
    }

    /// The sampler of this run's micro-batches.
    pub fn sampler(&self) -> Sampler {
        Sampler::new(self.sampling, self.model.seq_len, self.rows, self.seed).bucketed(self.bucket)
    }

    /// Settings that no plan can fix: model shape, batch and optimizer values.
    pub fn check(&self) -> Result<()> {
        self.model.check()?;
        let bad = |m: String| Err(Error::Config(m));
        if self.rows == 0 {
            return bad("rows (sequences per micro-batch) must be at least 1".into());
        }
        // The largest tensor of a micro-batch: rows x seq_len x max(d_model, vocab) values.
        let m = &self.model;
        let values = self
            .rows
            .checked_mul(m.seq_len)
            .and_then(|x| x.checked_mul(m.d_model.max(m.vocab)));
        if values.is_none_or(|v| v > 1 << 31) {
            return bad(format!(
                "rows {} x seq_len {} x max(d_model {}, vocab {}) is more than 2^31 values in one micro-batch's tensors; use fewer rows",
                self.rows, m.seq_len, m.d_model, m.vocab
            ));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("lr {} must be a finite number > 0", self.lr));
        }
        if let Some(r) = self.warmup_ratio.filter(|r| !(0.0..1.0).contains(r)) {
            return bad(format!("warmup_ratio {r} must be in [0, 1)"));
        }
        if self.epochs == Some(0) {
            return bad("epochs must be at least 1".into());
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return bad(format!(
                "min_lr {} must be finite, >= 0 and at most lr {}",
                self.min_lr, self.lr
            ));
        }
        let Some(need) = self.memory_estimate() else {
            return bad(format!(
                "the memory this model and batch need overflows u64 (d_model {}, {} layers, seq_len {}, rows {}, {} micro-batches)",
                self.model.d_model, self.model.layers, self.model.seq_len, self.rows, self.microbatches
            ));
        };
        if let Some(have) = physical_memory() {
            if need > have {
                return bad(format!(
                    "this model and batch need about {:.1} GiB (weights, gradients, AdamW and the activations of {} micro-batches) but the machine has {:.1} GiB",
                    need as f64 / (1u64 << 30) as f64,
                    self.microbatches,
                    have as f64 / (1u64 << 30) as f64
                ));
            }
        }
        if !(self.clip.is_finite() && self.clip > 0.0) {
            return bad(format!("clip {} must be a finite number > 0", self.clip));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight_decay {} must be a finite number >= 0",
                self.weight_decay
            ));
        }
        Ok(())
    }

    /// Bytes training needs at least, roughly: the static bytes of every parameter (4 bytes
    /// each, kept [`STATE_COPIES`] times: weights, gradients, two AdamW moments) and per micro-batch in flight about (12 d_model + 3 heads seq_len) floats per
    /// token per block. `None` if it overflows u64.
    pub fn memory_estimate(&self) -> Option<u64> {
        let m = &self.model;
        let d = m.d_model as u64;
        let params = m.param_count()? as u64;
        let tokens = (self.rows as u64).checked_mul(m.seq_len as u64)?;
        let per_token =
            (12 * d).checked_add((3 * m.heads as u64).checked_mul(m.seq_len as u64)?)?;
        let acts = tokens
            .checked_mul(per_token)?
            .checked_mul(m.layers.max(1) as u64)?
            .checked_mul(4)?
            .checked_mul(self.microbatches.max(1) as u64)?;
        params.checked_mul(4 * STATE_COPIES)?.checked_add(acts)
    }

    /// The whole-job plan of these settings: `replicas` copies of a `stages`-deep pipeline, its
    /// layer blocks cut into stages by the exact partitioner on the model's cost model (built
    /// by core's one path from a job spec to a plan).
    pub fn plan(&self) -> Result<ValidPlan> {
        self.check_job(None)?;
        let profile = self.model.cost_profile(self.rows);
        let plan = build(&self.job_spec(&profile))?;
        self.check_layers(&plan)?;
        Ok(plan)
    }

    /// The SkipPipe plan of these settings with `skip` stages skipped per micro-batch: the
    /// model's own cost profile, `cluster` (or stages x replicas identical devices), and the
    /// [`SkipSearch`] settings. Run once per job: over MPI only the root searches.
    pub fn skip_plan(&self, skip: usize, cluster: Option<&Cluster>) -> Result<SkipPlanned> {
        self.check_job(Some(skip))?;
        let profile = self.model.cost_profile(self.rows);
        let r = pipewright_core::job::build_skip(&self.skip_spec(skip, cluster, &profile))?;
        self.check_layers(&r.plan)?;
        Ok(SkipPlanned {
            plan: r.plan,
            moves: r.moves,
            seconds: r.scheduler_seconds,
            time_limit_hit: r.time_limit_hit,
        })
    }

    /// What building the plan (with `skip` stages skipped: a SkipPipe plan) would refuse before
    /// any work, checked without building it: a launcher refuses a bad job before it starts
    /// processes, and the route search runs only where the plan is built. Returns the plan's
    /// workers (on identical devices; none past the largest count).
    pub fn check_job(&self, skip: Option<usize>) -> Result<Option<usize>> {
        self.check()?;
        let blocks = self.model.num_blocks();
        let stages = self.stages.saturating_mul(self.chunks);
        if stages > blocks {
            return Err(Error::Config(format!(
                "the plan has {stages} stages but the model has only {blocks} layer blocks (embedding, {} transformer blocks, head)",
                self.model.layers
            )));
        }
        let s = &self.skip_search;
        if !(s.time_limit.is_finite() && s.time_limit > 0.0 && s.time_limit <= 3600.0) {
            return Err(Error::Config(format!(
                "skip_search.time_limit {:?}: seconds between 0 and 3600",
                s.time_limit
            )));
        }
        let profile = self.model.cost_profile(self.rows);
        let spec = match skip {
            Some(k) => self.skip_spec(k, None, &profile),
            None => self.job_spec(&profile),
        };
        spec.check()?;
        Ok(spec.workers())
    }

    /// The SkipPipe job of these settings.
    fn skip_spec<'a>(
        &self,
        skip: usize,
        cluster: Option<&'a Cluster>,
        profile: &'a Profile,
    ) -> JobSpec<'a> {
        let s = &self.skip_search;
        JobSpec {
            cluster,
            routes: Routes::Skip(SkipRoutes {
                skip,
                max_swaps: 1,
                moves: s.moves,
                time_limit: std::time::Duration::from_secs_f64(s.time_limit),
                seed: self.seed,
                mechanics: Default::default(),
                max_node_load: None,
                // SkipPipe's cost model prices geo-distributed routes, not these local ones.
                polish_moves: 0,
            }),
            ..self.job_spec(profile)
        }
    }

    /// The job these settings describe, its layers cut on `profile` (the model's costs).
    pub fn job_spec<'a>(&self, profile: &'a Profile) -> JobSpec<'a> {
        let shape = PipelineShape {
            depth: self.stages,
            chunks: self.chunks,
            replicas: self.replicas,
            microbatches: self.microbatches,
        };
        JobSpec::new(self.schedule, shape).with_layers(LayerCut::Profile(profile))
    }

    /// Can this model train with `plan`? Its layer count must be the model's and it must be
    /// valid.
    pub fn check_plan(&self, plan: &Plan) -> Result<()> {
        self.check_layers(plan)?;
        validate(plan)?;
        Ok(())
    }

    /// `plan` as this model trains it: its layers checked against the model, and validated
    /// unless it already is (a plan `job::build` made is taken as it is).
    pub fn accept(&self, plan: impl Into<PlanIn>) -> Result<Plan> {
        match plan.into() {
            PlanIn::Valid(p) => {
                self.check_layers(&p)?;
                Ok(p.into_plan())
            }
            PlanIn::Unchecked(p) => {
                self.check_plan(&p)?;
                Ok(p)
            }
        }
    }

    /// A plan's layer count must be the model's.
    fn check_layers(&self, plan: &Plan) -> Result<()> {
        let blocks = self.model.num_blocks();
        if plan.num_layers() != blocks {
            return Err(Error::Config(format!(
                "the plan holds {} layers (per stage {:?}) but the model has {blocks} layer blocks (embedding, {} transformer blocks, head); plan for this model, or train a model of {} transformer blocks",
                plan.num_layers(),
                plan.layers_per_stage(),
                self.model.layers,
                plan.num_layers().saturating_sub(2)
            )));
        }
        Ok(())
    }
}

/// A plan given to a trainer: one already validated, or one to validate (a plan file, a plan
/// made by hand).
pub enum PlanIn {
    Valid(ValidPlan),
    Unchecked(Plan),
}

impl PlanIn {
    pub fn plan(&self) -> &Plan {
        match self {
            PlanIn::Valid(p) => p,
            PlanIn::Unchecked(p) => p,
        }
    }
}

impl From<ValidPlan> for PlanIn {
    fn from(p: ValidPlan) -> Self {
        PlanIn::Valid(p)
    }
}

impl From<Plan> for PlanIn {
    fn from(p: Plan) -> Self {
        PlanIn::Unchecked(p)
    }
}

/// The machine's memory (Linux: MemTotal), if known.
fn physical_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = text
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    kb.checked_mul(1024)
}

//! `train --freeze ... --elastic`: PipeTransformer's AutoFreeze, and AutoPipe + AutoDP through
//! in-memory re-planning, driven between training steps.

use crate::BadInput;
use anyhow::Result;
use clap::Args;
use pipewright_core::cluster::Cluster;
use pipewright_core::elastic::{elastic_layout, peak_memory, ElasticChoice, GlobalBatch, Shape};
use pipewright_core::freeze::{FreezeMode, FreezePolicy};
use pipewright_core::ir::Plan;
use pipewright_core::profile::Profile;
use pipewright_core::schedule::ScheduleKind;
use pipewright_runtime::cache::PrefixCache;
use pipewright_runtime::train::{StepReport, Trainer};

#[derive(Args)]
pub struct FreezeArgs {
    /// Freeze converged front layer blocks: `adaptive` (gradient norms settled), `schedule`
    /// (the released rule, L (1 - (1 - alpha)^e) after decision e) or `off`.
    #[arg(long, value_enum, default_value = "off")]
    freeze: FreezeMode,
    /// Steps between freeze decisions (default: once per epoch of the training text).
    #[arg(long)]
    freeze_every: Option<u64>,
    /// Fraction of the still-training prefix that may freeze at one decision (adaptive), or
    /// the schedule's rate.
    #[arg(long, default_value_t = 0.3)]
    freeze_alpha: f64,
    /// Relative change of a layer's gradient norm below which it has settled (adaptive).
    #[arg(long, default_value_t = 0.1)]
    freeze_threshold: f64,
    /// Decisions over which a layer must stay settled (adaptive).
    #[arg(long, default_value_t = 2)]
    freeze_window: usize,
    /// Most of the freezable layer blocks (all but the head) that may ever freeze.
    #[arg(long, default_value_t = 0.8)]
    max_frozen: f64,
    /// On each freeze change, re-cut the training layers over the fastest depth that fits
    /// each worker's memory (as the starting plan uses it) and turn freed workers into more
    /// data-parallel replicas, at the same global batch.
    #[arg(long)]
    elastic: bool,
    /// With --elastic: `keep` the global batch (more replicas, fewer micro-batches each) or
    /// `scale` it (every replica keeps its micro-batches; the learning rate grows with the
    /// batch, the linear scaling rule).
    #[arg(long, value_enum, default_value = "keep", requires = "elastic")]
    elastic_batch: ElasticBatch,
    /// AutoCache: keep the frozen prefix's output for each training sample, up to this many
    /// bytes in memory (suffixes K, M, G: powers of 1024), the rest in a spill file; later
    /// epochs skip the frozen layers. Implies --sampling epochs.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub cache_budget: Option<u64>,
    /// Keep cached activations as f16 (half the bytes; the frozen output is rounded).
    #[arg(long, requires = "cache_budget")]
    cache_f16: bool,
    /// Directory for the cache's spill file (deleted when the run ends; default: the system's
    /// temporary directory).
    #[arg(long, requires = "cache_budget")]
    cache_dir: Option<std::path::PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ElasticBatch {
    Keep,
    Scale,
}

/// `123`, `64K`, `512M`, `2G` (powers of 1024).
fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                _ => return Err(format!("{s:?}: expected bytes, e.g. 1000000, 512M or 2G")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| {
            format!("{s:?}: expected bytes, e.g. 1000000, 512M or 2G (at most 2^64 - 1)")
        })
}

impl FreezeArgs {
    /// The frozen-prefix cache these flags ask for (checked against the freeze mode).
    pub fn cache(&self) -> Result<Option<std::sync::Arc<PrefixCache>>> {
        let Some(budget) = self.cache_budget else {
            return Ok(None);
        };
        if self.freeze == FreezeMode::Off {
            return Err(BadInput(
                "--cache-budget caches frozen layers: it needs --freeze adaptive or schedule"
                    .into(),
            )
            .into());
        }
        let dir = self.cache_dir.clone().unwrap_or_else(std::env::temp_dir);
        let cache = PrefixCache::new(budget, self.cache_f16, &dir);
        cache
            .check_dir()
            .map_err(|e| BadInput(format!("--cache-dir: {e}")))?;
        Ok(Some(std::sync::Arc::new(cache)))
    }
}

/// The freeze and elastic state of a run.
pub struct Controller {
    policy: FreezePolicy,
    every: u64,
    elastic: bool,
    decisions: usize,
    /// Mean gradient norm of each freezable layer block over each decision's steps.
    history: Vec<Vec<f64>>,
    sum: Vec<f64>,
    steps: usize,
    workers: usize,
    total_mbs: usize,
    kind: ScheduleKind,
    budget: u64,
    cluster: Cluster,
    /// Worker processes (MPI): every layout uses all of them.
    all_workers: bool,
    /// Scale the global batch with the replicas (micro-batches per replica at the start).
    scale_from: Option<usize>,
}

impl Controller {
    /// `None` when nothing freezes (no controller needed).
    pub fn new(
        a: &FreezeArgs,
        trainer: &Trainer,
        links: Option<&Cluster>,
        epoch_steps: u64,
        mpi: bool,
    ) -> Result<Option<Self>> {
        if a.freeze == FreezeMode::Off {
            if a.elastic || a.freeze_every.is_some() {
                return Err(BadInput(
                    "--elastic and --freeze-every need --freeze adaptive or schedule".into(),
                )
                .into());
            }
            return Ok(None);
        }
        let policy = FreezePolicy {
            mode: a.freeze,
            alpha: a.freeze_alpha,
            threshold: a.freeze_threshold,
            window: a.freeze_window,
            max_fraction: a.max_frozen,
        };
        policy
            .check()
            .map_err(|e| BadInput(format!("--freeze: {e}")))?;
        let cfg = &trainer.cfg;
        let plan = &trainer.plan;
        let every = a.freeze_every.unwrap_or(epoch_steps);
        if every == 0 {
            return Err(BadInput("--freeze-every must be at least 1".into()).into());
        }
        let kind = if plan.kind.default_chunks() == 1 && plan.kind != ScheduleKind::Custom {
            plan.kind
        } else {
            ScheduleKind::OneFOneB
        };
        let p = plan.num_workers();
        let cluster = match links {
            Some(c) => pipewright_core::sim::devices_for_plan(plan, c)?,
            None => Cluster::uniform(p),
        };
        // The memory each worker may use: what the starting plan needs on its fullest one.
        let profile = cfg.model.cost_profile(cfg.rows);
        let costs = profile.stage_costs(&plan.layers_per_stage());
        let budget = peak_memory(plan, &costs, &cluster)?;
        let freezable = cfg.model.num_blocks() - 1;
        Ok(Some(Controller {
            policy,
            every,
            elastic: a.elastic,
            decisions: 0,
            history: Vec::new(),
            sum: vec![0.0; freezable],
            steps: 0,
            workers: p,
            total_mbs: plan.num_microbatches,
            kind,
            budget,
            cluster,
            all_workers: mpi,
            scale_from: (a.elastic_batch == ElasticBatch::Scale).then(|| {
                let replicas = plan.stages.iter().map(|s| s.hosts.len()).max().unwrap_or(1);
                plan.num_microbatches / replicas.max(1)
            }),
        }))
    }

    /// The fastest layout with `frozen` blocks frozen that fits each worker's memory (using
    /// every worker process under MPI).
    fn layout(
        &self,
        profile: &Profile,
        frozen: usize,
    ) -> pipewright_core::error::Result<ElasticChoice> {
        let shape = Shape {
            workers: self.workers,
            use_all: self.all_workers,
            batch: match self.scale_from {
                Some(m) => GlobalBatch::Scale(m),
                None => GlobalBatch::Keep(self.total_mbs),
            },
        };
        elastic_layout(
            profile,
            frozen,
            shape,
            self.kind,
            &self.cluster,
            self.budget,
        )
    }

    /// Switch to `plan` and, when the global batch scales, the learning rate with it.
    fn replan(&self, trainer: &mut Trainer, plan: Plan) -> Result<String> {
        let before = trainer.plan.num_microbatches;
        trainer.replan(plan)?;
        if self.scale_from.is_none() || trainer.plan.num_microbatches == before {
            return Ok(String::new());
        }
        let x = trainer.plan.num_microbatches as f64 / self.total_mbs as f64;
        trainer.set_lr_scale(x)?;
        Ok(format!(
            "; global batch {} -> {} micro-batches, learning rate x{x:.3}",
            self.total_mbs, trainer.plan.num_microbatches
        ))
    }

    /// After a resume: count the decisions already taken, and freeze again what the
    /// checkpoint had frozen (re-planning first when elastic). Returns what it did, to log.
    pub fn resumed(
        &mut self,
        trainer: &mut Trainer,
        step: u64,
        frozen: usize,
    ) -> Result<Option<String>> {
        self.decisions = (step / self.every) as usize;
        if frozen <= trainer.frozen() {
            return Ok(None);
        }
        if self.elastic {
            let profile = trainer.cfg.model.cost_profile(trainer.cfg.rows);
            if let Ok(c) = self.layout(&profile, frozen) {
                let scaled = self.replan(trainer, c.plan)?;
                trainer.set_frozen(frozen)?;
                return Ok(Some(format!(
                    "the checkpoint had layer blocks 0..{frozen} frozen: frozen again on {}{scaled}",
                    pipewright_runtime::train::describe(&trainer.plan)
                )));
            }
        }
        Ok(Some(format!(
            "warning: the checkpoint had layer blocks 0..{frozen} frozen, but stage 0 of this plan ({:?}) has no room for them with a training layer after; they train again",
            trainer.plan.layers_per_stage()
        )))
    }

    /// After a step: maybe freeze more layers (and re-plan). Returns what changed, to log.
    pub fn after_step(&mut self, trainer: &mut Trainer, r: &StepReport) -> Result<Option<String>> {
        for (s, n) in self.sum.iter_mut().zip(&r.layer_norms) {
            *s += n;
        }
        self.steps += 1;
        if !r.step.is_multiple_of(self.every) {
            return Ok(None);
        }
        self.history
            .push(self.sum.iter().map(|s| s / self.steps as f64).collect());
        self.sum.iter_mut().for_each(|s| *s = 0.0);
        self.steps = 0;
        self.decisions += 1;
        let before = trainer.frozen();
        let freezable = self.sum.len();
        let mut want = self
            .policy
            .decide(self.decisions, before, freezable, &self.history);
        if want == before {
            return Ok(None);
        }
        let t0 = std::time::Instant::now();
        let old = pipewright_runtime::train::describe(&trainer.plan);
        let mut next: Option<Plan> = None;
        if self.elastic {
            // The deepest freeze that some layout fits; none: keep the plan.
            let profile = trainer.cfg.model.cost_profile(trainer.cfg.rows);
            let fit = (before + 1..=want)
                .rev()
                .find_map(|k| self.layout(&profile, k).ok().map(|c| (k, c)));
            if let Some((k, c)) = fit {
                want = k;
                if c.plan.layers_per_stage() != trainer.plan.layers_per_stage()
                    || c.plan.num_workers() != trainer.plan.num_workers()
                {
                    next = Some(c.plan);
                }
            }
        }
        // Without a re-plan the frozen prefix must fit inside stage 0.
        let stage0 = next
            .as_ref()
            .unwrap_or(&trainer.plan)
            .layers_per_stage()
            .first()
            .copied()
            .unwrap_or(1);
        want = want.min(stage0.saturating_sub(1));
        if want <= before {
            return Ok(None);
        }
        let scaled = match next {
            Some(plan) => self.replan(trainer, plan)?,
            None => String::new(),
        };
        trainer.set_frozen(want)?;
        let new = pipewright_runtime::train::describe(&trainer.plan);
        Ok(Some(if new == old {
            format!(
                "step {}: froze layer blocks 0..{want} (was {before}) in {:.3} s; plan kept: {new}",
                r.step,
                t0.elapsed().as_secs_f64()
            )
        } else {
            format!(
                "step {}: froze layer blocks 0..{want} (was {before}) and re-planned in {:.3} s{scaled}\n  before: {old}\n  after:  {new}",
                r.step,
                t0.elapsed().as_secs_f64()
            )
        }))
    }
}

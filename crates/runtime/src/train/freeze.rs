//! PipeTransformer's AutoFreeze, and AutoPipe + AutoDP through in-memory re-planning, decided
//! between training steps. The rules are core's (`policy::freeze`, `policy::elastic`); this
//! drives them from a trainer's gradient norms and applies what they decide.

use super::{describe, StepReport, Trainer};
use crate::error::{Error, Result};
use pipewright_core::cluster::Cluster;
use pipewright_core::plan::ir::Plan;
use pipewright_core::plan::ScheduleKind;
use pipewright_core::policy::critical::{choose, weight_frozen_profile};
use pipewright_core::policy::elastic::{
    elastic_layout, frozen_profile, keep_unless_faster, peak_memory, ElasticChoice, GlobalBatch,
    Shape,
};
use pipewright_core::policy::freeze::{default_interval, max_frozen, FreezeMode, FreezePolicy};
use pipewright_core::profile::Profile;

/// The least relative shortening of the simulated iteration for which `--freeze critical`
/// freezes one more settled block: a block whose freezing buys under 1% keeps training.
const CRITICAL_MIN_GAIN: f64 = 0.01;

/// The first `n` layer blocks, as a person reads a range ("layer blocks 0-2", not Rust's
/// exclusive `0..3`).
pub fn first_blocks(n: usize) -> String {
    match n {
        0 => "no layer blocks".into(),
        1 => "layer block 0".into(),
        n => format!("layer blocks 0-{}", n - 1),
    }
}

/// What freezes when, and whether the layout follows.
#[derive(Debug, Clone, PartialEq)]
pub struct FreezeSettings {
    pub policy: FreezePolicy,
    /// Steps between freeze decisions (default: a tenth of an epoch, at least 10 steps;
    /// `policy::freeze::default_interval`).
    pub every: Option<u64>,
    /// Re-cut the training layers over the fastest depth that fits, and turn freed workers
    /// into more data-parallel replicas (AutoPipe + AutoDP).
    pub elastic: bool,
    /// With `elastic`: every replica keeps its micro-batches, so the global batch grows and
    /// the learning rate with it (the linear scaling rule); else the global batch is kept.
    pub scale_batch: bool,
}

/// The freeze and elastic state of a run.
pub struct FreezeController {
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

impl FreezeController {
    /// `None` when nothing freezes (no controller needed).
    pub fn new(
        a: &FreezeSettings,
        trainer: &Trainer,
        links: Option<&Cluster>,
        epoch_steps: u64,
        mpi: bool,
    ) -> Result<Self> {
        let policy = a.policy;
        policy
            .check()
            .map_err(|e| Error::Config(format!("freeze policy: {e}")))?;
        let cfg = &trainer.cfg;
        let plan = &trainer.plan;
        if trainer.ties_embeddings() && policy.mode != FreezeMode::Critical {
            return Err(Error::Config(
                "a frozen prefix starts with the embedding, which a model with tied embeddings cannot freeze (its LM head's copy would train alone): freeze by the critical policy (it leaves the embedding training) or untie them (tie_word_embeddings = false)".into(),
            ));
        }
        let every = a.every.unwrap_or(default_interval(epoch_steps));
        if every == 0 {
            return Err(Error::Config(
                "steps between freeze decisions must be at least 1".into(),
            ));
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
        Ok(FreezeController {
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
            scale_from: a
                .scale_batch
                .then(|| plan.num_microbatches / plan.replicas()),
        })
    }

    /// The fastest layout with `frozen` blocks frozen that fits each worker's memory (using
    /// every worker process under MPI); `current` unless another is rated strictly faster.
    fn layout(
        &self,
        profile: &Profile,
        frozen: usize,
        current: &Plan,
    ) -> pipewright_core::error::Result<ElasticChoice> {
        let shape = Shape {
            workers: self.workers,
            use_all: self.all_workers,
            batch: match self.scale_from {
                Some(m) => GlobalBatch::Scale(m),
                None => GlobalBatch::Keep(self.total_mbs),
            },
        };
        let best = elastic_layout(
            profile,
            frozen,
            shape,
            self.kind,
            &self.cluster,
            self.budget,
        )?;
        // Under MPI every process must stay in the job: the current plan qualifies only if it
        // uses them all, and it must hold the frozen prefix in stage 0.
        if frozen > max_frozen(current)
            || (self.all_workers && current.num_workers() != self.workers)
        {
            return Ok(best);
        }
        let fp = frozen_profile(profile, frozen);
        keep_unless_faster(best, current, &fp, &self.cluster, self.budget)
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
            if let Ok(c) = self.layout(&profile, frozen, &trainer.plan) {
                let scaled = self.replan(trainer, c.plan)?;
                trainer.set_frozen(frozen)?;
                return Ok(Some(format!(
                    "the checkpoint had {} frozen: frozen again on {}{scaled}",
                    first_blocks(frozen),
                    describe(&trainer.plan)
                )));
            }
        }
        Ok(Some(format!(
            "warning: the checkpoint had {} frozen, but stage 0 of this plan ({:?}) has no room for them with a training layer after; they train again",
            first_blocks(frozen),
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
        if !self.policy.may_freeze(r.step, trainer.cfg.steps) {
            return Ok(None);
        }
        if self.policy.mode == FreezeMode::Critical {
            return self.critical(trainer, r.step);
        }
        let before = trainer.frozen();
        let freezable = self.sum.len();
        let mut want = self
            .policy
            .decide(self.decisions, before, freezable, &self.history);
        if want == before {
            return Ok(None);
        }
        let t0 = std::time::Instant::now();
        let old = describe(&trainer.plan);
        let mut next: Option<Plan> = None;
        if self.elastic {
            // The deepest freeze that some layout fits; none: keep the plan.
            let profile = trainer.cfg.model.cost_profile(trainer.cfg.rows);
            let fit = (before + 1..=want)
                .rev()
                .find_map(|k| self.layout(&profile, k, &trainer.plan).ok().map(|c| (k, c)));
            if let Some((k, c)) = fit {
                want = k;
                if c.plan.layers_per_stage() != trainer.plan.layers_per_stage()
                    || c.plan.num_workers() != trainer.plan.num_workers()
                {
                    next = Some(c.plan);
                }
            }
        }
        // The frozen prefix must fit the plan it will run under.
        want = want.min(max_frozen(next.as_ref().unwrap_or(&trainer.plan)));
        if want <= before {
            return Ok(None);
        }
        let scaled = match next {
            Some(plan) => self.replan(trainer, plan)?,
            None => String::new(),
        };
        trainer.set_frozen(want)?;
        let new = describe(&trainer.plan);
        Ok(Some(if new == old {
            format!(
                "step {}: froze {} ({before} before) in {:.3} s; plan kept: {new}",
                r.step,
                first_blocks(want),
                t0.elapsed().as_secs_f64()
            )
        } else {
            format!(
                "step {}: froze {} ({before} before) and re-planned in {:.3} s{scaled}\n  before: {old}\n  after:  {new}",
                r.step,
                first_blocks(want),
                t0.elapsed().as_secs_f64()
            )
        }))
    }

    /// `--freeze critical`: among the settled blocks (the adaptive rule's test, block by
    /// block), the simulator picks those whose freezing shortens the iteration most (a prefix
    /// whole, others by weight only); then AutoPipe + AutoDP as for a prefix.
    fn critical(&mut self, trainer: &mut Trainer, step: u64) -> Result<Option<String>> {
        let (prefix, weight_only) = (trainer.frozen(), trainer.weight_only().to_vec());
        let freezable = self.sum.len();
        let mut settled =
            self.policy
                .settled_blocks(prefix, &weight_only, freezable, &self.history);
        if trainer.ties_embeddings() {
            settled[0] = false; // the LM head's copy of it trains
        }
        let frozen_now = prefix + weight_only.len();
        let room = self.policy.cap(freezable).saturating_sub(frozen_now);
        let max_new = self.policy.step(freezable - frozen_now).min(room);
        if max_new == 0 || !settled.contains(&true) {
            return Ok(None);
        }
        let t0 = std::time::Instant::now();
        let profile = trainer.cfg.model.cost_profile(trainer.cfg.rows);
        let c = choose(
            &trainer.plan,
            &profile,
            &self.cluster,
            &settled,
            prefix,
            &weight_only,
            CRITICAL_MIN_GAIN,
            max_new,
        )?;
        if (c.prefix, &c.weight_only) == (prefix, &weight_only) {
            return Ok(None);
        }
        let old = describe(&trainer.plan);
        let mut scaled = String::new();
        if self.elastic {
            let fp = weight_frozen_profile(&profile, 0, &c.weight_only);
            if let Ok(l) = self.layout(&fp, c.prefix, &trainer.plan) {
                if l.plan.layers_per_stage() != trainer.plan.layers_per_stage()
                    || l.plan.num_workers() != trainer.plan.num_workers()
                {
                    scaled = self.replan(trainer, l.plan)?;
                }
            }
        }
        trainer.set_frozen(c.prefix)?;
        trainer.set_weight_only(&c.weight_only)?;
        let new = describe(&trainer.plan);
        let what = match (c.prefix, c.weight_only.is_empty()) {
            (0, _) => format!("weights of layer blocks {:?}", c.weight_only),
            (p, true) => first_blocks(p),
            (p, false) => format!("{} and the weights of {:?}", first_blocks(p), c.weight_only),
        };
        let plan = match new == old {
            true => format!("plan kept: {new}"),
            false => format!("re-planned{scaled}\n  before: {old}\n  after:  {new}"),
        };
        let secs = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.4}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        Ok(Some(format!(
            "step {step}: froze {what} (settled: {:?}); simulated iteration {:.4} -> {:.4} s (the model's cost estimate), each stage's compute on its critical path [{}] -> [{}] s; decided in {:.3} s; {plan}",
            (0..freezable).filter(|&i| settled[i]).collect::<Vec<_>>(),
            c.before,
            c.after,
            secs(&c.path_before),
            secs(&c.path_after),
            t0.elapsed().as_secs_f64()
        )))
    }
}

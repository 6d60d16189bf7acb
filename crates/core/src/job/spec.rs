//! The one path from intent to plan: a [`JobSpec`] (schedule, pipeline shape, how layers are
//! cut, where workers run, which routes micro-batches take) becomes a validated whole-job plan
//! in [`build`]. `train`, `simulate`, `schedule`, `skip-plan`, the planner and elastic
//! re-planning all call it; zb-auto and SkipPipe's routes are cases of it, not paths beside it.

use crate::cluster::Cluster;
use crate::error::{Error, Result};
use crate::plan::ir::Plan;
use crate::plan::validate::ValidPlan;
use crate::plan::ScheduleKind;
use crate::profile::{Profile, StageCost};
use crate::schedule::{check_request, generate};
use crate::search::partition::{assign_layers, min_max_split};
use crate::search::skipplan::{skip_plan, SkipResult, SkipSetup};
use crate::search::zbauto::zb_auto;
use crate::sim::devices_for_plan;
use std::time::Duration;

/// How many workers, chunks, replicas and micro-batches a job has. Named fields, because
/// positional runs of `usize` are easy to mis-order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineShape {
    /// Workers in one pipeline (P).
    pub depth: usize,
    /// Stage chunks per worker (interleaved V; zbv 2; the others 1).
    pub chunks: usize,
    /// Data-parallel copies of the pipeline (D); SkipPipe: data nodes.
    pub replicas: usize,
    /// Micro-batches per replica per iteration (M).
    pub microbatches: usize,
}

impl PipelineShape {
    /// `depth` x `replicas` workers with `microbatches` each, at `kind`'s default chunks.
    pub fn new(kind: ScheduleKind, depth: usize, replicas: usize, microbatches: usize) -> Self {
        PipelineShape {
            depth,
            chunks: kind.default_chunks(),
            replicas,
            microbatches,
        }
    }
}

/// How the model's layers are cut into the plan's stages.
#[derive(Debug, Clone, Copy)]
pub enum LayerCut<'a> {
    /// One layer per stage (a schedule on its own).
    OnePerStage,
    /// This many layers, as evenly as the stages allow (no costs known).
    Even(usize),
    /// The exact partitioner on the profile's layer costs, each stage timed on its worker's
    /// device; the plan carries each stage's costs.
    Profile(&'a Profile),
    /// Layers per stage as given, each stage's costs from the profile's layers.
    Given(&'a [usize], &'a Profile),
}

/// SkipPipe's route search settings (the shape's replicas are its data nodes).
#[derive(Debug, Clone, Copy)]
pub struct SkipRoutes {
    /// Middle stages each micro-batch skips.
    pub skip: usize,
    /// Swaps of neighbouring stages allowed per route.
    pub max_swaps: usize,
    /// Local-search moves per search.
    pub moves: usize,
    /// Wall-clock cap on the search.
    pub time_limit: Duration,
    pub seed: u64,
    /// How the search prices candidates (see [`SkipSetup::mechanics`]).
    pub mechanics: crate::sim::SimOptions,
    /// Micro-batches a middle stage's worker serves per iteration at most.
    pub max_node_load: Option<usize>,
    /// Moves of the search's last phase (see [`SkipSetup::polish_moves`]).
    pub polish_moves: usize,
}

/// Which way micro-batches travel.
#[derive(Debug, Clone, Copy)]
pub enum Routes {
    /// Every micro-batch through every stage of its replica, in model order.
    Pipeline,
    /// SkipPipe: each micro-batch visits a subset of the stages on searched routes.
    Skip(SkipRoutes),
}

/// Everything that decides a whole-job plan.
#[derive(Debug, Clone, Copy)]
pub struct JobSpec<'a> {
    pub kind: ScheduleKind,
    pub shape: PipelineShape,
    pub layers: LayerCut<'a>,
    /// Devices and links; default: identical devices, one per worker.
    pub cluster: Option<&'a Cluster>,
    /// Cluster device of each worker (the plan names them); default: worker w on device w.
    pub devices: Option<&'a [usize]>,
    /// zb-auto: stage-chunks of activations a worker may hold (default: the depth, 1F1B's).
    pub mem_cap: Option<usize>,
    /// zb-auto: every stage's costs when its layers carry none (default: 1 each).
    pub uniform_cost: Option<StageCost>,
    pub routes: Routes,
}

impl<'a> JobSpec<'a> {
    /// A pipeline of `kind` and `shape`, one layer per stage, identical devices.
    pub fn new(kind: ScheduleKind, shape: PipelineShape) -> Self {
        JobSpec {
            kind,
            shape,
            layers: LayerCut::OnePerStage,
            cluster: None,
            devices: None,
            mem_cap: None,
            uniform_cost: None,
            routes: Routes::Pipeline,
        }
    }

    /// The same spec with its layers cut by `layers`.
    pub fn with_layers(self, layers: LayerCut<'a>) -> Self {
        JobSpec { layers, ..self }
    }

    /// The workers [`build`]'s plan will have, known without building it (a launcher starts
    /// that many processes, and a route search is not run twice): a worker per stage of each
    /// replica (SkipPipe: of each data node). A skip job on a cluster places its stages on the
    /// cluster's devices, so it has none to count here.
    pub fn workers(&self) -> Option<usize> {
        match (self.routes, self.cluster) {
            (Routes::Skip(_), Some(_)) => None,
            _ => self.shape.depth.checked_mul(self.shape.replicas),
        }
    }

    /// What [`build`] refuses before any work (a shape no schedule takes, SkipPipe's rules),
    /// checked without building: a launcher refuses a bad job before it starts processes,
    /// and no route search runs twice. [`build`] may still refuse what only the work shows
    /// (a layer cut that does not fit, routes that cannot be found).
    pub fn check(&self) -> Result<()> {
        match self.routes {
            Routes::Skip(_) => {
                let (profile, uniform, setup) = skip_setup(self)?;
                let cluster = self.cluster.unwrap_or(&uniform);
                crate::search::skipplan::check_setup(profile, cluster, &setup)
            }
            Routes::Pipeline => {
                let s = self.shape;
                check_request(self.kind, s.depth, s.microbatches, s.chunks)
            }
        }
    }
}

/// The validated whole-job plan of `spec`.
pub fn build(spec: &JobSpec) -> Result<ValidPlan> {
    let plan = match spec.routes {
        Routes::Skip(_) => return Ok(build_skip(spec)?.plan),
        Routes::Pipeline => pipeline(spec)?,
    };
    // A generated plan that breaks a rule is pipewright's fault, not the input's.
    ValidPlan::new(plan).map_err(|e| {
        Error::Internal(format!(
            "the generated {} plan does not validate: {e}",
            spec.kind
        ))
    })
}

/// A SkipPipe job: the plan with the search's baselines (full pipeline, random routes).
pub fn build_skip(spec: &JobSpec) -> Result<SkipResult> {
    let (profile, uniform, setup) = skip_setup(spec)?;
    skip_plan(profile, spec.cluster.unwrap_or(&uniform), &setup)
}

/// A skip job's profile, the identical devices it runs on when it names no cluster, and its
/// search settings.
fn skip_setup<'a>(spec: &JobSpec<'a>) -> Result<(&'a Profile, Cluster, SkipSetup)> {
    let (Routes::Skip(r), LayerCut::Profile(profile)) = (spec.routes, spec.layers) else {
        return Err(Error::Schedule(
            "skip routes are searched on layer costs: give the job a profile".into(),
        ));
    };
    let devices = match spec.cluster {
        Some(_) => 0,
        None => spec
            .shape
            .depth
            .saturating_mul(spec.shape.replicas)
            .min(1 << 16),
    };
    let setup = SkipSetup {
        stages: spec.shape.depth,
        skip: r.skip,
        data_nodes: spec.shape.replicas,
        microbatches: spec.shape.microbatches,
        max_swaps: r.max_swaps,
        moves: r.moves,
        time_limit: r.time_limit,
        seed: r.seed,
        mechanics: r.mechanics,
        max_node_load: r.max_node_load,
        polish_moves: r.polish_moves,
    };
    Ok((profile, Cluster::uniform(devices), setup))
}

/// The plan of a pipeline job, not yet validated.
fn pipeline(spec: &JobSpec) -> Result<Plan> {
    let PipelineShape {
        depth,
        chunks,
        replicas: _,
        microbatches,
    } = spec.shape;
    if spec.mem_cap.is_some() && spec.kind != ScheduleKind::ZbAuto {
        return Err(Error::Schedule(format!(
            "a memory cap is a zb-auto setting; {} has its own memory",
            spec.kind
        )));
    }
    check_request(spec.kind, depth, microbatches, chunks)?;
    let one = if spec.kind == ScheduleKind::ZbAuto {
        // ZB-H1's shape (stage s on worker s), then the order searched for its stage costs.
        let shape = laid_out(spec, generate(ScheduleKind::ZbH1, depth, microbatches, 1)?)?;
        let costs = match shape.stage_costs() {
            Some(c) => c[..depth].to_vec(),
            None => vec![
                spec.uniform_cost
                    .unwrap_or(StageCost::uniform(1.0, 1.0, 1.0));
                depth
            ],
        };
        let first: Vec<usize> = (0..depth).collect();
        let cluster = devices(spec, &shape)?.subset(&first);
        zb_auto(
            depth,
            microbatches,
            &costs,
            &cluster,
            spec.mem_cap.unwrap_or(depth),
        )?
    } else {
        generate(spec.kind, depth, microbatches, chunks)?
    };
    laid_out(spec, one)
}

/// `one` pipeline replicated, placed on the spec's devices and with its layers cut.
fn laid_out(spec: &JobSpec, one: Plan) -> Result<Plan> {
    let mut plan = one.replicate(spec.shape.replicas)?;
    if let (Some(devs), Some(c)) = (spec.devices, spec.cluster) {
        if devs.len() != plan.num_workers() || devs.iter().any(|&d| d >= c.len()) {
            return Err(Error::Schedule(format!(
                "{} devices named for {} workers on a cluster of {}",
                devs.len(),
                plan.num_workers(),
                c.len()
            )));
        }
        plan.devices = devs.iter().map(|&d| c.devices[d].name.clone()).collect();
    }
    match spec.layers {
        LayerCut::OnePerStage => {}
        LayerCut::Even(n) => {
            let split = min_max_split(n, plan.num_stages(), |_, lo, hi| (hi - lo) as f64)
                .map_err(|e| Error::Infeasible(format!("{n} layers: {e}")))?;
            plan.set_layers(&split.layers_per_stage);
        }
        LayerCut::Profile(profile) => {
            let workers = devices(spec, &plan)?;
            assign_layers(profile, &mut plan, &workers)?;
        }
        LayerCut::Given(layers, profile) => {
            if layers.len() != plan.num_stages()
                || layers.iter().sum::<usize>() != profile.layers.len()
            {
                return Err(Error::Infeasible(format!(
                    "layers per stage {layers:?} for {} stages and {} layers",
                    plan.num_stages(),
                    profile.layers.len()
                )));
            }
            plan.set_layers(layers);
            for (st, c) in plan.stages.iter_mut().zip(profile.stage_costs(layers)) {
                st.cost = Some(c);
            }
        }
    }
    Ok(plan)
}

/// The devices `plan`'s workers run on: the cluster's devices it names, else the first ones;
/// identical devices without a cluster.
fn devices(spec: &JobSpec, plan: &Plan) -> Result<Cluster> {
    match spec.cluster {
        Some(c) => devices_for_plan(plan, c),
        None => Ok(Cluster::uniform(plan.num_workers())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Profile;

    /// The count a launcher uses is the count the plan has, for pipelines and skip routes.
    #[test]
    fn workers_are_known_before_the_plan_is_built() {
        let mut toml = String::from("[model]\nname = \"m\"\n");
        for i in 0..8 {
            toml += &format!("[[layers]]\nname = \"l{i}\"\nforward = 1\nbackward = 2\nparams = 4000\nactivation = 100\n");
        }
        let profile = Profile::parse("m.toml", &toml).unwrap();
        for (kind, depth, replicas) in [
            (ScheduleKind::OneFOneB, 3, 2),
            (ScheduleKind::GPipe, 2, 1),
            (ScheduleKind::ZbH1, 3, 1),
        ] {
            let shape = PipelineShape {
                depth,
                chunks: 1,
                replicas,
                microbatches: 4,
            };
            let spec = JobSpec::new(kind, shape).with_layers(LayerCut::Profile(&profile));
            assert_eq!(
                spec.workers(),
                Some(build(&spec).unwrap().num_workers()),
                "{kind}"
            );
        }
        let shape = PipelineShape {
            depth: 4,
            chunks: 1,
            replicas: 2,
            microbatches: 4,
        };
        let spec = JobSpec {
            routes: Routes::Skip(SkipRoutes {
                skip: 1,
                max_swaps: 1,
                moves: 50,
                time_limit: std::time::Duration::from_secs(60),
                seed: 3,
                mechanics: Default::default(),
                max_node_load: None,
                polish_moves: 0,
            }),
            ..JobSpec::new(ScheduleKind::OneFOneB, shape).with_layers(LayerCut::Profile(&profile))
        };
        assert_eq!(spec.workers(), Some(build(&spec).unwrap().num_workers()));
    }
}

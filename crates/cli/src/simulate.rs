//! `schedule` and `simulate`: generate plans and predict their time, bubbles and memory.

use crate::files::{cluster_for_plan, load_valid_plan};
use crate::output::{Mechanics, Outputs};
use crate::BadInput;
use anyhow::Result;
use clap::Args;
use pipewright_core::cluster::Cluster;
use pipewright_core::job::{build, JobSpec, LayerCut, PipelineShape};
use pipewright_core::plan::ir::Plan;
use pipewright_core::plan::validate::ValidPlan;
use pipewright_core::profile::{Profile, StageCost};
use pipewright_core::schedule::ScheduleKind;
use pipewright_core::sim::slotted::{slotted_plan_time, SlottedRun};
use pipewright_core::sim::{check_memory, simulate_with, SimOptions, SimSetup};
use serde_json::json;
use std::path::PathBuf;

#[derive(Args)]
pub struct SchedArgs {
    /// Schedule to generate (`--kind`, the old spelling, is still taken).
    #[arg(long = "schedule", alias = "kind", value_enum, default_value = "1f1b")]
    pub kind: ScheduleKind,
    /// Pipeline depth P: workers in the pipeline (train's default too).
    #[arg(long, default_value_t = 2)]
    pub stages: usize,
    /// Micro-batches M per iteration, per replica (train's default too).
    #[arg(long, default_value_t = 4)]
    pub microbatches: usize,
    /// Stage chunks per worker (interleaved: V, default 2; zbv: 2).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Data-parallel replicas D of the pipeline (workers r P .. (r + 1) P).
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Layer blocks of the model to cut evenly into the stages (default: one per stage).
    /// (`--layers` is train's count of transformer blocks; the old spelling here is still
    /// taken.)
    #[arg(long, alias = "layers")]
    pub layer_blocks: Option<usize>,
    /// zb-auto: micro-batches' activations a worker may hold (default P, 1F1B's peak).
    #[arg(long)]
    pub mem_cap: Option<usize>,
}

impl SchedArgs {
    /// The job these flags describe: layers cut evenly (`--layer-blocks`) or one per stage.
    pub fn spec(&self) -> Result<JobSpec<'static>> {
        if self.mem_cap.is_some() && self.kind != ScheduleKind::ZbAuto {
            return Err(BadInput(format!(
                "--mem-cap is a zb-auto setting; {} has its own memory",
                self.kind
            ))
            .into());
        }
        let shape = PipelineShape {
            depth: self.stages,
            chunks: self.chunks.unwrap_or(self.kind.default_chunks()),
            replicas: self.replicas,
            microbatches: self.microbatches,
        };
        let layers = match self.layer_blocks {
            Some(n) => LayerCut::Even(n),
            None => LayerCut::OnePerStage,
        };
        Ok(JobSpec {
            mem_cap: self.mem_cap,
            ..JobSpec::new(self.kind, shape).with_layers(layers)
        })
    }

    pub fn plan(&self) -> Result<ValidPlan> {
        let layers = self.layer_blocks;
        build(&self.spec()?).map_err(|e| match (e, layers) {
            (pipewright_core::Error::Infeasible(m), Some(n)) => {
                BadInput(format!("--layer-blocks {n}: {m}")).into()
            }
            (e, _) => e.into(),
        })
    }
}

#[derive(Args)]
pub struct SimulateArgs {
    #[command(flatten)]
    sched: SchedArgs,
    /// Forward cost per stage-chunk (uniform costs; default 1).
    #[arg(long, conflicts_with = "profile", allow_negative_numbers = true)]
    cost_f: Option<f64>,
    /// Input-gradient backward cost per stage-chunk (default 1).
    #[arg(long, conflicts_with = "profile", allow_negative_numbers = true)]
    cost_b: Option<f64>,
    /// Weight-gradient cost per stage-chunk (default 1); unsplit schedules run B+W as one.
    #[arg(long, conflicts_with = "profile", allow_negative_numbers = true)]
    cost_w: Option<f64>,
    /// Model profile TOML (docs/formats.md). A generated plan's stages are cut from it by the exact
    /// partitioner; a plan file's stages take their layers' costs.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Cluster TOML (docs/formats.md); workers run on the devices the plan names, else on the first ones.
    #[arg(long)]
    cluster: Option<PathBuf>,
    /// Simulate a plan file (JSON/CSV, e.g. from `plan --out`) instead of generating one; its
    /// own stage costs are used unless --profile or --cost-* say otherwise.
    #[arg(long, conflicts_with_all = ["kind", "stages", "microbatches", "chunks", "replicas", "layer_blocks"])]
    plan: Option<PathBuf>,
    /// All workers share one compute resource, one action at a time: how `pipewright train`
    /// runs in-process worker threads (burn's autodiff is serialised); messages stay concurrent.
    /// Without it each worker has its own device, as with `--transport mpi`.
    #[arg(long)]
    shared_compute: bool,
    /// Also price the plan in SkipPipe's own cost model (its simulator, com_sym.py,
    /// re-implemented: memory slots on the data nodes, whole-second dispatch passes); plans
    /// with routes only, as `skip-plan` writes them.
    #[arg(long)]
    skippipe_cost: bool,
    #[command(flatten)]
    mechanics: Mechanics,
    #[command(flatten)]
    out: Outputs,
}

pub fn cmd_simulate(a: SimulateArgs) -> Result<()> {
    let uniform = uniform_cost(&a)?;
    let profile = a.profile.as_deref().map(Profile::load).transpose()?;
    let plan = match &a.plan {
        Some(f) => load_valid_plan(f)?,
        None => {
            let cluster = a.cluster.as_deref().map(Cluster::load).transpose()?;
            let mut spec = JobSpec {
                cluster: cluster.as_ref(),
                uniform_cost: uniform,
                ..a.sched.spec()?
            };
            if let Some(p) = &profile {
                spec.layers = LayerCut::Profile(p);
            }
            build(&spec)?
        }
    };
    let cluster = match &a.cluster {
        Some(cf) => cluster_for_plan(cf, &plan)?,
        None => Cluster::uniform(plan.num_workers()),
    };
    let stages = stage_costs(&a, &plan, profile.as_ref(), uniform)?;
    simulate_and_print(&a, &plan, &stages, &cluster)
}

/// `--cost-f/b/w` as every stage's costs, if any is given.
fn uniform_cost(a: &SimulateArgs) -> Result<Option<StageCost>> {
    let flags = [
        ("--cost-f", a.cost_f),
        ("--cost-b", a.cost_b),
        ("--cost-w", a.cost_w),
    ];
    for (flag, v) in flags {
        if let Some(v) = v.filter(|v| !v.is_finite() || *v < 0.0) {
            return Err(BadInput(format!("{flag} {v}: costs must be finite and >= 0")).into());
        }
    }
    Ok(flags.iter().any(|(_, v)| v.is_some()).then(|| {
        StageCost::uniform(
            a.cost_f.unwrap_or(1.0),
            a.cost_b.unwrap_or(1.0),
            a.cost_w.unwrap_or(1.0),
        )
    }))
}

/// The stages' costs to simulate: the profile's, the plan's own, or uniform ones.
fn stage_costs(
    a: &SimulateArgs,
    plan: &Plan,
    profile: Option<&Profile>,
    uniform: Option<StageCost>,
) -> Result<Vec<StageCost>> {
    match (profile, &a.plan) {
        (Some(_), None) => Ok(plan.stage_costs().expect("assigned")),
        (Some(profile), Some(f)) => {
            if profile.layers.len() != plan.num_layers() {
                return Err(BadInput(format!(
                    "{}: the plan holds {} layers but {} has {}",
                    f.display(),
                    plan.num_layers(),
                    a.profile.as_ref().expect("given").display(),
                    profile.layers.len()
                ))
                .into());
            }
            Ok(profile.stage_costs(&plan.layers_per_stage()))
        }
        (None, _) if uniform.is_none() && plan.stage_costs().is_some() => {
            Ok(plan.stage_costs().expect("checked"))
        }
        (None, _) => {
            if a.cluster.is_some() && uniform.is_none() {
                return Err(BadInput(
                    "--cluster needs costs: a plan file with stage costs (from `plan --out`), --profile, or --cost-f/b/w".into(),
                )
                .into());
            }
            Ok(vec![
                uniform.unwrap_or(StageCost::uniform(1.0, 1.0, 1.0));
                plan.num_stages()
            ])
        }
    }
}

/// Simulate `plan` and print (or write) what the flags ask for.
fn simulate_and_print(
    a: &SimulateArgs,
    plan: &Plan,
    stages: &[StageCost],
    cluster: &Cluster,
) -> Result<()> {
    let p = plan.num_workers();
    check_memory(plan, stages, cluster)?;
    let setup = SimSetup {
        plan,
        stages,
        cluster,
    };
    let skippipe = a.skippipe_cost.then(|| skippipe_cost(&setup)).transpose()?;
    let mut r = simulate_with(
        &setup,
        SimOptions {
            shared_compute: a.shared_compute,
            ..a.mechanics.options()?
        },
    )?;
    if let Some(f) = &a.cluster {
        crate::output::mark_idle(&mut r.timeline, &Cluster::load(f)?);
    }
    let allreduce = r.iteration_time > r.makespan;
    let title = format!(
        "{} | workers={}{} M={} stages={} | makespan {:.4}{} | bubble {:.1}%",
        plan.kind,
        p,
        if a.shared_compute {
            " (one shared compute)"
        } else {
            ""
        },
        plan.num_microbatches,
        plan.num_stages(),
        r.makespan,
        if allreduce {
            format!(" (iteration {:.4} with all-reduce)", r.iteration_time)
        } else {
            String::new()
        },
        100.0 * r.bubble_fraction
    ) + &a.mechanics.note();
    a.out.write_timeline(&r.timeline, &title)?;
    if a.out.json {
        let mut j = serde_json::to_value(&r)?;
        j["schedule"] = json!(plan.kind);
        j["workers"] = json!(p);
        j["stages"] = json!(plan.num_stages());
        j["microbatches"] = json!(plan.num_microbatches);
        j["layers_per_stage"] = json!(plan.layers_per_stage());
        j["idle_devices"] = json!(r.timeline.idle_devices);
        if let Some(c) = skippipe {
            j["skippipe_cost"] = json!({"pipeline_time": c.pipeline_time, "finished": c.finished});
        }
        println!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(());
    }
    print_result(plan, &r, &title);
    if let Some(c) = skippipe {
        println!(
            "SkipPipe's cost model: {:.2} s, {} of {} micro-batches back on their data nodes",
            c.pipeline_time, c.finished, plan.num_microbatches
        );
    }
    Ok(())
}

/// `--skippipe-cost`: the plan in SkipPipe's cost model (`sim::slotted`).
fn skippipe_cost(setup: &SimSetup) -> Result<SlottedRun> {
    if setup.plan.routes.is_empty() {
        return Err(BadInput(
            "--skippipe-cost prices plans with routes (from `skip-plan --out`); this plan has none"
                .into(),
        )
        .into());
    }
    Ok(slotted_plan_time(setup).map_err(|e| BadInput(format!("--skippipe-cost: {e}")))?)
}

/// The simulation as text: per worker busy time, utilisation and peak activations, links,
/// all-reduce, and the timeline when it fits a terminal.
fn print_result(plan: &Plan, r: &pipewright_core::sim::SimResult, title: &str) {
    let p = plan.num_workers();
    let allreduce = r.iteration_time > r.makespan;
    println!("{title}");
    println!("layers per stage: {:?}", plan.layers_per_stage());
    println!(
        "{:>7} {:>12} {:>8} {:>14} {:>16}",
        "worker", "busy", "util", "peak act", "peak act bytes"
    );
    for w in 0..p {
        println!(
            "{:>7} {:>12.4} {:>7.1}% {:>14} {:>16}",
            w,
            r.busy[w],
            100.0 * r.busy[w] / r.makespan.max(1e-12),
            r.peak_activations[w],
            r.peak_activation_bytes[w]
        );
    }
    for l in &r.links {
        println!(
            "link w{} -> w{}: {} bytes, busy {:.4}",
            l.from, l.to, l.bytes, l.busy
        );
    }
    if allreduce {
        println!("gradient all-reduce per stage: {:.4?}", r.allreduce);
    }
    let unit = r
        .timeline
        .actions
        .iter()
        .map(|x| x.end - x.start)
        .filter(|d| *d > 0.0)
        .fold(f64::INFINITY, f64::min);
    if unit.is_finite() && r.makespan / unit <= 160.0 {
        println!("\ntimeline (one column = {unit:.4}; F forward, B input grad, W weight grad, X full backward):");
        print!("{}", r.timeline.to_text(unit));
    }
}

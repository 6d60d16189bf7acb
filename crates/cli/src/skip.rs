//! `skip-plan`: SkipPipe routes for a model on a (geo-distributed) cluster, with baselines.

use crate::files::write_file;
use crate::output::{Mechanics, Outputs};
use crate::BadInput;
use anyhow::Result;
use clap::Args;
use pipewright_core::cluster::Cluster;
use pipewright_core::job::{build_skip, JobSpec, LayerCut, PipelineShape, Routes, SkipRoutes};
use pipewright_core::plan::ScheduleKind;
use pipewright_core::profile::Profile;
use pipewright_core::search::skipplan::SkipResult;
use pipewright_core::sim::{simulate_with, Dispatch, SimOptions, SimSetup};
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct SkipPlanArgs {
    /// Model profile TOML (its last layer is the head, placed with the embedding).
    #[arg(long)]
    profile: PathBuf,
    /// Cluster TOML.
    #[arg(long)]
    cluster: PathBuf,
    /// Model stages S (stage 0, with the embedding, is always visited).
    #[arg(long)]
    stages: usize,
    /// Stages each micro-batch skips: a count, or a fraction of S below 1 (0.33 of 6 = 2).
    #[arg(long)]
    skip: f64,
    /// Devices that hold data, the embedding and the head: the data-parallel replicas, each
    /// with its own micro-batches (`--data-nodes`, the old spelling, is still taken).
    /// SkipPipe's published setting has 5.
    #[arg(long = "replicas", alias = "data-nodes", default_value_t = 1)]
    data_nodes: usize,
    /// Micro-batches per data node per iteration (SkipPipe's published setting: 6).
    #[arg(long, default_value_t = 4)]
    microbatches: usize,
    /// Swaps of neighbouring stages allowed per route.
    #[arg(long, default_value_t = 1)]
    max_swaps: usize,
    /// Micro-batches a middle stage's device serves per iteration at most (SkipPipe's TC1:
    /// `memory` agents per node). Default: an even share of its stage's visits among the
    /// stage's devices, 6 in SkipPipe's published setting. The full-pipeline baseline cannot
    /// keep it and is searched without it.
    #[arg(long)]
    max_node_load: Option<usize>,
    /// Annealing moves per search, the full pipeline's and the skip routes' (they run side by
    /// side). The plan depends on the inputs, the seed and the move budgets alone, unless
    /// --time-limit stops the search first (it then says so).
    #[arg(long, default_value_t = DEFAULT_MOVES)]
    moves: usize,
    /// Moves of a last phase that, among routes no slower in pipewright's simulator, looks
    /// for the fastest in SkipPipe's own cost model (its simulator's mechanics, as `simulate
    /// --skippipe-cost` prices them); 0 skips it.
    #[arg(long, default_value_t = 5000)]
    polish_moves: usize,
    /// Seconds the searches may take at most: a cap for runaway budgets, not the budget. A
    /// search it stops is reported, as its plan then depends on the machine's speed and load.
    #[arg(long, default_value_t = 120.0)]
    time_limit: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Write the scheduled whole-job plan (for `simulate --plan` and `train --plan`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Price candidates with SkipPipe's simulator mechanics (its `com_sym.py`: `--dispatch
    /// arrival --idle-gap 0.13 --no-link-queue`); the plan's orders are then arrival order's.
    #[command(flatten)]
    mechanics: Mechanics,
    #[command(flatten)]
    output: Outputs,
}

/// The default move budget: on the geo example (6 stages, skip 2, 5 data nodes) it meets
/// SkipPipe's figures for seeds 42-46 (pipeline-only 74.1-75.7 s, 74.7-77.0 s in SkipPipe's
/// model, 79.7-81.1 s with the all-reduce), where 40,000 left 75.2-76.9 s and 30,000 up to
/// 77.4 s (measured on a 2-core Xeon, 2026-12-07; docs/skippipe.md).
const DEFAULT_MOVES: usize = 60000;

/// Stages each micro-batch skips from `--skip`: a whole count, or a fraction of `stages` below
/// 1 (0.33 of 6 = 2).
pub fn skip_count(skip: f64, stages: usize) -> Result<usize> {
    if !(skip.is_finite() && skip >= 0.0) || (skip >= 1.0 && skip.fract() != 0.0) {
        return Err(BadInput(format!(
            "--skip {skip:?}: a whole number of stages, or a fraction below 1"
        ))
        .into());
    }
    Ok(if skip < 1.0 {
        (skip * stages as f64).round() as usize
    } else {
        skip as usize
    })
}

pub fn cmd_skip_plan(a: SkipPlanArgs) -> Result<()> {
    let profile = Profile::load(&a.profile)?;
    let cluster = Cluster::load(&a.cluster)?;
    let skip = skip_count(a.skip, a.stages)?;
    if !(a.time_limit.is_finite() && a.time_limit > 0.0 && a.time_limit <= 3600.0) {
        return Err(BadInput(format!(
            "--time-limit {:?}: seconds between 0 and 3600",
            a.time_limit
        ))
        .into());
    }
    let mechanics = a.mechanics.options()?;
    let shape = PipelineShape {
        depth: a.stages,
        chunks: 1,
        replicas: a.data_nodes,
        microbatches: a.microbatches,
    };
    let spec = JobSpec {
        cluster: Some(&cluster),
        routes: Routes::Skip(SkipRoutes {
            skip,
            max_swaps: a.max_swaps,
            moves: a.moves,
            time_limit: Duration::from_secs_f64(a.time_limit),
            seed: a.seed,
            mechanics,
            max_node_load: Some(
                a.max_node_load
                    .unwrap_or_else(|| even_load(&a, &cluster, skip)),
            ),
            polish_moves: a.polish_moves,
        }),
        ..JobSpec::new(ScheduleKind::Custom, shape).with_layers(LayerCut::Profile(&profile))
    };
    let r = build_skip(&spec)?;
    if let Some(f) = &a.out {
        write_file(f, &r.plan.to_json())?;
    }
    // The plan simulated once more: its timeline, and its time without the gradient all-reduce
    // (SkipPipe's own objective).
    let stages = r.plan.stage_costs().expect("skip plans carry stage costs");
    // Its orders are already the dispatch's.
    let options = SimOptions {
        dispatch: Dispatch::Plan,
        ..mechanics
    };
    let setup = SimSetup {
        plan: &r.plan,
        stages: &stages,
        cluster: &cluster,
    };
    let mut sim = simulate_with(&setup, options)?;
    crate::output::mark_idle(&mut sim.timeline, &cluster);
    let title = format!(
        "SkipPipe routes, skip {skip} of {}{}",
        a.stages,
        a.mechanics.note()
    );
    a.output.write_timeline(&sim.timeline, &title)?;
    print_result(&a, &r, skip, sim.makespan);
    Ok(())
}

/// The most micro-batches per middle device when each stage's visits (balanced over the
/// stages) are shared evenly among the devices of its pool.
fn even_load(a: &SkipPlanArgs, cluster: &Cluster, skip: usize) -> usize {
    let middle = a.stages.saturating_sub(1).max(1);
    let per_pool = (cluster.len().saturating_sub(a.data_nodes) / middle).max(1);
    let m = a.data_nodes.saturating_mul(a.microbatches);
    let visits = m
        .saturating_mul(middle.saturating_sub(skip))
        .div_ceil(middle);
    visits.div_ceil(per_pool).max(1)
}

/// The search's answer beside its baselines, as JSON or text.
fn print_result(a: &SkipPlanArgs, r: &SkipResult, skip: usize, no_allreduce: f64) {
    let reduction = 1.0 - r.skip_time / r.full_pipeline_time;
    if a.output.json {
        println!(
            "{}",
            json!({
                "full_pipeline_time": r.full_pipeline_time,
                "random_skip_time": r.random_skip_time,
                "random_routes_time": r.random_routes_time,
                "skip_time": r.skip_time,
                "skip_time_no_allreduce": no_allreduce,
                "skip_time_skippipe_model": r.skip_time_skippipe,
                "reduction": reduction,
                "scheduler_seconds": r.scheduler_seconds,
                "moves": r.moves,
                "time_limit_hit": r.time_limit_hit,
                "skip": skip,
                "layers_per_stage": r.plan.layers_per_stage(),
                "routes": r.plan.routes,
            })
        );
        return;
    }
    println!(
        "{} micro-batches ({} data nodes x {}), skip {skip} of {} stages, {} search moves in {:.2} s{}",
        r.plan.num_microbatches,
        a.data_nodes,
        a.microbatches,
        a.stages,
        r.moves,
        r.scheduler_seconds,
        a.mechanics.note()
    );
    println!(
        "  full pipeline (best placement): {:10.2} s per iteration",
        r.full_pipeline_time
    );
    println!(
        "  random skipping (network-blind): {:9.2} s",
        r.random_skip_time
    );
    println!(
        "  random routes (this placement):  {:9.2} s",
        r.random_routes_time
    );
    println!(
        "  skip routes (this scheduler):    {:9.2} s  ({:.1}% below the full pipeline; {:.2} s without the all-reduce)",
        r.skip_time,
        100.0 * reduction,
        no_allreduce
    );
    if r.time_limit_hit {
        println!(
            "  note: --time-limit {} s stopped the search before its budget (--moves {}, --polish-moves {}): this plan depends on the machine's speed and load; raise --time-limit for one that depends on the seed alone",
            a.time_limit, a.moves, a.polish_moves
        );
    }
    match r.skip_time_skippipe {
        Some(t) => println!("  the same routes in SkipPipe's cost model (its com_sym.py's mechanics): {t:.2} s without the all-reduce"),
        None => println!("  the same routes in SkipPipe's cost model: some micro-batches never come back (see `simulate --skippipe-cost`)"),
    }
}

//! `partition` and `plan`: cut a model into stages, and search whole-job plans.

use crate::files::write_file;
use crate::output::Outputs;
use crate::BadInput;
use anyhow::Result;
use clap::Args;
use pipewright_core::cluster::Cluster;
use pipewright_core::job::planner::{search_depth, Candidate};
use pipewright_core::profile::{Profile, StageCost};
use pipewright_core::schedule::{generate, ScheduleKind};
use pipewright_core::search::partition::{partition, Assignment, Objective, PartitionProblem};
use pipewright_core::sim::memory_peaks;
use serde_json::json;
use std::path::PathBuf;

#[derive(Args)]
pub struct PartitionArgs {
    /// Model profile TOML.
    #[arg(long)]
    profile: PathBuf,
    /// Number of stages K.
    #[arg(long)]
    stages: usize,
    /// Cluster TOML; without it, K identical devices joined by free links.
    #[arg(long)]
    cluster: Option<PathBuf>,
    /// Schedule whose in-flight activations count against device memory.
    #[arg(long, value_enum, default_value = "1f1b")]
    schedule: ScheduleKind,
    /// Micro-batches per iteration (default K).
    #[arg(long)]
    microbatches: Option<usize>,
    /// time: forward+backward on the device plus sending the cut; params: parameter bytes.
    #[arg(long, value_enum, default_value = "time")]
    objective: Objective,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("measured").args(["model", "model_config"])))]
pub struct PlanArgs {
    /// Model profile TOML (or --model / --model-config: measured here first).
    #[arg(long, required_unless_present_any = ["model", "model_config"], conflicts_with_all = ["model", "model_config"])]
    profile: Option<PathBuf>,
    /// Without --profile: the model to measure on this machine (as `profile` does).
    #[command(flatten)]
    model: crate::model::ModelArgs,
    /// With --model: sequence length (default: the model's).
    #[arg(long, requires = "measured")]
    seq_len: Option<usize>,
    /// With --model: sequences per micro-batch.
    #[arg(long, default_value_t = 4, requires = "measured")]
    rows: usize,
    /// Cluster TOML.
    #[arg(long)]
    cluster: PathBuf,
    /// Micro-batches per iteration over all replicas (profile micro-batch units).
    #[arg(long, default_value_t = 64)]
    global_batch: usize,
    /// Only plans of this many pipeline stages (default: every depth, 1 to the cluster's
    /// devices; the fastest wins, which may be data parallelism alone).
    #[arg(long)]
    stages: Option<usize>,
    /// Rows to print.
    #[arg(long, default_value_t = 8)]
    top: usize,
    /// Write the winning whole-job plan for `simulate --plan` and `train --plan`.
    #[arg(long)]
    out: Option<PathBuf>,
    /// What --out holds: the plan as JSON, pipewright's CSV, a grid, or torch's per-rank
    /// action CSV (`torch-csv`).
    #[arg(long, value_enum, default_value = "json", requires = "out")]
    format: crate::Format,
    /// JSON: all candidates, best first; the timeline: the winner's.
    #[command(flatten)]
    output: Outputs,
}

/// The profile to plan with: a file, or the model measured here (5 repeats, as `profile`).
fn plan_profile(a: &PlanArgs) -> Result<Profile> {
    if let Some(f) = &a.profile {
        return Ok(Profile::load(f)?);
    }
    let model = crate::train::model_to_measure(&a.model, a.seq_len, a.rows, 5)?;
    let p = pipewright_runtime::profile::profile_model(&model, a.rows, 5, 42);
    eprintln!(
        "measured on this machine: {}",
        crate::train::profile_summary(&p, a.rows)
    );
    Ok(p)
}

pub fn cmd_plan(a: PlanArgs) -> Result<()> {
    let profile = plan_profile(&a)?;
    let cluster = Cluster::load(&a.cluster)?;
    let t0 = std::time::Instant::now();
    let cands = search_depth(&profile, &cluster, a.global_batch, a.stages)?;
    let secs = t0.elapsed().as_secs_f64();
    let best = cands.first().filter(|c| c.iteration_time.is_some());
    if let Some(w) = best {
        let mut r = w.result.clone().expect("simulated");
        crate::output::mark_idle(&mut r.timeline, &cluster);
        let title = format!(
            "plan: {} | stages={} replicas={} M={} | iteration {:.4} s | bubble {:.1}%",
            w.schedule,
            w.depth,
            w.replicas,
            w.microbatches,
            w.iteration_time.unwrap(),
            100.0 * w.bubble_fraction
        );
        a.output.write_timeline(&r.timeline, &title)?;
        if let Some(f) = &a.out {
            let plan = w.plan.as_ref().expect("winner has a plan");
            write_file(f, &a.format.render(plan)?)?;
        }
    }
    if a.output.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"candidates": cands, "search_seconds": secs}))?
        );
        if best.is_none() && a.out.is_some() {
            return Err(BadInput("no candidate fits; nothing written to --out".into()).into());
        }
        return Ok(());
    }
    println!(
        "{} candidates for \"{}\" ({} layers) on {} devices, global batch {} micro-batches ({secs:.2} s)",
        cands.len(), profile.model.name, profile.layers.len(), cluster.len(), a.global_batch
    );
    print_candidates(&cands, a.top);
    match best {
        Some(w) => println!(
            "winner: layers per stage {:?}; pipeline 0 on {}",
            w.layers_per_stage,
            w.devices[0].join(", ")
        ),
        None => {
            return Err(BadInput(format!(
                "no candidate fits; the smallest: {}",
                cands[0].reason
            ))
            .into())
        }
    }
    Ok(())
}

/// The best `top` candidates as a table, each with why it lost to the winner.
fn print_candidates(cands: &[Candidate], top: usize) {
    println!(
        "{:>4} {:>5} {:>4} {:>4} {:>14} {:>14} {:>12} {:>7} {:>10}  lost because",
        "rank", "depth", "dp", "M", "schedule", "layout", "iteration s", "bubble", "peak GiB"
    );
    for (i, c) in cands.iter().take(top).enumerate() {
        let it = c
            .iteration_time
            .map_or("-".to_string(), |t| format!("{t:.4}"));
        println!(
            "{:>4} {:>5} {:>4} {:>4} {:>14} {:>14} {:>12} {:>6.1}% {:>10.2}  {}",
            i + 1,
            c.depth,
            c.replicas,
            c.microbatches,
            c.schedule.name(),
            c.layout.name(),
            it,
            100.0 * c.bubble_fraction,
            c.peak_memory_bytes as f64 / (1u64 << 30) as f64,
            if i == 0 && c.iteration_time.is_some() {
                "winner"
            } else {
                c.reason.as_str()
            }
        );
    }
}

pub fn cmd_partition(a: PartitionArgs) -> Result<()> {
    let profile = Profile::load(&a.profile)?;
    if a.stages > profile.layers.len() {
        return Err(BadInput(format!(
            "--stages {}: {} has only {} layers to cut",
            a.stages,
            a.profile.display(),
            profile.layers.len()
        ))
        .into());
    }
    let cluster = match &a.cluster {
        Some(f) => Cluster::load(f)?,
        None => Cluster::uniform(a.stages.max(1)),
    };
    let kind = a.schedule;
    if kind.default_chunks() != 1 {
        return Err(BadInput(format!("partition places one stage per device; --schedule {kind} puts several on one (use gpipe, 1f1b or zbh1)")).into());
    }
    let m = a.microbatches.unwrap_or(a.stages);
    let in_flight = if a.stages == 0 {
        vec![]
    } else {
        let plan = generate(kind, a.stages, m, 1)?;
        memory_peaks(&plan, &vec![StageCost::default(); a.stages])
            .iter()
            .map(|p| p.microbatches)
            .collect()
    };
    let objective = a.objective;
    let r = partition(&PartitionProblem {
        profile: &profile,
        cluster: &cluster,
        stages: a.stages,
        objective,
        in_flight: in_flight.clone(),
    })?;
    let names: Vec<&str> = r
        .devices
        .iter()
        .map(|&d| cluster.devices[d].name.as_str())
        .collect();
    if a.json {
        let j = json!({
            "boundaries": r.split.layers_per_stage,
            "stage_cost": r.split.stage_cost,
            "bottleneck": r.split.bottleneck,
            "devices": names,
            "objective": objective,
            "exact": r.exact,
            "in_flight": in_flight,
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(());
    }
    print_partition(&a, &profile, &r, &names);
    Ok(())
}

/// The partition as a table: a row per stage with its layers, device and cost.
fn print_partition(a: &PartitionArgs, profile: &Profile, r: &Assignment, names: &[&str]) {
    let objective = a.objective;
    let unit = if objective == Objective::Params {
        "bytes of parameters"
    } else {
        "s per micro-batch (forward + backward + send)"
    };
    println!(
        "{} layers of \"{}\" into {} stages; bottleneck {:.6} {unit}{}",
        profile.layers.len(),
        profile.model.name,
        a.stages,
        r.split.bottleneck,
        if r.exact {
            ""
        } else {
            " (heuristic device order: cluster too large for the exact search)"
        }
    );
    println!(
        "{:>6} {:>14} {:>18} {:>16}",
        "stage", "layers", "device", "cost"
    );
    let mut lo = 0;
    for (st, &n) in r.split.layers_per_stage.iter().enumerate() {
        let span = format!("{}..{} ({n})", lo, lo + n - 1);
        lo += n;
        let dev = if objective == Objective::Params {
            "-"
        } else {
            names[st]
        };
        println!(
            "{st:>6} {span:>14} {dev:>18} {:>16.6}",
            r.split.stage_cost[st]
        );
    }
}

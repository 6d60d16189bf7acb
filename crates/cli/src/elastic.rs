//! `elastic-sim`: replay a freezing trajectory under PipeTransformer's ablations (freeze only;
//! AutoPipe and AutoCache; AutoPipe and AutoDP; all four) on a profile and cluster, and print
//! throughput per epoch and the total speedup over training without freezing.

use crate::BadInput;
use anyhow::Result;
use clap::Args;
use pipewright_core::cluster::Cluster;
use pipewright_core::policy::elastic::{ablation, Ablation, AblationEpoch, AblationSetup};
use pipewright_core::policy::freeze::{FreezeMode, FreezePolicy};
use pipewright_core::profile::Profile;
use pipewright_core::schedule::ScheduleKind;
use serde_json::json;
use std::path::PathBuf;

#[derive(Args)]
pub struct ElasticSimArgs {
    /// Layer profile (seconds per micro-batch; e.g. examples/vit_b16_rtx5000.toml).
    #[arg(long)]
    profile: PathBuf,
    /// Cluster (e.g. examples/pipetransformer_2x8.toml); its first pipelines x stages devices
    /// are used, pipeline r on devices r*stages.. .
    #[arg(long)]
    cluster: PathBuf,
    /// Data-parallel pipelines at the start.
    #[arg(long, default_value_t = 2)]
    pipelines: usize,
    /// Stages of each pipeline at the start (default: the cluster's devices over --pipelines).
    #[arg(long = "stages")]
    stages_flag: Option<usize>,
    /// --stages, or its default once the cluster is known.
    #[arg(skip)]
    stages: usize,
    /// Micro-batches per pipeline per iteration at the start (the global batch stays).
    #[arg(long, default_value_t = 4)]
    microbatches: usize,
    /// Pipeline schedule (one stage per worker; `--kind`, the old spelling, is still taken).
    #[arg(long = "schedule", alias = "kind", value_enum, default_value = "1f1b")]
    kind: ScheduleKind,
    /// Epochs to replay.
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// The released schedule's rate: L (1 - (1 - alpha)^e) layers frozen after epoch e
    /// (train's default; the paper's is 0.5).
    #[arg(long, default_value_t = 0.3)]
    freeze_alpha: f64,
    /// Most of the freezable layers (all but the last) that may freeze.
    #[arg(long, default_value_t = 0.8)]
    max_frozen: f64,
    /// Frozen layers of the profile in each epoch, e.g. 0,13,19,20 (instead of the schedule;
    /// from the paper or from a run's metrics).
    #[arg(long, value_delimiter = ',')]
    trajectory: Option<Vec<usize>>,
    /// Bytes each worker may hold (default: the smallest device memory of the cluster).
    #[arg(long)]
    memory: Option<u64>,
    /// Samples per micro-batch, to print samples per second (default: iterations per second).
    #[arg(long)]
    rows: Option<usize>,
    #[arg(long)]
    json: bool,
}

/// PipeTransformer's reported speedups for ViT-B/16 on ImageNet (2 x 8 GPUs), per ablation.
fn paper(which: Ablation) -> Option<f64> {
    match which {
        Ablation::Baseline => None,
        Ablation::FreezeOnly => Some(0.95),
        Ablation::PipeCache => Some(1.26),
        Ablation::PipeDp => Some(2.27),
        Ablation::All => Some(2.83),
    }
}

pub fn cmd_elastic_sim(mut a: ElasticSimArgs) -> Result<()> {
    let profile = Profile::load(&a.profile)?;
    let cluster = Cluster::load(&a.cluster)?;
    a.stages = a
        .stages_flag
        .unwrap_or(cluster.devices.len() / a.pipelines.max(1));
    let workers = check_args(&a, &profile, &cluster)?;
    let per_iter = samples_per_iteration(&a)?;
    let trajectory = trajectory(&a, &profile)?;
    let memory = a.memory.unwrap_or_else(|| {
        cluster.devices[..workers]
            .iter()
            .filter_map(|d| d.memory)
            .min()
            .unwrap_or(u64::MAX)
    });
    let setup = AblationSetup {
        profile: &profile,
        cluster: &cluster,
        pipelines: a.pipelines,
        depth: a.stages,
        microbatches: a.microbatches,
        kind: a.kind,
        trajectory: &trajectory,
        memory_budget: memory,
    };
    let runs: Vec<(Ablation, Vec<_>)> = Ablation::ALL
        .iter()
        .map(|&w| {
            ablation(&setup, w)
                .map(|r| (w, r))
                .map_err(|e| BadInput(format!("{}: {e}", w.name())))
        })
        .collect::<std::result::Result<_, _>>()?;
    let base = total(&runs[0].1);
    let unit = if a.rows.is_some() {
        "samples/s"
    } else {
        "iterations/s"
    };
    let out = Ablations {
        runs,
        base,
        per_iter,
        unit,
        trajectory,
        memory,
    };
    if a.json {
        return out.print_json();
    }
    out.print_table(&a, &profile)
}

/// The flags' values that cannot be simulated; the workers the layout needs.
fn check_args(a: &ElasticSimArgs, profile: &Profile, cluster: &Cluster) -> Result<usize> {
    let workers = a.pipelines.saturating_mul(a.stages);
    if a.pipelines == 0 || a.stages == 0 || a.microbatches == 0 || a.epochs == 0 {
        return Err(BadInput(
            "--pipelines, --stages, --microbatches and --epochs must be at least 1".into(),
        )
        .into());
    }
    if a.epochs > 10_000 || a.microbatches > 100_000 {
        return Err(
            BadInput("--epochs at most 10000, --microbatches at most 100000".into()).into(),
        );
    }
    if workers > cluster.devices.len() {
        return Err(BadInput(format!(
            "{} pipelines x {} stages need {workers} devices; {} has {}",
            a.pipelines,
            a.stages,
            a.cluster.display(),
            cluster.devices.len()
        ))
        .into());
    }
    if a.stages > profile.layers.len() {
        return Err(BadInput(format!(
            "--stages {} is more than the profile's {} layers",
            a.stages,
            profile.layers.len()
        ))
        .into());
    }
    if a.kind.default_chunks() != 1 || a.kind == ScheduleKind::Custom {
        return Err(BadInput(format!(
            "--schedule {}: elastic-sim places one stage per worker (gpipe, 1f1b or zbh1)",
            a.kind
        ))
        .into());
    }
    Ok(workers)
}

/// Samples per iteration: every pipeline's micro-batches of rows each (must fit a usize).
fn samples_per_iteration(a: &ElasticSimArgs) -> Result<f64> {
    let per_iter = a
        .pipelines
        .checked_mul(a.microbatches)
        .and_then(|x| x.checked_mul(a.rows.unwrap_or(1)));
    Ok(match (a.rows, per_iter) {
        (Some(0), _) => return Err(BadInput("--rows must be at least 1".into()).into()),
        (_, None) => {
            return Err(BadInput(format!(
                "--pipelines {} x --microbatches {} x --rows {} samples per iteration is too many to count",
                a.pipelines,
                a.microbatches,
                a.rows.unwrap_or(1)
            ))
            .into())
        }
        (_, Some(n)) => n as f64,
    })
}

/// Frozen layers per epoch: `--trajectory`, or the freeze schedule's.
fn trajectory(a: &ElasticSimArgs, profile: &Profile) -> Result<Vec<usize>> {
    Ok(match &a.trajectory {
        Some(t) if t.is_empty() => return Err(BadInput("--trajectory is empty".into()).into()),
        Some(t) => t.clone(),
        None => {
            let policy = FreezePolicy {
                mode: FreezeMode::Schedule,
                alpha: a.freeze_alpha,
                max_fraction: a.max_frozen,
                ..FreezePolicy::default()
            };
            policy
                .check()
                .map_err(|e| BadInput(format!("--freeze-alpha / --max-frozen: {e}")))?;
            let freezable = profile.layers.len() - 1;
            let mut t = vec![0];
            for e in 1..a.epochs {
                let k = policy.decide(e, t[e - 1], freezable, &[]);
                t.push(k.max(t[e - 1]));
            }
            t
        }
    })
}

/// The ablations' epochs, ready to print.
struct Ablations {
    runs: Vec<(Ablation, Vec<AblationEpoch>)>,
    base: f64,
    per_iter: f64,
    unit: &'static str,
    trajectory: Vec<usize>,
    memory: u64,
}

fn total(r: &[AblationEpoch]) -> f64 {
    r.iter().map(|e| e.iteration_time).sum()
}

impl Ablations {
    fn print_json(&self) -> Result<()> {
        let Ablations {
            runs,
            base,
            per_iter,
            unit,
            trajectory,
            memory,
        } = self;
        let (base, per_iter) = (*base, *per_iter);
        let rows: Vec<_> = runs
            .iter()
            .map(|(w, r)| {
                json!({
                    "ablation": w.name(),
                    "speedup": base / total(r),
                    "paper_speedup": paper(*w),
                    "epochs": r.iter().map(|e| json!({
                        "frozen": e.frozen, "stages": e.depth, "replicas": e.replicas,
                        "iteration_time": e.iteration_time,
                        "throughput": per_iter / e.iteration_time,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"trajectory": trajectory, "memory_budget": memory, "throughput_unit": unit, "ablations": rows})
            )?
        );
        Ok(())
    }

    fn print_table(&self, a: &ElasticSimArgs, profile: &Profile) -> Result<()> {
        let Ablations {
            runs,
            base,
            per_iter,
            unit,
            trajectory,
            memory,
        } = self;
        let (base, per_iter, memory) = (*base, *per_iter, *memory);
        println!(
        "{} ({} layers) on {}: {} pipelines x {} stages, {} micro-batches each, {}, {:.1} GB per worker",
        profile.model.name,
        profile.layers.len(),
        a.cluster.display(),
        a.pipelines,
        a.stages,
        a.microbatches,
        a.kind,
        memory as f64 / 1e9
    );
        println!("\n{unit} per epoch (stages x replicas):");
        print!("{:>5} {:>6}", "epoch", "frozen");
        for (w, _) in runs {
            print!(" | {:>24}", w.name());
        }
        println!();
        for (e, &k) in trajectory.iter().enumerate() {
            print!("{:>5} {:>6}", e + 1, k);
            for (_, r) in runs {
                let x = &r[e];
                print!(
                    " | {:>13.1} ({:>2} x {:>2})",
                    per_iter / x.iteration_time,
                    x.depth,
                    x.replicas
                );
            }
            println!();
        }
        println!("\n{:<24} {:>9} {:>7}", "configuration", "speedup", "paper");
        for (w, r) in runs {
            println!(
                "{:<24} {:>8.2}x {:>7}",
                w.name(),
                base / total(r),
                paper(*w).map_or("-".into(), |p| format!("{p:.2}x"))
            );
        }
        Ok(())
    }
}

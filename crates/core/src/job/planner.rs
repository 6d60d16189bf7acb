//! Automatic planning: search pipeline depth, replicas, micro-batches, schedule and device
//! layout; rank candidates by simulated iteration time under memory limits.

use crate::cluster::Cluster;
use crate::error::{Error, Field, Result};
use crate::job::spec::{build, JobSpec, LayerCut, PipelineShape};
use crate::plan::ir::Plan;
use crate::plan::ScheduleKind;
use crate::profile::Profile;
use crate::sim::{check_memory, devices_for_plan, memory_peaks, simulate, SimResult, SimSetup};
use serde::Serialize;

/// How replicas' devices are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum Layout {
    /// Each pipeline takes consecutive devices (file order groups regions): pipeline
    /// neighbours share fast links.
    PipelineMajor,
    /// A stage's replicas take consecutive devices: the gradient all-reduce stays local.
    ReplicaMajor,
}

#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub depth: usize,
    pub replicas: usize,
    pub microbatches: usize,
    pub schedule: ScheduleKind,
    pub chunks: usize,
    pub layout: Layout,
    pub layers_per_stage: Vec<usize>,
    /// Device names per replica, per worker.
    pub devices: Vec<Vec<String>>,
    /// `None` when the candidate does not fit; `infeasible` says why.
    pub iteration_time: Option<f64>,
    pub bubble_fraction: f64,
    pub compute: f64,
    pub allreduce: f64,
    pub peak_memory_bytes: u64,
    pub infeasible: Option<String>,
    /// Why it lost to the winner (empty for the winner).
    pub reason: String,
    /// The whole-job plan (layers, costs and devices filled in), when it fits.
    #[serde(skip)]
    pub plan: Option<Plan>,
    #[serde(skip)]
    pub result: Option<SimResult>,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::PipelineMajor => "pipeline-major",
            Layout::ReplicaMajor => "replica-major",
        }
    }
}

/// Every (depth, replicas, micro-batches, schedule, layout) for `global_batch` micro-batches
/// per iteration over all replicas, simulated and sorted best first.
pub fn search(profile: &Profile, cluster: &Cluster, global_batch: usize) -> Result<Vec<Candidate>> {
    search_depth(profile, cluster, global_batch, None)
}

/// [`search`], with the pipeline depth fixed to `depth` when given (a user who wants a
/// pipeline of that many stages, whatever else would be faster).
pub fn search_depth(
    profile: &Profile,
    cluster: &Cluster,
    global_batch: usize,
    depth: Option<usize>,
) -> Result<Vec<Candidate>> {
    let d = cluster.len();
    if let Some(p) = depth.filter(|&p| p == 0 || p > d) {
        return Err(Error::shape(
            Field::Depth,
            p,
            format!("expected a pipeline depth from 1 to the cluster's {d} devices"),
        ));
    }
    let n = profile.layers.len();
    if global_batch == 0 {
        return Err(Error::shape(
            Field::GlobalBatch,
            0,
            "must be at least 1 micro-batch",
        ));
    }
    let mut out: Vec<Candidate> = Vec::new();
    // Only the best candidate so far keeps its plan and simulation (with a large cluster each
    // holds a timeline of every device): memory stays that of one plan.
    let mut best: Option<usize> = None;
    let mut keep_best = |out: &mut Vec<Candidate>| {
        let i = out.len() - 1;
        let t = out[i].iteration_time.unwrap_or(f64::INFINITY);
        match best {
            Some(b) if out[b].iteration_time.unwrap_or(f64::INFINITY) <= t => {
                (out[i].plan, out[i].result) = (None, None);
            }
            Some(b) if t.is_finite() => {
                (out[b].plan, out[b].result) = (None, None);
                best = Some(i);
            }
            None if t.is_finite() => best = Some(i),
            _ => {}
        }
    };
    for depth in depth.map_or(1..=d, |p| p..=p) {
        let replicas = d / depth;
        if !global_batch.is_multiple_of(replicas) {
            continue;
        }
        let m = global_batch / replicas;
        for kind in ScheduleKind::ALL {
            let v = kind.default_chunks();
            if depth * v > n || (depth == 1 && kind != ScheduleKind::OneFOneB) {
                continue;
            }
            let shape = PipelineShape {
                depth,
                chunks: v,
                replicas,
                microbatches: m,
            };
            let layouts: &[Layout] = if replicas > 1 && depth > 1 {
                &[Layout::PipelineMajor, Layout::ReplicaMajor]
            } else {
                &[Layout::PipelineMajor]
            };
            for &layout in layouts {
                if let Some(c) = evaluate(profile, cluster, kind, shape, layout)? {
                    out.push(c);
                    keep_best(&mut out);
                }
            }
        }
    }
    if out.is_empty() {
        let depths = depth.map_or("(depth, replicas)".to_string(), |p| {
            format!("depth {p} (with {} replicas)", d / p)
        });
        return Err(Error::Infeasible(format!(
            "no {depths} divides a global batch of {global_batch} micro-batches over {d} devices"
        )));
    }
    out.sort_by(|a, b| match (a.iteration_time, b.iteration_time) {
        (Some(x), Some(y)) => x.total_cmp(&y),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => a.peak_memory_bytes.cmp(&b.peak_memory_bytes),
    });
    explain(&mut out);
    Ok(out)
}

/// The candidate of `kind` and `shape` with replicas laid out by `layout`; `None` if the
/// schedule cannot be built for that shape.
fn evaluate(
    profile: &Profile,
    cluster: &Cluster,
    kind: ScheduleKind,
    shape: PipelineShape,
    layout: Layout,
) -> Result<Option<Candidate>> {
    let PipelineShape {
        depth, replicas, ..
    } = shape;
    // Worker r * depth + w (replica r, pipeline worker w) sits on this cluster device.
    let device = |r: usize, w: usize| match layout {
        Layout::PipelineMajor => r * depth + w,
        Layout::ReplicaMajor => w * replicas + r,
    };
    let devices: Vec<usize> = (0..replicas)
        .flat_map(|r| (0..depth).map(move |w| (r, w)))
        .map(|(r, w)| device(r, w))
        .collect();
    let names: Vec<String> = devices
        .iter()
        .map(|&d| cluster.devices[d].name.clone())
        .collect();
    let mut c = Candidate {
        depth,
        replicas,
        microbatches: shape.microbatches,
        schedule: kind,
        chunks: shape.chunks,
        layout,
        layers_per_stage: vec![],
        devices: names.chunks(depth).map(<[String]>::to_vec).collect(),
        iteration_time: None,
        bubble_fraction: 0.0,
        compute: 0.0,
        allreduce: 0.0,
        peak_memory_bytes: 0,
        infeasible: None,
        reason: String::new(),
        plan: None,
        result: None,
    };
    let spec = JobSpec {
        cluster: Some(cluster),
        devices: Some(&devices),
        ..JobSpec::new(kind, shape).with_layers(LayerCut::Profile(profile))
    };
    let plan = match build(&spec) {
        Ok(p) => p,
        Err(Error::Infeasible(e)) => {
            c.infeasible = Some(e);
            return Ok(Some(c));
        }
        Err(_) => return Ok(None),
    };
    let workers = devices_for_plan(&plan, cluster)?;
    let stages = plan.stage_costs().expect("costs assigned");
    c.layers_per_stage = plan.layers_per_stage();
    c.peak_memory_bytes = memory_peaks(&plan, &stages)
        .iter()
        .map(|p| p.static_bytes + p.activation_bytes)
        .max()
        .unwrap_or(0);
    if let Err(e) = check_memory(&plan, &stages, &workers) {
        c.infeasible = Some(format!("memory: {e}"));
        return Ok(Some(c));
    }
    let r = simulate(&SimSetup {
        plan: &plan,
        stages: &stages,
        cluster: &workers,
    })?;
    c.iteration_time = Some(r.iteration_time);
    c.bubble_fraction = r.bubble_fraction;
    c.compute = r.busy.iter().copied().fold(0.0, f64::max);
    c.allreduce = r.iteration_time - r.makespan;
    c.plan = Some(plan.into_plan());
    c.result = Some(r);
    Ok(Some(c))
}

/// Say why each candidate lost to the winner: the part of its iteration time that grew most.
fn explain(cands: &mut [Candidate]) {
    let Some(best) = cands
        .first()
        .filter(|c| c.iteration_time.is_some())
        .cloned()
    else {
        for c in cands.iter_mut() {
            c.reason = c.infeasible.clone().unwrap_or_default();
        }
        return;
    };
    let (bt, bc, ba) = (best.iteration_time.unwrap(), best.compute, best.allreduce);
    let b_idle = bt - bc - ba;
    for c in cands.iter_mut().skip(1) {
        if let Some(why) = &c.infeasible {
            c.reason = why.clone();
            continue;
        }
        let t = c.iteration_time.unwrap();
        let parts = [
            ("compute: slowest stage", c.compute - bc),
            (
                "bubble: idle and waiting for transfers",
                (t - c.compute - c.allreduce) - b_idle,
            ),
            ("communication: gradient all-reduce", c.allreduce - ba),
        ];
        let (what, delta) = parts
            .iter()
            .copied()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap();
        c.reason = if t <= bt {
            "ties with the winner".into()
        } else {
            format!("{what} (+{delta:.4} s)")
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_depth_keeps_only_its_plans_and_their_best() {
        let (prof, cl) = (
            crate::profile::uniform_layers(8, 4000, 1000),
            Cluster::uniform(4),
        );
        let all = search(&prof, &cl, 8).unwrap();
        for p in [1, 2, 4] {
            let at = search_depth(&prof, &cl, 8, Some(p)).unwrap();
            assert!(at.iter().all(|c| c.depth == p && c.replicas == 4 / p));
            let best = all.iter().find(|c| c.depth == p).unwrap();
            assert_eq!(at[0].iteration_time, best.iteration_time, "depth {p}");
            assert!(at[0].plan.is_some(), "depth {p}: the winner keeps its plan");
        }
        // 3 stages: one replica, and one of the 4 devices left idle.
        assert!(search_depth(&prof, &cl, 8, Some(3)).is_ok());
        for bad in [0, 5] {
            let e = search_depth(&prof, &cl, 8, Some(bad))
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("stages {bad}")), "{e}");
        }
    }
}

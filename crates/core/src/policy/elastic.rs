//! AutoPipe and AutoDP (PipeTransformer, He et al., ICML 2021): once front layers freeze, cut
//! the model again with the exact partitioner (frozen layers cost a forward only and hold no
//! gradients or optimizer state), take the fastest depth that fits each worker's memory (any
//! depth, not only halving), and turn the freed workers into more data-parallel replicas, each
//! with fewer micro-batches so the global batch stays the same.

use crate::cluster::Cluster;
use crate::error::{Error, Result};
use crate::job::{build, JobSpec, LayerCut, PipelineShape};
use crate::plan::ir::Plan;
use crate::plan::ScheduleKind;
use crate::profile::{Profile, StageCost};
use crate::search::partition::{min_max_split, prefix};
use crate::sim::{simulate, SimSetup};

/// `profile` with layers `0..frozen` frozen: no backward, weights only (a quarter of the
/// weights + gradients + two AdamW moments a training layer holds), and no activations kept
/// for a backward except the last frozen layer's output, which the first training layer keeps.
pub fn frozen_profile(profile: &Profile, frozen: usize) -> Profile {
    let mut p = profile.clone();
    for (i, l) in p.layers.iter_mut().enumerate().take(frozen) {
        l.backward = Some(0.0);
        l.weight_grad = Some(0.0);
        l.params = l.params.div_ceil(4);
        if i + 1 < frozen {
            l.activation = 0;
        }
    }
    p
}

/// One depth the search looked at.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub depth: usize,
    pub replicas: usize,
    /// Simulated iteration time; `None` when it does not fit the memory budget.
    pub time: Option<f64>,
    pub peak_memory_bytes: u64,
}

/// The layout chosen for a frozen prefix, and the others considered.
#[derive(Debug, Clone)]
pub struct ElasticChoice {
    pub plan: Plan,
    pub depth: usize,
    pub replicas: usize,
    pub time: f64,
    pub candidates: Vec<Candidate>,
}

/// The plan of depth `d` x `r` replicas for `total_mbs` micro-batches per iteration, cut by
/// the exact partitioner; with `pin`, the frozen prefix stays in stage 0 (as the runtime runs
/// it: forward only, outside autodiff, before a training layer), else frozen layers go
/// wherever their forward-only cost balances best (as PipeTransformer's AutoPipe places
/// them). Its stage costs; `None` if the layers or micro-batches do not divide that way.
fn layout(
    profile: &Profile,
    frozen: usize,
    pin: bool,
    kind: ScheduleKind,
    d: usize,
    r: usize,
    total_mbs: usize,
) -> Result<Option<(Plan, Vec<StageCost>)>> {
    let n = profile.layers.len();
    let at = if pin { frozen } else { 0 };
    if d > n - at || !total_mbs.is_multiple_of(r) {
        return Ok(None);
    }
    let work = prefix(profile.layers.iter().map(|l| l.forward + l.backward()));
    let head = work[at];
    let split = min_max_split(n - at, d, |st, lo, hi| {
        work[at + hi] - work[at + lo] + if st == 0 { head } else { 0.0 }
    })?;
    let mut layers = split.layers_per_stage;
    layers[0] += at;
    let shape = PipelineShape {
        depth: d,
        chunks: 1,
        replicas: r,
        microbatches: total_mbs / r,
    };
    let plan = build(&JobSpec::new(kind, shape).with_layers(LayerCut::Given(&layers, profile)))?
        .into_plan();
    let costs = plan.stage_costs().expect("costs given");
    Ok(Some((plan, costs)))
}

/// The fastest layout of `profile` with `frozen` front layers frozen on at most `workers`
/// workers, `total_mbs` micro-batches per iteration, each worker holding at most
/// `memory_budget` bytes (weights, gradients, optimizer state and in-flight activations, as
/// the simulator counts them). Ties go to the shallower pipeline.
pub fn elastic_plan(
    profile: &Profile,
    frozen: usize,
    workers: usize,
    total_mbs: usize,
    kind: ScheduleKind,
    cluster: &Cluster,
    memory_budget: u64,
) -> Result<ElasticChoice> {
    let shape = Shape {
        workers,
        use_all: false,
        batch: GlobalBatch::Keep(total_mbs),
    };
    elastic_layout(profile, frozen, shape, kind, cluster, memory_budget)
}

/// What happens to the global batch when freed workers become replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlobalBatch {
    /// This many micro-batches per iteration, split over the replicas.
    Keep(usize),
    /// Every replica runs this many micro-batches: the batch grows with the replicas (the
    /// caller scales the learning rate).
    Scale(usize),
}

/// The workers a layout may use and its global batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub workers: usize,
    /// Use every worker (processes that all stay in the job: the freed ones join as replicas).
    pub use_all: bool,
    pub batch: GlobalBatch,
}

/// [`elastic_plan`] for any [`Shape`]: as many replicas as the workers allow (all of them
/// with `use_all`) and the micro-batches divide into.
pub fn elastic_layout(
    profile: &Profile,
    frozen: usize,
    shape: Shape,
    kind: ScheduleKind,
    cluster: &Cluster,
    memory_budget: u64,
) -> Result<ElasticChoice> {
    let fp = frozen_profile(profile, frozen);
    let w = shape.workers;
    search(&fp, frozen, true, w, kind, cluster, memory_budget, |d| {
        let r = match shape.batch {
            GlobalBatch::Keep(total) => (1..=w / d).rev().find(|r| total.is_multiple_of(*r)),
            GlobalBatch::Scale(_) => Some(w / d),
        }
        .filter(|r| !shape.use_all || r * d == w)?;
        Some(match shape.batch {
            GlobalBatch::Keep(total) => (r, total),
            GlobalBatch::Scale(m) => (r, r * m),
        })
    })
}

/// Like [`elastic_plan`] on an already frozen (and maybe cached) `profile`, each depth taking
/// the replicas and micro-batches per iteration `shape_at(depth)` gives (`None`: skip that
/// depth).
#[allow(clippy::too_many_arguments)]
fn search(
    fp: &Profile,
    frozen: usize,
    pin: bool,
    workers: usize,
    kind: ScheduleKind,
    cluster: &Cluster,
    memory_budget: u64,
    shape_at: impl Fn(usize) -> Option<(usize, usize)>,
) -> Result<ElasticChoice> {
    if frozen >= fp.layers.len() {
        return Err(Error::Invalid(format!(
            "cannot freeze {frozen} of {} layers (the head always trains)",
            fp.layers.len()
        )));
    }
    if kind.default_chunks() != 1 {
        return Err(Error::Invalid(format!(
            "elastic re-planning keeps one stage per worker; {kind} places {}",
            kind.default_chunks()
        )));
    }
    let mut best: Option<ElasticChoice> = None;
    let mut candidates = Vec::new();
    for d in 1..=workers {
        let Some((r, total_mbs)) = shape_at(d).filter(|(r, m)| r * d <= workers && *m > 0) else {
            continue;
        };
        let Some((plan, costs)) = layout(fp, frozen, pin, kind, d, r, total_mbs)? else {
            continue;
        };
        let (time, peak) = time_and_peak(&plan, &costs, cluster)?;
        let fits = peak <= memory_budget;
        candidates.push(Candidate {
            depth: d,
            replicas: r,
            time: fits.then_some(time),
            peak_memory_bytes: peak,
        });
        if fits && best.as_ref().is_none_or(|b| time < b.time - 1e-12) {
            best = Some(ElasticChoice {
                plan,
                depth: d,
                replicas: r,
                time,
                candidates: Vec::new(),
            });
        }
    }
    let mut choice = best.ok_or_else(|| {
        Error::Infeasible(format!(
            "no depth of at most {workers} workers fits {memory_budget} bytes per worker with {frozen} layers frozen"
        ))
    })?;
    choice.candidates = candidates;
    Ok(choice)
}

/// The simulated iteration time and fullest worker's memory of `plan` with the stage costs of
/// `profile` (a frozen, maybe cached one).
pub(crate) fn price(plan: &Plan, profile: &Profile, cluster: &Cluster) -> Result<(Plan, f64, u64)> {
    let mut plan = plan.clone();
    let costs = profile.stage_costs(&plan.layers_per_stage());
    for (st, c) in plan.stages.iter_mut().zip(&costs) {
        st.cost = Some(*c);
    }
    let (time, peak) = time_and_peak(&plan, &costs, cluster)?;
    Ok((plan, time, peak))
}

/// `plan`'s simulated iteration time and its fullest worker's memory, on the first devices of
/// `cluster`.
fn time_and_peak(plan: &Plan, costs: &[StageCost], cluster: &Cluster) -> Result<(f64, u64)> {
    let devices: Vec<usize> = (0..plan.num_workers()).collect();
    let sim = simulate(&SimSetup {
        plan,
        stages: costs,
        cluster: &cluster.subset(&devices),
    })?;
    let peak = sim.peak_memory_bytes.iter().copied().max().unwrap_or(0);
    Ok((sim.iteration_time, peak))
}

/// AutoPipe's last word: `choice` only if the simulator rates it strictly faster than keeping
/// `current` (priced with `profile`'s frozen costs), else `current`. A re-cut of the same
/// depth, or a layout only as fast, is not worth moving every worker's layers for.
pub fn keep_unless_faster(
    choice: ElasticChoice,
    current: &Plan,
    profile: &Profile,
    cluster: &Cluster,
    memory_budget: u64,
) -> Result<ElasticChoice> {
    let (plan, time, peak) = price(current, profile, cluster)?;
    if peak > memory_budget || choice.time < time * (1.0 - 1e-9) {
        return Ok(choice);
    }
    Ok(ElasticChoice {
        depth: plan.num_stages(),
        replicas: plan.replicas(),
        plan,
        time,
        candidates: choice.candidates,
    })
}

/// `frozen` (a frozen profile) with the outputs of layers `0..cached` read from AutoCache:
/// those layers no longer run, hold no activations, and need not stay on the device.
pub fn cached_profile(frozen: &Profile, cached: usize) -> Profile {
    let mut p = frozen.clone();
    for l in p.layers.iter_mut().take(cached) {
        l.forward = 0.0;
        l.params = 0;
        l.activation = 0;
    }
    p
}

/// PipeTransformer's components, switched on one by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ablation {
    /// No freezing: the starting layout throughout.
    Baseline,
    /// Frozen layers skip backward and the optimizer; the layout stays.
    FreezeOnly,
    /// AutoPipe (shorter pipelines, as many as at the start) and AutoCache.
    PipeCache,
    /// AutoPipe and AutoDP (freed workers become replicas), no cache.
    PipeDp,
    /// AutoFreeze, AutoPipe, AutoDP and AutoCache.
    All,
}

impl Ablation {
    pub const ALL: [Ablation; 5] = [
        Ablation::Baseline,
        Ablation::FreezeOnly,
        Ablation::PipeCache,
        Ablation::PipeDp,
        Ablation::All,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Ablation::Baseline => "no freezing (baseline)",
            Ablation::FreezeOnly => "freeze only",
            Ablation::PipeCache => "+ AutoPipe + AutoCache",
            Ablation::PipeDp => "+ AutoPipe + AutoDP",
            Ablation::All => "all four",
        }
    }
}

/// A training job to replay under each ablation.
#[derive(Debug, Clone)]
pub struct AblationSetup<'a> {
    pub profile: &'a Profile,
    pub cluster: &'a Cluster,
    /// Pipelines at the start (data-parallel replicas).
    pub pipelines: usize,
    /// Stages of each pipeline at the start.
    pub depth: usize,
    /// Micro-batches of each starting pipeline per iteration (the global batch stays).
    pub microbatches: usize,
    pub kind: ScheduleKind,
    /// Frozen layers of the profile during each epoch (a non-decreasing prefix count).
    pub trajectory: &'a [usize],
    /// Bytes each worker may hold.
    pub memory_budget: u64,
}

/// One epoch of one ablation.
#[derive(Debug, Clone, PartialEq)]
pub struct AblationEpoch {
    pub frozen: usize,
    pub depth: usize,
    pub replicas: usize,
    /// Simulated seconds per iteration.
    pub iteration_time: f64,
}

/// Replay `setup`'s freezing trajectory under `which`: per epoch the layout chosen and its
/// simulated iteration time. With AutoCache, the layers frozen before an epoch are read from
/// the cache in it, and the layers newly frozen run forward once per sample (filling it).
pub fn ablation(setup: &AblationSetup, which: Ablation) -> Result<Vec<AblationEpoch>> {
    let (Some(workers), Some(total_mbs)) = (
        setup.pipelines.checked_mul(setup.depth),
        setup.pipelines.checked_mul(setup.microbatches),
    ) else {
        return Err(Error::Invalid(format!(
            "{} pipelines of {} stages and {} micro-batches each are too many to count",
            setup.pipelines, setup.depth, setup.microbatches
        )));
    };
    let n = setup.profile.layers.len();
    if setup.trajectory.windows(2).any(|w| w[1] < w[0]) {
        return Err(Error::Invalid(format!(
            "the freezing trajectory {:?} must not decrease (frozen layers stay frozen)",
            setup.trajectory
        )));
    }
    if let Some(&k) = setup.trajectory.iter().find(|&&k| k >= n) {
        return Err(Error::Invalid(format!(
            "the trajectory freezes {k} layers of {n} (the last layer always trains)"
        )));
    }
    // The starting layout: the exact partition of the unfrozen model.
    let start = search(
        setup.profile,
        0,
        false,
        workers,
        setup.kind,
        setup.cluster,
        u64::MAX,
        |d| (d == setup.depth).then_some((setup.pipelines, total_mbs)),
    )?;
    let start_peak = peak_memory(
        &start.plan,
        &setup.profile.stage_costs(&start.plan.layers_per_stage()),
        setup.cluster,
    )?;
    if start_peak > setup.memory_budget {
        return Err(Error::Infeasible(format!(
            "the starting layout ({} stages x {} pipelines) needs {start_peak} bytes on its fullest worker, more than the {} allowed",
            setup.depth, setup.pipelines, setup.memory_budget
        )));
    }
    let mut out: Vec<AblationEpoch> = Vec::with_capacity(setup.trajectory.len());
    // An epoch's layout depends only on the layers frozen in it and before it, and on the
    // layout it starts from.
    let mut seen: std::collections::HashMap<(usize, usize, Vec<usize>, usize), ElasticChoice> =
        std::collections::HashMap::new();
    let mut before = 0;
    let mut current = start.plan;
    for &k in setup.trajectory {
        let key = (k, before, current.layers_per_stage(), current.replicas());
        let choice = match seen.get(&key) {
            Some(c) => c.clone(),
            None => {
                let c = epoch_layout(setup, which, &current, k, before, workers, total_mbs)?;
                seen.insert(key, c.clone());
                c
            }
        };
        out.push(AblationEpoch {
            frozen: if which == Ablation::Baseline { 0 } else { k },
            depth: choice.depth,
            replicas: choice.replicas,
            iteration_time: choice.time,
        });
        current = choice.plan;
        before = k;
    }
    Ok(out)
}

/// One epoch of [`ablation`]: `k` layers frozen (`before` of them in earlier epochs), starting
/// from the layout `current`.
fn epoch_layout(
    setup: &AblationSetup,
    which: Ablation,
    current: &Plan,
    k: usize,
    before: usize,
    workers: usize,
    total_mbs: usize,
) -> Result<ElasticChoice> {
    let frozen = if which == Ablation::Baseline { 0 } else { k };
    let fp = frozen_profile(setup.profile, frozen);
    let cached = match which {
        Ablation::PipeCache | Ablation::All => cached_profile(&fp, before.min(frozen)),
        _ => fp,
    };
    // Nothing frozen yet, or no AutoPipe: the layout stays.
    let keep = ElasticChoice {
        plan: current.clone(),
        depth: current.num_stages(),
        replicas: current.replicas(),
        time: f64::INFINITY,
        candidates: Vec::new(),
    };
    if frozen == 0 || matches!(which, Ablation::Baseline | Ablation::FreezeOnly) {
        return keep_unless_faster(keep, current, &cached, setup.cluster, u64::MAX);
    }
    let dp = matches!(which, Ablation::PipeDp | Ablation::All);
    let c = search(
        &cached,
        frozen,
        false,
        workers,
        setup.kind,
        setup.cluster,
        setup.memory_budget,
        |d| {
            let r = if dp {
                (1..=workers / d)
                    .rev()
                    .find(|r| total_mbs.is_multiple_of(*r))
            } else {
                Some(setup.pipelines)
            };
            r.map(|r| (r, total_mbs))
        },
    )?;
    keep_unless_faster(c, current, &cached, setup.cluster, setup.memory_budget)
}

/// The most memory a worker of `plan` holds (the simulator's count): the budget an elastic
/// run keeps to.
pub fn peak_memory(plan: &Plan, costs: &[StageCost], cluster: &Cluster) -> Result<u64> {
    Ok(time_and_peak(plan, costs, cluster)?.1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::validate::validate;

    fn profile(n: usize) -> Profile {
        crate::profile::uniform_layers(n, 4_000_000, 100_000)
    }

    #[test]
    fn freezing_shortens_the_pipeline_and_adds_replicas_within_the_budget() {
        // Activations dominate memory (as for long sequences): 1 MB of weights, 4 MB of
        // activations per layer and micro-batch.
        let mut prof = profile(8);
        for l in &mut prof.layers {
            (l.params, l.activation) = (1_000_000, 4_000_000);
        }
        let cl = Cluster::uniform(4);
        // The budget: what the 4-deep pipeline holds per worker with nothing frozen.
        let (start, costs) = layout(&prof, 0, true, ScheduleKind::OneFOneB, 4, 1, 8)
            .unwrap()
            .unwrap();
        let budget = peak_memory(&start, &costs, &cl).unwrap();
        let none = elastic_plan(&prof, 0, 4, 8, ScheduleKind::OneFOneB, &cl, budget).unwrap();
        assert_eq!((none.depth, none.replicas), (4, 1), "{:?}", none.candidates);
        let half = elastic_plan(&prof, 4, 4, 8, ScheduleKind::OneFOneB, &cl, budget).unwrap();
        validate(&half.plan).unwrap();
        assert!(
            half.depth < 4 && half.replicas >= 2,
            "{:?}",
            half.candidates
        );
        assert!(half.time < none.time);
        // The frozen prefix sits in stage 0; the global batch is unchanged.
        assert!(half.plan.layers_per_stage()[0] > 4);
        assert_eq!(half.plan.num_microbatches, 8);
        for c in half.candidates.iter().chain(&none.candidates) {
            assert_eq!(c.time.is_some(), c.peak_memory_bytes <= budget, "{c:?}");
        }
        // Every depth is considered, not only halvings.
        let depths: Vec<usize> = half.candidates.iter().map(|c| c.depth).collect();
        assert_eq!(depths, vec![1, 2, 3, 4]);
    }

    #[test]
    fn frozen_layers_cost_a_forward_and_their_weights_only() {
        let p = frozen_profile(&profile(4), 2);
        assert_eq!(p.layers[0].backward(), 0.0);
        assert_eq!(p.layers[1].weight_grad(), 0.0);
        assert_eq!(p.layers[0].params, 1_000_000);
        assert_eq!(
            (p.layers[0].activation, p.layers[1].activation),
            (0, 100000)
        );
        assert_eq!(p.layers[2], profile(4).layers[2]);
        assert!(elastic_plan(
            &profile(4),
            4,
            2,
            4,
            ScheduleKind::OneFOneB,
            &Cluster::uniform(2),
            u64::MAX
        )
        .is_err());
        assert!(elastic_plan(
            &profile(4),
            1,
            2,
            4,
            ScheduleKind::ZbV,
            &Cluster::uniform(2),
            u64::MAX
        )
        .is_err());
    }

    #[test]
    fn ablations_replay_the_trajectory_each_component_helping() {
        let prof = profile(8);
        let cl = Cluster::uniform(4);
        let trajectory = [0, 4, 4, 6];
        let setup = AblationSetup {
            profile: &prof,
            cluster: &cl,
            pipelines: 1,
            depth: 4,
            microbatches: 8,
            kind: ScheduleKind::GPipe,
            trajectory: &trajectory,
            memory_budget: u64::MAX,
        };
        let run = |w| ablation(&setup, w).unwrap();
        let (base, freeze, cache, dp, all) = (
            run(Ablation::Baseline),
            run(Ablation::FreezeOnly),
            run(Ablation::PipeCache),
            run(Ablation::PipeDp),
            run(Ablation::All),
        );
        for e in 0..4 {
            assert_eq!(base[e], base[0]);
            assert!(freeze[e].iteration_time <= base[e].iteration_time + 1e-9);
            assert!(
                all[e].iteration_time <= dp[e].iteration_time + 1e-9,
                "epoch {e}"
            );
            assert_eq!(cache[e].replicas, 1);
        }
        // Nothing frozen: the starting layout everywhere.
        for r in [&freeze, &cache, &dp, &all] {
            assert_eq!(r[0], base[0]);
        }
        // Freezing frees workers that become replicas; in the first frozen epoch the cache is
        // still filling (all == dp), after it the cached layers cost nothing.
        assert!(dp[1].replicas > 1 && dp[1].iteration_time < base[1].iteration_time);
        assert_eq!(all[1].iteration_time, dp[1].iteration_time);
        assert!(all[2].iteration_time < dp[2].iteration_time);
        assert!(cache[2].iteration_time < cache[1].iteration_time);
        let bad = AblationSetup {
            trajectory: &[0, 3, 2],
            ..setup.clone()
        };
        assert!(ablation(&bad, Ablation::All).is_err());
        let bad = AblationSetup {
            trajectory: &[8],
            ..setup
        };
        assert!(ablation(&bad, Ablation::FreezeOnly).is_err());
    }
}

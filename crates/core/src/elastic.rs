//! AutoPipe and AutoDP (PipeTransformer, He et al., ICML 2021): once front layers freeze, cut
//! the model again with the exact partitioner (frozen layers cost a forward only and hold no
//! gradients or optimizer state), take the fastest depth that fits each worker's memory (any
//! depth, not only halving), and turn the freed workers into more data-parallel replicas, each
//! with fewer micro-batches so the global batch stays the same.

use crate::cluster::Cluster;
use crate::error::{Error, Result};
use crate::ir::Plan;
use crate::partition::{min_max_split, prefix};
use crate::profile::{Profile, StageCost};
use crate::schedule::{generate, ScheduleKind};
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

/// The plan of depth `d` x `r` replicas for `total_mbs` micro-batches per iteration, with
/// the frozen prefix in stage 0 and the other layers cut by the exact partitioner; its stage
/// costs; `None` if the layers or micro-batches do not divide that way.
fn layout(
    profile: &Profile,
    frozen: usize,
    kind: ScheduleKind,
    d: usize,
    r: usize,
    total_mbs: usize,
) -> Result<Option<(Plan, Vec<StageCost>)>> {
    let n = profile.layers.len();
    if d > n - frozen || !total_mbs.is_multiple_of(r) {
        return Ok(None);
    }
    let work = prefix(profile.layers.iter().map(|l| l.forward + l.backward()));
    let head = work[frozen];
    let split = min_max_split(n - frozen, d, |st, lo, hi| {
        work[frozen + hi] - work[frozen + lo] + if st == 0 { head } else { 0.0 }
    })?;
    let mut layers = split.layers_per_stage;
    layers[0] += frozen;
    let mut plan = generate(kind, d, total_mbs / r, 1)?.replicate(r)?;
    plan.set_layers(&layers);
    let costs = profile.stage_costs(&layers);
    for (st, c) in plan.stages.iter_mut().zip(&costs) {
        st.cost = Some(*c);
    }
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
    if frozen >= profile.layers.len() {
        return Err(Error::Invalid(format!(
            "cannot freeze {frozen} of {} layers (the head always trains)",
            profile.layers.len()
        )));
    }
    if kind.default_chunks() != 1 {
        return Err(Error::Invalid(format!(
            "elastic re-planning keeps one stage per worker; {kind} places {}",
            kind.default_chunks()
        )));
    }
    let fp = frozen_profile(profile, frozen);
    let mut best: Option<ElasticChoice> = None;
    let mut candidates = Vec::new();
    for d in 1..=workers {
        // As many replicas as the workers allow and the micro-batches divide into.
        let Some(r) = (1..=workers / d)
            .rev()
            .find(|r| total_mbs.is_multiple_of(*r))
        else {
            continue;
        };
        let Some((plan, costs)) = layout(&fp, frozen, kind, d, r, total_mbs)? else {
            continue;
        };
        let devices: Vec<usize> = (0..plan.num_workers()).collect();
        let sim = simulate(&SimSetup {
            plan: &plan,
            stages: &costs,
            cluster: &cluster.subset(&devices),
        })?;
        let peak = sim.peak_memory_bytes.iter().copied().max().unwrap_or(0);
        let fits = peak <= memory_budget;
        candidates.push(Candidate {
            depth: d,
            replicas: r,
            time: fits.then_some(sim.iteration_time),
            peak_memory_bytes: peak,
        });
        if fits
            && best
                .as_ref()
                .is_none_or(|b| sim.iteration_time < b.time - 1e-12)
        {
            best = Some(ElasticChoice {
                plan,
                depth: d,
                replicas: r,
                time: sim.iteration_time,
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

/// The most memory a worker of `plan` holds (the simulator's count): the budget an elastic
/// run keeps to.
pub fn peak_memory(plan: &Plan, costs: &[StageCost], cluster: &Cluster) -> Result<u64> {
    let devices: Vec<usize> = (0..plan.num_workers()).collect();
    let sim = simulate(&SimSetup {
        plan,
        stages: costs,
        cluster: &cluster.subset(&devices),
    })?;
    Ok(sim.peak_memory_bytes.iter().copied().max().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::validate;

    fn profile(n: usize) -> Profile {
        let mut toml = String::from("[model]\nname = \"m\"\n");
        for i in 0..n {
            toml += &format!("[[layers]]\nname = \"l{i}\"\nforward = 1\nbackward = 2\nparams = 4000000\nactivation = 100000\n");
        }
        Profile::parse("m.toml", &toml).unwrap()
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
        let (start, costs) = layout(&prof, 0, ScheduleKind::OneFOneB, 4, 1, 8)
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
}

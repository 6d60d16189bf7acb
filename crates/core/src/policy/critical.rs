//! The pipeline-aware freeze choice (after TimelyFreeze, arXiv 2602.05754): freezing pays only
//! where the backward it removes lies on the iteration's critical path. Among the layer blocks
//! the adaptive rule finds settled, the simulator decides which to freeze, and how:
//! - a block that extends the frozen prefix drops its whole backward (it runs forward only);
//! - a settled block behind a training block keeps its input gradient (the blocks before it
//!   still need it) and drops its weight gradient (W) only, wherever it sits.
//!
//! A settled block whose freezing does not shorten the simulated iteration keeps training: it
//! would cost accuracy and buy no time. `train --freeze critical` runs it (the runtime's
//! `train::freeze`), with weight-only blocks outside autodiff (`Worker::weight_only`).

use super::elastic::{frozen_profile, price};
use super::freeze::max_frozen;
use crate::cluster::Cluster;
use crate::error::Result;
use crate::plan::ir::Plan;
use crate::profile::Profile;

/// What the simulator chose, and the iteration it predicts before and after.
#[derive(Debug, Clone, PartialEq)]
pub struct CriticalChoice {
    /// Blocks `0..prefix` frozen whole.
    pub prefix: usize,
    /// Blocks past the prefix whose weight gradient is dropped (ascending).
    pub weight_only: Vec<usize>,
    /// Simulated iteration seconds with the freezing it started from, and with the choice.
    pub before: f64,
    pub after: f64,
    /// Compute seconds of each stage on the simulated critical path, before and after.
    pub path_before: Vec<f64>,
    pub path_after: Vec<f64>,
}

/// Compute seconds of each stage of `plan` on its simulated critical path
/// ([`crate::sim::Timeline::critical_path`]) with `profile`'s costs.
pub fn critical_path_by_stage(
    plan: &Plan,
    profile: &Profile,
    cluster: &Cluster,
) -> Result<Vec<f64>> {
    let costs = profile.stage_costs(&plan.layers_per_stage());
    let devices: Vec<usize> = (0..plan.num_workers()).collect();
    let sim = crate::sim::simulate(&crate::sim::SimSetup {
        plan,
        stages: &costs,
        cluster: &cluster.subset(&devices),
    })?;
    let mut by_stage = vec![0.0; plan.num_stages()];
    for a in sim.timeline.critical_path() {
        by_stage[a.action.stage] += a.end - a.start;
    }
    Ok(by_stage)
}

/// `profile` with blocks `0..prefix` frozen whole and the `weight_only` blocks without their
/// weight gradient: their backward is the input gradient alone, and they hold no gradients or
/// optimizer moments (a quarter of a training block's parameter memory), but keep their
/// activations for that backward.
pub fn weight_frozen_profile(profile: &Profile, prefix: usize, weight_only: &[usize]) -> Profile {
    let mut p = frozen_profile(profile, prefix);
    for &i in weight_only.iter().filter(|&&i| i >= prefix) {
        if let Some(l) = p.layers.get_mut(i) {
            let b = l.input_grad();
            (l.backward, l.weight_grad, l.input_grad) = (Some(b), Some(0.0), Some(b));
            l.params = l.params.div_ceil(4);
        }
    }
    p
}

/// Greedily, the settled block whose freezing shortens `plan`'s simulated iteration most,
/// while one shortens it by more than `min_gain` (relative) and fewer than `max_new` blocks
/// have been added, starting from `prefix` and `weight_only`. A weight-only block the prefix
/// reaches joins the prefix; the prefix stays where `plan` can run it (`max_frozen`).
/// `settled[i]`: block `i` may freeze.
#[allow(clippy::too_many_arguments)]
pub fn choose(
    plan: &Plan,
    profile: &Profile,
    cluster: &Cluster,
    settled: &[bool],
    prefix: usize,
    weight_only: &[usize],
    min_gain: f64,
    max_new: usize,
) -> Result<CriticalChoice> {
    let time = |p: usize, w: &[usize]| -> Result<f64> {
        Ok(price(plan, &weight_frozen_profile(profile, p, w), cluster)?.1)
    };
    let limit = max_frozen(plan).max(prefix);
    let (mut p, mut w) = normalise(prefix, weight_only.to_vec(), limit);
    let before = time(p, &w)?;
    let mut now = before;
    let start = p + w.len();
    while p + w.len() < start + max_new {
        let mut best: Option<(f64, usize, Vec<usize>)> = None;
        for i in (p..settled.len()).filter(|&i| settled[i] && !w.contains(&i)) {
            let mut nw = w.clone();
            nw.push(i);
            let (np, nw) = normalise(p, nw, limit);
            let t = time(np, &nw)?;
            if t < now * (1.0 - min_gain) && best.as_ref().is_none_or(|b| t < b.0) {
                best = Some((t, np, nw));
            }
        }
        let Some((t, np, nw)) = best else { break };
        (now, p, w) = (t, np, nw);
    }
    let path = |p: usize, w: &[usize]| {
        critical_path_by_stage(plan, &weight_frozen_profile(profile, p, w), cluster)
    };
    let (p0, w0) = normalise(prefix, weight_only.to_vec(), limit);
    Ok(CriticalChoice {
        path_before: path(p0, &w0)?,
        path_after: path(p, &w)?,
        prefix: p,
        weight_only: w,
        before,
        after: now,
    })
}

/// Weight-only blocks that touch the prefix join it (frozen whole) while the prefix is under
/// `limit` (what the plan's stage 0 can hold); the rest stay weight-only, sorted.
pub fn normalise(mut prefix: usize, mut w: Vec<usize>, limit: usize) -> (usize, Vec<usize>) {
    w.sort_unstable();
    w.dedup();
    while let Some(at) = w.iter().position(|&i| i == prefix && prefix < limit) {
        w.remove(at);
        prefix += 1;
    }
    w.retain(|&i| i >= prefix);
    (prefix, w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::ScheduleKind;

    /// 8 blocks of forward 1, backward 2 (W half of it), 1 MB each.
    fn profile(heavy: &[usize]) -> Profile {
        let mut toml = String::from("[model]\nname = \"m\"\n");
        for i in 0..8 {
            let f = if heavy.contains(&i) { 3 } else { 1 };
            toml += &format!(
                "[[layers]]\nname = \"l{i}\"\nforward = {f}\nbackward = {}\nparams = 1000000\nactivation = 1000\n",
                2 * f
            );
        }
        Profile::parse("m.toml", &toml).unwrap()
    }

    fn plan(layers: &[usize]) -> Plan {
        let mut p = crate::schedule::generate(ScheduleKind::OneFOneB, layers.len(), 8, 1).unwrap();
        p.set_layers(layers);
        p
    }

    /// Every subset of the settled blocks, frozen as `normalise` would run it: the fastest.
    fn brute_force(plan: &Plan, prof: &Profile, cl: &Cluster, settled: &[bool]) -> f64 {
        let idx: Vec<usize> = (0..settled.len()).filter(|&i| settled[i]).collect();
        let mut best = f64::INFINITY;
        for mask in 0u32..1 << idx.len() {
            let w: Vec<usize> = (0..idx.len())
                .filter(|b| mask >> b & 1 == 1)
                .map(|b| idx[b])
                .collect();
            let (p, w) = normalise(0, w, max_frozen(plan));
            let t = price(plan, &weight_frozen_profile(prof, p, &w), cl)
                .unwrap()
                .1;
            best = best.min(t);
        }
        best
    }

    #[test]
    fn the_bottleneck_stage_drops_its_weight_gradients_and_the_tail_its_backward() {
        // Stage 1 (blocks 4-7, two of them heavy) is the bottleneck: its settled blocks 5 and 6
        // drop their weight gradient. Stage 0's settled prefix freezes whole too: the last
        // micro-batch's backward on stage 0 ends a 1F1B iteration, on the critical path.
        let prof = profile(&[5, 6]);
        let pl = plan(&[4, 4]);
        let cl = Cluster::uniform(2);
        let settled = [true, true, true, false, false, true, true, false];
        let c = choose(&pl, &prof, &cl, &settled, 0, &[], 0.001, usize::MAX).unwrap();
        assert_eq!((c.prefix, c.weight_only.clone()), (3, vec![5, 6]), "{c:?}");
        assert_eq!((c.before, c.after), (204.0, 150.0));
        // The bottleneck, stage 1, holds most of the critical path before; less after.
        assert!(c.path_before[1] > c.path_before[0], "{c:?}");
        assert!(c.path_after[1] < c.path_before[1], "{c:?}");
        assert!(c.after < c.before);
        // As fast as the best of all 2^5 choices.
        let best = brute_force(&pl, &prof, &cl, &settled);
        assert!((c.after - best).abs() < 1e-9, "{} against {best}", c.after);
    }

    #[test]
    fn weight_gradients_off_the_critical_path_stay() {
        // ZB-H1 runs W in the bubbles: on a balanced 2-stage pipeline a settled block of stage
        // 0 behind a training block (block 2) gains nothing from dropping its W, so it trains.
        let prof = profile(&[]);
        let mut pl = crate::schedule::generate(ScheduleKind::ZbH1, 2, 8, 1).unwrap();
        pl.set_layers(&[4, 4]);
        let cl = Cluster::uniform(2);
        let settled = [false, false, true, false, false, false, false, false];
        let c = choose(&pl, &prof, &cl, &settled, 0, &[], 0.001, usize::MAX).unwrap();
        let alone = price(&pl, &weight_frozen_profile(&prof, 0, &[2]), &cl)
            .unwrap()
            .1;
        assert_eq!(
            (alone, c.before),
            (100.0, 100.0),
            "its W is hidden in a bubble"
        );
        assert_eq!(
            (c.prefix, c.weight_only.len(), c.after),
            (0, 0, 100.0),
            "{c:?}"
        );
        // Under 1F1B the same block's W is in the last micro-batch's fused backward, which
        // ends the iteration: there it pays, and is chosen.
        let one = plan(&[4, 4]);
        let c = choose(&one, &prof, &cl, &settled, 0, &[], 0.001, usize::MAX).unwrap();
        assert_eq!(c.weight_only, vec![2], "{c:?}");
    }

    #[test]
    fn a_balanced_pipeline_freezes_what_shortens_it_and_never_slows() {
        let prof = profile(&[]);
        let pl = plan(&[4, 4]);
        let cl = Cluster::uniform(2);
        for settled in [
            [true; 8],
            [false, true, false, true, false, true, false, true],
        ] {
            let c = choose(&pl, &prof, &cl, &settled, 0, &[], 0.001, usize::MAX).unwrap();
            assert!(c.after <= c.before, "{c:?}");
            assert!(c.prefix <= max_frozen(&pl));
            for &i in &c.weight_only {
                assert!(settled[i] && i >= c.prefix, "{c:?}");
            }
            let best = brute_force(&pl, &prof, &cl, &settled);
            assert!(c.after <= best * 1.10 + 1e-9, "{} against {best}", c.after);
        }
        // At most `max_new` blocks a decision: the one that gains most.
        let one = choose(&pl, &prof, &cl, &[true; 8], 0, &[], 0.001, 1).unwrap();
        assert_eq!(one.prefix + one.weight_only.len(), 1, "{one:?}");
        let all = choose(&pl, &prof, &cl, &[true; 8], 0, &[], 0.001, usize::MAX).unwrap();
        assert!(
            one.after >= all.after && one.after < one.before,
            "{one:?} {all:?}"
        );
        // Nothing settled: nothing changes.
        let c = choose(&pl, &prof, &cl, &[false; 8], 0, &[], 0.001, usize::MAX).unwrap();
        assert_eq!((c.prefix, c.weight_only.len(), c.after), (0, 0, c.before));
    }

    #[test]
    fn weight_only_blocks_that_touch_the_prefix_join_it() {
        assert_eq!(normalise(2, vec![4, 2, 3, 6], 8), (5, vec![6]));
        assert_eq!(normalise(0, vec![1], 8), (0, vec![1]));
        // Stage 0 holds a prefix of 3 at most: the blocks after it stay weight-only.
        assert_eq!(normalise(0, vec![0, 1, 2, 3, 4], 3), (3, vec![3, 4]));
        let p = weight_frozen_profile(&profile(&[]), 1, &[3]);
        assert_eq!((p.layers[0].backward(), p.layers[3].backward()), (0.0, 1.0));
        assert_eq!(
            (p.layers[3].weight_grad(), p.layers[3].input_grad()),
            (0.0, 1.0)
        );
        assert_eq!(p.layers[2].backward(), 2.0);
    }
}

//! Contiguous layers-to-stages partitioning that minimises the bottleneck stage.
//!
//! Exact by dynamic programming: `best[k][i]` is the smallest bottleneck that cuts the first `i`
//! layers into `k` stages; `best[k][i] = min_j max(best[k-1][j], cost(k-1, j, i))`. The stage
//! cost may depend on the stage index (its device) and on the cut (the activation it sends).

use crate::error::{Error, Result};

/// A partition: layers per stage, each stage's cost and the largest of them.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    pub layers_per_stage: Vec<usize>,
    pub stage_cost: Vec<f64>,
    pub bottleneck: f64,
}

/// Cut `n` layers into `k` non-empty contiguous stages minimising the maximum of
/// `cost(stage, lo, hi)`. `O(k n^2)` evaluations of `cost`.
pub fn min_max_split(n: usize, k: usize, cost: impl Fn(usize, usize, usize) -> f64) -> Result<Split> {
    if k == 0 {
        return Err(Error::Infeasible("cannot cut a model into 0 stages".into()));
    }
    if k > n {
        return Err(Error::Infeasible(format!("cannot cut {n} layers into {k} non-empty stages")));
    }
    let inf = f64::INFINITY;
    // best[i] for the current k; cut[k][i] = where the last stage starts.
    let mut best: Vec<f64> = (0..=n).map(|i| if i == 0 { 0.0 } else { inf }).collect();
    let mut cut = vec![vec![0usize; n + 1]; k + 1];
    for st in 1..=k {
        let mut next = vec![inf; n + 1];
        // Stage st-1 covers lo..hi; leave at least one layer for each later stage.
        for hi in st..=n - (k - st) {
            let mut b = inf;
            let mut arg = 0;
            for lo in (st - 1)..hi {
                if best[lo] >= b {
                    continue;
                }
                let v = best[lo].max(cost(st - 1, lo, hi));
                if v < b {
                    b = v;
                    arg = lo;
                }
            }
            next[hi] = b;
            cut[st][hi] = arg;
        }
        best = next;
    }
    if !best[n].is_finite() {
        return Err(Error::Infeasible(format!("no way to cut {n} layers into {k} stages within the limits")));
    }
    let mut bounds = vec![n];
    let mut hi = n;
    for st in (1..=k).rev() {
        hi = cut[st][hi];
        bounds.push(hi);
    }
    bounds.reverse();
    let layers_per_stage: Vec<usize> = bounds.windows(2).map(|w| w[1] - w[0]).collect();
    let stage_cost: Vec<f64> = bounds.windows(2).enumerate().map(|(s, w)| cost(s, w[0], w[1])).collect();
    Ok(Split { bottleneck: stage_cost.iter().copied().fold(0.0, f64::max), layers_per_stage, stage_cost })
}

/// Prefix sums, so a stage's total is two lookups.
pub fn prefix(xs: impl IntoIterator<Item = f64>) -> Vec<f64> {
    let mut out = vec![0.0];
    for x in xs {
        out.push(out.last().unwrap() + x);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// All compositions of n into k positive parts.
    pub(crate) fn compositions(n: usize, k: usize) -> Vec<Vec<usize>> {
        if k == 1 {
            return vec![vec![n]];
        }
        (1..=n - (k - 1)).flat_map(|first| compositions(n - first, k - 1).into_iter().map(move |mut r| {
            r.insert(0, first);
            r
        })).collect()
    }

    #[test]
    fn matches_brute_force() {
        let w = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0];
        let pre = prefix(w);
        for k in 1..=5 {
            let s = min_max_split(w.len(), k, |_, lo, hi| pre[hi] - pre[lo]).unwrap();
            let brute = compositions(w.len(), k)
                .iter()
                .map(|c| {
                    let mut lo = 0;
                    c.iter().map(|&n| { lo += n; pre[lo] - pre[lo - n] }).fold(0.0, f64::max)
                })
                .fold(f64::INFINITY, f64::min);
            assert_eq!(s.bottleneck, brute, "k={k}");
            assert_eq!(s.layers_per_stage.iter().sum::<usize>(), w.len());
        }
    }

    #[test]
    fn too_many_stages() {
        assert!(min_max_split(3, 4, |_, _, _| 1.0).unwrap_err().to_string().contains("cannot cut 3 layers into 4"));
    }
}

/// Cut a profile's layers into a plan's stages, each stage timed on its worker's device, with
/// the cut's activation sent to the next stage's device (model order). Returns per-stage costs.
pub fn split_for_plan(
    profile: &crate::profile::Profile,
    plan: &crate::ir::Plan,
    cluster: &crate::cluster::Cluster,
) -> Result<(Split, Vec<crate::profile::StageCost>)> {
    let layers = &profile.layers;
    let work = prefix(layers.iter().map(|l| l.forward + l.backward()));
    let s = plan.num_stages();
    let dev = |st: usize| plan.placement[st];
    let split = min_max_split(layers.len(), s, |st, lo, hi| {
        let compute = (work[hi] - work[lo]) / cluster.devices[dev(st)].speed;
        let send = if st + 1 < s { cluster.transfer_time(dev(st), dev(st + 1), layers[hi - 1].activation) } else { 0.0 };
        compute + send
    })
    .map_err(|e| Error::Infeasible(format!("profile \"{}\": {e}", profile.model.name)))?;
    let costs = profile.stage_costs(&split.layers_per_stage);
    Ok((split, costs))
}

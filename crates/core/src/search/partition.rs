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
/// `cost(stage, lo, hi)`, exactly. `cost` must not increase as a stage grows to the left (for
/// fixed `stage` and `hi`, non-increasing in `lo`): true of every cost here, a sum of
/// non-negative layer costs plus a term of the cut `hi`, or infinity past a memory limit.
///
/// `best[st][hi] = min_lo max(best[st-1][lo], cost(st-1, lo, hi))`. Replacing `best[st-1][lo]`
/// by its minimum over `lo..hi` (non-decreasing in `lo`) does not change that minimum, and
/// against a non-increasing cost the minimum of the max sits where the two cross: a binary
/// search with range-minimum queries. `O(k n log n)` evaluations of `cost`, where the plain
/// recurrence takes `O(k n^2)` (10,000 layers: milliseconds, not seconds).
#[allow(clippy::needless_range_loop)] // DP tables read clearest by index.
pub fn min_max_split(
    n: usize,
    k: usize,
    cost: impl Fn(usize, usize, usize) -> f64,
) -> Result<Split> {
    if k == 0 {
        return Err(Error::Infeasible("cannot cut a model into 0 stages".into()));
    }
    if k > n {
        return Err(Error::Infeasible(format!(
            "cannot cut {n} layers into {k} non-empty stages"
        )));
    }
    let inf = f64::INFINITY;
    // best[i] for the current k; cut[k][i] = where the last stage starts.
    let mut best: Vec<f64> = (0..=n).map(|i| if i == 0 { 0.0 } else { inf }).collect();
    let mut cut = vec![vec![0usize; n + 1]; k + 1];
    for st in 1..=k {
        let rmq = ArgMin::new(&best);
        let mut next = vec![inf; n + 1];
        // Stage st-1 covers lo..hi; leave at least one layer for each later stage.
        for hi in st..=n - (k - st) {
            let (first, last) = (st - 1, hi - 1);
            let h = |lo: usize| cost(st - 1, lo, hi);
            let g = |lo: usize| best[rmq.min_at(lo, last)];
            // First lo where the (non-decreasing) best-so-far reaches the stage cost.
            let (mut a, mut b) = (first, last + 1);
            while a < b {
                let mid = a + (b - a) / 2;
                if g(mid) >= h(mid) {
                    b = mid;
                } else {
                    a = mid + 1;
                }
            }
            let (mut val, mut arg) = (inf, first);
            for p in [a.checked_sub(1), Some(a)].into_iter().flatten() {
                if p < first || p > last {
                    continue;
                }
                let lo = rmq.min_at(p, last);
                let v = best[lo].max(h(lo));
                if v < val {
                    val = v;
                    arg = lo;
                }
            }
            next[hi] = val;
            cut[st][hi] = arg;
        }
        best = next;
    }
    if !best[n].is_finite() {
        return Err(Error::Infeasible(format!(
            "no way to cut {n} layers into {k} stages within the limits"
        )));
    }
    let mut bounds = vec![n];
    let mut hi = n;
    for st in (1..=k).rev() {
        hi = cut[st][hi];
        bounds.push(hi);
    }
    bounds.reverse();
    let layers_per_stage: Vec<usize> = bounds.windows(2).map(|w| w[1] - w[0]).collect();
    let stage_cost: Vec<f64> = bounds
        .windows(2)
        .enumerate()
        .map(|(s, w)| cost(s, w[0], w[1]))
        .collect();
    Ok(Split {
        bottleneck: stage_cost.iter().copied().fold(0.0, f64::max),
        layers_per_stage,
        stage_cost,
    })
}

/// Range-minimum queries (sparse table): the index of the smallest value in `lo..=hi`, the
/// latest one on ties, in O(1) after O(n log n) set-up.
struct ArgMin<'a> {
    values: &'a [f64],
    /// levels[j][i]: index of the minimum of values[i .. i + 2^j].
    levels: Vec<Vec<usize>>,
}

impl<'a> ArgMin<'a> {
    fn new(values: &'a [f64]) -> Self {
        let n = values.len();
        let mut levels = vec![(0..n).collect::<Vec<usize>>()];
        let mut span = 1;
        while 2 * span <= n {
            let prev = levels.last().expect("level 0");
            let next = (0..=n - 2 * span)
                .map(|i| Self::pick(values, prev[i], prev[i + span]))
                .collect();
            levels.push(next);
            span *= 2;
        }
        ArgMin { values, levels }
    }

    fn pick(values: &[f64], a: usize, b: usize) -> usize {
        match values[a].total_cmp(&values[b]) {
            std::cmp::Ordering::Less => a,
            std::cmp::Ordering::Greater => b,
            std::cmp::Ordering::Equal => a.max(b),
        }
    }

    fn min_at(&self, lo: usize, hi: usize) -> usize {
        let len = hi - lo + 1;
        let j = (usize::BITS - 1 - len.leading_zeros()) as usize;
        let l = &self.levels[j];
        Self::pick(self.values, l[lo], l[hi + 1 - (1 << j)])
    }
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
        (1..=n - (k - 1))
            .flat_map(|first| {
                compositions(n - first, k - 1)
                    .into_iter()
                    .map(move |mut r| {
                        r.insert(0, first);
                        r
                    })
            })
            .collect()
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
                    c.iter()
                        .map(|&n| {
                            lo += n;
                            pre[lo] - pre[lo - n]
                        })
                        .fold(0.0, f64::max)
                })
                .fold(f64::INFINITY, f64::min);
            assert_eq!(s.bottleneck, brute, "k={k}");
            assert_eq!(s.layers_per_stage.iter().sum::<usize>(), w.len());
        }
    }

    /// The plain O(k n^2) recurrence, as the reference.
    #[allow(clippy::needless_range_loop)]
    fn plain(n: usize, k: usize, cost: impl Fn(usize, usize, usize) -> f64) -> f64 {
        let mut best: Vec<f64> = (0..=n)
            .map(|i| if i == 0 { 0.0 } else { f64::INFINITY })
            .collect();
        for st in 1..=k {
            let mut next = vec![f64::INFINITY; n + 1];
            for hi in st..=n - (k - st) {
                for lo in (st - 1)..hi {
                    next[hi] = next[hi].min(best[lo].max(cost(st - 1, lo, hi)));
                }
            }
            best = next;
        }
        best[n]
    }

    #[test]
    fn fast_recurrence_equals_the_plain_one_on_random_costs() {
        // Layer work, a cost of each cut (the activation sent), per-stage speeds and a memory
        // cap that makes long stages infeasible: the shapes the callers use.
        let mut seed = 7u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as f64 / (1u64 << 31) as f64
        };
        for case in 0..300 {
            let n = 1 + (rnd() * 40.0) as usize;
            let k = 1 + (rnd() * n.min(8) as f64) as usize;
            let work = prefix((0..n).map(|_| (rnd() * 10.0).floor()));
            let send: Vec<f64> = (0..=n).map(|_| (rnd() * 6.0).floor()).collect();
            let speed: Vec<f64> = (0..k).map(|_| 1.0 + (rnd() * 3.0).floor()).collect();
            let cap = if case % 3 == 0 {
                2 + (rnd() * n as f64) as usize
            } else {
                n
            };
            let cost = |st: usize, lo: usize, hi: usize| {
                if hi - lo > cap {
                    return f64::INFINITY;
                }
                (work[hi] - work[lo]) / speed[st] + if st + 1 < k { send[hi] } else { 0.0 }
            };
            let want = plain(n, k, cost);
            match min_max_split(n, k, cost) {
                Ok(s) => {
                    assert_eq!(s.bottleneck, want, "case {case}: n={n} k={k}");
                    assert_eq!(s.layers_per_stage.iter().sum::<usize>(), n);
                    assert!(s.layers_per_stage.iter().all(|&l| l > 0));
                }
                Err(_) => assert!(want.is_infinite(), "case {case}: n={n} k={k} want {want}"),
            }
        }
    }

    #[test]
    fn too_many_stages() {
        assert!(min_max_split(3, 4, |_, _, _| 1.0)
            .unwrap_err()
            .to_string()
            .contains("cannot cut 3 layers into 4"));
    }

    /// Device classes found by region first equal those of comparing every device's links
    /// with every other's: with regions, a device's own link, a copy of a device (a subset
    /// holding one twice) and two regions whose links are alike (merged into one class).
    #[test]
    fn device_classes_by_region_equal_the_pairwise_ones() {
        let text = r#"
[defaults]
latency = 0.001
[[devices]]
name = "a0"
region = "a"
[[devices]]
name = "a1"
region = "a"
[[devices]]
name = "b0"
region = "b"
[[devices]]
name = "b1"
region = "b"
[[devices]]
name = "c0"
region = "c"
[[devices]]
name = "c1"
region = "c"
[[devices]]
name = "d0"
region = "d"
speed = 2.0
[[links]]
a = "a"
b = "b"
latency = 0.05
[[links]]
a = "c1"
b = "d0"
latency = 0.2
"#;
        let cl = crate::cluster::Cluster::parse("t", text).unwrap();
        let pairwise = |cl: &crate::cluster::Cluster| {
            let n = cl.len();
            let same = |a: usize, b: usize| {
                let (x, y) = (&cl.devices[a], &cl.devices[b]);
                x.speed == y.speed
                    && x.memory == y.memory
                    && (0..n).all(|k| {
                        k == a
                            || k == b
                            || (cl.link(a, k) == cl.link(b, k) && cl.link(k, a) == cl.link(k, b))
                    })
            };
            let mut classes: Vec<Vec<usize>> = Vec::new();
            for d in 0..n {
                match classes.iter_mut().find(|c| same(c[0], d)) {
                    Some(c) => c.push(d),
                    None => classes.push(vec![d]),
                }
            }
            classes
        };
        assert_eq!(device_classes(&cl), pairwise(&cl));
        // a and b differ (their link), c0 is alike to neither; c1 has a link of its own.
        assert_eq!(
            device_classes(&cl),
            vec![vec![0, 1], vec![2, 3], vec![4], vec![5], vec![6]]
        );
        let sub = cl.subset(&[0, 0, 2, 4, 5, 1]);
        assert_eq!(device_classes(&sub), pairwise(&sub));
    }
}

/// Cut a profile's layers into a plan's stages, each stage timed on its worker's device, with
/// the cut's activation sent to the next stage's device (model order). Returns per-stage costs.
pub fn split_for_plan(
    profile: &crate::profile::Profile,
    plan: &crate::plan::ir::Plan,
    cluster: &crate::cluster::Cluster,
) -> Result<(Split, Vec<crate::profile::StageCost>)> {
    let layers = &profile.layers;
    let work = prefix(layers.iter().map(|l| l.forward + l.backward()));
    let s = plan.num_stages();
    // A stage's first host stands for its replica group (replicas run the same split).
    let dev = |st: usize| plan.stages[st].hosts[0];
    let split = min_max_split(layers.len(), s, |st, lo, hi| {
        let compute = (work[hi] - work[lo]) / cluster.devices[dev(st)].speed;
        let send = if st + 1 < s {
            cluster.transfer_time(dev(st), dev(st + 1), layers[hi - 1].activation)
        } else {
            0.0
        };
        compute + send
    })
    .map_err(|e| Error::Infeasible(format!("profile \"{}\": {e}", profile.model.name)))?;
    let costs = profile.stage_costs(&split.layers_per_stage);
    Ok((split, costs))
}

/// Cut the profile's layers into the plan's stages ([`split_for_plan`]) and write the result
/// into the plan: layers per stage and each stage's costs, so the plan stands alone.
pub fn assign_layers(
    profile: &crate::profile::Profile,
    plan: &mut crate::plan::ir::Plan,
    cluster: &crate::cluster::Cluster,
) -> Result<Split> {
    let (split, costs) = split_for_plan(profile, plan, cluster)?;
    plan.set_layers(&split.layers_per_stage);
    for (st, c) in plan.stages.iter_mut().zip(costs) {
        st.cost = Some(c);
    }
    Ok(split)
}

/// What a partition minimises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// Stage forward + backward time on its device, plus sending the cut's activation onwards.
    Time,
    /// Bytes of parameters per stage (PipeTransformer's balance proxy); devices do not matter.
    Params,
}

/// A partition with a device for every stage.
#[derive(Debug, Clone, PartialEq)]
pub struct Assignment {
    pub split: Split,
    /// Cluster device index per stage.
    pub devices: Vec<usize>,
    /// False when the search space was too large and a heuristic order was used.
    pub exact: bool,
}

/// Inputs of [`partition`].
pub struct PartitionProblem<'a> {
    pub profile: &'a crate::profile::Profile,
    pub cluster: &'a crate::cluster::Cluster,
    pub stages: usize,
    pub objective: Objective,
    /// Activations in flight per stage (from the schedule): stage `k` keeps `in_flight[k]`
    /// micro-batches' activations. Empty = no memory check.
    pub in_flight: Vec<usize>,
}

/// Devices that are interchangeable: same speed, memory and region (so the same links).
fn device_classes(cluster: &crate::cluster::Cluster) -> Vec<Vec<usize>> {
    let n = cluster.len();
    let same = |a: usize, b: usize| {
        let (x, y) = (&cluster.devices[a], &cluster.devices[b]);
        x.speed == y.speed
            && x.memory == y.memory
            && x.memory_microbatches == y.memory_microbatches
            && (0..n).all(|k| {
                k == a
                    || k == b
                    || (cluster.link(a, k) == cluster.link(b, k)
                        && cluster.link(k, a) == cluster.link(k, b))
            })
    };
    // Devices of one region whose links are the region's, of equal speed and memory, are
    // alike without comparing their links one by one (linear in the devices); the groups are
    // then merged by comparing one member of each (the full check, per pair of groups).
    let region = cluster.region_linked();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut index: std::collections::HashMap<_, usize> = std::collections::HashMap::new();
    for (d, (x, r)) in cluster.devices.iter().zip(&region).enumerate() {
        let key = (
            x.speed.to_bits(),
            x.memory,
            x.memory_microbatches,
            r.ok_or(d),
        );
        match index.get(&key) {
            Some(&g) => groups[g].push(d),
            None => {
                index.insert(key, groups.len());
                groups.push(vec![d]);
            }
        }
    }
    let mut classes: Vec<Vec<usize>> = Vec::new();
    for g in groups {
        match classes.iter_mut().find(|c| same(c[0], g[0])) {
            Some(c) => c.extend(g),
            None => classes.push(g),
        }
    }
    for c in &mut classes {
        c.sort_unstable();
    }
    classes
}

/// Nearest-neighbour device chains of `k` devices, one from each class's first device (a chain
/// from another member of the class is the same chain up to interchangeable devices): each next
/// device the one reached fastest from the last (ties: the faster, then the lower index). Only
/// each class's next unused device is a candidate, which is what a scan of every device would
/// pick, so the chains cost O(classes^2 k), not O(devices^2 k).
fn neighbour_chains(
    cl: &crate::cluster::Cluster,
    classes: &[Vec<usize>],
    k: usize,
    layers: &[crate::profile::Layer],
) -> Vec<Vec<usize>> {
    let bytes = layers.iter().map(|l| l.activation).max().unwrap_or(0);
    let mut starts: Vec<(usize, usize)> =
        classes.iter().enumerate().map(|(j, c)| (c[0], j)).collect();
    starts.sort_unstable();
    starts
        .into_iter()
        .map(|(start, j0)| {
            let mut used = vec![0usize; classes.len()];
            used[j0] = 1;
            let mut chain = vec![start];
            while chain.len() < k {
                let last = *chain.last().unwrap();
                let cost = |d: usize| cl.transfer_time(last, d, bytes) - 1e-9 * cl.devices[d].speed;
                let (j, d) = (0..classes.len())
                    .filter_map(|j| classes[j].get(used[j]).map(|&d| (j, d)))
                    .min_by(|&(_, a), &(_, b)| cost(a).total_cmp(&cost(b)).then(a.cmp(&b)))
                    .expect("k <= devices");
                used[j] += 1;
                chain.push(d);
            }
            chain
        })
        .collect()
}

/// The costs the partition search weighs: the compute time of layers `lo..hi` as stage `st`
/// on device `d` (infinite if they do not fit its memory), and the activation sent at a cut.
struct StageCosts<'a> {
    pr: &'a PartitionProblem<'a>,
    work: Vec<f64>,
    params: Vec<f64>,
    acts: Vec<f64>,
}

impl<'a> StageCosts<'a> {
    fn new(pr: &'a PartitionProblem<'a>) -> Self {
        let layers = &pr.profile.layers;
        StageCosts {
            pr,
            work: prefix(layers.iter().map(|l| l.forward + l.backward())),
            params: prefix(layers.iter().map(|l| l.params as f64)),
            acts: prefix(layers.iter().map(|l| l.activation as f64)),
        }
    }

    /// Compute time of `lo..hi` as stage `st` on device `d`, or infinity if it does not fit
    /// (weights, gradients and AdamW state, plus the stage's in-flight activations).
    fn compute(&self, st: usize, d: usize, lo: usize, hi: usize) -> f64 {
        let dev = &self.pr.cluster.devices[d];
        let in_flight = self.pr.in_flight.get(st).copied();
        if let Some(cap) = dev.memory {
            let acts = in_flight.unwrap_or(0) as f64 * (self.acts[hi] - self.acts[lo]);
            if 4.0 * (self.params[hi] - self.params[lo]) + acts > cap as f64 {
                return f64::INFINITY;
            }
        }
        if let (Some(cap), Some(n)) = (dev.memory_microbatches, in_flight) {
            if n > cap as usize {
                return f64::INFINITY;
            }
        }
        (self.work[hi] - self.work[lo]) / dev.speed
    }

    /// Sending the activation at cut `cut` from device `a` to device `b`.
    fn send(&self, a: usize, b: usize, cut: usize) -> f64 {
        let bytes = self.pr.profile.layers[cut - 1].activation;
        self.pr.cluster.transfer_time(a, b, bytes)
    }

    /// Stage `st` (`lo..hi`) on `devices[st]`, with its send to the next stage's device.
    fn stage(&self, devices: &[usize], st: usize, lo: usize, hi: usize) -> f64 {
        let next = devices.get(st + 1);
        self.compute(st, devices[st], lo, hi) + next.map_or(0.0, |&b| self.send(devices[st], b, hi))
    }
}

/// States the exact search may visit before it gives up and uses a heuristic device order.
const EXACT_STATE_LIMIT: f64 = 4e6;

/// Contiguous partition into `stages` stages with a device per stage, minimising the bottleneck
/// under each device's memory (weights, gradients, AdamW state and in-flight activations).
///
/// Exact: a dynamic program over (start and end of the last stage, how many devices of each
/// interchangeable class are used, class of the last stage's device). With one class it reduces
/// to the `O(K n^2)` [`min_max_split`].
pub fn partition(pr: &PartitionProblem) -> Result<Assignment> {
    let n = pr.profile.layers.len();
    let k = pr.stages;
    let cl = pr.cluster;
    if k == 0 {
        return Err(Error::Infeasible("cannot cut a model into 0 stages".into()));
    }
    if k > n {
        return Err(Error::Infeasible(format!(
            "cannot cut {n} layers into {k} non-empty stages"
        )));
    }
    if pr.objective == Objective::Params {
        let pre = prefix(pr.profile.layers.iter().map(|l| l.params as f64));
        let split = min_max_split(n, k, |_, lo, hi| pre[hi] - pre[lo])?;
        return Ok(Assignment {
            split,
            devices: (0..k).map(|s| s % cl.len().max(1)).collect(),
            exact: true,
        });
    }
    if k > cl.len() {
        return Err(Error::Infeasible(format!(
            "{k} stages need {k} devices; the cluster has {}",
            cl.len()
        )));
    }
    let costs = StageCosts::new(pr);
    let classes = device_classes(cl);
    let caps: Vec<usize> = classes.iter().map(|x| x.len().min(k)).collect();
    let states: f64 = (n * n) as f64 / 2.0
        * caps.iter().map(|&x| (x + 1) as f64).product::<f64>()
        * classes.len() as f64;
    if classes.len() == 1 || states > EXACT_STATE_LIMIT {
        fixed_orders(&costs, &classes)
    } else {
        class_program(&costs, &classes, &caps)
    }
}

/// The partition on fixed device orders: the fastest devices in file order (file order groups
/// regions) and, with several classes (a search too large to be exact), a nearest-neighbour
/// chain from every device (each next device the one reached fastest); the best of them wins.
fn fixed_orders(costs: &StageCosts, classes: &[Vec<usize>]) -> Result<Assignment> {
    let pr = costs.pr;
    let (cl, k, n) = (pr.cluster, pr.stages, pr.profile.layers.len());
    let eval = |ids: &[usize]| {
        min_max_split(n, k, |st, lo, hi| costs.stage(ids, st, lo, hi))
            .ok()
            .filter(|s| s.bottleneck.is_finite())
    };
    let mut fastest: Vec<usize> = (0..cl.len()).collect();
    fastest.sort_by(|&a, &b| {
        cl.devices[b]
            .speed
            .total_cmp(&cl.devices[a].speed)
            .then(a.cmp(&b))
    });
    fastest.truncate(k);
    fastest.sort_unstable();
    let mut orders = vec![fastest];
    if classes.len() > 1 {
        orders.extend(neighbour_chains(cl, classes, k, &pr.profile.layers));
    }
    let best = orders
        .into_iter()
        .filter_map(|ids| eval(&ids).map(|s| (s, ids)))
        .min_by(|a, b| a.0.bottleneck.total_cmp(&b.0.bottleneck));
    let Some((split, ids)) = best else {
        let ids: Vec<usize> = (0..k).collect();
        return Err(infeasible(pr, &ids));
    };
    Ok(Assignment {
        split,
        devices: ids,
        exact: classes.len() == 1,
    })
}

/// The exact dynamic program over (start and end of the last stage, devices used per class in
/// a mixed-radix code, class of the last stage's device); each stage gets the next unused
/// device of its class.
fn class_program(costs: &StageCosts, classes: &[Vec<usize>], caps: &[usize]) -> Result<Assignment> {
    use std::collections::HashMap;
    type Key = (usize, usize, usize, usize); // (lo, hi, used code, class)
    let pr = costs.pr;
    let (k, n, c) = (pr.stages, pr.profile.layers.len(), classes.len());
    let mut radix = vec![1usize; c];
    for i in 1..c {
        radix[i] = radix[i - 1] * (caps[i - 1] + 1);
    }
    let count = |code: usize, j: usize| (code / radix[j]) % (caps[j] + 1);
    let device = |&(_, _, code, cj): &Key| classes[cj][count(code, cj) - 1];
    let mut layer: HashMap<Key, (f64, Option<Key>)> = HashMap::new();
    for (j, &r) in radix.iter().enumerate() {
        for hi in 1..=n - (k - 1) {
            layer.insert((0, hi, r, j), (0.0, None));
        }
    }
    let mut history: Vec<HashMap<Key, (f64, Option<Key>)>> = Vec::new();
    for st in 1..k {
        let mut next: HashMap<Key, (f64, Option<Key>)> = HashMap::new();
        for (&key, &(v, _)) in &layer {
            let (lo, hi, code, _) = key;
            let d_prev = device(&key);
            let comp = costs.compute(st - 1, d_prev, lo, hi);
            if !comp.is_finite() {
                continue;
            }
            for j in (0..c).filter(|&j| count(code, j) < caps[j]) {
                let d = classes[j][count(code, j)];
                let cost = v.max(comp + costs.send(d_prev, d, hi));
                for end in hi + 1..=n - (k - 1 - st) {
                    let e = next
                        .entry((hi, end, code + radix[j], j))
                        .or_insert((f64::INFINITY, None));
                    if cost < e.0 {
                        *e = (cost, Some(key));
                    }
                }
            }
        }
        history.push(std::mem::replace(&mut layer, next));
    }
    let mut best: Option<(f64, Key)> = None;
    for (&key, &(v, _)) in layer.iter().filter(|(key, _)| key.1 == n) {
        let total = v.max(costs.compute(k - 1, device(&key), key.0, key.1));
        if total.is_finite() && best.is_none_or(|(b, bk)| total < b || (total == b && key < bk)) {
            best = Some((total, key));
        }
    }
    let Some((_, mut key)) = best else {
        let ids: Vec<usize> = (0..k.min(pr.cluster.len())).collect();
        return Err(infeasible(pr, &ids));
    };
    history.push(layer);
    let mut keys = vec![key];
    for st in (1..k).rev() {
        key = history[st][&key].1.expect("back pointer");
        keys.push(key);
    }
    keys.reverse();
    let devices: Vec<usize> = keys.iter().map(device).collect();
    let bounds: Vec<usize> = keys.iter().map(|&(lo, _, _, _)| lo).chain([n]).collect();
    let stage_cost: Vec<f64> = (0..k)
        .map(|st| costs.stage(&devices, st, bounds[st], bounds[st + 1]))
        .collect();
    let split = Split {
        layers_per_stage: bounds.windows(2).map(|w| w[1] - w[0]).collect(),
        bottleneck: stage_cost.iter().copied().fold(0.0, f64::max),
        stage_cost,
    };
    Ok(Assignment {
        split,
        devices,
        exact: true,
    })
}

/// Name the device and bytes when nothing fits: the largest layer's needs on the roomiest device.
fn infeasible(pr: &PartitionProblem, _ids: &[usize]) -> Error {
    let cl = pr.cluster;
    let (li, layer) = pr
        .profile
        .layers
        .iter()
        .enumerate()
        .max_by_key(|(_, l)| 4 * l.params + l.activation)
        .expect("layers");
    let inflight = pr.in_flight.iter().copied().min().unwrap_or(1).max(1) as u64;
    let need = 4 * layer.params + inflight * layer.activation;
    let roomiest = cl
        .devices
        .iter()
        .rev()
        .max_by_key(|d| d.memory.unwrap_or(u64::MAX));
    match roomiest {
        Some(d) if d.memory.is_some_and(|m| m < need) => Error::Infeasible(format!(
            "layer {li} (\"{}\") needs {need} bytes ({} weights+grads+AdamW, {} activations for {inflight} micro-batches in flight) but the largest device, \"{}\", has {}",
            layer.name,
            4 * layer.params,
            inflight * layer.activation,
            d.name,
            d.memory.unwrap()
        )),
        _ => Error::Infeasible(format!(
            "no partition of {} layers into {} stages fits the devices' memory (the tightest is \"{}\" with {} bytes); use more stages or fewer micro-batches in flight",
            pr.profile.layers.len(),
            pr.stages,
            cl.devices.iter().min_by_key(|d| d.memory.unwrap_or(u64::MAX)).map_or("?", |d| d.name.as_str()),
            cl.devices.iter().filter_map(|d| d.memory).min().unwrap_or(0)
        )),
    }
}

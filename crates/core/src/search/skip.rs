//! SkipPipe's rules on a whole-job plan (Blagoev et al., "SkipPipe: Partial and Reordered
//! Pipelining Framework for Training LLMs in Heterogeneous Networks", 2025), each named in its
//! error like the validator's: the plan's first stage (embedding) and last stage (head and loss)
//! sit on the micro-batch's own data node, where its route starts and ends; the stages between
//! are the ones a route may skip or reorder.
//!
//! - `skip-ends`: a route starts at stage 0 and ends at the head stage, on the same worker.
//! - `skip-count`: each route visits all middle stages but exactly `skip` of them.
//! - `skip-swaps`: the middle stages are visited in model order except for swaps of two stages
//!   that follow each other in the model (indices differing by exactly 1), each visited right
//!   after the other in descending order, at most `max_swaps` per route. That is SkipPipe's own
//!   rule (its A* lets two stages trade places only when their indices differ by 1), which its
//!   convergence results rest on.
//! - `skip-balance`: over an iteration, visits per middle stage differ by at most 1.
//! - `skip-in-flight`: no worker holds activations of more than `max_in_flight` micro-batches.
//! - `skip-node-load`: no worker of a middle stage serves more than `max_node_load`
//!   micro-batches per iteration (SkipPipe's TC1: at most `memory` agents per node, each
//!   carrying the same number of micro-batches).

use crate::error::{Error, Result};
use crate::plan::ir::Plan;
use crate::sim::memory_peaks;

/// The rules' parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SkipRules {
    /// Middle stages each micro-batch skips.
    pub skip: usize,
    /// Swaps of neighbouring stages allowed per route.
    pub max_swaps: usize,
    /// Micro-batches in flight per worker at most.
    pub max_in_flight: Option<usize>,
    /// Micro-batches a middle stage's worker serves per iteration at most.
    pub max_node_load: Option<usize>,
}

fn broken(rule: &str, msg: String) -> Error {
    Error::Invalid(format!("{msg} (rule {rule})"))
}

/// How many swaps of two adjacent stages (indices differing by 1) turn the sorted order into
/// `v`, or `None` if `v` is not made of such swaps.
pub fn neighbour_swaps(v: &[usize]) -> Option<usize> {
    let mut sorted = v.to_vec();
    sorted.sort_unstable();
    let (mut i, mut n) = (0, 0);
    while i < v.len() {
        if v[i] == sorted[i] {
            i += 1;
        } else if i + 1 < v.len()
            && v[i] == sorted[i + 1]
            && v[i + 1] == sorted[i]
            && v[i] == v[i + 1] + 1
        {
            n += 1;
            i += 2;
        } else {
            return None;
        }
    }
    Some(n)
}

/// Check `plan` (already valid for [`crate::plan::validate::validate`]) against SkipPipe's rules.
pub fn check_skip_rules(plan: &Plan, rules: &SkipRules) -> Result<()> {
    let s = plan.num_stages();
    if s < 2 {
        return Err(broken(
            "skip-ends",
            format!("a SkipPipe plan needs an embedding stage and a head stage; this one has {s} stage(s)"),
        ));
    }
    let head = s - 1;
    let middle = s - 2;
    if rules.skip > middle {
        return Err(broken(
            "skip-count",
            format!("cannot skip {} of the {middle} middle stages", rules.skip),
        ));
    }
    let want = middle - rules.skip;
    let mut visits = vec![0usize; s];
    for (mb, r) in plan.routes.iter().enumerate() {
        let (Some(first), Some(last)) = (r.first(), r.last()) else {
            return Err(broken("skip-ends", format!("route of mb {mb} is empty")));
        };
        if first.stage != 0 || last.stage != head || first.worker != last.worker {
            return Err(broken(
                "skip-ends",
                format!(
                    "route of mb {mb} runs from stage {} on worker {} to stage {} on worker {}; it must start at stage 0 and end at the head, stage {head}, on the same worker (its data node)",
                    first.stage, first.worker, last.stage, last.worker
                ),
            ));
        }
        let mid: Vec<usize> = r[1..r.len() - 1].iter().map(|h| h.stage).collect();
        if mid.len() != want {
            return Err(broken(
                "skip-count",
                format!(
                    "route of mb {mb} visits {} of the {middle} middle stages; skipping {} leaves {want}",
                    mid.len(),
                    rules.skip
                ),
            ));
        }
        let Some(swaps) = neighbour_swaps(&mid) else {
            return Err(broken(
                "skip-swaps",
                format!("route of mb {mb} visits stages {mid:?}: only swaps of two neighbours may reorder them"),
            ));
        };
        if swaps > rules.max_swaps {
            return Err(broken(
                "skip-swaps",
                format!(
                    "route of mb {mb} visits stages {mid:?}: {swaps} swaps, at most {} allowed",
                    rules.max_swaps
                ),
            ));
        }
        for st in mid {
            visits[st] += 1;
        }
    }
    if middle > 0 {
        let counts = &visits[1..head];
        let (lo, hi) = (
            counts.iter().copied().min().unwrap_or(0),
            counts.iter().copied().max().unwrap_or(0),
        );
        if hi - lo > 1 {
            let least = 1 + counts.iter().position(|&c| c == lo).unwrap_or(0);
            let most = 1 + counts.iter().position(|&c| c == hi).unwrap_or(0);
            return Err(broken(
                "skip-balance",
                format!("stage {most} gets {hi} micro-batch visits but stage {least} only {lo}; they may differ by 1"),
            ));
        }
    }
    if let Some(cap) = rules.max_node_load {
        let mut load = vec![0usize; plan.num_workers()];
        for r in &plan.routes {
            for h in &r[1..r.len() - 1] {
                load[h.worker] += 1;
            }
        }
        if let Some((w, &n)) = load.iter().enumerate().find(|(_, &n)| n > cap) {
            return Err(broken(
                "skip-node-load",
                format!("worker {w} serves {n} micro-batches of the middle stages per iteration; the cap is {cap}"),
            ));
        }
    }
    if let Some(cap) = rules.max_in_flight {
        let no_costs = vec![crate::profile::StageCost::default(); s];
        for (w, p) in memory_peaks(plan, &no_costs).iter().enumerate() {
            if p.microbatches > cap {
                return Err(broken(
                    "skip-in-flight",
                    format!(
                        "worker {w} holds activations of {} micro-batches at once; the cap is {cap}",
                        p.microbatches
                    ),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::ir::{Hop, StagePlan};
    use crate::plan::validate::validate;
    use crate::schedule::gpipe_routes;

    /// 5 stages: embedding (stage 0) and head (stage 4) on data nodes 0 and 1, middle stages
    /// 1-3 on workers 2, 3, 4. `routes[mb]` lists the middle stages visited; micro-batch mb
    /// belongs to data node mb % 2.
    fn skip_plan(routes: &[&[usize]]) -> Plan {
        let stages = (0..5)
            .map(|s| StagePlan {
                layers: 1,
                hosts: match s {
                    0 | 4 => vec![0, 1],
                    s => vec![s + 1],
                },
                cost: None,
            })
            .collect();
        let routes = routes
            .iter()
            .enumerate()
            .map(|(mb, mid)| {
                let home = mb % 2;
                std::iter::once(Hop {
                    stage: 0,
                    worker: home,
                })
                .chain(mid.iter().map(|&s| Hop {
                    stage: s,
                    worker: s + 1,
                }))
                .chain(std::iter::once(Hop {
                    stage: 4,
                    worker: home,
                }))
                .collect()
            })
            .collect();
        gpipe_routes(stages, routes, 5)
    }

    const RULES: SkipRules = SkipRules {
        skip: 1,
        max_swaps: 1,
        max_in_flight: None,
        max_node_load: None,
    };

    #[test]
    fn skipped_and_swapped_routes_follow_the_rules() {
        let p = skip_plan(&[&[1, 2], &[2, 3], &[1, 3], &[3, 2], &[2, 1], &[1, 3]]);
        validate(&p).unwrap();
        check_skip_rules(&p, &RULES).unwrap();
    }

    /// SkipPipe's swap: two stages adjacent in the model, visited one right after the other in
    /// descending order. Stages 3 then 1 (2 skipped between them) are no swap, as [4, 1, 5] is
    /// none on a longer route.
    #[test]
    fn a_swap_is_between_adjacent_stages_only() {
        assert_eq!(neighbour_swaps(&[2, 1, 3]), Some(1));
        assert_eq!(neighbour_swaps(&[1, 3, 2]), Some(1));
        assert_eq!(
            neighbour_swaps(&[3, 1]),
            None,
            "indices 3 and 1 are not adjacent"
        );
        assert_eq!(neighbour_swaps(&[4, 1, 5]), None);
        assert_eq!(neighbour_swaps(&[1, 2, 3]), Some(0));
        let p = skip_plan(&[&[1, 2], &[3, 1]]);
        validate(&p).unwrap();
        let e = check_skip_rules(&p, &RULES).unwrap_err().to_string();
        assert!(
            e.contains("[3, 1]") && e.ends_with("(rule skip-swaps)"),
            "{e}"
        );
    }

    #[test]
    fn each_rule_is_named() {
        let e = |p: &Plan, r: &SkipRules| check_skip_rules(p, r).unwrap_err().to_string();
        // Ends elsewhere than its data node.
        let mut p = skip_plan(&[&[1, 2], &[2, 3]]);
        p.routes[0].last_mut().unwrap().worker = 1;
        assert!(
            e(&p, &RULES).ends_with("(rule skip-ends)"),
            "{}",
            e(&p, &RULES)
        );
        // Skips two instead of one.
        let p = skip_plan(&[&[1, 2], &[3]]);
        validate(&p).unwrap();
        assert_eq!(
            e(&p, &RULES),
            "route of mb 1 visits 1 of the 3 middle stages; skipping 1 leaves 2 (rule skip-count)"
        );
        // Two swaps where one is allowed; a reorder that is no swap.
        let p = skip_plan(&[&[2, 1, 3], &[1, 2, 3]]);
        let none = SkipRules {
            skip: 0,
            max_swaps: 0,
            max_in_flight: None,
            max_node_load: None,
        };
        assert_eq!(
            e(&p, &none),
            "route of mb 0 visits stages [2, 1, 3]: 1 swaps, at most 0 allowed (rule skip-swaps)"
        );
        let p = skip_plan(&[&[3, 1, 2], &[1, 2, 3]]);
        assert!(e(
            &p,
            &SkipRules {
                max_swaps: 5,
                ..none
            }
        )
        .ends_with("(rule skip-swaps)"));
        // Unbalanced visits: stage 1 three times, stage 3 once.
        let p = skip_plan(&[&[1, 2], &[1, 2], &[1, 3]]);
        assert_eq!(
            e(&p, &RULES),
            "stage 1 gets 3 micro-batch visits but stage 3 only 1; they may differ by 1 (rule skip-balance)"
        );
        // GPipe order holds every micro-batch of a data node in flight at once.
        let p = skip_plan(&[&[1, 2], &[2, 3], &[1, 3], &[1, 2], &[2, 3], &[1, 3]]);
        let capped = SkipRules {
            max_in_flight: Some(2),
            max_node_load: None,
            ..RULES
        };
        assert_eq!(
            e(&p, &capped),
            "worker 0 holds activations of 3 micro-batches at once; the cap is 2 (rule skip-in-flight)"
        );
        // Per-node load: each middle stage's only worker serves 4 of the 6 micro-batches.
        let load = |cap| SkipRules {
            max_node_load: Some(cap),
            ..RULES
        };
        check_skip_rules(&p, &load(4)).unwrap();
        assert_eq!(
            e(&p, &load(3)),
            "worker 2 serves 4 micro-batches of the middle stages per iteration; the cap is 3 (rule skip-node-load)"
        );
    }
}

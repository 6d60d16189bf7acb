//! The validator: a plan either runs to completion on any costs, or gets an error naming the
//! worker, the position in its list and the action.

use crate::error::{Error, Result};
use crate::ir::{Action, Op, Plan, RouteIndex};

/// Where an action sits: worker and step in its list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Site {
    pub worker: usize,
    pub step: usize,
}

/// Dependency slot of an action's result: F done, input-gradient done (B or BW), W-or-BW done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    F,
    Grad,
}

/// What `a` waits for (besides its worker reaching it): a list of (slot, stage).
pub(crate) fn deps(plan: &Plan, routes: &RouteIndex, a: &Action) -> [Option<(Slot, usize)>; 2] {
    match a.op {
        Op::F => [
            routes.prev(plan, a.mb, a.stage).map(|p| (Slot::F, p.stage)),
            None,
        ],
        Op::B | Op::BW => [
            Some((Slot::F, a.stage)),
            routes
                .next(plan, a.mb, a.stage)
                .map(|n| (Slot::Grad, n.stage)),
        ],
        Op::W => [Some((Slot::Grad, a.stage)), None],
    }
}

/// The rules a plan must keep, each named in its error message.
pub mod rules {
    /// Stages hold at least one layer and have at least one host, all within the plan.
    pub const STAGES: &str = "stages";
    /// A route starts at stage 0, which holds the embedding (layer 0).
    pub const ROUTE_START: &str = "route-start";
    /// A route ends at the last stage, which holds the head and the loss.
    pub const ROUTE_END: &str = "route-end";
    /// A route visits a stage at most once.
    pub const ROUTE_ONCE: &str = "route-once";
    /// Each hop's worker hosts that hop's stage.
    pub const HOP_HOST: &str = "hop-host";
    /// Actions exist for exactly the hops on the routes, on the hop's worker.
    pub const ACTIONS: &str = "actions";
    /// The per-worker orders run to completion.
    pub const DEADLOCK: &str = "deadlock";
}

/// Check structure, route rules, completeness, order and deadlock freedom.
pub fn validate(plan: &Plan) -> Result<()> {
    check_structure(plan)?;
    let sites = check_complete(plan)?;
    check_runs(plan, &sites)
}

fn bad(msg: String) -> Error {
    Error::Invalid(msg)
}

fn broke(rule: &str, msg: String) -> Error {
    Error::Invalid(format!("{msg} (rule {rule})"))
}

fn check_structure(plan: &Plan) -> Result<()> {
    use rules::*;
    let (s, m, p) = (plan.num_stages(), plan.num_microbatches, plan.num_workers());
    if s == 0 || p == 0 || m == 0 {
        return Err(bad(format!(
            "plan needs stages, workers and micro-batches (got {s}, {p}, {m})"
        )));
    }
    if !plan.devices.is_empty() && plan.devices.len() != p {
        return Err(bad(format!(
            "`devices` names {} devices for {p} workers",
            plan.devices.len()
        )));
    }
    for (st, spec) in plan.stages.iter().enumerate() {
        if spec.layers == 0 {
            return Err(broke(STAGES, format!("stage {st} holds no layers")));
        }
        if spec.hosts.is_empty() {
            return Err(broke(STAGES, format!("stage {st} has no host worker")));
        }
        if let Some(&w) = spec.hosts.iter().find(|&&w| w >= p) {
            return Err(broke(
                STAGES,
                format!("stage {st} is hosted by worker {w}, but the plan has {p} workers"),
            ));
        }
    }
    if plan.routes.len() != m {
        return Err(bad(format!(
            "{} routes for {m} micro-batches",
            plan.routes.len()
        )));
    }
    for (mb, r) in plan.routes.iter().enumerate() {
        let (Some(first), Some(last)) = (r.first(), r.last()) else {
            return Err(bad(format!("route of mb {mb} is empty")));
        };
        let mut seen = vec![false; s];
        for h in r {
            if h.stage >= s {
                return Err(bad(format!(
                    "route of mb {mb} visits stage {}, but the plan has {s} stages",
                    h.stage
                )));
            }
            if std::mem::replace(&mut seen[h.stage], true) {
                return Err(broke(
                    ROUTE_ONCE,
                    format!("route of mb {mb} visits stage {} twice", h.stage),
                ));
            }
            if !plan.stages[h.stage].hosts.contains(&h.worker) {
                return Err(broke(
                    HOP_HOST,
                    format!(
                        "route of mb {mb} runs stage {} on worker {}, which does not host it (hosts {:?})",
                        h.stage, h.worker, plan.stages[h.stage].hosts
                    ),
                ));
            }
        }
        if first.stage != 0 {
            return Err(broke(
                ROUTE_START,
                format!(
                    "route of mb {mb} starts at stage {}, but stage 0 holds the embedding",
                    first.stage
                ),
            ));
        }
        if last.stage != s - 1 {
            return Err(broke(
                ROUTE_END,
                format!(
                    "route of mb {mb} ends at stage {}, but stage {} holds the head and loss",
                    last.stage,
                    s - 1
                ),
            ));
        }
    }
    let routes = RouteIndex::new(plan);
    for (w, acts) in plan.workers.iter().enumerate() {
        for (i, a) in acts.iter().enumerate() {
            if a.stage >= s || a.mb >= m {
                return Err(bad(format!(
                    "worker {w}, step {i}: {a} is out of range ({s} stages, {m} micro-batches)"
                )));
            }
            match routes.hop(plan, a.mb, a.stage) {
                None => {
                    return Err(broke(
                        ACTIONS,
                        format!(
                            "worker {w}, step {i}: {a} but mb {} does not visit stage {} on its route",
                            a.mb, a.stage
                        ),
                    ))
                }
                Some(h) if h.worker != w => {
                    return Err(broke(
                        ACTIONS,
                        format!(
                            "worker {w}, step {i}: {a} belongs to worker {} (the route of mb {} runs stage {} there)",
                            h.worker, a.mb, a.stage
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
    }
    Ok(())
}

/// Per (stage, mb): where its F, B, W and BW are. Errors on missing, duplicate or stray actions.
pub(crate) struct Sites {
    m: usize,
    at: Vec<[Option<Site>; 4]>,
}

impl Sites {
    fn get(&self, op: Op, stage: usize, mb: usize) -> Option<Site> {
        self.at[stage * self.m + mb][op as usize]
    }
}

fn check_complete(plan: &Plan) -> Result<Sites> {
    let m = plan.num_microbatches;
    let mut at: Vec<[Option<Site>; 4]> = vec![[None; 4]; plan.num_stages() * m];
    for (w, acts) in plan.workers.iter().enumerate() {
        for (i, a) in acts.iter().enumerate() {
            let slot = &mut at[a.stage * m + a.mb][a.op as usize];
            if let Some(first) = slot {
                return Err(broke(
                    rules::ACTIONS,
                    format!(
                        "worker {w}, step {i}: {a} is a duplicate (first at step {})",
                        first.step
                    ),
                ));
            }
            *slot = Some(Site { worker: w, step: i });
        }
    }
    for (mb, r) in plan.routes.iter().enumerate() {
        for h in r {
            let (st, w) = (h.stage, h.worker);
            let [f, b, wg, bw] = at[st * m + mb];
            let missing = |op| {
                broke(
                    rules::ACTIONS,
                    format!(
                        "worker {w}: missing {} (the schedule never runs it)",
                        Action::new(op, st, mb)
                    ),
                )
            };
            if f.is_none() {
                return Err(missing(Op::F));
            }
            match (b, wg, bw) {
                (None, None, Some(_)) | (Some(_), Some(_), None) => {}
                (Some(_), None, None) => return Err(missing(Op::W)),
                (None, Some(_), None) => return Err(missing(Op::B)),
                (None, None, None) => return Err(missing(Op::BW)),
                (_, _, Some(s)) => {
                    return Err(broke(
                        rules::ACTIONS,
                        format!(
                            "worker {w}, step {}: {} but the backward of stage {st}, mb {mb} is also split into B and W",
                            s.step,
                            Action::new(Op::BW, st, mb)
                        ),
                    ))
                }
            }
        }
    }
    Ok(Sites { m, at })
}

/// Run the per-worker orders with dependencies only (no costs). If every action completes, the
/// plan runs on any positive costs; otherwise name what is stuck.
fn check_runs(plan: &Plan, sites: &Sites) -> Result<()> {
    let m = plan.num_microbatches;
    let s = plan.num_stages();
    let p = plan.num_workers();
    let mut done_f = vec![false; s * m];
    let mut done_grad = vec![false; s * m];
    let routes = RouteIndex::new(plan);
    let mut head = vec![0usize; p];
    // Worker waiting on (slot, stage, mb), if any.
    let mut waiting: Vec<Option<usize>> = vec![None; 2 * s * m];
    let key = |slot: Slot, st: usize, mb: usize| (slot as usize) * s * m + st * m + mb;
    let mut queue: Vec<usize> = (0..p).collect();
    while let Some(w) = queue.pop() {
        while let Some(a) = plan.workers[w].get(head[w]) {
            let missing = deps(plan, &routes, a)
                .into_iter()
                .flatten()
                .find(|&(slot, st)| {
                    let d = if slot == Slot::F { &done_f } else { &done_grad };
                    !d[st * m + a.mb]
                });
            if let Some((slot, st)) = missing {
                waiting[key(slot, st, a.mb)] = Some(w);
                break;
            }
            match a.op {
                Op::F => done_f[a.stage * m + a.mb] = true,
                Op::B | Op::BW => done_grad[a.stage * m + a.mb] = true,
                Op::W => {}
            }
            let slot = if a.op == Op::F {
                Some(Slot::F)
            } else if a.op.sends_grad() {
                Some(Slot::Grad)
            } else {
                None
            };
            if let Some(slot) = slot {
                if let Some(v) = waiting[key(slot, a.stage, a.mb)].take() {
                    queue.push(v);
                }
            }
            head[w] += 1;
        }
    }
    let stuck: Vec<usize> = (0..p)
        .filter(|&w| head[w] < plan.workers[w].len())
        .collect();
    if stuck.is_empty() {
        return Ok(());
    }
    // What each stuck head needs, and where that action sits.
    let need = |w: usize| {
        let a = plan.workers[w][head[w]];
        let (slot, st) = deps(plan, &routes, &a)
            .into_iter()
            .flatten()
            .find(|&(slot, st)| {
                !(if slot == Slot::F { &done_f } else { &done_grad })[st * m + a.mb]
            })
            .expect("a stuck action has a missing dependency");
        let op = match slot {
            Slot::F => Op::F,
            Slot::Grad if sites.get(Op::BW, st, a.mb).is_some() => Op::BW,
            Slot::Grad => Op::B,
        };
        let need = Action::new(op, st, a.mb);
        (
            a,
            need,
            sites.get(op, st, a.mb).expect("completeness checked"),
        )
    };
    // An action placed after the one that needs it on the same worker is an order error.
    if let Some(w) = stuck.iter().copied().find(|&w| need(w).2.worker == w) {
        let (a, need, site) = need(w);
        return Err(broke(
            rules::DEADLOCK,
            format!(
                "worker {w}, step {}: {a} comes before {need} (step {}) that it needs",
                head[w], site.step
            ),
        ));
    }
    let w = stuck[0];
    let (a, need, site) = need(w);
    let chain: Vec<String> = stuck
        .iter()
        .map(|&v| format!("worker {v} step {} {}", head[v], plan.workers[v][head[v]]))
        .collect();
    Err(broke(
        rules::DEADLOCK,
        format!(
            "deadlock: worker {w}, step {}: {a} waits for {need} (worker {}, step {}); stuck: {}",
            head[w],
            site.worker,
            site.step,
            chain.join(", ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Hop, Topology};
    use crate::schedule::{generate, ScheduleKind};

    fn plan() -> Plan {
        generate(ScheduleKind::OneFOneB, 2, 2, 1).unwrap()
    }

    #[test]
    fn generated_plans_validate() {
        for k in ScheduleKind::ALL {
            let p = generate(k, 4, 8, k.default_chunks()).unwrap();
            validate(&p).unwrap_or_else(|e| panic!("{k}: {e}"));
        }
    }

    #[test]
    fn missing_action() {
        let mut p = plan();
        p.workers[1].retain(|a| !(a.op == Op::BW && a.mb == 1));
        assert_eq!(
            validate(&p).unwrap_err().to_string(),
            "worker 1: missing BW(stage 1, mb 1) (the schedule never runs it) (rule actions)"
        );
    }

    #[test]
    fn wrong_order_on_one_worker() {
        let mut p = plan();
        // worker 1 runs F0 BW0 F1 BW1; put BW1 before F1.
        p.workers[1].swap(2, 3);
        assert_eq!(
            validate(&p).unwrap_err().to_string(),
            "worker 1, step 2: BW(stage 1, mb 1) comes before F(stage 1, mb 1) (step 3) that it needs (rule deadlock)"
        );
    }

    #[test]
    fn deadlock_across_workers() {
        let mut p = plan();
        // worker 0 runs F0 F1 BW0 BW1; make it wait for BW1's gradient before running F1.
        // worker 0 finishes mb 0 before starting mb 1; worker 1 insists on mb 1 first.
        p.workers[0] = vec![
            Action::new(Op::F, 0, 0),
            Action::new(Op::BW, 0, 0),
            Action::new(Op::F, 0, 1),
            Action::new(Op::BW, 0, 1),
        ];
        p.workers[1] = vec![
            Action::new(Op::F, 1, 1),
            Action::new(Op::F, 1, 0),
            Action::new(Op::BW, 1, 0),
            Action::new(Op::BW, 1, 1),
        ];
        assert_eq!(
            validate(&p).unwrap_err().to_string(),
            "deadlock: worker 0, step 1: BW(stage 0, mb 0) waits for BW(stage 1, mb 0) (worker 1, step 2); \
             stuck: worker 0 step 1 BW(stage 0, mb 0), worker 1 step 0 F(stage 1, mb 1) (rule deadlock)"
        );
    }

    #[test]
    fn duplicate_and_misplaced() {
        let mut p = plan();
        p.workers[0].push(Action::new(Op::F, 0, 0));
        assert!(validate(&p)
            .unwrap_err()
            .to_string()
            .contains("worker 0, step 4: F(stage 0, mb 0) is a duplicate (first at step 0)"));
        let mut p = plan();
        p.workers[0][0].stage = 1;
        assert_eq!(
            validate(&p).unwrap_err().to_string(),
            "worker 0, step 0: F(stage 1, mb 0) belongs to worker 1 (the route of mb 0 runs stage 1 there) (rule actions)"
        );
    }

    #[test]
    fn generated_whole_job_plans_validate() {
        for k in ScheduleKind::ALL {
            for d in 1..=3 {
                for (p, m) in [(1, 1), (2, 4), (3, 6), (4, 8)] {
                    let Ok(one) = generate(k, p, m, k.default_chunks()) else {
                        continue;
                    };
                    let job = one.replicate(d).unwrap();
                    assert_eq!(job.num_workers(), p * d);
                    assert_eq!(job.num_microbatches, m * d);
                    validate(&job).unwrap_or_else(|e| panic!("{k} P={p} M={m} D={d}: {e}"));
                    // Each stage's replica group has one host per replica.
                    let topo = Topology::new(&job);
                    assert!(topo.groups.iter().all(|g| g.len() == d));
                }
            }
        }
    }

    /// A 4-stage plan whose routes are given by hand, one worker per stage, each worker running
    /// all its forwards then its backwards (GPipe order, so any routes run).
    fn routed(routes: &[&[usize]]) -> Plan {
        let s = 4;
        let m = routes.len();
        let mut plan = Plan::pipeline(ScheduleKind::Custom, (0..s).collect(), m, vec![]);
        plan.routes = routes
            .iter()
            .map(|r| {
                r.iter()
                    .map(|&st| Hop {
                        stage: st,
                        worker: st,
                    })
                    .collect()
            })
            .collect();
        plan.workers = (0..s)
            .map(|w| {
                let mbs: Vec<usize> = (0..m).filter(|&mb| routes[mb].contains(&w)).collect();
                mbs.iter()
                    .map(|&mb| Action::new(Op::F, w, mb))
                    .chain(mbs.iter().map(|&mb| Action::new(Op::BW, w, mb)))
                    .collect()
            })
            .collect();
        plan
    }

    #[test]
    fn skipped_and_swapped_stages_are_valid() {
        validate(&routed(&[
            &[0, 1, 2, 3],
            &[0, 2, 3],
            &[0, 2, 1, 3],
            &[0, 3],
        ]))
        .unwrap();
    }

    #[test]
    fn head_on_the_data_node_is_valid() {
        // SkipPipe's form: stage 3 is the head alone, on worker 0 with the embedding.
        let mut plan = routed(&[&[0, 1, 2, 3], &[0, 2, 1, 3]]);
        plan.stages[3].hosts = vec![0];
        for r in &mut plan.routes {
            r.last_mut().unwrap().worker = 0;
        }
        let head = std::mem::take(&mut plan.workers[3]);
        plan.workers.pop();
        // Worker 0: F(0) of both, then the head's F and BW, then BW(0).
        plan.workers[0] = vec![Action::new(Op::F, 0, 0), Action::new(Op::F, 0, 1)];
        plan.workers[0].extend(head);
        plan.workers[0].extend([Action::new(Op::BW, 0, 0), Action::new(Op::BW, 0, 1)]);
        validate(&plan).unwrap();
        assert_eq!(
            plan.routes[1].first().unwrap().worker,
            plan.routes[1].last().unwrap().worker
        );
    }

    #[test]
    fn each_route_rule_is_named() {
        let e = |p: &Plan| validate(p).unwrap_err().to_string();
        assert_eq!(
            e(&routed(&[&[1, 2, 3]])),
            "route of mb 0 starts at stage 1, but stage 0 holds the embedding (rule route-start)"
        );
        assert_eq!(
            e(&routed(&[&[0, 1, 2]])),
            "route of mb 0 ends at stage 2, but stage 3 holds the head and loss (rule route-end)"
        );
        assert_eq!(
            e(&routed(&[&[0, 1, 1, 3]])),
            "route of mb 0 visits stage 1 twice (rule route-once)"
        );
        let mut p = routed(&[&[0, 1, 2, 3]]);
        p.routes[0][1].worker = 2;
        assert_eq!(
            e(&p),
            "route of mb 0 runs stage 1 on worker 2, which does not host it (hosts [1]) (rule hop-host)"
        );
        // An action for a stage the route skips.
        let mut p = routed(&[&[0, 2, 3]]);
        p.workers[1] = vec![Action::new(Op::F, 1, 0), Action::new(Op::BW, 1, 0)];
        assert_eq!(
            e(&p),
            "worker 1, step 0: F(stage 1, mb 0) but mb 0 does not visit stage 1 on its route (rule actions)"
        );
        // A hop without its actions.
        let mut p = routed(&[&[0, 1, 3]]);
        p.workers[1].clear();
        assert_eq!(
            e(&p),
            "worker 1: missing F(stage 1, mb 0) (the schedule never runs it) (rule actions)"
        );
        let mut p = routed(&[&[0, 1, 2, 3]]);
        p.stages[2].layers = 0;
        assert_eq!(e(&p), "stage 2 holds no layers (rule stages)");
        // Swapped stages whose worker orders cannot both be met deadlock, and say so.
        let mut p = routed(&[&[0, 1, 2, 3], &[0, 2, 1, 3]]);
        p.stages[2].hosts = vec![1];
        for r in &mut p.routes {
            for h in r.iter_mut().filter(|h| h.stage == 2) {
                h.worker = 1;
            }
        }
        let two = std::mem::take(&mut p.workers[2]);
        p.workers[1].splice(0..0, two);
        assert!(e(&p).contains("(rule deadlock)"), "{}", e(&p));
    }
}

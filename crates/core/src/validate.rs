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
        Op::F => [routes.prev(plan, a.mb, a.stage).map(|p| (Slot::F, p)), None],
        Op::B | Op::BW => [
            Some((Slot::F, a.stage)),
            routes.next(plan, a.mb, a.stage).map(|n| (Slot::Grad, n)),
        ],
        Op::W => [Some((Slot::Grad, a.stage)), None],
    }
}

/// Check structure, completeness, order and deadlock freedom.
pub fn validate(plan: &Plan) -> Result<()> {
    check_structure(plan)?;
    let sites = check_complete(plan)?;
    check_runs(plan, &sites)
}

fn bad(msg: String) -> Error {
    Error::Invalid(msg)
}

fn check_structure(plan: &Plan) -> Result<()> {
    let (s, m, p) = (plan.num_stages(), plan.num_microbatches, plan.num_workers());
    if s == 0 || p == 0 || m == 0 {
        return Err(bad(format!(
            "plan needs stages, workers and micro-batches (got {s}, {p}, {m})"
        )));
    }
    if let Some((st, &w)) = plan.placement.iter().enumerate().find(|(_, &w)| w >= p) {
        return Err(bad(format!(
            "stage {st} is placed on worker {w}, but the plan has {p} workers"
        )));
    }
    if plan.routes.len() != m {
        return Err(bad(format!(
            "{} routes for {m} micro-batches",
            plan.routes.len()
        )));
    }
    for (mb, r) in plan.routes.iter().enumerate() {
        if r.is_empty() {
            return Err(bad(format!("route of mb {mb} is empty")));
        }
        let mut seen = vec![false; s];
        for &st in r {
            if st >= s {
                return Err(bad(format!(
                    "route of mb {mb} visits stage {st}, but the plan has {s} stages"
                )));
            }
            if std::mem::replace(&mut seen[st], true) {
                return Err(bad(format!("route of mb {mb} visits stage {st} twice")));
            }
        }
    }
    for (w, acts) in plan.workers.iter().enumerate() {
        for (i, a) in acts.iter().enumerate() {
            if a.stage >= s || a.mb >= m {
                return Err(bad(format!(
                    "worker {w}, step {i}: {a} is out of range ({s} stages, {m} micro-batches)"
                )));
            }
            if plan.placement[a.stage] != w {
                return Err(bad(format!(
                    "worker {w}, step {i}: {a} belongs to worker {}",
                    plan.placement[a.stage]
                )));
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
    let idx = RouteIndex::new(plan);
    for (w, acts) in plan.workers.iter().enumerate() {
        for (i, a) in acts.iter().enumerate() {
            if !idx.visits(a.mb, a.stage) {
                return Err(bad(format!(
                    "worker {w}, step {i}: {a} but mb {} does not visit stage {} on its route",
                    a.mb, a.stage
                )));
            }
            let slot = &mut at[a.stage * m + a.mb][a.op as usize];
            if let Some(first) = slot {
                return Err(bad(format!(
                    "worker {w}, step {i}: {a} is a duplicate (first at step {})",
                    first.step
                )));
            }
            *slot = Some(Site { worker: w, step: i });
        }
    }
    for (mb, r) in plan.routes.iter().enumerate() {
        for &st in r {
            let w = plan.placement[st];
            let [f, b, wg, bw] = at[st * m + mb];
            let missing = |op| {
                bad(format!(
                    "worker {w}: missing {} (the schedule never runs it)",
                    Action::new(op, st, mb)
                ))
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
                    return Err(bad(format!(
                        "worker {w}, step {}: {} but the backward of stage {st}, mb {mb} is also split into B and W",
                        s.step,
                        Action::new(Op::BW, st, mb)
                    )))
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
        return Err(bad(format!(
            "worker {w}, step {}: {a} comes before {need} (step {}) that it needs",
            head[w], site.step
        )));
    }
    let w = stuck[0];
    let (a, need, site) = need(w);
    let chain: Vec<String> = stuck
        .iter()
        .map(|&v| format!("worker {v} step {} {}", head[v], plan.workers[v][head[v]]))
        .collect();
    Err(bad(format!(
        "deadlock: worker {w}, step {}: {a} waits for {need} (worker {}, step {}); stuck: {}",
        head[w],
        site.worker,
        site.step,
        chain.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
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
            "worker 1: missing BW(stage 1, mb 1) (the schedule never runs it)"
        );
    }

    #[test]
    fn wrong_order_on_one_worker() {
        let mut p = plan();
        // worker 1 runs F0 BW0 F1 BW1; put BW1 before F1.
        p.workers[1].swap(2, 3);
        assert_eq!(
            validate(&p).unwrap_err().to_string(),
            "worker 1, step 2: BW(stage 1, mb 1) comes before F(stage 1, mb 1) (step 3) that it needs"
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
             stuck: worker 0 step 1 BW(stage 0, mb 0), worker 1 step 0 F(stage 1, mb 1)"
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
            "worker 0, step 0: F(stage 1, mb 0) belongs to worker 1"
        );
    }
}

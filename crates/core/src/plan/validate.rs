//! The validator: a plan either runs to completion on any costs, or gets an error naming the
//! worker, the position in its list and the action.

use crate::error::{Error, Result};
use crate::plan::deps::{needs, Need};
use crate::plan::ir::{Action, Op, Plan, RouteIndex};

/// Where an action sits: worker and step in its list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Site {
    pub worker: usize,
    pub step: usize,
}

/// What `a` waits for (besides its worker reaching it), by the IR's one dependency rule.
fn needs_of(plan: &Plan, routes: &RouteIndex, a: &Action) -> [Option<Need>; 2] {
    let prev = routes.prev(plan, a.mb, a.stage).map(|h| h.stage);
    let next = routes.next(plan, a.mb, a.stage).map(|h| h.stage);
    needs(a.op, a.stage, prev, next)
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
    /// An overlapped pair is a forward followed, on its worker, by a backward (B or BW) of
    /// another micro-batch.
    pub const OVERLAP: &str = "overlap";
}

/// A plan [`validate`] accepted: the simulator and the runtime take it as it is, without
/// checking it again.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidPlan(Plan);

impl ValidPlan {
    /// `plan` once [`validate`] has accepted it.
    pub fn new(plan: Plan) -> Result<Self> {
        validate(&plan)?;
        Ok(ValidPlan(plan))
    }

    pub fn into_plan(self) -> Plan {
        self.0
    }
}

impl std::ops::Deref for ValidPlan {
    type Target = Plan;

    fn deref(&self) -> &Plan {
        &self.0
    }
}

/// Check structure, route rules, completeness, order and deadlock freedom.
pub fn validate(plan: &Plan) -> Result<()> {
    check_structure(plan)?;
    let sites = check_complete(plan)?;
    check_overlaps(plan)?;
    check_runs(plan, &sites)
}

/// Each overlapped pair's form. Its two halves' dependencies are those of two actions in a
/// row, which `check_runs` follows: the pair computes one half after the other.
fn check_overlaps(plan: &Plan) -> Result<()> {
    for (w, acts) in plan.workers.iter().enumerate() {
        for (i, a) in acts.iter().enumerate().filter(|(_, a)| a.overlap) {
            let why = match acts.get(i + 1) {
                _ if a.op != Op::F => {
                    format!("{a} is marked overlapped, but only a forward opens a pair")
                }
                None => format!("{a} opens an overlapped pair, but is the worker's last action"),
                Some(b) if !b.op.sends_grad() => {
                    format!("{a} is overlapped with {b}, which is not a backward (B or BW) ending the pair")
                }
                Some(b) if b.mb == a.mb => {
                    format!("{a} is overlapped with {b}: a pair joins two micro-batches")
                }
                Some(_) => continue,
            };
            return Err(broke(
                rules::OVERLAP,
                format!("worker {w}, step {i}: {why}"),
            ));
        }
    }
    Ok(())
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
    // Worker waiting on a result of micro-batch mb, if any.
    let mut waiting: Vec<Option<usize>> = vec![None; 2 * s * m];
    let key = |n: Need, mb: usize| match n {
        Need::Forward(st) => st * m + mb,
        Need::InputGrad(st) => s * m + st * m + mb,
    };
    let met = |done_f: &[bool], done_grad: &[bool], n: Need, mb: usize| match n {
        Need::Forward(st) => done_f[st * m + mb],
        Need::InputGrad(st) => done_grad[st * m + mb],
    };
    let mut queue: Vec<usize> = (0..p).collect();
    while let Some(w) = queue.pop() {
        while let Some(a) = plan.workers[w].get(head[w]) {
            let missing = needs_of(plan, &routes, a)
                .into_iter()
                .flatten()
                .find(|&n| !met(&done_f, &done_grad, n, a.mb));
            if let Some(n) = missing {
                waiting[key(n, a.mb)] = Some(w);
                break;
            }
            match a.op {
                Op::F => done_f[a.stage * m + a.mb] = true,
                Op::B | Op::BW => done_grad[a.stage * m + a.mb] = true,
                Op::W => {}
            }
            let result = if a.op == Op::F {
                Some(Need::Forward(a.stage))
            } else if a.op.sends_grad() {
                Some(Need::InputGrad(a.stage))
            } else {
                None
            };
            if let Some(n) = result {
                if let Some(v) = waiting[key(n, a.mb)].take() {
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
        let n = needs_of(plan, &routes, &a)
            .into_iter()
            .flatten()
            .find(|&n| !met(&done_f, &done_grad, n, a.mb))
            .expect("a stuck action has a missing dependency");
        let (op, st) = match n {
            Need::Forward(st) => (Op::F, st),
            Need::InputGrad(st) if sites.get(Op::BW, st, a.mb).is_some() => (Op::BW, st),
            Need::InputGrad(st) => (Op::B, st),
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

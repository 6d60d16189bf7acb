//! The Plan IR: per-worker ordered actions, stage placement and a route per micro-batch.
//!
//! Everything else (validator, simulator, runtime, timelines) is a function of a [`Plan`].
//! Communication is implied: after `F(s, m)` the activation goes to the worker of the stage
//! after `s` on micro-batch `m`'s route; after the input-gradient backward of `(s, m)` the
//! gradient goes to the worker of the stage before it. Nothing assumes "next stage = s + 1".

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

/// What one action computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
pub enum Op {
    /// Forward of one stage for one micro-batch.
    F,
    /// Input-gradient part of the backward (zero-bubble schedules split it from `W`).
    B,
    /// Weight-gradient part of the backward; needs the same stage's `B` first.
    W,
    /// Full backward: `B` and `W` fused, for schedules without the split.
    #[serde(rename = "BW")]
    BW,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::F => "F",
            Op::B => "B",
            Op::W => "W",
            Op::BW => "BW",
        }
    }
    pub fn parse(s: &str) -> Option<Op> {
        Some(match s {
            "F" => Op::F,
            "B" => Op::B,
            "W" => Op::W,
            "BW" => Op::BW,
            _ => return None,
        })
    }
    /// Does this action produce the input gradient that travels upstream?
    pub fn sends_grad(self) -> bool {
        matches!(self, Op::B | Op::BW)
    }
    /// Does this action end the life of the stage's kept activations?
    pub fn frees_activation(self) -> bool {
        matches!(self, Op::W | Op::BW)
    }
}

/// One step of a worker: `op` on `stage` for micro-batch `mb`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Action {
    pub op: Op,
    pub stage: usize,
    pub mb: usize,
}

impl Action {
    pub fn new(op: Op, stage: usize, mb: usize) -> Self {
        Action { op, stage, mb }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}(stage {}, mb {})",
            self.op.as_str(),
            self.stage,
            self.mb
        )
    }
}

/// A pipeline plan: the single representation every other part interprets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Which generator made it (free text, e.g. "1f1b").
    pub kind: String,
    pub num_microbatches: usize,
    /// `placement[s]` = worker that holds stage `s`; stages are model chunks in model order.
    pub placement: Vec<usize>,
    /// `routes[m]` = stages micro-batch `m` visits, in forward order.
    pub routes: Vec<Vec<usize>>,
    /// `workers[w]` = the actions worker `w` runs, in order.
    pub workers: Vec<Vec<Action>>,
}

/// Fast lookups along routes: previous and next stage of micro-batch `m` at stage `s`.
#[derive(Debug, Clone)]
pub struct RouteIndex {
    num_stages: usize,
    /// `pos[m * S + s]` = position of `s` on `m`'s route, or `usize::MAX`.
    pos: Vec<usize>,
}

impl RouteIndex {
    pub fn new(plan: &Plan) -> Self {
        let s = plan.num_stages();
        let mut pos = vec![usize::MAX; s * plan.routes.len()];
        for (m, r) in plan.routes.iter().enumerate() {
            for (i, &st) in r.iter().enumerate() {
                if st < s {
                    pos[m * s + st] = i;
                }
            }
        }
        RouteIndex { num_stages: s, pos }
    }
    pub fn position(&self, mb: usize, stage: usize) -> Option<usize> {
        let p = self.pos[mb * self.num_stages + stage];
        (p != usize::MAX).then_some(p)
    }
    /// Stage after `stage` on `mb`'s route, in O(1).
    pub fn next(&self, plan: &Plan, mb: usize, stage: usize) -> Option<usize> {
        self.position(mb, stage)
            .and_then(|i| plan.routes[mb].get(i + 1).copied())
    }
    /// Stage before `stage` on `mb`'s route, in O(1).
    pub fn prev(&self, plan: &Plan, mb: usize, stage: usize) -> Option<usize> {
        self.position(mb, stage)
            .and_then(|i| i.checked_sub(1).map(|j| plan.routes[mb][j]))
    }
    pub fn visits(&self, mb: usize, stage: usize) -> bool {
        self.position(mb, stage).is_some()
    }
}

impl Plan {
    pub fn num_stages(&self) -> usize {
        self.placement.len()
    }
    pub fn num_workers(&self) -> usize {
        self.workers.len()
    }
    /// The default route: every stage in model order.
    pub fn full_routes(num_stages: usize, num_microbatches: usize) -> Vec<Vec<usize>> {
        vec![(0..num_stages).collect(); num_microbatches]
    }
    /// Stages held by worker `w`, in model order.
    pub fn stages_of(&self, w: usize) -> Vec<usize> {
        (0..self.num_stages())
            .filter(|&s| self.placement[s] == w)
            .collect()
    }
    /// Stage after `stage` on `mb`'s route.
    pub fn next_stage(&self, mb: usize, stage: usize) -> Option<usize> {
        let r = &self.routes[mb];
        r.iter()
            .position(|&s| s == stage)
            .and_then(|i| r.get(i + 1).copied())
    }
    /// Stage before `stage` on `mb`'s route.
    pub fn prev_stage(&self, mb: usize, stage: usize) -> Option<usize> {
        let r = &self.routes[mb];
        r.iter()
            .position(|&s| s == stage)
            .and_then(|i| i.checked_sub(1).map(|j| r[j]))
    }
    /// Does the plan split backward into `B` and `W`?
    pub fn splits_backward(&self) -> bool {
        self.workers.iter().flatten().any(|a| a.op == Op::W)
    }

    // ---- views ----

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plan serialises")
    }

    pub fn from_json(file: &str, text: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| {
            Error::input(
                file,
                format!("line {}, column {}: {e}", e.line(), e.column()),
            )
        })
    }

    /// CSV, one record per row: `record,worker,step,op,stage,microbatch`. A `plan` row carries
    /// the kind and counts, `route` rows the routes (step = position), `action` rows the actions.
    pub fn to_csv(&self) -> String {
        let mut w = csv::Writer::from_writer(Vec::new());
        let mut row = |r: CsvRow| w.serialize(r).expect("csv in memory");
        row(CsvRow {
            record: "plan".into(),
            worker: self.num_workers(),
            step: self.num_stages(),
            op: self.kind.clone(),
            stage: 0,
            microbatch: self.num_microbatches,
        });
        for (m, r) in self.routes.iter().enumerate() {
            for (i, &s) in r.iter().enumerate() {
                row(CsvRow {
                    record: "route".into(),
                    worker: self.placement[s],
                    step: i,
                    op: String::new(),
                    stage: s,
                    microbatch: m,
                });
            }
        }
        for (wk, acts) in self.workers.iter().enumerate() {
            for (i, a) in acts.iter().enumerate() {
                row(CsvRow {
                    record: "action".into(),
                    worker: wk,
                    step: i,
                    op: a.op.as_str().into(),
                    stage: a.stage,
                    microbatch: a.mb,
                });
            }
        }
        String::from_utf8(w.into_inner().expect("csv flush")).expect("csv is utf-8")
    }

    pub fn from_csv(file: &str, text: &str) -> Result<Self> {
        let mut rd = csv::Reader::from_reader(text.as_bytes());
        let mut plan: Option<Plan> = None;
        for (i, rec) in rd.deserialize::<CsvRow>().enumerate() {
            let line = i + 2;
            let r = rec.map_err(|e| Error::input(file, format!("line {line}: {e}")))?;
            let bad = |msg: String| Error::input(file, format!("line {line}: {msg}"));
            match (r.record.as_str(), plan.as_mut()) {
                ("plan", None) => {
                    plan = Some(Plan {
                        kind: r.op,
                        num_microbatches: r.microbatch,
                        placement: vec![usize::MAX; r.step],
                        routes: vec![Vec::new(); r.microbatch],
                        workers: vec![Vec::new(); r.worker],
                    })
                }
                ("plan", Some(_)) => return Err(bad("a second `plan` record".into())),
                (_, None) => return Err(bad("the first record must be `plan`".into())),
                ("route", Some(p)) => {
                    if r.stage >= p.placement.len()
                        || r.microbatch >= p.routes.len()
                        || r.worker >= p.workers.len()
                    {
                        return Err(bad(format!(
                            "route record out of range (stage {}, mb {}, worker {})",
                            r.stage, r.microbatch, r.worker
                        )));
                    }
                    if r.step != p.routes[r.microbatch].len() {
                        return Err(bad(format!(
                            "route of mb {} skips position {}",
                            r.microbatch,
                            p.routes[r.microbatch].len()
                        )));
                    }
                    p.routes[r.microbatch].push(r.stage);
                    let old = p.placement[r.stage];
                    if old != usize::MAX && old != r.worker {
                        return Err(bad(format!(
                            "stage {} placed on worker {} and {}",
                            r.stage, old, r.worker
                        )));
                    }
                    p.placement[r.stage] = r.worker;
                }
                ("action", Some(p)) => {
                    let op = Op::parse(&r.op).ok_or_else(|| {
                        bad(format!("unknown op {:?} (expected F, B, W or BW)", r.op))
                    })?;
                    let acts = p
                        .workers
                        .get_mut(r.worker)
                        .ok_or_else(|| bad(format!("worker {} out of range", r.worker)))?;
                    if r.step != acts.len() {
                        return Err(bad(format!(
                            "worker {} skips step {}",
                            r.worker,
                            acts.len()
                        )));
                    }
                    acts.push(Action::new(op, r.stage, r.microbatch));
                }
                (other, _) => {
                    return Err(bad(format!(
                        "unknown record {other:?} (expected plan, route or action)"
                    )))
                }
            }
        }
        let mut p = plan.ok_or_else(|| Error::input(file, "empty: no `plan` record"))?;
        // Stages that no route visits keep their placement from the actions.
        for acts in 0..p.workers.len() {
            for a in p.workers[acts].clone() {
                if a.stage < p.placement.len() && p.placement[a.stage] == usize::MAX {
                    p.placement[a.stage] = acts;
                }
            }
        }
        if let Some(s) = p.placement.iter().position(|&w| w == usize::MAX) {
            return Err(Error::input(file, format!("stage {s} has no worker")));
        }
        Ok(p)
    }

    /// Text grid, one row per step and one column per worker, e.g. `F3` or `F3s5` when a
    /// worker holds several stages.
    pub fn grid(&self) -> String {
        let multi = (0..self.num_workers()).any(|w| self.stages_of(w).len() > 1);
        let cell = |a: &Action| {
            if multi {
                format!("{}{}s{}", a.op.as_str(), a.mb, a.stage)
            } else {
                format!("{}{}", a.op.as_str(), a.mb)
            }
        };
        let steps = self.workers.iter().map(Vec::len).max().unwrap_or(0);
        let width = self
            .workers
            .iter()
            .flatten()
            .map(|a| cell(a).len())
            .max()
            .unwrap_or(2)
            .max(3);
        let mut out = format!("{:>5} ", "step");
        for w in 0..self.num_workers() {
            out += &format!(" {:>width$}", format!("w{w}"));
        }
        out.push('\n');
        for i in 0..steps {
            out += &format!("{i:>5} ");
            for acts in &self.workers {
                let c = acts.get(i).map_or_else(|| ".".to_string(), cell);
                out += &format!(" {c:>width$}");
            }
            out.push('\n');
        }
        out
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct CsvRow {
    record: String,
    worker: usize,
    step: usize,
    op: String,
    stage: usize,
    microbatch: usize,
}

//! The Plan IR for a whole job: stages (the model layers each holds and the workers hosting it),
//! a route per micro-batch as (stage, worker) hops, and each worker's ordered actions.
//!
//! Everything else (validator, simulator, runtime, timelines) is a function of a [`Plan`].
//! Communication is implied by the routes: after `F(s, m)` the activation goes to the next hop
//! of `m`'s route; after the input-gradient backward of `(s, m)` the gradient goes to the hop
//! before it. Several hosts of one stage form its replica group, whose weight gradients are
//! summed; classic data parallelism is the case where replica `r`'s micro-batches run through
//! replica `r`'s workers. Ranks and groups are derived in one place, [`Topology`].

use crate::error::{Error, Field, Result};
use crate::limits::check_size;
use crate::plan::ScheduleKind;
use crate::profile::StageCost;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::Range;

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
    /// This forward and the worker's next action (a backward of another micro-batch) are one
    /// overlapped pair, torch's `OVERLAP_F_B` (DualPipe's F&B overlap). The pair computes one
    /// half after the other; each half's transfers travel while the other half computes
    /// (`validate` checks the pair's form).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub overlap: bool,
}

impl Action {
    pub fn new(op: Op, stage: usize, mb: usize) -> Self {
        Action {
            op,
            stage,
            mb,
            overlap: false,
        }
    }
    /// A grid cell or timeline label: `F3`, or `F3s5` with the stage; an overlapped forward
    /// ends in `+` (it and the next cell are one pair).
    pub fn cell(&self, with_stage: bool) -> String {
        let pair = if self.overlap { "+" } else { "" };
        match with_stage {
            true => format!("{}{}s{}{pair}", self.op.as_str(), self.mb, self.stage),
            false => format!("{}{}{pair}", self.op.as_str(), self.mb),
        }
    }
    /// This forward, overlapped with the action that follows it on its worker.
    pub fn overlapped(self) -> Self {
        Action {
            overlap: true,
            ..self
        }
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

/// One hop of a route: the stage a micro-batch visits and the worker that runs it there.
/// Written as `[stage, worker]` in JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "(usize, usize)", into = "(usize, usize)")]
pub struct Hop {
    pub stage: usize,
    pub worker: usize,
}

impl From<(usize, usize)> for Hop {
    fn from((stage, worker): (usize, usize)) -> Self {
        Hop { stage, worker }
    }
}
impl From<Hop> for (usize, usize) {
    fn from(h: Hop) -> Self {
        (h.stage, h.worker)
    }
}

/// One stage of the model: a contiguous run of layers (stages are in model order), the workers
/// that host it (its replica group), and optionally its costs (so a planned file simulates
/// without the profile it came from).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StagePlan {
    /// Model layers (layer blocks) this stage holds; stage `s` starts where stage `s - 1` ends.
    pub layers: usize,
    /// Workers hosting the stage; gradients are all-reduced among them.
    pub hosts: Vec<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<StageCost>,
}

/// A whole-job plan: the single representation every other part interprets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Which generator made it (`custom` for hand-made plans).
    pub kind: ScheduleKind,
    /// Micro-batches per iteration over the whole job (all replicas).
    pub num_microbatches: usize,
    pub stages: Vec<StagePlan>,
    /// `routes[m]` = the hops of micro-batch `m`, in forward order.
    pub routes: Vec<Vec<Hop>>,
    /// `workers[w]` = the actions worker `w` runs, in order.
    pub workers: Vec<Vec<Action>>,
    /// Cluster device name per worker; empty = worker `w` on the cluster's device `w`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<String>,
}

impl Plan {
    /// A plan that no generator made (searched routes, list-scheduled orders): its stages,
    /// one route per micro-batch and each worker's actions, on the cluster's first devices.
    pub fn custom(
        stages: Vec<StagePlan>,
        routes: Vec<Vec<Hop>>,
        workers: Vec<Vec<Action>>,
    ) -> Plan {
        Plan {
            kind: ScheduleKind::Custom,
            num_microbatches: routes.len(),
            stages,
            routes,
            workers,
            devices: Vec::new(),
        }
    }
}

/// Fast lookups along routes: hop before and after stage `s` on micro-batch `m`'s route.
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
            for (i, h) in r.iter().enumerate() {
                if h.stage < s {
                    pos[m * s + h.stage] = i;
                }
            }
        }
        RouteIndex { num_stages: s, pos }
    }
    pub fn position(&self, mb: usize, stage: usize) -> Option<usize> {
        let p = *self.pos.get(mb * self.num_stages + stage)?;
        (p != usize::MAX).then_some(p)
    }
    /// The hop of `mb` at `stage`, if its route visits it.
    pub fn hop(&self, plan: &Plan, mb: usize, stage: usize) -> Option<Hop> {
        self.position(mb, stage).map(|i| plan.routes[mb][i])
    }
    /// Hop after `stage` on `mb`'s route, in O(1).
    pub fn next(&self, plan: &Plan, mb: usize, stage: usize) -> Option<Hop> {
        self.position(mb, stage)
            .and_then(|i| plan.routes[mb].get(i + 1).copied())
    }
    /// Hop before `stage` on `mb`'s route, in O(1).
    pub fn prev(&self, plan: &Plan, mb: usize, stage: usize) -> Option<Hop> {
        self.position(mb, stage)
            .and_then(|i| i.checked_sub(1).map(|j| plan.routes[mb][j]))
    }
}

/// Who talks to whom, derived from a plan in one place: each stage's replica group (the hosts
/// whose gradients are summed, in a fixed order) and the stages each worker holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    /// `groups[s]` = hosts of stage `s`, ascending: the all-reduce group of its gradients.
    pub groups: Vec<Vec<usize>>,
    /// `held[w]` = stages worker `w` hosts, in model order.
    pub held: Vec<Vec<usize>>,
    /// Every worker, for reductions over the whole job (loss, gradient norm).
    pub everyone: Vec<usize>,
}

impl Topology {
    pub fn new(plan: &Plan) -> Self {
        let hosts: Vec<&[usize]> = plan.stages.iter().map(|st| &st.hosts[..]).collect();
        Self::of_hosts(&hosts, plan.num_workers())
    }

    /// The topology of stages hosted by `hosts[s]`, among `workers` workers.
    pub fn of_hosts(hosts: &[&[usize]], workers: usize) -> Self {
        let groups: Vec<Vec<usize>> = hosts
            .iter()
            .map(|h| {
                let mut g = h.to_vec();
                g.sort_unstable();
                g.dedup();
                g
            })
            .collect();
        let mut held = vec![Vec::new(); workers];
        for (s, g) in groups.iter().enumerate() {
            for &w in g {
                if let Some(h) = held.get_mut(w) {
                    h.push(s);
                }
            }
        }
        Topology {
            groups,
            held,
            everyone: (0..workers).collect(),
        }
    }
    /// Is `w` the first host of `s` (the one that counts the stage once in job-wide sums)?
    pub fn leads(&self, w: usize, s: usize) -> bool {
        self.groups[s].first() == Some(&w)
    }
}

impl Plan {
    /// One pipeline: stage `s` on worker `placement[s]`, one layer per stage, every
    /// micro-batch through every stage in model order.
    pub fn pipeline(
        kind: ScheduleKind,
        placement: Vec<usize>,
        num_microbatches: usize,
        workers: Vec<Vec<Action>>,
    ) -> Plan {
        let routes = (0..num_microbatches)
            .map(|_| {
                placement
                    .iter()
                    .enumerate()
                    .map(|(s, &w)| Hop {
                        stage: s,
                        worker: w,
                    })
                    .collect()
            })
            .collect();
        Plan {
            kind,
            num_microbatches,
            stages: placement
                .iter()
                .map(|&w| StagePlan {
                    layers: 1,
                    hosts: vec![w],
                    cost: None,
                })
                .collect(),
            routes,
            workers,
            devices: Vec::new(),
        }
    }

    /// `d` data-parallel copies of this plan: replica `r` runs on workers `r P .. (r + 1) P`
    /// and micro-batches `r M .. (r + 1) M`; each stage is hosted once per replica.
    pub fn replicate(&self, d: usize) -> Result<Plan> {
        if d == 0 {
            return Err(Error::shape(Field::Replicas, 0, "needs at least 1 replica"));
        }
        let (p, m) = (self.num_workers(), self.num_microbatches);
        let chunks = self.num_stages().div_ceil(p.max(1)).max(1);
        check_size(p, chunks, d, m)?;
        let mut out = Plan {
            kind: self.kind,
            num_microbatches: m * d,
            stages: self
                .stages
                .iter()
                .map(|st| StagePlan {
                    hosts: (0..d)
                        .flat_map(|r| st.hosts.iter().map(move |&w| r * p + w))
                        .collect(),
                    ..st.clone()
                })
                .collect(),
            routes: Vec::with_capacity(m * d),
            workers: Vec::with_capacity(p * d),
            devices: Vec::new(),
        };
        for r in 0..d {
            out.routes.extend(self.routes.iter().map(|route| {
                route
                    .iter()
                    .map(|h| Hop {
                        stage: h.stage,
                        worker: r * p + h.worker,
                    })
                    .collect::<Vec<_>>()
            }));
        }
        for r in 0..d {
            out.workers.extend(self.workers.iter().map(|acts| {
                acts.iter()
                    .map(|a| Action {
                        mb: r * m + a.mb,
                        ..*a
                    })
                    .collect::<Vec<_>>()
            }));
        }
        Ok(out)
    }

    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }
    /// Data-parallel replicas: the most hosts any stage has (1 for a plain pipeline).
    pub fn replicas(&self) -> usize {
        self.stages
            .iter()
            .map(|s| s.hosts.len())
            .max()
            .unwrap_or(1)
            .max(1)
    }
    pub fn num_workers(&self) -> usize {
        self.workers.len()
    }
    /// Model layers the plan covers (sum over stages).
    pub fn num_layers(&self) -> usize {
        self.stages.iter().map(|s| s.layers).sum()
    }
    /// Layers per stage.
    pub fn layers_per_stage(&self) -> Vec<usize> {
        self.stages.iter().map(|s| s.layers).collect()
    }
    /// The model layers of each stage, as ranges.
    pub fn layer_ranges(&self) -> Vec<Range<usize>> {
        let mut lo = 0;
        self.stages
            .iter()
            .map(|s| {
                let r = lo..lo + s.layers;
                lo = r.end;
                r
            })
            .collect()
    }
    /// Set the layers each stage holds.
    pub fn set_layers(&mut self, layers_per_stage: &[usize]) {
        for (st, &n) in self.stages.iter_mut().zip(layers_per_stage) {
            st.layers = n;
        }
    }
    /// Per-stage costs, when the plan carries them for every stage.
    pub fn stage_costs(&self) -> Option<Vec<StageCost>> {
        self.stages.iter().map(|s| s.cost).collect()
    }
    /// Stages hosted by worker `w`, in model order.
    pub fn stages_of(&self, w: usize) -> Vec<usize> {
        (0..self.num_stages())
            .filter(|&s| self.stages[s].hosts.contains(&w))
            .collect()
    }
    /// The stages of every worker, in model order: [`Plan::stages_of`] for all workers in one
    /// pass over the stages (linear in the plan, where asking each worker would be quadratic).
    pub fn stages_by_worker(&self) -> Vec<Vec<usize>> {
        let mut out = vec![Vec::new(); self.num_workers()];
        for (s, st) in self.stages.iter().enumerate() {
            for &h in &st.hosts {
                if let Some(v) = out.get_mut(h) {
                    if v.last() != Some(&s) {
                        v.push(s);
                    }
                }
            }
        }
        out
    }
    /// The default route: every stage in model order.
    pub fn full_routes(num_stages: usize, num_microbatches: usize) -> Vec<Vec<usize>> {
        vec![(0..num_stages).collect(); num_microbatches]
    }
    /// Does the plan split any backward into `B` and `W`?
    pub fn splits_backward(&self) -> bool {
        self.workers.iter().flatten().any(|a| a.op == Op::W)
    }
    /// Does any worker host several stages (cells then name the stage)?
    pub(crate) fn multi_stage(&self) -> bool {
        self.stages_by_worker().iter().any(|v| v.len() > 1)
    }

    // ---- views ----

    /// Text grid, one row per step and one column per worker, e.g. `F3` or `F3s5` when a
    /// worker holds several stages.
    pub fn grid(&self) -> String {
        let multi = self.multi_stage();
        let cell = |a: &Action| a.cell(multi);
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

//! Discrete-event simulator: runs a plan's per-worker orders on a cluster.
//!
//! Compute costs come from per-stage [`StageCost`]s divided by the worker's device speed.
//! After `F(s, m)` the stage's output travels to the worker of the next stage on `m`'s route;
//! after `B`/`BW(s, m)` a gradient of the stage's input travels to the previous stage. Each
//! directed link is a FIFO resource busy for `latency + bytes / bandwidth + overhead`; sends do
//! not block compute.

use super::setup::{Dispatch, SimOptions, SimSetup};
use crate::cluster::Cluster;
use crate::error::{Error, Result};
use crate::plan::deps::{needs, Need};
use crate::plan::ir::{Action, Hop, Op, Plan, RouteIndex, Topology};
use crate::profile::static_bytes;
use crate::profile::StageCost;
use crate::schedule::Time;
use crate::sim::timeline::{SpanKind, TimedAction, TimedSpan, TimedTransfer, Timeline};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// In-flight activations of one worker at their peak.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct MemoryPeak {
    /// Stage-chunk activations (one stage, one micro-batch) held at once.
    pub chunks: usize,
    /// Distinct micro-batches with activations held at once.
    pub microbatches: usize,
    /// Bytes of activations held at once.
    pub activation_bytes: u64,
    /// Weights, gradients and optimizer state of the worker's stages.
    pub static_bytes: u64,
}

/// Peaks of in-flight activations along each worker's order: an activation lives from its `F`
/// to the `W` or `BW` that ends its stage's backward. Order alone decides it, not costs.
pub fn memory_peaks(plan: &Plan, stages: &[StageCost]) -> Vec<MemoryPeak> {
    let m = plan.num_microbatches;
    let mut per_mb = vec![0usize; m];
    let hosted = plan.stages_by_worker();
    plan.workers
        .iter()
        .enumerate()
        .map(|(w, acts)| {
            per_mb.iter_mut().for_each(|c| *c = 0);
            let (mut chunks, mut mbs, mut bytes) = (0usize, 0usize, 0u64);
            let mut peak = MemoryPeak::default();
            for a in acts {
                let kept = stages.get(a.stage).map_or(0, |c| c.activation_kept);
                if a.op == Op::F {
                    chunks += 1;
                    bytes += kept;
                    if per_mb[a.mb] == 0 {
                        mbs += 1;
                    }
                    per_mb[a.mb] += 1;
                    peak.chunks = peak.chunks.max(chunks);
                    peak.microbatches = peak.microbatches.max(mbs);
                    peak.activation_bytes = peak.activation_bytes.max(bytes);
                } else if a.op.frees_activation() {
                    chunks = chunks.saturating_sub(1);
                    bytes = bytes.saturating_sub(kept);
                    per_mb[a.mb] = per_mb[a.mb].saturating_sub(1);
                    if per_mb[a.mb] == 0 {
                        mbs = mbs.saturating_sub(1);
                    }
                }
            }
            peak.static_bytes = hosted[w]
                .iter()
                .map(|&s| stages.get(s).map_or(0, |c| static_bytes(c.params)))
                .sum();
            peak
        })
        .collect()
}

/// Check per-device memory caps of the cluster (bytes and/or micro-batches in flight).
pub fn check_memory(plan: &Plan, stages: &[StageCost], cluster: &Cluster) -> Result<()> {
    for (w, peak) in memory_peaks(plan, stages).iter().enumerate() {
        let d = &cluster.devices[w];
        if let Some(cap) = d.memory_microbatches {
            if peak.microbatches > cap as usize {
                return Err(Error::Invalid(format!(
                    "worker {w} (device {}): {} micro-batches in flight, memory_microbatches allows {cap}",
                    d.name, peak.microbatches
                )));
            }
        }
        if let Some(cap) = d.memory {
            let need = peak.static_bytes + peak.activation_bytes;
            if need > cap {
                return Err(Error::Invalid(format!(
                    "worker {w} (device {}): needs {need} bytes ({} weights+grads+AdamW, {} activations), memory is {cap}",
                    d.name, peak.static_bytes, peak.activation_bytes
                )));
            }
        }
    }
    Ok(())
}

/// Per directed link: bytes carried and time busy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LinkUse {
    pub from: usize,
    pub to: usize,
    pub bytes: u64,
    pub busy: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SimResult {
    /// Last action's end: the pipeline part of the iteration.
    pub makespan: f64,
    /// Makespan, or later when a stage's gradient all-reduce ends after it.
    pub iteration_time: f64,
    /// Ring all-reduce time of each stage's gradients among its hosts (0 for one host).
    pub allreduce: Vec<f64>,
    pub busy: Vec<f64>,
    pub bubble_fraction: f64,
    pub peak_activations: Vec<usize>,
    pub peak_activation_bytes: Vec<u64>,
    pub peak_memory_bytes: Vec<u64>,
    pub links: Vec<LinkUse>,
    #[serde(skip)]
    pub timeline: Timeline,
}

const UNKNOWN: f64 = f64::INFINITY;

/// Mutable state of one simulation run.
struct State<'a> {
    plan: &'a Plan,
    stages: &'a [StageCost],
    cluster: &'a Cluster,
    routes: RouteIndex,
    m: usize,
    /// Arrival at the consuming worker: input activation of F(s, m); gradient for B(s, m).
    input_at: Vec<f64>,
    grad_at: Vec<f64>,
    f_done: Vec<f64>,
    b_done: Vec<f64>,
    head: Vec<usize>,
    free_at: Vec<f64>,
    busy: Vec<f64>,
    /// Per directed link used: when it is next free, bytes carried, time busy. Sparse: a plan
    /// uses few of the P x P pairs, and P may be large.
    link_use: std::collections::BTreeMap<(usize, usize), (f64, u64, f64)>,
    timeline: Timeline,
    events: BinaryHeap<Reverse<(Time, usize)>>,
    /// Workers whose next action waits on (stage, mb)'s results.
    waiting: Vec<Vec<usize>>,
    /// With shared compute: its busy intervals, sorted by start.
    shared: Option<Vec<(f64, f64)>>,
    options: SimOptions,
}

/// The earliest start at or after `ready` of an interval of length `d` that overlaps none of
/// `slots` (sorted, disjoint busy intervals); records it there. Touching intervals are merged,
/// so a resource that is rarely idle keeps few of them and a claim near the end is cheap.
fn claim(slots: &mut Vec<(f64, f64)>, ready: f64, d: f64) -> f64 {
    let mut i = slots.partition_point(|&(_, e)| e <= ready);
    let mut start = ready;
    while let Some(&(s, e)) = slots.get(i) {
        if start + d <= s {
            break;
        }
        start = start.max(e);
        i += 1;
    }
    if d <= 0.0 {
        return start;
    }
    let end = start + d;
    let joins_prev = i > 0 && slots[i - 1].1 >= start;
    let joins_next = i < slots.len() && slots[i].0 <= end;
    match (joins_prev, joins_next) {
        (true, true) => {
            slots[i - 1].1 = slots[i].1;
            slots.remove(i);
        }
        (true, false) => slots[i - 1].1 = end,
        (false, true) => slots[i].0 = start,
        (false, false) => slots.insert(i, (start, end)),
    }
    start
}

impl<'a> State<'a> {
    fn new(plan: &'a Plan, stages: &'a [StageCost], cluster: &'a Cluster) -> Self {
        let (p, s, m) = (plan.num_workers(), plan.num_stages(), plan.num_microbatches);
        let mut input_at = vec![UNKNOWN; s * m];
        for (mb, r) in plan.routes.iter().enumerate() {
            if let Some(h) = r.first() {
                input_at[h.stage * m + mb] = 0.0;
            }
        }
        State {
            plan,
            stages,
            cluster,
            routes: RouteIndex::new(plan),
            m,
            input_at,
            grad_at: vec![UNKNOWN; s * m],
            f_done: vec![UNKNOWN; s * m],
            b_done: vec![UNKNOWN; s * m],
            head: vec![0; p],
            free_at: vec![0.0; p],
            busy: vec![0.0; p],
            link_use: std::collections::BTreeMap::new(),
            timeline: Timeline {
                worker_names: (0..p).map(|w| cluster.devices[w].name.clone()).collect(),
                actions: Vec::with_capacity(plan.workers.iter().map(Vec::len).sum()),
                transfers: Vec::new(),
                marks: Vec::new(),
                spans: Vec::new(),
                idle_devices: Vec::new(),
            },
            events: BinaryHeap::new(),
            waiting: vec![Vec::new(); s * m],
            shared: None,
            options: SimOptions::default(),
        }
    }

    fn duration(&self, w: usize, a: &Action) -> f64 {
        let c = &self.stages[a.stage];
        let work = match a.op {
            Op::F => c.forward,
            Op::B => c.backward_input,
            Op::W => c.backward_weight,
            Op::BW => c.full_backward(),
        };
        work / self.cluster.devices[w].speed
    }

    /// Start worker w's next action if its inputs' arrival times are known; else wait.
    fn try_start(&mut self, w: usize) {
        let Some(a) = self.plan.workers[w].get(self.head[w]).copied() else {
            return;
        };
        let k = a.stage * self.m + a.mb;
        let prev = self.routes.prev(self.plan, a.mb, a.stage).map(|h| h.stage);
        let next = self.routes.next(self.plan, a.mb, a.stage).map(|h| h.stage);
        // When each need of the IR's dependency rule is met here (received, for a neighbour's).
        let ready = needs(a.op, a.stage, prev, next)
            .into_iter()
            .flatten()
            .map(|n| match n {
                Need::Forward(st) if st == a.stage => self.f_done[k],
                Need::Forward(_) => self.input_at[k],
                Need::InputGrad(st) if st == a.stage => self.b_done[k],
                Need::InputGrad(_) => self.grad_at[k],
            })
            .fold(0.0, f64::max);
        if ready == UNKNOWN {
            self.waiting[k].push(w);
            return;
        }
        let d = self.duration(w, &a);
        let start = match &mut self.shared {
            None => ready.max(self.free_at[w]),
            Some(slots) => claim(slots, ready.max(self.free_at[w]), d),
        };
        let end = start + d;
        self.busy[w] += end - start;
        self.free_at[w] = end + self.options.idle_gap;
        self.timeline.actions.push(TimedAction {
            worker: w,
            action: a,
            start,
            end,
        });
        self.events
            .push(Reverse((Time(end), self.timeline.actions.len() - 1)));
    }

    /// Send `a`'s result from worker `w` at time `t` to hop `dest` over the directed link's
    /// FIFO; returns the (stage, mb) key whose arrival time is now known.
    fn send(
        &mut self,
        w: usize,
        t: f64,
        a: Action,
        dest: Hop,
        bytes: u64,
        gradient: bool,
    ) -> usize {
        let (to_stage, to) = (dest.stage, dest.worker);
        let at = if to == w {
            t
        } else {
            let (free, carried, busy) = self.link_use.entry((w, to)).or_insert((0.0, 0, 0.0));
            let start = if self.options.no_link_queue {
                t
            } else {
                t.max(*free)
            };
            let end = start + self.cluster.transfer_time(w, to, bytes);
            *free = end;
            *carried += bytes;
            *busy += end - start;
            self.timeline.transfers.push(TimedTransfer {
                from: w,
                to,
                action: a,
                bytes,
                start,
                end,
            });
            end
        };
        let key = to_stage * self.m + a.mb;
        if gradient {
            self.grad_at[key] = at;
        } else {
            self.input_at[key] = at;
        }
        key
    }

    /// Action `idx` ended at `t`: record its results, send them on, wake who waits.
    fn complete(&mut self, t: f64, idx: usize) {
        let TimedAction {
            worker: w,
            action: a,
            ..
        } = self.timeline.actions[idx];
        let k = a.stage * self.m + a.mb;
        let next = self.routes.next(self.plan, a.mb, a.stage);
        let prev = self.routes.prev(self.plan, a.mb, a.stage);
        let mut wake = Vec::with_capacity(2);
        match a.op {
            Op::F => {
                self.f_done[k] = t;
                wake.push(k);
                match next {
                    Some(n) => {
                        wake.push(self.send(w, t, a, n, self.stages[a.stage].activation_out, false))
                    }
                    None => self.grad_at[k] = t,
                }
            }
            Op::B | Op::BW => {
                if a.op == Op::B {
                    self.b_done[k] = t;
                    wake.push(k);
                }
                if let Some(pv) = prev {
                    let bytes = self.stages[pv.stage].activation_out;
                    wake.push(self.send(w, t, a, pv, bytes, true));
                }
            }
            Op::W => {}
        }
        self.head[w] += 1;
        self.try_start(w);
        for key in wake {
            for v in std::mem::take(&mut self.waiting[key]) {
                self.try_start(v);
            }
        }
    }
}

/// Every message a route sends must arrive in finite time: an infinite link time (bandwidth 0, a
/// latency past f64) is refused naming the link, not simulated into a plan that never ends.
/// So is a plan whose compute (`work`) and messages, one after another, overflow f64 seconds
/// (a latency of 1e308 s is finite once, not twice): the makespan is at most that sum.
fn check_link_times(plan: &Plan, stages: &[StageCost], cluster: &Cluster, work: f64) -> Result<()> {
    let (mut total, mut slowest) = (work, (0.0, 0, 0, 0));
    for route in &plan.routes {
        for hop in route.windows(2) {
            let (a, b) = (hop[0].worker, hop[1].worker);
            let bytes = stages[hop[0].stage].activation_out;
            let secs = cluster.transfer_time(a, b, bytes);
            if !secs.is_finite() {
                return Err(Error::Invalid(format!(
                    "the link from worker {a} ({}) to worker {b} ({}) takes {secs} s for {bytes} bytes: messages on it never arrive",
                    cluster.devices[a].name, cluster.devices[b].name
                )));
            }
            // The activation forward, its gradient back.
            total += 2.0 * secs;
            if secs > slowest.0 {
                slowest = (secs, a, b, bytes);
            }
        }
    }
    if !total.is_finite() {
        let (secs, a, b, bytes) = slowest;
        return Err(Error::Invalid(format!(
            "the plan's messages take more seconds than f64 holds: the link from worker {a} ({}) to worker {b} ({}) takes {secs:e} s for {bytes} bytes (check latency, overhead and bandwidth)",
            cluster.devices[a].name, cluster.devices[b].name
        )));
    }
    Ok(())
}

/// Simulate; the plan should have been validated (a stuck plan is still reported, not hung).
pub fn simulate(setup: &SimSetup) -> Result<SimResult> {
    simulate_with(setup, SimOptions::default())
}

/// [`simulate`] under `options`: under arrival dispatch, the plan's routes in the orders that
/// dispatch gives them.
pub fn simulate_with(setup: &SimSetup, options: SimOptions) -> Result<SimResult> {
    if options.dispatch == Dispatch::Plan {
        return simulate_orders(setup, options);
    }
    let plan = super::dispatch::arrival_orders(setup, &options)?;
    let options = SimOptions {
        dispatch: Dispatch::Plan,
        ..options
    };
    simulate_orders(
        &SimSetup {
            plan: &plan,
            ..*setup
        },
        options,
    )
}

/// Refuse what cannot be simulated: stage costs that do not match the plan, too few devices,
/// a total compute time that overflows, links that never deliver.
fn check_simulable(setup: &SimSetup) -> Result<()> {
    let SimSetup {
        plan,
        stages,
        cluster,
    } = *setup;
    let (p, s) = (plan.num_workers(), plan.num_stages());
    if stages.len() != s {
        return Err(Error::Invalid(format!(
            "{} stage costs for a plan of {s} stages",
            stages.len()
        )));
    }
    if cluster.len() < p {
        return Err(Error::Invalid(format!(
            "the plan needs {p} workers but the cluster has {} devices",
            cluster.len()
        )));
    }
    // Times must stay finite: a sum of the work that overflows f64 is refused, not simulated.
    let slowest = cluster
        .devices
        .iter()
        .take(p)
        .map(|d| d.speed)
        .fold(f64::INFINITY, f64::min);
    let work: f64 = (stages
        .iter()
        .map(|c| c.forward + c.backward_input + c.backward_weight)
        .sum::<f64>()
        * plan.num_microbatches as f64
        + stages.iter().map(|c| c.update).sum::<f64>())
        / slowest;
    if !work.is_finite() {
        return Err(Error::Invalid(format!(
            "the plan's total compute time overflows ({work} s): stage costs too large for f64 seconds"
        )));
    }
    check_link_times(plan, stages, cluster, work)
}

/// Simulate the plan's own worker orders under `options` (its dispatch aside).
fn simulate_orders(setup: &SimSetup, options: SimOptions) -> Result<SimResult> {
    check_simulable(setup)?;
    let SimSetup {
        plan,
        stages,
        cluster,
    } = *setup;
    let p = plan.num_workers();
    let mut st = State::new(plan, stages, cluster);
    if options.shared_compute {
        st.shared = Some(Vec::new());
    }
    st.options = options;
    for w in 0..p {
        st.try_start(w);
    }
    let mut completed = 0usize;
    while let Some(Reverse((Time(t), idx))) = st.events.pop() {
        completed += 1;
        st.complete(t, idx);
    }
    let State {
        head,
        busy,
        link_use,
        mut timeline,
        shared,
        ..
    } = st;
    let total: usize = plan.workers.iter().map(Vec::len).sum();
    if completed != total {
        let stuck: Vec<String> = (0..p)
            .filter(|&w| head[w] < plan.workers[w].len())
            .map(|w| {
                format!(
                    "worker {w} at step {} {}",
                    head[w], plan.workers[w][head[w]]
                )
            })
            .collect();
        return Err(Error::Internal(format!(
            "simulation stuck after {completed} of {total} actions: {}",
            stuck.join(", ")
        )));
    }
    let makespan = timeline.actions.iter().map(|a| a.end).fold(0.0, f64::max);
    let (allreduce, iteration_time) = iteration_end_of(setup, &mut timeline, shared, makespan);
    let work: f64 = busy.iter().sum();
    let bubble_fraction = if makespan > 0.0 {
        1.0 - work / (p as f64 * makespan)
    } else {
        0.0
    };
    let peaks = memory_peaks(plan, stages);
    let links = link_use
        .into_iter()
        .filter(|(_, (_, bytes, busy))| *bytes > 0 || *busy > 0.0)
        .map(|((from, to), (_, bytes, busy))| LinkUse {
            from,
            to,
            bytes,
            busy,
        })
        .collect();
    Ok(SimResult {
        makespan,
        iteration_time,
        allreduce,
        busy,
        bubble_fraction,
        peak_activations: peaks.iter().map(|x| x.chunks).collect(),
        peak_activation_bytes: peaks.iter().map(|x| x.activation_bytes).collect(),
        peak_memory_bytes: peaks
            .iter()
            .map(|x| x.activation_bytes + x.static_bytes)
            .collect(),
        links,
        timeline,
    })
}

/// The iteration past the pipeline's `makespan`: each stage's gradients all-reduced among its
/// hosts as soon as the last of them has finished the stage's backward (overlapping other
/// stages' work, as bucketed DDP does), then each worker's optimizer step over the stages it
/// holds (one after another, in the order they become ready, when the compute is `shared`).
/// Both are drawn on `timeline`; returns each stage's all-reduce time and the iteration time.
fn iteration_end_of(
    setup: &SimSetup,
    timeline: &mut Timeline,
    shared: Option<Vec<(f64, f64)>>,
    makespan: f64,
) -> (Vec<f64>, f64) {
    let SimSetup {
        plan,
        stages,
        cluster,
    } = *setup;
    let topo = Topology::new(plan);
    let mut done = vec![0.0f64; plan.num_stages()];
    for a in &timeline.actions {
        if a.action.op.frees_activation() {
            done[a.action.stage] = done[a.action.stage].max(a.end);
        }
    }
    let allreduce: Vec<f64> = (0..done.len())
        .map(|st| ring_allreduce_time(cluster, &topo.groups[st], stages[st].params))
        .collect();
    let mut steps = optimizer_steps(&topo.held, &done, &allreduce, stages, cluster);
    let span = |worker, kind, stage, start, end| TimedSpan {
        worker,
        kind,
        stage,
        start,
        end,
        message: None,
    };
    for (st, group) in topo.groups.iter().enumerate() {
        if group.len() > 1 && allreduce[st] > 0.0 {
            for &w in group {
                let end = done[st] + allreduce[st];
                timeline
                    .spans
                    .push(span(w, SpanKind::AllReduce, Some(st), done[st], end));
            }
        }
    }
    let Some(mut slots) = shared else {
        for (w, &(ready, update)) in steps.iter().enumerate() {
            if update > 0.0 {
                let end = ready + update;
                timeline
                    .spans
                    .push(span(w, SpanKind::OptimizerStep, None, ready, end));
            }
        }
        return (allreduce, iteration_end(makespan, &steps));
    };
    steps.sort_by(|a, b| a.0.total_cmp(&b.0));
    let end = steps
        .iter()
        .map(|&(ready, update)| claim(&mut slots, ready, update) + update)
        .fold(makespan, f64::max);
    (allreduce, end)
}

/// Each worker's optimizer step as (ready, seconds): ready when every stage it holds (`held`)
/// has finished its last backward (`done`) and its all-reduce (`allreduce`), per stage.
pub fn optimizer_steps(
    held: &[Vec<usize>],
    done: &[f64],
    allreduce: &[f64],
    stages: &[StageCost],
    cluster: &Cluster,
) -> Vec<(f64, f64)> {
    held.iter()
        .enumerate()
        .map(|(w, held)| {
            let ready = held
                .iter()
                .map(|&st| done[st] + allreduce[st])
                .fold(0.0, f64::max);
            let update: f64 = held.iter().map(|&st| stages[st].update).sum();
            (ready, update / cluster.devices[w].speed)
        })
        .collect()
}

/// The iteration's end when each worker steps its optimizer on its own compute as soon as the
/// step is ready: the latest of the pipeline's `makespan` and every step's end.
pub fn iteration_end(makespan: f64, steps: &[(f64, f64)]) -> f64 {
    steps.iter().map(|(r, u)| r + u).fold(makespan, f64::max)
}

/// Ring all-reduce of `bytes` over `devices`: `2 (R - 1)` steps, each moving `bytes / R` over
/// every ring link at once, so each step lasts as long as the slowest link. The ring is ordered
/// as a topology-aware collective would order it: the order with the fastest slowest link
/// (searched exhaustively up to [`RING_SEARCH`] members, else the given order).
pub fn ring_allreduce_time(cluster: &Cluster, devices: &[usize], bytes: u64) -> f64 {
    let r = devices.len();
    if r < 2 {
        return 0.0;
    }
    let chunk = bytes.div_ceil(r as u64);
    let t = |a: usize, b: usize| cluster.transfer_time(a, b, chunk);
    let step = if r <= RING_SEARCH {
        let mut ring = devices.to_vec();
        let mut best = f64::INFINITY;
        slowest_ring_link(&mut ring, 1, 0.0, &t, &mut best);
        best
    } else {
        (0..r)
            .map(|i| t(devices[i], devices[(i + 1) % r]))
            .fold(0.0, f64::max)
    };
    2.0 * (r - 1) as f64 * step
}

/// Groups up to this size have their all-reduce ring searched exhaustively ((R - 1)! orders).
pub const RING_SEARCH: usize = 7;

/// Branch and bound over ring orders with `ring[..k]` fixed and the slowest link so far
/// `worst`: lowers `best` to the smallest slowest link of a completed ring.
fn slowest_ring_link(
    ring: &mut [usize],
    k: usize,
    worst: f64,
    t: &impl Fn(usize, usize) -> f64,
    best: &mut f64,
) {
    if worst >= *best {
        return;
    }
    let r = ring.len();
    if k == r {
        *best = worst.max(t(ring[r - 1], ring[0]));
        return;
    }
    for i in k..r {
        ring.swap(k, i);
        let w = worst.max(t(ring[k - 1], ring[k]));
        slowest_ring_link(ring, k + 1, w, t, best);
        ring.swap(k, i);
    }
}

/// The cluster's devices for a plan's workers, in worker order: the devices the plan names, or
/// the cluster's first devices when it names none.
pub fn devices_for_plan(plan: &Plan, cluster: &Cluster) -> Result<Cluster> {
    let p = plan.num_workers();
    if plan.devices.is_empty() {
        if cluster.len() < p {
            return Err(Error::Invalid(format!(
                "the plan needs {p} workers but the cluster has {} devices",
                cluster.len()
            )));
        }
        return Ok(cluster.subset(&(0..p).collect::<Vec<_>>()));
    }
    let index: std::collections::HashMap<&str, usize> = cluster
        .devices
        .iter()
        .enumerate()
        .map(|(i, d)| (d.name.as_str(), i))
        .collect();
    let ids = plan
        .devices
        .iter()
        .enumerate()
        .map(|(w, name)| {
            index.get(name.as_str()).copied().ok_or_else(|| {
                Error::Invalid(format!(
                    "the plan puts worker {w} on device {name:?}, which the cluster does not have"
                ))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(cluster.subset(&ids))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{generate, ScheduleKind};

    #[test]
    fn all_reduce_ring_takes_the_order_with_the_fastest_slowest_link() {
        // Five devices on a line, latency |i - j| s: the given order's ring closes over 4,
        // the best ring (0 1 3 4 2 or alike) never spans more than 2.
        let mut toml = String::from("[defaults]\nbandwidth = 1e18\n");
        for i in 0..5 {
            toml += &format!("[[devices]]\nname = \"d{i}\"\n");
        }
        for i in 0..5 {
            for j in i + 1..5 {
                toml += &format!(
                    "[[links]]\na = \"d{i}\"\nb = \"d{j}\"\nlatency = {}\n",
                    j - i
                );
            }
        }
        let c = Cluster::parse("line.toml", &toml).unwrap();
        let steps = 2.0 * 4.0;
        let t = ring_allreduce_time(&c, &[0, 1, 2, 3, 4], 1000);
        assert!((t - steps * 2.0).abs() < 1e-6, "{t}");
        // Any listing of the same devices gives the same ring.
        assert_eq!(t, ring_allreduce_time(&c, &[4, 2, 0, 3, 1], 1000));
        // Past the exhaustive size the given order is kept.
        let mut toml8 = String::from("[defaults]\nbandwidth = 1e18\n");
        for i in 0..RING_SEARCH + 1 {
            toml8 += &format!("[[devices]]\nname = \"d{i}\"\n");
        }
        for i in 0..RING_SEARCH + 1 {
            for j in i + 1..RING_SEARCH + 1 {
                toml8 += &format!(
                    "[[links]]\na = \"d{i}\"\nb = \"d{j}\"\nlatency = {}\n",
                    j - i
                );
            }
        }
        let c8 = Cluster::parse("line8.toml", &toml8).unwrap();
        let ids: Vec<usize> = (0..RING_SEARCH + 1).collect();
        let given = 2.0 * RING_SEARCH as f64 * RING_SEARCH as f64;
        assert!((ring_allreduce_time(&c8, &ids, 1000) - given).abs() < 1e-6);
    }

    fn unit(kind: ScheduleKind, p: usize, m: usize, v: usize) -> SimResult {
        let plan = generate(kind, p, m, v).unwrap();
        let stages = vec![StageCost::uniform(1.0, 1.0, 1.0); plan.num_stages()];
        simulate(&SimSetup {
            plan: &plan,
            stages: &stages,
            cluster: &Cluster::uniform(p),
        })
        .unwrap()
    }

    #[test]
    fn the_critical_path_runs_from_0_to_the_makespan_without_gaps() {
        for kind in [
            ScheduleKind::GPipe,
            ScheduleKind::OneFOneB,
            ScheduleKind::ZbH1,
        ] {
            for (p, m) in [(2, 4), (4, 8), (3, 3)] {
                let r = unit(kind, p, m, 1);
                let path = r.timeline.critical_path();
                assert_eq!(path[0].start, 0.0, "{kind:?} P={p} M={m}");
                assert_eq!(path.last().unwrap().end, r.makespan);
                // Each action starts when one before it ended (messages take no time here).
                for w in path.windows(2) {
                    assert!((w[1].start - w[0].end).abs() < 1e-9, "{kind:?}: {w:?}");
                }
                // 1F1B and GPipe with forward 1 and backward 2: the path holds the first
                // micro-batch's forwards down the pipeline, every micro-batch of one stage,
                // and the last's backwards back up: (M + P - 1) (F + B).
                if kind != ScheduleKind::ZbH1 {
                    let busy: f64 = path.iter().map(|a| a.end - a.start).sum();
                    assert_eq!(busy, ((m + p - 1) * 3) as f64, "{kind:?} P={p} M={m}");
                }
            }
        }
    }

    #[test]
    fn links_whose_messages_together_overflow_are_refused_naming_the_link() {
        let plan = generate(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
        let stages = vec![StageCost::uniform(1.0, 1.0, 1.0); 2];
        let run = |latency: f64| {
            let toml = format!(
                "[defaults]\nlatency = {latency:e}\n[[devices]]\nname = \"a\"\n[[devices]]\nname = \"b\"\n"
            );
            let cluster = Cluster::parse("c.toml", &toml).unwrap();
            simulate(&SimSetup {
                plan: &plan,
                stages: &stages,
                cluster: &cluster,
            })
        };
        // Each message is finite, four of them are not.
        let err = run(1e308).unwrap_err().to_string();
        assert!(
            err.contains("more seconds than f64 holds")
                && err.contains("worker 0 (a) to worker 1 (b)"),
            "{err}"
        );
        assert!(run(1e300).unwrap().makespan.is_finite());
    }

    #[test]
    fn each_worker_steps_the_optimizer_after_its_stages_are_done() {
        // 1F1B P=2 M=2, F 1 and BW 2: worker 1 ends its last backward at 7, worker 0 at 9.
        let plan = generate(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
        let run = |u0: f64, u1: f64, speed1: f64| {
            let mut stages = vec![StageCost::uniform(1.0, 1.0, 1.0); 2];
            (stages[0].update, stages[1].update) = (u0, u1);
            let mut cluster = Cluster::uniform(2);
            cluster.devices[1].speed = speed1;
            let r = simulate(&SimSetup {
                plan: &plan,
                stages: &stages,
                cluster: &cluster,
            })
            .unwrap();
            (r.makespan, r.iteration_time)
        };
        assert_eq!(run(0.0, 0.0, 1.0), (9.0, 9.0));
        assert_eq!(run(0.5, 2.0, 1.0), (9.0, 9.5));
        assert_eq!(run(0.5, 3.0, 1.0), (9.0, 10.0));
        // A faster device steps faster.
        assert_eq!(run(0.5, 6.0, 1.0).1, 13.0);
        assert!(run(0.5, 6.0, 2.0).1 < 13.0);
    }

    #[test]
    fn claim_takes_the_first_gap_that_fits() {
        let mut slots = Vec::new();
        assert_eq!(claim(&mut slots, 0.0, 2.0), 0.0);
        assert_eq!(claim(&mut slots, 5.0, 1.0), 5.0);
        assert_eq!(slots, vec![(0.0, 2.0), (5.0, 6.0)]);
        // Too long for the gap [2, 5): after the last interval.
        assert_eq!(claim(&mut slots, 1.0, 4.0), 6.0);
        assert_eq!(slots, vec![(0.0, 2.0), (5.0, 10.0)]);
        // Fits the gap exactly: the three become one.
        assert_eq!(claim(&mut slots, 0.0, 3.0), 2.0);
        assert_eq!(slots, vec![(0.0, 10.0)]);
        // Zero length takes no room.
        assert_eq!(claim(&mut slots, 4.0, 0.0), 10.0);
        assert_eq!(slots, vec![(0.0, 10.0)]);
    }

    #[test]
    fn shared_compute_runs_one_action_at_a_time() {
        let kinds = [
            (ScheduleKind::GPipe, 1),
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::ZbH1, 1),
            (ScheduleKind::Interleaved, 2),
            (ScheduleKind::ZbV, 2),
        ];
        for (kind, v) in kinds {
            for p in 1..=4 {
                for m in 1..=6 {
                    let Ok(plan) = generate(kind, p, m, v) else {
                        continue;
                    };
                    let mut stages = vec![StageCost::uniform(1.0, 1.5, 0.7); plan.num_stages()];
                    stages.iter_mut().for_each(|c| c.update = 0.3);
                    let setup = SimSetup {
                        plan: &plan,
                        stages: &stages,
                        cluster: &Cluster::uniform(p),
                    };
                    let own = simulate(&setup).unwrap();
                    let shared = simulate_with(
                        &setup,
                        SimOptions {
                            shared_compute: true,
                            ..SimOptions::default()
                        },
                    )
                    .unwrap();
                    let mut spans: Vec<(f64, f64)> = shared
                        .timeline
                        .actions
                        .iter()
                        .map(|a| (a.start, a.end))
                        .collect();
                    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
                    for w in spans.windows(2) {
                        assert!(w[0].1 <= w[1].0 + 1e-9, "{kind:?} P{p} M{m}: {w:?} overlap");
                    }
                    let work: f64 = shared.busy.iter().sum();
                    assert!((work - own.busy.iter().sum::<f64>()).abs() < 1e-9);
                    // All the work plus every worker's optimizer step, one at a time.
                    assert!(shared.iteration_time >= work + 0.3 * p as f64 - 1e-9);
                    if p == 1 {
                        assert_eq!(shared.iteration_time, own.iteration_time);
                    }
                }
            }
        }
        // GPipe P=2 M=2, F 1 and BW 2: the one resource is never idle, 12 units of work.
        let plan = generate(ScheduleKind::GPipe, 2, 2, 1).unwrap();
        let stages = vec![StageCost::uniform(1.0, 1.0, 1.0); 2];
        let setup = SimSetup {
            plan: &plan,
            stages: &stages,
            cluster: &Cluster::uniform(2),
        };
        let r = simulate_with(
            &setup,
            SimOptions {
                shared_compute: true,
                ..SimOptions::default()
            },
        )
        .unwrap();
        assert_eq!(r.makespan, 12.0);
        assert_eq!(simulate(&setup).unwrap().makespan, 9.0);
    }

    #[test]
    fn closed_form_unit_costs() {
        let g = unit(ScheduleKind::GPipe, 4, 8, 1);
        assert_eq!(g.makespan, 33.0);
        assert!((g.bubble_fraction - 3.0 / 11.0).abs() < 1e-12);
        assert_eq!(g.peak_activations, [8, 8, 8, 8]);
        let o = unit(ScheduleKind::OneFOneB, 4, 8, 1);
        assert_eq!(o.makespan, 33.0);
        assert!((o.bubble_fraction - 3.0 / 11.0).abs() < 1e-12);
        assert_eq!(o.peak_activations, [4, 3, 2, 1]);
        let z = unit(ScheduleKind::ZbH1, 4, 8, 1);
        assert_eq!(z.makespan, 27.0, "{:?}", z.busy);
        assert!(
            z.peak_activations.iter().all(|&x| x <= 4),
            "{:?}",
            z.peak_activations
        );
        let i = unit(ScheduleKind::Interleaved, 4, 8, 2);
        assert_eq!(i.makespan, 57.0);
        let v = unit(ScheduleKind::ZbV, 4, 8, 2);
        assert!(
            v.bubble_fraction <= 0.06,
            "zbv bubble {} makespan {}",
            v.bubble_fraction,
            v.makespan
        );
        assert!(
            v.peak_activations.iter().all(|&x| x <= 8),
            "{:?}",
            v.peak_activations
        );
    }

    /// ZB-V at unit costs is never slower than torch.distributed.pipelining's ZBVZeroBubble
    /// (its unit-cost makespans as measured for issue 12), within the same 2P stage-chunks of
    /// activations per worker.
    #[test]
    fn zb_v_at_unit_cost_matches_or_beats_torch() {
        let torch = [
            (2, 2, 14.0),
            (2, 4, 25.0),
            (2, 8, 49.0),
            (4, 4, 30.0),
            (4, 8, 51.0),
            (4, 16, 99.0),
            (8, 8, 62.0),
            (8, 16, 103.0),
            (8, 32, 199.0),
        ];
        for (p, m, theirs) in torch {
            let v = unit(ScheduleKind::ZbV, p, m, 2);
            assert!(
                v.makespan <= theirs,
                "P={p} M={m}: {} > {theirs}",
                v.makespan
            );
            assert!(v.peak_activations.iter().all(|&x| x <= 2 * p));
        }
    }
}

//! SkipPipe's route scheduler: data nodes hold the embedding stage and the head, the other
//! devices form a pool per middle stage, and each micro-batch's route skips `skip` middle
//! stages (and may swap neighbours) on workers chosen for the network, no middle worker
//! serving more than the load cap. The search starts from the candidate placement (data nodes
//! with the fastest links to the rest, or with the fastest all-reduce ring) where greedy
//! routes (each hop to the least-loaded pool worker reached fastest) are fastest; then a
//! seeded local search with the simulator's times in the loop (iteration time, the per-stage
//! all-reduce included) changes hop workers, exchanges whole routes, trades skipped stages,
//! toggles swaps and exchanges devices' places, accepting some slower candidates early on
//! (simulated annealing). Worker orders come from list scheduling in simulated time under
//! each device's in-flight cap (`sim::dispatch`), whose times the simulator reproduces. A last
//! phase then walks among routes no slower there towards the fastest in SkipPipe's own cost
//! model (`sim::slotted`), where routes that tie here can differ by seconds. Two
//! baselines run under the same rules and micro-batches: the full pipeline, searched the
//! same way, and random skipping (network-blind, and on this placement).

use crate::cluster::Cluster;
use crate::error::{Error, Field, Result};
use crate::plan::ir::Topology;
use crate::plan::ir::{Hop, Op, Plan, StagePlan};
use crate::plan::validate::ValidPlan;
use crate::profile::Profile;
use crate::rng::Lcg;
use crate::search::partition::{min_max_split, prefix};
use crate::search::skip::{check_skip_rules, neighbour_swaps, SkipRules};
use crate::sim::dispatch::{route_schedule, Order, RouteSchedule};
use crate::sim::slotted::{plan_slots, slotted_plan_time, slotted_time, SlottedSetup};
use crate::sim::{
    iteration_end, optimizer_steps, ring_allreduce_time, simulate_with, Dispatch, SimOptions,
    SimSetup,
};
use std::time::{Duration, Instant};

/// What to schedule.
#[derive(Debug, Clone)]
pub struct SkipSetup {
    /// Model stages (the head is added as a stage of its own on each data node).
    pub stages: usize,
    /// Middle stages each micro-batch skips.
    pub skip: usize,
    pub data_nodes: usize,
    /// Micro-batches per data node per iteration.
    pub microbatches: usize,
    pub max_swaps: usize,
    /// Local-search moves per search (the answer is deterministic for a seed within it).
    pub moves: usize,
    /// Wall-clock cap on the searches: they stop early when it is reached, and the result
    /// says so ([`SkipResult::time_limit_hit`]). Within it, the answer depends on the inputs,
    /// the seed and the move budgets alone.
    pub time_limit: Duration,
    pub seed: u64,
    /// How candidates are priced: pipewright's simulator as it is, or with SkipPipe's
    /// mechanics (arrival dispatch, an idle gap after each action, links that do not queue).
    pub mechanics: SimOptions,
    /// Micro-batches a middle stage's worker serves per iteration at most (SkipPipe's TC1).
    pub max_node_load: Option<usize>,
    /// Moves of a last phase that lowers the routes' time in SkipPipe's own cost model
    /// (`sim::slotted`) without raising the iteration time the search found; 0 skips it.
    pub polish_moves: usize,
}

/// The scheduler's answer and its baselines (iteration times in seconds).
#[derive(Debug, Clone)]
pub struct SkipResult {
    pub skip_time: f64,
    /// The skip plan's pipeline time (no all-reduce) in SkipPipe's cost model, `None` if a
    /// micro-batch never comes back there.
    pub skip_time_skippipe: Option<f64>,
    pub full_pipeline_time: f64,
    /// Network-blind random skipping: random placement and routes.
    pub random_skip_time: f64,
    /// SkipPipe's random baseline: this scheduler's network-aware placement, random routes.
    pub random_routes_time: f64,
    pub scheduler_seconds: f64,
    /// Local-search moves tried.
    pub moves: usize,
    /// The time limit stopped a search before its move budget: the plan then depends on the
    /// machine's speed and load, not only on the inputs and the seed.
    pub time_limit_hit: bool,
    pub plan: ValidPlan,
    pub full_plan: Plan,
    pub random_plan: Plan,
}

/// Who hosts what: data nodes (embedding and head) and one pool of devices per middle stage.
#[derive(Debug, Clone)]
struct Placement {
    data: Vec<usize>,
    pools: Vec<Vec<usize>>,
}

/// The annealing's start temperature, as a fraction of the best iteration time so far.
const ANNEAL_START: f64 = 0.005;

/// The scheduler's working state: the problem and how a candidate is scored.
struct Problem<'a> {
    cluster: &'a Cluster,
    setup: &'a SkipSetup,
    layers_per_stage: Vec<usize>,
    stage_costs: Vec<crate::profile::StageCost>,
    cap: Vec<usize>,
    /// Seconds of each (worker, stage, forward / whole backward), looked up rather than
    /// divided out for every action of every candidate.
    times: Vec<f64>,
    /// Seconds of each (from, to, stage)'s activation on the link, on clusters small enough
    /// for the table (`LINK_TABLE` entries).
    links: Option<Vec<f64>>,
}

/// The largest link table the search keeps (8 bytes each).
const LINK_TABLE: usize = 1 << 22;

impl<'a> Problem<'a> {
    fn new(
        cluster: &'a Cluster,
        setup: &'a SkipSetup,
        layers_per_stage: Vec<usize>,
        stage_costs: Vec<crate::profile::StageCost>,
        cap: Vec<usize>,
    ) -> Self {
        let (n, s) = (cluster.len(), stage_costs.len());
        let times = (0..n)
            .flat_map(|w| {
                let speed = cluster.devices[w].speed;
                stage_costs
                    .iter()
                    .flat_map(move |c| [c.forward / speed, c.full_backward() / speed])
            })
            .collect();
        let links = (n.saturating_mul(n).saturating_mul(s) <= LINK_TABLE).then(|| {
            (0..n * n)
                .flat_map(|ab| {
                    let (a, b) = (ab / n, ab % n);
                    stage_costs
                        .iter()
                        .map(move |c| cluster.transfer_time(a, b, c.activation_out))
                })
                .collect()
        });
        Problem {
            cluster,
            setup,
            layers_per_stage,
            stage_costs,
            cap,
            times,
            links,
        }
    }
}

/// Routes as chosen middle stages (in visiting order) and a worker per hop.
#[derive(Debug, Clone)]
struct Routes {
    /// Per micro-batch: (middle stage, worker) in visiting order.
    mid: Vec<Vec<(usize, usize)>>,
    /// Micro-batches a middle worker may serve: the setup's cap for skip routes, none for the
    /// full-pipeline baseline (where every micro-batch visits every stage, it cannot hold).
    cap: usize,
}

impl Problem<'_> {
    fn middle(&self) -> usize {
        self.setup.stages - 1
    }

    fn home(&self, pl: &Placement, mb: usize) -> usize {
        pl.data[mb / self.setup.microbatches]
    }

    /// Each stage's hosts: the data nodes for stage 0 and the head, else the stage's pool.
    fn hosts<'p>(&self, pl: &'p Placement) -> Vec<&'p [usize]> {
        let head = self.setup.stages;
        (0..=head)
            .map(|st| {
                if st == 0 || st == head {
                    &pl.data[..]
                } else {
                    &pl.pools[st - 1][..]
                }
            })
            .collect()
    }

    /// Every micro-batch's whole route: its data node, the middle hops, the head back home.
    fn hops(&self, pl: &Placement, r: &Routes) -> Vec<Vec<Hop>> {
        let head = self.setup.stages;
        r.mid
            .iter()
            .enumerate()
            .map(|(mb, mid)| {
                let home = self.home(pl, mb);
                let hop = |stage, worker| Hop { stage, worker };
                std::iter::once(hop(0, home))
                    .chain(mid.iter().map(|&(stage, worker)| hop(stage, worker)))
                    .chain(std::iter::once(hop(head, home)))
                    .collect()
            })
            .collect()
    }

    /// Worker orders for `routes` by list scheduling, with the simulator's costs.
    fn schedule(&self, routes: &[Vec<Hop>], order: Order) -> Option<RouteSchedule> {
        let (cl, costs) = (self.cluster, &self.stage_costs);
        let (n, s) = (cl.len(), costs.len());
        route_schedule(
            n,
            routes,
            &self.cap,
            order,
            &self.setup.mechanics,
            |w, op, st| self.times[(w * s + st) * 2 + usize::from(op != Op::F)],
            |a, b, st| match &self.links {
                Some(t) => t[(a * n + b) * s + st],
                None => cl.transfer_time(a, b, costs[st].activation_out),
            },
        )
    }

    fn plan(&self, pl: &Placement, r: &Routes, order: Order) -> Option<Plan> {
        let routes = self.hops(pl, r);
        let workers = self.schedule(&routes, order)?.workers;
        let stages: Vec<StagePlan> = self
            .hosts(pl)
            .into_iter()
            .enumerate()
            .map(|(st, hosts)| StagePlan {
                layers: self.layers_per_stage[st],
                hosts: hosts.to_vec(),
                cost: Some(self.stage_costs[st]),
            })
            .collect();
        // Devices are named once for the plans returned (`skip_plan`), not for every scored
        // candidate: worker w is the cluster's device w either way.
        Some(Plan::custom(stages, routes, workers))
    }

    /// The worker orders a plan may take, the first being the one the search scores with:
    /// arrival order under arrival dispatch, else arrival order or backward-first, whichever
    /// is faster. (On the geo example, scoring in arrival order ends 1.3 s faster on average
    /// over six seeds than scoring backward-first: 74.8 s against 76.0 s without the
    /// all-reduce.)
    fn orders(&self) -> &'static [Order] {
        match self.setup.mechanics.dispatch {
            Dispatch::Arrival => &[Order::Arrival],
            Dispatch::Plan => &[Order::Arrival, Order::BackwardFirst],
        }
    }

    /// Iteration time (all-reduce included) as `simulate` gives it for the plan of these routes
    /// in the first of [`Self::orders`], infinity if it cannot run: taken from the list schedule's own
    /// times, which the simulator reproduces (tested), at a fraction of the cost.
    fn score(&self, pl: &Placement, r: &Routes) -> f64 {
        self.priced(pl, r).map_or(f64::INFINITY, |p| p.0)
    }

    /// [`Self::score`] with the routes and the list schedule it came from.
    fn priced(&self, pl: &Placement, r: &Routes) -> Option<(f64, Vec<Vec<Hop>>, RouteSchedule)> {
        let routes = self.hops(pl, r);
        let rs = self.schedule(&routes, self.orders()[0])?;
        let topo = Topology::of_hosts(&self.hosts(pl), self.cluster.len());
        let allreduce: Vec<f64> = topo
            .groups
            .iter()
            .zip(&self.stage_costs)
            .map(|(g, c)| ring_allreduce_time(self.cluster, g, c.params))
            .collect();
        let steps = optimizer_steps(
            &topo.held,
            &rs.stage_done,
            &allreduce,
            &self.stage_costs,
            self.cluster,
        );
        Some((iteration_end(rs.makespan, &steps), routes, rs))
    }

    /// SkipPipe's cost model's time for these routes if their iteration time is at most
    /// `bound`, else infinity.
    fn skippipe_within(&self, pl: &Placement, r: &Routes, bound: f64) -> f64 {
        match self.priced(pl, r) {
            Some((t, routes, rs)) if t <= bound => self.skippipe_time(&routes, &rs.workers),
            _ => f64::INFINITY,
        }
    }

    /// The routes with these worker orders in SkipPipe's cost model (`sim::slotted`), infinity
    /// if a micro-batch never comes back there.
    fn skippipe_time(&self, routes: &[Vec<Hop>], workers: &[Vec<crate::plan::ir::Action>]) -> f64 {
        let (n, s) = (self.cluster.len(), self.stage_costs.len());
        let Some(slots) = plan_slots(routes, workers, &self.cap) else {
            return f64::INFINITY;
        };
        let run = slotted_time(
            SlottedSetup {
                routes,
                slots: &slots,
                memory: &self.cap,
            },
            |w, op, st| self.times[(w * s + st) * 2 + usize::from(op != Op::F)],
            |a, b, st| match &self.links {
                Some(t) => t[(a * n + b) * s + st],
                None => self
                    .cluster
                    .transfer_time(a, b, self.stage_costs[st].activation_out),
            },
        );
        if run.finished == routes.len() {
            run.pipeline_time
        } else {
            f64::INFINITY
        }
    }

    /// Balanced skip sets: micro-batch i skips middle stages (i*skip + j) mod middle.
    fn visits(&self, skip: usize, mb: usize) -> Vec<usize> {
        let mid = self.middle();
        let skipped: Vec<usize> = (0..skip).map(|j| (mb * skip + j) % mid).collect();
        (1..=mid)
            .filter(|st| !skipped.contains(&(st - 1)))
            .collect()
    }

    /// Random balanced skip sets (micro-batches shuffled over them) and a random worker of each
    /// visited stage's pool.
    fn random_routes(&self, pl: &Placement, rng: &mut Lcg) -> Routes {
        let m = pl.data.len() * self.setup.microbatches;
        let mut order: Vec<usize> = (0..m).collect();
        for i in (1..m).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let cap = self.setup.max_node_load.unwrap_or(usize::MAX);
        let mut load = vec![0usize; self.cluster.len()];
        Routes {
            cap,
            mid: (0..m)
                .map(|mb| {
                    self.visits(self.setup.skip, order[mb])
                        .into_iter()
                        .map(|st| {
                            // A random worker of the pool that has room under the load cap.
                            let open: Vec<usize> = pl.pools[st - 1]
                                .iter()
                                .copied()
                                .filter(|&w| load[w] < cap)
                                .collect();
                            let w = open[rng.below(open.len())];
                            load[w] += 1;
                            (st, w)
                        })
                        .collect()
                })
                .collect(),
        }
    }

    /// Micro-batches each worker serves on the middle stages.
    fn loads(&self, r: &Routes) -> Vec<usize> {
        let mut load = vec![0usize; self.cluster.len()];
        r.mid.iter().flatten().for_each(|&(_, w)| load[w] += 1);
        load
    }

    /// Each hop to the least-used worker of the stage's pool, ties to the fastest link.
    fn greedy_routes(&self, pl: &Placement, skip: usize) -> Routes {
        let m = pl.data.len() * self.setup.microbatches;
        let mut load = vec![0usize; self.cluster.len()];
        let act = self.stage_costs[0].activation_out;
        let mid = (0..m)
            .map(|mb| {
                let mut at = self.home(pl, mb);
                self.visits(skip, mb)
                    .into_iter()
                    .map(|st| {
                        let w = *pl.pools[st - 1]
                            .iter()
                            .min_by(|&&a, &&b| {
                                load[a].cmp(&load[b]).then(
                                    self.cluster
                                        .transfer_time(at, a, act)
                                        .total_cmp(&self.cluster.transfer_time(at, b, act)),
                                )
                            })
                            .expect("non-empty pool");
                        load[w] += 1;
                        at = w;
                        (st, w)
                    })
                    .collect()
            })
            .collect();
        Routes {
            mid,
            cap: usize::MAX,
        }
    }

    /// The plan of these routes in whichever of [`Self::orders`] simulates faster, its devices
    /// named, with its iteration time.
    fn finish(&self, p: &Placement, r: &Routes) -> Result<(f64, Plan)> {
        // The plan already holds the orders its dispatch gives.
        let options = SimOptions {
            dispatch: Dispatch::Plan,
            ..self.setup.mechanics
        };
        let timed = |order| {
            let plan = self.plan(p, r, order)?;
            let setup = SimSetup {
                plan: &plan,
                stages: &self.stage_costs,
                cluster: self.cluster,
            };
            // A simulation that cannot finish (a link that never delivers) is infinitely
            // slow: `skip_plan` names it.
            let t = simulate_with(&setup, options).map_or(f64::INFINITY, |x| x.iteration_time);
            Some((t, plan))
        };
        let (t, mut plan) = self
            .orders()
            .iter()
            .copied()
            .filter_map(timed)
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .ok_or_else(|| {
                Error::Infeasible(
                    "no ordering of these routes fits the devices' in-flight caps".into(),
                )
            })?;
        plan.devices = self
            .cluster
            .devices
            .iter()
            .map(|d| d.name.clone())
            .collect();
        Ok((t, plan))
    }

    /// The placement of `starts` on which greedy routes skipping `skip` stages are fastest,
    /// with those routes.
    fn best_start(&self, starts: &[Placement], skip: usize) -> (Placement, Routes) {
        starts
            .iter()
            .map(|pl| {
                let r = self.greedy_routes(pl, skip);
                (self.score(pl, &r), (pl.clone(), r))
            })
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .expect("at least one placement")
            .1
    }

    /// A random change that keeps the rules: another pool worker for a hop, exchanged skip
    /// sets of two micro-batches, a swap of two neighbouring stages toggled, or two devices
    /// exchanging their places (pools, data nodes) with every hop on them.
    fn neighbour(&self, pl: &Placement, r: &Routes, rng: &mut Lcg) -> (Placement, Routes) {
        let mut out = r.clone();
        let mut place = pl.clone();
        let m = out.mid.len();
        let mb = rng.below(m);
        // Trading skipped stages means nothing to the full pipeline.
        let kinds = if r.mid.first().is_some_and(|x| x.len() < self.middle()) {
            5
        } else {
            4
        };
        match rng.below(kinds) {
            4 => {
                let other = rng.below(m);
                self.trade_skipped(&mut out.mid, mb, other, rng);
            }
            0 if !out.mid[mb].is_empty() => {
                // Another worker of the pool for a hop. When that worker is at the load cap
                // (the only move that changes a worker's load), the two exchange: one of its
                // hops at this stage moves to the hop's old worker.
                let h = rng.below(out.mid[mb].len());
                let (st, old) = out.mid[mb][h];
                let pool = &pl.pools[st - 1];
                let w = pool[rng.below(pool.len())];
                if w != old && self.loads(&out)[w] >= out.cap {
                    let theirs: Vec<(usize, usize)> = (0..m)
                        .flat_map(|o| (0..out.mid[o].len()).map(move |k| (o, k)))
                        .filter(|&(o, k)| out.mid[o][k] == (st, w))
                        .collect();
                    let (o, k) = theirs[rng.below(theirs.len())];
                    out.mid[o][k].1 = old;
                }
                out.mid[mb][h].1 = w;
            }
            1 => {
                let other = rng.below(m);
                let (a, b) = (out.mid[mb].clone(), out.mid[other].clone());
                out.mid[mb] = b;
                out.mid[other] = a;
            }
            2 if out.mid[mb].len() >= 2 => {
                let h = rng.below(out.mid[mb].len() - 1);
                out.mid[mb].swap(h, h + 1);
                let order: Vec<usize> = out.mid[mb].iter().map(|h| h.0).collect();
                let swaps = neighbour_swaps(&order);
                if swaps.is_none_or(|s| s > self.setup.max_swaps) {
                    out.mid[mb].swap(h, h + 1);
                }
            }
            _ => {
                let used: Vec<usize> = pl
                    .data
                    .iter()
                    .chain(pl.pools.iter().flatten())
                    .copied()
                    .collect();
                let a = used[rng.below(used.len())];
                let b = rng.below(self.cluster.len());
                let swap = |x: &mut usize| {
                    if *x == a {
                        *x = b;
                    } else if *x == b {
                        *x = a;
                    }
                };
                place.data.iter_mut().for_each(swap);
                place.pools.iter_mut().flatten().for_each(swap);
                out.mid.iter_mut().flatten().for_each(|h| swap(&mut h.1));
            }
        }
        (place, out)
    }

    /// Micro-batches `a` and `b` trade a stage: `a` now visits one that `b` visited and `a`
    /// skipped, on `b`'s worker, and `b` one that `a` visited and `b` skipped, on `a`'s. Each
    /// stage keeps its visits (the balance rule), while skip sets other than the initial
    /// ones become reachable. The new stage goes where model order puts it; a swap that no
    /// longer follows the rules is undone.
    fn trade_skipped(&self, mid: &mut [Vec<(usize, usize)>], a: usize, b: usize, rng: &mut Lcg) {
        let only = |x: &[(usize, usize)], y: &[(usize, usize)]| -> Vec<(usize, usize)> {
            x.iter()
                .filter(|h| y.iter().all(|g| g.0 != h.0))
                .copied()
                .collect()
        };
        let (from_a, from_b) = (only(&mid[a], &mid[b]), only(&mid[b], &mid[a]));
        if from_a.is_empty() || from_b.is_empty() {
            return;
        }
        let ha = from_a[rng.below(from_a.len())];
        let hb = from_b[rng.below(from_b.len())];
        let max_swaps = self.setup.max_swaps;
        let put = |route: &mut Vec<(usize, usize)>, out: (usize, usize), into: (usize, usize)| {
            route.retain(|h| h.0 != out.0);
            let at = route.iter().filter(|h| h.0 < into.0).count();
            route.insert(at, into);
            let order: Vec<usize> = route.iter().map(|h| h.0).collect();
            if neighbour_swaps(&order).is_none_or(|n| n > max_swaps) {
                route.sort_unstable_by_key(|h| h.0);
            }
        };
        put(&mut mid[a], ha, hb);
        put(&mut mid[b], hb, ha);
    }

    /// Simulated annealing from `start` for `budget` moves (or until the deadline): a
    /// candidate replaces the current routes when the simulator says it is faster, or, while
    /// the temperature lasts, with the Metropolis probability of a slower one. Returns the best
    /// found and the moves tried. (Measured on the geo example: plain hill climbing stalls
    /// near 96 s whatever the budget; annealing from 0.5% of the time with 40,000 moves reaches
    /// 89-92 s; 2% wanders too far at that budget; restarts did no better than one long run.)
    fn improve(
        &self,
        start: (Placement, Routes),
        rng: &mut Lcg,
        budget: usize,
        deadline: Instant,
    ) -> ((Placement, Routes), f64, usize) {
        self.anneal(
            start,
            rng,
            (budget, deadline, ANNEAL_START, false),
            |p, r| self.score(p, r),
        )
    }

    /// Simulated annealing of `cost` from `start` (see [`Self::improve`]), starting at
    /// temperature `start_temp` x the start's cost; with `plateau`, it also moves to candidates
    /// that cost the same.
    fn anneal(
        &self,
        start: (Placement, Routes),
        rng: &mut Lcg,
        (budget, deadline, start_temp, plateau): (usize, Instant, f64, bool),
        cost: impl Fn(&Placement, &Routes) -> f64,
    ) -> ((Placement, Routes), f64, usize) {
        let mut best_t = cost(&start.0, &start.1);
        let mut best = start;
        let mut cur = best.clone();
        let mut cur_t = best_t;
        let mut moves = 0;
        while moves < budget && Instant::now() < deadline {
            let cand = self.neighbour(&cur.0, &cur.1, rng);
            let t = cost(&cand.0, &cand.1);
            moves += 1;
            // The temperature falls linearly to zero over the budget.
            let temp = start_temp * best_t * (1.0 - moves as f64 / budget as f64);
            let accept = t < cur_t
                || (plateau && t == cur_t)
                || (t.is_finite()
                    && temp > 0.0
                    && ((cur_t - t) / temp).exp() > rng.below(1 << 20) as f64 / (1 << 20) as f64);
            if accept {
                cur = cand;
                cur_t = t;
                if t < best_t {
                    best = cur.clone();
                    best_t = t;
                }
            }
        }
        (best, best_t, moves)
    }
}

/// Devices in a random order: the first `data_nodes` hold the data, the rest split evenly
/// into a pool per middle stage.
fn blind_placement(devices: usize, data_nodes: usize, middle: usize, rng: &mut Lcg) -> Placement {
    let mut ids: Vec<usize> = (0..devices).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let per = (devices - data_nodes) / middle;
    Placement {
        data: ids[..data_nodes].to_vec(),
        pools: (0..middle)
            .map(|k| ids[data_nodes + k * per..data_nodes + (k + 1) * per].to_vec())
            .collect(),
    }
}

/// Network-aware placements to start the search from. Data nodes are either the devices with
/// the fastest links to the rest, or (on clusters of up to [`RING_CANDIDATES_UP_TO`] devices)
/// groups whose all-reduce ring of `ring_bytes` is fast: the data nodes all-reduce the
/// embedding stage and the head at the end of every iteration, and on SkipPipe's geo network
/// the most central devices have a ring 2.4x slower than the fastest group's. Each pool then
/// takes, in turn, the free devices reached fastest from the previous stage's hosts.
fn placements(
    cluster: &Cluster,
    data_nodes: usize,
    middle: usize,
    bytes: u64,
    ring_bytes: u64,
) -> Vec<Placement> {
    let n = cluster.len();
    let reach = |a: usize, set: &[usize]| -> f64 {
        set.iter()
            .map(|&b| cluster.transfer_time(a, b, bytes))
            .sum::<f64>()
    };
    let all: Vec<usize> = (0..n).collect();
    // Each device's reach is computed once (n^2 link lookups, not n^2 log n).
    let to_all: Vec<f64> = all.iter().map(|&a| reach(a, &all)).collect();
    let mut order = all.clone();
    order.sort_by(|&a, &b| to_all[a].total_cmp(&to_all[b]).then(a.cmp(&b)));
    let mut groups = vec![order[..data_nodes].to_vec()];
    if n <= RING_CANDIDATES_UP_TO {
        groups.extend(fast_rings(cluster, data_nodes, ring_bytes));
    }
    groups
        .into_iter()
        .map(|data| {
            let free: Vec<usize> = order
                .iter()
                .copied()
                .filter(|d| !data.contains(d))
                .collect();
            let pools = pools_from(&data, free, middle, &reach);
            Placement { data, pools }
        })
        .collect()
}

/// Clusters up to this size also try data nodes chosen for a fast all-reduce ring (the search
/// grows a group from every device: about n^2 x data nodes^2 link lookups).
const RING_CANDIDATES_UP_TO: usize = 512;

/// Groups chosen for a fast ring: from each device, add the device whose slowest link to the
/// group is fastest, until there are `size`; the distinct groups with the fastest rings, best
/// first (at most [`RING_GROUPS`]).
fn fast_rings(cluster: &Cluster, size: usize, ring_bytes: u64) -> Vec<Vec<usize>> {
    let n = cluster.len();
    let chunk = ring_bytes.div_ceil(size.max(1) as u64);
    let t = |a: usize, b: usize| cluster.transfer_time(a, b, chunk);
    let mut groups: Vec<(f64, Vec<usize>)> = Vec::new();
    for seed in 0..n {
        let mut group = vec![seed];
        // Each outside device's slowest link to the group so far.
        let mut worst: Vec<f64> = (0..n).map(|d| t(seed, d)).collect();
        while group.len() < size {
            let Some(next) = (0..n)
                .filter(|d| !group.contains(d))
                .min_by(|&a, &b| worst[a].total_cmp(&worst[b]))
            else {
                break;
            };
            group.push(next);
            for (d, w) in worst.iter_mut().enumerate() {
                *w = w.max(t(next, d));
            }
        }
        group.sort_unstable();
        if group.len() == size && groups.iter().all(|(_, g)| *g != group) {
            groups.push((ring_allreduce_time(cluster, &group, ring_bytes), group));
        }
    }
    groups.sort_by(|a, b| a.0.total_cmp(&b.0));
    groups
        .into_iter()
        .take(RING_GROUPS)
        .map(|(_, g)| g)
        .collect()
}

/// Data-node groups chosen for their rings that the search considers as starts.
const RING_GROUPS: usize = 4;

/// A pool per middle stage from the `free` devices (in preference order): each takes the free
/// devices reached fastest (`reach`) from the previous stage's hosts, ties in their order.
fn pools_from(
    data: &[usize],
    mut free: Vec<usize>,
    middle: usize,
    reach: &impl Fn(usize, &[usize]) -> f64,
) -> Vec<Vec<usize>> {
    let per = free.len() / middle.max(1);
    let mut pools = Vec::with_capacity(middle);
    let mut prev = data.to_vec();
    for _ in 0..middle {
        // The same as taking the fastest one at a time, as the hosts stay fixed within a pool.
        let key: Vec<f64> = free.iter().map(|&a| reach(a, &prev)).collect();
        let mut idx: Vec<usize> = (0..free.len()).collect();
        idx.sort_by(|&i, &j| key[i].total_cmp(&key[j]));
        let mut taken = vec![false; free.len()];
        let pool: Vec<usize> = idx[..per]
            .iter()
            .map(|&i| {
                taken[i] = true;
                free[i]
            })
            .collect();
        free = free
            .iter()
            .zip(&taken)
            .filter(|(_, &t)| !t)
            .map(|(&d, _)| d)
            .collect();
        prev = pool.clone();
        pools.push(pool);
    }
    pools
}

/// Devices the placement takes at most: it compares every pair (n^2 link lookups).
const MAX_DEVICES: usize = 20_000;

/// The load cap must leave room for every visit: a middle stage gets up to
/// ceil(micro-batches x visited / middle) visits over the `per_pool` workers of its pool.
fn check_load_cap(setup: &SkipSetup, per_pool: usize) -> Result<()> {
    let Some(cap) = setup.max_node_load else {
        return Ok(());
    };
    let middle = setup.stages - 1;
    let m = setup.data_nodes * setup.microbatches;
    let visits = (m * (middle - setup.skip)).div_ceil(middle);
    if per_pool.saturating_mul(cap) < visits {
        return Err(Error::Infeasible(format!(
            "a middle stage gets {visits} micro-batch visits per iteration but its {per_pool} workers may serve {cap} each (the per-node load cap): raise the cap or add devices"
        )));
    }
    Ok(())
}

/// Refuse what cannot be scheduled, naming why, before any search.
pub(crate) fn check_setup(profile: &Profile, cluster: &Cluster, setup: &SkipSetup) -> Result<()> {
    let s = setup.stages;
    let n = profile.layers.len();
    let middle = s.saturating_sub(1);
    if s < 2 || n < s + 1 {
        return Err(Error::shape(
            Field::Depth,
            s,
            format!("needs at least 2 stages and more layers ({n}) than stages, the last layer being the head"),
        ));
    }
    if setup.skip >= middle {
        return Err(Error::shape(
            Field::Skip,
            setup.skip,
            format!("cannot skip {} of the {middle} middle stages (stage 0 and the head are always visited)", setup.skip),
        ));
    }
    if cluster.len() > MAX_DEVICES {
        return Err(Error::Invalid(format!(
            "the cluster has {} devices; skip-plan's network-aware placement compares every pair of them, and takes at most {MAX_DEVICES} (about 5 s at that size)",
            cluster.len()
        )));
    }
    if setup.data_nodes == 0 {
        return Err(Error::shape(
            Field::Replicas,
            0,
            "SkipPipe needs at least 1 data node",
        ));
    }
    if setup.microbatches == 0 {
        return Err(Error::shape(
            Field::Microbatches,
            0,
            "SkipPipe needs at least 1 micro-batch per data node",
        ));
    }
    // Each micro-batch runs a forward and a backward on each of its hops.
    crate::limits::check_size(setup.data_nodes, s + 1, 1, setup.microbatches)?;
    let pool_devices = cluster.len().saturating_sub(setup.data_nodes);
    if pool_devices < middle {
        return Err(Error::Invalid(format!(
            "{} devices cannot hold {} data nodes and a pool for each of {middle} middle stages",
            cluster.len(),
            setup.data_nodes
        )));
    }
    check_load_cap(setup, pool_devices / middle)
}

/// The emitted plan keeps every rule, is valid, and fits device memory in bytes (as
/// `simulate` and `plan` check it: a plan that does not fit is not written).
fn check_result(plan: Plan, cluster: &Cluster, setup: &SkipSetup) -> Result<ValidPlan> {
    let rules = SkipRules {
        skip: setup.skip,
        max_swaps: setup.max_swaps,
        max_in_flight: None,
        max_node_load: setup.max_node_load,
    };
    check_skip_rules(&plan, &rules)?;
    let plan = ValidPlan::new(plan)?;
    let costs = plan.stage_costs().expect("skip plans carry stage costs");
    let devices = crate::sim::devices_for_plan(&plan, cluster)?;
    crate::sim::check_memory(&plan, &costs, &devices)
        .map_err(|e| Error::Infeasible(format!("the skip plan does not fit device memory: {e}")))?;
    Ok(plan)
}

/// The search's problem: all layers but the head cut into `setup.stages` stages by compute
/// (min-max), the head a stage of its own.
fn problem<'a>(
    profile: &Profile,
    cluster: &'a Cluster,
    setup: &'a SkipSetup,
) -> Result<Problem<'a>> {
    let n = profile.layers.len();
    let work = prefix(
        profile.layers[..n - 1]
            .iter()
            .map(|l| l.forward + l.backward()),
    );
    let split = min_max_split(n - 1, setup.stages, |_, lo, hi| work[hi] - work[lo])?;
    let mut layers_per_stage = split.layers_per_stage;
    layers_per_stage.push(1);
    let stage_costs = profile.stage_costs(&layers_per_stage);
    let cap: Vec<usize> = cluster
        .devices
        .iter()
        .map(|d| d.memory_microbatches.map_or(usize::MAX, |c| c as usize))
        .collect();
    Ok(Problem::new(
        cluster,
        setup,
        layers_per_stage,
        stage_costs,
        cap,
    ))
}

/// A link or a device that never finishes (bandwidth or speed near 0, huge latency) makes
/// every candidate infinite: say so rather than print `inf s` and `NaN%`.
fn check_finite(skip: f64, full: f64, random: f64) -> Result<()> {
    let times = [
        ("skip routes", skip),
        ("the full pipeline", full),
        ("random routes", random),
    ];
    match times.into_iter().find(|(_, t)| !t.is_finite()) {
        Some((what, t)) => Err(Error::Infeasible(format!(
            "{what} take {t} s per iteration on this cluster: a link or a device is too slow for any time to be finite (check bandwidth, latency and speed)"
        ))),
        None => Ok(()),
    }
}

/// Schedule SkipPipe routes for `profile` on `cluster` (see the module docs).
pub fn skip_plan(profile: &Profile, cluster: &Cluster, setup: &SkipSetup) -> Result<SkipResult> {
    let t0 = Instant::now();
    check_setup(profile, cluster, setup)?;
    let middle = setup.stages - 1;
    let pr = problem(profile, cluster, setup)?;
    let bytes = pr.stage_costs[0].activation_out;
    let starts = placements(
        cluster,
        setup.data_nodes,
        middle,
        bytes,
        pr.stage_costs[0].params,
    );
    // Each search has its own generator, so a seed gives the same answer whatever the others
    // did; the same move budget for the full pipeline and the skip routes; the time limit
    // only stops a search early. The last phase keeps 15% of the time limit.
    let share = if setup.polish_moves > 0 { 0.85 } else { 1.0 };
    let deadline = t0 + setup.time_limit.mul_f64(share);
    // Each search starts from the placement where its greedy routes are fastest.
    let full_start = pr.best_start(&starts, 0);
    let mut skip_start = pr.best_start(&starts, setup.skip);
    // Greedy routes spread each pool's visits evenly, within any cap that leaves room.
    skip_start.1.cap = setup.max_node_load.unwrap_or(usize::MAX);
    let pl = skip_start.0.clone();
    // The two searches run side by side, one per core.
    let (((full_pl, full), _, m1), ((best_pl, best), _, m2)) = std::thread::scope(|sc| {
        let full = sc.spawn(|| {
            pr.improve(
                full_start,
                &mut Lcg(setup.seed ^ 0x1),
                setup.moves,
                deadline,
            )
        });
        let skip = pr.improve(
            skip_start,
            &mut Lcg(setup.seed ^ 0x2),
            setup.moves,
            deadline,
        );
        (full.join().expect("the full-pipeline search"), skip)
    });
    // Among routes as fast as these in pipewright's model, those fastest in SkipPipe's: its
    // mechanics (memory slots, whole-second passes) price routes that tie here differently
    // (on the geo example 74-76 s where the search alone left 76-81 s).
    let bound = pr.score(&best_pl, &best);
    let ((best_pl, best), _, m3) = pr.anneal(
        (best_pl, best),
        &mut Lcg(setup.seed ^ 0x4),
        (setup.polish_moves, t0 + setup.time_limit, 0.0, true),
        |p, r| pr.skippipe_within(p, r, bound),
    );
    let mut rng = Lcg(setup.seed ^ 0x3);
    // Network-blind random skipping: devices in a random order, random balanced skip sets
    // and random pool workers; and SkipPipe's random baseline: random routes on the
    // network-aware placement.
    let blind = blind_placement(cluster.len(), setup.data_nodes, middle, &mut rng);
    let random = pr.random_routes(&blind, &mut rng);
    let aware_random = pr.random_routes(&pl, &mut rng);
    let (best_t, plan) = pr.finish(&best_pl, &best)?;
    let (full_t, full_plan) = pr.finish(&full_pl, &full)?;
    let (random_t, random_plan) = pr.finish(&blind, &random)?;
    let (aware_random_t, _) = pr.finish(&pl, &aware_random)?;
    let plan = check_result(plan, cluster, setup)?;
    let skippipe = slotted_plan_time(&SimSetup {
        plan: &plan,
        stages: &pr.stage_costs,
        cluster,
    })
    .ok()
    .filter(|r| r.finished == plan.num_microbatches)
    .map(|r| r.pipeline_time);
    check_finite(best_t, full_t, random_t)?;
    Ok(SkipResult {
        skip_time: best_t,
        skip_time_skippipe: skippipe,
        full_pipeline_time: full_t,
        random_skip_time: random_t,
        random_routes_time: aware_random_t,
        scheduler_seconds: t0.elapsed().as_secs_f64(),
        moves: m1 + m2 + m3,
        time_limit_hit: m1 < setup.moves || m2 < setup.moves || m3 < setup.polish_moves,
        plan,
        full_plan,
        random_plan,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::simulate;

    #[test]
    fn scheduled_routes_follow_every_rule_and_beat_the_baselines_here() {
        use crate::cluster::Cluster;
        // 8 layers (the last the head) on 9 identical devices, 3 data nodes.
        let mut toml = String::from("[model]\nname = \"t\"\n");
        for i in 0..8 {
            toml += &format!("[[layers]]\nname = \"l{i}\"\nforward = 1\nbackward = 2\nparams = 1000\nactivation = 1000\n");
        }
        let profile = Profile::parse("t.toml", &toml).unwrap();
        let cluster = Cluster::uniform(9);
        for (skip, seed) in [(0, 1), (1, 2), (2, 3)] {
            let setup = SkipSetup {
                stages: 4,
                skip,
                data_nodes: 3,
                microbatches: 2,
                max_swaps: 1,
                moves: 200,
                time_limit: Duration::from_secs(60),
                seed,
                mechanics: SimOptions::default(),
                // As tight as it can be: each pool's 2 workers share its visits evenly.
                max_node_load: Some(3 - skip),
                polish_moves: 100,
            };
            let r = skip_plan(&profile, &cluster, &setup).unwrap();
            let rules = SkipRules {
                skip,
                max_swaps: 1,
                max_in_flight: None,
                max_node_load: Some(3 - skip),
            };
            for p in [&r.plan, &r.full_plan, &r.random_plan] {
                crate::plan::validate::validate(p).unwrap();
            }
            check_skip_rules(&r.plan, &rules).unwrap();
            check_skip_rules(&r.random_plan, &rules).unwrap();
            let full = SkipRules {
                skip: 0,
                max_node_load: None,
                ..rules
            };
            check_skip_rules(&r.full_plan, &full).unwrap();
            assert!(
                r.skip_time <= r.full_pipeline_time + 1e-9 || skip == 0,
                "{r:?}"
            );
            // Both random baselines are scored; searched routes beat random ones on the same
            // placement.
            assert!(r.random_skip_time.is_finite() && r.random_routes_time.is_finite());
            assert!(r.skip_time <= r.random_routes_time + 1e-9, "{r:?}");
            // Deterministic for a seed, and the budget, not the clock, ended it.
            let again = skip_plan(&profile, &cluster, &setup).unwrap();
            assert_eq!(again.plan, r.plan);
            assert!(!r.time_limit_hit && r.moves == 2 * 200 + 100, "{r:?}");
            // A time limit that cuts the search says so.
            let cut = SkipSetup {
                moves: 1 << 30,
                time_limit: Duration::from_millis(20),
                ..setup
            };
            assert!(skip_plan(&profile, &cluster, &cut).unwrap().time_limit_hit);
        }
    }

    /// The search scores candidates from the list schedule's own times; the simulator must give
    /// the same iteration time for the plan those orders make, on SkipPipe's geo network, for
    /// random and locally changed routes and placements, with devices of uneven speed.
    #[test]
    fn the_last_phase_lowers_skippipes_time_and_keeps_the_iteration_time() {
        let profile = Profile::parse(
            "llama500m.toml",
            include_str!("../../../../examples/llama500m_skippipe.toml"),
        )
        .unwrap();
        let cluster = Cluster::parse(
            "geo20.toml",
            include_str!("../../../../examples/geo20_skippipe.toml"),
        )
        .unwrap();
        for seed in [2, 3] {
            let run = |polish_moves| {
                let setup = SkipSetup {
                    stages: 6,
                    skip: 2,
                    data_nodes: 5,
                    microbatches: 6,
                    max_swaps: 1,
                    moves: 3000,
                    time_limit: Duration::from_secs(600),
                    seed,
                    mechanics: SimOptions::default(),
                    max_node_load: Some(6),
                    polish_moves,
                };
                skip_plan(&profile, &cluster, &setup).unwrap()
            };
            let (before, after) = (run(0), run(400));
            let (b, a) = (
                before.skip_time_skippipe.unwrap(),
                after.skip_time_skippipe.unwrap(),
            );
            assert!(a < b - 0.5, "seed {seed}: {b} s, then {a} s");
            assert!(after.skip_time <= before.skip_time + 1e-9, "seed {seed}");
            // What the result reports is what the model gives for the plan it returns.
            let again = slotted_plan_time(&SimSetup {
                plan: &after.plan,
                stages: &after.plan.stage_costs().unwrap(),
                cluster: &cluster,
            })
            .unwrap();
            assert_eq!(again.pipeline_time, a);
        }
    }

    #[test]
    fn scores_equal_the_simulated_iteration_time() {
        let profile = Profile::parse(
            "llama500m.toml",
            include_str!("../../../../examples/llama500m_skippipe.toml"),
        )
        .unwrap();
        let mut cluster = Cluster::parse(
            "geo20.toml",
            include_str!("../../../../examples/geo20_skippipe.toml"),
        )
        .unwrap();
        let mut rng = Lcg(9);
        for d in cluster.devices.iter_mut().step_by(3) {
            d.speed = 0.5 + rng.below(100) as f64 / 100.0;
        }
        // pipewright's mechanics, then SkipPipe's (arrival dispatch, idle gap, no link queue).
        let skippipe = SimOptions {
            dispatch: Dispatch::Arrival,
            idle_gap: 0.13,
            no_link_queue: true,
            ..SimOptions::default()
        };
        for mechanics in [SimOptions::default(), skippipe] {
            let setup = SkipSetup {
                stages: 6,
                skip: 2,
                data_nodes: 5,
                microbatches: 6,
                max_swaps: 1,
                moves: 0,
                time_limit: Duration::from_secs(1),
                seed: 0,
                mechanics,
                max_node_load: None,
                polish_moves: 0,
            };
            let layers_per_stage = vec![5, 4, 4, 4, 4, 4, 1];
            let costs = profile.stage_costs(&layers_per_stage);
            let pr = Problem::new(
                &cluster,
                &setup,
                layers_per_stage,
                costs,
                vec![3; cluster.len()],
            );
            let pl = placements(&cluster, 5, 5, 1 << 25, 1 << 20)[1].clone();
            let mut cand = (pl.clone(), pr.random_routes(&pl, &mut rng));
            for i in 0..60 {
                cand = pr.neighbour(&cand.0, &cand.1, &mut rng);
                if i % 20 == 0 {
                    cand.1 = pr.random_routes(&cand.0, &mut rng);
                }
                // Simulated from the plan's routes alone, dispatching as `mechanics` says.
                let plan = pr.plan(&cand.0, &cand.1, pr.orders()[0]).unwrap();
                let setup = SimSetup {
                    plan: &plan,
                    stages: &pr.stage_costs,
                    cluster: &cluster,
                };
                let sim = simulate_with(&setup, mechanics).unwrap();
                let score = pr.score(&cand.0, &cand.1);
                assert!(
                    (score - sim.iteration_time).abs() < 1e-9 * sim.iteration_time,
                    "{mechanics:?} move {i}: scored {score}, simulated {}",
                    sim.iteration_time
                );
                if mechanics.dispatch == Dispatch::Plan {
                    assert_eq!(simulate(&setup).unwrap().iteration_time, sim.iteration_time);
                }
            }
        }
    }

    /// Trading skipped stages keeps every stage's visits and SkipPipe's swap rule, and reaches
    /// skip sets the balanced start does not have.
    #[test]
    fn trading_skipped_stages_keeps_the_rules_and_reaches_new_skip_sets() {
        let cluster = Cluster::uniform(12);
        let setup = SkipSetup {
            stages: 6,
            skip: 2,
            data_nodes: 2,
            microbatches: 5,
            max_swaps: 1,
            moves: 0,
            time_limit: Duration::from_secs(1),
            seed: 0,
            mechanics: SimOptions::default(),
            max_node_load: None,
            polish_moves: 0,
        };
        let costs = vec![crate::profile::StageCost::default(); 7];
        let pr = Problem::new(&cluster, &setup, vec![1; 7], costs, vec![3; 12]);
        let pl = Placement {
            data: vec![0, 1],
            pools: (0..5).map(|k| vec![2 + 2 * k, 3 + 2 * k]).collect(),
        };
        let start = pr.greedy_routes(&pl, 2);
        let skip_set = |mid: &[(usize, usize)]| -> Vec<usize> {
            (1..=5)
                .filter(|st| mid.iter().all(|h| h.0 != *st))
                .collect()
        };
        let initial: Vec<Vec<usize>> = start.mid.iter().map(|m| skip_set(m)).collect();
        let visits = |r: &Routes| {
            let mut v = [0usize; 6];
            r.mid.iter().flatten().for_each(|h| v[h.0] += 1);
            v
        };
        let (mut r, mut rng, mut new_sets) = (start.clone(), Lcg(5), 0);
        for _ in 0..500 {
            let (a, b) = (rng.below(10), rng.below(10));
            pr.trade_skipped(&mut r.mid, a, b, &mut rng);
            if rng.below(2) == 0 {
                // A swap toggled, as the search does.
                let h = rng.below(2);
                r.mid[a].swap(h, h + 1);
                let order: Vec<usize> = r.mid[a].iter().map(|h| h.0).collect();
                if neighbour_swaps(&order).is_none_or(|n| n > 1) {
                    r.mid[a].swap(h, h + 1);
                }
            }
            assert_eq!(visits(&r), visits(&start));
            for (mb, mid) in r.mid.iter().enumerate() {
                let order: Vec<usize> = mid.iter().map(|h| h.0).collect();
                assert!(
                    neighbour_swaps(&order).is_some_and(|n| n <= 1),
                    "mb {mb}: {order:?}"
                );
                assert!(mid.iter().all(|&(st, w)| pl.pools[st - 1].contains(&w)));
                new_sets += usize::from(!initial.contains(&skip_set(mid)));
            }
        }
        assert!(new_sets > 0);
    }
}

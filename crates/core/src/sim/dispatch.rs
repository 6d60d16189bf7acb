//! List scheduling of arbitrary routes in simulated time: the worker orders a dispatcher that
//! runs whatever is ready would produce, under each worker's in-flight cap, with the
//! simulator's costs and mechanics, so that simulating those orders gives back the same
//! times. The skip scheduler scores its candidates with it, and `simulate --dispatch arrival`
//! replays a plan as SkipPipe's simulator dispatches (each node runs what arrived first).

use super::setup::{SimOptions, SimSetup};
use crate::error::{Error, Result};
use crate::plan::deps::{need_count, unblocks, Pending, Waiter};
use crate::plan::ir::{Action, Hop, Op, Plan};

/// How an idle worker picks among the actions whose inputs are there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// A ready backward first (it frees memory), else the lowest-numbered ready forward.
    BackwardFirst,
    /// What became ready first, forward or backward (SkipPipe's simulator runs what arrived
    /// first); ties to the backward, then the lower micro-batch.
    Arrival,
}

/// Worker orders from [`route_schedule`], and the times the simulator will give them.
#[derive(Debug, Clone)]
pub struct RouteSchedule {
    pub workers: Vec<Vec<Action>>,
    /// When the last action ends.
    pub makespan: f64,
    /// Per stage: when its last backward ends (its all-reduce may start then).
    pub stage_done: Vec<f64>,
}

/// One worker ordering for arbitrary routes by list scheduling in simulated time: each worker,
/// when idle, runs the ready action `order` picks that its in-flight cap admits.
/// `duration(worker, op, stage)` and `transfer(from, to, stage)` give the times (`stage`: the
/// one whose activation, or its gradient, travels); messages queue on each directed link and
/// workers rest after each action as `mechanics` tells the simulator to, so simulating the
/// orders under `mechanics` gives back these times (unit costs and free links reproduce plain
/// list scheduling). `None` if the caps stall it. Shared compute is not modelled.
pub fn route_schedule(
    num_workers: usize,
    routes: &[Vec<Hop>],
    cap: &[usize],
    order: Order,
    mechanics: &SimOptions,
    duration: impl Fn(usize, Op, usize) -> f64,
    transfer: impl Fn(usize, usize, usize) -> f64,
) -> Option<RouteSchedule> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let m = routes.len();
    let mut in_flight = vec![0usize; num_workers];
    let mut held = vec![0usize; num_workers * m];
    // Keyed by the time's bits: times are never negative or NaN, and for those the bits order
    // as the numbers do (cheaper to compare than floats).
    let mut events: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
    let longest = routes.iter().map(Vec::len).max().unwrap_or(0);
    let event = Event { longest };
    let mut ready = Readiness::new(num_workers, m, longest);
    for (mb, r) in routes.iter().enumerate() {
        events.push(Reverse((
            0.0f64.to_bits(),
            event.pack(1, r.first()?.worker, true, mb, 0),
        )));
    }
    let mut workers = vec![Vec::new(); num_workers];
    let total: usize = routes.iter().map(|r| 2 * r.len()).sum();
    let mut done = 0;
    let mut running: Vec<Option<(bool, usize, usize)>> = vec![None; num_workers];
    let stages = routes
        .iter()
        .flatten()
        .map(|h| h.stage + 1)
        .max()
        .unwrap_or(0);
    let mut stage_done = vec![0.0f64; stages];
    let mut makespan = 0.0f64;
    let mut links = Links {
        free: vec![Vec::new(); num_workers],
        queue: !mechanics.no_link_queue,
    };
    // Only a worker with an event at this instant can start something: its ready sets and
    // in-flight count change through its own events alone.
    let mut touched: Vec<usize> = Vec::with_capacity(num_workers);
    while let Some(&Reverse((at_bits, _))) = events.peek() {
        let now = f64::from_bits(at_bits);
        touched.clear();
        while let Some(&Reverse((t, key))) = events.peek() {
            if t > at_bits {
                break;
            }
            let (kind, w, fwd, mb, at) = event.unpack(key);
            events.pop();
            if !touched.contains(&w) {
                touched.push(w);
            }
            let r = &routes[mb];
            if kind == 2 {
                // The worker has rested after its action.
                running[w] = None;
                continue;
            }
            if kind == 1 {
                // An input arrived: one need met (an action with none arrives at time 0).
                ready.meet(r, w, (mb, at, fwd), now);
                continue;
            }
            if mechanics.idle_gap > 0.0 {
                let rested = now + mechanics.idle_gap;
                events.push(Reverse((rested.to_bits(), event.pack(2, w, fwd, mb, at))));
            } else {
                running[w] = None;
            }
            done += 1;
            makespan = makespan.max(now);
            if !fwd {
                let st = &mut stage_done[r[at].stage];
                *st = st.max(now);
                held[w * m + mb] -= 1;
                if held[w * m + mb] == 0 {
                    in_flight[w] -= 1;
                }
            }
            let mut arrives = |t: f64, to: usize, to_fwd: bool, to_at: usize| {
                events.push(Reverse((t.to_bits(), event.pack(1, to, to_fwd, mb, to_at))));
            };
            let sent = (&mut ready, &mut links, &transfer);
            deliver(r, w, (mb, at, fwd), now, sent, &mut arrives);
        }
        touched.sort_unstable();
        for &w in &touched {
            if running[w].is_some() {
                continue;
            }
            let (times, longest) = (&ready.at, ready.longest);
            let since = |mb: usize, at: usize, fwd: bool| times[slot(longest, mb, at, fwd)];
            let pick = pick_next(
                w,
                (&mut ready.forwards[w], &mut ready.backwards[w]),
                &mut held,
                &mut in_flight,
                cap[w],
                (order == Order::Arrival).then_some(&since),
            );
            if let Some((fwd, mb, at)) = pick {
                let (op, stage) = (if fwd { Op::F } else { Op::BW }, routes[mb][at].stage);
                workers[w].push(Action::new(op, stage, mb));
                running[w] = Some((fwd, mb, at));
                let end = now + duration(w, op, stage);
                events.push(Reverse((end.to_bits(), event.pack(0, w, fwd, mb, at))));
            }
        }
    }
    (done == total).then_some(RouteSchedule {
        workers,
        makespan,
        stage_done,
    })
}

/// What the action at position `at` of route `r` (micro-batch `mb`, forward or whole
/// backward) on worker `w`, done at `now`, counts towards by the IR's dependency rule: a need
/// met on this worker now, or on a neighbour's once the result has travelled there
/// (`arrives(time, worker, forward?, position)`).
fn deliver(
    r: &[Hop],
    w: usize,
    (mb, at, fwd): (usize, usize, bool),
    now: f64,
    (ready, links, transfer): (
        &mut Readiness,
        &mut Links,
        &impl Fn(usize, usize, usize) -> f64,
    ),
    arrives: &mut impl FnMut(f64, usize, bool, usize),
) {
    let op = if fwd { Op::F } else { Op::BW };
    let (prev, next) = neighbours(r, at);
    for waiter in unblocks(op, r[at].stage, prev, next).into_iter().flatten() {
        let (to_at, to_fwd) = match waiter {
            Waiter::Forward(_) => (at + 1, true),
            Waiter::Backward(st) if st == r[at].stage => (at, false),
            Waiter::Backward(_) => (at - 1, false),
            Waiter::Weight(_) => unreachable!("route schedules run fused backwards"),
        };
        if to_at == at {
            // Its own backward, on this worker: no message to wait for.
            ready.meet(r, w, (mb, at, false), now);
            continue;
        }
        let to = r[to_at].worker;
        // A gradient carries the activation of the stage it goes back to.
        let payload = r[if to_fwd { at } else { to_at }].stage;
        let t = if to == w {
            now
        } else {
            links.send(w, to, now, transfer(w, to, payload))
        };
        arrives(t, to, to_fwd, to_at);
    }
}

/// The index of (micro-batch, position on the route, forward?) when routes are at most
/// `longest` hops.
fn slot(longest: usize, mb: usize, at: usize, fwd: bool) -> usize {
    (mb * longest + at) * 2 + usize::from(fwd)
}

/// The directed links' queues: when each is next free (per sender, a short list of
/// (receiver, free at)); messages on a link travel one after another, first sent first,
/// unless `queue` is off.
struct Links {
    free: Vec<Vec<(usize, f64)>>,
    queue: bool,
}

impl Links {
    /// When a message of `secs` sent from `a` to `b` at `now` arrives.
    fn send(&mut self, a: usize, b: usize, now: f64, secs: f64) -> f64 {
        if !self.queue {
            return now + secs;
        }
        let links = &mut self.free[a];
        let i = links
            .iter()
            .position(|&(to, _)| to == b)
            .unwrap_or_else(|| {
                links.push((b, 0.0));
                links.len() - 1
            });
        let free = &mut links[i].1;
        *free = free.max(now) + secs;
        *free
    }
}

/// Which actions are ready on each worker, and since when: an action is ready once the
/// completions and messages it needs (the IR's dependency rule) have all come.
struct Readiness {
    pending: Pending,
    forwards: Vec<Ready>,
    backwards: Vec<Ready>,
    /// When each (micro-batch, position, direction) became ready (for `Order::Arrival`).
    at: Vec<f64>,
    longest: usize,
}

impl Readiness {
    fn new(workers: usize, microbatches: usize, longest: usize) -> Self {
        Readiness {
            pending: Pending::new(2 * microbatches * longest),
            forwards: vec![Vec::new(); workers],
            backwards: vec![Vec::new(); workers],
            at: vec![0.0; 2 * microbatches * longest],
            longest,
        }
    }

    /// One need of the action at position `at` of route `r` (micro-batch `mb`, forward or
    /// backward) on worker `w` is met at `now`; it joins the worker's ready list on its last.
    fn meet(&mut self, r: &[Hop], w: usize, (mb, at, fwd): (usize, usize, bool), now: f64) {
        let (prev, next) = neighbours(r, at);
        let waiter = if fwd {
            Waiter::Forward(r[at].stage)
        } else {
            Waiter::Backward(r[at].stage)
        };
        let slot = slot(self.longest, mb, at, fwd);
        if self.pending.meet(slot, need_count(waiter, prev, next)) {
            let list = if fwd {
                &mut self.forwards[w]
            } else {
                &mut self.backwards[w]
            };
            list.push((mb, at));
            self.at[slot] = now;
        }
    }
}

/// The plan's routes with the worker orders that arrival dispatch gives them under
/// `mechanics` (each device's in-flight cap from the cluster's `memory_microbatches`).
pub fn arrival_orders(setup: &SimSetup, mechanics: &SimOptions) -> Result<Plan> {
    let SimSetup {
        plan,
        stages,
        cluster,
    } = *setup;
    if mechanics.shared_compute {
        return Err(Error::Invalid(
            "arrival dispatch is not modelled on shared compute".into(),
        ));
    }
    if let Some(a) = plan
        .workers
        .iter()
        .flatten()
        .find(|a| !matches!(a.op, Op::F | Op::BW))
    {
        return Err(Error::Invalid(format!(
            "arrival dispatch runs forwards and whole backwards; this plan has {a}, a split backward"
        )));
    }
    let p = plan.num_workers();
    if cluster.len() < p || stages.len() != plan.num_stages() {
        return Err(Error::Invalid(format!(
            "the plan needs {p} workers and {} stage costs; the cluster has {} devices and there are {} costs",
            plan.num_stages(),
            cluster.len(),
            stages.len()
        )));
    }
    let cap: Vec<usize> = (0..p)
        .map(|w| {
            cluster.devices[w]
                .memory_microbatches
                .map_or(usize::MAX, |c| c as usize)
        })
        .collect();
    let orders = route_schedule(
        p,
        &plan.routes,
        &cap,
        Order::Arrival,
        mechanics,
        |w, op, st| {
            let c = &stages[st];
            let t = if op == Op::F { c.forward } else { c.full_backward() };
            t / cluster.devices[w].speed
        },
        |a, b, st| cluster.transfer_time(a, b, stages[st].activation_out),
    )
    .ok_or_else(|| {
        Error::Infeasible(
            "arrival dispatch stalls: the devices' in-flight caps (memory_microbatches) admit no order of these routes".into(),
        )
    })?;
    Ok(Plan {
        workers: orders.workers,
        ..plan.clone()
    })
}

/// The stages before and after position `at` of a route.
fn neighbours(r: &[Hop], at: usize) -> (Option<usize>, Option<usize>) {
    (
        (at > 0).then(|| r[at - 1].stage),
        r.get(at + 1).map(|h| h.stage),
    )
}

/// An event of [`route_schedule`] packed in one integer that sorts as (0 = an action ends on
/// the worker / 1 = an input arrives / 2 = the worker has rested, worker, forward?,
/// micro-batch, position on the route).
struct Event {
    longest: usize,
}

impl Event {
    fn pack(&self, kind: u8, w: usize, fwd: bool, mb: usize, at: usize) -> u64 {
        // Workers stay below 2^30 and (micro-batch, position) slots below 2^31: clusters
        // are far smaller, and plans have at most `limits::MAX_ACTIONS` actions.
        let slot = (mb * self.longest + at) as u64;
        (u64::from(kind) << 62) | ((w as u64) << 32) | (u64::from(fwd) << 31) | slot
    }

    fn unpack(&self, key: u64) -> (u8, usize, bool, usize, usize) {
        let slot = (key & 0x7fff_ffff) as usize;
        (
            (key >> 62) as u8,
            ((key >> 32) & 0x3fff_ffff) as usize,
            (key >> 31) & 1 == 1,
            slot / self.longest,
            slot % self.longest,
        )
    }
}

/// A worker's ready actions as (micro-batch, position on the route): a few at a time.
type Ready = Vec<(usize, usize)>;

/// Worker `w`'s next action when idle: a ready backward first, else the earliest ready forward
/// its in-flight cap admits (a micro-batch it already holds always continues); with `since`
/// (when each became ready), whichever of those became ready first. Counts what it admits;
/// `(forward?, mb, position on the route)`. Ties go to the lower micro-batch and position.
fn pick_next(
    w: usize,
    (ready_f, ready_b): (&mut Ready, &mut Ready),
    held: &mut [usize],
    in_flight: &mut [usize],
    cap: usize,
    since: Option<&dyn Fn(usize, usize, bool) -> f64>,
) -> Option<(bool, usize, usize)> {
    let m = held.len() / in_flight.len().max(1);
    let admits = |mb: usize| held[w * m + mb] > 0 || in_flight[w] < cap;
    let time = |x: &(usize, usize), fwd: bool| since.map_or(0.0, |t| t(x.0, x.1, fwd));
    // The first by (time ready, micro-batch, position); without `since`, by the latter two.
    let first = |set: &Ready, fwd: bool, ok: &dyn Fn(usize) -> bool| {
        set.iter()
            .enumerate()
            .filter(|(_, x)| ok(x.0))
            .min_by(|(_, a), (_, b)| time(a, fwd).total_cmp(&time(b, fwd)).then(a.cmp(b)))
            .map(|(i, &x)| (i, x))
    };
    let b = first(ready_b, false, &|_| true);
    let f = first(ready_f, true, &admits);
    let backward = match (b, f) {
        (Some(b), Some(f)) => since.is_none() || time(&f.1, true) >= time(&b.1, false),
        (b, _) => b.is_some(),
    };
    if backward {
        let (i, (mb, at)) = b?;
        ready_b.swap_remove(i);
        return Some((false, mb, at));
    }
    let (i, (mb, at)) = f?;
    ready_f.swap_remove(i);
    if held[w * m + mb] == 0 {
        in_flight[w] += 1;
    }
    held[w * m + mb] += 1;
    Some((true, mb, at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_schedule_respects_caps_and_dependencies() {
        // Two data-node micro-batches through a shared middle worker 2, cap 1 there.
        let r = |home: usize| {
            vec![
                Hop {
                    stage: 0,
                    worker: home,
                },
                Hop {
                    stage: 1,
                    worker: 2,
                },
                Hop {
                    stage: 2,
                    worker: home,
                },
            ]
        };
        let routes = vec![r(0), r(1), r(0)];
        let w = route_schedule(
            3,
            &routes,
            &[9, 9, 1],
            Order::BackwardFirst,
            &SimOptions::default(),
            |_, _, _| 1.0,
            |_, _, _| 0.0,
        )
        .unwrap()
        .workers;
        // Worker 2 finishes one micro-batch before it admits the next.
        let ops: Vec<String> = w[2].iter().map(|a| format!("{a}")).collect();
        assert_eq!(ops.len(), 6);
        for pair in w[2].chunks(2) {
            assert_eq!(pair[0].mb, pair[1].mb, "{ops:?}");
            assert_eq!((pair[0].op, pair[1].op), (Op::F, Op::BW));
        }
    }

    #[test]
    fn arrival_order_runs_what_became_ready_first() {
        // Two micro-batches from worker 0 through worker 1 and back to the head on worker 0,
        // whose forward takes 3: micro-batch 1's head forward is ready at 3, micro-batch 0's
        // head backward only at 5.
        let hop = |stage, worker| Hop { stage, worker };
        let routes = vec![vec![hop(0, 0), hop(1, 1), hop(2, 0)]; 2];
        let run = |order| {
            let slow_head =
                |_: usize, op: Op, st: usize| if op == Op::F && st == 2 { 3.0 } else { 1.0 };
            route_schedule(
                2,
                &routes,
                &[9, 9],
                order,
                &SimOptions::default(),
                slow_head,
                |_, _, _| 0.0,
            )
            .unwrap()
            .workers
        };
        let fourth = |w: &[Vec<Action>]| (w[0][3].op, w[0][3].mb, w[0][3].stage);
        assert_eq!(fourth(&run(Order::BackwardFirst)), (Op::BW, 0, 2));
        assert_eq!(fourth(&run(Order::Arrival)), (Op::F, 1, 2));
        // Either order runs every action once.
        for order in [Order::BackwardFirst, Order::Arrival] {
            assert_eq!(run(order).iter().map(Vec::len).sum::<usize>(), 12);
        }
    }

    #[test]
    fn idle_gap_and_unqueued_links_in_closed_form() {
        // Two micro-batches from worker 0 (forward 1 s) to worker 1 over a 3 s link.
        let hop = |stage, worker| Hop { stage, worker };
        let routes = vec![vec![hop(0, 0), hop(1, 1)]; 2];
        let second_arrival = |mechanics: SimOptions| {
            let rs = route_schedule(
                2,
                &routes,
                &[9, 9],
                Order::BackwardFirst,
                &mechanics,
                |_, _, _| 1.0,
                |a, b, _| if a == b { 0.0 } else { 3.0 },
            )
            .unwrap();
            rs.makespan
        };
        // Queued: mb 0's activation arrives at 4; mb 1's (sent at 2) waits for the link until
        // 4 and arrives at 7. Worker 1: F 4-5, B 5-6 (gradient back at 9), F 7-8, B 8-9
        // (back at 12). Worker 0's backwards: 9-10 and 12-13.
        assert_eq!(second_arrival(SimOptions::default()), 13.0);
        // Unqueued: mb 1 arrives at 5. Worker 1: F 4-5, B 5-6 (back at 9), F 6-7, B 7-8
        // (back at 11); worker 0's last backward 11-12.
        let free = SimOptions {
            no_link_queue: true,
            ..SimOptions::default()
        };
        assert_eq!(second_arrival(free), 12.0);
        // And a 0.5 s rest after each action: worker 0's forwards 0-1 and 1.5-2.5 (arrivals
        // at 4 and 5.5); worker 1: F 4-5, B 5.5-6.5 (back at 9.5), F 7-8, B 8.5-9.5 (back at
        // 12.5); worker 0's backwards 9.5-10.5 and 12.5-13.5.
        let rest = SimOptions {
            idle_gap: 0.5,
            ..free
        };
        assert_eq!(second_arrival(rest), 13.5);
    }
}

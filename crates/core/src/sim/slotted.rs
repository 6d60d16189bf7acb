//! SkipPipe's own cost model, as its scheduler prices a schedule (gensyn-ai/skippipe,
//! `schedulers/com_sym.py`), re-implemented from its behaviour so that `skip-plan` can score
//! routes by it too. It differs from pipewright's event simulator in its mechanics:
//! - Each micro-batch enters its data node in one of the node's memory slots, at round x 2.5 s
//!   + slot x forward; a slot's next round enters only after its previous one came back.
//! - Time runs in whole seconds, each in 15 passes over the nodes in device order. A node runs
//!   the work it holds that falls due in the current second, in order of (due time, arrival).
//!   Work still due in a second after its 15 passes is never run (this is how SkipPipe's own
//!   random baseline finishes 28 of its 30 micro-batches); it counts as not finished.
//! - A forward takes the node's forward time, the head (loss and its backward) on the data node
//!   a quarter of it, a backward 1.5x. A node holding its `memory` forwards retries another
//!   forward 0.1 s later.
//! - After each action the node rests 0.13 s (0.09 s after starting an injected micro-batch),
//!   and work due within its busy window moves to the window's end. Messages do not queue.

use crate::error::{Error, Result};
use crate::plan::ir::{Action, Hop, Op};
use crate::sim::SimSetup;

/// Seconds a node rests after an action, and after starting a micro-batch it injected.
const REST: f64 = 0.13;
const REST_INJECTED: f64 = 0.09;
/// Seconds between rounds of a data node's memory slots.
const ROUND_GAP: f64 = 2.5;
/// Seconds a forward that finds the node's memory full waits before trying again.
const RETRY: f64 = 0.1;
/// Passes over the nodes in each second, and the seconds simulated.
const PASSES: usize = 15;
const HORIZON: f64 = 10_000.0;
/// The arrival stamp of injected work: later than any message, so that it loses ties.
const INJECTED: f64 = 10_000.0;

/// Where a micro-batch enters: the memory slot of its data node it takes, and which round of
/// that slot it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub mb: usize,
    pub slot: usize,
    pub round: usize,
}

/// What to price: routes as `skip-plan` writes them (data node, middle hops, the head back on
/// the data node), the slots the micro-batches enter in, and per device how many forwards it
/// may hold.
#[derive(Debug, Clone, Copy)]
pub struct SlottedSetup<'a> {
    pub routes: &'a [Vec<Hop>],
    pub slots: &'a [Slot],
    pub memory: &'a [usize],
}

/// When the last micro-batch is back on its data node, and how many came back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlottedRun {
    pub pipeline_time: f64,
    pub finished: usize,
}

/// The slots micro-batches enter in when each data node starts them in its order (its first
/// hop's forwards) and each takes the slot that was freed first (by a first hop's backward),
/// as SkipPipe's agents reuse theirs: `memory[node]` slots per data node. `None` if a data node
/// starts more micro-batches at once than it has slots.
pub fn plan_slots(
    routes: &[Vec<Hop>],
    workers: &[Vec<Action>],
    memory: &[usize],
) -> Option<Vec<Slot>> {
    let mut homes: Vec<usize> = routes
        .iter()
        .filter_map(|r| r.first().map(|h| h.worker))
        .collect();
    homes.sort_unstable();
    homes.dedup();
    let mut out = Vec::with_capacity(routes.len());
    for home in homes {
        let first = |a: &Action| {
            routes.get(a.mb).and_then(|r| r.first())
                == Some(&Hop {
                    stage: a.stage,
                    worker: home,
                })
        };
        let mine = routes
            .iter()
            .filter(|r| r.first().is_some_and(|h| h.worker == home))
            .count();
        let mut free: std::collections::VecDeque<usize> = (0..memory[home].min(mine)).collect();
        let mut rounds = vec![0; free.len()];
        let mut taken = std::collections::HashMap::new();
        for a in workers.get(home)?.iter().filter(|a| first(a)) {
            if a.op == Op::F {
                let slot = free.pop_front()?;
                taken.insert(a.mb, slot);
                out.push(Slot {
                    mb: a.mb,
                    slot,
                    round: rounds[slot],
                });
                rounds[slot] += 1;
            } else if let Some(slot) = taken.remove(&a.mb) {
                free.push_back(slot);
            }
        }
    }
    Some(out)
}

/// SkipPipe's routes: each starts on its data node, visits other nodes once each, and ends with
/// the head back on the data node.
fn check_routes(routes: &[Vec<Hop>]) -> Result<()> {
    for (mb, r) in routes.iter().enumerate() {
        let bad = |why: &str| {
            Err(Error::Invalid(format!(
                "micro-batch {mb}'s route {why}, which SkipPipe's cost model cannot price (it prices routes as `skip-plan` writes them)"
            )))
        };
        let (Some(first), Some(last)) = (r.first(), r.last()) else {
            return bad("is empty");
        };
        if r.len() < 2 || first.worker != last.worker {
            return bad("does not end on its data node");
        }
        let mut chain: Vec<usize> = r[..r.len() - 1].iter().map(|h| h.worker).collect();
        chain.sort_unstable();
        if chain.windows(2).any(|w| w[0] == w[1]) {
            return bad("visits a node twice");
        }
    }
    Ok(())
}

/// `setup`'s plan priced in SkipPipe's cost model, slots as [`plan_slots`] gives them and the
/// devices' in-flight caps as its memory; an error if the plan starts more micro-batches on a
/// data node at once than the node's cap.
pub fn slotted_plan_time(setup: &SimSetup) -> Result<SlottedRun> {
    let (plan, cluster) = (setup.plan, setup.cluster);
    check_routes(&plan.routes)?;
    let memory: Vec<usize> = cluster
        .devices
        .iter()
        .map(|d| d.memory_microbatches.map_or(usize::MAX, |c| c as usize))
        .collect();
    let slots = plan_slots(&plan.routes, &plan.workers, &memory).ok_or_else(|| {
        Error::Invalid("a data node starts more micro-batches at once than it may hold (its memory_microbatches), which SkipPipe's cost model cannot price".into())
    })?;
    let speed: Vec<f64> = cluster.devices.iter().map(|d| d.speed).collect();
    let costs = setup.stages;
    Ok(slotted_time(
        SlottedSetup {
            routes: &plan.routes,
            slots: &slots,
            memory: &memory,
        },
        |w, op, st| match op {
            Op::F => costs[st].forward / speed[w],
            _ => costs[st].full_backward() / speed[w],
        },
        |a, b, st| cluster.transfer_time(a, b, costs[st].activation_out),
    ))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Forward,
    /// The head on the data node, after the last middle forward.
    Head,
    Backward,
}

/// Work held by a node: micro-batch `mb` at position `at` of its chain (data node, middle hops).
#[derive(Debug, Clone, Copy)]
struct Work {
    mb: usize,
    at: usize,
    phase: Phase,
    due: f64,
    arrived: f64,
    done: bool,
}

struct Node {
    held: Vec<Work>,
    /// When the node may start its next action.
    free_at: f64,
    /// Forwards it may still take in.
    memory: i64,
}

struct Run<'a, D, T> {
    setup: SlottedSetup<'a>,
    duration: D,
    transfer: T,
    nodes: Vec<Node>,
    /// Per micro-batch: its slot's index in `busy`, and its round.
    slot_of: Vec<(usize, usize)>,
    /// Per (data node, slot): a micro-batch of it is out.
    busy: Vec<bool>,
    finished: usize,
    end: f64,
}

/// Price `setup` in SkipPipe's cost model. `duration(worker, op, stage)` and
/// `transfer(from, to, stage)` give the times as in [`super::dispatch::route_schedule`]: a
/// forward, a whole backward, and the head (its forward and backward together, which is
/// SkipPipe's quarter of a forward when priced as its profiles are).
pub fn slotted_time(
    setup: SlottedSetup<'_>,
    duration: impl Fn(usize, Op, usize) -> f64,
    transfer: impl Fn(usize, usize, usize) -> f64,
) -> SlottedRun {
    let n = setup.memory.len();
    let slots = setup.slots.iter().map(|s| s.slot + 1).max().unwrap_or(0);
    let mut run = Run {
        setup,
        duration,
        transfer,
        nodes: (0..n)
            .map(|w| Node {
                held: Vec::new(),
                free_at: 0.0,
                memory: setup.memory[w].min(i64::MAX as usize) as i64,
            })
            .collect(),
        slot_of: vec![(0, 0); setup.routes.len()],
        busy: vec![false; n * slots],
        finished: 0,
        end: 0.0,
    };
    for s in setup.slots {
        let home = setup.routes[s.mb][0].worker;
        run.slot_of[s.mb] = (home * slots + s.slot, s.round);
        let due = s.round as f64 * ROUND_GAP + s.slot as f64 * run.forward(home, s.mb);
        run.nodes[home].held.push(Work {
            mb: s.mb,
            at: 0,
            phase: Phase::Forward,
            due,
            arrived: INJECTED,
            done: false,
        });
    }
    let mut second = run.next_second(0.0);
    while let Some(sec) = second.filter(|&s| s < HORIZON) {
        for _ in 0..PASSES {
            // A pass that changes nothing leaves the same state for the next one.
            let mut changed = false;
            for w in 0..n {
                changed |= run.step(w, sec);
            }
            if !changed {
                break;
            }
        }
        second = run.next_second(sec + 1.0);
    }
    SlottedRun {
        pipeline_time: run.end,
        finished: run.finished,
    }
}

impl<D, T> Run<'_, D, T>
where
    D: Fn(usize, Op, usize) -> f64,
    T: Fn(usize, usize, usize) -> f64,
{
    /// Seconds of micro-batch `mb`'s first forward on its data node `w`.
    fn forward(&self, w: usize, mb: usize) -> f64 {
        (self.duration)(w, Op::F, self.setup.routes[mb][0].stage)
    }

    /// The first second from `from` on in which work falls due; work due earlier was missed
    /// for good and is dropped.
    fn next_second(&mut self, from: f64) -> Option<f64> {
        for node in &mut self.nodes {
            node.held.retain(|w| w.due.floor() >= from);
        }
        self.nodes
            .iter()
            .flat_map(|nd| nd.held.iter().map(|w| w.due.floor()))
            .min_by(f64::total_cmp)
    }

    /// One visit of node `w` in second `sec`: runs, in order, the work due then that the
    /// node can take. True if anything changed.
    fn step(&mut self, w: usize, sec: f64) -> bool {
        // Nothing due: nothing changes (and sorting later gives the same order, the sort
        // being stable).
        if !self.nodes[w].held.iter().any(|x| x.due.floor() == sec) {
            return false;
        }
        let mut held = std::mem::take(&mut self.nodes[w].held);
        held.sort_by(|a, b| {
            a.due
                .total_cmp(&b.due)
                .then(a.arrived.total_cmp(&b.arrived))
        });
        let mut changed = false;
        let mut i = 0;
        while i < held.len() {
            let it = held[i];
            i += 1;
            if it.due.floor() != sec || it.done {
                continue;
            }
            let node = &mut self.nodes[w];
            let (slot, round) = self.slot_of[it.mb];
            if it.due < node.free_at {
                held[i - 1].due = node.free_at;
            } else if it.phase == Phase::Forward && node.memory <= 0 {
                held[i - 1].due += RETRY;
            } else if it.phase == Phase::Forward && it.at == 0 && round > 0 && self.busy[slot] {
                // Its slot is still out: it waits, unchanged.
                continue;
            } else {
                let end = self.act(w, it, &mut held);
                let rest = if it.arrived > 1000.0 {
                    REST_INJECTED
                } else {
                    REST
                };
                let free_at = end + rest;
                self.nodes[w].free_at = free_at;
                for other in held.iter_mut().filter(|o| o.mb != it.mb) {
                    if it.due <= other.due && free_at > other.due {
                        other.due = free_at;
                    }
                }
                held[i - 1].done = true;
            }
            changed = true;
        }
        held.retain(|x| !x.done);
        self.nodes[w].held = held;
        changed
    }

    /// Run `it` on node `w` and send what follows; returns when the action ends.
    fn act(&mut self, w: usize, it: Work, held: &mut Vec<Work>) -> f64 {
        // The micro-batch's data node and middle hops, then the head.
        let route = self.setup.routes[it.mb].as_slice();
        let (chain, head) = route.split_at(route.len() - 1);
        let (last, home) = (chain.len() - 1, chain[0].worker);
        let stage = chain[it.at].stage;
        let (end, next) = match it.phase {
            Phase::Forward => {
                self.nodes[w].memory -= 1;
                if it.at == 0 {
                    self.busy[self.slot_of[it.mb].0] = true;
                }
                let end = it.due + (self.duration)(w, Op::F, stage);
                if it.at < last {
                    (end, Some((it.at + 1, Phase::Forward, stage)))
                } else {
                    (end, Some((it.at, Phase::Head, stage)))
                }
            }
            Phase::Head => {
                let h = head[0].stage;
                let secs = (self.duration)(w, Op::F, h) + (self.duration)(w, Op::BW, h);
                (
                    it.due + secs,
                    Some((last, Phase::Backward, chain[last].stage)),
                )
            }
            Phase::Backward => {
                self.nodes[w].memory += 1;
                let end = it.due + (self.duration)(w, Op::BW, stage);
                if it.at > 0 {
                    let before = chain[it.at - 1].stage;
                    (end, Some((it.at - 1, Phase::Backward, before)))
                } else {
                    self.busy[self.slot_of[it.mb].0] = false;
                    self.finished += 1;
                    self.end = self.end.max(end);
                    (end, None)
                }
            }
        };
        if let Some((at, phase, payload)) = next {
            // The head runs on the data node, the rest where the chain says.
            let to = if phase == Phase::Head {
                home
            } else {
                chain[at].worker
            };
            let due = end + (self.transfer)(w, to, payload);
            let work = Work {
                mb: it.mb,
                at,
                phase,
                due,
                arrived: due,
                done: false,
            };
            if to == w {
                held.push(work);
            } else {
                self.nodes[to].held.push(work);
            }
        }
        end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Micro-batches entering data node 0, each going through node 1 (stage 1) and back to
    /// the head (stage 2) on node 0: forwards of 1 s, backwards of 1.5 s, the head 0.25 s,
    /// messages 0.5 s. The expected figures are com_sym.py's own for the same agents.
    fn two_nodes(slots: &[Slot]) -> SlottedRun {
        let route = vec![
            Hop {
                stage: 0,
                worker: 0,
            },
            Hop {
                stage: 1,
                worker: 1,
            },
            Hop {
                stage: 2,
                worker: 0,
            },
        ];
        let routes = vec![route; slots.len()];
        slotted_time(
            SlottedSetup {
                routes: &routes,
                slots,
                memory: &[3, 3],
            },
            |_, op, st| match (op, st) {
                (Op::F, 2) => 0.25,
                (_, 2) => 0.0,
                (Op::F, _) => 1.0,
                _ => 1.5,
            },
            |a, b, _| if a == b { 0.0 } else { 0.5 },
        )
    }

    #[test]
    fn one_micro_batch_in_closed_form() {
        // 0-1 forward, 1.5-2.5 on node 1, head 3.0-3.25, backward 3.75-5.25, home 5.75-7.25.
        let run = two_nodes(&[Slot {
            mb: 0,
            slot: 0,
            round: 0,
        }]);
        assert_eq!(
            run,
            SlottedRun {
                pipeline_time: 7.25,
                finished: 1
            }
        );
    }

    #[test]
    fn a_node_rests_after_each_action_and_postpones_what_falls_due() {
        // The second slot enters at 1 s but the data node rests until 1.09 s (0.09 s after an
        // injected micro-batch); everything after shifts with the 0.13 s rests (com_sym.py: 8.89).
        let run = two_nodes(&[
            Slot {
                mb: 0,
                slot: 0,
                round: 0,
            },
            Slot {
                mb: 1,
                slot: 1,
                round: 0,
            },
        ]);
        assert_eq!(run.finished, 2);
        assert!((run.pipeline_time - 8.89).abs() < 1e-9, "{run:?}");
    }

    #[test]
    fn a_round_due_while_its_slot_is_out_and_the_node_idle_is_lost() {
        // The slot's second round falls due at 2.5 s while the first is still out; nothing
        // else runs on the data node in that second, so it is never run (com_sym.py: 1 of 2).
        let run = two_nodes(&[
            Slot {
                mb: 0,
                slot: 0,
                round: 0,
            },
            Slot {
                mb: 1,
                slot: 0,
                round: 1,
            },
        ]);
        assert_eq!(
            run,
            SlottedRun {
                pipeline_time: 7.25,
                finished: 1
            }
        );
    }

    #[test]
    fn slots_follow_the_data_nodes_order_first_freed_first_taken() {
        let r = |home| {
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
        let routes = vec![r(0), r(0), r(0), r(1)];
        let (f, b) = (
            |mb| Action::new(Op::F, 0, mb),
            |mb| Action::new(Op::BW, 0, mb),
        );
        let workers = vec![
            vec![f(0), f(1), b(1), f(2), b(0), b(2)],
            vec![f(3), b(3)],
            vec![],
        ];
        let slots = plan_slots(&routes, &workers, &[2, 2, 2]).expect("fits");
        let at = |mb| slots.iter().find(|s| s.mb == mb).map(|s| (s.slot, s.round));
        assert_eq!(
            [at(0), at(1), at(2), at(3)],
            [Some((0, 0)), Some((1, 0)), Some((1, 1)), Some((0, 0))]
        );
        // Three at once on a node with two slots cannot be priced.
        let crowded = vec![
            vec![f(0), f(1), f(2), b(0), b(1), b(2)],
            vec![f(3), b(3)],
            vec![],
        ];
        assert_eq!(plan_slots(&routes, &crowded, &[2, 2, 2]), None);
    }
}

//! Schedule generators: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V, looped BFS, interleaved
//! zero bubble and DualPipeV, each producing a [`Plan`].
//!
//! GPipe, 1F1B and interleaved 1F1B are the closed-form orders of their papers (Huang et al.
//! 2019; Narayanan et al. 2019/2021). The zero-bubble orders (Qi et al. 2024) are produced the way
//! that paper's automatic scheduler does it in spirit: a greedy list schedule on unit costs that
//! runs `B` first (it is on the critical path), then `F` while memory allows, and fills the
//! remaining idle time with deferred `W`s.

mod dualpipev;
mod interleaved_zb;
mod looped_bfs;

use crate::error::{Error, Field, Result};
use crate::plan::deps::{need_count, unblocks, Pending, Waiter};
use crate::plan::ir::{Action, Op, Plan};
pub use crate::plan::ScheduleKind;
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

/// Build the plan of `kind` for `workers` pipeline workers, `microbatches` micro-batches and
/// `chunks` stages per worker (interleaved: any V >= 1; ZB-V: 2; others: 1).
pub fn generate(
    kind: ScheduleKind,
    workers: usize,
    microbatches: usize,
    chunks: usize,
) -> Result<Plan> {
    check_request(kind, workers, microbatches, chunks)?;
    match kind {
        ScheduleKind::Custom => unreachable!("refused by check_request"),
        ScheduleKind::GPipe => Ok(gpipe(workers, microbatches)),
        ScheduleKind::OneFOneB => Ok(interleaved(workers, microbatches, 1, kind)),
        ScheduleKind::Interleaved => Ok(interleaved(workers, microbatches, chunks, kind)),
        ScheduleKind::ZbH1 => Ok(zb_h1(workers, microbatches)),
        ScheduleKind::ZbV => zb_v(workers, microbatches),
        ScheduleKind::LoopedBfs => Ok(looped_bfs::looped_bfs(workers, microbatches, chunks)),
        ScheduleKind::InterleavedZb => Ok(interleaved_zb::interleaved_zb(
            workers,
            microbatches,
            chunks,
        )),
        ScheduleKind::DualPipeV => Ok(dualpipev::dualpipev(workers, microbatches)),
        // Its order depends on the stages' costs: `job::build` searches it (search::zbauto).
        ScheduleKind::ZbAuto => Err(Error::Schedule(
            "zb-auto is searched for the stages' costs, not generated: build it as a job (job::build)".into(),
        )),
    }
}

/// Can `kind` be generated for these sizes? The checks of [`generate`], without building
/// anything (for callers that build the plan another way, such as zb-auto with real costs).
pub fn check_request(
    kind: ScheduleKind,
    workers: usize,
    microbatches: usize,
    chunks: usize,
) -> Result<()> {
    let err = |m: String| Err(Error::Schedule(format!("{kind}: {m}")));
    let shape = |f: Field, v: usize, m: String| Err(Error::shape(f, v, format!("{kind} {m}")));
    if workers == 0 {
        return shape(Field::Depth, 0, "needs at least 1 stage".into());
    }
    if microbatches == 0 {
        return shape(
            Field::Microbatches,
            0,
            "needs at least 1 micro-batch".into(),
        );
    }
    if chunks == 0 {
        return shape(Field::Chunks, 0, "needs at least 1 chunk per worker".into());
    }
    crate::limits::check_size(workers, chunks, 1, microbatches)?;
    match kind {
        ScheduleKind::Custom => err("is not a generator: custom plans are written by hand or by a planner".into()),
        ScheduleKind::GPipe | ScheduleKind::OneFOneB | ScheduleKind::ZbH1 | ScheduleKind::ZbAuto if chunks != 1 => {
            shape(Field::Chunks, chunks, "places one stage per worker; more chunks need interleaved or zbv".into())
        }
        ScheduleKind::ZbV | ScheduleKind::DualPipeV if chunks != 2 => shape(Field::Chunks, chunks, "places exactly 2 chunks per worker in a V".into()),
        ScheduleKind::DualPipeV if microbatches < 2 * workers => shape(
            Field::Microbatches,
            microbatches,
            format!("needs at least as many micro-batches as stages, 2P = {}", 2 * workers),
        ),
        ScheduleKind::Interleaved if !microbatches.is_multiple_of(workers) => shape(
            Field::Microbatches,
            microbatches,
            format!("needs the micro-batches to be a multiple of the stages (they go round in groups of P = {workers})"),
        ),
        ScheduleKind::InterleavedZb => {
            let (rounds, _) = interleaved_zb::rounds(workers, microbatches);
            match microbatches.is_multiple_of(rounds) {
                true => Ok(()),
                false => shape(
                    Field::Microbatches,
                    microbatches,
                    format!("needs the micro-batches to be a multiple of their rounds, max(1, M / P) = {rounds}"),
                ),
            }
        }
        _ => Ok(()),
    }
}

fn gpipe(p: usize, m: usize) -> Plan {
    let workers = (0..p)
        .map(|s| {
            (0..m)
                .map(|mb| Action::new(Op::F, s, mb))
                .chain((0..m).map(|mb| Action::new(Op::BW, s, mb)))
                .collect()
        })
        .collect();
    Plan::pipeline(ScheduleKind::GPipe, (0..p).collect(), m, workers)
}

/// Interleaved 1F1B with `v` chunks per worker (Megatron-LM's order); `v = 1` is plain 1F1B.
/// Stage `c * p + w` is chunk `c` of worker `w`. Micro-batches go round in groups of `p`:
/// forward number `k` of a worker is chunk `(k / p) % v` of micro-batch `(k / (p v)) p + k % p`;
/// backwards walk the chunks in reverse.
fn interleaved(p: usize, m: usize, v: usize, kind: ScheduleKind) -> Plan {
    let total = m * v;
    let unit = |k: usize, backward: bool| {
        let group = k / (p * v);
        let chunk = (k % (p * v)) / p;
        let chunk = if backward { v - 1 - chunk } else { chunk };
        let mb = if v == 1 { k } else { group * p + k % p };
        (chunk, mb)
    };
    let workers = (0..p)
        .map(|w| {
            let warmup = if v == 1 {
                (p - w - 1).min(m)
            } else {
                ((p - w - 1) * 2 + (v - 1) * p).min(total)
            };
            let mut acts = Vec::with_capacity(2 * total);
            let fwd = |k: usize| {
                let (c, mb) = unit(k, false);
                Action::new(Op::F, c * p + w, mb)
            };
            let bwd = |k: usize| {
                let (c, mb) = unit(k, true);
                Action::new(Op::BW, c * p + w, mb)
            };
            acts.extend((0..warmup).map(fwd));
            for k in 0..total - warmup {
                acts.push(fwd(warmup + k));
                acts.push(bwd(k));
            }
            acts.extend((total - warmup..total).map(bwd));
            acts
        })
        .collect();
    Plan::pipeline(kind, (0..p * v).map(|s| s % p).collect(), m, workers)
}

/// ZB-H1: the 1F1B order with each backward split in two; worker `w` runs the `W` of
/// micro-batch `j` right after the `B` of micro-batch `j + w`, and the last `w` of them at the
/// end, where 1F1B's cool-down bubble was. Worker `w` thus holds at most `P` micro-batches'
/// activations (1F1B's worst worker) and the bubble shrinks to `(P - 1)(F + B - W)`.
fn zb_h1(p: usize, m: usize) -> Plan {
    let mut plan = interleaved(p, m, 1, ScheduleKind::ZbH1);
    for (w, acts) in plan.workers.iter_mut().enumerate() {
        let mut out = Vec::with_capacity(acts.len() + m);
        let mut next_w = 0;
        for a in acts.iter() {
            if a.op == Op::BW {
                out.push(Action::new(Op::B, a.stage, a.mb));
                if a.mb >= w {
                    out.push(Action::new(Op::W, a.stage, next_w));
                    next_w += 1;
                }
            } else {
                out.push(*a);
            }
        }
        out.extend((next_w..m).map(|mb| Action::new(Op::W, w, mb)));
        *acts = out;
    }
    plan
}

/// What a worker's memory limit counts when it admits a forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Micro-batches holding activations on the worker; one in flight may always continue,
    /// so a V placement cannot deadlock.
    MicroBatches,
    /// Stage-chunk activations held on the worker (the peak memory itself): tighter packing,
    /// but a greedy order may stall.
    Chunks,
}

/// A time in the list schedulers' event queues (ordered by `total_cmp`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Time(pub f64);
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Time {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// How the greedy list schedule picks a worker's next action.
pub struct Greedy<'a> {
    /// Memory limit per worker, counted as `admit` says.
    pub limit: &'a [usize],
    pub admit: Admission,
    /// Run a pending `W` before an admissible `F` once this many are pending (`usize::MAX`:
    /// only when no `F` can run, the zero-bubble default).
    pub w_first_at: usize,
    /// Duration of `op` on `stage`.
    pub duration: &'a dyn Fn(Op, usize) -> f64,
}

/// Greedy list schedule with split backward, in simulated time. Each free worker runs, in
/// order of preference: the oldest ready `B`; the oldest ready `F` that the memory limit
/// admits (or first a pending `W` once `w_first_at` are pending); the oldest pending `W`.
/// Returns the plan and its makespan (without communication).
pub fn greedy(
    kind: ScheduleKind,
    placement: Vec<usize>,
    m: usize,
    g: &Greedy,
) -> Result<(Plan, f64)> {
    let s_count = placement.len();
    let p = g.limit.len();
    let mut ready = Ready {
        f: vec![BTreeSet::new(); p],
        b: vec![BTreeSet::new(); p],
        w: vec![BTreeSet::new(); p],
        pending: Pending::new(3 * s_count * m),
        stages: s_count,
        m,
    };
    let mut chunks_in_flight = vec![0usize; p * m];
    let mut mbs_in_flight = vec![0usize; p];
    let mut chunks_total = vec![0usize; p];
    let mut busy = vec![false; p];
    let mut workers: Vec<Vec<Action>> = vec![Vec::new(); p];
    for mb in 0..m {
        ready.f[placement[0]].insert((mb, 0));
    }
    // (end time, worker, index of the action in the worker's list)
    let mut events: BinaryHeap<Reverse<(Time, usize, usize)>> = BinaryHeap::new();
    let total = 3 * m * s_count;
    let mut done = 0;
    let mut t = 0.0;
    loop {
        for w in 0..p {
            if busy[w] {
                continue;
            }
            let admissible = ready.f[w].iter().find(|&&(mb, _)| match g.admit {
                // A micro-batch already in flight may always continue.
                Admission::MicroBatches => {
                    chunks_in_flight[w * m + mb] > 0 || mbs_in_flight[w] < g.limit[w]
                }
                Admission::Chunks => chunks_total[w] < g.limit[w],
            });
            let w_first = ready.w[w].len() >= g.w_first_at;
            let pick = if let Some(&(mb, Reverse(s))) = ready.b[w].iter().next() {
                ready.b[w].remove(&(mb, Reverse(s)));
                Some(Action::new(Op::B, s, mb))
            } else if let (Some(&(mb, s)), false) = (admissible, w_first) {
                ready.f[w].remove(&(mb, s));
                chunks_total[w] += 1;
                if chunks_in_flight[w * m + mb] == 0 {
                    mbs_in_flight[w] += 1;
                }
                chunks_in_flight[w * m + mb] += 1;
                Some(Action::new(Op::F, s, mb))
            } else if let Some(&(mb, s)) = ready.w[w].iter().next() {
                ready.w[w].remove(&(mb, s));
                Some(Action::new(Op::W, s, mb))
            } else {
                None
            };
            if let Some(a) = pick {
                busy[w] = true;
                workers[w].push(a);
                let end = t + (g.duration)(a.op, a.stage);
                events.push(Reverse((Time(end), w, workers[w].len() - 1)));
            }
        }
        let Some(Reverse((Time(t1), _, _))) = events.peek().copied() else {
            break;
        };
        t = t1;
        while let Some(&Reverse((Time(te), w, i))) = events.peek() {
            if te != t {
                break;
            }
            events.pop();
            busy[w] = false;
            done += 1;
            let a = workers[w][i];
            ready.release(a, &placement);
            // A micro-batch's activations on a stage are freed by its last backward part.
            if matches!(a.op, Op::W | Op::BW) {
                chunks_total[w] -= 1;
                chunks_in_flight[w * m + a.mb] -= 1;
                if chunks_in_flight[w * m + a.mb] == 0 {
                    mbs_in_flight[w] -= 1;
                }
            }
        }
    }
    if done != total {
        return Err(Error::Schedule(format!("{kind}: greedy schedule stalled after {done} of {total} actions (memory limit too tight)")));
    }
    Ok((Plan::pipeline(kind, placement, m, workers), t))
}

/// The greedy scheduler's ready actions per worker: `F` and `W` keyed (mb, stage), `B` keyed
/// (mb, Reverse(stage)) so the deepest runs first; with the needs each still waits for.
struct Ready {
    f: Vec<BTreeSet<(usize, usize)>>,
    b: Vec<BTreeSet<(usize, Reverse<usize>)>>,
    w: Vec<BTreeSet<(usize, usize)>>,
    pending: Pending,
    stages: usize,
    m: usize,
}

impl Ready {
    /// `a` completed: what it makes ready, by the IR's dependency rule (every micro-batch
    /// visits the stages in model order; stage s on worker `placement[s]`).
    fn release(&mut self, a: Action, placement: &[usize]) {
        let around = |s: usize| (s.checked_sub(1), (s + 1 < self.stages).then_some(s + 1));
        let (prev, next) = around(a.stage);
        for waiter in unblocks(a.op, a.stage, prev, next).into_iter().flatten() {
            let (class, st) = match waiter {
                Waiter::Forward(st) => (0, st),
                Waiter::Backward(st) => (1, st),
                Waiter::Weight(st) => (2, st),
            };
            let (p2, n2) = around(st);
            let slot = (class * self.stages + st) * self.m + a.mb;
            if !self.pending.meet(slot, need_count(waiter, p2, n2)) {
                continue;
            }
            let host = placement[st];
            match waiter {
                Waiter::Forward(_) => self.f[host].insert((a.mb, st)),
                Waiter::Backward(_) => self.b[host].insert((a.mb, Reverse(st))),
                Waiter::Weight(_) => self.w[host].insert((a.mb, st)),
            };
        }
    }
}

/// ZB-V: the V placement (worker w holds stages w and 2P-1-w) under the greedy list schedule,
/// with at most 2P stage-chunks of activations on a worker (what P micro-batches in flight
/// would hold). Counting chunks packs tighter than counting micro-batches (P=8, M=32: 199
/// against 203 unit steps; torch's ZBVZeroBubble takes 199); the micro-batch count, which
/// cannot stall, is the fallback, and the shorter of the two is kept.
fn zb_v(p: usize, m: usize) -> Result<Plan> {
    let placement: Vec<usize> = (0..2 * p)
        .map(|s| if s < p { s } else { 2 * p - 1 - s })
        .collect();
    let kind = ScheduleKind::ZbV;
    let unit = |_: Op, _: usize| 1.0;
    let run = |limit: usize, admit: Admission| {
        let g = Greedy {
            limit: &vec![limit; p],
            admit,
            w_first_at: usize::MAX,
            duration: &unit,
        };
        greedy(kind, placement.clone(), m, &g)
    };
    let safe = run(p, Admission::MicroBatches)?;
    Ok(match run(2 * p, Admission::Chunks) {
        Ok(tight) if tight.1 <= safe.1 => tight.0,
        _ => safe.0,
    })
}

/// A plan for arbitrary routes (stages skipped or swapped, several stages per worker): each
/// worker runs its forwards in (micro-batch, route position) order, then its full backwards in
/// (micro-batch, reverse position) order. Both orders follow one global order of the
/// dependencies, so any valid routes run without deadlock (GPipe's memory, not its speed).
pub fn gpipe_routes(
    stages: Vec<crate::plan::ir::StagePlan>,
    routes: Vec<Vec<crate::plan::ir::Hop>>,
    num_workers: usize,
) -> Plan {
    let mut fwd: Vec<Vec<Action>> = vec![Vec::new(); num_workers];
    let mut bwd: Vec<Vec<Action>> = vec![Vec::new(); num_workers];
    for (mb, r) in routes.iter().enumerate() {
        for h in r {
            if let Some(f) = fwd.get_mut(h.worker) {
                f.push(Action::new(Op::F, h.stage, mb));
            }
        }
        for h in r.iter().rev() {
            if let Some(b) = bwd.get_mut(h.worker) {
                b.push(Action::new(Op::BW, h.stage, mb));
            }
        }
    }
    let workers = fwd
        .into_iter()
        .zip(bwd)
        .map(|(mut f, b)| {
            f.extend(b);
            f
        })
        .collect();
    Plan::custom(stages, routes, workers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_f_one_b_shape() {
        let p = generate(ScheduleKind::OneFOneB, 4, 8, 1).unwrap();
        let w0: Vec<String> = p.workers[0]
            .iter()
            .map(|a| format!("{}{}", a.op.as_str(), a.mb))
            .collect();
        assert_eq!(w0[..6], ["F0", "F1", "F2", "F3", "BW0", "F4"]);
        let w3: Vec<String> = p.workers[3]
            .iter()
            .take(4)
            .map(|a| format!("{}{}", a.op.as_str(), a.mb))
            .collect();
        assert_eq!(w3, ["F0", "BW0", "F1", "BW1"]);
    }

    #[test]
    fn any_routes_run_in_gpipe_order() {
        use crate::plan::ir::{Hop, StagePlan};
        let st = |hosts: Vec<usize>| StagePlan {
            layers: 2,
            hosts,
            cost: None,
        };
        // Stage 3 (the head) on worker 0 with the embedding; stage 1 on two workers.
        let stages = vec![st(vec![0]), st(vec![1, 2]), st(vec![3]), st(vec![0])];
        let h = |stage, worker| Hop { stage, worker };
        let routes = vec![
            vec![h(0, 0), h(1, 1), h(2, 3), h(3, 0)],
            vec![h(0, 0), h(2, 3), h(1, 2), h(3, 0)],
            vec![h(0, 0), h(2, 3), h(3, 0)],
            vec![h(0, 0), h(1, 2), h(3, 0)],
        ];
        let plan = gpipe_routes(stages, routes, 4);
        crate::plan::validate::validate(&plan).unwrap();
        assert_eq!(plan.workers[0].len(), 4 * 2 * 2);
    }

    #[test]
    fn bad_combinations_are_errors() {
        let e = |k, p, m, v| generate(k, p, m, v).unwrap_err().to_string();
        assert!(e(ScheduleKind::Interleaved, 4, 6, 2).contains(
            "micro-batches 6: interleaved needs the micro-batches to be a multiple of the stages"
        ));
        assert!(e(ScheduleKind::ZbV, 4, 8, 3).contains("exactly 2 chunks"));
        assert!(e(ScheduleKind::OneFOneB, 4, 8, 2).contains("one stage per worker"));
        assert!(e(ScheduleKind::GPipe, 0, 8, 1).contains("stages 0: gpipe needs at least 1 stage"));
        assert!("pipedream"
            .parse::<ScheduleKind>()
            .unwrap_err()
            .to_string()
            .contains("unknown schedule"));
    }
}

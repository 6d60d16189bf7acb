//! Interleaved zero bubble: the interleaved 1F1B order with the backward split into `B` and
//! `W` (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", its ZB-1P with `V` chunks per
//! worker), in the per-rank order of torch.distributed.pipelining's
//! `ScheduleInterleavedZeroBubble`.
//!
//! Micro-batches go round in `R = max(1, M / P)` rounds of `M / R`. Worker `w` warms up with
//! `(V - 1) M / R + P - 1 - w` forwards (one fewer per hop than interleaved 1F1B's two, as in
//! ZB-H1: the `W`s fill what the second would have waited for). In the steady phase each
//! forward is followed by a `B`; from the `(w + 1)`-th `B` on, each `B` is followed by the `W`
//! of the oldest `B` whose `W` has not run; the last `W`s close the step. Forwards walk the
//! chunks up, a round at a time; `B`s walk them down. A stage's micro-batches run in order.

use crate::plan::ir::{Action, Op, Plan};
use crate::plan::ScheduleKind;

/// The rounds micro-batches go in: `(rounds, micro-batches per round)`. `M` must be a
/// multiple of the rounds (checked by `check_request`).
pub(super) fn rounds(p: usize, m: usize) -> (usize, usize) {
    let r = (m / p).max(1);
    (r, m / r)
}

pub(super) fn interleaved_zb(p: usize, m: usize, v: usize) -> Plan {
    let (_, per_round) = rounds(p, m);
    let workers = (0..p).map(|w| worker(p, m, v, per_round, w)).collect();
    Plan::pipeline(
        ScheduleKind::InterleavedZb,
        (0..p * v).map(|s| s % p).collect(),
        m,
        workers,
    )
}

fn worker(p: usize, m: usize, v: usize, per_round: usize, w: usize) -> Vec<Action> {
    let units = v * m;
    let warmup = ((v - 1) * per_round + p - 1 - w).min(units);
    let up = |k: usize| ((k / per_round) % v) * p + w;
    let down = |k: usize| (v - 1 - ((k - warmup) / per_round) % v) * p + w;
    // The next micro-batch of each stage, per op.
    let mut next = vec![[0usize; 3]; p * v];
    let mut take = |op: Op, s: usize| {
        let i = match op {
            Op::F => 0,
            Op::B => 1,
            _ => 2,
        };
        next[s][i] += 1;
        Action::new(op, s, next[s][i] - 1)
    };
    let mut acts = Vec::with_capacity(3 * units);
    let mut b_stages = Vec::with_capacity(units);
    for k in 0..units + warmup {
        if k < units {
            acts.push(take(Op::F, up(k)));
        }
        if k >= warmup {
            acts.push(take(Op::B, down(k)));
            b_stages.push(down(k));
            if k - warmup >= w {
                let s = b_stages[k - warmup - w];
                acts.push(take(Op::W, s));
            }
        }
    }
    let done = units.saturating_sub(w);
    for &s in &b_stages[done.min(b_stages.len())..] {
        acts.push(take(Op::W, s));
    }
    acts
}

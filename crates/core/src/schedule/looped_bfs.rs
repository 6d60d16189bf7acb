//! Looped BFS: breadth-first pipeline parallelism (Lamy-Poirier 2023, arXiv 2211.05953), in
//! the per-rank order of torch.distributed.pipelining's `ScheduleLoopedBFS`.
//!
//! Worker `w` holds stages `w, w + P, ...` (a loop through the workers `V` times). It runs the
//! forwards of every micro-batch through its first stage, then through its next one (breadth
//! first: all micro-batches that are ready for an earlier stage go before any later stage),
//! then the full backwards stage by stage from its last, each over the micro-batches in
//! reverse. Every worker thus holds `V M` micro-batches' activations at the turn, as GPipe does;
//! the gain is fewer bubbles between the loops when `M` is large.

use crate::plan::ir::{Action, Op, Plan};
use crate::plan::ScheduleKind;

pub(super) fn looped_bfs(p: usize, m: usize, v: usize) -> Plan {
    let workers = (0..p)
        .map(|w| {
            let stages = (0..v).map(move |c| c * p + w);
            let forwards = stages
                .clone()
                .flat_map(|s| (0..m).map(move |mb| Action::new(Op::F, s, mb)));
            let backwards = stages
                .rev()
                .flat_map(|s| (0..m).rev().map(move |mb| Action::new(Op::BW, s, mb)));
            forwards.chain(backwards).collect()
        })
        .collect();
    Plan::pipeline(
        ScheduleKind::LoopedBfs,
        (0..p * v).map(|s| s % p).collect(),
        m,
        workers,
    )
}

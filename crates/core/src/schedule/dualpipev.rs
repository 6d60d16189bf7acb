//! DualPipeV: DeepSeek's DualPipe (DeepSeek-V3 technical report, arXiv 2412.19437) cut in half,
//! in the per-rank order of torch.distributed.pipelining's `ScheduleDualPipeV` (torch PR
//! #159591, after deepseek-ai/DualPipe).
//!
//! Worker `w` of `P` holds two stages in a V: `w` on the way down and `2P - 1 - w` on the way
//! back (so worker 0 holds the embedding and the head). Its order, in eight phases:
//! 1. `2(P - 1 - w)` forwards of its first stage;
//! 2. `w + 1` pairs of forwards, first stage then second;
//! 3. `P - 1 - w` rounds of: input gradient (B) of the second stage, the oldest pending W, a
//!    forward of the second stage;
//! 4. the steady phase, `M - 2P + w + 1` rounds of two overlapped pairs (torch's
//!    `OVERLAP_F_B`): a forward of the first stage with a full backward of the second, then a
//!    forward of the second with a full backward of the first. The last worker runs its very
//!    first such pair as two plain actions, which shortens the bubble;
//! 5. `P - 1 - w` rounds of: a full backward of the second stage, then the pair of a forward
//!    of the second stage with a full backward of the first;
//! 6. `w + 1` rounds of a backward of the second stage, then of the first; from the middle
//!    round on (the second stage's half of it on odd workers, the first's on even ones) the
//!    backwards split into B and a W left for later;
//! 7. `P - 1 - w` rounds of the oldest pending W, then a backward of the first stage (split as
//!    in phase 6);
//! 8. the pending Ws.
//!
//! Each stage's micro-batches run in order. Needs `M >= 2P` micro-batches.

use crate::plan::ir::{Action, Op, Plan};
use crate::plan::ScheduleKind;
use std::collections::VecDeque;

pub(super) fn dualpipev(p: usize, m: usize) -> Plan {
    let workers = (0..p).map(|w| Worker::new(p, w).order(p, m)).collect();
    let placement = (0..2 * p)
        .map(|s| if s < p { s } else { 2 * p - 1 - s })
        .collect();
    Plan::pipeline(ScheduleKind::DualPipeV, placement, m, workers)
}

/// One worker's order as it is built: the next micro-batch per stage of forwards and of
/// backwards, and the Ws its split backwards left for later.
struct Worker {
    first: usize,
    second: usize,
    next_f: [usize; 2],
    next_b: [usize; 2],
    pending_w: VecDeque<(usize, usize)>,
    acts: Vec<Action>,
}

impl Worker {
    fn new(p: usize, w: usize) -> Self {
        Worker {
            first: w,
            second: 2 * p - 1 - w,
            next_f: [0; 2],
            next_b: [0; 2],
            pending_w: VecDeque::new(),
            acts: Vec::new(),
        }
    }

    fn slot(&self, stage: usize) -> usize {
        usize::from(stage == self.second)
    }

    fn forward(&mut self, stage: usize) {
        let i = self.slot(stage);
        self.acts.push(Action::new(Op::F, stage, self.next_f[i]));
        self.next_f[i] += 1;
    }

    /// A backward of `stage`: full (BW), or split (B now, its W pending).
    fn backward(&mut self, stage: usize, split: bool) {
        let i = self.slot(stage);
        let mb = self.next_b[i];
        self.next_b[i] += 1;
        if split {
            self.acts.push(Action::new(Op::B, stage, mb));
            self.pending_w.push_back((stage, mb));
        } else {
            self.acts.push(Action::new(Op::BW, stage, mb));
        }
    }

    fn weight(&mut self) {
        if let Some((stage, mb)) = self.pending_w.pop_front() {
            self.acts.push(Action::new(Op::W, stage, mb));
        }
    }

    /// A forward of `f` overlapped with a full backward of `b`.
    fn pair(&mut self, f: usize, b: usize) {
        self.forward(f);
        let last = self.acts.len() - 1;
        self.acts[last] = self.acts[last].overlapped();
        self.backward(b, false);
    }

    fn order(mut self, p: usize, m: usize) -> Vec<Action> {
        let (first, second, w) = (self.first, self.second, self.first);
        let rest = p - 1 - w;
        (0..2 * rest).for_each(|_| self.forward(first));
        for _ in 0..=w {
            self.forward(first);
            self.forward(second);
        }
        for _ in 0..rest {
            self.backward(second, true);
            self.weight();
            self.forward(second);
        }
        for i in 0..m + w + 1 - 2 * p {
            if i == 0 && w == p - 1 {
                self.forward(first);
                self.backward(second, false);
            } else {
                self.pair(first, second);
            }
            self.pair(second, first);
        }
        for _ in 0..rest {
            self.backward(second, false);
            self.pair(second, first);
        }
        let (mut split, rounds) = (false, w + 1);
        let middle = rounds / 2;
        for i in 0..rounds {
            split |= i == middle && w % 2 == 1;
            self.backward(second, split);
            split |= i == middle && w % 2 == 0;
            self.backward(first, split);
        }
        for _ in 0..rest {
            self.weight();
            self.backward(first, split);
        }
        while !self.pending_w.is_empty() {
            self.weight();
        }
        self.acts
    }
}

//! The one dependency rule of the plan IR. For micro-batch m at stage s, with p and n the
//! stages before and after s on m's route:
//! - `F(s)` needs the output of `F(p)` (its input);
//! - `B(s)` and `BW(s)` need `F(s)` (its saved activations) and the input gradient of `n`
//!   (from `B(n)` or `BW(n)`);
//! - `W(s)` needs `B(s)`.
//!
//! The validator, the simulator and the list schedulers all read it: [`needs`] forwards (what
//! must be done before an action runs), [`unblocks`] backwards (which waiting actions a
//! completion counts towards), and [`Pending`] counts a scheduler's unmet needs.

use super::ir::Op;

/// A result an action waits for, of micro-batch m.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Need {
    /// `F(stage)` is done (its output exists).
    Forward(usize),
    /// `B(stage)` or `BW(stage)` is done (its input gradient exists).
    InputGrad(usize),
}

/// A kind of waiting action: the backward is `B` or `BW`, whichever the plan runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Waiter {
    Forward(usize),
    Backward(usize),
    Weight(usize),
}

/// What `op` at `stage` needs, its route's stages before and after being `prev` and `next`.
pub fn needs(op: Op, stage: usize, prev: Option<usize>, next: Option<usize>) -> [Option<Need>; 2] {
    match op {
        Op::F => [prev.map(Need::Forward), None],
        Op::B | Op::BW => [Some(Need::Forward(stage)), next.map(Need::InputGrad)],
        Op::W => [Some(Need::InputGrad(stage)), None],
    }
}

/// The converse of [`needs`]: the actions whose needs include `op` at `stage` being done.
pub fn unblocks(
    op: Op,
    stage: usize,
    prev: Option<usize>,
    next: Option<usize>,
) -> [Option<Waiter>; 2] {
    match op {
        Op::F => [next.map(Waiter::Forward), Some(Waiter::Backward(stage))],
        Op::B => [prev.map(Waiter::Backward), Some(Waiter::Weight(stage))],
        Op::BW => [prev.map(Waiter::Backward), None],
        Op::W => [None, None],
    }
}

/// How many needs the action `w` has (see [`needs`]), its route's neighbours being `prev`
/// and `next`.
pub fn need_count(w: Waiter, prev: Option<usize>, next: Option<usize>) -> usize {
    match w {
        Waiter::Forward(_) => usize::from(prev.is_some()),
        Waiter::Backward(_) => 1 + usize::from(next.is_some()),
        Waiter::Weight(_) => 1,
    }
}

/// Needs met so far per waiting action, for list schedulers: an action is ready when a
/// completion meets its last need. Actions are numbered by the scheduler (`slot`).
pub struct Pending {
    met: Vec<u32>,
}

impl Pending {
    /// Room for actions numbered `0..slots`.
    pub fn new(slots: usize) -> Self {
        Pending {
            met: vec![0; slots],
        }
    }

    /// One need of the action numbered `slot` is met; `count` is its [`need_count`]. True
    /// when that was the last (an action with no needs is ready at once).
    pub fn meet(&mut self, slot: usize, count: usize) -> bool {
        self.met[slot] += 1;
        self.met[slot] as usize >= count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `unblocks` is exactly the converse of `needs`, on every op and route position, and
    /// `need_count` counts `needs`.
    #[test]
    fn unblocks_is_the_converse_of_needs() {
        let ops = [Op::F, Op::B, Op::W, Op::BW];
        // Stages 0..3 on one route; stage 1 in the middle, 0 first, 2 last.
        let around = |s: usize| ((s > 0).then(|| s - 1), (s < 2).then_some(s + 1));
        for y_op in ops {
            for y in 0..3 {
                let (p, n) = around(y);
                let waiter = match y_op {
                    Op::F => Waiter::Forward(y),
                    Op::B | Op::BW => Waiter::Backward(y),
                    Op::W => Waiter::Weight(y),
                };
                let ns: Vec<Need> = needs(y_op, y, p, n).into_iter().flatten().collect();
                assert_eq!(ns.len(), need_count(waiter, p, n), "{y_op:?} {y}");
                for x_op in ops {
                    for x in 0..3 {
                        let (xp, xn) = around(x);
                        let meets = match x_op {
                            Op::F => Need::Forward(x),
                            Op::B | Op::BW => Need::InputGrad(x),
                            Op::W => continue,
                        };
                        let listed = unblocks(x_op, x, xp, xn).contains(&Some(waiter));
                        // W needs B only (a plan that runs BW has no W).
                        let needed = ns.contains(&meets) && !(y_op == Op::W && x_op == Op::BW);
                        assert_eq!(listed, needed, "{x_op:?}({x}) -> {y_op:?}({y})");
                    }
                }
            }
        }
    }

    #[test]
    fn pending_is_ready_at_the_last_need() {
        let mut p = Pending::new(3);
        assert!(!p.meet(0, 2));
        assert!(!p.meet(1, 2), "actions are counted apart");
        assert!(p.meet(0, 2));
        assert!(p.meet(2, 0), "no needs: ready at the first call");
    }
}

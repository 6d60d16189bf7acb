//! AutoFreeze (PipeTransformer, He et al., ICML 2021): decide how many front layer blocks stop
//! training. Only a prefix ever freezes, and it only grows.
//!
//! `adaptive` freezes a layer once its gradient norm has settled: the relative change of its
//! share of the training blocks' summed norm between successive decisions stayed, over a
//! window, below a bar. (The share, not the norm: every block's norm swings with the batch and
//! the loss, together; a fine-tune of all-MiniLM-L6-v2 moved them all by up to 50% between
//! decisions 31 steps apart while the front blocks' shares moved by under 5%.) The bar is the larger of a fixed
//! threshold and a percentile (the median by default) of the changes of all layers still
//! training. The released code's adaptive rule (`auto_freeze.py`) freezes up to the first
//! layer whose change reaches the median: settling is relative to the rest of the model, since
//! while fine-tuning every norm keeps moving as the loss falls, the front layers least.
//! Layer block 0, the embedding, is judged by the first transformer block's norm (the released
//! code judges encoder layers only): its gradient touches only the rows of the batch's tokens,
//! so its norm follows the batch's vocabulary more than convergence.
//! `schedule` is the released code's fixed rule, frozen(e) = L (1 - (1 - alpha)^e) after
//! decision e, kept for comparison.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// How front layers are frozen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum FreezeMode {
    Off,
    Adaptive,
    Schedule,
    /// The adaptive rule's settled blocks, frozen where the simulator says it shortens the
    /// iteration: a prefix whole, others by weight only (`policy::critical`).
    Critical,
}

/// The knobs of both rules.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FreezePolicy {
    pub mode: FreezeMode,
    /// At most this fraction of the still-active freezable prefix freezes at one decision
    /// (adaptive), or the schedule's rate.
    pub alpha: f64,
    /// Relative change of a layer's gradient norm below which it counts as settled.
    pub threshold: f64,
    /// Or below this percentile (0-100; 0: off) of the changes of the layers still training.
    pub percentile: f64,
    /// Decisions over which a layer must have stayed settled.
    pub window: usize,
    /// At most this fraction of the freezable layers is ever frozen.
    pub max_fraction: f64,
    /// Nothing freezes (adaptive, critical) before this fraction of the run's steps: a block
    /// frozen while the fine-tune still moves fast costs accuracy its norms cannot show
    /// (MiniLM on SpamAssassin, docs/elastic.md: frozen at 14% of the run, 0.7-0.8 points
    /// lost; at 33%, 0.25).
    pub start: f64,
}

impl Default for FreezePolicy {
    fn default() -> Self {
        FreezePolicy {
            mode: FreezeMode::Off,
            alpha: 0.3,
            threshold: 0.1,
            percentile: 50.0,
            window: 2,
            max_fraction: 0.8,
            start: 0.3,
        }
    }
}

impl FreezePolicy {
    pub fn check(&self) -> Result<()> {
        let ok = |x: f64| x.is_finite() && x > 0.0 && x <= 1.0;
        if !ok(self.alpha) || !ok(self.max_fraction) {
            return Err(Error::Invalid(format!(
                "freeze alpha {} and max fraction {} must be in (0, 1]",
                self.alpha, self.max_fraction
            )));
        }
        if !(self.threshold.is_finite() && self.threshold >= 0.0) || self.window == 0 {
            return Err(Error::Invalid(format!(
                "freeze threshold {} must be >= 0 and window {} at least 1",
                self.threshold, self.window
            )));
        }
        if !(0.0..1.0).contains(&self.start) {
            return Err(Error::Invalid(format!(
                "freeze start {} must be a fraction of the run in [0, 1)",
                self.start
            )));
        }
        if !(0.0..=100.0).contains(&self.percentile) {
            return Err(Error::Invalid(format!(
                "freeze percentile {} must be between 0 and 100",
                self.percentile
            )));
        }
        Ok(())
    }

    /// May a decision after `step` of a run of `steps` freeze anything? The released
    /// schedule's fixed rule always may; the settled tests only from `start` of the run on.
    pub fn may_freeze(&self, step: u64, steps: u64) -> bool {
        self.mode == FreezeMode::Schedule || step as f64 >= self.start * steps as f64
    }

    /// The most layers that may ever be frozen out of `freezable`.
    pub fn cap(&self, freezable: usize) -> usize {
        ((self.max_fraction * freezable as f64).floor() as usize).min(freezable)
    }

    /// Frozen layers after decision `e` (1, 2, ...), given `frozen` now and `norms[d][l]`, the
    /// gradient norm of layer `l` (of `freezable`) at decision `d` (the last row is the newest).
    pub fn decide(&self, e: usize, frozen: usize, freezable: usize, norms: &[Vec<f64>]) -> usize {
        let cap = self.cap(freezable);
        let want = match self.mode {
            FreezeMode::Off => frozen,
            FreezeMode::Schedule => {
                let f = freezable as f64 * (1.0 - (1.0 - self.alpha).powi(e as i32));
                f.floor() as usize
            }
            // A prefix alone (the critical policy's choice of others is `policy::critical`'s).
            FreezeMode::Adaptive | FreezeMode::Critical => {
                let settled = (frozen..freezable)
                    .take_while(|&l| self.settled(l, frozen, freezable, &[], norms))
                    .count();
                frozen + settled.min(self.step(freezable - frozen.min(freezable)))
            }
        };
        want.clamp(frozen, cap.max(frozen))
    }

    /// At least one block may freeze per decision, at most alpha of the `active` ones.
    pub fn step(&self, active: usize) -> usize {
        ((self.alpha * active as f64).floor() as usize).max(1)
    }

    /// For `--freeze critical`: whether each freezable block has settled, judged one by one
    /// (not only as a prefix). False inside the prefix `0..frozen` and for the `weight_only`
    /// blocks already frozen, which also leave the shares' sum (their norm is 0 now).
    pub fn settled_blocks(
        &self,
        frozen: usize,
        weight_only: &[usize],
        freezable: usize,
        norms: &[Vec<f64>],
    ) -> Vec<bool> {
        (0..freezable)
            .map(|l| {
                l >= frozen
                    && !weight_only.contains(&l)
                    && self.settled(l, frozen, freezable, weight_only, norms)
            })
            .collect()
    }

    /// Has layer `l`'s share of the gradient norm (its norm over the sum of the transformer
    /// blocks still training, less `skip`) changed by less than the bar (relative) between
    /// each of the last `window` pairs of decisions? The bar is the threshold, or the
    /// percentile of the changes of the transformer blocks still training at that pair if
    /// larger. (The embedding, layer 0, goes by layer 1.)
    fn settled(
        &self,
        l: usize,
        frozen: usize,
        freezable: usize,
        skip: &[usize],
        norms: &[Vec<f64>],
    ) -> bool {
        if norms.len() <= self.window {
            return false;
        }
        // The embedding goes by the first transformer block that still trains.
        let judge = (1..freezable).find(|k| !skip.contains(k)).unwrap_or(1);
        let (l, first) = match freezable > 1 {
            true => (if l == 0 { judge } else { l }, frozen.max(1)),
            false => (l, frozen),
        };
        // A block's share of the training blocks' summed norm: the norms of all blocks rise
        // and fall together with the batch and the loss (MiniLM's by +-50% between decisions
        // of a fine-tune), which hides how the gradient spreads over the layers.
        let training = || (first..freezable).filter(|k| !skip.contains(k));
        let share = |row: &[f64], l: usize| {
            let total: f64 = training().filter_map(|k| row.get(k)).sum();
            row.get(l)
                .map(|&x| x / total)
                .filter(|x| x.is_finite() && *x > 0.0)
        };
        let change = |w: &[Vec<f64>], l: usize| match (share(&w[0], l), share(&w[1], l)) {
            (Some(a), Some(b)) => Some(((b - a) / a).abs()),
            _ => None,
        };
        norms[norms.len() - self.window - 1..].windows(2).all(|w| {
            let Some(c) = change(w, l) else {
                return false;
            };
            let mut all: Vec<f64> = training().filter_map(|k| change(w, k)).collect();
            c < self.threshold.max(percentile(&mut all, self.percentile))
        })
    }
}

/// Steps between freeze decisions when none is given, for an epoch of `epoch_steps`: a tenth
/// of an epoch, but at least 10 steps (the whole epoch when it is shorter). The adaptive rule
/// needs `window + 1` decisions (3 by default) before it can freeze, so it may act within the
/// first third of an epoch, on a fine-tune of a few epochs; a decision per epoch (the paper's)
/// left a 3-epoch MiniLM fine-tune unfrozen until its last epoch.
pub fn default_interval(epoch_steps: u64) -> u64 {
    epoch_steps.div_ceil(10).max(epoch_steps.min(10)).max(1)
}

/// The `p`th percentile (0-100) of `v`, linearly interpolated (as numpy's default); 0 for
/// none or `p` 0.
fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() || p <= 0.0 {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let x = p / 100.0 * (v.len() - 1) as f64;
    let (lo, hi) = (x.floor() as usize, x.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (x - lo as f64)
}

/// The most layer blocks `plan` lets freeze: a prefix inside stage 0 (whose input is tokens,
/// so the prefix runs forward only, outside autodiff) with a layer that trains after it. The
/// one frozen-prefix rule: the trainer, the freeze controller and resume all ask it.
pub fn max_frozen(plan: &crate::plan::ir::Plan) -> usize {
    plan.layers_per_stage()
        .first()
        .map_or(0, |first| first.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settled tests wait for `start` of the run; the released schedule does not; a start
    /// of 1 or more (or not a number) is refused.
    #[test]
    fn nothing_settles_into_a_freeze_before_the_start_of_the_run() {
        let p = |mode, start| FreezePolicy {
            mode,
            start,
            ..FreezePolicy::default()
        };
        let a = p(FreezeMode::Adaptive, 0.3);
        assert!(!a.may_freeze(89, 300) && a.may_freeze(90, 300));
        assert!(p(FreezeMode::Critical, 0.3).may_freeze(90, 300));
        assert!(!p(FreezeMode::Critical, 0.3).may_freeze(1, 300));
        assert!(p(FreezeMode::Schedule, 0.3).may_freeze(1, 300));
        assert!(p(FreezeMode::Adaptive, 0.0).may_freeze(0, 300));
        for bad in [1.0, -0.1, f64::NAN] {
            assert!(p(FreezeMode::Adaptive, bad).check().is_err(), "{bad}");
        }
        assert_eq!(FreezePolicy::default().start, 0.3);
    }

    #[test]
    fn settled_blocks_are_judged_one_by_one_past_the_prefix() {
        let p = FreezePolicy {
            mode: FreezeMode::Critical,
            ..FreezePolicy::default()
        };
        // Five blocks: 1 and 3 keep their share, 2 and 4 swing; block 0 goes by block 1.
        let rows = [
            vec![1.0, 1.0, 1.0, 1.0, 1.0],
            vec![1.0, 1.0, 2.0, 1.0, 0.5],
            vec![1.0, 1.0, 0.5, 1.0, 2.0],
        ];
        let total = |r: &Vec<f64>| r[1..].iter().sum::<f64>();
        let norms: Vec<Vec<f64>> = rows
            .iter()
            .map(|r| r.iter().map(|x| x * total(r)).collect())
            .collect();
        assert_eq!(
            p.settled_blocks(0, &[], 5, &norms),
            [true, true, false, true, false]
        );
        // The prefix and the weight-only blocks are frozen already, not settled again; a
        // prefix alone stops at the first block that swings.
        assert_eq!(
            p.settled_blocks(1, &[3], 5, &norms),
            [false, true, false, false, false]
        );
        assert_eq!(p.decide(3, 0, 5, &norms), 1);
        // With block 1's weights frozen, the embedding goes by block 2, which swings.
        assert!(!p.settled_blocks(0, &[1], 5, &norms)[0]);
        assert_eq!(p.step(10), 3);
        assert_eq!(p.step(1), 1);
    }

    #[test]
    fn decisions_come_a_tenth_of_an_epoch_apart_but_at_least_ten_steps() {
        assert_eq!(default_interval(302), 31); // MiniLM on SpamAssassin, 16 e-mails a step
        assert_eq!(default_interval(1000), 100);
        assert_eq!(default_interval(40), 10);
        assert_eq!(default_interval(6), 6); // a short epoch: once an epoch
        assert_eq!(default_interval(0), 1);
        // The adaptive rule's first 3 decisions fit in the first epoch of 30 steps or more, and
        // in its first third (and 3 steps) from 100 steps on.
        for e in 30..5000 {
            assert!(3 * default_interval(e) <= e, "epoch of {e}");
            assert!(
                e < 100 || 3 * default_interval(e) <= e / 3 + 3,
                "epoch of {e}"
            );
        }
    }

    #[test]
    fn the_frozen_prefix_stays_inside_stage_0_with_a_training_layer_after() {
        use crate::plan::ir::Plan;
        let mut p = Plan::pipeline(
            crate::plan::ScheduleKind::Custom,
            vec![0, 1],
            1,
            vec![vec![], vec![]],
        );
        p.set_layers(&[3, 2]);
        assert_eq!(max_frozen(&p), 2);
        p.set_layers(&[1, 4]);
        assert_eq!(
            max_frozen(&p),
            0,
            "a stage 0 of one layer block freezes nothing"
        );
    }

    fn adaptive() -> FreezePolicy {
        FreezePolicy {
            mode: FreezeMode::Adaptive,
            alpha: 0.5,
            threshold: 0.05,
            percentile: 50.0,
            window: 2,
            max_fraction: 0.75,
            start: 0.0,
        }
    }

    #[test]
    fn adaptive_settles_relative_to_the_layers_still_training() {
        // Every norm swings with the batch (x1, x0.3, x3); under that, block 1 keeps its norm
        // while blocks 2-5 grow or shrink by 25-35% a decision. Block 1's share then moves by
        // 8% and 13% at the last two decisions, below the blocks' median change (24% and
        // 17%): block 1 and the embedding before it (judged by it) freeze. By the fixed
        // threshold alone (5%, percentile 0), nothing does.
        let swing = [1.0, 0.3, 3.0, 1.0];
        let growth = [1.0f64, 1.0, 1.35, 0.75, 1.3, 0.7];
        let norms: Vec<Vec<f64>> = (0..4)
            .map(|d| growth.iter().map(|g| swing[d] * g.powi(d as i32)).collect())
            .collect();
        let p = adaptive();
        assert_eq!(p.decide(2, 0, 6, &norms), 2);
        let fixed = FreezePolicy {
            percentile: 0.0,
            ..p
        };
        assert_eq!(fixed.decide(2, 0, 6, &norms), 0);
        // The shares and the median are over the blocks still training: with 0-1 frozen,
        // block 2 moves least among blocks 2-5 (21% and 14% against medians of 27% and 25%).
        assert_eq!(p.decide(3, 2, 6, &norms), 3);
        let mut v = vec![3.0, 1.0, 2.0, 4.0];
        assert_eq!(percentile(&mut v, 50.0), 2.5);
        assert_eq!(percentile(&mut v, 100.0), 4.0);
    }

    #[test]
    fn schedule_follows_the_closed_form_and_the_cap() {
        let p = FreezePolicy {
            mode: FreezeMode::Schedule,
            alpha: 0.3,
            max_fraction: 0.8,
            ..FreezePolicy::default()
        };
        // 10 layers: 10 (1 - 0.7^e) = 3, 5.1, 6.57, 7.599, 8.3 (capped at 8).
        let mut f = 0;
        let got: Vec<usize> = (1..=5)
            .map(|e| {
                f = p.decide(e, f, 10, &[]);
                f
            })
            .collect();
        assert_eq!(got, vec![3, 5, 6, 7, 8]);
        let off = FreezePolicy::default();
        assert_eq!(off.decide(3, 2, 10, &[]), 2);
    }

    #[test]
    fn adaptive_never_freezes_while_the_gradient_moves_between_layers() {
        // The front blocks' share goes up and down at each decision (their norms double, then
        // halve, while the others stay): never settled, however the whole model's norm swings.
        let norms: Vec<Vec<f64>> = (0..10)
            .map(|d| {
                let s = [1.0, 0.3, 3.0][d % 3]; // the batch's common swing
                (0..6)
                    .map(|l| s * if l <= 1 { [1.0, 2.0][d % 2] } else { 1.0 })
                    .collect()
            })
            .collect();
        let p = adaptive();
        for d in 1..norms.len() {
            assert_eq!(p.decide(d, 0, 6, &norms[..=d]), 0);
        }
        // A swing every block shares is no movement: with the same swing and the shares
        // fixed, the settled prefix freezes (alpha 0.5 of 6 = 3 at once).
        let swinging: Vec<Vec<f64>> = (0..4)
            .map(|d| {
                (0..6)
                    .map(|l| [1.0, 0.3, 3.0][d % 3] * (l + 1) as f64)
                    .collect()
            })
            .collect();
        assert_eq!(p.decide(3, 0, 6, &swinging), 3);
    }

    #[test]
    fn adaptive_freezes_a_settled_prefix_within_alpha_and_the_cap() {
        // Layers 0-3 settled (constant, their shares moving by under 1%), layer 4 still
        // moving, layer 5 settled but behind it.
        let row = |d: usize| vec![10.0, 20.0, 30.0, 40.0, 1.0 + d as f64, 50.0];
        let norms: Vec<Vec<f64>> = (0..4).map(row).collect();
        let p = adaptive();
        // Too little history: nothing.
        assert_eq!(p.decide(1, 0, 6, &norms[..2]), 0);
        // alpha 0.5 of 6 active = 3 at this decision.
        assert_eq!(p.decide(2, 0, 6, &norms), 3);
        // Then the settled layer 3; layer 4 blocks the rest (only a prefix freezes).
        assert_eq!(p.decide(3, 3, 6, &norms), 4);
        assert_eq!(p.decide(4, 4, 6, &norms), 4);
        // "Freezes everything allowed": all settled, the cap (0.75 of 6 = 4) holds.
        let flat: Vec<Vec<f64>> = (0..4).map(|_| vec![1.0; 6]).collect();
        let mut f = 0;
        for e in 1..10 {
            f = p.decide(e, f, 6, &flat);
        }
        assert_eq!(f, 4);
        // A window longer than any history never settles (and does not overflow).
        let long = FreezePolicy {
            window: usize::MAX,
            ..p
        };
        assert_eq!(long.decide(2, 0, 6, &flat), 0);
        // Zero or non-finite norms never count as settled.
        let dead: Vec<Vec<f64>> = (0..4).map(|_| vec![0.0, f64::NAN]).collect();
        assert_eq!(p.decide(2, 0, 2, &dead), 0);
    }

    #[test]
    fn bad_knobs_are_refused() {
        for p in [
            FreezePolicy {
                alpha: 0.0,
                ..FreezePolicy::default()
            },
            FreezePolicy {
                max_fraction: 1.5,
                ..FreezePolicy::default()
            },
            FreezePolicy {
                window: 0,
                ..FreezePolicy::default()
            },
            FreezePolicy {
                threshold: f64::NAN,
                ..FreezePolicy::default()
            },
            FreezePolicy {
                percentile: 101.0,
                ..FreezePolicy::default()
            },
        ] {
            assert!(p.check().is_err(), "{p:?}");
        }
        FreezePolicy::default().check().unwrap();
    }
}

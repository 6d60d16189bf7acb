//! Sizes refused up front: plans, simulations and timelines are held in memory.

use crate::error::{Error, Result};

/// The most actions a generated plan may have: plans, simulations and timelines are held in
/// memory, so sizes are refused up front rather than exhausting it.
pub const MAX_ACTIONS: u64 = 20_000_000;

/// Refuse a plan of `workers` x `chunks` stages, `replicas` pipelines and `microbatches` per
/// pipeline whose actions (up to 3 per stage and micro-batch) would exceed [`MAX_ACTIONS`].
pub fn check_size(
    workers: usize,
    chunks: usize,
    replicas: usize,
    microbatches: usize,
) -> Result<()> {
    let actions = [workers, chunks, replicas, microbatches, 3]
        .iter()
        .try_fold(1u64, |acc, &x| acc.checked_mul(x as u64));
    match actions {
        Some(a) if a <= MAX_ACTIONS => Ok(()),
        _ => Err(Error::Schedule(format!(
            "{workers} workers x {chunks} chunks x {replicas} replicas x {microbatches} micro-batches is {} actions, above the limit of {MAX_ACTIONS}",
            actions.map_or("more than 2^64".to_string(), |a| a.to_string())
        ))),
    }
}

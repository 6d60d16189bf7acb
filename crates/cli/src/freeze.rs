//! `train --freeze ... --elastic`: the flags of PipeTransformer's AutoFreeze, AutoPipe + AutoDP
//! and AutoCache, turned into the runtime's settings (the runtime's `train::freeze` decides).

use crate::BadInput;
use anyhow::Result;
use pipewright_core::policy::freeze::{FreezeMode, FreezePolicy};
use pipewright_runtime::cache::PrefixCache;
use pipewright_runtime::train::{ElasticBatch, FreezeSettings, RunSettings};

/// The runtime's freeze settings; `None` with `--freeze off` (which the other freeze
/// flags then cannot go with).
pub fn settings(r: &RunSettings) -> Result<Option<FreezeSettings>> {
    if r.freeze == FreezeMode::Off {
        if r.elastic || r.freeze_every.is_some() {
            return Err(BadInput(
                "--elastic and --freeze-every need --freeze adaptive, schedule or critical".into(),
            )
            .into());
        }
        return Ok(None);
    }
    let policy = FreezePolicy {
        mode: r.freeze,
        alpha: r.freeze_alpha,
        threshold: r.freeze_threshold,
        percentile: r.freeze_percentile,
        window: r.freeze_window,
        max_fraction: r.max_frozen,
        start: r.freeze_start,
    };
    policy
        .check()
        .map_err(|e| BadInput(format!("--freeze: {e}")))?;
    if r.freeze_every == Some(0) {
        return Err(BadInput("--freeze-every must be at least 1".into()).into());
    }
    Ok(Some(FreezeSettings {
        policy,
        every: r.freeze_every,
        elastic: r.elastic,
        scale_batch: r.elastic_batch == ElasticBatch::Scale,
    }))
}

/// The frozen-prefix cache these flags ask for (checked against the freeze mode).
pub fn cache(r: &RunSettings) -> Result<Option<std::sync::Arc<PrefixCache>>> {
    let Some(budget) = r.cache_budget else {
        return Ok(None);
    };
    if r.freeze == FreezeMode::Off {
        return Err(BadInput(
            "--cache-budget caches frozen layers: it needs --freeze adaptive, schedule or critical"
                .into(),
        )
        .into());
    }
    let dir = r.cache_dir.clone().unwrap_or_else(std::env::temp_dir);
    let cache = PrefixCache::new(budget, r.cache_f16, &dir);
    cache
        .check_dir()
        .map_err(|e| BadInput(format!("--cache-dir: {e}")))?;
    Ok(Some(std::sync::Arc::new(cache)))
}

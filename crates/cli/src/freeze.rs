//! `train --freeze ... --elastic`: the flags of PipeTransformer's AutoFreeze, AutoPipe + AutoDP
//! and AutoCache, turned into the runtime's settings (the runtime's `train::freeze` decides).

use crate::BadInput;
use anyhow::Result;
use clap::Args;
use pipewright_core::policy::freeze::{FreezeMode, FreezePolicy};
use pipewright_runtime::cache::PrefixCache;
use pipewright_runtime::train::FreezeSettings;

#[derive(Args)]
pub struct FreezeArgs {
    /// Freeze converged front layer blocks: `adaptive` (gradient norms settled), `schedule`
    /// (the released rule, L (1 - (1 - alpha)^e) after decision e) or `off`.
    #[arg(long, value_enum, default_value = "off")]
    pub(crate) freeze: FreezeMode,
    /// Steps between freeze decisions (default: once per epoch of the training text).
    #[arg(long)]
    pub(crate) freeze_every: Option<u64>,
    /// Fraction of the still-training prefix that may freeze at one decision (adaptive), or
    /// the schedule's rate.
    #[arg(long, default_value_t = 0.3)]
    pub(crate) freeze_alpha: f64,
    /// Relative change of a layer's gradient norm below which it has settled (adaptive).
    #[arg(long, default_value_t = 0.1)]
    pub(crate) freeze_threshold: f64,
    /// Or below this percentile of the changes of all layers still training (adaptive; 0:
    /// the threshold only). 50, the median, is the released code's rule.
    #[arg(long, default_value_t = 50.0)]
    pub(crate) freeze_percentile: f64,
    /// Decisions over which a layer must stay settled (adaptive).
    #[arg(long, default_value_t = 2)]
    pub(crate) freeze_window: usize,
    /// Most of the freezable layer blocks (all but the head) that may ever freeze.
    #[arg(long, default_value_t = 0.8)]
    pub(crate) max_frozen: f64,
    /// On each freeze change, re-cut the training layers over the fastest depth that fits
    /// each worker's memory (as the starting plan uses it) and turn freed workers into more
    /// data-parallel replicas, at the same global batch.
    #[arg(long)]
    pub(crate) elastic: bool,
    /// With --elastic: `keep` the global batch (more replicas, fewer micro-batches each) or
    /// `scale` it (every replica keeps its micro-batches; the learning rate grows with the
    /// batch, the linear scaling rule).
    #[arg(long, value_enum, default_value = "keep", requires = "elastic")]
    pub(crate) elastic_batch: ElasticBatch,
    /// AutoCache: keep the frozen prefix's output for each training sample, up to this many
    /// bytes in memory (suffixes K, M, G: powers of 1024), the rest in a spill file; later
    /// epochs skip the frozen layers. Implies --sampling epochs.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub(crate) cache_budget: Option<u64>,
    /// Keep cached activations as f16 (half the bytes; the frozen output is rounded).
    #[arg(long, requires = "cache_budget")]
    pub(crate) cache_f16: bool,
    /// Directory for the cache's spill file (deleted when the run ends; default: the system's
    /// temporary directory).
    #[arg(long, requires = "cache_budget")]
    pub(crate) cache_dir: Option<std::path::PathBuf>,
}

#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ElasticBatch {
    Keep,
    Scale,
}

/// `123`, `64K`, `512M`, `2G` (powers of 1024).
fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                _ => return Err(format!("{s:?}: expected bytes, e.g. 1000000, 512M or 2G")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| {
            format!("{s:?}: expected bytes, e.g. 1000000, 512M or 2G (at most 2^64 - 1)")
        })
}

impl FreezeArgs {
    /// The runtime's freeze settings; `None` with `--freeze off` (which the other freeze
    /// flags then cannot go with).
    pub fn settings(&self) -> Result<Option<FreezeSettings>> {
        if self.freeze == FreezeMode::Off {
            if self.elastic || self.freeze_every.is_some() {
                return Err(BadInput(
                    "--elastic and --freeze-every need --freeze adaptive or schedule".into(),
                )
                .into());
            }
            return Ok(None);
        }
        let policy = FreezePolicy {
            mode: self.freeze,
            alpha: self.freeze_alpha,
            threshold: self.freeze_threshold,
            percentile: self.freeze_percentile,
            window: self.freeze_window,
            max_fraction: self.max_frozen,
        };
        policy
            .check()
            .map_err(|e| BadInput(format!("--freeze: {e}")))?;
        if self.freeze_every == Some(0) {
            return Err(BadInput("--freeze-every must be at least 1".into()).into());
        }
        Ok(Some(FreezeSettings {
            policy,
            every: self.freeze_every,
            elastic: self.elastic,
            scale_batch: self.elastic_batch == ElasticBatch::Scale,
        }))
    }

    /// The frozen-prefix cache these flags ask for (checked against the freeze mode).
    pub fn cache(&self) -> Result<Option<std::sync::Arc<PrefixCache>>> {
        let Some(budget) = self.cache_budget else {
            return Ok(None);
        };
        if self.freeze == FreezeMode::Off {
            return Err(BadInput(
                "--cache-budget caches frozen layers: it needs --freeze adaptive or schedule"
                    .into(),
            )
            .into());
        }
        let dir = self.cache_dir.clone().unwrap_or_else(std::env::temp_dir);
        let cache = PrefixCache::new(budget, self.cache_f16, &dir);
        cache
            .check_dir()
            .map_err(|e| BadInput(format!("--cache-dir: {e}")))?;
        Ok(Some(std::sync::Arc::new(cache)))
    }
}

//! Which schedule a plan follows: a name the IR carries, below the generators that make it.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A schedule generator; `Custom` marks plans made by hand or by other planners.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    #[cfg_attr(feature = "clap", value(name = "gpipe"))]
    GPipe,
    #[serde(rename = "1f1b")]
    #[cfg_attr(feature = "clap", value(name = "1f1b"))]
    OneFOneB,
    Interleaved,
    #[cfg_attr(feature = "clap", value(name = "zbh1"))]
    ZbH1,
    #[cfg_attr(feature = "clap", value(name = "zbv"))]
    ZbV,
    /// Breadth-first: every micro-batch through a worker's first stage, then its next.
    #[serde(rename = "looped-bfs")]
    #[cfg_attr(feature = "clap", value(name = "looped-bfs"))]
    LoopedBfs,
    /// Interleaved 1F1B with the backward split into B and W (ZB-1P over chunks).
    #[serde(rename = "interleaved-zb")]
    #[cfg_attr(feature = "clap", value(name = "interleaved-zb"))]
    InterleavedZb,
    /// DualPipe cut in half: two stages a worker in a V, forwards overlapped with backwards.
    #[cfg_attr(feature = "clap", value(name = "dualpipev"))]
    DualPipeV,
    /// Zero-bubble order searched for the stages' real F, B, W costs under a memory cap.
    #[serde(rename = "zb-auto")]
    #[cfg_attr(feature = "clap", value(name = "zb-auto"))]
    ZbAuto,
    #[cfg_attr(feature = "clap", value(skip))]
    Custom,
}

impl ScheduleKind {
    /// Every generator (zb-auto is searched for real costs, not generated).
    pub const ALL: [ScheduleKind; 8] = [
        Self::GPipe,
        Self::OneFOneB,
        Self::Interleaved,
        Self::ZbH1,
        Self::ZbV,
        Self::LoopedBfs,
        Self::InterleavedZb,
        Self::DualPipeV,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::GPipe => "gpipe",
            Self::OneFOneB => "1f1b",
            Self::Interleaved => "interleaved",
            Self::ZbH1 => "zbh1",
            Self::ZbV => "zbv",
            Self::LoopedBfs => "looped-bfs",
            Self::InterleavedZb => "interleaved-zb",
            Self::DualPipeV => "dualpipev",
            Self::ZbAuto => "zb-auto",
            Self::Custom => "custom",
        }
    }
    /// Chunks (stages) per worker when the user does not say.
    pub fn default_chunks(self) -> usize {
        match self {
            Self::Interleaved
            | Self::ZbV
            | Self::LoopedBfs
            | Self::InterleavedZb
            | Self::DualPipeV => 2,
            _ => 1,
        }
    }
    /// Does the schedule split the backward into `B` and `W`?
    pub fn splits_backward(self) -> bool {
        matches!(
            self,
            Self::ZbH1 | Self::ZbV | Self::ZbAuto | Self::InterleavedZb | Self::DualPipeV
        )
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .chain([Self::ZbAuto, Self::Custom])
            .find(|k| k.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL
                    .iter()
                    .chain([&Self::ZbAuto])
                    .map(|k| k.name())
                    .collect();
                Error::Schedule(format!(
                    "unknown schedule {s:?} (expected one of {})",
                    names.join(", ")
                ))
            })
    }
}

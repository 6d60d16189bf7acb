//! The output flags that `simulate`, `plan` and `skip-plan` share: JSON on stdout, and the
//! timeline as a Chrome trace or an SVG Gantt chart.

use crate::files::{write_file, write_with};
use anyhow::Result;
use clap::Args;
use pipewright_core::cluster::Cluster;
use pipewright_core::sim::timeline::Timeline;
use std::path::PathBuf;

#[derive(Args)]
pub struct Outputs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write the timeline as a Chrome trace (open in https://ui.perfetto.dev).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write the timeline as an SVG Gantt chart.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

impl Outputs {
    /// Write `tl` where `--trace` and `--svg` say, the SVG titled `title`.
    pub fn write_timeline(&self, tl: &Timeline, title: &str) -> Result<()> {
        if let Some(f) = &self.trace {
            write_with(f, |mut w| tl.write_chrome_trace(&mut w))?;
        }
        if let Some(f) = &self.svg {
            write_file(f, &tl.to_svg(title))?;
        }
        Ok(())
    }
}

/// Mark the devices of `cluster` that no worker of `tl` runs on as idle, and say so on stderr
/// (stdout may be JSON): a plan that leaves paid-for devices unused should say which.
pub fn mark_idle(tl: &mut Timeline, cluster: &Cluster) {
    let working: std::collections::HashSet<&str> =
        tl.worker_names.iter().map(String::as_str).collect();
    let idle = cluster
        .devices
        .iter()
        .filter(|d| !working.contains(d.name.as_str()))
        .map(|d| d.name.clone())
        .collect();
    tl.idle_devices = idle;
    if let Some(line) = tl.idle_line() {
        eprintln!("{line}");
    }
}

//! The output flags that `simulate`, `plan` and `skip-plan` share: JSON on stdout, and the
//! timeline as a Chrome trace or an SVG Gantt chart; and the simulator mechanics flags of
//! `simulate` and `skip-plan`.

use crate::files::{write_file, write_with};
use anyhow::Result;
use clap::Args;
use pipewright_core::cluster::Cluster;
use pipewright_core::sim::timeline::Timeline;
use pipewright_core::sim::{Dispatch, SimOptions};
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

/// SkipPipe's simulator mechanics, to price plans as its `com_sym.py` does (or any mix).
#[derive(Args, Debug, Clone)]
pub struct Mechanics {
    /// How workers pick their next action: in the plan's order, or whatever became ready
    /// first within each device's in-flight cap (SkipPipe's simulator; forwards and whole
    /// backwards only).
    #[arg(long, value_enum, default_value = "plan")]
    pub dispatch: DispatchArg,
    /// Seconds a worker rests after each action (SkipPipe's simulator: 0.13).
    #[arg(long, default_value_t = 0.0)]
    pub idle_gap: f64,
    /// Messages on a link do not queue behind each other (SkipPipe's simulator).
    #[arg(long)]
    pub no_link_queue: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DispatchArg {
    Plan,
    Arrival,
}

impl Mechanics {
    /// The simulator options these flags ask for (`--idle-gap` checked).
    pub fn options(&self) -> Result<SimOptions> {
        if !(self.idle_gap.is_finite() && (0.0..=3600.0).contains(&self.idle_gap)) {
            return Err(crate::BadInput(format!(
                "--idle-gap {:?}: seconds between 0 and 3600",
                self.idle_gap
            ))
            .into());
        }
        Ok(SimOptions {
            dispatch: match self.dispatch {
                DispatchArg::Plan => Dispatch::Plan,
                DispatchArg::Arrival => Dispatch::Arrival,
            },
            idle_gap: self.idle_gap,
            no_link_queue: self.no_link_queue,
            ..SimOptions::default()
        })
    }

    /// A note for titles and summaries when the mechanics are not pipewright's own.
    pub fn note(&self) -> String {
        let mut parts = Vec::new();
        if self.dispatch == DispatchArg::Arrival {
            parts.push("arrival dispatch".to_string());
        }
        if self.idle_gap > 0.0 {
            parts.push(format!("{} s idle gap", self.idle_gap));
        }
        if self.no_link_queue {
            parts.push("links unqueued".to_string());
        }
        if parts.is_empty() {
            String::new()
        } else {
            format!(" [{}]", parts.join(", "))
        }
    }
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

//! What a simulation is given: the plan, its costs and devices, and how workers pick and run
//! their actions. Shared by the engine and the list schedulers (`dispatch`), so neither
//! imports the other for it.

use crate::cluster::Cluster;
use crate::plan::ir::Plan;
use crate::profile::StageCost;

/// Costs and places a simulation needs: the stage costs and, for each worker, its device.
pub struct SimSetup<'a> {
    pub plan: &'a Plan,
    /// One per stage, at speed 1.0.
    pub stages: &'a [StageCost],
    /// One device per worker, in worker order.
    pub cluster: &'a Cluster,
}

/// How the workers' compute is arranged beyond the cluster's devices.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SimOptions {
    /// All workers share one compute resource that runs one action (and one optimizer step) at
    /// a time: what in-process worker threads are while burn's autodiff is serialised
    /// (crates/runtime/src/backend.rs). Each action takes the earliest free slot at or after
    /// the time it could start; messages and waits stay concurrent.
    pub shared_compute: bool,
    /// Seconds a worker rests after each action before it starts its next (SkipPipe's
    /// simulator waits 0.13 s). The pipeline's makespan still ends with the last action.
    pub idle_gap: f64,
    /// Messages on a link do not queue behind each other: each travels from the moment it is
    /// sent (SkipPipe's simulator).
    pub no_link_queue: bool,
    /// Whether workers run the plan's order or whatever became ready first.
    pub dispatch: Dispatch,
}

/// How a worker picks its next action.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Dispatch {
    /// In the plan's order.
    #[default]
    Plan,
    /// Whatever became ready first, forward or backward, within the devices' in-flight caps
    /// (SkipPipe's simulator); the plan's routes stay, its orders are replaced.
    Arrival,
}

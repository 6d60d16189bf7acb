//! How workers exchange activations, gradients and reductions. The in-process transport runs
//! workers as threads over shared mailboxes; optional emulated links delay each message by
//! `latency + bytes / bandwidth + overhead` (FIFO per directed link), so a heterogeneous network
//! can be reproduced on one machine. Worker processes use `mpi` (feature `mpi`).

use std::time::Duration;

mod inproc;
#[cfg(feature = "mpi")]
pub mod mpi;

pub use inproc::InProcess;

/// What a message carries: the activation entering `stage` or the gradient for `stage`'s output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Activation,
    Gradient,
}

/// Identifies a message: kind, destination stage and micro-batch (replica-local).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tag {
    pub kind: Kind,
    pub stage: usize,
    pub mb: usize,
}

impl std::fmt::Display for Tag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.kind {
            Kind::Activation => "activation into",
            Kind::Gradient => "gradient of the output of",
        };
        write!(f, "{what} stage {}, micro-batch {}", self.stage, self.mb)
    }
}

/// A tensor on the wire: shape and values.
#[derive(Debug, Clone, PartialEq)]
pub struct Payload {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

impl Payload {
    pub fn bytes(&self) -> u64 {
        4 * self.values.len() as u64
    }
}

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum TransportError {
    /// A point-to-point message did not come: its sender died, hangs, or the plan is wrong.
    #[error("{unit} {at}: waited {secs} s for the {tag} from {unit} {from}, in vain ({unit} {from} died or is stuck; the peer timeout bounds the wait)")]
    Timeout {
        unit: &'static str,
        at: usize,
        from: usize,
        tag: Tag,
        secs: f64,
    },
    /// A collective did not complete: a member died or is stuck.
    #[error("{unit} {at}: {what} over {unit}s {group:?} did not complete in {secs} s (one of them died or is stuck; the peer timeout bounds the wait)")]
    Collective {
        unit: &'static str,
        at: usize,
        what: &'static str,
        group: Vec<usize>,
        secs: f64,
    },
    #[error("aborted: another worker failed")]
    Aborted,
    #[error("MPI: {0}")]
    Mpi(String),
}

/// Point-to-point messages, all-reduce and all-gather between workers (ranks are the plan's
/// worker ids). Every wait is bounded by the transport's peer timeout.
pub trait Transport: Send + Sync {
    fn send(&self, from: usize, to: usize, tag: Tag, payload: Payload);
    /// Wait at worker `at` for the message `tag` that worker `from` sends.
    fn recv(&self, at: usize, from: usize, tag: Tag) -> Result<Payload, TransportError>;
    /// Sum `data` element-wise over the ranks in `group` (every member calls with the same
    /// group, in the same order of calls); each gets the sum.
    fn all_reduce(
        &self,
        rank: usize,
        group: &[usize],
        data: &mut [f32],
    ) -> Result<(), TransportError>;
    /// [`Transport::all_reduce`] of one stage's gradients among its hosts: the data-parallel
    /// all-reduce the simulator models (emulated links charge its ring time here).
    fn all_reduce_gradients(
        &self,
        rank: usize,
        group: &[usize],
        data: &mut [f32],
    ) -> Result<(), TransportError> {
        self.all_reduce(rank, group, data)
    }
    /// Every worker's `part` in rank order, to every worker (each calls once per round).
    fn all_gather(&self, rank: usize, part: Vec<u8>) -> Result<Vec<Vec<u8>>, TransportError>;
    /// Get ready for a plan with these stage groups (MPI builds a communicator per group).
    /// Every worker calls it with the same groups.
    fn prepare(&self, _groups: &[Vec<usize>]) -> Result<(), TransportError> {
        Ok(())
    }
    /// Tell everyone waiting that a worker failed, so nobody hangs.
    fn abort(&self);
}

/// How long a worker waits for a peer by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

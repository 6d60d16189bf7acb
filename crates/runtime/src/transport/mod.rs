//! How workers exchange activations, gradients and reductions. The in-process transport runs
//! workers as threads over shared mailboxes; optional emulated links delay each message by
//! `latency + bytes / bandwidth + overhead` (FIFO per directed link), so a heterogeneous network
//! can be reproduced on one machine. Worker processes use `mpi` (feature `mpi`).

use std::sync::atomic::AtomicBool;
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
    #[error("{unit} {at}: waited {secs} s for the {tag} from {unit} {from}, in vain ({unit} {from} died or is stuck; {bound} bounds the wait)")]
    Timeout {
        unit: &'static str,
        at: usize,
        from: usize,
        tag: Tag,
        secs: f64,
        bound: &'static str,
    },
    /// A collective did not complete: a member died or is stuck.
    #[error("{unit} {at}: {what} over {unit}s {group:?} did not complete in {secs} s (one of them died or is stuck; {bound} bounds the wait)")]
    Collective {
        unit: &'static str,
        at: usize,
        what: &'static str,
        group: Vec<usize>,
        secs: f64,
        bound: &'static str,
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
    /// group, in the same order of calls); each gets the sum. A group of one has nothing to
    /// add; every transport shares this framing and moves the data its own way ([`Self::sum`]).
    fn all_reduce(
        &self,
        rank: usize,
        group: &[usize],
        data: &mut [f32],
    ) -> Result<(), TransportError> {
        if group.len() <= 1 {
            return Ok(());
        }
        self.sum(rank, group, data)
    }
    /// `data` becomes the element-wise sum of every member's over a `group` of two or more.
    fn sum(&self, rank: usize, group: &[usize], data: &mut [f32]) -> Result<(), TransportError>;
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
    /// Whether the step now starting is a first one (see [`Patience`]); every worker of a
    /// process says so before each step.
    fn set_first_step(&self, _first: bool) {}
}

/// How long to wait for the first step's peers by default: a GPU's first step compiles its
/// shaders and autotunes (minutes on a software Vulkan beside a busy CPU).
pub const DEFAULT_STARTUP_TIMEOUT: Duration = Duration::from_secs(600);

/// The startup timeout of this process's transports, in milliseconds.
static STARTUP_MS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(DEFAULT_STARTUP_TIMEOUT.as_millis() as u64);

/// Set the startup timeout of the transports this process builds from now on.
pub fn set_startup_timeout(d: Duration) {
    STARTUP_MS.store(
        d.as_millis().min(u64::MAX as u128) as u64,
        std::sync::atomic::Ordering::SeqCst,
    );
}

/// How long a wait for a peer may last. The peer timeout, except while a first step runs (of
/// the run, or the first after a plan switch): that step compiles kernels, autotunes and faults
/// pages in, so a peer that takes long is not dead, and the startup timeout bounds it instead.
/// Steps are in lockstep (every step ends in the gradients' all-reduce), so a worker in its
/// first step only ever waits for peers in theirs.
#[derive(Debug)]
pub struct Patience {
    peer: Duration,
    startup: Duration,
    first: AtomicBool,
}

impl Patience {
    pub fn new(peer: Duration) -> Self {
        let startup = Duration::from_millis(STARTUP_MS.load(std::sync::atomic::Ordering::SeqCst));
        Patience {
            peer,
            startup: startup.max(peer),
            first: AtomicBool::new(true),
        }
    }

    /// The bound on a wait that starts now, and what to call it in a message.
    pub fn bound(&self) -> (Duration, &'static str) {
        match self.first.load(std::sync::atomic::Ordering::SeqCst) {
            true => (
                self.startup,
                "the startup timeout (--startup-timeout: a first step compiles and autotunes)",
            ),
            false => (self.peer, "the peer timeout"),
        }
    }

    pub fn set_first(&self, first: bool) {
        self.first.store(first, std::sync::atomic::Ordering::SeqCst);
    }
}

/// How long a worker waits for a peer by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

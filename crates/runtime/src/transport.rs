//! How workers exchange activations, gradients and reductions. The in-process transport runs
//! workers as threads over shared mailboxes; optional emulated links delay each message by
//! `latency + bytes / bandwidth + overhead` (FIFO per directed link), so a heterogeneous network
//! can be reproduced on one machine.

use pipewright_core::cluster::Cluster;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

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
    #[error("worker {worker}: no message {tag:?} after {secs} s (a peer died or the plan is inconsistent)")]
    Timeout { worker: usize, tag: Tag, secs: u64 },
    #[error("aborted: another worker failed")]
    Aborted,
}

/// Point-to-point messages and all-reduce between workers (ranks are global worker ids).
pub trait Transport: Send + Sync {
    fn send(&self, from: usize, to: usize, tag: Tag, payload: Payload);
    fn recv(&self, at: usize, tag: Tag) -> Result<Payload, TransportError>;
    /// Sum `data` element-wise over the ranks in `group` (every member calls with the same
    /// group, in the same order of calls); each gets the sum.
    fn all_reduce(
        &self,
        rank: usize,
        group: &[usize],
        data: &mut [f32],
    ) -> Result<(), TransportError>;
    /// Tell everyone waiting that a worker failed, so nobody hangs.
    fn abort(&self);
}

struct Mailbox {
    messages: Mutex<HashMap<Tag, (Instant, Payload)>>,
    ready: Condvar,
}

#[derive(Default)]
struct Reduction {
    /// Contributions by position in the group, summed in that order once all arrived, so the
    /// result is bit-identical whatever the arrival order.
    parts: Vec<Option<Vec<f32>>>,
    sum: Option<Vec<f32>>,
    left: usize,
}

/// The cluster whose links are emulated, and when each directed link is next free.
type EmulatedLinks = (Cluster, Mutex<HashMap<(usize, usize), Instant>>);

/// Threads in one process.
pub struct InProcess {
    boxes: Vec<Mailbox>,
    /// Emulated network: device per worker and the cluster's links; `None` = instant.
    links: Option<EmulatedLinks>,
    reductions: Mutex<HashMap<(Vec<usize>, u64), Reduction>>,
    /// Calls of all_reduce per (rank, group), so repeated reductions pair up.
    rounds: Mutex<HashMap<(usize, Vec<usize>), u64>>,
    reduced: Condvar,
    aborted: AtomicBool,
    timeout: Duration,
}

impl InProcess {
    pub fn new(workers: usize) -> Arc<Self> {
        Arc::new(Self::build(workers, None))
    }

    /// Emulate `cluster`'s links; worker `w` sits on the cluster's device `w`.
    pub fn emulated(workers: usize, cluster: Cluster) -> Arc<Self> {
        Arc::new(Self::build(
            workers,
            Some((cluster, Mutex::new(HashMap::new()))),
        ))
    }

    fn build(workers: usize, links: Option<EmulatedLinks>) -> Self {
        InProcess {
            boxes: (0..workers)
                .map(|_| Mailbox {
                    messages: Mutex::new(HashMap::new()),
                    ready: Condvar::new(),
                })
                .collect(),
            links,
            reductions: Mutex::new(HashMap::new()),
            rounds: Mutex::new(HashMap::new()),
            reduced: Condvar::new(),
            aborted: AtomicBool::new(false),
            timeout: Duration::from_secs(600),
        }
    }
}

impl Transport for InProcess {
    fn send(&self, from: usize, to: usize, tag: Tag, payload: Payload) {
        let now = Instant::now();
        let at = match &self.links {
            Some((cluster, free)) if from != to => {
                let secs = cluster.transfer_time(from, to, payload.bytes());
                let mut free = free.lock().unwrap();
                let start = free.get(&(from, to)).copied().unwrap_or(now).max(now);
                let end = start + Duration::from_secs_f64(secs);
                free.insert((from, to), end);
                end
            }
            _ => now,
        };
        let mb = &self.boxes[to];
        mb.messages.lock().unwrap().insert(tag, (at, payload));
        mb.ready.notify_all();
    }

    fn recv(&self, at: usize, tag: Tag) -> Result<Payload, TransportError> {
        let mb = &self.boxes[at];
        let deadline = Instant::now() + self.timeout;
        let mut msgs = mb.messages.lock().unwrap();
        loop {
            if self.aborted.load(Ordering::SeqCst) {
                return Err(TransportError::Aborted);
            }
            let now = Instant::now();
            if let Some((ready_at, _)) = msgs.get(&tag) {
                if *ready_at <= now {
                    return Ok(msgs.remove(&tag).unwrap().1);
                }
                let wait = *ready_at - now;
                drop(msgs);
                std::thread::sleep(wait);
                msgs = mb.messages.lock().unwrap();
                continue;
            }
            if now >= deadline {
                return Err(TransportError::Timeout {
                    worker: at,
                    tag,
                    secs: self.timeout.as_secs(),
                });
            }
            msgs = mb
                .ready
                .wait_timeout(msgs, Duration::from_millis(100))
                .unwrap()
                .0;
        }
    }

    fn all_reduce(
        &self,
        rank: usize,
        group: &[usize],
        data: &mut [f32],
    ) -> Result<(), TransportError> {
        if group.len() <= 1 {
            return Ok(());
        }
        let round = {
            let mut r = self.rounds.lock().unwrap();
            let c = r.entry((rank, group.to_vec())).or_insert(0);
            *c += 1;
            *c
        };
        let key = (group.to_vec(), round);
        let deadline = Instant::now() + self.timeout;
        let mut red = self.reductions.lock().unwrap();
        {
            let slot = red.entry(key.clone()).or_default();
            if slot.parts.is_empty() {
                slot.parts = vec![None; group.len()];
                slot.left = group.len();
            }
            let me = group
                .iter()
                .position(|&g| g == rank)
                .expect("rank is in its group");
            slot.parts[me] = Some(data.to_vec());
            if slot.parts.iter().all(Option::is_some) {
                let mut sum = vec![0.0f32; data.len()];
                for part in slot.parts.iter().flatten() {
                    sum.iter_mut().zip(part).for_each(|(s, d)| *s += d);
                }
                slot.sum = Some(sum);
            }
        }
        self.reduced.notify_all();
        loop {
            if self.aborted.load(Ordering::SeqCst) {
                return Err(TransportError::Aborted);
            }
            let slot = red.get_mut(&key).expect("slot lives until all read it");
            if let Some(sum) = &slot.sum {
                data.copy_from_slice(sum);
                slot.left -= 1;
                if slot.left == 0 {
                    red.remove(&key);
                }
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(TransportError::Timeout {
                    worker: rank,
                    tag: Tag {
                        kind: Kind::Gradient,
                        stage: usize::MAX,
                        mb: usize::MAX,
                    },
                    secs: self.timeout.as_secs(),
                });
            }
            red = self
                .reduced
                .wait_timeout(red, Duration::from_millis(100))
                .unwrap()
                .0;
        }
    }

    fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        for b in &self.boxes {
            b.ready.notify_all();
        }
        self.reduced.notify_all();
    }
}

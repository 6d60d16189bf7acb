//! The in-process transport: workers as threads over shared mailboxes, with optional emulated
//! links.

use super::{Payload, Tag, Transport, TransportError, DEFAULT_TIMEOUT};
use pipewright_core::cluster::Cluster;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct Mailbox {
    messages: Mutex<HashMap<Tag, (Instant, Payload)>>,
    ready: Condvar,
}

/// One member's contribution to a collective.
#[derive(Clone)]
enum Part {
    Sum(Vec<f32>),
    Bytes(Vec<u8>),
}

#[derive(Default)]
struct Exchange {
    /// Contributions by position in the group; combined once all arrived, in group order, so a
    /// sum is bit-identical whatever the arrival order.
    parts: Vec<Option<Part>>,
    /// The combined result, computed once by the last to arrive and shared by all.
    done: Option<Arc<Vec<Part>>>,
    /// Members yet to read the result.
    left: usize,
}

/// The cluster whose links are emulated, and when each directed link is next free.
type EmulatedLinks = (Cluster, Mutex<HashMap<(usize, usize), Instant>>);

/// Threads in one process.
pub struct InProcess {
    boxes: Vec<Mailbox>,
    /// Emulated network: device per worker and the cluster's links; `None` = instant.
    links: Option<EmulatedLinks>,
    exchanges: Mutex<HashMap<(Vec<usize>, u64), Exchange>>,
    /// Collective calls per (rank, group), so repeated rounds pair up.
    rounds: Mutex<HashMap<(usize, Vec<usize>), u64>>,
    exchanged: Condvar,
    aborted: AtomicBool,
    patience: super::Patience,
}

impl InProcess {
    pub fn new(workers: usize) -> Arc<Self> {
        Arc::new(Self::build(workers, None, DEFAULT_TIMEOUT))
    }

    /// Emulate `cluster`'s links; worker `w` sits on the cluster's device `w`. Waits give up
    /// after `timeout`.
    pub fn emulated(workers: usize, cluster: Option<Cluster>, timeout: Duration) -> Arc<Self> {
        Arc::new(Self::build(
            workers,
            cluster.map(|c| (c, Mutex::new(HashMap::new()))),
            timeout,
        ))
    }

    fn build(workers: usize, links: Option<EmulatedLinks>, timeout: Duration) -> Self {
        InProcess {
            boxes: (0..workers)
                .map(|_| Mailbox {
                    messages: Mutex::new(HashMap::new()),
                    ready: Condvar::new(),
                })
                .collect(),
            links,
            exchanges: Mutex::new(HashMap::new()),
            rounds: Mutex::new(HashMap::new()),
            exchanged: Condvar::new(),
            aborted: AtomicBool::new(false),
            patience: super::Patience::new(timeout),
        }
    }

    /// Every member's `part`, in group order, once all have called, passed through `combine`
    /// once (by the last to arrive) and shared.
    fn exchange(
        &self,
        rank: usize,
        group: &[usize],
        part: Part,
        what: &'static str,
        combine: fn(Vec<Part>) -> Vec<Part>,
    ) -> Result<Arc<Vec<Part>>, TransportError> {
        let round = {
            let mut r = self.rounds.lock().unwrap();
            let c = r.entry((rank, group.to_vec())).or_insert(0);
            *c += 1;
            *c
        };
        let key = (group.to_vec(), round);
        let (timeout, bound) = self.patience.bound();
        let deadline = Instant::now() + timeout;
        let mut ex = self.exchanges.lock().unwrap();
        {
            let slot = ex.entry(key.clone()).or_default();
            if slot.parts.is_empty() {
                slot.parts = vec![None; group.len()];
                slot.left = group.len();
            }
            let me = group
                .iter()
                .position(|&g| g == rank)
                .expect("rank is in its group");
            slot.parts[me] = Some(part);
            if slot.parts.iter().all(Option::is_some) {
                let parts = std::mem::take(&mut slot.parts)
                    .into_iter()
                    .flatten()
                    .collect();
                slot.done = Some(Arc::new(combine(parts)));
            }
        }
        self.exchanged.notify_all();
        loop {
            if self.aborted.load(Ordering::SeqCst) {
                return Err(TransportError::Aborted);
            }
            let slot = ex.get_mut(&key).expect("slot lives until all read it");
            if let Some(done) = slot.done.clone() {
                slot.left -= 1;
                if slot.left == 0 {
                    ex.remove(&key);
                }
                return Ok(done);
            }
            if Instant::now() >= deadline {
                return Err(TransportError::Collective {
                    unit: "worker",
                    at: rank,
                    what,
                    group: group.to_vec(),
                    secs: timeout.as_secs_f64(),
                    bound,
                });
            }
            ex = self
                .exchanged
                .wait_timeout(ex, Duration::from_millis(100))
                .unwrap()
                .0;
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
                // A delay past what an Instant can hold never arrives: the receiver's wait
                // ends with the peer timeout, naming the link's sender.
                let end = Duration::try_from_secs_f64(secs)
                    .ok()
                    .and_then(|d| start.checked_add(d))
                    .unwrap_or(start + self.patience.bound().0.saturating_mul(2));
                free.insert((from, to), end);
                end
            }
            _ => now,
        };
        let mb = &self.boxes[to];
        mb.messages.lock().unwrap().insert(tag, (at, payload));
        mb.ready.notify_all();
    }

    fn recv(&self, at: usize, from: usize, tag: Tag) -> Result<Payload, TransportError> {
        let mb = &self.boxes[at];
        let (timeout, bound) = self.patience.bound();
        let deadline = Instant::now() + timeout;
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
                    unit: "worker",
                    at,
                    from,
                    tag,
                    secs: timeout.as_secs_f64(),
                    bound,
                });
            }
            msgs = mb
                .ready
                .wait_timeout(msgs, Duration::from_millis(100))
                .unwrap()
                .0;
        }
    }

    fn sum(&self, rank: usize, group: &[usize], data: &mut [f32]) -> Result<(), TransportError> {
        let sum = |parts: Vec<Part>| {
            let mut it = parts.into_iter().map(|p| match p {
                Part::Sum(v) => v,
                Part::Bytes(_) => unreachable!("all-reduce parts are sums"),
            });
            let mut acc = it.next().unwrap_or_default();
            for v in it {
                acc.iter_mut().zip(&v).for_each(|(a, b)| *a += b);
            }
            vec![Part::Sum(acc)]
        };
        let done = self.exchange(rank, group, Part::Sum(data.to_vec()), "all-reduce", sum)?;
        match done.first() {
            Some(Part::Sum(s)) => {
                data.copy_from_slice(s);
                Ok(())
            }
            _ => unreachable!("an all-reduce's exchange gives its sum"),
        }
    }

    fn all_reduce_gradients(
        &self,
        rank: usize,
        group: &[usize],
        data: &mut [f32],
    ) -> Result<(), TransportError> {
        self.all_reduce(rank, group, data)?;
        // The sum is ready once the last member arrives; the ring then takes as long as the
        // simulator says (each member waits it out).
        if let Some((cluster, _)) = &self.links {
            let bytes = std::mem::size_of_val(data) as u64;
            let secs = pipewright_core::sim::ring_allreduce_time(cluster, group, bytes);
            let (timeout, bound) = self.patience.bound();
            match Duration::try_from_secs_f64(secs) {
                Ok(d) if d <= timeout => std::thread::sleep(d),
                _ => {
                    return Err(TransportError::Collective {
                        unit: "worker",
                        at: rank,
                        what: "the emulated gradient all-reduce",
                        group: group.to_vec(),
                        secs: timeout.as_secs_f64(),
                        bound,
                    })
                }
            }
        }
        Ok(())
    }

    fn all_gather(&self, rank: usize, part: Vec<u8>) -> Result<Vec<Vec<u8>>, TransportError> {
        let everyone: Vec<usize> = (0..self.boxes.len()).collect();
        let done = self.exchange(rank, &everyone, Part::Bytes(part), "all-gather", |p| p)?;
        Ok(done
            .iter()
            .map(|p| match p {
                Part::Bytes(b) => b.clone(),
                Part::Sum(_) => unreachable!("all-gather parts are bytes"),
            })
            .collect())
    }

    fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        for b in &self.boxes {
            b.ready.notify_all();
        }
        self.exchanged.notify_all();
    }

    fn set_first_step(&self, first: bool) {
        self.patience.set_first(first);
    }
}

//! Cores lent in the bubble. Ranks of a pipeline on one machine are each bound to their own
//! core, and in a pipeline's warm-up and cool-down some wait while another computes alone: on
//! 2 stages of 1F1B, the first forward and the first and last backward of each step. A rank
//! that waits marks its core idle on a board that the ranks of the machine share (a small file
//! mapped into each). A rank about to run a large matrix product splits its rows with a helper
//! thread on each idle peer's core ([`split_rows`]). Measured on 2 cores, a LLaMA stage's
//! forward and backward ran 1.4-1.55x faster so.
//!
//! A helper computes only while its peer waits, and sleeps as soon as the peer computes
//! again, so it never takes time from the peer; the element-wise kernels stay on the rank's
//! own core.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Bytes of one rank's record on the board: its state, then its CPU mask.
const RECORD: usize = 256;
/// CPUs a record's mask holds.
const MASK_CPUS: usize = 64 * 16;

/// One rank's record.
#[repr(C)]
pub(crate) struct Record {
    /// 1 while the rank waits for a peer (its core is idle), else 0.
    idle: AtomicU32,
    /// 1 once `mask` holds the rank's CPUs.
    ready: AtomicU32,
    mask: [AtomicU64; MASK_CPUS / 64],
}

impl Record {
    /// The CPUs in the mask.
    fn cpus(&self) -> Vec<usize> {
        (0..MASK_CPUS)
            .filter(|&c| self.mask[c / 64].load(Ordering::Relaxed) & (1 << (c % 64)) != 0)
            .collect()
    }
}

const _: () = assert!(std::mem::size_of::<Record>() <= RECORD);

/// Bytes of a board for `ranks` local ranks (what a launcher creates, zeroed).
pub fn board_bytes(ranks: usize) -> usize {
    RECORD * ranks.max(1)
}

/// The board this rank joined, and its helpers (one per peer).
struct Lending {
    map: memmap2::MmapMut,
    me: usize,
    ranks: usize,
    helpers: Vec<Arc<Helper>>,
    /// Held by the thread whose product the helpers run.
    lender: Mutex<()>,
}

impl Lending {
    fn record(&self, rank: usize) -> &Record {
        assert!(rank < self.ranks);
        // SAFETY: the map is page-aligned and `ranks` records long ([`join`] checks); every
        // access to it goes through the records' atomics.
        unsafe { &*self.map.as_ptr().add(rank * RECORD).cast::<Record>() }
    }
}

static LENDING: OnceLock<Lending> = OnceLock::new();

/// Take part in lending as local rank `me` of `ranks`, running on `cpus`, on the board file
/// at `path` (created zeroed by the launcher, [`board_bytes`] long). Starts a helper thread
/// for each peer, which moves to the peer's CPUs once the peer has joined.
pub fn join(path: &Path, me: usize, ranks: usize, cpus: &[usize]) -> std::io::Result<()> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let len = file.metadata()?.len() as usize;
    if me >= ranks || len < board_bytes(ranks) {
        return Err(std::io::Error::other(format!(
            "{}: {len} bytes, too short for {ranks} ranks (or rank {me} out of range)",
            path.display()
        )));
    }
    // SAFETY: the file is only ever accessed through this map's atomics, by ranks of one job.
    let map = unsafe { memmap2::MmapMut::map_mut(&file)? };
    let helpers = (0..ranks)
        .filter(|&p| p != me)
        .map(|peer| Arc::new(Helper::new(peer)))
        .collect();
    let lending = Lending {
        map,
        me,
        ranks,
        helpers,
        lender: Mutex::new(()),
    };
    let mine = lending.record(me);
    for &c in cpus.iter().filter(|&&c| c < MASK_CPUS) {
        mine.mask[c / 64].fetch_or(1 << (c % 64), Ordering::Relaxed);
    }
    mine.ready.store(1, Ordering::Release);
    if LENDING.set(lending).is_err() {
        return Ok(());
    }
    for h in &LENDING.get().expect("just set").helpers {
        let h2 = h.clone();
        let t = std::thread::Builder::new()
            .name(format!("lend-{}", h.peer))
            .spawn(move || h2.serve())?;
        let _ = h.thread.set(t.thread().clone());
    }
    Ok(())
}

/// Whether this rank lends and borrows idle cores (it joined a board).
pub fn joined() -> bool {
    LENDING.get().is_some()
}

/// While it lives, this rank's core is marked idle (it waits for a peer).
pub struct Waiting(());

/// Mark this rank's core idle until the guard is dropped (nothing without a board).
pub fn waiting() -> Option<Waiting> {
    let l = LENDING.get()?;
    l.record(l.me).idle.store(1, Ordering::Release);
    Some(Waiting(()))
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(l) = LENDING.get() {
            l.record(l.me).idle.store(0, Ordering::Release);
        }
    }
}

/// A part of a product: its rows `r0..r1`; parts are disjoint.
type Work = dyn Fn(usize, usize) + Sync;

/// A [`Work`] (its lifetime erased) and the rows it is to run: the lender keeps the work
/// alive until the helper is done with it.
struct Job(*const Work, usize, usize);
// SAFETY: the work is Sync, and the lender waits for the helper before the borrow ends.
unsafe impl Send for Job {}

/// A thread that computes parts of this rank's products on a peer's core while the peer
/// waits.
struct Helper {
    peer: usize,
    job: Mutex<Option<Job>>,
    /// Set by the lender with a job, cleared by the helper when it is done.
    busy: AtomicBool,
    /// Whether the thread runs on the peer's CPUs yet.
    pinned: AtomicBool,
    /// Set when a part panicked here.
    failed: AtomicBool,
    /// How long its last part took, in ns.
    took: AtomicU64,
    /// Rows it computes per row of the lender's in the same time, in thousandths: the split's
    /// weight, learned from the parts' times ([`split_rows`]).
    speed: AtomicU32,
    thread: OnceLock<std::thread::Thread>,
}

impl Helper {
    fn new(peer: usize) -> Helper {
        Helper {
            peer,
            job: Mutex::new(None),
            busy: AtomicBool::new(false),
            pinned: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            took: AtomicU64::new(0),
            speed: AtomicU32::new(INITIAL_SPEED),
            thread: OnceLock::new(),
        }
    }

    fn serve(&self) {
        let l = LENDING.get().expect("helpers start after the board");
        let peer = l.record(self.peer);
        loop {
            if !self.pinned.load(Ordering::Relaxed) && peer.ready.load(Ordering::Acquire) == 1 {
                self.pinned.store(set_cpus(&peer.cpus()), Ordering::Release);
            }
            let job = self.job.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(Job(work, r0, r1)) = job {
                // SAFETY: the lender keeps `work` alive until `busy` is cleared.
                let work = unsafe { &*work };
                let t0 = std::time::Instant::now();
                // A panic is the lender's to report; the helper goes on.
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(r0, r1)));
                self.took
                    .store(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                self.failed.store(run.is_err(), Ordering::Relaxed);
                self.busy.store(false, Ordering::Release);
            } else if peer.idle.load(Ordering::Acquire) == 1
                && l.record(l.me).idle.load(Ordering::Acquire) == 0
            {
                // The peer's core is idle and the lender computes: stay ready for its next
                // product.
                std::thread::yield_now();
            } else {
                std::thread::park_timeout(std::time::Duration::from_millis(100));
            }
        }
    }
}

/// A helper's speed before any is measured, in thousandths of the lender's: a peer's core
/// computed its half of the block's products about 1.2x slower than the lender's on 2 cores
/// (its caches hold none of the operands).
const INITIAL_SPEED: u32 = 800;

/// Run `work` on rows `0..rows` split in contiguous parts: the first on this thread, one on
/// each helper whose peer's core is idle now, sized by the helpers' measured speeds. False
/// (nothing run) when no core is idle or a part would have under `least` rows.
pub(crate) fn split_rows(work: &(dyn Fn(usize, usize) + Sync), rows: usize, least: usize) -> bool {
    let Some(l) = LENDING.get() else { return false };
    // A helper holds one job: products from another thread of this process meanwhile run
    // unsplit.
    let Ok(_lender) = l.lender.try_lock() else {
        return false;
    };
    let idle: Vec<&Arc<Helper>> = l
        .helpers
        .iter()
        .filter(|h| {
            h.pinned.load(Ordering::Acquire) && l.record(h.peer).idle.load(Ordering::Acquire) == 1
        })
        .collect();
    if idle.is_empty() || rows < least * (idle.len() + 1) {
        return false;
    }
    let speeds: Vec<u32> = idle
        .iter()
        .map(|h| h.speed.load(Ordering::Relaxed))
        .collect();
    let cuts = cut_points(rows, &speeds);
    // SAFETY (of the erased lifetime): this function waits below until every helper has
    // cleared `busy`, i.e. finished with `work`.
    let erased: *const Work =
        unsafe { std::mem::transmute::<&(dyn Fn(usize, usize) + Sync), &'static Work>(work) };
    for (i, h) in idle.iter().enumerate() {
        h.busy.store(true, Ordering::Release);
        *h.job.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(Job(erased, cuts[i + 1], cuts[i + 2]));
        if let Some(t) = h.thread.get() {
            t.unpark();
        }
    }
    let t0 = std::time::Instant::now();
    // The helpers hold `work`: a panic waits for them before it goes on.
    let run = |r0, r1| std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(r0, r1)));
    let mut result = run(0, cuts[1]);
    let own = t0.elapsed().as_nanos() as u64;
    for (i, h) in idle.iter().enumerate() {
        // A part its helper has not taken yet (it was asleep) runs here.
        let taken_back = h.job.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(Job(_, r0, r1)) = taken_back {
            result = result.and(run(r0, r1));
            h.busy.store(false, Ordering::Release);
            continue;
        }
        while h.busy.load(Ordering::Acquire) {
            std::hint::spin_loop();
        }
        if h.failed.swap(false, Ordering::Relaxed) {
            result = result.and(Err(Box::new(
                "a part of a matrix product failed on a lent core",
            )));
        } else {
            let rows = cuts[i + 2] - cuts[i + 1];
            learn_speed(h, own, cuts[1], h.took.load(Ordering::Relaxed), rows);
        }
    }
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
    true
}

/// Where rows `0..rows` are cut: part 0 (this thread's, weight 1000) ends at `cuts[1]`, part
/// `i` (a helper's of speed `speeds[i - 1]`, in thousandths) runs `cuts[i]..cuts[i + 1]`;
/// parts are sized in proportion to their weights.
fn cut_points(rows: usize, speeds: &[u32]) -> Vec<usize> {
    let total = 1000 + speeds.iter().map(|&s| u64::from(s)).sum::<u64>();
    let mut cuts = vec![0];
    let mut acc = 1000u64;
    for &s in speeds {
        cuts.push((rows as u64 * acc / total) as usize);
        acc += u64::from(s);
    }
    cuts.push(rows);
    cuts
}

/// Move a helper's speed a tenth of the way to the one just measured: `rows` of its own in
/// `took` ns beside `own_rows` of the lender's in `own` ns. Parts too short to time well
/// (under 20 us) teach nothing.
fn learn_speed(h: &Helper, own: u64, own_rows: usize, took: u64, rows: usize) {
    if own < 20_000 || took < 20_000 || own_rows == 0 {
        return;
    }
    let now = (rows as u64 * own * 1000 / (own_rows as u64 * took)).clamp(100, 4000);
    let old = u64::from(h.speed.load(Ordering::Relaxed));
    h.speed
        .store(((old * 9 + now) / 10) as u32, Ordering::Relaxed);
}

/// The CPUs the calling thread may run on (its affinity mask).
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Let the calling thread run on `cpus` (true on success).
fn set_cpus(cpus: &[usize]) -> bool {
    if cpus.is_empty() {
        return false;
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set, filled with CPU numbers below
    // CPU_SETSIZE, then passed by pointer with its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// The board tests lend over: built once per test binary.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Rank 0 of a board of 2, rank 1 played by the test: joined, its CPUs offered, and busy
    /// until a test marks it idle (with the returned guard held, so tests take turns). Returns
    /// once the helper has moved to the peer's CPUs.
    pub(crate) fn peer() -> (std::sync::MutexGuard<'static, ()>, &'static Record) {
        static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
        static BOARD: OnceLock<tempfile::TempDir> = OnceLock::new();
        let turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
        BOARD.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("board");
            std::fs::write(&path, vec![0u8; board_bytes(2)]).unwrap();
            join(&path, 0, 2, &allowed_cpus()).unwrap();
            let l = LENDING.get().unwrap();
            let peer = l.record(1);
            for c in allowed_cpus() {
                peer.mask[c / 64].fetch_or(1 << (c % 64), Ordering::Relaxed);
            }
            peer.ready.store(1, Ordering::Release);
            let start = std::time::Instant::now();
            while !l.helpers[0].pinned.load(Ordering::Acquire) {
                assert!(
                    start.elapsed().as_secs() < 10,
                    "the helper never moved to the peer's CPUs"
                );
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            dir
        });
        (turn, LENDING.get().unwrap().record(1))
    }

    impl Record {
        /// Mark the played peer idle (its cores lent) or busy.
        pub(crate) fn set_idle(&self, idle: bool) {
            self.idle.store(u32::from(idle), Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The parts cover the rows once, in order, each within a row of its weight's share.
        #[test]
        fn parts_cover_the_rows_by_weight(rows in 0usize..5000, speeds in prop::collection::vec(100u32..4000, 0..6)) {
            let cuts = cut_points(rows, &speeds);
            prop_assert_eq!(cuts.len(), speeds.len() + 2);
            prop_assert_eq!((cuts[0], *cuts.last().unwrap()), (0, rows));
            prop_assert!(cuts.windows(2).all(|w| w[0] <= w[1]));
            let total = 1000.0 + speeds.iter().map(|&s| f64::from(s)).sum::<f64>();
            let weights: Vec<f64> = std::iter::once(1000.0).chain(speeds.iter().map(|&s| f64::from(s))).collect();
            for (i, w) in weights.iter().enumerate() {
                let share = rows as f64 * w / total;
                prop_assert!(((cuts[i + 1] - cuts[i]) as f64 - share).abs() <= 1.0);
            }
        }
    }

    #[test]
    fn products_split_with_an_idle_peer_cover_every_row_once() {
        let (_turn, peer) = super::testing::peer();
        let l = LENDING.get().unwrap();
        peer.idle.store(0, Ordering::Release);
        let rows = 1000;
        let seen: Vec<AtomicU32> = (0..rows).map(|_| AtomicU32::new(0)).collect();
        let by_helper = AtomicU32::new(0);
        let me = std::thread::current().id();
        let record = |r0: usize, r1: usize| {
            if std::thread::current().id() == me {
                // The lender's part waits for the helper to take its own.
                let start = std::time::Instant::now();
                while l.helpers[0].job.lock().unwrap().is_some() && start.elapsed().as_secs() < 10 {
                    std::thread::yield_now();
                }
            } else {
                by_helper.fetch_add(1, Ordering::Relaxed);
            }
            seen[r0..r1].iter().for_each(|s| {
                s.fetch_add(1, Ordering::Relaxed);
            });
        };
        // A busy peer lends nothing.
        assert!(!split_rows(&record, rows, 16));
        peer.idle.store(1, Ordering::Release);
        assert!(!split_rows(&record, 20, 16), "parts of under 16 rows");
        assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 0));
        for _ in 0..20 {
            assert!(split_rows(&record, rows, 16));
        }
        assert!(
            seen.iter().all(|s| s.load(Ordering::Relaxed) == 20),
            "every row once a split"
        );
        assert_eq!(
            by_helper.load(Ordering::Relaxed),
            20,
            "a part on the helper each time"
        );
        peer.idle.store(0, Ordering::Release);
    }

    #[test]
    fn a_speed_moves_a_tenth_of_the_way_and_short_parts_teach_nothing() {
        let h = Helper::new(1);
        // 100 rows in 2 ms beside the lender's 100 in 1 ms: speed 500.
        learn_speed(&h, 1_000_000, 100, 2_000_000, 100);
        assert_eq!(
            h.speed.load(Ordering::Relaxed),
            (INITIAL_SPEED * 9 + 500) / 10
        );
        let before = h.speed.load(Ordering::Relaxed);
        learn_speed(&h, 10_000, 100, 2_000_000, 100);
        learn_speed(&h, 1_000_000, 100, 19_000, 100);
        assert_eq!(h.speed.load(Ordering::Relaxed), before);
    }
}

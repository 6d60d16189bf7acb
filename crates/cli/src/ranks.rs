//! This process's rank in an MPI job, and what it says when the launcher stops it.
// Built without MPI, only `RANK` is used.
#![cfg_attr(not(feature = "mpi"), allow(dead_code))]

/// This process's MPI rank, once MPI is up (errors of input are then printed by rank 0 only).
pub static RANK: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

pub fn set_rank(rank: usize) {
    let _ = RANK.set(rank);
}

/// The signal that asked this process to stop, 0 if none.
static STOP_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn on_stop_signal(sig: libc::c_int) {
    STOP_SIGNAL.store(sig, std::sync::atomic::Ordering::SeqCst);
}

/// Over MPI, SIGINT (a Ctrl-C that the launcher passes on) ends the rank, and SIGTERM asks
/// it to stop at the next step boundary ([`stop_on_signals`]). Either way the rank says what
/// it was doing: a rank waiting for a peer names it, which, when the launcher is ending the job
/// because that peer died, is the line that tells which one (the launcher's SIGKILL follows).
pub fn watch_signals(rank: usize) {
    #[cfg(unix)]
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_stop_signal as *const () as libc::sighandler_t,
        );
    }
    std::thread::spawn(move || {
        let mut told = false;
        loop {
            let sig = STOP_SIGNAL.load(std::sync::atomic::Ordering::SeqCst);
            if sig != 0 {
                eprintln!("rank {rank}: stopped by SIGINT {}", doing());
                std::process::exit(128 + sig);
            }
            let asked = STOP_REQUEST_SIGNAL.load(std::sync::atomic::Ordering::SeqCst);
            if asked != 0 && !told {
                told = true;
                let name = if asked == libc::SIGTERM {
                    "SIGTERM"
                } else {
                    "SIGUSR1"
                };
                eprintln!(
                    "rank {rank}: {name}: stopping at the next step boundary with a checkpoint; {}",
                    doing()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    });
}

/// What this rank is doing when a signal comes: waiting for a peer (named), or computing. A
/// rank stopped mid-computation soon waits for a peer that died: it is given a moment to get
/// there (the launcher's SIGKILL follows after about a second).
fn doing() -> String {
    #[cfg(feature = "mpi")]
    let waiting = {
        let t0 = std::time::Instant::now();
        loop {
            let w = pipewright_runtime::transport::mpi::waiting_for();
            if w.is_some() || t0.elapsed() > std::time::Duration::from_millis(700) {
                break w;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    };
    #[cfg(not(feature = "mpi"))]
    let waiting: Option<String> = None;
    match waiting {
        Some(w) => format!("while waiting for {w}"),
        None => "while computing, not waiting for a peer".into(),
    }
}

/// The signal of the first stop request (SIGTERM or SIGUSR1), 0 if none.
static STOP_REQUEST_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// Set by SIGUSR1 (Slurm's `--signal`) and SIGTERM (`scancel`, a time limit, `kill`): the
/// run stops at its next step boundary, every rank at the same one, and writes a checkpoint,
/// so a preempted or requeued job continues with `--resume`. A second such signal ends the
/// process at once. Over MPI a SIGTERM to every rank is a stop, not a peer's failure; when a
/// rank dies instead, the launcher's SIGTERM to the others finds them waiting for it, and its
/// SIGKILL (or the peer timeout) ends them.
pub static STOP_REQUESTED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_stop_request(sig: libc::c_int) {
    STOP_REQUEST_SIGNAL.store(sig, std::sync::atomic::Ordering::SeqCst);
    if STOP_REQUESTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(128 + sig) };
    }
}

/// Stop at a step boundary on SIGUSR1 and SIGTERM (see [`STOP_REQUESTED`]).
pub fn stop_on_signals() {
    #[cfg(unix)]
    unsafe {
        let handler = on_stop_request as *const () as libc::sighandler_t;
        libc::signal(libc::SIGUSR1, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// Say once when this node runs more ranks than it has cores (the launcher's count of local
/// ranks: Open MPI's or MPICH's), and what that costs.
pub fn warn_oversubscribed() {
    let local = local_ranks();
    // SAFETY: sysconf only reads a system setting.
    let cores = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if let (Some(ranks), Ok(cores)) = (local, usize::try_from(cores)) {
        if cores > 0 && ranks > cores {
            eprintln!(
                "warning: {ranks} ranks share this node's {cores} cores: each computes at most {:.2} of a core, and waits for its peers' time slices; use at most {cores} ranks per node (more stages per rank: --chunks) for speed",
                cores as f64 / ranks as f64
            );
        }
    }
}

/// The ranks on this node, as the launcher counts them (Open MPI's, MPICH's or Slurm's).
pub fn local_ranks() -> Option<usize> {
    [
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MPI_LOCALNRANKS",
        "SLURM_NTASKS_PER_NODE",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.trim().parse::<usize>().ok())
}

/// This process's rank among the ranks on its node, as the launcher numbers them.
pub fn local_rank() -> Option<usize> {
    [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.trim().parse::<usize>().ok())
}

/// The launcher that started this process as one of several tasks, if one did: its name with
/// the variable that says so, the task count, and this task's number.
pub fn launcher_tasks() -> Option<(String, usize, usize)> {
    let num = |k: &str| std::env::var(k).ok()?.trim().parse::<usize>().ok();
    [
        ("mpirun", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
        ("srun", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"),
        ("a PMI launcher", "PMI_SIZE", "PMI_RANK"),
        ("a PMIx launcher", "PMIX_SIZE", "PMIX_RANK"),
    ]
    .into_iter()
    .find_map(|(who, size, rank)| {
        let n = num(size).filter(|&n| n > 1)?;
        Some((format!("{who} ({size}={n})"), n, num(rank).unwrap_or(0)))
    })
}

/// Under srun without PMIx (`--mpi=pmi2` or `none`), Open MPI's init dies with an unreadable
/// error: said before it, with the fix.
pub fn check_slurm_pmix() -> Result<(), String> {
    let has = |k: &str| std::env::var_os(k).is_some();
    let tasks = std::env::var("SLURM_STEP_NUM_TASKS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(1);
    if tasks > 1 && !has("PMIX_RANK") && !has("OMPI_COMM_WORLD_SIZE") {
        // Every task sees this; task 0 says it.
        let me = std::env::var("SLURM_PROCID")
            .ok()
            .and_then(|v| v.trim().parse().ok());
        set_rank(me.unwrap_or(0));
        let how = if has("PMI_RANK") { "PMI-2" } else { "no PMI" };
        return Err(format!(
            "srun started these {tasks} tasks with {how}; this Open MPI needs PMIx: srun --mpi=pmix ... (or start them with mpirun)"
        ));
    }
    Ok(())
}

/// Finish MPI after a run that completed (checkpoint written): a peer that never gets there
/// (stopped, hung) would hold MPI's finalisation for ever, so after `timeout` this rank says so
/// and exits 0 anyway: its work is done and saved.
///
/// Test hook: `PIPEWRIGHT_TEST_STOP_BEFORE_FINISH=R` makes rank R stop itself (SIGSTOP) here,
/// as a peer stopped after the final checkpoint would be.
#[cfg(feature = "mpi")]
pub fn finish_within(m: &pipewright_runtime::transport::mpi::Mpi, timeout: std::time::Duration) {
    let rank = m.world().rank;
    let hook = std::env::var("PIPEWRIGHT_TEST_STOP_BEFORE_FINISH").ok();
    if hook.and_then(|r| r.trim().parse::<usize>().ok()) == Some(rank) {
        // SAFETY: raise only sends a signal to this process.
        unsafe { libc::raise(libc::SIGSTOP) };
    }
    std::thread::spawn(move || {
        std::thread::sleep(timeout);
        eprintln!(
            "warning: rank {rank}: MPI did not finish within the peer timeout ({:.1} s) after the run: a peer is stopped or hung; exiting, the run and its checkpoint are complete",
            timeout.as_secs_f64()
        );
        use std::io::Write;
        let _ = std::io::stdout().flush();
        // SAFETY: _exit skips the C library's exit handlers, MPI's among them, which could
        // wait for the stopped peer in turn.
        unsafe { libc::_exit(0) };
    });
    m.finish();
}

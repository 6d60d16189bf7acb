//! `train --transport auto` (the default): a plan of several workers on one machine runs as
//! one process per worker. In-process workers serialise on burn's one autodiff lock, so
//! threads give a pipeline no speed-up; processes do (1.4x on 2 cores for the default run).
//! pipewright starts itself again under `mpirun`, each rank bound to its own cores, and the
//! ranks meet over the same MPI transport as a job a user launches.

use std::path::{Path, PathBuf};

/// Set in the ranks pipewright started itself, so the run header can say who placed them.
const LAUNCHED: &str = "PIPEWRIGHT_LAUNCHED";

/// Where `mpirun` places `workers` ranks on a machine with `cores` physical cores: each rank
/// bound to its own `cores / workers` of them (its BLAS then runs that many threads), or, with
/// more ranks than cores, left unbound (binding would stack them on the first cores).
pub fn placement(workers: usize, cores: usize) -> Vec<String> {
    let pe = format!("slot:PE={}", cores / workers.max(1));
    let flags: &[&str] = match workers <= cores {
        true => &["--map-by", &pe, "--bind-to", "core"],
        false => &["--oversubscribe", "--bind-to", "none", "--map-by", "slot"],
    };
    flags.iter().map(|f| f.to_string()).collect()
}

/// Physical cores this process may run on: its CPU affinity with hardware threads of one core
/// counted once (what `mpirun` counts as slots).
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut cores = std::collections::BTreeSet::new();
    for cpu in pipewright_runtime::machine::lend::allowed_cpus() {
        let siblings = format!("/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list");
        match std::fs::read_to_string(siblings) {
            Ok(s) => cores.insert(s.trim().to_string()),
            Err(_) => return logical,
        };
    }
    if cores.is_empty() {
        logical
    } else {
        cores.len()
    }
}

/// `mpirun` on the PATH, if any.
fn find_mpirun() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("mpirun"))
        .find(|p| p.is_file())
}

/// Why this run's workers stay threads, when they could not be processes; None when they can.
pub fn why_threads() -> Option<String> {
    if !cfg!(feature = "mpi") {
        return Some("this pipewright was built without MPI (cargo feature `mpi`)".into());
    }
    let Some(mpirun) = find_mpirun() else {
        return Some("mpirun is not on the PATH (scripts/install-deps installs Open MPI)".into());
    };
    // pipewright links Open MPI; another MPI's mpirun (MPICH's) cannot start its ranks.
    let version = std::process::Command::new(&mpirun)
        .arg("--version")
        .output();
    match version {
        Ok(o) if String::from_utf8_lossy(&o.stdout).contains("Open MPI") => None,
        _ => Some(format!("{} is not Open MPI's mpirun", mpirun.display())),
    }
}

/// A file each rank pipewright starts creates as it begins: a job that failed without it
/// failed to start, and the run goes on in threads.
const MARK: &str = "PIPEWRIGHT_LAUNCH_MARK";

/// Say (by the file the launching process named) that a rank started.
pub fn mark_started() {
    if let Some(path) = std::env::var_os(MARK).filter(|_| launched()) {
        let _ = std::fs::write(path, b"");
    }
}

/// `mpirun`'s process id while this process waits for it (0 before).
static MPIRUN: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
/// Stop requests seen (SIGTERM, SIGUSR1).
static STOPS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// A stop request for the job (SIGTERM, SIGUSR1, or a terminal's Ctrl-C). `mpirun` ends the
/// whole job on SIGTERM, but passes SIGUSR1 on to every rank, which stops there at the next
/// step boundary with a checkpoint: the first request goes on as SIGUSR1, a second as SIGTERM
/// (end now), as in a run of threads.
extern "C" fn forward_stop(_sig: libc::c_int) {
    let pid = MPIRUN.load(std::sync::atomic::Ordering::SeqCst);
    let first = STOPS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
    if pid > 0 {
        let sig = if first { libc::SIGUSR1 } else { libc::SIGTERM };
        // SAFETY: kill is async-signal-safe.
        unsafe { libc::kill(pid, sig) };
    }
}

/// Run this same command again as `workers` MPI ranks under `mpirun`, wait for the job, and
/// end this process with its exit status. Returns only if the job could not be started, with
/// the reason.
pub fn relaunch(workers: usize) -> String {
    let Some(mpirun) = find_mpirun() else {
        return "mpirun is not on the PATH".into();
    };
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return format!("cannot find this program's file: {e}"),
    };
    let mark = std::env::temp_dir().join(format!("pipewright-launch-{}", std::process::id()));
    let _ = std::fs::remove_file(&mark);
    let mut cmd = mpirun_command(&mpirun, workers);
    let board = lend_board(&mut cmd, workers);
    cmd.arg(exe)
        .args(std::env::args_os().skip(1))
        .env(LAUNCHED, "1")
        .env(MARK, &mark);
    // mpirun and the ranks in a process group of their own: a signal to this command's whole
    // group (`timeout`, a batch script's stop, Ctrl-C) reaches this process alone, which
    // passes it on as a stop at a step boundary; mpirun would end the job on it at once.
    // Nothing reads the terminal (a background group reading it would be stopped).
    {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0).stdin(std::process::Stdio::null());
    }
    // SAFETY: the handler only reads and writes atomics and calls kill.
    unsafe {
        let handler = forward_stop as *const () as libc::sighandler_t;
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGUSR1, handler);
        libc::signal(libc::SIGINT, handler);
        // A closed terminal hangs up this process only: the job must not outlive it unasked.
        libc::signal(libc::SIGHUP, handler);
    }
    let mut job = match cmd.spawn() {
        Ok(job) => job,
        Err(e) => return format!("{}: {e}", mpirun.display()),
    };
    MPIRUN.store(job.id() as i32, std::sync::atomic::Ordering::SeqCst);
    if STOPS.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        // Asked to stop while mpirun was starting: passed on now.
        // SAFETY: kill only sends a signal.
        unsafe { libc::kill(job.id() as i32, libc::SIGUSR1) };
    }
    let code = match job.wait() {
        Ok(status) => {
            use std::os::unix::process::ExitStatusExt;
            status
                .code()
                .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
        }
        Err(e) => {
            eprintln!("error: waiting for {}: {e}", mpirun.display());
            1
        }
    };
    if let Some(board) = board {
        let _ = std::fs::remove_file(board);
    }
    let started = std::fs::remove_file(&mark).is_ok();
    if code != 0 && !started && STOPS.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        // SAFETY: back to the default handlers for the run in threads.
        unsafe {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGHUP, libc::SIG_DFL);
        }
        crate::ranks::stop_on_signals();
        return format!(
            "{} exited with {code} before any worker started",
            mpirun.display()
        );
    }
    std::process::exit(code)
}

/// `mpirun` with its options for `workers` ranks on this machine (the program follows).
fn mpirun_command(mpirun: &std::path::Path, workers: usize) -> std::process::Command {
    let mut cmd = std::process::Command::new(mpirun);
    // SAFETY: geteuid only reads this process's user id.
    if unsafe { libc::geteuid() } == 0 {
        // Open MPI refuses root without this; a container's user is often root.
        cmd.arg("--allow-run-as-root");
    }
    let cores = physical_cores();
    if workers <= cores {
        give_ranks_mkl(&mut cmd, cores / workers.max(1));
    }
    if workers > cores {
        // Unbound ranks would each run a BLAS thread per core: one each, unless the user says.
        for var in [
            "OPENBLAS_NUM_THREADS",
            "MKL_NUM_THREADS",
            "RAYON_NUM_THREADS",
        ] {
            if std::env::var_os(var).is_none() {
                cmd.env(var, "1");
            }
        }
    }
    use std::io::IsTerminal;
    if std::io::stderr().is_terminal() {
        cmd.env(TERMINAL, "1");
        if std::io::stdout().is_terminal() {
            // One stream to one terminal: the bar (stderr) and the summary (stdout) then
            // arrive in the order they were written.
            cmd.arg("--merge-stderr-to-stdout");
        }
    }
    cmd.arg("-q")
        .args(["-np", &workers.to_string()])
        .args(placement(workers, cores));
    cmd
}

/// Ranks of `cores_per_rank` cores on an Intel CPU run MKL sequentially where it is installed
/// (`blas_lib::rank_library` says why); where it is not, the run header says what it would
/// give ([`placement_note`]).
fn give_ranks_mkl(cmd: &mut std::process::Command, cores_per_rank: usize) {
    use pipewright_runtime::machine::{blas_lib, coretype::CpuFeatures};
    let user_named = blas_lib::user_named();
    let cpu = CpuFeatures::detect();
    if let Some(mkl) =
        blas_lib::rank_library(&cpu, user_named, cores_per_rank, blas_lib::find_mkl())
    {
        cmd.env("PIPEWRIGHT_BLAS", mkl)
            .env(blas_lib::CHOSEN_MKL, "1");
        if std::env::var_os("MKL_THREADING_LAYER").is_none() {
            cmd.env("MKL_THREADING_LAYER", "SEQUENTIAL");
        }
    }
}

/// Names the board on which the ranks lend each other their idle cores
/// ([`pipewright_runtime::machine::lend`]) when `workers` ranks get a core each. The launcher
/// creates the file and removes it after the job. `PIPEWRIGHT_LEND=0` turns lending off.
fn lend_board(cmd: &mut std::process::Command, workers: usize) -> Option<PathBuf> {
    use pipewright_runtime::machine::lend;
    let (on, note) = pipewright_runtime::machine::env_switch(LEND);
    if let Some(note) = note {
        eprintln!("{note}: idle cores are lent");
    }
    let off = !on;
    // A board named in this environment (not by this launcher) is no rank's to join.
    cmd.env_remove(LEND_BOARD);
    if workers < 2 || workers != physical_cores() || off {
        return None;
    }
    let dir = Path::new("/dev/shm");
    let dir = if dir.is_dir() {
        dir.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let path = dir.join(format!("pipewright-lend-{}", std::process::id()));
    std::fs::write(&path, vec![0u8; lend::board_bytes(workers)]).ok()?;
    cmd.env(LEND_BOARD, &path);
    Some(path)
}

/// `0` turns lending idle cores off; see [`lend_board`].
const LEND: &str = "PIPEWRIGHT_LEND";
/// The board's path, set in the ranks.
const LEND_BOARD: &str = "PIPEWRIGHT_LEND_BOARD";

/// In a rank pipewright started with a lending board, and whose BLAS runs one thread: join
/// the board (see [`lend_board`]).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub fn join_lending() {
    use pipewright_runtime::machine::{blas_lib, lend};
    let Some(path) = std::env::var_os(LEND_BOARD).filter(|_| launched()) else {
        return;
    };
    let (Some(me), Some(ranks)) = (crate::ranks::local_rank(), crate::ranks::local_ranks()) else {
        return;
    };
    if blas_lib::blas_threads() == Some(1) {
        let _ = lend::join(Path::new(&path), me, ranks, &lend::allowed_cpus());
    }
}

/// For a rank pipewright started on `cores` cores of an Intel CPU without MKL: what MKL would
/// give, for the run header.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
fn mkl_hint(cores: usize) -> &'static str {
    use pipewright_runtime::machine::{blas_lib, coretype::CpuFeatures};
    let user_named = blas_lib::user_named();
    match launched() && blas_lib::wants_mkl(&CpuFeatures::detect(), user_named, cores) {
        true => "; MKL ran such ranks up to 17% faster on an Intel CPU: `scripts/install-deps --mkl` installs it (PIPEWRIGHT_BLAS=system keeps OpenBLAS)",
        false => "",
    }
}

/// Set in the ranks pipewright started from a terminal (see [`on_terminal`]).
const TERMINAL: &str = "PIPEWRIGHT_LAUNCHED_ON_TERMINAL";

/// Whether this rank was started by pipewright from a command whose stderr is a terminal:
/// its own stderr is mpirun's pipe, but what it writes ends up there.
pub fn on_terminal() -> bool {
    launched() && std::env::var_os(TERMINAL).is_some()
}

/// Whether pipewright started this process as one of its ranks.
pub fn launched() -> bool {
    std::env::var_os(LAUNCHED).is_some()
}

/// Ranks that share a machine unbound would each run a BLAS thread per core: each gets its
/// share of the cores instead, unless the user set a thread count.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub fn share_cores() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: sysconf only reads a system setting.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    let set = ["OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    if let Some(local) = crate::ranks::local_ranks().filter(|&n| n > 1 && cores >= online && !set) {
        pipewright_runtime::machine::blas_lib::set_blas_threads((online / local).max(1) as i32);
    }
}

/// How this rank was placed, for the run header (rank 0 of an MPI job).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub fn placement_note(ranks: usize) -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    // SAFETY: sysconf only reads a system setting.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    let who = match launched() {
        true => "started by pipewright under mpirun",
        false => "MPI ranks",
    };
    let bound = match cores < online {
        true => format!("rank 0 bound to {cores} of {online} cores"),
        false => format!("rank 0 not bound (may use all {online} cores)"),
    };
    // Ranks sharing a machine unbound contend for its cores (bound ran 20-25% faster here).
    let hint = match (cores < online, crate::ranks::local_ranks()) {
        (false, Some(local)) if (2..=online).contains(&local) => {
            "; bind ranks to cores for speed (mpirun --bind-to core, srun --cpu-bind=cores)"
        }
        _ if cores < online => mkl_hint(cores),
        _ => "",
    };
    let threads = pipewright_runtime::machine::blas_lib::blas_threads()
        .map_or("?".to_string(), |t| t.to_string());
    let lent = match pipewright_runtime::machine::lend::joined() {
        true => "; a rank's large products also run on the cores of ranks that wait",
        false => "",
    };
    let s = if threads == "1" { "" } else { "s" };
    format!("workers: {ranks} processes ({who}), {bound}, BLAS {threads} thread{s}{lent}{hint}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_get_disjoint_cores_or_none_when_oversubscribed() {
        assert_eq!(
            placement(2, 2),
            ["--map-by", "slot:PE=1", "--bind-to", "core"]
        );
        assert_eq!(
            placement(2, 16),
            ["--map-by", "slot:PE=8", "--bind-to", "core"]
        );
        assert_eq!(
            placement(3, 8),
            ["--map-by", "slot:PE=2", "--bind-to", "core"]
        );
        assert_eq!(
            placement(4, 2),
            ["--oversubscribe", "--bind-to", "none", "--map-by", "slot"]
        );
    }

    #[test]
    fn this_machine_has_at_least_one_core_and_no_more_than_its_cpus() {
        let cores = physical_cores();
        let cpus = std::thread::available_parallelism().unwrap().get();
        assert!((1..=cpus).contains(&cores), "{cores} of {cpus}");
    }
}

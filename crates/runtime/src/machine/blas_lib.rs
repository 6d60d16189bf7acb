//! Which BLAS library runs the model's matrix products: the one place that decides.
//!
//! The system OpenBLAS (Debian's 0.3.21) is linked and used unless `PIPEWRIGHT_BLAS` names
//! another library, loaded at run time: any that exports `cblas_sgemm` with 32-bit integers
//! (an LP64 build: MKL's `libmkl_rt`, a newer OpenBLAS, or the OpenBLAS of SciPy's
//! `scipy-openblas32` wheel, whose symbols carry a `scipy_` prefix). That is how the README's BLAS comparison was measured; a newer OpenBLAS ran
//! the block's products faster alone but training no faster, so none is the default.

use std::ffi::{c_char, CStr};
use std::sync::OnceLock;

/// `cblas_sgemm`'s C signature (row/column order, transposes, m, n, k, alpha, a, lda, b, ldb,
/// beta, c, ldc).
pub(crate) type Sgemm = unsafe extern "C" fn(
    cblas_sys::CBLAS_LAYOUT,
    cblas_sys::CBLAS_TRANSPOSE,
    cblas_sys::CBLAS_TRANSPOSE,
    i32,
    i32,
    i32,
    f32,
    *const f32,
    i32,
    *const f32,
    i32,
    f32,
    *mut f32,
    i32,
) -> ();

extern "C" {
    /// The linked system OpenBLAS's build description ("OpenBLAS 0.3.21 ... SkylakeX ...").
    fn openblas_get_config() -> *const c_char;
    fn openblas_get_num_threads() -> i32;
    fn openblas_set_num_threads(n: i32);
}

/// A library's thread-count getter and setter (OpenBLAS's `openblas_{get,set}_num_threads`).
#[derive(Clone, Copy)]
pub(crate) struct Threads {
    get: unsafe extern "C" fn() -> i32,
    set: unsafe extern "C" fn(i32),
}

/// The library in use.
pub struct Blas {
    pub(crate) sgemm: Sgemm,
    /// How to make it single-threaded for a while, if it says ([`single_threaded`]).
    threads: Option<Threads>,
    /// What it is and where it came from, for users and benchmark logs.
    pub description: String,
}

/// Why a requested library cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("PIPEWRIGHT_BLAS={path}: {why} (unset it, or set it to `system` for the linked OpenBLAS)")]
pub struct BlasError {
    pub path: String,
    pub why: String,
    /// MKL was asked for by name and is not installed (a front end says how to install it).
    pub mkl_missing: bool,
}

/// The linked system OpenBLAS's build description ("OpenBLAS 0.3.21 ... Prescott ...").
fn system_config() -> String {
    // SAFETY: OpenBLAS returns a static NUL-terminated string.
    unsafe { CStr::from_ptr(openblas_get_config()) }
        .to_string_lossy()
        .into_owned()
}

fn system() -> Blas {
    let chosen = match std::env::var(CHOSEN_CORETYPE) {
        Ok(c) => {
            format!("; kernels {c} chosen by pipewright for this CPU, OPENBLAS_CORETYPE overrides")
        }
        Err(_) => String::new(),
    };
    Blas {
        sgemm: cblas_sys::cblas_sgemm,
        threads: Some(Threads {
            get: openblas_get_num_threads,
            set: openblas_set_num_threads,
        }),
        description: format!("{} (system library{chosen})", system_config()),
    }
}

/// Set in ranks that pipewright gave MKL by itself ([`rank_library`]): the version line says so.
pub const CHOSEN_MKL: &str = "PIPEWRIGHT_MKL_CHOSEN";

/// Where `PIPEWRIGHT_BLAS=mkl` (and [`rank_library`]) look for MKL's single dynamic library:
/// `$MKLROOT`, where `scripts/install-deps --mkl` puts PyPI's `mkl`, a `pip install --user`,
/// oneAPI's default, then the system's (Debian's `libmkl-rt`).
pub fn mkl_dirs() -> Vec<std::path::PathBuf> {
    use std::path::PathBuf;
    let mut dirs = Vec::new();
    if let Some(root) = std::env::var_os("MKLROOT").filter(|r| !r.is_empty()) {
        let root = PathBuf::from(root);
        dirs.extend([root.join("lib"), root.join("lib/intel64")]);
    }
    if let Some(home) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        let home = PathBuf::from(home);
        dirs.extend([
            home.join(".local/share/pipewright/mkl/lib"),
            home.join(".local/lib"),
        ]);
    }
    dirs.extend(
        [
            "/opt/intel/oneapi/mkl/latest/lib",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/local/lib",
        ]
        .map(PathBuf::from),
    );
    dirs
}

/// The first `libmkl_rt` (newest soname first) in [`mkl_dirs`] that is whole ([`mkl_in`]).
pub fn find_mkl() -> Option<std::path::PathBuf> {
    mkl_dirs().iter().find_map(|d| mkl_in(d))
}

/// The newest `libmkl_rt` in `dir` whose core and threading layers (sequential, GNU OpenMP)
/// lie beside it. `libmkl_rt` loads them only at its first product, and a missing one then ends
/// the process with MKL's own fatal error, past any fallback: a partial install is passed over.
pub fn mkl_in(dir: &std::path::Path) -> Option<std::path::PathBuf> {
    ["so.3", "so.2", "so"].iter().find_map(|suffix| {
        let rt = dir.join(format!("libmkl_rt.{suffix}"));
        let parts = ["core", "sequential", "gnu_thread"];
        let whole = parts
            .iter()
            .all(|p| dir.join(format!("libmkl_{p}.{suffix}")).is_file());
        (rt.is_file() && whole).then_some(rt)
    })
}

/// The library pipewright gives the ranks it starts itself, where it can do better than the
/// system OpenBLAS: MKL, run sequentially, for ranks bound to one core each of an Intel CPU
/// (and, by [`split_products`], for in-process workers, whose products are split instead).
/// Measured on a 2-core Intel Xeon (Sapphire Rapids): the default 2-stage run at 4,437 /
/// 4,386 / 4,302 tokens/s on MKL against 3,739 / 4,334 / 3,566 on Debian's OpenBLAS 0.3.21,
/// whose SkylakeX kernels reach 188 GFLOP/s there where MKL reaches 284. Not on AMD, where
/// the two run level (104 and 102 GFLOP/s single-threaded on a Zen 4); not with more cores a
/// rank (MKL's OpenMP threads then compete with the kernels' rayon threads: 2,000 against
/// 3,364 on 1 stage); never over a library the user named.
pub fn rank_library(
    cpu: &super::coretype::CpuFeatures,
    user_named: bool,
    cores_per_rank: usize,
    mkl: Option<std::path::PathBuf>,
) -> Option<std::path::PathBuf> {
    wants_mkl(cpu, user_named, cores_per_rank)
        .then_some(mkl)
        .flatten()
}

/// Whether pipewright would run a process's products on MKL, were it installed: on an Intel
/// CPU, where the library runs each product on `threads_per_product` threads (1: ranks of a
/// core each, or products split by [`split_products`]), unless the user named a library.
pub fn wants_mkl(
    cpu: &super::coretype::CpuFeatures,
    user_named: bool,
    threads_per_product: usize,
) -> bool {
    cpu.x86_64 && cpu.intel && !user_named && threads_per_product == 1
}

/// Set in a process that pipewright restarted with `OPENBLAS_CORETYPE` of its choosing (its
/// value): says so in the description, and stops a second restart.
pub const CHOSEN_CORETYPE: &str = "PIPEWRIGHT_CORETYPE_CHOSEN";

/// How the BLAS kernels in use fit this CPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelFit {
    /// They use its widest vectors (or cannot be judged: another library, another CPU).
    Fits,
    /// The linked OpenBLAS chose narrower kernels by itself: start again with
    /// `OPENBLAS_CORETYPE` set to this, before the library initialises.
    Restart(&'static str),
    /// Narrower kernels that the user's settings chose (`OPENBLAS_CORETYPE`, `PIPEWRIGHT_BLAS`)
    /// or that a restart could not change: say so once, with the fix.
    Slow { core: String, best: &'static str },
}

/// Threads the BLAS in use runs its products on, if it says.
pub fn blas_threads() -> Option<i32> {
    let b = blas().ok()?;
    // SAFETY: the library's own getter, which takes nothing.
    b.threads.map(|t| unsafe { (t.get)() })
}

/// Set the threads the BLAS in use runs its products on; false if it has no such setting.
pub fn set_blas_threads(n: i32) -> bool {
    let Some(t) = blas().ok().and_then(|b| b.threads) else {
        return false;
    };
    // SAFETY: the library's own setter, which takes a plain int.
    unsafe { (t.set)(n.max(1)) };
    true
}

/// Judge the BLAS in use against this CPU (see [`super::coretype`]).
pub fn kernel_fit() -> KernelFit {
    use super::coretype::{better_coretype, core_in_config, CpuFeatures};
    let system = std::env::var_os("PIPEWRIGHT_BLAS").is_none_or(|v| v.is_empty() || v == "system");
    let config = match (system, blas()) {
        (true, _) => system_config(),
        (false, Ok(b)) => b.description.clone(),
        (false, Err(_)) => return KernelFit::Fits,
    };
    let Some(core) = core_in_config(&config) else {
        return KernelFit::Fits;
    };
    let Some(best) = better_coretype(core, &CpuFeatures::detect()) else {
        return KernelFit::Fits;
    };
    let asked = std::env::var_os("OPENBLAS_CORETYPE").is_some();
    if system && !asked && std::env::var_os(CHOSEN_CORETYPE).is_none() {
        return KernelFit::Restart(best);
    }
    KernelFit::Slow {
        core: core.to_string(),
        best,
    }
}

/// For tests that compare products to the bit. Where the linked OpenBLAS chose narrower kernels
/// by itself (the CLI then restarts with better ones: [`KernelFit::Restart`]), run the test
/// `name` of this test binary again in a child process on the kernels pipewright chooses, as
/// the CLI runs, and give whether it passed; `None` where the kernels in use are already those.
/// (On a CPU newer than the library, OpenBLAS 0.3.21 falls back to Haswell kernels, whose
/// edge rows round differently when the rows are split.)
#[doc(hidden)]
pub fn rerun_on_chosen_kernels(name: &str) -> Option<bool> {
    let KernelFit::Restart(core) = kernel_fit() else {
        return None;
    };
    let exe = std::env::current_exe().ok()?;
    let status = std::process::Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env("OPENBLAS_CORETYPE", core)
        .env(CHOSEN_CORETYPE, "1")
        .status()
        .ok()?;
    Some(status.success())
}

/// Loads the library at `path` and finds its `cblas_sgemm`; if found, it stays loaded for the
/// process (unloaded again if not). `sequential`: an MKL runs each product in its calling
/// thread, whatever `MKL_THREADING_LAYER` says (pipewright's own choice for split products).
fn load(path: &str, sequential: bool) -> Result<Blas, String> {
    // A path that exists (not a name for the loader's search) must be a regular file: dlopen
    // blocks on a FIFO and reads a device forever. A missing one is named by the loader.
    if path.contains('/') && std::fs::metadata(path).is_ok() {
        pipewright_core::inputs::regular_file(std::path::Path::new(path)).map_err(|e| match e {
            pipewright_core::Error::Input { msg, .. } => msg,
            e => e.to_string(),
        })?;
    }
    // SAFETY: loading runs the library's initialisers; a BLAS's start its thread pool.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
    let find = |names: &[&str]| {
        names.iter().find_map(|n| {
            // SAFETY: the symbol is looked up with the type of the function it names.
            unsafe { lib.get::<unsafe extern "C" fn()>(n.as_bytes()) }
                .ok()
                .map(|s| *s)
        })
    };
    let sgemm = find(&["cblas_sgemm", "scipy_cblas_sgemm"])
        .ok_or("it exports no cblas_sgemm (nor scipy_cblas_sgemm)")?;
    // MKL's single dynamic library picks a threading layer at its first call, Intel's OpenMP
    // by default, which PyPI's `mkl` does not bring: the first product then dies in the dynamic
    // linker (`undefined symbol: omp_get_num_procs`), past any error handling. So the layer is
    // checked here: GNU OpenMP (libgomp, part of the GCC runtime) unless MKL_THREADING_LAYER
    // names one, and a named one whose runtime cannot be loaded is refused.
    let mkl_layer = match find(&["MKL_Set_Threading_Layer"]) {
        None => "",
        Some(f) if sequential => {
            // SAFETY: `int MKL_Set_Threading_Layer(int)`; 1 is MKL_THREADING_SEQUENTIAL.
            let f: unsafe extern "C" fn(i32) -> i32 = unsafe { std::mem::transmute(f) };
            unsafe { f(1) };
            ", threading: sequential"
        }
        Some(f) => match std::env::var("MKL_THREADING_LAYER") {
            Err(std::env::VarError::NotPresent) => {
                // SAFETY: `int MKL_Set_Threading_Layer(int)`; 3 is MKL_THREADING_GNU.
                let f: unsafe extern "C" fn(i32) -> i32 = unsafe { std::mem::transmute(f) };
                unsafe { f(3) };
                ", threading: GNU OpenMP"
            }
            Ok(v) => {
                let runtime = match v.to_ascii_uppercase().as_str() {
                    "SEQUENTIAL" | "PGI" => None,
                    "GNU" => Some("libgomp.so.1"),
                    "INTEL" => Some("libiomp5.so"),
                    "TBB" => Some("libtbb.so.12"),
                    _ => {
                        return Err(format!(
                            "MKL_THREADING_LAYER={v} is not one of INTEL, SEQUENTIAL, GNU, TBB, PGI"
                        ))
                    }
                };
                if let Some(r) = runtime {
                    // Where MKL would find it: the search path, or beside MKL itself.
                    let beside = std::path::Path::new(path).with_file_name(r);
                    // SAFETY: loading an OpenMP or TBB runtime runs only its initialisers.
                    let found = unsafe { libloading::Library::new(r) }
                        .or_else(|e| unsafe { libloading::Library::new(&beside) }.map_err(|_| e));
                    if let Err(e) = found {
                        return Err(format!(
                            "MKL_THREADING_LAYER={v} needs {r}, which cannot be loaded ({e}); unset it for GNU OpenMP"
                        ));
                    }
                }
                match v.eq_ignore_ascii_case("SEQUENTIAL") {
                    true => ", threading: sequential",
                    false => "",
                }
            }
            Err(_) => return Err("MKL_THREADING_LAYER is not UTF-8".to_string()),
        },
    };
    let config = find(&["openblas_get_config", "scipy_openblas_get_config"]).map(|f| {
        // SAFETY: OpenBLAS's `openblas_get_config` takes nothing and returns a static C string.
        let f: unsafe extern "C" fn() -> *const c_char = unsafe { std::mem::transmute(f) };
        unsafe { CStr::from_ptr(f()) }
            .to_string_lossy()
            .into_owned()
    });
    let threads = find(&[
        "openblas_get_num_threads",
        "scipy_openblas_get_num_threads",
        "MKL_Get_Max_Threads",
    ])
    .zip(find(&[
        "openblas_set_num_threads",
        "scipy_openblas_set_num_threads",
        "MKL_Set_Num_Threads",
    ]))
    .map(|(get, set)| Threads {
        // SAFETY: OpenBLAS's `int openblas_get_num_threads(void)` and
        // `void openblas_set_num_threads(int)`, or MKL's `int MKL_Get_Max_Threads(void)` and
        // `void MKL_Set_Num_Threads(int)`: the same signatures.
        get: unsafe {
            std::mem::transmute::<unsafe extern "C" fn(), unsafe extern "C" fn() -> i32>(get)
        },
        set: unsafe {
            std::mem::transmute::<unsafe extern "C" fn(), unsafe extern "C" fn(i32)>(set)
        },
    });
    let name = match (&config, find(&["MKL_Set_Threading_Layer"]).is_some()) {
        (Some(c), _) => c.clone(),
        (None, true) => "MKL".to_string(),
        (None, false) => "CBLAS".to_string(),
    };
    // The function pointers stay valid while the library is loaded: for good, from here.
    std::mem::forget(lib);
    let chosen = match std::env::var_os(CHOSEN_MKL) {
        Some(_) => "; chosen by pipewright for ranks of one core on an Intel CPU, PIPEWRIGHT_BLAS=system overrides",
        None => "",
    };
    Ok(Blas {
        // SAFETY: `cblas_sgemm` has the standard CBLAS signature in every CBLAS library.
        sgemm: unsafe { std::mem::transmute::<unsafe extern "C" fn(), Sgemm>(sgemm) },
        threads,
        description: format!("{name} ({path}{mkl_layer}{chosen})"),
    })
}

/// Chooses the library: the one `PIPEWRIGHT_BLAS` names, or the system OpenBLAS when it is
/// unset, empty or `system`.
fn choose() -> Result<Blas, BlasError> {
    let Some(v) = std::env::var_os("PIPEWRIGHT_BLAS") else {
        return Ok(system());
    };
    let mut path = v.to_string_lossy().into_owned();
    if path.is_empty() || path == "system" {
        return Ok(system());
    }
    if path == "mkl" {
        let Some(found) = find_mkl() else {
            return Err(BlasError {
                path,
                why: format!(
                    "no whole MKL found (looked for libmkl_rt with its core and threading layers beside it in {})",
                    mkl_dirs().iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
                ),
                mkl_missing: true,
            });
        };
        path = found.display().to_string();
    } else if v.to_str().is_none() {
        return Err(BlasError {
            path,
            why: "not a UTF-8 path".to_string(),
            mkl_missing: false,
        });
    }
    match load(&path, false) {
        Ok(b) => Ok(b),
        // pipewright's own choice ([`rank_library`]) must not stop a run the system library
        // can train: a damaged MKL falls back, and says so.
        Err(why) if std::env::var_os(CHOSEN_MKL).is_some() => {
            let mut b = system();
            b.description +=
                &format!("; the MKL pipewright chose, {path}, could not be used: {why}");
            Ok(b)
        }
        Err(why) => Err(BlasError {
            path,
            why,
            mkl_missing: false,
        }),
    }
}

static CHOSEN: OnceLock<Result<Blas, BlasError>> = OnceLock::new();

/// The library in use, or why the one `PIPEWRIGHT_BLAS` names cannot be. Commands call this
/// first, so that a bad setting stops them with a clear message before any work.
pub fn blas() -> Result<&'static Blas, &'static BlasError> {
    match SWITCHED.get() {
        Some(b) => Ok(b),
        None => CHOSEN.get_or_init(choose).as_ref(),
    }
}

/// The library [`split_products`] moved this process's products to (MKL on an Intel CPU); from
/// then on [`blas`] returns it.
static SWITCHED: OnceLock<Blas> = OnceLock::new();

/// The `cblas_sgemm` the kernels call: the chosen library's (the system one if the choice
/// failed, which [`blas`] reports before any product runs).
pub(crate) fn sgemm() -> Sgemm {
    static FALLBACK: OnceLock<Blas> = OnceLock::new();
    match blas() {
        Ok(b) => b.sgemm,
        Err(_) => FALLBACK.get_or_init(system).sgemm,
    }
}

/// How many callers are inside [`single_threaded`], and the library's thread count to restore
/// when the last one leaves.
static SINGLE: std::sync::Mutex<(usize, i32)> = std::sync::Mutex::new((0, 0));

/// While the guard lives, the library runs each product single-threaded in its calling
/// thread, so that the caller can run many small products at once on rayon's threads.
/// OpenBLAS gains little from its threads on small products: a batch of 16 attention
/// products (128 x 64 x 128, one per sequence and head), timed in C, ran at 92-101 GFLOP/s one
/// after the other on its 2 threads (90-93 on one), and at 176 as 2 single-threaded calls at
/// once. The count is the library's global setting, so other
/// threads' products meanwhile run single-threaded too (correct, only slower). `None` if the
/// library has no such setting.
pub(crate) fn single_threaded() -> Option<SingleThreaded> {
    let threads = blas().ok()?.threads?;
    let mut s = SINGLE.lock().unwrap_or_else(|e| e.into_inner());
    if s.0 == 0 {
        // SAFETY: OpenBLAS's thread-count calls take and return plain ints.
        s.1 = unsafe { (threads.get)() };
        unsafe { (threads.set)(1) };
    }
    s.0 += 1;
    Some(SingleThreaded(threads))
}

/// See [`single_threaded`]; the last one dropped restores the library's thread count.
pub(crate) struct SingleThreaded(Threads);

impl Drop for SingleThreaded {
    fn drop(&mut self) {
        let mut s = SINGLE.lock().unwrap_or_else(|e| e.into_inner());
        s.0 -= 1;
        if s.0 == 0 {
            // SAFETY: as in `single_threaded`.
            unsafe { (self.0.set)(s.1) };
        }
    }
}

/// Threads that pipewright splits a large product over itself, on rayon's pool, with the library
/// single-threaded (0: the library's own threading). See [`split_products`].
static SPLIT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// `0` keeps the library's own threading ([`split_products`]).
pub const SPLIT_VAR: &str = "PIPEWRIGHT_SPLIT";

/// The most threads [`split_products`] takes over from the library. Each part packs the whole
/// right operand again, which the library's threads share: 2 is what was measured.
const MAX_SPLIT: usize = 4;

/// For trainers whose workers are threads of this process: run every product single-threaded
/// and split the large ones over rayon's pool instead of the library's (one pool of threads on
/// the cores, not two). Two pools on 2 cores, OpenBLAS's threads yielding in a loop while
/// rayon's ran the other ops, put 1-stage runs of `examples/gpt_bench.toml` into a mode about
/// 30% slower in 6 of 34 runs (300,000 involuntary context switches in 11 s); one pool had none
/// in 28, with the same median (its fast runs a few percent slower: each part packs the right
/// operand again, which the library's threads share). Kept to the library's threading
/// where it already runs one thread (MPI ranks given a core each) or more than [`MAX_SPLIT`],
/// and where `PIPEWRIGHT_SPLIT=0`. On an Intel CPU the products then move to MKL, run
/// sequentially, where it is installed ([`wants_mkl`]; MKL's threads competing with rayon's were
/// why it lost there before). Returns the threads products are split over (0: not split).
pub fn split_products() -> usize {
    split_products_with(mkl_for_split)
}

/// [`split_products`], with `library` naming the library to move the products to, if any (for
/// tests; [`split_products`] asks [`mkl_for_split`]).
#[doc(hidden)]
pub fn split_products_with(library: impl FnOnce() -> Option<std::path::PathBuf>) -> usize {
    use std::sync::atomic::Ordering;
    let s = SINGLE.lock().unwrap_or_else(|e| e.into_inner());
    let done = SPLIT.load(Ordering::Relaxed);
    let decided = done > 0 || SWITCHED.get().is_some() || SWITCH_FAILED.get().is_some();
    if decided || s.0 > 0 || !super::env_switch(SPLIT_VAR).0 {
        return done;
    }
    let Some(threads) = blas().ok().and_then(|b| b.threads) else {
        return 0;
    };
    // SAFETY: the library's thread-count calls take and return plain ints.
    let lib = unsafe { (threads.get)() }.max(1) as usize;
    let n = lib.min(rayon::current_num_threads());
    // A product's own threads are given up where they are split, or where there was one.
    if !(n == 1 && lib == 1 || (2..=MAX_SPLIT).contains(&n)) {
        return 0;
    }
    let threads = match library().and_then(|p| switch_to(&p)) {
        Some(b) => b.threads,
        None => Some(threads),
    };
    if let Some(t) = threads {
        // SAFETY: as above.
        unsafe { (t.set)(1) };
    }
    if n < 2 {
        return 0;
    }
    SPLIT.store(n, Ordering::Relaxed);
    n
}

/// MKL, where [`split_products`] moves the products to it ([`wants_mkl`], and not with
/// `PIPEWRIGHT_SPLIT=0`) and it is installed.
pub fn mkl_for_split() -> Option<std::path::PathBuf> {
    let on = super::env_switch(SPLIT_VAR).0;
    (on && wants_mkl(&super::coretype::CpuFeatures::detect(), user_named(), 1))
        .then(find_mkl)
        .flatten()
}

/// Whether the user named a library (`PIPEWRIGHT_BLAS`, `system` included): pipewright then
/// chooses none itself.
pub fn user_named() -> bool {
    std::env::var_os("PIPEWRIGHT_BLAS").is_some()
}

/// Why the library [`split_products`] chose could not be loaded (the products stay where they
/// were), for the run header.
static SWITCH_FAILED: OnceLock<String> = OnceLock::new();

/// Loads `path` to run this process's products from now on, sequentially; None (and a reason
/// for the header) if it cannot be used.
fn switch_to(path: &std::path::Path) -> Option<&'static Blas> {
    let shown = path.display().to_string();
    match load(&shown, true) {
        Ok(mut b) => {
            b.description += "; chosen by pipewright for in-process workers on an Intel CPU, PIPEWRIGHT_BLAS=system overrides";
            SWITCHED.set(b).ok()?;
            SWITCHED.get()
        }
        Err(why) => {
            let _ = SWITCH_FAILED.set(format!(
                "the MKL pipewright chose, {shown}, could not be used: {why}"
            ));
            None
        }
    }
}

/// How [`split_products`] runs this process's products, for a run header: None where the
/// library's own threading runs them.
pub fn split_note() -> Option<String> {
    let n = split_threads();
    let split = (n > 1).then(|| {
        format!("large products split over {n} threads by pipewright, BLAS 1 thread each")
    });
    let could = n > 1 && wants_mkl(&super::coretype::CpuFeatures::detect(), user_named(), 1);
    let library = match (SWITCHED.get(), SWITCH_FAILED.get()) {
        (Some(_), _) => Some(MKL_CHOSEN.to_string()),
        (None, Some(why)) => Some(why.clone()),
        (None, None) => could.then(|| MKL_HINT.to_string()),
    };
    match (split, library) {
        (Some(s), Some(l)) => Some(format!("{s}; {l}")),
        (s, l) => s.or(l),
    }
}

/// The header's words where [`split_products`] moved the products to MKL.
const MKL_CHOSEN: &str =
    "MKL runs them (sequential), chosen for this Intel CPU; PIPEWRIGHT_BLAS=system keeps OpenBLAS";

/// What MKL would give an Intel CPU where it is not installed, for run headers.
/// Measured on a 2-core Xeon (Sapphire Rapids), one thread each: a 512 x 256 x 1024 product in
/// 2.11 ms on MKL against 2.61 in Debian's OpenBLAS 0.3.21 (SkylakeX kernels).
pub const MKL_HINT: &str = "MKL ran single-threaded products 24% faster than Debian's OpenBLAS on an Intel Xeon: pipewright's scripts/install-deps installs it";

/// Threads a large product is split over by pipewright (0: none; see [`split_products`]).
pub fn split_threads() -> usize {
    SPLIT.load(std::sync::atomic::Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `out = a · b` through a chosen library's `sgemm`, 2 x 3 times 3 x 2.
    fn product(b: &Blas) -> [f32; 4] {
        let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let y = [7.0f32, 8.0, 9.0, 10.0, 11.0, 12.0];
        let mut out = [0.0f32; 4];
        // SAFETY: row-major 2 x 3 and 3 x 2 operands, a 2 x 2 output.
        unsafe {
            (b.sgemm)(
                cblas_sys::CblasRowMajor,
                cblas_sys::CblasNoTrans,
                cblas_sys::CblasNoTrans,
                2,
                2,
                3,
                1.0,
                x.as_ptr(),
                3,
                y.as_ptr(),
                2,
                0.0,
                out.as_mut_ptr(),
                2,
            )
        };
        out
    }

    #[test]
    fn system_library_multiplies_and_names_itself() {
        let b = system();
        assert_eq!(product(&b), [58.0, 64.0, 139.0, 154.0]);
        assert!(b.description.contains("OpenBLAS"), "{}", b.description);
    }

    #[test]
    fn a_library_loaded_by_path_multiplies() {
        // The system OpenBLAS again, this time through the loader.
        let path = [
            "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
            "/usr/lib/libopenblas.so.0",
        ]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
        let Some(path) = path else { return };
        let b = load(path, false).expect("OpenBLAS loads");
        assert_eq!(product(&b), [58.0, 64.0, 139.0, 154.0]);
        assert!(b.description.contains(path), "{}", b.description);
    }

    #[test]
    fn single_threaded_nests_and_restores_the_thread_count() {
        let get = || system().threads.map(|t| unsafe { (t.get)() });
        let Some(_) = get() else { return };
        {
            let _outer = single_threaded().expect("OpenBLAS has a thread-count setting");
            {
                let _inner = single_threaded().expect("nests");
                assert_eq!(get(), Some(1));
            }
            assert_eq!(get(), Some(1), "the outer guard still holds");
        }
        // Whenever no guard is held (other tests may hold one now), the count is the saved one.
        let s = SINGLE.lock().unwrap();
        if s.0 == 0 {
            assert_eq!(get(), Some(s.1));
            assert!(s.1 >= 1);
        }
    }

    #[test]
    fn only_a_whole_mkl_is_found() {
        let dir = std::env::temp_dir().join(format!("pw-mkl-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let touch = |n: &str| std::fs::write(dir.join(n), b"").unwrap();
        assert_eq!(mkl_in(&dir), None, "nothing there");
        touch("libmkl_rt.so.2");
        assert_eq!(mkl_in(&dir), None, "no core, no layers");
        touch("libmkl_core.so.2");
        touch("libmkl_sequential.so.2");
        assert_eq!(mkl_in(&dir), None, "no GNU OpenMP layer");
        touch("libmkl_gnu_thread.so.2");
        assert_eq!(mkl_in(&dir), Some(dir.join("libmkl_rt.so.2")));
        // A newer runtime without its own core is passed over for the whole older one.
        touch("libmkl_rt.so.3");
        touch("libmkl_core.so.2");
        assert_eq!(mkl_in(&dir), Some(dir.join("libmkl_rt.so.2")));
        for p in ["core", "sequential", "gnu_thread"] {
            touch(&format!("libmkl_{p}.so.3"));
        }
        assert_eq!(mkl_in(&dir), Some(dir.join("libmkl_rt.so.3")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unusable_libraries_say_why() {
        let e = load("/nonexistent/libblas.so", false)
            .err()
            .expect("no such file");
        assert!(e.contains("/nonexistent/libblas.so"), "{e}");
        // A real library without CBLAS: the C maths library.
        let libm = [
            "/lib/x86_64-linux-gnu/libm.so.6",
            "/usr/lib/x86_64-linux-gnu/libm.so.6",
        ]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
        if let Some(p) = libm {
            let e = load(p, true).err().expect("libm has no sgemm");
            assert!(e.contains("exports no cblas_sgemm"), "{e}");
        }
    }
}

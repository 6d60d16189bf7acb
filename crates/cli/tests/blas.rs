//! The BLAS kernels fit the CPU by default: where the linked OpenBLAS picks kernels narrower
//! than the CPU's vectors, pipewright restarts with `OPENBLAS_CORETYPE` set to ones that fit;
//! a user's own `OPENBLAS_CORETYPE` is respected, and a run on narrow kernels says so once,
//! with the fix.

use pipewright_runtime::machine::coretype::{core_in_config, core_level, CpuFeatures};
use std::process::{Command, Output};

fn pw(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipewright"));
    c.args(args)
        .env_remove("OPENBLAS_CORETYPE")
        .env_remove("PIPEWRIGHT_BLAS")
        .env_remove("PIPEWRIGHT_CORETYPE_CHOSEN");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("runs")
}

/// The core name `--version` reports.
fn core(env: &[(&str, &str)]) -> Option<String> {
    let out = String::from_utf8(pw(&["--version"], env).stdout).unwrap();
    let blas = out.lines().find(|l| l.starts_with("BLAS: "))?.to_string();
    core_in_config(&blas).map(str::to_string)
}

#[test]
fn by_default_the_kernels_use_the_cpus_widest_vectors() {
    let cpu = CpuFeatures::detect();
    let Some(best) = cpu.best_coretype() else {
        eprintln!("skipped: not an x86-64 CPU with AVX");
        return;
    };
    let Some(got) = core(&[]) else {
        eprintln!("skipped: the BLAS names no known x86-64 core");
        return;
    };
    assert_eq!(
        core_level(&got),
        core_level(best),
        "kernels {got} on a CPU for {best}"
    );
}

#[test]
fn a_users_core_type_is_kept_and_a_run_on_narrow_kernels_says_so_once() {
    let cpu = CpuFeatures::detect();
    let Some(slowest) = cpu.narrower_coretype() else {
        eprintln!("skipped: no kernels below this CPU's best to try");
        return;
    };
    let narrow = [("OPENBLAS_CORETYPE", slowest)];
    let Some(reported) = core(&narrow).filter(|c| c.eq_ignore_ascii_case(slowest)) else {
        eprintln!("skipped: this BLAS does not take OPENBLAS_CORETYPE");
        return;
    };
    let tiny = [
        "--d-model",
        "16",
        "--heads",
        "2",
        "--layers",
        "2",
        "--seq-len",
        "16",
    ];
    let args = [&["train", "--steps", "1", "--no-checkpoint"][..], &tiny].concat();
    let o = pw(&args, &narrow);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let warnings: Vec<&str> = err
        .lines()
        .filter(|l| l.contains(&format!("runs {reported} kernels")))
        .collect();
    assert_eq!(warnings.len(), 1, "{err}");
    let best = cpu.best_coretype().unwrap();
    assert!(
        warnings[0].contains(&format!("unset OPENBLAS_CORETYPE, or set it to {best}")),
        "{err}"
    );
}

/// `PIPEWRIGHT_BLAS=mkl` finds MKL where `scripts/install-deps --mkl` (or `$MKLROOT`) put it, or
/// stops `train` with exit 2, naming where it looked and how to install it; a partial install
/// is passed over.
#[test]
fn mkl_by_name_is_found_or_refused_with_the_fix() {
    let home = std::env::temp_dir().join(format!("pw-mkl-home-{}", std::process::id()));
    std::fs::create_dir_all(&home).unwrap();
    // A partial install (the runtime without its core and layers) is passed over.
    let partial = home.join(".local/share/pipewright/mkl/lib");
    std::fs::create_dir_all(&partial).unwrap();
    std::fs::write(partial.join("libmkl_rt.so.3"), b"").unwrap();
    let home = home.to_str().unwrap();
    let none = [
        ("PIPEWRIGHT_BLAS", "mkl"),
        ("HOME", home),
        ("MKLROOT", home),
    ];
    if pipewright_runtime::machine::blas_lib::mkl_dirs()
        .iter()
        .filter(|d| !d.starts_with(std::env::var("HOME").unwrap_or_default()))
        .any(|d| pipewright_runtime::machine::blas_lib::mkl_in(d).is_some())
    {
        eprintln!("skipped: a system MKL is installed here");
        return;
    }
    let o = pw(&["train", "--steps", "1", "--no-checkpoint"], &none);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("PIPEWRIGHT_BLAS=mkl: no whole MKL found")
            && err.contains(&format!("{home}/.local/share/pipewright/mkl/lib"))
            && err.contains("scripts/install-deps --mkl"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// An MKL that pipewright chose by itself (for its ranks on an Intel CPU) and that cannot be
/// loaded leaves the run on the system OpenBLAS, and `--version` says why; the same file named
/// by the user stops the run.
#[test]
fn a_damaged_mkl_of_pipewrights_choosing_falls_back_to_openblas() {
    let bad = std::env::temp_dir().join(format!("pw-bad-mkl-{}.so", std::process::id()));
    std::fs::write(&bad, b"").unwrap();
    let chosen = [
        ("PIPEWRIGHT_BLAS", bad.to_str().unwrap()),
        ("PIPEWRIGHT_MKL_CHOSEN", "1"),
    ];
    let v = String::from_utf8(pw(&["--version"], &chosen).stdout).unwrap();
    assert!(v.contains("could not be used"), "{v}");
    let train = ["train", "--steps", "1", "--no-checkpoint", "--layers", "1"];
    assert!(pw(&train, &chosen).status.success());
    let named = pw(&train, &chosen[..1]);
    assert_eq!(named.status.code(), Some(2));
}

/// A FIFO (or a directory) named as the library is refused before the loader opens it (which
/// would block on the FIFO for ever): exit 2, one line naming it.
#[test]
fn a_fifo_as_the_library_is_refused_not_waited_on() {
    let dir = std::env::temp_dir().join(format!("pw-blas-fifo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("libfake.so");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success()));
    for lib in [&fifo, &dir] {
        let lib = lib.to_str().unwrap();
        let mut c = Command::new("timeout");
        c.args([
            "20",
            env!("CARGO_BIN_EXE_pipewright"),
            "train",
            "--steps",
            "1",
        ])
        .args(["--no-checkpoint"])
        .env("PIPEWRIGHT_BLAS", lib);
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{lib}: {err}");
        assert!(
            err.contains(&format!(
                "PIPEWRIGHT_BLAS={lib}: cannot read: not a regular file"
            )),
            "{err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

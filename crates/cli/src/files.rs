//! Reading plans and clusters, and writing outputs whole or not at all.

use crate::error::BadInput;
use anyhow::{Context, Result};
use pipewright_core::plan::ir::Plan;
use pipewright_core::plan::validate::ValidPlan;
use std::path::Path;

/// Read a plan file (CSV by extension, JSON otherwise) without validating it.
pub fn load_plan(file: &Path) -> Result<Plan> {
    let text = pipewright_core::inputs::read_file(file)?;
    let name = file.display().to_string();
    Ok(if file.extension().is_some_and(|e| e == "csv") {
        Plan::from_csv(&name, &text)?
    } else {
        Plan::from_json(&name, &text)?
    })
}

/// Read and validate a plan file; errors name the file.
pub fn load_valid_plan(file: &Path) -> Result<ValidPlan> {
    let plan = load_plan(file)?;
    Ok(ValidPlan::new(plan).map_err(|e| BadInput(format!("{}: {e}", file.display())))?)
}

/// The cluster's devices for the plan's workers (named in the plan, or the first ones).
pub fn cluster_for_plan(path: &Path, plan: &Plan) -> Result<pipewright_core::cluster::Cluster> {
    let c = pipewright_core::cluster::Cluster::load(path)?;
    pipewright_core::sim::devices_for_plan(plan, &c)
        .map_err(|e| BadInput(format!("{}: {e}", path.display())).into())
}

/// An output path may be missing or a regular file; anything else (a directory, a symlink, a
/// FIFO, a device) is refused rather than replaced by the rename that writes it, and so is
/// a file this command has read (by any name: `report m.jsonl --out m.jsonl`).
pub fn check_output(path: &Path) -> Result<()> {
    if let Some(input) = pipewright_core::inputs::input_at(path) {
        return Err(BadInput(format!(
            "{}: is {}, an input of this command; refusing to replace it (write elsewhere)",
            path.display(),
            input.display()
        ))
        .into());
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(dir) = parent.filter(|d| !d.is_dir()) {
        return Err(BadInput(format!(
            "{}: its directory {} does not exist (create it first)",
            path.display(),
            dir.display()
        ))
        .into());
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_file() => Err(BadInput(format!(
            "{}: exists and is not a regular file (a directory, link, FIFO or device); refusing to replace it",
            path.display()
        ))
        .into()),
        _ => Ok(()),
    }
}

/// Stream into `path` via a temporary file and rename, so a failed write leaves no half file.
pub fn write_with(
    path: &Path,
    fill: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<()>,
) -> Result<()> {
    check_output(path)?;
    let tmp = path.with_extension("tmp~");
    let res = std::fs::File::create(&tmp).and_then(|f| {
        let mut w = std::io::BufWriter::new(f);
        fill(&mut w)?;
        use std::io::Write;
        w.flush()
    });
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(anyhow::Error::new(e).context(format!("cannot write {}", tmp.display())));
    }
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// Write via a temporary file and rename, so a failed write leaves no half file.
pub fn write_file(path: &Path, text: &str) -> Result<()> {
    write_with(path, |w| w.write_all(text.as_bytes()))
}

/// An output directory, created if missing; refused if the path is something else.
pub fn output_dir(dir: &Path) -> Result<()> {
    if dir.exists() && !dir.is_dir() {
        return Err(BadInput(format!(
            "--out {}: exists and is not a directory",
            dir.display()
        ))
        .into());
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))
}

/// Fill a new directory beside `dir`, then put it in `dir`'s place in one rename: where `dir`
/// exists, the two are exchanged atomically (`renameat2(RENAME_EXCHANGE)`) after the regular
/// files of `dir` that `keep` names were carried over, and the old one is removed. A kill
/// leaves the old directory or the new one, never a mix (and at worst a `.NAME.tmp~PID`
/// beside it).
pub fn replace_dir(
    dir: &Path,
    keep: impl Fn(&str) -> bool,
    fill: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    // `.`, `..` or a trailing slash name no directory to rename: the real path does.
    let real = dir.canonicalize();
    let dir = real.as_deref().unwrap_or(dir);
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = dir
        .file_name()
        .ok_or_else(|| BadInput(format!("{}: not a directory name", dir.display())))?;
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    let tmp = parent.join(format!(
        ".{}.tmp~{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let filled = fill(&tmp).and_then(|()| carry_over(dir, &tmp, &keep));
    if let Err(e) = filled {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let empty = std::fs::read_dir(dir).map_or(true, |mut d| d.next().is_none());
    if empty {
        // rename(2) replaces a missing or empty directory in one step.
        return std::fs::rename(&tmp, dir)
            .with_context(|| format!("cannot write {}", dir.display()));
    }
    exchange(&tmp, dir).with_context(|| format!("cannot replace {}", dir.display()))?;
    // `tmp` now holds the old directory.
    std::fs::remove_dir_all(&tmp).with_context(|| format!("cannot remove {}", tmp.display()))
}

/// The regular files of `from` that `keep` names, hard-linked (or copied) into `to`.
fn carry_over(from: &Path, to: &Path, keep: &impl Fn(&str) -> bool) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(from) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let regular = e.file_type().is_ok_and(|t| t.is_file());
        if !regular || !keep(&name.to_string_lossy()) || to.join(&name).exists() {
            continue;
        }
        std::fs::hard_link(e.path(), to.join(&name))
            .or_else(|_| std::fs::copy(e.path(), to.join(&name)).map(|_| ()))
            .with_context(|| format!("cannot carry over {}", e.path().display()))?;
    }
    Ok(())
}

/// Exchange two directories atomically; where the file system cannot, in two renames.
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c =
        |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: two NUL-terminated paths relative to the working directory.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if !matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) {
        return Err(e);
    }
    let old = a.with_extension("old~");
    std::fs::rename(b, &old)?;
    std::fs::rename(a, b)?;
    std::fs::rename(&old, a)
}

/// Whether `a` and `b` name the same file or directory (by device and inode).
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => (x.dev(), x.ino()) == (y.dev(), y.ino()),
        _ => false,
    }
}

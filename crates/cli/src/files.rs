//! Reading plans and clusters, and writing outputs whole or not at all.

use crate::error::BadInput;
use anyhow::{Context, Result};
use pipewright_core::plan::ir::Plan;
use pipewright_core::plan::validate::validate;
use std::path::Path;

/// Read a plan file (CSV by extension, JSON otherwise) without validating it.
pub fn load_plan(file: &Path) -> Result<Plan> {
    let text = pipewright_core::error::read_file(file)?;
    let name = file.display().to_string();
    Ok(if file.extension().is_some_and(|e| e == "csv") {
        Plan::from_csv(&name, &text)?
    } else {
        Plan::from_json(&name, &text)?
    })
}

/// Read and validate a plan file; errors name the file.
pub fn load_valid_plan(file: &Path) -> Result<Plan> {
    let plan = load_plan(file)?;
    validate(&plan).map_err(|e| BadInput(format!("{}: {e}", file.display())))?;
    Ok(plan)
}

/// The cluster's devices for the plan's workers (named in the plan, or the first ones).
pub fn cluster_for_plan(path: &Path, plan: &Plan) -> Result<pipewright_core::cluster::Cluster> {
    let c = pipewright_core::cluster::Cluster::load(path)?;
    pipewright_core::sim::devices_for_plan(plan, &c)
        .map_err(|e| BadInput(format!("{}: {e}", path.display())).into())
}

/// An output path may be missing or a regular file; anything else (a directory, a symlink, a
/// FIFO, a device) is refused rather than replaced by the rename that writes it.
pub fn check_output(path: &Path) -> Result<()> {
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

//! The checkpoint directory: durable writes and verified reads. A checkpoint is a directory
//! `step-NNNNNN` (or `step-NNNNNN.K` when that step was saved before) holding its files and a
//! `manifest.json` with the SHA-256 and size of each. It is written under a temporary name, every
//! file and directory fsynced, renamed into place, and only then does `latest` (replaced by an
//! atomic rename) point at it. Older checkpoints are pruned after that, keeping the newest K,
//! so a crash at any point leaves a complete checkpoint that `latest` or a fallback finds.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

const MANIFEST: &str = "manifest.json";
/// The manifest's own SHA-256, so a flipped byte in the manifest is named as such.
const MANIFEST_SUM: &str = "manifest.sha256";
const LATEST: &str = "latest";
/// The lock file of a checkpoint directory (see [`lock`]).
const LOCK: &str = ".lock";

/// One run's hold on a checkpoint directory: an advisory lock on its `.lock` file, released
/// when this is dropped or the process ends (a killed run leaves no stale lock).
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

/// Take `dir` for this run, or refuse at once, naming the run that holds it: two runs writing
/// one directory would delete each other's checkpoints in progress.
pub fn lock(dir: &Path) -> Result<DirLock> {
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let path = dir.join(LOCK);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| io(&path, e))?;
    if let Err(e) = file.try_lock() {
        let who = lock_holder(&path).unwrap_or_else(|| "another run".into());
        return Err(Error::checkpoint(
            dir,
            format!("in use by {who} ({e}); wait for it to end, or give this run another checkpoint directory"),
        ));
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let me = format!(
        "the run of process {} on host {}",
        std::process::id(),
        host.trim()
    );
    file.set_len(0)
        .and_then(|_| file.write_all(me.as_bytes()))
        .and_then(|_| file.flush())
        .map_err(|e| io(&path, e))?;
    Ok(DirLock { _file: file })
}

/// Who holds the lock file at `path`. A run that has just taken the lock writes its name a
/// moment later, so an empty file is read again for up to a second before giving up.
fn lock_holder(path: &Path) -> Option<String> {
    for _ in 0..100 {
        let holder = std::fs::read_to_string(path).unwrap_or_default();
        if !holder.trim().is_empty() {
            return Some(holder.trim().to_string());
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    None
}

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    step: u64,
    /// Relative path -> (hex SHA-256, bytes).
    files: BTreeMap<String, (String, u64)>,
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn io(p: &Path, e: std::io::Error) -> Error {
    Error::checkpoint(p, e.to_string())
}

/// A write that failed (a full disk, say): the run failed, it was not given bad input.
fn wio(p: &Path, e: std::io::Error) -> Error {
    Error::Io {
        what: format!("{}: cannot write the checkpoint", p.display()),
        err: e,
    }
}

fn fsync_dir(p: &Path) -> Result<()> {
    File::open(p)
        .and_then(|f| f.sync_all())
        .map_err(|e| io(p, e))
}

/// Writes one checkpoint, one file-system operation at a time. `crash_after` stops it after
/// that many operations, as a kill would (for tests that crash between every pair).
pub struct Writer {
    dir: PathBuf,
    tmp: PathBuf,
    step: u64,
    files: BTreeMap<String, (String, u64)>,
    ops: usize,
    crash_after: Option<usize>,
}

/// The error a simulated crash returns.
pub const CRASH: &str = "simulated crash";

impl Writer {
    pub fn begin(dir: &Path, step: u64, crash_after: Option<usize>) -> Result<Writer> {
        let mut w = Writer {
            dir: dir.to_path_buf(),
            tmp: dir.join(format!(".step-{step:06}.partial")),
            step,
            files: BTreeMap::new(),
            ops: 0,
            crash_after,
        };
        w.op()?;
        std::fs::create_dir_all(dir).map_err(|e| wio(dir, e))?;
        // A partial directory is what a crash left behind: never a checkpoint.
        for e in std::fs::read_dir(dir).map_err(|e| wio(dir, e))?.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with(".step-") && name.ends_with(".partial") {
                w.op()?;
                std::fs::remove_dir_all(e.path()).map_err(|x| wio(&e.path(), x))?;
            }
        }
        w.op()?;
        std::fs::create_dir_all(&w.tmp).map_err(|e| wio(&w.tmp, e))?;
        Ok(w)
    }

    fn op(&mut self) -> Result<()> {
        if self.crash_after == Some(self.ops) {
            return Err(Error::checkpoint(&self.dir, CRASH));
        }
        self.ops += 1;
        Ok(())
    }

    /// Write `rel` (a path inside the checkpoint), then fsync it.
    pub fn file(&mut self, rel: &str, bytes: &[u8]) -> Result<()> {
        let p = self.tmp.join(rel);
        if let Some(parent) = p.parent() {
            if !parent.exists() {
                self.op()?;
                std::fs::create_dir_all(parent).map_err(|e| wio(parent, e))?;
            }
        }
        self.op()?;
        let mut f = File::create(&p).map_err(|e| wio(&p, e))?;
        f.write_all(bytes).map_err(|e| wio(&p, e))?;
        self.op()?;
        f.sync_all().map_err(|e| wio(&p, e))?;
        self.files
            .insert(rel.to_string(), (sha256(bytes), bytes.len() as u64));
        Ok(())
    }

    /// Seal the checkpoint: manifest, fsyncs, rename into place, point `latest` at it, prune
    /// to the newest `keep`. Returns the checkpoint's directory.
    pub fn finish(mut self, keep: usize) -> Result<PathBuf> {
        let manifest = Manifest {
            step: self.step,
            files: std::mem::take(&mut self.files),
        };
        let text = serde_json::to_vec_pretty(&manifest).expect("manifest serialises");
        let mp = self.tmp.join(MANIFEST);
        self.op()?;
        let mut f = File::create(&mp).map_err(|e| wio(&mp, e))?;
        f.write_all(&text).map_err(|e| wio(&mp, e))?;
        self.op()?;
        f.sync_all().map_err(|e| wio(&mp, e))?;
        let sp = self.tmp.join(MANIFEST_SUM);
        self.op()?;
        let mut f = File::create(&sp).map_err(|e| wio(&sp, e))?;
        f.write_all(sha256(&text).as_bytes())
            .map_err(|e| wio(&sp, e))?;
        self.op()?;
        f.sync_all().map_err(|e| wio(&sp, e))?;
        let mut dirs: Vec<PathBuf> = manifest
            .files
            .keys()
            .filter_map(|k| Path::new(k).parent().map(|p| self.tmp.join(p)))
            .filter(|p| *p != self.tmp)
            .collect();
        dirs.dedup();
        dirs.push(self.tmp.clone());
        for d in dirs {
            self.op()?;
            fsync_dir(&d)?;
        }
        // A name no complete checkpoint has: the step, or the step and a counter.
        let base = format!("step-{:06}", self.step);
        let name = (0..)
            .map(|k| {
                if k == 0 {
                    base.clone()
                } else {
                    format!("{base}.{k}")
                }
            })
            .find(|n| !self.dir.join(n).exists())
            .expect("a free name");
        let fin = self.dir.join(&name);
        self.op()?;
        std::fs::rename(&self.tmp, &fin).map_err(|e| wio(&fin, e))?;
        self.op()?;
        fsync_dir(&self.dir)?;
        let lt = self.dir.join(".latest.partial");
        self.op()?;
        let mut f = File::create(&lt).map_err(|e| wio(&lt, e))?;
        f.write_all(name.as_bytes()).map_err(|e| wio(&lt, e))?;
        self.op()?;
        f.sync_all().map_err(|e| wio(&lt, e))?;
        self.op()?;
        std::fs::rename(&lt, self.dir.join(LATEST)).map_err(|e| wio(&lt, e))?;
        self.op()?;
        fsync_dir(&self.dir)?;
        // Prune: keep the newest `keep` (the new one among them).
        let all = list(&self.dir);
        let keep = keep.max(1);
        if all.len() > keep {
            for (_, old) in &all[..all.len() - keep] {
                if *old == fin {
                    continue;
                }
                self.op()?;
                std::fs::remove_dir_all(old).map_err(|e| wio(old, e))?;
            }
        }
        Ok(fin)
    }
}

/// A checkpoint left unfinished (its write failed) is removed, not left to fill the disk; a
/// killed process leaves it to the next run's [`Writer::begin`].
impl Drop for Writer {
    fn drop(&mut self) {
        if self.tmp.exists() && self.crash_after.is_none() {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

/// The subdirectory of a checkpoint directory that keeps the best validation's checkpoint
/// (`RunConfig::keep_best`).
pub const BEST_DIR: &str = "best";

/// Remove every checkpoint in `dir` and `latest` (an earlier run's, under this run's lock),
/// and the best validation's in [`BEST_DIR`].
pub fn remove_all(dir: &Path) -> Result<()> {
    for (_, ck) in list(dir) {
        std::fs::remove_dir_all(&ck).map_err(|e| wio(&ck, e))?;
    }
    // The best validation's checkpoint (`--keep-best`) belongs to the same run.
    let best = dir.join(BEST_DIR);
    if best.is_dir() {
        remove_all(&best)?;
        std::fs::remove_dir(&best).map_err(|e| wio(&best, e))?;
    }
    match std::fs::remove_file(dir.join(LATEST)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(wio(&dir.join(LATEST), e)),
        _ => Ok(()),
    }
}

/// Checkpoint directories in `dir`, oldest first, by (step, counter).
pub fn list(dir: &Path) -> Vec<((u64, u64), PathBuf)> {
    let mut out: Vec<((u64, u64), PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let rest = name.strip_prefix("step-")?;
            let (step, k) = match rest.split_once('.') {
                Some((s, k)) => (s.parse().ok()?, k.parse().ok()?),
                None => (rest.parse().ok()?, 0),
            };
            e.path().is_dir().then(|| ((step, k), e.path()))
        })
        .collect();
    out.sort();
    out
}

/// A checkpoint whose every file matches its manifest: the files' bytes by relative path.
pub struct Verified {
    pub path: PathBuf,
    pub step: u64,
    pub files: BTreeMap<String, Vec<u8>>,
}

/// Read `ck` and check every file against the manifest; the error names the file that fails.
/// The bytes of `p` if it is a regular file of at most `max` bytes. A FIFO, a device or a
/// directory is refused without opening it (a read would block or never end), and a file larger
/// than expected without reading it (a crafted size cannot take the memory).
fn read_regular(p: &Path, max: u64) -> Result<Vec<u8>> {
    let m = std::fs::symlink_metadata(p).map_err(|e| io(p, e))?;
    if !m.file_type().is_file() {
        return Err(Error::checkpoint(
            p,
            "is not a regular file (a FIFO, device, link or directory)",
        ));
    }
    pipewright_core::inputs::note_input(p);
    if m.len() > max {
        return Err(Error::checkpoint(
            p,
            format!("holds {} bytes, more than the {max} expected", m.len()),
        ));
    }
    std::fs::read(p).map_err(|e| io(p, e))
}

/// Largest manifest read (a checkpoint's lists its files: a few KiB).
const MANIFEST_MAX: u64 = 16 << 20;

/// Is `name` a checkpoint's own name in its directory (`step-N` or `step-N.K`)?
fn is_checkpoint_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("step-") else {
        return false;
    };
    let (step, k) = rest.split_once('.').unwrap_or((rest, "0"));
    let digits = |x: &str| !x.is_empty() && x.bytes().all(|b| b.is_ascii_digit());
    digits(step) && digits(k)
}

pub fn verify(ck: &Path) -> Result<Verified> {
    let mp = ck.join(MANIFEST);
    let text = read_regular(&mp, MANIFEST_MAX)?;
    let sp = ck.join(MANIFEST_SUM);
    let sum = String::from_utf8_lossy(&read_regular(&sp, 1024)?).into_owned();
    if sum.trim() != sha256(&text) {
        return Err(Error::checkpoint(
            &mp,
            format!("does not match its checksum in {MANIFEST_SUM}: one of the two is corrupt"),
        ));
    }
    let m: Manifest = serde_json::from_slice(&text)
        .map_err(|e| Error::checkpoint(&mp, format!("corrupt manifest: {e}")))?;
    let mut files = BTreeMap::new();
    for (rel, (hash, len)) in &m.files {
        // Files inside the checkpoint only: a crafted `../` cannot read elsewhere.
        let inside = Path::new(rel)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !inside {
            return Err(Error::checkpoint(
                &mp,
                format!("names {rel:?}, outside the checkpoint"),
            ));
        }
        let p = ck.join(rel);
        let bytes = read_regular(&p, *len)?;
        if bytes.len() as u64 != *len || sha256(&bytes) != *hash {
            return Err(Error::checkpoint(
                &p,
                format!(
                    "does not match the manifest (expected {len} bytes with SHA-256 {}..., found {} bytes with {}...): the file is corrupt",
                    hash.chars().take(12).collect::<String>(),
                    bytes.len(),
                    &sha256(&bytes)[..12]
                ),
            ));
        }
        files.insert(rel.clone(), bytes);
    }
    Ok(Verified {
        path: ck.to_path_buf(),
        step: m.step,
        files,
    })
}

/// The checkpoint to resume: the one `latest` names if it verifies, else the newest that
/// does. The second value says why `latest` was passed over, if it was.
pub fn newest_verified(dir: &Path) -> Result<(Verified, Option<String>)> {
    let lp = dir.join(LATEST);
    // `latest` only names a checkpoint of this directory; anything else is passed over.
    let first = match read_regular(&lp, 1024) {
        Ok(bytes) => {
            let name = String::from_utf8_lossy(&bytes).trim().to_string();
            if is_checkpoint_name(&name) {
                let ck = dir.join(&name);
                match verify(&ck) {
                    Ok(v) => return Ok((v, None)),
                    Err(e) => (e.to_string(), Some(ck)),
                }
            } else {
                (
                    format!(
                        "{}: names {name:?}, not a checkpoint of this directory",
                        lp.display()
                    ),
                    None,
                )
            }
        }
        Err(e) => (e.to_string(), None),
    };
    for (_, ck) in list(dir).into_iter().rev() {
        if Some(&ck) == first.1.as_ref() {
            continue;
        }
        if let Ok(v) = verify(&ck) {
            return Ok((v, Some(first.0)));
        }
    }
    Err(Error::checkpoint(
        dir,
        format!("no checkpoint to resume: {}", first.0),
    ))
}

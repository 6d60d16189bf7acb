//! The files a command reads: each is checked to be a regular file before anything opens it
//! (opening a FIFO blocks, reading a device never ends), and remembered, so that no output of
//! the same process replaces one (by device and inode: symlinks and hard links included).

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Every input so far: (device, inode) to the path it was read by. A set, not a list: an image
/// folder notes one input per image.
static READ: Mutex<Option<HashMap<(u64, u64), PathBuf>>> = Mutex::new(None);

/// `path`'s metadata if it is a regular file (symlinks followed), noted as an input; else an
/// error naming it.
pub fn regular_file(path: &Path) -> Result<std::fs::Metadata> {
    let name = || path.display().to_string();
    let m =
        std::fs::metadata(path).map_err(|e| Error::input(name(), format!("cannot read: {e}")))?;
    if !m.is_file() {
        return Err(Error::input(
            name(),
            "cannot read: not a regular file (a directory, FIFO or device)",
        ));
    }
    note(path, &m);
    Ok(m)
}

/// Note `path` (a file or a directory whose files are read) as an input of this process.
pub fn note_input(path: &Path) {
    if let Ok(m) = std::fs::metadata(path) {
        note(path, &m);
    }
}

fn note(path: &Path, m: &std::fs::Metadata) {
    let id = file_id(m);
    let mut read = READ.lock().unwrap_or_else(|e| e.into_inner());
    read.get_or_insert_with(HashMap::new)
        .entry(id)
        .or_insert_with(|| path.to_path_buf());
}

/// The input that `path` is, if it is one: the same file, by any name.
pub fn input_at(path: &Path) -> Option<PathBuf> {
    let id = file_id(&std::fs::metadata(path).ok()?);
    let read = READ.lock().unwrap_or_else(|e| e.into_inner());
    read.as_ref()?.get(&id).cloned()
}

/// Read a file, naming it in the error.
pub fn read_file(path: &std::path::Path) -> Result<String> {
    regular_file(path)?;
    std::fs::read_to_string(path)
        .map_err(|e| Error::input(path.display().to_string(), format!("cannot read: {e}")))
}

#[cfg(unix)]
fn file_id(m: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (m.dev(), m.ino())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_input_is_known_by_every_name_and_fifos_are_refused() {
        let d = std::env::temp_dir().join(format!("pw-inputs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let (f, link, hard, other) = (d.join("m.jsonl"), d.join("ln"), d.join("hard"), d.join("o"));
        std::fs::write(&f, "{}\n").unwrap();
        std::fs::write(&other, "").unwrap();
        std::os::unix::fs::symlink(&f, &link).unwrap();
        std::fs::hard_link(&f, &hard).unwrap();
        assert_eq!(input_at(&f), None);
        regular_file(&f).unwrap();
        for p in [&f, &link, &hard] {
            assert_eq!(input_at(p).as_deref(), Some(f.as_path()), "{}", p.display());
        }
        assert_eq!(input_at(&other), None);
        assert_eq!(input_at(&d.join("missing")), None);
        let fifo = d.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc_mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = regular_file(&fifo).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
        let err = regular_file(&d).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
        let _ = std::fs::remove_dir_all(&d);
    }

    extern "C" {
        #[link_name = "mkfifo"]
        fn libc_mkfifo(path: *const std::os::raw::c_char, mode: u32) -> i32;
    }
}

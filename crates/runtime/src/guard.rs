//! Third-party file readers (Parquet, images, safetensors) behind one boundary: a panic inside
//! one on a malformed file becomes an error naming the file, and its message is capped, as a
//! reader's own messages can quote the whole bad value.

use std::cell::Cell;
use std::path::Path;

thread_local! {
    /// Inside [`reader`]: the panic is turned into an error, not printed.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Characters of a reader's message kept in an error line.
pub const MESSAGE_CHARS: usize = 240;

/// `text` cut to `max` characters, saying how much was cut.
pub fn capped(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_string(),
        Some((at, _)) => format!(
            "{}... ({} more characters)",
            &text[..at],
            text[at..].chars().count()
        ),
    }
}

/// Run `read` (a third-party reader on `file`); a panic in it becomes an error naming the
/// file and `what` it was read as, and an error whose message is too long becomes one with a
/// capped message (a shorter one is returned as it is, keeping its type).
pub fn reader<T, E>(file: &Path, what: &str, read: impl FnOnce() -> Result<T, E>) -> Result<T, E>
where
    E: From<String> + std::fmt::Display,
{
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info)
            }
        }));
    });
    let was = QUIET.with(|q| q.replace(true));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(read));
    QUIET.with(|q| q.set(was));
    match out {
        Ok(r) => r.map_err(|e| {
            let max = MESSAGE_CHARS + 2 * file.as_os_str().len();
            let text = e.to_string();
            match text.chars().count() > max {
                true => E::from(capped(&text, max)),
                false => e,
            }
        }),
        Err(payload) => {
            let why = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(E::from(format!(
                "{}: not a {what} that reads: its reader failed ({})",
                file.display(),
                capped(&why, MESSAGE_CHARS)
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_error_naming_the_file_and_long_messages_are_capped() {
        let f = Path::new("/data/x.parquet");
        let e = reader(f, "Parquet file", || -> Result<(), String> {
            panic!("called `Option::unwrap()` on a `None` value")
        })
        .unwrap_err();
        assert_eq!(
            e,
            "/data/x.parquet: not a Parquet file that reads: its reader failed (called `Option::unwrap()` on a `None` value)"
        );
        let long = "x".repeat(46_000);
        let e = reader(f, "Parquet file", || -> Result<(), String> {
            Err(long.clone())
        })
        .unwrap_err();
        assert!(e.len() < 400 && e.ends_with("more characters)"), "{e}");
        assert_eq!(reader(f, "Parquet file", || Ok::<_, String>(3)), Ok(3));
        assert_eq!(capped("héllo", 2), "hé... (3 more characters)");
    }
}

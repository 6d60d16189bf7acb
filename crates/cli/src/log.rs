//! Log lines for runs without a terminal (nohup, Slurm, CI): what the progress bar shows, as a
//! timestamped line every few steps.

use pipewright_runtime::train::StepRow;
use std::time::{SystemTime, UNIX_EPOCH};

/// `YYYY-MM-DD HH:MM:SS` in UTC for `secs` since the Unix epoch.
pub fn utc(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Now, as [`utc`] writes it.
pub fn now() -> String {
    utc(SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()))
}

/// This process's resident memory in bytes (Linux), if known.
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Print `line` and its newline to stderr in one write: stderr is unbuffered, so `eprintln!`
/// writes the text and the newline apart, and under mpirun, which forwards a rank's stdout and
/// stderr separately, a stdout line could land between them ("memory 340 MBval loss ...").
pub fn eprint_line(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// One step's line: step, loss, validation loss, learning rate, throughput, gradient norm and
/// memory, after a timestamp.
pub fn step_line(row: &StepRow) -> String {
    let r = row.report;
    let val = row
        .val_loss
        .map_or(String::new(), |v| format!(" val {v:.4}"));
    let val = match (row.accuracy, row.f1) {
        (Some(em), Some(f1)) => format!("{val} exact match {em:.3} F1 {f1:.3}"),
        (Some(a), None) => format!("{val} accuracy {a:.3}"),
        _ => val,
    };
    let mem = resident_bytes().map_or(String::new(), |b| {
        format!(" memory {:.0} MB", b as f64 / 1e6)
    });
    let mfu = row
        .mfu
        .map_or(String::new(), |m| format!(" MFU {:.1}%", 100.0 * m));
    format!(
        "{} step {}/{} loss {:.4}{val} lr {:.2e} tokens/s {:.0}{mfu} grad norm {:.3}{mem}",
        now(),
        r.step,
        row.steps,
        r.loss,
        r.lr,
        row.tokens_per_s(),
        r.grad_norm
    )
}

#[cfg(test)]
mod tests {
    use super::utc;

    #[test]
    fn timestamps_are_civil_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00:00");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(utc(1_796_477_045), "2026-12-05 13:24:05");
    }
}

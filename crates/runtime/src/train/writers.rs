//! Metrics writers a run reports to, for the CLI and library users alike: JSON lines (the
//! run's starting point, then a row per step) and TensorBoard event files. Each is a
//! [`RunSink`]; [`Fanout`] reports to several.

use super::run::{RunSink, RunStart, StepRow};
use super::tensorboard::EventFile;
use crate::error::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The run's metrics as JSON lines at `path`: a resumed run continues the file from its step.
pub struct MetricsFile {
    path: PathBuf,
    file: Option<std::io::BufWriter<std::fs::File>>,
}

impl MetricsFile {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        MetricsFile {
            path: path.into(),
            file: None,
        }
    }

    fn error(&self, err: std::io::Error) -> Error {
        cannot_write(&self.path, err)
    }

    fn write(&mut self, row: &serde_json::Value) -> Result<()> {
        let Some(f) = self.file.as_mut() else {
            return Ok(());
        };
        let r = writeln!(f, "{row}").and_then(|_| f.flush());
        r.map_err(|e| self.error(e))
    }
}

fn cannot_write(path: &Path, err: std::io::Error) -> Error {
    Error::Io {
        what: format!("cannot write {}", path.display()),
        err,
    }
}

impl RunSink for MetricsFile {
    fn start(&mut self, s: &RunStart) -> Result<()> {
        if let Some(step) = s.resumed {
            cut_metrics(&self.path, step).map_err(|e| self.error(e))?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(s.resumed.is_some())
            .truncate(s.resumed.is_none())
            .open(&self.path)
            .map_err(|e| self.error(e))?;
        self.file = Some(std::io::BufWriter::new(file));
        match s.resumed {
            None => self.write(&s.to_json()),
            Some(_) => Ok(()),
        }
    }

    fn step(&mut self, row: &StepRow) -> Result<()> {
        self.write(&row.to_json())
    }
}

/// A resumed run continues the metrics file from the resumed step: rows of later steps (from
/// the run that was cut short) are dropped, so no step appears twice.
fn cut_metrics(f: &Path, step: u64) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(f) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                .is_some_and(|s| s <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let tmp = f.with_extension("tmp~");
    std::fs::write(&tmp, kept).and_then(|_| std::fs::rename(&tmp, f))
}

/// The run's metrics as a new TensorBoard event file in `dir` (`tensorboard --logdir DIR`).
pub struct TensorBoard {
    dir: PathBuf,
    file: Option<EventFile>,
}

impl TensorBoard {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        TensorBoard {
            dir: dir.into(),
            file: None,
        }
    }

    fn write(&mut self, row: &serde_json::Value) -> Result<()> {
        let Some(f) = self.file.as_mut() else {
            return Ok(());
        };
        f.write_row(row).map_err(|e| cannot_write(f.path(), e))
    }
}

impl RunSink for TensorBoard {
    fn start(&mut self, s: &RunStart) -> Result<()> {
        let f = EventFile::create(&self.dir).map_err(|e| cannot_write(&self.dir, e))?;
        self.file = Some(f);
        match s.resumed {
            None => self.write(&s.to_json()),
            Some(_) => Ok(()),
        }
    }

    fn step(&mut self, row: &StepRow) -> Result<()> {
        self.write(&row.to_json())
    }
}

/// Reports to every sink in turn.
#[derive(Default)]
pub struct Fanout(pub Vec<Box<dyn RunSink>>);

impl RunSink for Fanout {
    fn start(&mut self, s: &RunStart) -> Result<()> {
        self.0.iter_mut().try_for_each(|k| k.start(s))
    }

    fn note(&mut self, text: &str) {
        self.0.iter_mut().for_each(|k| k.note(text))
    }

    fn step(&mut self, row: &StepRow) -> Result<()> {
        self.0.iter_mut().try_for_each(|k| k.step(row))
    }
}

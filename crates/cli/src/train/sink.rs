//! The CLI's run sink: the log on stderr, a progress bar on a terminal, the metrics and
//! TensorBoard files.

use super::args::TrainArgs;
use pipewright_runtime::train::{RunSink, RunStart, StepRow};
use std::path::{Path, PathBuf};

/// The CLI's sink: the log on stderr, a progress bar on a terminal, and the metrics file.
pub(super) struct Progress {
    bar: indicatif::ProgressBar,
    metrics_path: Option<PathBuf>,
    metrics: Option<std::io::BufWriter<std::fs::File>>,
    /// `--tensorboard`'s directory (the root only), and its event file once the run starts.
    tensorboard_dir: Option<PathBuf>,
    tensorboard: Option<crate::tensorboard::EventFile>,
    /// Log lines every this many steps, when stderr is no terminal (the root only).
    log_every: Option<u64>,
    /// How the workers run: the processes' placement (the root of an MPI job), or who splits
    /// the products of in-process workers.
    pub(super) placement: Option<String>,
    /// How the plan was made, where a search made it (the root only).
    pub(super) plan_note: Option<String>,
}

impl Progress {
    pub(super) fn new(a: &TrainArgs, root: bool) -> Self {
        use std::io::IsTerminal;
        // A rank pipewright started writes to mpirun, which passes its bytes on to the
        // terminal the command was run from: it draws the bar there as that command would.
        let terminal = std::io::stderr().is_terminal() || crate::launch::on_terminal();
        let bar = match (root, terminal) {
            (false, _) => indicatif::ProgressBar::hidden(),
            (true, true) if !std::io::stderr().is_terminal() => {
                indicatif::ProgressBar::with_draw_target(
                    Some(0),
                    indicatif::ProgressDrawTarget::term_like(Box::new(console::Term::stderr())),
                )
            }
            (true, _) => indicatif::ProgressBar::new(0),
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} ETA {eta}")
                .expect("template"),
        );
        Progress {
            bar,
            metrics_path: a.metrics.clone().filter(|_| root),
            metrics: None,
            tensorboard_dir: a.tensorboard.clone().filter(|_| root),
            tensorboard: None,
            log_every: (root && !terminal).then_some(a.log_every),
            placement: None,
            plan_note: None,
        }
    }

    fn emit(&mut self, row: serde_json::Value) -> pipewright_runtime::error::Result<()> {
        if let Some(m) = self.metrics.as_mut() {
            use std::io::Write;
            writeln!(m, "{row}")
                .and_then(|_| m.flush())
                .map_err(|e| self.metrics_error(e))?;
        }
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.write_row(&row).map_err(|e| tb_error(tb.path(), e))?;
        }
        Ok(())
    }

    fn metrics_error(&self, e: std::io::Error) -> pipewright_runtime::error::Error {
        let path = self.metrics_path.as_ref().expect("metrics open");
        pipewright_runtime::error::Error::Io {
            what: format!("cannot write {}", path.display()),
            err: e,
        }
    }
}

/// A TensorBoard event file that cannot be written, named.
fn tb_error(path: &Path, err: std::io::Error) -> pipewright_runtime::error::Error {
    pipewright_runtime::error::Error::Io {
        what: format!("cannot write {}", path.display()),
        err,
    }
}

impl RunSink for Progress {
    fn start(&mut self, s: &RunStart) -> pipewright_runtime::error::Result<()> {
        eprintln!("{}", s.header);
        for line in [&self.plan_note, &self.placement].into_iter().flatten() {
            eprintln!("{line}");
        }
        if let Some(f) = self.metrics_path.clone() {
            if let Some(step) = s.resumed {
                // A resumed run continues the same metrics file from its step.
                cut_metrics(&f, step).map_err(|e| self.metrics_error(e))?;
            }
            let file = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(s.resumed.is_some())
                .truncate(s.resumed.is_none())
                .open(&f);
            self.metrics = Some(std::io::BufWriter::new(
                file.map_err(|e| self.metrics_error(e))?,
            ));
        }
        if let Some(d) = &self.tensorboard_dir {
            let f = crate::tensorboard::EventFile::create(d).map_err(|e| tb_error(d, e))?;
            self.tensorboard = Some(f);
        }
        if s.resumed.is_none() {
            self.emit(s.to_json())?;
        }
        self.bar.set_length(s.steps);
        self.bar.set_position(s.step);
        Ok(())
    }

    fn note(&mut self, text: &str) {
        // A finished bar stays as it is: suspending it would draw it again below the note.
        match self.bar.is_finished() {
            true => eprintln!("{text}"),
            false => self.bar.suspend(|| eprintln!("{text}")),
        }
    }

    fn step(&mut self, row: &StepRow) -> pipewright_runtime::error::Result<()> {
        self.emit(row.to_json())?;
        let acc = row
            .last_accuracy
            .map_or(String::new(), |a| format!(" acc {a:.3}"));
        self.bar.set_message(format!(
            "loss {:.3} val {:.3}{acc} {:.0} tok/s",
            row.report.loss,
            row.last_val,
            row.tokens_per_s()
        ));
        self.bar.inc(1);
        if row.report.step == row.steps {
            self.bar.finish();
            // The bar leaves the cursor at its line's end: what follows starts a line of its own.
            if !self.bar.is_hidden() {
                eprintln!();
            }
        }
        let step = row.report.step;
        if self
            .log_every
            .is_some_and(|n| step.is_multiple_of(n) || step == row.steps)
        {
            crate::log::eprint_line(&crate::log::step_line(row));
        }
        Ok(())
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

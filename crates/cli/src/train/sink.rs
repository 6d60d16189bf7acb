//! The CLI's run sink: the log on stderr, a progress bar on a terminal, the metrics and
//! TensorBoard files.

use super::args::TrainArgs;
use pipewright_runtime::train::{Fanout, MetricsFile, RunSink, RunStart, StepRow, TensorBoard};

/// The CLI's sink: the log on stderr, a progress bar on a terminal, and the metrics writers
/// the flags ask for (the runtime's, which a library user plugs in the same way).
/// The progress bar's look once steps are running.
const BAR: &str = "{bar:30} {pos}/{len} {msg} ETA {eta}";

pub(super) struct Progress {
    bar: indicatif::ProgressBar,
    /// `--metrics` and `--tensorboard` (the root only).
    files: Fanout,
    /// Log lines every this many steps, when stderr is no terminal (the root only).
    log_every: Option<u64>,
    /// How the workers run: the processes' placement (the root of an MPI job), or who splits
    /// the products of in-process workers.
    pub(super) placement: Option<String>,
    /// How the plan was made, where a search made it (the root only).
    pub(super) plan_note: Option<String>,
    /// What the first step does besides training, shown with a spinner until it ends (a GPU
    /// compiling its shaders: a minute or more of nothing otherwise).
    pub(super) first_step: Option<String>,
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
        bar.set_style(indicatif::ProgressStyle::with_template(BAR).expect("template"));
        let mut files = Fanout::default();
        if root {
            if let Some(f) = &a.run.metrics {
                files.0.push(Box::new(MetricsFile::new(f)));
            }
            if let Some(d) = &a.run.tensorboard {
                files.0.push(Box::new(TensorBoard::new(d)));
            }
        }
        Progress {
            bar,
            files,
            log_every: (root && !terminal).then_some(a.run.log_every),
            placement: None,
            plan_note: None,
            first_step: None,
        }
    }
}

impl RunSink for Progress {
    fn start(&mut self, s: &RunStart) -> pipewright_runtime::error::Result<()> {
        eprintln!("{}", s.header);
        for line in [&self.plan_note, &self.placement].into_iter().flatten() {
            eprintln!("{line}");
        }
        self.files.start(s)?;
        self.bar.set_length(s.steps);
        self.bar.set_position(s.step);
        if let Some(what) = &self.first_step {
            self.bar.set_style(
                indicatif::ProgressStyle::with_template("{spinner} {pos}/{len} {msg} {elapsed}")
                    .expect("template"),
            );
            self.bar.set_message(what.clone());
            self.bar
                .enable_steady_tick(std::time::Duration::from_millis(200));
        }
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
        self.files.step(row)?;
        if self.first_step.take().is_some() {
            self.bar.disable_steady_tick();
            self.bar
                .set_style(indicatif::ProgressStyle::with_template(BAR).expect("template"));
        }
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

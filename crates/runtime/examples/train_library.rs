//! Train a 2-stage 1F1B pipeline through the library, reporting to a sink of our own.
use pipewright_runtime::data::Corpus;
use pipewright_runtime::error::Result;
use pipewright_runtime::train::{RunConfig, RunSink, StepRow, TrainConfig, Trainer, TrainingRun};

/// Prints the log and one line per step.
struct Print;

impl RunSink for Print {
    fn note(&mut self, text: &str) {
        eprintln!("{text}");
    }
    fn step(&mut self, row: &StepRow) -> Result<()> {
        let (r, tps) = (row.report, row.tokens_per_s());
        println!("step {:>2}: loss {:.3}, {tps:.0} tokens/s", r.step, r.loss);
        Ok(())
    }
}

fn main() -> Result<()> {
    // The default GPT on 2 stages, 1F1B, 4 micro-batches.
    let cfg = TrainConfig {
        steps: 10,
        ..TrainConfig::default()
    };
    let plan = cfg.plan()?;
    let trainer = Trainer::new(cfg, plan)?;
    let settings = RunConfig {
        eval_every: 5,
        ..RunConfig::default()
    };
    let mut run = TrainingRun::new(trainer, Corpus::builtin(), settings)?;
    let s = run.run(&mut Print)?;
    println!(
        "val loss {:.3} -> {:.3} after {} steps",
        s.first_val, s.last_val, s.step
    );
    Ok(())
}

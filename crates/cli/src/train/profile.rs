//! `profile`: measure the model's layers, op by op if asked.

use crate::files::write_file;
use crate::BadInput;
use anyhow::Result;
use clap::Args;
use pipewright_runtime::model::ModelConfig;
use pipewright_runtime::train::TrainConfig;
use std::path::PathBuf;

#[derive(Args)]
pub struct ProfileArgs {
    /// The model to measure (default: the train default).
    #[command(flatten)]
    model: crate::model::ModelArgs,
    /// Sequence length (default: the model's).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 4)]
    rows: usize,
    /// Timed repetitions per layer (median).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Output file.
    #[arg(long, default_value = "profile.toml")]
    out: PathBuf,
    /// Instead of a profile, print where a transformer block's time goes: each op alone,
    /// forward and forward + backward, beside the whole block.
    #[arg(long)]
    ops: bool,
}

/// The model `profile` (and `plan --model`) measures: the flags' model at `seq_len`, checked
/// with the same limits as training it in micro-batches of `rows`.
pub fn model_to_measure(
    m: &crate::model::ModelArgs,
    seq_len: Option<usize>,
    rows: usize,
    repeats: usize,
) -> Result<ModelConfig> {
    let mut model = m.resolve()?.map_or_else(ModelConfig::default, |c| c.config);
    if let Some(t) = seq_len {
        model.seq_len = t;
    }
    model = with_a_head(model);
    model.check()?;
    if rows == 0 || repeats == 0 || repeats > 1000 {
        return Err(BadInput(format!(
            "--rows must be at least 1 and --repeats between 1 and 1000 (got {rows} and {repeats})"
        ))
        .into());
    }
    TrainConfig {
        model: model.clone(),
        rows,
        ..TrainConfig::default()
    }
    .check()
    .map_err(|e| BadInput(format!("--rows {rows}: {e}")))?;
    Ok(model)
}

/// A bare encoder (a `BertModel` or `ViTModel` directory) has no head until a task gives it
/// one: it is measured with a 2-class classifier, whose cost is small beside the blocks'.
fn with_a_head(model: ModelConfig) -> ModelConfig {
    use pipewright_runtime::model::{registry, TaskHead};
    if model.head.is_some() || !registry::spec(model.family).task_only {
        return model;
    }
    eprintln!(
        "a bare {} encoder: measured with a 2-class classification head (fine-tuning gives it its task's)",
        model.family.name()
    );
    model.with_head(Some(TaskHead::Classify { classes: 2 }))
}

pub fn cmd_profile(a: ProfileArgs) -> Result<()> {
    let model = model_to_measure(&a.model, a.seq_len, a.rows, a.repeats)?;
    if a.ops {
        use pipewright_runtime::model::Family;
        if !matches!(model.family, Family::Gpt | Family::Llama) {
            return Err(BadInput(format!(
                "--ops breaks down the gpt and llama families' blocks; a {} block is measured whole by profile without --ops",
                model.family.name()
            ))
            .into());
        }
        print_ops(&model, a.rows, a.repeats);
        return Ok(());
    }
    let prof = pipewright_runtime::profile::profile_model(&model, a.rows, a.repeats, 42);
    write_file(&a.out, &prof.to_toml())?;
    println!("{}", profile_summary(&prof, a.rows));
    Ok(())
}

/// A measured profile in one line: its layer blocks and their summed times.
pub fn profile_summary(prof: &pipewright_core::profile::Profile, rows: usize) -> String {
    let (f, b): (f64, f64) = prof
        .layers
        .iter()
        .fold((0.0, 0.0), |(f, b), l| (f + l.forward, b + l.backward()));
    format!(
        "{} layer blocks; forward {f:.4} s, backward {b:.4} s per micro-batch of {rows} sequences",
        prof.layers.len()
    )
}

/// `profile --ops`: where a transformer block's time goes, op by op, beside the whole block
/// and the alternatives measured but not used.
fn print_ops(model: &ModelConfig, rows: usize, repeats: usize) {
    use pipewright_runtime::profile;
    let ops = match model.family {
        pipewright_runtime::model::Family::Llama => {
            profile::llama::op_breakdown(model, rows, repeats)
        }
        _ => profile::op_breakdown(model, rows, repeats),
    };
    let parts = &ops.ops;
    let sum = parts.iter().fold((0.0, 0.0), |(f, b), o| {
        (f + o.forward, b + o.forward_backward)
    });
    println!(
        "one transformer block (d_model {}, {} heads, seq {}), micro-batch of {} sequences; median of {}:",
        model.d_model, model.heads, model.seq_len, rows, repeats
    );
    println!(
        "{:<38} {:>5} {:>12} {:>14} {:>7}",
        "op (timed alone)", "times", "forward ms", "fwd + bwd ms", "share"
    );
    let row = |name: &str, count: String, f: f64, b: f64| {
        println!(
            "{name:<38} {count:>5} {:>12.3} {:>14.3} {:>6.1}%",
            f * 1e3,
            b * 1e3,
            100.0 * b / sum.1
        )
    };
    for o in parts {
        row(o.name, o.count.to_string(), o.forward, o.forward_backward);
    }
    row("sum of the ops", String::new(), sum.0, sum.1);
    let w = &ops.whole;
    row(
        "whole block, run as one",
        String::new(),
        w.forward,
        w.forward_backward,
    );
    println!(
        "alternatives (measured, not used), beside the fwd + bwd time of what they would replace:"
    );
    for alt in &ops.alternatives {
        let replaced: f64 = alt
            .replaces
            .iter()
            .filter_map(|(name, part)| {
                parts
                    .iter()
                    .find(|o| o.name == *name)
                    .map(|o| o.forward_backward * part)
            })
            .sum();
        let what: Vec<String> = alt
            .replaces
            .iter()
            .map(|(name, part)| {
                if *part < 1.0 {
                    format!("{:.2} of {name}", part)
                } else {
                    name.to_string()
                }
            })
            .collect();
        println!(
            "{:<38} {:>5} {:>12.3} {:>14.3}  vs {:.3} ms ({}): {:.2}x",
            alt.op.name,
            "",
            alt.op.forward * 1e3,
            alt.op.forward_backward * 1e3,
            replaced * 1e3,
            what.join(" + "),
            alt.op.forward_backward / replaced
        );
    }
}

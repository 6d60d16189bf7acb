//! Errors as the user sees them: which are bad input (exit 2) and which are failures (exit 1).

/// Errors that are the user's input: exit 2.
#[derive(Debug)]
pub struct BadInput(pub String);
impl std::fmt::Display for BadInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for BadInput {}

use pipewright_core::error::Field;
use pipewright_core::Error as CoreError;
use pipewright_runtime::data::{Error as DataError, Field as DataField};
use pipewright_runtime::error::Error as RunError;
use pipewright_runtime::model::error::Error as ModelError;

/// How a command names the parts of a job's shape on its command line.
#[derive(Clone, Copy)]
pub enum Flags {
    /// `schedule`, `simulate`, `train`, `partition`, `skip-plan`: --stages, --chunks,
    /// --replicas, ...
    Pipeline,
    /// `plan`: `--global-batch`.
    Planner,
    /// `elastic-sim`: replicas are `--pipelines`.
    ElasticSim,
    /// Commands whose flags name no part of a shape.
    None,
}

impl Flags {
    fn flag(self, field: Field) -> Option<&'static str> {
        Some(match (self, field) {
            (Flags::None, _) => return None,
            (Flags::ElasticSim, Field::Replicas) => "--pipelines",
            (_, Field::Depth) => "--stages",
            (_, Field::Chunks) => "--chunks",
            (_, Field::Replicas) => "--replicas",
            (_, Field::Microbatches) => "--microbatches",
            (_, Field::Skip) => "--skip",
            (_, Field::GlobalBatch) => "--global-batch",
        })
    }
}

/// The core error inside `e`, if it is one (directly or as the runtime carries it).
fn core_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a CoreError> {
    e.downcast_ref::<CoreError>()
        .or(match e.downcast_ref::<RunError>() {
            Some(RunError::Core(c)) => Some(c),
            _ => None,
        })
}

/// The data error inside `e`, if it is one (directly or as the runtime carries it).
fn data_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a DataError> {
    e.downcast_ref::<DataError>()
        .or(match e.downcast_ref::<RunError>() {
            Some(RunError::Data(d)) => Some(d),
            _ => None,
        })
}

/// The flag that sets a data field (every command that reads data spells them alike).
fn data_flag(field: DataField) -> &'static str {
    match field {
        DataField::Data => "--data",
        DataField::ValData => "--val-data",
        DataField::ValFraction => "--val-fraction",
        DataField::Task => "--task",
        DataField::TextField => "--text-field",
        DataField::LabelField => "--label-field",
        DataField::ShardTokens => "--shard-tokens",
    }
}

/// One link of an error chain as the user reads it: a shape or data setting error names this
/// command's flag.
fn link_text(e: &(dyn std::error::Error + 'static), flags: Flags) -> String {
    match data_error(e) {
        Some(DataError::Setting { field, value, msg }) => {
            return format!("{} {value}: {msg}", data_flag(*field))
        }
        Some(d @ DataError::NoField { field, .. }) => {
            return format!("{d} (choose it with {})", data_flag(*field))
        }
        _ => {}
    }
    if let Some(RunError::EarlierRun { dir, step }) = e.downcast_ref::<RunError>() {
        return format!(
            "{}: holds an earlier run's checkpoints (the newest at step {step}); --resume continues that run, --overwrite replaces its checkpoints, or choose another directory",
            dir.display()
        );
    }
    match core_error(e) {
        Some(CoreError::Shape { field, value, msg }) => match flags.flag(*field) {
            Some(flag) => format!("{flag} {value}: {msg}"),
            None => e.to_string(),
        },
        _ => e.to_string(),
    }
}

/// Characters of one link of an error chain in the line a user reads: a library's message
/// may quote a whole bad value (46,000 characters of a non-UTF-8 Parquet string).
const LINK_CHARS: usize = 600;

/// The whole error as one line.
pub fn message(e: &anyhow::Error, flags: Flags) -> String {
    let links: Vec<String> = e
        .chain()
        .map(|c| pipewright_runtime::guard::capped(&link_text(c, flags), LINK_CHARS))
        .collect();
    links.join(": ")
}

/// Exit 2 for input the user can fix (flags, files, plans, checkpoints), 1 for failures
/// (a worker or peer failed, an internal fault, a write that failed).
pub fn exit_code(e: &anyhow::Error) -> i32 {
    let internal = e.chain().any(|c| {
        matches!(core_error(c), Some(CoreError::Internal(_)))
            || matches!(data_error(c), Some(DataError::Internal(_)))
    });
    let bad = e.chain().any(|c| {
        c.is::<BadInput>()
            || core_error(c).is_some()
            || data_error(c).is_some()
            || c.is::<ModelError>()
            || matches!(c.downcast_ref::<RunError>(), Some(RunError::Model(_)))
            || matches!(
                c.downcast_ref::<RunError>(),
                Some(
                    RunError::Config(_) | RunError::Checkpoint { .. } | RunError::EarlierRun { .. }
                )
            )
    });
    if bad && !internal {
        2
    } else {
        1
    }
}

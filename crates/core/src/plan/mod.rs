//! The plan IR and its rules: what every worker does, in order (`ir`), which schedule made it
//! (`kind`), the checks every plan passes before anything runs it (`validate`), its files
//! (`files`: JSON and CSV), and the per-rank action CSV of `torch.distributed.pipelining`
//! (`torch_csv`).

pub mod deps;
mod files;
pub mod ir;
pub mod kind;
pub mod torch_csv;
pub mod validate;

pub use kind::ScheduleKind;

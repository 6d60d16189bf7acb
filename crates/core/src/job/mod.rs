//! From intent to plan: a job spec (schedule, pipeline shape, how layers are cut, skip routes)
//! becomes a validated whole-job plan in one function (`spec`); the planner searches specs.

pub mod planner;
pub mod spec;

pub use spec::{build, build_skip, JobSpec, LayerCut, PipelineShape, Routes, SkipRoutes};

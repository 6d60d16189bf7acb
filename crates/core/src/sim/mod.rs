//! The discrete-event simulator (`engine`) and the timelines it and the runtime draw
//! (`timeline`: Chrome trace, SVG, text), and list scheduling of routes in simulated time
//! (`dispatch`), and SkipPipe's own cost model (`slotted`). What a simulation is given
//! (`setup`) is shared by the engine and `dispatch`, which the engine calls.

pub mod dispatch;
mod engine;
mod setup;
pub mod slotted;
pub mod timeline;

pub use engine::*;
pub use setup::{Dispatch, SimOptions, SimSetup};

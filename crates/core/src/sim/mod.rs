//! The discrete-event simulator (`engine`) and the timelines it and the runtime draw
//! (`timeline`: Chrome trace, SVG, text), and list scheduling of routes in simulated time
//! (`dispatch`), and SkipPipe's own cost model (`slotted`).

pub mod dispatch;
mod engine;
pub mod slotted;
pub mod timeline;

pub use engine::*;

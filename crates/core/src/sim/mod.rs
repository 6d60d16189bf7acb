//! The discrete-event simulator (`engine`) and the timelines it and the runtime draw
//! (`timeline`: Chrome trace, SVG, text).

mod engine;
pub mod timeline;

pub use engine::*;

//! Decisions taken during training: which layers freeze (`freeze`, PipeTransformer's
//! AutoFreeze) and the layout that fits the layers still training (`elastic`: AutoPipe, AutoDP).

pub mod critical;
pub mod elastic;
pub mod freeze;

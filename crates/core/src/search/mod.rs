//! Searches below a whole job: cutting layers into stages (`partition`), zero-bubble orders for
//! real costs (`zbauto`), and SkipPipe's rules (`skip`) and routes (`skipplan`).

pub mod partition;
pub mod skip;
pub mod skipplan;
pub mod zbauto;

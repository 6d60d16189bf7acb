//! What the CLI test suites share.

/// Model flags of a tiny model that trains in moments.
pub const TINY: [&str; 8] = [
    "--d-model",
    "16",
    "--heads",
    "2",
    "--layers",
    "2",
    "--seq-len",
    "16",
];

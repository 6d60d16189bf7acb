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

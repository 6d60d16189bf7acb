//! The machine the kernels run on, set up once per process: which BLAS library runs the
//! products (the system OpenBLAS, or MKL where it wins) and with which kernels for this CPU,
//! the cores a worker process may lend to a peer on the same machine, and the environment
//! switches that turn these choices off. `kernels/` holds the maths and asks here.

pub mod blas_lib;
pub mod coretype;
pub mod lend;

/// A 0/1 switch in the environment (`PIPEWRIGHT_LEND`, `PIPEWRIGHT_SPLIT`): whether it is on
/// (only `0` turns it off), and for a value that is neither 0 nor 1 the start of a note saying
/// so, to which the caller adds what still happens.
pub fn env_switch(var: &str) -> (bool, Option<String>) {
    match std::env::var(var).as_deref().map(str::trim) {
        Ok("0") => (false, None),
        Err(_) | Ok("1" | "") => (true, None),
        Ok(v) => (
            true,
            Some(format!("note: {var}={v:?} is neither 0 (off) nor 1 (on)")),
        ),
    }
}

//! The one place that picks the tensor backend. A GPU backend is a different constructor here.
//! The crate enables burn's `x86-v4` feature: flex's GEMM then carries AVX-512 kernels, chosen
//! at run time where the CPU has them (1-stage training of examples/gpt_bench.toml 1.16x faster
//! on this project's AVX-512 machines; CPUs without it keep the AVX2 kernels).

use burn::tensor::Device;

/// Device for training: burn's pure-Rust CPU backend (`flex`) with autodiff.
pub fn train_device() -> Device {
    Device::flex().autodiff()
}

/// The same device without autodiff: gradients and received activations live here.
pub fn plain_device() -> Device {
    Device::flex()
}

/// burn 0.22.1's autodiff keeps one process-wide graph locator; a backward in one thread and a
/// forward registering steps in another can take its two locks in opposite orders and deadlock
/// (seen as `GraphCleaner::init` vs `GraphLocator::select`). Until that is fixed upstream,
/// in-process workers hold this lock while they run autodiff work: waiting for messages stays
/// concurrent, compute is serialised (each op still uses all cores). Worker processes (MPI)
/// do not need it.
pub fn autodiff_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

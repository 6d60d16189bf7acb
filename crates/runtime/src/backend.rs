//! The one place that picks the tensor backend. A GPU backend is a different constructor here.

use burn::tensor::Device;

/// Device for training: burn's pure-Rust CPU backend (`flex`) with autodiff.
pub fn train_device() -> Device {
    Device::flex().autodiff()
}

/// The same device without autodiff: gradients and received activations live here.
pub fn plain_device() -> Device {
    Device::flex()
}

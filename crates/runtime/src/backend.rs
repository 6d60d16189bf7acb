//! The one place that picks the tensor backend: the CPU (flex) or wgpu (`--device`).
//! The crate enables burn's `x86-v4` feature: flex's GEMM then carries AVX-512 kernels, chosen
//! at run time where the CPU has them (1-stage training of examples/gpt_bench.toml 1.16x faster
//! on this project's AVX-512 machines; CPUs without it keep the AVX2 kernels).

use burn::backend::DispatchDevice;
use burn::tensor::{Device, DeviceKind};
use std::sync::OnceLock;

/// Where the model's tensors live and its operations run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceChoice {
    /// burn's pure-Rust CPU backend (`flex`) with this project's fused kernels (BLAS products,
    /// causal attention, norms).
    #[default]
    Cpu,
    /// burn's wgpu backend: a GPU through Vulkan (or Metal), or a software Vulkan device such
    /// as Mesa's lavapipe. burn's own operations; the fused CPU kernels do not run there.
    /// `Some(i)`: the machine's i-th discrete GPU; `None`: wgpu's default device (the most
    /// powerful it finds, or `CUBECL_WGPU_DEFAULT_DEVICE`).
    Wgpu(Option<usize>),
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceChoice::Cpu => write!(f, "cpu"),
            DeviceChoice::Wgpu(None) => write!(f, "wgpu (its default device)"),
            DeviceChoice::Wgpu(Some(i)) => write!(f, "wgpu (discrete GPU {i})"),
        }
    }
}

static CHOICE: OnceLock<DeviceChoice> = OnceLock::new();

/// A device that cannot be chosen, started or finished with; the message names it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct DeviceError(pub String);

/// Chooses the process's device, once, before any tensor is made; `Err` (naming both) if it
/// was already chosen otherwise.
pub fn choose_device(choice: DeviceChoice) -> Result<(), DeviceError> {
    let chosen = *CHOICE.get_or_init(|| choice);
    if chosen == choice {
        Ok(())
    } else {
        Err(DeviceError(format!(
            "the device was already chosen as {chosen}; it cannot change to {choice} in one process"
        )))
    }
}

/// Make burn's own default device the CPU (`BURN_DEVICE=flex`). burn builds a loaded
/// optimizer state on its default device, wgpu where that is compiled in, and moves it to the
/// parameters' device at the next step: resuming or exporting a CPU checkpoint started a
/// Vulkan device for nothing (and Mesa printed "XDG_RUNTIME_DIR is invalid" on a server).
/// Call at the start of `main`, before any thread: it sets an environment variable.
pub fn pin_burn_default_device() {
    std::env::set_var("BURN_DEVICE", "flex");
}

/// The process's device (the CPU unless [`choose_device`] said otherwise).
pub fn device_choice() -> DeviceChoice {
    *CHOICE.get_or_init(DeviceChoice::default)
}

/// Device for training: the chosen device with autodiff.
pub fn train_device() -> Device {
    plain_device().autodiff()
}

/// The same device without autodiff: gradients and received activations live here.
pub fn plain_device() -> Device {
    device_of(device_choice())
}

/// The device `choice` names, without autodiff.
pub fn device_of(choice: DeviceChoice) -> Device {
    match choice {
        DeviceChoice::Cpu => Device::flex(),
        DeviceChoice::Wgpu(None) => Device::wgpu(DeviceKind::DefaultDevice),
        DeviceChoice::Wgpu(Some(i)) => Device::wgpu(DeviceKind::DiscreteGpu(i)),
    }
}

/// Starts the chosen device with one small tensor, so that a machine without one (no Vulkan
/// driver for wgpu) is told so plainly rather than by a panic deep in a step.
pub fn start_device() -> Result<(), DeviceError> {
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(|| {
        burn::tensor::Tensor::<1>::zeros([1], &plain_device()).into_data()
    });
    std::panic::set_hook(quiet);
    r.map(|_| ()).map_err(|e| {
        let why = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "it panicked".into());
        DeviceError(format!(
            "the {} device did not start: {why}",
            device_choice()
        ))
    })
}

/// The name the chosen device gives itself once started (`llvmpipe (LLVM 15.0.6, 256 bits)` for
/// Mesa's lavapipe, `NVIDIA H100 80GB HBM3`); none on the CPU.
pub fn device_name() -> Option<String> {
    let device = plain_device();
    let DispatchDevice::Cube(cube) = device.as_dispatch() else {
        return None;
    };
    Some(cube.client().properties().identity.name.clone())
}

/// Whether tensors on `device` run this project's fused CPU kernels (flex, with or without
/// autodiff); others take burn's own operations.
pub fn fused_kernels(device: &Device) -> bool {
    matches!(
        device.clone().without_autodiff().as_dispatch(),
        DispatchDevice::Flex(_)
    )
}

/// Waits until the device has run every operation this thread queued; a no-op on the CPU.
/// burn's wgpu backend queues operations per thread (its fusion streams); worker threads are
/// new at every step, and one that ended with its optimizer step still queued left the next
/// step's threads reading parameters from before it (measured: 2-stage losses leaving the
/// CPU's from the third step, in threads and over MPI; 1 stage was unaffected). Each worker
/// settles before its thread ends.
pub fn settle() -> Result<(), DeviceError> {
    if device_choice() == DeviceChoice::Cpu {
        return Ok(());
    }
    plain_device()
        .sync()
        .map_err(|e| DeviceError(format!("the {} device failed: {e:?}", device_choice())))
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

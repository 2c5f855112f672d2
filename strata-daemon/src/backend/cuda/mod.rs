//! CUDA backend (cargo feature `cuda`, on by default): the driver and NVRTC are loaded at run time through
//! cudarc's dynamic loading, so every build compiles without a CUDA toolkit and runs on the CPU where no
//! driver is found. [`probe`] looks for the libraries before any driver call (cudarc panics when libcuda is
//! absent); [`GpuModel`] holds the dense weights, the KV cache and the VRAM expert cache on the card and runs
//! the forward pass (hybrid per layer: the GPU computes hit experts, the CPU pool the misses).

pub mod balance;
pub mod driver;
pub mod kernels;
pub mod model;
pub mod ops;
mod pass;
pub mod pipeline;
pub mod slots;

use std::sync::Arc;

pub use driver::Device;
pub use model::GpuConfig;
pub use pipeline::{GpuModel, StageInfo};

impl From<crate::backend::BackendError> for GpuError {
    /// A pass's error seen from inside the backend (a recorded pass's ops).
    fn from(e: crate::backend::BackendError) -> Self {
        match e {
            crate::backend::BackendError::Gpu(g) => g,
            e @ (crate::backend::BackendError::NonFinite { .. } | crate::backend::BackendError::BlobRead { .. }) => {
                GpuError::Unsupported(e.to_string())
            }
        }
    }
}

/// Errors of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// A library (libcuda, libnvrtc) could not be loaded.
    #[error("{0}")]
    NoLibrary(String),
    /// A driver call failed.
    #[error("CUDA driver call {what} failed: {code}")]
    Driver {
        /// The call.
        what: &'static str,
        /// The driver's status name.
        code: String,
    },
    /// NVRTC failed (the compile log is included).
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    /// A copy outside a buffer.
    #[error("device copy of {len} bytes at {off} outside a {size}-byte buffer")]
    Bounds {
        /// Offset.
        off: usize,
        /// Length.
        len: usize,
        /// Buffer size.
        size: usize,
    },
    /// The model or a setting cannot run on the GPU.
    #[error("{0}")]
    Unsupported(String),
    /// The model's architecture uses a choice the GPU kernels do not implement yet (an attention output bias,
    /// sigmoid gating, an expert weight scale): the model runs on the CPU.
    #[error("architecture {arch}: {what} has no GPU kernels yet")]
    Architecture {
        /// `general.architecture`.
        arch: String,
        /// The missing choice.
        what: &'static str,
    },
    /// A tensor's format has no GPU kernels yet: the model runs on the CPU.
    #[error("tensor {tensor} is {ty:?}, which has no GPU kernels yet")]
    Format {
        /// Tensor name.
        tensor: String,
        /// Its format.
        ty: crate::quant::GgmlType,
    },
    /// Not enough device memory for what was asked.
    #[error("not enough VRAM: {0}")]
    OutOfMemory(String),
}

const CUDA_LIBS: &[&str] = &["libcuda.so.1", "libcuda.so"];
const NVRTC_LIBS: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

fn loadable(names: &[&str]) -> Option<String> {
    for n in names {
        // SAFETY: loading a shared library runs its initializers; the CUDA driver and NVRTC are trusted
        // system libraries, loaded here only to see whether they exist (cudarc loads them again by name).
        if unsafe { libloading::Library::new(*n) }.is_ok() {
            return Some(n.to_string());
        }
    }
    None
}

/// What [`probe`] found.
pub struct Probe {
    /// The opened device.
    pub device: Arc<Device>,
    /// Driver library name.
    pub libcuda: String,
    /// NVRTC library name.
    pub libnvrtc: String,
    /// Devices the driver sees.
    pub visible: usize,
}

/// Looks for the CUDA driver and NVRTC libraries, then for device `ordinal`. Errors (the caller runs on the
/// CPU and says why in one line): a library missing, no device, driver failure.
pub fn probe(ordinal: usize) -> Result<Probe, GpuError> {
    let libcuda =
        loadable(CUDA_LIBS).ok_or_else(|| GpuError::NoLibrary("no CUDA driver (libcuda.so.1 not found)".into()))?;
    let libnvrtc = loadable(NVRTC_LIBS).ok_or_else(|| {
        GpuError::NoLibrary("CUDA driver found but no NVRTC (libnvrtc.so.13/.12 not on the library path)".into())
    })?;
    let mut n = 0;
    // SAFETY: the driver library is loadable (checked above), so cudarc's lazy symbol loading cannot panic
    // for a missing library.
    unsafe { driver::check("cuInit", cudarc::driver::sys::cuInit(0))? };
    // SAFETY: valid out-pointer.
    unsafe { driver::check("cuDeviceGetCount", cudarc::driver::sys::cuDeviceGetCount(&mut n))? };
    if n as usize <= ordinal {
        return Err(GpuError::NoLibrary(format!("CUDA driver found but no device {ordinal} ({n} devices)")));
    }
    let device = Device::open(ordinal)?;
    Ok(Probe { device, libcuda, libnvrtc, visible: n as usize })
}

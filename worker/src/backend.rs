//! The burn backends a worker runs on.
//!
//! `flex` (CPU, with its `rayon` and `simd` features) is always built. `cuda` is built
//! with the `cuda` cargo feature; its driver library is loaded at run time, and burn
//! panics on first use when it is absent, so [`cuda_available`] checks for it first.

/// The CPU backend.
pub type CpuBackend = burn_flex::Flex;

/// The CUDA backend.
#[cfg(feature = "cuda")]
pub type CudaBackend = burn_cuda::Cuda;

/// Which backend to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// CPU (`burn-flex`).
    #[default]
    Cpu,
    /// NVIDIA GPU (`burn-cuda`), when built with the `cuda` feature.
    Cuda,
}

impl std::str::FromStr for BackendKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" | "flex" => Ok(BackendKind::Cpu),
            "cuda" | "gpu" => Ok(BackendKind::Cuda),
            other => Err(format!("unknown backend {other:?} (expected cpu or cuda)")),
        }
    }
}

/// Why a backend cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The binary was built without the `cuda` feature.
    #[error("this binary was built without CUDA support (rebuild with --features cuda)")]
    CudaNotBuilt,
    /// The CUDA driver library could not be loaded.
    #[error("the CUDA driver library (libcuda.so.1) could not be loaded: {0}")]
    NoCudaDriver(String),
}

/// Checks that the CUDA driver library can be loaded, so the backend will not panic.
pub fn cuda_available() -> Result<(), BackendError> {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: loading the system CUDA driver runs its initialisers, which is what
        // the CUDA backend would do anyway; nothing is called through the handle.
        match unsafe { libloading::Library::new("libcuda.so.1") } {
            Ok(_) => Ok(()),
            Err(e) => Err(BackendError::NoCudaDriver(e.to_string())),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(BackendError::CudaNotBuilt)
    }
}

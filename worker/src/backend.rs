//! The burn backends a worker runs on.
//!
//! `flex` (CPU, with its `rayon` and `simd` features) is always built. `cuda` is built
//! with the `cuda` cargo feature; its driver library and NVRTC are loaded at run time and
//! its kernels compiled against the CUDA headers, and burn panics on first use when one
//! is absent, so [`cuda_available`] checks for all three first. `wgpu` is built with the
//! `wgpu` cargo feature: any GPU through Vulkan, or a CPU adapter (Mesa's llvmpipe, chosen
//! with `CUBECL_WGPU_DEFAULT_DEVICE=Cpu`), which is how the device engine is tested on
//! hosts without a GPU; [`wgpu_available`] checks for the Vulkan loader.

/// The CPU backend.
pub type CpuBackend = burn_flex::Flex;

/// The CUDA backend.
#[cfg(feature = "cuda")]
pub type CudaBackend = burn_cuda::Cuda;

/// The wgpu backend.
#[cfg(feature = "wgpu")]
pub type WgpuBackend = burn_wgpu::Wgpu;

/// What the kernels run on `device` are chosen from, as text: cubecl picks tilings,
/// vector widths and reduction strategies from a device's hardware properties and
/// features, so two devices alike in these run the same arithmetic, and two that differ
/// may not (part of the device engine's fingerprint). Empty for flex, whose kernels
/// depend on nothing of the host.
pub fn device_identity<B: burn_tensor::backend::Backend>(device: &B::Device) -> String {
    let any: &dyn std::any::Any = device;
    #[cfg(feature = "cuda")]
    if let Some(d) = any.downcast_ref::<burn_cuda::CudaDevice>() {
        use cubecl::Runtime;
        let client = cubecl::cuda::CudaRuntime::client(d);
        let p = client.properties();
        return format!("{:?} {:?}", p.hardware, p.features);
    }
    #[cfg(feature = "wgpu")]
    if let Some(d) = any.downcast_ref::<burn_wgpu::WgpuDevice>() {
        use cubecl::Runtime;
        let client = burn_wgpu::WgpuRuntime::client(d);
        let p = client.properties();
        return format!("{:?} {:?}", p.hardware, p.features);
    }
    let _ = any;
    String::new()
}

/// Which backend to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// CPU (`burn-flex`).
    #[default]
    Cpu,
    /// NVIDIA GPU (`burn-cuda`), when built with the `cuda` feature.
    Cuda,
    /// Any GPU through wgpu (Vulkan), or a software adapter, when built with the `wgpu`
    /// feature.
    Wgpu,
}

impl BackendKind {
    /// Whether the backend is a device (GPU or software adapter) rather than the host.
    pub fn is_device(self) -> bool {
        !matches!(self, BackendKind::Cpu)
    }

    /// Checks that this build and host can run the backend (see [`cuda_available`] and
    /// [`wgpu_available`]).
    pub fn available(self) -> Result<(), BackendError> {
        match self {
            BackendKind::Cpu => Ok(()),
            BackendKind::Cuda => cuda_available(),
            BackendKind::Wgpu => wgpu_available(),
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Wgpu => "wgpu",
        })
    }
}

/// The weight format a backend serves when `asked` was asked for: the file's blocks
/// (`native`, `native-i16`) run on the host engine's CPU kernels only, so a device backend
/// asked for them gets f16 tensors instead, which the log says; every other pair as asked.
pub fn serving_weights(
    backend: BackendKind,
    asked: crate::engine::llama::WeightDtype,
) -> crate::engine::llama::WeightDtype {
    use crate::engine::llama::WeightDtype;
    if backend.is_device() && asked.is_native() {
        tracing::warn!(
            %backend,
            asked = %asked,
            serving = %WeightDtype::F16,
            "the file's blocks run on the host engine only: the device engine keeps the \
             weights as f16 tensors"
        );
        WeightDtype::F16
    } else {
        asked
    }
}

/// Runs `$body` with `$b` the burn backend type of `$kind` (a [`BackendKind`]), after
/// checking the backend can run here (`?` on a [`BackendError`]).
#[macro_export]
macro_rules! with_backend {
    ($kind:expr, $b:ident => $body:expr) => {{
        let kind: $crate::backend::BackendKind = $kind;
        kind.available()?;
        match kind {
            $crate::backend::BackendKind::Cpu => {
                type $b = $crate::backend::CpuBackend;
                $body
            }
            $crate::backend::BackendKind::Cuda => {
                #[cfg(feature = "cuda")]
                {
                    type $b = $crate::backend::CudaBackend;
                    $body
                }
                #[cfg(not(feature = "cuda"))]
                unreachable!("the CUDA check fails without the cuda feature")
            }
            $crate::backend::BackendKind::Wgpu => {
                #[cfg(feature = "wgpu")]
                {
                    type $b = $crate::backend::WgpuBackend;
                    $body
                }
                #[cfg(not(feature = "wgpu"))]
                unreachable!("the wgpu check fails without the wgpu feature")
            }
        }
    }};
}

impl std::str::FromStr for BackendKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" | "flex" => Ok(BackendKind::Cpu),
            "cuda" | "gpu" => Ok(BackendKind::Cuda),
            "wgpu" | "vulkan" => Ok(BackendKind::Wgpu),
            other => Err(format!(
                "unknown backend {other:?} (expected cpu, cuda or wgpu)"
            )),
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
    /// No NVRTC library, which compiles the backend's kernels at run time, could be loaded.
    #[error(
        "the CUDA runtime compiler (NVRTC) could not be loaded: tried {}; install the CUDA \
         toolkit's NVRTC and put its directory on LD_LIBRARY_PATH",
        .0.join(", ")
    )]
    NoNvrtc(Vec<String>),
    /// The CUDA headers that NVRTC compiles the kernels against were not found.
    #[error(
        "the CUDA headers ({HEADER}) were not found in {}; set CUDA_PATH to the CUDA \
         toolkit's directory",
        .0.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    NoCudaHeaders(Vec<std::path::PathBuf>),
    /// The binary was built without the `wgpu` feature.
    #[error("this binary was built without wgpu support (rebuild with --features wgpu)")]
    WgpuNotBuilt,
    /// The Vulkan loader could not be loaded.
    #[error(
        "the Vulkan loader (libvulkan.so.1) could not be loaded: {0}; install a Vulkan \
         driver (on Debian: apt-get install libvulkan1 mesa-vulkan-drivers)"
    )]
    NoVulkan(String),
}

/// The header every kernel NVRTC compiles for the CUDA backend includes.
const HEADER: &str = "cuda_runtime.h";

/// The names NVRTC goes by on Linux, as the CUDA backend's loader tries them.
pub const NVRTC_NAMES: &[&str] = &[
    "libnvrtc.so",
    "libnvrtc.so.13",
    "libnvrtc.so.12",
    "libnvrtc.so.11",
    "libnvrtc.so.1",
];

/// The directory holding the CUDA headers, where the CUDA backend looks for it:
/// `$CUDA_PATH/include`, else `/usr/local/cuda/include`, `/opt/cuda/include` or, with
/// `nvcc` in `/usr/bin`, `/usr/include`. The places looked in when none has them.
pub fn cuda_include_dir(
    cuda_path: Option<&std::path::Path>,
    exists: impl Fn(&std::path::Path) -> bool,
) -> Result<std::path::PathBuf, Vec<std::path::PathBuf>> {
    use std::path::{Path, PathBuf};
    let roots: Vec<PathBuf> = match cuda_path {
        Some(p) => vec![p.to_path_buf()],
        None => {
            let mut r = vec![PathBuf::from("/usr/local/cuda"), PathBuf::from("/opt/cuda")];
            if exists(Path::new("/usr/bin/nvcc")) {
                r.push(PathBuf::from("/usr"));
            }
            r
        }
    };
    let dirs: Vec<PathBuf> = roots.into_iter().map(|r| r.join("include")).collect();
    match dirs.iter().find(|d| exists(&d.join(HEADER))) {
        Some(d) => Ok(d.clone()),
        None => Err(dirs),
    }
}

/// Checks what the CUDA backend needs before it is used, since burn panics on the first
/// kernel without it: the driver library, NVRTC and the CUDA headers; the error names the
/// one missing.
pub fn cuda_available() -> Result<(), BackendError> {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: loading the system CUDA libraries runs their initialisers, which is what
        // the CUDA backend would do anyway; nothing is called through the handles.
        if let Err(e) = unsafe { libloading::Library::new("libcuda.so.1") } {
            return Err(BackendError::NoCudaDriver(e.to_string()));
        }
        // SAFETY: as above.
        if !NVRTC_NAMES
            .iter()
            .any(|n| unsafe { libloading::Library::new(n) }.is_ok())
        {
            return Err(BackendError::NoNvrtc(
                NVRTC_NAMES.iter().map(|n| n.to_string()).collect(),
            ));
        }
        let cuda_path = std::env::var_os("CUDA_PATH").map(std::path::PathBuf::from);
        cuda_include_dir(cuda_path.as_deref(), |p| p.exists())
            .map_err(BackendError::NoCudaHeaders)?;
        Ok(())
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(BackendError::CudaNotBuilt)
    }
}

/// Checks that the wgpu backend can find a Vulkan driver, since burn panics on first use
/// without one.
pub fn wgpu_available() -> Result<(), BackendError> {
    #[cfg(feature = "wgpu")]
    {
        // SAFETY: loading the system Vulkan loader runs its initialisers, which is what
        // the wgpu backend would do anyway; nothing is called through the handle.
        match unsafe { libloading::Library::new("libvulkan.so.1") } {
            Ok(_) => Ok(()),
            Err(e) => Err(BackendError::NoVulkan(e.to_string())),
        }
    }
    #[cfg(not(feature = "wgpu"))]
    {
        Err(BackendError::WgpuNotBuilt)
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;

    /// The headers are looked for where the CUDA backend looks, and a missing install
    /// names every place tried.
    #[test]
    fn cuda_headers_are_found_where_the_backend_looks() {
        let dir = tempfile::TempDir::new().expect("tempdir");
        let include = dir.path().join("include");
        std::fs::create_dir_all(&include).expect("mkdir");
        let missing = cuda_include_dir(Some(dir.path()), |p| p.exists()).expect_err("no header");
        assert_eq!(missing, vec![include.clone()]);
        std::fs::write(include.join(HEADER), "").expect("header");
        assert_eq!(
            cuda_include_dir(Some(dir.path()), |p| p.exists()),
            Ok(include)
        );

        // Without CUDA_PATH: the distribution's places, `/usr` only with its nvcc.
        let none = cuda_include_dir(None, |_| false).expect_err("nothing installed");
        assert_eq!(
            none,
            vec![
                PathBuf::from("/usr/local/cuda/include"),
                PathBuf::from("/opt/cuda/include")
            ]
        );
        let usr = cuda_include_dir(None, |p| {
            p == Path::new("/usr/bin/nvcc") || p == Path::new("/usr/include/cuda_runtime.h")
        });
        assert_eq!(usr, Ok(PathBuf::from("/usr/include")));
        let message = BackendError::NoCudaHeaders(none).to_string();
        assert!(message.contains("cuda_runtime.h") && message.contains("/opt/cuda/include"));
        assert!(message.contains("CUDA_PATH"), "{message}");
    }

    /// A device backend never serves the file's blocks (the host engine's), and says so;
    /// the host keeps what it was asked.
    #[test]
    fn device_backends_serve_tensors() {
        use crate::engine::llama::WeightDtype;
        for kind in [BackendKind::Cuda, BackendKind::Wgpu] {
            assert!(kind.is_device());
            assert_eq!(
                serving_weights(kind, WeightDtype::NativeI16),
                WeightDtype::F16
            );
            assert_eq!(serving_weights(kind, WeightDtype::Native), WeightDtype::F16);
            assert_eq!(serving_weights(kind, WeightDtype::F32), WeightDtype::F32);
            assert_eq!(kind.to_string().parse::<BackendKind>(), Ok(kind));
        }
        assert_eq!(
            serving_weights(BackendKind::Cpu, WeightDtype::NativeI16),
            WeightDtype::NativeI16
        );
        assert!("tpu".parse::<BackendKind>().is_err());
    }

    /// Without the feature the check says how to get it; with it, on a host that lacks a
    /// part, the error names that part.
    #[test]
    fn the_cuda_check_names_what_is_missing() {
        let result = cuda_available();
        if cfg!(feature = "cuda") {
            if let Err(e) = result {
                let message = e.to_string();
                assert!(
                    ["libcuda.so.1", "NVRTC", "cuda_runtime.h"]
                        .iter()
                        .any(|p| message.contains(p)),
                    "{message}"
                );
            }
        } else {
            let message = result.expect_err("built without CUDA").to_string();
            assert!(message.contains("--features cuda"), "{message}");
        }
        let nvrtc = BackendError::NoNvrtc(NVRTC_NAMES.iter().map(|n| n.to_string()).collect());
        assert!(nvrtc.to_string().contains("libnvrtc.so.12"), "{nvrtc}");
    }
}

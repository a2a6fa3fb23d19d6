//! A device that cannot run fails the load with an error naming it, instead of a panic
//! at the first request. Its own test binary: the backend's panic is caught, but what
//! it leaves behind must not meet other tests' devices.
#![cfg(feature = "wgpu")]

use baton_worker::{
    backend::WgpuBackend,
    engine::{
        llama::{
            synthetic::{write_synthetic_llama, SyntheticSpec},
            WeightDtype,
        },
        Engine, EngineError,
    },
};
use burn_wgpu::WgpuDevice;

/// No host has a seventh discrete GPU: the load's error names the device asked for.
#[test]
fn wgpu_a_missing_adapter_fails_the_load_with_an_error_naming_it() {
    let dir = tempfile::TempDir::new().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_synthetic_llama(&path, &SyntheticSpec::tiny(1)).expect("write tiny model");
    let device = WgpuDevice::DiscreteGpu(7);
    let err = match Engine::<WgpuBackend>::load(&path, WeightDtype::F32, &device) {
        Ok(_) => panic!("a load on a device that does not exist succeeded"),
        Err(e) => e,
    };
    assert!(matches!(err, EngineError::Device { .. }), "{err:?}");
    assert_eq!(err.kind(), "device");
    let message = err.to_string();
    assert!(message.contains("DiscreteGpu(7)"), "{message}");
}

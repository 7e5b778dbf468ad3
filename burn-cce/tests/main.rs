//! The crate's integration tests, one module per topic, in one binary: a release build
//! re-instantiates Burn's generic backends in every test binary (~2 minutes each on 2 cores).

// Without a CubeCL runtime feature only the CPU tests run; the kernel tests are unused.
#![cfg_attr(not(feature = "cube"), allow(dead_code, unused_imports))]

mod cce;
mod lse;

use burn::tensor::Device;

/// Runs `f`, with kernels required (`burn_kernels_core::route::require_kernels`) where `device`
/// is a CubeCL device of this build: a call in it that would take the tensor-op reference
/// there panics. On other devices (Flex) `f` runs as is, through the reference.
pub fn kernels<T>(device: &Device, f: impl FnOnce() -> T) -> T {
    if burn_kernels_core::route::cube_device(device).is_some() {
        burn_kernels_core::route::require_kernels(f)
    } else {
        f()
    }
}

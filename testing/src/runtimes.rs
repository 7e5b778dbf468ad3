//! Running one test body on every enabled runtime.
//!
//! A test body is a function `fn name(device: &Device)`. [`testgen!`](crate::testgen)
//! instantiates it once per CubeCL runtime enabled in the *calling* crate's features
//! (`vulkan`, `cuda`), on that runtime's device through Burn's `Dispatch` backend (so on
//! `Fusion<CubeBackend>` where Burn's `fusion` feature is on, as in the workspace), and on the
//! same device with autodiff for gradient tests.

use burn::tensor::{DType, Device, Tensor, TensorCreationOptions};

/// Generates `#[test]` functions for every enabled runtime. See the module docs.
///
/// ```text
/// fn forward_matches_reference(device: &Device) { /* ... */ }
/// fn grads_match_reference(device: &Device) { /* ... (device has autodiff) */ }
/// burn_kernels_testing::testgen! {
///     backend: [forward_matches_reference],
///     autodiff: [grads_match_reference],
/// }
/// ```
#[macro_export]
macro_rules! testgen {
    (backend: [$($b:ident),* $(,)?], autodiff: [$($a:ident),* $(,)?] $(,)?) => {
        #[cfg(feature = "vulkan")]
        mod vulkan {
            fn device() -> ::burn::tensor::Device {
                $crate::runtimes::quick_software_shaders();
                ::burn::tensor::Device::vulkan(::burn::tensor::DeviceKind::DefaultDevice)
            }
            $( #[test] fn $b() { super::$b(&device()); } )*
            $( #[test] fn $a() { super::$a(&device().autodiff()); } )*
        }
        #[cfg(all(feature = "wgpu", not(feature = "vulkan")))]
        mod wgpu {
            fn device() -> ::burn::tensor::Device {
                $crate::runtimes::quick_software_shaders();
                ::burn::tensor::Device::wgpu(::burn::tensor::DeviceKind::DefaultDevice)
            }
            $( #[test] fn $b() { super::$b(&device()); } )*
            $( #[test] fn $a() { super::$a(&device().autodiff()); } )*
        }
        #[cfg(feature = "cuda")]
        mod cuda {
            fn device() -> ::burn::tensor::Device {
                $crate::runtimes::exact_f32_matmul();
                ::burn::tensor::Device::cuda(0)
            }
            $( #[test] fn $b() { super::$b(&device()); } )*
            $( #[test] fn $a() { super::$a(&device().autodiff()); } )*
        }
    };
}

/// Tells Mesa's llvmpipe (lavapipe, the Vulkan driver on the CPU that CI tests with) to skip
/// LLVM's optimization passes, unless `GALLIVM_PERF` is already set. Kernel tests there are
/// bound by shader compilation, not execution (a profile: 44% LLVM, 29% lavapipe's NIR passes,
/// under 1% running kernels); `nopt` cuts ~30% of their time. GPU drivers do not read it.
/// [`testgen!`](crate::testgen) calls it before creating a Vulkan device.
pub fn quick_software_shaders() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("GALLIVM_PERF").is_none() {
            // SAFETY: set once, before this process creates its first Vulkan device (the only
            // reader); the other test threads read the environment through std, which locks.
            unsafe { std::env::set_var("GALLIVM_PERF", "nopt") };
        }
    });
}

/// Turns off cubek's TF32 rounding of f32 matmul inputs (`MatmulConfig::allow_tf32`, on by
/// default) for this test process, before its first CUDA device exists, so that tensor-op
/// references are exact f32. With TF32 on, Burn's f32 matmul on CUDA is accurate to ~1e-3, and
/// kernels held to f32 tolerances against it failed on the H200 (2026-11-27: the fused 4-bit
/// KV read, rel. L2 4.7e-4 from the reference; a model's gradient through 30 layers, 1.9e-3).
/// burn-cce's chunk GEMMs follow the same setting, so its `tf32` option runs exact f32 in these
/// tests (its f32 tolerances allow TF32 either way).
/// [`testgen!`](crate::testgen) calls it for its CUDA tests.
pub fn exact_f32_matmul() {
    use cubek::std::config::{CubekConfig, MatmulConfig, RuntimeConfig};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let exact = CubekConfig {
            matmul: MatmulConfig { allow_tf32: false },
        };
        if !CubekConfig::try_set(exact) {
            eprintln!(
                "exact_f32_matmul: cubek's config was read already; f32 matmuls may use TF32"
            );
        }
    });
}

/// Whether `device` is a wgpu device. The CI tests Vulkan on Mesa's lavapipe on two CPU cores,
/// where each new kernel variant costs seconds of shader compilation and a model-sized forward
/// pass tens of seconds; long dtype × option matrices and model-sized inputs run in part there
/// (each test says which part) and in full on CUDA.
pub fn is_wgpu(device: &Device) -> bool {
    burn_kernels_core::route::is_wgpu(device)
}

/// Whether `device` is a CUDA device.
pub fn is_cuda(device: &Device) -> bool {
    burn_kernels_core::route::is_cuda(device)
}

/// The float dtypes a test should cover on `device`: f32 always, f16 and bf16 where the
/// backend stores them (lavapipe, for one, may lack 16-bit float shaders).
///
/// `BURN_KERNELS_TEST_DTYPES` (e.g. `bf16` or `f32,f16`) keeps only the listed ones, so that a
/// long test can run as one process per dtype on a GPU machine with a time limit.
pub fn float_dtypes(device: &Device) -> Vec<DType> {
    let only = std::env::var("BURN_KERNELS_TEST_DTYPES").ok();
    let listed = |d: DType| {
        only.as_deref().is_none_or(|list| {
            let name = match d {
                DType::F16 => "f16",
                DType::BF16 => "bf16",
                _ => "f32",
            };
            list.split(',').any(|x| x.trim().eq_ignore_ascii_case(name))
        })
    };
    let dtypes: Vec<DType> = [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .filter(|&d| d == DType::F32 || device.supports_dtype(d))
        .filter(|&d| listed(d))
        .collect();
    // A filter that leaves nothing would make every dtype loop pass without checking anything.
    assert!(
        !dtypes.is_empty(),
        "BURN_KERNELS_TEST_DTYPES={only:?} leaves no dtype this device supports"
    );
    dtypes
}

/// Fills and frees device memory with NaN so that a kernel output later allocated from the
/// same pool starts as NaN: an element the kernel never writes then fails the comparison
/// instead of passing by luck with a stale value.
pub fn poison_memory(device: &Device, elems: usize, dtype: DType) {
    let t = Tensor::<1>::full(
        [elems.max(1)],
        f32::NAN,
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    );
    let _ = device.sync();
    drop(t);
}

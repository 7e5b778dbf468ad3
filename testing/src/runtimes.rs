//! Running one test body on every enabled runtime.
//!
//! A test body is a generic function `fn name<B: SomeBackendTrait>(device: &B::Device)`.
//! [`testgen!`](crate::testgen) instantiates it once per runtime enabled in the *calling*
//! crate's features (`vulkan`, `cuda`), with `CubeBackend<Runtime, f32, i32, u32>` for plain
//! tests and `Autodiff<CubeBackend<..>>` for gradient tests. The calling crate must depend on
//! `burn`, `burn-cubecl` and `cubecl` (with `cubecl/cuda` under its `cuda` feature).

use burn::tensor::{DType, Tensor, TensorCreationOptions, backend::Backend};

/// Generates `#[test]` functions for every enabled runtime. See the module docs.
///
/// ```text
/// fn forward_matches_reference<B: MyBackend>(device: &B::Device) { /* ... */ }
/// fn grads_match_reference<B: MyBackend + AutodiffBackend>(device: &B::Device) { /* ... */ }
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
            pub type Runtime = ::burn::backend::wgpu::WgpuRuntime;
            pub type TestBackend = ::burn_cubecl::CubeBackend<Runtime, f32, i32, u32>;
            fn device() -> ::burn::backend::wgpu::WgpuDevice {
                ::burn::backend::wgpu::WgpuDevice::default()
            }
            $( #[test] fn $b() { super::$b::<TestBackend>(&device()); } )*
            $( #[test] fn $a() { super::$a::<::burn::backend::Autodiff<TestBackend>>(&device()); } )*
        }
        #[cfg(feature = "cuda")]
        mod cuda {
            pub type Runtime = ::cubecl::cuda::CudaRuntime;
            pub type TestBackend = ::burn_cubecl::CubeBackend<Runtime, f32, i32, u8>;
            fn device() -> ::cubecl::cuda::CudaDevice {
                ::cubecl::cuda::CudaDevice::default()
            }
            $( #[test] fn $b() { super::$b::<TestBackend>(&device()); } )*
            $( #[test] fn $a() { super::$a::<::burn::backend::Autodiff<TestBackend>>(&device()); } )*
        }
    };
}

/// The float dtypes a test should cover on `device`: f32 always, f16 and bf16 where the
/// backend stores them (lavapipe, for one, may lack 16-bit float shaders).
///
/// `BURN_KERNELS_TEST_DTYPES` (e.g. `bf16` or `f32,f16`) keeps only the listed ones, so that a
/// long test can run as one process per dtype on a GPU machine with a time limit.
pub fn float_dtypes<B: Backend>(device: &B::Device) -> Vec<DType> {
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
        .filter(|&d| d == DType::F32 || B::supports_dtype(device, d))
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
pub fn poison_memory<B: Backend>(device: &B::Device, elems: usize, dtype: DType) {
    let t = Tensor::<B, 1>::full(
        [elems.max(1)],
        f32::NAN,
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    );
    let _ = B::sync(device);
    drop(t);
}

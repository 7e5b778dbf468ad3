//! The crate's integration tests, one module per topic, in one binary: a release build
//! re-instantiates Burn's generic backends in every test binary (~2 minutes each on 2 cores).
//!
//! Every test body takes a `&Device`: the CPU tests pass `Device::flex()` (the tensor-op
//! reference), `burn_kernels_testing::testgen!` each enabled CubeCL runtime's device (the
//! kernels, through Burn's `Dispatch`).

// Without a CubeCL runtime feature only the CPU tests run; the kernel tests are unused.
#![cfg_attr(not(feature = "cube"), allow(dead_code, unused_imports))]

/// Declares each check `f(&Device)` as a CPU test (`cpu::f`, on `Device::flex()`) and, through
/// `testgen!`, as a test on each enabled CubeCL runtime; the checks listed after
/// `; kernels only:` run on the runtimes alone.
macro_rules! on_all {
    ($($f:ident),* $(,)? $(; kernels only: [$($g:ident),* $(,)?] $(,)?)?) => {
        mod cpu {
            $( #[test] fn $f() { super::$f(&::burn::tensor::Device::flex()); } )*
        }
        burn_kernels_testing::testgen! { backend: [$($f,)* $($($g,)*)?], autodiff: [] }
    };
}

mod cache;
mod decode_attention;
mod ops;
mod quant_attention;
mod shadowkv;

use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData};
use burn_kernels_core::route::{cube_device, launches, require_kernels};

/// Runs `f` with kernels required on a CubeCL device (`require_kernels`: an op that would
/// silently take the tensor-op reference there panics); elsewhere (the CPU, which runs the
/// reference) as is.
pub fn on_kernels<T>(device: &Device, f: impl FnOnce() -> T) -> T {
    if cube_device(device).is_some() {
        require_kernels(f)
    } else {
        f()
    }
}

/// Launches counted so far of each op (see `burn_kernels_core::route::launches`).
pub fn launch_counts<const N: usize>(ops: [&'static str; N]) -> [u64; N] {
    ops.map(launches)
}

/// On a CubeCL device, checks that each op's kernel was launched since `before` (call it after
/// the outputs were read back: under fusion the kernels run when the stream executes).
pub fn assert_launched<const N: usize>(device: &Device, ops: [&'static str; N], before: [u64; N]) {
    if cube_device(device).is_none() {
        return;
    }
    for (op, before) in ops.iter().zip(before) {
        assert!(launches(op) > before, "{op}: no kernel launch counted");
    }
}

/// `values` as a tensor of `shape` stored in `dtype` on `device`.
pub(crate) fn tensor<const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    dtype: DType,
    device: &Device,
) -> Tensor<D> {
    let data = TensorData::new(values, shape).convert_dtype(dtype);
    Tensor::from_data(
        data,
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}

/// `values` as an f32 tensor of `shape` on the CPU (`Flex`), where the references run.
pub(crate) fn cpu<const D: usize>(values: Vec<f32>, shape: [usize; D]) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, shape), &Device::flex())
}

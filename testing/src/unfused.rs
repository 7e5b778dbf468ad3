//! Calling a backend extension on `CubeBackend` directly, outside Burn's `Dispatch` and
//! `Fusion`: each crate has one test that compares this path with the `Dispatch` one.

use burn::backend::ops::{BoolTensorOps, FloatTensorOps, IntTensorOps};
use burn::backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn::tensor::{Device, Tensor, TensorData, read_sync};
use burn_cubecl::{CubeBackend, CubeDevice};

/// The CubeCL device behind `device`.
///
/// # Panics
/// When `device` is not a CubeCL device of a runtime this build enables.
pub fn cube_device(device: &Device) -> CubeDevice {
    burn_kernels_core::route::cube_device(device).expect("a CubeCL device")
}

/// `t`'s values as an unfused `CubeBackend` float tensor on `device`.
pub fn float<const D: usize>(t: &Tensor<D>, device: &Device) -> FloatTensor<CubeBackend> {
    CubeBackend::float_from_data(t.to_data(), &cube_device(device))
}

/// `t`'s values as an unfused `CubeBackend` int tensor on `device`.
pub fn int<const D: usize>(
    t: &Tensor<D, burn::tensor::Int>,
    device: &Device,
) -> IntTensor<CubeBackend> {
    CubeBackend::int_from_data(t.to_data(), &cube_device(device))
}

/// `t`'s values as an unfused `CubeBackend` bool tensor on `device`.
pub fn boolean<const D: usize>(
    t: &Tensor<D, burn::tensor::Bool>,
    device: &Device,
) -> BoolTensor<CubeBackend> {
    CubeBackend::bool_from_data(t.to_data(), &cube_device(device))
}

/// Reads an unfused float tensor back.
pub fn read_float(t: FloatTensor<CubeBackend>) -> TensorData {
    read_sync(CubeBackend::float_into_data(t)).expect("read back an unfused tensor")
}

/// Reads an unfused int tensor back.
pub fn read_int(t: IntTensor<CubeBackend>) -> TensorData {
    read_sync(CubeBackend::int_into_data(t)).expect("read back an unfused tensor")
}

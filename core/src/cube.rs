//! `CubeBackend` runs the [`FusedBackend`] kernels.

use burn::nn::RmsNorm;
use burn::tensor::{DType, Int, Tensor, TensorPrimitive};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::kernels;
use crate::layer_ops::{FusedBackend, GEMV_MAX_ROWS, LayerOps, TensorOps};
use crate::rope::Rope;

/// A `CubeBackend` float tensor from a kernel's output (shared by the crates' backend impls).
pub fn cube_float<R, F, I, BT, const D: usize>(
    t: burn_cubecl::tensor::CubeTensor<R>,
) -> Tensor<CubeBackend<R, F, I, BT>, D>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> FusedBackend
    for CubeBackend<R, F, I, BT>
{
    fn fused_linear(x: Tensor<Self, 3>, w: Tensor<Self, 2>) -> Tensor<Self, 3> {
        let [b, s, k] = x.dims();
        let n = w.dims()[1];
        if b * s > GEMV_MAX_ROWS || x.dtype() != w.dtype() {
            return TensorOps.linear(x, w);
        }
        let out = cube_float::<R, F, I, BT, 2>(kernels::linear::gemv(
            x.reshape([b * s, k]).into_primitive().tensor(),
            w.into_primitive().tensor(),
        ));
        out.reshape([b, s, n])
    }

    fn fused_rms_norm(norm: &RmsNorm<Self>, x: Tensor<Self, 3>) -> Tensor<Self, 3> {
        let gamma = norm.gamma.val().cast(x.dtype());
        cube_float(kernels::rms_norm::rms_norm(
            x.into_primitive().tensor(),
            gamma.into_primitive().tensor(),
            norm.epsilon,
        ))
    }

    fn fused_rope(
        rope: &Rope<Self>,
        x: Tensor<Self, 4>,
        positions: Tensor<Self, 2, Int>,
    ) -> Tensor<Self, 4> {
        // The kernel reads f32 tables (what `Rope::new` builds).
        let (cos, sin) = rope.tables();
        let (cos, sin) = (cos.clone().cast(DType::F32), sin.clone().cast(DType::F32));
        cube_float(kernels::rope::rope(
            x.into_primitive().tensor(),
            positions.into_primitive(),
            cos.into_primitive().tensor(),
            sin.into_primitive().tensor(),
        ))
    }

    fn fused_silu_mul(gate: Tensor<Self, 3>, up: Tensor<Self, 3>) -> Tensor<Self, 3> {
        cube_float(kernels::silu_mul::silu_mul(
            gate.into_primitive().tensor(),
            up.into_primitive().tensor(),
        ))
    }
}

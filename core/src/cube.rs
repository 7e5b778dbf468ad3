//! The layer kernels as a Burn backend extension: `CubeBackend` runs them, Burn's `Dispatch`
//! routes to it, and `Fusion<CubeBackend>` (generated) registers each call as a custom
//! operation of the fused stream. [`crate::FusedOps`] decides when to call them.

use burn::backend::{
    Backend, backend_extension,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::Shape;

/// One CubeCL kernel each for the small ops of a transformer layer (forward only).
///
/// Call them through [`crate::FusedOps`], which checks the device and the shapes first; the
/// methods here assume valid input.
#[backend_extension(
    Cube: cfg(feature = "cube"),
    Fusion: cfg(all(feature = "cube", feature = "fusion")),
)]
pub trait LayerKernels: Backend {
    /// `x · γ / √(mean(x²) + ε)` over the last dimension, accumulated in f32.
    ///
    /// # Shapes
    /// - `x`: `[..., cols]`, `gamma`: `[cols]` in `x`'s dtype; returns `x`'s shape
    #[fusion(dtype = x, shape = x)]
    #[cfg_attr(not(feature = "cube"), allow(unused_variables))]
    fn rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f64) -> FloatTensor<Self>;

    /// Rotate-half RoPE of `x` at `positions`, from f32 tables.
    ///
    /// # Shapes
    /// - `x`: `[batch, heads, seq, head_dim]` (any strides), `positions`: `[batch, seq]`,
    ///   `cos`, `sin`: `[max_positions, head_dim / 2]` f32; returns `x`'s shape, contiguous
    #[fusion(dtype = x, shape = x)]
    fn rope(
        x: FloatTensor<Self>,
        positions: IntTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// `silu(gate) · up`.
    ///
    /// # Shapes
    /// - `gate`, `up`: the same shape and dtype; returns it
    #[fusion(dtype = gate, shape = gate)]
    fn silu_mul(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `x · w` for a few rows (a GEMV), accumulated in f32.
    ///
    /// # Shapes
    /// - `x`: `[rows, k]`, `w`: `[k, n]` in `x`'s dtype; returns `[rows, n]`
    #[fusion(dtype = x, shape = gemv_shape(x, w))]
    fn gemv(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// The output shape of [`LayerKernels::gemv`]: `[rows, n]`.
pub fn gemv_shape(x: &Shape, w: &Shape) -> Shape {
    Shape::new([x[0], w[1]])
}

#[cfg(feature = "cube")]
mod cube_backend {
    use super::LayerKernels;
    use crate::kernels;
    use crate::route::count_launch;
    use burn::backend::tensor::{FloatTensor, IntTensor};
    use burn_cubecl::CubeBackend;

    impl LayerKernels for CubeBackend {
        fn rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
            count_launch("rms_norm");
            kernels::rms_norm::rms_norm(x, gamma, eps)
        }

        fn rope(
            x: FloatTensor<Self>,
            positions: IntTensor<Self>,
            cos: FloatTensor<Self>,
            sin: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            count_launch("rope");
            kernels::rope::rope(x, positions, cos, sin)
        }

        fn silu_mul(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
            count_launch("silu_mul");
            kernels::silu_mul::silu_mul(gate, up)
        }

        fn gemv(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
            count_launch("gemv");
            kernels::linear::gemv(x, w)
        }
    }
}

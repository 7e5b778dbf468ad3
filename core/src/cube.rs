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

    /// `(x + y, rms_norm(x + y))`: a residual add and the norm after it in one launch.
    ///
    /// # Shapes
    /// - `x`, `y`: `[..., cols]`, `gamma`: `[cols]`, one dtype; returns two tensors of `x`'s
    ///   shape
    #[cfg_attr(not(feature = "cube"), allow(unused_variables))]
    #[fusion(meta = |x, _y, _gamma, _eps| {
        let spec = burn::backend::fusion::custom::TensorSpec::new;
        (spec(x.shape.clone(), x.dtype), spec(x.shape.clone(), x.dtype))
    })]
    fn add_rms_norm(
        x: FloatTensor<Self>,
        y: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

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

    /// [`LayerKernels::rope`] of a layer's queries and keys in one launch.
    ///
    /// # Shapes
    /// - `q`: `[batch, q_heads, seq, head_dim]`, `k`: `[batch, k_heads, seq, head_dim]` (any
    ///   strides), `positions`, `cos`, `sin`: as `rope`; returns `q`'s and `k`'s shapes,
    ///   contiguous
    #[fusion(meta = |q, k, _positions, _cos, _sin| {
        let spec = burn::backend::fusion::custom::TensorSpec::new;
        (spec(q.shape.clone(), q.dtype), spec(k.shape.clone(), k.dtype))
    })]
    fn rope2(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        positions: IntTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// A static cache's step write: `kc[:, :, index[t]] = k[:, :, t]`, the same for `vc`, in
    /// one launch; returns the updated buffers.
    ///
    /// # Shapes
    /// - `kc`, `vc`: `[batch, heads, capacity, head_dim]`; `k`, `v`: `[batch, heads, seq,
    ///   head_dim]` (any strides), one dtype; `index`: `[seq]`, each `< capacity`
    #[fusion(meta = |kc, vc, _k, _v, _index| {
        let spec = burn::backend::fusion::custom::TensorSpec::new;
        (spec(kc.shape.clone(), kc.dtype), spec(vc.shape.clone(), vc.dtype))
    })]
    fn store_kv(
        kc: FloatTensor<Self>,
        vc: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        index: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

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

    /// `x · eᵀ` for a few rows, reading `e` along its rows (a tied LM head), accumulated in
    /// f32.
    ///
    /// # Shapes
    /// - `x`: `[rows, k]`, `e`: `[n, k]` in `x`'s dtype; returns `[rows, n]`
    #[fusion(dtype = x, shape = gemv_t_shape(x, e))]
    fn gemv_t(x: FloatTensor<Self>, e: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `(x · wa, x · wb, x · wc)` in one launch (a layer's Q, K and V projections).
    ///
    /// # Shapes
    /// - `x`: `[rows, k]`, `wa`: `[k, na]`, `wb`: `[k, nb]`, `wc`: `[k, nc]` in `x`'s dtype;
    ///   returns `[rows, na]`, `[rows, nb]`, `[rows, nc]`
    #[fusion(meta = |x, wa, wb, wc| {
        let spec = burn::backend::fusion::custom::TensorSpec::new;
        (
            spec(gemv_shape(&x.shape, &wa.shape), x.dtype),
            spec(gemv_shape(&x.shape, &wb.shape), x.dtype),
            spec(gemv_shape(&x.shape, &wc.shape), x.dtype),
        )
    })]
    fn gemv3(
        x: FloatTensor<Self>,
        wa: FloatTensor<Self>,
        wb: FloatTensor<Self>,
        wc: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// `silu(x · wg) · (x · wu)` in one launch (a SwiGLU MLP's first half).
    ///
    /// # Shapes
    /// - `x`: `[rows, k]`, `wg`, `wu`: `[k, n]` in `x`'s dtype; returns `[rows, n]`
    #[fusion(dtype = x, shape = gemv_shape(x, wg))]
    fn gemv_swiglu(
        x: FloatTensor<Self>,
        wg: FloatTensor<Self>,
        wu: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// `(x + y, h · wa, h · wb, h · wc)` with `h = rms_norm(x + y)` (`gamma`, `eps`), in one
    /// launch: a decode layer's residual add, attention norm and Q, K, V projections.
    ///
    /// # Shapes
    /// - `x`, `y`: `[rows, k]`, `gamma`: `[k]`, `wa`: `[k, na]`, `wb`: `[k, nb]`, `wc`:
    ///   `[k, nc]`, one dtype; returns `[rows, k]`, `[rows, na]`, `[rows, nb]`, `[rows, nc]`
    #[fusion(meta = |x, _y, _gamma, _eps, wa, wb, wc| {
        let spec = burn::backend::fusion::custom::TensorSpec::new;
        (
            spec(x.shape.clone(), x.dtype),
            spec(gemv_shape(&x.shape, &wa.shape), x.dtype),
            spec(gemv_shape(&x.shape, &wb.shape), x.dtype),
            spec(gemv_shape(&x.shape, &wc.shape), x.dtype),
        )
    })]
    #[allow(clippy::too_many_arguments)]
    fn norm_gemv3(
        x: FloatTensor<Self>,
        y: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        wa: FloatTensor<Self>,
        wb: FloatTensor<Self>,
        wc: FloatTensor<Self>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );

    /// [`LayerKernels::norm_gemv3`] whose epilogue also rotates the queries and keys (RoPE at
    /// `positions`) and stores the keys and values into a static cache at `index`: a decode
    /// layer's residual add, attention norm, Q/K/V projections, RoPE and cache write in one
    /// launch. Returns `x + y`, the rotated queries and the written buffers.
    ///
    /// # Shapes
    /// - `x`, `y`: `[rows, k]` with `rows = batch · seq`, `gamma`: `[k]`, `wq`: `[k, hq · d]`,
    ///   `wk`, `wv`: `[k, hkv · d]`, one dtype
    /// - `positions`: `[rows]` int; `cos`, `sin`: `[max_positions, d / 2]` f32
    /// - `kc`, `vc`: `[batch, hkv, capacity, d]`; `index`: `[seq]` int, each `< capacity`
    /// - returns `[rows, k]`, `[rows, hq · d]` and `kc`'s and `vc`'s shapes
    #[fusion(meta = |x, _y, _gamma, _eps, wq, _wk, _wv, _positions, _cos, _sin, kc, vc, _index| {
        let spec = burn::backend::fusion::custom::TensorSpec::new;
        (
            spec(x.shape.clone(), x.dtype),
            spec(gemv_shape(&x.shape, &wq.shape), x.dtype),
            spec(kc.shape.clone(), kc.dtype),
            spec(vc.shape.clone(), vc.dtype),
        )
    })]
    #[allow(clippy::too_many_arguments)]
    fn norm_gemv3_rope_store(
        x: FloatTensor<Self>,
        y: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        wq: FloatTensor<Self>,
        wk: FloatTensor<Self>,
        wv: FloatTensor<Self>,
        positions: IntTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        kc: FloatTensor<Self>,
        vc: FloatTensor<Self>,
        index: IntTensor<Self>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );

    /// `(x + y, silu(h · wg) · (h · wu))` with `h = rms_norm(x + y)` (`gamma`, `eps`), in one
    /// launch: a decode layer's residual add after the attention, MLP norm and gated half.
    ///
    /// # Shapes
    /// - `x`, `y`: `[rows, k]`, `gamma`: `[k]`, `wg`, `wu`: `[k, n]`, one dtype; returns
    ///   `[rows, k]` and `[rows, n]`
    #[fusion(meta = |x, _y, _gamma, _eps, wg, _wu| {
        let spec = burn::backend::fusion::custom::TensorSpec::new;
        (
            spec(x.shape.clone(), x.dtype),
            spec(gemv_shape(&x.shape, &wg.shape), x.dtype),
        )
    })]
    fn norm_gemv_swiglu(
        x: FloatTensor<Self>,
        y: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        wg: FloatTensor<Self>,
        wu: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// The output shape of [`LayerKernels::gemv_t`]: `[rows, n]` for `e` `[n, k]`.
pub fn gemv_t_shape(x: &Shape, e: &Shape) -> Shape {
    Shape::new([x[0], e[0]])
}

/// The output shape of [`LayerKernels::gemv`]: `[rows, n]`.
pub fn gemv_shape(x: &Shape, w: &Shape) -> Shape {
    Shape::new([x[0], w[1]])
}

#[cfg(feature = "cube")]
mod cube_backend {
    use super::LayerKernels;
    use crate::kernels;
    use crate::kernels::linear::NormIn;
    use crate::route::count_launch;
    use burn::backend::tensor::{FloatTensor, IntTensor};
    use burn_cubecl::CubeBackend;

    impl LayerKernels for CubeBackend {
        fn rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
            count_launch("rms_norm");
            kernels::rms_norm::rms_norm(x, gamma, eps)
        }

        fn add_rms_norm(
            x: FloatTensor<Self>,
            y: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            eps: f64,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            count_launch("add_rms_norm");
            kernels::rms_norm::add_rms_norm(x, y, gamma, eps)
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

        fn rope2(
            q: FloatTensor<Self>,
            k: FloatTensor<Self>,
            positions: IntTensor<Self>,
            cos: FloatTensor<Self>,
            sin: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            count_launch("rope2");
            kernels::rope::rope2(q, k, positions, cos, sin)
        }

        fn store_kv(
            kc: FloatTensor<Self>,
            vc: FloatTensor<Self>,
            k: FloatTensor<Self>,
            v: FloatTensor<Self>,
            index: IntTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            count_launch("store_kv");
            kernels::store_kv::store_kv(kc, vc, k, v, index)
        }

        fn silu_mul(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
            count_launch("silu_mul");
            kernels::silu_mul::silu_mul(gate, up)
        }

        fn gemv(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
            count_launch("gemv");
            kernels::linear::gemv(x, w)
        }

        fn gemv_t(x: FloatTensor<Self>, e: FloatTensor<Self>) -> FloatTensor<Self> {
            count_launch("gemv_t");
            kernels::gemv_t::gemv_t(x, e)
        }

        fn gemv3(
            x: FloatTensor<Self>,
            wa: FloatTensor<Self>,
            wb: FloatTensor<Self>,
            wc: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            count_launch("gemv3");
            kernels::linear::gemv3(x, wa, wb, wc)
        }

        fn gemv_swiglu(
            x: FloatTensor<Self>,
            wg: FloatTensor<Self>,
            wu: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            count_launch("gemv_swiglu");
            kernels::linear::gemv_swiglu(x, wg, wu)
        }

        fn norm_gemv3(
            x: FloatTensor<Self>,
            y: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            eps: f64,
            wa: FloatTensor<Self>,
            wb: FloatTensor<Self>,
            wc: FloatTensor<Self>,
        ) -> (
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
        ) {
            count_launch("norm_gemv3");
            kernels::linear::norm_gemv3(x, NormIn { y, gamma, eps }, wa, wb, wc)
        }

        fn norm_gemv3_rope_store(
            x: FloatTensor<Self>,
            y: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            eps: f64,
            wq: FloatTensor<Self>,
            wk: FloatTensor<Self>,
            wv: FloatTensor<Self>,
            positions: IntTensor<Self>,
            cos: FloatTensor<Self>,
            sin: FloatTensor<Self>,
            kc: FloatTensor<Self>,
            vc: FloatTensor<Self>,
            index: IntTensor<Self>,
        ) -> (
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
        ) {
            use kernels::qkv_store::{CacheWrite, RopeIn, norm_gemv3_rope_store};
            count_launch("norm_gemv3_rope_store");
            norm_gemv3_rope_store(
                x,
                NormIn { y, gamma, eps },
                [wq, wk, wv],
                RopeIn {
                    positions,
                    cos,
                    sin,
                },
                CacheWrite {
                    keys: kc,
                    values: vc,
                    index,
                },
            )
        }

        fn norm_gemv_swiglu(
            x: FloatTensor<Self>,
            y: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            eps: f64,
            wg: FloatTensor<Self>,
            wu: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            count_launch("norm_gemv_swiglu");
            kernels::linear::norm_gemv_swiglu(x, NormIn { y, gamma, eps }, wg, wu)
        }
    }
}

//! The ops of a transformer layer besides its attention (the projections, RMSNorm, RoPE, the
//! SwiGLU gate), as a plug-in: plain tensor ops (differentiable, any backend) or one CubeCL
//! kernel each (inference only).
//!
//! At decode time a layer's work is dozens of tiny kernels, so their launch cost, not the
//! device, sets the speed: Burn's `RmsNorm` is six launches, a tensor-op RoPE ten (two
//! gathers, six element-wise ops, a two-part concatenation), `silu(g)·u` seven. The kernels
//! here do each in one, and a projection of a few rows is a GEMV with a lighter launch than
//! Burn's matmul. They ride along with the attention implementation
//! ([`crate::FusedLayers`]), which every forward pass already receives, so a model enables them for
//! inference without a new parameter and training keeps the tensor ops.

use burn::backend::Dispatch;
use burn::nn::RmsNorm;
use burn::tensor::{DType, Int, Tensor, activation};

use crate::LayerKernels;
use crate::cache::IndexedSlot;
use crate::rope::Rope;
use crate::route::{Grad, route};

mod cache_store;
use cache_store::{default_add_norm_qkv_rope_store, one_launch_store, qkv_store_mismatch};

/// Rows (`batch · seq`) up to which [`FusedOps::linear`] runs its GEMV kernel by default;
/// more rows go to Burn's matmul. `BURN_KERNELS_GEMV_MAX_ROWS` (1 to 256) moves the bound,
/// for measuring the two against each other on a device.
pub const GEMV_MAX_ROWS: usize = 16;

/// Rows (`batch · seq`) up to which [`FusedOps::linear_t`] runs its kernel (the tied LM head
/// of a decode step) by default, or up to `BURN_KERNELS_GEMV_MAX_ROWS` where that is more;
/// more rows go to Burn's matmul.
pub const LM_HEAD_MAX_ROWS: usize = 32;

/// The most rows the projections' GEMV kernels take: [`GEMV_MAX_ROWS`] unless
/// `BURN_KERNELS_GEMV_MAX_ROWS` holds a number from 1 to 256.
fn gemv_max_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("BURN_KERNELS_GEMV_MAX_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|v| (1..=256).contains(v))
            .unwrap_or(GEMV_MAX_ROWS)
    })
}

/// The layer ops a model runs around its attention.
///
/// # Shapes
/// - `rms_norm`: `x` `[batch, seq, hidden]` and a norm of `hidden`; returns `x`'s shape
/// - `rope`: `x` `[batch, heads, seq, head_dim]` (any strides), `positions` `[batch, seq]`;
///   returns `x`'s shape
/// - `silu_mul`: `gate`, `up` `[batch, seq, inter]`; returns `silu(gate) · up`
/// - `linear`: `x` `[batch, seq, in]`, `w` `[in, out]`; returns `x · w`, `[batch, seq, out]`
/// - `linear_t`: `x` `[batch, seq, in]`, `e` `[out, in]`; returns `x · eᵀ`, `[batch, seq, out]`
/// - `linear3`: `x` `[batch, seq, in]`, `wa`, `wb`, `wc` `[in, out_*]`; returns the three
///   products `[batch, seq, out_*]` (a layer's Q, K and V)
/// - `swiglu`: `x` `[batch, seq, in]`, `gate`, `up` `[in, inter]`; returns
///   `silu(x · gate) · (x · up)`, `[batch, seq, inter]`
/// - `add_rms_norm`: `x`, `y` `[batch, seq, hidden]`; returns `(x + y, rms_norm(x + y))`
/// - `rope2`: `rope` of `q` `[batch, q_heads, seq, head_dim]` and `k` `[batch, k_heads, seq,
///   head_dim]` at the same positions
/// - `add_norm_linear3`: `x`, `y` `[batch, seq, hidden]`; returns `x + y` and `linear3` of
///   `rms_norm(x + y)`
/// - `add_norm_swiglu`: `x`, `y` `[batch, seq, hidden]`; returns `x + y` and `swiglu` of
///   `rms_norm(x + y)`
/// - `add_norm_qkv_rope_store`: `x`, `y` `[batch, seq, hidden]`, `w` `[hidden, q_heads ·
///   head_dim]`, `[hidden, kv_heads · head_dim]` twice, `positions` `[batch, seq]`, the slot's
///   buffers `[batch, kv_heads, capacity, head_dim]` and index `[seq]`; returns `x + y`, the
///   rotated queries `[batch, q_heads, seq, head_dim]` and the slot with the rotated keys and
///   the values written at its index
pub trait LayerOps: Send + Sync + std::fmt::Debug {
    fn linear(&self, x: Tensor<3>, w: Tensor<2>) -> Tensor<3>;
    fn rms_norm(&self, norm: &RmsNorm, x: Tensor<3>) -> Tensor<3>;
    fn rope(&self, rope: &Rope, x: Tensor<4>, positions: Tensor<2, Int>) -> Tensor<4>;
    fn silu_mul(&self, gate: Tensor<3>, up: Tensor<3>) -> Tensor<3>;

    /// `x · eᵀ` for `e` `[out, in]` read along its rows (a tied LM head): Burn's matmul of
    /// `e`'s transposed view, or where `x` is f32 `(e · xᵀ)ᵀ` (`e` in its own layout).
    fn linear_t(&self, x: Tensor<3>, e: Tensor<2>) -> Tensor<3> {
        let [b, s, k] = x.dims();
        let n = e.dims()[0];
        let x = x.reshape([b * s, k]);
        let out = if matches!(x.dtype(), DType::F16 | DType::BF16) {
            crate::gemm::matmul(x, e.transpose())
        } else {
            e.matmul(x.transpose()).transpose()
        };
        out.reshape([b, s, n])
    }

    fn linear3(
        &self,
        x: Tensor<3>,
        wa: Tensor<2>,
        wb: Tensor<2>,
        wc: Tensor<2>,
    ) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
        (
            self.linear(x.clone(), wa),
            self.linear(x.clone(), wb),
            self.linear(x, wc),
        )
    }

    fn swiglu(&self, x: Tensor<3>, gate: Tensor<2>, up: Tensor<2>) -> Tensor<3> {
        self.silu_mul(self.linear(x.clone(), gate), self.linear(x, up))
    }

    fn add_rms_norm(&self, norm: &RmsNorm, x: Tensor<3>, y: Tensor<3>) -> (Tensor<3>, Tensor<3>) {
        let sum = x + y;
        (sum.clone(), self.rms_norm(norm, sum))
    }

    fn rope2(
        &self,
        rope: &Rope,
        q: Tensor<4>,
        k: Tensor<4>,
        positions: Tensor<2, Int>,
    ) -> (Tensor<4>, Tensor<4>) {
        (
            self.rope(rope, q, positions.clone()),
            self.rope(rope, k, positions),
        )
    }

    fn add_norm_linear3(
        &self,
        norm: &RmsNorm,
        x: Tensor<3>,
        y: Tensor<3>,
        w: [Tensor<2>; 3],
    ) -> (Tensor<3>, [Tensor<3>; 3]) {
        default_add_norm_linear3(self, norm, x, y, w)
    }

    fn add_norm_swiglu(
        &self,
        norm: &RmsNorm,
        x: Tensor<3>,
        y: Tensor<3>,
        gate: Tensor<2>,
        up: Tensor<2>,
    ) -> (Tensor<3>, Tensor<3>) {
        default_add_norm_swiglu(self, norm, x, y, gate, up)
    }

    /// A decode layer's steps before its attention: [`LayerOps::add_norm_linear3`], RoPE of
    /// the queries and keys ([`LayerOps::rope2`]) and the keys' and values' store into a
    /// static cache's slot ([`crate::KvCache::indexed_slot`]).
    #[allow(clippy::too_many_arguments)]
    fn add_norm_qkv_rope_store(
        &self,
        norm: &RmsNorm,
        x: Tensor<3>,
        y: Tensor<3>,
        w: [Tensor<2>; 3],
        rope: &Rope,
        positions: Tensor<2, Int>,
        slot: IndexedSlot,
    ) -> (Tensor<3>, Tensor<4>, IndexedSlot) {
        default_add_norm_qkv_rope_store(self, norm, x, y, w, rope, positions, slot)
    }
}

/// Plain tensor ops: what Burn's autodiff differentiates, and the oracle of the kernels.
#[derive(Debug, Clone, Copy, Default)]
pub struct TensorOps;

impl LayerOps for TensorOps {
    /// f16/bf16 projections run [`crate::gemm::linear`] (a fixed kernel where Burn's
    /// autotuned matmul fails on Hopper), f32 ones Burn's matmul.
    fn linear(&self, x: Tensor<3>, w: Tensor<2>) -> Tensor<3> {
        crate::gemm::linear(x, w)
    }

    fn rms_norm(&self, norm: &RmsNorm, x: Tensor<3>) -> Tensor<3> {
        norm.forward(x)
    }

    fn rope(&self, rope: &Rope, x: Tensor<4>, positions: Tensor<2, Int>) -> Tensor<4> {
        rope.apply(x, positions)
    }

    fn silu_mul(&self, gate: Tensor<3>, up: Tensor<3>) -> Tensor<3> {
        activation::silu(gate) * up
    }
}

/// The layer ops as one CubeCL kernel each where the tensors live on a CubeCL device and no
/// gradient is needed ([`crate::LayerKernels`], through Burn's `Dispatch`); elsewhere, and for
/// projections of more than [`GEMV_MAX_ROWS`] rows (see `BURN_KERNELS_GEMV_MAX_ROWS`), the
/// [`TensorOps`].
#[derive(Debug, Clone, Copy, Default)]
pub struct FusedOps;

impl LayerOps for FusedOps {
    fn linear(&self, x: Tensor<3>, w: Tensor<2>) -> Tensor<3> {
        let [b, s, k] = x.dims();
        let n = w.dims()[1];
        let unsupported = if b * s > gemv_max_rows() {
            // Not logged as a fallback: Burn's matmul is the right kernel for many rows.
            return TensorOps.linear(x, w);
        } else if x.dtype() != w.dtype() {
            Some(format!("x is {:?}, w is {:?}", x.dtype(), w.dtype()))
        } else {
            None
        };
        if !route("gemv", &x.device(), Grad::ForwardOnly, unsupported) {
            return TensorOps.linear(x, w);
        }
        let out = Dispatch::gemv(x.reshape([b * s, k]).into_dispatch(), w.into_dispatch());
        Tensor::<2>::from_dispatch(out).reshape([b, s, n])
    }

    /// The GEMV-T kernel for up to [`LM_HEAD_MAX_ROWS`] rows.
    fn linear_t(&self, x: Tensor<3>, e: Tensor<2>) -> Tensor<3> {
        let [b, s, k] = x.dims();
        let n = e.dims()[0];
        let unsupported = if b * s > LM_HEAD_MAX_ROWS.max(gemv_max_rows()) {
            return TensorOps.linear_t(x, e);
        } else if x.dtype() != e.dtype() || e.dims()[1] != k {
            Some(format!(
                "x {:?} {:?}, e {:?} {:?}",
                x.dims(),
                x.dtype(),
                e.dims(),
                e.dtype()
            ))
        } else {
            None
        };
        if !route("gemv_t", &x.device(), Grad::ForwardOnly, unsupported) {
            return TensorOps.linear_t(x, e);
        }
        let out = Dispatch::gemv_t(x.reshape([b * s, k]).into_dispatch(), e.into_dispatch());
        Tensor::<2>::from_dispatch(out).reshape([b, s, n])
    }

    fn linear3(
        &self,
        x: Tensor<3>,
        wa: Tensor<2>,
        wb: Tensor<2>,
        wc: Tensor<2>,
    ) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
        let [b, s, k] = x.dims();
        let ns = [&wa, &wb, &wc].map(|w| w.dims()[1]);
        let unsupported = if b * s > gemv_max_rows() {
            return TensorOps.linear3(x, wa, wb, wc);
        } else if [&wa, &wb, &wc].iter().any(|w| w.dtype() != x.dtype()) {
            Some(format!("x is {:?}, the weights differ", x.dtype()))
        } else {
            None
        };
        if !route("gemv3", &x.device(), Grad::ForwardOnly, unsupported) {
            return TensorOps.linear3(x, wa, wb, wc);
        }
        let (oa, ob, oc) = Dispatch::gemv3(
            x.reshape([b * s, k]).into_dispatch(),
            wa.into_dispatch(),
            wb.into_dispatch(),
            wc.into_dispatch(),
        );
        let out = |t, n: usize| Tensor::<2>::from_dispatch(t).reshape([b, s, n]);
        (out(oa, ns[0]), out(ob, ns[1]), out(oc, ns[2]))
    }

    fn swiglu(&self, x: Tensor<3>, gate: Tensor<2>, up: Tensor<2>) -> Tensor<3> {
        let [b, s, k] = x.dims();
        let n = gate.dims()[1];
        let unsupported = if b * s > gemv_max_rows() {
            return TensorOps.swiglu(x, gate, up);
        } else {
            swiglu_mismatch(&x, &gate, &up)
        };
        if !route("gemv_swiglu", &x.device(), Grad::ForwardOnly, unsupported) {
            return TensorOps.swiglu(x, gate, up);
        }
        let out = Dispatch::gemv_swiglu(
            x.reshape([b * s, k]).into_dispatch(),
            gate.into_dispatch(),
            up.into_dispatch(),
        );
        Tensor::<2>::from_dispatch(out).reshape([b, s, n])
    }

    fn add_norm_linear3(
        &self,
        norm: &RmsNorm,
        x: Tensor<3>,
        y: Tensor<3>,
        w: [Tensor<2>; 3],
    ) -> (Tensor<3>, [Tensor<3>; 3]) {
        let [b, s, k] = x.dims();
        let unsupported = if b * s > gemv_max_rows() {
            return default_add_norm_linear3(self, norm, x, y, w);
        } else {
            mismatch(&x, &y).or_else(|| {
                w.iter()
                    .any(|w| w.dtype() != x.dtype() || w.dims()[0] != k)
                    .then(|| format!("x is {:?} {:?}, the weights differ", x.dims(), x.dtype()))
            })
        };
        if !route("norm_gemv3", &x.device(), Grad::ForwardOnly, unsupported) {
            return default_add_norm_linear3(self, norm, x, y, w);
        }
        let ns = w.each_ref().map(|w| w.dims()[1]);
        let gamma = norm.gamma.val().cast(x.dtype());
        let [wa, wb, wc] = w.map(|w| w.into_dispatch());
        let rows = |t: Tensor<3>| t.reshape([b * s, k]).into_dispatch();
        let (sum, oa, ob, oc) = Dispatch::norm_gemv3(
            rows(x),
            rows(y),
            gamma.into_dispatch(),
            norm.epsilon,
            wa,
            wb,
            wc,
        );
        let out = |t, n: usize| Tensor::<2>::from_dispatch(t).reshape([b, s, n]);
        (
            out(sum, k),
            [out(oa, ns[0]), out(ob, ns[1]), out(oc, ns[2])],
        )
    }

    fn add_norm_swiglu(
        &self,
        norm: &RmsNorm,
        x: Tensor<3>,
        y: Tensor<3>,
        gate: Tensor<2>,
        up: Tensor<2>,
    ) -> (Tensor<3>, Tensor<3>) {
        let [b, s, k] = x.dims();
        let n = gate.dims()[1];
        let unsupported = if b * s > gemv_max_rows() {
            return default_add_norm_swiglu(self, norm, x, y, gate, up);
        } else {
            swiglu_mismatch(&x, &gate, &up).or_else(|| mismatch(&x, &y))
        };
        if !route(
            "norm_gemv_swiglu",
            &x.device(),
            Grad::ForwardOnly,
            unsupported,
        ) {
            return default_add_norm_swiglu(self, norm, x, y, gate, up);
        }
        let gamma = norm.gamma.val().cast(x.dtype());
        let rows = |t: Tensor<3>| t.reshape([b * s, k]).into_dispatch();
        let (sum, out) = Dispatch::norm_gemv_swiglu(
            rows(x),
            rows(y),
            gamma.into_dispatch(),
            norm.epsilon,
            gate.into_dispatch(),
            up.into_dispatch(),
        );
        let out3 = |t, n: usize| Tensor::<2>::from_dispatch(t).reshape([b, s, n]);
        (out3(sum, k), out3(out, n))
    }

    #[allow(clippy::too_many_arguments)]
    fn add_norm_qkv_rope_store(
        &self,
        norm: &RmsNorm,
        x: Tensor<3>,
        y: Tensor<3>,
        w: [Tensor<2>; 3],
        rope: &Rope,
        positions: Tensor<2, Int>,
        slot: IndexedSlot,
    ) -> (Tensor<3>, Tensor<4>, IndexedSlot) {
        let [b, s, k] = x.dims();
        if b * s > gemv_max_rows() || !one_launch_store() {
            return default_add_norm_qkv_rope_store(self, norm, x, y, w, rope, positions, slot);
        }
        let unsupported = qkv_store_mismatch(&x, &y, &w, &positions, &slot);
        if !route(
            "norm_gemv3_rope_store",
            &x.device(),
            Grad::ForwardOnly,
            unsupported,
        ) {
            return default_add_norm_qkv_rope_store(self, norm, x, y, w, rope, positions, slot);
        }
        let d = slot.keys.dims()[3];
        let hq = w[0].dims()[1] / d;
        let gamma = norm.gamma.val().cast(x.dtype());
        let (cos, sin) = rope.tables();
        let (cos, sin) = (cos.clone().cast(DType::F32), sin.clone().cast(DType::F32));
        let [wq, wk, wv] = w.map(|w| w.into_dispatch());
        let rows = |t: Tensor<3>| t.reshape([b * s, k]).into_dispatch();
        let (sum, q, kc, vc) = Dispatch::norm_gemv3_rope_store(
            rows(x),
            rows(y),
            gamma.into_dispatch(),
            norm.epsilon,
            wq,
            wk,
            wv,
            positions.reshape([b * s]).into_dispatch(),
            cos.into_dispatch(),
            sin.into_dispatch(),
            slot.keys.into_dispatch(),
            slot.values.into_dispatch(),
            slot.index.clone().into_dispatch(),
        );
        let q = Tensor::<2>::from_dispatch(q)
            .reshape([b, s, hq, d])
            .swap_dims(1, 2);
        let slot = IndexedSlot {
            keys: Tensor::from_dispatch(kc),
            values: Tensor::from_dispatch(vc),
            index: slot.index,
        };
        (Tensor::<2>::from_dispatch(sum).reshape([b, s, k]), q, slot)
    }

    fn add_rms_norm(&self, norm: &RmsNorm, x: Tensor<3>, y: Tensor<3>) -> (Tensor<3>, Tensor<3>) {
        let unsupported = mismatch(&x, &y);
        if !route("add_rms_norm", &x.device(), Grad::ForwardOnly, unsupported) {
            return TensorOps.add_rms_norm(norm, x, y);
        }
        let gamma = norm.gamma.val().cast(x.dtype());
        let (sum, out) = Dispatch::add_rms_norm(
            x.into_dispatch(),
            y.into_dispatch(),
            gamma.into_dispatch(),
            norm.epsilon,
        );
        (Tensor::from_dispatch(sum), Tensor::from_dispatch(out))
    }

    fn rms_norm(&self, norm: &RmsNorm, x: Tensor<3>) -> Tensor<3> {
        if !route("rms_norm", &x.device(), Grad::ForwardOnly, None) {
            return TensorOps.rms_norm(norm, x);
        }
        let gamma = norm.gamma.val().cast(x.dtype());
        Tensor::from_dispatch(Dispatch::rms_norm(
            x.into_dispatch(),
            gamma.into_dispatch(),
            norm.epsilon,
        ))
    }

    fn rope(&self, rope: &Rope, x: Tensor<4>, positions: Tensor<2, Int>) -> Tensor<4> {
        if !route("rope", &x.device(), Grad::ForwardOnly, None) {
            return TensorOps.rope(rope, x, positions);
        }
        // The kernel reads f32 tables (what `Rope::new` builds).
        let (cos, sin) = rope.tables();
        let (cos, sin) = (cos.clone().cast(DType::F32), sin.clone().cast(DType::F32));
        Tensor::from_dispatch(Dispatch::rope(
            x.into_dispatch(),
            positions.into_dispatch(),
            cos.into_dispatch(),
            sin.into_dispatch(),
        ))
    }

    fn rope2(
        &self,
        rope: &Rope,
        q: Tensor<4>,
        k: Tensor<4>,
        positions: Tensor<2, Int>,
    ) -> (Tensor<4>, Tensor<4>) {
        let unsupported =
            (q.dtype() != k.dtype()).then(|| format!("q is {:?}, k is {:?}", q.dtype(), k.dtype()));
        if !route("rope2", &q.device(), Grad::ForwardOnly, unsupported) {
            return TensorOps.rope2(rope, q, k, positions);
        }
        let (cos, sin) = rope.tables();
        let (cos, sin) = (cos.clone().cast(DType::F32), sin.clone().cast(DType::F32));
        let (q, k) = Dispatch::rope2(
            q.into_dispatch(),
            k.into_dispatch(),
            positions.into_dispatch(),
            cos.into_dispatch(),
            sin.into_dispatch(),
        );
        (Tensor::from_dispatch(q), Tensor::from_dispatch(k))
    }

    fn silu_mul(&self, gate: Tensor<3>, up: Tensor<3>) -> Tensor<3> {
        let unsupported = (gate.dims() != up.dims())
            .then(|| format!("gate {:?} and up {:?} differ", gate.dims(), up.dims()));
        if !route("silu_mul", &gate.device(), Grad::ForwardOnly, unsupported) {
            return TensorOps.silu_mul(gate, up);
        }
        Tensor::from_dispatch(Dispatch::silu_mul(gate.into_dispatch(), up.into_dispatch()))
    }
}

/// Why `x`, `gate` and `up` cannot go to a GEMV+SwiGLU kernel, if they cannot (shapes that
/// do not fit, dtypes that differ).
fn swiglu_mismatch(x: &Tensor<3>, gate: &Tensor<2>, up: &Tensor<2>) -> Option<String> {
    if gate.dims() != up.dims() || gate.dims()[0] != x.dims()[2] {
        Some(format!(
            "x {:?}, gate {:?} and up {:?} do not fit",
            x.dims(),
            gate.dims(),
            up.dims()
        ))
    } else if gate.dtype() != x.dtype() || up.dtype() != x.dtype() {
        Some(format!("x is {:?}, the weights differ", x.dtype()))
    } else {
        None
    }
}

/// Why `x` and `y` cannot be added by a kernel, if they cannot (shapes or dtypes differ).
fn mismatch(x: &Tensor<3>, y: &Tensor<3>) -> Option<String> {
    (x.dims() != y.dims() || x.dtype() != y.dtype()).then(|| {
        format!(
            "x {:?} {:?} and y {:?} {:?} differ",
            x.dims(),
            x.dtype(),
            y.dims(),
            y.dtype()
        )
    })
}

/// [`LayerOps::add_norm_linear3`]'s composition (the add and norm, then the projections) with
/// `ops`' own add/norm and projections: the trait's default, and what [`FusedOps`] runs where
/// the one-launch kernel does not apply.
fn default_add_norm_linear3<O: LayerOps + ?Sized>(
    ops: &O,
    norm: &RmsNorm,
    x: Tensor<3>,
    y: Tensor<3>,
    w: [Tensor<2>; 3],
) -> (Tensor<3>, [Tensor<3>; 3]) {
    let (sum, h) = ops.add_rms_norm(norm, x, y);
    let [wa, wb, wc] = w;
    let (a, b, c) = ops.linear3(h, wa, wb, wc);
    (sum, [a, b, c])
}

/// [`LayerOps::add_norm_swiglu`]'s composition with `ops`' own kernels.
fn default_add_norm_swiglu<O: LayerOps + ?Sized>(
    ops: &O,
    norm: &RmsNorm,
    x: Tensor<3>,
    y: Tensor<3>,
    gate: Tensor<2>,
    up: Tensor<2>,
) -> (Tensor<3>, Tensor<3>) {
    let (sum, h) = ops.add_rms_norm(norm, x, y);
    (sum, ops.swiglu(h, gate, up))
}

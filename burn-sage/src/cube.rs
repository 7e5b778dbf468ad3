//! The Sage kernels as a Burn backend extension: `CubeBackend` runs them, Burn's `Dispatch`
//! routes to it, and `Fusion<CubeBackend>` (generated) registers each call as a custom
//! operation of the fused stream. [`crate::sage_attention`] and [`crate::quantize_stage`]
//! decide when to call them.

// The attention ops take Q, K and the five outputs of the tensor-op stages besides the plan.
#![allow(clippy::too_many_arguments)]
// Without a CubeCL runtime the generated `Dispatch` methods have no backend to pass their
// arguments to.
#![cfg_attr(not(feature = "cube"), allow(unused_variables))]

use burn::backend::{Backend, backend_extension, tensor::FloatTensor};
use burn::tensor::Shape;

use crate::kernels::KernelChoice;
use crate::{GroupLayout, SagePlan};

/// The CubeCL kernels of Sage attention (forward only).
///
/// Call them through [`crate::sage_attention`] and [`crate::quantize_stage`], which validate
/// the input and pick the kernel first ([`crate::sage_kernel`]); the methods here assume valid
/// input and a kernel that takes it.
///
/// # Shapes
/// - `q`: `[b, hq, sq, d]`, `k`: `[b, hkv, skv, d]`, in the plan's dtype
/// - `q_mean`: `[b, hq, nm, d]` f32, `k_mean`: `[b, hkv, 1, d]` f32, `delta_s`:
///   `[b, hq, nm, skv]` f32 when the plan smooths Q (any f32 tensor otherwise, unread),
///   `v`: `[b, hkv, skv, d]`, `post`: `[b, hkv, 1, d]` f32: the outputs of
///   [`crate::prep::prepare_with`]
#[backend_extension(
    Cube: cfg(feature = "cube"),
    Fusion: cfg(all(feature = "cube", feature = "fusion")),
)]
pub trait SageKernels: Backend {
    /// Quantizes Q and K and runs the attention kernel `kernel`; returns the output, q's shape
    /// and dtype.
    #[fusion(dtype = q, shape = q)]
    fn sage_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        q_mean: FloatTensor<Self>,
        k_mean: FloatTensor<Self>,
        delta_s: FloatTensor<Self>,
        v: FloatTensor<Self>,
        post: FloatTensor<Self>,
        plan: SagePlan,
        kernel: KernelChoice,
    ) -> FloatTensor<Self>;

    /// [`SageKernels::sage_attention`] that also returns the log-sum-exp of each query row's
    /// scaled scores, `[b, hq, sq]` f32 ([`crate::kernels::lse_shape`]).
    #[fusion(meta = fusion_meta::attention_lse)]
    fn sage_attention_lse(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        q_mean: FloatTensor<Self>,
        k_mean: FloatTensor<Self>,
        delta_s: FloatTensor<Self>,
        v: FloatTensor<Self>,
        post: FloatTensor<Self>,
        plan: SagePlan,
        kernel: KernelChoice,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `x − mean` quantized per group (see [`crate::quantize_stage`]): the integers as f32
    /// values, x's shape, and the scales, `[b, h, layout.groups(s)]` f32
    /// ([`crate::kernels::scales_shape`]).
    #[fusion(meta = fusion_meta::quantize)]
    fn sage_quantize(
        x: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        mean_block: usize,
        layout: GroupLayout,
        qmax: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `lhs · rhs` (`[b, h, m, k] · [b, h, k, n]`, f32) by a GEMM that is not autotuned: ΔS
    /// (see [`crate::prep::prepare_with`]).
    #[fusion(dtype = lhs, shape = matmul_shape(lhs, rhs))]
    fn sage_fixed_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// The output shape of [`SageKernels::sage_fixed_matmul`]: `[b, h, m, n]`.
pub fn matmul_shape(lhs: &Shape, rhs: &Shape) -> Shape {
    Shape::new([lhs[0], lhs[1], lhs[2], rhs[3]])
}

/// Output metadata of the ops with several outputs, for `Fusion<CubeBackend>`.
#[cfg(all(feature = "cube", feature = "fusion"))]
mod fusion_meta {
    use burn::backend::fusion::custom::TensorSpec;
    use burn::tensor::DType;

    use crate::kernels::{KernelChoice, lse_shape, scales_shape};
    use crate::{GroupLayout, SagePlan};

    pub fn attention_lse(
        q: &TensorSpec,
        _k: &TensorSpec,
        _q_mean: &TensorSpec,
        _k_mean: &TensorSpec,
        _delta_s: &TensorSpec,
        _v: &TensorSpec,
        _post: &TensorSpec,
        _plan: &SagePlan,
        _kernel: &KernelChoice,
    ) -> (TensorSpec, TensorSpec) {
        (q.clone(), TensorSpec::new(lse_shape(&q.shape), DType::F32))
    }

    pub fn quantize(
        x: &TensorSpec,
        _mean: &TensorSpec,
        _mean_block: &usize,
        layout: &GroupLayout,
        _qmax: &f32,
    ) -> (TensorSpec, TensorSpec) {
        (
            TensorSpec::new(x.shape.clone(), DType::F32),
            TensorSpec::new(scales_shape(&x.shape, layout), DType::F32),
        )
    }
}

#[cfg(feature = "cube")]
mod cube_backend {
    use burn::backend::ops::IntTensorOps;
    use burn::backend::tensor::FloatTensor;
    use burn::tensor::FloatDType;
    use burn_cubecl::CubeBackend;
    use burn_kernels_core::route::count_launch;

    use super::SageKernels;
    use crate::kernels::{self, KernelChoice, PreparedInputs};
    use crate::{GroupLayout, SageOptions, SagePlan};

    /// Counts the launch of the attention op and of the kernel that runs it.
    fn count(kernel: KernelChoice) {
        count_launch("sage_attention");
        count_launch(match kernel {
            KernelChoice::Unit => "sage_attention_unit",
            KernelChoice::Cmma => "sage_attention_cmma",
            KernelChoice::Mma => "sage_attention_mma",
            KernelChoice::Wgmma => "sage_attention_wgmma",
            KernelChoice::Tuned => "sage_attention_tuned",
        });
    }

    /// `plan` with or without the log-sum-exp output.
    fn with_lse(plan: SagePlan, return_lse: bool) -> SagePlan {
        SagePlan {
            opts: SageOptions {
                return_lse,
                ..plan.opts
            },
            ..plan
        }
    }

    fn inputs(
        q: FloatTensor<CubeBackend>,
        k: FloatTensor<CubeBackend>,
        q_mean: FloatTensor<CubeBackend>,
        k_mean: FloatTensor<CubeBackend>,
        delta_s: FloatTensor<CubeBackend>,
        v: FloatTensor<CubeBackend>,
        post: FloatTensor<CubeBackend>,
        plan: &SagePlan,
    ) -> PreparedInputs {
        PreparedInputs {
            q,
            k,
            q_mean,
            k_mean,
            delta_s: plan.opts.smooth_q.then_some(delta_s),
            v,
            post,
        }
    }

    impl SageKernels for CubeBackend {
        fn sage_attention(
            q: FloatTensor<Self>,
            k: FloatTensor<Self>,
            q_mean: FloatTensor<Self>,
            k_mean: FloatTensor<Self>,
            delta_s: FloatTensor<Self>,
            v: FloatTensor<Self>,
            post: FloatTensor<Self>,
            plan: SagePlan,
            kernel: KernelChoice,
        ) -> FloatTensor<Self> {
            count(kernel);
            let plan = with_lse(plan, false);
            let inputs = inputs(q, k, q_mean, k_mean, delta_s, v, post, &plan);
            kernels::sage_forward(inputs, &plan, kernel).0
        }

        fn sage_attention_lse(
            q: FloatTensor<Self>,
            k: FloatTensor<Self>,
            q_mean: FloatTensor<Self>,
            k_mean: FloatTensor<Self>,
            delta_s: FloatTensor<Self>,
            v: FloatTensor<Self>,
            post: FloatTensor<Self>,
            plan: SagePlan,
            kernel: KernelChoice,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            count(kernel);
            let plan = with_lse(plan, true);
            let inputs = inputs(q, k, q_mean, k_mean, delta_s, v, post, &plan);
            let (out, lse) = kernels::sage_forward(inputs, &plan, kernel);
            (out, lse.expect("the plan asks for the log-sum-exp"))
        }

        fn sage_quantize(
            x: FloatTensor<Self>,
            mean: FloatTensor<Self>,
            mean_block: usize,
            layout: GroupLayout,
            qmax: f32,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            count_launch("sage_quantize");
            let int_dtype = kernels::int_storage(&x.client)
                .expect("quantize_stage checked the integer storage");
            let (ints, scales) =
                kernels::quantize::quantize(x, mean, mean_block, layout, qmax, int_dtype);
            (Self::int_into_float(ints, FloatDType::F32), scales)
        }

        fn sage_fixed_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
            kernels::fixed_matmul(lhs, rhs)
        }
    }
}

//! `CubeBackend` runs the CubeCL kernels; a configuration no kernel handles runs the reference
//! (with a log line), never a wrong answer.

use burn::tensor::{Tensor, TensorPrimitive, ops::FloatTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use burn::tensor::{DType, Int};

use crate::{GroupLayout, SageBackend, SagePlan, kernels, reference};

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> SageBackend
    for CubeBackend<R, F, I, BT>
{
    fn sage_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        plan: &SagePlan,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let run = kernels::choose(&q.client, plan).and_then(|choice| {
            kernels::sage_forward::<R, F, I, BT>(q.clone(), k.clone(), v.clone(), plan, choice)
        });
        match run {
            Ok(out) => out,
            Err(why) => {
                log::info!("burn-sage: {why}; running the tensor-op reference");
                let t = |x| Tensor::<Self, 4>::from_primitive(TensorPrimitive::Float(x));
                let (out, lse) = reference::sage_attention(t(q), t(k), t(v), plan);
                (
                    out.into_primitive().tensor(),
                    lse.map(|l| l.into_primitive().tensor()),
                )
            }
        }
    }

    fn sage_kernel(device: &Self::Device, plan: &SagePlan) -> Option<kernels::KernelChoice> {
        kernels::choose(&R::client(device), plan).ok()
    }

    fn sage_quantize(
        x: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        mean_block: usize,
        layout: GroupLayout,
        qmax: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let int_dtype = kernels::int_storage(&x.client).unwrap_or(DType::I32);
        let (ints, scales) =
            kernels::quantize::quantize(x, mean, mean_block, layout, qmax, int_dtype);
        let ints = Tensor::<Self, 4, Int>::from_primitive(ints)
            .float()
            .cast(DType::F32);
        (ints.into_primitive().tensor(), scales)
    }
}

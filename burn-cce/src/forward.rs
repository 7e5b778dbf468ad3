//! `CubeBackend` runs the CubeCL kernels.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::{CceBackend, LceGrads, LceParams, chunked, kernels};

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> CceBackend
    for CubeBackend<R, F, I, BT>
{
    fn logsumexp_rows(logits: FloatTensor<Self>, softcap: Option<f32>) -> FloatTensor<Self> {
        kernels::lse::logsumexp_rows(logits, softcap)
    }

    fn linear_ce_forward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        targets: IntTensor<Self>,
        params: &LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        chunked::forward::<R, F, I, BT>(e, c, bias, targets, params)
    }

    fn linear_ce_backward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        params: &LceParams,
    ) -> LceGrads<Self> {
        chunked::backward::<R, F, I, BT>(e, c, bias, targets, lse, dout, params)
    }

    fn memory_in_use(device: &Self::Device) -> Option<u64> {
        let client = R::client(device);
        client.memory_usage().ok().map(|usage| usage.bytes_in_use)
    }
}

//! `CubeBackend` runs the CubeCL kernels: the row-wise log-sum-exp kernel and the chunked
//! linear cross-entropy of [`crate::chunked`].

use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn_cubecl::CubeBackend;
use burn_kernels_core::route::count_launch;

use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;

use crate::kernels::fused;
use crate::{CceKernels, LceParams, chunked, kernels, live};

impl CceKernels for CubeBackend {
    fn logsumexp_rows(logits: FloatTensor<Self>, softcap: Option<f32>) -> FloatTensor<Self> {
        count_launch("logsumexp");
        kernels::lse::logsumexp_rows(logits, softcap)
    }

    fn linear_ce_forward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        count_launch("linear_ce_forward");
        chunked::forward(e, c, None, targets, &params)
    }

    fn linear_ce_forward_bias(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        count_launch("linear_ce_forward");
        chunked::forward(e, c, Some(bias), targets, &params)
    }

    fn linear_ce_backward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        count_launch("linear_ce_backward");
        let (de, dc, _) = chunked::backward(e, c, None, targets, lse, dout, &params);
        (de, dc)
    }

    fn linear_ce_backward_bias(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        count_launch("linear_ce_backward");
        let (de, dc, db) = chunked::backward(e, c, Some(bias), targets, lse, dout, &params);
        (de, dc, db.expect("a bias has a gradient"))
    }

    fn linear_ce_loss(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        count_launch("linear_ce_forward");
        loss(chunked::forward(e, c, None, targets, &params))
    }

    fn linear_ce_loss_bias(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        count_launch("linear_ce_forward");
        loss(chunked::forward(e, c, Some(bias), targets, &params))
    }

    fn linear_ce_loss_train(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        count_launch("linear_ce_forward");
        if fused::wanted(&params, false, "training forward")
            && let Some((lse, target, de_unit)) =
                fused::forward_grad(e.clone(), c.clone(), targets.clone(), params.softcap)
        {
            live::sample(&de_unit, "forward state");
            let (loss, lse) = loss((lse, target));
            return (loss, lse, de_unit);
        }
        // Declined: the backward declines the same inputs and never reads this buffer.
        let unwritten = empty_device_contiguous_dtype(
            e.client.clone(),
            e.device.clone(),
            e.meta.shape().clone(),
            e.dtype,
        );
        let (loss, lse) = loss(chunked::forward(e, c, None, targets, &params));
        (loss, lse, unwritten)
    }

    fn linear_ce_backward_train(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        de_unit: FloatTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        count_launch("linear_ce_backward");
        if fused::wanted(&params, false, "training backward")
            && let Some((de, dc)) = fused::backward_dc(
                e.clone(),
                c.clone(),
                targets.clone(),
                lse.clone(),
                dout.clone(),
                de_unit,
                params.softcap,
                params.filter_eps,
            )
        {
            live::sample(&dc, "gradients");
            return (de, dc);
        }
        let (de, dc, _) = chunked::backward(e, c, None, targets, lse, dout, &params);
        (de, dc)
    }
}

/// `(lse − target_logit, lse)` from the forward's `(lse, target_logit)`.
fn loss(
    (lse, target): (FloatTensor<CubeBackend>, FloatTensor<CubeBackend>),
) -> (FloatTensor<CubeBackend>, FloatTensor<CubeBackend>) {
    (CubeBackend::float_sub(lse.clone(), target), lse)
}

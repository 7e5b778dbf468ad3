//! `CubeBackend` runs the CubeCL kernels.

use burn::tensor::ops::FloatTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::{CceBackend, kernels};

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> CceBackend
    for CubeBackend<R, F, I, BT>
{
    fn logsumexp_rows(logits: FloatTensor<Self>, softcap: Option<f32>) -> FloatTensor<Self> {
        kernels::lse::logsumexp_rows(logits, softcap)
    }
}

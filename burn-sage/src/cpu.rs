//! The CPU backend uses the reference (the trait's default method).

use burn::backend::NdArray;
use burn::backend::ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArrayTensor, QuantElement, SharedArray,
};

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> crate::SageBackend
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
}

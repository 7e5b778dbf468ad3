//! KIVI-style group quantization: packed codes, their layout, quantize and dequantize (see the
//! crate docs' Quantization section).

use burn::backend::Dispatch;
use burn::tensor::{DType, Int, Tensor};

use crate::{KvCacheError, KvKernels, PackedPrimitive, kernel, reference};

/// Packed quantization codes with their per-group scale and min.
#[derive(Debug, Clone)]
pub struct Packed {
    /// `[rows, groups · words_per_group]`, u32.
    pub words: Tensor<2, Int>,
    /// `[rows, groups]`, the dtype of the quantized tensor.
    pub scale: Tensor<2>,
    /// `[rows, groups]`, the dtype of the quantized tensor.
    pub min: Tensor<2>,
}

impl Packed {
    /// Bytes of the words, scales and mins.
    pub fn bytes(&self) -> usize {
        bytes_of(&self.scale) + bytes_of(&self.min) + bytes_of_int(&self.words)
    }

    /// The backend primitives, for [`KvKernels`].
    pub fn into_primitive(self) -> PackedPrimitive<Dispatch> {
        PackedPrimitive {
            words: self.words.into_dispatch(),
            scale: self.scale.into_dispatch(),
            min: self.min.into_dispatch(),
        }
    }

    /// The tensors of [`KvKernels`] primitives.
    pub fn from_primitive(p: PackedPrimitive<Dispatch>) -> Self {
        Self {
            words: Tensor::from_dispatch(p.words),
            scale: Tensor::from_dispatch(p.scale),
            min: Tensor::from_dispatch(p.min),
        }
    }

    /// Why the kernels cannot read these words, if they cannot: they read `u32` words and
    /// scales and mins of one dtype.
    pub(crate) fn unsupported(&self) -> Option<String> {
        if self.words.dtype() != DType::U32 {
            Some(format!("the words are {:?}, not U32", self.words.dtype()))
        } else if self.min.dtype() != self.scale.dtype() {
            Some(format!(
                "the scales are {:?}, the mins {:?}",
                self.scale.dtype(),
                self.min.dtype()
            ))
        } else {
            None
        }
    }
}

pub(crate) fn bytes_of<const D: usize>(t: &Tensor<D>) -> usize {
    t.shape().num_elements() * t.dtype().size()
}

pub(crate) fn bytes_of_int<const D: usize>(t: &Tensor<D, Int>) -> usize {
    t.shape().num_elements() * t.dtype().size()
}

/// How rows of `cols` values are grouped and packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantLayout {
    /// 2 or 4.
    pub bits: u32,
    /// Columns per group (the last group of a row may be shorter).
    pub group: usize,
    /// Columns per row.
    pub cols: usize,
}

impl QuantLayout {
    /// A validated layout.
    ///
    /// # Errors
    /// [`KvCacheError::InvalidBits`] unless `bits` is 2 or 4, [`KvCacheError::ZeroGroupSize`]
    /// for `group == 0`.
    pub fn new(bits: u32, group: usize, cols: usize) -> Result<Self, KvCacheError> {
        if bits != 2 && bits != 4 {
            return Err(KvCacheError::InvalidBits(bits));
        }
        if group == 0 {
            return Err(KvCacheError::ZeroGroupSize);
        }
        Ok(Self { bits, group, cols })
    }

    /// Columns of a full group: `min(group, cols)`.
    pub fn group_len(&self) -> usize {
        self.group.min(self.cols).max(1)
    }

    /// Groups per row.
    pub fn groups(&self) -> usize {
        self.cols.div_ceil(self.group_len())
    }

    pub fn codes_per_word(&self) -> usize {
        (32 / self.bits) as usize
    }

    pub fn words_per_group(&self) -> usize {
        self.group_len().div_ceil(self.codes_per_word())
    }

    /// The largest code, `2^bits − 1`.
    pub fn levels(&self) -> u32 {
        (1 << self.bits) - 1
    }
}

/// Quantizes each row in groups of `group` columns: per group `min`, `scale = (max −
/// min)/(2^bits − 1)`, codes `round((x − min)/scale)` packed into `u32` words.
///
/// # Shapes
/// - `x`: `[rows, cols]`
/// - returns [`Packed`]: words `[rows, groups · words_per_group]`, scale and min `[rows,
///   groups]` (see [`QuantLayout`])
///
/// # Errors
/// [`KvCacheError::InvalidBits`], [`KvCacheError::ZeroGroupSize`].
pub fn quantize(
    x: Tensor<2>,
    bits: u32,
    group: usize,
) -> Result<(Packed, QuantLayout), KvCacheError> {
    let layout = QuantLayout::new(bits, group, x.dims()[1])?;
    Ok((quantize_rows(x, layout), layout))
}

/// [`quantize`] with a layout already validated for `x`'s columns.
pub(crate) fn quantize_rows(x: Tensor<2>, layout: QuantLayout) -> Packed {
    if !kernel("kv_quantize", &x.device(), None) {
        return reference::quantize(x, layout);
    }
    Packed::from_primitive(Dispatch::kv_quantize(x.into_dispatch(), layout))
}

/// The inverse of [`quantize`]: `min + code·scale`.
///
/// # Shapes
/// - `packed` as returned with `layout`; returns `[rows, layout.cols]`
pub fn dequantize(packed: &Packed, layout: QuantLayout) -> Tensor<2> {
    if !kernel(
        "kv_dequantize",
        &packed.scale.device(),
        packed.unsupported(),
    ) {
        return reference::dequantize(packed, layout);
    }
    Tensor::from_dispatch(Dispatch::kv_dequantize(
        packed.clone().into_primitive(),
        layout,
    ))
}

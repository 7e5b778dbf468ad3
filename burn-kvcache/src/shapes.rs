//! Output shapes of the ops, from their input shapes: what the kernel launchers allocate and
//! what `Fusion` registers before the kernels run (one definition for both).

use burn::tensor::Shape;

use crate::QuantLayout;

/// The merge's outputs for `a` `[n, d]`: `dir [n, d]` and the per-row `[n]` (magnitudes and
/// distance).
pub fn merged_shapes(a: &Shape) -> (Shape, Shape) {
    let [n, d] = a.dims::<2>();
    (Shape::new([n, d]), Shape::new([n]))
}

/// Keys per split of the fused quantized attention's partial launch.
pub const QUANT_ATTENTION_SPLIT: usize = 256;

/// Key splits of the fused quantized attention read over `keys` cached keys: each split's f32
/// partial results (`[rows, splits, d]` outputs and `[rows, splits]` maxima and sums) are its
/// working set, merged after.
pub fn quant_attention_splits(keys: usize) -> usize {
    keys.div_ceil(QUANT_ATTENTION_SPLIT).max(1)
}

/// The dequantized rows for scales `[rows, groups]`: `[rows, layout.cols]`.
pub fn dequantized_shape(scale: &Shape, layout: &QuantLayout) -> Shape {
    Shape::new([scale[0], layout.cols])
}

/// The rebuilt keys for `wt` `[batch, heads, rank, d]` and `chunks` `[batch, heads, k]`:
/// `[batch, heads, k · chunk, d]`.
pub fn gather_rope_shape(wt: &Shape, chunks: &Shape, chunk: &usize) -> Shape {
    let [b, h, _, d] = wt.dims::<4>();
    Shape::new([b, h, chunks[2] * chunk, d])
}

/// The landmark scores for `landmarks` `[b, h, t, dd]`: `[b·h, t]`.
pub fn landmark_scores_shape(landmarks: &Shape) -> Shape {
    let [b, h, t, _] = landmarks.dims::<4>();
    Shape::new([b * h, t])
}

/// The selection for `scores` `[rows, cols]` keeping `kk` slots per row: `[rows, kk]`.
pub fn top_k_shape(scores: &Shape, kk: &usize) -> Shape {
    Shape::new([scores[0], *kk])
}

impl QuantLayout {
    /// The packed form of `rows` rows: words `[rows, groups · words_per_group]` (u32) and the
    /// per-group scale and min `[rows, groups]`.
    pub fn packed_shapes(&self, rows: usize) -> (Shape, Shape) {
        let (ng, wpg) = (self.groups(), self.words_per_group());
        (Shape::new([rows, ng * wpg]), Shape::new([rows, ng]))
    }
}

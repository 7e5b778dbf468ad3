//! CubeCL kernels, one file per op; each is generic over the runtime and the float dtype
//! (math in f32).
//!
//! - [`merge`]: one unit per row pair (norms, angle, SLERP, retention);
//! - [`restore`]: one unit per output element;
//! - [`quantize`]: one unit per group (min/max, codes, its packed words);
//! - [`dequantize`]: one unit per output element;
//! - [`gather_rope`]: ShadowKV's key rebuild, a cube per tile of tokens and 32 rotated pairs
//!   (the tile's low-rank rows gathered into shared memory once), or one unit per pair;
//! - [`landmark_scores`]: ShadowKV's scoring, a cube per 256 landmarks of a KV head (logits
//!   and a partial log-sum-exp), then the group's softmax sums and maximum;
//! - [`top_k`]: ShadowKV's selection, one cube per row (a bitwise search for the `k`-th
//!   largest key, then a scan of the units' counts for ordered output);
//! - [`decode_attention`]: split-K attention over full-precision keys, one cube of planes per
//!   split (lanes over channels, the planes merged in shared memory), combined by
//!   [`quant_attention`]'s combine kernel where there are several splits;
//! - [`quant_attention`]: attention read from packed KIVI keys and values (split keys, one
//!   unit per query row and split, then one per output element to combine the splits).
//!
//! Outputs are allocated with `empty_device_contiguous_dtype`: the kernels index them linearly,
//! and CubeCL's CUDA runtime may pitch (row-pad) a plain 2-D allocation.

pub mod decode_attention;
pub mod dequantize;
pub mod gather_rope;
pub mod landmark_scores;
pub mod merge;
pub mod quant_attention;
pub mod quantize;
pub mod restore;
pub mod top_k;

/// Units per cube of the element-wise launches.
pub(crate) const UNITS: u32 = 256;

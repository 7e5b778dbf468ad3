//! # burn-kernels-core: the model pieces the paper crates plug into
//!
//! Defined once here and shared by the Llama example and the paper crates:
//! - [`attention::AttentionImpl`]: how `softmax(q·kᵀ)·v` is computed (reference, Burn's fused
//!   kernel, SageAttention later), with GQA and bottom-right-aligned causal masks;
//! - [`cache::KvCache`]: a per-layer KV cache that also runs the attention over what it holds
//!   (the full cache and [`static_cache::StaticKvCache`], written in place for captured decode
//!   steps, here; ShadowKV, MiniCache and quantized caches in burn-kvcache);
//! - [`rope::Rope`]: rotary embeddings (HF rotate-half, Llama-3 frequency scaling);
//! - [`layer_ops::LayerOps`]: the layer's projections, RMSNorm, RoPE and SwiGLU gate as tensor
//!   ops or as one CubeCL kernel each ([`fused_layers::FusedLayers`], inference), the kernels a
//!   Burn backend extension ([`LayerKernels`]) that runs on `Fusion<CubeBackend>` and Burn's
//!   `Dispatch`;
//! - [`gemm`]: f16/bf16 GEMMs by a fixed kernel (a Hopper one of its own), differentiable
//!   ([`GemmKernels`]): the projections' and burn-cce's, where Burn's autotuned matmul fails on
//!   Hopper;
//! - [`route`]: the one place where every crate decides between a kernel and the reference;
//! - [`sampling::Sampler`]: next-token distributions and draws (greedy, temperature, top-k,
//!   top-p), which speculative decoding builds on.

pub mod attention;
pub mod cache;
mod cube;
pub mod fused_layers;
pub mod gemm;
pub mod kernels;
pub mod layer_ops;
pub mod logging;
pub mod recompute_attention;
pub mod rope;
pub mod route;
pub mod sampling;
pub mod setup;
pub mod static_cache;
mod tracked;
pub mod train_ops;

pub use attention::{AttentionImpl, AttentionKind, AttnOptions, BurnAttention, ReferenceAttention};
pub use cache::{CacheError, FullKvCache, IndexedSlot, KvCache, append_kv};
pub use cube::{LayerKernels, gemv_shape};
pub use fused_layers::FusedLayers;
pub use gemm::{GemmKernel, GemmKernels};
pub use layer_ops::{FusedOps, GEMV_MAX_ROWS, LayerOps, TensorOps};
pub use recompute_attention::RecomputeAttention;
pub use rope::{Rope, RopeScaling};
pub use sampling::{Greedy, Sampler, SamplingConfig, TopKTopP};
pub use static_cache::{IndexedWrite, StaticCacheError, StaticKvCache};
pub use train_ops::{TrainLayerGrads, TrainLayerKernels, TrainOps};

//! # burn-kvcache: KV-cache compression for Burn
//!
//! ShadowKV (low-rank pre-RoPE keys on the device, values offloaded to host memory, sparse
//! chunk retrieval) and MiniCache (cross-layer SLERP merging), composed with KIVI-style
//! quantized KV. The API lands with the burn-kvcache issues; this crate builds as a workspace
//! member until then.

//! # burn-sage: SageAttention2 for Burn
//!
//! INT8/INT4 quantized attention with K smoothing (and Q smoothing with the ΔS correction),
//! FP16 or FP8 (E4M3) PV with f32 accumulation, as CubeCL kernels behind an extension trait.
//! Paper: SageAttention2 (Zhang et al., 2024). The API lands with the burn-sage issue; this crate
//! builds as a workspace member until then.

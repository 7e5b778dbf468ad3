//! # burn-specdec: multi-draft speculative sampling for Burn
//!
//! Token-level verification schemes (single-draft SD, SpecInfer, SpecTr, importance sampling,
//! LP-optimal), batched on the device, with analytic acceptance probabilities and a generation
//! loop. The API lands with the burn-specdec issue; this crate builds as a workspace member
//! until then.

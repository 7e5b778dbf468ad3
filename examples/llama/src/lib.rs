//! Llama-style model for the burn-kernels examples: the model, weights loading and generation
//! land with the Llama issue; this crate builds as a workspace member until then.

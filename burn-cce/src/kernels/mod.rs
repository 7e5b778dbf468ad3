//! CubeCL kernels, one file per stage; each is generic over the runtime.

pub mod lse;

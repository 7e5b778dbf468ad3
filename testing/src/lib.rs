//! Shared test support for the burn-kernels crates.
//!
//! - [`random`]: seeded random tensors (uniform, normal and "peaky" LLM-like distributions);
//! - [`compare`]: error metrics (max-abs, max-rel, relative L1, RMSE, cosine similarity) and
//!   assertions with readable failure messages, with tolerances derived from the dtype;
//! - [`testgen!`]: one generic test body instantiated on every enabled runtime
//!   (Vulkan, CUDA) and, where asked, on the CPU reference backend.

pub mod compare;
pub mod random;
pub mod runtimes;

pub use compare::{Metrics, Tolerance, assert_close, assert_close_data, metrics};
pub use random::{Dist, random_tensor, random_values};
pub use runtimes::{float_dtypes, poison_memory};

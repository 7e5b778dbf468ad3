//! Shared test support for the burn-kernels crates.
//!
//! - [`random`]: seeded random tensors (uniform, normal and "peaky" LLM-like distributions);
//! - [`compare`]: error metrics (max-abs, max-rel, relative L1, RMSE, cosine similarity) and
//!   assertions with readable failure messages, with tolerances derived from the dtype;
//! - [`testgen!`]: one generic test body instantiated on every enabled runtime
//!   (Vulkan, CUDA), through Burn's `Dispatch` backend, with and without autodiff.

pub mod compare;
pub mod random;
pub mod runtimes;
pub mod stats;
pub mod unfused;

pub use compare::{
    Metrics, TF32_REL_L2, Tolerance, assert_close, assert_close_data, assert_close_unless_tf32,
    assert_matmul_close, assert_product_close, f32_matmul_is_tf32, metrics,
};
pub use random::{Dist, random_tensor, random_values};
pub use runtimes::{float_dtypes, is_cuda, is_wgpu, poison_memory};
pub use stats::chi_square_p_value;

//! The `llama` and `finetune` command lines over `burn_llama`'s public API. Their code lives in
//! this crate's library, and the binaries (`src/bin/`) only call [`llama::main`] and
//! [`finetune::main`], so that it is compiled once, not once per binary.

pub mod finetune;
pub mod llama;

use burn::tensor::{DType, Device};
use clap::ValueEnum;

/// Weight and activation dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    F32,
    F16,
    Bf16,
}

impl From<DTypeArg> for DType {
    fn from(d: DTypeArg) -> Self {
        match d {
            DTypeArg::F32 => DType::F32,
            DTypeArg::F16 => DType::F16,
            DTypeArg::Bf16 => DType::BF16,
        }
    }
}

/// Where a command runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// Burn's pure-Rust CPU backend (`Flex`); every op runs its tensor-op reference.
    Cpu,
    /// Burn's CubeCL backend on Vulkan (SPIR-V kernels; needs the `vulkan` feature).
    Vulkan,
    /// Burn's CubeCL backend on wgpu (WGSL kernels; needs the `wgpu` feature).
    Wgpu,
    /// Burn's CubeCL backend on CUDA GPU 0 (needs the `cuda` feature).
    Cuda,
}

impl BackendArg {
    /// The Burn device, or why this build cannot run there.
    ///
    /// # Errors
    /// The Cargo feature the backend needs, when this build lacks it; for CUDA, a missing
    /// libdevice ([`burn_kernels_core::setup::cuda_preflight`]).
    pub fn device(self) -> Result<Device, String> {
        match self {
            BackendArg::Cpu => Ok(Device::flex()),
            #[cfg(feature = "vulkan")]
            BackendArg::Vulkan => Ok(Device::vulkan(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(feature = "wgpu")]
            BackendArg::Wgpu => Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(feature = "cuda")]
            BackendArg::Cuda => burn_kernels_core::setup::cuda_preflight()
                .map(|_| Device::cuda(0))
                .map_err(|e| e.to_string()),
            #[allow(unreachable_patterns)]
            other => Err(missing_feature(
                other
                    .to_possible_value()
                    .expect("no skipped variant")
                    .get_name(),
            )),
        }
    }
}

pub use burn_llama::names::value_names;

/// The CLI name of one value of a [`ValueEnum`].
pub fn value_name<T: ValueEnum>(v: T) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_string())
        .unwrap_or_default()
}

/// Keeps CubeCL's compiled kernels and autotune results across runs
/// ([`burn_kernels_core::setup::persistent_caches`] in its default folder) and says where.
pub fn keep_compiled_kernels() {
    let dir = burn_kernels_core::setup::default_cache_dir();
    if let Some(caches) = burn_kernels_core::setup::persistent_caches(&dir) {
        eprintln!("CubeCL caches: {caches}");
    }
}

/// The error of a command asked for a backend this build lacks.
pub fn missing_feature(feature: &str) -> String {
    format!(
        "built without the `{feature}` feature: cargo run --release -p burn-llama-examples --features {feature}"
    )
}

/// Prints `error: …` and exits with status 1 when a command failed.
pub fn exit_on_error(result: Result<(), String>) {
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

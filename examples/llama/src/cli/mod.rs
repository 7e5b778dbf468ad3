//! The `llama` and `finetune` command lines. Their code lives in the library, and the binaries
//! (`src/bin/`) only call [`llama::main`] and [`finetune::main`], so that the backends they
//! dispatch to are compiled once, not once per binary (minutes of a two-core CI build).

pub mod finetune;
pub mod llama;

/// Burn's CubeCL backend on Vulkan (wgpu), as the command lines run it.
#[cfg(feature = "vulkan")]
pub type VulkanBackend = burn_cubecl::CubeBackend;

/// Burn's CubeCL backend on CUDA, as the command lines run it.
#[cfg(feature = "cuda")]
pub type CudaBackend = burn_cubecl::CubeBackend;

/// The error of a command asked for a backend this build lacks.
pub fn missing_feature(feature: &str) -> String {
    format!(
        "built without the `{feature}` feature: cargo run --release -p burn-llama --features {feature}"
    )
}

/// Prints `error: …` and exits with status 1 when a command failed.
pub fn exit_on_error(result: Result<(), String>) {
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

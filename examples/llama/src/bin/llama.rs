//! `llama generate` and `llama perplexity` on CPU, Vulkan or CUDA (see [`burn_llama_examples::cli::llama`]).

fn main() {
    // Warnings (e.g. an op falling back to its reference) show by default; RUST_LOG for more.
    burn_kernels_core::logging::init();
    burn_llama_examples::cli::llama::main()
}

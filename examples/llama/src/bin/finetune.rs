//! Fine-tuning with Cut Cross-Entropy or Burn's plain loss (see [`burn_llama_examples::cli::finetune`]).

fn main() {
    // Warnings (e.g. an op falling back to its reference) show by default; RUST_LOG for more.
    burn_kernels_core::logging::init();
    burn_llama_examples::cli::finetune::main()
}

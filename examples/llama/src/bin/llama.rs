//! `llama generate` and `llama perplexity` on CPU, Vulkan or CUDA (see [`burn_llama::cli::llama`]).

fn main() {
    burn_llama::cli::llama::main()
}

//! Fine-tuning with Cut Cross-Entropy or Burn's plain loss (see [`burn_llama::cli::finetune`]).

fn main() {
    burn_llama::cli::finetune::main()
}

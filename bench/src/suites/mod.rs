//! Benchmark suites. Each registers problems × implementations and names its baseline.

pub mod attention;
pub mod llama;
pub mod lse;

use burn::tensor::backend::Backend;
use burn_cce::CceBackend;

use crate::harness::Suite;

/// Names of every suite, in the order `--suite all` runs them.
pub const ALL: &[&str] = &["attention-baseline", "lse", "llama"];

/// Options every suite gets.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    pub quick: bool,
    /// Device memory an implementation may use; larger problems are skipped for it.
    pub max_mem_bytes: f64,
    /// Where the peer scripts (PyTorch) live.
    pub peers_dir: std::path::PathBuf,
}

/// Builds the suite called `name`.
pub fn build<B: Backend + CceBackend>(name: &str, opts: SuiteOptions) -> Option<Suite<B>> {
    match name {
        "attention-baseline" => Some(attention::suite::<B>(opts)),
        "lse" => Some(lse::suite::<B>(opts)),
        "llama" => Some(llama::suite::<B>(opts)),
        _ => None,
    }
}

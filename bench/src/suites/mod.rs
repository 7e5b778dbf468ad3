//! Benchmark suites. Each registers problems × implementations and names its baseline.

pub mod attention;
pub mod cce;
pub mod data_parallel;
pub mod e2e;
pub mod gemm;
pub mod generate;
mod kv_decode;
pub mod llama;
pub mod lse;
pub mod minicache;
pub mod sage;
pub mod shadowkv;
pub mod specdec;

use crate::harness::{MemoryProbe, Suite};

/// A tiny Llama (hidden 64, 4 query / 2 KV heads of 16) with `num_layers` and `vocab_size`, for
/// the `--quick` smoke runs of the model suites.
pub fn tiny_llama(num_layers: usize, vocab_size: usize) -> burn_llama::LlamaConfig {
    burn_llama::LlamaConfig {
        hidden_size: 64,
        intermediate_size: 128,
        num_layers,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        vocab_size,
        ..burn_llama::LlamaConfig::smollm2_135m()
    }
}

/// Names of every suite, in the order `--suite all` runs them.
pub const ALL: &[&str] = &[
    "attention-baseline",
    "gemm",
    "sage",
    "lse",
    "cce",
    "llama",
    "shadowkv",
    "minicache",
    "specdec",
    "e2e",
    "e2e-generate",
];

/// Suites that run only when asked for by name (or through `--suite e2e --devices …`).
pub const ON_REQUEST: &[&str] = &["e2e-dp"];

/// The device memory pool's page limits (CubeCL's `MemoryDeviceProperties`), which decide
/// how much a set of tensors really reserves.
#[derive(Debug, Clone, Copy)]
pub struct PoolProps {
    /// The largest page (and allocation): a quarter of the device memory on CUDA.
    pub max_page: u64,
    pub alignment: u64,
}

/// Options every suite gets.
#[derive(Clone)]
pub struct SuiteOptions {
    pub quick: bool,
    /// Device memory an implementation may use; larger problems are skipped for it.
    pub max_mem_bytes: f64,
    /// Host memory an implementation may fill (ShadowKV keeps values there).
    pub max_host_mem_bytes: f64,
    /// Where the peer scripts (PyTorch) live.
    pub peers_dir: std::path::PathBuf,
    pub pool: PoolProps,
    /// Reads the device memory pool, where the runtime has one.
    pub probe: Option<MemoryProbe>,
    /// `--filter`: a problem runs only if its label contains every one of these.
    pub filters: Vec<String>,
    /// `--exclude`: a problem whose label contains any of these does not run.
    pub excludes: Vec<String>,
    /// `--cce-gemm-sweep`: the cce suite also times each fixed GEMM kernel.
    pub cce_gemm_sweep: bool,
    /// `--cce-pass-blocks`: the cce suite also times the default with these logits blocks
    /// (MiB) for the forward and the scoring pass (`CceOptions::pass_chunk_bytes`).
    pub cce_pass_blocks: Vec<usize>,
    /// `--cce-chunk-bytes`: the cce suite also times the default with these logits blocks
    /// (MiB) for every pass (`CceOptions::chunk_bytes`).
    pub cce_chunk_bytes: Vec<usize>,
    /// `--draft-model`: the specdec suite also times these trained drafts (`finetune` run
    /// folders, .gguf or HF folders) beside the truncated-layer one; e2e-generate uses the
    /// first instead of the truncated-layer one.
    pub draft_model: Vec<std::path::PathBuf>,
    /// `--draft-lens`: the specdec suite's draft lengths L (empty: its default).
    pub draft_lens: Vec<usize>,
    /// `--spec-drafts`: the specdec suite's numbers of drafts K (empty: its defaults).
    pub spec_drafts: Vec<usize>,
    /// `--batches`: the e2e suite's batch sizes instead of its defaults (growing batches find
    /// the largest that fits: the first out-of-memory fails that problem).
    pub batches: Vec<usize>,
    /// `--seq`: the e2e suite's tokens per sequence instead of its default.
    pub seq: Option<usize>,
    /// `--decode-kernels`: the specdec suite decodes (autoregressive and speculative alike)
    /// with the fused layer ops and the decode attention kernel instead of Burn's attention
    /// op and tensor ops.
    pub decode_kernels: bool,
    /// `--spec-new-tokens`: tokens the specdec suite generates per repetition.
    pub spec_new_tokens: Option<usize>,
    /// `--e2e-phases`: the e2e suite times each Burn step's phases too.
    pub e2e_phases: bool,
    /// `--e2e-checkpointing`: what the e2e suite's Burn steps recompute in the backward.
    pub e2e_checkpointing: Option<E2eCheckpointing>,
    /// `--e2e-profile-step`: the e2e step whose kernels a CUDA profiler records.
    pub e2e_profile_step: Option<usize>,
    /// `--devices`: the GPUs of the data-parallel suite (`e2e-dp`).
    pub devices: Vec<usize>,
}

impl SuiteOptions {
    /// Whether the problem labelled `label` runs under `--filter` and `--exclude`.
    pub fn selects(&self, label: &str) -> bool {
        self.filters.iter().all(|f| label.contains(f.as_str()))
            && !self.excludes.iter().any(|e| label.contains(e.as_str()))
    }
}

/// Builds the suite called `name`.
pub fn build(name: &str, opts: SuiteOptions) -> Option<Suite> {
    match name {
        "attention-baseline" => Some(attention::suite(opts)),
        "gemm" => Some(gemm::suite(opts)),
        "lse" => Some(lse::suite(opts)),
        "sage" => Some(sage::suite(opts)),
        "cce" => Some(cce::suite(opts)),
        "llama" => Some(llama::suite(opts)),
        "shadowkv" => Some(shadowkv::suite(opts)),
        "minicache" => Some(minicache::suite(opts)),
        "specdec" => Some(specdec::suite(opts)),
        "e2e" => Some(e2e::suite(opts)),
        "e2e-generate" => Some(generate::suite(opts)),
        "e2e-dp" => Some(data_parallel::suite(opts)),
        _ => None,
    }
}

/// Runs a Python peer script (`python3 SCRIPT ARGS…`) that prints one JSON line
/// `{"times_ms": [...], "peak_mem_mb": x?}` or `{"error": "..."}`.
pub fn run_python_peer(
    script: &std::path::Path,
    args: &[&str],
) -> Result<crate::harness::PeerRun, String> {
    peer_run(&python_json(script, args)?)
}

/// Runs `python3 script args` and parses the last line of its stdout that starts with `{`.
pub fn python_json(script: &std::path::Path, args: &[&str]) -> Result<serde_json::Value, String> {
    if !script.exists() {
        return Err(format!("peer script {} not found", script.display()));
    }
    let out = std::process::Command::new("python3")
        .arg(script)
        .args(args)
        .output()
        .map_err(|e| format!("python3: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| {
            format!(
                "peer printed no result: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    serde_json::from_str(line).map_err(|e| e.to_string())
}

/// A peer's result object: `{"times_ms": [...], "peak_mem_mb": x}` or `{"error": ...}`.
pub fn peer_run(v: &serde_json::Value) -> Result<crate::harness::PeerRun, String> {
    if let Some(e) = v.get("error") {
        return Err(format!("peer: {}", e.as_str().unwrap_or(&e.to_string())));
    }
    let times_ms = v["times_ms"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        .ok_or_else(|| "peer gave no times".to_string())?;
    Ok(crate::harness::PeerRun {
        times_ms,
        peak_mem_mb: v.get("peak_mem_mb").and_then(|x| x.as_f64()),
    })
}

/// What the e2e suite's Burn steps recompute in the backward instead of keeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum E2eCheckpointing {
    /// Memory-bound activations (RMSNorm's outputs, the SwiGLU product): Burn's balanced
    /// gradient checkpointing on the autodiff device.
    Ops,
    /// Whole layers: burn-llama's layer checkpointing (each layer's input kept, the layer run
    /// again in the backward).
    Layers,
}

//! Benchmark suites. Each registers problems × implementations and names its baseline.

pub mod attention;
pub mod cce;
pub mod llama;
pub mod lse;
pub mod sage;

use burn::tensor::backend::Backend;
use burn_cce::CceBackend;
use burn_sage::SageBackend;

use crate::harness::Suite;

/// Names of every suite, in the order `--suite all` runs them.
pub const ALL: &[&str] = &["attention-baseline", "sage", "lse", "cce", "llama"];

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
pub fn build<B: Backend + CceBackend + SageBackend>(
    name: &str,
    opts: SuiteOptions,
) -> Option<Suite<B>> {
    match name {
        "attention-baseline" => Some(attention::suite::<B>(opts)),
        "lse" => Some(lse::suite::<B>(opts)),
        "sage" => Some(sage::suite::<B>(opts)),
        "cce" => Some(cce::suite::<B>(opts)),
        "llama" => Some(llama::suite::<B>(opts)),
        _ => None,
    }
}

/// Runs a Python peer script (`python3 SCRIPT ARGS…`) that prints one JSON line
/// `{"times_ms": [...], "peak_mem_mb": x?}` or `{"error": "..."}`.
pub fn run_python_peer(
    script: &std::path::Path,
    args: &[&str],
) -> Result<crate::harness::PeerRun, String> {
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
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
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

//! Live-memory tracking of the chunked path, for benchmarks.
//!
//! CubeCL 0.10 keeps no high-water mark of the bytes in use, and a watcher sampling the pool
//! from another thread misses short peaks. While [`track_live_peak`] runs, the chunked
//! forward and backward read the pool's bytes in use (`MemoryUsage::bytes_in_use`: every
//! slice whose handle is alive, without page rounding) right after each of their
//! allocations, with that step's inputs still held, and keep the largest reading. Buffers are
//! freed in program order on the host (the stream orders reuse on the device), so these
//! readings are the live set at each step; the largest is the call's peak as long as no op
//! allocates and frees a temporary inside one call (the chunk GEMMs and burn-cce's kernels do
//! not).

use std::cell::Cell;

use burn_cubecl::{CubeRuntime, tensor::CubeTensor};

/// The largest reading so far and the step that took it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LivePeak {
    /// Bytes in use (absolute, or beyond those in use before, see [`crate::track_live_peak`]).
    pub bytes: u64,
    /// The chunked path's step right after whose allocation it was read (e.g. `"logits"`,
    /// `"dE pass: product"`).
    pub step: &'static str,
}

thread_local! {
    /// `Some(peak)` while tracking on this thread (`step` empty until the first reading).
    static PEAK: Cell<Option<LivePeak>> = const { Cell::new(None) };
    /// Print every reading to stderr (`BURN_CCE_LIVE_TRACE` set when tracking started).
    static TRACE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `run` with live tracking on this thread and returns the largest `bytes_in_use` the
/// chunked path read during it (absolute: the caller subtracts what was held before), or
/// `None` when nothing was read (`run` did not go through the chunked path). With the
/// environment variable `BURN_CCE_LIVE_TRACE` set, every reading is printed to stderr.
pub fn track_live_peak(run: impl FnOnce()) -> Option<LivePeak> {
    PEAK.with(|p| p.set(Some(LivePeak { bytes: 0, step: "" })));
    TRACE.with(|t| t.set(std::env::var_os("BURN_CCE_LIVE_TRACE").is_some()));
    run();
    PEAK.with(|p| p.take()).filter(|p| !p.step.is_empty())
}

/// Whether [`track_live_peak`] is running on this thread.
pub(crate) fn tracking() -> bool {
    PEAK.with(|p| p.get()).is_some()
}

/// Reads the pool of `tensor`'s device into the running peak, when tracking; `step` names the
/// allocation just made.
pub(crate) fn sample<R: CubeRuntime>(tensor: &CubeTensor<R>, step: &'static str) {
    let Some(peak) = PEAK.with(|p| p.get()) else {
        return;
    };
    if let Ok(usage) = tensor.client.memory_usage() {
        let bytes = usage.bytes_in_use;
        if TRACE.with(|t| t.get()) {
            eprintln!("burn-cce live: {bytes} B after {step}");
        }
        if bytes >= peak.bytes || peak.step.is_empty() {
            PEAK.with(|p| p.set(Some(LivePeak { bytes, step })));
        }
    }
}

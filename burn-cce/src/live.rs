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

thread_local! {
    /// `Some(peak)` while tracking on this thread.
    static PEAK: Cell<Option<u64>> = const { Cell::new(None) };
    /// Readings taken while tracking.
    static SAMPLES: Cell<usize> = const { Cell::new(0) };
}

/// Runs `run` with live tracking on this thread and returns the largest `bytes_in_use` the
/// chunked path read during it (absolute: the caller subtracts what was held before), or
/// `None` when nothing was read (`run` did not go through the chunked path).
pub fn track_live_peak(run: impl FnOnce()) -> Option<u64> {
    PEAK.with(|p| p.set(Some(0)));
    SAMPLES.with(|s| s.set(0));
    run();
    let peak = PEAK.with(|p| p.take());
    let samples = SAMPLES.with(|s| s.take());
    peak.filter(|_| samples > 0)
}

/// Reads the pool of `tensor`'s device into the running peak, when tracking.
pub(crate) fn sample<R: CubeRuntime>(tensor: &CubeTensor<R>) {
    if PEAK.with(|p| p.get()).is_none() {
        return;
    }
    if let Ok(usage) = tensor.client.memory_usage() {
        PEAK.with(|p| p.set(p.get().map(|peak| peak.max(usage.bytes_in_use))));
        SAMPLES.with(|s| s.set(s.get() + 1));
    }
}

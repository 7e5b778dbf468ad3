//! Live-memory tracking of the chunked path, for benchmarks.
//!
//! CubeCL keeps no high-water mark of the bytes in use, and a watcher sampling the pool from
//! another thread misses short peaks. While [`track_live_peak`] runs, the chunked forward and
//! backward read the bytes in use of the pools of the stream they run on
//! (`MemoryUsage::bytes_in_use` of CubeCL's memory report: every slice whose handle is alive,
//! without page rounding; the runtime's auxiliary memories left out) right after each of their
//! allocations, with that step's inputs still held, and keep the largest reading. Buffers are
//! freed in program order on the host (the stream orders reuse on the device), so these
//! readings are the live set at each step; the largest is the call's peak as long as no op
//! allocates and frees a temporary inside one call (the chunk GEMMs and burn-cce's kernels do
//! not).

use std::sync::{Mutex, MutexGuard};

use burn::backend::StreamId;
use burn_cubecl::tensor::CubeTensor;

/// The largest reading so far and the step that took it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LivePeak {
    /// Bytes in use (absolute, or beyond those in use before, see [`crate::track_live_peak`]).
    pub bytes: u64,
    /// The chunked path's step right after whose allocation it was read (e.g. `"logits"`,
    /// `"dE pass: product"`).
    pub step: &'static str,
}

/// A value per CubeCL stream (the current one: this thread's, or the stream Burn's fusion
/// executes a deferred op for, on its device thread). The chunked path records its plan,
/// phases and live peak here, so that a caller reads them whether the op ran on its thread
/// (an unfused backend) or was deferred by fusion and executed on the device's thread for the
/// caller's stream.
pub(crate) struct PerStream<T: Copy>(Mutex<Vec<(u64, T)>>);

impl<T: Copy> PerStream<T> {
    pub(crate) const fn new() -> Self {
        Self(Mutex::new(Vec::new()))
    }

    fn entries(&self) -> MutexGuard<'_, Vec<(u64, T)>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The current stream's value.
    pub(crate) fn get(&self) -> Option<T> {
        let key = StreamId::current().value;
        self.entries()
            .iter()
            .find(|(k, _)| *k == key)
            .map(|&(_, v)| v)
    }

    /// Sets (or with `None` removes) the current stream's value, returning the previous one.
    pub(crate) fn replace(&self, value: Option<T>) -> Option<T> {
        let key = StreamId::current().value;
        let mut entries = self.entries();
        let at = entries.iter().position(|(k, _)| *k == key);
        let old = at.map(|i| entries.swap_remove(i).1);
        if let Some(value) = value {
            entries.push((key, value));
        }
        old
    }

    /// Applies `f` to the current stream's value, if it has one.
    pub(crate) fn update(&self, f: impl FnOnce(&mut T)) {
        let key = StreamId::current().value;
        if let Some((_, v)) = self.entries().iter_mut().find(|(k, _)| *k == key) {
            f(v);
        }
    }
}

/// A running tracking: the largest reading (`step` empty until the first one), and whether
/// every reading is printed.
#[derive(Clone, Copy)]
struct Tracking {
    peak: LivePeak,
    trace: bool,
}

static TRACKING: PerStream<Tracking> = PerStream::new();

/// Runs `run` with live tracking of the current stream (this thread's) and returns the largest
/// `bytes_in_use` the chunked path read during it (absolute: the caller subtracts what was
/// held before), or `None` when nothing was read (`run` did not go through the chunked path).
/// With the environment variable `BURN_CCE_LIVE_TRACE` set, every reading is printed to
/// stderr.
///
/// Burn's fusion defers the chunked path until the device synchronizes or an output is read:
/// call [`crate::track_live_peak`], which synchronizes the device inside the tracking.
pub fn track_live_peak(run: impl FnOnce()) -> Option<LivePeak> {
    TRACKING.replace(Some(Tracking {
        peak: LivePeak { bytes: 0, step: "" },
        trace: std::env::var_os("BURN_CCE_LIVE_TRACE").is_some(),
    }));
    run();
    TRACKING
        .replace(None)
        .map(|t| t.peak)
        .filter(|p| !p.step.is_empty())
}

/// Reads the pool of `tensor`'s device into the running peak, when tracking; `step` names the
/// allocation just made.
pub(crate) fn sample(tensor: &CubeTensor, step: &'static str) {
    let Some(tracking) = TRACKING.get() else {
        return;
    };
    let bytes = burn_kernels_core::route::bytes_in_use(&tensor.client);
    if tracking.trace {
        eprintln!("burn-cce live: {bytes} B after {step}");
    }
    TRACKING.update(|t| {
        if bytes >= t.peak.bytes || t.peak.step.is_empty() {
            t.peak = LivePeak { bytes, step };
        }
    });
}

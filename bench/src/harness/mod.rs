//! Problems × implementations, warm-up, synchronized timing and medians.

use burn::tensor::Device;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

mod run;
pub use run::{median, quantile, run_suite};

/// How a candidate runs.
pub enum Runner<'a> {
    /// Enqueues the work once; the harness warms up, synchronizes and times it.
    InProcess(Box<dyn FnMut() + 'a>),
    /// A candidate that times itself: a peer outside this process (e.g. PyTorch on the same GPU
    /// in the same run), or a stateful run whose calls cannot repeat (decode steps growing a
    /// cache). Returns its own per-repetition times (and peak memory, if it measures it), or
    /// why it could not run.
    Timed(Box<dyn FnOnce() -> Result<PeerRun, String> + 'a>),
}

/// What an out-of-process peer measured.
#[derive(Debug, Clone, Default)]
pub struct PeerRun {
    pub times_ms: Vec<f64>,
    /// Peak device memory of one call beyond its inputs, MB (10⁶ bytes).
    pub peak_mem_mb: Option<f64>,
}

impl From<Vec<f64>> for PeerRun {
    fn from(times_ms: Vec<f64>) -> Self {
        PeerRun {
            times_ms,
            peak_mem_mb: None,
        }
    }
}

/// Reads the runtime's memory pool.
#[derive(Clone)]
pub struct MemoryProbe {
    /// Bytes reserved on the device, after freeing unused pages first when asked. The
    /// difference around one call is the call's working set as the pool saw it, rounded up to
    /// the pool's page sizes.
    pub reserved: std::sync::Arc<dyn Fn(bool) -> Option<u64> + Send + Sync>,
    /// Runs the given call with every allocation exact-size (CubeCL's persistent allocation
    /// mode, where a freed buffer is reused only by a request of the same size) and returns the
    /// bytes it allocated: an upper bound on the most bytes in use at once, without page
    /// rounding (each size's concurrent buffers are counted at their own peak), the analogue of
    /// PyTorch's `max_memory_allocated` that the peers report.
    pub allocated: std::sync::Arc<AllocatedProbe>,
    /// Runs the given call with burn-cce's live tracking and returns the most bytes in use at
    /// once beyond those in use before, as read after each allocation of the chunked path
    /// (`burn_cce::track_live_peak`); `None` for calls that do not go through it.
    pub live: std::sync::Arc<AllocatedProbe>,
}

/// See [`MemoryProbe::allocated`].
pub type AllocatedProbe = dyn Fn(&mut dyn FnMut()) -> Option<u64> + Send + Sync;

/// A call's memory, MB (10⁶ bytes) beyond what was held before it.
#[derive(Debug, Clone, Copy)]
pub struct CallMemory {
    /// Bytes allocated exact-size (see [`MemoryProbe::allocated`]).
    pub allocated_mb: Option<f64>,
    /// Growth of the pool's reservation.
    pub pool_growth_mb: Option<f64>,
    /// Live peak (see [`MemoryProbe::live`]).
    pub live_mb: Option<f64>,
}

/// What a candidate adds to its record once it ran: parameters (into the record's `params`)
/// and a short note for the table.
#[derive(Debug, Clone, Default)]
pub struct Extra {
    pub params: BTreeMap<String, serde_json::Value>,
    pub note: Option<String>,
}

/// One implementation of a problem, ready to run.
pub struct Candidate<'a> {
    pub name: &'static str,
    /// `Err(reason)` when this implementation is skipped for the problem (e.g. too much memory).
    pub run: Result<Runner<'a>, String>,
    /// Tokens one run processes when they differ from the problem's (e.g. each implementation
    /// decodes the largest batch it fits).
    pub tokens: Option<f64>,
    /// Called after the candidate was measured.
    #[allow(clippy::type_complexity)]
    pub extra: Option<Box<dyn FnOnce() -> Extra + 'a>>,
}

impl<'a> Candidate<'a> {
    /// A candidate the harness times in this process.
    pub fn timed_here(name: &'static str, run: impl FnMut() + 'a) -> Self {
        Candidate {
            name,
            run: Ok(Runner::InProcess(Box::new(run))),
            tokens: None,
            extra: None,
        }
    }

    /// A candidate that times itself (see [`Runner::Timed`]).
    pub fn timed_elsewhere(
        name: &'static str,
        run: impl FnOnce() -> Result<PeerRun, String> + 'a,
    ) -> Self {
        Candidate {
            name,
            run: Ok(Runner::Timed(Box::new(run))),
            tokens: None,
            extra: None,
        }
    }

    /// A skipped candidate.
    pub fn skipped(name: &'static str, reason: String) -> Self {
        Candidate {
            name,
            run: Err(reason),
            tokens: None,
            extra: None,
        }
    }

    /// Sets the tokens one run processes (see [`Candidate::tokens`]).
    pub fn with_tokens(mut self, tokens: f64) -> Self {
        self.tokens = Some(tokens);
        self
    }

    /// Sets what the candidate adds to its record after it ran.
    pub fn with_extra(mut self, extra: impl FnOnce() -> Extra + 'a) -> Self {
        self.extra = Some(Box::new(extra));
        self
    }
}

/// One problem of a suite. `setup` allocates its inputs and returns the candidates; they are
/// dropped (freeing device memory) before the next problem is set up.
pub struct Problem {
    pub label: String,
    pub params: BTreeMap<String, serde_json::Value>,
    /// Floating-point operations of one run, where meaningful.
    pub flops: Option<f64>,
    /// Fewest bytes one run must move through device memory, where meaningful.
    pub bytes: Option<f64>,
    /// Tokens one run processes, where meaningful (reported as tokens/s).
    pub tokens: Option<f64>,
    pub setup: Setup,
}

/// What makes a [`Problem`]'s candidates on a device.
pub type Setup = Box<dyn Fn(&Device) -> Vec<Candidate<'static>>>;

/// How a suite's results are drawn: `y` against the numeric parameter `x` (log2 axis), one line
/// per implementation and combination of the `series` parameters; or, with `bars`, one
/// horizontal bar of `y` per record.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PlotSpec {
    pub x: String,
    pub series: Vec<String>,
    /// `"tflops"`, `"gbps"`, `"tokens_per_sec"` or `"median_ms"`.
    pub y: String,
    /// Bars instead of lines (suites of one problem and several implementations).
    #[serde(default)]
    pub bars: bool,
    /// With `bars`: the record parameter drawn as the first part of each bar, in `y`'s unit
    /// (e.g. a prefill's share of a whole generation's time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bar_part: Option<String>,
}

/// A suite: problems × implementations, one of them the baseline for the speed-up ratios.
pub struct Suite {
    pub name: &'static str,
    pub description: &'static str,
    pub baseline: &'static str,
    pub problems: Vec<Problem>,
    pub plot: Option<PlotSpec>,
    /// Also record each in-process candidate's peak memory (one extra call each).
    pub measure_memory: bool,
}

/// One measured (or skipped) implementation on one problem.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub problem: String,
    pub params: BTreeMap<String, serde_json::Value>,
    pub implementation: String,
    pub median_ms: Option<f64>,
    pub min_ms: Option<f64>,
    pub p90_ms: Option<f64>,
    pub reps: usize,
    pub tflops: Option<f64>,
    pub gbps: Option<f64>,
    #[serde(default)]
    pub tokens_per_sec: Option<f64>,
    /// Peak device memory of one call beyond its inputs, MB (10⁶ bytes), where measured: bytes
    /// allocated exact-size (see [`MemoryProbe::allocated`]; PyTorch peers:
    /// `max_memory_allocated`).
    #[serde(default)]
    pub peak_mem_mb: Option<f64>,
    /// Growth of the memory pool's reservation over one call, MB (whole pages), where measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_growth_mb: Option<f64>,
    /// Most bytes in use at once beyond the inputs, MB, read after each allocation of
    /// burn-cce's chunked path (see [`MemoryProbe::live`]), where it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live_peak_mb: Option<f64>,
    /// Baseline median / this median, both measured in this run; the ratio of tokens/s where
    /// both have one (implementations may process different token counts).
    pub speedup_vs_baseline: Option<f64>,
    pub skipped: Option<String>,
    /// What the implementation reported about its run (e.g. the batch it fit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The results of one suite.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SuiteResult {
    pub suite: String,
    /// The commit this suite was measured at (suites of one file may come from several runs).
    #[serde(default)]
    pub commit: String,
    pub description: String,
    pub baseline: String,
    pub records: Vec<Record>,
    pub plot: Option<PlotSpec>,
}

/// Timing knobs.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Warm-up time after the first (compiling, autotuning) call.
    pub warmup: Duration,
    /// Target time of the timed repetitions.
    pub measure: Duration,
    pub min_reps: usize,
    pub max_reps: usize,
}

impl Timing {
    pub fn new(quick: bool) -> Self {
        if quick {
            Timing {
                warmup: Duration::from_millis(200),
                measure: Duration::from_millis(500),
                min_reps: 3,
                max_reps: 20,
            }
        } else {
            Timing {
                warmup: Duration::from_millis(1000),
                measure: Duration::from_secs(2),
                min_reps: 5,
                max_reps: 100,
            }
        }
    }
}

thread_local! {
    static KEPT: std::cell::RefCell<Vec<Box<dyn std::any::Any>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Keeps a timed call's outputs alive until the harness has synchronized the device after the
/// call. Burn's fused backend runs queued work lazily, so outputs dropped before the
/// synchronization need not be computed, and a timing could then measure work that never ran.
/// (Burn plain's SmolLM2 loss step timing 1.9 ms on an H200 was first blamed on this; session 22
/// found Burn's matmul failing at launch there instead, which [`run_suite`] now also rejects.)
/// Every in-process candidate hands its outputs here.
pub fn keep<T: 'static>(outputs: T) {
    KEPT.with(|k| k.borrow_mut().push(Box::new(outputs)));
}

/// Synchronizes the device, then drops what the call [`keep`]s.
pub fn sync(device: &Device) {
    device.sync().expect("device synchronization failed");
    KEPT.with(|k| k.borrow_mut().clear());
}

/// Builds a parameter map from `(name, value)` pairs.
pub fn params<const N: usize>(
    pairs: [(&str, serde_json::Value); N],
) -> BTreeMap<String, serde_json::Value> {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

//! Problems × implementations, warm-up, synchronized timing and medians.

use burn::tensor::Device;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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
    #[allow(clippy::type_complexity)]
    pub setup: Box<dyn Fn(&Device) -> Vec<Candidate<'static>>>,
}

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

/// Times `run`: the first call (JIT compilation, autotune) and a warm-up are discarded, then
/// each repetition is timed from enqueue to device synchronization. Returns sorted times in ms.
/// Memory of one synchronized call: the bytes it allocates exact-size, and the pool's growth
/// after freeing unused pages (so that the call has to reserve what it needs).
fn measure_memory(device: &Device, run: &mut dyn FnMut(), probe: &MemoryProbe) -> CallMemory {
    sync(device);
    let before = (probe.reserved)(true);
    run();
    sync(device);
    let after = (probe.reserved)(false);
    let allocated = (probe.allocated)(&mut || {
        run();
        sync(device);
    });
    let live = (probe.live)(&mut || {
        run();
        sync(device);
    });
    CallMemory {
        allocated_mb: allocated.map(|b| b as f64 / 1e6),
        live_mb: live.map(|b| b as f64 / 1e6),
        pool_growth_mb: before
            .zip(after)
            .map(|(b, a)| a.saturating_sub(b) as f64 / 1e6),
    }
}

fn time_candidate(device: &Device, run: &mut dyn FnMut(), t: Timing) -> Vec<f64> {
    run();
    sync(device);
    let start = Instant::now();
    let mut warm = 0;
    // One warm call after the compiling one; more while they are short.
    while warm < 1 || (start.elapsed() < t.warmup && warm < 50) {
        run();
        sync(device);
        warm += 1;
    }
    let per_call = start.elapsed().as_secs_f64() / warm as f64;
    let reps =
        ((t.measure.as_secs_f64() / per_call.max(1e-6)) as usize).clamp(t.min_reps, t.max_reps);
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            run();
            sync(device);
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times
}

/// The `p` quantile of ascending `sorted` (non-empty), interpolated linearly between the two
/// nearest ranks: the true median for an even count (the mean of the middle two), not the
/// slower of them.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let pos = (sorted.len() - 1) as f64 * p.clamp(0.0, 1.0);
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// Runs every problem × implementation of `suite` with a progress bar.
/// Panics anywhere in the process since [`count_panics`] was installed.
static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Counts every panic in the process, then runs the previous hook. The device runtime's server
/// thread panics (e.g. on an allocation that does not fit) without failing the caller: the
/// launch is dropped, later calls may find their buffers gone, and a timing taken meanwhile
/// measures work that never ran. The count lets [`run_suite`] reject such timings.
fn count_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::Relaxed);
            prev(info);
        }));
    });
}

pub fn run_suite(
    suite: Suite,
    device: &Device,
    timing: Timing,
    probe: Option<&MemoryProbe>,
    skip_impls: &[String],
) -> SuiteResult {
    let bar = ProgressBar::new(suite.problems.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>20} [{bar:30}] {pos}/{len} {elapsed_precise} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(suite.name);
    let mut records = Vec::new();
    for problem in &suite.problems {
        bar.set_message(problem.label.clone());
        count_panics();
        let mut panics_seen = PANICS.load(Ordering::Relaxed);
        let mut failures_seen = burn_kernels_core::logging::device_failures();
        let candidates = (problem.setup)(device);
        let mut rows: Vec<Record> = Vec::new();
        for cand in candidates {
            let mut rec = Record {
                problem: problem.label.clone(),
                params: problem.params.clone(),
                implementation: cand.name.to_string(),
                median_ms: None,
                min_ms: None,
                p90_ms: None,
                reps: 0,
                tflops: None,
                gbps: None,
                tokens_per_sec: None,
                peak_mem_mb: None,
                pool_growth_mb: None,
                live_peak_mb: None,
                speedup_vs_baseline: None,
                skipped: None,
                note: None,
            };
            let tokens = cand.tokens.or(problem.tokens);
            let started = Instant::now();
            let run = match skip_impls.iter().find(|p| cand.name.contains(p.as_str())) {
                Some(p) => Err(format!("left out by --skip-impl {p}")),
                None => cand.run,
            };
            match run {
                Err(reason) => rec.skipped = Some(reason),
                Ok(runner) => {
                    let (mut peak, mut pool, mut live) = (None, None, None);
                    let res = catch_unwind(AssertUnwindSafe(|| match runner {
                        Runner::InProcess(mut run) => {
                            let times = time_candidate(device, &mut *run, timing);
                            // After warm-up, so autotuning's trial buffers are not counted.
                            if suite.measure_memory
                                && let Some(p) = probe
                            {
                                let m = measure_memory(device, &mut *run, p);
                                peak = m.allocated_mb;
                                pool = m.pool_growth_mb;
                                live = m.live_mb;
                            }
                            Ok(times)
                        }
                        Runner::Timed(run) => run().map(|r| {
                            peak = r.peak_mem_mb;
                            let mut t = r.times_ms;
                            t.sort_by(f64::total_cmp);
                            t
                        }),
                    }));
                    rec.peak_mem_mb = peak;
                    rec.pool_growth_mb = pool;
                    rec.live_peak_mb = live;
                    let panics = PANICS.load(Ordering::Relaxed) - panics_seen;
                    let failures = burn_kernels_core::logging::device_failures() - failures_seen;
                    let res = match res {
                        Ok(Ok(_)) if failures > 0 => Err(Box::new(format!(
                            "{failures} device launch failure(s) logged during this run (see the \
                             log): outputs left unwritten, timings not trusted"
                        ))
                            as Box<dyn std::any::Any + Send>),
                        Ok(Ok(_)) if panics > 0 => Err(Box::new(format!(
                            "{panics} panic(s) in the process during this run (see the log; \
                             e.g. the device runtime out of memory): timings not trusted"
                        ))
                            as Box<dyn std::any::Any + Send>),
                        Ok(Ok(times)) if !times.is_empty() => Ok(times),
                        Ok(Ok(_)) => {
                            Err(Box::new("no timings".to_string()) as Box<dyn std::any::Any + Send>)
                        }
                        Ok(Err(msg)) => Err(Box::new(msg) as Box<dyn std::any::Any + Send>),
                        Err(e) => Err(e),
                    };
                    match res {
                        Ok(times) => {
                            let median = percentile(&times, 0.5);
                            rec.median_ms = Some(median);
                            rec.min_ms = Some(times[0]);
                            rec.p90_ms = Some(percentile(&times, 0.9));
                            rec.reps = times.len();
                            rec.tflops = problem.flops.map(|f| f / (median * 1e-3) / 1e12);
                            rec.gbps = problem.bytes.map(|b| b / (median * 1e-3) / 1e9);
                            rec.tokens_per_sec = tokens.map(|n| n / (median * 1e-3));
                            if let Some(extra) = cand.extra {
                                let extra = extra();
                                rec.params.extend(extra.params);
                                rec.note = extra.note;
                            }
                        }
                        Err(e) => {
                            let msg = e
                                .downcast_ref::<String>()
                                .cloned()
                                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                                .unwrap_or_else(|| "panicked".into());
                            rec.skipped = Some(format!("failed: {msg}"));
                        }
                    }
                }
            }
            // The wall time of the whole candidate (compilation, autotuning, warm-up, reps)
            // shows what a suite's running time is made of.
            let line = format!(
                "  {} | {}: {}{}{}{}{}{} [{:.1} s]",
                problem.label,
                rec.implementation,
                rec.median_ms.map_or_else(
                    || rec.skipped.clone().unwrap_or_default(),
                    |m| format!("{m:.3} ms")
                ),
                rec.tokens_per_sec
                    .map_or(String::new(), |t| format!(", {t:.1} tokens/s")),
                rec.peak_mem_mb
                    .map_or(String::new(), |m| format!(", peak {m:.0} MB")),
                rec.pool_growth_mb
                    .map_or(String::new(), |m| format!(", pool +{m:.0} MB")),
                rec.live_peak_mb
                    .map_or(String::new(), |m| format!(", live {m:.0} MB")),
                rec.note
                    .as_ref()
                    .map_or(String::new(), |n| format!(" ({n})")),
                started.elapsed().as_secs_f64()
            );
            // A log file gets one line per implementation, so a run cut short still says what
            // it measured; a terminal sees them above the bar.
            if bar.is_hidden() {
                eprintln!("{line}");
            } else {
                bar.println(line);
            }
            panics_seen = PANICS.load(Ordering::Relaxed);
            failures_seen = burn_kernels_core::logging::device_failures();
            rows.push(rec);
        }
        let base = rows
            .iter()
            .find(|r| r.implementation == suite.baseline)
            .map(|r| (r.median_ms, r.tokens_per_sec));
        for r in &mut rows {
            r.speedup_vs_baseline = match (base, r.tokens_per_sec) {
                (Some((_, Some(b))), Some(t)) => Some(t / b),
                (Some((b, _)), _) => b.zip(r.median_ms).map(|(b, m)| b / m),
                (None, _) => None,
            };
        }
        records.extend(rows);
        bar.inc(1);
    }
    bar.finish_with_message("done");
    SuiteResult {
        suite: suite.name.to_string(),
        commit: String::new(),
        description: suite.description.to_string(),
        baseline: suite.baseline.to_string(),
        records,
        plot: suite.plot,
    }
}

/// Builds a parameter map from `(name, value)` pairs.
pub fn params<const N: usize>(
    pairs: [(&str, serde_json::Value); N],
) -> BTreeMap<String, serde_json::Value> {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn percentile_is_the_true_median() {
        assert_eq!(super::percentile(&[1.0, 3.0], 0.5), 2.0);
        assert_eq!(super::percentile(&[1.0, 2.0, 10.0], 0.5), 2.0);
        assert_eq!(super::percentile(&[4.0], 0.9), 4.0);
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert!((super::percentile(&ten, 0.9) - 9.1).abs() < 1e-12);
        assert_eq!(super::percentile(&ten, 0.0), 1.0);
        assert_eq!(super::percentile(&ten, 1.0), 10.0);
    }

    use super::*;

    /// A panic on another thread during a candidate's run (as the device runtime's server
    /// thread panics when out of memory) fails that candidate, not the next one.
    #[test]
    fn panic_on_another_thread_fails_the_candidate() {
        let problem = Problem {
            label: "p".into(),
            params: BTreeMap::new(),
            flops: None,
            bytes: None,
            tokens: None,
            setup: Box::new(|_| {
                let mut once = true;
                vec![
                    Candidate::timed_here("clean", || {}),
                    Candidate::timed_here("server-panic", move || {
                        if std::mem::take(&mut once) {
                            let _ = std::thread::spawn(|| panic!("simulated server panic")).join();
                        }
                    }),
                    Candidate::timed_here("after", || {}),
                ]
            }),
        };
        let suite = Suite {
            name: "t",
            description: "",
            baseline: "clean",
            problems: vec![problem],
            plot: None,
            measure_memory: false,
        };
        let timing = Timing {
            warmup: Duration::from_millis(1),
            measure: Duration::from_millis(1),
            min_reps: 2,
            max_reps: 3,
        };
        let res = run_suite(suite, &Device::flex(), timing, None, &[]);
        let by = |n: &str| res.records.iter().find(|r| r.implementation == n).unwrap();
        assert!(by("clean").median_ms.is_some());
        let bad = by("server-panic");
        assert!(bad.median_ms.is_none());
        assert!(
            bad.skipped.as_deref().unwrap().contains("1 panic"),
            "{bad:?}"
        );
        assert!(by("after").median_ms.is_some());
    }
}

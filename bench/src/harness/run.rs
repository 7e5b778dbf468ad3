//! The runner: each problem × implementation warmed up, timed with device synchronization,
//! and reduced to median, min and p90, with panics and device failures failing the candidate
//! they happened in.

use burn::tensor::Device;
use indicatif::{ProgressBar, ProgressStyle};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use super::{
    CallMemory, Candidate, MemoryProbe, Problem, Record, Runner, Suite, SuiteResult, Timing, sync,
};

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

/// Times `run`: the first call (JIT compilation, autotune) and a warm-up are discarded, then
/// each repetition is timed from enqueue to device synchronization. Returns sorted times in ms.
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

/// The true median of `values` (the mean of the middle two for an even count); NaN when empty.
pub fn median(values: &[f64]) -> f64 {
    quantile(values, 0.5)
}

/// The `p` quantile of `values`, interpolated between the two nearest ranks; NaN when empty.
pub fn quantile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    percentile(&sorted, p)
}

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

/// Runs every problem × implementation of `suite` with a progress bar.
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
    let ctx = Context {
        device,
        timing,
        probe: probe.filter(|_| suite.measure_memory),
        skip_impls,
    };
    let mut records = Vec::new();
    for problem in &suite.problems {
        bar.set_message(problem.label.clone());
        count_panics();
        // Panics and device failures from here on (the problem's setup included) fail the
        // candidate that runs next.
        let mut seen = Seen::now();
        let mut rows: Vec<Record> = Vec::new();
        for cand in (problem.setup)(device) {
            let started = Instant::now();
            let rec = ctx.run_candidate(problem, cand, seen);
            seen = Seen::now();
            // The wall time of the whole candidate (compilation, autotuning, warm-up, reps)
            // shows what a suite's running time is made of. A log file gets one line per
            // implementation, so a run cut short still says what it measured; a terminal sees
            // them above the bar.
            let line = report_line(problem, &rec, started.elapsed().as_secs_f64());
            if bar.is_hidden() {
                eprintln!("{line}");
            } else {
                bar.println(line);
            }
            rows.push(rec);
        }
        set_speedups(&mut rows, suite.baseline);
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

/// What every candidate of a suite runs with.
struct Context<'a> {
    device: &'a Device,
    timing: Timing,
    /// The memory probe, where the suite measures memory.
    probe: Option<&'a MemoryProbe>,
    skip_impls: &'a [String],
}

/// A candidate's times (ascending), or why it has none.
type Outcome = Result<Vec<f64>, String>;

/// The process's panic and logged device-failure counts at one moment.
#[derive(Clone, Copy)]
struct Seen {
    panics: usize,
    failures: usize,
}

impl Seen {
    fn now() -> Self {
        Seen {
            panics: PANICS.load(Ordering::Relaxed),
            failures: burn_kernels_core::logging::device_failures(),
        }
    }
}

impl Context<'_> {
    /// Runs one candidate and fills its record: timings, rates, memory, or why it was skipped
    /// or failed.
    fn run_candidate(&self, problem: &Problem, cand: Candidate<'_>, since: Seen) -> Record {
        let mut rec = Record::new(problem, cand.name);
        let run = match self.skip_impls.iter().find(|p| match p.strip_suffix('$') {
            Some(whole) => cand.name == whole,
            None => cand.name.contains(p.as_str()),
        }) {
            Some(p) => Err(format!("left out by --skip-impl {p}")),
            None => cand.run,
        };
        let runner = match run {
            Err(reason) => {
                rec.skipped = Some(reason);
                return rec;
            }
            Ok(runner) => runner,
        };
        match self.measure(runner, &mut rec, since) {
            Ok(times) => {
                let median = percentile(&times, 0.5);
                rec.median_ms = Some(median);
                rec.min_ms = Some(times[0]);
                rec.p90_ms = Some(percentile(&times, 0.9));
                rec.reps = times.len();
                rec.tflops = problem.flops.map(|f| f / (median * 1e-3) / 1e12);
                rec.gbps = problem.bytes.map(|b| b / (median * 1e-3) / 1e9);
                rec.tokens_per_sec = cand.tokens.or(problem.tokens).map(|n| n / (median * 1e-3));
                if let Some(extra) = cand.extra {
                    let extra = extra();
                    rec.params.extend(extra.params);
                    rec.note = extra.note;
                }
            }
            Err(msg) => rec.skipped = Some(format!("failed: {msg}")),
        }
        rec
    }

    /// Runs `runner` (catching its panics) and returns its times, failed where a panic anywhere
    /// in the process or a logged device launch failure happened `since`. Fills the record's
    /// memory figures.
    fn measure(&self, runner: Runner<'_>, rec: &mut Record, since: Seen) -> Outcome {
        let res = catch_unwind(AssertUnwindSafe(|| match runner {
            Runner::InProcess(mut run) => {
                let times = time_candidate(self.device, &mut *run, self.timing);
                // After warm-up, so autotuning's trial buffers are not counted.
                if let Some(p) = self.probe {
                    let m = measure_memory(self.device, &mut *run, p);
                    rec.peak_mem_mb = m.allocated_mb;
                    rec.pool_growth_mb = m.pool_growth_mb;
                    rec.live_peak_mb = m.live_mb;
                }
                Ok(times)
            }
            Runner::Timed(run) => run().map(|r| {
                rec.peak_mem_mb = r.peak_mem_mb;
                let mut t = r.times_ms;
                t.sort_by(f64::total_cmp);
                t
            }),
        }));
        let now = Seen::now();
        let (panics, failures) = (now.panics - since.panics, now.failures - since.failures);
        match res {
            Ok(Ok(_)) if failures > 0 => Err(format!(
                "{failures} device launch failure(s) logged during this run (see the log): \
                 outputs left unwritten, timings not trusted"
            )),
            Ok(Ok(_)) if panics > 0 => Err(format!(
                "{panics} panic(s) in the process during this run (see the log; e.g. the \
                 device runtime out of memory): timings not trusted"
            )),
            Ok(Ok(times)) if !times.is_empty() => Ok(times),
            Ok(Ok(_)) => Err("no timings".to_string()),
            Ok(Err(msg)) => Err(msg),
            Err(e) => Err(e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panicked".into())),
        }
    }
}

impl Record {
    /// An empty record of `implementation` on `problem`.
    fn new(problem: &Problem, implementation: &str) -> Self {
        Record {
            problem: problem.label.clone(),
            params: problem.params.clone(),
            implementation: implementation.to_string(),
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
        }
    }
}

/// Each row's speed-up over the `baseline` implementation's row of the same problem: by
/// tokens/s where both have it, else by median time.
fn set_speedups(rows: &mut [Record], baseline: &str) {
    let base = rows
        .iter()
        .find(|r| r.implementation == baseline)
        .map(|r| (r.median_ms, r.tokens_per_sec));
    for r in rows {
        r.speedup_vs_baseline = match (base, r.tokens_per_sec) {
            (Some((_, Some(b))), Some(t)) => Some(t / b),
            (Some((b, _)), _) => b.zip(r.median_ms).map(|(b, m)| b / m),
            (None, _) => None,
        };
    }
}

/// The log line of one candidate: its median with min, p90 and repetitions (or why it has
/// none), rates, memory, note and the wall time it took. A run cut short by a time limit keeps
/// these lines, while the JSON and markdown are written only at the end.
fn report_line(problem: &Problem, rec: &Record, wall_s: f64) -> String {
    let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or(String::new(), f);
    format!(
        "  {} | {}: {}{}{}{}{}{} [{wall_s:.1} s]",
        problem.label,
        rec.implementation,
        rec.median_ms.map_or_else(
            || rec.skipped.clone().unwrap_or_default(),
            |m| {
                let (min, p90) = (rec.min_ms.unwrap_or(m), rec.p90_ms.unwrap_or(m));
                format!("{m:.3} ms (min {min:.3}, p90 {p90:.3}, {} reps)", rec.reps)
            }
        ),
        opt(rec.tokens_per_sec, &|t| format!(", {t:.1} tokens/s")),
        opt(rec.peak_mem_mb, &|m| format!(", peak {m:.0} MB")),
        opt(rec.pool_growth_mb, &|m| format!(", pool +{m:.0} MB")),
        opt(rec.live_peak_mb, &|m| format!(", live {m:.0} MB")),
        rec.note
            .as_ref()
            .map_or(String::new(), |n| format!(" ({n})")),
    )
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
    use crate::harness::{Setup, Timing};
    use std::collections::BTreeMap;
    use std::time::Duration;

    /// A problem labelled `p` with no counts, whose candidates `setup` makes.
    fn problem_p(setup: Setup) -> Problem {
        Problem {
            label: "p".into(),
            params: BTreeMap::new(),
            flops: None,
            bytes: None,
            tokens: None,
            setup,
        }
    }

    /// A panic on another thread during a candidate's run (as the device runtime's server
    /// thread panics when out of memory) fails that candidate, not the next one.
    #[test]
    fn panic_on_another_thread_fails_the_candidate() {
        let problem = problem_p(Box::new(|_| {
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
        }));
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

    /// A candidate's log line carries its median, min, p90 and repetitions, so a run cut
    /// short before the JSON is written still has them.
    #[test]
    fn report_line_has_min_and_p90() {
        let problem = problem_p(Box::new(|_| Vec::new()));
        let mut rec = Record::new(&problem, "c");
        rec.median_ms = Some(2.5);
        rec.min_ms = Some(2.25);
        rec.p90_ms = Some(3.0);
        rec.reps = 7;
        let line = report_line(&problem, &rec, 1.0);
        assert!(
            line.contains("2.500 ms (min 2.250, p90 3.000, 7 reps)"),
            "{line}"
        );
    }
}

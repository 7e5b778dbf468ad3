//! What the chunked backward did and where its time went, for logs, benchmarks and tests:
//! the vocabulary plan of the last backward on this thread ([`last_backward_plan`]), one call
//! timed pass by pass ([`time_backward_phases`]), and the block sizes it chooses
//! ([`BackwardBlocks`]).

use burn::backend::Backend;
use burn::tensor::Device;
use burn_cubecl::CubeDevice;

pub use crate::blocks::{BackwardBlocks, DeAccumulation};
use crate::live::PerStream;

type Cb = burn_cubecl::CubeBackend;

/// Counts of the backward's vocabulary plan, for logs and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Vocabulary entries whose gradient was computed.
    pub entries: usize,
    /// Chunks processed.
    pub chunks: usize,
    /// Row blocks of dE's second pass (0: dE was accumulated in the vocabulary pass).
    pub de_row_blocks: usize,
    /// The block sizes it ran with.
    pub blocks: Option<BackwardBlocks>,
}

pub(crate) static LAST_PLAN: PerStream<PlanStats> = PerStream::new();
static PHASES: PerStream<BackwardPhases> = PerStream::new();

/// The plan of the last chunked backward run for this thread's stream (for benchmarks, tests
/// and logs). Under Burn's fusion the backward runs when its outputs are read or the device
/// synchronizes: read the plan after that.
pub fn last_backward_plan() -> Option<PlanStats> {
    LAST_PLAN.get()
}

/// Wall time of the chunked backward's passes, ms, each ended by a device synchronization.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BackwardPhases {
    /// The scoring pass (recomputed logits, per-entry scores read back, the plan).
    pub scoring_ms: f64,
    /// The vocabulary pass: dC, and dE where it is accumulated there.
    pub vocabulary_ms: f64,
    /// dE's second pass over row blocks ([`DeAccumulation::RowBlocks`]), else 0.
    pub de_pass_ms: f64,
}

/// Runs `run` with the chunked backward timing its passes (it synchronizes the device between
/// them, which the untimed backward does not) and returns the last backward's phases, if one
/// ran on this thread's stream. `device` is synchronized at the end of `run`, inside the
/// timing, so that a backward Burn's fusion deferred runs there. For benchmarks.
pub fn time_backward_phases(device: &Device, run: impl FnOnce()) -> Option<BackwardPhases> {
    PHASES.replace(Some(BackwardPhases::default()));
    run();
    let _ = device.sync();
    PHASES
        .replace(None)
        .filter(|p| p.scoring_ms + p.vocabulary_ms > 0.0)
}

/// Marks the end of a backward pass when phases are timed: synchronizes `device` and records
/// the time since the previous mark in the field `pick` selects.
pub(crate) struct PhaseClock(Option<std::time::Instant>);

impl PhaseClock {
    pub(crate) fn start(device: &CubeDevice) -> Self {
        let on = PHASES.get().is_some();
        Self(on.then(|| {
            let _ = Cb::sync(device);
            std::time::Instant::now()
        }))
    }

    pub(crate) fn lap(&mut self, device: &CubeDevice, pick: fn(&mut BackwardPhases) -> &mut f64) {
        if let Some(t0) = self.0 {
            let _ = Cb::sync(device);
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            PHASES.update(|phases| *pick(phases) = ms);
            self.0 = Some(std::time::Instant::now());
        }
    }
}

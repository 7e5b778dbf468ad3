//! What the chunked backward did and where its time went, for logs, benchmarks and tests:
//! the vocabulary plan of the last backward on this thread ([`last_backward_plan`]), one call
//! timed pass by pass ([`time_backward_phases`]), and the block sizes it chooses
//! ([`BackwardBlocks`]).

pub use crate::chunked::{
    BackwardBlocks, BackwardPhases, DeAccumulation, PlanStats, last_backward_plan,
    time_backward_phases,
};

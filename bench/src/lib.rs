//! The benchmark runner's library: the harness, the report writer and the suites. The binary
//! (`src/main.rs`, behind `cargo xtask bench`) picks the runtime and runs them. The split keeps
//! `cargo test` from building the binary, which instantiates every suite on concrete backends
//! (minutes of a two-core CI build); the unit tests need only the generic code.

pub mod harness;
pub mod report;
pub mod suites;

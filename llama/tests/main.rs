//! The crate's integration tests, one module per topic, in one binary: a release build
//! re-instantiates Burn's generic backends in every test binary (~2 minutes each on 2 cores).

// Without a CubeCL runtime feature only the CPU tests run; the runtime tests are unused.
#![cfg_attr(not(feature = "cube"), allow(dead_code, unused_imports))]

mod common;

mod checkpoint;
mod data_parallel;

mod finetune;
mod loader;
mod model;
mod replay;
mod sage;
mod spec;
mod spec_law;
mod train;

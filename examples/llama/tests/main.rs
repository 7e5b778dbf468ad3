//! The crate's integration tests, one module per topic, in one binary: a release build
//! re-instantiates Burn's generic backends in every test binary (~2 minutes each on 2 cores).

mod common;

mod finetune;
mod loader;
mod model;
mod sage;
mod spec;
mod train;

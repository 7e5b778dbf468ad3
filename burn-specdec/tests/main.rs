//! The crate's integration tests, one module per topic, in one binary: a release build
//! re-instantiates Burn's generic backends in every test binary (~2 minutes each on 2 cores).

mod common;

mod block;
mod device;
mod errors;
mod exact;
mod figure2;
mod lookup;
mod sampling;

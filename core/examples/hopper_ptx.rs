//! Writes core's Hopper kernels' PTX (compiled without a device) into the directory given as
//! the first argument (default `target/hopper-ptx`), one `<name>.ptx` each, and fails where a
//! kernel with the drain-free main loop (all but the `_stages` ones) keeps a group in flight at
//! fewer than the ring's four stages; `scripts/hopper-ptx.sh` then runs `ptxas -v` on them.

use burn_kernels_core::gemm::hopper::offline::{hopper_ptx, waits_in_flight, write_all};

fn main() -> Result<(), String> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or("target/hopper-ptx".into());
    write_all(dir.as_ref(), hopper_ptx(), |name, ptx| {
        let in_flight = waits_in_flight(ptx);
        (!name.ends_with("_stages") && in_flight < 4)
            .then(|| format!("{in_flight} waits keep a group in flight, fewer than 4"))
    })
}

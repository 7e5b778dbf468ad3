//! Writes burn-sage's Hopper attention kernel's PTX (compiled without a device) into the
//! directory given as the first argument (default `target/hopper-ptx`), one `<name>.ptx` each;
//! `scripts/hopper-ptx.sh` then runs `ptxas -v` on them.

use burn_kernels_core::gemm::hopper::offline::write_all;

fn main() -> Result<(), String> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or("target/hopper-ptx".into());
    write_all(
        dir.as_ref(),
        burn_sage::kernels::attn_wgmma::offline::sage_ptx(),
        |_, _| None,
    )
}

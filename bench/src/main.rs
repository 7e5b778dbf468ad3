//! The benchmark runner behind `cargo xtask bench`.
//!
//! Runs suites of problems × implementations on one backend, prints a markdown table, and
//! writes `<out>/<date>/<device>.json`, `.md` and an SVG chart per suite.

use burn_kernels_bench::{harness, report, suites};

use burn::tensor::Device;
use clap::{Parser, ValueEnum};
use std::path::PathBuf;

/// The runtime the benchmarks measure on: Burn's CubeCL backend (fused, as a Burn user gets
/// it) on one of its runtimes, each behind the Cargo feature of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendKind {
    /// CUDA GPU 0.
    Cuda,
    /// Vulkan (SPIR-V kernels).
    Vulkan,
    /// wgpu (WGSL kernels).
    Wgpu,
}

impl BackendKind {
    /// The `--backend` value, also the Cargo feature of the runtime.
    fn name(self) -> &'static str {
        match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Vulkan => "vulkan",
            BackendKind::Wgpu => "wgpu",
        }
    }

    /// The Burn device, or why this build cannot run there.
    fn device(self) -> Result<Device, String> {
        match self {
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => burn_kernels_core::setup::cuda_preflight()
                .map(|_| Device::cuda(0))
                .map_err(|e| e.to_string()),
            #[cfg(feature = "vulkan")]
            BackendKind::Vulkan => Ok(Device::vulkan(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(feature = "wgpu")]
            BackendKind::Wgpu => Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
            #[allow(unreachable_patterns)]
            other => Err(format!(
                "this binary was built without the `{0}` feature (cargo xtask bench --backend \
                 {0} builds it with)",
                other.name()
            )),
        }
    }
}

#[derive(Debug, Parser)]
#[command(about = "burn-kernels benchmarks: problems × implementations against a baseline")]
struct Args {
    /// Runtime to measure on.
    #[arg(long, value_enum, default_value = "cuda")]
    backend: BackendKind,
    /// Suites to run (repeatable), or `all`.
    #[arg(long = "suite", default_value = "all")]
    suites: Vec<String>,
    /// Fewer sizes and shorter timing, for a smoke test.
    #[arg(long)]
    quick: bool,
    /// Folder for the JSON, markdown and SVG results.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// Device memory (GB) an implementation may use; larger problems are skipped for it.
    #[arg(long, default_value_t = 40.0)]
    max_mem_gb: f64,
    /// Host memory (GB) an implementation may fill (ShadowKV's offloaded values); default
    /// 75% of the memory available now (the rest: pinned staging buffers, the OS).
    #[arg(long)]
    max_host_mem_gb: Option<f64>,
    /// Device name for the results (default: nvidia-smi's name on CUDA, else the backend's).
    #[arg(long)]
    device_name: Option<String>,
    /// Commit the binary was built from (default: the COMMIT file `cargo xtask device-build`
    /// writes, next to the executable or in its parent folder, else `git rev-parse`).
    #[arg(long)]
    commit: Option<String>,
    /// Folder of the peer scripts (PyTorch), relative to the working directory.
    #[arg(long, default_value = "bench/peers")]
    peers_dir: PathBuf,
    /// Run only the problems whose label contains every one of these substrings.
    #[arg(long = "filter")]
    filters: Vec<String>,
    /// Leave out the problems whose label contains any of these substrings.
    #[arg(long = "exclude")]
    excludes: Vec<String>,
    /// Leave out the implementations whose name contains any of these substrings (a pattern
    /// ending in `$` matches a whole name: `--skip-impl 'cce$'` leaves out "cce" alone).
    #[arg(long = "skip-impl")]
    skip_impls: Vec<String>,
    /// cce suite: also time every cubek tensor-core GEMM kernel burn-cce can be told to use
    /// (`GemmStrategy::Kernel`), for the loss and the gradient.
    #[arg(long)]
    cce_gemm_sweep: bool,
    /// cce suite: also time the default with these logits blocks (MiB, comma-separated) for
    /// the forward and the backward's scoring pass instead of 32 MiB.
    #[arg(long, value_delimiter = ',')]
    cce_pass_blocks: Vec<usize>,
    /// cce suite: also time the default with these logits blocks (MiB, comma-separated) for
    /// every pass, the gradient's included (more memory, fewer and larger GEMMs).
    #[arg(long, value_delimiter = ',')]
    cce_chunk_bytes: Vec<usize>,
    /// specdec suite: also time these trained drafts (`finetune` run folders, .gguf or HF
    /// folders; comma-separated) beside the target's first 8 layers. e2e-generate: the first
    /// one replaces the 8-layer draft.
    #[arg(long, value_delimiter = ',')]
    draft_model: Vec<std::path::PathBuf>,
    /// specdec suite: draft lengths L to time (comma-separated; default 4).
    #[arg(long, value_delimiter = ',')]
    draft_lens: Vec<usize>,
    /// specdec suite: numbers of drafts K to time (comma-separated; default 1, 2, 4).
    #[arg(long, value_delimiter = ',')]
    spec_drafts: Vec<usize>,
    /// e2e suite: these batch sizes (comma-separated) instead of 4, 8, 16. Growing batches
    /// find the largest that fits: a problem that runs out of device memory fails, and the
    /// runtime may not recover for the next ones, so run one loss per process
    /// (`--skip-impl cce` / `--skip-impl plain`).
    #[arg(long, value_delimiter = ',')]
    batches: Vec<usize>,
    /// e2e suite: tokens per sequence instead of 1024. The plain loss's logits cost
    /// `49152 · 4` bytes a token whatever the length, the reference attention's saved scores
    /// grow with it: shorter sequences are where CCE's saving decides the batch.
    #[arg(long)]
    seq: Option<usize>,
    /// e2e-dp suite (which `--suite e2e` adds when this lists two GPUs or more): data-parallel
    /// fine-tuning over these CUDA GPUs (comma-separated, e.g. `0,1`) against one GPU.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,
    /// specdec suite: decode with burn-kernels-core's fused layer ops and burn-kvcache's decode
    /// attention kernel (autoregressive and speculative alike) instead of Burn's attention op.
    #[arg(long)]
    decode_kernels: bool,
    /// Tokens the specdec suite generates per repetition (default 64): more weighs the
    /// captured rows' one-time capture less.
    #[arg(long, value_name = "N")]
    spec_new_tokens: Option<usize>,
    /// e2e suite: also time each Burn step's phases (forward + loss, backward, optimizer) with a
    /// device synchronization between them, printed as medians when a candidate ends (the
    /// synchronizations add to the step times of that run).
    #[arg(long)]
    e2e_phases: bool,
    /// e2e suite: Burn's steps recompute activations in the backward instead of keeping them:
    /// `ops` (Burn's balanced gradient checkpointing: RMSNorm's outputs, the SwiGLU product)
    /// or `layers` (burn-llama's layer checkpointing: whole layers; also every replica of the
    /// e2e-dp suite).
    #[arg(long, value_enum)]
    e2e_checkpointing: Option<suites::E2eCheckpointing>,
    /// e2e suite, CUDA: bracket step N (1-based, after warm-up and autotuning) of each Burn
    /// candidate with `cuProfilerStart`/`cuProfilerStop`, so `ncu --profile-from-start off`
    /// profiles the kernels of that one step.
    #[arg(long, value_name = "N")]
    e2e_profile_step: Option<usize>,
    /// Do not measure peak memory (one extra call per implementation, with exact-size
    /// buffers that can run out of memory where the timed runs fit).
    #[arg(long)]
    skip_memory: bool,
    /// Fewest timed repetitions per implementation (default 5, 3 with --quick); fewer keep
    /// long problems within a time limit.
    #[arg(long)]
    min_reps: Option<usize>,
    /// Warm-up time per implementation after its first (compiling) call, ms (default 1000,
    /// 200 with --quick); at least one warm call always runs.
    #[arg(long)]
    warmup_ms: Option<u64>,
    /// Target time of the timed repetitions per implementation, ms (default 2000, 500 with
    /// --quick); `--min-reps` still applies. Shorter keeps a whole suite inside a time limit.
    #[arg(long)]
    measure_ms: Option<u64>,
    /// List the suites and exit.
    #[arg(long)]
    list: bool,
    /// Re-render the markdown and charts of an existing results JSON, running nothing.
    #[arg(long, value_name = "JSON")]
    render: Option<PathBuf>,
}

fn main() {
    // Warnings (e.g. a kernel replaced after a failed launch) show by default; RUST_LOG for more.
    burn_kernels_core::logging::init();
    let args = Args::parse();
    if args.list {
        for s in suites::ALL {
            println!("{s}");
        }
        return;
    }
    if let Some(path) = &args.render {
        if let Err(e) = render(path) {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
        return;
    }
    if let Err(e) = check_drafts(&args.draft_model) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    // Compiled kernels and autotune results persist across runs (warm device calls reuse them).
    let dir = burn_kernels_core::setup::default_cache_dir();
    if let Some(caches) = burn_kernels_core::setup::persistent_caches(&dir) {
        eprintln!("CubeCL caches: {caches}");
    }
    let result = args.backend.device().and_then(|device| {
        let (probe, pool) = runtime(&device)?;
        run(&args, &device, args.backend.name(), Some(probe), pool)
    });
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// Every `--draft-model` must be a training run's checkpoint or a model file or folder, checked
/// before any suite runs (a suite's setup would otherwise fail after the others' timings).
fn check_drafts(paths: &[PathBuf]) -> Result<(), String> {
    for p in paths {
        let model = p.is_file() || p.join("config.json").is_file();
        if burn_llama::finetune::checkpoint_dir(p).is_none() && !model {
            return Err(format!(
                "--draft-model {}: not a finetune run folder (no checkpoint: state.json and \
                 model.mpk), a .gguf file or an HF model folder",
                p.display()
            ));
        }
    }
    Ok(())
}

/// The runtime's memory probe and pool limits for `device` (a CubeCL device).
#[cfg(feature = "cube")]
fn runtime(device: &Device) -> Result<(harness::MemoryProbe, suites::PoolProps), String> {
    let cube = burn_kernels_core::route::cube_device(device)
        .ok_or_else(|| format!("{device:?} is not a CubeCL device"))?;
    let client = cube.client();
    let mem = &client.properties().memory;
    let pool = suites::PoolProps {
        max_page: mem.max_page_size,
        alignment: mem.alignment,
    };
    Ok((memory_probe(client, device.clone()), pool))
}

#[cfg(not(feature = "cube"))]
fn runtime(device: &Device) -> Result<(harness::MemoryProbe, suites::PoolProps), String> {
    Err(format!(
        "{device:?}: this binary was built without a CubeCL runtime (features cuda, vulkan, wgpu)"
    ))
}

/// The runtime's memory-pool readings (see [`harness::MemoryProbe`]), for the pools of this
/// thread's stream (the one Burn's fusion executes this thread's work on).
#[cfg(feature = "cube")]
fn memory_probe(client: cubecl::client::Client, device: Device) -> harness::MemoryProbe {
    use cubecl::MemoryScope;
    use std::sync::Arc;
    let usage =
        |client: &cubecl::client::Client| client.memory_report(MemoryScope::CurrentStream).usage();
    let reserved = {
        let client = client.clone();
        Arc::new(move |cleanup| {
            if cleanup {
                client.memory_cleanup().ok()?;
            }
            Some(usage(&client).bytes_reserved)
        })
    };
    let allocated = Arc::new(move |run: &mut dyn FnMut()| -> Option<u64> {
        client.memory_cleanup().ok()?;
        let before = usage(&client).bytes_reserved;
        // SAFETY: the mode is set for this thread's stream, which runs `run`, and set back
        // before returning; the exact-size buffers left free are released below.
        unsafe { client.allocation_mode(cubecl::MemoryAllocationMode::Persistent) };
        run();
        unsafe { client.allocation_mode(cubecl::MemoryAllocationMode::Auto) };
        let after = usage(&client).bytes_reserved;
        client.memory_cleanup().ok()?;
        Some(after.saturating_sub(before))
    });
    let live = Arc::new(move |run: &mut dyn FnMut()| -> Option<u64> {
        let peak = burn_cce::track_live_peak(&device, run)?;
        eprintln!(
            "  live peak {} B, reached after step \"{}\"",
            peak.bytes, peak.step
        );
        Some(peak.bytes)
    });
    harness::MemoryProbe {
        reserved,
        allocated,
        live,
    }
}

/// 75% of `MemAvailable` (Linux), else 16 GB.
fn default_host_mem_bytes() -> f64 {
    let avail = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
        line.split_whitespace().nth(1)?.parse::<f64>().ok()
    });
    avail.map_or(16e9, |kb| 0.75 * kb * 1024.0)
}

fn render(path: &std::path::Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let report: report::Report =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    // Beside the file: `write` adds the day's folder, which a results file already sits in.
    let mut dir = path.parent().unwrap_or(std::path::Path::new("."));
    if dir.file_name().is_some_and(|d| d == report.date.as_str()) {
        dir = dir.parent().unwrap_or(std::path::Path::new("."));
    }
    for p in report::write(dir, report).map_err(|e| format!("writing results: {e}"))? {
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

fn device_name(args: &Args, device: &Device, backend: &str) -> String {
    if let Some(n) = &args.device_name {
        return n.clone();
    }
    if backend == "cuda"
        && let Ok(out) = std::process::Command::new("nvidia-smi")
            .args(["--query-gpu=name", "--format=csv,noheader"])
            .output()
        && out.status.success()
        && let Some(line) = String::from_utf8_lossy(&out.stdout).lines().next()
    {
        return line.trim().to_string();
    }
    format!("{device:?}")
}

fn commit(args: &Args) -> String {
    if let Some(c) = &args.commit {
        return c.clone();
    }
    // The COMMIT file `cargo xtask device-build` writes at the bundle's root (binaries in its
    // `bin/`) names the commit they were built from; the working tree it runs in may be a copy
    // whose git state is older (the device tool's copy kept the session's first HEAD).
    let bundled = || {
        let exe = std::env::current_exe().ok()?;
        exe.ancestors()
            .skip(1)
            .take(2)
            .find_map(|dir| std::fs::read_to_string(dir.join("COMMIT")).ok())
            .map(|s| s.trim().to_string())
    };
    let git = || {
        std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    bundled().or_else(git).unwrap_or_else(|| "unknown".into())
}

fn run(
    args: &Args,
    device: &Device,
    backend: &str,
    probe: Option<harness::MemoryProbe>,
    pool: suites::PoolProps,
) -> Result<(), String> {
    let mut names: Vec<String> = if args.suites.iter().any(|s| s == "all") {
        suites::ALL.iter().map(|s| s.to_string()).collect()
    } else {
        args.suites.clone()
    };
    // `--suite e2e` is the whole end-to-end table: fine-tuning and generation
    // (`--exclude passkey` leaves the generation out).
    if let Some(i) = names.iter().position(|n| n == "e2e")
        && !names.iter().any(|n| n == "e2e-generate")
    {
        names.insert(i + 1, "e2e-generate".into());
    }
    if let Some(i) = names.iter().position(|n| n == "e2e-generate")
        && args.devices.len() > 1
        && !names.iter().any(|n| n == "e2e-dp")
    {
        names.insert(i + 1, "e2e-dp".into());
    }
    let opts = suites::SuiteOptions {
        quick: args.quick,
        max_mem_bytes: args.max_mem_gb * 1e9,
        max_host_mem_bytes: args
            .max_host_mem_gb
            .map_or_else(default_host_mem_bytes, |gb| gb * 1e9),
        peers_dir: args.peers_dir.clone(),
        pool,
        probe: probe.clone(),
        filters: args.filters.clone(),
        excludes: args.excludes.clone(),
        cce_gemm_sweep: args.cce_gemm_sweep,
        cce_pass_blocks: args.cce_pass_blocks.clone(),
        cce_chunk_bytes: args.cce_chunk_bytes.clone(),
        draft_model: args.draft_model.clone(),
        draft_lens: args.draft_lens.clone(),
        spec_drafts: args.spec_drafts.clone(),
        batches: args.batches.clone(),
        seq: args.seq,
        decode_kernels: args.decode_kernels,
        spec_new_tokens: args.spec_new_tokens,
        e2e_phases: args.e2e_phases,
        e2e_checkpointing: args.e2e_checkpointing,
        e2e_profile_step: args.e2e_profile_step,
        devices: args.devices.clone(),
    };
    let mut built = Vec::new();
    for n in &names {
        let mut suite = suites::build(n, opts.clone()).ok_or_else(|| {
            format!(
                "unknown suite `{n}`; known: {}, {}",
                suites::ALL.join(", "),
                suites::ON_REQUEST.join(", ")
            )
        })?;
        suite.problems.retain(|p| opts.selects(&p.label));
        suite.measure_memory &= !args.skip_memory;
        built.push(suite);
    }
    let device_label = device_name(args, device, backend);
    eprintln!(
        "device: {device_label} ({backend}), suites: {}",
        names.join(", ")
    );
    let mut timing = harness::Timing::new(args.quick);
    if let Some(n) = args.min_reps {
        timing.min_reps = n.max(1);
    }
    if let Some(ms) = args.warmup_ms {
        timing.warmup = std::time::Duration::from_millis(ms);
    }
    if let Some(ms) = args.measure_ms {
        timing.measure = std::time::Duration::from_millis(ms);
    }
    let commit = commit(args);
    let results = built
        .into_iter()
        .map(|s| harness::SuiteResult {
            commit: commit.clone(),
            ..harness::run_suite(s, device, timing, probe.as_ref(), &args.skip_impls)
        })
        .collect();
    let report = report::Report {
        date: report::today(),
        device: device_label,
        backend: backend.to_string(),
        commit,
        suites: results,
    };
    println!("{}", report::markdown(&report));
    let written = report::write(&args.out, report).map_err(|e| format!("writing results: {e}"))?;
    for p in written {
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

//! Where an op runs: its CubeCL kernel, through the crate's backend extension, or the tensor-op
//! reference.
//!
//! Every public op of the paper crates asks [`route`] first, on the caller's thread, before it
//! calls its `Dispatch` extension method. The kernel runs where the tensors live on a CubeCL
//! device (CUDA, Vulkan, wgpu, …) of a runtime this crate was built for, whether Burn's `Cube`
//! backend is fused (`Fusion<CubeBackend>`, Burn's default) or not; everywhere else (Burn's
//! `Flex` CPU backend, a device with autodiff for an op without a backward, a configuration the
//! kernel does not cover) the reference runs, and a configuration the kernel does not cover is
//! logged once per op and reason.
//!
//! Tests hold [`require_kernels`] around calls that must run kernels: within it a call that
//! would take the reference on a CubeCL device panics instead, naming the op and the reason.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{Device, StreamId};

/// Whether the op has a backward on the autodiff backend (CCE), or runs forward only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grad {
    /// The extension implements `Autodiff<B>`: tensors on an autodiff device take the kernel.
    Differentiable,
    /// Forward only: on an autodiff device the (differentiable) reference runs.
    ForwardOnly,
}

thread_local! {
    static STRICT: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with kernels required: a call inside it that would take the tensor-op reference
/// on a CubeCL device panics with the op's name and the reason. For tests.
pub fn require_kernels<T>(f: impl FnOnce() -> T) -> T {
    let before = STRICT.with(|s| s.replace(true));
    let out = f();
    STRICT.with(|s| s.set(before));
    out
}

/// Whether this build can run kernels on `device` (a CubeCL device of a runtime this crate
/// was built for), and the CubeCL device if so. Autodiff is looked through.
#[cfg(feature = "cube")]
pub fn cube_device(device: &Device) -> Option<burn_cubecl::CubeDevice> {
    match device.clone().inner().as_dispatch() {
        burn::backend::DispatchDevice::Cube(d) => Some(d.clone()),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// Whether this build can run kernels on `device`: never, without a CubeCL runtime feature.
#[cfg(not(feature = "cube"))]
pub fn cube_device(_device: &Device) -> Option<burn_cubecl::CubeDevice> {
    None
}

/// Device memory in use on `device`'s current stream, in bytes (CubeCL's `bytes_in_use`: every
/// slice whose handle is alive, without page rounding); `None` where `device` is not a CubeCL
/// device of this build. Work Burn's fusion deferred is not counted until the device is
/// synchronized. For benchmarks and memory tests.
pub fn memory_in_use(device: &Device) -> Option<u64> {
    #[cfg(feature = "cube")]
    {
        Some(bytes_in_use(&cube_device(device)?.client()))
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        None
    }
}

/// [`memory_in_use`] of a CubeCL client.
pub fn bytes_in_use(client: &cubecl::client::Client) -> u64 {
    client
        .memory_report(cubecl::MemoryScope::CurrentStream)
        .streams
        .iter()
        .map(|stream| stream.pools.usage().bytes_in_use)
        .sum()
}

/// Whether `device` is a CubeCL device of the CUDA runtime.
pub fn is_cuda(device: &Device) -> bool {
    #[cfg(feature = "cube")]
    {
        cube_device(device).is_some_and(|d| d.runtime() == burn_cubecl::cubecl::RuntimeId::Cuda)
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        false
    }
}

/// Whether `device` is a CubeCL device of the wgpu runtime (Vulkan, Metal, WebGPU).
pub fn is_wgpu(device: &Device) -> bool {
    #[cfg(feature = "cube")]
    {
        cube_device(device).is_some_and(|d| d.runtime() == burn_cubecl::cubecl::RuntimeId::Wgpu)
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        false
    }
}

/// Decides whether `op` runs its kernel on `device`: `true` for the kernel, `false` for the
/// reference. `unsupported` is why the kernel cannot take this call (shape, dtype, option),
/// if it cannot; it is logged once per op and reason. Ops that `BURN_KERNELS_REFERENCE` lists
/// (comma-separated names) always take the reference.
///
/// # Panics
/// Inside [`require_kernels`], when the answer is the reference on a CubeCL device.
pub fn route(op: &'static str, device: &Device, grad: Grad, unsupported: Option<String>) -> bool {
    let on_cube = cube_device(device).is_some();
    if on_cube && forced_reference(op) {
        log_once(op, "BURN_KERNELS_REFERENCE lists it");
        return false;
    }
    let reason = if !on_cube {
        None
    } else if grad == Grad::ForwardOnly && device.is_autodiff() {
        Some("the device has autodiff and the kernel has no backward".to_string())
    } else {
        unsupported
    };
    match (on_cube, reason) {
        (true, None) => true,
        (true, Some(reason)) => {
            if STRICT.with(Cell::get) {
                panic!("{op}: the tensor-op reference would run on {device:?}: {reason}");
            }
            log_once(op, &reason);
            false
        }
        (false, _) => {
            if STRICT.with(Cell::get) {
                panic!(
                    "{op}: {device:?} runs no kernels in this build (enable the crate's cuda, \
                     vulkan or wgpu feature)"
                );
            }
            false
        }
    }
}

/// Whether `BURN_KERNELS_REFERENCE` (ops' names, comma-separated, e.g. `gemv_t,rope2`) lists
/// `op`: those ops take the tensor-op reference on every device, even inside
/// [`require_kernels`]. For locating a kernel that misbehaves on a device by taking kernels out
/// one at a time.
fn forced_reference(op: &str) -> bool {
    static LISTED: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    LISTED
        .get_or_init(|| {
            std::env::var("BURN_KERNELS_REFERENCE")
                .map(|v| v.split(',').map(|s| s.trim().to_string()).collect())
                .unwrap_or_default()
        })
        .iter()
        .any(|o| o == op)
}

fn log_once(op: &'static str, reason: &str) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let key = format!("{op}: {reason}");
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if seen.get_or_insert_with(HashSet::new).insert(key) {
        log::info!("{op} runs the tensor-op reference: {reason}");
    }
}

static LAUNCHES: Mutex<Vec<(&'static str, &'static AtomicU64)>> = Mutex::new(Vec::new());

/// Counts one launch of `op`'s kernel (called by the `CubeBackend` implementations, when the
/// kernel is enqueued; under fusion that is when the fused stream executes).
pub fn count_launch(op: &'static str) {
    counter(op).fetch_add(1, Ordering::Relaxed);
    let key = (StreamId::current().value, op);
    let mut all = STREAM_LAUNCHES.lock().unwrap_or_else(|e| e.into_inner());
    *all.get_or_insert_with(HashMap::new).entry(key).or_insert(0) += 1;
}

/// Launch counts per (stream, op): see [`stream_launches`]. An entry per stream that launched
/// the op, kept for the process (streams are per thread: a few per test or worker thread).
#[allow(clippy::type_complexity)]
static STREAM_LAUNCHES: Mutex<Option<HashMap<(u64, &'static str), u64>>> = Mutex::new(None);

/// Kernel launches of `op` counted so far for the calling thread's stream: what a test that
/// asserts an exact count reads, since tests on other threads launch the same kernels
/// concurrently. Under fusion the launch happens on the device's thread, but for the stream of
/// the thread that queued the op, so the count is the caller's.
pub fn stream_launches(op: &'static str) -> u64 {
    let key = (StreamId::current().value, op);
    let all = STREAM_LAUNCHES.lock().unwrap_or_else(|e| e.into_inner());
    all.as_ref().and_then(|m| m.get(&key)).copied().unwrap_or(0)
}

/// Kernel launches of `op` counted so far in this process (see [`count_launch`]).
pub fn launches(op: &'static str) -> u64 {
    counter(op).load(Ordering::Relaxed)
}

fn counter(op: &'static str) -> &'static AtomicU64 {
    let mut all = LAUNCHES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, c)) = all.iter().find(|(name, _)| *name == op) {
        return c;
    }
    let c: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
    all.push((op, c));
    c
}

//! Launching one GEMM with a chosen cubek kernel (moved here from burn-cce so the model's
//! projections can use it too).
//!
//! A launch can fail after `launch_ref` returned: CubeCL 0.12's CUDA server validates a kernel's
//! tensor-memory-accelerator descriptors when it launches it, on the device thread, and marks
//! the launch's buffers as carrying the failure instead of returning it; kernels that later read
//! those buffers, or memory the pool hands out again from them, are skipped and fail in turn. On
//! an H200 (2026-11-27/28) Burn's autotuned matmul failed that way ("Tile shape must be non-zero
//! and <= 256"): for a row-major f16/bf16 `lhs` with `m ≥ 4n`, cubek's TMA routines on the `cmma`
//! tile instruction (simple and specialized) choose a 32-row tile and 16 rows of them, a
//! 512-row TMA box, which the driver refuses; a tensor map counts as written, so the failure
//! also marks the matmul's inputs and every later candidate and kernel reading them fails
//! (burn-cubecl's autotune then decides for no measured candidate). Their `mma` twins (16-row
//! tiles, swizzled boxes of at most 256 rows), which [`GemmKernel::DEFAULT`] names, run.
//! So the first launch of each kernel at each problem is checked (`Client::check`, a round trip
//! to the device thread, no device synchronization); a kernel that failed is replaced by the
//! next candidate for that problem from then on, with a log line, and its output is kept out of
//! the pool.

use burn::tensor::{DType, Shape};
use burn_cubecl::{CubeTuneId, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor};
use cubecl::client::Client;
use cubecl::std::tensor::TensorHandle;
use cubek::{
    matmul::{
        definition::{MatmulElems, MatmulGlobalElems},
        kernels::{
            MatmulOpStrategy,
            plan::{MatmulCall, MatmulCallInput},
            select::{problem::MatmulProblem, selector::select},
            tensor::PlainTensor,
            tune::MatmulTableGroups,
        },
        launch::launch_ref,
        multi_level::{
            Strategy as MultiLevel,
            components::tile::TileMatmulKind,
            routines::{
                TileSizeSelection,
                batch::{
                    double_buffering::DoubleBufferingArgs,
                    ordered_double_buffering::OrderedSelectionArgs, simple::SimpleArgs,
                    simple_unit::SimpleUnitSelectionArgs,
                },
            },
        },
        routine::BlueprintStrategy,
        strategy::Strategy,
    },
    std::{Hardware, InputBinding, plan::Plan},
};
use std::collections::HashMap;
use std::sync::Mutex;

use burn::backend::cubecl::dtype_to_storage_type;

use super::GemmKernel;

/// `[rows, cols]` of a matrix.
pub fn dims2(t: &CubeTensor) -> [usize; 2] {
    t.meta.shape().dims::<2>()
}

/// How one candidate kernel is launched: a cubek multi-level strategy through `launch_ref`, or
/// cubek's tile-DSL routines through their selection and autotune tables.
#[derive(Clone)]
enum Launch {
    Cubek(Strategy),
    TileDsl,
    Wgmma,
}

impl std::fmt::Display for Launch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Launch::Cubek(strategy) => write!(f, "{strategy}"),
            Launch::TileDsl => f.write_str("tile-dsl (cubek tables)"),
            Launch::Wgmma => f.write_str("wgmma (burn-kernels-core)"),
        }
    }
}

/// The launch counter ([`crate::route::launches`]) of GEMMs that ran on this crate's Hopper
/// kernel ([`GemmKernel::Wgmma`]), counted once the launch is known to have run.
pub const WGMMA_LAUNCHES: &str = "gemm-wgmma";

impl Launch {
    /// Counts a launch that ran, for the kernels tests ask about.
    fn count(&self) {
        if matches!(self, Launch::Wgmma) {
            crate::route::count_launch(WGMMA_LAUNCHES);
        }
    }

    fn of(kernel: GemmKernel) -> Self {
        match kernel {
            GemmKernel::Wgmma => Launch::Wgmma,
            GemmKernel::TileDsl => Launch::TileDsl,
            other => Launch::Cubek(cubek_strategy(other).expect("a cubek strategy")),
        }
    }

    /// Writes `lhs · rhs` into `out` (contiguous `[m, n]` in `out_dtype`); an error where the
    /// kernel refuses the problem before launching.
    fn launch(
        &self,
        lhs: &CubeTensor,
        rhs: &CubeTensor,
        out: &CubeTensor,
        out_dtype: DType,
    ) -> Result<(), String> {
        let client: Client = lhs.client.clone();
        let in_storage = dtype_to_storage_type(lhs.dtype);
        let out_storage = dtype_to_storage_type(out_dtype);
        match self {
            Launch::Wgmma => super::hopper::hopper_gemm(lhs, rhs, out, out_dtype),
            Launch::Cubek(strategy) => {
                let mut elems = MatmulElems::from_globals(&MatmulGlobalElems {
                    lhs: in_storage,
                    rhs: in_storage,
                    out: out_storage,
                });
                launch_ref(
                    strategy,
                    &client,
                    InputBinding::new(lhs.clone().binding(), in_storage),
                    InputBinding::new(rhs.clone().binding(), in_storage),
                    out.clone().binding(),
                    &mut elems,
                )
                .map_err(|err| format!("{err:?}"))
            }
            Launch::TileDsl => {
                let input = |t: &CubeTensor| {
                    MatmulCallInput::plain(PlainTensor::new(t.clone().binding(), in_storage))
                };
                let (lhs_in, rhs_in) = (input(lhs), input(rhs));
                let problem = MatmulProblem::new(
                    (lhs.meta.shape(), lhs_in.tensor.kind()),
                    (rhs.meta.shape(), rhs_in.tensor.kind()),
                );
                let hw = Hardware::from_client(&client);
                // Its point is the Hopper boxes (TMA fills, warpgroup MMA). Elsewhere the
                // portable kernels serve; on Vulkan (lavapipe) the tables' first autotune also hung
                // in wgpu's device poll (2026-11-27), as Burn's does from cold caches.
                if !hw.bulk_tensor_copy() {
                    return Err("no tensor memory accelerator on this device".into());
                }
                let plan = select(
                    MatmulOpStrategy::Autotune,
                    &problem,
                    &hw,
                    MatmulTableGroups::default(),
                )
                .map_err(|why| format!("{why}"))?;
                let destination = TensorHandle::new(
                    out.handle.clone(),
                    out.meta.shape().clone(),
                    out.meta.strides().clone(),
                    out_storage,
                );
                let call = MatmulCall {
                    hw,
                    tune_id: CubeTuneId::new(&client, &lhs.device),
                    client,
                    lhs: lhs_in,
                    rhs: rhs_in,
                    out: out_storage,
                    routes: None,
                    destination: Some(destination),
                };
                plan.launch(&call)
                    .map(|_| ())
                    .map_err(|why| format!("{why}"))
            }
        }
    }
}

/// cubek's multi-level launch strategy for `kernel`; `None` for [`GemmKernel::TileDsl`], which
/// goes through cubek's tile-DSL selection instead, and for this crate's [`GemmKernel::Wgmma`].
fn cubek_strategy(kernel: GemmKernel) -> Option<Strategy> {
    let simple = |multi_rows| SimpleArgs {
        multi_rows,
        tile_matmul: TileMatmulKind::Mma,
    };
    let simple_cmma = |multi_rows| SimpleArgs {
        multi_rows,
        tile_matmul: TileMatmulKind::Cmma,
    };
    let double = |specialized| DoubleBufferingArgs {
        specialized,
        tile_matmul: TileMatmulKind::Mma,
    };
    let ordered = |row_count| OrderedSelectionArgs {
        partition_k: Some(2),
        row_count: Some(row_count),
        rows_per_plane: Some(2),
        tile_matmul: TileMatmulKind::Mma,
    };
    use BlueprintStrategy::Inferred;
    let strategy = match kernel {
        GemmKernel::DoubleCyclic => MultiLevel::DoubleCyclicMma(Inferred(double(false))),
        GemmKernel::DoubleCyclicSpecialized => MultiLevel::DoubleCyclicMma(Inferred(double(true))),
        GemmKernel::SimpleCyclic => MultiLevel::SimpleCyclicMma(Inferred(simple(false))),
        GemmKernel::SimpleCyclicMultiRow => MultiLevel::SimpleCyclicMma(Inferred(simple(true))),
        GemmKernel::OrderedDouble4 => MultiLevel::OrderedDoubleMma(Inferred(ordered(4))),
        GemmKernel::OrderedDouble8 => MultiLevel::OrderedDoubleMma(Inferred(ordered(8))),
        GemmKernel::SpecializedCyclic => MultiLevel::SpecializedCyclicMma(Inferred(().into())),
        GemmKernel::SimpleTma => MultiLevel::SimpleTmaMma(Inferred(simple(false))),
        GemmKernel::SimpleTmaMultiRow => MultiLevel::SimpleTmaMma(Inferred(simple(true))),
        GemmKernel::SimpleTmaCmma => MultiLevel::SimpleTmaCmma(Inferred(simple_cmma(false))),
        GemmKernel::SimpleTmaMultiRowCmma => MultiLevel::SimpleTmaCmma(Inferred(simple_cmma(true))),
        GemmKernel::SpecializedTmaCmma => MultiLevel::SpecializedTmaCmma(Inferred(().into())),
        GemmKernel::SpecializedTma => MultiLevel::SpecializedTmaMma(Inferred(().into())),
        GemmKernel::TileDsl | GemmKernel::Wgmma => return None,
    };
    Some(strategy.into())
}

/// One GEMM problem under one strategy: what decides whether a launch can succeed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct LaunchKey {
    device: String,
    strategy: String,
    lhs: (Vec<usize>, Vec<usize>),
    rhs: (Vec<usize>, Vec<usize>),
    dtypes: (DType, DType),
}

/// Whether each strategy launched at each problem it was tried on.
static VERDICTS: Mutex<Option<HashMap<LaunchKey, bool>>> = Mutex::new(None);

fn verdict(key: &LaunchKey) -> Option<bool> {
    let verdicts = VERDICTS.lock().unwrap_or_else(|e| e.into_inner());
    verdicts.as_ref().and_then(|v| v.get(key).copied())
}

/// Outputs of launches that failed, kept for the process's lifetime: CubeCL marks a failed
/// launch's buffers as carrying the failure, and a later allocation reusing that memory would
/// carry it too (every following kernel then reads as failed).
static QUARANTINE: Mutex<Vec<CubeTensor>> = Mutex::new(Vec::new());

/// Keeps the output of a launch that failed for the process's lifetime (see [`QUARANTINE`]).
pub(crate) fn quarantine(out: CubeTensor) {
    QUARANTINE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(out);
}

fn record(key: LaunchKey, ran: bool) {
    let mut verdicts = VERDICTS.lock().unwrap_or_else(|e| e.into_inner());
    verdicts.get_or_insert_with(HashMap::new).insert(key, ran);
}

/// The last cause in a CubeCL error chain (its root), on one line.
fn root_cause(err: &impl std::fmt::Display) -> String {
    let text = err.to_string();
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    lines
        .iter()
        .rposition(|l| *l == "Caused by:")
        .and_then(|i| lines.get(i + 1))
        .unwrap_or(&lines.first().copied().unwrap_or_default())
        .to_string()
}

/// `lhs · rhs` (`[m, k] · [k, n]`, any strides; or batches of them, `[.., m, k] · [.., k, n]`
/// with the same leading dimensions) into a new contiguous `[.., m, n]` tensor of `dtype`
/// (f32 accumulation), by `kernel`, else the portable double-buffered kernel, else the unit
/// kernel; `None` where the runtime runs none of them (the caller then autotunes). Tensor cores
/// are used for f16/bf16 inputs, and for f32 only with `tf32`.
pub fn fixed_gemm(
    lhs: CubeTensor,
    rhs: CubeTensor,
    dtype: DType,
    kernel: GemmKernel,
    tf32: bool,
) -> Option<CubeTensor> {
    let (lhs_dims, rhs_dims) = (lhs.meta.shape().to_vec(), rhs.meta.shape().to_vec());
    let rank = lhs_dims.len();
    assert!(
        rank >= 2 && rhs_dims.len() == rank && lhs_dims[..rank - 2] == rhs_dims[..rank - 2],
        "gemm: operands {lhs_dims:?} · {rhs_dims:?} are not (batches of) matrices"
    );
    let (m, k, n) = (lhs_dims[rank - 2], lhs_dims[rank - 1], rhs_dims[rank - 1]);
    let mut out_dims = lhs_dims[..rank - 2].to_vec();
    out_dims.extend([m, n]);
    let in_dtype = lhs.dtype;
    // Tensor-core tiles for half-precision inputs, and for f32 where TF32 is allowed; no
    // dimension smaller than a tile.
    let tensor_cores = (matches!(in_dtype, DType::F16 | DType::BF16)
        || (tf32 && in_dtype == DType::F32))
        && m.min(n).min(k) >= 16;
    let unit = Launch::Cubek(
        MultiLevel::SimpleUnit(BlueprintStrategy::Inferred(SimpleUnitSelectionArgs {
            tile_size: TileSizeSelection::MinTileSize,
        }))
        .into(),
    );
    let mma = Launch::of(kernel);
    // A kernel the device cannot run (TMA before Hopper, on Vulkan) falls back to the
    // portable double-buffered one, then to the unit kernel.
    // The Hopper kernel falls back to cubek's fastest `mma` one before the portable ones.
    let candidates = match (tensor_cores, kernel) {
        (true, GemmKernel::DoubleCyclic) => vec![mma, unit],
        (true, GemmKernel::Wgmma) => vec![
            mma,
            Launch::of(GemmKernel::SpecializedTma),
            Launch::of(GemmKernel::DoubleCyclic),
            unit,
        ],
        (true, _) => vec![mma, Launch::of(GemmKernel::DoubleCyclic), unit],
        (false, _) => vec![unit],
    };
    let client: Client = lhs.client.clone();
    let layout = |t: &CubeTensor| (t.meta.shape().to_vec(), t.meta.strides().to_vec());
    // Kernels whose checked launch failed. They are marked as failing only once a later kernel
    // runs: when every kernel fails, the failure is the process's (an earlier failure spreading
    // through reused memory), not theirs.
    let mut failed: Vec<LaunchKey> = Vec::new();
    for strategy in candidates {
        let key = LaunchKey {
            device: format!("{:?}", lhs.device),
            strategy: strategy.to_string(),
            lhs: layout(&lhs),
            rhs: layout(&rhs),
            dtypes: (in_dtype, dtype),
        };
        let known = verdict(&key);
        if known == Some(false) {
            continue;
        }
        let out = empty_device_contiguous_dtype(
            lhs.client.clone(),
            lhs.device.clone(),
            Shape::from(out_dims.clone()),
            dtype,
        );
        if let Err(err) = strategy.launch(&lhs, &rhs, &out, dtype) {
            log::debug!("gemm: {strategy} unavailable here ({err})");
            record(key, false);
            continue;
        }
        if known == Some(true) {
            // A kernel known to run at this problem ran after the ones that failed here.
            for key in failed {
                record(key, false);
            }
            strategy.count();
            return Some(out);
        }
        // The first launch of this kernel at this problem: did the device thread run it?
        match client.check([&out.handle]) {
            Ok(()) => {
                record(key, true);
                for key in failed {
                    record(key, false);
                }
                strategy.count();
                return Some(out);
            }
            Err(err) => {
                log::warn!(
                    "gemm: {strategy} failed to launch for [{m}×{k}]·[{k}×{n}] {in_dtype:?} \
                     ({}); the next kernel runs this GEMM",
                    root_cause(&err)
                );
                log::debug!("gemm: {err}");
                failed.push(key);
                quarantine(out);
            }
        }
    }
    None
}

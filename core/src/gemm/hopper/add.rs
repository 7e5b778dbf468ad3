//! The Hopper GEMM's adding stores: `out += lhs · rhs` into an f32 accumulator
//! ([`hopper_gemm_add`]) or into a compensated 16-bit sum ([`hopper_gemm_add_compensated`]),
//! each product summed in f32 in the kernel's registers and added as its tile is stored: no
//! product is written to memory, and no separate addition runs.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::wgmma::Accumulator;

use super::{
    Epilogue, HopperTile, Plan, Reduction, epilogue, gemm_into, launch, persistent, plan,
    prefetched,
};

/// Where `t` is not a contiguous `[m, n]` tensor of one of `dtypes` for `plan`'s product, why.
fn refused(t: &CubeTensor, plan: &Plan, dtypes: &[DType], what: &str) -> Option<String> {
    let strides = t.meta.strides();
    let contiguous = strides.len() == 2 && strides[0] == plan.n && strides[1] == 1;
    let shaped = t.meta.shape().num_dims() == 2 && t.meta.shape().dims::<2>() == [plan.m, plan.n];
    (!dtypes.contains(&t.dtype) || !shaped || !contiguous).then(|| {
        format!(
            "{what} of {:?} {:?} for a [{}, {}] product (contiguous {dtypes:?} only)",
            t.dtype,
            t.meta.shape(),
            plan.m,
            plan.n
        )
    })
}

/// Adds `lhs · rhs` (`[m, k] · [k, n]`) into `out` (contiguous `[m, n]` f32), summed in f32 in
/// the kernel's registers: `out` takes the place of a product and its addition (an f32
/// accumulator over chunks of K, as burn-cce's dE blocks). An error where
/// [`super::unsupported`] says why not, where `out` is not contiguous f32 of that shape, and
/// where the kernel (tile and dtype) failed to launch on this device (checked at its first
/// launch in the process; `out` then holds no valid sum).
pub fn hopper_gemm_add(lhs: &CubeTensor, rhs: &CubeTensor, out: &CubeTensor) -> Result<(), String> {
    let plan = plan(&lhs.client, lhs, rhs)?;
    if let Some(why) = refused(out, &plan, &[DType::F32], "an accumulator") {
        return Err(why);
    }
    let tile = HopperTile {
        epilogue: Epilogue::Add,
        ..plan.tile
    };
    epilogue::verified((tile, lhs.dtype), out.clone(), || {
        gemm_into(lhs, rhs, &plan, (out, DType::F32), true)
    })
    .map(|_| ())
}

/// How [`hopper_gemm_add_compensated_with`] reads and writes the compensated pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CompensatedStore {
    /// Each unit reads and writes its own values, two adjacent columns at a time, in the
    /// epilogue (any `n`).
    Pairwise,
    /// Each warp's rows staged through shared memory in slices of 32 columns and the pair read
    /// and written eight values at a time, in the epilogue (`n` a multiple of 8, the pair
    /// starting on whole vectors): see `store_compensated_wide`.
    Wide,
    /// The pair loaded by TMA during the main loop, updated in shared memory and stored by TMA
    /// (the sum in the operands' dtype, `n` a multiple of 16, 16-byte aligned starts; tiles of
    /// [`prefetched::PREFETCH_BN`] columns).
    Prefetched,
    /// As `Prefetched`, in a persistent kernel: one cube an SM walks several tiles, the next
    /// tile's stages loaded while this tile's pair is updated and stored (see `persistent.rs`).
    /// The default where it fits (H100: 0.201 ms a chunk of burn-cce's dE carry at the
    /// Gemma-2 shape against the prefetched kernel's 0.212).
    Persistent,
}

/// Adds `lhs · rhs` (`[m, k] · [k, n]`) into the compensated sum `sum + fix · |sum| · 2⁻¹⁵`:
/// `sum` (contiguous `[m, n]` bf16 or f16) holds the running sum rounded to its dtype, `fix`
/// (contiguous `[m, n]` i8) each value's rounding error in units of `|sum| · 2⁻¹⁵`. Each
/// product is summed in f32 in the kernel's registers and added in f32; both tensors are
/// rewritten. Zero-filled, they are a zero sum.
///
/// For a long sum kept in a 16-bit tensor (burn-cce's dE over vocabulary chunks) with one byte
/// per value besides it, rather than an f32 accumulator's four: with bf16 each addition rounds
/// the pair at about `|sum| · 2⁻¹⁶` (bf16 alone: `2⁻⁹`), and `sum` is the compensated sum
/// rounded to bf16. f16's narrow exponent range gives small values less: prefer bf16.
///
/// The fastest [`CompensatedStore`] the problem allows: [`CompensatedStore::Persistent`] unless
/// it does not fit or failed to launch before in this process, then `Prefetched` (the same
/// fit), `Wide`, `Pairwise`. `BURN_KERNELS_COMPENSATED_STORE=prefetched` (or `wide`,
/// `pairwise`) caps the choice there, for measurements side by side.
/// One launch, K never split. An error where [`super::unsupported`] says why not, where `sum`
/// or `fix` is not as above, and where the kernel (tile and dtype) failed to launch on this
/// device (checked at its first launch in the process; the pair then holds no valid sum).
pub fn hopper_gemm_add_compensated(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    sum: &CubeTensor,
    fix: &CubeTensor,
) -> Result<(), String> {
    let plan = checked_plan(lhs, rhs, sum, fix)?;
    let cap = store_cap();
    let tma = prefetched::refused(&plan, lhs, sum, fix).is_none();
    let store = if cap == CompensatedStore::Persistent
        && tma
        && !prefetched::failed_before(&plan, CompensatedStore::Persistent, lhs.dtype)
    {
        CompensatedStore::Persistent
    } else if matches!(
        cap,
        CompensatedStore::Persistent | CompensatedStore::Prefetched
    ) && tma
        && !prefetched::failed_before(&plan, CompensatedStore::Prefetched, lhs.dtype)
    {
        CompensatedStore::Prefetched
    } else if cap != CompensatedStore::Pairwise && wide_fits(&plan, sum, fix) {
        CompensatedStore::Wide
    } else {
        CompensatedStore::Pairwise
    };
    launch_compensated(lhs, rhs, &plan, sum, fix, store)
}

/// The first store the default's choice tries (`BURN_KERNELS_COMPENSATED_STORE`, read once):
/// `Persistent` unless it names another.
fn store_cap() -> CompensatedStore {
    static CAP: std::sync::OnceLock<CompensatedStore> = std::sync::OnceLock::new();
    *CAP.get_or_init(
        || match std::env::var("BURN_KERNELS_COMPENSATED_STORE").as_deref() {
            Ok("prefetched") => CompensatedStore::Prefetched,
            Ok("wide") => CompensatedStore::Wide,
            Ok("pairwise") => CompensatedStore::Pairwise,
            _ => CompensatedStore::Persistent,
        },
    )
}

/// [`hopper_gemm_add_compensated`] with the given [`CompensatedStore`]: an error also where it
/// does not fit the problem.
pub fn hopper_gemm_add_compensated_with(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    sum: &CubeTensor,
    fix: &CubeTensor,
    store: CompensatedStore,
) -> Result<(), String> {
    let plan = checked_plan(lhs, rhs, sum, fix)?;
    match store {
        CompensatedStore::Prefetched | CompensatedStore::Persistent => {
            if let Some(why) = prefetched::refused(&plan, lhs, sum, fix) {
                return Err(why);
            }
        }
        CompensatedStore::Wide if !wide_fits(&plan, sum, fix) => {
            return Err(format!(
                "{store:?}: n = {} or the pair's start unaligned",
                plan.n
            ));
        }
        _ => {}
    }
    launch_compensated(lhs, rhs, &plan, sum, fix, store)
}

/// The plan of `lhs · rhs` added into the pair, or why the pair or the product is refused.
fn checked_plan(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    sum: &CubeTensor,
    fix: &CubeTensor,
) -> Result<Plan, String> {
    let plan = plan(&lhs.client, lhs, rhs)?;
    let why = refused(sum, &plan, &[DType::BF16, DType::F16], "a sum")
        .or_else(|| refused(fix, &plan, &[DType::I8], "corrections"));
    match why {
        Some(why) => Err(why),
        None => Ok(plan),
    }
}

/// Eight values at a time where every row starts on a whole vector: 16 bytes of the sum, 8 of
/// the corrections.
fn wide_fits(plan: &Plan, sum: &CubeTensor, fix: &CubeTensor) -> bool {
    let offset = |t: &CubeTensor| t.handle.offset_start.unwrap_or(0);
    plan.n.is_multiple_of(8) && offset(sum).is_multiple_of(16) && offset(fix).is_multiple_of(8)
}

fn launch_compensated(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    plan: &Plan,
    sum: &CubeTensor,
    fix: &CubeTensor,
    store: CompensatedStore,
) -> Result<(), String> {
    match store {
        CompensatedStore::Prefetched => return prefetched::launch(lhs, rhs, plan, sum, fix),
        CompensatedStore::Persistent => return persistent::launch(lhs, rhs, plan, sum, fix),
        CompensatedStore::Wide | CompensatedStore::Pairwise => {}
    }
    let epilogue = Epilogue::AddCompensated { store };
    let tile = HopperTile {
        epilogue,
        ..plan.tile
    };
    let reduction = Reduction {
        epilogue,
        fix: fix.clone(),
        ..Reduction::none(lhs)
    };
    epilogue::verified((tile, lhs.dtype), sum.clone(), || {
        launch(lhs, rhs, plan, (sum.clone(), sum.dtype), 1, reduction)
    })
    .map(|_| ())
}

/// The unit of a compensated sum's correction, relative to its value: `|hi| · 2⁻¹⁵`. A value
/// rounded to bf16 is within `|hi| · 2⁻⁸` of the exact sum, so the correction fits an `i8`.
const CORRECTION_UNIT: f64 = 1.0 / 32768.0;

/// The value of a compensated pair plus `x`, in f32: `hi + (x + q · |hi| · 2⁻¹⁵)`.
#[cube]
pub(super) fn compensated_value<O: Float>(x: f32, hi: O, q: i8) -> f32 {
    let hi = f32::cast_from(hi);
    hi + (x + f32::cast_from(q) * (f32::abs(hi) * f32::new(CORRECTION_UNIT)))
}

/// The correction of `sum` rounded to `hi`: `(sum − hi) / (|hi| · 2⁻¹⁵)`, rounded, within
/// ±127; 0 where `hi` is zero, infinite or NaN.
#[cube]
pub(super) fn correction<O: Float>(sum: f32, hi: O) -> i8 {
    let hi = f32::cast_from(hi);
    let unit = f32::abs(hi) * f32::new(CORRECTION_UNIT);
    let mut q = f32::new(0.0);
    if unit > 0.0 && !unit.is_inf() {
        q = f32::clamp(f32::round((sum - hi) / unit), -127.0, 127.0);
    }
    if q.is_nan() {
        q = f32::new(0.0);
    }
    i8::cast_from(q)
}

/// Stores (or corrections) loaded before any of them is written, per batch: a store may alias
/// a later load, so the compiler keeps a load after every earlier store, and one batch's loads
/// then overlap instead of each waiting for the last store.
#[allow(clippy::manual_is_multiple_of)]
const fn batch_of(stores: usize) -> usize {
    if stores % 8 == 0 {
        8
    } else if stores % 4 == 0 {
        4
    } else if stores % 2 == 0 {
        2
    } else {
        1
    }
}

/// [`Epilogue::AddCompensated`] (not wide) of one consumer warpgroup's tile (`rows0`, `col0`), `width`
/// values (1 or 2 adjacent columns) per store of `out`: per value, the f32 sum of the tile's
/// value and the pair (`out`, `fix`), rounded into `out` with its rounding error into `fix`
/// (rows `stride` apart). A zero, infinite or NaN sum gets no correction. One matrix: the
/// offsets have no batch term, as [`hopper_gemm_add_compensated`] launches with no batch and
/// K unsplit.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn store_compensated<O: Float, N2: Size>(
    acc: &Accumulator<f32>,
    unit: u32,
    rows0: u32,
    col0: u32,
    m: u32,
    n: u32,
    stride: u32,
    out: &mut Tensor<Vector<O, N2>>,
    fix: &mut Tensor<i8>,
    #[comptime] width: usize,
    #[comptime] values: usize,
) {
    let stores = comptime![values / width];
    let batch = comptime![batch_of(stores)];
    #[unroll]
    for b in 0..comptime![stores / batch] {
        let mut olds = Array::<Vector<O, N2>>::new(batch);
        let mut qs = Array::<i8>::new(comptime![batch * width]);
        #[unroll]
        for t in 0..batch {
            let (r, col) = acc.position_of_nth(unit, ((b * batch + t) * width) as u32);
            let (row, col) = (rows0 + r, col0 + col);
            if row < m && col < n {
                let elem = row as usize * stride as usize + col as usize;
                olds[t] = out[elem / width];
                #[unroll]
                for h in 0..width {
                    qs[t * width + h] = fix[elem + h];
                }
            }
        }
        #[unroll]
        for t in 0..batch {
            let nth = (b * batch + t) * width;
            let (r, col) = acc.position_of_nth(unit, nth as u32);
            let (row, col) = (rows0 + r, col0 + col);
            if row < m && col < n {
                let elem = row as usize * stride as usize + col as usize;
                let old = olds[t];
                let mut v = Vector::<O, N2>::empty();
                #[unroll]
                for h in 0..width {
                    let sum =
                        compensated_value::<O>(acc.get(nth + h), old.extract(h), qs[t * width + h]);
                    let hi = O::cast_from(sum);
                    v.insert(h, hi);
                    fix[elem + h] = correction::<O>(sum, hi);
                }
                out[elem / width] = v;
            }
        }
    }
}

/// Columns of the tile staged per round of [`store_compensated_wide`].
const SLICE: usize = 32;
/// Row stride of a warp's staging rows (padded against bank conflicts).
const STAGE_ROW: usize = SLICE + 4;
/// Shared f32 values the wide store stages: 16 rows of [`STAGE_ROW`] for each of the 8
/// consumer warps.
pub(super) const STAGE_LEN: usize = 8 * 16 * STAGE_ROW;

/// The sum and corrections of 8 adjacent values from `elem` (zeros where `valid` is false).
#[cube]
fn load_eight<O: Float, N8: Size>(
    out8: &mut [Vector<O, N8>],
    fix8: &mut [Vector<i8, N8>],
    elem: usize,
    valid: bool,
) -> (Vector<O, N8>, Vector<i8, N8>) {
    let mut v = Vector::<O, N8>::new(O::from_int(0));
    let mut q = Vector::<i8, N8>::new(i8::new(0));
    if valid {
        v = out8[elem / 8];
        q = fix8[elem / 8];
    }
    (v, q)
}

/// [`Epilogue::AddCompensated`] `{ wide: true }` of one consumer warpgroup's tile (`rows0`,
/// `col0`; `n` and `stride` multiples of 8, the sum and corrections starting on whole vectors),
/// one warp's 16 rows at a time through shared memory: per slice of [`SLICE`] columns the warp
/// stages its accumulator values (a plane sync, no cube-wide one), then each lane reads 16
/// adjacent values of one row and updates the pair with two 16-byte loads and stores of the sum
/// and two 8-byte ones of the corrections: full sectors, 8 accesses a slice instead of 48. The
/// next slice's sum and corrections are loaded before this slice's are written, so the loads'
/// latency overlaps the staging and the arithmetic. Same values as [`store_compensated`].
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn store_compensated_wide<O: Float, N2: Size>(
    acc: &Accumulator<f32>,
    unit: u32,
    consumer: u32,
    rows0: u32,
    col0: u32,
    m: u32,
    n: u32,
    stride: u32,
    out: &mut Tensor<Vector<O, N2>>,
    fix: &mut Tensor<i8>,
    stage: &mut Shared<[f32]>,
    #[comptime] bn: usize,
) {
    let size!(N8) = 8usize;
    let out8 = out.as_mut_slice().with_vector_size_mut::<N8>();
    let fix8 = fix
        .as_mut_slice()
        .as_vectorized_mut()
        .with_vector_size_mut::<N8>();
    let (warp, lane) = ((unit / 32) as usize, (unit % 32) as usize);
    let base = (consumer as usize * 4 + warp) * comptime![16 * STAGE_ROW];
    // This lane's row of the warp's 16 and its 16 columns of each slice.
    let (r, c0) = (lane / 2, (lane % 2) * 16);
    let row = rows0 as usize + warp * 16 + r;
    let row_ok = row < m as usize;
    let row_elem = row * stride as usize;
    let slices = comptime![bn / SLICE];

    let mut cur_v = Array::<Vector<O, N8>>::new(2usize);
    let mut cur_q = Array::<Vector<i8, N8>>::new(2usize);
    let mut nxt_v = Array::<Vector<O, N8>>::new(2usize);
    let mut nxt_q = Array::<Vector<i8, N8>>::new(2usize);
    #[unroll]
    for h in 0..2usize {
        let col = col0 as usize + c0 + 8 * h;
        let (v, q) = load_eight::<O, N8>(out8, fix8, row_elem + col, row_ok && col < n as usize);
        cur_v[h] = v;
        cur_q[h] = q;
    }
    #[unroll]
    for j in 0..slices {
        if comptime![j + 1 < slices] {
            #[unroll]
            for h in 0..2usize {
                let col = col0 as usize + (j + 1) * SLICE + c0 + 8 * h;
                let (v, q) =
                    load_eight::<O, N8>(out8, fix8, row_elem + col, row_ok && col < n as usize);
                nxt_v[h] = v;
                nxt_q[h] = q;
            }
        }
        // The warp's previous slice is read before this one is staged over it.
        sync_plane();
        #[unroll]
        for nb in 0..comptime![SLICE / 8] {
            #[unroll]
            for v in 0..2usize {
                #[unroll]
                for e in 0..2usize {
                    let nth = comptime![(j * (SLICE / 8) + nb) * 4 + v * 2 + e];
                    let at = (lane / 4 + 8 * v) * STAGE_ROW + nb * 8 + 2 * (lane % 4) + e;
                    stage[base + at] = acc.get(nth);
                }
            }
        }
        sync_plane();
        #[unroll]
        for h in 0..2usize {
            let col = col0 as usize + j * SLICE + c0 + 8 * h;
            if row_ok && col < n as usize {
                let old = cur_v[h];
                let qs = cur_q[h];
                let mut hi_v = Vector::<O, N8>::empty();
                let mut q_v = Vector::<i8, N8>::empty();
                #[unroll]
                for i in 0..8usize {
                    let x = stage[base + r * STAGE_ROW + c0 + 8 * h + i];
                    let sum = compensated_value::<O>(x, old.extract(i), qs.extract(i));
                    let hi = O::cast_from(sum);
                    hi_v.insert(i, hi);
                    q_v.insert(i, correction::<O>(sum, hi));
                }
                let elem = row_elem + col;
                out8[elem / 8] = hi_v;
                fix8[elem / 8] = q_v;
            }
        }
        if comptime![j + 1 < slices] {
            #[unroll]
            for h in 0..2usize {
                cur_v[h] = nxt_v[h];
                cur_q[h] = nxt_q[h];
            }
        }
    }
}

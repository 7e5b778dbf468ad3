//! A GEMM on Hopper's warpgroup MMA (`wgmma`) fed by the tensor memory accelerator (TMA).
//!
//! Why: cubek 0.4.0-pre.1's kernels ran SmolLM2's training projections at 70–140 µs each on an
//! H200 against cuBLAS's 18–25 µs (`ncu`, 2026-11-29, 69.9 of a 219 ms bf16 step's GPU time):
//! they issue `mma.sync`, a quarter of what a Hopper SM's tensor cores do per instruction.
//!
//! One cube computes a `BM × bn` tile of `C = A · B` (`BM` = 128, `bn` 64–256 chosen per
//! problem) over its share of K:
//! - warpgroup 0 is the producer: one unit loads `BK` = 64 columns of K of `A` and `B` per stage
//!   by TMA (boxes one 128-byte swizzle panel wide) into a ring of [`STAGES`] stages, each
//!   guarded by a "full" barrier (TMA bytes arrived) and an "empty" one (both consumers done);
//! - warpgroups 1 and 2 are the consumers: each issues the `64 × bn × 16` MMAs of its 64 rows
//!   for a stage, keeps that group in flight while it issues the next stage's, releases a stage
//!   once its MMAs completed, and after the last stage writes its rows, two columns at a time.
//!
//! Both operands may be K-major (row-major `A`, a transposed view of `B`) or MN-major (a
//! transposed view of `A`, row-major `B`): the MMA reads either from shared memory, so a
//! backward pass's `Aᵀ · dC` needs no copy. TMA fills out-of-range rows and K with zeros, so
//! tails in `m`, `n` and `k` need no special case; the strides must be multiples of 16 bytes and
//! the operands start 16-byte aligned ([`unsupported`] says so otherwise). Where the output has
//! few tiles and K is long (a weight gradient: `576 × 192` over 8192 tokens), K is split across
//! cubes into f32 partial sums, which a second kernel adds and rounds. Cubes walk down M when `A`
//! is the smaller operand, so the larger one is read from memory once.
//!
//! Besides storing the tile, the kernel can reduce it in registers ([`Epilogue`]): the row
//! log-sum-exp and column filter scores of a linear cross-entropy's logits, for burn-cce's forward
//! and scoring passes ([`hopper_row_lse`], [`hopper_column_scores`]), which then never store the
//! logits; write the loss's logit gradient `G` instead of the logits, for its backward
//! ([`hopper_grad`]); or add the tile into an f32 accumulator ([`hopper_gemm_add`]) or a
//! compensated 16-bit sum ([`hopper_gemm_add_compensated`]).
//!
//! Measured on an H200 (2026-11-29, `bench/results/2026-11-29/nvidia-h200-s38-wgmma-gemm.md`):
//! 1.1–3.1× cubek's `SpecializedTma` and 0.34–0.70× cuBLAS at SmolLM2's training products. The
//! tied head's logits reach 365 TFLOP/s with L2 throughput at 76% (`ncu`): a tile of B read once
//! per pair of cubes needs TMA multicast within a cluster, and larger tiles need the consumers'
//! register reallocation (`setmaxnreg`), neither of which CubeCL 0.12 exposes.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::DType;
use burn_cubecl::{ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor};
use cubecl::calculate_cube_count_elemwise;
use cubecl::ir::ElemType;
use cubecl::prelude::*;
use cubecl::wgmma::{Major, Swizzle, WARPGROUP_M, WgmmaTileLayout};

mod add;
mod epilogue;
mod grad;
mod mainloop;
#[cfg(feature = "ptx-dump")]
pub mod offline;
mod persistent;
mod plan;
mod prefetched;
pub use add::{
    CompensatedStore, hopper_gemm_add, hopper_gemm_add_compensated,
    hopper_gemm_add_compensated_with,
};
pub use epilogue::{Epilogue, LogitOptions, hopper_column_scores, hopper_row_lse};
pub use grad::{GradInputs, hopper_grad};
use plan::{Plan, plan, tensor_map};
pub use plan::{splits_for, tile_width, unsupported};
pub use prefetched::PREFETCH_BN;

/// Rows of `C` per cube: one 64-row MMA for each of the two consumer warpgroups.
pub const BM: usize = 2 * WARPGROUP_M;
/// K per stage: one 128-byte swizzle panel of 16-bit elements.
pub const BK: usize = 64;
/// Stages in the shared-memory ring.
pub const STAGES: usize = 4;
/// Units of a warpgroup.
const WG: u32 = 128;
/// Elements of one MN-major panel (64 along M or N × `BK`), one TMA box.
const PANEL: usize = 64 * BK;
/// Bytes of an element (f16/bf16 only).
const ELEM_BYTES: usize = 2;

/// The comptime shape of one kernel: the tile width and the operands' layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HopperTile {
    /// Columns of `C` per cube (a multiple of 64 up to 256 where `B` is MN-major, of 8
    /// otherwise).
    pub bn: usize,
    /// `K`: `A` row-major; `MN`: `A` column-major (a transposed view).
    pub a_major: Major,
    /// `MN`: `B` row-major (`[k, n]`, N contiguous); `K`: `B` column-major (`x · wᵀ`).
    pub b_major: Major,
    /// Whether the output is stored two columns at a time (`n` even; the output vectorized
    /// by 2).
    pub pairs: bool,
    /// Whether consecutive cubes walk down M (sharing a tile of `B`) rather than along N
    /// (sharing a tile of `A`): the cubes running at once then read few tiles of the larger
    /// operand, and the smaller one stays in L2 (the tied head's logits read `E`, 56 MB at
    /// SmolLM2's shape, once instead of once per 128 rows).
    pub m_fast: bool,
    /// What becomes of the tile: stored, or reduced in registers ([`Epilogue`]).
    pub epilogue: Epilogue,
    /// Whether the consumers' main loop keeps one MMA group in flight at every stage
    /// ([`overlapped_main_loop`]); else three stages in four wait for their own MMAs.
    pub overlap: bool,
}

/// Whether the Hopper kernels run the main loop that keeps one MMA group in flight at every
/// stage (`mainloop::consume_rounds`): `BURN_KERNELS_HOPPER_OVERLAP=1`. Off by default until
/// its tests have passed on a GPU: written in session 65 from the PTX (the older loop's waits
/// drain the tensor cores at three stages of four), not yet run on a device. Read once.
pub fn overlapped_main_loop() -> bool {
    static OVERLAP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OVERLAP.get_or_init(|| std::env::var("BURN_KERNELS_HOPPER_OVERLAP").as_deref() == Ok("1"))
}

impl HopperTile {
    fn layout(major: Major, rows: usize) -> WgmmaTileLayout {
        WgmmaTileLayout {
            major,
            swizzle: Swizzle::B128,
            rows,
            k: BK,
        }
    }

    /// The layout of one stage of `A`'s tile.
    pub fn a_layout(&self) -> WgmmaTileLayout {
        Self::layout(self.a_major, BM)
    }

    /// The layout of one stage of `B`'s tile.
    pub fn b_layout(&self) -> WgmmaTileLayout {
        Self::layout(self.b_major, self.bn)
    }
}

/// `out[z] = A[:, Kz] · B[Kz, :]` for the cube's tile, where `Kz` is split `z`'s range of K
/// tiles (`tiles_per_split` of the `k_tiles`); `out` is `[splits, m, n]`, rows `out_stride`
/// apart, in vectors of 2 where `tile.pairs` ([`Epilogue::Add`]: added to what `out` holds).
/// With a reducing [`Epilogue`] (one split), `reduced` receives the reduction instead, from the
/// logits `C + bias[v0 + col]` (soft-capped by `softcap`), `lse` and `targets` (per row); `out`
/// is not written. [`Epilogue::Grad`] (one split) writes the logits' gradient into `out`, from
/// `lse`, `dout` and `targets` of token `token0 + row` and the vocabulary ids `ids[col]` (when
/// gathered) or `v0 + col`. [`Epilogue::AddCompensated`] (one split) adds into `out` and its
/// corrections `fix` (`[m, n]`, rows `out_stride` apart).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub(super) fn hopper_gemm_kernel<E: Float, O: Float, N2: Size, I: Numeric>(
    a: &TensorMap<E, Tiled>,
    b: &TensorMap<E, Tiled>,
    out: &mut Tensor<Vector<O, N2>>,
    bias: &Tensor<f32>,
    lse: &Tensor<f32>,
    dout: &Tensor<f32>,
    targets: &Tensor<I>,
    ids: &Tensor<I>,
    reduced: &mut Tensor<f32>,
    fix: &mut Tensor<i8>,
    m: u32,
    n: u32,
    out_stride: u32,
    k_tiles: u32,
    tiles_per_split: u32,
    v0: u32,
    token0: u32,
    softcap: f32,
    #[comptime] tile: HopperTile,
    #[define(E, O, I)] _dtypes: [ElemType; 3],
) {
    let bn = comptime![tile.bn];
    let mut a_smem = Shared::<[E]>::new_aligned_slice(comptime![STAGES * BM * BK], 1024usize);
    let mut b_smem = Shared::<[E]>::new_aligned_slice(comptime![STAGES * tile.bn * BK], 1024usize);
    // The column scores' per-plane maxima (8 planes of consumers), or the wide compensated
    // store's staging rows.
    let score_len = comptime![if tile.epilogue.is_score() {
        8 * bn
    } else if tile.epilogue.is_wide_compensated() {
        add::STAGE_LEN
    } else {
        1
    }];
    let mut scores = Shared::<[f32]>::new_slice(score_len);

    let full = mainloop::ring_barriers();
    let empty = mainloop::ring_barriers();
    if UNIT_POS == 0 {
        mainloop::init_ring(&full, &empty);
    }
    sync_async_proxy_shared();
    sync_cube();

    let first = CUBE_POS_Z * tiles_per_split;
    let end = first + tiles_per_split;
    let last = select(end < k_tiles, end, k_tiles);
    let count = select(last > first, last - first, 0u32);
    let (tile_m, tile_n, row0, col0) = mainloop::tile_origin(tile);
    let wg = UNIT_POS / WG;

    if wg == 0 {
        if UNIT_POS == 0 {
            mainloop::produce::<E>(
                a,
                b,
                &mut a_smem,
                &mut b_smem,
                &full,
                &empty,
                first,
                count,
                row0,
                col0,
                0u32,
                tile,
            );
        }
    } else {
        let c = (wg - 1) as usize;
        let acc =
            mainloop::consume::<E>(&a_smem, &b_smem, &full, &empty, c, count, 0u32, tile, false);
        let unit = UNIT_POS % WG;
        let rows0 = row0 + c as u32 * 64;
        let (has_bias, has_softcap) = comptime![(tile.epilogue.bias(), tile.epilogue.softcap())];
        let base = CUBE_POS_Z as usize * m as usize * n as usize;
        if comptime![matches!(tile.epilogue, Epilogue::RowLse { .. })] {
            epilogue::row_lse(
                &acc,
                unit,
                rows0,
                col0,
                tile_n,
                m,
                n,
                v0,
                bias,
                softcap,
                reduced,
                has_bias,
                has_softcap,
            );
        } else if comptime![tile.epilogue.is_score()] {
            epilogue::column_score::<I>(
                &acc,
                unit,
                c as u32,
                rows0,
                col0,
                m,
                n,
                v0,
                bias,
                lse,
                targets,
                softcap,
                &mut scores,
                bn,
                has_bias,
                has_softcap,
            );
        } else if comptime![tile.epilogue.is_grad()] {
            grad::write_grad::<O, N2, I>(
                &acc,
                unit,
                rows0,
                m,
                token0,
                col0,
                n,
                v0,
                bias,
                lse,
                dout,
                targets,
                ids,
                softcap,
                out,
                out_stride,
                tile.epilogue,
                bn,
            );
        } else if comptime![tile.epilogue.is_wide_compensated()] {
            add::store_compensated_wide::<O, N2>(
                &acc,
                unit,
                c as u32,
                rows0,
                col0,
                m,
                n,
                out_stride,
                out,
                fix,
                &mut scores,
                bn,
            );
        } else if comptime![tile.epilogue.is_compensated()] {
            let width = comptime![if tile.pairs { 2usize } else { 1usize }];
            add::store_compensated::<O, N2>(
                &acc,
                unit,
                rows0,
                col0,
                m,
                n,
                out_stride,
                out,
                fix,
                width,
                comptime![WARPGROUP_M * tile.bn / WG as usize],
            );
        } else if comptime![tile.pairs] {
            // Two adjacent columns per store (`n` even, so a pair never straddles a row).
            #[unroll]
            for j in 0..comptime![WARPGROUP_M * tile.bn / (2 * WG as usize)] {
                let (r, col) = acc.position_of_nth(unit, 2 * j as u32);
                let row = rows0 + r;
                let col = col0 + col;
                if row < m && col < n {
                    let at = (base + row as usize * out_stride as usize + col as usize) / 2;
                    let mut x0 = acc.get(2 * j);
                    let mut x1 = acc.get(2 * j + 1);
                    if comptime![tile.epilogue == Epilogue::Add] {
                        let old = out[at];
                        x0 += f32::cast_from(old.extract(0usize));
                        x1 += f32::cast_from(old.extract(1usize));
                    }
                    let mut v = Vector::<O, N2>::empty();
                    v.insert(0usize, O::cast_from(x0));
                    v.insert(1usize, O::cast_from(x1));
                    out[at] = v;
                }
            }
        } else {
            #[unroll]
            for nth in 0..acc.len() {
                let (r, col) = acc.position_of_nth(unit, nth as u32);
                let row = rows0 + r;
                let col = col0 + col;
                if row < m && col < n {
                    let at = base + row as usize * out_stride as usize + col as usize;
                    let mut x = acc.get(nth);
                    if comptime![tile.epilogue == Epilogue::Add] {
                        x += f32::cast_from(out[at].extract(0usize));
                    }
                    out[at] = Vector::<O, N2>::new(O::cast_from(x));
                }
            }
        }
    }
    if comptime![tile.epilogue.is_score()] {
        sync_cube();
        epilogue::write_column_scores(&scores, col0, tile_m, n, reduced, bn);
    }
}

/// `out = Σ_z partials[z]` (`add`: `out += Σ_z partials[z]`), rounded to `out`'s dtype.
#[cube(launch)]
fn split_sum_kernel<O: Float>(
    partials: &Tensor<f32>,
    out: &mut Tensor<O>,
    splits: u32,
    #[comptime] add: bool,
    #[define(O)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let len = out.len();
    let mut sum = f32::new(0.0);
    if add {
        sum = f32::cast_from(out[i]);
    }
    for z in 0..splits as usize {
        sum += partials[z * len + i];
    }
    out[i] = O::cast_from(sum);
}

/// Writes `lhs · rhs` (`[m, k] · [k, n]`) into `out` (contiguous `[m, n]` of `out_dtype`); an
/// error where [`unsupported`] says why not.
pub fn hopper_gemm(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    out: &CubeTensor,
    out_dtype: DType,
) -> Result<(), String> {
    let plan = plan(&lhs.client, lhs, rhs)?;
    gemm_into(lhs, rhs, &plan, (out, out_dtype), false);
    Ok(())
}

/// [`hopper_gemm`] (`add`: [`hopper_gemm_add`]) of a planned problem, K split where the tiles
/// are few.
fn gemm_into(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    plan: &Plan,
    (out, out_dtype): (&CubeTensor, DType),
    add: bool,
) {
    let client = lhs.client.clone();
    let (m, n, k) = (plan.m, plan.n, plan.k);
    let tiles = m.div_ceil(BM) * n.div_ceil(plan.tile.bn);
    let sms = client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(132) as usize;
    let k_tiles = k.div_ceil(BK);
    let splits = splits_for(tiles, k_tiles, sms);
    let per_split = k_tiles.div_ceil(splits);
    let splits = k_tiles.div_ceil(per_split);
    let partials = (splits > 1).then(|| {
        empty_device_contiguous_dtype(
            client.clone(),
            lhs.device.clone(),
            burn::tensor::Shape::new([splits, m, n]),
            DType::F32,
        )
    });
    let (target, target_dtype) = match &partials {
        Some(p) => (p.clone(), DType::F32),
        None => (out.clone(), out_dtype),
    };
    let mut reduction = Reduction::none(lhs);
    if add && partials.is_none() {
        reduction.epilogue = Epilogue::Add;
    }
    launch(lhs, rhs, plan, (target, target_dtype), splits, reduction);
    if let Some(partials) = partials {
        let len = m * n;
        let units = CubeDim::new_1d(256);
        split_sum_kernel::launch(
            &client,
            calculate_cube_count_elemwise(&client, len, units),
            units,
            partials.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            splits as u32,
            add,
            dtype_to_storage_type(out_dtype),
        );
    }
}

/// The arguments of a reducing [`Epilogue`] (placeholders for [`Epilogue::Store`]).
struct Reduction {
    epilogue: Epilogue,
    /// `[V]` f32.
    bias: CubeTensor,
    /// `[m]` f32 (from `row0` with [`Epilogue::Grad`]).
    lse: CubeTensor,
    /// `[m]` f32, the loss's gradient per token ([`Epilogue::Grad`]).
    dout: CubeTensor,
    /// `[m]`, an integer dtype.
    targets: CubeTensor,
    /// `[n]`, the vocabulary id of each column where gathered ([`Epilogue::Grad`]); the
    /// targets' dtype.
    ids: CubeTensor,
    /// Written by the epilogue.
    out: CubeTensor,
    /// `[m, n]` i8, the corrections of [`Epilogue::AddCompensated`] (read and written).
    fix: CubeTensor,
    v0: usize,
    /// The token of row 0 ([`Epilogue::Grad`]).
    row0: usize,
    softcap: f32,
}

impl Reduction {
    /// No reduction: one-element placeholders for the kernel's unused arguments (the written
    /// one apart from the read ones: a buffer is not bound twice where one binding writes).
    fn none(like: &CubeTensor) -> Self {
        let read = placeholder(like, DType::F32);
        let ids = placeholder(like, DType::U32);
        Reduction {
            epilogue: Epilogue::Store,
            bias: read.clone(),
            lse: read.clone(),
            dout: read,
            targets: ids.clone(),
            ids,
            out: placeholder(like, DType::F32),
            fix: placeholder(like, DType::I8),
            v0: 0,
            row0: 0,
            softcap: 1.0,
        }
    }
}

/// A one-element tensor of `dtype` on `like`'s device, for an argument a kernel does not use.
fn placeholder(like: &CubeTensor, dtype: DType) -> CubeTensor {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        burn::tensor::Shape::new([1]),
        dtype,
    )
}

/// The TMA maps of `lhs` and `rhs` in `tile`'s boxes (a K-major tile one box of all its rows, an
/// MN-major one a box per 64-row panel, `BK` lines of K each), and the cubes: one a tile of
/// `C` and split of K, consecutive ones down M where `tile.m_fast`.
fn operand_maps_and_grid(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    plan: &Plan,
    tile: &HopperTile,
    splits: usize,
) -> ([TensorMapArg<Tiled>; 2], CubeCount) {
    let (a_mn, b_k, bn) = (tile.a_major == Major::MN, tile.b_major == Major::K, tile.bn);
    let a_map = tensor_map(lhs, a_mn, plan.a_stride, if a_mn { BK } else { BM });
    let b_map = tensor_map(rhs, b_k, plan.b_stride, if b_k { bn } else { BK });
    let (tiles_m, tiles_n) = (plan.m.div_ceil(BM) as u32, plan.n.div_ceil(bn) as u32);
    let count = match tile.m_fast {
        true => CubeCount::Static(tiles_m, tiles_n, splits as u32),
        false => CubeCount::Static(tiles_n, tiles_m, splits as u32),
    };
    ([a_map, b_map], count)
}

/// Launches the kernel for `plan` in `splits` splits of K, storing into `target` (`[splits, m,
/// n]` of its dtype) or reducing as `reduction` says.
fn launch(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    plan: &Plan,
    (target, target_dtype): (CubeTensor, DType),
    splits: usize,
    reduction: Reduction,
) {
    let client = lhs.client.clone();
    let Plan { m, n, k, .. } = *plan;
    let epilogue = reduction.epilogue;
    let tile = HopperTile {
        epilogue,
        // A reduction stores nothing (its `target` is a placeholder); `G`'s rows are padded to
        // an even stride.
        pairs: match epilogue {
            Epilogue::Store | Epilogue::Add | Epilogue::AddCompensated { .. } => plan.tile.pairs,
            Epilogue::Grad { .. } => true,
            Epilogue::RowLse { .. } | Epilogue::ColumnScore { .. } => false,
        },
        ..plan.tile
    };
    let out_stride = match epilogue {
        Epilogue::Grad { .. } => target.meta.strides()[0],
        _ => n,
    };
    let ([a_map, b_map], count) = operand_maps_and_grid(lhs, rhs, plan, &tile, splits);
    let k_tiles = k.div_ceil(BK);
    let per_split = k_tiles.div_ceil(splits);
    let dtypes = [
        dtype_to_storage_type(lhs.dtype),
        dtype_to_storage_type(target_dtype),
        dtype_to_storage_type(reduction.targets.dtype),
    ];
    // SAFETY: TMA reads only inside the maps (zeros past their ends); the output is written only
    // at rows below `m` and columns below `n` of each split's `[m, n]` block, which `target`
    // holds (`G`: columns below `n` rounded up to even, inside its padded rows); a reduction
    // writes only inside the shapes its entry point allocated.
    unsafe {
        hopper_gemm_kernel::launch_unchecked(
            &client,
            count,
            CubeDim::new_1d(3 * WG),
            if tile.pairs { 2 } else { 1 },
            a_map,
            b_map,
            target.into_tensor_arg(),
            reduction.bias.into_tensor_arg(),
            reduction.lse.into_tensor_arg(),
            reduction.dout.into_tensor_arg(),
            reduction.targets.into_tensor_arg(),
            reduction.ids.into_tensor_arg(),
            reduction.out.into_tensor_arg(),
            reduction.fix.into_tensor_arg(),
            m as u32,
            n as u32,
            out_stride as u32,
            k_tiles as u32,
            per_split as u32,
            reduction.v0 as u32,
            reduction.row0 as u32,
            reduction.softcap,
            tile,
            dtypes,
        );
    }
}

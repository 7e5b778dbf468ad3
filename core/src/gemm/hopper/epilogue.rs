//! Epilogues of the Hopper GEMM that reduce a cube's tile of `C` in registers instead of
//! storing it: the per-row log-sum-exp and the per-column gradient-filter score of a
//! linear cross-entropy (burn-cce's forward and scoring passes over a chunk of the
//! vocabulary). The logits of a chunk then never reach memory: storing them in f32 and reading
//! them back took 6.3 + 3.4 ms of a Gemma-2-shape loss + gradient besides the GEMMs' own store
//! (H100, 2026-12-06).
//!
//! Both read `C`'s values where the warpgroup MMA leaves them (see
//! `cubecl::wgmma::Accumulator::position_of_nth`): a unit of plane `p` (lane `l`) holds rows
//! `16p + l / 4` ("row a") and `16p + l / 4 + 8` ("row b") of its warpgroup's 64, two adjacent
//! columns `8j + 2 (l % 4)` of every group `j` of 8; its `nth` value is in row a where
//! `(nth / 2) % 2 == 0`. A row's values are spread over the 4 units of a quad (lanes differing
//! in their two low bits), a column's over the 8 lanes of a plane with the same `l % 4`, the 4
//! planes of a warpgroup and the two consumer warpgroups.

use burn::tensor::{DType, Shape};
use burn_cubecl::{ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor};
use cubecl::prelude::*;
use cubecl::wgmma::Accumulator;

use super::{BM, CompensatedStore, HopperTile, Plan, Reduction, launch, placeholder, plan};
use std::collections::HashMap;
use std::sync::Mutex;

/// Whether each reducing kernel (tile, epilogue, dtype) ran at its first launch in this process.
static VERIFIED: Mutex<Option<HashMap<(HopperTile, DType), bool>>> = Mutex::new(None);

/// Whether the kernel `key` ran at its first launch in this process (`None`: not launched yet).
fn known(key: &(HopperTile, DType)) -> Option<bool> {
    let all = VERIFIED.lock().unwrap_or_else(|e| e.into_inner());
    all.as_ref().and_then(|m| m.get(key).copied())
}

/// Whether the kernel `key` failed at its first launch in this process.
pub(super) fn failed_before(key: &(HopperTile, DType)) -> bool {
    known(key) == Some(false)
}

/// Launches a reduction into `out` by `launch_it`, whose kernel is `key`: refused at once where
/// that kernel failed before; at its first launch, checked on the device thread (no device
/// synchronization), its failure returned and remembered.
pub(super) fn verified(
    key: (HopperTile, DType),
    out: CubeTensor,
    launch_it: impl FnOnce(),
) -> Result<CubeTensor, String> {
    let known = known(&key);
    if known == Some(false) {
        return Err(format!("{:?} failed to launch before", key.0.epilogue));
    }
    launch_it();
    if known == Some(true) {
        return Ok(out);
    }
    let ran = out.client.check([&out.handle]);
    VERIFIED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(key, ran.is_ok());
    match ran {
        Ok(()) => Ok(out),
        Err(err) => {
            let why = format!("{:?} failed to launch ({err})", key.0.epilogue);
            log::warn!("hopper gemm: {why}");
            // Kept for the process, as `fixed_gemm` keeps its failed outputs.
            crate::gemm::launch::quarantine(out);
            Err(why)
        }
    }
}

/// Launches the reduction of `plan`'s product into `out` (one split of K), through [`verified`].
fn reduce(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    plan: &Plan,
    reduction: Reduction,
    out: CubeTensor,
) -> Result<CubeTensor, String> {
    let target = (placeholder(lhs, DType::F32), DType::F32);
    let tile = HopperTile {
        epilogue: reduction.epilogue,
        ..plan.tile
    };
    verified((tile, lhs.dtype), out, || {
        launch(lhs, rhs, plan, target, 1, reduction)
    })
}

/// The logits' options of a reducing epilogue: a bias (`[V]` f32, read at `v0 + col`) and a
/// soft cap.
#[derive(Clone, Copy, Debug)]
pub struct LogitOptions<'a> {
    /// `[V]` f32: added to column `col` of the product as `bias[v0 + col]`.
    pub bias: Option<&'a CubeTensor>,
    /// The vocabulary id of the product's first column.
    pub v0: usize,
    /// `softcap · tanh(x / softcap)` of each logit.
    pub softcap: Option<f32>,
}

impl LogitOptions<'_> {
    /// The reduction's arguments over the placeholders.
    pub(super) fn reduction(
        &self,
        epilogue: Epilogue,
        lhs: &CubeTensor,
        out: &CubeTensor,
    ) -> Reduction {
        let none = Reduction::none(lhs);
        Reduction {
            epilogue,
            bias: self.bias.cloned().unwrap_or(none.bias.clone()),
            out: out.clone(),
            v0: self.v0,
            softcap: self.softcap.unwrap_or(1.0),
            ..none
        }
    }

    pub(super) fn check(&self) -> Result<(), String> {
        match self.bias {
            Some(b) if b.dtype != DType::F32 => Err(format!("a {:?} bias (f32 only)", b.dtype)),
            _ => Ok(()),
        }
    }
}

/// Per row of the logits `x = lhs · rhs (+ bias, soft-capped)`, `(max, Σ exp(x − max))` over
/// each tile of 64–256 columns, without storing the logits: one launch of the Hopper kernel
/// with [`Epilogue::RowLse`]. The caller merges the tiles' pairs (`Σ = 0` marks none).
///
/// # Shapes
/// - `lhs`: `[m, k]`, `rhs`: `[k, n]`, both f16 or both bf16 (as [`super::hopper_gemm`])
/// - returns `[2, tiles, m]` f32: the maxima, then the sums, of each column tile
///
/// # Errors
/// Where the kernel cannot run the product ([`super::unsupported`]) or the bias is not f32,
/// and where this kernel (tile and dtype) failed to launch on the device (checked at its first
/// launch in the process).
pub fn hopper_row_lse(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    options: LogitOptions,
) -> Result<CubeTensor, String> {
    options.check()?;
    let plan = plan(&lhs.client, lhs, rhs)?;
    let tiles = plan.n.div_ceil(plan.tile.bn);
    let out = empty_device_contiguous_dtype(
        lhs.client.clone(),
        lhs.device.clone(),
        Shape::new([2, tiles, plan.m]),
        DType::F32,
    );
    let epilogue = Epilogue::RowLse {
        bias: options.bias.is_some(),
        softcap: options.softcap.is_some(),
    };
    let reduction = options.reduction(epilogue, lhs, &out);
    reduce(lhs, rhs, &plan, reduction, out)
}

/// Per column of the logits `x = lhs · rhs (+ bias, soft-capped)`, the largest gradient-filter
/// score `|exp(x − lse[row]) − [targets[row] = v0 + col]|` over each tile of 128 rows (2 where
/// it is NaN), without storing the logits: one launch with [`Epilogue::ColumnScore`].
///
/// # Shapes
/// - `lhs`: `[m, k]`, `rhs`: `[k, n]` (as [`hopper_row_lse`]), `lse`: `[m]` f32, `targets`:
///   `[m]` of an integer dtype
/// - returns `[tiles, n]` f32, one row of maxima per tile of rows
///
/// # Errors
/// As [`hopper_row_lse`], and where `lse` is not f32.
pub fn hopper_column_scores(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    options: LogitOptions,
    lse: &CubeTensor,
    targets: &CubeTensor,
) -> Result<CubeTensor, String> {
    options.check()?;
    if lse.dtype != DType::F32 {
        return Err(format!("a {:?} log-sum-exp (f32 only)", lse.dtype));
    }
    let plan = plan(&lhs.client, lhs, rhs)?;
    let out = empty_device_contiguous_dtype(
        lhs.client.clone(),
        lhs.device.clone(),
        Shape::new([plan.m.div_ceil(BM), plan.n]),
        DType::F32,
    );
    let epilogue = Epilogue::ColumnScore {
        bias: options.bias.is_some(),
        softcap: options.softcap.is_some(),
    };
    let mut reduction = options.reduction(epilogue, lhs, &out);
    reduction.lse = lse.clone();
    reduction.targets = targets.clone();
    reduce(lhs, rhs, &plan, reduction, out)
}

/// What the kernel does with its tile of `C`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// Stores the tile (in the output's dtype).
    Store,
    /// Adds the tile to the output's values (in f32, rounded to the output's dtype).
    Add,
    /// Adds the tile to a compensated sum: the output's 16-bit values and an 8-bit correction
    /// of each ([`super::hopper_gemm_add_compensated`]).
    AddCompensated {
        /// How the pair is read and written.
        store: CompensatedStore,
    },
    /// Stores the logits' gradient `(exp(x − lse[t]) − [targets[t] = id]) · dout[t] · cap'(x)`
    /// of each value ([`super::hopper_grad`]), in the output's dtype.
    Grad {
        /// Whether a bias is added.
        bias: bool,
        /// Whether the logit is soft-capped.
        softcap: bool,
        /// Whether column `col`'s vocabulary id is `ids[col]` (else `v0 + col`).
        gathered: bool,
    },
    /// Per row, `(max, Σ exp(x − max))` over the tile's columns of the logit `x`
    /// ([`logit`]), into `[2, tiles_n, m]` (the maxima, then the sums).
    RowLse {
        /// Whether a bias (`bias[v0 + col]`) is added.
        bias: bool,
        /// Whether the logit is soft-capped.
        softcap: bool,
    },
    /// Per column, the largest `|exp(x − lse[row]) − [targets[row] = v0 + col]|` over the tile's
    /// rows (2 where it is NaN), into `[tiles_m, n]`.
    ColumnScore {
        /// Whether a bias is added.
        bias: bool,
        /// Whether the logit is soft-capped.
        softcap: bool,
    },
}

impl Epilogue {
    /// Whether a bias is read.
    pub fn bias(&self) -> bool {
        match self {
            Epilogue::Store | Epilogue::Add | Epilogue::AddCompensated { .. } => false,
            Epilogue::RowLse { bias, .. }
            | Epilogue::ColumnScore { bias, .. }
            | Epilogue::Grad { bias, .. } => *bias,
        }
    }

    /// Whether the logits are soft-capped.
    pub fn softcap(&self) -> bool {
        match self {
            Epilogue::Store | Epilogue::Add | Epilogue::AddCompensated { .. } => false,
            Epilogue::RowLse { softcap, .. }
            | Epilogue::ColumnScore { softcap, .. }
            | Epilogue::Grad { softcap, .. } => *softcap,
        }
    }

    /// Whether the tile is added to the output ([`Epilogue::Add`], [`Epilogue::AddCompensated`]).
    pub fn adds(&self) -> bool {
        matches!(self, Epilogue::Add | Epilogue::AddCompensated { .. })
    }

    /// Whether this is [`Epilogue::Grad`].
    pub fn is_grad(&self) -> bool {
        matches!(self, Epilogue::Grad { .. })
    }

    /// Whether column ids are read from `ids` ([`Epilogue::Grad`] of a gathered chunk).
    pub fn gathered(&self) -> bool {
        matches!(self, Epilogue::Grad { gathered: true, .. })
    }

    /// Whether this is [`Epilogue::AddCompensated`].
    pub fn is_compensated(&self) -> bool {
        matches!(self, Epilogue::AddCompensated { .. })
    }

    /// Whether this is [`Epilogue::AddCompensated`] staged through shared memory.
    pub fn is_wide_compensated(&self) -> bool {
        matches!(
            self,
            Epilogue::AddCompensated {
                store: CompensatedStore::Wide
            }
        )
    }

    /// Whether this is [`Epilogue::ColumnScore`] (it needs shared memory and a cube-wide sync).
    pub fn is_score(&self) -> bool {
        matches!(self, Epilogue::ColumnScore { .. })
    }
}

/// Below every finite logit; a row max that stays here had no column in range.
const NO_MAX: f64 = -3.0e38;

/// The logit of a raw product: `raw + bias[vocab_id]`, then `softcap · tanh(x / softcap)`.
#[cube]
pub(super) fn logit(
    raw: f32,
    bias: &Tensor<f32>,
    vocab_id: u32,
    softcap: f32,
    #[comptime] has_bias: bool,
    #[comptime] has_softcap: bool,
) -> f32 {
    let mut x = raw;
    if has_bias {
        x += bias[vocab_id as usize];
    }
    if has_softcap {
        x = softcap * f32::tanh(x / softcap);
    }
    x
}

/// [`Epilogue::RowLse`] of one consumer warpgroup's 64 rows (from `rows0`) and the tile's
/// columns (from `col0`; tile `tile_n` along N).
#[cube]
// `is_multiple_of` is not available inside kernels.
#[allow(clippy::too_many_arguments, clippy::manual_is_multiple_of)]
pub(super) fn row_lse(
    acc: &Accumulator<f32>,
    unit: u32,
    rows0: u32,
    col0: u32,
    tile_n: u32,
    m: u32,
    n: u32,
    v0: u32,
    bias: &Tensor<f32>,
    softcap: f32,
    out: &mut Tensor<f32>,
    #[comptime] has_bias: bool,
    #[comptime] has_softcap: bool,
) {
    // Two walks over the registers: the quad's row maxima first, so the sums need no rescaling.
    let mut max_a = f32::new(NO_MAX);
    let mut max_b = f32::new(NO_MAX);
    #[unroll]
    for nth in 0..acc.len() {
        let (_, col) = acc.position_of_nth(unit, nth as u32);
        let col = col0 + col;
        if col < n {
            let x = logit(acc.get(nth), bias, v0 + col, softcap, has_bias, has_softcap);
            if (nth / 2) % 2 == 0 {
                max_a = max(max_a, x);
            } else {
                max_b = max(max_b, x);
            }
        }
    }
    max_a = max(max_a, plane_shuffle_xor(max_a, 1u32));
    max_a = max(max_a, plane_shuffle_xor(max_a, 2u32));
    max_b = max(max_b, plane_shuffle_xor(max_b, 1u32));
    max_b = max(max_b, plane_shuffle_xor(max_b, 2u32));
    let mut sum_a = f32::new(0.0);
    let mut sum_b = f32::new(0.0);
    #[unroll]
    for nth in 0..acc.len() {
        let (_, col) = acc.position_of_nth(unit, nth as u32);
        let col = col0 + col;
        if col < n {
            let x = logit(acc.get(nth), bias, v0 + col, softcap, has_bias, has_softcap);
            if (nth / 2) % 2 == 0 {
                sum_a += f32::exp(x - max_a);
            } else {
                sum_b += f32::exp(x - max_b);
            }
        }
    }
    sum_a += plane_shuffle_xor(sum_a, 1u32);
    sum_a += plane_shuffle_xor(sum_a, 2u32);
    sum_b += plane_shuffle_xor(sum_b, 1u32);
    sum_b += plane_shuffle_xor(sum_b, 2u32);
    if unit % 4 == 0 {
        let half = out.len() / 2;
        let base = tile_n as usize * m as usize;
        let (row_a, _) = acc.position_of_nth(unit, 0u32);
        let row_a = rows0 + row_a;
        let row_b = row_a + 8;
        if row_a < m {
            out[base + row_a as usize] = max_a;
            out[half + base + row_a as usize] = sum_a;
        }
        if row_b < m {
            out[base + row_b as usize] = max_b;
            out[half + base + row_b as usize] = sum_b;
        }
    }
}

/// The filter score of the value `nth` of a unit: `|softmax − onehot|` at its row and column,
/// 2 where that is NaN (a NaN must reach the gradient, not be filtered away), 0 outside `C`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn score_of<I: Numeric>(
    acc: &Accumulator<f32>,
    nth: usize,
    unit: u32,
    rows0: u32,
    col0: u32,
    m: u32,
    n: u32,
    v0: u32,
    bias: &Tensor<f32>,
    lse: &Tensor<f32>,
    targets: &Tensor<I>,
    softcap: f32,
    #[comptime] has_bias: bool,
    #[comptime] has_softcap: bool,
) -> f32 {
    let (row, col) = acc.position_of_nth(unit, nth as u32);
    let row = rows0 + row;
    let col = col0 + col;
    let mut g = f32::new(0.0);
    if row < m && col < n {
        let vocab_id = v0 + col;
        let x = logit(acc.get(nth), bias, vocab_id, softcap, has_bias, has_softcap);
        let p = f32::exp(x - lse[row as usize]);
        g = f32::abs(p);
        if u32::cast_from(targets[row as usize]) == vocab_id {
            g = f32::abs(p - 1.0);
        }
        if g.is_nan() {
            g = f32::new(2.0);
        }
    }
    g
}

/// [`Epilogue::ColumnScore`], first half: the largest score of each column over one consumer
/// warpgroup's rows, per plane, into `partial[plane of the cube's 8][column]` (`bn` columns).
/// Every column of the tile is written by every plane.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn column_score<I: Numeric>(
    acc: &Accumulator<f32>,
    unit: u32,
    consumer: u32,
    rows0: u32,
    col0: u32,
    m: u32,
    n: u32,
    v0: u32,
    bias: &Tensor<f32>,
    lse: &Tensor<f32>,
    targets: &Tensor<I>,
    softcap: f32,
    partial: &mut [f32],
    #[comptime] bn: usize,
    #[comptime] has_bias: bool,
    #[comptime] has_softcap: bool,
) {
    let lane = unit % 32;
    let plane = consumer * 4 + unit / 32;
    // Values `4j + h` (row a) and `4j + 2 + h` (row b) share column `8j + 2 (lane % 4) + h`.
    #[unroll]
    for j in 0..comptime![bn / 8] {
        #[unroll]
        for h in 0..2usize {
            // Scores are ≥ 0: 0 is the empty maximum.
            let mut best = f32::new(0.0);
            #[unroll]
            for r in 0..2usize {
                let score = score_of::<I>(
                    acc,
                    4 * j + 2 * r + h,
                    unit,
                    rows0,
                    col0,
                    m,
                    n,
                    v0,
                    bias,
                    lse,
                    targets,
                    softcap,
                    has_bias,
                    has_softcap,
                );
                best = max(best, score);
            }
            best = max(best, plane_shuffle_xor(best, 4u32));
            best = max(best, plane_shuffle_xor(best, 8u32));
            best = max(best, plane_shuffle_xor(best, 16u32));
            if lane < 4 {
                let col = 8 * j as u32 + 2 * lane + h as u32;
                partial[plane as usize * bn + col as usize] = best;
            }
        }
    }
}

/// [`Epilogue::ColumnScore`], second half (after a cube-wide sync): the largest of the 8
/// planes' partial maxima of each column, into row `tile_m` of `out` (`[tiles_m, n]`).
#[cube]
pub(super) fn write_column_scores(
    partial: &[f32],
    col0: u32,
    tile_m: u32,
    n: u32,
    out: &mut Tensor<f32>,
    #[comptime] bn: usize,
) {
    let col = UNIT_POS;
    if col < bn as u32 && col0 + col < n {
        let mut best = partial[col as usize];
        #[unroll]
        for p in 1..8usize {
            best = max(best, partial[p * bn + col as usize]);
        }
        out[tile_m as usize * n as usize + (col0 + col) as usize] = best;
    }
}

//! The PV grid on the device: `P̃` and `V` rounded to the format the `P̃·V` product runs in
//! (FP8 E4M3 values, or the f16/bf16 grid), and the copies of `V` the matrix-unit kernels read
//! (row-major for [`super::attn_cmma`], transposed and padded for [`super::attn_mma`]).

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::prelude::*;

use super::common::grid;
use crate::Grid;

/// A PV grid as the bit-level rounding needs it.
#[derive(CubeLaunch, CubeType, Clone, Copy, Debug)]
pub struct RoundArgs {
    /// Mantissa bits of f32 dropped: `23 − mantissa`.
    pub drop: u32,
    /// Smallest normal value of the grid, `2^min_exp`.
    pub min_normal: f32,
    /// Spacing of the subnormal values, `2^(min_exp − mantissa)`, and its inverse; both 0
    /// when that spacing is below f32's normal range (bf16), where the subnormals flush to 0
    /// (a division by a flushed step would give NaN).
    pub sub_step: f32,
    pub inv_sub_step: f32,
    /// Largest value (saturation).
    pub max: f32,
}

impl RoundArgs {
    pub fn new(grid: Grid) -> Self {
        let sub = grid.min_exp - grid.mantissa as i32;
        Self {
            drop: 23 - grid.mantissa,
            min_normal: 2f32.powi(grid.min_exp),
            sub_step: if sub >= -126 { 2f32.powi(sub) } else { 0.0 },
            inv_sub_step: if sub >= -126 { 2f32.powi(-sub) } else { 0.0 },
            max: grid.max,
        }
    }

    pub(super) fn launch_arg(self) -> RoundArgsLaunch {
        RoundArgsLaunch::new(
            self.drop,
            self.min_normal,
            self.sub_step,
            self.inv_sub_step,
            self.max,
        )
    }
}

/// `x` rounded to the grid, ties away from zero, saturating: [`crate::Grid::round`] with bit
/// operations instead of logarithms. Adding half a unit in the last kept place to the f32 bits
/// and truncating rounds the magnitude half-up, carries into the exponent included.
#[cube]
pub fn round_bits(x: f32, g: &RoundArgs) -> f32 {
    let a = f32::abs(x);
    let bits = u32::reinterpret(a);
    let keep = u32::MAX - ((1u32 << g.drop) - 1);
    let normal = f32::reinterpret((bits + (1u32 << (g.drop - 1))) & keep);
    let sub = f32::floor(a * g.inv_sub_step + 0.5) * g.sub_step;
    let r = f32::min(select(a >= g.min_normal, normal, sub), g.max);
    if x < 0.0 { -r } else { r }
}

/// `V` (or `V / v_scale`) rounded to the PV grid and stored in the PV dtype, once, so the
/// attention kernel only copies tiles.
#[cube(launch)]
fn round_v_kernel<V: Float, P: Float>(
    v: &Tensor<V>,
    out: &mut Tensor<P>,
    g: RoundArgs,
    #[comptime] round: bool,
    #[define(V, P)] _dtypes: [ElemType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let mut x = f32::cast_from(v[i]);
        if round {
            x = round_bits(x, &g);
        }
        out[i] = P::cast_from(x);
    }
}

/// The PV-grid copy of `v` in `dtype` (f16/bf16), rounded when `round`.
pub(super) fn round_v(v: CubeTensor, dtype: DType, g: RoundArgs, round: bool) -> CubeTensor {
    let v = into_contiguous(v);
    let client = v.client.clone();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        v.device.clone(),
        v.meta.shape().clone(),
        dtype,
    );
    let n = v.meta.num_elements();
    let dtypes = [dtype_to_storage_type(v.dtype), dtype_to_storage_type(dtype)];
    round_v_kernel::launch(
        &client,
        grid(&client, n.div_ceil(256)),
        CubeDim::new_1d(256),
        v.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        g.launch_arg(),
        round,
        dtypes,
    );
    out
}

/// `Vᵀ` per KV head, `[b·h_kv, d, skv_pad]` in the PV dtype: keys past `skv` are zero, values
/// rounded to the PV grid when `round`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn v_transposed_kernel<V: Float, P: Float>(
    v: &Tensor<V>,
    out: &mut Tensor<P>,
    g: RoundArgs,
    skv: usize,
    skv_pad: usize,
    #[comptime] dim: usize,
    #[comptime] round: bool,
    #[define(V, P)] _dtypes: [ElemType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let key = i % skv_pad;
        let d = (i / skv_pad) % dim;
        let bhk = i / (skv_pad * dim);
        let mut x = f32::new(0.0);
        if key < skv {
            x = f32::cast_from(v[(bhk * skv + key) * dim + d]);
            if round {
                x = round_bits(x, &g);
            }
        }
        out[i] = P::cast_from(x);
    }
}

/// Keys a cube of [`v_transposed_tiled_kernel`] takes.
const VT_KEYS: usize = 32;
/// Units a cube of [`v_transposed_tiled_kernel`].
const VT_UNITS: usize = 256;

/// [`v_transposed_kernel`] through shared memory: a cube per [`VT_KEYS`] keys of a KV head
/// reads their rows whole (consecutive units, consecutive channels), then writes each
/// channel's run of keys (consecutive units, consecutive keys). Both sides are coalesced; the
/// plain kernel's reads stride by the head dim, and its index arithmetic divides at run time.
/// Needs `skv_pad` and `VT_KEYS · dim` to be multiples of [`VT_KEYS`] and [`VT_UNITS`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn v_transposed_tiled_kernel<V: Float, P: Float>(
    v: &Tensor<V>,
    out: &mut Tensor<P>,
    g: RoundArgs,
    skv: usize,
    skv_pad: usize,
    heads: usize,
    #[comptime] dim: usize,
    #[comptime] round: bool,
    #[define(V, P)] _dtypes: [ElemType; 2],
) {
    let tiles = skv_pad / VT_KEYS;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if cube >= heads * tiles {
        terminate!();
    }
    let (bhk, k0) = (cube / tiles, (cube % tiles) * VT_KEYS);
    let unit = UNIT_POS_X as usize;
    let stride = comptime!(dim + 1);
    let mut tile = Shared::<[f32]>::new_slice(comptime!(VT_KEYS * (dim + 1)));
    #[unroll]
    for step in 0..comptime!(VT_KEYS * dim / VT_UNITS) {
        let idx = step * VT_UNITS + unit;
        let (k, c) = (idx / dim, idx % dim);
        let key = k0 + k;
        let mut x = f32::new(0.0);
        if key < skv {
            x = f32::cast_from(v[(bhk * skv + key) * dim + c]);
            if round {
                x = round_bits(x, &g);
            }
        }
        tile[k * stride + c] = x;
    }
    sync_cube();
    #[unroll]
    for step in 0..comptime!(VT_KEYS * dim / VT_UNITS) {
        let idx = step * VT_UNITS + unit;
        let (c, k) = (idx / VT_KEYS, idx % VT_KEYS);
        out[(bhk * dim + c) * skv_pad + k0 + k] = P::cast_from(tile[k * stride + c]);
    }
}

/// [`v_transposed`] without rounding, for the tests: `v` `[b, h, skv, d]` to
/// `[b·h, d, skv_pad]` in `dtype`, keys past `skv` zero.
pub fn v_transposed_map(v: CubeTensor, dtype: DType, skv_pad: usize) -> CubeTensor {
    v_transposed(v, dtype, RoundArgs::new(Grid::E4M3), false, skv_pad)
}

/// `Vᵀ` in the PV dtype, padded to whole tiles (see [`v_transposed_kernel`]).
pub(super) fn v_transposed(
    v: CubeTensor,
    dtype: DType,
    g: RoundArgs,
    round: bool,
    skv_pad: usize,
) -> CubeTensor {
    let v = into_contiguous(v);
    let client = v.client.clone();
    let [b, h, skv, d] = v.meta.shape().dims::<4>();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        v.device.clone(),
        Shape::new([b * h, d, skv_pad]),
        dtype,
    );
    let n = b * h * d * skv_pad;
    let dtypes = [dtype_to_storage_type(v.dtype), dtype_to_storage_type(dtype)];
    if n == 0 {
        return out;
    }
    if skv_pad.is_multiple_of(VT_KEYS) && (VT_KEYS * d).is_multiple_of(VT_UNITS) {
        v_transposed_tiled_kernel::launch(
            &client,
            grid(&client, b * h * (skv_pad / VT_KEYS)),
            CubeDim::new_1d(VT_UNITS as u32),
            v.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            g.launch_arg(),
            skv,
            skv_pad,
            b * h,
            d,
            round,
            dtypes,
        );
        return out;
    }
    // SAFETY: every index the kernel forms is below its tensor's length (guarded by `out.len()`
    // for the output; `key < skv`, `d < dim`, `bhk < b·h` for the input).
    unsafe {
        v_transposed_kernel::launch_unchecked(
            &client,
            grid(&client, n.div_ceil(256)),
            CubeDim::new_1d(256),
            v.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            g.launch_arg(),
            skv,
            skv_pad,
            d,
            round,
            dtypes,
        );
    }
    out
}

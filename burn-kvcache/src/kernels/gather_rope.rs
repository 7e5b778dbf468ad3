//! ShadowKV's fused key rebuild: gather the low-rank rows of the selected chunks, multiply by
//! the per-head right factor and rotate by RoPE at the chunk positions, in one pass. A unit owns
//! output pairs `(j, j + d/2)`: both halves come out of the same two dot products of length
//! `rank`, which is what the rotate-half RoPE needs.
//!
//! The tiled kernel (the default): a cube takes a tile of up to 64 tokens of one (sequence,
//! head) and 32 pairs. It gathers the tile's low-rank rows into shared memory once, then each
//! warp walks the rank with 32 consecutive pairs (one coalesced load of each factor column a
//! step) and a register tile of the tile's tokens, reading their rows from shared memory as
//! broadcasts: two global loads per step feed 4 FMAs a token. The plain kernel (one unit per
//! pair, three loads for two FMAs a step) is the fallback where a tile's rows do not fit in
//! shared memory (a rank above 1536).

use burn::backend::cubecl::dtype_to_storage_type;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::UNITS;
use crate::shapes::gather_rope_shape;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gather_rope_kernel<F: Float, I: Int>(
    a: &Tensor<F>,
    wt: &Tensor<F>,
    chunks: &Tensor<I>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    out: &mut Tensor<F>,
    chunk: usize,
    pairs: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let idx = ABSOLUTE_POS;
    if idx >= pairs {
        terminate!();
    }
    let rows = a.shape(1);
    let rank = a.shape(2);
    let heads = wt.shape(1);
    let d = wt.shape(3);
    let half = d / 2;
    let n = chunks.shape(2) * chunk;
    let positions = cos.shape(0);

    let j = idx % half;
    let rest = idx / half;
    let tok = rest % n;
    let bh = rest / n;
    let bi = bh / heads;
    let (pos, valid) = token_position(chunks, bh, tok, chunk, rows, positions);
    let o = (bh * n + tok) * d + j;
    let mut x1 = f32::new(0.0);
    let mut x2 = f32::new(0.0);
    if valid {
        let arow = (bi * rows + pos) * rank;
        let wbase = bh * rank * d + j;
        for r in 0..rank {
            let av = f32::cast_from(a[arow + r]);
            let w = wbase + r * d;
            x1 += av * f32::cast_from(wt[w]);
            x2 += av * f32::cast_from(wt[w + half]);
        }
    }
    store_rotated(out, cos, sin, o, pos, j, half, x1, x2, valid);
}

/// Writes the pair `(x1, x2)` of output `o` (channels `j` and `j + half`) rotated by RoPE at
/// `pos`, or zeros where the token has no row (`!valid`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_rotated<F: Float>(
    out: &mut Tensor<F>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    o: usize,
    pos: usize,
    j: usize,
    half: usize,
    x1: f32,
    x2: f32,
    valid: bool,
) {
    let mut y1 = f32::new(0.0);
    let mut y2 = f32::new(0.0);
    if valid {
        let cs = cos[pos * half + j];
        let sn = sin[pos * half + j];
        y1 = x1 * cs - x2 * sn;
        y2 = x2 * cs + x1 * sn;
    }
    out[o] = F::cast_from(y1);
    out[o + half] = F::cast_from(y2);
}

/// Warps of the tiled kernel's cubes; a tile's tokens are spread over them.
const WARPS: usize = 8;
/// Most shared memory the tiled kernel's gathered rows take, in f32 values (48 KiB).
const TILE_VALUES: usize = 12_288;

/// Tokens a cube of the tiled kernel takes at `rank` with `shared_bytes` of shared memory a
/// cube: a multiple of [`WARPS`] up to 64 whose rows fit (and fit [`TILE_VALUES`]), or `None`
/// (the plain kernel) when not even [`WARPS`] do.
fn tile_tokens(rank: usize, shared_bytes: usize) -> Option<usize> {
    let values = TILE_VALUES.min(shared_bytes / 4);
    let fit = (values / rank.max(1)) / WARPS * WARPS;
    (fit >= WARPS).then_some(fit.min(64))
}

/// The position of token `tok` (of `n`) of `(sequence, head)` row `bh`, and whether it has a row
/// and a table entry (else its output is zeros).
#[cube]
fn token_position<I: Int>(
    chunks: &Tensor<I>,
    bh: usize,
    tok: usize,
    chunk: usize,
    rows: usize,
    positions: usize,
) -> (usize, bool) {
    let k = chunks.shape(2);
    // Indices are never negative (chunk ids).
    let c = usize::cast_from(chunks[bh * k + tok / chunk]);
    let pos = c * chunk + tok % chunk;
    (pos, pos < rows && pos < positions)
}

#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn gather_rope_tiled_kernel<F: Float, I: Int>(
    a: &Tensor<F>,
    wt: &Tensor<F>,
    chunks: &Tensor<I>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    out: &mut Tensor<F>,
    chunk: usize,
    #[comptime] rank: usize,
    #[comptime] tile: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let rows = a.shape(1);
    let heads = wt.shape(1);
    let d = wt.shape(3);
    let half = d / 2;
    let n = chunks.shape(2) * chunk;
    let positions = cos.shape(0);
    let j_blocks = (half + 31) / 32;
    let cx = CUBE_POS_X as usize;
    let j = (cx % j_blocks) * 32 + UNIT_POS_X as usize;
    let t0 = (cx / j_blocks) * tile;
    let bh = CUBE_POS_Y as usize;
    let bi = bh / heads;
    let warp = UNIT_POS_Y as usize;
    let unit = UNIT_POS as usize;

    // The tile's low-rank rows, gathered once: consecutive units read consecutive values of a
    // row. Tokens past the end or without a row read as zeros.
    let mut rows_sm = Shared::<[f32]>::new_slice(comptime!(tile * rank));
    for step in 0..comptime!((tile * rank).div_ceil(32 * WARPS)) {
        let idx = step * 32 * WARPS + unit;
        if idx < comptime!(tile * rank) {
            let tok = t0 + idx / rank;
            let mut x = f32::new(0.0);
            if tok < n {
                let (pos, valid) = token_position(chunks, bh, tok, chunk, rows, positions);
                if valid {
                    x = f32::cast_from(a[(bi * rows + pos) * rank + idx % rank]);
                }
            }
            rows_sm[idx] = x;
        }
    }
    sync_cube();
    if j >= half {
        terminate!();
    }

    // Warp `w` owns the tile's tokens `w`, `w + WARPS`, ...: a step of the rank reads one row
    // value a token (the same address across the warp) and one value of each factor column.
    let per = comptime!(tile / WARPS);
    let mut x1 = Array::<f32>::new(per);
    let mut x2 = Array::<f32>::new(per);
    #[unroll]
    for i in 0..per {
        x1[i] = f32::new(0.0);
        x2[i] = f32::new(0.0);
    }
    let wbase = bh * rank * d + j;
    for r in 0..rank {
        let w1 = f32::cast_from(wt[wbase + r * d]);
        let w2 = f32::cast_from(wt[wbase + r * d + half]);
        #[unroll]
        for i in 0..per {
            let av = rows_sm[(warp + WARPS * i) * rank + r];
            x1[i] += av * w1;
            x2[i] += av * w2;
        }
    }
    #[unroll]
    for i in 0..per {
        let tok = t0 + warp + WARPS * i;
        if tok < n {
            let (pos, valid) = token_position(chunks, bh, tok, chunk, rows, positions);
            let o = (bh * n + tok) * d + j;
            store_rotated(out, cos, sin, o, pos, j, half, x1[i], x2[i], valid);
        }
    }
}

/// Launches the gather-reconstruct-rope.
///
/// # Shapes
/// - `a`: `[batch, rows, rank]` (left low-rank factor, one row per position)
/// - `wt`: `[batch, heads, rank, d]` (right factor per head), `a`'s dtype, `d` even
/// - `chunks`: `[batch, heads, k]` int chunk ids
/// - `cos`, `sin`: `[positions, d/2]` f32 tables
/// - returns `[batch, heads, k · chunk, d]` in `a`'s dtype; position `c·chunk + t` of chunk `c`
///   is `RoPE(a[b, pos] · wt[b, h], pos)`, or zeros when `pos ≥ rows` or `pos ≥ positions`
pub fn gather_reconstruct_rope(
    a: CubeTensor,
    wt: CubeTensor,
    chunks: CubeTensor,
    cos: CubeTensor,
    sin: CubeTensor,
    chunk: usize,
) -> CubeTensor {
    let a = into_contiguous(a);
    let wt = into_contiguous(wt);
    let chunks = into_contiguous(chunks);
    let cos = into_contiguous(cos);
    let sin = into_contiguous(sin);
    let [b, h, _, d] = wt.meta.shape().dims::<4>();
    let k = chunks.meta.shape().dims::<3>()[2];
    let client = a.client.clone();
    let dtype = a.dtype;
    let out = empty_device_contiguous_dtype(
        client.clone(),
        a.device.clone(),
        gather_rope_shape(wt.meta.shape(), chunks.meta.shape(), &chunk),
        dtype,
    );
    let pairs = b * h * k * chunk * (d / 2);
    if pairs == 0 {
        return out;
    }
    let dtypes = [
        dtype_to_storage_type(dtype),
        dtype_to_storage_type(chunks.dtype),
    ];
    let rank = a.meta.shape().dims::<3>()[2];
    // The grid's second dimension is `b·h` (at most 65 535 cubes); past that, the plain kernel.
    let shared = client.properties().hardware.max_shared_memory_size;
    if let Some(tile) = tile_tokens(rank, shared).filter(|_| b * h <= 65_535) {
        let n = k * chunk;
        let cubes_x = (d / 2).div_ceil(32) * n.div_ceil(tile);
        gather_rope_tiled_kernel::launch(
            &client,
            CubeCount::Static(cubes_x as u32, (b * h) as u32, 1),
            CubeDim::new_2d(32, WARPS as u32),
            a.into_tensor_arg(),
            wt.into_tensor_arg(),
            chunks.into_tensor_arg(),
            cos.into_tensor_arg(),
            sin.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            chunk,
            rank,
            tile,
            dtypes,
        );
        return out;
    }
    let cube_dim = CubeDim::new_1d(UNITS);
    let cube_count = calculate_cube_count_elemwise(&client, pairs, cube_dim);
    gather_rope_kernel::launch(
        &client,
        cube_count,
        cube_dim,
        a.into_tensor_arg(),
        wt.into_tensor_arg(),
        chunks.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        chunk,
        pairs,
        dtypes,
    );
    out
}

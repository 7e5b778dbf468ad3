//! What the fused kernels do on a tile, as `#[cube]` functions (inlined into each kernel):
//! storing a block of operand rows to shared memory, the plane's block of logits
//! `S = X·Yᵀ` on the matrix units, the logit gradient of that block into shared memory, the
//! product `G·Y` added into the plane's f32 accumulators, and writing them out.
//!
//! Tiles the units store (the owned operand's, the gradient tile) are row-major and swizzled
//! ([`chunk_at()`]): 16-byte chunk `c` of row `r` sits at chunk `c xor (r mod 8)`, so the 8
//! consecutive rows one `ldmatrix` matrix reads fall in 8 different bank groups with no padding
//! (the backward has no room for it). Walked tiles, which bulk copies fill a row at a time, are
//! padded instead (`copies::padded_at`). Fragment layouts are PTX's
//! for `mma.m16n8k16` (16-bit operands, f32 accumulators): lane `l` (`g = l / 4`, `t = l mod 4`)
//! holds rows `g` and `g + 8` and, in each block of 8 columns, columns `2t` and `2t + 1`; an
//! accumulator block of 16 × 8 is two `Vector<f32, 2>` (row `g`, row `g + 8`).

use burn_kernels_core::kernels::flash::stages::mma_step;
use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;

use super::copies::padded_at;
use super::{FusedArgs, THREADS, TILE};

/// Stores rows `first .. first + TILE` of `src` (`[len, dim]`, contiguous, read 8 values at a
/// time; rows at or past `len` as zeros) to the tile at the start of `sm`, swizzled.
#[cube]
pub fn store_rows<P: Float, N2: Size, N8: Size>(
    src: &Tensor<Vector<P, N8>>,
    first: usize,
    len: usize,
    sm: &mut Shared<[Vector<P, N2>]>,
    tid: usize,
    #[comptime] dim: usize,
) {
    let vecs = comptime!(dim / 8);
    let wide = sm
        .slice_mut(0usize, comptime!(TILE * dim / 2))
        .with_vector_size_mut::<N8>();
    #[unroll]
    for i in 0..comptime!(TILE * dim / 8 / THREADS) {
        let b = tid + i * THREADS;
        let r = b / vecs;
        let c = b % vecs;
        let mut x = Vector::<P, N8>::new(P::from_int(0));
        if first + r < len {
            x = src[(first + r) * vecs + c];
        }
        wide[chunk_at(r, c, dim) / 4] = x;
    }
}

/// The word at which 16-byte chunk `chunk` (8 values) of row `row` of a swizzled operand tile
/// starts: chunk `chunk xor (row mod 8)` of the row (`dim / 8` chunks, a multiple of 8).
#[cube]
pub fn chunk_at(row: usize, chunk: usize, #[comptime] dim: usize) -> usize {
    row * comptime!(dim / 2) + (chunk ^ (row % 8)) * 4
}

/// The rows and columns of the tile whose logits plane `plane` keeps after [`scores()`]: rows
/// `r0 .. r0 + 16`, columns `c0 .. c0 + 32`.
#[cube]
pub fn score_block(plane: usize) -> (usize, usize) {
    (32 * ((plane % 4) / 2) + 16 * (plane / 4), 32 * (plane % 2))
}

/// The A fragments (`ldmatrix.x4`) of the 16 × 16 block of the swizzled tile `x_sm` at rows
/// `row0 ..`, chunks `chunk ..` (lane `l` names row `row0 + l mod 16`, chunk `chunk + l / 16`).
#[cube]
fn a_block<P: Float, N2: Size>(
    x_sm: &Shared<[Vector<P, N2>]>,
    row0: usize,
    chunk: usize,
    lane: usize,
    #[comptime] dim: usize,
) -> Array<Vector<P, N2>> {
    let def = MmaDefinition::<P, P, f32>::new(16usize, 8usize, 16usize);
    let at = chunk_at(row0 + lane % 16, chunk + lane / 16, dim);
    def.load_matrix::<Vector<P, N2>, N2>(&x_sm[at..at + 4], MatrixIdent::A, 4usize, false)
}

/// 16 f32 pairs of zeros: a plane's 32 × 32 block of sums, before the first product.
#[cube]
fn zero_block<N2: Size>() -> Array<Vector<f32, N2>> {
    let mut full = Array::<Vector<f32, N2>>::new(16usize);
    #[unroll]
    for i in 0..16usize {
        full[i] = Vector::<f32, N2>::new(f32::new(0.0));
    }
    full
}

/// `full += A·Bᵀ` on column block `n` of a plane's 32 × 32 block (both row blocks), over
/// `steps` 16-deep steps whose B fragments one `ldmatrix` (`.x2` a step) loads from word `at` of
/// `y_sm`; row block `m`'s fragments of step `j` are at `a[4(a0 + m·steps + j) ..]`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn column_products<P: Float, N2: Size>(
    a: &Array<Vector<P, N2>>,
    a0: usize,
    y_sm: &Shared<[Vector<P, N2>]>,
    at: usize,
    full: &mut Array<Vector<f32, N2>>,
    n: usize,
    #[comptime] steps: usize,
) {
    let def = MmaDefinition::<P, P, f32>::new(16usize, 8usize, 16usize);
    let b = def.load_matrix::<Vector<P, N2>, N2>(
        &y_sm[at..at + 4],
        MatrixIdent::B,
        comptime!(2 * steps),
        false,
    );
    let mut cf = Array::<Vector<f32, N2>>::new(2usize);
    #[unroll]
    for m in 0..2usize {
        let i = 8 * m + 2 * n;
        cf[0] = full[i];
        cf[1] = full[i + 1];
        #[unroll]
        for j in 0..steps {
            mma_step::<P, N2>(&def, a, a0 + m * steps + j, &b, 2 * j, &mut cf);
        }
        full[i] = cf[0];
        full[i + 1] = cf[1];
    }
}

/// The plane's share of `S = X·Yᵀ` on a tile (`TILE × TILE`, `dim` deep; the walked tile at word
/// `yo` of `y_sm`). Planes `p` and `p ^ 4` compute the 32 × 32 block `((p mod 4) / 2, p mod 2)`
/// over the two halves of the depth (`p / 4`): per 16 channels 2 A `ldmatrix.x4` and 4 B
/// `ldmatrix.x2` feed 8 products (a 16 × 32 block over the whole depth needs 6 for 8). Each
/// plane then hands the partner the 16 rows it does not keep, through `g_sm`
/// (`trade_narrow`), and leaves the full sums of the block [`score_block()`] names in `s`:
/// column block `n` at `s[2n]` (row `g`) and
/// `s[2n + 1]`. Syncs the cube four times, the last after the trade's last read of `g_sm`.
///
/// A fragments by `ldmatrix.x4` (lane `l` at row `l mod 16` of the row block, chunk `l / 16` of
/// a 16-deep step); B fragments by `ldmatrix.x2` (lane `l < 16` at row `8n + l mod 8`, chunk
/// `l / 8` of the step).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn scores<P: Float, N2: Size>(
    x_sm: &Shared<[Vector<P, N2>]>,
    y_sm: &Shared<[Vector<P, N2>]>,
    yo: usize,
    g_sm: &mut Shared<[Vector<P, N2>]>,
    s: &mut Array<Vector<f32, N2>>,
    plane: usize,
    lane: usize,
    #[comptime] dim: usize,
) {
    let rows = 32 * ((plane % 4) / 2);
    let cols = 32 * (plane % 2);
    // Row block m's sums at full[8m ..].
    let mut full = zero_block::<N2>();
    // The depth half's first chunk.
    let k0 = (plane / 4) * comptime!(dim / 16);
    // Fragments of row block m at a[4m ..], one 16-deep step at a time (fewer live registers
    // beside the accumulators than a whole 32-channel step's).
    let mut a = Array::<Vector<P, N2>>::new(8usize);
    for step in 0..comptime!(dim / 32) {
        #[unroll]
        for m in 0..2usize {
            let f = a_block::<P, N2>(x_sm, rows + m * 16, k0 + 2 * step, lane, dim);
            #[unroll]
            for r in 0..4usize {
                a[m * 4 + r] = f[r];
            }
        }
        #[unroll]
        for n in 0..4usize {
            // Lanes 0..16 name the two 8 × 8 matrices of the step (lanes past 16 as well, for
            // an address the instruction ignores).
            let at = yo + padded_at(cols + n * 8 + lane % 8, k0 + 2 * step + (lane / 8) % 2, dim);
            column_products::<P, N2>(&a, 0usize, y_sm, at, &mut full, n, 1usize);
        }
    }
    trade_narrow::<P, N2>(&full, g_sm, s, plane, lane);
}

/// The plane's A fragments of [`scores()`] over its whole depth half, for [`scores_held()`]: step
/// `h` (32 channels), row block `m`, 16-deep step `j` at `a[16h + 4(2m + j) ..]`; `dim / 4`
/// registers a lane (144 at `dim = 576`). Loaded once, they let a walk read only the walked
/// tiles from shared memory.
#[cube]
pub fn held_fragments<P: Float, N2: Size>(
    x_sm: &Shared<[Vector<P, N2>]>,
    plane: usize,
    lane: usize,
    #[comptime] dim: usize,
) -> Array<Vector<P, N2>> {
    let rows = 32 * ((plane % 4) / 2);
    let k0 = (plane / 4) * comptime!(dim / 16);
    let mut a = Array::<Vector<P, N2>>::new(comptime!(dim / 4));
    #[unroll]
    for h in 0..comptime!(dim / 64) {
        #[unroll]
        for m in 0..2usize {
            #[unroll]
            for j in 0..2usize {
                let f = a_block::<P, N2>(x_sm, rows + m * 16, k0 + 4 * h + 2 * j, lane, dim);
                #[unroll]
                for r in 0..4usize {
                    a[h * 16 + (2 * m + j) * 4 + r] = f[r];
                }
            }
        }
    }
    a
}

/// [`scores()`] with the A fragments held in registers ([`held_fragments()`]) and the walked tile
/// at word `yo` of `y_sm`. Syncs the cube once, after the last read of the walked tile.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn scores_held<P: Float, N2: Size>(
    a: &Array<Vector<P, N2>>,
    y_sm: &Shared<[Vector<P, N2>]>,
    yo: usize,
    xchg_sm: &mut Shared<[Vector<f32, N2>]>,
    s: &mut Array<Vector<f32, N2>>,
    plane: usize,
    lane: usize,
    #[comptime] dim: usize,
) {
    let cols = 32 * (plane % 2);
    let k0 = (plane / 4) * comptime!(dim / 16);
    let mut full = zero_block::<N2>();
    #[unroll]
    for h in 0..comptime!(dim / 64) {
        #[unroll]
        for n in 0..4usize {
            let at = yo + padded_at(cols + n * 8 + lane % 8, k0 + 4 * h + lane / 8, dim);
            column_products::<P, N2>(a, h * 4, y_sm, at, &mut full, n, 2usize);
        }
    }
    trade::<N2>(&full, xchg_sm, s, plane, lane);
}

/// Hands the partner plane (`plane ^ 4`, the other depth half of the same block) the 16 rows
/// of `full` this plane does not keep, through `xchg_sm`, and leaves the full sums of the rows
/// it keeps in `s`. Syncs the cube once.
#[cube]
fn trade<N2: Size>(
    full: &Array<Vector<f32, N2>>,
    xchg_sm: &mut Shared<[Vector<f32, N2>]>,
    s: &mut Array<Vector<f32, N2>>,
    plane: usize,
    lane: usize,
) {
    // The half that plane keeps is row block `half`; the other goes to the partner.
    let half = plane / 4;
    #[unroll]
    for i in 0..8usize {
        let mut give = full[8 + i];
        if half == 1 {
            give = full[i];
        }
        xchg_sm[(plane * 8 + i) * 32 + lane] = give;
    }
    sync_cube();
    let partner = plane ^ 4;
    #[unroll]
    for i in 0..8usize {
        let mut keep = full[i];
        if half == 1 {
            keep = full[8 + i];
        }
        s[i] = keep + xchg_sm[(partner * 8 + i) * 32 + lane];
    }
}

/// [`trade`] through the gradient tile `g_sm` (the backward has no room for a buffer of its own),
/// in two rounds — first the planes of depth half 0 give, then those of half 1 — of 8 KB, the f32
/// sums stored as their bits. Syncs the cube four times; the last sync follows the last read, so
/// the caller may write `g_sm` after it.
#[cube]
fn trade_narrow<P: Float, N2: Size>(
    full: &Array<Vector<f32, N2>>,
    g_sm: &mut Shared<[Vector<P, N2>]>,
    s: &mut Array<Vector<f32, N2>>,
    plane: usize,
    lane: usize,
) {
    let half = plane / 4;
    // The pair's 8 sums a lane (16 words) start at word slot(i)·32 + lane: pair p mod 4.
    let pair = (plane % 4) * 16;
    #[unroll]
    for round in 0..2usize {
        if half == round {
            #[unroll]
            for i in 0..8usize {
                let mut give = full[8 + i];
                if half == 1 {
                    give = full[i];
                }
                #[unroll]
                for e in 0..2usize {
                    g_sm[(pair + 2 * i + e) * 32 + lane] =
                        Vector::<P, N2>::reinterpret(give.extract(e));
                }
            }
        }
        sync_cube();
        if half != round {
            #[unroll]
            for i in 0..8usize {
                let mut keep = full[i];
                if half == 1 {
                    keep = full[8 + i];
                }
                let mut got = Vector::<f32, N2>::empty();
                #[unroll]
                for e in 0..2usize {
                    got.insert(e, f32::reinterpret(g_sm[(pair + 2 * i + e) * 32 + lane]));
                }
                s[i] = keep + got;
            }
        }
        sync_cube();
    }
}

/// The soft-capped logit `c·tanh(x / c)`, its slope in `slope`; `x` (`slope` untouched)
/// without a cap.
#[cube]
pub fn capped(x: f32, cap: f32, slope: &mut f32, #[comptime] has_softcap: bool) -> f32 {
    let mut y = x;
    if has_softcap {
        let t = f32::tanh(x / cap);
        y = cap * t;
        *slope = f32::new(1.0) - t * t;
    }
    y
}

/// Token `token`'s log-sum-exp, loss gradient and target, stored at index `at` of `tok_lse`,
/// `tok_dout`, `tok_target` (a padding token at or past `args.tokens`: zero gradient, target
/// `u32::MAX`, which matches no entry).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn token_grad<I: Int>(
    lse: &Tensor<f32>,
    dout: &Tensor<f32>,
    targets: &Tensor<I>,
    token: usize,
    args: &FusedArgs,
    tok_lse: &mut Shared<[f32]>,
    tok_dout: &mut Shared<[f32]>,
    tok_target: &mut Shared<[u32]>,
    at: usize,
) {
    let mut l = f32::new(0.0);
    let mut d = f32::new(0.0);
    let mut target = u32::new(u32::MAX as i64);
    if token < args.tokens {
        l = lse[token];
        d = dout[token];
        target = u32::cast_from(targets[token]);
    }
    tok_lse[at] = l;
    tok_dout[at] = d;
    tok_target[at] = target;
}

/// The logit gradient `(softmax − onehot) · dout · cap'` of the plane's block `s` (rows
/// `r0 + g + 8v`, columns `c0 + 8n + 2t + e` of the tile, as [`scores()`] leaves it and
/// [`score_block()`] names them), stored to
/// `g_sm` (swizzled, `TILE / 2` words a row) in the operands' dtype.
///
/// The tile's tokens' log-sum-exp, loss gradient and target are in `tok_lse`, `tok_dout` and
/// `tok_target` ([`token_grad()`]), by column with `vocab_owned` (the rows are vocabulary entries
/// `o0 + row`, the columns tokens `w0 + col`) and by row otherwise (rows tokens, columns
/// entries). Columns past the walked operand's end get 0.
///
/// Returns whether any of the lane's entries has `|softmax − onehot|` at least
/// `args.filter_eps` (always `true` without `filtered`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn gradients<P: Float, N2: Size>(
    s: &Array<Vector<f32, N2>>,
    g_sm: &mut Shared<[Vector<P, N2>]>,
    tok_lse: &Shared<[f32]>,
    tok_dout: &Shared<[f32]>,
    tok_target: &Shared<[u32]>,
    args: &FusedArgs,
    o0: usize,
    w0: usize,
    r0: usize,
    c0: usize,
    lane: usize,
    #[comptime] vocab_owned: bool,
    #[comptime] has_softcap: bool,
    #[comptime] filtered: bool,
) -> bool {
    let g = lane / 4;
    let t = lane % 4;
    let mut big = comptime!(!filtered).runtime();
    #[unroll]
    for n in 0..4usize {
        #[unroll]
        for v in 0..2usize {
            let sv = s[2 * n + v];
            let row = r0 + g + 8 * v;
            let mut out = Vector::<P, N2>::empty();
            #[unroll]
            for e in 0..2usize {
                let col = c0 + 8 * n + 2 * t + e;
                let mut slope = f32::new(1.0);
                let x = capped(sv.extract(e), args.softcap, &mut slope, has_softcap);
                let mut lse = tok_lse[row];
                let mut dout = tok_dout[row];
                let mut hit = tok_target[row] == u32::cast_from(w0 + col);
                let mut valid = w0 + col < args.vocab;
                if vocab_owned {
                    lse = tok_lse[col];
                    dout = tok_dout[col];
                    hit = tok_target[col] == u32::cast_from(o0 + row);
                    valid = w0 + col < args.tokens;
                }
                let mut gr = f32::exp(x - lse);
                if hit {
                    gr -= f32::new(1.0);
                }
                if filtered {
                    // Padding rows (zeros past the owned operand's end) decide nothing, so the
                    // dE and dC walks leave out the same tiles.
                    let mut rows = args.tokens;
                    if vocab_owned {
                        rows = args.vocab;
                    }
                    let real = valid && o0 + row < rows;
                    big = big || (real && f32::abs(gr) >= args.filter_eps);
                }
                let gr = select(valid, gr * dout * slope, f32::new(0.0));
                out.insert(e, P::cast_from(gr));
            }
            g_sm[chunk_at(row, (c0 + 8 * n) / 8, TILE) + t] = out;
        }
    }
    big
}

/// `acc += G·Y`: rows `r0 .. r0 + 32` of `g_sm` (`TILE` deep) times `y_sm`'s `TILE` rows,
/// channels `q0 .. q0 + dim / 4`; row block `m` (16 rows), channel block `n` (8 channels) at
/// `acc[(m · dim / 32 + n) · 2 ..]` (row `g`, row `g + 8`).
///
/// A fragments by `ldmatrix.x4` from `g_sm`; B fragments by `ldmatrix.x4.trans` from `y_sm`
/// (lane `l` at row `16kk + 8((l / 8) mod 2) + l mod 8`, channels `q0 + 16dp + 8(l / 16) ..`:
/// channel blocks `2dp` and `2dp + 1` of step `kk`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn accumulate<P: Float, N2: Size>(
    g_sm: &Shared<[Vector<P, N2>]>,
    y_sm: &Shared<[Vector<P, N2>]>,
    yo: usize,
    r0: usize,
    q0: usize,
    acc: &mut Array<Vector<f32, N2>>,
    lane: usize,
    #[comptime] dim: usize,
) {
    let def = MmaDefinition::<P, P, f32>::new(16usize, 8usize, 16usize);
    let blocks = comptime!(dim / 32);
    let mut c0 = Array::<Vector<f32, N2>>::new(2usize);
    let mut c1 = Array::<Vector<f32, N2>>::new(2usize);
    for kk in 0..comptime!(TILE / 16) {
        let a_at = chunk_at(r0 + lane % 16, 2 * kk + lane / 16, TILE);
        let a0 = def.load_matrix::<Vector<P, N2>, N2>(
            &g_sm[a_at..a_at + 4],
            MatrixIdent::A,
            4usize,
            false,
        );
        let a_hi = chunk_at(r0 + 16 + lane % 16, 2 * kk + lane / 16, TILE);
        let a1 = def.load_matrix::<Vector<P, N2>, N2>(
            &g_sm[a_hi..a_hi + 4],
            MatrixIdent::A,
            4usize,
            false,
        );
        // Row block m's fragments at a[4m ..].
        let mut a = Array::<Vector<P, N2>>::new(8usize);
        #[unroll]
        for j in 0..4usize {
            a[j] = a0[j];
            a[4 + j] = a1[j];
        }
        let b_row = kk * 16 + ((lane / 8) % 2) * 8 + lane % 8;
        #[unroll]
        for dp in 0..comptime!(dim / 64) {
            let at = yo + padded_at(b_row, q0 / 8 + 2 * dp + lane / 16, dim);
            let b = def.load_matrix::<Vector<P, N2>, N2>(
                &y_sm[at..at + 4],
                MatrixIdent::B,
                4usize,
                true,
            );
            #[unroll]
            for m in 0..2usize {
                let i = (m * blocks + 2 * dp) * 2;
                c0[0] = acc[i];
                c0[1] = acc[i + 1];
                c1[0] = acc[i + 2];
                c1[1] = acc[i + 3];
                mma_step::<P, N2>(&def, &a, m, &b, 0usize, &mut c0);
                mma_step::<P, N2>(&def, &a, m, &b, 2usize, &mut c1);
                acc[i] = c0[0];
                acc[i + 1] = c0[1];
                acc[i + 2] = c1[0];
                acc[i + 3] = c1[1];
            }
        }
    }
}

/// Writes the lane's accumulators ([`accumulate()`]'s layout) as rows `first + 16m + g + 8v`,
/// channels `q0 + 8n + 2t ..` of `dst` (`[len, dim]`, contiguous, pairs), rows below `len`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn write_rows<P: Float, N2: Size>(
    acc: &Array<Vector<f32, N2>>,
    dst: &mut Tensor<Vector<P, N2>>,
    first: usize,
    len: usize,
    q0: usize,
    lane: usize,
    #[comptime] dim: usize,
) {
    let g = lane / 4;
    let t = lane % 4;
    let blocks = comptime!(dim / 32);
    #[unroll]
    for m in 0..2usize {
        #[unroll]
        for v in 0..2usize {
            let row = first + 16 * m + g + 8 * v;
            if row < len {
                #[unroll]
                for n in 0..comptime!(dim / 32) {
                    let x = acc[(m * blocks + n) * 2 + v];
                    let mut y = Vector::<P, N2>::empty();
                    #[unroll]
                    for e in 0..2usize {
                        y.insert(e, P::cast_from(x.extract(e)));
                    }
                    dst[(row * dim + q0 + 8 * n) / 2 + t] = y;
                }
            }
        }
    }
}

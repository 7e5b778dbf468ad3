//! What the flash kernels do on a tile, as `#[cube]` functions (inlined into each kernel):
//! loading a tile into shared memory (row-major, and channel-major for the products that walk
//! its rows), the A fragments of a plane's rows, the two shapes of `mma.m16n8k16` products, and
//! the probabilities and score gradients of a tile on the lane's registers.
//!
//! Operands are addressed by a head's first element `base` and a row stride `stride`, both in
//! elements (even: rows are read in pairs), so a `[batch, heads, seq, dim]` view of a
//! `[batch, seq, heads, dim]` buffer is read in place.
//!
//! Fragment layouts are PTX's for `mma.m16n8k16` with 16-bit operands and f32 accumulators:
//! lane `l` (group `g = l / 4`, `t = l mod 4`) holds rows `g` and `g + 8` and, in each block of
//! 8 columns, columns `2t` and `2t + 1`. An accumulator block of 16 × 8 is two `Vector<f32, 2>`
//! (row `g`, row `g + 8`); two adjacent blocks are the A operand of one 16-deep step, which is
//! how probabilities and score gradients go from one product into the next without leaving the
//! registers.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;

use super::{FlashArgs, PAD, Rows, THREADS, TILE};

/// The first element of head `bh` (`batch · heads + head`) of an operand laid out as `rows`.
#[cube]
pub fn head_base(rows: &Rows, bh: usize, heads: usize) -> usize {
    (bh / heads) * rows.batch + (bh % heads) * rows.head
}

/// Stores tile rows `0 .. TILE` (row `r` at element `base + r · stride` of `src`, `dim`
/// channels in pairs; rows at or past `valid` as zeros) to `rows_sm` (row-major, `dim / 2 + PAD`
/// words a row). Both products read this one copy (`ldmatrix`, plain or transposed).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn store_tile<P: Float, N2: Size>(
    src: &Tensor<Vector<P, N2>>,
    base: usize,
    stride: usize,
    valid: usize,
    rows_sm: &mut Shared<[Vector<P, N2>]>,
    tid: usize,
    #[comptime] dim: usize,
) {
    let half = comptime!(dim / 2);
    let rw = comptime!(dim / 2 + PAD);
    #[unroll]
    for i in 0..comptime!(TILE * dim / 2 / THREADS) {
        let b = tid + i * THREADS;
        let r = b / half;
        let c2 = b % half;
        let mut x = Vector::<P, N2>::new(P::from_int(0));
        if r < valid {
            x = src[(base + r * stride) / 2 + c2];
        }
        rows_sm[r * rw + c2] = x;
    }
}

/// The A fragments of rows `first + g` and `first + g + 8` of `src` (row `r` at element
/// `base + r · stride`, `dim` channels in pairs; rows at or past `len` zero): step `kk`
/// (channels `16kk ..`) at `frag[4kk ..]`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn a_fragments<P: Float, N2: Size>(
    src: &Tensor<Vector<P, N2>>,
    base: usize,
    stride: usize,
    first: usize,
    len: usize,
    lane: usize,
    frag: &mut Array<Vector<P, N2>>,
    #[comptime] dim: usize,
) {
    let g = lane / 4;
    let t = lane % 4;
    #[unroll]
    for kk in 0..comptime!(dim / 16) {
        #[unroll]
        for j in 0..4usize {
            let row = first + g + 8 * (j % 2);
            let mut x = Vector::<P, N2>::new(P::from_int(0));
            if row < len {
                x = src[(base + row * stride) / 2 + kk * 8 + t + 4 * (j / 2)];
            }
            frag[kk * 4 + j] = x;
        }
    }
}

/// One `mma.m16n8k16` step: `cf += A · B` with A `a[4kk .. 4kk + 4]` and B the two registers
/// `b[first]`, `b[first + 1]`.
#[cube]
pub fn mma_step<P: Float, N2: Size>(
    def: &MmaDefinition<P, P, f32>,
    a: &Array<Vector<P, N2>>,
    kk: usize,
    b: &Array<Vector<P, N2>>,
    first: usize,
    cf: &mut Array<Vector<f32, N2>>,
) {
    let mut ah = Array::<Vector<P, N2>>::new(4usize);
    let mut bh = Array::<Vector<P, N2>>::new(2usize);
    #[unroll]
    for j in 0..4usize {
        ah[j] = a[kk * 4 + j];
    }
    bh[0] = b[first];
    bh[1] = b[first + 1];
    let r = def.execute(&ah, &bh, &*cf);
    cf[0] = r[0];
    cf[1] = r[1];
}

/// `c = A · Bᵀ`: the plane's 16 rows (A fragments `a`, `dim` deep) against the tile's `TILE`
/// rows in `rows_sm`; block `n` (tile rows `8n ..`) at `c[2n]` (row `g`) and `c[2n + 1]`.
///
/// B fragments come by `ldmatrix.x4`: lane `l` points at tile row `8n + l mod 8`, channels
/// `32h + 8(l / 8) ..` (16 bytes); the four 8 × 8 matrices are two 16-deep steps.
#[cube]
pub fn rows_product<P: Float, N2: Size>(
    a: &Array<Vector<P, N2>>,
    rows_sm: &Shared<[Vector<P, N2>]>,
    c: &mut Array<Vector<f32, N2>>,
    lane: usize,
    #[comptime] dim: usize,
) {
    let def = MmaDefinition::<P, P, f32>::new(16usize, 8usize, 16usize);
    let rw = comptime!(dim / 2 + PAD);
    let mut cf = Array::<Vector<f32, N2>>::new(2usize);
    #[unroll]
    for n in 0..comptime!(TILE / 8) {
        cf[0] = Vector::<f32, N2>::new(f32::new(0.0));
        cf[1] = Vector::<f32, N2>::new(f32::new(0.0));
        #[unroll]
        for h in 0..comptime!(dim / 32) {
            let at = (n * 8 + lane % 8) * rw + h * 16 + (lane / 8) * 4;
            let b = def.load_matrix::<Vector<P, N2>, N2>(
                &rows_sm[at..at + 4],
                MatrixIdent::B,
                4usize,
                false,
            );
            mma_step::<P, N2>(&def, a, 2 * h, &b, 0usize, &mut cf);
            mma_step::<P, N2>(&def, a, 2 * h + 1, &b, 2usize, &mut cf);
        }
        c[n * 2] = cf[0];
        c[n * 2 + 1] = cf[1];
    }
}

/// `acc += A · B`: A the plane's 16 rows by the tile's `TILE` rows (pairs of accumulator
/// blocks, as [`rows_product`] leaves them, rounded), B the tile's rows by `dim` channels from
/// the same row-major `rows_sm`; channel block `dn` at `acc[2dn]` (row `g`) and `acc[2dn + 1]`.
///
/// B fragments come by `ldmatrix.x4.trans`: lane `l` points at tile row
/// `16kk + 8((l / 8) mod 2) + l mod 8`, channels `16dp + 8(l / 16) ..`; the four matrices are the
/// two registers of channel blocks `2dp` and `2dp + 1` for step `kk`.
#[cube]
pub fn accumulate<P: Float, N2: Size>(
    a: &Array<Vector<P, N2>>,
    rows_sm: &Shared<[Vector<P, N2>]>,
    acc: &mut Array<Vector<f32, N2>>,
    lane: usize,
    #[comptime] dim: usize,
) {
    let def = MmaDefinition::<P, P, f32>::new(16usize, 8usize, 16usize);
    let rw = comptime!(dim / 2 + PAD);
    let mut c0 = Array::<Vector<f32, N2>>::new(2usize);
    let mut c1 = Array::<Vector<f32, N2>>::new(2usize);
    #[unroll]
    for dp in 0..comptime!(dim / 16) {
        c0[0] = acc[dp * 4];
        c0[1] = acc[dp * 4 + 1];
        c1[0] = acc[dp * 4 + 2];
        c1[1] = acc[dp * 4 + 3];
        #[unroll]
        for kk in 0..comptime!(TILE / 16) {
            let row = kk * 16 + ((lane / 8) % 2) * 8 + lane % 8;
            let at = row * rw + dp * 8 + (lane / 16) * 4;
            let b = def.load_matrix::<Vector<P, N2>, N2>(
                &rows_sm[at..at + 4],
                MatrixIdent::B,
                4usize,
                true,
            );
            mma_step::<P, N2>(&def, a, kk, &b, 0usize, &mut c0);
            mma_step::<P, N2>(&def, a, kk, &b, 2usize, &mut c1);
        }
        acc[dp * 4] = c0[0];
        acc[dp * 4 + 1] = c0[1];
        acc[dp * 4 + 2] = c1[0];
        acc[dp * 4 + 3] = c1[1];
    }
}

/// Whether query `query` sees key `key`: both exist and, with a causal mask (bottom-right:
/// `offset = skv − sq`), the key is not after the query's diagonal. Without `masked` (a tile
/// whose every query sees every key, checked once a tile by the caller) always.
#[cube]
pub fn visible(
    args: &FlashArgs,
    query: usize,
    key: usize,
    #[comptime] causal: bool,
    #[comptime] masked: bool,
) -> bool {
    let mut seen = true;
    if masked {
        seen = query < args.sq && key < args.skv;
        if causal {
            seen = seen && key <= query + args.offset;
        }
    }
    seen
}

/// The end of the keys a tile of queries `q0 .. q0 + TILE` sees: all of them, or with a causal
/// mask those up to the last query's diagonal.
#[cube]
pub fn keys_end(args: &FlashArgs, q0: usize, #[comptime] causal: bool) -> usize {
    let mut end = args.skv;
    if causal {
        let mut last = q0 + TILE;
        if last > args.sq {
            last = args.sq;
        }
        end = last + args.offset;
    }
    end
}

/// Whether every query from `first` on sees every key of the tile `kv0 .. kv0 + TILE` (no key
/// past the end, none after the first query's diagonal, no key-padding mask): such a tile needs
/// no mask.
#[cube]
pub fn sees_key_tile(
    args: &FlashArgs,
    kv0: usize,
    first: usize,
    #[comptime] causal: bool,
    #[comptime] padded: bool,
) -> bool {
    let mut full = kv0 + TILE <= args.skv;
    if causal {
        full = full && kv0 + TILE <= first + args.offset + 1;
    }
    if padded {
        full = false;
    }
    full
}

/// Stores which keys of the tile `kv0 .. kv0 + TILE` a key-padding mask hides (`pad`: one f32 a
/// key, nonzero = hidden, the batch's keys from `pad_base`) in `hidden_sm` (keys past the end
/// hidden too), when `padded`. The caller syncs before the tile is read.
#[cube]
// `padded` is known when the kernel is compiled, `tid < TILE` only when it runs: kept apart.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn store_hidden(
    pad: &Tensor<f32>,
    pad_base: usize,
    kv0: usize,
    args: &FlashArgs,
    hidden_sm: &mut Shared<[f32]>,
    tid: usize,
    #[comptime] padded: bool,
) {
    if padded {
        if tid < TILE {
            let key = kv0 + tid;
            let mut h = f32::new(1.0);
            if key < args.skv {
                h = pad[pad_base + key];
            }
            hidden_sm[tid] = h;
        }
    }
}

/// A tile of the query-owned walk (rows queries, columns keys `col0 ..`): from the scores `s`
/// and `dp = dO·Vᵀ`, the score gradients `dS = P ⊙ (dP − Δ)` with
/// `P = exp(scale · s − lse)`, as A-operand pairs in `ds` (zero where a key is hidden; with
/// `padded` also where `hidden_sm`, from [`store_hidden`], marks the key).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn query_rows_gradients<P: Float, N2: Size>(
    s: &Array<Vector<f32, N2>>,
    dp: &Array<Vector<f32, N2>>,
    ds: &mut Array<Vector<P, N2>>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    hidden_sm: &Shared<[f32]>,
    args: &FlashArgs,
    row: usize,
    col0: usize,
    t: usize,
    #[comptime] causal: bool,
    #[comptime] masked: bool,
    #[comptime] padded: bool,
) {
    #[unroll]
    for n in 0..comptime!(TILE / 8) {
        #[unroll]
        for v in 0..2usize {
            let sv = s[n * 2 + v];
            let dv = dp[n * 2 + v];
            let mut out = Vector::<P, N2>::empty();
            #[unroll]
            for e in 0..2usize {
                let c = n * 8 + 2 * t + e;
                let mut seen = visible(args, row + 8 * v, col0 + c, causal, masked);
                if padded {
                    seen = seen && hidden_sm[c] == f32::new(0.0);
                }
                let p = f32::exp(sv.extract(e) * args.scale - lse[v]);
                let g = p * (dv.extract(e) - delta[v]);
                let g = select(seen, g, f32::new(0.0));
                out.insert(e, P::cast_from(g));
            }
            ds[n * 2 + v] = out;
        }
    }
}

/// A tile of the key-owned walk (rows keys, columns queries `col0 ..`): from the transposed
/// scores `st` and `dpt = V·dOᵀ`, the probabilities `Pᵀ` in `p` and the score gradients
/// `dSᵀ` in `ds`, as A-operand pairs (zero where a query does not see the key); the queries'
/// log-sum-exp and `Δ` from shared memory. With `padded`, `key_hidden[v]` is nonzero where a
/// key-padding mask hides the lane's key `row + 8v`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn key_rows_gradients<P: Float, N2: Size>(
    st: &Array<Vector<f32, N2>>,
    dpt: &Array<Vector<f32, N2>>,
    p: &mut Array<Vector<P, N2>>,
    ds: &mut Array<Vector<P, N2>>,
    lse_sm: &Shared<[f32]>,
    delta_sm: &Shared<[f32]>,
    key_hidden: &Array<f32>,
    args: &FlashArgs,
    row: usize,
    col0: usize,
    t: usize,
    #[comptime] causal: bool,
    #[comptime] masked: bool,
    #[comptime] padded: bool,
) {
    #[unroll]
    for n in 0..comptime!(TILE / 8) {
        #[unroll]
        for v in 0..2usize {
            let sv = st[n * 2 + v];
            let dv = dpt[n * 2 + v];
            let mut pv = Vector::<P, N2>::empty();
            let mut gv = Vector::<P, N2>::empty();
            #[unroll]
            for e in 0..2usize {
                let c = n * 8 + 2 * t + e;
                let mut seen = visible(args, col0 + c, row + 8 * v, causal, masked);
                if padded {
                    seen = seen && key_hidden[v] == f32::new(0.0);
                }
                let pe = select(
                    seen,
                    f32::exp(sv.extract(e) * args.scale - lse_sm[c]),
                    f32::new(0.0),
                );
                pv.insert(e, P::cast_from(pe));
                gv.insert(e, P::cast_from(pe * (dv.extract(e) - delta_sm[c])));
            }
            p[n * 2 + v] = pv;
            ds[n * 2 + v] = gv;
        }
    }
}

/// Writes the lane's accumulators as rows `first + g` and `first + g + 8` of `dst` (row `r` at
/// element `base + r · stride`, `dim` channels), those below `len`; row `g + 8v` times
/// `factor[v]`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn write_rows<P: Float, N2: Size>(
    acc: &Array<Vector<f32, N2>>,
    dst: &mut Tensor<P>,
    base: usize,
    stride: usize,
    first: usize,
    len: usize,
    factor: &Array<f32>,
    lane: usize,
    #[comptime] dim: usize,
) {
    let g = lane / 4;
    let t = lane % 4;
    #[unroll]
    for v in 0..2usize {
        let row = first + g + 8 * v;
        if row < len {
            let f = factor[v];
            #[unroll]
            for dn in 0..comptime!(dim / 8) {
                let x = acc[dn * 2 + v];
                #[unroll]
                for e in 0..2usize {
                    dst[base + row * stride + dn * 8 + 2 * t + e] = P::cast_from(x.extract(e) * f);
                }
            }
        }
    }
}

/// Zeros `acc` (`dim / 4` accumulator registers: `dim / 8` blocks of two rows).
#[cube]
pub fn zero<N2: Size>(acc: &mut Array<Vector<f32, N2>>, #[comptime] dim: usize) {
    #[unroll]
    for i in 0..comptime!(dim / 4) {
        acc[i] = Vector::<f32, N2>::new(f32::new(0.0));
    }
}

/// A tile of the forward walk (rows queries, columns keys `col0 ..`): folds the scores `s`
/// (replaced by the scaled, masked scores) into the running maxima `m` of the lane's two rows
/// and the lane's partial sums `l`, rescales `acc` by `exp(m_old − m_new)`, and leaves
/// `P = exp(scale · s − m_new)` as A-operand pairs in `p` (zero where a key is hidden; with
/// `padded` also where `hidden_sm`, from [`store_hidden`], marks the key). The
/// maxima are reduced over the 4 lanes that share a row; the sums stay per lane until the end.
/// A hidden score is `-1e30`, a finite "minus infinity": its probability is selected away, so
/// no infinity reaches the arithmetic.
#[cube]
// `acc[i] = acc[i] * scale` as run on the GPU (the `*=` form was not tested there).
#[allow(clippy::too_many_arguments, clippy::assign_op_pattern)]
pub fn online_softmax<P: Float, N2: Size>(
    s: &mut Array<Vector<f32, N2>>,
    p: &mut Array<Vector<P, N2>>,
    m: &mut Array<f32>,
    l: &mut Array<f32>,
    acc: &mut Array<Vector<f32, N2>>,
    hidden_sm: &Shared<[f32]>,
    args: &FlashArgs,
    row: usize,
    col0: usize,
    t: usize,
    #[comptime] dim: usize,
    #[comptime] causal: bool,
    #[comptime] masked: bool,
    #[comptime] padded: bool,
) {
    #[unroll]
    for v in 0..2usize {
        let query = row + 8 * v;
        let mut mx = m[v];
        #[unroll]
        for n in 0..comptime!(TILE / 8) {
            let sv = s[n * 2 + v];
            let mut x = Vector::<f32, N2>::empty();
            #[unroll]
            for e in 0..2usize {
                let c = n * 8 + 2 * t + e;
                let mut seen = visible(args, query, col0 + c, causal, masked);
                if padded {
                    seen = seen && hidden_sm[c] == f32::new(0.0);
                }
                let xe = select(seen, sv.extract(e) * args.scale, f32::new(-1.0e30));
                mx = f32::max(mx, xe);
                x.insert(e, xe);
            }
            s[n * 2 + v] = x;
        }
        mx = f32::max(mx, plane_shuffle_xor(mx, 1u32));
        mx = f32::max(mx, plane_shuffle_xor(mx, 2u32));
        let alpha = f32::exp(m[v] - mx);
        let mut sum = f32::new(0.0);
        #[unroll]
        for n in 0..comptime!(TILE / 8) {
            let x = s[n * 2 + v];
            let mut pv = Vector::<P, N2>::empty();
            #[unroll]
            for e in 0..2usize {
                let xe = x.extract(e);
                let pe = select(xe > f32::new(-1.0e30), f32::exp(xe - mx), f32::new(0.0));
                sum += pe;
                pv.insert(e, P::cast_from(pe));
            }
            p[n * 2 + v] = pv;
        }
        l[v] = l[v] * alpha + sum;
        m[v] = mx;
        let scale = Vector::<f32, N2>::new(alpha);
        #[unroll]
        for dn in 0..comptime!(dim / 8) {
            acc[dn * 2 + v] = acc[dn * 2 + v] * scale;
        }
    }
}

/// The running maxima and partial sums of the forward walk at their start.
#[cube]
pub fn softmax_start(m: &mut Array<f32>, l: &mut Array<f32>) {
    #[unroll]
    for v in 0..2usize {
        m[v] = f32::new(-1.0e30);
        l[v] = f32::new(0.0);
    }
}

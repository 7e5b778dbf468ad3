//! The online softmax of the Hopper kernel, on the lane's registers: the arithmetic of
//! `attn_mma`'s stages with fewer instructions a score, and a rescale written for a `P̃·V`
//! accumulator that is never reset.
//!
//! - Without `ΔS`, a score is kept as `s·k_scale`; the row's Q scale (times the softmax scale)
//!   is applied inside the exponent's argument, one fused multiply-add with `−m`, and to the
//!   tile's maximum once a row. With `ΔS` the score is `s·k_scale·q_scale + ΔS`, one multiply
//!   and one fused multiply-add.
//! - Where `P̃·V` is FP16 (`native`: `p_scale` is 1 and the conversion rounds `P̃`), `P̃` is the
//!   exponential itself, with no multiply.
//! - The output is `o + A`: `A` is the warpgroup accumulator every tile's `P̃·V` adds into, `o`
//!   f32 registers that start at zero. When a row's maximum moves and its values scale by
//!   `α`, the true output `o + A` must become `α·(o + A)`; `A` cannot be written, so `o`
//!   becomes `α·o + (α − 1)·A` (see [`rescale`]). A row whose maximum holds costs nothing.
//!
//! - With `poly` (opt-in for now, [`super::poly_exp`]) every logit, maximum and `τ` is in base 2
//!   (the Q scales and `ΔS` carry `log₂e`), and `exp` is
//!   [`exp2_poly`](super::super::fast_exp::exp2_poly) on the FMA pipe: nine instructions
//!   where libdevice's `expf`, which CubeCL's LLVM path calls, takes about eleven. The log-sum-exp is written in base e.
//!
//! Index `n·4 + v·2 + e` of a tile's scores is 8-key block `n`, row `v` of the lane's two, key
//! `2·(lane mod 4) + e` of the block (the accumulator's layout, as in `attn_mma`).

use cubecl::prelude::*;
use cubecl::wgmma::Accumulator;

use super::super::AttnArgs;
use super::super::attn_mma::BKV;
use super::super::fast_exp::exp2_poly;
use super::super::pv_grid::{RoundArgs, round_bits};

/// `e^x`, or `2^x` where `poly` (the arguments are then in base 2).
#[cube]
pub(super) fn exp_of(x: f32, #[comptime] poly: bool) -> f32 {
    if poly { exp2_poly(x) } else { f32::exp(x) }
}

/// The lane's scores of one tile from the S accumulator (see the module docs for what each
/// holds), masked where `masked` (past the keys' end, the causal diagonal, rows past the end),
/// and the lane's per-row maxima of them in `mx`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn scores(
    acc: &Accumulator<i32>,
    sf: &mut Array<f32>,
    mx: &mut Array<f32>,
    ks_sm: &Shared<[f32]>,
    ds_sm: &Shared<[f32]>,
    slot: usize,
    args: &AttnArgs,
    qsc: &Array<f32>,
    rows: &Array<usize>,
    own: &Array<bool>,
    kv0: usize,
    t: usize,
    #[comptime] masked: bool,
    #[comptime] causal: bool,
    #[comptime] has_ds: bool,
) {
    let offset = args.skv - args.sq;
    #[unroll]
    for v in 0..2usize {
        mx[v] = f32::new(-1.0e30);
    }
    #[unroll]
    for n in 0..comptime!(BKV / 8) {
        #[unroll]
        for e in 0..2usize {
            let col = n * 8 + 2 * t + e;
            let ksc = ks_sm[slot + col];
            let mut dsc = f32::new(0.0);
            if has_ds {
                dsc = ds_sm[slot + col];
            }
            #[unroll]
            for v in 0..2usize {
                // Accumulator element `4n + 2v + e`: block `n`, row `v`, key `e` of the pair.
                let mut x = f32::cast_from(acc.get(n * 4 + v * 2 + e)) * ksc;
                if has_ds {
                    x = x * qsc[v] + dsc;
                }
                if masked {
                    let key = kv0 + col;
                    let mut valid = own[v] && key < args.skv;
                    if causal {
                        valid = valid && key <= rows[v] + offset;
                    }
                    x = select(valid, x, f32::new(-1.0e30));
                }
                sf[n * 4 + v * 2 + e] = x;
                mx[v] = f32::max(mx[v], x);
            }
        }
    }
}

/// The running maxima: each row's tile maximum over the 4 lanes of its quad (in logits: times
/// the row's Q scale where the scores do not hold it); where it exceeds the running maximum by
/// more than `tau`, the maximum moves, the row's sum scales by `α = exp(m_old − m_new)` and the
/// row's output `o + A` by the same, through `o ← α·o + (α − 1)·A`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn rescale<N2: Size>(
    mx: &Array<f32>,
    m: &mut Array<f32>,
    l: &mut Array<f32>,
    o: &mut Array<Vector<f32, N2>>,
    acc: &Accumulator<f32>,
    qsc: &Array<f32>,
    tau: f32,
    #[comptime] has_ds: bool,
    #[comptime] dim: usize,
    #[comptime] poly: bool,
) {
    let mut alpha = Array::<f32>::new(2usize);
    let mut need = false;
    #[unroll]
    for v in 0..2usize {
        let mut tm = mx[v];
        if !has_ds {
            tm *= qsc[v];
        }
        tm = f32::max(tm, plane_shuffle_xor(tm, 1u32));
        tm = f32::max(tm, plane_shuffle_xor(tm, 2u32));
        let m_new = f32::max(m[v], tm);
        let mut a = f32::new(1.0);
        if m_new > m[v] + tau {
            a = exp_of(m[v] - m_new, poly);
            m[v] = m_new;
            need = true;
        }
        alpha[v] = a;
        l[v] *= a;
    }
    if need {
        #[unroll]
        for i in 0..comptime!(dim / 4) {
            // Pair `i` belongs to row `i mod 2`; where that row's α is 1 this leaves `o`.
            let a = alpha[i % 2];
            let x = output_pair::<N2>(acc, i);
            o[i] = o[i] * Vector::<f32, N2>::new(a) + x * Vector::<f32, N2>::new(a - 1.0);
        }
    }
}

/// Pair `i` of the lane's output values in the `P̃·V` accumulator (the layout of `o`: row
/// `i mod 2` of the lane's two, columns `8·(i / 2) + 2·(lane mod 4)` and `+1`).
#[cube]
pub(super) fn output_pair<N2: Size>(acc: &Accumulator<f32>, i: usize) -> Vector<f32, N2> {
    let mut x = Vector::<f32, N2>::empty();
    x.insert(0usize, acc.get(2 * i));
    x.insert(1usize, acc.get(2 * i + 1));
    x
}

/// `P̃ = exp(logit − m)·p_scale`, rounded to the PV grid unless `native`, as A-operand pairs
/// (index `n·2 + v`); adds the unrounded `exp(logit − m)` to the lane's row sums.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn probabilities<P: Float, N2: Size>(
    sf: &Array<f32>,
    p: &mut Array<Vector<P, N2>>,
    m: &Array<f32>,
    l: &mut Array<f32>,
    qsc: &Array<f32>,
    args: &AttnArgs,
    g: &RoundArgs,
    #[comptime] masked: bool,
    #[comptime] has_ds: bool,
    #[comptime] native: bool,
    #[comptime] poly: bool,
) {
    #[unroll]
    for v in 0..2usize {
        let neg_m = -m[v];
        let mut mul = f32::new(1.0);
        if !has_ds {
            mul = qsc[v];
        }
        let mut sum = f32::new(0.0);
        #[unroll]
        for n in 0..comptime!(BKV / 8) {
            let mut pv = Vector::<P, N2>::empty();
            #[unroll]
            for e in 0..2usize {
                let x = sf[n * 4 + v * 2 + e];
                // With ΔS the score is the logit (`mul` is 1 and left out).
                let mut pe = if has_ds {
                    exp_of(x + neg_m, poly)
                } else {
                    exp_of(x * mul + neg_m, poly)
                };
                if masked {
                    // Masked scores sit at -1e30: exp(0) when the whole row is masked so far.
                    pe = select(x > f32::new(-1.0e29), pe, f32::new(0.0));
                }
                sum += pe;
                if native {
                    pv.insert(e, P::cast_from(pe));
                } else {
                    pv.insert(e, P::cast_from(round_bits(pe * args.p_scale, g)));
                }
            }
            p[n * 2 + v] = pv;
        }
        l[v] += sum;
    }
}

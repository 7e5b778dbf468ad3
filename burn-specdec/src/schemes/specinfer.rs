//! SpecInfer (Miao et al., 2024): recursive rejection sampling over the drafts.
//!
//! Start with `p_1 = p`. Draft `k` is accepted with probability `min(1, p_k(x_k) / q_k(x_k))`;
//! on rejection `p_{k+1} = norm(max(p_k - q_k, 0))` and the next draft is tried. If every draft
//! is rejected the output is sampled from `p_{K+1}`.
//!
//! Exactness: by the single-draft argument, "accept `x_k ~ q_k` w.p. `min(1, p_k/q_k)`, else
//! sample `norm(max(p_k - q_k, 0))`" outputs `p_k`; replacing the fallback by the rest of the
//! chain, which outputs `p_{k+1}` by induction, keeps that. The `p_k` do not depend on the drafts,
//! so draft `k`'s test only reads `x_k` and the acceptance probability is
//! `1 - prod_k (1 - sum_x min(p_k(x), q_k(x)))`.

use super::SequentialPlan;
use crate::prob::{normalised_or, positive_part_diff, ratio_capped};

/// The chain `p_1 .. p_{K+1}` (`K + 1` rows).
pub(crate) fn residual_chain(p: &[f64], qs: &[Vec<f64>]) -> Vec<Vec<f64>> {
    let mut chain = Vec::with_capacity(qs.len() + 1);
    chain.push(p.to_vec());
    for q in qs {
        let pk = chain.last().expect("chain starts with p");
        // An empty residual means p_k = q_k: draft k is then never rejected, so the next stage is
        // unreachable and any row will do.
        let next = normalised_or(positive_part_diff(pk, q), pk);
        chain.push(next);
    }
    chain
}

pub(crate) fn plan(p: &[f64], qs: &[Vec<f64>]) -> SequentialPlan {
    let chain = residual_chain(p, qs);
    let mut accept = Vec::with_capacity(qs.len());
    let mut reject_all = 1.0;
    for (q, pk) in qs.iter().zip(&chain) {
        accept.push(
            pk.iter()
                .zip(q)
                .map(|(&a, &b)| ratio_capped(a, b))
                .collect(),
        );
        let stage: f64 = pk.iter().zip(q).map(|(a, b)| a.min(*b)).sum();
        reject_all *= (1.0 - stage).max(0.0);
    }
    SequentialPlan {
        accept,
        residual: chain.last().expect("K + 1 rows").clone(),
        acceptance: 1.0 - reject_all,
    }
}

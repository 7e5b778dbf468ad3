//! LP-optimal scheme: the acceptance-maximising coupling of [`crate::lp`], with the truncations
//! described there, and the importance-sampling plan whenever that accepts more (only possible
//! under truncation or solver round-off; configurable) or the LP is disabled.

use super::{CouplingPlan, Plan};
use crate::error::Result;
use crate::lp::{self, LpInfo, LpTruncation};

pub(crate) fn plan(p: &[f64], qs: &[Vec<f64>], trunc: LpTruncation) -> Result<(Plan, LpInfo)> {
    let fallback = super::importance::plan(p, qs);
    let flow = match lp::choose_alphabet(p, qs, trunc) {
        Some((alphabet, tail)) => Some(lp::solve(p, qs, alphabet, tail)?),
        None => None,
    };
    match flow {
        Some(flow)
            if !trunc.fallback_to_importance_sampling || flow.acceptance >= fallback.acceptance =>
        {
            let info = flow.info.clone();
            Ok((Plan::Coupling(CouplingPlan { flow }), info))
        }
        flow => {
            let mut info = flow.map_or_else(
                || LpInfo {
                    alphabet: Vec::new(),
                    tail_tokens: lp::acceptable_tokens(p, qs).len(),
                    sets: 0,
                    variables: 0,
                    lp_acceptance: 0.0,
                    fell_back_to_importance_sampling: true,
                },
                |f| f.info,
            );
            info.fell_back_to_importance_sampling = true;
            Ok((Plan::Selection(fallback), info))
        }
    }
}

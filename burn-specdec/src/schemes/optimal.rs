//! LP-optimal scheme: the acceptance-maximising coupling of [`crate::lp`], with the truncations
//! described there; under truncation (or solver round-off) the same flow read as weighted
//! importance sampling ([`super::weighted`]) or the sequential importance-sampling plan may
//! accept more, and the best of the three is used (configurable), as is the sequential plan
//! when the LP is disabled.

use super::weighted::WeightedPlan;
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
        Some(flow) if !trunc.fallback_to_importance_sampling => {
            let info = flow.info.clone();
            Ok((Plan::Coupling(CouplingPlan { flow }), info))
        }
        Some(flow) => {
            // The flow read two ways: the coupling (in-tail SD for the tail symbol) and the
            // weighted selection (SD against the selection's law); under truncation either can
            // accept more. The sequential IS plan competes with both.
            let weighted = WeightedPlan::from_flow(p, qs, &flow);
            let mut info = flow.info.clone();
            let best = flow
                .acceptance
                .max(weighted.acceptance)
                .max(fallback.acceptance);
            if best == flow.acceptance {
                Ok((Plan::Coupling(CouplingPlan { flow }), info))
            } else if best == weighted.acceptance {
                Ok((Plan::Weighted(weighted), info))
            } else {
                info.fell_back_to_importance_sampling = true;
                Ok((Plan::Selection(fallback), info))
            }
        }
        None => {
            let info = LpInfo::disabled(p, qs);
            Ok((Plan::Selection(fallback), info))
        }
    }
}

//! Single-draft speculative sampling (Leviathan et al., 2023; Chen et al., 2023).
//!
//! Accept the drafted `x ~ q` with probability `min(1, p(x)/q(x))`, otherwise sample
//! `norm(max(p - q, 0))`. The output law is `min(p, q) + (1 - sum min(p, q)) * norm(max(p - q, 0))
//! = p`, and the acceptance probability is `sum_x min(p(x), q(x)) = 1 - TV(p, q)`. This is SpecInfer
//! with one draft, so the plan is shared.

use super::SequentialPlan;
use crate::error::{Result, SpecDecError};

pub(crate) fn plan(p: &[f64], qs: &[Vec<f64>]) -> Result<SequentialPlan> {
    if qs.len() != 1 {
        return Err(SpecDecError::SingleDraftOnly { drafts: qs.len() });
    }
    Ok(super::specinfer::plan(p, qs))
}

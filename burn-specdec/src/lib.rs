//! # burn-specdec: multi-draft speculative sampling
//!
//! Host reference (plain Rust, `f64` math) of the token-level verification schemes of
//! *Multi-Draft Speculative Sampling: Canonical Architectures and Theoretical Limits* (Khisti et
//! al., arXiv 2410.18234) and its baselines. Given a target distribution `p` over a vocabulary of
//! size `V`, K draft distributions `q_1..q_K` (identical or not), the K drafted tokens
//! `x_k ~ q_k` (independent) and caller-supplied uniforms, a scheme outputs a token whose law is
//! exactly `p`, accepting one of the drafts as often as it can.
//!
//! | [`Scheme`] | rule | acceptance probability |
//! |---|---|---|
//! | [`Scheme::SingleDraft`] | K = 1: accept w.p. `min(1, p(x)/q(x))`, else `norm(max(p - q, 0))` | `sum min(p, q)` |
//! | [`Scheme::SpecInfer`] | recursive rejection: draft k against `p_k`, `p_{k+1} = norm(max(p_k - q_k, 0))` | `1 - prod_k (1 - sum min(p_k, q_k))` |
//! | [`Scheme::SpecTr`] | k-sequential selection with `min(1, p/(rho q_k))`, derived residual | `1 - prod_k (1 - beta_k(rho))` |
//! | [`Scheme::SequentialImportance`] | select a draft with importance weights (law `q~`), then SD against `q~` | `sum min(p, q~)` |
//! | [`Scheme::WeightedImportance`] | the paper's IS: select a drafted token with the LP's set-dependent weights (law `q~`), then SD against `q~` | `sum min(p, q~)` |
//! | [`Scheme::Optimal`] | max-flow LP coupling of drafted token sets and output, truncated with a lumped tail symbol | LP value (or IS's, if larger) |
//!
//! The derivations (SpecTr's residual, the IS weights, the LP and its truncations) are in the
//! docs of the [`schemes`] submodules and of [`lp`].
//!
//! ## API
//! A [`Verifier`] is the *plan* of a scheme for one `(p, q_1..q_K)` (residuals, acceptance
//! tables, LP solution): it depends only on the distributions, never on the drafted tokens.
//! [`Verifier::verify`] then decides one token from the drafted tokens and
//! [`uniforms_per_token`]`(K) = K + 2` uniforms. Probability rows may be `f32` or `f64` and only
//! need to be proportional to distributions (they are normalised in `f64`).
//!
//! ```
//! use burn_specdec::{Scheme, Verifier};
//!
//! let p = [0.5_f32, 0.3, 0.2];
//! let q = [0.2_f32, 0.2, 0.6];
//! let verifier = Verifier::new(Scheme::SequentialImportance, &p, &[q, q])?;
//! // Drafted tokens x_1 = 2, x_2 = 0 and K + 2 = 4 uniforms in [0, 1).
//! let outcome = verifier.verify(&[2, 0], &[0.9, 0.1, 0.3, 0.5])?;
//! assert!(outcome.token < 3);
//! assert!(verifier.acceptance_probability() > 0.0);
//! # Ok::<(), burn_specdec::SpecDecError>(())
//! ```
//!
//! ## Blocks of drafted tokens
//! [`verify_block`] applies a scheme along K drafted continuations of length L (SpecInfer/SpecTr
//! token-tree verification): at each position the drafts still consistent with the accepted
//! tokens compete, a rejected draft drops out, a residual token ends the block, and a bonus
//! token follows L accepted positions. The derivation is in [`block`]; the generation loop on a
//! real model is `burn_llama::spec` (the `burn-llama` library, `llama/`).
//!
//! ## On the device
//! [`device::verify_blocks`] verifies a whole batch of blocks in one CubeCL kernel where the
//! tensors live on a CubeCL device (CUDA, wgpu/Vulkan; the backend extension
//! [`device::SpecDecKernels`], fused or not), with the same uniforms as the host giving the same
//! tokens up to `f32` rounding at thresholds; [`Scheme::Optimal`] is host-only
//! ([`SpecDecError::UnsupportedOnDevice`]). It has no tensor-op fallback: on other devices
//! (Burn's `Flex` CPU backend, autodiff devices) it returns [`SpecDecError::NoDeviceKernel`]
//! and callers verify on the host.
//!
//! ## Randomness consumption
//! Every scheme consumes exactly `K + 2` uniforms `u[0..K+2]` in `[0, 1)` per token, so that a
//! batched device kernel (batch × draft length × (K + 2) uniforms) given the same uniforms makes
//! the same decisions:
//!
//! | uniform | single-draft SD, SpecInfer, SpecTr | sequential importance sampling | optimal (LP) | weighted IS (LP weights) |
//! |---|---|---|---|---|
//! | `u[k]`, `k < K` | accept draft k iff `u[k] < a_k(x_k)` | select draft k (`k < K-1`) iff `u[k] < s_k(x_k)`; `u[K-1]` unused | `u[0]`: in-tail SD test when the lumped tail symbol is chosen (truncated LPs only); others unused | `u[0]`: SD test of the selected token, `min(1, p(y)/q~(y))`; `u[1 + i]`: selection test of the `i`-th tail draft when the lumped tail symbol is selected (truncated LPs only); others unused |
//! | `u[K]` | unused | accept the selected `y` iff `u[K] < min(1, p(y)/q~(y))` | pick an accepted symbol or "reject" by inverse CDF of the conditional row of the drafted set | select a symbol of the drafted set by inverse CDF of its weights; if the tail rule declines every tail draft, the same `u[K]` rescaled to the tail symbol's interval selects an alphabet symbol |
//! | `u[K+1]` | residual sample by [`inverse_cdf`] | residual sample | residual (or in-tail residual) sample | residual sample |
//!
//! (A plan built with [`Scheme::Optimal`] may run the IS decision; see [`LpInfo`].) Decisions
//! compare in `f64`; a device kernel computing in `f32` agrees except when a uniform lands within
//! rounding distance of a threshold. [`Verifier::verify_with_rng`] draws the `K + 2` uniforms in
//! order from any [`rand::Rng`].
//!
//! The analytic acceptance probabilities are [`acceptance_probability`] (closed forms; the LP's
//! value for the optimal scheme) and [`acceptance_probability_enumerated`] (sum over all draft
//! tuples of the exact conditional acceptance, for small alphabets); [`optimal_acceptance_bound`]
//! is the theoretical optimum by max-flow/min-cut.
//!
//! ## Figure 2 of the paper
//! Alphabet `{1, 2, 3}`, `p` uniform, K = 2 identical drafts `q = [1/3, q2, 2/3 - q2]`; analytic
//! acceptance probabilities computed by this crate (`cargo run --release -p burn-specdec
//! --example figure2`; a test checks that this table matches the code). "Bound" is the min-cut
//! optimum, which for K = 2 identical drafts is the paper's closed form.
//!
//! | q2 | SpecInfer | SpecTr | IS | Optimal (LP) | Bound |
//! |---|---|---|---|---|---|
//! | 0.0000 | 0.6667 | 0.6667 | 0.6667 | 0.6667 | 0.6667 |
//! | 0.1000 | 0.7900 | 0.8102 | 0.8517 | 0.8567 | 0.8567 |
//! | 0.2000 | 0.8933 | 0.9224 | 1.0000 | 1.0000 | 1.0000 |
//! | 0.3000 | 0.9767 | 0.9926 | 1.0000 | 1.0000 | 1.0000 |
//! | 0.4000 | 0.9511 | 0.9753 | 1.0000 | 1.0000 | 1.0000 |
//! | 0.5000 | 0.8611 | 0.8889 | 0.9583 | 0.9722 | 0.9722 |
//! | 0.6000 | 0.7511 | 0.7656 | 0.7933 | 0.7956 | 0.7956 |
//! | 0.6667 | 0.6667 | 0.6667 | 0.6667 | 0.6667 | 0.6667 |
//!
//! The optimal scheme attains the bound, and importance sampling (no LP) lies between it and both
//! baselines: `tests/figure2.rs` asserts Optimal ≥ IS ≥ max(SpecTr, SpecInfer) on a 601-point
//! grid for this and the paper's second setting `q = [1/6, q2, 5/6 - q2]`, and that acceptance
//! is 1 exactly on `1 - sqrt(2/3) <= q2 <= sqrt(2/3) - 1/3` (by the min-cut bound, acceptance
//! is 1 iff `p(S) <= 1 - (1 - q(S))^2` for every set of tokens `S`).
//!
//! ## Exactness
//! Every scheme outputs exactly `p`; the tests check this by enumerating all draft tuples
//! ([`output_law_enumerated`]) and by χ² goodness-of-fit on 2·10⁵ samples per case. Residual rows
//! that have no mass are replaced by `p`; that only happens on branches of probability zero in
//! exact arithmetic (e.g. `q = p`).

mod analytic;
pub mod block;
pub mod device;
mod error;
mod lookup;
pub mod lp;
mod prob;
pub mod schemes;

pub use analytic::{
    ENUMERATION_LIMIT, Figure2Row, acceptance_probabilities, acceptance_probability,
    acceptance_probability_enumerated, figure2_markdown, figure2_row, optimal_acceptance_bound,
    output_law_enumerated,
};
pub use block::{BlockOutcome, verify_block};
pub use error::{DistributionId, Result, SpecDecError};
pub use lookup::PromptLookup;
pub use lp::{LpInfo, LpTruncation};
pub use prob::inverse_cdf;
pub use schemes::importance::RESERVE_ITERATIONS;

use rand::Rng;
use schemes::Plan;

/// A token-level verification scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// Single-draft speculative sampling; requires K = 1.
    SingleDraft,
    /// SpecInfer's recursive rejection sampling over the drafts (Miao et al., 2024).
    SpecInfer,
    /// SpecTr's k-sequential selection (Sun et al., 2023) with the optimal `rho` and the residual
    /// derived so that the output is exactly `p` (derivation in [`schemes::spectr`]). Different
    /// `q_k` use the natural generalisation (per-draft `min(1, p/(rho q_k))`).
    SpecTr,
    /// The paper's canonical two-step scheme (importance-weighted selection of one draft, then
    /// single-draft SD against the selection law `q~`) with closed-form sequential importance
    /// weights chosen per `(p, q_1..q_K)`, no LP; see [`schemes::importance`] for the weights
    /// and why the output is exactly `p`. Never accepts less than SpecInfer or SpecTr.
    SequentialImportance,
    /// The paper's weighted importance sampling: its canonical two-step scheme with the
    /// importance weights of the (truncated) LP of [`lp`] — select one drafted token with
    /// weights depending on the drafted set, then single-draft SD against the selection's exact
    /// law `q~` (see [`schemes::weighted`]). Exact for any truncation; without truncation it
    /// accepts as much as [`Scheme::Optimal`].
    WeightedImportance(LpTruncation),
    /// The acceptance-maximising coupling from the max-flow LP (see [`lp`]), truncated as
    /// configured; with [`LpTruncation::fallback_to_importance_sampling`] (the default) it never
    /// accepts less than [`Scheme::SequentialImportance`].
    Optimal(LpTruncation),
}

impl Scheme {
    /// [`Scheme::Optimal`] with [`LpTruncation::DEFAULT`].
    pub const OPTIMAL: Self = Self::Optimal(LpTruncation::DEFAULT);

    /// [`Scheme::WeightedImportance`] with [`LpTruncation::DEFAULT`].
    pub const WEIGHTED_IMPORTANCE: Self = Self::WeightedImportance(LpTruncation::DEFAULT);

    /// Short display name.
    pub fn name(&self) -> &'static str {
        match self {
            Self::SingleDraft => "single-draft SD",
            Self::SpecInfer => "SpecInfer",
            Self::SpecTr => "SpecTr",
            Self::SequentialImportance => "sequential IS",
            Self::WeightedImportance(_) => "weighted IS",
            Self::Optimal(_) => "Optimal",
        }
    }
}

/// Which importance weights the IS scheme selected for a given `(p, q_1..q_K)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SelectionRule {
    /// `s_k = min(1, p_k/q_k)` with SpecInfer's residual chain `p_k`.
    SpecInferChain,
    /// `s_k = min(1, p/(rho q_k))` with SpecTr's `rho`.
    SpecTrChain {
        /// SpecTr's `rho`.
        rho: f64,
    },
    /// Reserve-adjusted importance ratios after this many fixed-point rounds.
    Reserve {
        /// 1-based round.
        iteration: usize,
    },
}

/// Result of verifying one token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Outcome {
    /// Index `k` of the draft whose token was accepted, or `None` if the token came from a
    /// residual. A residual token can coincide with a drafted token (e.g. for SpecTr, IS and
    /// truncated LPs); it is still reported as `None`, matching the acceptance probabilities.
    pub accepted: Option<usize>,
    /// The output token, distributed exactly as `p`.
    pub token: usize,
}

/// Number of uniforms every scheme consumes per token with `num_drafts` drafts: `K + 2`.
///
/// Which uniform drives which decision is tabulated in the crate docs ("Randomness
/// consumption"); the count is the same for every scheme so that device buffers have a fixed
/// stride.
pub const fn uniforms_per_token(num_drafts: usize) -> usize {
    num_drafts + 2
}

/// A scheme prepared for one `(p, q_1..q_K)`.
#[derive(Clone, Debug)]
pub struct Verifier {
    scheme: Scheme,
    target: Vec<f64>,
    drafts: Vec<Vec<f64>>,
    plan: Plan,
    rho: Option<f64>,
    lp_info: Option<LpInfo>,
}

/// A scheme's plan, with SpecTr's `rho` and the LP's report where the scheme has them.
pub(crate) struct Planned {
    pub(crate) plan: Plan,
    pub(crate) rho: Option<f64>,
    pub(crate) lp_info: Option<LpInfo>,
}

/// Prepares `scheme` on inputs that [`prob::validate_inputs`] returned.
pub(crate) fn plan_scheme(scheme: Scheme, target: &[f64], drafts: &[Vec<f64>]) -> Result<Planned> {
    let mut rho = None;
    let mut lp_info = None;
    let plan = match scheme {
        Scheme::SingleDraft => Plan::Sequential(schemes::single::plan(target, drafts)?),
        Scheme::SpecInfer => Plan::Sequential(schemes::specinfer::plan(target, drafts)),
        Scheme::SpecTr => {
            let (plan, r) = schemes::spectr::plan(target, drafts);
            rho = Some(r);
            Plan::Sequential(plan)
        }
        Scheme::SequentialImportance => Plan::Selection(schemes::importance::plan(target, drafts)),
        Scheme::WeightedImportance(trunc) => {
            let (plan, info) = schemes::weighted::plan(target, drafts, trunc)?;
            lp_info = Some(info);
            plan
        }
        Scheme::Optimal(trunc) => {
            let (plan, info) = schemes::optimal::plan(target, drafts, trunc)?;
            lp_info = Some(info);
            plan
        }
    };
    Ok(Planned { plan, rho, lp_info })
}

impl Verifier {
    /// Validates and normalises `p` and `qs` (one row per draft) and prepares `scheme`.
    ///
    /// # Errors
    /// [`SpecDecError::NoDrafts`], [`SpecDecError::EmptyVocabulary`],
    /// [`SpecDecError::VocabularyMismatch`], [`SpecDecError::NonFinite`],
    /// [`SpecDecError::Negative`], [`SpecDecError::NotNormalisable`],
    /// [`SpecDecError::SingleDraftOnly`], and [`SpecDecError::Lp`] if the LP solver fails.
    pub fn new<T, Q>(scheme: Scheme, p: &[T], qs: &[Q]) -> Result<Self>
    where
        T: Copy + Into<f64>,
        Q: AsRef<[T]>,
    {
        let (target, drafts) = prob::validate_inputs(p, qs)?;
        let Planned { plan, rho, lp_info } = plan_scheme(scheme, &target, &drafts)?;
        Ok(Self {
            scheme,
            target,
            drafts,
            plan,
            rho,
            lp_info,
        })
    }

    /// The scheme this plan implements.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// Vocabulary size `V`.
    pub fn vocab_size(&self) -> usize {
        self.target.len()
    }

    /// Number of drafts `K`.
    pub fn num_drafts(&self) -> usize {
        self.drafts.len()
    }

    /// The normalised target distribution.
    pub fn target(&self) -> &[f64] {
        &self.target
    }

    /// The normalised draft distribution `q_k`.
    pub fn draft(&self, k: usize) -> Option<&[f64]> {
        self.drafts.get(k).map(Vec::as_slice)
    }

    /// Closed-form probability that a draft is accepted.
    pub fn acceptance_probability(&self) -> f64 {
        self.plan.acceptance()
    }

    /// SpecTr's `rho` (SpecTr plans only).
    pub fn spectr_rho(&self) -> Option<f64> {
        self.rho
    }

    /// The selection law `q~` of an importance-sampling plan, sequential or weighted (also for an
    /// optimal plan that uses one of them).
    pub fn selection_law(&self) -> Option<&[f64]> {
        match &self.plan {
            Plan::Selection(s) => Some(&s.proposal),
            Plan::Weighted(w) => Some(&w.proposal),
            _ => None,
        }
    }

    /// The importance weights chosen by an importance-sampling plan.
    pub fn selection_rule(&self) -> Option<SelectionRule> {
        match &self.plan {
            Plan::Selection(s) => Some(s.rule),
            _ => None,
        }
    }

    /// What the LP did (optimal plans only).
    pub fn lp_info(&self) -> Option<&LpInfo> {
        self.lp_info.as_ref()
    }

    /// Decides one token from the drafted tokens and `K + 2` uniforms (layout in the crate docs).
    ///
    /// # Errors
    /// [`SpecDecError::DraftCountMismatch`], [`SpecDecError::TokenOutOfRange`],
    /// [`SpecDecError::ZeroDraftProbability`], [`SpecDecError::UniformCount`],
    /// [`SpecDecError::UniformOutOfRange`].
    pub fn verify(&self, drafts: &[usize], uniforms: &[f64]) -> Result<Outcome> {
        prob::validate_drafts(&self.drafts, drafts)?;
        prob::validate_uniforms(uniforms, uniforms_per_token(self.num_drafts()))?;
        Ok(self.plan.decide(drafts, uniforms))
    }

    /// [`Verifier::verify`] with `K + 2` uniforms drawn in order from `rng`.
    ///
    /// # Errors
    /// As [`Verifier::verify`], except for the uniform errors.
    pub fn verify_with_rng<R: Rng + ?Sized>(
        &self,
        drafts: &[usize],
        rng: &mut R,
    ) -> Result<Outcome> {
        prob::validate_drafts(&self.drafts, drafts)?;
        let uniforms: Vec<f64> = (0..uniforms_per_token(self.num_drafts()))
            .map(|_| rng.random::<f64>())
            .collect();
        Ok(self.plan.decide(drafts, &uniforms))
    }

    /// Exact law of the output token given the drafted tuple (the uniforms marginalised out).
    ///
    /// # Errors
    /// The draft errors of [`Verifier::verify`].
    pub fn output_law_given_drafts(&self, drafts: &[usize]) -> Result<Vec<f64>> {
        prob::validate_drafts(&self.drafts, drafts)?;
        Ok(self.plan.law(drafts).0)
    }

    /// Exact probability that a draft is accepted given the drafted tuple.
    ///
    /// # Errors
    /// The draft errors of [`Verifier::verify`].
    pub fn acceptance_given_drafts(&self, drafts: &[usize]) -> Result<f64> {
        prob::validate_drafts(&self.drafts, drafts)?;
        Ok(self.plan.law(drafts).1)
    }
}

/// One-shot [`Verifier::new`] + [`Verifier::verify`]. Prefer a [`Verifier`] when the same
/// distributions verify many tokens (the optimal scheme solves an LP per plan).
///
/// # Errors
/// Those of [`Verifier::new`] and [`Verifier::verify`].
pub fn verify<T, Q>(
    scheme: Scheme,
    p: &[T],
    qs: &[Q],
    drafts: &[usize],
    uniforms: &[f64],
) -> Result<Outcome>
where
    T: Copy + Into<f64>,
    Q: AsRef<[T]>,
{
    Verifier::new(scheme, p, qs)?.verify(drafts, uniforms)
}

/// One-shot [`Verifier::new`] + [`Verifier::verify_with_rng`].
///
/// # Errors
/// Those of [`Verifier::new`] and [`Verifier::verify_with_rng`].
pub fn verify_with_rng<T, Q, R>(
    scheme: Scheme,
    p: &[T],
    qs: &[Q],
    drafts: &[usize],
    rng: &mut R,
) -> Result<Outcome>
where
    T: Copy + Into<f64>,
    Q: AsRef<[T]>,
    R: Rng + ?Sized,
{
    Verifier::new(scheme, p, qs)?.verify_with_rng(drafts, rng)
}

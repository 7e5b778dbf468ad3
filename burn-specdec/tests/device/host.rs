//! The host side of the comparison: the host's walk through a block with the same uniforms,
//! and a test-side copy of importance sampling's candidates to recognise f32 near-ties.

use super::*;

/// The host walk of [`verify_block`] with explicit uniforms (to draw them robustly); returns
/// the uniform tensor rows `[L + 1][K + 2]` (NaN where unused) and the outcome.
pub(super) fn host_walk(scheme: Scheme, seq: &Seq, rng: &mut StdRng) -> (Vec<f32>, BlockOutcome) {
    let k = seq.drafts.len();
    let l = seq.drafts[0].len();
    let stride = uniforms_per_token(k);
    let mut uniforms = vec![f32::NAN; (l + 1) * stride];
    let mut survivors: Vec<usize> = (0..k).collect();
    let mut tokens = Vec::new();
    for j in 0..l {
        let p = &seq.target[survivors[0]][j];
        let qs: Vec<&[f32]> = survivors
            .iter()
            .map(|&d| seq.draft[d][j].as_slice())
            .collect();
        let drafted: Vec<usize> = survivors.iter().map(|&d| seq.drafts[d][j]).collect();
        let verifier = Verifier::new(scheme, p, &qs).expect("valid rows");
        let decide = |us: &[f64]| verifier.verify(&drafted, us).expect("valid uniforms");
        let us = robust_uniforms(rng, uniforms_per_token(survivors.len()), decide);
        for (i, &u) in us.iter().enumerate() {
            uniforms[j * stride + i] = u as f32;
        }
        let outcome = decide(&us);
        tokens.push(outcome.token);
        if outcome.accepted.is_none() {
            return (
                uniforms,
                BlockOutcome {
                    tokens,
                    accepted: j,
                    survivors,
                },
            );
        }
        survivors.retain(|&d| seq.drafts[d][j] == outcome.token);
    }
    let p: Vec<f64> = seq.target[survivors[0]][l]
        .iter()
        .map(|&x| x as f64)
        .collect();
    let total: f64 = p.iter().sum();
    let p: Vec<f64> = p.iter().map(|x| x / total).collect();
    let us = robust_uniforms(rng, 1, |us: &[f64]| inverse_cdf(&p, us[0]));
    uniforms[l * stride] = us[0] as f32;
    tokens.push(inverse_cdf(&p, us[0]).expect("mass"));
    (
        uniforms,
        BlockOutcome {
            tokens,
            accepted: l,
            survivors,
        },
    )
}

pub(super) fn ratio_capped(num: f64, den: f64) -> f64 {
    if den > 0.0 { (num / den).min(1.0) } else { 0.0 }
}

pub(super) fn normalised_or(w: Vec<f64>, fallback: &[f64]) -> Vec<f64> {
    let total: f64 = w.iter().sum();
    if total > 0.0 && total.is_finite() {
        w.iter().map(|x| x / total).collect()
    } else {
        fallback.to_vec()
    }
}

/// Every candidate the host's importance-sampling plan compares, in its order (the plan keeps
/// the first strict maximum).
pub(super) fn is_candidates(p: &[f64], qs: &[Vec<f64>]) -> Vec<Candidate> {
    let mut out = Vec::new();
    for_each_candidate(p, qs, |c| out.push(c));
    out
}

/// The host's importance-sampling decision with candidate `c`: `(accepted draft, token)`.
pub(super) fn is_decide(
    p: &[f64],
    c: &Candidate,
    drafted: &[usize],
    us: &[f64],
) -> (Option<usize>, usize) {
    let k = drafted.len();
    let sel = (0..k - 1)
        .find(|&d| us[d] < c.select[d][drafted[d]])
        .unwrap_or(k - 1);
    let y = drafted[sel];
    if us[k] < ratio_capped(p[y], c.q_tilde[y]) {
        (Some(sel), y)
    } else {
        let residual = p
            .iter()
            .zip(&c.q_tilde)
            .map(|(a, b)| (a - b).max(0.0))
            .collect();
        let residual = normalised_or(residual, p);
        (None, inverse_cdf(&residual, us[k + 1]).unwrap_or(0))
    }
}

/// Whether the host reports a near-tie on this block: at an importance-sampling position up
/// to the first one where the device differs, another candidate of the host's plan accepts
/// within [`CANDIDATE_TIE`] of the chosen one and decides differently with the same uniforms.
/// The host's choice between them is then below f32 resolution. Other schemes have no plan
/// choice, so a difference there is never a near-tie.
pub(super) fn host_near_tie(
    scheme: Scheme,
    seq: &Seq,
    uniforms: &[f32],
    host: &BlockOutcome,
    device_tokens: &[i64],
) -> bool {
    if scheme != Scheme::SequentialImportance {
        return false;
    }
    let k = seq.drafts.len();
    let l = seq.drafts[0].len();
    let stride = uniforms_per_token(k);
    let first_diff = host
        .tokens
        .iter()
        .zip(device_tokens)
        .position(|(&h, &d)| h as i64 != d)
        .unwrap_or(host.accepted);
    let mut survivors: Vec<usize> = (0..k).collect();
    for j in 0..=first_diff.min(host.accepted) {
        if j >= l {
            break;
        }
        let qs: Vec<&[f32]> = survivors
            .iter()
            .map(|&d| seq.draft[d][j].as_slice())
            .collect();
        let drafted: Vec<usize> = survivors.iter().map(|&d| seq.drafts[d][j]).collect();
        let us: Vec<f64> = uniforms[j * stride..j * stride + uniforms_per_token(qs.len())]
            .iter()
            .map(|&u| u as f64)
            .collect();
        let verifier = Verifier::new(scheme, &seq.target[survivors[0]][j], &qs).expect("valid");
        let p = verifier.target();
        let qs: Vec<Vec<f64>> = (0..qs.len())
            .map(|d| verifier.draft(d).expect("draft").to_vec())
            .collect();
        let candidates = is_candidates(p, &qs);
        let best = candidates.iter().fold(&candidates[0], |b, c| {
            if c.acceptance > b.acceptance { c } else { b }
        });
        assert_eq!(
            Some(best.q_tilde.as_slice()),
            verifier.selection_law(),
            "the test's candidates reproduce the host's plan"
        );
        let chosen = is_decide(p, best, &drafted, &us);
        let tie = candidates.iter().any(|c| {
            c.acceptance >= best.acceptance * (1.0 - CANDIDATE_TIE)
                && is_decide(p, c, &drafted, &us) != chosen
        });
        if tie {
            return true;
        }
        if j < host.accepted {
            survivors.retain(|&d| seq.drafts[d][j] == host.tokens[j]);
        }
    }
    false
}

/// Sequences compared, and the ones that differed (with and without a host near-tie).
#[derive(Default)]
pub(super) struct Tally {
    pub(super) sequences: usize,
    pub(super) near_ties: Vec<String>,
    pub(super) mismatches: Vec<String>,
}

impl Tally {
    /// Every sequence agrees, except at most [`NEAR_TIES_PER_MILLE`] per 1000 where the host
    /// reports a near-tie.
    pub(super) fn assert_agreement(&self) {
        assert!(
            self.mismatches.is_empty(),
            "{} of {} sequences differ from the host without a near-tie:\n{}",
            self.mismatches.len(),
            self.sequences,
            self.mismatches.join("\n")
        );
        let allowed = (self.sequences * NEAR_TIES_PER_MILLE).div_ceil(1000);
        for tie in &self.near_ties {
            eprintln!("near-tie (host decision unstable under row rounding): {tie}");
        }
        assert!(
            self.near_ties.len() <= allowed,
            "{} of {} sequences differ at a host near-tie (at most {allowed} allowed):\n{}",
            self.near_ties.len(),
            self.sequences,
            self.near_ties.join("\n")
        );
    }
}

/// An RNG that yields the given uniforms (multiples of 2^-24) as `random::<f64>()` values.
pub(super) struct Scripted {
    pub(super) values: Vec<f64>,
    pub(super) next: usize,
}

impl RngCore for Scripted {
    fn next_u32(&mut self) -> u32 {
        unreachable!("verify_block draws f64 uniforms")
    }

    fn next_u64(&mut self) -> u64 {
        let u = self.values[self.next];
        self.next += 1;
        // `random::<f64>()` is `(x >> 11) * 2^-53`.
        ((u * GRID) as u64) << 40
    }

    fn fill_bytes(&mut self, _dst: &mut [u8]) {
        unreachable!("verify_block draws f64 uniforms")
    }
}

/// Draws a sequence and its uniforms, and checks the walk against the host's [`verify_block`].
pub(super) fn host_case(
    scheme: Scheme,
    v: usize,
    k: usize,
    l: usize,
    style: Style,
    rng: &mut StdRng,
) -> (Seq, Vec<f32>, BlockOutcome) {
    let seq = random_seq(rng, v, k, l, style);
    let (uniforms, outcome) = host_walk(scheme, &seq, rng);
    let values: Vec<f64> = uniforms
        .iter()
        .filter(|u| !u.is_nan())
        .map(|&u| u as f64)
        .collect();
    let count = values.len();
    let mut script = Scripted { values, next: 0 };
    let host = verify_block(
        scheme,
        &seq.drafts,
        |d, j| seq.target[d][j].clone(),
        |d, j| seq.draft[d][j].clone(),
        &mut script,
    )
    .expect("valid block");
    assert_eq!(host, outcome, "the walk reproduces verify_block");
    assert_eq!(script.next, count, "verify_block consumed every uniform");
    (seq, uniforms, outcome)
}

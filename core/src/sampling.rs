//! Next-token distributions and draws.

use rand::{Rng, SeedableRng, rngs::StdRng};

/// Turns one row of logits into a token. `distribution` exposes the probabilities the draw
/// follows, which speculative decoding needs for its acceptance tests.
pub trait Sampler: Send {
    /// The probabilities the next draw follows (sums to 1; one-hot for greedy).
    fn distribution(&self, logits: &[f32]) -> Vec<f32>;
    /// Draws a token.
    fn sample(&mut self, logits: &[f32]) -> u32;
}

/// Always the most likely token (the first one on ties).
#[derive(Debug, Clone, Copy, Default)]
pub struct Greedy;

fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best
}

impl Sampler for Greedy {
    fn distribution(&self, logits: &[f32]) -> Vec<f32> {
        let mut p = vec![0.0; logits.len()];
        p[argmax(logits)] = 1.0;
        p
    }

    fn sample(&mut self, logits: &[f32]) -> u32 {
        argmax(logits) as u32
    }
}

/// Settings of [`TopKTopP`] / [`SamplingConfig::build`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingConfig {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub seed: u64,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }
}

impl SamplingConfig {
    pub fn build(self) -> Box<dyn Sampler> {
        if self.temperature <= 0.0 {
            Box::new(Greedy)
        } else {
            Box::new(TopKTopP::new(self))
        }
    }
}

/// Temperature, then top-k, then nucleus (top-p) filtering; seeded.
#[derive(Debug, Clone)]
pub struct TopKTopP {
    cfg: SamplingConfig,
    rng: StdRng,
}

impl TopKTopP {
    pub fn new(cfg: SamplingConfig) -> Self {
        Self {
            cfg,
            rng: StdRng::seed_from_u64(cfg.seed),
        }
    }
}

impl Sampler for TopKTopP {
    fn distribution(&self, logits: &[f32]) -> Vec<f32> {
        let t = self.cfg.temperature.max(1e-6);
        if self.cfg.top_k.is_none() && self.cfg.top_p.is_none() {
            // Plain softmax: no ordering needed (the sort costs milliseconds per 49K-entry row).
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let weights: Vec<f64> = logits
                .iter()
                .map(|&l| (((l - max) / t) as f64).exp())
                .collect();
            let total: f64 = weights.iter().sum();
            return weights.iter().map(|w| (w / total) as f32).collect();
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let keep_k = self
            .cfg
            .top_k
            .unwrap_or(logits.len())
            .clamp(1, logits.len());
        let max = logits[order[0]];
        let weights: Vec<f64> = order[..keep_k]
            .iter()
            .map(|&i| (((logits[i] - max) / t) as f64).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        // Nucleus: the smallest prefix (by probability) whose mass reaches top_p.
        let mut keep = keep_k;
        if let Some(p) = self.cfg.top_p {
            let mut acc = 0.0;
            for (n, w) in weights.iter().enumerate() {
                acc += w / total;
                if acc >= p as f64 {
                    keep = n + 1;
                    break;
                }
            }
        }
        let kept: f64 = weights[..keep].iter().sum();
        let mut probs = vec![0.0f32; logits.len()];
        for (n, &i) in order[..keep].iter().enumerate() {
            probs[i] = (weights[n] / kept) as f32;
        }
        probs
    }

    fn sample(&mut self, logits: &[f32]) -> u32 {
        let probs = self.distribution(logits);
        let u: f32 = self.rng.random();
        let mut acc = 0.0;
        let mut last = 0;
        for (i, &p) in probs.iter().enumerate() {
            if p > 0.0 {
                acc += p;
                last = i;
                if u < acc {
                    return i as u32;
                }
            }
        }
        last as u32
    }
}

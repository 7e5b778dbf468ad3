//! The attention implementations of the CLI (`--attention`), by name, including the
//! SageAttention2 variants of `burn-sage`, and the capture of every layer's Q/K/V that
//! adaptive Sage calibrates on; and the attention of a training step ([`TrainAttention`],
//! `finetune --attention`).
//!
//! | name | Q·Kᵀ | P̃·V |
//! |---|---|---|
//! | `reference` | f32 tensor ops | f32 |
//! | `burn-fused` | Burn's attention op | |
//! | `decode` | split-K decode kernel (burn-kvcache) for ≤ 16 queries, else Burn's op | f32 |
//! | `sage` | INT8, one scale per 32 queries / 64 keys, K smoothed | FP16 |
//! | `sage-fp8` | as `sage` | FP8 E4M3, per-channel V scale |
//! | `sage-int4` | INT4 per thread, Q and K smoothed | FP16 |
//! | `sage-int4-fp8` | as `sage-int4` | FP8 E4M3 |
//! | `sage-adaptive` | INT4 or INT8 per thread, chosen per layer on a calibration pass | FP16 |
//! | `sage-adaptive-fp8` | as `sage-adaptive` | FP8 E4M3 |

use burn::tensor::{Int, Tensor, TensorData};
use burn_kernels_core::{
    AttentionImpl, AttentionKind, BurnAttention, FullKvCache, RecomputeAttention,
    ReferenceAttention,
};

use crate::precision::Precision;
use burn_kvcache::DecodeAttention;
use burn_sage::adaptive::{CaptureAttention, Captured, LayerReport, choose_layer};
use burn_sage::{PvPrecision, QkQuant, SageAttention, SageError, SageOptions};

use crate::model::Llama;

/// A built attention implementation and, for adaptive Sage, its per-layer calibration reports.
pub type BuiltAttention = (Box<dyn AttentionImpl>, Vec<LayerReport>);

/// Which quantization of `Q·Kᵀ` a Sage variant uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SageQk {
    /// INT8 per thread (the mma fragment's granularity: one scale per query row pair and per
    /// 8 keys of a 64-key block), Q and K smoothed: the finest INT8 variant, the one that meets
    /// the accuracy bar on every SmolLM2 layer, at the speed of the coarser ones on the GPU.
    Int8,
    /// INT4 per thread, Q and K smoothed.
    Int4,
    /// INT4 or INT8 per thread (Q and K smoothed), chosen per layer by
    /// [`burn_sage::adaptive`] on the captured Q/K/V of a calibration pass.
    Adaptive,
}

/// An attention implementation of the CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionChoice {
    Builtin(AttentionKind),
    /// [`burn_kvcache::DecodeAttention`].
    Decode,
    Sage {
        qk: SageQk,
        pv: PvPrecision,
    },
}

/// The attention implementations by their CLI names (`--attention`), one variant each; the
/// names and help the CLI shows come from this enum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AttentionName {
    /// Exact attention in f32 tensor ops.
    Reference,
    /// Burn's attention op (its fused kernel where the backend has one).
    #[value(alias = "burn")]
    BurnFused,
    /// burn-kvcache's split-K decode kernel for up to 16 queries, Burn's op otherwise.
    Decode,
    /// SageAttention2: INT8 Q·Kᵀ per thread, Q and K smoothed, FP16 P̃·V.
    Sage,
    /// As `sage` with FP8 E4M3 P̃·V (per-channel V scale).
    SageFp8,
    /// INT4 Q·Kᵀ per thread, Q and K smoothed, FP16 P̃·V.
    SageInt4,
    /// As `sage-int4` with FP8 E4M3 P̃·V.
    SageInt4Fp8,
    /// INT4 or INT8 per layer, chosen on a calibration pass over the prompt or text; FP16 P̃·V.
    SageAdaptive,
    /// As `sage-adaptive` with FP8 E4M3 P̃·V.
    SageAdaptiveFp8,
}

impl From<AttentionName> for AttentionChoice {
    fn from(name: AttentionName) -> Self {
        use AttentionName as N;
        let sage = |qk, pv| AttentionChoice::Sage { qk, pv };
        match name {
            N::Reference => Self::Builtin(AttentionKind::Reference),
            N::BurnFused => Self::Builtin(AttentionKind::BurnFused),
            N::Decode => Self::Decode,
            N::Sage => sage(SageQk::Int8, PvPrecision::Fp16),
            N::SageFp8 => sage(SageQk::Int8, PvPrecision::Fp8E4m3),
            N::SageInt4 => sage(SageQk::Int4, PvPrecision::Fp16),
            N::SageInt4Fp8 => sage(SageQk::Int4, PvPrecision::Fp8E4m3),
            N::SageAdaptive => sage(SageQk::Adaptive, PvPrecision::Fp16),
            N::SageAdaptiveFp8 => sage(SageQk::Adaptive, PvPrecision::Fp8E4m3),
        }
    }
}

impl AttentionChoice {
    /// The CLI names, comma-separated.
    pub fn names() -> String {
        crate::names::value_names::<AttentionName>()
    }

    /// The implementation a CLI name stands for (`burn` is accepted for `burn-fused`).
    pub fn parse(s: &str) -> Option<Self> {
        <AttentionName as clap::ValueEnum>::from_str(s, false)
            .ok()
            .map(Self::from)
    }

    /// The Sage options of a Sage variant (for `Adaptive`, the base options the per-layer
    /// choice is made under). `causal` and `scale` come from each call.
    pub fn sage_options(&self) -> Option<SageOptions> {
        let Self::Sage { qk, pv } = *self else {
            return None;
        };
        let (qk, smooth_q) = match qk {
            SageQk::Int8 => (QkQuant::Int8PerThread, true),
            SageQk::Int4 => (QkQuant::Int4PerThread, true),
            SageQk::Adaptive => (QkQuant::Int8PerThread, true),
        };
        Some(SageOptions {
            qk,
            pv,
            smooth_q,
            ..SageOptions::default()
        })
    }

    /// Whether [`AttentionChoice::build`] needs calibration tokens.
    pub fn is_adaptive(&self) -> bool {
        matches!(
            self,
            Self::Sage {
                qk: SageQk::Adaptive,
                ..
            }
        )
    }

    /// The implementation. Adaptive Sage first runs `calibration`'s model over its tokens with
    /// the reference attention, then keeps INT4 in the layers where its score
    /// `cos_sim · (1 − rel_l1)` against exact attention reaches `int4_threshold`; the
    /// per-layer reports come back with it (empty for the other choices).
    ///
    /// # Errors
    /// [`AttentionError::NeedsCalibration`] for adaptive Sage without calibration tokens; a
    /// [`SageError`] from the calibration.
    pub fn build(
        &self,
        calibration: Option<(&Llama, &[u32])>,
        int4_threshold: f64,
    ) -> Result<BuiltAttention, AttentionError> {
        let opts = match (self, self.sage_options()) {
            (Self::Builtin(kind), _) => return Ok((kind.build(), Vec::new())),
            (Self::Decode, _) => return Ok((Box::new(DecodeAttention::default()), Vec::new())),
            (_, Some(opts)) => opts,
            (Self::Sage { .. }, None) => unreachable!("a Sage choice has Sage options"),
        };
        if !self.is_adaptive() {
            return Ok((Box::new(SageAttention::new(opts)), Vec::new()));
        }
        let (model, tokens) = calibration.ok_or(AttentionError::NeedsCalibration)?;
        let reports = calibrate(model, tokens, &opts, int4_threshold)?;
        let per_layer = reports.iter().map(|r| r.choice).collect();
        Ok((
            Box::new(SageAttention::with_layers(opts, per_layer)),
            reports,
        ))
    }
}

/// Why an attention choice could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AttentionError {
    /// Adaptive Sage chooses per layer from a calibration pass over some tokens.
    #[error("adaptive Sage attention needs calibration tokens")]
    NeedsCalibration,
    #[error(transparent)]
    Sage(#[from] SageError),
    /// The calibration pass saw no attention call of some layer.
    #[error("the calibration pass did not reach layer {0}")]
    LayerNotCaptured(usize),
}

/// Q, K, V (after RoPE) and the causal flag of the first attention call of every layer when
/// `model` runs `tokens` (one sequence, empty cache) with the reference attention.
///
/// # Errors
/// [`AttentionError::LayerNotCaptured`] if some layer was never called.
pub fn capture_qkv(model: &Llama, tokens: &[u32]) -> Result<Vec<Captured>, AttentionError> {
    let device = model.embed.device();
    let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, tokens.len()]), &device);
    let capture = CaptureAttention::new(Box::new(ReferenceAttention));
    let mut cache = FullKvCache::new(model.config.num_layers);
    drop(model.forward(input, &[], &mut cache, &capture));
    let captured = capture.take();
    (0..model.config.num_layers)
        .map(|layer| {
            captured
                .get(layer)
                .cloned()
                .flatten()
                .ok_or(AttentionError::LayerNotCaptured(layer))
        })
        .collect()
}

/// Adaptive Sage's per-layer INT4/INT8 choice on the Q/K/V `model` produces for `tokens`
/// ([`burn_sage::adaptive::choose_layer`] with `base`, each layer's causal flag and the
/// model's `1/√head_dim`).
///
/// # Errors
/// As [`capture_qkv`] and [`choose_layer`].
pub fn calibrate(
    model: &Llama,
    tokens: &[u32],
    base: &SageOptions,
    int4_threshold: f64,
) -> Result<Vec<LayerReport>, AttentionError> {
    capture_qkv(model, tokens)?
        .into_iter()
        .enumerate()
        .map(|(layer, (q, k, v, causal))| {
            let opts = SageOptions { causal, ..*base };
            Ok(choose_layer(layer, q, k, v, &opts, int4_threshold)?)
        })
        .collect()
}

/// The fixed (non-adaptive) Sage variants of the CLI, in the order the tables list them.
pub const SAGE_VARIANTS: [&str; 4] = ["sage", "sage-fp8", "sage-int4", "sage-int4-fp8"];

/// The options of a fixed Sage variant of [`SAGE_VARIANTS`] by name.
///
/// # Panics
/// If `name` is not a fixed Sage variant.
pub fn sage_variant(name: &str) -> SageOptions {
    AttentionChoice::parse(name)
        .filter(|c| !c.is_adaptive())
        .and_then(|c| c.sage_options())
        .unwrap_or_else(|| panic!("`{name}` is not a fixed Sage variant"))
}

/// The attention of a training step (`finetune --attention`).
///
/// Measured on an H200 (SmolLM2-135M shape, batch 8 × 1024, CCE): in f32 (2026-11-28,
/// `bench/results/2026-11-28/nvidia-h200-s32-e2e-train.md`) `recompute` takes 396 ms and
/// 15.0 GB a step, `reference` 488 ms and 43.0 GB, `fused` 1485 ms and 14.1 GB (cubek's f32
/// attention backward); at 2048 tokens only `recompute` fits among the f32 ones (1077 ms,
/// 31 GB). In bf16 (2026-11-29, `bench/results/2026-11-29/nvidia-h200-s34-e2e-train.md`)
/// `recompute` (core's flash backward kernels) takes 197 ms, `fused` 283 ms, both 10.8 GB.
/// [`TrainAttention::for_precision`] picks the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TrainAttention {
    /// Burn's attention op: on a CubeCL device its fused kernels, whose backward recomputes the
    /// probabilities from each query's saved log-sum-exp (saved state O(batch · heads · seq)
    /// instead of the scores; slower than `reference` in f32 on an H200). The decomposed
    /// attention where Burn has no fused backward (the CPU, key-padding masks).
    Fused,
    /// The decomposed f32 attention, which saves the `batch · heads · seq²` scores and
    /// probabilities for the backward.
    #[default]
    Reference,
    /// On a CubeCL device: a fused forward (saves the output and one log-sum-exp per query,
    /// as `fused`) and a backward that recomputes each layer's probabilities: Burn's forward
    /// and composed backward with TF32 matmuls in f32; in f16/bf16 core's FlashAttention-2
    /// style forward and backward kernels on CUDA at head dim 64, else Burn's fused ones
    /// ([`burn_kernels_core::recompute_attention`]). On CUDA in f16/bf16 the layer's RMSNorm,
    /// SwiGLU gate and RoPE run core's differentiable kernels too
    /// ([`burn_kernels_core::TrainOps`]). `fused` elsewhere.
    Recompute,
}

impl TrainAttention {
    /// The default for `precision`: [`TrainAttention::Recompute`] (in bf16 the flash backward
    /// kernels where they apply and Burn's fused backward elsewhere, so never slower than
    /// `fused`; in f32 cubek's attention backward is slow and the decomposed attention keeps
    /// every layer's scores).
    pub fn for_precision(_precision: Precision) -> Self {
        TrainAttention::Recompute
    }

    /// The implementation.
    pub fn build(self) -> Box<dyn AttentionImpl> {
        match self {
            TrainAttention::Fused => Box::new(BurnAttention),
            TrainAttention::Reference => Box::new(ReferenceAttention),
            TrainAttention::Recompute => Box::new(RecomputeAttention),
        }
    }
}

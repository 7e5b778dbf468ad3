//! Adaptive precision (the paper's adaptive quantization): per layer, measure the INT4 and
//! INT8 outputs against exact attention on a calibration batch and keep INT4 only where its
//! accuracy score `cos_sim · (1 − rel_l1)` reaches a threshold.

use std::sync::Mutex;

use burn::tensor::{DType, Tensor};
use burn_kernels_core::attention::{AttentionImpl, AttnOptions};

use crate::{Accuracy, QkQuant, SageError, SageOptions, reference, sage_attention};

/// Default score INT4 must reach to be kept for a layer.
pub const DEFAULT_INT4_THRESHOLD: f64 = 0.99;

/// What calibration measured for one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerReport {
    pub layer: usize,
    pub int4: Accuracy,
    pub int8: Accuracy,
    pub choice: QkQuant,
}

fn values(x: Tensor<4>) -> Vec<f32> {
    x.cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 data")
}

/// Accuracy of Sage attention under each of `variants` against exact f32 attention of the same
/// `q`, `k`, `v` (computed once, on their device). Every variant runs with `causal` and `scale` (`None`:
/// `1/√head_dim`) in place of its own.
///
/// # Shapes
/// As [`sage_attention`]: `q` `[batch, q_heads, q_len, head_dim]`, `k`, `v`
/// `[batch, kv_heads, kv_len, head_dim]`.
///
/// # Errors
/// The input errors of [`sage_attention`].
pub fn accuracies(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    causal: bool,
    scale: Option<f32>,
    variants: &[SageOptions],
) -> Result<Vec<Accuracy>, SageError> {
    crate::plan(
        &q.dims(),
        &k.dims(),
        &v.dims(),
        [q.dtype(), k.dtype(), v.dtype()],
        &SageOptions {
            causal,
            scale,
            ..SageOptions::default()
        },
    )?;
    let scale = scale.unwrap_or(1.0 / (q.dims()[3] as f32).sqrt());
    let (exact, _) = reference::exact_attention(q.clone(), k.clone(), v.clone(), causal, scale);
    let exact = values(exact);
    variants
        .iter()
        .map(|variant| {
            let opts = SageOptions {
                causal,
                scale: Some(scale),
                ..*variant
            };
            let out = sage_attention(q.clone(), k.clone(), v.clone(), &opts)?.out;
            Ok(Accuracy::of(&values(out), &exact))
        })
        .collect()
}

/// Measures INT4 (per-thread) and INT8 (per-thread) against exact attention on one layer's
/// `q`, `k`, `v` and picks INT4 when its score reaches `threshold`.
pub fn choose_layer(
    layer: usize,
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    base: &SageOptions,
    threshold: f64,
) -> Result<LayerReport, SageError> {
    let with = |qk| SageOptions { qk, ..*base };
    let acc = accuracies(
        q,
        k,
        v,
        base.causal,
        base.scale,
        &[with(QkQuant::Int4PerThread), with(QkQuant::Int8PerThread)],
    )?;
    let (int4, int8) = (acc[0], acc[1]);
    let choice = if int4.score() >= threshold {
        QkQuant::Int4PerThread
    } else {
        QkQuant::Int8PerThread
    };
    Ok(LayerReport {
        layer,
        int4,
        int8,
        choice,
    })
}

/// One choice per layer from captured `(q, k, v)` (e.g. by [`CaptureAttention`]).
pub fn calibrate(
    captures: Vec<(Tensor<4>, Tensor<4>, Tensor<4>)>,
    base: &SageOptions,
    threshold: f64,
) -> Result<Vec<LayerReport>, SageError> {
    captures
        .into_iter()
        .enumerate()
        .map(|(layer, (q, k, v))| choose_layer(layer, q, k, v, base, threshold))
        .collect()
}

/// Q/K/V of one call with its causal flag.
pub type Captured = (Tensor<4>, Tensor<4>, Tensor<4>, bool);

/// An attention implementation that records the first call of every layer (its Q, K, V) and
/// forwards to `inner`: run the model once on a calibration batch, then [`calibrate`].
#[derive(Debug)]
pub struct CaptureAttention {
    pub inner: Box<dyn AttentionImpl>,
    captured: Mutex<Vec<Option<Captured>>>,
}

impl CaptureAttention {
    pub fn new(inner: Box<dyn AttentionImpl>) -> Self {
        Self {
            inner,
            captured: Mutex::new(Vec::new()),
        }
    }

    /// The captured calls, by layer (`None` for a layer never called).
    pub fn take(&self) -> Vec<Option<Captured>> {
        std::mem::take(&mut *self.captured.lock().expect("not poisoned"))
    }
}

impl AttentionImpl for CaptureAttention {
    fn name(&self) -> String {
        format!("capture({})", self.inner.name())
    }

    fn attend(
        &self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
    ) -> Tensor<4> {
        {
            let mut cap = self.captured.lock().expect("not poisoned");
            if cap.len() <= layer {
                cap.resize(layer + 1, None);
            }
            if cap[layer].is_none() {
                cap[layer] = Some((q.clone(), k.clone(), v.clone(), opts.causal));
            }
        }
        self.inner.attend(layer, q, k, v, opts)
    }
}

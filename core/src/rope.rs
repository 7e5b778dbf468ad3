//! Rotary position embeddings, HF "rotate-half" layout, with Llama-3 frequency scaling.

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};

/// Llama-3 frequency scaling parameters (HF `rope_scaling` with `rope_type = "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// Precomputed cos/sin tables for positions `0..max_positions` (constant tensors: a module
/// with no parameters, so a model can hold it).
#[derive(Module, Debug)]
pub struct Rope {
    cos: Tensor<2>,
    sin: Tensor<2>,
    head_dim: usize,
}

/// The inverse frequencies `θ^(−2i/d)`, scaled as Llama-3 does when `scaling` is given.
pub fn inverse_frequencies(head_dim: usize, theta: f32, scaling: Option<RopeScaling>) -> Vec<f64> {
    let half = head_dim / 2;
    (0..half)
        .map(|i| {
            let f = (theta as f64).powf(-((2 * i) as f64) / head_dim as f64);
            let Some(s) = scaling else { return f };
            let old = s.original_max_position_embeddings as f64;
            let low_wavelen = old / s.low_freq_factor as f64;
            let high_wavelen = old / s.high_freq_factor as f64;
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / s.factor as f64
            } else {
                let smooth = (old / wavelen - s.low_freq_factor as f64)
                    / (s.high_freq_factor as f64 - s.low_freq_factor as f64);
                (1.0 - smooth) * f / s.factor as f64 + smooth * f
            }
        })
        .collect()
}

/// The cos and sin of the angles `p · f` for positions `p < positions` and the
/// [`inverse_frequencies`] `f`, computed in f64 and rounded to f32: the values of the
/// `[positions, head_dim / 2]` tables (row-major).
pub fn rope_angles(
    head_dim: usize,
    positions: usize,
    theta: f32,
    scaling: Option<RopeScaling>,
) -> (Vec<f32>, Vec<f32>) {
    let inv = inverse_frequencies(head_dim, theta, scaling);
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(positions * half);
    let mut sin = Vec::with_capacity(positions * half);
    for p in 0..positions {
        for &f in &inv {
            let a = p as f64 * f;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    (cos, sin)
}

impl Rope {
    /// Tables for `head_dim` (even) and positions `0..max_positions`.
    pub fn new(
        head_dim: usize,
        max_positions: usize,
        theta: f32,
        scaling: Option<RopeScaling>,
        device: &Device,
    ) -> Self {
        assert!(
            head_dim.is_multiple_of(2),
            "RoPE needs an even head_dim, got {head_dim}"
        );
        let (cos, sin) = rope_angles(head_dim, max_positions, theta, scaling);
        let shape = [max_positions, head_dim / 2];
        Self {
            cos: Tensor::from_data(TensorData::new(cos, shape), device),
            sin: Tensor::from_data(TensorData::new(sin, shape), device),
            head_dim,
        }
    }

    /// The `[max_positions, head_dim / 2]` cos and sin tables (f32).
    pub fn tables(&self) -> (&Tensor<2>, &Tensor<2>) {
        (&self.cos, &self.sin)
    }

    /// Positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Rotates `x` by the angles of `positions`.
    ///
    /// # Shapes
    /// - `x`: `[batch, heads, seq, head_dim]`
    /// - `positions`: `[batch, seq]`, each `< max_positions()`
    pub fn apply(&self, x: Tensor<4>, positions: Tensor<2, Int>) -> Tensor<4> {
        let [b, h, s, d] = x.dims();
        debug_assert_eq!(d, self.head_dim);
        let half = d / 2;
        let idx = positions.reshape([b * s]);
        let dtype = x.dtype();
        let gather = |t: &Tensor<2>| {
            t.clone()
                .select(0, idx.clone())
                .reshape([b, 1, s, half])
                .cast(dtype)
        };
        let (cos, sin) = (gather(&self.cos), gather(&self.sin));
        let x1 = x.clone().slice([0..b, 0..h, 0..s, 0..half]);
        let x2 = x.slice([0..b, 0..h, 0..s, half..d]);
        Tensor::cat(
            vec![
                x1.clone() * cos.clone() - x2.clone() * sin.clone(),
                x2 * cos + x1 * sin,
            ],
            3,
        )
    }
}

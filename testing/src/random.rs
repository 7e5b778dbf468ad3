//! Seeded random inputs. Tests draw fresh values per case from a seed, never zeros.

use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData};
use rand::{Rng, SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, Normal, Uniform};

/// A value distribution for test inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Dist {
    /// Uniform on `[lo, hi)`.
    Uniform { lo: f32, hi: f32 },
    /// Normal with the given mean and standard deviation.
    Normal { mean: f32, std: f32 },
    /// LLM-activation-like: normal(0, `std`) with a fraction `spike_prob` of entries multiplied
    /// by `spike_scale` (outlier channels / peaky logits, which break naive quantization and
    /// make softmax near one-hot).
    Peaky {
        std: f32,
        spike_prob: f32,
        spike_scale: f32,
    },
}

impl Dist {
    /// Standard normal.
    pub const STANDARD: Dist = Dist::Normal {
        mean: 0.0,
        std: 1.0,
    };
    /// Peaky default: 1% of entries 20x larger.
    pub const PEAKY: Dist = Dist::Peaky {
        std: 1.0,
        spike_prob: 0.01,
        spike_scale: 20.0,
    };
}

/// `n` values drawn from `dist` with the given seed.
pub fn random_values(n: usize, dist: Dist, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    match dist {
        Dist::Uniform { lo, hi } => {
            let u = Uniform::new(lo, hi).expect("lo < hi");
            (0..n).map(|_| u.sample(&mut rng)).collect()
        }
        Dist::Normal { mean, std } => {
            let d = Normal::new(mean, std).expect("std >= 0");
            (0..n).map(|_| d.sample(&mut rng)).collect()
        }
        Dist::Peaky {
            std,
            spike_prob,
            spike_scale,
        } => {
            let d = Normal::new(0.0, std).expect("std >= 0");
            (0..n)
                .map(|_| {
                    let v: f32 = d.sample(&mut rng);
                    if rng.random::<f32>() < spike_prob {
                        v * spike_scale
                    } else {
                        v
                    }
                })
                .collect()
        }
    }
}

/// A float tensor of `shape` drawn from `dist` with `seed`, stored as `dtype` on `device`.
pub fn random_tensor<const D: usize>(
    shape: [usize; D],
    dist: Dist,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> Tensor<D> {
    let n = shape.iter().product();
    let data = TensorData::new(random_values(n, dist, seed), shape).convert_dtype(dtype);
    Tensor::from_data(
        data,
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}

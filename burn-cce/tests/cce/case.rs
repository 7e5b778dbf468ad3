//! Test cases, their host inputs and the two loss paths: the plain reference and CCE.

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_cce::{
    CceOptions, DeCarry, FilterEps, GemmKernel, GemmStrategy, PassKernels, Reduction,
    linear_cross_entropy, reference,
};
use burn_kernels_testing::{Dist, compare::to_f32, is_wgpu, poison_memory, random_values};

use crate::kernels;

pub(super) const IGNORE: i64 = -100;

#[derive(Debug, Clone)]
pub(super) struct Case {
    /// `[batch, seq]` leading dims of the embeddings.
    pub(super) lead: [usize; 2],
    pub(super) d: usize,
    pub(super) v: usize,
    /// Fraction of targets set to the ignore index.
    pub(super) ignore: f32,
    pub(super) softcap: Option<f32>,
    pub(super) bias: bool,
    pub(super) shift: bool,
    pub(super) reduction: Reduction,
    pub(super) filter: FilterEps,
    pub(super) sort: bool,
    pub(super) accum: bool,
    /// How dE is carried between chunks (`accum`).
    pub(super) carry: DeCarry,
    /// Vocabulary entries per chunk the case asks for (via `chunk_bytes`); `None`: automatic.
    pub(super) chunk: Option<usize>,
    /// Most cases use the fixed GEMM: autotuning compiles ~30 candidate kernels per new shape
    /// (minutes per test on CUDA); one case runs the autotuned default.
    pub(super) gemm: GemmStrategy,
    pub(super) passes: PassKernels,
    pub(super) seed: u64,
}

impl Case {
    pub(super) fn new(lead: [usize; 2], d: usize, v: usize, seed: u64) -> Self {
        Self {
            lead,
            d,
            v,
            ignore: 0.0,
            softcap: None,
            bias: false,
            shift: false,
            reduction: Reduction::Mean,
            filter: FilterEps::Auto,
            sort: true,
            accum: true,
            carry: DeCarry::Auto,
            chunk: Some(96),
            gemm: GemmStrategy::Fixed,
            passes: PassKernels::Chunked,
            seed,
        }
    }

    pub(super) fn tokens(&self) -> usize {
        self.lead[0] * self.lead[1]
    }

    pub(super) fn options(&self) -> CceOptions {
        CceOptions {
            ignore_index: IGNORE,
            softcap: self.softcap,
            reduction: self.reduction,
            shift: self.shift,
            filter_eps: self.filter,
            sort_vocab: self.sort,
            accum_fp32: self.accum,
            return_lse: true,
            chunk_bytes: self.chunk.map(|chunk| self.tokens() * 4 * chunk),
            pass_chunk_bytes: None,
            de_block_rows: None,
            de_carry: self.carry,
            gemm: self.gemm,
            tf32: true,
            passes: self.passes,
        }
    }
}

/// Host inputs: embeddings that lean towards their target's classifier row (so softmax is
/// peaky, as in a trained model, and filtering has something to skip), targets with a
/// fraction ignored, optional bias, and per-token loss weights.
pub(super) struct Inputs {
    pub(super) e: Vec<f32>,
    pub(super) c: Vec<f32>,
    pub(super) bias: Option<Vec<f32>>,
    pub(super) targets: Vec<i64>,
    pub(super) weights: Vec<f32>,
}

pub(super) fn inputs(case: &Case) -> Inputs {
    let (n, d, v) = (case.tokens(), case.d, case.v);
    let c = random_values(v * d, Dist::STANDARD, case.seed);
    let picks = random_values(n, Dist::Uniform { lo: 0.0, hi: 1.0 }, case.seed + 1);
    let drop = random_values(n, Dist::Uniform { lo: 0.0, hi: 1.0 }, case.seed + 2);
    let targets: Vec<i64> = picks
        .iter()
        .zip(&drop)
        .map(|(&u, &r)| {
            if r < case.ignore {
                IGNORE
            } else {
                ((u * v as f32) as i64).min(v as i64 - 1)
            }
        })
        .collect();
    let noise = random_values(
        n * d,
        Dist::Normal {
            mean: 0.0,
            std: 2.0 / (d as f32).sqrt(),
        },
        case.seed + 3,
    );
    // Row i leans towards c[target of i] (or of the next position when shifted): logit ≈ +5.
    let lean = 5.0 / d as f32;
    let mut e = noise;
    for i in 0..n {
        let t = if case.shift {
            targets.get(i + 1)
        } else {
            targets.get(i)
        };
        if let Some(&t) = t
            && t >= 0
        {
            for k in 0..d {
                e[i * d + k] += lean * c[t as usize * d + k];
            }
        }
    }
    let bias = case
        .bias
        .then(|| random_values(v, Dist::STANDARD, case.seed + 4));
    let weights = random_values(n, Dist::Uniform { lo: 0.5, hi: 1.5 }, case.seed + 5);
    Inputs {
        e,
        c,
        bias,
        targets,
        weights,
    }
}

/// Targets after the shift: position t takes target t + 1 of its sequence; the last position
/// of each sequence is ignored.
pub(super) fn shifted(targets: &[i64], seq: usize) -> Vec<i64> {
    (0..targets.len())
        .map(|p| {
            if p % seq + 1 < seq {
                targets[p + 1]
            } else {
                IGNORE
            }
        })
        .collect()
}

/// Loss values and gradients, all as f32 host vectors.
#[derive(Debug)]
pub(super) struct Outcome {
    pub(super) loss: Vec<f32>,
    pub(super) de: Vec<f32>,
    pub(super) dc: Vec<f32>,
    pub(super) db: Option<Vec<f32>>,
}

pub(super) fn tensor<const D: usize>(
    values: &[f32],
    shape: [usize; D],
    dtype: DType,
    device: &Device,
) -> Tensor<D> {
    let data = TensorData::new(values.to_vec(), shape).convert_dtype(dtype);
    Tensor::from_data(data, (device, dtype))
}

/// Values as the device holds them in `dtype`, back in f32 (the oracle sees rounded inputs).
pub(super) fn rounded(values: &[f32], dtype: DType) -> Vec<f32> {
    to_f32(TensorData::new(values.to_vec(), [values.len()]).convert_dtype(dtype))
}

pub(super) fn grads_of(
    loss: Tensor<1>,
    weights: &[f32],
    e: &Tensor<3>,
    c: &Tensor<2>,
    b: &Option<Tensor<1>>,
) -> Outcome {
    let device = loss.device();
    let len = loss.dims()[0];
    let w = if len == 1 {
        Tensor::<1>::ones([1], &device)
    } else {
        Tensor::from_data(TensorData::new(weights.to_vec(), [len]), &device)
    };
    let grads = (loss.clone() * w).sum().backward();
    let host = |t: Tensor<2>| to_f32(t.into_data());
    Outcome {
        loss: to_f32(loss.into_data()),
        de: to_f32(e.grad(&grads).expect("dE").into_data()),
        dc: host(c.grad(&grads).expect("dC")),
        db: b
            .as_ref()
            .map(|b| to_f32(b.grad(&grads).expect("db").into_data())),
    }
}

/// The plain path on `device` in `dtype`.
pub(super) fn plain(case: &Case, x: &Inputs, dtype: DType, device: &Device) -> Outcome {
    let [bs, s] = case.lead;
    let e = tensor::<3>(&x.e, [bs, s, case.d], dtype, device).require_grad();
    let c = tensor::<2>(&x.c, [case.v, case.d], dtype, device).require_grad();
    let b = x
        .bias
        .as_ref()
        .map(|b| tensor::<1>(b, [case.v], dtype, device).require_grad());
    let targets = if case.shift {
        shifted(&x.targets, s)
    } else {
        x.targets.clone()
    };
    let n = case.tokens();
    let t = Tensor::<1, Int>::from_data(TensorData::new(targets, [n]), device);
    let loss = reference::plain_linear_cross_entropy(
        e.clone().reshape([n, case.d]),
        c.clone(),
        b.clone(),
        t,
        IGNORE,
        case.softcap,
        case.reduction,
    );
    grads_of(loss, &x.weights, &e, &c, &b)
}

pub(super) fn cce(case: &Case, x: &Inputs, dtype: DType, device: &Device) -> (Outcome, Vec<f32>) {
    let [bs, s] = case.lead;
    let e = tensor::<3>(&x.e, [bs, s, case.d], dtype, device).require_grad();
    let c = tensor::<2>(&x.c, [case.v, case.d], dtype, device).require_grad();
    let b = x
        .bias
        .as_ref()
        .map(|b| tensor::<1>(b, [case.v], dtype, device).require_grad());
    let t = Tensor::<2, Int>::from_data(TensorData::new(x.targets.clone(), [bs, s]), device);
    // Stale NaNs in the pool make any element the kernels fail to write visible.
    poison_memory(device, case.tokens() * case.v.max(case.d) * 2, DType::F32);
    let out = kernels(device, || {
        linear_cross_entropy(e.clone(), c.clone(), t, b.clone(), &case.options())
    })
    .expect("valid input");
    let lse = to_f32(out.lse.expect("return_lse").into_data());
    (grads_of(out.loss, &x.weights, &e, &c, &b), lse)
}

pub(super) fn cases() -> Vec<Case> {
    let base = Case::new([4, 63], 123, 507, 11);
    vec![
        base.clone(),
        Case {
            ignore: 0.2,
            gemm: GemmStrategy::Autotune,
            ..base.clone()
        },
        // cubek's tile-DSL routines under their own tables (TMA and warpgroup MMA on Hopper).
        Case {
            softcap: Some(4.0),
            gemm: GemmStrategy::Kernel(GemmKernel::TileDsl),
            ..Case::new([3, 41], 96, 1031, 17)
        },
        Case {
            softcap: Some(4.0),
            bias: true,
            ..base.clone()
        },
        Case {
            shift: true,
            ignore: 0.2,
            reduction: Reduction::Sum,
            ..base.clone()
        },
        Case {
            reduction: Reduction::None,
            ignore: 0.2,
            bias: true,
            ..base.clone()
        },
        Case {
            sort: false,
            filter: FilterEps::Value(1e-3),
            ..base.clone()
        },
        Case {
            accum: false,
            chunk: Some(32),
            ..base.clone()
        },
        Case {
            filter: FilterEps::Off,
            ..base.clone()
        },
        Case::new([1, 1], 64, 33, 12),
        Case {
            chunk: Some(32),
            bias: true,
            ..Case::new([3, 17], 1, 1009, 13)
        },
        Case {
            shift: true,
            ..Case::new([2, 5], 16, 40, 14)
        },
        // Automatic chunk and dE blocks.
        Case {
            chunk: None,
            bias: true,
            ..base
        },
    ]
}

/// Whether case `k` of [`cases`] runs in `dtype` on `device`. On wgpu (lavapipe in CI, where
/// each option set compiles new kernels, seconds apiece, and this suite took 14 minutes) f32
/// runs every case and 16-bit dtypes the base case; CUDA runs every case in every dtype.
pub(super) fn runs(device: &Device, k: usize, dtype: DType) -> bool {
    dtype == DType::F32 || !is_wgpu(device) || k == 0
}

//! The host-side linear algebra of the prefill (Gram matrix on the device, its symmetric
//! eigen-decomposition with `nalgebra` on the host), RoPE tables and un-rotation.

use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData};
use burn_kernels_core::RopeScaling;
use burn_kernels_core::rope::rope_angles;
use nalgebra::{DMatrix, SymmetricEigen};

use crate::KvCacheError;

/// A rank-`r` factorization `x ≈ a · wt` of an `[s, n]` matrix: `wt` holds the top-`r`
/// right singular vectors of `x` (eigenvectors of `xᵀx`) as rows, `a = x · wtᵀ`.
#[derive(Debug, Clone)]
pub struct LowRank {
    /// `[s, r]`, the dtype of `x`.
    pub a: Tensor<2>,
    /// `[r, n]`, the dtype of `x`; orthonormal rows.
    pub wt: Tensor<2>,
    /// Eigenvalues of `xᵀx` (squared singular values), descending, all `n` of them.
    pub eigenvalues: Vec<f64>,
}

impl LowRank {
    /// The share of `‖x‖²_F` the kept rank captures: `Σ_{i<r} λ_i / Σ λ_i`.
    pub fn energy(&self) -> f64 {
        let r = self.a.dims()[1];
        let total: f64 = self.eigenvalues.iter().map(|x| x.max(0.0)).sum();
        let kept: f64 = self.eigenvalues[..r].iter().map(|x| x.max(0.0)).sum();
        if total > 0.0 { kept / total } else { 1.0 }
    }
}

/// The best rank-`rank` approximation of `x` in the Frobenius norm (truncated SVD): the Gram
/// matrix `xᵀx` is formed on the device in f32 and read back (`n²` values), its eigenvectors
/// come from `nalgebra` in f64, and `a = x · W` is a device matmul.
///
/// # Shapes
/// - `x`: `[s, n]`; returns `a [s, rank]`, `wt [rank, n]`
///
/// # Errors
/// [`KvCacheError::ZeroRank`], [`KvCacheError::RankTooLarge`] for `rank > n`.
pub fn low_rank(x: Tensor<2>, rank: usize) -> Result<LowRank, KvCacheError> {
    let [_, n] = x.dims();
    if rank == 0 {
        return Err(KvCacheError::ZeroRank);
    }
    if rank > n {
        return Err(KvCacheError::RankTooLarge { rank, max: n });
    }
    let dtype = x.dtype();
    let device = x.device();
    let x32 = x.cast(DType::F32);
    let gram = x32.clone().transpose().matmul(x32.clone());
    let gram = gram
        .into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .expect("f64 data");
    // Symmetrize: the device matmul need not give bitwise-symmetric sums.
    let g = DMatrix::<f64>::from_fn(n, n, |i, j| 0.5 * (gram[i * n + j] + gram[j * n + i]));
    let eig = SymmetricEigen::new(g);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| eig.eigenvalues[j].total_cmp(&eig.eigenvalues[i]));
    let eigenvalues = order.iter().map(|&i| eig.eigenvalues[i]).collect();
    // Wᵀ row-major: row c is eigenvector order[c].
    let mut wt = Vec::with_capacity(rank * n);
    for &c in &order[..rank] {
        wt.extend(eig.eigenvectors.column(c).iter().map(|&v| v as f32));
    }
    let wt = Tensor::<2>::from_data(
        TensorData::new(wt, [rank, n]),
        TensorCreationOptions::new(device).with_dtype(DType::F32),
    );
    let a = x32.matmul(wt.clone().transpose());
    Ok(LowRank {
        a: a.cast(dtype),
        wt: wt.cast(dtype),
        eigenvalues,
    })
}

/// RoPE settings of the model (the head dim comes from the cache), so that ShadowKV can undo
/// the rotation of the keys it is given and redo it on the keys it rebuilds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParams {
    pub theta: f32,
    pub scaling: Option<RopeScaling>,
}

impl Default for RopeParams {
    /// Llama-2's θ = 10000 without scaling.
    fn default() -> Self {
        Self {
            theta: 10_000.0,
            scaling: None,
        }
    }
}

/// `(cos, sin)` tables `[positions, head_dim / 2]` in f32: [`rope_angles`], the values of
/// [`burn_kernels_core::Rope`]'s tables, so rebuilt keys rotate as the model's did.
pub fn rope_tables(
    head_dim: usize,
    positions: usize,
    rope: RopeParams,
    device: &Device,
) -> (Tensor<2>, Tensor<2>) {
    let (cos, sin) = rope_angles(head_dim, positions, rope.theta, rope.scaling);
    let half = head_dim / 2;
    let opts = || TensorCreationOptions::new(device.clone()).with_dtype(DType::F32);
    (
        Tensor::from_data(TensorData::new(cos, [positions, half]), opts()),
        Tensor::from_data(TensorData::new(sin, [positions, half]), opts()),
    )
}

/// Undoes RoPE (rotation by `−angle`) of keys at positions `0..len`, in f32.
///
/// # Shapes
/// - `x`: `[heads, len, d]`; `cos`, `sin`: `[≥ len, d/2]`; returns `[heads, len, d]` f32
pub fn unrope(x: Tensor<3>, cos: &Tensor<2>, sin: &Tensor<2>) -> Tensor<3> {
    let [h, s, d] = x.dims();
    let half = d / 2;
    let x = x.cast(DType::F32);
    let cos = cos.clone().slice([0..s, 0..half]).reshape([1, s, half]);
    let sin = sin.clone().slice([0..s, 0..half]).reshape([1, s, half]);
    let x1 = x.clone().slice([0..h, 0..s, 0..half]);
    let x2 = x.slice([0..h, 0..s, half..d]);
    Tensor::cat(
        vec![
            x1.clone() * cos.clone() + x2.clone() * sin.clone(),
            x2 * cos - x1 * sin,
        ],
        2,
    )
}

//! MiniCache's merge and restore of adjacent layers' rows (see the crate docs' MiniCache section).

use burn::backend::Dispatch;
use burn::tensor::{Int, Tensor};

use crate::{KvCacheError, KvKernels, kernel, reference};

/// The shared direction, both magnitudes and the angular distance of merged row pairs.
#[derive(Debug, Clone)]
pub struct Merged {
    /// `[n, d]`, input dtype; layer `a`'s own direction for retained rows.
    pub dir: Tensor<2>,
    /// `[n]`, input dtype: `‖a_i‖`.
    pub mag_a: Tensor<1>,
    /// `[n]`, input dtype: `‖b_i‖`.
    pub mag_b: Tensor<1>,
    /// `[n]`, f32: `θ_i / π`; row `i` is retained when it is above `gamma`.
    pub dist: Tensor<1>,
}

pub(crate) fn check_t_gamma(t: f32, gamma: f32) -> Result<(), KvCacheError> {
    if !(0.0..=1.0).contains(&t) {
        return Err(KvCacheError::InvalidInterpolation(t));
    }
    if !gamma.is_finite() || gamma < 0.0 {
        return Err(KvCacheError::InvalidGamma(gamma));
    }
    Ok(())
}

/// Merges row `i` of `a` (layer `l`) with row `i` of `b` (layer `l+1`): magnitudes, the SLERP
/// of their directions with weight `t` on `b`, and the normalized angle `θ/π` between them.
/// Rows with `θ/π > gamma` are retained: their `dir` is `a`'s own direction. See the crate
/// docs for the exact math.
///
/// # Shapes
/// - `a`, `b`: `[n, d]`, one float dtype
/// - returns [`Merged`]: `dir [n, d]`, `mag_a`, `mag_b` `[n]`, `dist [n]` (f32)
///
/// # Errors
/// [`KvCacheError::InvalidInterpolation`], [`KvCacheError::InvalidGamma`],
/// [`KvCacheError::ShapeMismatch`].
pub fn merge(a: Tensor<2>, b: Tensor<2>, t: f32, gamma: f32) -> Result<Merged, KvCacheError> {
    check_t_gamma(t, gamma)?;
    if a.dims() != b.dims() {
        return Err(KvCacheError::ShapeMismatch {
            left: a.dims().to_vec(),
            right: b.dims().to_vec(),
        });
    }
    let unsupported =
        (a.dtype() != b.dtype()).then(|| format!("a is {:?}, b is {:?}", a.dtype(), b.dtype()));
    if !kernel("minicache_merge", &a.device(), unsupported) {
        return Ok(reference::merge(a, b, t, gamma));
    }
    let (dir, mag_a, mag_b, dist) =
        Dispatch::minicache_merge(a.into_dispatch(), b.into_dispatch(), t, gamma);
    Ok(Merged {
        dir: Tensor::from_dispatch(dir),
        mag_a: Tensor::from_dispatch(mag_a),
        mag_b: Tensor::from_dispatch(mag_b),
        dist: Tensor::from_dispatch(dist),
    })
}

/// Restores one layer of merged rows: `mag_i · dir_i`, or retained row `slot_i − 1` where
/// `slot_i > 0`.
///
/// # Shapes
/// - `dir`: `[n, d]`, `mag`: `[n]`, `retained`: `(slot [n], rows [r, d])` with every slot in
///   `[0, r]`
/// - returns `[n, d]` in the dtype of `dir`
///
/// # Errors
/// [`KvCacheError::ShapeMismatch`] when the shapes disagree.
pub fn restore(
    dir: Tensor<2>,
    mag: Tensor<1>,
    retained: Option<(Tensor<1, Int>, Tensor<2>)>,
) -> Result<Tensor<2>, KvCacheError> {
    let [n, d] = dir.dims();
    let mismatch = |right: Vec<usize>| KvCacheError::ShapeMismatch {
        left: vec![n, d],
        right,
    };
    if mag.dims() != [n] {
        return Err(mismatch(mag.dims().to_vec()));
    }
    if let Some((slot, rows)) = &retained {
        if slot.dims() != [n] {
            return Err(mismatch(slot.dims().to_vec()));
        }
        if rows.dims()[1] != d {
            return Err(mismatch(rows.dims().to_vec()));
        }
    }
    let dtype = dir.dtype();
    let unsupported = if mag.dtype() != dtype {
        Some(format!("dir is {dtype:?}, mag is {:?}", mag.dtype()))
    } else {
        retained
            .as_ref()
            .filter(|(_, rows)| rows.dtype() != dtype)
            .map(|(_, rows)| format!("dir is {dtype:?}, the retained rows {:?}", rows.dtype()))
    };
    if !kernel("minicache_restore", &dir.device(), unsupported) {
        return Ok(reference::restore(dir, mag, retained));
    }
    let out = match retained {
        Some((slot, rows)) if rows.dims()[0] > 0 => Dispatch::minicache_restore_retained(
            dir.into_dispatch(),
            mag.into_dispatch(),
            slot.into_dispatch(),
            rows.into_dispatch(),
        ),
        _ => Dispatch::minicache_restore(dir.into_dispatch(), mag.into_dispatch()),
    };
    Ok(Tensor::from_dispatch(out))
}

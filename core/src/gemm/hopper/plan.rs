//! Which problems the Hopper kernel takes and how: the operands' layouts, the tile width, the
//! split of K, and the TMA maps.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::client::Client;
use cubecl::features::{Tma, WgmmaElems};
use cubecl::ir::{ElemType, FloatKind, types::MatrixShape};
use cubecl::prelude::*;
use cubecl::wgmma::{Major, WARPGROUP_M, WgmmaTileLayout};
use cubecl::zspace::{Shape, Strides};

use super::{BK, ELEM_BYTES, Epilogue, HopperTile};

/// The layout of `[rows, cols]` with `strides`: whether its first dimension is the contiguous
/// one (`A` MN-major, `B` K-major), and the stride of the other. `None` where neither dimension
/// is contiguous or TMA cannot address the other's stride (16-byte multiples).
fn operand(dims: [usize; 2], strides: [usize; 2]) -> Option<(bool, usize)> {
    let aligned = |s: usize| (s * ELEM_BYTES).is_multiple_of(16);
    if strides[1] == 1 && strides[0] >= dims[1] && aligned(strides[0]) {
        Some((false, strides[0]))
    } else if strides[0] == 1 && strides[1] >= dims[0] && aligned(strides[1]) {
        Some((true, strides[1]))
    } else {
        None
    }
}

/// The widest tile (a multiple of 64, so an MN-major `B` loads whole 64-column panels) that
/// wastes the fewest columns of `n`.
pub fn tile_width(n: usize) -> usize {
    [256, 192, 128, 64]
        .into_iter()
        .min_by_key(|&bn| (n.div_ceil(bn) * bn - n, usize::MAX - bn))
        .expect("candidates")
}

/// How many splits of K: enough cubes for every SM where the tiles alone are too few, each split
/// at least 4 stages long.
pub fn splits_for(tiles: usize, k_tiles: usize, sms: usize) -> usize {
    if tiles >= sms / 2 || k_tiles < 8 {
        return 1;
    }
    (sms / tiles).clamp(1, k_tiles / 4)
}

pub(super) fn elem(dtype: DType) -> Option<ElemType> {
    match dtype {
        DType::F16 => Some(ElemType::Float(FloatKind::F16)),
        DType::BF16 => Some(ElemType::Float(FloatKind::BF16)),
        _ => None,
    }
}

/// What a launch needs to know of a problem the kernel takes: its sizes, the tile, and each
/// operand's stride along its non-contiguous dimension.
#[derive(Clone, Copy)]
pub(super) struct Plan {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) tile: HopperTile,
    pub(super) a_stride: usize,
    pub(super) b_stride: usize,
}

/// The [`Plan`] of `lhs · rhs` on this device, or why the kernel cannot run it.
pub(super) fn plan(client: &Client, lhs: &CubeTensor, rhs: &CubeTensor) -> Result<Plan, String> {
    let Some(e) = elem(lhs.dtype).filter(|_| rhs.dtype == lhs.dtype) else {
        return Err(format!("{:?} · {:?} (f16/bf16 only)", lhs.dtype, rhs.dtype));
    };
    let features = &client.properties().features;
    if !features.tma.contains(Tma::Base) {
        return Err("no tensor memory accelerator".into());
    }
    if lhs.meta.shape().num_dims() != 2 || rhs.meta.shape().num_dims() != 2 {
        return Err("batched operands".into());
    }
    if lhs.meta.is_tiled() || rhs.meta.is_tiled() {
        return Err("storage-tiled operands".into());
    }
    let [m, k] = lhs.meta.shape().dims::<2>();
    let n = rhs.meta.shape().dims::<2>()[1];
    let bn = tile_width(n);
    let elems = WgmmaElems {
        a: e,
        b: e,
        cd: ElemType::Float(FloatKind::F32),
    };
    let shape = MatrixShape {
        m: WARPGROUP_M,
        n: bn,
        k: WgmmaTileLayout::k_step(ELEM_BYTES),
    };
    if !features
        .matmul
        .wgmma
        .iter()
        .any(|c| c.matches(elems, shape))
    {
        return Err(format!("no {:?} warpgroup MMA of n = {bn}", lhs.dtype));
    }
    let strides = |t: &CubeTensor| {
        let s = t.meta.strides();
        [s[0], s[1]]
    };
    let unaligned = || "an operand with no contiguous dimension or an unaligned stride".to_string();
    let (a_mn, a_stride) = operand([m, k], strides(lhs)).ok_or_else(unaligned)?;
    // `B` is `[k, n]`: its first dimension (K) contiguous is K-major.
    let (b_k, b_stride) = operand([k, n], strides(rhs)).ok_or_else(unaligned)?;
    // TMA reads from 16-byte aligned addresses only.
    let offset = |t: &CubeTensor| t.handle.offset_start.unwrap_or(0);
    if !offset(lhs).is_multiple_of(16) || !offset(rhs).is_multiple_of(16) {
        return Err("an operand starting at an address TMA cannot read from".into());
    }
    let tile = HopperTile {
        bn,
        a_major: if a_mn { Major::MN } else { Major::K },
        b_major: if b_k { Major::K } else { Major::MN },
        pairs: n.is_multiple_of(2),
        m_fast: m * k < k * n,
        epilogue: Epilogue::Store,
        overlap: super::overlapped_main_loop(),
    };
    Ok(Plan {
        m,
        n,
        k,
        tile,
        a_stride,
        b_stride,
    })
}

/// Why this device or problem cannot run the kernel; `None` where it can.
pub fn unsupported(client: &Client, lhs: &CubeTensor, rhs: &CubeTensor) -> Option<String> {
    plan(client, lhs, rhs).err()
}

/// A tensor map over `t` (`[rows, cols]`, one of them contiguous), seen with its contiguous
/// dimension last, in boxes of `box_rows × 64` of that dimension's elements swizzled 128 bytes.
pub(super) fn tensor_map(
    t: &CubeTensor,
    contiguous_first: bool,
    stride: usize,
    box_outer: usize,
) -> TensorMapArg<Tiled> {
    let [rows, cols] = t.meta.shape().dims::<2>();
    let mut binding = t.clone().binding();
    let (outer, inner) = if contiguous_first {
        (cols, rows)
    } else {
        (rows, cols)
    };
    binding.shape = Shape::new([outer, inner]);
    binding.strides = Strides::new(&[stride, 1]);
    TensorMapArg::new(
        TiledArgs {
            tile_size: Shape::new([box_outer, BK]),
        },
        binding.into_tensor_arg(),
        elem(t.dtype).expect("checked"),
    )
    .with_swizzle(HopperTile::layout(Major::K, 64).tensor_map_swizzle())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tile_widths_waste_least() {
        assert_eq!(tile_width(576), 192);
        assert_eq!(tile_width(192), 192);
        assert_eq!(tile_width(1536), 256);
        assert_eq!(tile_width(49152), 256);
        assert_eq!(tile_width(64), 64);
        assert_eq!(tile_width(100), 128);
        assert_eq!(tile_width(1), 64);
    }

    #[test]
    fn splits_fill_the_device_only_for_few_tiles() {
        // The projections' forward: 64 × 3 tiles, no split.
        assert_eq!(splits_for(64 * 3, 9, 132), 1);
        // A weight gradient 576 × 192 over 8192 tokens: 5 tiles, 128 K tiles.
        assert_eq!(splits_for(5, 128, 132), 26);
        // Short K: no split.
        assert_eq!(splits_for(5, 7, 132), 1);
        // Few K tiles cap the split at 4 stages each.
        assert_eq!(splits_for(2, 12, 132), 3);
    }

    #[test]
    fn kernel_names_round_trip() {
        use crate::gemm::GemmKernel;
        for kernel in GemmKernel::ALL {
            assert_eq!(GemmKernel::from_name(kernel.name()), Some(kernel));
        }
        assert_eq!(GemmKernel::from_name("wgmma"), Some(GemmKernel::Wgmma));
        assert_eq!(GemmKernel::from_name("cublas"), None);
    }

    #[test]
    fn layouts_of_operands() {
        assert_eq!(operand([128, 576], [576, 1]), Some((false, 576)));
        assert_eq!(operand([576, 128], [1, 576]), Some((true, 576)));
        assert_eq!(operand([128, 577], [577, 1]), None);
        assert_eq!(operand([128, 576], [1152, 2]), None);
    }
}

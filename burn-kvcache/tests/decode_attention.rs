//! The full-precision decode attention (`DecodeAttention`, kernel `kv_decode_attention`):
//! strided inputs through the public op, and the kernel itself in every launch layout (one
//! unit or one hardware plane per plane, one to four planes per cube, one split or many, a
//! split length that is not a whole pass) against the host attention of
//! [`crate::quant_attention`]'s cases, with NaN keys and values at hidden positions and the
//! mask read through a transposed view.

use burn::tensor::{Bool, Device, Tensor};
use burn_kernels_core::{AttentionImpl, AttnOptions, ReferenceAttention};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, compare::to_f32, float_dtypes, random_tensor,
};
use burn_kvcache::DecodeAttention;

use crate::{assert_launched, launch_counts, on_kernels};

/// `x` `[b, h, s, d]` with NaN at the positions `hidden` `[b, s]` hides.
pub(crate) fn hide(x: Tensor<4>, hidden: &Tensor<2, Bool>) -> Tensor<4> {
    let [b, h, s, d] = x.dims();
    let at = hidden.clone().reshape([b, 1, s, 1]).expand([b, h, s, d]);
    x.mask_fill(at, f32::NAN)
}

/// `m` `[b, s]` inside a wider `[b, s + 3]` mask (one hidden column before, two after).
fn wide(m: &Tensor<2, Bool>) -> Tensor<2, Bool> {
    let [b, _] = m.dims();
    let device = m.device();
    Tensor::cat(
        vec![
            Tensor::<2, Bool>::full([b, 1], true, &device),
            m.clone(),
            Tensor::<2, Bool>::full([b, 2], true, &device),
        ],
        1,
    )
}

/// `opts` with its key padding `m` `[b, s]` read through a slice of [`wide`]`(m)`.
pub(crate) fn widened(opts: &AttnOptions, m: &Tensor<2, Bool>) -> AttnOptions {
    let [b, s] = m.dims();
    AttnOptions {
        key_padding: Some(wide(m).slice([0..b, 1..s + 1])),
        ..opts.clone()
    }
}

/// The decode attention reads its inputs through their strides: the swapped-head views a
/// layer hands over (`[b, s, h, d]` storage) give what their contiguous copies give, and
/// both match the reference attention.
fn decode_attention_strided(device: &Device) {
    let before = launch_counts(["kv_decode_attention"]);
    for dtype in float_dtypes(device) {
        for (b, hq, hkv, sq, skv, d) in [(1, 9, 3, 1, 517, 64), (2, 8, 2, 3, 70, 128)] {
            let seed = 77 + skv as u64;
            let view = |h: usize, s: usize, seed: u64, dist: Dist| {
                random_tensor::<4>([b, s, h, d], dist, seed, dtype, device).swap_dims(1, 2)
            };
            let q = view(hq, sq, seed, Dist::STANDARD);
            let k = view(hkv, skv, seed + 1, Dist::PEAKY);
            let v = view(hkv, skv, seed + 2, Dist::STANDARD);
            let opts = AttnOptions {
                causal: true,
                scale: 1.0 / (d as f32).sqrt(),
                key_padding: None,
            };
            let decode = DecodeAttention { max_queries: sq };
            let strided = on_kernels(device, || {
                decode.attend(0, q.clone(), k.clone(), v.clone(), &opts)
            });
            let copies = |x: &Tensor<4>| Tensor::<4>::from_data(x.to_data(), device).cast(dtype);
            let contiguous = on_kernels(device, || {
                decode.attend(0, copies(&q), copies(&k), copies(&v), &opts)
            });
            let reference = ReferenceAttention.attend(0, q, k, v, &opts);
            let name = format!("strided decode attention {b}x{hq}/{hkv}x{sq}x{skv}x{d} {dtype:?}");
            let (s, c) = (to_f32(strided.into_data()), to_f32(contiguous.into_data()));
            assert_eq!(s, c, "{name}: strided and contiguous inputs differ");
            let tol = Tolerance::for_reduction(dtype, d + skv);
            assert_close(&name, &s, &to_f32(reference.into_data()), tol);
        }
    }
    assert_launched(device, ["kv_decode_attention"], before);
}

/// The kernel launched on the unfused `CubeBackend` in every layout it takes, against the host
/// attention: planes of one unit (which need no plane ops, so this runs on every runtime) and,
/// where the device has them, hardware planes; 1, 2 and 4 planes per cube (their merge through
/// shared memory); the default split, a split of 5 keys (not a whole pass of the cube, and many
/// splits to combine) and one split (the cube writes the output itself). Outputs land in
/// NaN-poisoned memory, hidden keys and values are NaN, and the mask is a transposed view.
#[cfg(feature = "cube")]
fn kernel_layouts(device: &Device) {
    use crate::quant_attention::{CASES, HostCase, f64s, host_attention, inputs, padding};
    use burn::backend::ops::BoolTensorOps;
    use burn_cubecl::CubeBackend;
    use burn_kernels_testing::poison_memory;
    use burn_kernels_testing::unfused::{boolean, float, read_float};
    use burn_kvcache::kernels::decode_attention::{DecodeLayout, decode_attention, supported};

    for dtype in float_dtypes(device) {
        for (ci, c) in CASES.iter().enumerate().filter(|(_, c)| c.n == 0) {
            let (skv, d, rows) = (c.t, c.d, (c.hq / c.hkv) * c.sq);
            let [q, k, v] = inputs(c, 5000 + 10 * ci as u64, dtype, device);
            let host = HostCase {
                q: f64s(&q),
                k: f64s(&k),
                v: f64s(&v),
            };
            let scale = 1.0 / (d as f32).sqrt();
            let exp = host_attention(c, &host, scale as f64);
            let mask = padding(c, device);
            let (k, v) = match &mask {
                Some(m) => (hide(k, m), hide(v, m)),
                None => (k, v),
            };
            let (qc, kc, vc) = (float(&q, device), float(&k, device), float(&v, device));
            let lanes = std::iter::once(1).chain(supported(&qc.client, d, rows));
            for lanes in lanes.collect::<Vec<_>>() {
                // Each (planes, one split or not) is a kernel to compile; one unit holding
                // every channel of many rows makes a long one on lavapipe (10 s), so the
                // large cases take four planes only.
                let all: &[usize] = if lanes == 1 && rows * d > 256 {
                    &[4]
                } else {
                    &[1, 2, 4]
                };
                for &planes in all {
                    for split in [None, Some(5), Some(skv)] {
                        let layout = DecodeLayout {
                            lanes,
                            planes: Some(planes),
                            split,
                        };
                        let what = format!("decode kernel {c:?} {dtype:?} {layout:?}");

                        poison_memory(device, 4 * c.b * c.hq * c.sq * d * (skv / 5 + 2), dtype);
                        // The mask as the transposed view of a `[skv, b]` tensor: strides
                        // `(1, b)`, which the kernel must follow.
                        let mc = mask.as_ref().map(|m| {
                            let t = boolean(&m.clone().swap_dims(0, 1), device);
                            CubeBackend::bool_swap_dims(t, 0, 1)
                        });
                        let out = decode_attention(
                            qc.clone(),
                            kc.clone(),
                            vc.clone(),
                            mc,
                            scale,
                            c.causal,
                            layout,
                        );
                        let got = to_f32(read_float(out));
                        assert_eq!(got.len(), c.b * c.hq * c.sq * d, "{what}");
                        let (mut g, mut e) = (Vec::new(), Vec::new());
                        for (row, want) in exp.iter().enumerate() {
                            if let Some(want) = want {
                                g.extend_from_slice(&got[row * d..(row + 1) * d]);
                                e.extend(want.iter().map(|&x| x as f32));
                            }
                        }
                        assert!(!e.is_empty(), "{what}");
                        assert_close(&what, &g, &e, Tolerance::for_reduction(dtype, d + skv));
                    }
                }
            }
        }
    }
}

mod cpu {
    #[test]
    fn decode_attention_strided() {
        super::decode_attention_strided(&::burn::tensor::Device::flex());
    }
}

#[cfg(feature = "cube")]
burn_kernels_testing::testgen! {
    backend: [decode_attention_strided, kernel_layouts],
    autodiff: [],
}
#[cfg(not(feature = "cube"))]
burn_kernels_testing::testgen! {
    backend: [decode_attention_strided],
    autodiff: [],
}

//! `quant_attention` (the kernel on every enabled runtime, the reference on the CPU) against
//! attention computed on the host in f64 from the codes themselves: the test decodes the packed
//! words, scales and mins as they are stored, so both sides see the same dequantized values
//! (neither rounds them to the dtype), and the comparison is the dtype's tolerance for a
//! reduction. Random seeded inputs, awkward sizes (head dim 34 = a short value group, odd
//! head counts, several key splits, no tail, no quantized part), masks, poisoned outputs;
//! then the cache itself with and without the fused read.

use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};
use burn_kernels_core::{AttentionImpl, AttnOptions, FullKvCache, KvCache, ReferenceAttention};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, compare::to_f32, float_dtypes, poison_memory, random_tensor,
};
use burn_kvcache::{
    DecodeAttention, KvCacheError, Packed, QuantAttnView, QuantConfig, QuantKv, QuantLayout,
    kv_has_quant_attention, quant_attention, quantize,
};

use crate::decode_attention::{hide, widened};
use crate::{assert_launched, launch_counts, on_kernels};

/// Value groups and key groups of this many channels / tokens.
const GROUP: usize = 32;

#[derive(Debug, Clone, Copy)]
pub(crate) struct Case {
    pub(crate) b: usize,
    pub(crate) hq: usize,
    pub(crate) hkv: usize,
    pub(crate) sq: usize,
    pub(crate) causal: bool,
    /// Quantized positions (a multiple of `GROUP`), then full-precision ones.
    pub(crate) n: usize,
    pub(crate) t: usize,
    pub(crate) d: usize,
    pub(crate) bits: u32,
    /// Left padding of sequences 0 and 1 (hidden keys).
    pub(crate) pad: [usize; 2],
}

pub(crate) const CASES: &[Case] = &[
    // Decode, GQA, short tail.
    Case {
        b: 1,
        hq: 4,
        hkv: 2,
        sq: 1,
        causal: true,
        n: 32,
        t: 5,
        d: 64,
        bits: 4,
        pad: [0, 0],
    },
    // A short last value group (34 = 32 + 2), 3 KV heads, 2 bits, padding.
    Case {
        b: 2,
        hq: 6,
        hkv: 3,
        sq: 1,
        causal: true,
        n: 96,
        t: 33,
        d: 34,
        bits: 2,
        pad: [0, 7],
    },
    // Causal chunk of 3 queries across two key splits, padded first sequence.
    Case {
        b: 2,
        hq: 2,
        hkv: 2,
        sq: 3,
        causal: true,
        n: 288,
        t: 7,
        d: 16,
        bits: 4,
        pad: [5, 0],
    },
    // Non-causal rows, three splits, no tail.
    Case {
        b: 1,
        hq: 3,
        hkv: 1,
        sq: 4,
        causal: false,
        n: 544,
        t: 0,
        d: 64,
        bits: 4,
        pad: [0, 0],
    },
    // Nothing quantized yet: the tail alone.
    Case {
        b: 1,
        hq: 2,
        hkv: 1,
        sq: 1,
        causal: true,
        n: 0,
        t: 9,
        d: 16,
        bits: 4,
        pad: [0, 0],
    },
    // Full precision only (the decode attention): SmolLM2's 9/3 heads, a verification-sized
    // causal query block, two key splits, a padded sequence.
    Case {
        b: 2,
        hq: 9,
        hkv: 3,
        sq: 5,
        causal: true,
        n: 0,
        t: 301,
        d: 64,
        bits: 4,
        pad: [3, 0],
    },
    // Llama-3's 4 query heads per KV head and 128 channels, a long prime-length cache (many
    // key splits, a short last one), a padded sequence.
    Case {
        b: 2,
        hq: 8,
        hkv: 2,
        sq: 1,
        causal: true,
        n: 0,
        t: 1031,
        d: 128,
        bits: 4,
        pad: [0, 11],
    },
    // Multi-head attention with 32 channels: fewer keys than one read-ahead chunk past a split.
    Case {
        b: 1,
        hq: 2,
        hkv: 2,
        sq: 1,
        causal: false,
        n: 0,
        t: 37,
        d: 32,
        bits: 4,
        pad: [0, 0],
    },
    // One key, one query, an odd number of pairs per head.
    Case {
        b: 1,
        hq: 3,
        hkv: 3,
        sq: 1,
        causal: false,
        n: 0,
        t: 1,
        d: 34,
        bits: 2,
        pad: [0, 0],
    },
    // No quantized part (the decode attention), head dim 8 (below a CUDA plane), a speculative
    // verification's 4 causal queries over two rows, GQA 2:1, padding.
    Case {
        b: 2,
        hq: 2,
        hkv: 1,
        sq: 4,
        causal: true,
        n: 0,
        t: 29,
        d: 8,
        bits: 2,
        pad: [0, 3],
    },
];

/// Host copy of the tensors a case feeds the op, as stored (rounded to the dtype).
pub(crate) struct HostCase {
    pub(crate) q: Vec<f64>,
    /// `[b, hkv, n + t, d]`, the quantized part decoded from its codes.
    pub(crate) k: Vec<f64>,
    pub(crate) v: Vec<f64>,
}

fn int_values(t: Tensor<2, Int>) -> Vec<u32> {
    t.into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .expect("ints")
        .into_iter()
        .map(|x| x as u32)
        .collect()
}

/// Code `i` of the group at word offset `base`.
fn code(words: &[u32], base: usize, i: usize, bits: u32) -> f64 {
    let per = (32 / bits) as usize;
    ((words[base + i / per] >> ((i % per) as u32 * bits)) & ((1 << bits) - 1)) as f64
}

/// Packs `k`, `v` (`[b, h, n, d]`) as `QuantKv` stores them and decodes the codes on the
/// host into `[b, h, n, d]` f64.
#[allow(clippy::type_complexity)]
fn pack(
    k: Tensor<4>,
    v: Tensor<4>,
    bits: u32,
) -> (
    (Packed, QuantLayout),
    (Packed, QuantLayout),
    Vec<f64>,
    Vec<f64>,
) {
    let [b, h, n, d] = k.dims();
    let nb = n / GROUP;
    // Keys per channel: rows of GROUP tokens of one channel.
    let krows = k
        .reshape([b, h, nb, GROUP, d])
        .swap_dims(3, 4)
        .reshape([b * h * nb * d, GROUP]);
    let (kp, kl) = quantize(krows, bits, GROUP).expect("valid");
    let (vp, vl) = quantize(v.reshape([b * h * n, d]), bits, GROUP).expect("valid");
    let (kw, ks, km) = (
        int_values(kp.words.clone()),
        to_f32(kp.scale.to_data()),
        to_f32(kp.min.to_data()),
    );
    let (vw, vs, vm) = (
        int_values(vp.words.clone()),
        to_f32(vp.scale.to_data()),
        to_f32(vp.min.to_data()),
    );
    let mut hk = vec![0.0; b * h * n * d];
    let mut hv = vec![0.0; b * h * n * d];
    let (kwpg, vng, vwpg) = (kl.words_per_group(), vl.groups(), vl.words_per_group());
    for bh in 0..b * h {
        for j in 0..n {
            for c in 0..d {
                let g = (bh * nb + j / GROUP) * d + c;
                let x = code(&kw, g * kwpg, j % GROUP, bits);
                hk[(bh * n + j) * d + c] = km[g] as f64 + x * ks[g] as f64;
                let g = (bh * n + j) * vng + c / GROUP;
                let x = code(&vw, g * vwpg, c % GROUP, bits);
                hv[(bh * n + j) * d + c] = vm[g] as f64 + x * vs[g] as f64;
            }
        }
    }
    ((kp, kl), (vp, vl), hk, hv)
}

/// Attention in f64; `None` for rows that see no key.
pub(crate) fn host_attention(c: &Case, h: &HostCase, scale: f64) -> Vec<Option<Vec<f64>>> {
    let skv = c.n + c.t;
    let group = c.hq / c.hkv;
    let mut out = Vec::new();
    for bi in 0..c.b {
        for head in 0..c.hq {
            let kvh = bi * c.hkv + head / group;
            for i in 0..c.sq {
                let qrow = &h.q[((bi * c.hq + head) * c.sq + i) * c.d..][..c.d];
                let last = if c.causal { i + skv - c.sq } else { skv - 1 };
                let seen: Vec<usize> = (c.pad[bi]..=last).collect();
                if seen.is_empty() {
                    out.push(None);
                    continue;
                }
                let s: Vec<f64> = seen
                    .iter()
                    .map(|&j| {
                        let krow = &h.k[(kvh * skv + j) * c.d..][..c.d];
                        scale * qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = p.iter().sum();
                let mut o = vec![0.0; c.d];
                for (&j, pj) in seen.iter().zip(&p) {
                    for (ch, oc) in o.iter_mut().enumerate() {
                        *oc += pj / l * h.v[(kvh * skv + j) * c.d + ch];
                    }
                }
                out.push(Some(o));
            }
        }
    }
    out
}

pub(crate) fn padding(c: &Case, device: &Device) -> Option<Tensor<2, Bool>> {
    let skv = c.n + c.t;
    c.pad.iter().any(|&p| p > 0).then(|| {
        let m: Vec<bool> = (0..c.b)
            .flat_map(|bi| (0..skv).map(move |j| j < c.pad[bi]))
            .collect();
        Tensor::<2, Bool>::from_data(TensorData::new(m, [c.b, skv]), device)
    })
}

/// A case's seeded query, keys and values (`[b, hq, sq, d]`, `[b, hkv, n + t, d]` twice).
pub(crate) fn inputs(c: &Case, seed: u64, dtype: DType, device: &Device) -> [Tensor<4>; 3] {
    let kv = [c.b, c.hkv, c.n + c.t, c.d];
    [
        random_tensor::<4>([c.b, c.hq, c.sq, c.d], Dist::STANDARD, seed, dtype, device),
        random_tensor::<4>(kv, Dist::PEAKY, seed + 1, dtype, device),
        random_tensor::<4>(kv, Dist::STANDARD, seed + 2, dtype, device),
    ]
}

pub(crate) fn f64s<const D: usize>(t: &Tensor<D>) -> Vec<f64> {
    to_f32(t.to_data()).into_iter().map(f64::from).collect()
}

fn matches_host(device: &Device) {
    let ops = ["kv_quant_attention", "kv_decode_attention"];
    let before = launch_counts(ops);
    // Where the kernel does not run (the CPU), the reference does: it dequantizes into the
    // dtype (as `QuantKv` does there before the model's attention), which this oracle of the
    // codes themselves does not, so there it is held to the reduction tolerance in f32 only
    // (what the CPU run covered before: NdArray<f32>). The kernels dequantize in f32 registers
    // and are checked in every dtype the device stores.
    let dtypes: Vec<DType> = float_dtypes(device)
        .into_iter()
        .filter(|&d| kv_has_quant_attention(device) || d == DType::F32)
        .collect();
    for dtype in dtypes {
        for (ci, c) in CASES.iter().enumerate() {
            let (skv, d) = (c.n + c.t, c.d);
            let [q, k, v] = inputs(c, 1000 + 10 * ci as u64, dtype, device);
            let part = |x: &Tensor<4>, from: usize, to: usize| {
                x.clone().slice([0..c.b, 0..c.hkv, from..to, 0..d])
            };
            let (keys, values, hk, hv) = if c.n > 0 {
                let (kp, vp, qk, qv) = pack(part(&k, 0, c.n), part(&v, 0, c.n), c.bits);
                (Some(kp), Some(vp), qk, qv)
            } else {
                (None, None, Vec::new(), Vec::new())
            };
            let tail = (c.t > 0).then(|| (part(&k, c.n, skv), part(&v, c.n, skv)));
            // Interleave the decoded quantized part and the stored tail per (b, h).
            let (tk, tv) = match &tail {
                Some((a, b)) => (f64s(a), f64s(b)),
                None => (Vec::new(), Vec::new()),
            };
            let join = |qpart: &[f64], tpart: &[f64]| -> Vec<f64> {
                (0..c.b * c.hkv)
                    .flat_map(|bh| {
                        let a = if c.n > 0 {
                            &qpart[bh * c.n * d..(bh + 1) * c.n * d]
                        } else {
                            &[][..]
                        };
                        let b = if c.t > 0 {
                            &tpart[bh * c.t * d..(bh + 1) * c.t * d]
                        } else {
                            &[][..]
                        };
                        a.iter().chain(b).copied().collect::<Vec<_>>()
                    })
                    .collect()
            };
            let host = HostCase {
                q: f64s(&q),
                k: join(&hk, &tk),
                v: join(&hv, &tv),
            };
            let scale = 1.0 / (d as f32).sqrt();
            let opts = AttnOptions {
                causal: c.causal,
                scale,
                key_padding: padding(c, device),
            };
            let view = QuantAttnView {
                keys,
                values,
                qlen: c.n,
                tail,
            };
            let exp = host_attention(c, &host, scale as f64);
            let check = |what: &str, got: Tensor<4>| {
                assert_eq!(got.dims(), [c.b, c.hq, c.sq, d]);
                let got = to_f32(got.into_data());
                let (mut g, mut e) = (Vec::new(), Vec::new());
                for (row, want) in exp.iter().enumerate() {
                    if let Some(want) = want {
                        g.extend_from_slice(&got[row * d..(row + 1) * d]);
                        e.extend(want.iter().map(|&x| x as f32));
                    }
                }
                assert!(!e.is_empty());
                assert_close(
                    &format!("{what} {c:?} {dtype:?}"),
                    &g,
                    &e,
                    Tolerance::for_reduction(dtype, d + skv),
                );
            };
            let poison =
                || poison_memory(device, 4 * c.b * c.hq * c.sq * d * (skv / 256 + 2), dtype);
            // With no quantized part, the decode attention runs the same kernel over the
            // full-precision keys and values.
            if c.n == 0 {
                // Where the kernel runs, hidden keys and values are NaN (a static cache's
                // unwritten rows), which may not reach the output, and the mask is a slice of a
                // wider one (Burn may materialize it; `decode_attention::kernel_layouts` passes
                // a true strided view).
                let kernel = kv_has_quant_attention(device);
                let (k, v, opts) = match &opts.key_padding {
                    Some(m) if kernel => (hide(k, m), hide(v, m), widened(&opts, m)),
                    _ => (k, v, opts.clone()),
                };
                poison();
                let decode = DecodeAttention { max_queries: c.sq };
                let got = on_kernels(device, || decode.attend(0, q.clone(), k, v, &opts));
                check("decode attention", got);
            }
            poison();
            let got = on_kernels(device, || quant_attention(q, &view, &opts)).expect("valid view");
            check("quant_attention", got);
        }
    }
    assert_launched(device, ops, before);
}

/// A quantized cache decoding with the fused read gives what it gives when it dequantizes the
/// layer for the model's attention (the path backends without the kernel take).
#[cfg(feature = "cube")]
fn cache_fused_matches_dequantized(device: &Device) {
    let before = launch_counts(["kv_quant_attention"]);
    let (b, hq, hkv, d, layers) = (2, 4, 2, 64, 2);
    for bits in [4, 2] {
        let cfg = |fused| QuantConfig {
            bits,
            residual: 16,
            fused_attention: fused,
            ..QuantConfig::default()
        };
        let mut fused = QuantKv::new(layers, cfg(true)).unwrap();
        let mut plain = QuantKv::new(layers, cfg(false)).unwrap();
        let mut full = FullKvCache::new(layers);
        let opts = AttnOptions {
            causal: true,
            scale: 0.125,
            key_padding: None,
        };
        // A prefill of 100 (64 quantized), then 40 single steps (one more block quantized).
        let mut seed = 7;
        for n in [100].into_iter().chain([1; 40]) {
            let mut rnd = |shape: [usize; 4]| {
                seed += 1;
                random_tensor::<4>(shape, Dist::STANDARD, seed, DType::F32, device)
            };
            let (q, k, v) = (rnd([b, hq, n, d]), rnd([b, hkv, n, d]), rnd([b, hkv, n, d]));
            for layer in 0..layers {
                let caches: [&mut dyn KvCache; 3] = [&mut fused, &mut plain, &mut full];
                let [a, p, f] = caches.map(|c| {
                    let y = on_kernels(device, || {
                        c.attend(
                            layer,
                            q.clone(),
                            k.clone(),
                            v.clone(),
                            &ReferenceAttention,
                            &opts,
                        )
                        .expect("the cache attends")
                    });
                    to_f32(y.into_data())
                });
                if n == 1 {
                    let len = fused.seq_len();
                    let name = format!("quant{bits} layer {layer} at {len}");
                    let tol = Tolerance::for_reduction(DType::F32, d + len);
                    assert_close(&name, &a, &p, tol);
                    // And the fused read differs from the exact cache (it does read the codes).
                    assert!(
                        a.iter().zip(&f).any(|(x, y)| (x - y).abs() > 1e-4),
                        "{name}"
                    );
                }
            }
        }
        assert_eq!(fused.bytes_held(), plain.bytes_held());
    }
    assert_launched(device, ["kv_quant_attention"], before);
}

mod cpu {
    #[test]
    fn matches_host() {
        super::matches_host(&::burn::tensor::Device::flex());
    }
}
burn_kernels_testing::testgen! {
    backend: [matches_host, cache_fused_matches_dequantized],
    autodiff: [],
}

#[test]
fn typed_errors() {
    let device = Device::flex();
    let (b, h, d) = (1, 2, 16);
    let x = |n: usize| random_tensor::<4>([b, h, n, d], Dist::STANDARD, 1, DType::F32, &device);
    let q = x(1);
    let opts = |causal: bool, mask: Option<usize>| AttnOptions {
        causal,
        scale: 0.25,
        key_padding: mask.map(|n| {
            Tensor::<2, Bool>::from_data(TensorData::new(vec![false; b * n], [b, n]), &device)
        }),
    };
    let view = |n: usize, t: Option<(usize, usize)>| QuantAttnView {
        keys: None,
        values: None,
        qlen: n,
        tail: t.map(|(tk, tv)| (x(tk), x(tv))),
    };
    let err =
        |q: Tensor<4>, v: QuantAttnView, o: AttnOptions| quant_attention(q, &v, &o).unwrap_err();
    let shape = |e: KvCacheError| matches!(e, KvCacheError::ShapeMismatch { .. });
    // Nothing to attend to; tails of different lengths; quantized positions without codes.
    assert!(shape(err(q.clone(), view(0, None), opts(true, None))));
    assert!(shape(err(
        q.clone(),
        view(0, Some((3, 4))),
        opts(true, None)
    )));
    assert!(shape(err(
        q.clone(),
        view(32, Some((3, 3))),
        opts(true, None)
    )));
    // A causal query longer than the keys; a mask of the wrong length.
    assert!(shape(err(x(5), view(0, Some((3, 3))), opts(true, None))));
    assert!(shape(err(
        q.clone(),
        view(0, Some((3, 3))),
        opts(true, Some(4))
    )));
    // Query heads not a multiple of the KV heads.
    let q3 = random_tensor::<4>([b, 3, 1, d], Dist::STANDARD, 2, DType::F32, &device);
    assert!(shape(err(q3, view(0, Some((3, 3))), opts(true, None))));
    // A valid tail-only view works.
    assert!(quant_attention(q, &view(0, Some((3, 3))), &opts(true, Some(3))).is_ok());
}

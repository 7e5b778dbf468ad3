//! Tensor constructors and the drivers that feed a cache prompts and decode steps.

use burn::tensor::{Bool, DType, Device, Tensor, TensorData};
use burn_kernels_core::{AttnOptions, KvCache, ReferenceAttention};
use burn_kernels_testing::{Dist, compare::to_f32, random_tensor};
use burn_kvcache::ShadowKvConfig;

use crate::on_kernels;
pub(super) use crate::{cpu, tensor};

pub(super) struct Run {
    /// Outputs of the decode calls (after the prefill), flattened.
    pub(super) decode: Vec<f32>,
    pub(super) prefill: Vec<f32>,
}

pub(super) const LAYERS: usize = 3;

/// `run` (a [`drive`]) on `cache`, with kernels required on a CubeCL device (see
/// `on_kernels`), then on `full`; returns both runs.
pub(super) fn drive_both(
    device: &Device,
    cache: &mut dyn KvCache,
    full: &mut dyn KvCache,
    run: impl Fn(&mut dyn KvCache) -> Run,
) -> (Run, Run) {
    let y = on_kernels(device, || run(cache));
    (y, run(full))
}

/// Feeds `cache` the same random per-layer Q/K/V: a prompt of `prompt` slots (`pads[i]`
/// leading ones masked) then decode steps of `steps` tokens; `cut` truncates to `len` before
/// step `at`.
#[allow(clippy::too_many_arguments)]
pub(super) fn drive(
    cache: &mut dyn KvCache,
    (b, hq, h, d): (usize, usize, usize, usize),
    prompt: usize,
    pads: &[usize],
    steps: &[usize],
    cut: Option<(usize, usize)>,
    seed: u64,
    device: &Device,
) -> Run {
    let mut run = Run {
        decode: Vec::new(),
        prefill: Vec::new(),
    };
    let all: Vec<usize> = std::iter::once(prompt)
        .chain(steps.iter().copied())
        .collect();
    for (i, &s) in all.iter().enumerate() {
        if let Some((at, len)) = cut
            && at == i
        {
            cache.truncate(len);
            assert_eq!(cache.seq_len(), len);
        }
        let total = cache.seq_len() + s;
        let opts = causal_opts(pads, total, d, device);
        for layer in 0..LAYERS {
            let sd = seed + (i * LAYERS + layer) as u64 * 3;
            let q = random_tensor::<4>([b, hq, s, d], Dist::STANDARD, sd, DType::F32, device);
            let k = random_tensor::<4>([b, h, s, d], Dist::STANDARD, sd + 1, DType::F32, device);
            let v = random_tensor::<4>([b, h, s, d], Dist::STANDARD, sd + 2, DType::F32, device);
            let y = to_f32(
                cache
                    .attend(layer, q, k, v, &ReferenceAttention, &opts)
                    .expect("the cache attends")
                    .into_data(),
            );
            if i == 0 {
                run.prefill.extend(y);
            } else {
                run.decode.extend(y);
            }
        }
    }
    run
}

/// Causal attention options over `total` keys whose first `pads[r]` keys of row `r` are padding
/// (no mask when nothing is padded), scale `1/√d`.
fn causal_opts(pads: &[usize], total: usize, d: usize, device: &Device) -> AttnOptions {
    let b = pads.len();
    let key_padding = pads.iter().any(|&p| p > 0).then(|| {
        let data: Vec<bool> = (0..b)
            .flat_map(|r| (0..total).map(move |j| j < pads[r]))
            .collect();
        Tensor::<2, Bool>::from_data(TensorData::new(data, [b, total]), device)
    });
    AttnOptions {
        causal: true,
        scale: (d as f32).sqrt().recip(),
        key_padding,
    }
}

pub(super) fn cfg(rank: usize, budget: usize) -> ShadowKvConfig {
    ShadowKvConfig {
        rank,
        chunk: 4,
        budget,
        local_chunks: 2,
        outlier_chunks: 3,
        min_prompt: 0,
        scoring: Default::default(),
        candidates: 1,
        pinned_uploads: true,
        reuse_min_percent: ShadowKvConfig::default().reuse_min_percent,
    }
}

/// Like [`drive`] but each row's Q/K/V come from its own seed (so a row alone gets the same
/// data): returns per decode call, per row, the flattened output.
pub(super) fn drive_rows(
    cache: &mut dyn KvCache,
    (hq, h, d): (usize, usize, usize),
    lens: &[usize],
    prompt: usize,
    steps: &[usize],
    device: &Device,
) -> Vec<Vec<Vec<f32>>> {
    let b = lens.len();
    let pads: Vec<usize> = lens.iter().map(|l| prompt - l).collect();
    let mut outs = Vec::new();
    let all: Vec<usize> = std::iter::once(prompt)
        .chain(steps.iter().copied())
        .collect();
    for (i, &s) in all.iter().enumerate() {
        let total = cache.seq_len() + s;
        let opts = causal_opts(&pads, total, d, device);
        for layer in 0..LAYERS {
            // Row r's data: its own seed, its real tokens at the end (the prompt's padding
            // slots get filler).
            let make = |heads: usize, which: u64| {
                let rows: Vec<Tensor<4>> = lens
                    .iter()
                    .map(|&len| {
                        let sd = 1000 * len as u64 + (i * LAYERS + layer) as u64 * 3 + which;
                        let real = if i == 0 { len } else { s };
                        let x = random_tensor::<4>(
                            [1, heads, real, d],
                            Dist::STANDARD,
                            sd,
                            DType::F32,
                            device,
                        );
                        if real < s {
                            let fill = random_tensor::<4>(
                                [1, heads, s - real, d],
                                Dist::STANDARD,
                                7,
                                DType::F32,
                                device,
                            );
                            Tensor::cat(vec![fill, x], 2)
                        } else {
                            x
                        }
                    })
                    .collect();
                Tensor::cat(rows, 0)
            };
            let (q, k, v) = (make(hq, 0), make(h, 1), make(h, 2));
            let y = cache
                .attend(layer, q, k, v, &ReferenceAttention, &opts)
                .expect("the cache attends");
            if i > 0 {
                let [_, hh, ss, dd] = y.dims();
                outs.push(
                    (0..b)
                        .map(|r| {
                            to_f32(y.clone().slice([r..r + 1, 0..hh, 0..ss, 0..dd]).into_data())
                        })
                        .collect(),
                );
            }
        }
    }
    outs
}

/// RoPE at positions `0..n` (the model's rotation), for building rotated keys.
pub(super) fn rotate(x: Tensor<3>, cos: &Tensor<2>, sin: &Tensor<2>, n: usize) -> Tensor<3> {
    let [h, s, d] = x.dims();
    let half = d / 2;
    let c = cos.clone().slice([0..n, 0..half]).reshape([1, s, half]);
    let sn = sin.clone().slice([0..n, 0..half]).reshape([1, s, half]);
    let x1 = x.clone().slice([0..h, 0..s, 0..half]);
    let x2 = x.slice([0..h, 0..s, half..d]);
    Tensor::cat(
        vec![
            x1.clone() * c.clone() - x2.clone() * sn.clone(),
            x2 * c + x1 * sn,
        ],
        2,
    )
}

//! Burn's own matmul (the fused backend's autotuned GEMM) at the shapes this workspace runs,
//! against PyTorch's on the same GPU: the f32 square GEMM (TF32 where allowed), bf16, and the
//! ShadowKV and CCE shapes. Each Burn output is checked against f64 dot products at sampled
//! entries before it is timed, so a kernel that writes nothing (or half) fails instead of
//! timing fast.
//!
//! FLOPs: `2·m·n·k`. `+add` candidates add an `m × n` tensor to the product, which Burn's
//! fusion folds into the GEMM's epilogue.

use burn::tensor::{DType, Tensor};
use burn_kernels_core::gemm::{self, GemmKernel};
use burn_kernels_testing::{Dist, random_tensor};
use serde_json::json;

use super::{SuiteOptions, run_python_peer};
use crate::harness::{Candidate, Extra, Problem, Suite, keep, params};

/// One GEMM: `[m, k] · [k, n]`, the right side stored `[n, k]` and transposed (a view) when
/// `rhs_t`, as `x · wᵀ` does; the left side stored `[k, m]` and transposed when `lhs_t`, as a
/// weight gradient `xᵀ · dy` does. Each timed call runs the product `inner` times (short
/// products, where one synchronization per product would be most of the time).
#[derive(Debug, Clone, Copy)]
struct Shape {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    rhs_t: bool,
    lhs_t: bool,
    dtype: DType,
    inner: usize,
}

impl Shape {
    const fn new(name: &'static str, [m, k, n]: [usize; 3], dtype: DType) -> Self {
        Shape {
            name,
            m,
            n,
            k,
            rhs_t: false,
            lhs_t: false,
            dtype,
            inner: 1,
        }
    }

    /// A SmolLM2-135M training product at batch 8 × 1024 tokens, bf16, 10 per timed call.
    const fn train(name: &'static str, mkn: [usize; 3], rhs_t: bool, lhs_t: bool) -> Self {
        Shape {
            rhs_t,
            lhs_t,
            inner: 10,
            ..Shape::new(name, mkn, DType::BF16)
        }
    }
}

/// The products of a SmolLM2-135M training step (8 × 1024 tokens, hidden 576, K/V 192, MLP
/// 1536, vocabulary 49152): each projection's forward `x · w`, input gradient `dy · wᵀ` and
/// weight gradient `xᵀ · dy`, and the tied head's logits `x · Eᵀ`.
const TRAIN: &[Shape] = &[
    Shape::train("train q/o fwd", [8192, 576, 576], false, false),
    Shape::train("train k/v fwd", [8192, 576, 192], false, false),
    Shape::train("train up fwd", [8192, 576, 1536], false, false),
    Shape::train("train down fwd", [8192, 1536, 576], false, false),
    Shape::train("train up dx", [8192, 1536, 576], true, false),
    Shape::train("train k/v dx", [8192, 192, 576], true, false),
    Shape::train("train up dw", [576, 8192, 1536], false, true),
    Shape::train("train k/v dw", [576, 8192, 192], false, true),
    Shape::train("train down dw", [1536, 8192, 576], false, true),
    Shape {
        inner: 1,
        ..Shape::train("train logits", [8192, 576, 49152], true, false)
    },
];

const SHAPES: &[Shape] = &[
    Shape {
        name: "square",
        m: 8192,
        n: 8192,
        k: 8192,
        rhs_t: false,
        lhs_t: false,
        dtype: DType::F32,
        inner: 1,
    },
    Shape {
        name: "square",
        m: 8192,
        n: 8192,
        k: 8192,
        rhs_t: false,
        lhs_t: false,
        dtype: DType::BF16,
        inner: 1,
    },
    // ShadowKV's bench fill: keys from a rank-64 mix at a 128K context.
    Shape {
        name: "shadowkv-keys",
        m: 131072,
        n: 1024,
        k: 64,
        rhs_t: false,
        lhs_t: false,
        dtype: DType::F16,
        inner: 1,
    },
    // ShadowKV's projection onto the key basis (f32).
    Shape {
        name: "shadowkv-project",
        m: 131072,
        n: 160,
        k: 1024,
        rhs_t: true,
        lhs_t: false,
        dtype: DType::F32,
        inner: 1,
    },
    // CCE's chunk logits at the Gemma-2 shape: E · C_chunkᵀ.
    Shape {
        name: "cce-logits",
        m: 8192,
        n: 4096,
        k: 2304,
        rhs_t: true,
        lhs_t: false,
        dtype: DType::BF16,
        inner: 1,
    },
];

const QUICK: &[Shape] = &[
    Shape {
        name: "square",
        m: 256,
        n: 256,
        k: 256,
        rhs_t: false,
        lhs_t: false,
        dtype: DType::F32,
        inner: 1,
    },
    Shape {
        name: "odd",
        m: 131,
        n: 67,
        k: 97,
        rhs_t: true,
        lhs_t: false,
        dtype: DType::F32,
        inner: 1,
    },
];

pub fn suite(opts: SuiteOptions) -> Suite {
    let shapes: Vec<Shape> = if opts.quick {
        QUICK.to_vec()
    } else {
        SHAPES.iter().chain(TRAIN).copied().collect()
    };
    let problems = shapes
        .iter()
        .flat_map(|&s| {
            // The training products run without the `+add` epilogue variant.
            let adds: &[bool] = if s.inner > 1 || s.lhs_t {
                &[false]
            } else {
                &[false, true]
            };
            let opts = &opts;
            adds.iter()
                .map(move |&add| problem(s, add, opts))
                .collect::<Vec<_>>()
        })
        .collect();
    Suite {
        name: "gemm",
        description: "Burn's matmul (fused backend, autotuned) vs PyTorch's, at this workspace's shapes; outputs checked at sampled entries",
        baseline: "burn",
        problems,
        measure_memory: false,
        plot: None,
    }
}

fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "other",
    }
}

fn problem(s: Shape, add: bool, opts: &SuiteOptions) -> Problem {
    let peers = opts.peers_dir.clone();
    let Shape {
        m,
        n,
        k,
        rhs_t,
        lhs_t,
        dtype,
        inner,
        ..
    } = s;
    Problem {
        label: format!(
            "{} {m}x{n}x{k}{}{} {}{}{}",
            s.name,
            if lhs_t { " (lhs transposed)" } else { "" },
            if rhs_t { " (rhs transposed)" } else { "" },
            dtype_name(dtype),
            if add { " +add" } else { "" },
            // The times are per call: say how many products a call runs.
            if inner > 1 {
                format!(" x{inner} per call")
            } else {
                String::new()
            }
        ),
        params: params([
            ("shape", json!(s.name)),
            ("m", json!(m)),
            ("n", json!(n)),
            ("k", json!(k)),
            ("rhs_transposed", json!(rhs_t)),
            ("lhs_transposed", json!(lhs_t)),
            ("dtype", json!(dtype_name(dtype))),
            ("epilogue_add", json!(add)),
            ("products_per_call", json!(inner)),
        ]),
        flops: Some(2.0 * (m * n * k * inner) as f64),
        bytes: None,
        tokens: None,
        setup: Box::new(move |device| {
            let dtype = if device.supports_dtype(dtype) {
                dtype
            } else {
                DType::F32
            };
            let a = if lhs_t {
                random_tensor::<2>([k, m], Dist::STANDARD, 1, dtype, device).transpose()
            } else {
                random_tensor::<2>([m, k], Dist::STANDARD, 1, dtype, device)
            };
            let b = if rhs_t {
                random_tensor::<2>([n, k], Dist::STANDARD, 2, dtype, device).transpose()
            } else {
                random_tensor::<2>([k, n], Dist::STANDARD, 2, dtype, device)
            };
            let c = add.then(|| random_tensor::<2>([m, n], Dist::STANDARD, 3, dtype, device));
            // Burn's autotuned matmul, and for f16/bf16 core's fixed kernels by name. Not Burn's
            // at the training products: the model never runs it there, and on an H200 its
            // autotune's failed launches (cubek's TMA kernels on `cmma`) marked the memory of
            // every later product in the process as failed (2026-11-29).
            let mut impls: Vec<(&'static str, Option<GemmKernel>)> = Vec::new();
            if inner == 1 && !lhs_t {
                impls.push(("burn", None));
            }
            if matches!(dtype, DType::F16 | DType::BF16) {
                impls.push(("core specialized-tma", Some(GemmKernel::SpecializedTma)));
                impls.push(("core wgmma", Some(GemmKernel::Wgmma)));
            }
            // Checking each candidate chose its kernel process-wide: put back the one in force
            // before (each timed call chooses its own again).
            let before = gemm::default_kernel();
            let mut cands: Vec<Candidate> = impls
                .into_iter()
                .map(|(name, kernel)| burn_candidate(name, kernel, [&a, &b], c.as_ref(), inner))
                .collect();
            gemm::set_default_kernel(before);
            let tf32_modes: &[&str] = if dtype == DType::F32 {
                &["1", "0"]
            } else {
                &["1"]
            };
            for &tf32 in tf32_modes {
                let script = peers.join("gemm_torch.py");
                let name = if tf32 == "1" {
                    "pytorch"
                } else {
                    "pytorch (strict f32)"
                };
                let args = [
                    m.to_string(),
                    n.to_string(),
                    k.to_string(),
                    dtype_name(dtype).to_string(),
                    inner.to_string(),
                ];
                cands.push(Candidate::timed_elsewhere(name, move || {
                    let mut argv = vec![
                        "--m", &args[0], "--n", &args[1], "--k", &args[2], "--dtype", &args[3],
                        "--tf32", tf32, "--inner", &args[4],
                    ];
                    if rhs_t {
                        argv.push("--rhs-t");
                    }
                    if lhs_t {
                        argv.push("--lhs-t");
                    }
                    if add {
                        argv.push("--add");
                    }
                    run_python_peer(&script, &argv)
                }));
            }
            cands
        }),
    }
}

/// One Burn implementation of `a · b (+ c)`: Burn's autotuned matmul (`kernel` `None`) or core's
/// GEMM on `kernel`, run `inner` times per timed call; checked at sampled entries first, and
/// skipped with the reason when its output is wrong or unreadable.
fn burn_candidate<'a>(
    name: &'static str,
    kernel: Option<GemmKernel>,
    [a, b]: [&Tensor<2>; 2],
    c: Option<&Tensor<2>>,
    inner: usize,
) -> Candidate<'a> {
    let one = {
        let (a, b, c) = (a.clone(), b.clone(), c.cloned());
        move || {
            let out = match kernel {
                Some(kernel) => {
                    gemm::set_default_kernel(kernel);
                    gemm::matmul(a.clone(), b.clone())
                }
                None => a.clone().matmul(b.clone()),
            };
            match &c {
                Some(c) => out + c.clone(),
                None => out,
            }
        }
    };
    let check = sampled_error(&one(), a, b, c);
    let run = move || {
        for _ in 1..inner {
            keep(one());
        }
        keep(one())
    };
    match check {
        Ok(err) if err <= TOLERANCE => Candidate::timed_here(name, run).with_extra(move || Extra {
            params: params([("max_sampled_error", json!(err))]),
            note: Some(format!("sampled error {err:.1e} of the output's rms")),
        }),
        Ok(err) => Candidate::skipped(
            name,
            format!("wrong output: sampled error {err:.2e} of the output's rms"),
        ),
        Err(why) => Candidate::skipped(name, format!("output unreadable: {why}")),
    }
}

/// Largest sampled |error| over the output's sampled rms: at most this for TF32 or 16-bit
/// rounding (~1e-3 expected), far below what an unwritten or half-written output gives (≥ 1).
const TOLERANCE: f64 = 2e-2;

/// Compares `out` with f64 dot products at 509 sampled entries (the corners included) and
/// returns the largest |error| over the sampled reference's rms.
fn sampled_error(
    out: &Tensor<2>,
    a: &Tensor<2>,
    b: &Tensor<2>,
    c: Option<&Tensor<2>>,
) -> Result<f64, String> {
    let host = |t: &Tensor<2>| -> Result<Vec<f32>, String> {
        t.clone()
            .cast(DType::F32)
            .try_into_data()
            .map_err(|e| e.to_string())?
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| format!("{e:?}"))
    };
    let [m, k] = a.dims();
    let [_, n] = b.dims();
    let (o, av, bv) = (host(out)?, host(a)?, host(b)?);
    let cv = c.map(host).transpose()?;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |bound: usize| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) as usize) % bound
    };
    let mut points = vec![(0, 0), (m - 1, n - 1), (0, n - 1), (m - 1, 0)];
    points.extend((0..505).map(|_| (next(m), next(n))));
    let (mut worst, mut sq) = (0f64, 0f64);
    for &(i, j) in &points {
        let mut r: f64 = (0..k)
            .map(|p| av[i * k + p] as f64 * bv[p * n + j] as f64)
            .sum();
        if let Some(cv) = &cv {
            r += cv[i * n + j] as f64;
        }
        worst = worst.max((o[i * n + j] as f64 - r).abs());
        sq += r * r;
    }
    let rms = (sq / points.len() as f64).sqrt().max(f64::MIN_POSITIVE);
    Ok(worst / rms)
}

//! Burn's own matmul (the fused backend's autotuned GEMM) at the shapes this workspace runs,
//! against PyTorch's on the same GPU: the f32 square GEMM (TF32 where allowed), bf16, and the
//! ShadowKV and CCE shapes. Each Burn output is checked against f64 dot products at sampled
//! entries before it is timed, so a kernel that writes nothing (or half) fails instead of
//! timing fast.
//!
//! FLOPs: `2·m·n·k`. `+add` candidates add an `m × n` tensor to the product, which Burn's
//! fusion folds into the GEMM's epilogue.

use burn::tensor::{DType, Tensor};
use burn_kernels_testing::{Dist, random_tensor};
use serde_json::json;

use super::{SuiteOptions, run_python_peer};
use crate::harness::{Candidate, Extra, Problem, Suite, keep, params};

/// One GEMM: `[m, k] · [k, n]`, the right side stored `[n, k]` and transposed (a view) when
/// `rhs_t`, as `x · wᵀ` does.
#[derive(Debug, Clone, Copy)]
struct Shape {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    rhs_t: bool,
    dtype: DType,
}

const SHAPES: &[Shape] = &[
    Shape {
        name: "square",
        m: 8192,
        n: 8192,
        k: 8192,
        rhs_t: false,
        dtype: DType::F32,
    },
    Shape {
        name: "square",
        m: 8192,
        n: 8192,
        k: 8192,
        rhs_t: false,
        dtype: DType::BF16,
    },
    // ShadowKV's bench fill: keys from a rank-64 mix at a 128K context.
    Shape {
        name: "shadowkv-keys",
        m: 131072,
        n: 1024,
        k: 64,
        rhs_t: false,
        dtype: DType::F16,
    },
    // ShadowKV's projection onto the key basis (f32).
    Shape {
        name: "shadowkv-project",
        m: 131072,
        n: 160,
        k: 1024,
        rhs_t: true,
        dtype: DType::F32,
    },
    // CCE's chunk logits at the Gemma-2 shape: E · C_chunkᵀ.
    Shape {
        name: "cce-logits",
        m: 8192,
        n: 4096,
        k: 2304,
        rhs_t: true,
        dtype: DType::BF16,
    },
];

const QUICK: &[Shape] = &[
    Shape {
        name: "square",
        m: 256,
        n: 256,
        k: 256,
        rhs_t: false,
        dtype: DType::F32,
    },
    Shape {
        name: "odd",
        m: 131,
        n: 67,
        k: 97,
        rhs_t: true,
        dtype: DType::F32,
    },
];

pub fn suite(opts: SuiteOptions) -> Suite {
    let shapes = if opts.quick { QUICK } else { SHAPES };
    let problems = shapes
        .iter()
        .flat_map(|&s| [problem(s, false, &opts), problem(s, true, &opts)])
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
        dtype,
        ..
    } = s;
    Problem {
        label: format!(
            "{} {m}x{n}x{k}{} {}{}",
            s.name,
            if rhs_t { " (rhs transposed)" } else { "" },
            dtype_name(dtype),
            if add { " +add" } else { "" }
        ),
        params: params([
            ("shape", json!(s.name)),
            ("m", json!(m)),
            ("n", json!(n)),
            ("k", json!(k)),
            ("rhs_transposed", json!(rhs_t)),
            ("dtype", json!(dtype_name(dtype))),
            ("epilogue_add", json!(add)),
        ]),
        flops: Some(2.0 * (m * n * k) as f64),
        bytes: None,
        tokens: None,
        setup: Box::new(move |device| {
            let dtype = if device.supports_dtype(dtype) {
                dtype
            } else {
                DType::F32
            };
            let a = random_tensor::<2>([m, k], Dist::STANDARD, 1, dtype, device);
            let b = if rhs_t {
                random_tensor::<2>([n, k], Dist::STANDARD, 2, dtype, device).transpose()
            } else {
                random_tensor::<2>([k, n], Dist::STANDARD, 2, dtype, device)
            };
            let c = add.then(|| random_tensor::<2>([m, n], Dist::STANDARD, 3, dtype, device));
            let run = {
                let (a, b, c) = (a.clone(), b.clone(), c.clone());
                move || {
                    let out = a.clone().matmul(b.clone());
                    match &c {
                        Some(c) => out + c.clone(),
                        None => out,
                    }
                }
            };
            let check = sampled_error(&run(), &a, &b, c.as_ref());
            let mut cands = vec![match check {
                Ok(err) if err <= TOLERANCE => Candidate::timed_here("burn", move || keep(run()))
                    .with_extra(move || Extra {
                        params: params([("max_sampled_error", json!(err))]),
                        note: Some(format!("sampled error {err:.1e} of the output's rms")),
                    }),
                Ok(err) => Candidate::skipped(
                    "burn",
                    format!("wrong output: sampled error {err:.2e} of the output's rms"),
                ),
                Err(why) => Candidate::skipped("burn", format!("output unreadable: {why}")),
            }];
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
                ];
                cands.push(Candidate::timed_elsewhere(name, move || {
                    let mut argv = vec![
                        "--m", &args[0], "--n", &args[1], "--k", &args[2], "--dtype", &args[3],
                        "--tf32", tf32,
                    ];
                    if rhs_t {
                        argv.push("--rhs-t");
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

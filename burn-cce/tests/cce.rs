//! Cut Cross-Entropy on every enabled runtime, in the style of the official suite: an f32
//! ground truth (the plain path on the CPU), the same plain path in the input dtype on the
//! backend under test ("ref"), and CCE; CCE must be no further from the ground truth than ref
//! is, for the loss, dE, dC and db. Plus direct checks of the backend ops against the tensor-op
//! reference (forward, exact backward, filtered backward and its plan) and typed errors.

use burn::backend::{Dispatch, DispatchTensor};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_cce::{
    CceError, CceKernels, CceOptions, FilterEps, GemmKernel, GemmStrategy, LceParams, Reduction,
    diagnostics::{BackwardBlocks, DeAccumulation, last_backward_plan},
    linear_cross_entropy, reference,
};
use burn_kernels_core::route::launches;
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, compare::metrics, compare::to_f32, float_dtypes, is_wgpu,
    poison_memory, random_tensor, random_values, testgen,
};

use crate::kernels;

const IGNORE: i64 = -100;

#[derive(Debug, Clone)]
struct Case {
    /// `[batch, seq]` leading dims of the embeddings.
    lead: [usize; 2],
    d: usize,
    v: usize,
    /// Fraction of targets set to the ignore index.
    ignore: f32,
    softcap: Option<f32>,
    bias: bool,
    shift: bool,
    reduction: Reduction,
    filter: FilterEps,
    sort: bool,
    accum: bool,
    /// Vocabulary entries per chunk the case asks for (via `chunk_bytes`); `None`: automatic.
    chunk: Option<usize>,
    /// Most cases use the fixed GEMM: autotuning compiles ~30 candidate kernels per new shape
    /// (minutes per test on CUDA); one case runs the autotuned default.
    gemm: GemmStrategy,
    seed: u64,
}

impl Case {
    fn new(lead: [usize; 2], d: usize, v: usize, seed: u64) -> Self {
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
            chunk: Some(96),
            gemm: GemmStrategy::Fixed,
            seed,
        }
    }

    fn tokens(&self) -> usize {
        self.lead[0] * self.lead[1]
    }

    fn options(&self) -> CceOptions {
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
            gemm: self.gemm,
            tf32: true,
        }
    }
}

/// Host inputs: embeddings that lean towards their target's classifier row (so softmax is
/// peaky, as in a trained model, and filtering has something to skip), targets with a
/// fraction ignored, optional bias, and per-token loss weights.
struct Inputs {
    e: Vec<f32>,
    c: Vec<f32>,
    bias: Option<Vec<f32>>,
    targets: Vec<i64>,
    weights: Vec<f32>,
}

fn inputs(case: &Case) -> Inputs {
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
fn shifted(targets: &[i64], seq: usize) -> Vec<i64> {
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
struct Outcome {
    loss: Vec<f32>,
    de: Vec<f32>,
    dc: Vec<f32>,
    db: Option<Vec<f32>>,
}

fn tensor<const D: usize>(
    values: &[f32],
    shape: [usize; D],
    dtype: DType,
    device: &Device,
) -> Tensor<D> {
    let data = TensorData::new(values.to_vec(), shape).convert_dtype(dtype);
    Tensor::from_data(data, (device, dtype))
}

/// Values as the device holds them in `dtype`, back in f32 (the oracle sees rounded inputs).
fn rounded(values: &[f32], dtype: DType) -> Vec<f32> {
    to_f32(TensorData::new(values.to_vec(), [values.len()]).convert_dtype(dtype))
}

fn grads_of(
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
fn plain(case: &Case, x: &Inputs, dtype: DType, device: &Device) -> Outcome {
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

fn cce(case: &Case, x: &Inputs, dtype: DType, device: &Device) -> (Outcome, Vec<f32>) {
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

/// `max|gt − cce| ≤ max|gt − ref| + tol`, with `tol` one rounding in `dtype` of the largest
/// ground-truth value, times `1 + extra` where CCE rounds `extra` more times than ref (dE
/// accumulated in the input dtype over that many chunks).
///
/// Where f32 matrix products run in TF32 (CUDA), the rounding is TF32's (unit roundoff 2⁻¹¹),
/// not f32's: CCE and ref each carry independent TF32 errors of that size.
fn assert_no_worse(
    name: &str,
    gt: &[f32],
    cce: &[f32],
    reff: &[f32],
    (dtype, tf32): (DType, bool),
    extra: usize,
) {
    assert_eq!(gt.len(), cce.len(), "{name}: length");
    assert!(
        cce.iter().all(|x| x.is_finite()),
        "{name}: non-finite values in the CCE result"
    );
    let scale = gt.iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
    let tol = if tf32 && dtype == DType::F32 {
        Tolerance::tf32()
    } else {
        Tolerance::for_dtype(dtype)
    };
    let err_cce = metrics(cce, gt).max_abs;
    // A non-finite ref gives no slack.
    let err_ref = metrics(reff, gt).max_abs;
    let bound = err_ref + (1 + extra) as f64 * (tol.atol + tol.rtol * scale);
    assert!(
        err_cce <= bound,
        "{name}: max|gt − cce| = {err_cce:.3e} > max|gt − ref| = {err_ref:.3e} + tol \
         (bound {bound:.3e}, scale {scale:.3e}); cce vs gt: {}",
        metrics(cce, gt)
    );
}

fn run(device: &Device, case: &Case, dtype: DType) {
    let x = inputs(case);
    let host = Inputs {
        e: rounded(&x.e, dtype),
        c: rounded(&x.c, dtype),
        bias: x.bias.as_ref().map(|b| rounded(b, dtype)),
        targets: x.targets.clone(),
        weights: x.weights.clone(),
    };
    let gt = plain(case, &host, DType::F32, &Device::flex().autodiff());
    let reff = plain(case, &x, dtype, device);
    let (got, lse) = cce(case, &x, dtype, device);
    let name = format!("{case:?} {dtype:?}");
    let de_extra = de_roundings(case, dtype);
    let prec = (
        dtype,
        burn_kernels_testing::compare::f32_matmul_is_tf32(device),
    );
    assert_no_worse(
        &format!("loss {name}"),
        &gt.loss,
        &got.loss,
        &reff.loss,
        prec,
        0,
    );
    assert_no_worse(
        &format!("dE {name}"),
        &gt.de,
        &got.de,
        &reff.de,
        prec,
        de_extra,
    );
    assert_no_worse(&format!("dC {name}"), &gt.dc, &got.dc, &reff.dc, prec, 0);
    if let (Some(g), Some(c), Some(r)) = (&gt.db, &got.db, &reff.db) {
        assert_no_worse(&format!("db {name}"), g, c, r, prec, 0);
    }
    assert_eq!(lse.len(), case.tokens(), "lse covers every token");
    assert!(lse.iter().all(|x| x.is_finite()), "lse is finite: {name}");
}

/// Extra roundings of dE when it is accumulated in a 16-bit dtype: one per vocabulary chunk.
fn de_roundings(case: &Case, dtype: DType) -> usize {
    if case.accum || dtype == DType::F32 {
        return 0;
    }
    let chunk = params(case, None).grad_chunk_len(case.tokens(), case.v, case.d, dtype);
    case.v.div_ceil(chunk)
}

fn cases() -> Vec<Case> {
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
fn runs(device: &Device, k: usize, dtype: DType) -> bool {
    dtype == DType::F32 || !is_wgpu(device) || k == 0
}

fn loss_and_gradients(device: &Device) {
    for dtype in float_dtypes(device) {
        for (k, case) in cases().into_iter().enumerate() {
            if !runs(device, k, dtype) {
                continue;
            }
            let started = std::time::Instant::now();
            run(device, &case, dtype);
            eprintln!(
                "loss_and_gradients: case {k} {dtype:?} ok [{:.1} s]",
                started.elapsed().as_secs_f64()
            );
        }
    }
}

/// Backend ops against the tensor-op reference on the same rounded inputs.
struct OpInputs {
    e: Tensor<2>,
    c: Tensor<2>,
    bias: Option<Tensor<1>>,
    targets: Tensor<1, Int>,
}

fn op_inputs(case: &Case, dtype: DType, device: &Device) -> (OpInputs, OpInputs) {
    let x = inputs(case);
    let n = case.tokens();
    let targets: Vec<i64> = x.targets.iter().map(|&t| t.max(0)).collect();
    let make = |e: &[f32], c: &[f32], b: &Option<Vec<f32>>| (e.to_vec(), c.to_vec(), b.clone());
    let (e, c, b) = make(&x.e, &x.c, &x.bias);
    let dev = OpInputs {
        e: tensor::<2>(&e, [n, case.d], dtype, device),
        c: tensor::<2>(&c, [case.v, case.d], dtype, device),
        bias: b.as_ref().map(|b| tensor::<1>(b, [case.v], dtype, device)),
        targets: Tensor::from_data(TensorData::new(targets.clone(), [n]), device),
    };
    let cpu_dev = Device::flex();
    let cpu = OpInputs {
        e: tensor::<2>(&rounded(&e, dtype), [n, case.d], DType::F32, &cpu_dev),
        c: tensor::<2>(&rounded(&c, dtype), [case.v, case.d], DType::F32, &cpu_dev),
        bias: b
            .as_ref()
            .map(|b| tensor::<1>(&rounded(b, dtype), [case.v], DType::F32, &cpu_dev)),
        targets: Tensor::from_data(TensorData::new(targets, [n]), &cpu_dev),
    };
    (dev, cpu)
}

fn params(case: &Case, filter_eps: Option<f32>) -> LceParams {
    LceParams {
        filter_eps,
        ..case.options().params(DType::F32)
    }
}

fn float<const D: usize>(t: DispatchTensor) -> Tensor<D> {
    Tensor::from_dispatch(t)
}

/// [`CceKernels::linear_ce_forward`] (`_bias` with a bias) through Burn's `Dispatch`:
/// `(lse, target_logit)`.
fn forward_op(x: &OpInputs, p: LceParams) -> (Tensor<1>, Tensor<1>) {
    let (e, c, t) = (
        x.e.clone().into_dispatch(),
        x.c.clone().into_dispatch(),
        x.targets.clone().into_dispatch(),
    );
    let (lse, tl) = match &x.bias {
        None => Dispatch::linear_ce_forward(e, c, t, p),
        Some(b) => Dispatch::linear_ce_forward_bias(e, c, b.clone().into_dispatch(), t, p),
    };
    (float(lse), float(tl))
}

/// [`CceKernels::linear_ce_backward`] (`_bias` with a bias) through Burn's `Dispatch`:
/// `(dE, dC, db)`.
fn backward_op(
    x: &OpInputs,
    lse: &Tensor<1>,
    dout: &Tensor<1>,
    p: LceParams,
) -> (Tensor<2>, Tensor<2>, Option<Tensor<1>>) {
    let (e, c, t) = (
        x.e.clone().into_dispatch(),
        x.c.clone().into_dispatch(),
        x.targets.clone().into_dispatch(),
    );
    let (lse, dout) = (lse.clone().into_dispatch(), dout.clone().into_dispatch());
    match &x.bias {
        None => {
            let (de, dc) = Dispatch::linear_ce_backward(e, c, t, lse, dout, p);
            (float(de), float(dc), None)
        }
        Some(b) => {
            let b = b.clone().into_dispatch();
            let (de, dc, db) = Dispatch::linear_ce_backward_bias(e, c, b, t, lse, dout, p);
            (float(de), float(dc), Some(float(db)))
        }
    }
}

fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    to_f32(t.into_data())
}

/// Output of an f32-accumulated product whose inputs and output are stored in `dtype`:
/// element-wise for f32 (TF32 bound on CUDA), relative L2 within the dtype's rounding otherwise.
/// `extra` further roundings (a dE accumulated in the dtype) widen the relative-L2 bound like a
/// random walk.
fn assert_product_close(
    name: &str,
    actual: &[f32],
    expected: &[f32],
    len: usize,
    (dtype, extra): (DType, usize),
    device: &Device,
) {
    if dtype == DType::F32 {
        burn_kernels_testing::assert_matmul_close(name, actual, expected, len, device);
    } else {
        let m = metrics(actual, expected);
        let bound = Tolerance::for_dtype(dtype).rtol * ((1 + extra) as f64).sqrt();
        assert!(
            m.non_finite_mismatches == 0 && m.rel_l2 <= bound,
            "{name}: relative L2 {:.3e} above the {dtype:?} rounding {bound:.1e}\n  {m}",
            m.rel_l2
        );
    }
}

fn forward_matches_reference(device: &Device) {
    let before = launches("linear_ce_forward");
    for dtype in float_dtypes(device) {
        for (k, case) in cases().into_iter().enumerate() {
            if !runs(device, k, dtype) {
                continue;
            }
            let (dev, cpu) = op_inputs(&case, dtype, device);
            let p = params(&case, None);
            poison_memory(device, case.tokens() * case.v * 2, DType::F32);
            let (lse, tl) = forward_op(&dev, p);
            let (lse_ref, tl_ref) =
                reference::linear_ce_forward(cpu.e, cpu.c, cpu.bias, cpu.targets, case.softcap);
            let name = format!("{case:?} {dtype:?}");
            let (lse, tl) = (host(lse), host(tl));
            burn_kernels_testing::assert_matmul_close(
                &format!("lse {name}"),
                &lse,
                &to_f32(lse_ref.into_data()),
                case.d * case.v,
                device,
            );
            burn_kernels_testing::assert_matmul_close(
                &format!("target logit {name}"),
                &tl,
                &to_f32(tl_ref.into_data()),
                case.d,
                device,
            );
        }
    }
    // The outputs were read back: the chunked forward ran on CubeBackend (through Dispatch
    // and, where Burn fuses, Fusion).
    assert!(
        launches("linear_ce_forward") > before,
        "no linear_ce_forward launch counted"
    );
}

/// Reference scores: max over tokens of |softmax − onehot| per vocabulary entry, and the
/// reference lse, on the CPU.
fn host_scores(cpu: &OpInputs, cap: Option<f32>) -> (Vec<f32>, Tensor<1>) {
    let (lse, _) = reference::linear_ce_forward(
        cpu.e.clone(),
        cpu.c.clone(),
        cpu.bias.clone(),
        cpu.targets.clone(),
        cap,
    );
    let (logits, _) = reference::logits_f32(cpu.e.clone(), cpu.c.clone(), cpu.bias.clone(), cap);
    let p = (logits - lse.clone().unsqueeze_dim::<2>(1)).exp();
    let [n, v] = p.dims();
    let p = to_f32(p.into_data());
    let t = cpu.targets.to_data().try_into_vec_as::<i64>().unwrap();
    let mut score = vec![0f32; v];
    for i in 0..n {
        for j in 0..v {
            let g = if t[i] == j as i64 {
                (p[i * v + j] - 1.0).abs()
            } else {
                p[i * v + j]
            };
            score[j] = score[j].max(g);
        }
    }
    (score, lse)
}

/// An eps in the widest gap of the scores (on a log scale) between 1e-5 and 1e-1, so that no
/// entry sits on the boundary where rounding could flip it.
fn eps_in_gap(scores: &[f32]) -> f32 {
    let mut s: Vec<f32> = scores
        .iter()
        .copied()
        .filter(|&x| x > 1e-5 && x < 1e-1)
        .collect();
    s.sort_by(f32::total_cmp);
    s.windows(2)
        .max_by(|a, b| (a[1] / a[0]).total_cmp(&(b[1] / b[0])))
        .map(|w| (w[0] * w[1]).sqrt())
        .unwrap_or(1e-3)
}

fn backward_matches_reference(device: &Device) {
    for dtype in float_dtypes(device) {
        for (k, case) in cases().into_iter().enumerate() {
            if !runs(device, k, dtype) {
                continue;
            }
            let started = std::time::Instant::now();
            let (dev, cpu) = op_inputs(&case, dtype, device);
            let n = case.tokens();
            let (scores, lse_ref) = host_scores(&cpu, case.softcap);
            let dout = random_values(n, Dist::Uniform { lo: 0.5, hi: 1.5 }, case.seed + 9);
            // Odd cases filter at an eps between score levels: the kernels must drop exactly
            // the entries (sorted) or chunks (unsorted) the host scores say, and nothing else.
            let eps = (k % 2 == 1).then(|| eps_in_gap(&scores));
            let chunk = params(&case, eps).grad_chunk_len(n, case.v, case.d, dtype);
            let keep: Vec<bool> = match eps {
                None => vec![true; case.v],
                Some(eps) if case.sort => scores.iter().map(|&s| s >= eps).collect(),
                Some(eps) => {
                    let mut keep = vec![false; case.v];
                    for v0 in (0..case.v).step_by(chunk) {
                        let v1 = (v0 + chunk).min(case.v);
                        let any = scores[v0..v1].iter().any(|&s| s >= eps);
                        keep[v0..v1].iter_mut().for_each(|x| *x = any);
                    }
                    keep
                }
            };
            let lse_dev = Tensor::<1>::from_data(lse_ref.to_data(), (device, DType::F32));
            let dout_dev =
                Tensor::<1>::from_data(TensorData::new(dout.clone(), [n]), (device, DType::F32));
            poison_memory(device, n * case.v * 2, DType::F32);
            let (de, dc, db) = backward_op(&dev, &lse_dev, &dout_dev, params(&case, eps));
            // Read back first: under Burn's fusion the op runs when its outputs are read, and
            // records its plan then.
            let (de, dc, db) = (host(de), host(dc), db.map(host));
            if eps.is_some() {
                let stats = last_backward_plan().expect("a plan was recorded");
                assert_eq!(
                    stats.entries,
                    keep.iter().filter(|&&k| k).count(),
                    "{case:?} {dtype:?}: entries processed at eps {eps:?}"
                );
            }
            // The reference with the dropped vocabulary columns' gradient removed: dC rows
            // and db entries of dropped entries are 0, dE lacks their contribution.
            let mask = Tensor::<1>::from_data(
                TensorData::new(keep.iter().map(|&k| k as u8 as f32).collect(), [case.v]),
                &Device::flex(),
            );
            let (de_ref, dc_ref, db_ref) =
                masked_reference_backward(&cpu, lse_ref, &dout, &mask, case.softcap);
            let name = format!("{case:?} {dtype:?} eps={eps:?}");
            let de_extra = de_roundings(&case, dtype);
            assert_product_close(
                &format!("dE {name}"),
                &de,
                &de_ref,
                case.v,
                (dtype, de_extra),
                device,
            );
            assert_product_close(&format!("dC {name}"), &dc, &dc_ref, n, (dtype, 0), device);
            if let (Some(db), Some(db_ref)) = (db, db_ref) {
                assert_product_close(&format!("db {name}"), &db, &db_ref, n, (dtype, 0), device);
            }
            eprintln!(
                "backward_matches_reference: case {k} {dtype:?} ok [{:.1} s]",
                started.elapsed().as_secs_f64()
            );
        }
    }
}

/// dE accumulated in blocks of rows — a second pass over regrouped vocabulary chunks with f32
/// accumulation, or row-blocked products added into dE — against one block of all rows (the
/// single pass, as before blocks existed) and the masked reference: awkward sizes, 32-entry
/// vocabulary chunks (a 21-entry tail, pairs regrouped in the second pass) and 13 row blocks
/// (a 3-row tail).
fn blocked_backward_matches_single_pass(device: &Device) {
    let base = Case {
        chunk: Some(32),
        ..Case::new([3, 53], 150, 1013, 31)
    };
    let cases = [
        Case {
            bias: true,
            softcap: Some(5.0),
            ..base.clone()
        },
        Case {
            sort: false,
            ..base.clone()
        },
        Case {
            filter: FilterEps::Off,
            bias: true,
            ..base.clone()
        },
        Case {
            accum: false,
            ..base.clone()
        },
    ];
    const ROWS: usize = 13;
    for dtype in float_dtypes(device) {
        for (k, case) in cases.iter().enumerate() {
            // On wgpu 16-bit dtypes run the base case (see `runs`).
            if !runs(device, k, dtype) {
                continue;
            }
            let n = case.tokens();
            let (scores, lse_ref) = host_scores(&op_inputs(case, dtype, device).1, case.softcap);
            let eps = (case.filter != FilterEps::Off).then(|| eps_in_gap(&scores));
            let dout = random_values(n, Dist::Uniform { lo: 0.5, hi: 1.5 }, case.seed + 9);
            let name = format!("{case:?} {dtype:?} eps={eps:?}");
            let run = |rows: usize| {
                let (dev, _) = op_inputs(case, dtype, device);
                let lse = Tensor::<1>::from_data(lse_ref.to_data(), (device, DType::F32));
                let dout = Tensor::<1>::from_data(
                    TensorData::new(dout.clone(), [n]),
                    (device, DType::F32),
                );
                let p = LceParams {
                    de_block_rows: Some(rows),
                    ..params(case, eps)
                };
                poison_memory(device, n * case.v * 2, DType::F32);
                let (de, dc, db) = backward_op(&dev, &lse, &dout, p);
                // Read back before the plan: under fusion the op runs when read.
                let (de, dc, db) = (host(de), host(dc), db.map(host));
                let stats = last_backward_plan().expect("a plan was recorded");
                let blocks = BackwardBlocks::new(&p, n, case.v, case.d, dtype);
                (de, dc, db, stats, blocks)
            };
            let (de, dc, db, stats, blocks) = run(ROWS);
            let (de_one, dc_one, db_one, stats_one, _) = run(usize::MAX);
            assert!(stats.chunks > 2, "{name}: several vocabulary chunks");
            if case.accum && dtype != DType::F32 {
                assert_eq!(blocks.de, DeAccumulation::RowBlocks, "{name}");
                assert!(
                    blocks.pass2_chunk > blocks.chunk,
                    "{name}: the second pass regroups chunks ({blocks:?})"
                );
                assert_eq!(stats.de_row_blocks, n.div_ceil(ROWS), "{name}");
            } else {
                assert_eq!(blocks.de, DeAccumulation::Direct, "{name}");
                assert_eq!(stats.de_row_blocks, 0, "{name}");
            }
            assert_eq!(stats_one.de_row_blocks, 0, "{name}: one block");
            assert_eq!(stats.entries, stats_one.entries, "{name}: same plan");
            // dC and db come from the same chunk GEMMs either way.
            assert_eq!(dc, dc_one, "dC {name}");
            assert_eq!(db, db_one, "db {name}");
            // dE: the same f32 sums in another order, rounded once (or once per chunk).
            let de_extra = de_roundings(case, dtype);
            assert_product_close(
                &format!("dE blocked vs one block {name}"),
                &de,
                &de_one,
                case.v,
                (dtype, de_extra),
                device,
            );

            let cpu = op_inputs(case, dtype, device).1;
            let keep: Vec<bool> = match eps {
                None => vec![true; case.v],
                Some(eps) if case.sort => scores.iter().map(|&s| s >= eps).collect(),
                Some(eps) => {
                    let mut keep = vec![false; case.v];
                    for v0 in (0..case.v).step_by(blocks.chunk) {
                        let v1 = (v0 + blocks.chunk).min(case.v);
                        let any = scores[v0..v1].iter().any(|&s| s >= eps);
                        keep[v0..v1].iter_mut().for_each(|x| *x = any);
                    }
                    keep
                }
            };
            let mask = Tensor::<1>::from_data(
                TensorData::new(keep.iter().map(|&k| k as u8 as f32).collect(), [case.v]),
                &Device::flex(),
            );
            let (de_ref, dc_ref, db_ref) =
                masked_reference_backward(&cpu, lse_ref.clone(), &dout, &mask, case.softcap);
            assert_product_close(
                &format!("dE {name}"),
                &de,
                &de_ref,
                case.v,
                (dtype, de_extra),
                device,
            );
            assert_product_close(&format!("dC {name}"), &dc, &dc_ref, n, (dtype, 0), device);
            if let (Some(db), Some(db_ref)) = (db, db_ref) {
                assert_product_close(&format!("db {name}"), &db, &db_ref, n, (dtype, 0), device);
            }
        }
    }
}

/// The analytic working set of the backward at the benchmark shapes (8192 tokens, bf16,
/// default options): the numbers documented in `burn_cce::diagnostics::BackwardBlocks`.
#[test]
fn working_set_at_bench_shapes() {
    let params = CceOptions::default().params(DType::BF16);
    let n = 8192;
    // (V, D, chunk, dE rows, second-pass chunk, working bytes)
    let shapes = [
        (256_000, 2304, 672, 1184, 2016, 36_126_720),
        (49_152, 576, 256, 2048, 512, 12_877_824),
    ];
    for (v, d, chunk, rows, pass2_chunk, working) in shapes {
        let blocks = BackwardBlocks::new(&params, n, v, d, DType::BF16);
        assert_eq!(
            blocks,
            BackwardBlocks {
                chunk,
                de: DeAccumulation::RowBlocks,
                rows,
                pass2_chunk,
            },
            "V={v} D={d}"
        );
        let bytes = blocks.working_bytes(n, d, DType::BF16, false);
        let bound = 2 * (n + v) * d;
        println!(
            "V={v} D={d}: working set {bytes} B, peak {} B = {:.4}× dE + dC ({bound} B)",
            bound + bytes,
            (bound + bytes) as f64 / bound as f64
        );
        assert_eq!(bytes, working, "V={v} D={d}");
    }
    // Gemma-2: within the 1.05× of dE + dC.
    let bound = 2 * (n + 256_000) * 2304;
    assert!((bound + 36_126_720) as f64 <= 1.05 * bound as f64);
}

/// The live-memory peak the chunked path reports (`track_live_peak`) brackets what it must
/// hold: the forward at least its logits block (`pass_chunk_bytes`) and at most that plus
/// `O(n + V)` vectors; the backward at least dE + dC, at most dE + dC plus the designed
/// working set (`BackwardBlocks::working_bytes`) and `O(n + V)` vectors.
fn live_peak_brackets_the_working_set(device: &Device) {
    for dtype in float_dtypes(device) {
        let case = Case {
            chunk: Some(512),
            ..Case::new([3, 347], 128, 4099, 41)
        };
        let (n, v, d, s) = (case.tokens(), case.v, case.d, dtype.size());
        // Vectors of n or V entries (lse, scores and their parts, ids): small beside the
        // blocks below.
        let small = 16 * 4 * (n + v);
        let name = format!("{dtype:?}");

        let pass_chunk = 640;
        let p = LceParams {
            chunk_bytes: None,
            pass_chunk_bytes: Some(4 * n * pass_chunk),
            ..params(&case, None)
        };
        let (dev, _) = op_inputs(&case, dtype, device);
        let forward = || forward_op(&dev, p).0;
        // Tracked after a first call: compilation and autotuning stay out, as in benchmarks.
        // (`track_live_peak` synchronizes the device first: the deferred first call runs
        // before the tracking starts.)
        let mut lse = Some(forward());
        let peak = burn_cce::track_live_peak(device, || lse = Some(forward()))
            .expect("the chunked forward reads the pool")
            .bytes;
        let block = 4 * n * pass_chunk;
        assert!(
            (block..block + small).contains(&(peak as usize)),
            "forward {name}: live peak {peak} B, logits block {block} B"
        );

        let p = params(&case, Some(1e-4));
        let blocks = BackwardBlocks::new(&p, n, v, d, dtype);
        let dout = Tensor::<1>::full([n], 1.0 / n as f32, (device, DType::F32));
        let lse = lse.expect("the forward ran");
        // The outputs are kept until the device has synchronized (inside `track_live_peak`),
        // so that the deferred op runs whatever the fusion stream does with dropped outputs.
        let backward = || backward_op(&dev, &lse, &dout, p);
        let mut _grads = Some(backward());
        let live = burn_cce::track_live_peak(device, || _grads = Some(backward()))
            .expect("the chunked backward reads the pool");
        let peak = live.bytes as usize;
        let grads = s * (n + v) * d;
        let working = blocks.working_bytes(n, d, dtype, false);
        println!(
            "{name}: backward live peak {peak} B (after \"{}\") = dE + dC {grads} B + {} B \
             (designed working set {working} B)",
            live.step,
            peak.saturating_sub(grads)
        );
        assert!(
            (grads..grads + working + small).contains(&peak),
            "backward {name}: live peak {peak} B, dE + dC {grads} B, working set {working} B \
             ({blocks:?})"
        );
    }
}

/// The exact reference gradient with the logit-gradient columns outside `mask` zeroed.
fn masked_reference_backward(
    cpu: &OpInputs,
    lse: Tensor<1>,
    dout: &[f32],
    mask: &Tensor<1>,
    cap: Option<f32>,
) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    let n = dout.len();
    let dout = Tensor::<1>::from_data(TensorData::new(dout.to_vec(), [n]), &Device::flex());
    // G = dL/dlogits from the reference, so that dropped columns can be zeroed.
    let g = reference::logit_grad(
        cpu.e.clone(),
        cpu.c.clone(),
        cpu.bias.clone(),
        cpu.targets.clone(),
        lse,
        dout,
        cap,
    );
    let [_, v] = g.dims();
    let g = g * mask.clone().unsqueeze_dim::<2>(0);
    let de = to_f32(g.clone().matmul(cpu.c.clone()).into_data());
    let dc = to_f32(g.clone().transpose().matmul(cpu.e.clone()).into_data());
    let db = cpu
        .bias
        .as_ref()
        .map(|_| to_f32(g.sum_dim(0).reshape([v]).into_data()));
    (de, dc, db)
}

fn all_ignored(device: &Device) {
    for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        let e = Tensor::<3>::ones([2, 5, 8], device).require_grad();
        let c = Tensor::<2>::ones([11, 8], device).require_grad();
        let t = Tensor::<2, Int>::full([2, 5], IGNORE, device);
        let opts = CceOptions {
            reduction,
            ..Default::default()
        };
        let loss = linear_cross_entropy(e, c, t, None, &opts).unwrap().loss;
        let v = to_f32(loss.into_data());
        let len = if reduction == Reduction::None { 10 } else { 1 };
        assert_eq!(
            v,
            vec![0.0; len],
            "{reduction:?}: every token ignored gives 0"
        );
    }
    // With shift and one position per sequence, every target falls off the end.
    let e = Tensor::<3>::ones([3, 1, 8], device);
    let c = Tensor::<2>::ones([11, 8], device);
    let t = Tensor::<2, Int>::from_ints([[1], [2], [3]], device);
    let opts = CceOptions {
        shift: true,
        ..Default::default()
    };
    let loss = linear_cross_entropy(e, c, t, None, &opts).unwrap().loss;
    assert_eq!(to_f32(loss.into_data()), vec![0.0]);
}

fn typed_errors(device: &Device) {
    let e = || Tensor::<3>::ones([2, 3, 8], device);
    let c = || Tensor::<2>::ones([10, 8], device);
    let t = |v: i64| {
        Tensor::<2, Int>::from_data(TensorData::new(vec![1, 2, 3, 4, v, 5], [2, 3]), device)
    };
    let o = CceOptions::default();
    let err = |r: Result<_, CceError>| r.expect_err("an error");
    assert_eq!(
        err(linear_cross_entropy(e(), c(), t(10), None, &o)),
        CceError::TargetOutOfRange {
            position: 4,
            value: 10,
            vocab: 10
        }
    );
    assert_eq!(
        err(linear_cross_entropy(e(), c(), t(-1), None, &o)),
        CceError::TargetOutOfRange {
            position: 4,
            value: -1,
            vocab: 10
        }
    );
    assert_eq!(
        err(linear_cross_entropy(
            e(),
            Tensor::<2>::ones([10, 7], device),
            t(0),
            None,
            &o
        )),
        CceError::HiddenSizeMismatch {
            embeddings: 8,
            classifier: 7
        }
    );
    assert!(matches!(
        err(linear_cross_entropy(
            e(),
            c(),
            Tensor::<2, Int>::zeros([3, 2], device),
            None,
            &o
        )),
        CceError::TargetShapeMismatch { .. }
    ));
    assert!(matches!(
        err(linear_cross_entropy(
            e(),
            c(),
            t(0),
            Some(Tensor::<1>::ones([9], device)),
            &o
        )),
        CceError::BiasShapeMismatch { .. }
    ));
    let bad_cap = CceOptions {
        softcap: Some(0.0),
        ..o
    };
    assert_eq!(
        err(linear_cross_entropy(e(), c(), t(0), None, &bad_cap)),
        CceError::InvalidSoftcap(0.0)
    );
    let bad_eps = CceOptions {
        filter_eps: FilterEps::Value(f32::NAN),
        ..o
    };
    assert!(matches!(
        err(linear_cross_entropy(e(), c(), t(0), None, &bad_eps)),
        CceError::InvalidFilterEps(_)
    ));
    assert_eq!(
        err(linear_cross_entropy(
            e(),
            Tensor::<2>::ones([0, 8], device),
            t(0),
            None,
            &o
        )),
        CceError::EmptyVocabulary
    );
}

/// The CPU reference path (Flex) runs the same checks without a GPU runtime.
#[test]
fn cpu_loss_and_gradients() {
    let device = Device::flex().autodiff();
    for case in cases() {
        run(&device, &case, DType::F32);
    }
}

#[test]
fn cpu_all_ignored_and_errors() {
    all_ignored(&Device::flex().autodiff());
    typed_errors(&Device::flex());
}

#[test]
fn plain_ce_matches_host_f64() {
    // The oracle itself against a direct f64 computation on a tiny case.
    let case = Case {
        softcap: Some(3.0),
        bias: true,
        ignore: 0.3,
        ..Case::new([2, 3], 5, 7, 21)
    };
    let x = inputs(&case);
    let out = plain(&case, &x, DType::F32, &Device::flex().autodiff());
    let (n, d, v) = (case.tokens(), case.d, case.v);
    let mut total = 0f64;
    let mut valid = 0usize;
    for i in 0..n {
        if x.targets[i] == IGNORE {
            continue;
        }
        let logits: Vec<f64> = (0..v)
            .map(|j| {
                let dot: f64 = (0..d)
                    .map(|k| x.e[i * d + k] as f64 * x.c[j * d + k] as f64)
                    .sum();
                let raw = dot + x.bias.as_ref().unwrap()[j] as f64;
                3.0 * (raw / 3.0).tanh()
            })
            .collect();
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + logits.iter().map(|l| (l - m).exp()).sum::<f64>().ln();
        total += lse - logits[x.targets[i] as usize];
        valid += 1;
    }
    let expected = (total / valid as f64) as f32;
    assert_close(
        "plain CE vs f64",
        &out.loss,
        &[expected],
        Tolerance::for_reduction(DType::F32, v),
    );
}

/// The extension called on the unfused `CubeBackend` directly (outside Burn's `Dispatch` and
/// `Fusion`) gives exactly the `Dispatch` (fused) results: the same kernels on the same inputs,
/// for the forward and the filtered backward with a bias and softcap, and the row-wise
/// log-sum-exp.
#[cfg(feature = "cube")]
fn unfused_backend_matches_dispatch(device: &Device) {
    use burn_cubecl::CubeBackend;
    use burn_kernels_testing::unfused::{float as unfused, int, read_float};

    let case = Case {
        bias: true,
        softcap: Some(4.0),
        chunk: Some(64),
        ..Case::new([2, 37], 48, 301, 51)
    };
    let n = case.tokens();
    for dtype in float_dtypes(device) {
        let name = format!("{dtype:?}");
        let (x, _) = op_inputs(&case, dtype, device);
        let bias = x.bias.as_ref().expect("the case has a bias");
        let p = params(&case, Some(1e-4));

        let (lse, tl) = forward_op(&x, p);
        let (lse_u, tl_u) = <CubeBackend as CceKernels>::linear_ce_forward_bias(
            unfused(&x.e, device),
            unfused(&x.c, device),
            unfused(bias, device),
            int(&x.targets, device),
            p,
        );
        assert_eq!(to_f32(read_float(lse_u)), host(lse.clone()), "lse {name}");
        assert_eq!(to_f32(read_float(tl_u)), host(tl), "target logit {name}");

        let dout = Tensor::<1>::from_data(
            TensorData::new(
                random_values(n, Dist::Uniform { lo: 0.5, hi: 1.5 }, 52),
                [n],
            ),
            (device, DType::F32),
        );
        let (de, dc, db) = backward_op(&x, &lse, &dout, p);
        let (de_u, dc_u, db_u) = <CubeBackend as CceKernels>::linear_ce_backward_bias(
            unfused(&x.e, device),
            unfused(&x.c, device),
            unfused(bias, device),
            int(&x.targets, device),
            unfused(&lse, device),
            unfused(&dout, device),
            p,
        );
        assert_eq!(to_f32(read_float(de_u)), host(de), "dE {name}");
        assert_eq!(to_f32(read_float(dc_u)), host(dc), "dC {name}");
        assert_eq!(to_f32(read_float(db_u)), host(db.expect("db")), "db {name}");

        let logits = random_tensor::<2>([7, 333], Dist::PEAKY, 53, dtype, device);
        let via_dispatch = Tensor::<1>::from_dispatch(Dispatch::logsumexp_rows(
            logits.clone().into_dispatch(),
            Some(3.0),
        ));
        let direct = CubeBackend::logsumexp_rows(unfused(&logits, device), Some(3.0));
        assert_eq!(
            to_f32(read_float(direct)),
            host(via_dispatch),
            "logsumexp {name}"
        );
    }
}

testgen! {
    backend: [
        forward_matches_reference,
        backward_matches_reference,
        blocked_backward_matches_single_pass,
        live_peak_brackets_the_working_set,
        typed_errors,
        unfused_backend_matches_dispatch,
    ],
    autodiff: [loss_and_gradients, all_ignored],
}

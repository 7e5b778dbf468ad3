//! The backend ops through Burn's `Dispatch`, their inputs, and host-side references for them.

use burn::backend::{Dispatch, DispatchTensor};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_cce::{CceKernels, LceParams, reference};
use burn_kernels_testing::{Tolerance, compare::metrics, compare::to_f32};

use super::case::*;
use super::loss::de_roundings;

/// Backend ops against the tensor-op reference on the same rounded inputs.
pub(super) struct OpInputs {
    pub(super) e: Tensor<2>,
    pub(super) c: Tensor<2>,
    pub(super) bias: Option<Tensor<1>>,
    pub(super) targets: Tensor<1, Int>,
}

pub(super) fn op_inputs(case: &Case, dtype: DType, device: &Device) -> (OpInputs, OpInputs) {
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

pub(super) fn params(case: &Case, filter_eps: Option<f32>) -> LceParams {
    LceParams {
        filter_eps,
        ..case.options().params(DType::F32)
    }
}

pub(super) fn float<const D: usize>(t: DispatchTensor) -> Tensor<D> {
    Tensor::from_dispatch(t)
}

/// [`CceKernels::linear_ce_forward`] (`_bias` with a bias) through Burn's `Dispatch`:
/// `(lse, target_logit)`.
pub(super) fn forward_op(x: &OpInputs, p: LceParams) -> (Tensor<1>, Tensor<1>) {
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
pub(super) fn backward_op(
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

pub(super) fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    to_f32(t.into_data())
}

/// The forward's `(lse, target_logit)` read back against the reference's: each a product
/// `D · V` (the log-sum-exp) or `D` (the target logit) deep.
pub(super) fn assert_forward_close(
    name: &str,
    (lse, tl): (&[f32], &[f32]),
    (lse_ref, tl_ref): (Tensor<1>, Tensor<1>),
    case: &Case,
    device: &Device,
) {
    burn_kernels_testing::assert_matmul_close(
        &format!("lse {name}"),
        lse,
        &to_f32(lse_ref.into_data()),
        case.d * case.v,
        device,
    );
    burn_kernels_testing::assert_matmul_close(
        &format!("target logit {name}"),
        tl,
        &to_f32(tl_ref.into_data()),
        case.d,
        device,
    );
}

/// Output of an f32-accumulated product whose inputs and output are stored in `dtype`:
/// element-wise for f32 (TF32 bound on CUDA), relative L2 within the dtype's rounding otherwise.
/// `extra` further roundings (a dE accumulated in the dtype) widen the relative-L2 bound like a
/// random walk.
pub(super) fn assert_product_close(
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

/// Reference scores: max over tokens of |softmax − onehot| per vocabulary entry, and the
/// reference lse, on the CPU.
pub(super) fn host_scores(cpu: &OpInputs, cap: Option<f32>) -> (Vec<f32>, Tensor<1>) {
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
pub(super) fn eps_in_gap(scores: &[f32]) -> f32 {
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

/// The exact reference gradient with the logit-gradient columns outside `mask` zeroed.
pub(super) fn masked_reference_backward(
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

/// Which vocabulary entries a backward filtered at `eps` processes: all without `eps`; sorted,
/// the entries whose host score reaches `eps`; unsorted, every entry of a `chunk`-entry chunk
/// where one does.
pub(super) fn kept_entries(
    scores: &[f32],
    eps: Option<f32>,
    sorted: bool,
    chunk: usize,
) -> Vec<bool> {
    let v = scores.len();
    match eps {
        None => vec![true; v],
        Some(eps) if sorted => scores.iter().map(|&s| s >= eps).collect(),
        Some(eps) => {
            let mut keep = vec![false; v];
            for v0 in (0..v).step_by(chunk) {
                let v1 = (v0 + chunk).min(v);
                let any = scores[v0..v1].iter().any(|&s| s >= eps);
                keep[v0..v1].iter_mut().for_each(|x| *x = any);
            }
            keep
        }
    }
}

/// The reference backward with the dropped entries' gradient removed (their dC rows and db
/// entries 0, dE without their contribution), for one case's inputs.
pub(super) struct MaskedCheck<'a> {
    pub(super) case: &'a Case,
    pub(super) cpu: &'a OpInputs,
    pub(super) lse: Tensor<1>,
    pub(super) dout: &'a [f32],
    pub(super) keep: &'a [bool],
    pub(super) dtype: DType,
}

impl MaskedCheck<'_> {
    /// Checks an op's `(dE, dC, db)` against the masked reference: dE within the product
    /// tolerance over the vocabulary plus the case's extra roundings, dC and db over the rows.
    pub(super) fn assert_matches(
        self,
        name: &str,
        (de, dc, db): (&[f32], &[f32], Option<&Vec<f32>>),
        device: &Device,
    ) {
        let (case, dtype, n) = (self.case, self.dtype, self.dout.len());
        let mask = Tensor::<1>::from_data(
            TensorData::new(
                self.keep.iter().map(|&k| k as u8 as f32).collect(),
                [case.v],
            ),
            &Device::flex(),
        );
        let (de_ref, dc_ref, db_ref) =
            masked_reference_backward(self.cpu, self.lse, self.dout, &mask, case.softcap);
        let de_extra = de_roundings(case, dtype);
        assert_product_close(
            &format!("dE {name}"),
            de,
            &de_ref,
            case.v,
            (dtype, de_extra),
            device,
        );
        assert_product_close(&format!("dC {name}"), dc, &dc_ref, n, (dtype, 0), device);
        if let (Some(db), Some(db_ref)) = (db, db_ref) {
            assert_product_close(&format!("db {name}"), db, &db_ref, n, (dtype, 0), device);
        }
    }
}

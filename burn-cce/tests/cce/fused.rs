//! The fused passes (`PassKernels::Fused`) against the tensor-op reference: the ops on awkward
//! sizes (one token, prime and tail counts, every hidden size class up to 576, a soft cap), and
//! the whole loss under autodiff (shift, ignored tokens, sum reduction). They run on CUDA, the
//! runtime with the manual MMA they need; each check also asserts the fused kernels launched,
//! so a silent fall-back to the chunked passes fails. Elsewhere the loss check asserts the
//! fall-back: the chunked passes' result and no fused launch.

use std::sync::{Mutex, MutexGuard};

use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_cce::kernels::fused::TILE;
use burn_cce::{CceKernels, FilterEps, PassKernels, Reduction, reference};
use burn_kernels_core::route::launches;
use burn_kernels_testing::{Dist, is_cuda, poison_memory, random_values};

use super::case::*;
use super::loss::{de_roundings, run};
use super::ops::*;

/// The 16-bit dtypes the fused kernels take.
const DTYPES: [DType; 2] = [DType::BF16, DType::F16];

fn fused(case: Case) -> Case {
    Case {
        passes: PassKernels::Fused,
        filter: FilterEps::Off,
        ..case
    }
}

/// `[1, n]` tokens, hidden size, vocabulary, seed; one with a soft cap.
fn op_cases() -> Vec<Case> {
    vec![
        fused(Case::new([1, 1], 64, 61, 41)),
        fused(Case {
            softcap: Some(4.0),
            ..Case::new([1, 67], 128, 1000, 42)
        }),
        fused(Case::new([2, 65], 576, 4099, 43)),
        fused(Case::new([1, 257], 192, 193, 44)),
    ]
}

/// The fused checks count the fused launches (a process-wide counter): one check at a time,
/// so that each counts only its own.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Whether the fused kernels can be checked on `device`, and then the lock that keeps the other
/// fused check out; a line saying so where they cannot.
fn fused_runs(device: &Device, test: &str) -> Option<MutexGuard<'static, ()>> {
    if !is_cuda(device) {
        eprintln!("{test}: the fused passes need CUDA's manual MMA; nothing to check here");
        return None;
    }
    Some(ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner()))
}

pub(super) fn fused_ops_match_reference(device: &Device) {
    let Some(_one) = fused_runs(device, "fused_ops_match_reference") else {
        return;
    };
    every_op_case(
        ["cce_fused_forward", "cce_fused_backward"],
        |case, dtype, _| check_ops(case, dtype, None, device),
    );
}

/// Runs `check` on every op case in every 16-bit dtype (with the number of checks before it),
/// then asserts that each check launched each of the `kernels` once: none fell back to the
/// chunked passes.
fn every_op_case(kernels: [&'static str; 2], mut check: impl FnMut(&Case, DType, u64)) {
    let before = kernels.map(launches);
    let mut checked = 0u64;
    for dtype in DTYPES {
        for case in op_cases() {
            check(&case, dtype, checked);
            checked += 1;
        }
    }
    let after = kernels.map(launches);
    assert_eq!(
        [after[0] - before[0], after[1] - before[1]],
        [checked; 2],
        "launches of {kernels:?}"
    );
}

/// The reference forward `(lse, target_logit)` of `cpu`'s inputs (no bias), on the CPU.
fn reference_forward(cpu: &OpInputs, case: &Case) -> (Tensor<1>, Tensor<1>) {
    reference::linear_ce_forward(
        cpu.e.clone(),
        cpu.c.clone(),
        None,
        cpu.targets.clone(),
        case.softcap,
    )
}

/// A loss gradient for each of `case`'s tokens, seeded by the case: away from 0 and 1, so that
/// a gradient left unscaled or scaled twice fails.
fn loss_gradient(case: &Case) -> Vec<f32> {
    random_values(
        case.tokens(),
        Dist::Uniform { lo: 0.5, hi: 1.5 },
        case.seed + 9,
    )
}

/// The fused forward and backward ops on `case` in `dtype` (with the gradient filter at
/// `filter_eps`) against the reference whose logit gradients outside `keep` (per vocabulary
/// entry; `None`: all kept) are zeroed, outputs over poisoned memory.
fn check_ops(case: &Case, dtype: DType, filter: Option<(f32, &[bool])>, device: &Device) {
    let filter_eps = filter.map(|(eps, _)| eps);
    let name = format!("fused {case:?} {dtype:?} filter {filter_eps:?}");
    let (dev, cpu) = op_inputs(case, dtype, device);
    let (n, p) = (case.tokens(), params(case, None));
    poison_memory(device, n * case.v * 2, DType::F32);
    let (lse, tl) = forward_op(&dev, p);
    let (lse_ref, tl_ref) = reference_forward(&cpu, case);
    let (lse, tl) = (host(lse), host(tl));
    assert_forward_close(&name, (&lse, &tl), (lse_ref.clone(), tl_ref), case, device);

    let dout = loss_gradient(case);
    let lse_dev = Tensor::<1>::from_data(lse_ref.to_data(), (device, DType::F32));
    let dout_dev = Tensor::<1>::from_data(TensorData::new(dout.clone(), [n]), (device, DType::F32));
    poison_memory(device, (n + case.v) * case.d * 4, DType::F32);
    let (de, dc, db) = backward_op(&dev, &lse_dev, &dout_dev, params(case, filter_eps));
    assert!(db.is_none(), "{name}: no bias, no db");
    let (de, dc) = (host(de), host(dc));
    let all = vec![true; case.v];
    let keep = filter.map_or(all.as_slice(), |(_, keep)| keep);
    MaskedCheck {
        case,
        cpu: &cpu,
        lse: lse_ref,
        dout: &dout,
        keep,
        dtype,
    }
    .assert_matches(&name, (&de, &dc, None), device);
}

/// The training path: `linear_ce_loss_train` (loss, lse and dE₁ from one walk over the
/// vocabulary, an online softmax) and `linear_ce_backward_train` (dE = dout ⊙ dE₁, dC from one
/// walk over the tokens) against the reference on the op cases, outputs over poisoned memory.
/// The first check keeps another handle on dE₁, so the backward must scale it into a new
/// tensor and leave the shared one as it was.
pub(super) fn fused_training_ops_match_reference(device: &Device) {
    let Some(_one) = fused_runs(device, "fused_training_ops_match_reference") else {
        return;
    };
    let kernels = ["cce_fused_forward_grad", "cce_fused_backward_dc"];
    every_op_case(kernels, |case, dtype, checked| {
        check_training_ops(case, dtype, checked == 0, None, device)
    });
}

/// [`fused_training_ops_match_reference`]'s check of one case; with `filter`, the backward
/// filters at its threshold, so dC must match the reference without the logit gradients
/// outside `keep` (per vocabulary entry) while dE stays exact (summed in the forward).
fn check_training_ops(
    case: &Case,
    dtype: DType,
    shared: bool,
    filter: Option<(f32, &[bool])>,
    device: &Device,
) {
    let filter_eps = filter.map(|(eps, _)| eps);
    let name =
        format!("fused training {case:?} {dtype:?} shared dE₁ {shared} filter {filter_eps:?}");
    let (dev, cpu) = op_inputs(case, dtype, device);
    let (n, p) = (case.tokens(), params(case, None));
    poison_memory(device, (n + case.v) * case.d * 4, DType::F32);
    let (loss, lse, de_unit) = Dispatch::linear_ce_loss_train(
        dev.e.clone().into_dispatch(),
        dev.c.clone().into_dispatch(),
        dev.targets.clone().into_dispatch(),
        p,
    );
    let (loss, lse, de_unit) = (float::<1>(loss), float::<1>(lse), float::<2>(de_unit));
    let (lse_ref, tl_ref) = reference_forward(&cpu, case);
    let (loss_h, lse_h) = (host(loss), host(lse.clone()));
    // The target logit the loss implies (lse − loss).
    let tl: Vec<f32> = lse_h.iter().zip(&loss_h).map(|(l, x)| l - x).collect();
    assert_forward_close(
        &name,
        (&lse_h, &tl),
        (lse_ref.clone(), tl_ref),
        case,
        device,
    );

    let dout = loss_gradient(case);
    let dout_dev = Tensor::<1>::from_data(TensorData::new(dout.clone(), [n]), (device, DType::F32));
    let unit_before = shared.then(|| host(de_unit.clone()));
    let kept = shared.then(|| de_unit.clone());
    poison_memory(device, (n + case.v) * case.d * 4, DType::F32);
    let (de, dc) = Dispatch::linear_ce_backward_train(
        dev.e.clone().into_dispatch(),
        dev.c.clone().into_dispatch(),
        dev.targets.clone().into_dispatch(),
        lse.into_dispatch(),
        dout_dev.into_dispatch(),
        de_unit.into_dispatch(),
        params(case, filter_eps),
    );
    let (de, dc) = (host(float::<2>(de)), host(float::<2>(dc)));
    if let (Some(kept), Some(unit_before)) = (kept, unit_before) {
        assert_eq!(
            host(kept),
            unit_before,
            "{name}: the shared dE₁ was written"
        );
    }
    let all = vec![true; case.v];
    let keep = filter.map_or(all.as_slice(), |(_, keep)| keep);
    let mask = |keep: &[bool]| {
        let values = keep.iter().map(|&k| k as u8 as f32).collect();
        Tensor::<1>::from_data(TensorData::new(values, [case.v]), &Device::flex())
    };
    let (de_ref, _, _) =
        masked_reference_backward(&cpu, lse_ref.clone(), &dout, &mask(&all), case.softcap);
    let (_, dc_ref, _) = masked_reference_backward(&cpu, lse_ref, &dout, &mask(keep), case.softcap);
    // dE₁ is stored in the dtype, then scaled: one rounding more than the case's.
    let de_extra = de_roundings(case, dtype) + 1;
    assert_product_close(
        &format!("dE {name}"),
        &de,
        &de_ref,
        case.v,
        (dtype, de_extra),
        device,
    );
    assert_product_close(&format!("dC {name}"), &dc, &dc_ref, n, (dtype, 0), device);
}

/// The fused backward's gradient filter, which leaves out whole tiles of 64 tokens × 64
/// entries. With 61 tokens (one token tile, padded) a tile is left out exactly where every entry
/// of its 64 has a host score (largest `|softmax − onehot|` over the tokens) below the threshold:
/// a threshold between the tiles' levels must leave out some tiles and keep others, both walks
/// alike (the training path leaves them out of dC only: its dE is summed in the forward).
/// Beside it: a threshold below every entry leaves nothing out, and one above every
/// `|softmax − onehot|` (at most 1) leaves out every tile, so both gradients must be written as
/// zeros over poisoned memory.
pub(super) fn fused_filter_per_tile(device: &Device) {
    let Some(_one) = fused_runs(device, "fused_filter_per_tile") else {
        return;
    };
    let before = launches("cce_fused_backward");
    let training_before = launches("cce_fused_backward_dc");
    let one_tile = fused(Case::new([1, 61], 128, 2053, 48));
    for dtype in DTYPES {
        let (_, cpu) = op_inputs(&one_tile, dtype, device);
        let (scores, _) = host_scores(&cpu, None);
        let tiles: Vec<f32> = scores
            .chunks(TILE)
            .map(|t| t.iter().copied().fold(0.0, f32::max))
            .collect();
        // The widest gap between the tiles' largest scores (here 0.24 to 0.83: a ratio of 3.5,
        // far from what rounding moves).
        let mut sorted = tiles.clone();
        sorted.sort_by(f32::total_cmp);
        let (lo, hi) = sorted
            .windows(2)
            .map(|w| (w[0], w[1]))
            .max_by(|a, b| (a.1 / a.0).total_cmp(&(b.1 / b.0)))
            .expect("several tiles");
        let eps = (lo * hi).sqrt();
        let keep = kept_entries(&scores, Some(eps), false, TILE);
        let kept = tiles.iter().filter(|&&m| m >= eps).count();
        assert!(
            hi / lo > 1.5 && 0 < kept && kept < tiles.len(),
            "{dtype:?}: eps {eps} (gap {lo}..{hi}) must split the {} tiles, keeps {kept}",
            tiles.len()
        );
        check_ops(&one_tile, dtype, Some((eps, &keep)), device);
        check_training_ops(&one_tile, dtype, false, Some((eps, &keep)), device);
    }
    let case = fused(Case::new([1, 130], 128, 1000, 47));
    for dtype in DTYPES {
        check_ops(&case, dtype, Some((1e-30, &vec![true; case.v])), device);

        let (dev, _) = op_inputs(&case, dtype, device);
        let n = case.tokens();
        let (lse, _) = forward_op(&dev, params(&case, None));
        let dout = loss_gradient(&case);
        let dout = Tensor::<1>::from_data(TensorData::new(dout, [n]), (device, DType::F32));
        poison_memory(device, (n + case.v) * case.d * 4, DType::F32);
        let (de, dc, _) = backward_op(&dev, &lse, &dout, params(&case, Some(2.0)));
        for (what, g) in [("dE", host(de)), ("dC", host(dc))] {
            let bad = g.iter().filter(|&&x| x != 0.0).count();
            assert_eq!(
                bad, 0,
                "{dtype:?} {what}: every tile filtered, {bad} entries not 0"
            );
        }
    }
    assert_eq!(
        launches("cce_fused_backward") - before,
        3 * DTYPES.len() as u64,
        "fused backward launches"
    );
    assert_eq!(
        launches("cce_fused_backward_dc") - training_before,
        DTYPES.len() as u64,
        "fused training backward launches"
    );
}

/// The loss under autodiff with the fused passes asked for, and with the default
/// ([`PassKernels::Auto`]). On CUDA they run (the training path: one training forward and one
/// training backward launch a loss); elsewhere (f32 on wgpu, whose runtime has no manual MMA)
/// they decline and the chunked passes must give the same checked result with no fused launch.
pub(super) fn fused_loss_and_gradients(device: &Device) {
    let cuda = is_cuda(device);
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dtypes = if cuda {
        DTYPES.to_vec()
    } else {
        vec![DType::F32]
    };
    let before = (
        launches("cce_fused_forward_grad"),
        launches("cce_fused_backward_dc"),
    );
    let cases = [
        fused(Case {
            shift: true,
            ignore: 0.2,
            reduction: Reduction::Sum,
            ..Case::new([3, 41], 128, 1031, 45)
        }),
        fused(Case {
            softcap: Some(4.0),
            ignore: 0.1,
            ..Case::new([2, 70], 64, 509, 46)
        }),
    ];
    let passes = [PassKernels::Fused, PassKernels::Auto];
    for &dtype in &dtypes {
        for case in &cases {
            for passes in passes {
                run(
                    device,
                    &Case {
                        passes,
                        ..case.clone()
                    },
                    dtype,
                );
            }
        }
    }
    // Each loss took the training path (the embeddings are tracked): one training forward
    // and one training backward.
    let fused = if cuda {
        dtypes.len() * cases.len() * passes.len()
    } else {
        0
    } as u64;
    let after = (
        launches("cce_fused_forward_grad"),
        launches("cce_fused_backward_dc"),
    );
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (fused, fused),
        "fused training launches (none where the fused passes decline)"
    );
}

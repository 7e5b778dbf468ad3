//! The fused passes (`PassKernels::Fused`) against the tensor-op reference: the ops on awkward
//! sizes (one token, prime and tail counts, every hidden size class up to 576, a soft cap), and
//! the whole loss under autodiff (shift, ignored tokens, sum reduction). They run on CUDA, the
//! runtime with the manual MMA they need; each check also asserts the fused kernels launched,
//! so a silent fall-back to the chunked passes fails. Elsewhere the loss check asserts the
//! fall-back: the chunked passes' result and no fused launch.

use std::sync::{Mutex, MutexGuard};

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_cce::kernels::fused::TILE;
use burn_cce::{FilterEps, PassKernels, Reduction, reference};
use burn_kernels_core::route::launches;
use burn_kernels_testing::{Dist, is_cuda, poison_memory, random_values};

use super::case::*;
use super::loss::run;
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
    let before = (
        launches("cce_fused_forward"),
        launches("cce_fused_backward"),
    );
    let mut checked = 0u64;
    for dtype in DTYPES {
        for case in op_cases() {
            check_ops(&case, dtype, None, device);
            checked += 1;
        }
    }
    // Every check above ran the fused kernels, none fell back to the chunked passes.
    let after = (
        launches("cce_fused_forward"),
        launches("cce_fused_backward"),
    );
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (checked, checked),
        "fused launches (forward, backward)"
    );
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
    let (lse_ref, tl_ref) = reference::linear_ce_forward(
        cpu.e.clone(),
        cpu.c.clone(),
        None,
        cpu.targets.clone(),
        case.softcap,
    );
    let (lse, tl) = (host(lse), host(tl));
    assert_forward_close(&name, (&lse, &tl), (lse_ref.clone(), tl_ref), case, device);

    let dout = random_values(n, Dist::Uniform { lo: 0.5, hi: 1.5 }, case.seed + 9);
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

/// The fused backward's gradient filter, which leaves out whole tiles of 64 tokens × 64
/// entries. With 61 tokens (one token tile, padded) a tile is left out exactly where every entry
/// of its 64 has a host score (largest `|softmax − onehot|` over the tokens) below the threshold:
/// a threshold between the tiles' levels must leave out some tiles and keep others, both walks
/// alike. Beside it: a threshold below every entry leaves nothing out, and one above every
/// `|softmax − onehot|` (at most 1) leaves out every tile, so both gradients must be written as
/// zeros over poisoned memory.
pub(super) fn fused_filter_per_tile(device: &Device) {
    let Some(_one) = fused_runs(device, "fused_filter_per_tile") else {
        return;
    };
    let before = launches("cce_fused_backward");
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
    }
    let case = fused(Case::new([1, 130], 128, 1000, 47));
    for dtype in DTYPES {
        check_ops(&case, dtype, Some((1e-30, &vec![true; case.v])), device);

        let (dev, _) = op_inputs(&case, dtype, device);
        let n = case.tokens();
        let (lse, _) = forward_op(&dev, params(&case, None));
        let dout = random_values(n, Dist::Uniform { lo: 0.5, hi: 1.5 }, case.seed + 9);
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
}

/// The loss under autodiff with the fused passes asked for. On CUDA they run (one backward
/// launch a loss); elsewhere (f32 on wgpu, whose runtime has no manual MMA) they decline and the
/// chunked passes must give the same checked result with no fused launch.
pub(super) fn fused_loss_and_gradients(device: &Device) {
    let cuda = is_cuda(device);
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dtypes = if cuda {
        DTYPES.to_vec()
    } else {
        vec![DType::F32]
    };
    let before = launches("cce_fused_backward");
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
    for &dtype in &dtypes {
        for case in &cases {
            run(device, case, dtype);
        }
    }
    let fused = if cuda { dtypes.len() * cases.len() } else { 0 };
    assert_eq!(
        launches("cce_fused_backward") - before,
        fused as u64,
        "fused backward launches (none where the fused passes decline)"
    );
}

//! Kernel selection by measurement (issue 32): where a runtime has more than one attention
//! kernel for a plan ([`candidates`]), CubeCL's autotune times each at the first launch of a
//! shape and keeps the fastest, per GPU and [`SageTuneKey`] (the lengths and heads rounded up
//! to powers of two, the options that change the work). The quantization before the attention
//! kernel is the same for every candidate, so only the attention launch is timed. CubeCL keeps
//! the results in its autotune cache, so a later process on the same GPU does not measure again.
//!
//! [`KernelChoice::Tuned`] is what [`super::choose`] returns for such a plan; [`tuned_kernel`]
//! says which kernel won once a shape has run.

use std::sync::Arc;

use burn_cubecl::{CubeDevice, CubeTuneId, tensor::CubeTensor};
use cubecl::AutotuneKey;
use cubecl::prelude::*;
use cubecl::tune::{AutotuneOutput, LocalTuner, Tunable, TunableSet, TuneGroup, local_tuner};
use serde::{Deserialize, Serialize};

use super::{
    AttnArgs, KernelChoice, QuantizedInputs, attn_cmma, attn_mma, attn_unit, attn_wgmma, choose,
};
use crate::{SageOptions, SagePlan};

/// The kernels on the matrix units, in the order they are tried.
const MATRIX_KERNELS: [KernelChoice; 3] =
    [KernelChoice::Wgmma, KernelChoice::Mma, KernelChoice::Cmma];

/// Whether `kernel`, asked for by name, takes `plan` on this client.
fn takes(client: &Client, plan: &SagePlan, kernel: KernelChoice) -> bool {
    let opts = SageOptions {
        kernel: Some(kernel),
        ..plan.opts
    };
    choose(client, &SagePlan { opts, ..*plan }).is_ok()
}

/// The kernels the tuner times for `plan` on this client: each matrix-unit kernel that takes
/// the plan when asked for by name, else the portable kernel where it takes it; empty when none
/// does.
pub fn candidates(client: &Client, plan: &SagePlan) -> Vec<KernelChoice> {
    let matrix: Vec<_> = MATRIX_KERNELS
        .into_iter()
        .filter(|&k| takes(client, plan, k))
        .collect();
    if matrix.is_empty() && takes(client, plan, KernelChoice::Unit) {
        vec![KernelChoice::Unit]
    } else {
        matrix
    }
}

/// Whether `kernel` is one of [`candidates`] for `plan`, asking only about it where it is a
/// matrix-unit kernel (every launch of a tuned plan checks its kernel).
fn is_candidate(client: &Client, plan: &SagePlan, kernel: KernelChoice) -> bool {
    match kernel {
        KernelChoice::Unit => candidates(client, plan) == [KernelChoice::Unit],
        _ => takes(client, plan, kernel),
    }
}

/// The autotune key: what changes the kernels' relative speed.
#[derive(Hash, Eq, PartialEq, Debug, Clone, Serialize, Deserialize, AutotuneKey)]
pub struct SageTuneKey {
    /// The input dtype, the quantization, the P·V precision, the mask, Q smoothing, the
    /// log-sum-exp output and the GQA group.
    variant: String,
    head_dim: usize,
    /// `batch · q_heads`.
    #[autotune(anchor)]
    rows: usize,
    #[autotune(anchor)]
    q_len: usize,
    #[autotune(anchor)]
    kv_len: usize,
}

impl SageTuneKey {
    /// The key of `plan`.
    pub fn of(plan: &SagePlan) -> Self {
        let o = &plan.opts;
        let variant = format!(
            "{:?} {:?} {:?} causal={} smooth_q={} lse={} group={}",
            plan.dtype,
            o.qk,
            o.pv,
            o.causal,
            o.smooth_q,
            o.return_lse,
            plan.group()
        );
        Self::new(
            variant,
            plan.head_dim,
            plan.batch * plan.q_heads,
            plan.q_len,
            plan.kv_len,
        )
    }
}

/// What a tuned launch reads.
type Inputs = (QuantizedInputs, AttnArgs, SagePlan);

/// What a launch returns: `(out, lse when the plan asks for it)`.
pub(crate) struct Launched(pub CubeTensor, pub Option<CubeTensor>);

impl AutotuneOutput for Launched {
    #[cfg(feature = "autotune-checks")]
    fn check_equivalence(&self, other: Self) {
        self.0.check_equivalence(other.0);
    }
}

static TUNER: LocalTuner<SageTuneKey, CubeTuneId> = local_tuner!();

/// The tunable set of this client's device: every kernel, each refusing the plans
/// [`candidates`] leaves it out of (a refused tunable is never timed). Built once per device
/// (the tuner keys its sets by this closure's type and the device).
fn tunables(
    id: &CubeTuneId,
    client: &Client,
) -> Arc<TunableSet<SageTuneKey, Inputs, Launched, KernelChoice>> {
    let client = client.clone();
    TUNER.init(id, move || {
        let group = TuneGroup::<SageTuneKey>::new("sage_attention", |_| 0);
        let mut set = TunableSet::new_cloning_inputs(|(_, _, plan): &Inputs| SageTuneKey::of(plan));
        for kernel in MATRIX_KERNELS.into_iter().chain([KernelChoice::Unit]) {
            let client = client.clone();
            let run = move |(x, args, plan): Inputs| {
                if !is_candidate(&client, &plan, kernel) {
                    return Err(format!("{kernel} does not take this plan"));
                }
                let (out, lse) = launch(kernel, x, args, &plan);
                Ok::<_, String>(Launched(out, lse))
            };
            set = set.with(Tunable::identified(kernel, run).group(&group, |_| 0));
        }
        set
    })
}

/// Launches `kernel` (one [`candidates`] allows).
pub(crate) fn launch(
    kernel: KernelChoice,
    x: QuantizedInputs,
    args: AttnArgs,
    plan: &SagePlan,
) -> (CubeTensor, Option<CubeTensor>) {
    match kernel {
        KernelChoice::Unit => attn_unit::launch(x, args, plan),
        KernelChoice::Cmma => attn_cmma::launch(x, args, plan),
        KernelChoice::Mma => attn_mma::launch(x, args, plan),
        KernelChoice::Wgmma => attn_wgmma::launch(x, args, plan),
        KernelChoice::Tuned => tuned(x, args, plan),
    }
}

/// Runs the fastest of [`candidates`] for `plan`'s key, timing them first where this GPU has
/// not measured the key yet.
fn tuned(x: QuantizedInputs, args: AttnArgs, plan: &SagePlan) -> (CubeTensor, Option<CubeTensor>) {
    let client = x.qi.client.clone();
    let id = CubeTuneId::new(&client, &x.qi.device);
    let set = tunables(&id, &client);
    let Launched(out, lse) = TUNER.execute(&id, &client, set, (x, args, plan.clone()));
    (out, lse)
}

/// The kernel the tuner picked for `plan`'s key on this client's device; `None` until a launch
/// of that key has been timed (in this process, or read back from the autotune cache by one).
pub fn tuned_kernel(device: &CubeDevice, plan: &SagePlan) -> Option<KernelChoice> {
    let client = device.client();
    let id = CubeTuneId::new(&client, device);
    let set = tunables(&id, &client);
    TUNER.fastest_identity(&id, &set, &SageTuneKey::of(plan))
}

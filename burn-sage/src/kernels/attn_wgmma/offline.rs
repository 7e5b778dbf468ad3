//! The Hopper attention kernel compiled to PTX without a device (feature `ptx-dump`), for
//! `ptxas -v` (`scripts/hopper-ptx.sh`), through core's offline compiler.

use burn_kernels_core::gemm::hopper::offline::{ptx_of, settings_of, sm90_properties, tensor};
use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::*;

use super::super::AttnArgsCompilationArg;
use super::super::pv_grid::RoundArgsCompilationArg;
use super::kernel::attn_wgmma_kernel::AttnWgmmaKernel;
use super::{WG, warpgroups};

/// `(name, PTX or the compiler's error)` of the default variant (bf16 output, f16 `P̃·V`,
/// D = 128) causal and not, at the default warpgroups a cube.
pub fn sage_ptx() -> Vec<(String, Result<String, String>)> {
    let props = sm90_properties();
    let target = std::sync::Arc::new(TargetProperties::default());
    let wgs = warpgroups();
    let mut out = Vec::new();
    for causal in [false, true] {
        let args = AttnArgsCompilationArg {
            rows: (),
            hq: (),
            group: (),
            sq: (),
            skv: (),
            q_block: (),
            q_inter: (),
            q_groups: (),
            k_block: (),
            k_inter: (),
            k_groups: (),
            mean_block: (),
            mean_blocks: (),
            scale: (),
            p_scale: (),
            mantissa: (),
            min_exp: (),
            grid_max: (),
        };
        let g = RoundArgsCompilationArg {
            drop: (),
            min_normal: (),
            sub_step: (),
            inv_sub_step: (),
            max: (),
        };
        let kernel = AttnWgmmaKernel::new(
            settings_of((wgs * WG) as u32),
            props.clone(),
            target.clone(),
            (),
            (),
            (),
            tensor(),
            tensor(),
            tensor(),
            tensor(),
            tensor(),
            tensor(),
            args,
            g,
            (),
            2,
            128,
            causal,
            false,
            false,
            true,
            wgs,
            false,
            [
                ElemType::Float(FloatKind::BF16),
                ElemType::Float(FloatKind::F16),
            ],
        );
        out.push((format!("sage_wgmma_d128_causal_{causal}"), ptx_of(kernel)));
    }
    out
}

//! A static KV cache's write of one step: the new keys and values of a layer stored at
//! device-held positions of both buffers in one launch (two `select_assign`s otherwise), in
//! place where the buffers are not shared.

use burn::backend::cubecl::dtype_to_storage_type;
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::UNITS;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn store_kv_kernel<F: Float, I: Int>(
    kc: &mut Tensor<F>,
    vc: &mut Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    index: &Tensor<I>,
    elems: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let idx = ABSOLUTE_POS;
    if idx >= elems {
        terminate!();
    }
    let heads = k.shape(1);
    let seq = k.shape(2);
    let d = k.shape(3);
    let c = idx % d;
    let rest = idx / d;
    let t = rest % seq;
    let bh = rest / seq;
    let h = bh % heads;
    let b = bh / heads;
    let at = usize::cast_from(index[t]);
    let kd = b * kc.stride(0) + h * kc.stride(1) + at * kc.stride(2) + c * kc.stride(3);
    let vd = b * vc.stride(0) + h * vc.stride(1) + at * vc.stride(2) + c * vc.stride(3);
    kc[kd] = k[b * k.stride(0) + h * k.stride(1) + t * k.stride(2) + c * k.stride(3)];
    vc[vd] = v[b * v.stride(0) + h * v.stride(1) + t * v.stride(2) + c * v.stride(3)];
}

/// `kc[:, :, index[t]] = k[:, :, t]` and the same for `vc`, `v`; returns the buffers (the
/// inputs' own memory where nothing else holds it, else copies).
///
/// # Shapes
/// - `kc`, `vc`: `[b, h, capacity, d]`; `k`, `v`: `[b, h, s, d]` (any strides), one dtype
/// - `index`: `[s]` int, each `< capacity`
pub fn store_kv(
    kc: CubeTensor,
    vc: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    index: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let own = |t: CubeTensor| {
        if t.can_mut() && t.is_nonoverlapping() {
            t
        } else {
            t.copy()
        }
    };
    let (kc, vc) = (own(kc), own(vc));
    let index = into_contiguous(index);
    let elems = k.meta.shape().num_elements();
    if elems == 0 {
        return (kc, vc);
    }
    let client = kc.client.clone();
    let dtypes = [
        dtype_to_storage_type(kc.dtype),
        dtype_to_storage_type(index.dtype),
    ];
    let cube_dim = CubeDim::new_1d(UNITS);
    store_kv_kernel::launch(
        &client,
        calculate_cube_count_elemwise(&client, elems, cube_dim),
        cube_dim,
        kc.clone().into_tensor_arg(),
        vc.clone().into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        index.into_tensor_arg(),
        elems,
        dtypes,
    );
    (kc, vc)
}

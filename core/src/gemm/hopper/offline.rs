//! The Hopper kernels compiled to PTX without a device (feature `ptx-dump`), so `ptxas -v` can
//! report their registers and spills on a machine with no GPU (`scripts/hopper-ptx.sh`).
//!
//! The device properties are the few an sm_90 part gives CubeCL that these kernels read: TMA,
//! the barriers, the warpgroup MMA shapes the LLVM backend lowers, and bf16/f16/i8 types.

use std::sync::Arc;

use cubecl::Compiler;
use cubecl::ir::{
    DeviceIdentity, DeviceProperties, ElemType, FloatKind, HardwareProperties,
    MemoryDeviceProperties, OpaqueType,
    features::{Plane, Tma},
    nvidia::SmArch,
};
use cubecl::prelude::*;
use cubecl::profile::TimingMethod;
use cubecl::wgmma::Major;
use cubecl_llvm::nvptx::ptx_version::PtxVersion;
use cubecl_llvm::shared::lowered_features::{GpuTarget, restrict_features};
use cubecl_llvm::{PlironArtifact, PlironCompiler, PlironOptions};

use super::{CompensatedStore, Epilogue, HopperTile, WG};

/// An H100's properties as far as the Hopper kernels read them (also burn-sage's).
pub fn sm90_properties() -> Arc<DeviceProperties> {
    let hardware = HardwareProperties {
        load_width: 128,
        vector_register_count: None,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: 32,
        max_shared_memory_size: 232_448,
        max_cube_count: (u32::MAX, u32::from(u16::MAX), u32::from(u16::MAX)),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(132),
        num_tensor_cores: None,
        min_tensor_cores_dim: None,
        num_cpu_cores: None,
        last_level_cache_size: None,
        max_vector_size: VectorSize::MAX,
        cube_mma_reserved_shared_memory: 0,
    };
    let mut props = DeviceProperties::new(
        Default::default(),
        MemoryDeviceProperties::new(u64::MAX, 256),
        hardware,
        TimingMethod::Device,
        DeviceIdentity {
            name: "offline sm_90".to_string(),
            fingerprint: "offline_sm90".to_string(),
            physical: None,
        },
    );
    cubecl_cpp::shared::register_supported_types(&mut props);
    props.features.tma.insert(Tma::Base);
    props.features.copy_async = true;
    props.features.cube_cluster = true;
    props.features.memory_reinterpret = true;
    props.features.alignment = true;
    props.features.device_memory_scope = true;
    props.features.plane.insert(Plane::Sync);
    props.features.plane.insert(Plane::Ops);
    props.features.plane.insert(Plane::NonUniformControlFlow);
    props.register_opaque_type(OpaqueType::TensorMap);
    props.register_opaque_type(OpaqueType::Barrier);
    restrict_features(&mut props, GpuTarget::Nvptx { arch: arch() });
    Arc::new(props)
}

fn arch() -> SmArch {
    SmArch::new(90, true)
}

/// The PTX of `kernel` for sm_90a, as CubeCL's CUDA runtime compiles it (driver 13.0's PTX).
pub fn ptx_of(kernel: impl CubeKernel) -> Result<String, String> {
    let mut compiler = PlironCompiler {
        target: cubecl_llvm::LlvmTarget::Nvptx,
    };
    let options = PlironOptions {
        sm_arch: Some(arch()),
        ptx_version: PtxVersion::for_driver(13000),
        grid_constants: true,
        ..Default::default()
    };
    match compiler.compile(kernel.define(), &options) {
        Ok(PlironArtifact::NvptxCode(module)) => {
            // SAFETY: the module's PTX is NUL-terminated.
            Ok(unsafe { std::ffi::CStr::from_ptr(module.ptx.as_ptr()) }
                .to_string_lossy()
                .into_owned())
        }
        Ok(_) => Err("not PTX".to_string()),
        Err(err) => Err(format!("{err:?}")),
    }
}

/// A tensor argument's compilation form (no aliasing).
pub fn tensor() -> TensorCompilationArg {
    TensorCompilationArg {
        meta: TensorMetaCompilationArg { len: (), rank: () },
        buffer: BufferCompilationArg { inplace: None },
    }
}

/// How many of `ptx`'s warpgroup-MMA waits keep one group in flight (`wgmma.wait_group 1`).
pub fn waits_in_flight(ptx: &str) -> usize {
    ptx.lines()
        .filter(|l| {
            let mut words = l.split_whitespace();
            words
                .next()
                .is_some_and(|w| w.starts_with("wgmma.wait_group"))
                && words.next() == Some("1;")
        })
        .count()
}

/// Writes each `(name, PTX)` of `kernels` to `dir/<name>.ptx` (printing the paths), and fails
/// (after writing the rest) where one did not compile or `check` finds fault with its PTX.
pub fn write_all(
    dir: &std::path::Path,
    kernels: Vec<(String, Result<String, String>)>,
    check: impl Fn(&str, &str) -> Option<String>,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let mut failed = 0;
    for (name, ptx) in kernels {
        match ptx {
            Ok(ptx) => {
                if let Some(why) = check(&name, &ptx) {
                    eprintln!("{name}: {why}");
                    failed += 1;
                }
                let path = dir.join(format!("{name}.ptx"));
                std::fs::write(&path, ptx).map_err(|e| e.to_string())?;
                println!("{}", path.display());
            }
            Err(err) => {
                eprintln!("{name}: {err}");
                failed += 1;
            }
        }
    }
    match failed {
        0 => Ok(()),
        n => Err(format!("{n} kernels failed to compile or their check")),
    }
}

/// A launch of `units` units a cube, unchecked, 64-bit addresses.
pub fn settings_of(units: u32) -> KernelSettings {
    KernelSettings::new(
        *CubeDim::new_1d(units),
        ExecutionMode::Unchecked,
        AddressType::U64,
    )
}

/// The dE carry's tile (burn-cce's compensated adding product: `A` the logits' gradient,
/// row-major; `B` the classifier chunk, row-major) with `store`.
fn carry_tile(store: CompensatedStore) -> HopperTile {
    HopperTile {
        bn: super::PREFETCH_BN,
        a_major: Major::K,
        b_major: Major::MN,
        pairs: true,
        m_fast: false,
        epilogue: Epilogue::AddCompensated { store },
        overlap: true,
    }
}

/// `(name, PTX or the compiler's error)` of each Hopper kernel whose registers matter, in bf16.
pub fn hopper_ptx() -> Vec<(String, Result<String, String>)> {
    let props = sm90_properties();
    let target = Arc::new(TargetProperties::default());
    let bf16 = ElemType::Float(FloatKind::BF16);
    let mut out = Vec::new();
    for overlap in [true, false] {
        let tile = HopperTile {
            overlap,
            ..carry_tile(CompensatedStore::Persistent)
        };
        let kernel =
            super::persistent::compensated_persistent_kernel::CompensatedPersistentKernel::new(
                settings_of(3 * WG),
                props.clone(),
                target.clone(),
                (),
                (),
                (),
                (),
                (),
                (),
                (),
                tile,
                bf16,
            );
        let name = if overlap { "" } else { "_stages" };
        out.push((format!("compensated_persistent{name}"), ptx_of(kernel)));
    }
    // `G`: the logits' gradient (burn-cce's backward), a 256-column tile.
    let grad = HopperTile {
        bn: 256,
        a_major: Major::K,
        b_major: Major::K,
        pairs: true,
        m_fast: true,
        epilogue: Epilogue::Grad {
            bias: false,
            softcap: true,
            gathered: false,
        },
        overlap: true,
    };
    let i32_ = ElemType::Int(cubecl::ir::IntKind::I32);
    let kernel = super::hopper_gemm_kernel::HopperGemmKernel::new(
        settings_of(3 * WG),
        props.clone(),
        target.clone(),
        (),
        (),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        (),
        (),
        (),
        (),
        (),
        (),
        (),
        (),
        2,
        grad,
        [bf16, bf16, i32_],
    );
    out.push(("gemm_grad".to_string(), ptx_of(kernel)));
    out
}

//! Shared by the tests: the real SmolLM2-135M-Instruct weights, tiny random-weight configs, and
//! a model's last-position logits.

use std::sync::OnceLock;

use burn::tensor::{Device, Int, Tensor, TensorData};

use burn_kernels_core::{FullKvCache, ReferenceAttention};
use burn_llama::config::LlamaConfig;
use burn_llama::model::Llama;

use burn_llama::loader::{Checkpoint, default_model_path, load};

/// The checkpoint at the default model path, loaded once per test binary.
pub fn checkpoint() -> &'static Checkpoint {
    static CKPT: OnceLock<Checkpoint> = OnceLock::new();
    CKPT.get_or_init(|| {
        load(&default_model_path()).unwrap_or_else(|e| {
            panic!("{e}\n(the SmolLM2 weights come from `./scripts/setup.sh`, or `cargo xtask fetch-model`)")
        })
    })
}

/// The committed paragraph's tokens.
pub fn paragraph_tokens() -> Vec<u32> {
    let text = include_str!("../../data/paragraph.txt");
    checkpoint().tokenizer.encode(text).unwrap()
}

/// Tokens of the paragraph a model-sized test runs on `device`: all of them, or on wgpu its
/// first [`WGPU_TOKENS`] (see [`burn_kernels_testing::is_wgpu`]: in CI that is lavapipe, where
/// a forward pass of the 135M-parameter model over the whole paragraph takes minutes).
pub fn paragraph_tokens_on(device: &Device) -> Vec<u32> {
    let mut ids = paragraph_tokens();
    if burn_kernels_testing::is_wgpu(device) {
        ids.truncate(WGPU_TOKENS);
    }
    ids
}

/// See [`paragraph_tokens_on`].
pub const WGPU_TOKENS: usize = 96;

/// A tiny Llama configuration (hidden 16, two query heads on one KV head of 8) with `vocab`
/// tokens, `layers` layers and a context of `max_seq_len` positions, for CPU tests of the
/// generation code on random weights.
pub fn tiny_config(vocab: usize, layers: usize, max_seq_len: usize) -> LlamaConfig {
    LlamaConfig {
        vocab_size: vocab,
        hidden_size: 16,
        intermediate_size: 24,
        num_layers: layers,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 8,
        max_seq_len,
        ..LlamaConfig::smollm2_135m()
    }
}

/// Last-position logits of `tokens` from scratch (one forward pass, a fresh full cache, exact
/// attention), on the CPU.
pub fn last_logits(model: &Llama, tokens: &[u32]) -> Vec<f32> {
    let n = tokens.len();
    let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, n]), &Device::flex());
    let mut cache = FullKvCache::new(model.config.num_layers);
    let hidden = model.forward(input, &[], &mut cache, &ReferenceAttention);
    let h = hidden.dims()[2];
    let logits = model.logits(hidden.slice([0..1, n - 1..n, 0..h]));
    logits.into_data().try_to_vec::<f32>().unwrap()
}

/// The attention a decode test on `device` runs: the reference on the CPU, the decode kernels
/// (fused layer ops, decode attention) on GPUs.
pub fn decode_attention_for(device: &Device) -> Box<dyn burn_kernels_core::AttentionImpl> {
    if *device == Device::flex() {
        Box::new(ReferenceAttention)
    } else {
        Box::new(burn_kernels_core::FusedLayers::new(std::sync::Arc::new(
            burn_kvcache::DecodeAttention::default(),
        )))
    }
}

/// Runs `f` while another thread keeps `device` busy with small launches and host reads of
/// their results (deterministic values: no draws from the device's random generator), as the
/// test suite's threads do side by side. Panics with `f`'s panic, or when a neighbour read is
/// wrong.
pub fn beside_other_work<T>(device: &Device, f: impl FnOnce() -> T) -> T {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    // On CUDA a read fails while another thread's capture is open (global capture mode, see
    // `burn_llama::graph`): an error, which the neighbour counts; a wrong value fails anywhere.
    let errors_allowed = burn_kernels_testing::is_cuda(device);
    let stop = Arc::new(AtomicBool::new(false));
    let neighbour = {
        let (stop, device) = (stop.clone(), device.clone());
        std::thread::spawn(move || {
            let (mut rounds, mut errors) = (0usize, 0usize);
            let a = Tensor::<1, Int>::arange(0..96 * 80, &device)
                .float()
                .reshape([96, 80])
                .div_scalar(8000.0);
            let want = a
                .clone()
                .matmul(a.clone().transpose())
                .sum()
                .into_scalar::<f32>();
            while !stop.load(Ordering::Relaxed) {
                let got = a
                    .clone()
                    .matmul(a.clone().transpose())
                    .sum()
                    .try_into_scalar::<f32>();
                match got {
                    Ok(got) => assert!(
                        (got - want).abs() <= 1e-3 * want.abs(),
                        "neighbour read {got}, not {want}"
                    ),
                    Err(e) if errors_allowed => {
                        errors += 1;
                        if errors == 1 {
                            eprintln!("the neighbour's read failed (a capture was open): {e:?}");
                        }
                    }
                    Err(e) => panic!("the neighbour's read failed: {e:?}"),
                }
                rounds += 1;
            }
            (rounds, errors)
        })
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    stop.store(true, Ordering::Relaxed);
    let (rounds, errors) = neighbour.join().expect("the neighbour's reads are right");
    eprintln!("the neighbour thread ran {rounds} rounds, {errors} of its reads failed");
    match result {
        Ok(out) => out,
        Err(e) => std::panic::resume_unwind(e),
    }
}

/// Whether a decode step that did not replay as a graph was refused for the reason CUDA's
/// global capture mode gives when another thread synchronizes during the capture (see
/// `burn_llama::graph`): allowed on CUDA beside other work, never elsewhere.
pub fn capture_refused_beside_work(device: &Device, reason: Option<&str>) -> bool {
    burn_kernels_testing::is_cuda(device)
        && reason.is_some_and(|r| r.contains("STREAM_CAPTURE") || r.contains("status 900"))
}

/// Greedy generation of `prompts` eagerly (through a fresh full cache) and by the captured
/// decoder ([`burn_llama::graph::generate_captured`]): the eager tokens, then the captured
/// generation and how its step ran.
pub fn eager_and_captured(
    model: &Llama,
    prompts: &[Vec<u32>],
    attention: &dyn burn_kernels_core::AttentionImpl,
    opts: &burn_llama::generate::GenerateOptions,
) -> (
    Vec<Vec<u32>>,
    burn_llama::generate::Generation,
    burn_llama::graph::CaptureInfo,
) {
    use burn_kernels_core::Greedy;
    let mut cache = FullKvCache::new(model.config.num_layers);
    let eager = burn_llama::generate::generate(
        model,
        prompts,
        &mut cache,
        attention,
        &mut Greedy,
        opts,
        &mut |_, _| {},
    )
    .expect("valid prompts")
    .tokens;
    let (captured, info) = burn_llama::graph::generate_captured(
        model,
        prompts,
        attention,
        &mut Greedy,
        opts,
        &mut |_, _| {},
    )
    .expect("valid prompts");
    (eager, captured, info)
}

//! What the KV-cache decode suites (`shadowkv`, `minicache`) share: the model, synthetic cache
//! filling, synchronized decode steps, and (in [`memory`]) the memory plan that picks each
//! cache's largest batch from tensor shapes (never by running into an out-of-memory error, which
//! may abort the process on CUDA).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, Int, Tensor, TensorData};
use burn_kernels_core::{AttentionImpl, AttnOptions, BurnAttention, KvCache, Rope};
use burn_llama::{Llama, LlamaConfig};

use super::SuiteOptions;
use crate::harness::MemoryProbe;

mod memory;
pub use memory::*;

/// The Llama-3-8B shape (vocabulary 128256) or, in quick mode, a tiny model with the same
/// head layout for smoke tests (4 layers, hidden 512, 8 query heads and 2 KV heads of 128).
pub fn model_config(quick: bool) -> LlamaConfig {
    let full = LlamaConfig::llama3_8b();
    if quick {
        LlamaConfig {
            vocab_size: 2048,
            hidden_size: 512,
            intermediate_size: 1024,
            num_layers: 4,
            num_heads: 8,
            num_kv_heads: 2,
            ..full
        }
    } else {
        full
    }
}

/// What a decode-suite candidate's run needs besides its plan: the suite's model, the memory
/// probe, the device and the problem's label (one clone per candidate).
#[derive(Clone)]
pub struct RunEnv {
    pub model: Rc<SharedModel>,
    pub probe: Option<MemoryProbe>,
    pub device: Device,
    pub label: String,
}

impl RunEnv {
    /// The start of every run: the pool's free memory released, then the model on the device.
    pub fn start(&self) -> Llama {
        self.device.memory_cleanup();
        self.model.get(&self.device)
    }
}

/// One random-weight model per suite run, built at the first problem and shared by the
/// candidates (tensors are reference-counted: clones share the weights).
pub struct SharedModel {
    cfg: LlamaConfig,
    positions: usize,
    model: RefCell<Option<Llama>>,
}

impl SharedModel {
    /// A model of `cfg` whose RoPE covers `positions` (the model's own tables stop at 32K).
    pub fn new(cfg: LlamaConfig, positions: usize) -> Rc<Self> {
        Rc::new(Self {
            cfg,
            positions,
            model: RefCell::new(None),
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    pub fn get(&self, device: &Device) -> Llama {
        self.model
            .borrow_mut()
            .get_or_insert_with(|| {
                let t0 = Instant::now();
                let mut m = Llama::random(&self.cfg, device, DType::F16);
                let c = &self.cfg;
                m.rope = Rope::new(
                    c.head_dim,
                    self.positions,
                    c.rope_theta,
                    c.rope_scaling,
                    device,
                );
                sync(device);
                // Frees the pages of the f32 draws the f16 weights were cast from.
                device.memory_cleanup();
                eprintln!(
                    "  random-weight model: {} layers, {:.1} GB of f16 weights, built in {:.1} s",
                    c.num_layers,
                    weight_bytes(c) as f64 / GB,
                    t0.elapsed().as_secs_f64()
                );
                m
            })
            .clone()
    }
}

pub use crate::harness::sync;

/// Attention that computes nothing: fills a cache through `KvCache::attend` without the
/// prompt's quadratic attention (the suites time decode steps only).
#[derive(Debug, Clone, Copy)]
pub struct SkipAttention;

impl AttentionImpl for SkipAttention {
    fn name(&self) -> String {
        "skip".into()
    }

    fn attend(
        &self,
        _layer: usize,
        q: Tensor<4>,
        _k: Tensor<4>,
        _v: Tensor<4>,
        _opts: &AttnOptions,
    ) -> Tensor<4> {
        q
    }
}

/// Options of a fill call: nothing is attended, no padding.
pub fn fill_opts(cfg: &LlamaConfig) -> AttnOptions {
    AttnOptions {
        causal: true,
        scale: (cfg.head_dim as f32).sqrt().recip(),
        key_padding: None,
    }
}

/// The query a fill call passes (ignored by [`SkipAttention`]).
pub fn fill_query(cfg: &LlamaConfig, batch: usize, device: &Device) -> Tensor<4> {
    Tensor::zeros(
        [batch, cfg.num_heads, 1, cfg.head_dim],
        (device, DType::F16),
    )
}

/// Standard-normal f16 `[batch, kv_heads, n, head_dim]`.
pub fn random_states(cfg: &LlamaConfig, batch: usize, n: usize, device: &Device) -> Tensor<4> {
    Tensor::random(
        [batch, cfg.num_kv_heads, n, cfg.head_dim],
        Distribution::Normal(0.0, 1.0),
        (device, DType::F16),
    )
}

/// One decode step of every sequence: a new token each (different per step and sequence, so
/// queries change as in generation), the forward through `cache` with `attention`,
/// and the logits; the caller synchronizes.
pub fn decode_step(
    model: &Llama,
    cache: &mut dyn KvCache,
    batch: usize,
    step: u64,
    device: &Device,
    attention: &dyn AttentionImpl,
) {
    let vocab = model.config.vocab_size as u64;
    let ids: Vec<i64> = (0..batch as u64)
        .map(|i| ((step * 1_000_003 + i * 7919 + 17) % vocab) as i64)
        .collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [batch, 1]), device);
    let h = model.forward(tokens, &[], cache, attention);
    crate::harness::keep(model.logits(h));
}

/// `n` untimed decode steps from step 0 with Burn's attention (warm-up), then a sync; returns
/// the next step.
pub fn warm_up(
    model: &Llama,
    cache: &mut dyn KvCache,
    batch: usize,
    n: usize,
    device: &Device,
) -> u64 {
    for step in 0..n as u64 {
        decode_step(model, cache, batch, step, device, &BurnAttention);
    }
    sync(device);
    n as u64
}

/// Runs `n` decode steps, each synchronized, and returns their times in ms.
pub fn timed_steps(
    model: &Llama,
    cache: &mut dyn KvCache,
    batch: usize,
    first_step: u64,
    n: usize,
    device: &Device,
    attention: &dyn AttentionImpl,
) -> Vec<f64> {
    (0..n as u64)
        .map(|i| {
            let t0 = Instant::now();
            decode_step(model, cache, batch, first_step + i, device, attention);
            sync(device);
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect()
}

/// The pool's reserved bytes now (no cleanup), where the backend reports them.
pub fn reserved(probe: &Option<MemoryProbe>) -> Option<u64> {
    probe.as_ref().and_then(|p| (p.reserved)(false))
}

/// This process's resident host memory, from `/proc/self/status` (Linux).
pub fn host_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// `12.3 GB` (`4.5 MB` below 1 GB), or `?` when unknown.
pub fn gb(bytes: Option<u64>) -> String {
    match bytes {
        None => "?".into(),
        Some(b) if (b as f64) < GB => format!("{:.1} MB", b as f64 / 1e6),
        Some(b) => format!("{:.1} GB", b as f64 / GB),
    }
}

/// The parameters every decode-suite problem records: context, model shape, dtype and the
/// device budget, followed by the suite's own.
pub fn problem_params<const N: usize>(
    opts: &SuiteOptions,
    ctx: usize,
    own: [(&str, serde_json::Value); N],
) -> std::collections::BTreeMap<String, serde_json::Value> {
    let mut p = crate::harness::params([
        ("context", serde_json::json!(ctx)),
        (
            "shape",
            serde_json::json!(if opts.quick { "tiny" } else { "llama-3-8b" }),
        ),
        ("dtype", serde_json::json!("f16")),
        ("max_mem_gb", serde_json::json!(opts.max_mem_bytes / GB)),
    ]);
    p.extend(crate::harness::params(own));
    p
}

/// `32K` for 32768.
pub fn ctx_label(ctx: usize) -> String {
    if ctx >= 1024 && ctx.is_multiple_of(1024) {
        format!("{}K", ctx / 1024)
    } else {
        ctx.to_string()
    }
}

/// Bytes of an f16 `[batch, kv_heads, n, head_dim]` tensor.
pub fn seq_bytes(cfg: &LlamaConfig, batch: usize, n: usize) -> u64 {
    (batch * cfg.num_kv_heads * n * cfg.head_dim) as u64 * F16
}

/// Median (the true one: the mean of the middle two for an even count) and mean of step
/// times (ms).
pub fn median_mean(times: &[f64]) -> (f64, f64) {
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    (crate::harness::median(times), mean)
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::suites::PoolProps;

    /// An 80 GB H100 as CUDA reports it to CubeCL (a quarter of 85.5 GB per page).
    pub const H100: PoolProps = PoolProps {
        max_page: 85_520_809_984 / 4,
        alignment: 512,
    };

    /// The options of a full run on the H100 machine (80 GB device, 110 GB host budgets).
    pub fn h100_opts() -> SuiteOptions {
        SuiteOptions {
            quick: false,
            max_mem_bytes: 80e9,
            max_host_mem_bytes: 110e9,
            peers_dir: "bench/peers".into(),
            pool: H100,
            probe: None,
            filters: Vec::new(),
            excludes: Vec::new(),
            cce_gemm_sweep: false,
            cce_pass_blocks: Vec::new(),
            cce_chunk_bytes: Vec::new(),
            draft_model: Vec::new(),
            draft_lens: Vec::new(),
            spec_drafts: Vec::new(),
            batches: Vec::new(),
            seq: None,
            decode_kernels: false,
            spec_new_tokens: None,
            e2e_phases: false,
            e2e_checkpointing: None,
            e2e_profile_step: None,
            devices: Vec::new(),
        }
    }

    #[test]
    fn llama3_8b_weights() {
        let cfg = model_config(false);
        let bytes = weight_bytes(&cfg);
        // 8.03 B parameters.
        assert!((bytes as f64 / 2e9 - 8.03).abs() < 0.01, "{bytes}");
    }
}

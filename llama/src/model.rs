//! The Llama architecture: token embedding, RMSNorm, RoPE, grouped-query attention, SwiGLU MLP,
//! tied or untied LM head. Attention and the KV cache are plug-ins from `burn-kernels-core`.

use burn::module::{Module, Param};
use burn::nn::RmsNorm;
use burn::tensor::{DType, Device, Distribution, Int, Tensor, TensorCreationOptions, TensorData};
use burn_kernels_core::{
    AttentionImpl, AttnOptions, CacheError, KvCache, LayerOps, Rope, TensorOps, gemm,
};

use crate::config::LlamaConfig;
use crate::loader::{Checkpoint, HostTensor, LoadError};

/// One transformer block. Projection weights are stored `[in, out]`.
#[derive(Module, Debug)]
pub struct Block {
    pub attn_norm: RmsNorm,
    pub wq: Param<Tensor<2>>,
    pub wk: Param<Tensor<2>>,
    pub wv: Param<Tensor<2>>,
    pub wo: Param<Tensor<2>>,
    pub mlp_norm: RmsNorm,
    pub w_gate: Param<Tensor<2>>,
    pub w_up: Param<Tensor<2>>,
    pub w_down: Param<Tensor<2>>,
}

/// A Llama-architecture causal language model.
#[derive(Module, Debug)]
pub struct Llama {
    /// `[vocab, hidden]`.
    pub embed: Param<Tensor<2>>,
    pub layers: Vec<Block>,
    pub norm: RmsNorm,
    /// `[hidden, vocab]`; `None` when tied to the embedding.
    pub lm_head: Option<Param<Tensor<2>>>,
    #[module(skip)]
    pub config: LlamaConfig,
    pub rope: Rope,
}

/// The next prepared tensor, on the device.
fn upload<const D: usize>(
    data: &mut impl Iterator<Item = TensorData>,
    opts: &TensorCreationOptions,
) -> Tensor<D> {
    Tensor::from_data(
        data.next().expect("one prepared tensor per job"),
        opts.clone(),
    )
}

fn norm(gamma: Tensor<1>, eps: f32) -> RmsNorm {
    RmsNorm {
        gamma: Param::from_tensor(gamma),
        epsilon: eps as f64,
    }
}

/// The rows of the token table `[vocab, hidden]` for `tokens` `[batch, seq]`:
/// `[batch, seq, hidden]` ([`Llama::embed_tokens`]).
pub(crate) fn embed_rows(table: Tensor<2>, tokens: Tensor<2, Int>) -> Tensor<3> {
    let [b, s] = tokens.dims();
    let [_, hidden] = table.dims();
    table
        .select(0, tokens.reshape([b * s]))
        .reshape([b, s, hidden])
}

/// The classifier `[vocab, hidden]` of an embedding and an optional LM head
/// ([`Llama::classifier`]): the head transposed (a view), else the tied embedding.
pub(crate) fn classifier_of(
    embed: &Param<Tensor<2>>,
    lm_head: Option<&Param<Tensor<2>>>,
) -> Tensor<2> {
    match lm_head {
        Some(w) => w.val().transpose(),
        None => embed.val(),
    }
}

/// Why [`Llama::try_forward`] could not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForwardError {
    /// The cached positions plus the new tokens reach past the model's RoPE tables.
    #[error("context too long: {needed} positions, the model covers {max}")]
    ContextTooLong { needed: usize, max: usize },
    /// The KV cache could not attend.
    #[error("KV cache, layer {layer}: {message}")]
    Cache { layer: usize, message: String },
}

/// Positions beyond this are not precomputed unless the model's context is shorter: Llama-3's
/// 128K context (its tables are 2 × 131072 × head_dim/2 f32, 67 MB at head_dim 128). It was
/// 32768, and the ShadowKV bench's 128K fill and decode read RoPE angles past the tables
/// unchecked; [`Llama::try_forward`] now refuses positions past them.
const MAX_ROPE_POSITIONS: usize = 131_072;

impl Block {
    /// One layer on the residual stream `x` plus the previous layer's output `pending` (added
    /// here, in the same launch as this layer's first norm); returns the stream after the
    /// attention and the MLP's output, which the next layer (or the final norm) adds.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        layer: usize,
        x: Tensor<3>,
        pending: Option<Tensor<3>>,
        cfg: &LlamaConfig,
        rope: &Rope,
        positions: &Tensor<2, Int>,
        cache: &mut dyn KvCache,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Result<(Tensor<3>, Tensor<3>), CacheError> {
        let [b, s, _] = x.dims();
        let (hq, hkv, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let ops = attention.layer_ops().unwrap_or(&TensorOps);
        let w = [self.wq.val(), self.wk.val(), self.wv.val()];
        // A static cache written at device-held positions takes the keys and values from the
        // projection's own launch (the decode step's 8 launches a layer become 6).
        let slot = match pending {
            Some(_) => cache.indexed_slot(layer),
            None => None,
        };
        let (x, o) = match (pending, slot) {
            (Some(y), Some(slot)) => {
                let (x, q, slot) = ops.add_norm_qkv_rope_store(
                    &self.attn_norm,
                    x,
                    y,
                    w,
                    rope,
                    positions.clone(),
                    slot,
                );
                (x, cache.attend_indexed(layer, q, slot, attention, opts)?)
            }
            (pending, _) => {
                let (x, [q, k, v]) = match pending {
                    Some(y) => ops.add_norm_linear3(&self.attn_norm, x, y, w),
                    None => {
                        let [wq, wk, wv] = w;
                        let h = ops.rms_norm(&self.attn_norm, x.clone());
                        let (q, k, v) = ops.linear3(h, wq, wk, wv);
                        (x, [q, k, v])
                    }
                };
                let heads = |t: Tensor<3>, n: usize| t.reshape([b, s, n, d]).swap_dims(1, 2);
                let (q, k) = ops.rope2(rope, heads(q, hq), heads(k, hkv), positions.clone());
                let v = heads(v, hkv);
                (x, cache.attend(layer, q, k, v, attention, opts)?)
            }
        };
        let o = o.swap_dims(1, 2).reshape([b, s, hq * d]);
        let attn_out = ops.linear(o, self.wo.val());
        let (x, gated) = ops.add_norm_swiglu(
            &self.mlp_norm,
            x,
            attn_out,
            self.w_gate.val(),
            self.w_up.val(),
        );
        Ok((x, ops.linear(gated, self.w_down.val())))
    }
}

impl Llama {
    /// Runs `tokens` through the model after what `cache` holds and returns the final hidden
    /// states (after the last norm).
    ///
    /// # Shapes
    /// - `tokens`: `[batch, seq]`; `left_pad[i]` leading entries of row `i` are padding (masked
    ///   as keys, RoPE positions start after them); an empty slice means no padding
    /// - returns `[batch, seq, hidden]`
    ///
    /// # Panics
    /// Where [`Llama::try_forward`] returns an error.
    pub fn forward(
        &self,
        tokens: Tensor<2, Int>,
        left_pad: &[usize],
        cache: &mut dyn KvCache,
        attention: &dyn AttentionImpl,
    ) -> Tensor<3> {
        self.try_forward(tokens, left_pad, cache, attention)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Llama::forward`], with its failures as errors: positions past the model's context
    /// ([`Llama::max_positions`]) and a KV cache that could not attend.
    ///
    /// # Errors
    /// [`ForwardError`].
    pub fn try_forward(
        &self,
        tokens: Tensor<2, Int>,
        left_pad: &[usize],
        cache: &mut dyn KvCache,
        attention: &dyn AttentionImpl,
    ) -> Result<Tensor<3>, ForwardError> {
        let [b, s] = tokens.dims();
        let device = tokens.device();
        let start = cache.seq_len();
        if start + s > self.max_positions() {
            return Err(ForwardError::ContextTooLong {
                needed: start + s,
                max: self.max_positions(),
            });
        }
        let pad = |i: usize| left_pad.get(i).copied().unwrap_or(0);
        let positions: Vec<i64> = (0..b)
            .flat_map(|i| (0..s).map(move |t| (start + t).saturating_sub(pad(i)) as i64))
            .collect();
        let positions = Tensor::<2, Int>::from_data(TensorData::new(positions, [b, s]), &device);
        let key_padding = left_pad.iter().any(|&p| p > 0).then(|| {
            let total = start + s;
            let data: Vec<bool> = (0..b)
                .flat_map(|i| (0..total).map(move |j| j < pad(i)))
                .collect();
            Tensor::from_data(TensorData::new(data, [b, total]), &device)
        });
        let opts = AttnOptions {
            causal: true,
            scale: self.attention_scale(),
            key_padding,
        };
        self.forward_at(tokens, positions, &opts, cache, attention)
    }

    /// The softmax scale of the model's attention, `1/√head_dim`.
    pub fn attention_scale(&self) -> f32 {
        (self.config.head_dim as f32).sqrt().recip()
    }

    /// [`Llama::try_forward`] with the RoPE positions and the attention options given as device
    /// tensors: it reads no host value and uploads nothing, so with a cache of fixed shapes
    /// (`StaticKvCache::at`) it is a step a CUDA graph can capture. Positions are not checked
    /// against the RoPE tables here.
    ///
    /// # Shapes
    /// - `tokens`, `positions`: `[batch, seq]`; returns `[batch, seq, hidden]`
    ///
    /// # Errors
    /// [`ForwardError::Cache`] when the cache could not attend.
    pub fn forward_at(
        &self,
        tokens: Tensor<2, Int>,
        positions: Tensor<2, Int>,
        opts: &AttnOptions,
        cache: &mut dyn KvCache,
        attention: &dyn AttentionImpl,
    ) -> Result<Tensor<3>, ForwardError> {
        let mut x = self.embed_tokens(tokens);
        let ops = attention.layer_ops().unwrap_or(&TensorOps);
        let mut pending = None;
        for (layer, block) in self.layers.iter().enumerate() {
            (x, pending) = block
                .forward(
                    layer,
                    x,
                    pending,
                    &self.config,
                    &self.rope,
                    &positions,
                    cache,
                    attention,
                    opts,
                )
                .map(|(x, y)| (x, Some(y)))
                .map_err(|e| ForwardError::Cache {
                    layer,
                    message: e.to_string(),
                })?;
        }
        Ok(match pending {
            Some(y) => ops.add_rms_norm(&self.norm, x, y).1,
            None => ops.rms_norm(&self.norm, x),
        })
    }

    /// The token embeddings, the residual stream before the first layer.
    ///
    /// # Shapes
    /// - `tokens`: `[batch, seq]`; returns `[batch, seq, hidden]`
    pub fn embed_tokens(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        embed_rows(self.embed.val(), tokens)
    }

    /// One layer alone on the residual stream `x`, without a KV cache: the stream after it (its
    /// input plus the attention's and the MLP's outputs). `block` holds the layer's weights:
    /// `self.layers[layer]`, or a view of them (cast, say); the model gives the configuration
    /// and the RoPE tables. Layer checkpointing ([`crate::checkpoint`]) runs the model a layer
    /// at a time with it.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, hidden]`; `positions`: `[batch, seq]`; returns `[batch, seq, hidden]`
    ///
    /// # Errors
    /// [`ForwardError::Cache`] when the attention could not run.
    pub fn block_forward(
        &self,
        block: &Block,
        layer: usize,
        x: Tensor<3>,
        positions: &Tensor<2, Int>,
        opts: &AttnOptions,
        attention: &dyn AttentionImpl,
    ) -> Result<Tensor<3>, ForwardError> {
        let mut cache = burn_kernels_core::FullKvCache::new(self.config.num_layers);
        let (x, y) = block
            .forward(
                layer,
                x,
                None,
                &self.config,
                &self.rope,
                positions,
                &mut cache,
                attention,
                opts,
            )
            .map_err(|e| ForwardError::Cache {
                layer,
                message: e.to_string(),
            })?;
        Ok(x + y)
    }

    /// Positions the model's RoPE tables cover, its context length here: the config's
    /// `max_seq_len`, at most `MAX_ROPE_POSITIONS` (131 072).
    pub fn max_positions(&self) -> usize {
        self.rope.max_positions()
    }

    /// The output classifier as `[vocab, hidden]`: the embedding when tied, else the LM head
    /// transposed (a view, no copy). This is the `C` of a linear cross-entropy.
    pub fn classifier(&self) -> Tensor<2> {
        classifier_of(&self.embed, self.lm_head.as_ref())
    }

    /// Logits of hidden states, in f32.
    ///
    /// # Shapes
    /// - `hidden`: `[batch, seq, hidden]`; returns `[batch, seq, vocab]`
    pub fn logits(&self, hidden: Tensor<3>) -> Tensor<3> {
        // One 2-D product over all rows: broadcasting the weight over the batch makes some
        // backends (NdArray) copy it per row.
        let [b, s, h] = hidden.dims();
        let x = hidden.reshape([b * s, h]);
        let half = matches!(x.dtype(), DType::F16 | DType::BF16);
        let logits = match (&self.lm_head, half) {
            // f16/bf16: core's fixed-kernel GEMM (Burn's autotuned one fails on Hopper), which
            // reads the tied embedding's transposed view in place.
            (Some(w), true) => gemm::matmul(x, w.val()),
            (None, true) => gemm::matmul(x, self.embed.val().transpose()),
            (Some(w), false) => x.matmul(w.val()),
            // Tied: E·hᵀ reads the [vocab, hidden] embedding in its own layout instead of
            // transposing all of it on every call.
            (None, false) => self.embed.val().matmul(x.transpose()).transpose(),
        };
        let vocab = logits.dims()[1];
        logits.reshape([b, s, vocab]).cast(DType::F32)
    }

    /// [`Llama::logits`] through `ops`' projections: with [`burn_kernels_core::FusedOps`], a
    /// decode step's few rows take the GEMV kernels (the tied head reads the embedding along
    /// its rows) instead of Burn's matmul.
    ///
    /// # Shapes
    /// - `hidden`: `[batch, seq, hidden]`; returns `[batch, seq, vocab]`
    pub fn logits_with(&self, hidden: Tensor<3>, ops: &dyn LayerOps) -> Tensor<3> {
        let logits = match &self.lm_head {
            Some(w) => ops.linear(hidden, w.val()),
            None => ops.linear_t(hidden, self.embed.val()),
        };
        logits.cast(DType::F32)
    }

    /// Builds the model from loaded weights, stored as `dtype` on `device`.
    pub fn from_checkpoint(
        ckpt: &Checkpoint,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, LoadError> {
        crate::loader::validate(&ckpt.config, &ckpt.tensors)?;
        let cfg = &ckpt.config;
        let get = |name: &str| -> Result<&HostTensor, LoadError> {
            ckpt.tensors
                .get(name)
                .ok_or_else(|| LoadError::MissingTensor {
                    name: name.to_string(),
                })
        };
        // Host work (transposes, dtype conversion) first, on every core; then the uploads,
        // in the order the model takes the tensors.
        let mut jobs: Vec<(&HostTensor, bool)> = Vec::new();
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            jobs.push((get(&format!("{p}.input_layernorm.weight"))?, false));
            for w in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"] {
                jobs.push((get(&format!("{p}.{w}.weight"))?, true));
            }
            jobs.push((get(&format!("{p}.self_attn.o_proj.weight"))?, true));
            jobs.push((get(&format!("{p}.post_attention_layernorm.weight"))?, false));
            for w in ["gate_proj", "up_proj", "down_proj"] {
                jobs.push((get(&format!("{p}.mlp.{w}.weight"))?, true));
            }
        }
        if !cfg.tie_word_embeddings {
            jobs.push((get("lm_head.weight")?, true));
        }
        jobs.push((get("model.embed_tokens.weight")?, false));
        jobs.push((get("model.norm.weight")?, false));
        let opts = TensorCreationOptions::new(device.clone()).with_dtype(dtype);
        let mut data = crate::loader::host::prepare(&jobs, dtype).into_iter();
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            let attn_norm = norm(upload(&mut data, &opts), cfg.rms_norm_eps);
            let [wq, wk, wv, wo] = [(); 4].map(|_| Param::from_tensor(upload(&mut data, &opts)));
            let mlp_norm = norm(upload(&mut data, &opts), cfg.rms_norm_eps);
            let [w_gate, w_up, w_down] =
                [(); 3].map(|_| Param::from_tensor(upload(&mut data, &opts)));
            layers.push(Block {
                attn_norm,
                wq,
                wk,
                wv,
                wo,
                mlp_norm,
                w_gate,
                w_up,
                w_down,
            });
        }
        let lm_head =
            (!cfg.tie_word_embeddings).then(|| Param::from_tensor(upload(&mut data, &opts)));
        let embed = Param::from_tensor(upload(&mut data, &opts));
        let final_norm = norm(upload(&mut data, &opts), cfg.rms_norm_eps);
        Ok(Self {
            embed,
            layers,
            norm: final_norm,
            lm_head,
            rope: Self::rope(cfg, device),
            config: cfg.clone(),
        })
    }

    /// A model of `cfg`'s shape with random weights (N(0, 0.02), norms 1), for benchmarks.
    pub fn random(cfg: &LlamaConfig, device: &Device, dtype: DType) -> Self {
        let opts = TensorCreationOptions::new(device.clone()).with_dtype(dtype);
        let w = |rows: usize, cols: usize| {
            Param::from_tensor(
                Tensor::<2>::random([rows, cols], Distribution::Normal(0.0, 0.02), device)
                    .cast(dtype),
            )
        };
        let ones = |n: usize| norm(Tensor::<1>::ones([n], opts.clone()), cfg.rms_norm_eps);
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let layers = (0..cfg.num_layers)
            .map(|_| Block {
                attn_norm: ones(h),
                wq: w(h, cfg.num_heads * d),
                wk: w(h, cfg.num_kv_heads * d),
                wv: w(h, cfg.num_kv_heads * d),
                wo: w(cfg.num_heads * d, h),
                mlp_norm: ones(h),
                w_gate: w(h, cfg.intermediate_size),
                w_up: w(h, cfg.intermediate_size),
                w_down: w(cfg.intermediate_size, h),
            })
            .collect();
        Self {
            embed: w(cfg.vocab_size, h),
            layers,
            norm: ones(h),
            lm_head: (!cfg.tie_word_embeddings).then(|| w(h, cfg.vocab_size)),
            rope: Self::rope(cfg, device),
            config: cfg.clone(),
        }
    }

    fn rope(cfg: &LlamaConfig, device: &Device) -> Rope {
        Rope::new(
            cfg.head_dim,
            cfg.max_seq_len.min(MAX_ROPE_POSITIONS),
            cfg.rope_theta,
            cfg.rope_scaling,
            device,
        )
    }
}

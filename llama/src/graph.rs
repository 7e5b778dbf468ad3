//! Generation whose decode step is captured once and replayed ([`burn::tensor::capture`]): on
//! CUDA the step's few hundred kernel launches become one graph launch, which is what bounds a
//! small model's decode speed. The step has the same shapes at every length: keys and values
//! live in a [`StaticKvCache`] allocated to the generation's length, the new token, its RoPE
//! position and the cache length are one device tensor written in place before each replay, and
//! attention reads the whole cache with the positions not yet written masked.
//!
//! Backends without graphs (Burn's CPU backend) replay by running the step again: the same
//! tokens, at eager speed ([`CaptureInfo::graph`] says which ran). CubeCL's wgpu runtime
//! captures and replays too.
//!
//! # Threads (CUDA)
//!
//! CubeCL 0.12.0-pre.1 captures in CUDA's global capture mode: while a capture is open, another
//! thread's synchronizing call on the GPU (a read back, an event wait) fails with CUDA error 900
//! (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`) and invalidates the capture. The generation then
//! re-runs its step eagerly, with the same tokens, and says why ([`CaptureInfo::reason`]:
//! `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`); the other thread gets an error from its read, not
//! a wrong value (H100, 2026-12-05). Capture where no other thread works on the GPU during the
//! few hundred milliseconds of the warm-up and capture; the replays themselves can run beside
//! other work.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use burn::tensor::{Bool, Device, Graph, Int, Tensor, TensorData, capture};
use burn_kernels_core::route::cube_device;
use burn_kernels_core::{AttentionImpl, AttnOptions, Sampler, StaticKvCache, TensorOps};

use crate::generate::{
    GenerateError, GenerateOptions, Generation, Rows, host_rows, last_logits, padded_batch,
};
use crate::model::{ForwardError, Llama};

/// How `llama generate` runs its decode steps (`--decode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DecodeMode {
    /// Capture one decode step as a graph and replay it (CUDA, wgpu; the CPU re-runs the
    /// step). The full KV cache only; speculative decoding with model drafts replays its draft
    /// and verification steps ([`crate::spec::graph`]).
    #[default]
    Graph,
    /// Run every step's ops one by one, through the chosen KV cache.
    Eager,
}

/// How [`generate_captured`] ran its decode steps.
#[derive(Debug, Clone, PartialEq)]
pub struct CaptureInfo {
    /// The step replayed as a hardware graph (one launch per step).
    pub graph: bool,
    /// Why it did not, when it did not (the backend's answer to the capture).
    pub reason: Option<String>,
    /// Seconds spent on the warm-up runs and the capture (included in the decode time).
    pub capture_secs: f64,
    /// Positions the static cache was allocated for.
    pub capacity: usize,
}

impl std::fmt::Display for CaptureInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.reason, self.graph) {
            (_, true) => write!(
                f,
                "decode step captured as a graph ({:.2} s to warm up and capture)",
                self.capture_secs
            ),
            (Some(reason), false) => write!(f, "decode step re-run eagerly ({reason})"),
            (None, false) => write!(f, "no decode step ran"),
        }
    }
}

/// Writes `values` into `slot`'s buffer in place (allocating it the first time).
///
/// # Errors
/// [`GraphError::NotInPlace`] when another handle shares the buffer: a captured graph would
/// keep reading the old one.
fn refresh(
    slot: &mut Option<Tensor<1, Int>>,
    values: Vec<i64>,
    device: &Device,
) -> Result<(), GraphError> {
    let n = values.len();
    let fresh = Tensor::<1, Int>::from_data(TensorData::new(values, [n]), device);
    *slot = Some(match slot.take() {
        None => fresh,
        Some(held) if held.can_mut() => held.slice_assign(0..n, fresh),
        Some(_) => return Err(GraphError::NotInPlace),
    });
    Ok(())
}

/// A captured decode step that could not be replayed safely.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraphError {
    #[error("the decode step's input buffer is shared, so it cannot be refreshed in place")]
    NotInPlace,
}

impl From<GraphError> for ForwardError {
    fn from(e: GraphError) -> Self {
        ForwardError::Cache {
            layer: 0,
            message: e.to_string(),
        }
    }
}

/// The device tensor a step reads its host-given values from (`[n]` int, refreshed in place).
pub(crate) type StepInputs = Rc<RefCell<Option<Tensor<1, Int>>>>;

/// The values a step closure reads, written before every run.
pub(crate) fn step_inputs(inputs: &StepInputs) -> Tensor<1, Int> {
    inputs
        .borrow()
        .clone()
        .expect("inputs are written before a step")
}

/// A step with fixed shapes that reads its host-given values from one device tensor
/// ([`StepInputs`]), captured on its first run and replayed on the next ones: what
/// [`CapturedDecoder`] and the captured speculative decoding ([`crate::spec::graph`]) are built
/// from.
pub(crate) struct Replayed<'a, O> {
    inputs: StepInputs,
    step: Option<Box<dyn FnMut() -> O + 'a>>,
    graph: Option<Graph<O, Box<dyn FnMut() -> O + 'a>>>,
    device: Device,
    /// Whether the capture gave a hardware graph, why not, and how long it took.
    pub(crate) info: CaptureInfo,
}

impl<'a, O: Clone> Replayed<'a, O> {
    /// `step` must read its values through `inputs` ([`step_inputs`]).
    pub(crate) fn new(
        device: &Device,
        inputs: StepInputs,
        step: Box<dyn FnMut() -> O + 'a>,
    ) -> Self {
        Self {
            inputs,
            step: Some(step),
            graph: None,
            device: device.clone(),
            info: CaptureInfo {
                graph: false,
                reason: None,
                capture_secs: 0.0,
                capacity: 0,
            },
        }
    }

    /// Writes `values` into the inputs and runs the step: the first call captures it (three
    /// warm-up runs, then the recorded one), later calls replay it.
    ///
    /// # Errors
    /// [`GraphError::NotInPlace`] when the inputs could not be refreshed in place.
    pub(crate) fn run(&mut self, values: Vec<i64>) -> Result<O, GraphError> {
        refresh(&mut self.inputs.borrow_mut(), values, &self.device)?;
        Ok(match &mut self.graph {
            None => {
                let t = Instant::now();
                let g = capture(&self.device, self.step.take().expect("captured once"));
                self.info.capture_secs = t.elapsed().as_secs_f64();
                self.info.graph = g.is_hardware();
                self.info.reason = g.capture_error().map(|e| {
                    // One line: the backend's error and its causes.
                    let text = e.to_string();
                    text.split('\n')
                        .map(str::trim)
                        .filter(|l| !l.is_empty())
                        .collect::<Vec<_>>()
                        .join(" ")
                });
                // On a CubeCL runtime the capture run's output is recorded, not computed: a
                // hardware graph (CUDA's stream capture, wgpu's software graph) records the
                // launches without running them, and a capture refused midway (wgpu records
                // dispatches only, so a host write inside fails it) leaves a recorded output
                // too. So the first output comes from a replay (or a re-run). Elsewhere (the
                // CPU) capture is refused before the run, whose output is computed.
                //
                // Until 2026-12-05 a hardware graph's first output was read from the capture
                // run's buffers, which hold the last warm-up's values only when the allocator
                // gives the capture run the warm-up's buffers: at times it did not, mostly
                // while another thread used the device, and the first step's logits were stale
                // (`captured_decode_beside_other_work` in the llama tests).
                let recorded = cube_device(&self.device).is_some();
                let g = self.graph.insert(g);
                match recorded {
                    // Safety: as every later call's replay (see below).
                    true => unsafe { g.replay() }.clone(),
                    false => g.output().clone(),
                }
            }
            // Safety: the graph reads what its closure owns or borrows for 'a (the model's
            // weights, constants, caches held in `Rc`s that the closure keeps alive) and the
            // inputs, refreshed in place above on the same device stream; nothing else writes
            // them while it runs, and the caller's read of the output waits for it.
            Some(g) => unsafe { g.replay() }.clone(),
        })
    }
}

/// What one step returns: the logits of every row, `[batch, vocab]` f32.
pub(crate) type StepOutput = Result<Tensor<2>, ForwardError>;

/// A model's decode step over a [`StaticKvCache`], captured on its first call and replayed on
/// the next ones (see the module docs).
pub struct CapturedDecoder<'a> {
    cache: Rc<RefCell<StaticKvCache>>,
    step: Replayed<'a, StepOutput>,
    pad: Vec<usize>,
    len: usize,
    capacity: usize,
}

impl<'a> CapturedDecoder<'a> {
    /// Runs the prompts through `model` (eagerly: one call, shapes of its own) into a static
    /// cache sized for them plus `max_new_tokens`, and returns the decoder with each row's
    /// last-position logits (on the host).
    ///
    /// # Errors
    /// As [`crate::generate::generate`].
    pub fn prefill(
        model: &'a Llama,
        attention: &'a dyn AttentionImpl,
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
    ) -> Result<(Self, Vec<Vec<f32>>), GenerateError> {
        let (tokens, pad) = padded_batch(model, prompts, max_new_tokens)?;
        let device = model.embed.device();
        let [b, longest] = tokens.dims();
        let capacity = longest + max_new_tokens.max(1);
        let mut cache = StaticKvCache::new(model.config.num_layers, capacity);
        let hidden = model.try_forward(tokens, &pad, &mut cache, attention)?;
        let logits = last_logits(model, hidden, attention)?;
        let cache = Rc::new(RefCell::new(cache));
        let inputs = StepInputs::default();

        // Constant inputs of the step, owned by it (so alive as long as the graph).
        let positions =
            Tensor::<1, Int>::arange(0..capacity as i64, &device).reshape([1, capacity]);
        let padding: Vec<bool> = pad
            .iter()
            .flat_map(|&p| (0..capacity).map(move |j| j < p))
            .collect();
        let padding =
            Tensor::<2, Bool>::from_data(TensorData::new(padding, [b, capacity]), &device);
        let scale = model.attention_scale();
        let vocab = model.config.vocab_size;
        let (shared, values) = (cache.clone(), inputs.clone());
        let step = Box::new(move || {
            let inputs = step_inputs(&values);
            let tokens = inputs.clone().slice(0..b).reshape([b, 1]);
            let rope = inputs.clone().slice(b..2 * b).reshape([b, 1]);
            let len = inputs.slice(2 * b..2 * b + 1);
            let mask =
                StaticKvCache::unwritten_mask(positions.clone(), len.clone(), padding.clone());
            let opts = AttnOptions {
                causal: true,
                scale,
                key_padding: Some(mask),
            };
            let mut cache = shared.borrow_mut();
            let hidden = model.forward_at(tokens, rope, &opts, &mut cache.at(len), attention)?;
            let ops = attention.layer_ops().unwrap_or(&TensorOps);
            Ok(model.logits_with(hidden, ops).reshape([b, vocab]))
        });
        let mut step = Replayed::new(&device, inputs, step);
        step.info.capacity = capacity;
        let decoder = Self {
            cache,
            step,
            pad,
            len: longest,
            capacity,
        };
        Ok((decoder, logits))
    }

    /// Feeds one token per row at the current length and returns the next logits,
    /// `[batch, vocab]` f32 on the device. The first call captures the step (three warm-up
    /// runs, then the recorded one); later calls replay it.
    ///
    /// # Errors
    /// [`GenerateError::ContextTooLong`] past the cache's capacity; [`GenerateError::Forward`]
    /// when the step failed or its input could not be refreshed in place.
    pub fn step(&mut self, tokens: &[u32]) -> Result<Tensor<2>, GenerateError> {
        assert_eq!(tokens.len(), self.pad.len(), "one token per row");
        if self.len >= self.capacity {
            return Err(GenerateError::ContextTooLong {
                prompt: self.len,
                new_tokens: 1,
                needed: self.len + 1,
                max: self.capacity,
            });
        }
        let mut inputs: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
        inputs.extend(self.pad.iter().map(|&p| (self.len - p) as i64));
        inputs.push(self.len as i64);
        let output = self
            .step
            .run(inputs)
            .map_err(|e| GenerateError::Forward(e.into()))?;
        self.len += 1;
        Ok(output?)
    }

    /// Steps back one position, so the next [`CapturedDecoder::step`] overwrites the last one
    /// (benchmarks repeat one step this way).
    pub fn rewind(&mut self) {
        self.len = self.len.saturating_sub(1);
    }

    /// Sets the positions cached to `len` (at most the current length): the next step writes
    /// position `len` and attends to the positions before it.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Positions cached: the prompt's (padded) length plus the steps taken.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached (never: a prefill caches at least one position).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How the steps ran so far.
    pub fn info(&self) -> &CaptureInfo {
        &self.step.info
    }

    /// The static cache the step writes (shared with the captured step).
    pub(crate) fn cache(&self) -> &Rc<RefCell<StaticKvCache>> {
        &self.cache
    }

    /// Bytes the static cache holds.
    pub fn cache_bytes(&self) -> usize {
        burn_kernels_core::KvCache::bytes_held(&*self.cache.borrow())
    }
}

/// [`crate::generate::generate`] with a full-precision KV cache held in a [`StaticKvCache`] and
/// every decode step replayed from one capture ([`CapturedDecoder`]); the same tokens.
///
/// # Errors
/// As [`crate::generate::generate`]; [`GenerateError::Forward`] also when the captured step
/// failed.
pub fn generate_captured(
    model: &Llama,
    prompts: &[Vec<u32>],
    attention: &dyn AttentionImpl,
    sampler: &mut dyn Sampler,
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(usize, u32),
) -> Result<(Generation, CaptureInfo), GenerateError> {
    let t0 = Instant::now();
    let (mut decoder, mut logits) =
        CapturedDecoder::prefill(model, attention, prompts, opts.max_new_tokens)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let mut rows = Rows::new(prompts.len(), opts);
    let t1 = Instant::now();
    let mut steps = 0;
    while let Some(next) = rows.sample(&logits, sampler, opts, on_token) {
        logits = host_rows(decoder.step(&next)?)?;
        steps += 1;
    }
    let decode_secs = t1.elapsed().as_secs_f64();
    Ok((
        Generation {
            tokens: rows.out,
            prefill_tokens: prompts.iter().map(Vec::len).sum(),
            prefill_secs,
            decode_steps: steps,
            decode_secs,
            cache_bytes: decoder.cache_bytes(),
        },
        decoder.info().clone(),
    ))
}

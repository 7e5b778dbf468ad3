//! Where the time of one decode step goes, for a random-weight model of SmolLM2-135M's shape
//! (timing does not depend on the weights): the host cost of one kernel launch, the wall time
//! of a decode step split into its stages (each followed by a device sync), and the share of
//! the final read-back and host sampling. `--attention decode` and `--fused-ops` select the
//! decode kernels; the logits of one step are first checked against the plain path
//! (reference attention, tensor ops) from the same cache contents.
//!
//! ```sh
//! cargo run --release -p burn-llama-examples --features cuda --example decode_profile -- --backend cuda
//! # kernels per stage: a cubecl.toml with `[profiling.logger] level = "minimal"` and
//! # `stderr = true` makes CubeCL print the kernels launched between two syncs
//! ```

use std::time::Instant;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use std::sync::Arc;

use burn_kernels_core::{
    AttentionImpl, AttentionKind, FullKvCache, FusedLayers, KvCache, ReferenceAttention,
};
use burn_kvcache::DecodeAttention;
use burn_llama::graph::CapturedDecoder;
use burn_llama::{Llama, LlamaConfig};
use burn_llama_examples::cli::{BackendArg, DTypeArg};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(about = "Split of a decode step's wall time")]
struct Args {
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendArg,
    /// reference, burn-fused or decode.
    #[arg(long, default_value = "burn-fused")]
    attention: String,
    /// RMSNorm, RoPE and the SwiGLU gate as one kernel each.
    #[arg(long)]
    fused_ops: bool,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Weight and activation dtype.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// Cached positions before the timed steps.
    #[arg(long, default_value_t = 64)]
    context: usize,
    /// Timed decode steps.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Cached positions of the logits check (its own short prefill, so that a long
    /// `--context` does not also compile a long reference-attention prefill).
    #[arg(long, default_value_t = 64)]
    check_context: usize,
    /// Layers of the model (default: SmolLM2-135M's 30).
    #[arg(long)]
    layers: Option<usize>,
    /// Also time `llama generate`'s captured step (a static cache written at device-held
    /// positions, replayed as a graph where the backend has graphs) after the eager one.
    #[arg(long)]
    graph: bool,
}

fn main() {
    let args = Args::parse();
    let attention = match args.attention.as_str() {
        "decode" => None,
        name => Some(AttentionKind::parse(name).unwrap_or_else(|| {
            eprintln!("error: --attention is reference, burn-fused or decode");
            std::process::exit(1)
        })),
    };
    burn_llama_examples::cli::exit_on_error(
        args.backend
            .device()
            .map(|device| run(&args, &device, attention)),
    );
}

/// Milliseconds `f` takes, device work included.
fn timed<T>(device: &Device, f: impl FnOnce() -> T) -> (T, f64) {
    device.sync().expect("device sync");
    let t = Instant::now();
    let out = f();
    device.sync().expect("device sync");
    (out, t.elapsed().as_secs_f64() * 1e3)
}

fn median(v: Vec<f64>) -> f64 {
    summary(v).0
}

/// The true median (the mean of the middle two for an even count), the minimum and the 90th
/// percentile (nearest rank) of `v` (not empty).
fn summary(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let med = match n % 2 {
        1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    };
    let p90 = v[((n * 9).div_ceil(10)).clamp(1, n) - 1];
    (med, v[0], p90)
}

fn run(args: &Args, device: &Device, attention: Option<AttentionKind>) {
    let mut cfg = LlamaConfig::smollm2_135m();
    if let Some(n) = args.layers {
        cfg.num_layers = n;
    }
    let model = Llama::random(&cfg, device, DType::from(args.dtype));
    let attention: Arc<dyn AttentionImpl> = match attention {
        Some(kind) => Arc::from(kind.build()),
        None => Arc::new(DecodeAttention::default()),
    };
    let attention: Arc<dyn AttentionImpl> = if args.fused_ops {
        Arc::new(FusedLayers::new(attention))
    } else {
        attention
    };
    let b = args.batch;
    println!(
        "{} layers, hidden {}, {:?}, batch {b}, context {}, attention {}",
        cfg.num_layers,
        cfg.hidden_size,
        args.dtype,
        args.context,
        attention.name()
    );

    // The host cost of a launch: a chain of tiny element-wise kernels, synced once.
    let launches = 2000;
    let x = Tensor::<2>::ones([b, cfg.hidden_size], device);
    let chain = |x: Tensor<2>| (0..launches).fold(x, |x, _| x + 1.0);
    let _ = timed(device, || chain(x.clone()));
    let (_, ms) = timed(device, || chain(x.clone()));
    println!(
        "launch: {:.1} µs per element-wise kernel ({launches} chained)",
        1e3 * ms / launches as f64
    );

    let ids = |n: usize, offset: usize| {
        let v: Vec<i64> = (0..b * n)
            .map(|i| ((i * 7919 + offset) % cfg.vocab_size) as i64)
            .collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [b, n]), device)
    };
    let mut cache = FullKvCache::new(cfg.num_layers);
    let (hidden, ms) = timed(device, || {
        model.forward(ids(args.context, 0), &[], &mut cache, attention.as_ref())
    });
    drop(hidden);
    println!(
        "prefill {} tokens: {ms:.1} ms (first call compiles)",
        args.context
    );

    // Correctness first: one step from the same cache contents, against the plain path.
    let check_prompt = || ids(args.check_context.max(1), 0);
    let mut plain_cache = FullKvCache::new(cfg.num_layers);
    drop(model.forward(check_prompt(), &[], &mut plain_cache, &ReferenceAttention));
    let mut check_cache = FullKvCache::new(cfg.num_layers);
    drop(model.forward(check_prompt(), &[], &mut check_cache, attention.as_ref()));
    let logits = |cache: &mut FullKvCache, att: &dyn AttentionImpl| {
        let h = model.forward(ids(2, 1), &[], cache, att);
        model
            .logits(h)
            .into_data()
            .try_to_vec::<f32>()
            .expect("f32 logits")
    };
    let want = logits(&mut plain_cache, &ReferenceAttention);
    let got = logits(&mut check_cache, attention.as_ref());
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let err = want
        .iter()
        .zip(&got)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    println!(
        "check: 2 new positions after {} cached, max |Δlogit| {err:.3e} (max |logit| \
         {scale:.3e}) against reference attention + tensor ops",
        args.check_context.max(1)
    );

    let (mut forward, mut logits_ms, mut read, mut total) = (vec![], vec![], vec![], vec![]);
    for step in 0..args.steps + 4 {
        let t = Instant::now();
        let (hidden, f) = timed(device, || {
            model.forward(ids(1, step), &[], &mut cache, attention.as_ref())
        });
        let (logits, l) = timed(device, || model.logits(hidden));
        let (data, r) = timed(device, || {
            logits.into_data().try_to_vec::<f32>().expect("f32 logits")
        });
        let argmax = data
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i);
        std::hint::black_box(argmax);
        // The first steps compile and tune.
        if step >= 4 {
            forward.push(f);
            logits_ms.push(l);
            read.push(r);
            total.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let (f, l, r, t) = (
        median(forward),
        median(logits_ms),
        median(read),
        median(total),
    );
    println!(
        "decode step (median of {}): {t:.2} ms = forward {f:.2} ms ({:.3} ms per layer) + \
         logits {l:.2} ms + read-back {r:.2} ms + host {:.2} ms",
        args.steps,
        f / cfg.num_layers as f64,
        (t - f - l - r).max(0.0)
    );
    println!("cache after: {} positions", cache.seq_len());

    // One unsynced step: what the host alone spends launching, against the synced wall time.
    let t = Instant::now();
    let hidden = model.forward(ids(1, 0), &[], &mut cache, attention.as_ref());
    let enqueue = t.elapsed().as_secs_f64() * 1e3;
    device.sync().expect("device sync");
    let wall = t.elapsed().as_secs_f64() * 1e3;
    drop(hidden);
    println!("forward enqueue (host only) {enqueue:.2} ms, with the device done {wall:.2} ms");
    if args.graph {
        captured_steps(args, device, &model, attention.as_ref());
    }
}

/// The captured step of `llama generate` from a prompt of `--context` tokens per row: its
/// median over `--steps` replays (the first four, which warm up and capture, left out).
fn captured_steps(args: &Args, device: &Device, model: &Llama, attention: &dyn AttentionImpl) {
    let vocab = model.config.vocab_size;
    let prompts: Vec<Vec<u32>> = (0..args.batch)
        .map(|r| {
            (0..args.context.max(1))
                .map(|i| ((i * 7919 + r) % vocab) as u32)
                .collect()
        })
        .collect();
    let (mut decoder, _) = CapturedDecoder::prefill(model, attention, &prompts, args.steps + 8)
        .unwrap_or_else(|e| panic!("prefill: {e}"));
    let mut times = Vec::new();
    for step in 0..args.steps + 4 {
        let tokens: Vec<u32> = (0..args.batch)
            .map(|r| ((step * 31 + r) % vocab) as u32)
            .collect();
        let (logits, ms) = timed(device, || decoder.step(&tokens));
        drop(logits.unwrap_or_else(|e| panic!("step: {e}")));
        if step >= 4 {
            times.push(ms);
        }
    }
    let (med, min, p90) = summary(times);
    println!(
        "captured decode step (median of {}): {med:.3} ms (min {min:.3}, p90 {p90:.3}); {}",
        args.steps,
        decoder.info()
    );
}

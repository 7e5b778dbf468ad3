//! Compression ratio and perplexity of the KV caches of `burn-kvcache` on real text (CPU,
//! Flex, SmolLM2-135M); prints markdown tables to stdout.
//!
//! ```sh
//! cargo run --release -p burn-llama-examples --example kv_table -- --text llama/data/paragraph.txt
//! ```
//!
//! Every row prefills the first `--prefix` tokens, then scores the rest teacher-forced in
//! decode steps of `--chunk` tokens through the cache
//! ([`burn_llama::eval::perplexity_with_cache_chunked`]); compression is full bytes / bytes
//! held at the end. Rows: full, MiniCache (start layer = num_layers / 2), 4- and 2-bit
//! quantization, MiniCache + 4-bit; then a γ sweep and a start-layer sweep of MiniCache, with
//! the fraction of merged token pairs retained unmerged.

use burn::tensor::Device;
use burn_kernels_core::{KvCache, ReferenceAttention};
use burn_kvcache::{MiniCacheConfig, MiniCacheKv, QuantConfig};
use burn_llama::eval::{CacheEval, CacheKind, CacheSpec, perplexity_with_cache_chunked};
use burn_llama_examples::smollm::load_smollm;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(about = "KV-cache compression vs perplexity (CPU, Flex)")]
struct Args {
    /// The text to score.
    #[arg(long, default_value = "llama/data/paragraph.txt")]
    text: std::path::PathBuf,
    /// Tokens prefilled before scoring (default: half the text).
    #[arg(long)]
    prefix: Option<usize>,
    /// Use at most this many tokens of the text.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Tokens per teacher-forced decode step.
    #[arg(long, default_value_t = 4)]
    chunk: usize,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0,0.02,0.05,0.1,0.2,0.3,0.4,0.5"
    )]
    gammas: Vec<f32>,
    /// Start layers of the start-layer sweep (at the default γ).
    #[arg(long, value_delimiter = ',', default_value = "0,8,15,22")]
    start_layers: Vec<usize>,
    #[arg(long, default_value_t = 0.6)]
    t: f32,
    #[arg(long, default_value_t = 0.05)]
    gamma: f32,
    /// MiniCache merge window.
    #[arg(long, default_value_t = 16)]
    window: usize,
    #[arg(long, default_value_t = 32)]
    group: usize,
    #[arg(long, default_value_t = 32)]
    residual: usize,
}

struct Row {
    label: String,
    eval: CacheEval,
    /// Retained fraction and mean θ/π of the merged pairs.
    merge: Option<(f64, f64)>,
}

fn main() {
    let args = Args::parse();
    let device = Device::flex();
    let (ckpt, model) = load_smollm(&device);
    let text = std::fs::read_to_string(&args.text).expect("readable text");
    let mut tokens = ckpt.tokenizer.encode(&text).expect("tokenizes");
    if let Some(m) = args.max_tokens {
        tokens.truncate(m);
    }
    let prefix = args.prefix.unwrap_or(tokens.len() / 2);
    let cfg = &model.config;
    let layers = cfg.num_layers;
    let attention = ReferenceAttention;
    let mc = MiniCacheConfig {
        start_layer: None,
        t: args.t,
        gamma: args.gamma,
        window: args.window,
    };
    let quant = QuantConfig {
        bits: 4,
        group_size: args.group,
        residual: args.residual,
        ..QuantConfig::default()
    };
    eprintln!(
        "{}: {} tokens, prefix {prefix}, {} scored, chunk {}; {layers} layers, {} KV heads, \
         head_dim {}",
        args.text.display(),
        tokens.len(),
        tokens.len() - prefix,
        args.chunk,
        cfg.num_kv_heads,
        cfg.head_dim
    );

    let eval = |cache: &mut dyn KvCache| {
        let t = std::time::Instant::now();
        let e =
            perplexity_with_cache_chunked(&model, &tokens, prefix, cache, &attention, args.chunk);
        eprintln!(
            "  {}: ppl {:.4}, {:.2}x in {:.1}s",
            e.cache,
            e.perplexity,
            e.compression(),
            t.elapsed().as_secs_f64()
        );
        e
    };
    let spec = |kind| CacheSpec {
        minicache: mc,
        quant,
        ..CacheSpec::new(kind)
    };
    let minicache_row = |label: String, cfg: MiniCacheConfig, q: Option<QuantConfig>| {
        let mut c = match q {
            Some(q) => MiniCacheKv::with_quant(layers, cfg, q),
            None => MiniCacheKv::new(layers, cfg),
        }
        .expect("valid config");
        let e = eval(&mut c);
        Row {
            label,
            eval: e,
            merge: Some((c.stats().retained_fraction(), c.stats().mean_dist())),
        }
    };

    let mut main_rows = Vec::new();
    for (label, kind) in [
        ("full", CacheKind::Full),
        ("quant4", CacheKind::Quant4),
        ("quant2", CacheKind::Quant2),
    ] {
        let mut c = spec(kind).build(layers).expect("valid config");
        main_rows.push(Row {
            label: label.into(),
            eval: eval(c.as_mut()),
            merge: None,
        });
    }
    main_rows.insert(
        1,
        minicache_row(format!("minicache (start {})", layers / 2), mc, None),
    );
    main_rows.push(minicache_row(
        format!("minicache+quant4 (start {})", layers / 2),
        mc,
        Some(quant),
    ));
    let base = main_rows[0].eval.perplexity;

    println!(
        "KV caches on `{}` ({} tokens: {prefix} prefilled, {} scored in steps of {}), \
         SmolLM2-135M f32 on CPU, t = {}, γ = {}, merge window {}, quantization group {}, \
         residual {}.\n",
        args.text.display(),
        tokens.len(),
        tokens.len() - prefix,
        args.chunk,
        args.t,
        args.gamma,
        args.window,
        args.group,
        args.residual
    );
    print_table(&main_rows, base);

    let sweep: Vec<Row> = args
        .gammas
        .iter()
        .map(|&gamma| {
            minicache_row(
                format!("minicache γ = {gamma}"),
                MiniCacheConfig { gamma, ..mc },
                None,
            )
        })
        .collect();
    println!("\nγ sweep (MiniCache alone, start layer {}):\n", layers / 2);
    print_table(&sweep, base);

    let mut starts = Vec::new();
    for &s in args.start_layers.iter().filter(|&&s| s < layers) {
        let c = MiniCacheConfig {
            start_layer: Some(s),
            ..mc
        };
        starts.push(minicache_row(format!("minicache start {s}"), c, None));
        starts.push(minicache_row(
            format!("minicache+quant4 start {s}"),
            c,
            Some(quant),
        ));
    }
    println!("\nStart-layer sweep (γ = {}):\n", args.gamma);
    print_table(&starts, base);

    print_merge_bounds(layers, cfg.head_dim);
}

/// Merging alone cannot beat L / (unmerged + pairs·(d + 3)/d) even with nothing retained and
/// nothing pending: a merged pair holds one direction, two magnitudes and a slot per token and
/// KV head, against 2·d elements unmerged.
fn print_merge_bounds(layers: usize, head_dim: usize) {
    let d = head_dim as f64;
    println!("\nUpper bounds of merging alone (nothing retained, nothing pending), f32:\n");
    println!("| start layer | merged pairs | unmerged layers | best compression |");
    println!("|---|---|---|---|");
    for s in [0, layers / 4, layers / 2, 3 * layers / 4] {
        let pairs = (layers - s) / 2;
        let unmerged = layers - 2 * pairs;
        let held = unmerged as f64 + pairs as f64 * (d + 3.0) / d;
        println!(
            "| {s} | {pairs} | {unmerged} | {:.3}x |",
            layers as f64 / held
        );
    }
}

fn print_table(rows: &[Row], base: f64) {
    println!(
        "| cache | KV bytes held | full bytes | compression | retained | mean θ/π | perplexity \
         | Δ vs full |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows {
        let e = &r.eval;
        println!(
            "| {} | {} | {} | {:.2}x | {} | {} | {:.4} | {:+.2}% |",
            r.label,
            e.bytes_held,
            e.full_bytes,
            e.compression(),
            r.merge
                .map_or("–".into(), |(f, _)| format!("{:.1}%", 100.0 * f)),
            r.merge.map_or("–".into(), |(_, d)| format!("{d:.3}")),
            e.perplexity,
            100.0 * (e.perplexity / base - 1.0)
        );
    }
}

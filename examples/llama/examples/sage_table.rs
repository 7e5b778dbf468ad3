//! SageAttention2 (burn-sage) on SmolLM2-135M-Instruct: the accuracy of each Sage variant on the
//! Q/K/V every layer sees when the model reads a text (against exact f32 attention, the paper's
//! metrics), and the text's perplexity under each variant. Prints markdown to stdout.
//!
//! ```sh
//! cargo run --release -p burn-llama-examples --example sage_table -- --text llama/data/paragraph.txt
//! ```
//!
//! On the CPU (Flex) every Sage variant runs burn-sage's tensor-op reference, which rounds
//! exactly as the kernels do. Q/K/V are captured (after RoPE) from one forward pass with the
//! reference attention, so every layer's inputs are the full-precision model's.

use burn::tensor::Device;
use burn_kernels_core::ReferenceAttention;
use burn_llama::attention::{AttentionChoice, SAGE_VARIANTS, capture_qkv, sage_variant};
use burn_llama::generate::perplexity;
use burn_llama_examples::smollm::load_smollm;
use burn_sage::adaptive::{DEFAULT_INT4_THRESHOLD, accuracies};
use burn_sage::{Accuracy, SageOptions};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(about = "Sage attention accuracy per layer and perplexity on SmolLM2 (CPU, Flex)")]
struct Args {
    /// The text the model reads.
    #[arg(long, default_value = "llama/data/paragraph.txt")]
    text: std::path::PathBuf,
    /// Skip the perplexity table.
    #[arg(long)]
    no_perplexity: bool,
}

fn main() {
    let args = Args::parse();
    let device = Device::flex();
    let (ckpt, model) = load_smollm(&device);
    let text = std::fs::read_to_string(&args.text).expect("readable text");
    let tokens = ckpt.tokenizer.encode(&text).expect("tokenizes");
    let cfg = &model.config;

    // Variants: the CLI's fixed ones, and INT4 without Q smoothing to show what it buys.
    let mut variants: Vec<(String, SageOptions)> = SAGE_VARIANTS
        .iter()
        .map(|&name| (format!("`{name}`"), sage_variant(name)))
        .collect();
    variants.insert(
        3,
        (
            "`sage-int4`, no Q smoothing".into(),
            SageOptions {
                smooth_q: false,
                ..sage_variant("sage-int4")
            },
        ),
    );
    let options: Vec<SageOptions> = variants.iter().map(|(_, o)| *o).collect();

    let t = std::time::Instant::now();
    let captured = capture_qkv(&model, &tokens).expect("every layer runs");
    let per_layer: Vec<Vec<Accuracy>> = captured
        .into_iter()
        .map(|(q, k, v, causal)| accuracies(q, k, v, causal, None, &options).expect("valid"))
        .collect();
    eprintln!(
        "{} layers measured in {:.1}s",
        per_layer.len(),
        t.elapsed().as_secs_f64()
    );

    println!(
        "Sage attention against exact f32 attention on the Q/K/V of every layer of \
         SmolLM2-135M-Instruct reading `{}` ({} tokens, causal; {} query / {} KV heads, head \
         dim {}), CPU (Flex: burn-sage's reference path, same rounding as the kernels).\n",
        args.text.display(),
        tokens.len(),
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim
    );
    println!(
        "| variant | Q·Kᵀ | P̃·V | cos sim mean | cos sim min (layer) | rel L1 mean | rel L1 max | RMSE mean | RMSE max |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|");
    for (i, (label, o)) in variants.iter().enumerate() {
        let col: Vec<Accuracy> = per_layer.iter().map(|l| l[i]).collect();
        let n = col.len() as f64;
        let mean = |f: fn(&Accuracy) -> f64| col.iter().map(f).sum::<f64>() / n;
        let max = |f: fn(&Accuracy) -> f64| col.iter().map(f).fold(f64::MIN, f64::max);
        let (worst, min_cos) = col
            .iter()
            .enumerate()
            .map(|(l, a)| (l, a.cos_sim))
            .fold((0, f64::MAX), |m, x| if x.1 < m.1 { x } else { m });
        println!(
            "| {label} | {} | {} | {:.6} | {min_cos:.6} ({worst}) | {:.4} | {:.4} | {:.5} | {:.5} |",
            qk_label(o),
            pv_label(o),
            mean(|a| a.cos_sim),
            mean(|a| a.rel_l1),
            max(|a| a.rel_l1),
            mean(|a| a.rmse),
            max(|a| a.rmse),
        );
    }

    println!("\nPer layer: cos sim / rel L1 / RMSE.\n");
    let header: Vec<&str> = variants.iter().map(|(l, _)| l.as_str()).collect();
    println!("| layer | {} |", header.join(" | "));
    println!("|---:|{}", "---|".repeat(variants.len()));
    for (layer, accs) in per_layer.iter().enumerate() {
        let cells: Vec<String> = accs
            .iter()
            .map(|a| format!("{:.6} / {:.4} / {:.5}", a.cos_sim, a.rel_l1, a.rmse))
            .collect();
        println!("| {layer} | {} |", cells.join(" | "));
    }

    if args.no_perplexity {
        return;
    }
    let t = std::time::Instant::now();
    let full = perplexity(&model, &tokens, &ReferenceAttention).expect("the text fits the context");
    println!(
        "\nPerplexity of `{}` ({} tokens), CPU:\n",
        args.text.display(),
        tokens.len()
    );
    println!("| attention | perplexity | vs full |");
    println!("|---|---:|---:|");
    println!("| `reference` (f32) | {full:.4} | |");
    for name in SAGE_VARIANTS.iter().copied().chain(["sage-adaptive"]) {
        let choice = AttentionChoice::parse(name).expect("a CLI name");
        let (attention, reports) = choice
            .build(Some((&model, &tokens)), DEFAULT_INT4_THRESHOLD)
            .expect("builds");
        let ppl =
            perplexity(&model, &tokens, attention.as_ref()).expect("the text fits the context");
        let label = if reports.is_empty() {
            format!("`{name}`")
        } else {
            let int4 = reports
                .iter()
                .filter(|r| r.choice == burn_sage::QkQuant::Int4PerThread)
                .count();
            format!(
                "`{name}` ({int4} of {} layers INT4 at score ≥ {DEFAULT_INT4_THRESHOLD})",
                reports.len()
            )
        };
        println!(
            "| {label} | {ppl:.4} | {:+.3}% |",
            (ppl - full) / full * 100.0
        );
    }
    eprintln!("perplexities in {:.1}s", t.elapsed().as_secs_f64());
}

fn qk_label(o: &SageOptions) -> String {
    let smooth = match (o.smooth_q, o.smooth_k) {
        (true, true) => "Q+K smoothed",
        (false, true) => "K smoothed",
        (true, false) => "Q smoothed",
        (false, false) => "no smoothing",
    };
    format!("{}, {smooth}", o.qk.name())
}

fn pv_label(o: &SageOptions) -> &'static str {
    match o.pv {
        burn_sage::PvPrecision::Fp16 => "FP16",
        burn_sage::PvPrecision::Fp8E4m3 => "FP8 E4M3",
    }
}

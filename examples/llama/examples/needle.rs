//! Needle in a haystack (pass-key retrieval) with SmolLM2-135M on the CPU: full cache vs
//! ShadowKV at a few sparse budgets. Prints a markdown table to stdout.
//!
//! ```sh
//! cargo run --release -p burn-llama-examples --example needle -- --tokens 7000 --depths 0.1,0.5,0.9
//! ```
//!
//! The prompt is the classic pass-key task (Mohtashami & Jaggi, 2023): repeated filler
//! sentences with "The pass key is NNNNN. Remember it. NNNNN is the pass key." inserted at a
//! relative depth, ending with "What is the pass key? The pass key is". Each prompt is
//! prefilled once, in pieces of `--piece` tokens through a full cache (the CPU reference
//! attention would otherwise hold `heads·S²` scores at once); its keys and values then seed
//! every cache compared: the full cache itself, and ShadowKV through
//! [`burn_kvcache::ShadowKvCache::compress_prompt`] (a ShadowKV prefill is exact, so the
//! first answer token is the same for every cache; the rest are decoded greedily through each
//! cache). A trial counts as retrieved when the decoded answer contains the key's digits.
//!
//! Budgets are fractions of the prompt length, rounded down to whole chunks; outlier chunks
//! scale with the budget as the paper's defaults do (48 chunks per 2048 tokens) unless
//! `--outliers` is given.

use std::time::Instant;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_kernels_core::{FullKvCache, KvCache, ReferenceAttention};
use burn_kvcache::ShadowKvConfig;
use burn_llama::eval::shadowkv_for;
use burn_llama::model::Llama;
use burn_llama::passkey::{fillers_for, holds_key, passkey_text};
use burn_llama_examples::smollm::load_smollm;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(about = "Pass-key retrieval: full cache vs ShadowKV (CPU, Flex)")]
struct Args {
    /// Approximate prompt length in tokens.
    #[arg(long, default_value_t = 7000)]
    tokens: usize,
    /// Relative depths of the needle.
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.3,0.5,0.7,0.9")]
    depths: Vec<f64>,
    /// Pass keys tried per depth.
    #[arg(long, default_value_t = 1)]
    trials: usize,
    /// Sparse budgets as fractions of the prompt.
    #[arg(long, value_delimiter = ',', default_value = "0.0625,0.25")]
    budgets: Vec<f64>,
    /// ShadowKV rank (SmolLM2: kv_heads · head_dim = 192).
    #[arg(long, default_value_t = 160)]
    rank: usize,
    /// Outlier chunks (default: 24 per 1024 budget tokens).
    #[arg(long)]
    outliers: Option<usize>,
    /// Prefill piece length.
    #[arg(long, default_value_t = 512)]
    piece: usize,
    /// Answer tokens decoded.
    #[arg(long, default_value_t = 8)]
    max_new: usize,
}

fn argmax_last(model: &Llama, hidden: Tensor<3>) -> u32 {
    let [_, s, h] = hidden.dims();
    let last = hidden.slice([0..1, s - 1..s, 0..h]);
    model
        .logits(last)
        .argmax(2)
        .into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .expect("int")[0] as u32
}

/// Greedy tokens after `first` (already sampled from the prefill).
fn decode(model: &Llama, cache: &mut dyn KvCache, first: u32, n: usize) -> Vec<u32> {
    let device = model.embed.val().device();
    let mut out = vec![first];
    while out.len() < n {
        let last = *out.last().expect("non-empty") as i64;
        let input = Tensor::<2, Int>::from_data(TensorData::new(vec![last], [1, 1]), &device);
        let hidden = model.forward(input, &[], cache, &ReferenceAttention);
        out.push(argmax_last(model, hidden));
    }
    out
}

fn main() {
    let args = Args::parse();
    let device = Device::flex();
    let (ckpt, model) = load_smollm(&device);
    let tok = &ckpt.tokenizer;
    let cfg = model.config.clone();
    let fillers = fillers_for(tok, args.tokens).expect("encode");

    let mut labels = vec!["full".to_string()];
    let mut hits = vec![0usize; 1 + args.budgets.len()];
    let mut rows = Vec::new();
    let mut key_state = 0x9e37_79b9u32;
    for &depth in &args.depths {
        for _ in 0..args.trials {
            // A 5-digit key from a fixed LCG: reproducible runs.
            key_state = key_state
                .wrapping_mul(1_664_525)
                .wrapping_add(1_013_904_223);
            let key = 10_000 + (key_state >> 8) % 90_000;
            let ids = tok
                .encode(&passkey_text(fillers, depth, key))
                .expect("encode");
            let n = ids.len();
            let t = Instant::now();
            let mut rec = FullKvCache::new(cfg.num_layers);
            let mut hidden = None;
            for from in (0..n).step_by(args.piece) {
                let to = (from + args.piece).min(n);
                let piece: Vec<i64> = ids[from..to].iter().map(|&x| x as i64).collect();
                let input =
                    Tensor::<2, Int>::from_data(TensorData::new(piece, [1, to - from]), &device);
                hidden = Some(model.forward(input, &[], &mut rec, &ReferenceAttention));
            }
            let first = argmax_last(&model, hidden.expect("n ≥ 1"));
            let prefill_s = t.elapsed().as_secs_f64();

            let mut answers = Vec::new();
            let t = Instant::now();
            let mut full = rec.clone();
            answers.push(decode(&model, &mut full, first, args.max_new));
            let full_s = t.elapsed().as_secs_f64();
            let mut shadow_s = Vec::new();
            for (bi, &frac) in args.budgets.iter().enumerate() {
                let chunk = 8;
                let budget = (((n as f64 * frac) as usize) / chunk).max(4) * chunk;
                let outliers = args.outliers.unwrap_or((budget * 24).div_ceil(1024));
                let sc = ShadowKvConfig {
                    rank: args.rank,
                    chunk,
                    budget,
                    local_chunks: 4,
                    outlier_chunks: outliers,
                    min_prompt: 0,
                };
                if labels.len() <= bi + 1 {
                    labels.push(format!(
                        "shadowkv {:.1}% (budget {budget}, {outliers} outlier chunks, rank {})",
                        frac * 100.0,
                        args.rank
                    ));
                }
                let t = Instant::now();
                let mut sk = shadowkv_for(&cfg, sc).expect("valid config");
                for layer in 0..cfg.num_layers {
                    let (k, v) = rec.layer(layer).expect("prefilled");
                    let sparse = sk.compress_prompt(layer, k, v, None).expect("valid prompt");
                    assert!(sparse, "a prompt of {n} tokens is compressed");
                }
                answers.push(decode(&model, &mut sk, first, args.max_new));
                let b = sk.bytes_split();
                shadow_s.push(format!(
                    "{:.1}s, device {:.1} MB + host {:.1} MB",
                    t.elapsed().as_secs_f64(),
                    b.device as f64 / 1e6,
                    b.host as f64 / 1e6
                ));
            }
            let mut cells = Vec::new();
            for (i, a) in answers.iter().enumerate() {
                let text = tok.decode(a).expect("decode");
                let ok = holds_key(&text, key);
                hits[i] += usize::from(ok);
                cells.push(format!(
                    "{} `{}`",
                    if ok { "✓" } else { "✗" },
                    text.trim().replace('\n', " ")
                ));
            }
            eprintln!(
                "depth {depth} key {key}: {n} tokens, prefill {prefill_s:.1}s, full decode \
                 {full_s:.1}s, shadowkv {shadow_s:?}"
            );
            rows.push((depth, key, n, cells));
        }
    }

    println!(
        "| depth | key | tokens | {} |",
        labels
            .iter()
            .map(|l| l.as_str())
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|---|---|{}", "---|".repeat(labels.len()));
    for (depth, key, n, cells) in &rows {
        println!("| {depth} | {key} | {n} | {} |", cells.join(" | "));
    }
    let total = rows.len().max(1);
    println!(
        "| **accuracy** | | | {} |",
        hits.iter()
            .map(|h| format!("{h}/{total} ({:.0}%)", 100.0 * *h as f64 / total as f64))
            .collect::<Vec<_>>()
            .join(" | ")
    );
}

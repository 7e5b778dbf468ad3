//! Long-context retrieval with SmolLM2-135M on the CPU: the full cache against ShadowKV at a
//! few sparse budgets. Prints a markdown table to stdout.
//!
//! ```sh
//! # the pass-key task at five depths
//! cargo run --release -p burn-llama-examples --example needle -- --tokens 7000
//! # RULER-style tasks (burn_llama::ruler) in the Shakespeare corpus, 4 seeds each
//! cargo run --release -p burn-llama-examples --example needle -- --tokens 4096 \
//!     --tasks single,multi-key,multi-value,multi-query,variable-tracking --trials 4
//! ```
//!
//! Without `--tasks` the prompt is the classic pass-key task (Mohtashami & Jaggi, 2023):
//! repeated filler sentences with "The pass key is NNNNN. Remember it. NNNNN is the pass key."
//! at a relative depth, ending with "What is the pass key? The pass key is"; a trial counts when
//! the answer holds the key's digits. With `--tasks`, each trial is a [`ruler_sample`] of the
//! task (seed = trial number) in the corpus of `cargo xtask fetch-corpus` (`--haystack`; the
//! filler sentences where it is missing), scored by [`string_match_all`].
//!
//! Each prompt is prefilled once ([`greedy_answers`]) and its keys and values seed every cache
//! compared, so the first answer token is the same for all; the rest are decoded greedily
//! through each cache. Budgets are fractions of the prompt length, rounded down to whole chunks;
//! outlier chunks scale with the budget as the paper's defaults do (48 chunks per 2048 tokens)
//! unless `--outliers` is given.

use std::path::PathBuf;

use burn::tensor::Device;
use burn_kernels_core::ReferenceAttention;
use burn_kvcache::{ChunkScoring, ShadowKvConfig};
use burn_llama::eval::{SeededCache, greedy_answers};
use burn_llama::passkey::{fillers_for, passkey_text};
use burn_llama::ruler::{Haystack, RulerTask, ruler_sample, string_match_all};
use burn_llama_examples::smollm::load_smollm;
use clap::{Parser, ValueEnum};

#[derive(Debug, Parser)]
#[command(about = "Long-context retrieval: full cache vs ShadowKV (CPU, Flex)")]
struct Args {
    /// Approximate prompt length in tokens.
    #[arg(long, default_value_t = 7000)]
    tokens: usize,
    /// RULER-style tasks to run instead of the pass key.
    #[arg(long, value_enum, value_delimiter = ',')]
    tasks: Vec<RulerTask>,
    /// Relative depths of the pass key (without `--tasks`).
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.3,0.5,0.7,0.9")]
    depths: Vec<f64>,
    /// Trials per depth (pass key) or per task (seeds 0, 1, ...).
    #[arg(long, default_value_t = 1)]
    trials: usize,
    /// Text the RULER-style needles are hidden in (a .txt file or a folder of them).
    /// Default: the Shakespeare corpus of `cargo xtask fetch-corpus`.
    #[arg(long)]
    haystack: Option<PathBuf>,
    /// Sparse budgets as fractions of the prompt.
    #[arg(long, value_delimiter = ',', default_value = "0.0625,0.25")]
    budgets: Vec<f64>,
    /// ShadowKV rank (SmolLM2: kv_heads · head_dim = 192).
    #[arg(long, default_value_t = 160)]
    rank: usize,
    /// ShadowKV chunk length (tokens per landmark).
    #[arg(long, default_value_t = 8)]
    chunk: usize,
    /// Outlier chunks (default: 192 tokens' worth per 1024 budget tokens, 24 chunks of 8).
    #[arg(long)]
    outliers: Option<usize>,
    /// How ShadowKV scores chunks; several give a column each (same prefill).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "mean")]
    scoring: Vec<ChunkScoring>,
    /// ShadowKV two-stage selection: candidate chunks per selected chunk (1: off).
    #[arg(long, default_value_t = 1)]
    candidates: usize,
    /// ShadowKV reuses the previous step's chunks only where they are at least this percent
    /// of a step's (`ShadowKvConfig::reuse_min_percent`; the answers do not depend on it).
    #[arg(long, default_value_t = ShadowKvConfig::default().reuse_min_percent)]
    reuse_min: u32,
    /// Prefill piece length.
    #[arg(long, default_value_t = 512)]
    piece: usize,
    /// Answer tokens decoded (default: 8 for the pass key, 48 for the RULER-style tasks).
    #[arg(long)]
    max_new: Option<usize>,
}

/// One prompt to answer: its row label, text and what the answer must hold.
struct Trial {
    group: String,
    label: String,
    text: String,
    answers: Vec<String>,
}

fn corpus_dir() -> PathBuf {
    let home = std::env::var("HOME").unwrap_or_else(|_| ".".into());
    PathBuf::from(home).join(".cache/burn-kernels/corpus/shakespeare")
}

fn main() {
    let args = Args::parse();
    let device = Device::flex();
    let (ckpt, model) = load_smollm(&device);
    let tok = &ckpt.tokenizer;

    let trials = trials(&args, tok);
    let max_new = args
        .max_new
        .unwrap_or(if args.tasks.is_empty() { 8 } else { 48 });
    let mut labels = vec!["full".to_string()];
    let mut rows = Vec::new();
    for trial in &trials {
        let ids = tok.encode(&trial.text).expect("encode");
        let n = ids.len();
        let mut caches = vec![SeededCache::Full];
        for (&frac, &scoring) in args
            .budgets
            .iter()
            .flat_map(|f| args.scoring.iter().map(move |s| (f, s)))
        {
            let chunk = args.chunk.max(1);
            // The local window and the outliers hold the same tokens whatever the chunk: 32
            // local tokens, and 192 outlier tokens per 1024 of budget (the paper's 48 chunks
            // of 8 per 2048).
            let local_chunks = 32usize.div_ceil(chunk);
            let budget = (((n as f64 * frac) as usize) / chunk).max(local_chunks) * chunk;
            let outliers = args
                .outliers
                .unwrap_or((budget * 192).div_ceil(1024 * chunk));
            if labels.len() <= caches.len() {
                labels.push(format!(
                    "shadowkv {:.1}% (budget {budget}, chunk {chunk}, {outliers} outlier chunks, rank {}, scoring {}, candidates {})",
                    frac * 100.0,
                    args.rank,
                    scoring.to_possible_value().expect("named").get_name(),
                    args.candidates
                ));
            }
            caches.push(SeededCache::ShadowKv(ShadowKvConfig {
                rank: args.rank,
                chunk,
                budget,
                local_chunks,
                outlier_chunks: outliers,
                min_prompt: 0,
                scoring,
                candidates: args.candidates,
                pinned_uploads: true,
                reuse_min_percent: args.reuse_min,
            }));
        }
        let got = greedy_answers(
            &model,
            &ids,
            &caches,
            args.piece,
            max_new,
            tok.eos_token_ids(),
            &ReferenceAttention,
        )
        .unwrap_or_else(|e| panic!("{}: {e}", trial.label));
        let mut row = Row {
            group: trial.group.clone(),
            label: trial.label.clone(),
            tokens: n,
            cells: Vec::new(),
            scores: Vec::new(),
            agree: Vec::new(),
        };
        for answer in &got.tokens {
            let text = tok.decode(answer).expect("decode");
            let score = string_match_all(&text, &trial.answers);
            row.scores.push(score);
            row.agree.push(*answer == got.tokens[0]);
            let mark = match score {
                1.0 => "✓".to_string(),
                0.0 => "✗".to_string(),
                s => format!("{:.0}%", s * 100.0),
            };
            row.cells.push(format!(
                "{mark} `{}`",
                text.trim().replace(['\n', '|'], " ")
            ));
        }
        // How much adjacent decode steps' chunk selections overlap: the share of the values a
        // step could take from the previous one instead of host memory.
        let overlap: Vec<String> = got
            .shadow
            .iter()
            .flatten()
            .map(|t| format!("{:.1}%", 100.0 * t.overlap()))
            .collect();
        eprintln!(
            "{}: {n} tokens, prefill {:.1}s, per cache {:.1?} s, bytes (device, host) {:?}, \
             ShadowKV selections overlapping the previous step's {overlap:?}",
            trial.label, got.prefill_secs, got.decode_secs, got.bytes
        );
        rows.push(row);
    }
    print_tables(&labels, &rows);
}

/// The prompts: pass keys at each depth, or each task's seeded samples.
fn trials(args: &Args, tok: &burn_llama::tokenizer::Tokenizer) -> Vec<Trial> {
    let mut out = Vec::new();
    if args.tasks.is_empty() {
        let fillers = fillers_for(tok, args.tokens).expect("encode");
        let mut key_state = 0x9e37_79b9u32;
        for &depth in &args.depths {
            for _ in 0..args.trials {
                // A 5-digit key from a fixed LCG: reproducible runs.
                key_state = key_state
                    .wrapping_mul(1_664_525)
                    .wrapping_add(1_013_904_223);
                let key = 10_000 + (key_state >> 8) % 90_000;
                out.push(Trial {
                    group: "pass key".into(),
                    label: format!("pass key, depth {depth}, key {key}"),
                    text: passkey_text(fillers, depth, key),
                    answers: vec![key.to_string()],
                });
            }
        }
        return out;
    }
    let dir = args.haystack.clone().unwrap_or_else(corpus_dir);
    let haystack = Haystack::load(&dir).unwrap_or_else(|e| {
        eprintln!("{e}; the needles are hidden in filler sentences instead");
        Haystack::filler()
    });
    let mut count = |s: &str| tok.encode(s).map(|ids| ids.len());
    for &task in &args.tasks {
        for seed in 0..args.trials as u64 {
            let s = ruler_sample(task, &haystack, args.tokens, seed, &mut count)
                .unwrap_or_else(|e| panic!("{}: {e}", task.name()));
            out.push(Trial {
                group: task.name(),
                label: format!("{}, seed {seed}", task.name()),
                text: s.text,
                answers: s.answers,
            });
        }
    }
    out
}

/// One answered trial: its answers' cells, scores and agreement with the full cache, per cache.
struct Row {
    group: String,
    label: String,
    tokens: usize,
    cells: Vec<String>,
    scores: Vec<f64>,
    agree: Vec<bool>,
}

/// The answers, then each task's mean score and answers equal to the full cache's.
fn print_tables(labels: &[String], rows: &[Row]) {
    println!("| trial | tokens | {} |", labels.join(" | "));
    println!("|---|---:|{}", "---|".repeat(labels.len()));
    for r in rows {
        println!("| {} | {} | {} |", r.label, r.tokens, r.cells.join(" | "));
    }
    println!();
    println!(
        "| task | trials | {} |",
        labels
            .iter()
            .map(|l| format!("{l}: score (equal answers)"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|---:|{}", "---:|".repeat(labels.len()));
    let mut groups: Vec<&str> = Vec::new();
    for r in rows {
        if !groups.contains(&r.group.as_str()) {
            groups.push(&r.group);
        }
    }
    let all = rows.iter().collect::<Vec<_>>();
    let summary = |name: &str, rows: &[&Row]| {
        let cells = (0..labels.len()).map(|c| {
            let score = rows.iter().map(|r| r.scores[c]).sum::<f64>() / rows.len() as f64;
            let equal = rows.iter().filter(|r| r.agree[c]).count();
            format!("{:.1} ({equal}/{})", 100.0 * score, rows.len())
        });
        let cells = cells.collect::<Vec<_>>().join(" | ");
        println!("| {name} | {} | {cells} |", rows.len());
    };
    for g in &groups {
        let rows: Vec<&Row> = rows.iter().filter(|r| r.group == *g).collect();
        summary(g, &rows);
    }
    if groups.len() > 1 {
        summary("**all**", &all);
    }
}

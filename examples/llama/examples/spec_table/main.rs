//! Block efficiency of the multi-draft schemes on real text, with K identical drafts (the
//! target's first layers, or a trained draft), K = 1..max-k, at several draft temperatures;
//! prints markdown tables to stdout (each row as soon as it is measured).
//!
//! ```sh
//! cargo run --release -p burn-llama-examples --example spec_table -- --prompts 5 --new-tokens 32
//! # a few hundred prompts of held-out Shakespeare on a GPU, with a distilled draft
//! cargo run --release -p burn-llama-examples --features cuda --example spec_table -- --backend cuda \
//!     --corpus ~/.cache/burn-kernels/corpus/shakespeare --prompts 256 --draft-model runs/draft4
//! ```
//!
//! 1. *Measured block efficiency*: speculative decoding of `--prompts` windows of
//!    `--prompt-len` tokens, decoded `--batch` at a time per configuration (target at
//!    `--target-temperature`, no stop tokens); every configuration uses the same seeds. The
//!    windows are consecutive tokens of `llama/data/paragraph.txt`, or, with
//!    `--corpus`, evenly spaced over the corpus's last `--heldout-fraction` (the part
//!    `finetune` holds out, so a draft distilled from the rest never saw them). K = 1 is
//!    single-draft SD, shared by every row.
//! 3. *Exact acceptance* (`--exact`, instead of 1 and 2): for every prompt the target's own
//!    continuation of `--new-tokens` tokens, and at each of its positions each scheme's exact
//!    acceptance probability for K = `--exact-ks` identical drafts; mean over prompts ±
//!    standard error, and a chart with `--chart` (see `exact.rs`):
//!    `spec_table --exact --corpus ~/.cache/burn-kernels/corpus/shakespeare --prompts 500
//!    --prompt-len 64 --new-tokens 16 --draft-temperatures 1.0,1.2,2.0 --chart exact.svg`.
//!    Split over several runs (each may be killed by a time limit: its rows file keeps every
//!    finished prompt): the same command with `--prompt-start S --prompt-count C --rows-out
//!    rows_S.jsonl` per run, then `spec_table --merge rows_*.jsonl --chart exact.svg` (no model
//!    needed) prints the table of all of them (see `rows.rs`).
//! 2. *Analytic acceptance* (skipped with `--analytic-positions 0`): at evenly spaced positions
//!    of the paragraph (teacher-forced contexts), each scheme's exact probability of accepting
//!    one of K identical drafts, `Verifier::acceptance_probability`, averaged over positions (the
//!    paper's Table 3). It has no sampling noise, so it shows the schemes' ordering where the
//!    measured block efficiencies are within noise of each other.

use std::path::PathBuf;
use std::time::Instant;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_kernels_core::{AttentionImpl, FullKvCache, ReferenceAttention, SamplingConfig};
use burn_llama::finetune::{Corpus, read_corpus};
use burn_llama::loader::{Checkpoint, default_model_path, load};
use burn_llama::model::Llama;
use burn_llama::spec::{Draft, SpecOptions, SpecStats, speculative_generate, truncated_draft};
use burn_specdec::{LpTruncation, Scheme, Verifier};
use clap::{Parser, ValueEnum};

mod exact;
mod rows;
mod table;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    /// Burn's CPU backend (Flex), f32, with the reference attention.
    Cpu,
    /// CUDA f32 with the decode kernels (fused layer ops, split-K decode attention; build with
    /// `--features cuda`).
    Cuda,
}

#[derive(Debug, Parser)]
#[command(about = "Block efficiency of multi-draft speculative decoding")]
struct Args {
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendArg,
    /// Number of prompt windows (0 skips the measured table).
    #[arg(long, default_value_t = 5)]
    prompts: usize,
    /// Tokens per prompt window.
    #[arg(long, default_value_t = 50)]
    prompt_len: usize,
    /// Take the prompts from this corpus (a .txt file or a folder of them) instead of the
    /// committed paragraph.
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// The corpus's held-out tail the prompts come from (`finetune --val-fraction`).
    #[arg(long, default_value_t = 0.05)]
    heldout_fraction: f64,
    /// Prompts decoded together in one speculative run.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[arg(long, default_value_t = 32)]
    new_tokens: usize,
    /// Draft length L.
    #[arg(long, default_value_t = 4)]
    draft_len: usize,
    /// Layers of the truncated-layer draft (without --draft-model).
    #[arg(long, default_value_t = 8)]
    draft_layers: usize,
    /// A trained draft (a `finetune` run folder, .gguf or HF folder) instead of the truncated
    /// target.
    #[arg(long)]
    draft_model: Option<PathBuf>,
    #[arg(long, default_value_t = 6)]
    max_k: usize,
    #[arg(long, value_delimiter = ',', default_value = "1.0,1.2")]
    draft_temperatures: Vec<f32>,
    #[arg(long, default_value_t = 1.0)]
    target_temperature: f32,
    /// Schemes for K >= 2: specinfer, spectr, is (sequential), wis (weighted IS), optimal.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "specinfer,spectr,is,wis,optimal"
    )]
    schemes: Vec<String>,
    /// The LP variable budget of wis and optimal (`LpTruncation::max_variables`; default
    /// `LpTruncation::DEFAULT`'s): larger budgets keep more tokens individually at large K.
    #[arg(long)]
    lp_max_variables: Option<usize>,
    /// Runs per configuration, with seeds 0.. (results pooled).
    #[arg(long, default_value_t = 1)]
    repeats: u64,
    /// Positions of the paragraph for the analytic table (0 skips it).
    #[arg(long, default_value_t = 0)]
    analytic_positions: usize,
    /// Draft depths of the analytic table (default: --draft-layers).
    #[arg(long, value_delimiter = ',')]
    analytic_layers: Vec<usize>,
    /// The exact acceptance table over the prompts' continuations instead of the measured and
    /// analytic tables.
    #[arg(long)]
    exact: bool,
    /// Numbers of identical drafts of the exact table.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    exact_ks: Vec<usize>,
    /// Where the exact table's chart (SVG) goes.
    #[arg(long)]
    chart: Option<PathBuf>,
    /// Skip the first N prompts of the selection (`--prompts` windows, as one run over all of
    /// them would choose and seed them), so that runs can cover disjoint prompt ranges.
    #[arg(long, default_value_t = 0, requires = "exact")]
    prompt_start: usize,
    /// With `--exact`, measure at most this many prompts (from `--prompt-start` on; default: all
    /// the rest), so that each run of a split covers its own range.
    #[arg(long, requires = "exact")]
    prompt_count: Option<usize>,
    /// Write each prompt's mean acceptance per cell and scheme to this file as JSON lines,
    /// flushed as each prompt finishes (see `rows.rs`); `--merge` makes the table from them.
    #[arg(long, requires = "exact")]
    rows_out: Option<PathBuf>,
    /// Print the exact table (and `--chart`) from these `--rows-out` files instead of
    /// measuring (no model is loaded); a prompt in several files is counted once.
    #[arg(long, num_args = 1.., conflicts_with_all = ["exact", "rows_out"])]
    merge: Vec<PathBuf>,
}

fn scheme(name: &str, lp_max_variables: Option<usize>) -> Scheme {
    let trunc = LpTruncation {
        max_variables: lp_max_variables.unwrap_or(LpTruncation::DEFAULT.max_variables),
        ..LpTruncation::DEFAULT
    };
    match name {
        "specinfer" => Scheme::SpecInfer,
        "spectr" => Scheme::SpecTr,
        "is" => Scheme::SequentialImportance,
        "wis" => Scheme::WeightedImportance(trunc),
        "optimal" => Scheme::Optimal(trunc),
        other => panic!("unknown scheme {other}"),
    }
}

/// Pools the counters of several runs.
fn pool(into: &mut SpecStats, s: &SpecStats) {
    into.target_calls += s.target_calls;
    into.blocks += s.blocks;
    into.accepted += s.accepted;
    into.emitted += s.emitted;
    into.decode_secs += s.decode_secs;
    into.draft_secs += s.draft_secs;
    into.target_secs += s.target_secs;
    into.verify_secs += s.verify_secs;
}

fn header(first: &str, ks: &[usize]) -> String {
    let mut out = format!("| {first} | scheme |");
    for k in ks {
        out.push_str(&format!(" K = {k} |"));
    }
    out.push_str("\n|---|---|");
    for _ in ks {
        out.push_str("---|");
    }
    out.push('\n');
    out
}

/// Softmax rows of `model`'s logits at temperature `t` for every position of `tokens`.
fn distributions(
    model: &Llama,
    tokens: &[u32],
    temperatures: &[f32],
    attention: &dyn AttentionImpl,
) -> Vec<Vec<Vec<f64>>> {
    let n = tokens.len();
    let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    let device = model.embed.device();
    let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, n]), &device);
    let mut cache = FullKvCache::new(model.config.num_layers);
    let hidden = model.forward(input, &[], &mut cache, attention);
    let logits = model
        .logits(hidden)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let vocab = logits.len() / n;
    temperatures
        .iter()
        .map(|&t| {
            logits
                .chunks(vocab)
                .map(|row| {
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let w: Vec<f64> = row
                        .iter()
                        .map(|&l| (((l - max) / t) as f64).exp())
                        .collect();
                    let s: f64 = w.iter().sum();
                    w.iter().map(|x| x / s).collect()
                })
                .collect()
        })
        .collect()
}

fn main() {
    let args = Args::parse();
    if !args.merge.is_empty() {
        let merged = rows::merge_files(&args.merge).map_err(|e| format!("--merge: {e}"));
        burn_llama_examples::cli::exit_on_error(merged.map(|t| t.print(args.chart.as_deref())));
        return;
    }
    let ckpt = load(&default_model_path()).expect("model (cargo xtask fetch-model)");
    match args.backend {
        BackendArg::Cpu => run(&args, &ckpt, &Device::flex(), &ReferenceAttention),
        BackendArg::Cuda => {
            let device = burn_llama_examples::cli::BackendArg::Cuda.device();
            burn_llama_examples::cli::exit_on_error(device.map(|device| {
                // The decode kernels: fused layer ops and the split-K decode attention.
                let kernels = burn_kernels_core::FusedLayers::new(std::sync::Arc::new(
                    burn_kvcache::DecodeAttention::default(),
                ));
                run(&args, &ckpt, &device, &kernels);
            }));
        }
    }
}

/// The prompt windows: consecutive ones of the paragraph, or evenly spaced ones over the
/// corpus's held-out tokens, split as `finetune` splits them (so a draft distilled from the
/// training tokens never saw a prompt).
fn prompts(args: &Args, ckpt: &Checkpoint, paragraph: &[u32]) -> Vec<Vec<u32>> {
    let Some(path) = &args.corpus else {
        return paragraph
            .chunks_exact(args.prompt_len)
            .take(args.prompts)
            .map(<[u32]>::to_vec)
            .collect();
    };
    let text = read_corpus(path, 0).expect("corpus");
    let tokens = ckpt.tokenizer.encode(&text).expect("tokenize");
    let ids = Corpus::split(tokens, args.heldout_fraction).val;
    assert!(
        ids.len() >= args.prompt_len,
        "the held-out tail has {} tokens, fewer than one prompt",
        ids.len()
    );
    let span = ids.len() - args.prompt_len;
    let n = args.prompts;
    (0..n)
        .map(|i| {
            let s = if n == 1 { 0 } else { span * i / (n - 1) };
            ids[s..s + args.prompt_len].to_vec()
        })
        .collect()
}

fn run(args: &Args, ckpt: &Checkpoint, device: &Device, attention: &dyn AttentionImpl) {
    let target = Llama::from_checkpoint(ckpt, device, DType::F32).expect("checkpoint");
    let text = include_str!("../../../../llama/data/paragraph.txt");
    let ids = ckpt.tokenizer.encode(text).expect("tokenize");
    let started = Instant::now();

    if args.exact || args.prompts > 0 {
        let (draft, draft_name) = match &args.draft_model {
            Some(path) => (
                burn_llama::finetune::load_model(path, device, DType::F32).unwrap_or_else(|e| {
                    eprintln!("error: --draft-model {}: {e}", path.display());
                    std::process::exit(2)
                }),
                format!("{}", path.display()),
            ),
            None => (
                truncated_draft(&target, args.draft_layers).expect("draft layers"),
                format!(
                    "first {} of {} layers",
                    args.draft_layers,
                    target.layers.len()
                ),
            ),
        };
        let mut prompts = prompts(args, ckpt, &ids);
        if args.exact {
            if args.prompt_start >= prompts.len() || args.prompt_count == Some(0) {
                eprintln!(
                    "error: --prompt-start {} --prompt-count {:?} leaves none of the {} prompts",
                    args.prompt_start,
                    args.prompt_count,
                    prompts.len()
                );
                std::process::exit(2);
            }
            prompts.drain(..args.prompt_start);
            prompts.truncate(args.prompt_count.unwrap_or(usize::MAX));
            let result = exact::Exact {
                target: &target,
                draft: &draft,
                draft_name,
                attention,
                prompts,
                new_tokens: args.new_tokens,
                target_temperature: args.target_temperature,
                draft_temperatures: args.draft_temperatures.clone(),
                schemes: args
                    .schemes
                    .iter()
                    .map(|n| scheme(n, args.lp_max_variables))
                    .collect(),
                ks: args.exact_ks.clone(),
                chart: args.chart.as_deref(),
                first_prompt: args.prompt_start,
                rows_out: args.rows_out.as_deref(),
            }
            .run();
            burn_llama_examples::cli::exit_on_error(result);
            eprintln!("total {:.0}s", started.elapsed().as_secs_f64());
            return;
        }
        measured_table(
            args,
            &target,
            &draft,
            &draft_name,
            &prompts,
            attention,
            started,
        );
    }
    analytic_table(args, &target, &ids, attention, started);
    eprintln!("total {:.0}s", started.elapsed().as_secs_f64());
}

/// The measured table: block efficiency of every scheme and K over the prompts, with `draft`.
fn measured_table(
    args: &Args,
    target: &Llama,
    draft: &Llama,
    draft_name: &str,
    prompts: &[Vec<u32>],
    attention: &dyn AttentionImpl,
    started: Instant,
) {
    let ks: Vec<usize> = (1..=args.max_k).collect();
    eprintln!(
        "measured: {} prompts of {} tokens ({}), batches of {}, {} new tokens, L = {}, \
         draft = {draft_name} ({} layers), target T = {}, {} seed(s)",
        prompts.len(),
        args.prompt_len,
        args.corpus.as_ref().map_or_else(
            || "the paragraph".to_string(),
            |c| format!("held-out tail of {}", c.display())
        ),
        args.batch,
        args.new_tokens,
        args.draft_len,
        draft.layers.len(),
        args.target_temperature,
        args.repeats
    );
    let run = |scheme: Scheme, k: usize, temperature: f32| -> SpecStats {
        let drafts = vec![
            Draft::model(
                draft,
                SamplingConfig {
                    temperature,
                    ..SamplingConfig::default()
                }
            );
            k
        ];
        let mut total = SpecStats::default();
        for seed in 0..args.repeats {
            for (i, chunk) in prompts.chunks(args.batch.max(1)).enumerate() {
                let opts = SpecOptions {
                    scheme,
                    draft_len: args.draft_len,
                    target_sampling: SamplingConfig {
                        temperature: args.target_temperature,
                        ..SamplingConfig::default()
                    },
                    max_new_tokens: args.new_tokens,
                    stop_tokens: Vec::new(),
                    seed: seed * 1_000_003 + i as u64,
                };
                let g =
                    speculative_generate(target, &drafts, chunk, attention, &opts, &mut |_, _| {})
                        .expect("speculative run");
                pool(&mut total, &g.stats);
            }
        }
        eprintln!(
            "  T={temperature} {:15} K={k}: block efficiency {:.3} ({} blocks), {:.2} tok/s \
             (draft {:.1}s, target {:.1}s, verify {:.1}s) [{:.0}s elapsed]",
            scheme.name(),
            total.block_efficiency(),
            total.blocks,
            total.tokens_per_sec(),
            total.draft_secs,
            total.target_secs,
            total.verify_secs,
            started.elapsed().as_secs_f64()
        );
        total
    };
    println!(
        "Measured block efficiency (tokens per target call per sequence), draft: \
         {draft_name}\n\n{}",
        header("draft T", &ks).trim_end()
    );
    for &t in &args.draft_temperatures {
        let single = run(Scheme::SingleDraft, 1, t);
        for name in &args.schemes {
            let s = scheme(name, args.lp_max_variables);
            let mut row = format!("| {t:.1} | {} |", s.name());
            for &k in &ks {
                let stats = if k == 1 { single.clone() } else { run(s, k, t) };
                row.push_str(&format!(" {:.3} |", stats.block_efficiency()));
            }
            // Each row as soon as it is measured: a run cut short keeps what it finished.
            println!("{row}");
        }
    }
    println!();
}

/// The analytic table: each scheme's acceptance probability per token from the target's and the
/// truncated drafts' distributions over the paragraph; `--analytic-positions 0` skips it.
fn analytic_table(
    args: &Args,
    target: &Llama,
    ids: &[u32],
    attention: &dyn AttentionImpl,
    started: Instant,
) {
    let ks: Vec<usize> = (1..=args.max_k).collect();
    if let Some(stride) = ids.len().checked_div(args.analytic_positions) {
        let layers = if args.analytic_layers.is_empty() {
            vec![args.draft_layers]
        } else {
            args.analytic_layers.clone()
        };
        let n = ids.len();
        let stride = stride.max(1);
        let positions: Vec<usize> = (0..n)
            .step_by(stride)
            .take(args.analytic_positions)
            .collect();
        eprintln!(
            "analytic: {} positions of {n} (stride {stride}), target T = {}",
            positions.len(),
            args.target_temperature
        );
        let p = distributions(target, ids, &[args.target_temperature], attention).remove(0);
        let mut out = header("draft (layers, T)", &ks);
        for &l in &layers {
            let draft = truncated_draft(target, l).expect("draft layers");
            let qs = distributions(&draft, ids, &args.draft_temperatures, attention);
            for (&t, q) in args.draft_temperatures.iter().zip(&qs) {
                for name in &args.schemes {
                    let s = scheme(name, args.lp_max_variables);
                    out.push_str(&format!("| {l}, {t:.1} | {} |", s.name()));
                    for &k in &ks {
                        let s = if k == 1 { Scheme::SingleDraft } else { s };
                        let mean = positions
                            .iter()
                            .map(|&i| {
                                let drafts = vec![q[i].as_slice(); k];
                                Verifier::new(s, &p[i], &drafts)
                                    .expect("valid rows")
                                    .acceptance_probability()
                            })
                            .sum::<f64>()
                            / positions.len() as f64;
                        out.push_str(&format!(" {mean:.4} |"));
                    }
                    out.push('\n');
                    eprintln!(
                        "  layers {l} T={t} {} done [{:.0}s elapsed]",
                        s.name(),
                        started.elapsed().as_secs_f64()
                    );
                }
            }
        }
        println!("Analytic acceptance probability per token (mean over positions)\n\n{out}");
    }
}

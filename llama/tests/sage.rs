//! SageAttention2 (burn-sage) in SmolLM2-135M-Instruct on its real weights (fetched by
//! `./scripts/setup.sh`): the committed paragraph's perplexity with Sage INT8 attention within
//! 0.5% of full-precision attention (the bar), and every variant's accuracy on the
//! Q/K/V captured from each layer against exact f32 attention. On wgpu (lavapipe in CI) the
//! model-sized checks take the paragraph's first tokens (`common::paragraph_tokens_on`).

use crate::common::{checkpoint, paragraph_tokens_on};

use burn::tensor::{DType, Device};
use burn_kernels_core::ReferenceAttention;
use burn_kernels_testing::{is_wgpu, testgen};
use burn_llama::attention::{AttentionChoice, SAGE_VARIANTS, capture_qkv, sage_variant};
use burn_llama::generate::perplexity;
use burn_llama::model::Llama;
use burn_sage::adaptive::{DEFAULT_INT4_THRESHOLD, accuracies};
use burn_sage::{PvPrecision, QkQuant, SageOptions};

fn model(device: &Device) -> Llama {
    Llama::from_checkpoint(checkpoint(), device, DType::F32).expect("valid checkpoint")
}

/// The relative perplexity change each Sage variant of the CLI may make against full-precision
/// attention. Measured on the CPU (2026-11-27, the committed paragraph, 280 tokens): sage
/// +0.021%, sage-fp8 +0.34%, sage-int4 +6.6%, sage-int4-fp8 +6.1%, sage-adaptive +0.021% (every
/// layer INT8). The bounds leave the INT8 variants at the paper's "no end-to-end loss" and INT4,
/// its lossy setting, at 10%; attention that is broken (scores zeroed: uniform attention) takes
/// the perplexity to the hundreds.
const PERPLEXITY_BOUNDS: [(&str, f64); 5] = [
    ("sage", 0.005),
    ("sage-fp8", 0.01),
    ("sage-int4", 0.10),
    ("sage-int4-fp8", 0.10),
    ("sage-adaptive", 0.10),
];

/// Perplexity with full-precision attention and with every Sage variant of the CLI, each within
/// its bound of [`PERPLEXITY_BOUNDS`]; adaptive Sage, which keeps INT8 where INT4 falls short,
/// no worse than all-INT4.
fn sage_perplexity_close_to_full(device: &Device) {
    let ids = paragraph_tokens_on(device);
    let model = model(device);
    let full = perplexity(&model, &ids, &ReferenceAttention).expect("fits the context");
    println!(
        "{device:?}: perplexity over {} tokens: full {full:.4}",
        ids.len()
    );
    assert!(
        full.is_finite() && full < 30.0,
        "full-precision perplexity {full}"
    );
    // On wgpu (lavapipe in CI, where each variant compiles its own kernels) only `sage`, the
    // variant with the bar; CUDA and the CPU run every variant.
    let wgpu = is_wgpu(device);
    let mut seen = Vec::new();
    for name in SAGE_VARIANTS.iter().copied().chain(["sage-adaptive"]) {
        if wgpu && name != "sage" {
            continue;
        }
        let (attention, reports) = AttentionChoice::parse(name)
            .expect("a CLI name")
            .build(Some((&model, &ids)), DEFAULT_INT4_THRESHOLD)
            .expect("builds");
        let ppl = perplexity(&model, &ids, attention.as_ref()).expect("fits the context");
        let rel = (ppl - full) / full;
        let int4 = reports
            .iter()
            .filter(|r| r.choice == burn_sage::QkQuant::Int4PerThread)
            .count();
        println!(
            "{device:?}: {name} ({}) {ppl:.4} ({:+.3}% vs full){}",
            attention.name(),
            rel * 100.0,
            if reports.is_empty() {
                String::new()
            } else {
                format!(", {int4} of {} layers INT4", reports.len())
            }
        );
        assert!(ppl.is_finite(), "{name}: perplexity {ppl}");
        let bound = PERPLEXITY_BOUNDS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, b)| *b)
            .expect("a bound for every variant");
        assert!(
            rel.abs() <= bound,
            "{name}: perplexity {ppl} vs full {full} ({:+.3}%, bound {:.1}%)",
            rel * 100.0,
            bound * 100.0
        );
        seen.push((name, ppl));
    }
    let of = |n: &str| seen.iter().find(|(m, _)| *m == n).map(|(_, p)| *p);
    if let (Some(adaptive), Some(int4)) = (of("sage-adaptive"), of("sage-int4")) {
        assert!(
            adaptive <= int4 + 0.005 * full,
            "adaptive Sage {adaptive} worse than all-INT4 {int4}"
        );
    }
}

/// INT8 per warp without Q smoothing: the CLI's `sage` until 2026-11-25, printed beside the
/// variants for comparison.
fn int8_warp() -> SageOptions {
    SageOptions {
        qk: QkQuant::Int8PerWarp,
        ..SageOptions::default()
    }
}

/// Every layer's Q/K/V as the model produces them for the paragraph, against exact attention:
/// the CLI's `sage` (INT8 per thread, Q and K smoothing) reaches cos sim 0.9995 with FP16 P·V
/// and `sage-fp8` 0.999 (the bars); the INT4 variants and per-warp INT8 are printed
/// and must be finite.
fn sage_accuracy_on_captured_layers(device: &Device) {
    let ids = paragraph_tokens_on(device);
    let model = model(device);
    let mut names: Vec<&str> = SAGE_VARIANTS.to_vec();
    let mut variants: Vec<SageOptions> = SAGE_VARIANTS.iter().map(|&n| sage_variant(n)).collect();
    names.push("int8-warp");
    variants.push(int8_warp());
    // On wgpu only the variants with bars, `sage` and `sage-fp8` (see the perplexity test).
    if is_wgpu(device) {
        (names, variants) = names
            .into_iter()
            .zip(variants)
            .filter(|(n, _)| matches!(*n, "sage" | "sage-fp8"))
            .unzip();
    }
    assert_eq!(
        (variants[0].qk, variants[0].smooth_q, variants[0].pv),
        (QkQuant::Int8PerThread, true, PvPrecision::Fp16),
        "the bars below are for INT8 per thread with Q smoothing"
    );
    let captured = capture_qkv(&model, &ids).expect("every layer runs");
    assert_eq!(captured.len(), model.config.num_layers);
    println!("| layer | {} |", names.join(" | "));
    let mut below = Vec::new();
    for (layer, (q, k, v, causal)) in captured.into_iter().enumerate() {
        assert!(causal, "layer {layer}: the prefill is causal");
        let acc = accuracies(q, k, v, causal, None, &variants).expect("valid");
        let cells: Vec<String> = acc.iter().map(|a| format!("{a}")).collect();
        println!("| {layer} | {} |", cells.join(" | "));
        for (name, a) in names.iter().zip(&acc) {
            assert!(
                a.cos_sim.is_finite() && a.rel_l1.is_finite() && a.rmse.is_finite(),
                "layer {layer} {name}: {a}"
            );
            let bar = match *name {
                "sage" => 0.9995,
                "sage-fp8" => 0.999,
                _ => continue,
            };
            if a.cos_sim < bar {
                below.push(format!(
                    "layer {layer} {name}: cos sim {} < {bar}",
                    a.cos_sim
                ));
            }
        }
    }
    assert!(below.is_empty(), "below the bar:\n{}", below.join("\n"));
}

#[test]
fn cpu_sage_perplexity_close_to_full() {
    sage_perplexity_close_to_full(&Device::flex());
}

#[test]
fn cpu_sage_accuracy_on_captured_layers() {
    sage_accuracy_on_captured_layers(&Device::flex());
}

testgen! {
    backend: [sage_perplexity_close_to_full, sage_accuracy_on_captured_layers],
    autodiff: [],
}

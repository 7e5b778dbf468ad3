//! Row-wise log-sum-exp (burn-cce's first kernel) against the same math in Burn tensor ops.
//!
//! Memory-bound: the fewest bytes are one read of the `rows × cols` input and one write of
//! `rows` outputs.

use burn::tensor::DType;
use burn_cce::{LseOptions, logsumexp, reference};
use burn_kernels_testing::{Dist, random_tensor};
use serde_json::json;

use super::SuiteOptions;
use crate::harness::{Candidate, PlotSpec, Problem, Suite, keep, params};

pub fn suite(opts: SuiteOptions) -> Suite {
    let vocab: &[usize] = if opts.quick {
        &[4096, 32768]
    } else {
        &[4096, 32768, 131072, 262144]
    };
    let rows = if opts.quick { 256 } else { 2048 };
    let problems = vocab.iter().map(|&cols| problem(rows, cols)).collect();
    Suite {
        name: "lse",
        description: "row-wise log-sum-exp of f32 logits: CubeCL kernel vs Burn tensor ops",
        baseline: "burn-tensor-ops",
        problems,
        measure_memory: false,
        plot: Some(PlotSpec {
            x: "cols".into(),
            series: vec![],
            y: "gbps".into(),
            ..PlotSpec::default()
        }),
    }
}

fn problem(rows: usize, cols: usize) -> Problem {
    Problem {
        label: format!("{rows}x{cols}"),
        params: params([
            ("rows", json!(rows)),
            ("cols", json!(cols)),
            ("dtype", json!("f32")),
        ]),
        flops: None,
        bytes: Some(((rows * cols + rows) * 4) as f64),
        tokens: None,
        setup: Box::new(move |device| {
            let x = random_tensor::<2>([rows, cols], Dist::PEAKY, 1, DType::F32, device);
            let x2 = x.clone();
            vec![
                // burn-cce's public op: its kernel on a CubeCL device (through Burn's fusion as a
                // custom operation), the same tensor ops as the baseline elsewhere.
                Candidate::timed_here("cubecl-kernel", move || {
                    keep(logsumexp(x.clone(), 1, LseOptions::default()).expect("valid input"));
                }),
                Candidate::timed_here("burn-tensor-ops", move || {
                    keep(reference::logsumexp(x2.clone(), 1, None));
                }),
            ]
        }),
    }
}

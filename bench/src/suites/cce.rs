//! Cut Cross-Entropy against Burn's plain cross-entropy path and the PyTorch peers, at the
//! paper's Gemma-2 shape (N=8192, V=256000, D=2304) and SmolLM2's (N=8192, V=49152, D=576),
//! bf16, on synthetic peaky logits: a Zipf log-frequency prior over a shuffled vocabulary (one
//! hidden dimension), targets drawn from the prior, each token leaning +10 towards its target,
//! bulk logits ~ N(0, 1.5²). Time and peak memory (the pool's growth over one call) for the loss,
//! the gradient, and both.
//!
//! FLOPs: the forward is one `N·V·D` GEMM (2NVD); the backward recomputes it and runs two more
//! (6NVD without filtering, less with it).

use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Distribution, Int, Tensor, TensorData};
use burn_cce::{
    CceKernels, CceOptions, DeCarry, FilterEps, GemmKernel, GemmStrategy, LceParams, PassKernels,
    diagnostics, linear_cross_entropy, reference,
};
use rand::{Rng, SeedableRng, rngs::StdRng, seq::SliceRandom};
use serde_json::json;
use std::path::PathBuf;

use super::{SuiteOptions, run_python_peer};
use crate::harness::{Candidate, Extra, Problem, Suite, keep, params};

const SHAPES: &[(&str, usize, usize, usize)] = &[
    ("gemma", 8192, 256_000, 2304),
    ("smollm2", 8192, 49_152, 576),
];
const QUICK_SHAPES: &[(&str, usize, usize, usize)] = &[("tiny", 256, 8192, 128)];

/// CCE option sets that matter: the default, and each optimization switched off; with
/// `sweep`, also the default with each fixed GEMM kernel; and the default with each of
/// `pass_blocks` (MiB) as the forward's and scoring pass's logits block, and with each of
/// `chunk_blocks` (MiB) as every pass's.
fn variants(
    sweep: bool,
    pass_blocks: &[usize],
    chunk_blocks: &[usize],
) -> Vec<(&'static str, CceOptions)> {
    // The default runs the fused passes where they run ([`PassKernels::Auto`]); the options
    // below it are the chunked passes', so their variants take the chunked passes.
    let d = chunked(CceOptions::default());
    // One variant per block size (MiB), named after it; `set` puts the size in the options.
    let sized = |mibs: &[usize], what: &'static str, set: fn(CceOptions, usize) -> CceOptions| {
        mibs.iter()
            .map(|&mib| {
                let name = format!("cce ({what} {mib} MiB)");
                (&*Box::leak(name.into_boxed_str()), set(d, mib << 20))
            })
            .collect::<Vec<_>>()
    };
    let blocks = sized(pass_blocks, "pass block", |o, b| CceOptions {
        pass_chunk_bytes: Some(b),
        ..o
    });
    let chunks = sized(chunk_blocks, "all blocks", |o, b| CceOptions {
        chunk_bytes: Some(b),
        ..o
    });
    // The same blocks with the paper's gradient filter (Apple's default): the time of the
    // backward where most of the vocabulary's softmax is below 2⁻¹² (bf16).
    let filtered = sized(chunk_blocks, "paper's filter, all blocks", |o, b| {
        CceOptions {
            chunk_bytes: Some(b),
            filter_eps: FilterEps::Paper,
            ..o
        }
    });
    // The paper's filter with each forward/scoring block and the automatic gradient chunks
    // (the automatic blocks' memory): which of the two block sizes costs the time.
    let filtered_pass = sized(pass_blocks, "paper's filter, pass block", |o, b| {
        CceOptions {
            pass_chunk_bytes: Some(b),
            filter_eps: FilterEps::Paper,
            ..o
        }
    });
    let kernels = GemmKernel::ALL.into_iter().filter(|_| sweep).map(move |k| {
        (
            // Candidate names are `&'static str`: one short string per kernel per problem.
            &*Box::leak(format!("cce (gemm {})", k.name()).into_boxed_str()),
            CceOptions {
                gemm: GemmStrategy::Kernel(k),
                ..d
            },
        )
    });
    let named: Vec<(&'static str, CceOptions)> = vec![
        ("cce", CceOptions::default()),
        ("cce (chunked passes)", d),
        (
            "cce (no vocab sorting)",
            CceOptions {
                sort_vocab: false,
                ..d
            },
        ),
        (
            "cce (paper's grad filter)",
            CceOptions {
                filter_eps: FilterEps::Paper,
                ..d
            },
        ),
        // dE carried compensated in the vocabulary pass (opt-in; the default carries it in
        // f32, at Gemma-2's shape in a second pass over row blocks), without and with the
        // paper's filter.
        (
            "cce (compensated dE carry)",
            CceOptions {
                de_carry: DeCarry::Compensated,
                ..d
            },
        ),
        (
            "cce (paper's grad filter, compensated dE carry)",
            CceOptions {
                filter_eps: FilterEps::Paper,
                de_carry: DeCarry::Compensated,
                ..d
            },
        ),
        (
            "cce (autotuned GEMM)",
            CceOptions {
                gemm: GemmStrategy::Autotune,
                ..d
            },
        ),
        // One kernel per pass, no logits written (hidden sizes up to 576; `Setup::variants`
        // leaves it out elsewhere, where it would run the chunked passes).
        (
            "cce (fused passes)",
            CceOptions {
                passes: PassKernels::Fused,
                ..d
            },
        ),
        // The same with the paper's gradient filter, which the fused backward applies per
        // 64 × 64 tile (Apple's kernels filter by block as well).
        (
            "cce (fused passes, grad filter)",
            CceOptions {
                passes: PassKernels::Fused,
                filter_eps: FilterEps::Paper,
                ..d
            },
        ),
        (
            "cce (bf16 dE accumulation)",
            CceOptions {
                accum_fp32: false,
                ..d
            },
        ),
        // One f32 accumulator for all of dE (N·D·4 bytes, 75 MB at the Gemma shape) instead of
        // the second pass over row blocks: the time/memory trade of `de_block_rows`.
        (
            "cce (one f32 dE accumulator)",
            CceOptions {
                de_block_rows: Some(usize::MAX),
                ..d
            },
        ),
    ];
    named
        .into_iter()
        .chain(kernels)
        .chain(blocks)
        .chain(chunks)
        .chain(filtered)
        .chain(filtered_pass)
        .collect()
}

/// `o` with the chunked passes (the block, filter and GEMM options the variants vary are
/// theirs; the default [`PassKernels::Auto`] runs the fused passes where they run).
pub(super) fn chunked(o: CceOptions) -> CceOptions {
    CceOptions {
        passes: PassKernels::Chunked,
        ..o
    }
}

pub fn suite(opts: SuiteOptions) -> Suite {
    let shapes = if opts.quick { QUICK_SHAPES } else { SHAPES };
    let mut problems = Vec::new();
    for &(name, n, v, d) in shapes {
        for mode in ["loss", "grad", "both"] {
            problems.push(problem(name, n, v, d, mode, &opts));
        }
    }
    Suite {
        name: "cce",
        description: "linear cross-entropy, bf16, synthetic peaky logits (Zipf prior, target +10): \
                      burn-cce vs Burn's plain path (matmul → log-softmax → gather, autodiff) and \
                      the PyTorch peers; peak MB = bytes one call allocates beyond its inputs, every allocation exact-size (CubeCL's persistent mode: an upper bound on the bytes in use at once; PyTorch: max_memory_allocated), pool MB = growth of the default memory pool's reservation over one call (whole pages), live MB = most bytes in use at once beyond the inputs, read after every allocation of burn-cce's chunked path (burn_cce::track_live_peak)",
        baseline: "burn-plain",
        problems,
        measure_memory: true,
        plot: None,
    }
}

/// The synthetic inputs (see the module docs), generated on the device.
struct Inputs {
    e: Tensor<2>,
    c: Tensor<2>,
    targets: Tensor<1, Int>,
}

fn inputs(n: usize, v: usize, d: usize, dtype: DType, device: &Device) -> Inputs {
    let mut rng = StdRng::seed_from_u64(7);
    let mut rank: Vec<usize> = (1..=v).collect();
    rank.shuffle(&mut rng);
    let prior: Vec<f32> = rank.iter().map(|&r| -(r as f32).ln()).collect();
    // Targets from the prior: p(v) ∝ 1/rank(v), sampled by inverse CDF over ranks.
    let harmonic: Vec<f64> = (1..=v)
        .scan(0.0, |s, r| {
            *s += 1.0 / r as f64;
            Some(*s)
        })
        .collect();
    let mut by_rank = vec![0usize; v];
    for (id, &r) in rank.iter().enumerate() {
        by_rank[r - 1] = id;
    }
    let targets: Vec<i64> = (0..n)
        .map(|_| {
            let u = rng.random::<f64>() * harmonic[v - 1];
            let r = harmonic.partition_point(|&h| h < u).min(v - 1);
            by_rank[r] as i64
        })
        .collect();

    let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [n]), device);
    let prior = Tensor::<2>::from_data(TensorData::new(prior, [v, 1]), device);
    let c = Tensor::<2>::random([v, d - 1], Distribution::Normal(0.0, 1.0), device);
    let lean = c.clone().select(0, targets.clone()) * (10.0 / (d - 1) as f32);
    let noise = Tensor::<2>::random(
        [n, d - 1],
        Distribution::Normal(0.0, 1.5 / ((d - 1) as f64).sqrt()),
        device,
    );
    let e = Tensor::cat(vec![Tensor::ones([n, 1], device), noise + lean], 1);
    let c = Tensor::cat(vec![prior, c], 1);
    Inputs {
        e: e.cast(dtype),
        c: c.cast(dtype),
        targets,
    }
}

fn problem(
    shape: &'static str,
    n: usize,
    v: usize,
    d: usize,
    mode: &'static str,
    opts: &SuiteOptions,
) -> Problem {
    let gemm = 2.0 * (n * v * d) as f64;
    let flops = match mode {
        "loss" => gemm,
        "grad" => 3.0 * gemm,
        _ => 4.0 * gemm,
    };
    let setup = Setup {
        shape,
        n,
        v,
        d,
        mode,
        max_mem: opts.max_mem_bytes,
        peers: opts.peers_dir.clone(),
        sweep: opts.cce_gemm_sweep,
        pass_blocks: opts.cce_pass_blocks.clone(),
        chunk_blocks: opts.cce_chunk_bytes.clone(),
    };
    Problem {
        label: format!("{shape} N={n} V={v} D={d} {mode}"),
        params: params([
            ("shape", json!(shape)),
            ("n", json!(n)),
            ("v", json!(v)),
            ("d", json!(d)),
            ("mode", json!(mode)),
            ("dtype", json!("bf16 (f16 where the runtime lacks bf16)")),
        ]),
        flops: Some(flops),
        bytes: None,
        tokens: Some(n as f64),
        setup: Box::new(move |device| setup.candidates(device)),
    }
}

/// One problem's settings, from which its candidates are built on the device.
struct Setup {
    shape: &'static str,
    n: usize,
    v: usize,
    d: usize,
    /// `loss`, `grad` (the backward alone) or `both` (an autodiff step).
    mode: &'static str,
    max_mem: f64,
    peers: PathBuf,
    sweep: bool,
    pass_blocks: Vec<usize>,
    chunk_blocks: Vec<usize>,
}

impl Setup {
    fn candidates(&self, device: &Device) -> Vec<Candidate<'static>> {
        // bf16 as in the paper; f16 where the runtime lacks bf16 (lavapipe smoke runs).
        let dtype = if device.supports_dtype(DType::BF16) {
            DType::BF16
        } else {
            DType::F16
        };
        let x = inputs(self.n, self.v, self.d, dtype, device);
        let mut cands = match self.mode {
            "loss" => self.loss(&x),
            "grad" => self.grad(&x, dtype, device),
            _ => self.step(&x),
        };
        if self.mode != "grad" {
            cands.push(self.plain(&x));
        }
        cands.extend(self.peers());
        cands
    }

    fn variants(&self, sweep: bool) -> Vec<(&'static str, CceOptions)> {
        let fused = self.d.is_multiple_of(64) && self.d <= burn_cce::kernels::fused::MAX_DIM;
        variants(sweep, &self.pass_blocks, &self.chunk_blocks)
            .into_iter()
            .filter(|(_, o)| fused || o.passes != PassKernels::Fused)
            .collect()
    }

    /// The loss of every variant whose options change it: the GEMM kernel and the logits
    /// blocks.
    fn loss(&self, x: &Inputs) -> Vec<Candidate<'static>> {
        let kernels = self.variants(self.sweep).into_iter().filter(|(_, o)| {
            let varies = matches!(o.gemm, GemmStrategy::Kernel(_))
                || o.pass_chunk_bytes.is_some()
                || o.chunk_bytes.is_some()
                || o.passes != PassKernels::Chunked
                || *o == chunked(CceOptions::default());
            // The filter does not change the loss.
            let sized = o.chunk_bytes.is_some() || o.pass_chunk_bytes.is_some();
            varies && !(sized && o.filter_eps == FilterEps::Paper)
        });
        kernels
            .map(|(name, opts)| {
                let (e, c, t) = (x.e.clone(), x.c.clone(), x.targets.clone());
                Candidate::timed_here(name, move || {
                    keep(
                        linear_cross_entropy(e.clone(), c.clone(), t.clone(), None, &opts)
                            .expect("valid input"),
                    );
                })
            })
            .collect()
    }

    /// The backward alone: burn-cce's extension ops, which `linear_cross_entropy` calls on a
    /// CubeCL device (under Burn's fusion, custom operations).
    fn grad(&self, x: &Inputs, dtype: DType, device: &Device) -> Vec<Candidate<'static>> {
        let kernels = burn_kernels_core::route::cube_device(device).is_some();
        // One log-sum-exp for every variant, from the default options: computing it with each
        // variant's kernel would launch the kernels of variants the run leaves out
        // (`--skip-impl`), and a kernel refused at launch poisons the process's later work.
        let lse = kernels.then(|| {
            let (lse, _) = Dispatch::linear_ce_forward(
                x.e.clone().into_dispatch(),
                x.c.clone().into_dispatch(),
                x.targets.clone().into_dispatch(),
                chunked(CceOptions::default()).params(dtype),
            );
            Tensor::<1>::from_dispatch(lse)
        });
        let mut cands = Vec::new();
        for (name, o) in self.variants(self.sweep) {
            let Some(lse) = lse.clone() else {
                cands.push(Candidate::skipped(name, "not a CubeCL device".into()));
                continue;
            };
            if let Some(why) = too_slow_to_tune(self.shape, o) {
                cands.push(Candidate::skipped(name, why));
                continue;
            }
            cands.push(self.backward(x, name, o.params(dtype), lse, device));
        }
        cands.push(Candidate::skipped(
            "burn-plain",
            "autodiff runs the backward only after its forward: see loss+gradient".into(),
        ));
        cands
    }

    /// One variant's backward, reporting its chunking once and timing its passes apart in one
    /// more call.
    fn backward(
        &self,
        x: &Inputs,
        name: &'static str,
        p: LceParams,
        lse: Tensor<1>,
        device: &Device,
    ) -> Candidate<'static> {
        let (n, v) = (self.n, self.v);
        let dout = Tensor::<1>::full([n], 1.0 / n as f32, (device, DType::F32));
        let (e, c, t) = (x.e.clone(), x.c.clone(), x.targets.clone());
        let call = move || {
            keep(Dispatch::linear_ce_backward(
                e.clone().into_dispatch(),
                c.clone().into_dispatch(),
                t.clone().into_dispatch(),
                lse.clone().into_dispatch(),
                dout.clone().into_dispatch(),
                p,
            ));
        };
        let timed = call.clone();
        let mut reported = false;
        let dev = device.clone();
        let candidate = Candidate::timed_here(name, move || {
            call();
            if !reported {
                reported = true;
                // Under fusion the backward runs at the synchronization.
                let _ = dev.sync();
                if let Some(plan) = diagnostics::last_backward_plan() {
                    eprintln!(
                        "  {name}: gradient computed for {} of {v} vocabulary entries in {} chunks",
                        plan.entries, plan.chunks
                    );
                }
            }
        });
        // One more call, synchronized between the backward's passes.
        let dev = device.clone();
        candidate.with_extra(move || {
            let mut x = Extra::default();
            if let Some(ph) = diagnostics::time_backward_phases(&dev, timed) {
                x.params.extend(params([
                    ("scoring_ms", json!(ph.scoring_ms)),
                    ("vocabulary_pass_ms", json!(ph.vocabulary_ms)),
                    ("de_pass_ms", json!(ph.de_pass_ms)),
                ]));
                x.note = Some(format!(
                    "passes: scoring {:.1} ms, vocabulary {:.1} ms, dE {:.1} ms",
                    ph.scoring_ms, ph.vocabulary_ms, ph.de_pass_ms
                ));
            }
            x
        })
    }

    /// Loss and gradient through autodiff, each variant.
    fn step(&self, x: &Inputs) -> Vec<Candidate<'static>> {
        self.variants(false)
            .into_iter()
            .map(|(name, o)| match too_slow_to_tune(self.shape, o) {
                Some(why) => Candidate::skipped(name, why),
                None => {
                    let (e, c, t) = (x.e.clone(), x.c.clone(), x.targets.clone());
                    Candidate::timed_here(name, move || {
                        keep(autodiff_step(&e, &c, &t, Some(o)));
                    })
                }
            })
            .collect()
    }

    /// Burn's plain loss (and its autodiff step), where its N×V buffers fit.
    fn plain(&self, x: &Inputs) -> Candidate<'static> {
        // Burn's plain path holds several N×V buffers (bf16 logits, f32 log-probabilities, their
        // gradient, ...): skip it where that cannot fit.
        let plain_bytes = 6.0 * (self.n * self.v) as f64 * 4.0;
        if plain_bytes > self.max_mem {
            return Candidate::skipped("burn-plain", format!("needs ~{:.0} GB", plain_bytes / 1e9));
        }
        let (e, c, t) = (x.e.clone(), x.c.clone(), x.targets.clone());
        let both = self.mode == "both";
        Candidate::timed_here("burn-plain", move || {
            keep(if both {
                autodiff_step(&e, &c, &t, None)
            } else {
                vec![reference::plain_linear_cross_entropy(
                    e.clone(),
                    c.clone(),
                    None,
                    t.clone(),
                    -100,
                    None,
                    burn_cce::Reduction::Mean,
                )]
            });
        })
    }

    /// The PyTorch peers, timed by their own script in the same run.
    fn peers(&self) -> Vec<Candidate<'static>> {
        let (shape, mode) = (self.shape, self.mode);
        [
            ("cce", "cut-cross-entropy (torch)"),
            ("cce-exact", "cut-cross-entropy (torch, no filter)"),
            ("liger", "liger-kernel (torch)"),
            ("torch", "pytorch-plain"),
        ]
        .into_iter()
        .map(|(peer, label)| {
            let script = self.peers.join("cce_torch.py");
            Candidate::timed_elsewhere(label, move || {
                run_python_peer(&script, &["--impl", peer, "--shape", shape, "--mode", mode])
            })
        })
        .collect()
    }
}

/// Why the autotuned-GEMM variant is left out at a shape, if it is.
///
/// SmolLM2: the backward meets ~100 gathered chunk shapes, and autotuning each (~30 candidate
/// kernels compiled and timed) took minutes on the H100 (2026-11-25), more than the suite's whole
/// time limit. Gemma-2: on Burn 0.23.0-pre.1 Burn's autotuned matmul fails at its chunk shape on
/// an H200 (2026-11-27: a TMA kernel refused at launch, "Tile shape must be non-zero and <= 256"),
/// and the failure spreads to the work after it (the other variants' gradients read as failed).
fn too_slow_to_tune(shape: &str, o: CceOptions) -> Option<String> {
    if o.gemm != GemmStrategy::Autotune {
        return None;
    }
    match shape {
        "smollm2" => Some(
            "autotuning its ~100 chunk shapes takes minutes (bench/NOTES.md); fixed GEMM measured"
                .into(),
        ),
        "gemma" => Some(
            "Burn 0.23.0-pre.1's autotuned matmul fails at this shape on Hopper (a TMA launch \
             error that spreads to later work; bench/results/2026-11-27/burn-0.23-before-after.md)"
                .into(),
        ),
        _ => None,
    }
}

/// One training-style step with autodiff: the loss (CCE with `options`, or the plain path)
/// and its gradients with respect to E and C, returned for the timed closure to [`keep`].
fn autodiff_step(
    e: &Tensor<2>,
    c: &Tensor<2>,
    t: &Tensor<1, Int>,
    options: Option<CceOptions>,
) -> Vec<Tensor<1>> {
    let e = e.clone().autodiff().require_grad();
    let c = c.clone().autodiff().require_grad();
    let t = t.clone().autodiff();
    let loss = match options {
        Some(o) => {
            linear_cross_entropy(e.clone(), c.clone(), t, None, &o)
                .expect("valid input")
                .loss
        }
        None => reference::plain_linear_cross_entropy(
            e.clone(),
            c.clone(),
            None,
            t,
            -100,
            None,
            burn_cce::Reduction::Mean,
        ),
    };
    let grads = loss.backward();
    let mut kept = vec![loss];
    kept.extend(
        [e.grad(&grads), c.grad(&grads)]
            .into_iter()
            .flatten()
            .map(|g| g.flatten(0, 1)),
    );
    kept
}

//! `spec_table --exact`: each scheme's exact per-token acceptance probability (the paper's
//! Table 3), without sampling noise. For every prompt the target continues the prompt itself
//! (sampled at `--target-temperature`, seed = the prompt's index); at every position of that
//! continuation the target's row `p` and the draft's row `q` (at each draft temperature) give
//! each scheme's exact probability of accepting one of K identical drafts
//! (`Verifier::acceptance_probability`). Per prompt the positions are averaged; the table gives
//! the mean over prompts ± its standard error, and an SVG chart plots acceptance against K.
//! Every (prompt, cell, position) is a job for one worker per core (see `Exact::measure`), so a
//! many-core machine runs a few hundred prompts in parallel with the model's passes.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex, mpsc};

use burn_kernels_core::{AttentionImpl, FullKvCache, SamplingConfig};
use burn_llama::generate::{GenerateOptions, generate};
use burn_llama::model::Llama;
use burn_specdec::{Scheme, Verifier};

/// Mean and standard error of the mean.
fn mean_se(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if values.len() < 2 {
        return (mean, f64::NAN);
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt())
}

/// A prompt's rows: the target's `p` per position, and the draft's rows per draft temperature
/// and position.
struct Rows {
    p: Vec<Vec<f64>>,
    qs: Vec<Vec<Vec<f64>>>,
}

/// A prompt's index, its rows, a cell and the position to measure it at.
type Job = (usize, Arc<Rows>, Cell, usize);

/// A finished job: the prompt's index, the cell, the position and the acceptance there.
type Done = (usize, Cell, usize, f64);

/// Acceptance per position, indexed `[temperature][scheme][k][prompt][position]`.
type PerPosition = Vec<Vec<Vec<Vec<Vec<f64>>>>>;

/// A rough rank of a scheme's cost per position (the LP-based ones are the slowest).
fn cost(scheme: Scheme) -> u8 {
    match scheme {
        Scheme::Optimal(_) | Scheme::WeightedImportance(_) => 3,
        Scheme::SequentialImportance => 2,
        Scheme::SpecTr => 1,
        _ => 0,
    }
}

/// What one table cell needs: a draft temperature, a scheme, K.
#[derive(Clone, Copy)]
struct Cell {
    temperature: usize,
    scheme: usize,
    k: usize,
}

/// The options of an exact run.
pub struct Exact<'a> {
    pub target: &'a Llama,
    pub draft: &'a Llama,
    pub draft_name: String,
    pub attention: &'a dyn AttentionImpl,
    pub prompts: Vec<Vec<u32>>,
    pub new_tokens: usize,
    pub target_temperature: f32,
    pub draft_temperatures: Vec<f32>,
    pub schemes: Vec<Scheme>,
    pub ks: Vec<usize>,
    /// Where the chart goes (none: no chart).
    pub chart: Option<&'a Path>,
}

impl Exact<'_> {
    /// Acceptance per prompt, indexed `[temperature][scheme][k][prompt]`. The model runs on this
    /// thread, prompt after prompt; every (prompt, cell, position) is a job for a pool of workers
    /// (one per core), so that later prompts' rows are computed while earlier prompts' cells run,
    /// and the slow cells (large K, LP-based schemes) of many prompts run side by side.
    fn measure(&self) -> Vec<Vec<Vec<Vec<f64>>>> {
        let (nt, ns, nk) = (
            self.draft_temperatures.len(),
            self.schemes.len(),
            self.ks.len(),
        );
        let n = self.prompts.len();
        // Per position, summed in order at the end (whatever order the jobs finish in).
        let mut out: PerPosition = vec![vec![vec![vec![Vec::new(); n]; nk]; ns]; nt];
        let cells: Vec<Cell> = (0..nt)
            .flat_map(|t| {
                (0..ns).flat_map(move |s| {
                    (0..nk).map(move |k| Cell {
                        temperature: t,
                        scheme: s,
                        k,
                    })
                })
            })
            .collect();
        // The slowest cells first.
        let mut order = cells.clone();
        order.sort_by_key(|c| std::cmp::Reverse((self.ks[c.k], cost(self.schemes[c.scheme]))));
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let started = std::time::Instant::now();
        // Room for a whole prompt's jobs: the next prompt's rows are computed while the workers
        // run them (a few prompts' rows alive at most).
        let bound = (cells.len() * self.new_tokens).max(2 * threads);
        let (job_tx, job_rx) = mpsc::sync_channel::<Job>(bound);
        let job_rx = Mutex::new(job_rx);
        let (done_tx, done_rx) = mpsc::channel::<Done>();
        std::thread::scope(|scope| {
            for _ in 0..threads {
                let (job_rx, done_tx) = (&job_rx, done_tx.clone());
                scope.spawn(move || {
                    loop {
                        let job = job_rx.lock().expect("job queue").recv();
                        let Ok((prompt, rows, cell, position)) = job else {
                            break;
                        };
                        let value = self.acceptance(&rows, cell, position);
                        if done_tx.send((prompt, cell, position, value)).is_err() {
                            break;
                        }
                    }
                });
            }
            drop(done_tx);
            let mut left = vec![0; n];
            let record = |(prompt, c, i, v): Done, out: &mut PerPosition, left: &mut [usize]| {
                out[c.temperature][c.scheme][c.k][prompt][i] = v;
                left[prompt] -= 1;
                if left[prompt] == 0 {
                    eprintln!(
                        "  exact: prompt {}/{n} done [{:.0}s elapsed]",
                        prompt + 1,
                        started.elapsed().as_secs_f64()
                    );
                }
            };
            for (i, prompt) in self.prompts.iter().enumerate() {
                let rows = Arc::new(self.rows(prompt, i as u64));
                let positions = rows.p.len();
                left[i] = cells.len() * positions;
                for c in &cells {
                    out[c.temperature][c.scheme][c.k][i] = vec![f64::NAN; positions];
                }
                for &cell in &order {
                    for position in 0..positions {
                        job_tx
                            .send((i, Arc::clone(&rows), cell, position))
                            .expect("workers run");
                    }
                }
                while let Ok(done) = done_rx.try_recv() {
                    record(done, &mut out, &mut left);
                }
            }
            drop(job_tx);
            for done in done_rx {
                record(done, &mut out, &mut left);
            }
        });
        out.into_iter()
            .map(|by_scheme| {
                by_scheme
                    .into_iter()
                    .map(|by_k| {
                        by_k.into_iter()
                            .map(|by_prompt| {
                                by_prompt
                                    .into_iter()
                                    .map(|v| v.iter().sum::<f64>() / v.len() as f64)
                                    .collect()
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect()
    }

    /// The target's rows `p` and the draft's rows at each draft temperature, at the positions
    /// of the prompt's continuation.
    fn rows(&self, prompt: &[u32], seed: u64) -> Rows {
        let sequence = self.continue_prompt(prompt, seed);
        let rows = sequence.len() - prompt.len();
        let first = prompt.len() - 1;
        let p = super::distributions(
            self.target,
            &sequence,
            &[self.target_temperature],
            self.attention,
        )
        .swap_remove(0)
        .drain(first..first + rows)
        .collect();
        let qs = super::distributions(
            self.draft,
            &sequence,
            &self.draft_temperatures,
            self.attention,
        )
        .into_iter()
        .map(|mut q| q.drain(first..first + rows).collect())
        .collect();
        Rows { p, qs }
    }

    /// A cell's exact acceptance probability at one position of a prompt.
    fn acceptance(&self, rows: &Rows, c: Cell, position: usize) -> f64 {
        let k = self.ks[c.k];
        let scheme = if k == 1 {
            Scheme::SingleDraft
        } else {
            self.schemes[c.scheme]
        };
        let q = rows.qs[c.temperature][position].as_slice();
        Verifier::new(scheme, &rows.p[position], &vec![q; k])
            .expect("valid rows")
            .acceptance_probability()
    }

    /// The prompt and the target's own continuation of it.
    fn continue_prompt(&self, prompt: &[u32], seed: u64) -> Vec<u32> {
        let mut cache = FullKvCache::new(self.target.config.num_layers);
        let mut sampler = SamplingConfig {
            temperature: self.target_temperature,
            seed,
            ..SamplingConfig::default()
        }
        .build();
        let opts = GenerateOptions {
            max_new_tokens: self.new_tokens,
            stop_tokens: Vec::new(),
        };
        let g = generate(
            self.target,
            &[prompt.to_vec()],
            &mut cache,
            self.attention,
            sampler.as_mut(),
            &opts,
            &mut |_, _| {},
        )
        .expect("prompt fits the context");
        let mut sequence = prompt.to_vec();
        sequence.extend(&g.tokens[0]);
        sequence
    }

    /// Measures, prints the markdown table (and writes the chart).
    pub fn run(&self) {
        eprintln!(
            "exact: {} prompts, {} continuation tokens each, target T = {}, draft = {}",
            self.prompts.len(),
            self.new_tokens,
            self.target_temperature,
            self.draft_name
        );
        let values = self.measure();
        let mut table = super::header("draft T", &self.ks);
        for (t, temp) in self.draft_temperatures.iter().enumerate() {
            for (s, scheme) in self.schemes.iter().enumerate() {
                let _ = write!(table, "| {temp:.1} | {} |", scheme.name());
                for per_prompt in &values[t][s] {
                    let (mean, se) = mean_se(per_prompt);
                    let _ = write!(table, " {mean:.4} ± {se:.4} |");
                }
                table.push('\n');
            }
        }
        println!(
            "Exact acceptance probability per token, mean over {} prompts ± standard error \
             (draft: {}, target T = {})\n\n{table}",
            self.prompts.len(),
            self.draft_name,
            self.target_temperature
        );
        // The spread across prompts (easy and hard contexts) is shared by every scheme: the
        // per-prompt differences to the first scheme order them.
        let mut diffs = super::header("draft T", &self.ks);
        for (t, temp) in self.draft_temperatures.iter().enumerate() {
            for (s, scheme) in self.schemes.iter().enumerate().skip(1) {
                let _ = write!(
                    diffs,
                    "| {temp:.1} | {} − {} |",
                    scheme.name(),
                    self.schemes[0].name()
                );
                for (k, per_prompt) in values[t][s].iter().enumerate() {
                    let d: Vec<f64> = per_prompt
                        .iter()
                        .zip(&values[t][0][k])
                        .map(|(a, b)| a - b)
                        .collect();
                    let (mean, se) = mean_se(&d);
                    let _ = write!(diffs, " {mean:+.4} ± {se:.4} |");
                }
                diffs.push('\n');
            }
        }
        println!("Paired differences per token (mean over prompts ± standard error)\n\n{diffs}");
        if let Some(path) = self.chart {
            match std::fs::write(path, self.chart_svg(&values)) {
                Ok(()) => eprintln!("chart: {}", path.display()),
                Err(e) => eprintln!("chart: {}: {e}", path.display()),
            }
        }
    }

    /// One panel per draft temperature: acceptance against K, a line per scheme, ±1 standard
    /// error bars.
    fn chart_svg(&self, values: &[Vec<Vec<Vec<f64>>>]) -> String {
        const W: f64 = 320.0;
        const H: f64 = 240.0;
        const PAD: f64 = 40.0;
        const COLORS: [&str; 6] = [
            "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
        ];
        let cells: Vec<(f64, f64)> = values
            .iter()
            .flatten()
            .flatten()
            .map(|v| mean_se(v))
            .collect();
        let se = |c: &(f64, f64)| if c.1.is_finite() { c.1 } else { 0.0 };
        let lo = cells
            .iter()
            .map(|c| c.0 - se(c))
            .fold(f64::INFINITY, f64::min);
        let hi = cells
            .iter()
            .map(|c| c.0 + se(c))
            .fold(f64::NEG_INFINITY, f64::max);
        let span = (hi - lo).max(1e-6);
        let (lo, hi) = (lo - 0.05 * span, hi + 0.05 * span);
        let kmax = *self.ks.iter().max().unwrap_or(&1) as f64;
        let kmin = *self.ks.iter().min().unwrap_or(&1) as f64;
        let x = |k: usize| PAD + (k as f64 - kmin) / (kmax - kmin).max(1.0) * (W - 2.0 * PAD);
        let y = |v: f64| H - PAD - (v - lo) / (hi - lo) * (H - 2.0 * PAD);
        let width = W * self.draft_temperatures.len() as f64;
        let mut svg = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{}\" \
             font-family=\"sans-serif\" font-size=\"11\">\n",
            H + 20.0 * self.schemes.len() as f64
        );
        for (t, temp) in self.draft_temperatures.iter().enumerate() {
            let _ = writeln!(
                svg,
                "<g transform=\"translate({})\"><text x=\"{PAD}\" y=\"16\">draft T = {temp:.1}\
                 </text><line x1=\"{PAD}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\
                 <line x1=\"{PAD}\" y1=\"{PAD}\" x2=\"{PAD}\" y2=\"{b}\" stroke=\"black\"/>\
                 <text x=\"2\" y=\"{top}\">{hi:.3}</text><text x=\"2\" y=\"{b}\">{lo:.3}</text>",
                W * t as f64,
                b = H - PAD,
                r = W - PAD,
                top = PAD + 4.0,
            );
            for &k in &self.ks {
                let _ = writeln!(
                    svg,
                    "<text x=\"{}\" y=\"{}\">K={k}</text>",
                    x(k) - 8.0,
                    H - PAD + 14.0
                );
            }
            for (s, _) in self.schemes.iter().enumerate() {
                let color = COLORS[s % COLORS.len()];
                let points: Vec<String> = self
                    .ks
                    .iter()
                    .zip(&values[t][s])
                    .map(|(&k, v)| format!("{:.1},{:.1}", x(k), y(mean_se(v).0)))
                    .collect();
                let _ = writeln!(
                    svg,
                    "<polyline fill=\"none\" stroke=\"{color}\" points=\"{}\"/>",
                    points.join(" ")
                );
                for (&k, v) in self.ks.iter().zip(&values[t][s]) {
                    let (m, se) = mean_se(v);
                    let se = if se.is_finite() { se } else { 0.0 };
                    let _ = writeln!(
                        svg,
                        "<line x1=\"{0:.1}\" x2=\"{0:.1}\" y1=\"{1:.1}\" y2=\"{2:.1}\" \
                         stroke=\"{color}\"/>",
                        x(k),
                        y(m - se),
                        y(m + se)
                    );
                }
            }
            svg.push_str("</g>\n");
        }
        for (s, scheme) in self.schemes.iter().enumerate() {
            let _ = writeln!(
                svg,
                "<text x=\"{PAD}\" y=\"{}\" fill=\"{}\">{}</text>",
                H + 14.0 + 20.0 * s as f64,
                COLORS[s % COLORS.len()],
                scheme.name()
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

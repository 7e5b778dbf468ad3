//! `spec_table --exact`: each scheme's exact per-token acceptance probability (the paper's
//! Table 3), without sampling noise. For every prompt the target continues the prompt itself
//! (sampled at `--target-temperature`, seed = the prompt's index); at every position of that
//! continuation the target's row `p` and the draft's row `q` (at each draft temperature) give
//! each scheme's exact probability of accepting one of K identical drafts
//! (`burn_specdec::acceptance_probabilities`, which shares the LP between schemes). Per prompt
//! the positions are averaged; the table gives the mean over prompts ± its standard error, and
//! an SVG chart plots acceptance against K. Every (prompt, draft temperature, K, position) is a
//! job, all schemes at once, for one worker per core (see `Exact::measure`), so a
//! many-core machine runs a few hundred prompts in parallel with the model's passes. With
//! `--rows-out`, each prompt's means go to a rows file as soon as it finishes (`rows.rs`).

use std::path::Path;
use std::sync::{Arc, Mutex, mpsc};

use burn_kernels_core::{AttentionImpl, FullKvCache, SamplingConfig};
use burn_llama::generate::{GenerateOptions, generate};
use burn_llama::model::Llama;
use burn_specdec::{Scheme, acceptance_probabilities};

use super::rows::{Row, RowsWriter};
use super::table::Table;

/// A prompt's rows: the target's `p` per position, and the draft's rows per draft temperature
/// and position.
struct Rows {
    p: Vec<Vec<f64>>,
    qs: Vec<Vec<Vec<f64>>>,
}

/// A prompt's index, its rows, a group of cells and the position to measure them at.
type Job = (usize, Arc<Rows>, Group, usize);

/// A finished job: the prompt's index, the group, the position and each scheme's acceptance
/// there.
type Done = (usize, Group, usize, Vec<f64>);

/// Acceptance per position, indexed `[temperature][scheme][k][prompt][position]`.
type PerPosition = Vec<Vec<Vec<Vec<Vec<f64>>>>>;

/// What one table cell needs: a draft temperature, a scheme, K.
#[derive(Clone, Copy)]
struct Cell {
    temperature: usize,
    scheme: usize,
    k: usize,
}

/// The cells of every scheme at one draft temperature and K: one job per position computes
/// them together (`burn_specdec::acceptance_probabilities` shares the LP between the LP-based
/// schemes and the sequential plan).
#[derive(Clone, Copy)]
struct Group {
    temperature: usize,
    k: usize,
}

/// The options of an exact run.
pub struct Exact<'a> {
    pub target: &'a Llama,
    pub draft: &'a Llama,
    pub draft_name: String,
    pub attention: &'a dyn AttentionImpl,
    pub prompts: Vec<Vec<u32>>,
    /// The first prompt's index in the corpus selection (`--prompt-start`): prompt `i` of
    /// `prompts` is seeded and recorded as `first_prompt + i`.
    pub first_prompt: usize,
    pub new_tokens: usize,
    pub target_temperature: f32,
    pub draft_temperatures: Vec<f32>,
    pub schemes: Vec<Scheme>,
    pub ks: Vec<usize>,
    /// Where the chart goes (none: no chart).
    pub chart: Option<&'a Path>,
    /// Where each finished prompt's rows go (`--rows-out`; none: nowhere).
    pub rows_out: Option<&'a Path>,
}

impl Exact<'_> {
    /// Acceptance per prompt, indexed `[temperature][scheme][k][prompt]`. The model runs on this
    /// thread, prompt after prompt; every (prompt, cell, position) is a job for a pool of workers
    /// (one per core), so that later prompts' rows are computed while earlier prompts' cells run,
    /// and the slow groups (large K) of many prompts run side by side.
    /// Each finished prompt's rows go to `writer` (a failed write is reported and ends writing).
    fn measure(&self, mut writer: Option<RowsWriter>) -> Vec<Vec<Vec<Vec<f64>>>> {
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
        let mut groups: Vec<Group> = (0..nt)
            .flat_map(|t| (0..nk).map(move |k| Group { temperature: t, k }))
            .collect();
        // The slowest groups first.
        groups.sort_by_key(|g| std::cmp::Reverse(self.ks[g.k]));
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let started = std::time::Instant::now();
        // Room for a whole prompt's jobs: the next prompt's rows are computed while the workers
        // run them (a few prompts' rows alive at most).
        let bound = (groups.len() * self.new_tokens).max(2 * threads);
        let (job_tx, job_rx) = mpsc::sync_channel::<Job>(bound);
        let job_rx = Mutex::new(job_rx);
        let (done_tx, done_rx) = mpsc::channel::<Done>();
        std::thread::scope(|scope| {
            for _ in 0..threads {
                let (job_rx, done_tx) = (&job_rx, done_tx.clone());
                scope.spawn(move || {
                    loop {
                        let job = job_rx.lock().expect("job queue").recv();
                        let Ok((prompt, rows, group, position)) = job else {
                            break;
                        };
                        let values = self.acceptances(&rows, group, position);
                        if done_tx.send((prompt, group, position, values)).is_err() {
                            break;
                        }
                    }
                });
            }
            drop(done_tx);
            let mut left = vec![0; n];
            let mut record =
                |(prompt, g, i, vs): Done, out: &mut PerPosition, left: &mut [usize]| {
                    for (s, v) in vs.into_iter().enumerate() {
                        out[g.temperature][s][g.k][prompt][i] = v;
                    }
                    left[prompt] -= 1;
                    if left[prompt] == 0 {
                        eprintln!(
                            "  exact: prompt {}/{n} done [{:.0}s elapsed]",
                            prompt + 1,
                            started.elapsed().as_secs_f64()
                        );
                        if let Some(w) = &mut writer
                            && let Err(e) = w.write_prompt(&self.prompt_rows(out, &cells, prompt))
                        {
                            eprintln!("error: --rows-out {e}; no more rows are written");
                            writer = None;
                        }
                    }
                };
            for (i, prompt) in self.prompts.iter().enumerate() {
                let rows = Arc::new(self.rows(prompt, (self.first_prompt + i) as u64));
                let positions = rows.p.len();
                left[i] = groups.len() * positions;
                for c in &cells {
                    out[c.temperature][c.scheme][c.k][i] = vec![f64::NAN; positions];
                }
                for &group in &groups {
                    for position in 0..positions {
                        job_tx
                            .send((i, Arc::clone(&rows), group, position))
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

    /// Every scheme's exact acceptance probability at one position of a prompt, for a group's
    /// draft temperature and K.
    fn acceptances(&self, rows: &Rows, g: Group, position: usize) -> Vec<f64> {
        let k = self.ks[g.k];
        let schemes: Vec<Scheme> = if k == 1 {
            vec![Scheme::SingleDraft; self.schemes.len()]
        } else {
            self.schemes.clone()
        };
        let q = rows.qs[g.temperature][position].as_slice();
        acceptance_probabilities(&schemes, &rows.p[position], &vec![q; k]).expect("valid rows")
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

    /// Prompt `prompt`'s rows file lines: per cell, its mean over the prompt's positions.
    fn prompt_rows(&self, out: &PerPosition, cells: &[Cell], prompt: usize) -> Vec<Row> {
        cells
            .iter()
            .map(|c| {
                let v = &out[c.temperature][c.scheme][c.k][prompt];
                Row {
                    prompt: self.first_prompt + prompt,
                    k: self.ks[c.k],
                    temperature: self.draft_temperatures[c.temperature],
                    scheme: self.schemes[c.scheme].name().to_string(),
                    positions: v.len(),
                    // The same sum as `measure`'s, so the rows give the printed table.
                    mean: v.iter().sum::<f64>() / v.len() as f64,
                    draft: self.draft_name.clone(),
                    target_temperature: self.target_temperature,
                }
            })
            .collect()
    }

    /// Measures, prints the markdown table (and writes the chart and the rows file).
    pub fn run(&self) -> Result<(), String> {
        let writer = match self.rows_out {
            Some(path) => Some(RowsWriter::create(path).map_err(|e| format!("--rows-out {e}"))?),
            None => None,
        };
        eprintln!(
            "exact: {} prompts, {} continuation tokens each, target T = {}, draft = {}",
            self.prompts.len(),
            self.new_tokens,
            self.target_temperature,
            self.draft_name
        );
        let values = self.measure(writer);
        Table {
            draft_name: self.draft_name.clone(),
            target_temperature: self.target_temperature,
            temperatures: self.draft_temperatures.clone(),
            schemes: self.schemes.iter().map(|s| s.name().to_string()).collect(),
            ks: self.ks.clone(),
            prompts: (0..self.prompts.len())
                .map(|i| self.first_prompt + i)
                .collect(),
            values,
        }
        .print(self.chart);
        Ok(())
    }
}

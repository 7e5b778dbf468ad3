//! The exact table's statistics and rendering, shared by a measuring run (`exact.rs`) and
//! `--merge` (`rows.rs`): per-prompt acceptance means → markdown tables of the mean over prompts ±
//! standard error, and the SVG chart.

use std::fmt::Write as _;
use std::path::Path;

/// Mean and standard error of the mean (NaN standard error below two values).
pub fn mean_se(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if values.len() < 2 {
        return (mean, f64::NAN);
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt())
}

/// Per-prompt acceptance of every cell, and what the table's caption names.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// The draft, as the caption names it.
    pub draft_name: String,
    /// The target's sampling temperature.
    pub target_temperature: f32,
    /// The draft temperatures (the rows' first column), in order.
    pub temperatures: Vec<f32>,
    /// The schemes' display names (`Scheme::name`), in order.
    pub schemes: Vec<String>,
    /// The numbers of identical drafts (the columns), in order.
    pub ks: Vec<usize>,
    /// Per prompt, its index in the corpus selection (the order of `values`' last axis).
    pub prompts: Vec<usize>,
    /// Each prompt's mean acceptance over its positions, `[temperature][scheme][k][prompt]`.
    pub values: Vec<Vec<Vec<Vec<f64>>>>,
}

impl Table {
    /// The table of means ± standard errors and the table of paired differences to the first
    /// scheme, as printed to stdout.
    pub fn markdown(&self) -> String {
        let mut table = super::header("draft T", &self.ks);
        for (t, temp) in self.temperatures.iter().enumerate() {
            for (s, scheme) in self.schemes.iter().enumerate() {
                let _ = write!(table, "| {temp:.1} | {scheme} |");
                for per_prompt in &self.values[t][s] {
                    let (mean, se) = mean_se(per_prompt);
                    let _ = write!(table, " {mean:.4} ± {se:.4} |");
                }
                table.push('\n');
            }
        }
        let mut out = format!(
            "Exact acceptance probability per token, mean over {} prompts ± standard error \
             (draft: {}, target T = {})\n\n{table}\n",
            self.prompts.len(),
            self.draft_name,
            self.target_temperature
        );
        // The spread across prompts (easy and hard contexts) is shared by every scheme: the
        // per-prompt differences to the first scheme order them.
        let mut diffs = super::header("draft T", &self.ks);
        for (t, temp) in self.temperatures.iter().enumerate() {
            for (s, scheme) in self.schemes.iter().enumerate().skip(1) {
                let _ = write!(diffs, "| {temp:.1} | {scheme} − {} |", self.schemes[0]);
                for (k, per_prompt) in self.values[t][s].iter().enumerate() {
                    let d: Vec<f64> = per_prompt
                        .iter()
                        .zip(&self.values[t][0][k])
                        .map(|(a, b)| a - b)
                        .collect();
                    let (mean, se) = mean_se(&d);
                    let _ = write!(diffs, " {mean:+.4} ± {se:.4} |");
                }
                diffs.push('\n');
            }
        }
        let _ = write!(
            out,
            "Paired differences per token (mean over prompts ± standard error)\n\n{diffs}"
        );
        out
    }

    /// Prints the tables to stdout and writes the chart to `chart` (if any).
    pub fn print(&self, chart: Option<&Path>) {
        println!("{}", self.markdown());
        if let Some(path) = chart {
            match std::fs::write(path, self.chart_svg()) {
                Ok(()) => eprintln!("chart: {}", path.display()),
                Err(e) => eprintln!("chart: {}: {e}", path.display()),
            }
        }
    }

    /// One panel per draft temperature: acceptance against K, a line per scheme, ±1 standard
    /// error bars.
    pub fn chart_svg(&self) -> String {
        const W: f64 = 320.0;
        const H: f64 = 240.0;
        const PAD: f64 = 40.0;
        const COLORS: [&str; 6] = [
            "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
        ];
        let cells: Vec<(f64, f64)> = self
            .values
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
        let width = W * self.temperatures.len() as f64;
        let mut svg = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{}\" \
             font-family=\"sans-serif\" font-size=\"11\">\n",
            H + 20.0 * self.schemes.len() as f64
        );
        for (t, temp) in self.temperatures.iter().enumerate() {
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
            for s in 0..self.schemes.len() {
                let color = COLORS[s % COLORS.len()];
                let points: Vec<String> = self
                    .ks
                    .iter()
                    .zip(&self.values[t][s])
                    .map(|(&k, v)| format!("{:.1},{:.1}", x(k), y(mean_se(v).0)))
                    .collect();
                let _ = writeln!(
                    svg,
                    "<polyline fill=\"none\" stroke=\"{color}\" points=\"{}\"/>",
                    points.join(" ")
                );
                for (&k, v) in self.ks.iter().zip(&self.values[t][s]) {
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
                "<text x=\"{PAD}\" y=\"{}\" fill=\"{}\">{scheme}</text>",
                H + 14.0 + 20.0 * s as f64,
                COLORS[s % COLORS.len()],
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

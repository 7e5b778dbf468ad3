//! What a fine-tuning run reports: the progress bar, the step-time summary, `log.csv` and the
//! loss-curve plot (`loss.svg`, with `--compare`'s runs beside it).

use std::path::Path;

use burn_llama::finetune::StepLog;
use indicatif::{ProgressBar, ProgressStyle};
use plotters::prelude::*;

/// Wall time of each training step, for the summary a run prints at its end.
pub(super) struct StepTimes {
    last: std::time::Instant,
    /// Milliseconds of the steps that did not validate, after the first two (kernel
    /// compilation and autotuning).
    ms: Vec<f64>,
    seen: usize,
}

impl StepTimes {
    pub(super) fn new() -> Self {
        Self {
            last: std::time::Instant::now(),
            ms: Vec::new(),
            seen: 0,
        }
    }

    /// A step ended now; `validated`: it also ran the validation.
    pub(super) fn record(&mut self, validated: bool) {
        let now = std::time::Instant::now();
        self.seen += 1;
        if self.seen > 2 && !validated {
            self.ms.push((now - self.last).as_secs_f64() * 1e3);
        }
        self.last = now;
    }

    /// `step ms median (min / p90) over n steps, tokens/s`, `None` with fewer than 3 steps.
    pub(super) fn summary(&self, tokens_per_step: usize) -> Option<String> {
        if self.ms.len() < 3 {
            return None;
        }
        let mut ms = self.ms.clone();
        ms.sort_by(f64::total_cmp);
        let n = ms.len();
        let median = match n % 2 {
            1 => ms[n / 2],
            _ => (ms[n / 2 - 1] + ms[n / 2]) / 2.0,
        };
        let p90 = ms[((n as f64 * 0.9).ceil() as usize).clamp(1, n) - 1];
        Some(format!(
            "step time {median:.1} ms median (min {:.1}, p90 {p90:.1}) over {n} steps without \
             validation: {:.0} tokens/s",
            ms[0],
            tokens_per_step as f64 / (median / 1e3)
        ))
    }
}

pub(super) fn progress(len: u64, unit: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{{bar:30}} {{pos}}/{{len}} {unit} {{elapsed_precise}} (eta {{eta}}) {{msg}}"
        ))
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar
}

pub(super) fn write_csv(path: &Path, log: &[StepLog]) -> Result<(), String> {
    let mut s = String::from("step,lr,loss,val_loss\n");
    for l in log {
        let v = l.val_loss.map_or(String::new(), |v| format!("{v}"));
        s += &format!("{},{},{},{}\n", l.step, l.lr, l.loss, v);
    }
    std::fs::write(path, s).map_err(|e| format!("{}: {e}", path.display()))
}

/// One run's training loss per step and validation loss (with the value before training at
/// step 0 where known).
pub(super) struct Curve {
    name: String,
    train: Vec<(f64, f64)>,
    val: Vec<(f64, f64)>,
}

impl Curve {
    pub(super) fn from_log(name: &str, log: &[StepLog], start_val: f64) -> Self {
        Self {
            name: name.into(),
            train: log.iter().map(|l| (l.step as f64, l.loss)).collect(),
            val: std::iter::once((0.0, start_val))
                .chain(
                    log.iter()
                        .filter_map(|l| l.val_loss.map(|v| (l.step as f64, v))),
                )
                .collect(),
        }
    }

    /// From another run's `log.csv` (as [`write_csv`] writes it), named after its folder.
    pub(super) fn from_csv(dir: &Path) -> Result<Self, String> {
        let path = dir.join("log.csv");
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let bad = |line: &str| format!("{}: bad line `{line}`", path.display());
        let mut curve = Self {
            name: dir
                .file_name()
                .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into()),
            train: Vec::new(),
            val: Vec::new(),
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split(',').collect();
            let num = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok());
            let (step, loss) = num(0).zip(num(2)).ok_or_else(|| bad(line))?;
            curve.train.push((step, loss));
            if let Some(v) = num(3) {
                curve.val.push((step, v));
            }
        }
        Ok(curve)
    }
}

/// Training (thin) and validation (thick) loss of each run, one colour per run.
pub(super) fn plot(path: &Path, curves: &[Curve]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let points = || curves.iter().flat_map(|c| c.train.iter().chain(&c.val));
    let (lo, hi) = points().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let last = points().fold(1.0f64, |m, p| m.max(p.0));
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("loss (nats per token)", ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..last, (lo * 0.95)..(hi * 1.05))
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, c) in curves.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(c.train.iter().copied(), color))
            .map_err(|e| err(&e))?
            .label(format!("{}: training", c.name))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], color));
        chart
            .draw_series(LineSeries::new(
                c.val.iter().copied(),
                color.stroke_width(3),
            ))
            .map_err(|e| err(&e))?
            .label(format!("{}: validation", c.name))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 15, y)], color.stroke_width(3))
            });
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

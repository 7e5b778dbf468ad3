//! Result files: `<date>/<device>.json` (merged across runs of the same day and device),
//! a markdown table, and an SVG chart per suite.

use plotters::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::harness::{Record, SuiteResult};

/// Everything one results file holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub date: String,
    pub device: String,
    pub backend: String,
    pub commit: String,
    pub suites: Vec<SuiteResult>,
}

/// Today's date (UTC) as `YYYY-MM-DD`.
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

fn slug(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_matches('-').to_string()
}

/// Writes (merging with an existing file of the same day and device) the JSON, markdown and
/// plots into the day's folder `dir/<date>/`, named after the device; returns the paths written.
pub fn write(dir: &Path, mut report: Report) -> std::io::Result<Vec<PathBuf>> {
    let dir = &dir.join(&report.date);
    std::fs::create_dir_all(dir)?;
    let stem = slug(&report.device);
    let json_path = dir.join(format!("{stem}.json"));
    if let Ok(old) = std::fs::read_to_string(&json_path)
        && let Ok(old) = serde_json::from_str::<Report>(&old)
        && old.backend == report.backend
    {
        let mut merged: Vec<SuiteResult> = old
            .suites
            .into_iter()
            .filter(|s| !report.suites.iter().any(|n| n.suite == s.suite))
            .collect();
        merged.append(&mut report.suites);
        report.suites = merged;
    }
    let mut written = vec![json_path.clone()];
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)?;
    let md_path = dir.join(format!("{stem}.md"));
    let mut md = markdown(&report);
    for s in &report.suites {
        if let Some(svg) = plot(dir, &stem, &report, s)? {
            let name = svg.file_name().unwrap().to_string_lossy().to_string();
            let _ = writeln!(md, "\n![{}]({name})", s.suite);
            written.push(svg);
        }
    }
    std::fs::write(&md_path, md)?;
    written.push(md_path);
    Ok(written)
}

/// A skip or failure reason fit for one table cell: its first line, at most 160 characters.
fn note(reason: Option<&str>) -> String {
    let line = reason.and_then(|r| r.lines().next()).unwrap_or("");
    let mut cell: String = line.chars().take(160).collect();
    if cell.len() < line.len() {
        cell.push('…');
    }
    cell.replace('|', "\\|")
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("–".to_string(), |v| format!("{v:.digits$}"))
}

/// A markdown table per suite.
pub fn markdown(report: &Report) -> String {
    let mut md = format!(
        "# Benchmarks: {} ({}), {}\n\nLatest run at commit `{}`. Times are medians of synchronized repetitions \
         after warm-up; speed-up = baseline median / median, both from this run (the ratio of \
         tokens/s where implementations process different token counts).\n",
        report.device, report.backend, report.date, report.commit
    );
    for s in &report.suites {
        // The memory column only where a suite measured memory.
        let mem = s.records.iter().any(|r| r.peak_mem_mb.is_some());
        let pool = s.records.iter().any(|r| r.pool_growth_mb.is_some());
        let (mut mem_head, mut mem_rule) = if mem {
            (" peak MB |".to_string(), "---:|".to_string())
        } else {
            (String::new(), String::new())
        };
        if pool {
            mem_head += " pool MB |";
            mem_rule += "---:|";
        }
        let live = s.records.iter().any(|r| r.live_peak_mb.is_some());
        if live {
            mem_head += " live MB |";
            mem_rule += "---:|";
        }
        let _ = write!(
            md,
            "\n## {}\n\n{}. Baseline: `{}`. Commit `{}`.\n\n| problem | implementation | median ms | min ms | p90 ms | TFLOP/s | GB/s | tokens/s |{mem_head} speed-up | note |\n|---|---|---:|---:|---:|---:|---:|---:|{mem_rule}---:|---|\n",
            s.suite, s.description, s.baseline, s.commit
        );
        for r in &s.records {
            let mut mem_cell = if mem {
                format!(" {} |", fmt_opt(r.peak_mem_mb, 0))
            } else {
                String::new()
            };
            if pool {
                mem_cell += &format!(" {} |", fmt_opt(r.pool_growth_mb, 0));
            }
            if live {
                mem_cell += &format!(" {} |", fmt_opt(r.live_peak_mb, 0));
            }
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |{mem_cell} {} | {} |",
                r.problem,
                r.implementation,
                fmt_opt(r.median_ms, 3),
                fmt_opt(r.min_ms, 3),
                fmt_opt(r.p90_ms, 3),
                fmt_opt(r.tflops, 1),
                fmt_opt(r.gbps, 0),
                fmt_opt(r.tokens_per_sec, 1),
                r.speedup_vs_baseline
                    .map_or("–".into(), |v| format!("{v:.2}×")),
                note(r.skipped.as_deref().or(r.note.as_deref())),
            );
        }
    }
    md
}

fn metric(r: &Record, y: &str) -> Option<f64> {
    match y {
        "tflops" => r.tflops,
        "gbps" => r.gbps,
        "tokens_per_sec" => r.tokens_per_sec,
        _ => r.median_ms,
    }
}

/// Draws `s` as an SVG line chart when the suite asks for one.
fn plot(
    dir: &Path,
    stem: &str,
    report: &Report,
    s: &SuiteResult,
) -> std::io::Result<Option<PathBuf>> {
    let Some(spec) = &s.plot else { return Ok(None) };
    if spec.bars {
        return bars(dir, stem, report, s, spec);
    }
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in &s.records {
        let (Some(x), Some(y)) = (
            r.params.get(&spec.x).and_then(|v| v.as_f64()),
            metric(r, &spec.y),
        ) else {
            continue;
        };
        let mut key = r.implementation.clone();
        for p in &spec.series {
            if let Some(v) = r.params.get(p) {
                let _ = write!(key, " {p}={v}");
            }
        }
        // Sizes usually double from one problem to the next: plot them evenly, on log2.
        series
            .entry(key)
            .or_default()
            .push((x.max(f64::MIN_POSITIVE).log2(), y));
    }
    if series.is_empty() {
        return Ok(None);
    }
    let path = dir.join(format!("{stem}-{}.svg", s.suite));
    let (xmin, xmax, ymax) = series
        .values()
        .flatten()
        .fold((f64::INFINITY, 0f64, 0f64), |(a, b, c), &(x, y)| {
            (a.min(x), b.max(x), c.max(y))
        });
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(&path, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = chart_builder(&root, report, s)
            .y_label_area_size(70)
            .build_cartesian_2d(xmin - 0.25..xmax + 0.25, 0f64..ymax * 1.5)?;
        chart
            .configure_mesh()
            .x_desc(spec.x.as_str())
            .y_desc(y_label(&spec.y))
            .x_labels(((xmax - xmin).round() as usize + 1).max(2))
            .x_label_formatter(&|v| format!("{:.0}", v.exp2()))
            .light_line_style(WHITE)
            .draw()?;
        for (i, (name, mut pts)) in series.into_iter().enumerate() {
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            let color = Palette99::pick(i).to_rgba();
            let style = ShapeStyle::from(color).stroke_width(2);
            chart
                .draw_series(LineSeries::new(pts.clone(), style))?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, style.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(Some(path))
}

/// A chart of suite `s` on `root` with what both plots share: the title (suite, device, date),
/// the margin and the x label area.
fn chart_builder<'a, 'b, DB: DrawingBackend>(
    root: &'a DrawingArea<DB, plotters::coord::Shift>,
    report: &Report,
    s: &SuiteResult,
) -> ChartBuilder<'a, 'b, DB> {
    let mut builder = ChartBuilder::on(root);
    builder
        .caption(
            format!("{} — {} ({})", s.suite, report.device, report.date),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45);
    builder
}

fn y_label(y: &str) -> &'static str {
    match y {
        "tflops" => "TFLOP/s",
        "gbps" => "GB/s",
        "tokens_per_sec" => "tokens/s",
        _ => "median ms",
    }
}

/// Draws `s` as horizontal bars of `spec.y`, one per record (label: implementation and, with
/// several problems, the problem), the `spec.bar_part` parameter as each bar's first part, and
/// each record's speed-up against the baseline at the bar's end.
fn bars(
    dir: &Path,
    stem: &str,
    report: &Report,
    s: &SuiteResult,
    spec: &crate::harness::PlotSpec,
) -> std::io::Result<Option<PathBuf>> {
    let problems: std::collections::BTreeSet<&str> =
        s.records.iter().map(|r| r.problem.as_str()).collect();
    let rows: Vec<(String, f64, Option<f64>, Option<f64>)> = s
        .records
        .iter()
        .filter_map(|r| {
            let y = metric(r, &spec.y)?;
            let label = if problems.len() > 1 {
                format!("{} — {}", r.implementation, r.problem)
            } else {
                r.implementation.clone()
            };
            let part = spec
                .bar_part
                .as_ref()
                .and_then(|p| r.params.get(p))
                .and_then(|v| v.as_f64())
                .map(|v| v.min(y));
            Some((label, y, part, r.speedup_vs_baseline))
        })
        .collect();
    if rows.is_empty() {
        return Ok(None);
    }
    let path = dir.join(format!("{stem}-{}.svg", s.suite));
    let ymax = rows.iter().map(|r| r.1).fold(0f64, f64::max);
    let n = rows.len();
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let height = 120 + 34 * n as u32;
        let root = SVGBackend::new(&path, (1000, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let label_width = rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(8) as u32;
        let mut chart = chart_builder(&root, report, s)
            .y_label_area_size((label_width * 7 + 10).min(420))
            .build_cartesian_2d(0f64..ymax * 1.25, (0..(n - 1).max(1)).into_segmented())?;
        let names: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
        chart
            .configure_mesh()
            .x_desc(y_label(&spec.y))
            .y_labels(n)
            .y_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => n
                    .checked_sub(1 + *i)
                    .and_then(|j| names.get(j).cloned())
                    .unwrap_or_default(),
                _ => String::new(),
            })
            .light_line_style(WHITE)
            .draw()?;
        let whole = RGBColor(174, 199, 232).to_rgba();
        let first = RGBColor(31, 119, 180).to_rgba();
        for (i, (_, y, part, speedup)) in rows.iter().enumerate() {
            // The first record at the top.
            let row = n - 1 - i;
            let band = |from: f64, to: f64, style: ShapeStyle| {
                Rectangle::new(
                    [
                        (from, SegmentValue::Exact(row)),
                        (to, SegmentValue::Exact(row + 1)),
                    ],
                    style,
                )
            };
            let start = part.unwrap_or(0.0);
            chart.draw_series([band(start, *y, whole.filled())])?;
            if let Some(p) = part {
                chart.draw_series([band(0.0, *p, first.filled())])?;
            }
            // A white outline separates neighbouring bars.
            chart.draw_series([band(0.0, *y, WHITE.stroke_width(6))])?;
            if let Some(x) = speedup {
                chart.draw_series([Text::new(
                    format!("{y:.0}  ({x:.2}×)"),
                    (*y + ymax * 0.01, SegmentValue::CenterOf(row)),
                    ("sans-serif", 14),
                )])?;
            }
        }
        if let Some(p) = &spec.bar_part {
            let legend = format!("dark: {p}; light: the rest");
            root.draw(&Text::new(
                legend,
                (20, height as i32 - 20),
                ("sans-serif", 14),
            ))?;
        }
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(Some(path))
}

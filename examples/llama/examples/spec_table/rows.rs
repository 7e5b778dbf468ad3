//! `--rows-out` and `--merge`: an exact run's per-prompt results as JSON lines, so that a run of
//! hundreds of prompts can be split into runs over disjoint prompt ranges (`--prompt-start`,
//! each killed by a time limit if need be) and their files merged into the one table a single
//! run would print.
//!
//! A rows file has one line per (prompt, draft temperature, scheme, K):
//! `{"prompt":12,"k":4,"temperature":1.2,"scheme":"SpecInfer","positions":16,"mean":0.71,
//! "draft":"first 8 of 30 layers","target_temperature":1.0}` — `prompt` is the prompt's index in
//! the corpus selection (`--prompts`), `mean` its acceptance averaged over its `positions`
//! continuation positions (serde_json reads it back to within its last bit, far below the
//! table's four decimals). A prompt's lines are written together and flushed when its last job
//! finishes, so a killed run keeps every prompt it finished.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::table::Table;

/// One prompt's mean acceptance in one cell for one scheme: one line of a rows file.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The prompt's index in the corpus selection.
    pub prompt: usize,
    /// Number of identical drafts.
    pub k: usize,
    /// Draft temperature.
    pub temperature: f32,
    /// The scheme's display name (`Scheme::name`).
    pub scheme: String,
    /// Continuation positions averaged over.
    pub positions: usize,
    /// The prompt's acceptance averaged over its positions.
    pub mean: f64,
    /// The draft, as the table's caption names it.
    pub draft: String,
    /// The target's sampling temperature.
    pub target_temperature: f32,
}

/// Why rows files could not be written or merged.
#[derive(Debug)]
pub enum RowsError {
    /// Reading or writing a file failed.
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A line of a rows file is not a row.
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// Rows of different runs' configurations (draft, target temperature) were merged.
    Mismatch(String),
    /// The files hold no complete prompt.
    NoRows,
}

impl fmt::Display for RowsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io { path, error } => write!(f, "{}: {error}", path.display()),
            Self::Line {
                path,
                line,
                message,
            } => write!(f, "{}:{line}: {message}", path.display()),
            Self::Mismatch(message) => write!(f, "rows of different runs: {message}"),
            Self::NoRows => write!(f, "the rows files hold no complete prompt"),
        }
    }
}

impl std::error::Error for RowsError {}

impl Row {
    /// The row as one JSON line (without the newline).
    pub fn to_json(&self) -> String {
        json!({
            "prompt": self.prompt,
            "k": self.k,
            "temperature": self.temperature,
            "scheme": self.scheme,
            "positions": self.positions,
            "mean": self.mean,
            "draft": self.draft,
            "target_temperature": self.target_temperature,
        })
        .to_string()
    }

    /// Parses one JSON line; the message names the missing or malformed field.
    pub fn parse(line: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        let uint = |name: &str| {
            v.get(name)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| format!("`{name}` is not a non-negative integer"))
        };
        let float = |name: &str| {
            v.get(name)
                .and_then(Value::as_f64)
                .ok_or_else(|| format!("`{name}` is not a number"))
        };
        let string = |name: &str| {
            v.get(name)
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| format!("`{name}` is not a string"))
        };
        Ok(Self {
            prompt: uint("prompt")?,
            k: uint("k")?,
            temperature: float("temperature")? as f32,
            scheme: string("scheme")?,
            positions: uint("positions")?,
            mean: float("mean")?,
            draft: string("draft")?,
            target_temperature: float("target_temperature")? as f32,
        })
    }
}

/// Appends each finished prompt's rows to a rows file (created empty), flushed per prompt.
pub struct RowsWriter {
    path: PathBuf,
    file: File,
}

impl RowsWriter {
    /// Creates (truncates) the file.
    pub fn create(path: &Path) -> Result<Self, RowsError> {
        let file = File::create(path).map_err(|error| RowsError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Writes one prompt's rows in one write, and flushes them to the file.
    pub fn write_prompt(&mut self, rows: &[Row]) -> Result<(), RowsError> {
        let mut text = String::new();
        for row in rows {
            text.push_str(&row.to_json());
            text.push('\n');
        }
        self.file
            .write_all(text.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|error| RowsError::Io {
                path: self.path.clone(),
                error,
            })
    }
}

/// Reads a rows file. A last line without its newline that is not a row (a write cut by a
/// kill) is skipped with a warning; any other bad line is an error.
pub fn read_rows(path: &Path) -> Result<Vec<Row>, RowsError> {
    let text = std::fs::read_to_string(path).map_err(|error| RowsError::Io {
        path: path.to_path_buf(),
        error,
    })?;
    let lines: Vec<&str> = text.split('\n').collect();
    let mut rows = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match Row::parse(line) {
            Ok(row) => rows.push(row),
            // The last piece of `split` is the text after the last newline.
            Err(message) if i + 1 == lines.len() => eprintln!(
                "warning: {}:{}: skipping a cut last line ({message})",
                path.display(),
                i + 1
            ),
            Err(message) => {
                return Err(RowsError::Line {
                    path: path.to_path_buf(),
                    line: i + 1,
                    message,
                });
            }
        }
    }
    Ok(rows)
}

/// The result of merging rows files.
#[derive(Debug)]
pub struct Merged {
    /// The table over every complete prompt, in prompt order.
    pub table: Table,
    /// Prompts found in more than one file (counted once, from the first file that has all their
    /// cells).
    pub duplicates: Vec<usize>,
    /// Prompts left out because some of their cells are missing.
    pub incomplete: Vec<usize>,
}

/// Position of `x` in `seen`, appending it the first time (first-seen order).
fn index_of<T: PartialEq>(seen: &mut Vec<T>, x: T) -> usize {
    seen.iter().position(|y| *y == x).unwrap_or_else(|| {
        seen.push(x);
        seen.len() - 1
    })
}

/// A prompt's value per (temperature, scheme, K) axis index.
type PromptCells = HashMap<(usize, usize, usize), f64>;

/// Merges the rows of several files (in the order given): each prompt comes from the first file
/// that has all its cells; the axes (temperatures, schemes, K) keep the order the rows first
/// name them in.
pub fn merge(files: &[Vec<Row>]) -> Result<Merged, RowsError> {
    let first = files.iter().flatten().next().ok_or(RowsError::NoRows)?;
    let (draft, target_temperature) = (first.draft.clone(), first.target_temperature);
    let (mut temps, mut schemes, mut ks) = (Vec::new(), Vec::new(), Vec::new());
    // Per file, per prompt: its cells.
    let mut per_file: Vec<HashMap<usize, PromptCells>> = Vec::new();
    for rows in files {
        let mut prompts: HashMap<usize, PromptCells> = HashMap::new();
        for row in rows {
            if row.draft != draft || row.target_temperature != target_temperature {
                return Err(RowsError::Mismatch(format!(
                    "prompt {}: draft {:?} at target T = {} against {draft:?} at T = \
                     {target_temperature}",
                    row.prompt, row.draft, row.target_temperature
                )));
            }
            let t = index_of(&mut temps, row.temperature.to_bits());
            let s = index_of(&mut schemes, row.scheme.clone());
            let k = index_of(&mut ks, row.k);
            // A file holding a prompt twice keeps its first rows.
            prompts
                .entry(row.prompt)
                .or_default()
                .entry((t, s, k))
                .or_insert(row.mean);
        }
        per_file.push(prompts);
    }
    let full = temps.len() * schemes.len() * ks.len();
    let mut all: Vec<usize> = per_file.iter().flat_map(|m| m.keys().copied()).collect();
    all.sort_unstable();
    all.dedup();
    let (mut prompts, mut chosen, mut duplicates, mut incomplete) =
        (vec![], vec![], vec![], vec![]);
    for p in all {
        let holders: Vec<&PromptCells> = per_file.iter().filter_map(|m| m.get(&p)).collect();
        if holders.len() > 1 {
            duplicates.push(p);
        }
        match holders.into_iter().find(|c| c.len() == full) {
            Some(cells) => {
                prompts.push(p);
                chosen.push(cells);
            }
            None => incomplete.push(p),
        }
    }
    if prompts.is_empty() {
        return Err(RowsError::NoRows);
    }
    let values = (0..temps.len())
        .map(|t| {
            (0..schemes.len())
                .map(|s| {
                    (0..ks.len())
                        .map(|k| chosen.iter().map(|c| c[&(t, s, k)]).collect())
                        .collect()
                })
                .collect()
        })
        .collect();
    Ok(Merged {
        table: Table {
            draft_name: draft,
            target_temperature,
            temperatures: temps.into_iter().map(f32::from_bits).collect(),
            schemes,
            ks,
            prompts,
            values,
        },
        duplicates,
        incomplete,
    })
}

/// Reads and merges rows files (see [`merge`]), reporting duplicates and incomplete prompts on
/// stderr.
pub fn merge_files(paths: &[PathBuf]) -> Result<Table, RowsError> {
    let files = paths
        .iter()
        .map(|p| read_rows(p))
        .collect::<Result<Vec<_>, _>>()?;
    let merged = merge(&files)?;
    eprintln!(
        "merge: {} rows files, {} prompts",
        paths.len(),
        merged.table.prompts.len()
    );
    if !merged.duplicates.is_empty() {
        eprintln!(
            "merge: {} prompts in more than one file, counted once: {:?}",
            merged.duplicates.len(),
            merged.duplicates
        );
    }
    let prompts = &merged.table.prompts;
    let gaps: Vec<usize> = (0..prompts.last().map_or(0, |&p| p))
        .filter(|p| prompts.binary_search(p).is_err())
        .collect();
    if !gaps.is_empty() {
        eprintln!(
            "warning: merge: {} prompts below the last one ({}) are in no file: {gaps:?}",
            gaps.len(),
            prompts.last().map_or(0, |&p| p)
        );
    }
    if !merged.incomplete.is_empty() {
        eprintln!(
            "warning: merge: {} prompts with missing cells left out: {:?}",
            merged.incomplete.len(),
            merged.incomplete
        );
    }
    Ok(merged.table)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of prompts `range` over 2 temperatures × 2 schemes × 3 Ks, with values that differ
    /// per prompt and cell.
    fn rows(range: std::ops::Range<usize>) -> Vec<Row> {
        let mut out = Vec::new();
        for prompt in range {
            for temperature in [1.0f32, 1.2] {
                for scheme in ["SpecInfer", "Optimal"] {
                    for k in [2, 4, 8] {
                        let x = (prompt * 7 + k * 3 + scheme.len()) % 11;
                        out.push(Row {
                            prompt,
                            k,
                            temperature,
                            scheme: scheme.to_string(),
                            positions: 8,
                            mean: 0.3 + 0.05 * x as f64 + 0.01 * temperature as f64,
                            draft: "first 8 of 30 layers".to_string(),
                            target_temperature: 1.0,
                        });
                    }
                }
            }
        }
        out
    }

    /// Writes `rows` with the run's writer and reads them back.
    fn round_trip(name: &str, rows: &[Row]) -> Vec<Row> {
        let path = std::env::temp_dir().join(format!(
            "spec_table_rows_{}_{name}.jsonl",
            std::process::id()
        ));
        let mut w = RowsWriter::create(&path).unwrap();
        // Two prompts' writes, as a run makes them.
        let half = rows.len() / 2;
        w.write_prompt(&rows[..half]).unwrap();
        w.write_prompt(&rows[half..]).unwrap();
        let back = read_rows(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        back
    }

    #[test]
    fn merging_disjoint_files_gives_the_one_file_table() {
        let whole = round_trip("whole", &rows(0..10));
        let first = round_trip("first", &rows(0..4));
        let second = round_trip("second", &rows(4..10));
        // serde_json's default float parsing may be off by the last bit: the rows round trip
        // to within 1e-15, and the tables below are compared exactly (both parsed).
        assert_eq!(whole.len(), rows(0..10).len());
        for (back, row) in whole.iter().zip(&rows(0..10)) {
            assert!(
                (back.mean - row.mean).abs() < 1e-15,
                "{back:?} against {row:?}"
            );
            let exact = Row {
                mean: row.mean,
                ..back.clone()
            };
            assert_eq!(&exact, row, "JSON lines round trip");
        }
        let one = merge(std::slice::from_ref(&whole)).unwrap();
        // The later range first: the table is in prompt order whatever the files' order.
        let two = merge(&[second, first]).unwrap();
        assert_eq!(one.table.prompts, (0..10).collect::<Vec<_>>());
        assert_eq!(two.table, one.table);
        assert_eq!(two.table.markdown(), one.table.markdown());
        assert_eq!(two.table.chart_svg(), one.table.chart_svg());
        assert!(two.duplicates.is_empty() && two.incomplete.is_empty());
        // The statistics: a cell's mean and standard error over the 10 prompts.
        let cell: Vec<f64> = whole
            .iter()
            .filter(|r| r.temperature == 1.2 && r.scheme == "Optimal" && r.k == 4)
            .map(|r| r.mean)
            .collect();
        assert_eq!(one.table.values[1][1][1], cell);
        let (mean, se) = crate::table::mean_se(&cell);
        let expected_mean = cell.iter().sum::<f64>() / 10.0;
        let var = cell
            .iter()
            .map(|v| (v - expected_mean).powi(2))
            .sum::<f64>()
            / 9.0;
        assert!((mean - expected_mean).abs() < 1e-12);
        assert!((se - (var / 10.0).sqrt()).abs() < 1e-12);
        let cell_text = format!(" {mean:.4} ± {se:.4} |");
        assert!(one.table.markdown().contains(&cell_text));
        assert!(one.table.markdown().contains("mean over 10 prompts"));
    }

    #[test]
    fn a_duplicate_prompt_is_counted_once() {
        let one = merge(&[rows(0..6)]).unwrap();
        // Prompts 2 and 3 in both files (with other values in the second: ignored).
        let mut second = rows(2..6);
        for r in &mut second {
            if r.prompt < 4 {
                r.mean += 0.5;
            }
        }
        let two = merge(&[rows(0..4), second]).unwrap();
        assert_eq!(two.duplicates, vec![2, 3]);
        assert_eq!(two.table.prompts.len(), 6);
        assert_eq!(two.table, one.table);
        // A file holding its prompts twice (concatenated) counts them once too.
        let twice = [rows(0..6), rows(0..6)].concat();
        assert_eq!(merge(&[twice]).unwrap().table, one.table);
    }

    #[test]
    fn incomplete_prompts_and_bad_files_are_reported() {
        let mut cut = rows(0..3);
        cut.pop();
        let merged = merge(&[cut]).unwrap();
        assert_eq!(merged.incomplete, vec![2]);
        assert_eq!(merged.table.prompts, vec![0, 1]);
        assert!(matches!(merge(&[]), Err(RowsError::NoRows)));
        let mut other = rows(3..4);
        other[0].target_temperature = 0.7;
        assert!(matches!(
            merge(&[rows(0..3), other]),
            Err(RowsError::Mismatch(_))
        ));
        assert!(Row::parse("{\"prompt\": 1}").is_err());
        let path =
            std::env::temp_dir().join(format!("spec_table_rows_{}_bad.jsonl", std::process::id()));
        // A bad line before the last is an error; a cut last line is skipped.
        let good = rows(0..1)[0].to_json();
        std::fs::write(&path, format!("{good}\nnot json\n{good}\n")).unwrap();
        let err = read_rows(&path).unwrap_err().to_string();
        assert!(err.contains(":2: not JSON"), "{err}");
        std::fs::write(&path, format!("{good}\n{}", &good[..20])).unwrap();
        assert_eq!(read_rows(&path).unwrap().len(), 1);
        std::fs::remove_file(&path).unwrap();
        let missing = read_rows(Path::new("/nonexistent/rows.jsonl"));
        assert!(matches!(missing, Err(RowsError::Io { .. })));
    }
}

//! Prints the Figure 2 table (analytic acceptance probabilities) as Markdown.
//!
//! `cargo run --release -p burn-specdec --example figure2 [q1]` (default `q1 = 1/3`; the paper's
//! right plot uses `q1 = 1/6`).

use burn_specdec::{figure2_markdown, figure2_row};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let q1 = match std::env::args().nth(1) {
        Some(arg) => parse_fraction(&arg)?,
        None => 1.0 / 3.0,
    };
    let top = 1.0 - q1;
    let mut grid: Vec<f64> = (0..)
        .map(|i| f64::from(i) / 10.0)
        .take_while(|&q2| q2 < top - 1e-9)
        .collect();
    grid.push(top);
    let rows = grid
        .iter()
        .map(|&q2| figure2_row(q1, q2))
        .collect::<Result<Vec<_>, _>>()?;
    println!("p = [1/3, 1/3, 1/3], K = 2 identical drafts, q = [{q1:.4}, q2, {top:.4} - q2]\n");
    println!("| q2 | SpecInfer | SpecTr | IS | Optimal (LP) | Bound |");
    println!("|---|---|---|---|---|---|");
    print!("{}", figure2_markdown(&rows));
    Ok(())
}

fn parse_fraction(s: &str) -> Result<f64, Box<dyn std::error::Error>> {
    Ok(match s.split_once('/') {
        Some((a, b)) => a.trim().parse::<f64>()? / b.trim().parse::<f64>()?,
        None => s.trim().parse()?,
    })
}

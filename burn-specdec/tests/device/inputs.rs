//! Random rows, sequences and robust uniforms for the device-vs-host verification tests.

use super::*;

pub(super) const STYLES: [Style; 5] = [
    Style::Flat,
    Style::Peaky,
    Style::Sparse,
    Style::QEqualsP,
    Style::Disjoint,
];

/// The device schemes and the draft counts they take.
pub(super) fn schemes() -> [(Scheme, &'static [usize]); 4] {
    [
        (Scheme::SingleDraft, &[1]),
        (Scheme::SpecInfer, &[1, 2, 3, 4]),
        (Scheme::SpecTr, &[1, 2, 3, 4]),
        (Scheme::SequentialImportance, &[1, 2, 3, 4]),
    ]
}

pub(super) fn normal(rng: &mut StdRng) -> f64 {
    // Irwin-Hall approximation: plenty for test rows.
    (0..12).map(|_| rng.random::<f64>()).sum::<f64>() - 6.0
}

/// A random row over `v` tokens; `parity` restricts the support to tokens of that parity.
pub(super) fn random_row(
    rng: &mut StdRng,
    v: usize,
    style: Style,
    parity: Option<usize>,
) -> Vec<f32> {
    let mut row: Vec<f32> = (0..v)
        .map(|_| match style {
            Style::Peaky => (6.0 * normal(rng)).exp() as f32,
            _ => (-(1.0 - rng.random::<f64>()).ln()) as f32,
        })
        .collect();
    if style == Style::Sparse {
        for x in row.iter_mut() {
            if rng.random::<bool>() {
                *x = 0.0;
            }
        }
    }
    if let Some(par) = parity {
        for (i, x) in row.iter_mut().enumerate() {
            if i % 2 != par {
                *x = 0.0;
            }
        }
    }
    if row.iter().all(|&x| x <= 0.0) {
        let allowed: Vec<usize> = (0..v)
            .filter(|i| parity.is_none_or(|p| i % 2 == p))
            .collect();
        row[allowed[rng.random_range(0..allowed.len())]] = 1.0;
    }
    row
}

pub(super) fn sample(row: &[f32], rng: &mut StdRng) -> usize {
    let w: Vec<f64> = row.iter().map(|&x| x as f64).collect();
    inverse_cdf(&w, rng.random::<f64>()).expect("row has mass")
}

/// One sequence: rows `[K][L + 1]` / `[K][L]` of length V, drafted tokens `[K][L]`.
pub(super) struct Seq {
    pub(super) target: Vec<Vec<Vec<f32>>>,
    pub(super) draft: Vec<Vec<Vec<f32>>>,
    pub(super) drafts: Vec<Vec<usize>>,
}

/// Draws a token tree: drafts sharing a prefix share the target row, and (for identical draft
/// models) the draft row; later drafts often copy an earlier sibling's token so that several
/// drafts survive.
pub(super) fn random_seq(rng: &mut StdRng, v: usize, k: usize, l: usize, style: Style) -> Seq {
    let identical_models = rng.random::<bool>();
    let (p_par, q_par) = if style == Style::Disjoint && v >= 2 {
        (Some(0), Some(1))
    } else {
        (None, None)
    };
    let mut class = vec![0usize; k];
    let mut next_class = 1;
    let mut target_rows: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
    let mut draft_rows: HashMap<(usize, usize, usize), Vec<f32>> = HashMap::new();
    let mut target = vec![Vec::new(); k];
    let mut draft = vec![Vec::new(); k];
    let mut drafts = vec![Vec::new(); k];
    for j in 0..=l {
        for d in 0..k {
            let p = target_rows
                .entry((class[d], j))
                .or_insert_with(|| random_row(rng, v, style, p_par))
                .clone();
            target[d].push(p.clone());
            if j == l {
                continue;
            }
            let model = if identical_models { 0 } else { d };
            let q = draft_rows
                .entry((class[d], j, model))
                .or_insert_with(|| {
                    if style == Style::QEqualsP {
                        p.clone()
                    } else {
                        random_row(rng, v, style, q_par)
                    }
                })
                .clone();
            let sibling = (0..d).find(|&e| class[e] == class[d]);
            let x = match sibling {
                Some(e) if rng.random::<f64>() < 0.5 && q[drafts[e][j]] > 0.0 => drafts[e][j],
                _ => sample(&q, rng),
            };
            draft[d].push(q);
            drafts[d].push(x);
        }
        if j < l {
            let mut ids: HashMap<(usize, usize), usize> = HashMap::new();
            for d in 0..k {
                let key = (class[d], drafts[d][j]);
                class[d] = *ids.entry(key).or_insert_with(|| {
                    next_class += 1;
                    next_class
                });
            }
        }
    }
    Seq {
        target,
        draft,
        drafts,
    }
}

pub(super) fn grid_uniform(rng: &mut StdRng) -> f64 {
    rng.random_range(0..(1u64 << 24)) as f64 / GRID
}

/// The first uniform whose move by `±MARGIN` changes `decide`'s result.
pub(super) fn is_robust<T: PartialEq>(us: &[f64], decide: &impl Fn(&[f64]) -> T) -> Option<usize> {
    let base = decide(us);
    for i in 0..us.len() {
        for delta in [-MARGIN, MARGIN] {
            let mut moved = us.to_vec();
            moved[i] = (us[i] + delta).clamp(0.0, 1.0 - 1.0 / GRID);
            if decide(&moved) != base {
                return Some(i);
            }
        }
    }
    None
}

/// Draws `n` grid uniforms, redrawing any within `MARGIN` of a threshold of `decide`.
pub(super) fn robust_uniforms<T: PartialEq>(
    rng: &mut StdRng,
    n: usize,
    decide: impl Fn(&[f64]) -> T,
) -> Vec<f64> {
    let mut us: Vec<f64> = (0..n).map(|_| grid_uniform(rng)).collect();
    for _ in 0..10_000 {
        match is_robust(&us, &decide) {
            None => return us,
            Some(i) => us[i] = grid_uniform(rng),
        }
    }
    panic!("no robust uniforms found");
}

//! Long-context retrieval tasks in the style of RULER (Hsieh et al., 2024), built from any text:
//! needles ("One of the special magic numbers for *key* is: *number*.") or chains of variable
//! assignments hidden at seeded places in a haystack of the text's lines, followed by a question
//! and the start of its answer. A model completes the answer greedily; [`string_match_all`]
//! scores it as RULER does (the share of expected answers the completion contains).
//!
//! The `needle` example runs these tasks on SmolLM2 through the full cache and through ShadowKV
//! (`--tasks`); the haystack is the fine-tuning corpus (`cargo xtask fetch-corpus`) where it is
//! present. Each [`RulerSample`] is fully determined by its task, haystack, length and seed.
//!
//! | task | needles | question | answers |
//! |---|---|---|---|
//! | [`RulerTask::Single`] | 1 key, 1 number | its number | 1 |
//! | [`RulerTask::MultiKey`] | 4 keys, 1 number each | one key's number | 1 |
//! | [`RulerTask::MultiValue`] | 1 key, 4 numbers | all of its numbers | 4 |
//! | [`RulerTask::MultiQuery`] | 4 keys, 1 number each | two keys' numbers | 2 |
//! | [`RulerTask::VariableTracking`] | a chain of 4 assignments and a distractor chain | the chain's variables | 4 |

use std::path::Path;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// One retrieval task (`needle --tasks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum RulerTask {
    /// One needle; asks for its number (RULER's `niah_single`).
    Single,
    /// Four needles with different keys; asks for one key's number (`niah_multikey`).
    MultiKey,
    /// Four needles with the same key; asks for all four numbers (`niah_multivalue`).
    MultiValue,
    /// Four needles with different keys; asks for two keys' numbers (`niah_multiquery`).
    MultiQuery,
    /// A chain of four variable assignments (`VAR B = VAR A.`) and a distractor chain; asks
    /// for every variable that holds the first one's value (`vt`).
    VariableTracking,
}

impl RulerTask {
    /// Every task, in the order of the module table.
    pub const ALL: [RulerTask; 5] = [
        RulerTask::Single,
        RulerTask::MultiKey,
        RulerTask::MultiValue,
        RulerTask::MultiQuery,
        RulerTask::VariableTracking,
    ];

    /// The task's name on the command line.
    pub fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self)
            .expect("no skipped variant")
            .get_name()
            .to_string()
    }
}

/// Needles per NIAH task beyond the single one, and the variable chain's length.
const NEEDLES: usize = 4;
/// The keys needles are filed under.
const KEYS: [&str; 24] = [
    "apple", "river", "lantern", "falcon", "meadow", "copper", "harbor", "violet", "thunder",
    "marble", "willow", "compass", "ember", "glacier", "orchid", "saddle", "beacon", "cobalt",
    "pepper", "quartz", "raven", "summit", "tulip", "velvet",
];

const NIAH_INTRO: &str = "Some special magic numbers are hidden within the following text. \
                          Make sure to memorize it. I will quiz you about the numbers \
                          afterwards.\n";
const VT_INTRO: &str = "Memorize and track the chain of variable assignments hidden in the \
                        following text.\n";
/// Used when no text is given (a haystack must have at least one line).
const FILLER: &str = "The grass is green. The sky is blue. The sun is yellow. Here we go. \
                      There and back again.";

/// The text needles are hidden in: its non-empty lines, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Haystack {
    lines: Vec<String>,
}

/// Why a haystack could not be built.
#[derive(Debug, thiserror::Error)]
pub enum RulerError {
    /// The text has no non-empty line.
    #[error("the haystack text has no non-empty line")]
    EmptyHaystack,
    /// The corpus could not be read.
    #[error("reading the haystack corpus {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Counting a piece's tokens failed.
    #[error("counting tokens: {0}")]
    Count(String),
}

impl Haystack {
    /// The non-empty lines of `text`, trimmed.
    ///
    /// # Errors
    /// [`RulerError::EmptyHaystack`] when there are none.
    pub fn new(text: &str) -> Result<Self, RulerError> {
        let lines: Vec<String> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect();
        match lines.is_empty() {
            true => Err(RulerError::EmptyHaystack),
            false => Ok(Self { lines }),
        }
    }

    /// Repeated filler sentences (the pass-key task's), for when no corpus is at hand.
    pub fn filler() -> Self {
        Self {
            lines: vec![FILLER.to_string()],
        }
    }

    /// The lines of every `.txt` file under `dir` (a file itself when `dir` is one), in file
    /// name order.
    ///
    /// # Errors
    /// [`RulerError::Io`] when a file cannot be read; [`RulerError::EmptyHaystack`] when
    /// nothing was found.
    pub fn load(dir: &Path) -> Result<Self, RulerError> {
        let io = |source| RulerError::Io {
            path: dir.display().to_string(),
            source,
        };
        let mut files = Vec::new();
        if dir.is_file() {
            files.push(dir.to_path_buf());
        } else {
            for entry in std::fs::read_dir(dir).map_err(io)? {
                let path = entry.map_err(io)?.path();
                if path.extension().is_some_and(|e| e == "txt") {
                    files.push(path);
                }
            }
            files.sort();
        }
        let mut text = String::new();
        for file in files {
            text.push_str(
                &std::fs::read_to_string(&file).map_err(|source| RulerError::Io {
                    path: file.display().to_string(),
                    source,
                })?,
            );
            text.push('\n');
        }
        Self::new(&text)
    }

    /// Lines in the haystack.
    pub fn len(&self) -> usize {
        self.lines.len()
    }

    /// Never true (a haystack has a line).
    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }
}

/// A prompt and what its completion must contain.
#[derive(Debug, Clone, PartialEq)]
pub struct RulerSample {
    /// The task it was built for.
    pub task: RulerTask,
    /// The prompt text: introduction, haystack with the needles, question, answer prefix.
    pub text: String,
    /// The strings the completion is scored on ([`string_match_all`]).
    pub answers: Vec<String>,
}

/// RULER's `string_match_all`: the share of `answers` that occur in `output` (case-insensitive).
/// 1.0 for no answers.
pub fn string_match_all(output: &str, answers: &[String]) -> f64 {
    if answers.is_empty() {
        return 1.0;
    }
    let out = output.to_lowercase();
    let hits = answers
        .iter()
        .filter(|a| out.contains(&a.to_lowercase()))
        .count();
    hits as f64 / answers.len() as f64
}

/// What a task hides and asks: the needle sentences (in order), the question with its answer
/// prefix, the expected answers.
struct Plan {
    intro: &'static str,
    needles: Vec<String>,
    question: String,
    answers: Vec<String>,
}

/// A 7-digit number, as RULER's needles hold.
fn number(rng: &mut StdRng) -> String {
    rng.random_range(1_000_000..10_000_000u32).to_string()
}

/// A five-letter upper-case variable name.
fn variable(rng: &mut StdRng) -> String {
    (0..5)
        .map(|_| char::from(b'A' + rng.random_range(0..26u8)))
        .collect()
}

fn needle(key: &str, value: &str) -> String {
    format!("One of the special magic numbers for {key} is: {value}.")
}

fn plan(task: RulerTask, rng: &mut StdRng) -> Plan {
    let mut keys = KEYS.to_vec();
    keys.shuffle(rng);
    let niah = |needles, question: String, answers| Plan {
        intro: NIAH_INTRO,
        needles,
        question,
        answers,
    };
    let ask_one = |key: &str| {
        format!(
            "\nWhat is the special magic number for {key} mentioned in the provided text? The \
             special magic number for {key} mentioned in the provided text is"
        )
    };
    match task {
        RulerTask::Single => {
            let value = number(rng);
            niah(vec![needle(keys[0], &value)], ask_one(keys[0]), vec![value])
        }
        RulerTask::MultiKey | RulerTask::MultiQuery => {
            let values: Vec<String> = (0..NEEDLES).map(|_| number(rng)).collect();
            let needles = (0..NEEDLES).map(|i| needle(keys[i], &values[i])).collect();
            let asked = match task {
                RulerTask::MultiKey => 1,
                _ => 2,
            };
            // The asked keys are a seeded choice among the hidden ones.
            let mut order: Vec<usize> = (0..NEEDLES).collect();
            order.shuffle(rng);
            let picked = &order[..asked];
            let answers = picked.iter().map(|&i| values[i].clone()).collect();
            let question = match picked {
                [i] => ask_one(keys[*i]),
                _ => {
                    let names = format!("{} and {}", keys[picked[0]], keys[picked[1]]);
                    format!(
                        "\nWhat are all the special magic numbers for {names} mentioned in the \
                         provided text? The special magic numbers for {names} mentioned in the \
                         provided text are"
                    )
                }
            };
            niah(needles, question, answers)
        }
        RulerTask::MultiValue => {
            let key = keys[0];
            let values: Vec<String> = (0..NEEDLES).map(|_| number(rng)).collect();
            let needles = values.iter().map(|v| needle(key, v)).collect();
            let question = format!(
                "\nWhat are all the special magic numbers for {key} mentioned in the provided \
                 text? The special magic numbers for {key} mentioned in the provided text are"
            );
            niah(needles, question, values)
        }
        RulerTask::VariableTracking => {
            let chain = |rng: &mut StdRng, value: &str| {
                let names: Vec<String> = (0..NEEDLES).map(|_| variable(rng)).collect();
                let mut lines = vec![format!("VAR {} = {value}.", names[0])];
                lines.extend(
                    names
                        .windows(2)
                        .map(|w| format!("VAR {} = VAR {}.", w[1], w[0])),
                );
                (names, lines)
            };
            let value = number(rng);
            let (names, lines) = chain(rng, &value);
            let other = number(rng);
            let (_, noise) = chain(rng, &other);
            // The two chains interleave, each in its own order.
            let mut needles = Vec::new();
            for (a, b) in lines.into_iter().zip(noise) {
                needles.push(a);
                needles.push(b);
            }
            let question = format!(
                "\nQuestion: Find all variables that are assigned the value {value} in the text \
                 above. Answer: According to the chain of variable assignments in the text \
                 above, {NEEDLES} variables are assigned the value {value}, they are:"
            );
            Plan {
                intro: VT_INTRO,
                needles,
                question,
                answers: names,
            }
        }
    }
}

/// A prompt of about `tokens` tokens for `task`: the haystack's lines from a seeded start (its
/// lines again from the top where it runs out) with the needles at seeded places, in their
/// order. `count` gives a piece of text's tokens; the prompt's length is the sum over its
/// pieces, so it can be a few tokens off the tokenized whole.
///
/// # Errors
/// [`RulerError::Count`] when `count` fails.
pub fn ruler_sample<E: std::fmt::Display>(
    task: RulerTask,
    haystack: &Haystack,
    tokens: usize,
    seed: u64,
    count: &mut dyn FnMut(&str) -> Result<usize, E>,
) -> Result<RulerSample, RulerError> {
    let mut rng = StdRng::seed_from_u64(seed ^ (task as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let plan = plan(task, &mut rng);
    let mut count = |s: &str| count(s).map_err(|e| RulerError::Count(e.to_string()));
    let mut used = count(plan.intro)? + count(&plan.question)?;
    for n in &plan.needles {
        used += count(n)? + 1;
    }
    // Haystack lines until the budget is spent (at least one).
    let start = rng.random_range(0..haystack.lines.len());
    let mut hay = Vec::new();
    while hay.is_empty() || used < tokens {
        let line = &haystack.lines[(start + hay.len()) % haystack.lines.len()];
        used += count(line)? + 1;
        hay.push(line.as_str());
    }
    // Seeded, sorted places among the lines (several needles may share one).
    let mut at: Vec<usize> = (0..plan.needles.len())
        .map(|_| rng.random_range(0..=hay.len()))
        .collect();
    at.sort_unstable();
    let mut text = String::from(plan.intro);
    let mut next = 0;
    for (i, line) in hay.iter().enumerate() {
        while next < at.len() && at[next] == i {
            text.push_str(&plan.needles[next]);
            text.push('\n');
            next += 1;
        }
        text.push_str(line);
        text.push('\n');
    }
    for n in &plan.needles[next..] {
        text.push_str(n);
        text.push('\n');
    }
    text.push_str(&plan.question);
    Ok(RulerSample {
        task,
        text,
        answers: plan.answers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Words and line breaks: a tokenizer's count is about additive the same way.
    fn words(s: &str) -> Result<usize, String> {
        Ok(s.split_whitespace().count() + s.matches('\n').count())
    }

    fn hay() -> Haystack {
        let text: String = (0..97)
            .map(|i| format!("Line {i} of the play, with some words in it.\n\n"))
            .collect();
        Haystack::new(&text).unwrap()
    }

    #[test]
    fn samples_hide_every_needle_in_order_and_reach_the_length() {
        let hay = hay();
        assert_eq!(hay.len(), 97);
        for task in RulerTask::ALL {
            for (seed, tokens) in [(0, 1), (1, 37), (7, 500), (11, 3001)] {
                let s = ruler_sample(task, &hay, tokens, seed, &mut words).unwrap();
                let n = words(&s.text).unwrap();
                assert!(n >= tokens, "{task:?} {tokens}: {n} words");
                // One line over at most (a line has 10 words).
                assert!(n < tokens + 120, "{task:?} {tokens}: {n} words");
                let expect = match task {
                    RulerTask::Single | RulerTask::MultiKey => 1,
                    RulerTask::MultiQuery => 2,
                    RulerTask::MultiValue | RulerTask::VariableTracking => 4,
                };
                assert_eq!(s.answers.len(), expect, "{task:?}");
                let needles = s
                    .text
                    .lines()
                    .filter(|l| l.starts_with("One of the") || l.starts_with("VAR "))
                    .collect::<Vec<_>>();
                let hidden = match task {
                    RulerTask::Single => 1,
                    RulerTask::VariableTracking => 8,
                    _ => 4,
                };
                assert_eq!(needles.len(), hidden, "{task:?}: {needles:?}");
                // The prompt holds every answer before its question.
                let (body, question) = s.text.rsplit_once('\n').unwrap();
                for a in &s.answers {
                    assert!(body.contains(a.as_str()), "{task:?}: {a} not hidden");
                }
                assert!(
                    question.ends_with("is")
                        || question.ends_with("are")
                        || question.ends_with(':')
                );
                if task == RulerTask::VariableTracking {
                    // The chain is in order: each variable is assigned after the one it copies.
                    let pos = |v: &str| body.find(&format!("VAR {v} =")).unwrap();
                    for w in s.answers.windows(2) {
                        assert!(pos(&w[0]) < pos(&w[1]), "{:?}", s.answers);
                        assert!(body.contains(&format!("VAR {} = VAR {}.", w[1], w[0])));
                    }
                    let value = question.split_whitespace().find(|w| w.len() == 7).unwrap();
                    let value = value.trim_end_matches(',');
                    assert!(body.contains(&format!("VAR {} = {value}.", s.answers[0])));
                }
            }
        }
    }

    #[test]
    fn samples_are_seeded() {
        let hay = hay();
        for task in RulerTask::ALL {
            let a = ruler_sample(task, &hay, 300, 5, &mut words).unwrap();
            assert_eq!(a, ruler_sample(task, &hay, 300, 5, &mut words).unwrap());
            assert_ne!(a, ruler_sample(task, &hay, 300, 6, &mut words).unwrap());
        }
        // Different tasks with one seed do not share their numbers.
        let a = ruler_sample(RulerTask::Single, &hay, 300, 5, &mut words).unwrap();
        let b = ruler_sample(RulerTask::MultiKey, &hay, 300, 5, &mut words).unwrap();
        assert_ne!(a.answers, b.answers);
    }

    #[test]
    fn string_match_all_counts_answers() {
        let answers: Vec<String> = ["1234567", "ABCDE"].map(String::from).to_vec();
        assert_eq!(string_match_all("it is 1234567 and abcde.", &answers), 1.0);
        assert_eq!(string_match_all("it is 1234567.", &answers), 0.5);
        assert_eq!(string_match_all("nothing", &answers), 0.0);
        assert_eq!(string_match_all("", &[]), 1.0);
    }

    #[test]
    fn haystacks_need_a_line_and_read_folders() {
        assert!(matches!(
            Haystack::new("\n  \n"),
            Err(RulerError::EmptyHaystack)
        ));
        assert_eq!(Haystack::filler().len(), 1);
        let dir = std::env::temp_dir().join(format!("ruler-hay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("b.txt"), "second\n").unwrap();
        std::fs::write(dir.join("a.txt"), "first\n\n").unwrap();
        std::fs::write(dir.join("c.md"), "ignored\n").unwrap();
        let h = Haystack::load(&dir).unwrap();
        assert_eq!(h.lines, ["first", "second"]);
        assert!(matches!(
            Haystack::load(&dir.join("missing")),
            Err(RulerError::Io { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! A small stderr logger for the workspace's binaries (`llama`, `finetune`, the bench runner),
//! so that the libraries' `log` lines reach the user: a kernel replaced after a failed launch,
//! an op falling back to its reference. Libraries never install it; a binary calls [`init`].
//!
//! `RUST_LOG` is read as comma-separated directives: a level (`warn`, the default), or
//! `target=level` for targets starting with `target` (`burn_cce=debug,warn`). The most specific
//! matching directive wins.

use log::{Level, LevelFilter, Log, Metadata, Record};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Warnings from CubeCL's runtime that say work did not run: a launch refused on the device
/// thread, an autotune that found no working kernel. Neither reaches the caller as an error:
/// the outputs are left unwritten and only a later read fails. Counted whatever `RUST_LOG` says.
static DEVICE_FAILURES: AtomicUsize = AtomicUsize::new(0);

/// How many CubeCL launch failures this process has logged since [`init`] (see
/// `DEVICE_FAILURES`). A benchmark whose run raised it timed work that did not all run.
pub fn device_failures() -> usize {
    DEVICE_FAILURES.load(Ordering::Relaxed)
}

fn is_device_failure(record: &Record) -> bool {
    record.level() <= Level::Warn && record.target().starts_with("cubecl_runtime") && {
        let text = record.args().to_string();
        text.contains("launch error") || text.contains("measured no candidate")
    }
}

struct StderrLogger {
    /// `(target prefix, level)`, longest prefix first.
    directives: Vec<(String, LevelFilter)>,
    default: LevelFilter,
}

impl StderrLogger {
    fn level_for(&self, target: &str) -> LevelFilter {
        self.directives
            .iter()
            .find(|(prefix, _)| target.starts_with(prefix.as_str()))
            .map_or(self.default, |(_, level)| *level)
    }
}

impl Log for StderrLogger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= self.level_for(metadata.target())
            || (metadata.level() <= Level::Warn && metadata.target().starts_with("cubecl_runtime"))
    }

    fn log(&self, record: &Record) {
        if is_device_failure(record) {
            DEVICE_FAILURES.fetch_add(1, Ordering::Relaxed);
        }
        if record.level() <= self.level_for(record.target()) {
            eprintln!("[{} {}] {}", record.level(), record.target(), record.args());
        }
    }

    fn flush(&self) {}
}

/// Parses `RUST_LOG`-style directives (see the module docs); unknown levels are ignored.
fn parse(spec: &str, default: LevelFilter) -> StderrLogger {
    let mut logger = StderrLogger {
        directives: Vec::new(),
        default,
    };
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('=') {
            Some((target, level)) => {
                if let Ok(level) = level.trim().parse() {
                    logger.directives.push((target.trim().to_string(), level));
                }
            }
            None => {
                if let Ok(level) = part.parse() {
                    logger.default = level;
                }
            }
        }
    }
    logger
        .directives
        .sort_by_key(|(prefix, _)| std::cmp::Reverse(prefix.len()));
    logger
}

static LOGGER: OnceLock<StderrLogger> = OnceLock::new();

/// Installs the stderr logger with `RUST_LOG`'s directives (warnings by default). Does nothing
/// if a logger is already installed.
pub fn init() {
    let logger = LOGGER.get_or_init(|| {
        parse(
            &std::env::var("RUST_LOG").unwrap_or_default(),
            LevelFilter::Warn,
        )
    });
    // Warnings always pass the global filter, for the device-failure count.
    let max = logger
        .directives
        .iter()
        .map(|(_, level)| *level)
        .fold(logger.default.max(LevelFilter::Warn), std::cmp::max);
    if log::set_logger(logger).is_ok() {
        log::set_max_level(max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives_pick_the_longest_prefix() {
        let l = parse("burn=info, burn_cce=debug,error", LevelFilter::Warn);
        assert_eq!(l.default, LevelFilter::Error);
        assert_eq!(l.level_for("burn_cce::gemm"), LevelFilter::Debug);
        assert_eq!(l.level_for("burn_fusion"), LevelFilter::Info);
        assert_eq!(l.level_for("cubecl_cuda"), LevelFilter::Error);
        let l = parse("", LevelFilter::Warn);
        assert_eq!(l.level_for("anything"), LevelFilter::Warn);
        let l = parse("nonsense,x=loud", LevelFilter::Warn);
        assert_eq!(l.level_for("x"), LevelFilter::Warn);
    }

    #[test]
    fn cubecl_launch_failures_are_recognized() {
        let check = |level, target, text: &str| {
            is_device_failure(
                &Record::builder()
                    .level(level)
                    .target(target)
                    .args(format_args!("{text}"))
                    .build(),
            )
        };
        let server = "cubecl_runtime::logging::server";
        assert!(check(Level::Warn, server, "A launch error happened"));
        assert!(check(
            Level::Warn,
            "cubecl_runtime::tune::schedule",
            "Autotune measured no candidate for key K"
        ));
        assert!(!check(Level::Info, server, "A launch error happened"));
        assert!(!check(
            Level::Warn,
            "burn_cce::gemm",
            "A launch error happened"
        ));
        assert!(!check(Level::Warn, server, "a slow kernel"));
    }
}

//! Rank 0's console: the log lines (written so that a failed write never
//! stops the run) and the progress bar on a terminal's stderr, hidden while
//! a line is written. Every other rank writes nothing. It never decides
//! what to log or when.

use std::cell::Cell;
use std::io::{IsTerminal, Write};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// Where the loop's lines go: `log` on rank 0 (with a progress bar when
/// stderr is a terminal), nowhere on the other ranks.
pub(super) struct Console {
    master: bool,
    guard: LogGuard,
    bar: Option<ProgressBar>,
}

impl Console {
    /// The console of a rank; `master` for the rank that logs.
    pub(super) fn new(master: bool) -> Console {
        Console {
            master,
            guard: LogGuard::default(),
            bar: None,
        }
    }

    /// Shows a progress bar of `steps` steps at `at` (rank 0, on a terminal).
    pub(super) fn start_progress(&mut self, at: u64, steps: u64) {
        if !self.master || !std::io::stderr().is_terminal() {
            return;
        }
        let bar = ProgressBar::new(steps);
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:40} {pos}/{len} steps, {elapsed} elapsed, eta {eta} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_position(at);
        bar.enable_steady_tick(Duration::from_millis(200));
        self.bar = Some(bar);
    }

    /// Writes `line` to `log` (rank 0 only), hiding the progress bar meanwhile.
    pub(super) fn line(&self, log: &mut dyn Write, line: String) {
        if !self.master {
            return;
        }
        match &self.bar {
            Some(bar) => bar.suspend(|| self.guard.write(log, &line)),
            None => self.guard.write(log, &line),
        }
    }

    /// Moves the progress bar to `done` steps.
    pub(super) fn progress(&self, done: u64) {
        if let Some(bar) = &self.bar {
            bar.set_position(done);
        }
    }

    /// Shows `message` beside the progress bar.
    pub(super) fn note(&self, message: String) {
        if let Some(bar) = &self.bar {
            bar.set_message(message);
        }
    }

    /// Clears the progress bar away, for the summary.
    pub(super) fn finish_progress(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }

    /// Says on stderr how many lines were lost, if any: the log is what
    /// failed, so this goes where the warnings went.
    pub(super) fn report_lost_lines(&self) {
        if self.guard.failures() > 0 {
            let _ = writeln!(
                std::io::stderr(),
                "cohort train: {} log line(s) could not be written",
                self.guard.failures()
            );
        }
    }
}

/// Writes log lines without ever failing the run: a failed write (a full
/// disk, a closed pipe) is reported on stderr (the first one, then every
/// 100th) and counted.
#[derive(Debug, Default)]
pub(super) struct LogGuard {
    failures: Cell<u64>,
}

impl LogGuard {
    /// Writes `line` and a newline to `log`.
    pub(super) fn write(&self, log: &mut dyn Write, line: &str) {
        if let Err(e) = writeln!(log, "{line}") {
            let n = self.failures.get() + 1;
            self.failures.set(n);
            if n == 1 || n.is_multiple_of(100) {
                // stderr may be gone too; there is nowhere left to report that.
                let _ = writeln!(
                    std::io::stderr(),
                    "cohort train: writing the log failed ({e}; {n} line(s) lost so far); \
                     training continues"
                );
            }
        }
    }

    /// Lines lost so far.
    pub(super) fn failures(&self) -> u64 {
        self.failures.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_that_cannot_be_written_is_counted_not_fatal() {
        let guard = LogGuard::default();
        let mut full = match std::fs::OpenOptions::new().write(true).open("/dev/full") {
            Ok(f) => f,
            Err(e) => {
                eprintln!("skipping: no /dev/full ({e})");
                return;
            }
        };
        guard.write(&mut full, "lost");
        guard.write(&mut full, "lost too");
        assert_eq!(guard.failures(), 2);
        let mut ok = Vec::new();
        guard.write(&mut ok, "kept");
        assert_eq!(ok, b"kept\n");
        assert_eq!(guard.failures(), 2);
    }
}

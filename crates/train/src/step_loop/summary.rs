//! The end of a run: the job's throughput after the untimed first steps
//! ([`Throughput`]), and the summary lines rank 0 logs last. It never runs
//! a step.

use std::io::Write;
use std::time::Instant;

use cohort_comm::{ProcessGroup, ReduceOp};

use super::console::Console;
use super::parallel_strategy::{Outcome, ParallelStrategy};
use crate::config::TrainConfig;
use crate::error::TrainError;

/// The tokens trained on after the first `untimed` steps (allocation and
/// warm-up), and since when.
pub(super) struct Throughput {
    untimed: u64,
    /// This rank's share of the tokens since timing began.
    tokens: f64,
    since: Option<Instant>,
}

impl Throughput {
    pub(super) fn new(untimed: u64) -> Throughput {
        Throughput {
            untimed,
            tokens: 0.0,
            since: None,
        }
    }

    /// Counts a step of `tokens` (this rank's share), the `steps_run`th of
    /// this process; timing begins after the untimed ones.
    pub(super) fn add_step(&mut self, tokens: f64, steps_run: u64) {
        if self.since.is_some() {
            self.tokens += tokens;
        }
        if self.since.is_none() && steps_run >= self.untimed {
            self.since = Some(Instant::now());
        }
    }

    /// The job's tokens per second since timing began (0 when no step was
    /// timed), over `group`'s ranks. Collective.
    pub(super) fn tokens_per_s(
        &self,
        group: &ProcessGroup,
        steps_run: u64,
    ) -> Result<f64, TrainError> {
        let mut tokens = [self.tokens];
        group
            .all_reduce(&mut tokens, ReduceOp::Sum)
            .map_err(TrainError::comm("token count all_reduce"))?;
        let Some(t0) = self.since else {
            return Ok(0.0);
        };
        let secs = t0.elapsed().as_secs_f64();
        if steps_run > self.untimed && secs > 0.0 {
            return Ok(tokens[0] / secs);
        }
        Ok(0.0)
    }
}

/// What the loop knows at the end beyond the outcome.
pub(super) struct Ends {
    /// Updates skipped for a non-finite loss or gradient.
    pub skipped: u64,
    /// The straggler over the last steps, as a line, if one is named.
    pub straggler: Option<String>,
}

/// Logs the run's summary: the last losses against the floor and the
/// throughput, the time per phase, where the checkpoints are, the
/// strategy's own lines, the straggler and the skipped updates.
pub(super) fn log_summary(
    cfg: &TrainConfig,
    outcome: &Outcome,
    strategy: &dyn ParallelStrategy,
    ends: &Ends,
    console: &Console,
    log: &mut dyn Write,
) {
    let last = |v: &[(u64, f32)]| {
        v.last()
            .map(|x| format!("{:.4}", x.1))
            .unwrap_or("-".into())
    };
    let floor = (outcome.loss_floor)
        .map(|f| format!("{f:.4}"))
        .unwrap_or("unknown".into());
    let line = format!(
        "done: {} steps; train loss {}, val loss {}, floor {floor}; {:.0} tokens/s on {}",
        outcome.final_step,
        last(&outcome.train_losses),
        last(&outcome.val_losses),
        outcome.tokens_per_s,
        strategy.who(),
    );
    console.line(log, line);
    let n = outcome.steps_run.max(1);
    let line = format!(
        "time per step (rank 0): {} | {}",
        outcome.phases.per_step(n),
        outcome.phases.shares()
    );
    console.line(log, line);
    if let Some(out) = &cfg.out {
        console.line(log, format!("checkpoint: {}", out.display()));
    }
    for line in strategy.summary() {
        console.line(log, line);
    }
    if let Some(line) = &ends.straggler {
        console.line(log, line.clone());
    }
    if ends.skipped > 0 {
        let line = format!(
            "skipped {} update(s) for a non-finite loss or gradient",
            ends.skipped
        );
        console.line(log, line);
    }
}

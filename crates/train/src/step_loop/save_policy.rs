//! When the loop saves and what a failed save costs: checkpoints that
//! cannot be written are found before the first step; a save is due every
//! `save_interval` steps and at the end; a failed save is logged and
//! training goes on, unless it was the final checkpoint or
//! `max_failed_saves` failed in a row. Rank 0 writes the checkpoints, so
//! its verdict is every rank's. It never writes a checkpoint itself: the
//! strategy does.

use std::io::Write;

use cohort_comm::ProcessGroup;

use super::console::Console;
use super::parallel_strategy::ParallelStrategy;
use crate::checkpoint;
use crate::config::TrainConfig;
use crate::error::TrainError;

/// The saves of a run so far.
pub(super) struct SavePolicy {
    /// Saves that failed since the last one that did not.
    failed_in_a_row: u32,
}

impl SavePolicy {
    /// Checks, before the first step, that rank 0 can write checkpoints to
    /// `cfg.out` (checkpoints that cannot be written would lose the run's
    /// work). Collective.
    pub(super) fn before_first_step(
        cfg: &TrainConfig,
        group: &ProcessGroup,
    ) -> Result<SavePolicy, TrainError> {
        if let Some(out) = &cfg.out {
            let verdict = if group.rank() == 0 {
                checkpoint::check_writable(out)
            } else {
                Ok(())
            };
            agree_on_rank_0(group, verdict, || {
                format!("rank 0 cannot write checkpoints to {}", out.display())
            })?;
        }
        Ok(SavePolicy { failed_in_a_row: 0 })
    }

    /// Saves after step `done` when one is due (or `last`: the run stops
    /// there, on a signal), logging what the save reports; fails the run
    /// when the policy says the loss is too great. Collective.
    pub(super) fn save_if_due(
        &mut self,
        cfg: &TrainConfig,
        done: u64,
        last: bool,
        strategy: &mut dyn ParallelStrategy,
        console: &Console,
        log: &mut dyn Write,
    ) -> Result<(), TrainError> {
        let due = cfg.save_interval > 0 && done.is_multiple_of(cfg.save_interval);
        let last = last || done == cfg.steps;
        let (true, Some(out)) = (due || last, &cfg.out) else {
            return Ok(());
        };
        let report = strategy.save(out, done)?;
        for line in report.lines {
            console.line(log, format!("[step {done} / {}] {line}", cfg.steps));
        }
        let saved = agree_on_rank_0(strategy.group(), report.failed.map_or(Ok(()), Err), || {
            format!("rank 0 could not save the checkpoint of step {done}")
        });
        let why = match saved {
            Ok(()) => {
                self.failed_in_a_row = 0;
                return Ok(());
            }
            Err(TrainError::CheckpointLost(why)) => why,
            Err(e) => return Err(e),
        };
        self.failed_in_a_row += 1;
        let (failed, limit) = (self.failed_in_a_row, cfg.max_failed_saves);
        if last {
            return Err(TrainError::CheckpointLost(format!(
                "{why}; it was the final checkpoint, so the run fails"
            )));
        }
        if limit > 0 && failed >= limit {
            return Err(TrainError::CheckpointLost(format!(
                "{why}; {failed} checkpoints in a row failed (max_failed_saves = {limit}), so \
                 the run stops"
            )));
        }
        let line = format!(
            "[step {done} / {}] {why}; training continues ({failed} failed in a row, the run \
             stops at {limit})",
            cfg.steps
        );
        console.line(log, line);
        Ok(())
    }
}

/// Makes rank 0's `verdict` every rank's: an error on rank 0 fails every
/// rank, with rank 0's reason there and `elsewhere()` on the others.
/// Collective.
fn agree_on_rank_0(
    group: &ProcessGroup,
    verdict: Result<(), String>,
    elsewhere: impl FnOnce() -> String,
) -> Result<(), TrainError> {
    let mut failed = [i32::from(verdict.is_err())];
    group
        .broadcast(&mut failed, 0)
        .map_err(TrainError::comm("checkpoint check broadcast"))?;
    match (failed[0], verdict) {
        (0, _) => Ok(()),
        (_, Err(why)) => Err(TrainError::CheckpointLost(why)),
        (_, Ok(())) => Err(TrainError::CheckpointLost(elsewhere())),
    }
}

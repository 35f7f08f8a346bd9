//! When the loop saves and what a failed save costs: checkpoints that
//! cannot be written are found before the first step; a save is due every
//! `save_interval` steps and at the end; a failed save is logged and
//! training goes on, unless it was the final checkpoint or
//! `max_failed_saves` failed in a row. Rank 0 writes the checkpoints, so
//! its verdict is every rank's.
//!
//! A periodic save may go to the writer thread (`--save-mode background`,
//! see `checkpoint::Saver`): training goes on, and at each step boundary
//! until it is done rank 0 says whether it is (one broadcast a step while a
//! save is in flight), so that its failure costs what a failed save on the
//! training thread costs, on every rank at the same step. The next save, the
//! final one and a signal's wait for it first; the final and the signal's
//! are written on the training thread, so the run never exits before they
//! are committed. It never writes a checkpoint itself: the strategy does.

use std::io::Write;

use cohort_comm::ProcessGroup;

use super::console::Console;
use super::parallel_strategy::ParallelStrategy;
use crate::checkpoint::{self, SaveReport, Saver};
use crate::config::TrainConfig;
use crate::error::TrainError;

/// The saves of a run so far.
pub(super) struct SavePolicy {
    /// Saves that failed since the last one that did not.
    failed_in_a_row: u32,
    /// Writes the whole-model checkpoints, maybe on its writer thread.
    saver: Saver,
    /// The step of the save the writer thread is writing, as every rank knows it.
    in_flight: Option<u64>,
}

/// What rank 0 says of a save, made every rank's.
#[derive(Debug, PartialEq)]
enum Verdict {
    Saved,
    /// Rank 0's reason there, a line naming rank 0 on the others.
    Failed(String),
    /// On the writer thread: the verdict comes at a later step boundary.
    Writing,
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
        Ok(SavePolicy {
            failed_in_a_row: 0,
            saver: Saver::new(cfg.save_mode),
            in_flight: None,
        })
    }

    /// Saves after step `done` when one is due (or `last`: the run stops
    /// there, on a signal), logging what the save reports; first learns
    /// whether the save in flight is done (waiting for it when another is
    /// due). Fails the run when the policy says the loss is too great.
    /// Collective.
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
        let wanted = (due || last) && cfg.out.is_some();
        if let Some(step) = self.in_flight {
            self.collect(cfg, step, wanted, strategy.group(), console, log)?;
        }
        let (true, Some(out)) = (wanted, &cfg.out) else {
            return Ok(());
        };
        self.saver.allow_background(!last);
        let report = strategy.save(out, done, &mut self.saver)?;
        match agree(strategy.group(), report, done, cfg, console, log)? {
            Verdict::Writing => {
                self.in_flight = Some(done);
                Ok(())
            }
            verdict => self.judge(cfg, done, verdict, last, console, log),
        }
    }

    /// Learns from rank 0 whether the background save of `step` is done (`wait`: waits
    /// for it), and judges it when it is. Collective.
    fn collect(
        &mut self,
        cfg: &TrainConfig,
        step: u64,
        wait: bool,
        group: &ProcessGroup,
        console: &Console,
        log: &mut dyn Write,
    ) -> Result<(), TrainError> {
        let report = match self.saver.finished(wait) {
            Some((_, report)) => report,
            None => SaveReport {
                pending: true,
                ..SaveReport::default()
            },
        };
        let verdict = agree(group, report, step, cfg, console, log)?;
        if verdict == Verdict::Writing {
            return Ok(());
        }
        self.in_flight = None;
        // A background save is never the final one: the final one follows it.
        self.judge(cfg, step, verdict, false, console, log)
    }

    /// What the save of `step` costs the run: nothing when saved; a failure is logged
    /// and training goes on, unless it was the final checkpoint (`last`) or
    /// `max_failed_saves` failed in a row.
    fn judge(
        &mut self,
        cfg: &TrainConfig,
        step: u64,
        verdict: Verdict,
        last: bool,
        console: &Console,
        log: &mut dyn Write,
    ) -> Result<(), TrainError> {
        let Verdict::Failed(why) = verdict else {
            self.failed_in_a_row = 0;
            return Ok(());
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
            "[step {step} / {}] {why}; training continues ({failed} failed in a row, the run \
             stops at {limit})",
            cfg.steps
        );
        console.line(log, line);
        Ok(())
    }
}

/// Logs rank 0's `report` of the save of `step` and makes what it says every rank's.
/// Collective.
fn agree(
    group: &ProcessGroup,
    report: SaveReport,
    step: u64,
    cfg: &TrainConfig,
    console: &Console,
    log: &mut dyn Write,
) -> Result<Verdict, TrainError> {
    for line in report.lines {
        console.line(log, format!("[step {step} / {}] {line}", cfg.steps));
    }
    let mut code = [match (&report.failed, report.pending) {
        (Some(_), _) => 1,
        (None, true) => 2,
        (None, false) => 0,
    }];
    group
        .broadcast(&mut code, 0)
        .map_err(TrainError::comm("checkpoint verdict broadcast"))?;
    Ok(match (code[0], report.failed) {
        (0, _) => Verdict::Saved,
        (2, _) => Verdict::Writing,
        (_, Some(why)) => Verdict::Failed(why),
        (_, None) => Verdict::Failed(format!(
            "rank 0 could not save the checkpoint of step {step}"
        )),
    })
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

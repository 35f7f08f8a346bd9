//! Rank 0's run log (TensorBoard events and `metrics.jsonl`, see
//! `run_log`) as the loop keeps it: opened when the run has a log
//! directory, written at each log or evaluation step, and dropped with a
//! warning when a write fails. A run log never stops training.

use std::io::Write;
use std::path::Path;

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::run_log::{RunLog, TrainFigures};

/// The run log, if this rank keeps one and it still works.
pub(super) struct Metrics(Option<RunLog>);

impl Metrics {
    /// Opens the run log for a run starting after step `start`, on rank 0
    /// (`master`) when the config names a log directory.
    pub(super) fn open(cfg: &TrainConfig, master: bool, start: u64) -> Result<Metrics, TrainError> {
        let (true, Some(dir)) = (master, cfg.log_dir()) else {
            return Ok(Metrics(None));
        };
        let restart = crate::elastic::restart_count_from_env()?;
        let log = RunLog::open(&dir, start, restart).map_err(|e| TrainError::RunLog(e.0))?;
        Ok(Metrics(Some(log)))
    }

    /// Where the run log is written, if anywhere.
    pub(super) fn dir(&self) -> Option<&Path> {
        self.0.as_ref().map(RunLog::dir)
    }

    /// Records step `done`'s figures and validation loss, if it has any.
    pub(super) fn record(
        &mut self,
        done: u64,
        figures: Option<&TrainFigures>,
        val_loss: Option<f32>,
        floor: Option<f64>,
    ) {
        let Some(log) = &mut self.0 else {
            return;
        };
        if figures.is_none() && val_loss.is_none() {
            return;
        }
        if let Err(e) = log.step(done, figures, val_loss, floor) {
            // Like the log lines, the run log never stops training.
            let _ = writeln!(
                std::io::stderr(),
                "cohort train: writing the run log failed ({}); training continues without it",
                e.0
            );
            self.0 = None;
        }
    }
}

//! Evaluation on the loop's interval: every `eval_interval` steps and at
//! the end, the strategy's validation loss, logged beside the data set's
//! loss floor. It never evaluates itself: the strategy does.

use std::io::Write;

use super::console::Console;
use super::parallel_strategy::{Outcome, ParallelStrategy};
use crate::config::TrainConfig;
use crate::error::TrainError;

/// The validation loss after step `done` when an evaluation is due (and
/// then logged and kept in `outcome`), else `None`. Collective.
pub(super) fn evaluate_if_due(
    cfg: &TrainConfig,
    done: u64,
    strategy: &mut dyn ParallelStrategy,
    outcome: &mut Outcome,
    console: &Console,
    log: &mut dyn Write,
) -> Result<Option<f32>, TrainError> {
    let due = cfg.eval_interval > 0 && done.is_multiple_of(cfg.eval_interval);
    if !due && done != cfg.steps {
        return Ok(None);
    }
    let val = strategy.evaluate()?;
    outcome.val_losses.push((done, val));
    console.note(format!("val loss {val:.4}"));
    let floor = (outcome.loss_floor)
        .map(|f| format!(" (floor {f:.4})"))
        .unwrap_or_default();
    let line = format!("[step {done} / {}] val loss = {val:.4}{floor}", cfg.steps);
    console.line(log, line);
    Ok(Some(val))
}

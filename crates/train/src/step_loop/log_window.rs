//! The log window: what each rank adds up between two log lines (loss,
//! tokens, gradient norm, skips, time per phase), and its reduction over
//! the ranks into the figures of one log line ([`WindowTotals`]) and the run
//! log ([`TrainFigures`]). It never decides when to log, and writes nothing
//! itself.

use std::time::Instant;

use cohort_comm::ReduceOp;

use super::parallel_strategy::{ParallelStrategy, StepGradients};
use crate::error::TrainError;
use crate::phases::{Phase, Phases, PHASES};
use crate::run_log::TrainFigures;

/// Milliseconds per step of each phase on one rank, in the order of [`PHASES`].
type PhaseMs = [f64; PHASES.len()];

/// One rank's figures of one log window.
pub(super) struct Window {
    started: Instant,
    steps: u64,
    /// Updates applied (a skipped step has no loss to average).
    updates: u64,
    /// Sum over applied updates of this rank's loss share.
    loss: f64,
    /// This rank's share of the tokens trained on.
    tokens: f64,
    /// Sum over the window's steps of the gradient norm before clipping.
    grad_norm: f64,
    /// This rank's time per phase in the window.
    pub phases: Phases,
}

/// A window reduced over the ranks: the figures of its log line.
pub(super) struct WindowTotals {
    /// The job's mean loss over the window's applied updates (NaN: none).
    pub loss: f32,
    /// The job's tokens per second over the window.
    pub tokens_per_s: f64,
    /// Mean gradient norm over the window's steps, before clipping.
    pub grad_norm: f32,
    /// Updates skipped in the window.
    pub skipped: u64,
    /// Each rank's milliseconds per step in each phase (rank 0's first);
    /// empty unless asked for.
    pub rank_ms: Vec<PhaseMs>,
    /// The straggler over the last steps, if one is named (`straggler`).
    pub straggler: Option<super::straggler::Straggler>,
}

impl WindowTotals {
    /// The run log's figures of the window, at learning rate `lr`.
    pub(super) fn figures(&self, lr: f64) -> TrainFigures {
        TrainFigures {
            loss: self.loss,
            lr,
            grad_norm: self.grad_norm,
            skipped: self.skipped,
            tokens_per_s: self.tokens_per_s,
            rank_ms: self.rank_ms.clone(),
            straggler: (self.straggler.as_ref()).map(|s| (s.rank, s.slower())),
        }
    }
}

impl Window {
    pub(super) fn new() -> Window {
        Window {
            started: Instant::now(),
            steps: 0,
            updates: 0,
            loss: 0.0,
            tokens: 0.0,
            grad_norm: 0.0,
            phases: Phases::default(),
        }
    }

    /// Adds a step whose gradients were `grads`, of norm `norm` before
    /// clipping; `applied` unless its update was skipped.
    pub(super) fn add_step(&mut self, grads: &StepGradients, norm: f32, applied: bool) {
        self.grad_norm += norm as f64;
        if applied {
            self.loss += grads.loss_share;
            self.updates += 1;
        }
        self.steps += 1;
        self.tokens += grads.tokens;
    }

    /// The steps of the window.
    pub(super) fn steps(&self) -> u64 {
        self.steps
    }

    /// This rank's time per phase, per step of the window.
    pub(super) fn per_step(&self) -> crate::phases::PerStep<'_> {
        self.phases.per_step(self.steps)
    }

    /// Sums the window over the ranks of `strategy`'s group: the loss
    /// shares and tokens all-reduced, and, with `rank_ms`, every rank's time
    /// per phase gathered (so that a slow rank stands out in the run log).
    /// Returns the totals and the strategy's note for the log line (its own
    /// collective, run in between). The time spent here is charged to
    /// [`Phase::Comm`]. Collective.
    pub(super) fn reduce(
        &mut self,
        strategy: &mut dyn ParallelStrategy,
        rank_ms: bool,
    ) -> Result<(WindowTotals, String), TrainError> {
        let t_comm = Instant::now();
        // A window whose updates were all skipped has no loss: NaN.
        let mut sums = [self.loss / self.updates as f64, self.tokens];
        (strategy.group())
            .all_reduce(&mut sums, ReduceOp::Sum)
            .map_err(TrainError::comm("loss and token count all_reduce"))?;
        let note = strategy.log_note()?;
        let group = strategy.group();
        let mut all: Vec<PhaseMs> = Vec::new();
        if rank_ms {
            let mine = self.phases.ms_per_step(self.steps);
            let mut flat = vec![0f64; PHASES.len() * group.size()];
            group
                .all_gather(&mine, &mut flat)
                .map_err(TrainError::comm("phase time all_gather"))?;
            all = flat
                .chunks_exact(PHASES.len())
                .map(|ms| ms.try_into().expect("chunks of one rank's phases"))
                .collect();
        }
        self.phases.add(Phase::Comm, t_comm.elapsed());
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        let totals = WindowTotals {
            loss: sums[0] as f32,
            tokens_per_s: sums[1] / secs,
            grad_norm: (self.grad_norm / self.steps.max(1) as f64) as f32,
            skipped: self.steps - self.updates,
            rank_ms: all,
            straggler: None,
        };
        Ok((totals, note))
    }
}

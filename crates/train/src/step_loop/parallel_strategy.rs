//! What a way of spreading training over ranks supplies to the one
//! training loop ([`ParallelStrategy`]), what it hands back each step
//! ([`StepGradients`]) and at the start ([`Start`]), and what a finished
//! run reports ([`Outcome`]). This module holds only these contracts: it
//! never runs a step, and knows no particular strategy.

use std::path::Path;

use cohort_comm::ProcessGroup;
use cohort_engine::{Backend, ViewMut};

use crate::checkpoint::{SaveReport, Saver};
use crate::error::TrainError;
use crate::phases::Phases;

/// What a strategy computed for one step.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StepGradients {
    /// This rank's share of the step's mean loss: summed over the group's
    /// ranks, the job's mean loss (a DDP rank: its loss / world; a pipeline
    /// stage without the loss: 0).
    pub loss_share: f64,
    /// Whether every loss this rank saw was finite.
    pub loss_finite: bool,
    /// This rank's share of the tokens the step trained on, padding
    /// excluded: summed over the group's ranks, the job's.
    pub tokens: f64,
    /// The gradients are the sum of this many micro-batches' mean-loss
    /// gradients; the guard divides by it.
    pub micro_batches: usize,
}

impl StepGradients {
    /// A data-parallel rank's step: `loss_sum` over its `accum` micro-batches and `tokens`, of
    /// a job of `world` such ranks.
    pub(crate) fn data_parallel(loss_sum: f32, tokens: u64, accum: usize, world: usize) -> Self {
        StepGradients {
            loss_share: loss_sum as f64 / accum as f64 / world as f64,
            loss_finite: loss_sum.is_finite(),
            tokens: tokens as f64,
            micro_batches: accum,
        }
    }
}

/// Where a run starts, as a strategy built it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Start {
    /// The first step to run: 0, or where a resumed checkpoint left off.
    pub step: u64,
    /// Lines describing the run (resumed checkpoint, `data_lines`, model,
    /// batch), logged once before the first step.
    pub header: Vec<String>,
    /// The data set's best possible loss, when known.
    pub loss_floor: Option<f64>,
}

/// What a way of spreading training over ranks supplies to [`run`].
pub(crate) trait ParallelStrategy {
    /// The group the loop's own collectives run in (the skip decision, the
    /// logged loss and token counts); its rank 0 writes the log.
    fn group(&self) -> &ProcessGroup;

    /// Where the run starts and what to log before the first step.
    fn start(&self) -> Start;

    /// Computes step `step`'s gradients and synchronises them as this
    /// strategy needs (all-reduced, summed between pipeline stages, received
    /// from workers, ...), timing its phases into `phases`. Collective.
    fn gradients(&mut self, step: u64, phases: &mut Phases) -> Result<StepGradients, TrainError>;

    /// This rank's gradient buffer, which the guard scales, checks and clips
    /// in place before [`ParallelStrategy::apply`] reads it.
    fn grads_mut(&mut self) -> &mut [f32];

    /// This rank's gradient where it lives in a device's memory, with the backend whose
    /// kernels scale, check and clip it; `None` (the default): it is [`grads_mut`]'s, on the
    /// host.
    ///
    /// [`grads_mut`]: ParallelStrategy::grads_mut
    fn device_grads(&mut self) -> Option<(&dyn Backend, ViewMut<'_, f32>)> {
        None
    }

    /// The norm to clip by, given this rank's norm of its (scaled) gradient
    /// buffer. DDP's ranks hold identical whole gradients, so their own
    /// norm is the global one; a pipeline stage or a shard combines theirs
    /// with the other ranks'. Collective, called only when clipping by norm.
    fn global_norm(&mut self, local: f32) -> Result<f32, TrainError> {
        Ok(local)
    }

    /// Applies the update at learning rate `lr` (`None`: the step is
    /// skipped), then clears the gradients and does whatever follows an
    /// update (answering workers with the new parameters, ...).
    fn apply(&mut self, step: u64, lr: Option<f64>) -> Result<(), TrainError>;

    /// Extra figures for the step's log line (`" | idle 12%"`), known on
    /// rank 0; collective, called on every rank at each log step.
    fn log_note(&mut self) -> Result<String, TrainError> {
        Ok(String::new())
    }

    /// The mean validation loss, known to every rank. Collective.
    fn evaluate(&mut self) -> Result<f32, TrainError>;

    /// Saves a checkpoint of the state after `step` steps under `out` (rank
    /// 0 of the group writes it), reporting what to log and, on rank 0,
    /// whether it failed. A whole model goes through `saver`, which may write it from a
    /// copy on its writer thread (the report is then `pending`). Collective.
    fn save(&mut self, out: &Path, step: u64, saver: &mut Saver) -> Result<SaveReport, TrainError>;

    /// The whole model's parameters at the end. Collective.
    fn final_params(&mut self) -> Result<Vec<f32>, TrainError>;

    /// Who trained, for the summary line ("2 rank(s)").
    fn who(&self) -> String;

    /// Lines for the end of the log, after the summary.
    fn summary(&self) -> Vec<String> {
        Vec::new()
    }
}

/// What a finished run reports (on every rank; losses are averaged over ranks).
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Optimizer steps run in this process (not counting resumed ones).
    pub steps_run: u64,
    /// The step the run ended at.
    pub final_step: u64,
    /// Mean training loss over ranks of each logged step, as `(step, loss)`.
    pub train_losses: Vec<(u64, f32)>,
    /// Validation losses, as `(step, loss)`.
    pub val_losses: Vec<(u64, f32)>,
    /// The data set's loss floor, if known.
    pub loss_floor: Option<f64>,
    /// Tokens per second over the whole job (all ranks), excluding the first step.
    pub tokens_per_s: f64,
    /// Time per phase on this rank, summed over the run.
    pub phases: Phases,
    /// The parameters at the end (identical on every rank).
    pub params: Vec<f32>,
}

impl Outcome {
    /// A run at `step` with nothing run yet, on data whose loss floor is
    /// `loss_floor`.
    pub(crate) fn starting_at(step: u64, loss_floor: Option<f64>) -> Outcome {
        Outcome {
            steps_run: 0,
            final_step: step,
            train_losses: Vec::new(),
            val_losses: Vec::new(),
            loss_floor,
            tokens_per_s: 0.0,
            phases: Phases::default(),
            params: Vec::new(),
        }
    }
}

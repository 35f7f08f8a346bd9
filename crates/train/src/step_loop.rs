//! The one training loop. Every way of spreading training over ranks (data
//! parallel, pipeline, parameter server; sharded data parallel next) runs
//! its steps here and supplies only what differs, through [`Strategy`]:
//! how a step's gradients are computed and synchronised, how the norm to
//! clip by is combined across ranks, how the update is applied (and what
//! follows it), how to evaluate and how to save.
//!
//! Each step, the loop: asks the strategy for the step's gradients; hands
//! them to the [`StepGuard`] (scale by the micro-batch count, clamp, skip
//! on a NaN/Inf anywhere, clip by the global norm); applies or skips the
//! update at the schedule's learning rate; then logs, evaluates and saves
//! on the configured intervals. Rank 0 of the strategy's group writes the
//! log, and the run log (TensorBoard and `metrics.jsonl`, see `run_log`)
//! when there is a log directory; a log that cannot be written never stops
//! the run.
//!
//! This module never touches a model, a socket or a data set itself.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_data::{Batch, Dataset};
use cohort_engine::optim::LrSchedule;
use cohort_gpt::{Labels, GPT};

use crate::batches::TrainBatches;
use crate::checkpoint::{self, SaveReport};
use crate::config::TrainConfig;
use crate::fault::{clip_to_norm, LogGuard, NanInjection, StepGuard};
use crate::phases::{Phase, Phases};
use crate::run_log::{RunLog, TrainFigures, METRICS_FILE};
use crate::train::Outcome;
use crate::TrainError;

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
    /// Lines describing the run (resumed checkpoint, [`data_lines`], model,
    /// batch), logged once before the first step.
    pub header: Vec<String>,
    /// The data set's best possible loss, when known.
    pub loss_floor: Option<f64>,
}

/// What a way of spreading training over ranks supplies to [`run`].
pub(crate) trait Strategy {
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
    /// in place before [`Strategy::apply`] reads it.
    fn grads_mut(&mut self) -> &mut [f32];

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
    /// whether it failed. Collective.
    fn save(&mut self, out: &Path, step: u64) -> Result<SaveReport, TrainError>;

    /// The whole model's parameters at the end. Collective.
    fn final_params(&mut self) -> Result<Vec<f32>, TrainError>;

    /// Who trained, for the summary line ("2 rank(s)").
    fn who(&self) -> String;

    /// Lines for the end of the log, after the summary.
    fn summary(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Trains `strategy` for `cfg.steps` steps; rank 0 of its group logs to
/// `log`. Throughput is measured after the first `untimed_steps` steps
/// (allocation and warm-up). Collective: every rank of the group calls it.
pub(crate) fn run(
    cfg: &TrainConfig,
    strategy: &mut dyn Strategy,
    log: &mut dyn Write,
    untimed_steps: u64,
) -> Result<Outcome, TrainError> {
    let master = strategy.group().rank() == 0;
    let log_guard = LogGuard::default();
    let mut say = |log: &mut dyn Write, line: String| {
        if master {
            log_guard.write(log, &line);
        }
    };
    let Start {
        step: start,
        header,
        loss_floor: floor,
    } = strategy.start();
    for line in header {
        say(log, line);
    }
    let schedule =
        LrSchedule::warmup_cosine(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.decay_steps())?;
    let inject = match cfg.inject_nan {
        Some(hook) => Some(hook),
        None => NanInjection::from_env()?,
    };
    let mut guard = StepGuard::new(
        cfg.clip_value,
        cfg.grad_clip,
        cfg.max_consecutive_skips,
        inject,
    );
    let bar = progress_bar(master, start, cfg.steps);
    // Checkpoints that cannot be written would lose the run's work: find out
    // before the first step, on rank 0, which writes them.
    if let Some(out) = &cfg.out {
        let verdict = if master {
            checkpoint::check_writable(out)
        } else {
            Ok(())
        };
        agree_on_rank_0(strategy.group(), verdict, || {
            format!("rank 0 cannot write checkpoints to {}", out.display())
        })?;
    }
    let mut failed_saves = 0u32;
    let mut run_log = match (master, cfg.log_dir()) {
        (true, Some(dir)) => {
            let restart = crate::elastic::restart_count_from_env()?;
            Some(RunLog::open(&dir, start, restart).map_err(|e| TrainError::RunLog(e.0))?)
        }
        _ => None,
    };
    if let Some(l) = &run_log {
        say(
            log,
            format!(
                "logs: {} (TensorBoard and {METRICS_FILE})",
                l.dir().display()
            ),
        );
    }
    let mut outcome = Outcome::starting_at(start, floor);
    let mut window = Window::new();
    // Tokens (the job's, after the untimed steps) and when timing began.
    let mut timed_tokens = 0f64;
    let mut timed_from: Option<Instant> = None;

    for step in start..cfg.steps {
        let lr = schedule.lr(step);
        let grads = strategy.gradients(step, &mut window.phases)?;
        let t_opt = Instant::now();
        let rank = strategy.group().rank();
        let stats = guard.scale(step, rank, strategy.grads_mut(), grads.micro_batches);
        let skip = guard.decide(strategy.group(), step, grads.loss_finite, stats)?;
        // The norm before clipping, for the logs and for clipping (a
        // collective for strategies whose ranks hold parts of the gradient).
        let norm = strategy.global_norm(stats.norm)?;
        window.grad_norm += norm as f64;
        let applied = skip.is_none();
        if applied && guard.clip_norm() > 0.0 {
            clip_to_norm(strategy.grads_mut(), norm, guard.clip_norm());
        }
        strategy.apply(step, applied.then_some(lr))?;
        if applied {
            window.loss += grads.loss_share;
            window.updates += 1;
        }
        window.phases.add(Phase::Optimizer, t_opt.elapsed());
        if let Some(skip) = skip {
            let line = format!("[step {} / {}] {skip}", step + 1, cfg.steps);
            print_line(&bar, &mut say, log, line);
        }
        window.steps += 1;
        window.tokens += grads.tokens;
        if timed_from.is_some() {
            timed_tokens += grads.tokens;
        }
        let done = step + 1;
        outcome.steps_run += 1;
        outcome.final_step = done;
        if timed_from.is_none() && outcome.steps_run >= untimed_steps {
            timed_from = Some(Instant::now());
        }

        // -- log, eval, save (every rank takes part in the collectives) ---
        let t_log = Instant::now();
        let mut figures = None;
        let mut val_loss = None;
        if done % cfg.log_interval == 0 || done == cfg.steps {
            let t_comm = Instant::now();
            // A window whose updates were all skipped has no loss: NaN.
            let mut sums = [window.loss / window.updates as f64, window.tokens];
            strategy
                .group()
                .all_reduce(&mut sums, ReduceOp::Sum)
                .map_err(TrainError::comm("loss and token count all_reduce"))?;
            let note = strategy.log_note()?;
            // Every rank's time per phase for the run log, so that a slow rank
            // stands out (every rank knows from the config whether there is one).
            let group = strategy.group();
            let mine = window.phases.ms_per_step(window.steps);
            let mut all = Vec::new();
            if cfg.log_dir().is_some() {
                all = vec![0f64; 6 * group.size()];
                group
                    .all_gather(&mine, &mut all)
                    .map_err(TrainError::comm("phase time all_gather"))?;
            }
            window.phases.add(Phase::Comm, t_comm.elapsed());
            let loss = sums[0] as f32;
            outcome.train_losses.push((done, loss));
            let secs = window.started.elapsed().as_secs_f64().max(1e-9);
            let line = format!(
                "[step {done} / {}] loss = {loss:.4} | lr {lr:.2e} | {:.0} tok/s | {}{note}",
                cfg.steps,
                sums[1] / secs,
                window.phases.per_step(window.steps),
            );
            print_line(&bar, &mut say, log, line);
            figures = Some(TrainFigures {
                loss,
                lr,
                grad_norm: (window.grad_norm / window.steps.max(1) as f64) as f32,
                skipped: window.steps - window.updates,
                tokens_per_s: sums[1] / secs,
                rank_ms: all
                    .chunks_exact(6)
                    .map(|c| c.try_into().expect("chunks of 6"))
                    .collect(),
            });
            outcome.phases.merge(&window.phases);
            window = Window::new();
        }
        if (cfg.eval_interval > 0 && done % cfg.eval_interval == 0) || done == cfg.steps {
            let val = strategy.evaluate()?;
            outcome.val_losses.push((done, val));
            val_loss = Some(val);
            if let Some(bar) = &bar {
                bar.set_message(format!("val loss {val:.4}"));
            }
            let floor = floor
                .map(|f| format!(" (floor {f:.4})"))
                .unwrap_or_default();
            let line = format!("[step {done} / {}] val loss = {val:.4}{floor}", cfg.steps);
            print_line(&bar, &mut say, log, line);
        }
        let save_now = cfg.save_interval > 0 && done % cfg.save_interval == 0;
        if let (true, Some(out)) = (save_now || done == cfg.steps, &cfg.out) {
            let report = strategy.save(out, done)?;
            for line in report.lines {
                let line = format!("[step {done} / {}] {line}", cfg.steps);
                print_line(&bar, &mut say, log, line);
            }
            let saved =
                agree_on_rank_0(strategy.group(), report.failed.map_or(Ok(()), Err), || {
                    format!("rank 0 could not save the checkpoint of step {done}")
                });
            match saved {
                Ok(()) => failed_saves = 0,
                Err(TrainError::CheckpointLost(why)) => {
                    failed_saves += 1;
                    let limit = cfg.max_failed_saves;
                    if done == cfg.steps {
                        return Err(TrainError::CheckpointLost(format!(
                            "{why}; it was the final checkpoint, so the run fails"
                        )));
                    }
                    if limit > 0 && failed_saves >= limit {
                        return Err(TrainError::CheckpointLost(format!(
                            "{why}; {failed_saves} checkpoints in a row failed \
                             (max_failed_saves = {limit}), so the run stops"
                        )));
                    }
                    let line = format!(
                        "[step {done} / {}] {why}; training continues ({failed_saves} failed in a \
                         row, the run stops at {limit})",
                        cfg.steps
                    );
                    print_line(&bar, &mut say, log, line);
                }
                Err(e) => return Err(e),
            }
        }
        if figures.is_some() || val_loss.is_some() {
            if let Some(l) = &mut run_log {
                if let Err(e) = l.step(done, figures.as_ref(), val_loss, floor) {
                    // Like the log lines, the run log never stops training.
                    let _ = writeln!(
                        std::io::stderr(),
                        "cohort train: writing the run log failed ({}); training continues \
                         without it",
                        e.0
                    );
                    run_log = None;
                }
            }
        }
        window.phases.add(Phase::Logging, t_log.elapsed());
        if let Some(bar) = &bar {
            bar.set_position(done);
        }
    }
    outcome.phases.merge(&window.phases);
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let mut tokens = [timed_tokens];
    strategy
        .group()
        .all_reduce(&mut tokens, ReduceOp::Sum)
        .map_err(TrainError::comm("token count all_reduce"))?;
    if let Some(t0) = timed_from {
        let secs = t0.elapsed().as_secs_f64();
        if outcome.steps_run > untimed_steps && secs > 0.0 {
            outcome.tokens_per_s = tokens[0] / secs;
        }
    }
    outcome.params = strategy.final_params()?;

    // -- summary ----------------------------------------------------------
    let last = |v: &[(u64, f32)]| {
        v.last()
            .map(|x| format!("{:.4}", x.1))
            .unwrap_or("-".into())
    };
    let floor = floor.map(|f| format!("{f:.4}")).unwrap_or("unknown".into());
    say(
        log,
        format!(
            "done: {} steps; train loss {}, val loss {}, floor {floor}; {:.0} tokens/s on {}",
            outcome.final_step,
            last(&outcome.train_losses),
            last(&outcome.val_losses),
            outcome.tokens_per_s,
            strategy.who(),
        ),
    );
    let n = outcome.steps_run.max(1);
    say(
        log,
        format!(
            "time per step (rank 0): {} | {}",
            outcome.phases.per_step(n),
            outcome.phases.shares()
        ),
    );
    if let Some(out) = &cfg.out {
        say(log, format!("checkpoint: {}", out.display()));
    }
    for line in strategy.summary() {
        say(log, line);
    }
    if guard.skipped() > 0 {
        say(
            log,
            format!(
                "skipped {} update(s) for a non-finite loss or gradient",
                guard.skipped()
            ),
        );
    }
    if log_guard.failures() > 0 {
        // The log is what failed: this line goes where the warnings went.
        let _ = writeln!(
            std::io::stderr(),
            "cohort train: {} log line(s) could not be written",
            log_guard.failures()
        );
    }
    Ok(outcome)
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

/// Figures of one log window.
struct Window {
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
    phases: Phases,
}

impl Window {
    fn new() -> Window {
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
}

/// The lines every strategy's header has about its data: what it is, and
/// its loss floor when known.
pub(crate) fn data_lines(data: &dyn Dataset) -> Vec<String> {
    let mut lines = vec![format!("data: {}", data.describe())];
    if let Some(floor) = data.loss_floor() {
        lines.push(format!(
            "loss floor (best possible): {floor:.4}; start ~ ln(vocab) = {:.4}",
            (data.vocab_size() as f64).ln()
        ));
    }
    lines
}

/// How a strategy runs one micro-batch: the forward with its labels, and
/// the backward after it. [`accumulate_with`] calls them in turn.
pub(crate) trait MicroBatches {
    /// The forward of `batch` with next-token targets: its mean loss.
    fn forward(&mut self, model: &mut GPT, batch: &Batch) -> Result<Option<f32>, TrainError>;

    /// The backward of the last forward, accumulating into the model's
    /// gradients; `last` for the step's last micro-batch. Times itself into
    /// `phases`.
    fn backward(
        &mut self,
        model: &mut GPT,
        last: bool,
        phases: &mut Phases,
    ) -> Result<(), TrainError>;
}

/// The plain forward with labels, as every replicated strategy runs it.
pub(crate) fn forward_batch(model: &mut GPT, batch: &Batch) -> Result<Option<f32>, TrainError> {
    Ok(model.forward(
        cohort_gpt::Forward::new(&batch.input_ids, batch.batch, batch.seq)
            .attention_mask(padding_mask(batch))
            .labels(Labels::Next(&batch.targets)),
    )?)
}

/// [`MicroBatches`] whose backwards are plain but the last.
struct SyncOnLast<'f> {
    last_backward: &'f mut dyn FnMut(&mut GPT, &mut Phases) -> Result<(), TrainError>,
}

impl MicroBatches for SyncOnLast<'_> {
    fn forward(&mut self, model: &mut GPT, batch: &Batch) -> Result<Option<f32>, TrainError> {
        forward_batch(model, batch)
    }

    fn backward(
        &mut self,
        model: &mut GPT,
        last: bool,
        phases: &mut Phases,
    ) -> Result<(), TrainError> {
        if last {
            return (self.last_backward)(model, phases);
        }
        phases.time(Phase::Backward, || {
            model.backward(cohort_gpt::Backward::new())
        })?;
        Ok(())
    }
}

/// Forward and backward over one step's `cfg.grad_accum` micro-batches,
/// gradients summing in the model; the last micro-batch's backward is
/// `last_backward` (where data parallelism synchronises: PyTorch's
/// `no_sync` for all the others). `replica` is this rank's index among the
/// ranks that read different data, which with the step picks the dropout
/// masks. Returns the summed loss and the real tokens (padding excluded).
pub(crate) fn accumulate(
    model: &mut GPT,
    batches: &mut TrainBatches,
    cfg: &TrainConfig,
    replica: usize,
    step: u64,
    phases: &mut Phases,
    last_backward: &mut dyn FnMut(&mut GPT, &mut Phases) -> Result<(), TrainError>,
) -> Result<(f32, u64), TrainError> {
    let passes = &mut SyncOnLast { last_backward };
    accumulate_with(model, batches, cfg, replica, step, phases, passes)
}

/// [`accumulate`] with each micro-batch's forward and backward run by
/// `passes` (a strategy that gathers parameters around each part, or
/// synchronises every micro-batch's gradients).
pub(crate) fn accumulate_with(
    model: &mut GPT,
    batches: &mut TrainBatches,
    cfg: &TrainConfig,
    replica: usize,
    step: u64,
    phases: &mut Phases,
    passes: &mut dyn MicroBatches,
) -> Result<(f32, u64), TrainError> {
    let (mut loss_sum, mut tokens) = (0f32, 0u64);
    for micro in 0..cfg.grad_accum {
        let batch = phases.time(Phase::Data, || batches.next_batch());
        tokens += batch.attention_mask.iter().filter(|&&m| m == 1).count() as u64;
        model.set_training(true);
        model.set_dropout_key(
            cfg.seed,
            replica as u64,
            step * cfg.grad_accum as u64 + micro as u64,
        );
        let loss = phases.time(Phase::Forward, || passes.forward(model, &batch))?;
        loss_sum += loss.unwrap_or(0.0);
        passes.backward(model, micro + 1 == cfg.grad_accum, phases)?;
    }
    Ok((loss_sum, tokens))
}

/// The attention mask of a batch with padding (None when every position is a
/// token, the common case, which spares the model the mask's bookkeeping).
pub(crate) fn padding_mask(batch: &Batch) -> Option<&[u8]> {
    batch
        .attention_mask
        .contains(&0)
        .then_some(&batch.attention_mask[..])
}

/// The loss of `model` on each of `val` ((place in the job's list, batch)), in eval mode.
pub(crate) fn batch_losses(
    val: &[(usize, Batch)],
    model: &mut GPT,
) -> Result<Vec<(usize, f32)>, TrainError> {
    batch_losses_with(val, model, &mut forward_batch)
}

/// A batch's forward with next-token targets: its mean loss.
pub(crate) type ForwardFn<'f> = dyn FnMut(&mut GPT, &Batch) -> Result<Option<f32>, TrainError> + 'f;

/// [`batch_losses`] with each batch's forward run by `forward` (a strategy
/// that gathers parameters around each part).
pub(crate) fn batch_losses_with(
    val: &[(usize, Batch)],
    model: &mut GPT,
    forward: &mut ForwardFn<'_>,
) -> Result<Vec<(usize, f32)>, TrainError> {
    model.set_training(false);
    let losses = val
        .iter()
        .map(|(k, batch)| Ok((*k, forward(model, batch)?.unwrap_or(0.0))))
        .collect::<Result<Vec<_>, TrainError>>();
    model.set_training(true);
    losses
}

/// The validation loss over the job's `total` batches, of which this rank computed `mine`
/// ((place in the list, loss)), known to every rank of `pg` (`None`: this process computed
/// them all); NaN for no batches. Each batch's loss lands in its own slot, summed with zeros
/// only (which is exact), and the slots are averaged in list order: the figure is the same
/// bits however the list was shared out among ranks. Collective over `pg`.
pub(crate) fn mean_val_loss(
    pg: Option<&ProcessGroup>,
    total: usize,
    mine: &[(usize, f32)],
) -> Result<f32, TrainError> {
    if total == 0 {
        return Ok(f32::NAN);
    }
    let mut slots = vec![0f32; total];
    for &(k, loss) in mine {
        slots[k] = loss;
    }
    if let Some(pg) = pg {
        pg.all_reduce(&mut slots, ReduceOp::Sum)
            .map_err(TrainError::comm("val loss all_reduce"))?;
    }
    let sum: f64 = slots.iter().map(|&l| l as f64).sum();
    Ok((sum / total as f64) as f32)
}

/// Writes a log line, hiding the progress bar (on stderr) meanwhile.
fn print_line(
    bar: &Option<indicatif::ProgressBar>,
    say: &mut dyn FnMut(&mut dyn Write, String),
    log: &mut dyn Write,
    line: String,
) {
    match bar {
        Some(bar) => bar.suspend(|| say(log, line)),
        None => say(log, line),
    }
}

fn progress_bar(master: bool, at: u64, steps: u64) -> Option<indicatif::ProgressBar> {
    if !master || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} steps, {elapsed} elapsed, eta {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_position(at);
    bar.enable_steady_tick(Duration::from_millis(200));
    Some(bar)
}

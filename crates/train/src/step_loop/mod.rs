//! The one training loop. Every way of spreading training over ranks (data
//! parallel with DDP or a ZeRO stage, pipeline, parameter server) runs its
//! steps here and supplies only what differs, through [`ParallelStrategy`]:
//! how a step's gradients are computed and synchronised, how the norm to
//! clip by is combined across ranks, how the update is applied (and what
//! follows it), how to evaluate and how to save.
//!
//! Each step, [`run`] (read it top to bottom, as nanoGPT's loop): asks the
//! strategy for the step's gradients; hands them to the [`StepGuard`]
//! (scale by the micro-batch count, clamp, skip on a NaN/Inf anywhere,
//! clip by the global norm); applies or skips the update at the schedule's
//! learning rate; then logs, evaluates and saves on the configured
//! intervals, or saves and stops when a signal asked (`stop_request`). The pieces beside it: the log window and its reduction over
//! the ranks (`log_window`), evaluation (`evaluation`), the save policy
//! (`save_policy`), the run log (`metrics`), the console with its progress
//! bar (`console`) and the summary (`summary`); `micro_batches` holds what
//! replicated strategies share inside a step. Rank 0 of the strategy's
//! group writes the log; a log that cannot be written never stops the run.
//!
//! This module never touches a model, a socket or a data set itself.

mod console;
mod evaluation;
mod log_window;
mod metrics;
mod micro_batches;
mod parallel_strategy;
mod save_policy;
mod straggler;
mod summary;

pub(crate) use micro_batches::{
    accumulate, batch_losses, batch_losses_with, mean_val_loss, padding_mask, MicroBatches,
    Unsynchronised,
};
pub use parallel_strategy::Outcome;
pub(crate) use parallel_strategy::{ParallelStrategy, Start, StepGradients};
pub(crate) use straggler::test_delay;

use std::io::Write;
use std::time::Instant;

use cohort_comm::flight;
use cohort_engine::optim::LrSchedule;

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::grad_guard::{clip_to_norm, clip_to_norm_on, NanInjection, StepGuard};
use crate::phases::Phase;
use crate::run_log::METRICS_FILE;
use crate::stop_request;
use console::Console;
use log_window::Window;
use metrics::Metrics;
use save_policy::SavePolicy;
use straggler::Stragglers;
use summary::Throughput;

/// Trains `strategy` for `cfg.steps` steps; rank 0 of its group logs to
/// `log`. Throughput is measured after the first `untimed_steps` steps
/// (allocation and warm-up). Collective: every rank of the group calls it.
pub(crate) fn run(
    cfg: &TrainConfig,
    strategy: &mut dyn ParallelStrategy,
    log: &mut dyn Write,
    untimed_steps: u64,
) -> Result<Outcome, TrainError> {
    let master = strategy.group().rank() == 0;
    let mut console = Console::new(master);
    let start = strategy.start();
    start
        .header
        .into_iter()
        .for_each(|line| console.line(log, line));
    if start.step > 0 && start.step >= cfg.steps {
        // Exit 0, as a Hugging Face Trainer resumed at max_steps does: a finished run is a
        // success, and an elastic launcher must not spend a restart on it.
        let line = format!(
            "nothing to do: checkpoint is at step {}, --steps {}",
            start.step, cfg.steps
        );
        console.line(log, line);
        let mut outcome = Outcome::starting_at(start.step, start.loss_floor);
        outcome.params = strategy.final_params()?;
        return Ok(outcome);
    }
    let schedule =
        LrSchedule::warmup_cosine(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.decay_steps())?;
    let inject = cfg
        .inject_nan
        .map_or_else(NanInjection::from_env, |n| Ok(Some(n)))?;
    let (clip_value, clip_norm) = (cfg.clip_value, cfg.grad_clip);
    let mut guard = StepGuard::new(clip_value, clip_norm, cfg.max_consecutive_skips, inject);
    console.start_progress(start.step, cfg.steps);
    if let Some(out) = &cfg.out {
        // A hang's rings land beside the checkpoints.
        flight::set_dump_dir(out);
    }
    let mut saves = SavePolicy::before_first_step(cfg, strategy.group())?;
    let mut metrics = Metrics::open(cfg, master, start.step)?;
    if let Some(dir) = metrics.dir() {
        let line = format!("logs: {} (TensorBoard and {})", dir.display(), METRICS_FILE);
        console.line(log, line);
    }
    let mut outcome = Outcome::starting_at(start.step, start.loss_floor);
    let mut window = Window::new();
    let mut throughput = Throughput::new(untimed_steps);
    let group = strategy.group();
    let mut stragglers = Stragglers::new(group.size(), group.local_world_size());

    for step in start.step..cfg.steps {
        // -- the step: gradients, the guard, the update ---------------------
        let lr = schedule.lr(step);
        // The flight recorder notes each collective's phase and step.
        flight::set_context("forward", step);
        let grads = strategy.gradients(step, &mut window.phases)?;
        flight::set_context("optimizer", step);
        let t_opt = Instant::now();
        let rank = strategy.group().rank();
        let stats = match strategy.device_grads() {
            Some((dev, g)) => guard.scale_on(step, rank, dev, g, grads.micro_batches)?,
            None => guard.scale(step, rank, strategy.grads_mut(), grads.micro_batches),
        };
        let stop_wanted = stop_request::requested().is_some();
        let (skip, stop) = guard.decide(
            strategy.group(),
            step,
            grads.loss_finite,
            stats,
            stop_wanted,
        )?;
        // The norm before clipping, for the logs and for clipping (a
        // collective for strategies whose ranks hold parts of the gradient).
        let norm = strategy.global_norm(stats.norm)?;
        let applied = skip.is_none();
        if applied && guard.clip_norm() > 0.0 {
            match strategy.device_grads() {
                Some((dev, g)) => clip_to_norm_on(dev, g, norm, guard.clip_norm()),
                None => clip_to_norm(strategy.grads_mut(), norm, guard.clip_norm()),
            };
        }
        strategy.apply(step, applied.then_some(lr))?;
        window.phases.add(Phase::Optimizer, t_opt.elapsed());
        if let Some(skip) = skip {
            console.line(log, format!("[step {} / {}] {skip}", step + 1, cfg.steps));
        }
        window.add_step(&grads, norm, applied);
        let done = step + 1;
        outcome.steps_run += 1;
        outcome.final_step = done;
        throughput.add_step(grads.tokens, outcome.steps_run);

        // -- log, evaluate, save (every rank takes part in the collectives) -
        let t_log = Instant::now();
        flight::set_context("log", step);
        let mut figures = None;
        if done % cfg.log_interval == 0 || done == cfg.steps {
            // Every rank's phases: for the run log, and to name a straggler.
            let rank_ms = cfg.log_dir().is_some() || strategy.group().size() > 1;
            let (mut totals, mut note) = window.reduce(strategy, rank_ms)?;
            totals.straggler = stragglers.add(window.steps(), &totals.rank_ms).cloned();
            if let Some(straggler) = &totals.straggler {
                note.push_str(&format!(" | straggler: {straggler}"));
            }
            outcome.train_losses.push((done, totals.loss));
            let line = format!(
                "[step {done} / {}] loss = {:.4} | lr {lr:.2e} | {:.0} tok/s | {}{note}",
                cfg.steps,
                totals.loss,
                totals.tokens_per_s,
                window.per_step(),
            );
            console.line(log, line);
            figures = Some(totals.figures(lr));
            outcome.phases.merge(&window.phases);
            window = Window::new();
        }
        flight::set_context("eval", step);
        let val_loss =
            evaluation::evaluate_if_due(cfg, done, strategy, &mut outcome, &console, log)?;
        flight::set_context("save", step);
        saves.save_if_due(cfg, done, stop, strategy, &console, log)?;
        metrics.record(done, figures.as_ref(), val_loss, outcome.loss_floor);
        if stop {
            let signal = stop_request::requested()
                .map_or_else(|| "a signal to another rank".into(), stop_request::name);
            let saved = match &cfg.out {
                Some(out) => format!(
                    "checkpoint saved in {0}; --resume {0} continues it (a requeued Slurm job \
                     resumes by itself)",
                    out.display()
                ),
                None => "no --out, so nothing was saved".into(),
            };
            console.finish_progress();
            let line = format!("[step {done} / {}] stopped by {signal}: {saved}", cfg.steps);
            console.line(log, line);
            return Err(TrainError::Stopped {
                signal,
                step: done,
                saved,
            });
        }
        window.phases.add(Phase::Logging, t_log.elapsed());
        console.progress(done);
    }
    outcome.phases.merge(&window.phases);
    console.finish_progress();
    outcome.tokens_per_s = throughput.tokens_per_s(strategy.group(), outcome.steps_run)?;
    outcome.params = strategy.final_params()?;
    let straggler = stragglers.last().map(|s| format!("straggler: {s}"));
    let ends = summary::Ends {
        skipped: guard.skipped(),
        straggler,
    };
    summary::log_summary(cfg, &outcome, strategy, &ends, &console, log);
    console.report_lost_lines();
    Ok(outcome)
}

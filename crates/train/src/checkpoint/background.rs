//! Saves off the training thread: at the step boundary the state a whole-model
//! checkpoint holds (the parameters and the optimizer's buffers) is copied into
//! staging buffers, and a writer thread hashes, fsyncs and commits it exactly as
//! a save on the training thread does (`save::write_and_prune`: the same
//! atomic directory and `latest` pointer), while training goes on.
//!
//! The writer runs at the lowest priority (`SCHED_IDLE`, else nice 19): where the
//! training threads keep every core busy, it takes the time they leave (waits in
//! collectives, the step's serial parts) rather than time from the step, and when
//! the next save waits for it, the cores the waiting ranks leave idle are its.
//!
//! At most one save is in flight: the next one, and the final one, wait for it
//! ([`Saver::finished`]). The staging buffers are allocated at the first save
//! and reused after. Whether a save failed is learnt from [`Saver::finished`];
//! the save policy makes that every rank's verdict. A `Saver` dropped with a
//! save in flight (a run that fails) waits for it, so that what was begun is
//! committed or reported. This module never writes from the live training
//! buffers on another thread, and never starts a second save before the first
//! is done.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Duration;

use cohort_engine::optim::{Optimizer, OptimizerState};
use cohort_gpt::GPT;

use super::layout::TrainState;
use super::save::{failed_save, save_or_report, write_and_prune, Companions, SaveReport};
use super::trainer_files;
use crate::config::{SaveMode, TrainConfig};

/// The test hook `COHORT_TEST_SAVE_DELAY=STEP:SECS`: the writer of step `STEP`'s background
/// save sleeps `SECS` seconds before it writes, so that a test can kill the job mid-save.
const SAVE_DELAY_VAR: &str = "COHORT_TEST_SAVE_DELAY";

/// The copy of the state a background save writes from.
struct Staging {
    /// The parameters, in a model that only holds them ([`GPT::staging`]).
    model: GPT,
    /// The optimizer's name, its step and its buffers by name.
    optimizer: String,
    optimizer_step: u64,
    buffers: Vec<(String, Vec<f32>)>,
}

impl Staging {
    /// Copies `model`'s parameters and `opt`'s state into `spare` (reused when its shapes
    /// match, else allocated anew).
    fn copy(spare: Option<Staging>, model: &GPT, opt: &dyn Optimizer) -> Result<Staging, String> {
        let mut staging = match spare {
            Some(s) if s.model.config() == model.config() => s,
            _ => Staging {
                model: GPT::staging(model.config().clone()).map_err(|e| e.to_string())?,
                optimizer: String::new(),
                optimizer_step: 0,
                buffers: Vec::new(),
            },
        };
        staging.model.params_mut().copy_from_slice(model.params());
        let state = opt.state();
        let same = staging.buffers.len() == state.buffers.len()
            && (staging.buffers.iter().zip(&state.buffers))
                .all(|((n, b), (m, c))| n == m && b.len() == c.len());
        if !same {
            staging.buffers = (state.buffers.iter())
                .map(|(n, b)| (n.clone(), vec![0.0; b.len()]))
                .collect();
        }
        for ((_, dst), (_, src)) in staging.buffers.iter_mut().zip(&state.buffers) {
            dst.copy_from_slice(src);
        }
        staging.optimizer = state.optimizer;
        staging.optimizer_step = state.step;
        Ok(staging)
    }

    fn optimizer_state(&self) -> OptimizerState<'_> {
        OptimizerState {
            optimizer: self.optimizer.clone(),
            step: self.optimizer_step,
            buffers: (self.buffers.iter())
                .map(|(n, b)| (n.clone(), b.as_slice()))
                .collect(),
        }
    }
}

/// A save on the writer thread: its step, and the thread, which hands back the report and
/// the staging buffers.
struct InFlight {
    step: u64,
    writer: JoinHandle<(SaveReport, Staging)>,
}

/// Writes whole-model checkpoints, on the training thread or on a writer thread (see the
/// module doc). One per run, kept by the save policy.
pub(crate) struct Saver {
    mode: SaveMode,
    /// Whether the save asked for now may go to the writer thread (not the final one, nor a
    /// signal's: those must be complete before the run exits).
    background_now: bool,
    in_flight: Option<InFlight>,
    spare: Option<Staging>,
}

impl Saver {
    /// A saver writing in `mode`.
    pub(crate) fn new(mode: SaveMode) -> Saver {
        Saver {
            mode,
            background_now: false,
            in_flight: None,
            spare: None,
        }
    }

    /// Whether the next save may go to the writer thread (the policy says no for the final
    /// checkpoint and a signal's).
    pub(crate) fn allow_background(&mut self, allowed: bool) {
        self.background_now = allowed && self.mode == SaveMode::Background;
    }

    /// Saves the checkpoint of `state` (the whole `model` and `opt`'s state) into `out`:
    /// on this thread, returning its report, or, when the policy allows, from a copy on the
    /// writer thread, returning a `pending` report. A save still in flight is waited for
    /// first (its report then comes from [`Saver::finished`], which the policy calls
    /// before any save, so none is lost).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn save_whole(
        &mut self,
        out: &Path,
        cfg: &TrainConfig,
        world: usize,
        model: &GPT,
        opt: &dyn Optimizer,
        state: &TrainState,
        tokenizer_json: Option<&str>,
    ) -> SaveReport {
        if !self.background_now {
            return save_or_report(out, cfg, world, model, opt, state, tokenizer_json);
        }
        if let Some((step, report)) = self.finished(true) {
            // Not expected (the policy collects a save before the next), but never lost.
            if let Some(why) = report.failed {
                eprintln!("checkpoint of step {step}: {why}");
            }
        }
        let staging = match Staging::copy(self.spare.take(), model, opt) {
            Ok(staging) => staging,
            Err(e) => return failed_save(out, state.step, format!("staging copy: {e}")),
        };
        let job = Job {
            out: out.to_path_buf(),
            cfg: cfg.clone(),
            world,
            state: *state,
            tokenizer_json: tokenizer_json.map(str::to_string),
            delay: test_delay(state.step),
        };
        let spawned = std::thread::Builder::new()
            .name("checkpoint-writer".into())
            .spawn(move || job.run(staging));
        match spawned {
            Ok(writer) => {
                self.in_flight = Some(InFlight {
                    step: state.step,
                    writer,
                });
                SaveReport {
                    pending: true,
                    ..SaveReport::default()
                }
            }
            Err(e) => failed_save(out, state.step, format!("cannot start the writer: {e}")),
        }
    }

    /// The step and report of the save in flight once it is done (`wait`: waiting for it);
    /// `None` when there is none, or it is still writing and `wait` is false.
    pub(crate) fn finished(&mut self, wait: bool) -> Option<(u64, SaveReport)> {
        let done = self.in_flight.as_ref()?.writer.is_finished();
        if !done && !wait {
            return None;
        }
        let InFlight { step, writer } = self.in_flight.take()?;
        match writer.join() {
            Ok((report, staging)) => {
                self.spare = Some(staging);
                Some((step, report))
            }
            Err(_) => Some((
                step,
                SaveReport {
                    failed: Some(format!(
                        "checkpoint of step {step} NOT saved: its writer thread panicked"
                    )),
                    ..SaveReport::default()
                },
            )),
        }
    }
}

impl Drop for Saver {
    /// A run that ends with a save in flight (an error elsewhere) lets it finish: a
    /// checkpoint half written is never committed, one finished is worth keeping.
    fn drop(&mut self) {
        if let Some((step, report)) = self.finished(true) {
            if let Some(why) = report.failed {
                eprintln!("checkpoint of step {step}: {why}");
            }
        }
    }
}

/// What the writer thread needs beside the staged state.
struct Job {
    out: PathBuf,
    cfg: TrainConfig,
    world: usize,
    state: TrainState,
    tokenizer_json: Option<String>,
    delay: Option<Duration>,
}

impl Job {
    fn run(self, staging: Staging) -> (SaveReport, Staging) {
        yield_to_training();
        if let Some(delay) = self.delay {
            std::thread::sleep(delay);
        }
        let (model, step) = (&staging.model, self.state.step);
        let tokenizer = self.tokenizer_json.as_deref();
        let companions = Companions::new(
            &self.cfg,
            self.world,
            model.config(),
            &self.state,
            tokenizer,
        );
        let optimizer = staging.optimizer_state();
        let report = match companions {
            Ok(companions) => write_and_prune(
                &self.out,
                self.cfg.keep_checkpoints,
                step,
                model,
                trainer_files::optimizer_file(&optimizer),
                &companions,
            ),
            Err(e) => failed_save(&self.out, step, e),
        };
        (report, staging)
    }
}

/// Puts the calling thread (the writer) at the lowest CPU priority: `SCHED_IDLE`, or nice 19
/// where that is refused. Lowering one's own priority needs no privilege; should both be
/// refused, the writer runs as before.
fn yield_to_training() {
    #[cfg(target_os = "linux")]
    // SAFETY: scheduling syscalls on the calling thread (pid 0 / its own tid), reading only the
    // `sched_param` we own for the duration of the call.
    unsafe {
        let param = libc::sched_param { sched_priority: 0 };
        if libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0 {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, 19);
        }
    }
}

/// [`SAVE_DELAY_VAR`]'s delay for the save of `step`, if it names that step.
fn test_delay(step: u64) -> Option<Duration> {
    let value = std::env::var(SAVE_DELAY_VAR).ok()?;
    let (at, secs) = value.split_once(':')?;
    (at.trim().parse::<u64>().ok()? == step)
        .then(|| secs.trim().parse::<f64>().ok().map(Duration::from_secs_f64))
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The writer thread ends up below the training threads, and only it does.
    #[cfg(target_os = "linux")]
    #[test]
    fn the_writer_yields_to_training() {
        let idle_or_nice = || {
            // SAFETY: scheduling queries on the calling thread; no memory is passed.
            unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                (
                    libc::sched_getscheduler(0) == libc::SCHED_IDLE,
                    libc::getpriority(libc::PRIO_PROCESS, tid),
                )
            }
        };
        let before = idle_or_nice();
        let writer = std::thread::spawn(move || {
            yield_to_training();
            idle_or_nice()
        })
        .join()
        .unwrap();
        assert!(writer.0 || writer.1 == 19, "writer: {writer:?}");
        assert_eq!(
            idle_or_nice(),
            before,
            "the calling thread keeps its priority"
        );
    }
}

//! What a worker does when `cohort run` (the elastic launcher) restarted
//! it: the restarted workers of a job resume from the checkpoints it
//! wrote, possibly on another number of ranks.
//!
//! - A worker with `COHORT_RESTART_COUNT` (or Slurm's `SLURM_RESTART_COUNT`,
//!   a requeued job) > 0 and no `--resume` resumes from
//!   its `--out` directory when that holds a checkpoint (a first start, or a
//!   restart before the first checkpoint, starts from scratch).
//! - When the world size differs from the checkpoint's, the data are
//!   re-split by the new world (each rank's `DistributedSampler` stride), the
//!   position in the epoch is carried over as a count of samples consumed by
//!   all ranks together, and `grad_accum` is rescaled so that the global
//!   batch (`batch_size x world x grad_accum`) stays what it was, which keeps
//!   the learning-rate schedule and the optimizer's statistics meaningful.
//!   torchrun leaves this to the user; where the old global batch is not a
//!   multiple of `batch_size x new world`, cohort keeps `grad_accum`, the
//!   global batch changes, and the log says so.
//!
//! - A resume without `--out` goes on writing in the run directory it resumed
//!   from (or says that nothing will be saved), and a longer schedule than the
//!   checkpoint's is said in one line.
//!
//! This module decides; it never loads weights (`checkpoint` does) and
//! never talks to other ranks.

use std::path::Path;

use cohort_engine::optim::LrSchedule;
use serde_json::Value;

use crate::checkpoint::{self, trainer_files};
use crate::config::TrainConfig;
use crate::error::{ConfigError, TrainError};

/// Set by the launcher: how many times it restarted the job's workers.
pub const RESTART_COUNT_VAR: &str = "COHORT_RESTART_COUNT";

/// Set by Slurm in a job that was requeued (`scontrol requeue`, or
/// preemption with requeue): how many times it was.
pub const SLURM_RESTART_COUNT_VAR: &str = "SLURM_RESTART_COUNT";

/// The job's restart count from the environment: the launcher's, or Slurm's
/// for a requeued job (the larger; 0 when neither is set), so that a job
/// that saved and stopped on SIGUSR1 resumes when Slurm runs it again.
pub fn restart_count_from_env() -> Result<u32, TrainError> {
    let count = |name: &'static str, why: &'static str| match std::env::var(name) {
        Ok(v) => v.trim().parse::<u32>().map_err(|_| {
            TrainError::Config(ConfigError::Invalid {
                key: name,
                value: v,
                why,
            })
        }),
        Err(_) => Ok(0),
    };
    let launcher = count(
        RESTART_COUNT_VAR,
        "must be a whole number (the launcher's restart count)",
    )?;
    let slurm = count(
        SLURM_RESTART_COUNT_VAR,
        "must be a whole number (Slurm's requeue count)",
    )?;
    Ok(launcher.max(slurm))
}

/// The settings a (re)started worker trains with: `cfg`, plus `resume` set
/// to `out` after a restart when `out` holds a checkpoint, and `grad_accum`
/// rescaled when resuming on another world size. Returns the lines to log.
pub fn prepare_resume(
    cfg: &TrainConfig,
    world: usize,
    restart_count: u32,
) -> (TrainConfig, Vec<String>) {
    let mut cfg = cfg.clone();
    let mut notes = Vec::new();
    let asked = cfg.resume.clone();
    cfg.out_to_resumed_run();
    if restart_count > 0 && cfg.resume.is_none() {
        if let Some(out) = cfg
            .out
            .as_ref()
            .filter(|out| checkpoint::choose(out).is_ok())
        {
            notes.push(format!(
                "restart {restart_count} of this job: resuming from {}",
                out.display()
            ));
            cfg.resume = Some(out.clone());
        }
    }
    if let (Some(from), None) = (&asked, &cfg.out) {
        notes.push(format!(
            "{} is a checkpoint of no run directory and there is no --out: this run saves no \
             checkpoint and no logs",
            from.display()
        ));
    } else if let (Some(from), Some(out)) = (&asked, &cfg.out) {
        if checkpoint::output_root(from).as_ref() == Some(out) {
            notes.push(format!(
                "checkpoints and logs go on in {}, where this run resumes from (--out DIR to \
                 write elsewhere)",
                out.display()
            ));
        }
    }
    let saved = cfg.resume.as_deref().and_then(saved_shape);
    if let Some(saved) = saved.filter(|s| s.world != world) {
        let (accum, note) = rescale(&saved, cfg.batch_size, world, cfg.grad_accum);
        cfg.grad_accum = accum;
        notes.push(note);
    }
    notes.extend(saved.and_then(|saved| schedule_note(&saved, &cfg)));
    (cfg, notes)
}

/// The line that says a resume re-lays the cosine schedule over another length than the
/// checkpoint's (more --steps): the schedule follows this run's settings, as a Hugging Face
/// Trainer's rebuilt for a new max_steps does, so the learning rate jumps at the resumed
/// step; `--lr-decay-steps` with the saved length keeps the saved shape instead.
fn schedule_note(saved: &SavedShape, cfg: &TrainConfig) -> Option<String> {
    let (was, now) = (saved.decay_steps?, cfg.decay_steps());
    if was == now || saved.step >= cfg.steps {
        return None;
    }
    let lr = |decay| {
        LrSchedule::warmup_cosine(cfg.lr, cfg.min_lr, cfg.warmup_steps, decay)
            .map(|s| s.lr(saved.step))
            .ok()
    };
    Some(format!(
        "the checkpoint's learning-rate schedule decays over {was} steps, this run's over \
         {now}: the cosine schedule is re-laid over {now} steps (lr at step {}: {:.2e} -> \
         {:.2e}); --lr-decay-steps {was} keeps the saved shape",
        saved.step,
        lr(was)?,
        lr(now)?
    ))
}

/// The job shape a checkpoint was written with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SavedShape {
    world: usize,
    batch_size: usize,
    grad_accum: usize,
    /// The step it was saved at.
    step: u64,
    /// The length of its learning-rate schedule (not in checkpoints before it was kept).
    decay_steps: Option<u64>,
}

/// The shape recorded in the checkpoint a resume from `path` loads (the one
/// `latest` names, or the intact one before it that loading falls back to);
/// `None` when it cannot be read (loading it reports why).
fn saved_shape(path: &Path) -> Option<SavedShape> {
    let dir = checkpoint::choose(path).ok()?;
    let trainer = trainer_files::load_trainer_state(&dir).ok()??;
    let field = |key: &str| {
        trainer
            .extra
            .get(key)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
    };
    Some(SavedShape {
        world: field("world_size")?,
        batch_size: field("batch_size")?,
        grad_accum: field("grad_accum")?,
        step: trainer.step,
        decay_steps: field("lr_decay_steps").map(|v| v as u64),
    })
}

/// `grad_accum` for `world` ranks of `batch_size` that keeps the saved
/// global batch, if it divides; else `accum` unchanged. With the log line.
fn rescale(saved: &SavedShape, batch_size: usize, world: usize, accum: usize) -> (usize, String) {
    let global = saved.batch_size * saved.world * saved.grad_accum;
    let per_step = batch_size * world;
    let head = format!("world size {} -> {world}", saved.world);
    if global.is_multiple_of(per_step) {
        let kept = global / per_step;
        return (
            kept,
            format!(
                "{head}: grad_accum {} -> {kept} keeps the global batch of {global} sequences",
                saved.grad_accum
            ),
        );
    }
    (
        accum,
        format!(
            "{head}: the global batch of {global} sequences is not a multiple of {batch_size} x \
             {world}, so it changes to {}; the data are re-split by the new world",
            per_step * accum
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_global_batch_is_kept_when_it_divides() {
        let saved = SavedShape {
            world: 4,
            batch_size: 2,
            grad_accum: 1,
            step: 0,
            decay_steps: None,
        };
        let (accum, note) = rescale(&saved, 2, 2, 1);
        assert_eq!(accum, 2);
        assert!(
            note.contains("world size 4 -> 2: grad_accum 1 -> 2"),
            "{note}"
        );
        assert_eq!(rescale(&saved, 2, 4, 1).0, 1);
        let (accum, note) = rescale(&saved, 2, 3, 1);
        assert_eq!(accum, 1);
        assert!(note.contains("changes to 6"), "{note}");
    }

    #[test]
    fn a_restarted_worker_resumes_only_from_a_checkpoint_that_exists() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = TrainConfig {
            out: Some(dir.path().to_path_buf()),
            ..TrainConfig::default()
        };
        // No checkpoint yet: start from scratch even after a restart.
        let (same, notes) = prepare_resume(&cfg, 2, 3);
        assert_eq!((same.resume, notes.len()), (None, 0));
        std::fs::write(dir.path().join("latest"), "step-000010").unwrap();
        std::fs::create_dir(dir.path().join("step-000010")).unwrap();
        std::fs::write(dir.path().join("step-000010/config.json"), "{}").unwrap();
        let (first, _) = prepare_resume(&cfg, 2, 0);
        assert_eq!(first.resume, None, "a first start never resumes by itself");
        let (restarted, notes) = prepare_resume(&cfg, 2, 1);
        assert_eq!(restarted.resume.as_deref(), Some(dir.path()));
        assert!(notes[0].starts_with("restart 1 of this job"), "{notes:?}");
    }
}

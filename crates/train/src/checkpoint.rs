//! Saving and resuming a training run: the model through
//! `cohort_gpt::checkpoint` (Hugging Face GPT-2 format, atomic writes), with
//! the optimizer's state and the trainer's position (step, epoch, offset in
//! the epoch's sample order; see `trainer_files`) as further files of it,
//! and the shape of the job that produced it. Resuming restores all of it, so
//! the run continues bitwise as if it had never stopped: the learning rate
//! and dropout keys are functions of the step, the data of (epoch, offset).
//!
//! Checkpoints are `OUT/step-NNNNNN` directories, written atomically and
//! verified by `cohort_gpt::checkpoint` (SHA-256 of every file). What goes
//! wrong on the way is not fatal (say, the disk fills up): a failed
//! save is reported and the run goes on with the previous checkpoint intact;
//! only the newest `keep_checkpoints` are kept. Resuming from `OUT` takes
//! the checkpoint `latest` names, or, if that one is damaged, the newest
//! intact one before it. Only rank 0 calls [`save_or_report`]; every rank
//! calls [`resume`]. This module never deletes a checkpoint that `latest`
//! names, and never resumes ranks from different steps.

use crate::config::TrainConfig;
use crate::trainer_files::{self, TrainerState};
use crate::TrainError;
use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_engine::optim::Optimizer;
use cohort_gpt::checkpoint::{self as ckpt, Checkpoint, CheckpointError};
use cohort_gpt::{GPTConfig, GPT};
use serde_json::{json, Value};
use std::fs;
use std::path::{Path, PathBuf};

/// Name prefix of the trainer's checkpoints (`step-000100`).
const STEP_PREFIX: &str = "step-";

/// Where a run is: what a checkpoint records beyond weights and optimizer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrainState {
    /// Optimizer steps completed.
    pub step: u64,
    /// Epoch of the sampler.
    pub epoch: u64,
    /// Samples of this epoch this rank has consumed.
    pub offset: usize,
}

/// Writes `out/step-NNNNNN` (and points `out/latest` at it).
fn save(
    out: &Path,
    cfg: &TrainConfig,
    world: usize,
    model: &GPT,
    opt: &dyn Optimizer,
    state: &TrainState,
    tokenizer_json: Option<&str>,
) -> Result<(), TrainError> {
    let mut extra = serde_json::Map::new();
    extra.insert("epoch".into(), json!(state.epoch));
    extra.insert("offset".into(), json!(state.offset));
    extra.insert("world_size".into(), json!(world));
    extra.insert("batch_size".into(), json!(cfg.batch_size));
    extra.insert("grad_accum".into(), json!(cfg.grad_accum));
    extra.insert("data".into(), json!(cfg.data));
    let trainer = TrainerState {
        step: state.step,
        seed: cfg.seed,
        extra,
    };
    let name = format!("{STEP_PREFIX}{:06}", state.step);
    let optimizer = opt.state();
    let trainer = trainer_files::trainer_state_json(&trainer);
    let mut extra_files = vec![(trainer_files::TRAINER_STATE_FILE, trainer.as_slice())];
    // What Hugging Face needs beside the model to load the checkpoint without a warning.
    let hf = match tokenizer_json {
        Some(json) => {
            extra_files.push((cohort_tokenizer::TOKENIZER_FILE, json.as_bytes()));
            let tokenizer = cohort_tokenizer::Tokenizer::from_json(json)?;
            cohort_tokenizer::hf_files(&tokenizer, model.config().max_position_embeddings)
        }
        None => cohort_tokenizer::HfFiles::without_tokenizer(),
    };
    extra_files.extend(hf.files.iter().map(|(name, bytes)| (*name, &bytes[..])));
    ckpt::save(
        out,
        &name,
        &Checkpoint {
            config_extra: hf.config_keys,
            model: Some(model),
            tensor_files: vec![trainer_files::optimizer_file(&optimizer)],
            extra_files,
        },
    )?;
    Ok(())
}

/// What a save left to report.
#[derive(Debug, Default)]
pub(crate) struct SaveReport {
    /// Lines for the log (a checkpoint that could not be deleted).
    pub lines: Vec<String>,
    /// Why the checkpoint was not saved, naming the path, the OS error and
    /// the last good checkpoint; the training loop decides whether the run
    /// goes on.
    pub failed: Option<String>,
}

/// Checks, before the first step, that checkpoints can be written to `out`:
/// creates it and writes and deletes a file in it. An error names the path.
pub(crate) fn check_writable(out: &Path) -> Result<(), String> {
    let probe = out.join(format!(".write-test-{}", std::process::id()));
    fs::create_dir_all(out)
        .and_then(|()| fs::write(&probe, b"cohort"))
        .and_then(|()| fs::remove_file(&probe))
        .map_err(|e| format!("cannot write checkpoints to {}: {e}", out.display()))
}

/// Saves the checkpoint of `state` into `out` and deletes the checkpoints
/// beyond `cfg.keep_checkpoints`; a failure is reported, not returned, so
/// that the caller (with the other ranks) decides what it costs.
pub(crate) fn save_or_report(
    out: &Path,
    cfg: &TrainConfig,
    world: usize,
    model: &GPT,
    opt: &dyn Optimizer,
    state: &TrainState,
    tokenizer_json: Option<&str>,
) -> SaveReport {
    if let Err(e) = save(out, cfg, world, model, opt, state, tokenizer_json) {
        let last = ckpt::resolve(out)
            .map(|dir| dir.display().to_string())
            .unwrap_or_else(|_| "none".into());
        return SaveReport {
            lines: Vec::new(),
            failed: Some(format!(
                "checkpoint of step {} NOT saved (last good checkpoint: {last}): {e}",
                state.step
            )),
        };
    }
    SaveReport {
        lines: prune(out, cfg.keep_checkpoints),
        failed: None,
    }
}

/// The trainer's checkpoints in `root`, newest first, as (step, directory).
fn step_dirs(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut dirs: Vec<(u64, PathBuf)> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_str()?.to_string();
            let step = name.strip_prefix(STEP_PREFIX)?.parse().ok()?;
            entry.path().is_dir().then(|| (step, entry.path()))
        })
        .collect();
    dirs.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    dirs
}

/// Deletes the checkpoints of `root` beyond the newest `keep` (0: none),
/// sparing the one `latest` names, and the temp directories of saves that
/// were killed. Returns a line for each deletion that failed.
fn prune(root: &Path, keep: usize) -> Vec<String> {
    let mut doomed: Vec<PathBuf> = Vec::new();
    if keep > 0 {
        let latest = ckpt::resolve(root).ok();
        doomed.extend(
            step_dirs(root)
                .into_iter()
                .skip(keep)
                .map(|(_, dir)| dir)
                .filter(|dir| Some(dir) != latest.as_ref()),
        );
    }
    // Only rank 0 saves, one checkpoint at a time: a temp directory still
    // here was left by a save that was killed.
    doomed.extend(
        fs::read_dir(root)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
            .map(|e| e.path()),
    );
    doomed
        .into_iter()
        .filter_map(|dir| {
            fs::remove_dir_all(&dir)
                .err()
                .map(|e| format!("could not delete old checkpoint {}: {e}", dir.display()))
        })
        .collect()
}

/// A run restored from a checkpoint.
#[derive(Debug)]
pub(crate) struct Resumed {
    /// Where it continues.
    pub state: TrainState,
    /// The checkpoint it was restored from.
    pub dir: PathBuf,
    /// The damaged checkpoints passed over, for the log.
    pub notes: Vec<String>,
}

/// Whether `e` says a checkpoint's files are damaged or missing (worth
/// trying an older one), rather than that it belongs to another model.
fn is_damage(e: &TrainError) -> bool {
    matches!(
        e,
        TrainError::Checkpoint(
            CheckpointError::Corrupt { .. }
                | CheckpointError::Io { .. }
                | CheckpointError::Format { .. }
                | CheckpointError::NotACheckpoint { .. }
        )
    )
}

/// The checkpoints `path` offers, in the order to try them: `path` itself
/// when it is a checkpoint; for an output directory, the one `latest` names
/// (or its `.old-` copy), then the older `step-*` ones, newest first.
fn candidates(path: &Path) -> Result<Vec<PathBuf>, TrainError> {
    if path.join(ckpt::CONFIG_FILE).is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = Vec::new();
    let latest = ckpt::resolve(path);
    let below = match &latest {
        Ok(dir) => {
            out.push(dir.clone());
            let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
            name.and_then(|n| {
                n.trim_start_matches(".old-")
                    .strip_prefix(STEP_PREFIX)?
                    .parse()
                    .ok()
            })
        }
        Err(_) => None,
    };
    let older: Vec<PathBuf> = step_dirs(path)
        .into_iter()
        .filter(|(step, dir)| below.is_none_or(|b| *step < b) && !out.contains(dir))
        .map(|(_, dir)| dir)
        .collect();
    out.extend(older);
    if out.is_empty() {
        return Err(latest.err().map_or_else(
            || {
                CheckpointError::NotACheckpoint {
                    path: path.to_path_buf(),
                }
                .into()
            },
            TrainError::from,
        ));
    }
    Ok(out)
}

/// Restores model, optimizer and position from `path`: a checkpoint, or an
/// output directory, whose latest checkpoint is used or, when that one is
/// damaged (a checksum mismatch, a missing or truncated file), the newest
/// intact one before it. A checkpoint that belongs to another job shape is
/// an error, never passed over. Collective: the ranks check that they all
/// resumed at the same step.
pub(crate) fn resume(
    path: &Path,
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    model: &mut GPT,
    opt: &mut dyn Optimizer,
) -> Result<Resumed, TrainError> {
    resume_split(path, cfg, pg, pg.size(), model, opt)
}

/// As [`resume`], for a job whose data are split over `world` ranks of
/// `pg` (a pipeline's replicas) rather than over all of them.
pub(crate) fn resume_split(
    path: &Path,
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    world: usize,
    model: &mut GPT,
    opt: &mut dyn Optimizer,
) -> Result<Resumed, TrainError> {
    let resumed = resume_alone(path, cfg, world, model, opt)?;
    agree_on_step(pg, resumed.state.step, &resumed.dir)?;
    Ok(resumed)
}

/// As [`resume`], for the one process that holds the model (a parameter
/// server), with `world` the number of ranks the data are split over.
pub(crate) fn resume_alone(
    path: &Path,
    cfg: &TrainConfig,
    world: usize,
    model: &mut GPT,
    opt: &mut dyn Optimizer,
) -> Result<Resumed, TrainError> {
    let mut notes = Vec::new();
    let mut tried = Vec::new();
    let candidates = candidates(path)?;
    let single = candidates.len() == 1;
    for dir in candidates {
        match load(&dir, cfg, world, model, opt) {
            Ok(state) => return Ok(Resumed { state, dir, notes }),
            Err(e) if is_damage(&e) && !single => {
                notes.push(format!(
                    "checkpoint {} is unusable, trying the one before it: {e}",
                    dir.display()
                ));
                tried.push(e.to_string());
            }
            Err(e) => return Err(e),
        }
    }
    Err(TrainError::Resume {
        path: path.to_path_buf(),
        reason: format!("no intact checkpoint in it: {}", tried.join("; ")),
    })
}

/// Fails unless every rank resumed at `step` (each reads the checkpoint
/// itself, so a node with another copy of the directory would diverge).
fn agree_on_step(pg: &ProcessGroup, step: u64, dir: &Path) -> Result<(), TrainError> {
    let mut range = [step as i64, -(step as i64)];
    pg.all_reduce(&mut range, ReduceOp::Max)
        .map_err(TrainError::comm("resume step all_reduce"))?;
    let (max, min) = (range[0], -range[1]);
    if max != min {
        return Err(TrainError::Resume {
            path: dir.to_path_buf(),
            reason: format!(
                "the ranks resumed at different steps ({min} to {max}): every node must see \
                 the same checkpoint directory"
            ),
        });
    }
    Ok(())
}

/// Checks that the checkpoint in `dir` (its config.json) is of the model this run builds, so
/// a run resumed with other shape flags stops with what differs instead of a tensor's shape.
fn check_same_model(dir: &Path, run: &GPTConfig) -> Result<(), TrainError> {
    let stored = ckpt::load_config(dir)?;
    let pairs = [
        ("n_layers", stored.n_layers, run.n_layers),
        ("n_heads", stored.n_heads, run.n_heads),
        ("d_model", stored.d_model, run.d_model),
        ("d_ff", stored.d_ff, run.d_ff),
        ("vocab_size", stored.vocab_size, run.vocab_size),
        (
            "seq_len",
            stored.max_position_embeddings,
            run.max_position_embeddings,
        ),
        ("bias", stored.bias as usize, run.bias as usize),
        (
            "tie_word_embeddings",
            stored.tie_word_embeddings as usize,
            run.tie_word_embeddings as usize,
        ),
    ];
    let differ: Vec<String> = pairs
        .iter()
        .filter(|(_, theirs, ours)| theirs != ours)
        .map(|(key, theirs, ours)| format!("{key} {theirs} in its config.json, {ours} in this run"))
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(TrainError::Resume {
        path: dir.to_path_buf(),
        reason: format!("it is another model: {}", differ.join(", ")),
    })
}

/// Restores model, optimizer and position from the checkpoint directory
/// `dir`, after checking every file against its checksum. The job must have
/// the shape that wrote it (world size, batch, accumulation, seed, data), or
/// the data order would silently differ: that is an error naming the setting;
/// only the world size (and with it the accumulation) may change, as after an
/// elastic restart, and then the data position is carried over.
fn load(
    dir: &Path,
    cfg: &TrainConfig,
    world: usize,
    model: &mut GPT,
    opt: &mut dyn Optimizer,
) -> Result<TrainState, TrainError> {
    let dir = dir.to_path_buf();
    ckpt::verify(&dir)?;
    check_same_model(&dir, model.config())?;
    ckpt::load_params_into(&dir, model)?;
    if !trainer_files::load_optimizer_into(&dir, opt)? {
        return Err(TrainError::Resume {
            path: dir,
            reason: "it has no optimizer state (a model-only checkpoint cannot be resumed; \
                     start a new run from it instead)"
                .into(),
        });
    }
    let trainer = trainer_files::load_trainer_state(&dir)?.ok_or_else(|| TrainError::Resume {
        path: dir.clone(),
        reason: "it has no trainer_state.json".into(),
    })?;
    // On another world size (an elastic restart) the data are re-split and
    // `grad_accum` may differ: see elastic.rs.
    let regrouped = (trainer.extra.get("world_size").and_then(Value::as_u64))
        .map(|w| w as usize)
        .filter(|&w| w != world);
    let expect = [
        ("world_size", json!(world)),
        ("batch_size", json!(cfg.batch_size)),
        ("grad_accum", json!(cfg.grad_accum)),
        ("data", json!(cfg.data)),
    ];
    for (key, want) in expect {
        if regrouped.is_some() && matches!(key, "world_size" | "grad_accum") {
            continue;
        }
        let got = trainer.extra.get(key).cloned().unwrap_or(Value::Null);
        if got != want {
            return Err(TrainError::Resume {
                path: dir,
                reason: format!("it was written with {key} = {got}, this run has {want}"),
            });
        }
    }
    if trainer.seed != cfg.seed {
        return Err(TrainError::Resume {
            path: dir,
            reason: format!(
                "it was written with seed = {}, this run has {}",
                trainer.seed, cfg.seed
            ),
        });
    }
    let field = |key: &str| trainer.extra.get(key).and_then(Value::as_u64);
    let (Some(epoch), Some(offset)) = (field("epoch"), field("offset")) else {
        return Err(TrainError::Resume {
            path: dir,
            reason: "trainer_state.json has no epoch/offset".into(),
        });
    };
    let offset = match regrouped {
        Some(from) => crate::elastic::remap_offset(offset as usize, from, world),
        None => offset as usize,
    };
    Ok(TrainState {
        step: trainer.step,
        epoch,
        offset,
    })
}

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
//! intact one before it. Only rank 0 calls [`save_or_report`] (a whole
//! model, DDP's format); every rank calls [`save_sharded`] (the ZeRO
//! stages: each rank writes its own shard, rank 0 commits them, see
//! `cohort_gpt::checkpoint`'s sharded format) and [`resume`] (or
//! [`resume_into`], for a rank that restores only its own shard: a sharded
//! checkpoint is then read only where that shard lies). Either kind of
//! checkpoint resumes under any strategy and world size, and
//! [`consolidate`] turns a sharded one into DDP's format. This module never
//! deletes a checkpoint that `latest` names, and never resumes ranks from
//! different steps or different checkpoints.

use crate::config::TrainConfig;
use crate::trainer_files::{self, TrainerState};
use crate::TrainError;
use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_engine::optim::{Optimizer, OptimizerState};
use cohort_gpt::checkpoint::{
    self as ckpt, Checkpoint, CheckpointError, Piece, ShardIndex, ShardRecord,
};
use cohort_gpt::{GPTConfig, GPT};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::ops::Range;
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

/// The name of the checkpoint of `step` (`step-000100`).
fn step_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step:06}")
}

/// What a checkpoint stores beside the model's tensors: the trainer's position and job shape
/// (`trainer_state.json`) and, with a tokenizer, what Hugging Face needs beside the model to
/// load the checkpoint without a warning.
struct Companions {
    trainer: Vec<u8>,
    tokenizer_json: Option<String>,
    hf: cohort_tokenizer::HfFiles,
}

impl Companions {
    fn new(
        cfg: &TrainConfig,
        world: usize,
        model: &GPTConfig,
        state: &TrainState,
        tokenizer_json: Option<&str>,
    ) -> Result<Companions, TrainError> {
        let mut extra = serde_json::Map::new();
        extra.insert("epoch".into(), json!(state.epoch));
        extra.insert("offset".into(), json!(state.offset));
        extra.insert("world_size".into(), json!(world));
        extra.insert("batch_size".into(), json!(cfg.batch_size));
        extra.insert("grad_accum".into(), json!(cfg.grad_accum));
        extra.insert("data".into(), json!(cfg.data));
        let trainer = trainer_files::trainer_state_json(&TrainerState {
            step: state.step,
            seed: cfg.seed,
            extra,
        });
        let hf = match tokenizer_json {
            Some(json) => {
                let tokenizer = cohort_tokenizer::Tokenizer::from_json(json)?;
                cohort_tokenizer::hf_files(&tokenizer, model.max_position_embeddings)
            }
            None => cohort_tokenizer::HfFiles::without_tokenizer(),
        };
        Ok(Companions {
            trainer,
            tokenizer_json: tokenizer_json.map(str::to_string),
            hf,
        })
    }

    /// The files, as (name, bytes).
    fn files(&self) -> Vec<(&'static str, &[u8])> {
        let mut files = vec![(trainer_files::TRAINER_STATE_FILE, self.trainer.as_slice())];
        if let Some(json) = &self.tokenizer_json {
            files.push((cohort_tokenizer::TOKENIZER_FILE, json.as_bytes()));
        }
        files.extend(
            self.hf
                .files
                .iter()
                .map(|(name, bytes)| (*name, &bytes[..])),
        );
        files
    }
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
    let optimizer = opt.state();
    let companions = Companions::new(cfg, world, model.config(), state, tokenizer_json)?;
    ckpt::save(
        out,
        &step_name(state.step),
        &Checkpoint {
            config_extra: companions.hf.config_keys.clone(),
            model: Some(model),
            tensor_files: vec![trainer_files::optimizer_file(&optimizer)],
            extra_files: companions.files(),
        },
    )?;
    Ok(())
}

/// The report of a save that failed, naming the last good checkpoint.
fn failed_save(out: &Path, step: u64, why: impl std::fmt::Display) -> SaveReport {
    let last = ckpt::resolve(out)
        .map(|dir| dir.display().to_string())
        .unwrap_or_else(|_| "none".into());
    SaveReport {
        lines: Vec::new(),
        failed: Some(format!(
            "checkpoint of step {step} NOT saved (last good checkpoint: {last}): {why}"
        )),
    }
}

/// One rank's share of a sharded checkpoint (see [`save_sharded`]).
pub(crate) struct OwnedShard<'a> {
    /// The pieces of the model's flat buffer that rank `r` of the group holds, and where
    /// they lie in its buffers (rank 0 writes every rank's into the index).
    pub pieces_of: &'a dyn Fn(usize) -> Vec<Piece>,
    /// This rank's parameters over its pieces (its flat shard).
    pub params: &'a [f32],
    /// This rank's optimizer state over the same elements.
    pub optimizer: OptimizerState<'a>,
    /// The strategy's name, for the index.
    pub strategy: &'static str,
}

/// Integers per rank that rank 0 gathers after the shards are written: whether the write
/// succeeded, the file's size, its tensors' length and its SHA-256 as four words.
const RECORD_WORDS: usize = 7;

/// A hex SHA-256 as four words, and back.
fn digest_words(hex: &str) -> [i64; 4] {
    let mut words = [0i64; 4];
    for (i, w) in words.iter_mut().enumerate() {
        *w = u64::from_str_radix(&hex[i * 16..(i + 1) * 16], 16).unwrap_or(0) as i64;
    }
    words
}

fn digest_hex(words: &[i64]) -> String {
    words
        .iter()
        .map(|w| format!("{:016x}", *w as u64))
        .collect()
}

/// Saves a sharded checkpoint of `state` into `out`: every rank writes its own shard
/// (`shard`), and rank 0, once all are written, `model`'s config, the index and the
/// trainer's files, and commits the checkpoint (see `cohort_gpt::checkpoint`'s sharded
/// format: a checkpoint directory exists only with every shard in it). Nothing is gathered
/// but the shards' digests. A failed write on any rank is rank 0's failed report (the loop
/// decides what it costs); only a collective's failure is an error. Collective.
pub(crate) fn save_sharded(
    out: &Path,
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    model: &GPT,
    shard: &OwnedShard<'_>,
    state: &TrainState,
    tokenizer_json: Option<&str>,
) -> Result<SaveReport, TrainError> {
    let (rank, world, master) = (pg.rank(), pg.size(), pg.rank() == 0);
    let name = step_name(state.step);
    // Rank 0 makes the staging directory; the others write into it only once it exists.
    let begun = if master {
        ckpt::begin_sharded(out, &name).map(|_| ())
    } else {
        Ok(())
    };
    let mut ok = [i32::from(begun.is_ok())];
    pg.broadcast(&mut ok, 0)
        .map_err(TrainError::comm("checkpoint staging broadcast"))?;
    if ok[0] == 0 {
        return Ok(match begun {
            Err(e) => failed_save(out, state.step, e),
            Ok(()) => SaveReport::default(),
        });
    }
    let staging = ckpt::staging_dir(out, &name);
    let mut buffers = vec![(ckpt::PARAMS_BUFFER, shard.params)];
    buffers.extend(
        shard
            .optimizer
            .buffers
            .iter()
            .map(|(n, b)| (n.as_str(), *b)),
    );
    let written = ckpt::write_shard(&staging, rank, world, &(shard.pieces_of)(rank), &buffers);
    let mut mine = [0i64; RECORD_WORDS];
    match &written {
        Ok(record) => {
            mine[..3].copy_from_slice(&[1, record.bytes as i64, record.len as i64]);
            mine[3..].copy_from_slice(&digest_words(&record.sha256));
        }
        // Rank 0 reports the failure; only this rank knows why.
        Err(e) if !master => eprintln!(
            "[rank{rank}]: checkpoint of step {}: writing this rank's shard failed: {e}",
            state.step
        ),
        Err(_) => {}
    }
    let mut all = vec![0i64; if master { RECORD_WORDS * world } else { 0 }];
    pg.gather(&mine, master.then_some(&mut all[..]), 0)
        .map_err(TrainError::comm("checkpoint shard record gather"))?;
    if !master {
        return Ok(SaveReport::default());
    }
    if let Err(e) = written {
        ckpt::abort_sharded(out, &name);
        return Ok(failed_save(out, state.step, e));
    }
    let records: Vec<&[i64]> = all.chunks(RECORD_WORDS).collect();
    let failed: Vec<String> = (records.iter().enumerate())
        .filter(|(_, w)| w[0] != 1)
        .map(|(r, _)| r.to_string())
        .collect();
    if !failed.is_empty() {
        ckpt::abort_sharded(out, &name);
        return Ok(failed_save(
            out,
            state.step,
            format!(
                "rank(s) {} could not write their shard (their log says why)",
                failed.join(", ")
            ),
        ));
    }
    let committed = (|| -> Result<(), TrainError> {
        let shards = (records.iter().enumerate())
            .map(|(r, w)| ShardRecord {
                rank: r,
                file: ckpt::shard_file_name(r, world),
                sha256: digest_hex(&w[3..]),
                bytes: w[1] as u64,
                len: w[2] as usize,
                pieces: (shard.pieces_of)(r),
            })
            .collect();
        let mut metadata = BTreeMap::new();
        metadata.insert(STRATEGY_KEY.to_string(), shard.strategy.to_string());
        metadata.insert(
            trainer_files::SHARDED_OPTIMIZER_KEY.to_string(),
            shard.optimizer.optimizer.clone(),
        );
        metadata.insert(
            trainer_files::SHARDED_STEP_KEY.to_string(),
            shard.optimizer.step.to_string(),
        );
        let names = buffers.iter().map(|(n, _)| n.to_string()).collect();
        let index = ShardIndex::new(model.num_params(), names, metadata, shards)?;
        let companions = Companions::new(cfg, world, model.config(), state, tokenizer_json)?;
        let files = Checkpoint {
            config_extra: companions.hf.config_keys.clone(),
            model: None,
            tensor_files: Vec::new(),
            extra_files: companions.files(),
        };
        ckpt::commit_sharded(out, &name, model.config(), &files, &index)?;
        Ok(())
    })();
    if let Err(e) = committed {
        ckpt::abort_sharded(out, &name);
        return Ok(failed_save(out, state.step, e));
    }
    Ok(SaveReport {
        lines: prune(out, cfg.keep_checkpoints),
        failed: None,
    })
}

/// The index metadata key naming the strategy that wrote a sharded checkpoint.
const STRATEGY_KEY: &str = "strategy";

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
        return failed_save(out, state.step, e);
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
                | CheckpointError::Shard { .. }
        ) | TrainError::PeerResume { damaged: true, .. }
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

/// [`resume`] on this rank alone, into `target`.
/// With `pg`, the ranks try the same checkpoints and resume from the same one (see
/// [`agree_on_load`]).
fn resume_target(
    path: &Path,
    cfg: &TrainConfig,
    world: usize,
    target: &mut dyn Restore,
    pg: Option<&ProcessGroup>,
) -> Result<Resumed, TrainError> {
    let mut notes = Vec::new();
    let mut tried = Vec::new();
    let candidates = candidates(path)?;
    let single = candidates.len() == 1;
    for dir in candidates {
        let loaded = load(&dir, cfg, world, target);
        let loaded = match pg {
            Some(pg) => agree_on_load(pg, loaded)?,
            None => loaded,
        };
        match loaded {
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

/// Makes the outcome of one rank's load of a checkpoint every rank's. Each rank reads only
/// the files it needs (a sharded strategy its own shards), so one rank may find a file
/// damaged that the others never read; the ranks must still pass over, or fail on, the same
/// checkpoints. The worst outcome wins (another error, then damage, then success), and the
/// lowest rank with it tells the others its error, which they return naming it. Collective.
fn agree_on_load(
    pg: &ProcessGroup,
    loaded: Result<TrainState, TrainError>,
) -> Result<Result<TrainState, TrainError>, TrainError> {
    // code x 2^32 + (2^32 - 1 - rank): the maximum is the worst code's lowest rank.
    const RANKS: i64 = 1 << 32;
    let code = match &loaded {
        Ok(_) => 0,
        Err(e) if is_damage(e) => 1,
        Err(_) => 2,
    };
    let mut key = [if code == 0 {
        0
    } else {
        code * RANKS + (RANKS - 1 - pg.rank() as i64)
    }];
    pg.all_reduce(&mut key, ReduceOp::Max)
        .map_err(TrainError::comm("resume outcome all_reduce"))?;
    let (worst, who) = (key[0] / RANKS, (RANKS - 1 - key[0] % RANKS) as usize);
    if worst == 0 {
        return Ok(loaded);
    }
    let mut text = match &loaded {
        Err(e) if who == pg.rank() => e.to_string().into_bytes(),
        _ => Vec::new(),
    };
    let mut len = [text.len() as i64];
    pg.broadcast(&mut len, who)
        .map_err(TrainError::comm("resume error broadcast"))?;
    text.resize(len[0] as usize, 0);
    pg.broadcast(&mut text, who)
        .map_err(TrainError::comm("resume error broadcast"))?;
    if who == pg.rank() {
        return Ok(loaded);
    }
    Ok(Err(TrainError::PeerResume {
        rank: who,
        damaged: worst == 1,
        message: String::from_utf8_lossy(&text).into_owned(),
    }))
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
    resume_into(path, cfg, pg, world, &mut Whole { model, opt })
}

/// As [`resume`], restoring into `target` (a sharded strategy's own shard).
pub(crate) fn resume_into(
    path: &Path,
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    world: usize,
    target: &mut dyn Restore,
) -> Result<Resumed, TrainError> {
    let resumed = resume_target(path, cfg, world, target, Some(pg))?;
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
    resume_target(path, cfg, world, &mut Whole { model, opt }, None)
}

/// Where a resume puts the parameters and optimizer state of a checkpoint.
pub(crate) trait Restore {
    /// The model the run builds (a checkpoint of another is refused).
    fn config(&self) -> &GPTConfig;
    /// Loads the parameters and optimizer state of the checkpoint `dir` (verified but for
    /// its shards, which are checked as they are read). Returns false, when the checkpoint
    /// has no optimizer state.
    fn restore(&mut self, dir: &Path) -> Result<bool, TrainError>;
}

/// The whole model and an optimizer over all of it (DDP, pipeline, parameter server).
struct Whole<'a> {
    model: &'a mut GPT,
    opt: &'a mut dyn Optimizer,
}

impl Restore for Whole<'_> {
    fn config(&self) -> &GPTConfig {
        self.model.config()
    }

    fn restore(&mut self, dir: &Path) -> Result<bool, TrainError> {
        ckpt::load_params_into(dir, self.model)?;
        trainer_files::load_optimizer_into(dir, self.opt)
    }
}

/// One rank's flat shard of a sharded strategy: the pieces of the model's buffer it holds
/// (at their place in its buffers of `len` elements, padding zero), restored from any
/// checkpoint. From a sharded one only those ranges are read, from the shards that hold
/// them; from DDP's format the whole file is read and the rest dropped.
pub(crate) struct ShardTarget<'a> {
    config: &'a GPTConfig,
    pieces: Vec<Piece>,
    len: usize,
    /// The parameters of the pieces, once restored.
    pub params: Vec<f32>,
    /// The optimizer's state over the pieces, once restored.
    pub optimizer: Option<SavedOptimizer>,
}

/// An optimizer's state as a checkpoint holds it: name, step and buffers.
pub(crate) struct SavedOptimizer {
    name: String,
    step: u64,
    buffers: Vec<(String, Vec<f32>)>,
}

impl<'a> ShardTarget<'a> {
    pub(crate) fn new(config: &'a GPTConfig, pieces: Vec<Piece>, len: usize) -> Self {
        ShardTarget {
            config,
            pieces,
            len,
            params: Vec::new(),
            optimizer: None,
        }
    }

    /// The flat shard of each of `buffers`, whose values over the pieces are concatenated
    /// in `values` (in the pieces' order).
    fn place(&self, values: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
        values
            .into_iter()
            .map(|v| {
                let mut flat = vec![0f32; self.len];
                let mut at = 0;
                for p in &self.pieces {
                    let n = p.end - p.start;
                    flat[p.at..p.at + n].copy_from_slice(&v[at..at + n]);
                    at += n;
                }
                flat
            })
            .collect()
    }

    /// The state this rank holds, as an optimizer loads it.
    pub(crate) fn optimizer_state(&self) -> Option<OptimizerState<'_>> {
        self.optimizer.as_ref().map(|saved| OptimizerState {
            optimizer: saved.name.clone(),
            step: saved.step,
            buffers: (saved.buffers.iter())
                .map(|(n, b)| (n.clone(), &b[..]))
                .collect(),
        })
    }
}

impl Restore for ShardTarget<'_> {
    fn config(&self) -> &GPTConfig {
        self.config
    }

    fn restore(&mut self, dir: &Path) -> Result<bool, TrainError> {
        let ranges: Vec<Range<usize>> = self.pieces.iter().map(|p| p.start..p.end).collect();
        let take = |full: &[f32]| -> Vec<f32> {
            ranges
                .iter()
                .flat_map(|r| full[r.clone()].iter().copied())
                .collect()
        };
        let (params, optimizer) = if let Some(index) = ckpt::read_index(dir)? {
            let names: Vec<&str> = index.buffers.iter().map(String::as_str).collect();
            let mut values = ckpt::read_ranges(dir, &index, &names, &ranges)?;
            let at = names.iter().position(|n| *n == ckpt::PARAMS_BUFFER);
            let params = at
                .map(|i| values.remove(i))
                .ok_or_else(|| CheckpointError::Format {
                    path: dir.join(ckpt::SHARD_INDEX_FILE),
                    reason: format!("no {:?} buffer", ckpt::PARAMS_BUFFER),
                })?;
            let meta = |key: &str| index.metadata.get(key).cloned();
            let optimizer = match (
                meta(trainer_files::SHARDED_OPTIMIZER_KEY),
                meta(trainer_files::SHARDED_STEP_KEY).and_then(|s| s.parse().ok()),
            ) {
                (Some(name), Some(step)) => {
                    let names = (names.iter())
                        .filter(|n| **n != ckpt::PARAMS_BUFFER)
                        .map(|n| n.to_string());
                    Some(SavedOptimizer {
                        name,
                        step,
                        buffers: names.zip(values).collect(),
                    })
                }
                _ => None,
            };
            (params, optimizer)
        } else {
            // DDP's format: the whole model and optimizer file, of which this rank keeps
            // its pieces.
            let mut model = GPT::new(self.config.clone(), 0)?;
            ckpt::load_params_into(dir, &mut model)?;
            let (params, n) = (take(model.params()), model.num_params());
            drop(model);
            let optimizer = match ckpt::read_tensor_file(dir, trainer_files::OPTIMIZER_FILE)? {
                Some(file) => {
                    let field = |key: &str| file.metadata.get(key).cloned();
                    let (Some(name), Some(step)) = (
                        field("optimizer"),
                        field("step").and_then(|s| s.parse().ok()),
                    ) else {
                        return Err(CheckpointError::Format {
                            path: file.path,
                            reason: "metadata has no optimizer or step".into(),
                        }
                        .into());
                    };
                    if let Some((name, b)) = file.tensors.iter().find(|(_, b)| b.len() != n) {
                        return Err(CheckpointError::Format {
                            path: file.path.clone(),
                            reason: format!(
                                "tensor {name:?} has {} elements, the model {n}",
                                b.len()
                            ),
                        }
                        .into());
                    }
                    let buffers = (file.tensors.iter())
                        .map(|(name, full)| (name.clone(), take(full)))
                        .collect::<Vec<_>>();
                    Some(SavedOptimizer {
                        name,
                        step,
                        buffers,
                    })
                }
                None => None,
            };
            (params, optimizer)
        };
        self.params = self.place(vec![params]).swap_remove(0);
        self.optimizer = optimizer.map(|saved| {
            let (names, values): (Vec<String>, Vec<Vec<f32>>) = saved.buffers.into_iter().unzip();
            SavedOptimizer {
                buffers: names.into_iter().zip(self.place(values)).collect(),
                ..saved
            }
        });
        Ok(self.optimizer.is_some())
    }
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
    target: &mut dyn Restore,
) -> Result<TrainState, TrainError> {
    let dir = dir.to_path_buf();
    // A sharded checkpoint's shards are checked as they are read.
    ckpt::verify_except(&dir, |name| is_shard_file(&dir, name))?;
    check_same_model(&dir, target.config())?;
    if !target.restore(&dir)? {
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

/// Whether file `name` of checkpoint `dir` is a shard of a sharded checkpoint (checked as
/// it is read, by the ranks that need it, rather than up front by every rank).
fn is_shard_file(dir: &Path, name: &str) -> bool {
    name.starts_with("shard-") && dir.join(ckpt::SHARD_INDEX_FILE).is_file()
}

/// Writes the checkpoint `from` denotes (a checkpoint directory, or an output directory's
/// latest; sharded or not) as one consolidated checkpoint in `out`: the model in Hugging
/// Face's layout (`config.json`, `model.safetensors`), the whole optimizer state when it has
/// one, and its other files (trainer state, tokenizer files) as they are. The result is a
/// DDP checkpoint that `--resume` continues at any world size and that Hugging Face's
/// `from_pretrained` loads; `out` is written atomically. Returns the directory read.
pub fn consolidate(from: &Path, out: &Path) -> Result<PathBuf, TrainError> {
    let dir = ckpt::resolve(from)?;
    ckpt::verify_except(&dir, |name| is_shard_file(&dir, name))?;
    let (model, _) = ckpt::load_model(&dir)?;
    // The optimizer's buffers, whole: from the shards, or the file as it is.
    let mut optimizer: Option<ckpt::LoadedTensors> = None;
    if let Some(index) = ckpt::read_index(&dir)? {
        if let Some(name) = index.metadata.get(trainer_files::SHARDED_OPTIMIZER_KEY) {
            let names: Vec<&str> = (index.buffers.iter())
                .map(String::as_str)
                .filter(|b| *b != ckpt::PARAMS_BUFFER)
                .collect();
            let values =
                ckpt::read_ranges(&dir, &index, &names, std::slice::from_ref(&(0..index.len)))?;
            let step = (index.metadata.get(trainer_files::SHARDED_STEP_KEY))
                .cloned()
                .unwrap_or_default();
            let metadata = HashMap::from([
                ("optimizer".to_string(), name.clone()),
                ("step".to_string(), step),
            ]);
            optimizer = Some(ckpt::LoadedTensors {
                path: dir.join(ckpt::SHARD_INDEX_FILE),
                metadata,
                tensors: names.iter().map(|n| n.to_string()).zip(values).collect(),
            });
        }
    } else {
        optimizer = ckpt::read_tensor_file(&dir, trainer_files::OPTIMIZER_FILE)?;
    }
    // Every other file as it is, and config.json's keys beyond the model's (a tokenizer's
    // token ids).
    let skip = [
        ckpt::CONFIG_FILE,
        ckpt::MODEL_FILE,
        ckpt::CHECKSUMS_FILE,
        ckpt::SHARD_INDEX_FILE,
        trainer_files::OPTIMIZER_FILE,
    ];
    let mut others: Vec<(String, Vec<u8>)> = Vec::new();
    let mut names: Vec<String> = fs::read_dir(&dir)
        .map_err(|source| CheckpointError::Io {
            op: "list",
            path: dir.clone(),
            source,
        })?
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| !skip.contains(&n.as_str()) && !is_shard_file(&dir, n) && !n.starts_with('.'))
        .collect();
    names.sort();
    for name in names {
        if let Some(bytes) = ckpt::read_file_verified(&dir, &name)? {
            others.push((name, bytes));
        }
    }
    let config_path = dir.join(ckpt::CONFIG_FILE);
    let config: serde_json::Map<String, Value> = ckpt::read_file_verified(&dir, ckpt::CONFIG_FILE)?
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .ok_or_else(|| CheckpointError::Format {
            path: config_path,
            reason: "not a JSON object".into(),
        })?;
    let tensor_files = optimizer
        .iter()
        .map(|file| ckpt::TensorFile {
            name: trainer_files::OPTIMIZER_FILE,
            tensors: (file.tensors.iter())
                .map(|(n, b)| (n.clone(), &b[..]))
                .collect(),
            metadata: file.metadata.clone(),
        })
        .collect();
    ckpt::save_dir(
        out,
        &Checkpoint {
            model: Some(&model),
            tensor_files,
            extra_files: others.iter().map(|(n, b)| (n.as_str(), &b[..])).collect(),
            config_extra: config
                .iter()
                .map(|(k, v)| (k.as_str(), v.clone()))
                .collect(),
        },
    )?;
    Ok(dir)
}

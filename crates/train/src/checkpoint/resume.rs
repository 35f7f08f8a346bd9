//! Resuming a training run: the checkpoint to continue from (`latest`, or
//! the newest intact one before it), checked against the job's shape, read
//! into the whole model and optimizer ([`resume`]) or only into a rank's
//! own shard ([`resume_into`]: a sharded checkpoint is then read only where
//! that shard lies). Either kind of checkpoint resumes under any strategy
//! and world size. This module never resumes ranks from different steps or
//! different checkpoints, and never passes over a checkpoint that belongs
//! to another model or job shape.

use std::ops::Range;
use std::path::{Path, PathBuf};

use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_engine::optim::{Optimizer, OptimizerState};
use cohort_gpt::checkpoint::{self as ckpt, CheckpointError, Piece};
use cohort_gpt::{GPTConfig, GPT};
use serde_json::{json, Value};

use super::layout::{is_shard_file, remap_offset, step_dirs, TrainState, STEP_PREFIX};
use super::trainer_files;
use crate::config::TrainConfig;
use crate::error::TrainError;

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

/// Whether the files of checkpoint `dir` are intact (a sharded checkpoint's shards are
/// checked later, as they are read): the first gate of every candidate, for loading and
/// for [`choose`] alike.
fn check_files(dir: &Path) -> Result<(), TrainError> {
    ckpt::verify_except(dir, |name| is_shard_file(dir, name))?;
    Ok(())
}

/// The checkpoint a resume from `path` reads: the first of its candidates whose files are
/// intact (or that fails for another reason than damage, which loading then reports), as
/// loading walks them. Whoever needs the resumed job's shape before loading (the world-size
/// rescale) reads it here, so that it reads the checkpoint loading reads.
pub(crate) fn choose(path: &Path) -> Result<PathBuf, TrainError> {
    let candidates = candidates(path)?;
    let single = candidates.len() == 1;
    let mut last = None;
    for dir in candidates {
        match check_files(&dir) {
            Err(e) if is_damage(&e) && !single => last = Some(e),
            _ => return Ok(dir),
        }
    }
    Err(TrainError::Resume {
        path: path.to_path_buf(),
        reason: format!(
            "no intact checkpoint in it{}",
            last.map_or(String::new(), |e| format!(": {e}"))
        ),
    })
}

/// The line that says a resume from the output directory `path` goes on from `dir`, an
/// older checkpoint than the one its `latest` names (missing, or damaged); `None` when
/// `dir` is the one `latest` names.
fn fallback_note(path: &Path, dir: &Path) -> Option<String> {
    let named = std::fs::read_to_string(path.join(ckpt::LATEST_FILE)).ok()?;
    let named = named.trim();
    let got = dir.file_name()?.to_string_lossy().into_owned();
    if got.trim_start_matches(".old-") == named {
        return None;
    }
    let step = |name: &str| -> String {
        let n = name.trim_start_matches(".old-");
        n.strip_prefix(STEP_PREFIX)
            .and_then(|s| s.parse::<u64>().ok())
            .map_or_else(|| format!("{n:?}"), |s| s.to_string())
    };
    let missing = ![named.to_string(), format!(".old-{named}")]
        .iter()
        .any(|n| path.join(n).join(ckpt::CONFIG_FILE).is_file());
    Some(format!(
        "{} names step {} which is {}: resuming from step {}",
        path.join(ckpt::LATEST_FILE).display(),
        step(named),
        if missing { "missing" } else { "corrupt" },
        step(&got)
    ))
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
            Ok(state) => {
                // Said first and on one line: the run goes on from an older step than the
                // output directory's `latest` names.
                notes.splice(0..0, fallback_note(path, &dir));
                return Ok(Resumed { state, dir, notes });
            }
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
    let mut differ: Vec<String> = pairs
        .iter()
        .filter(|(_, theirs, ours)| theirs != ours)
        .map(|(key, theirs, ours)| format!("{key} {theirs} in its config.json, {ours} in this run"))
        .collect();
    // The family's axes (a Llama resumed as a GPT-2 would load no tensor by name).
    let axes = |c: &GPTConfig| {
        format!(
            "{:?} / {:?} / {:?} / {} key/value heads / qkv bias {}",
            c.norm,
            c.positions,
            c.mlp,
            c.kv_heads(),
            c.has_qkv_bias()
        )
    };
    if axes(&stored) != axes(run) {
        differ.push(format!(
            "architecture {} in its config.json, {} in this run",
            axes(&stored),
            axes(run)
        ));
    }
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
    check_files(&dir)?;
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
        Some(from) => remap_offset(offset as usize, from, world),
        None => offset as usize,
    };
    Ok(TrainState {
        step: trainer.step,
        epoch,
        offset,
    })
}

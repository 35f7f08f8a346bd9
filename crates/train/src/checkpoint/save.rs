//! Saving a training run: the model through `cohort_gpt::checkpoint`
//! (atomic writes, a checksum of every file) with the optimizer's state and the
//! trainer's position as further files, whole by rank 0
//! ([`save_or_report`], DDP's format) or sharded by every rank
//! ([`save_sharded`], the ZeRO stages), and the pruning of old checkpoints.
//! A failed save is reported, never returned: the loop decides what it
//! costs. This module never deletes the checkpoint `latest` names.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use cohort_comm::ProcessGroup;
use cohort_engine::optim::{Optimizer, OptimizerState};
use cohort_gpt::checkpoint::{
    self as ckpt, Checkpoint, Piece, ShardIndex, ShardRecord, TensorFile,
};
use cohort_gpt::{GPTConfig, GPT};
use serde_json::json;

use super::layout::{step_dirs, step_name, TrainState};
use super::trainer_files::{self, TrainerState};
use crate::config::TrainConfig;
use crate::error::TrainError;

/// What a checkpoint stores beside the model's tensors: the trainer's position and job shape
/// (`trainer_state.json`) and, with a tokenizer, what Hugging Face needs beside the model to
/// load the checkpoint without a warning.
pub(super) struct Companions {
    trainer: Vec<u8>,
    tokenizer_json: Option<String>,
    hf: cohort_tokenizer::HfFiles,
}

impl Companions {
    pub(super) fn new(
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
        // The schedule's length, so that a resume with more --steps can say it re-lays it.
        extra.insert("lr_decay_steps".into(), json!(cfg.decay_steps()));
        let trainer = trainer_files::trainer_state_json(&TrainerState {
            step: state.step,
            seed: cfg.seed,
            extra,
        });
        let hf = match tokenizer_json {
            Some(json) => {
                let tokenizer = cohort_tokenizer::Tokenizer::from_json(json)?;
                // A model fine-tuned from a directory keeps what that directory says of its
                // special tokens (SmolLM2's `<|im_end|>` eos, Llama 3's list of eos ids), so it
                // stops where its origin did.
                let (tokenizer_config, generation) = crate::input::model_dir_files(cfg)?;
                let hf = cohort_tokenizer::hf_files(&tokenizer, model.max_position_embeddings)
                    .carrying(&tokenizer, tokenizer_config.as_ref(), generation.as_ref());
                // A run on conversations keeps the template they were rendered with, so the
                // checkpoint chats (`/v1/chat/completions`) as the data was written.
                match crate::input::chat_template_source(cfg)? {
                    Some((template, eos)) => {
                        hf.with_chat_template(&tokenizer, template, eos.as_deref())
                    }
                    None => hf,
                }
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

/// Writes `out/step-NNNNNN` (and points `out/latest` at it) from `model`, the optimizer's
/// file (`optimizer`) and the `companions`, then deletes the checkpoints beyond `keep`: what a
/// save does once its state is at hand, on the training thread or on the writer's
/// (`background`). A failure is reported, not returned.
pub(super) fn write_and_prune(
    out: &Path,
    keep: usize,
    step: u64,
    model: &GPT,
    optimizer: TensorFile<'_>,
    companions: &Companions,
) -> SaveReport {
    let written = ckpt::save(
        out,
        &step_name(step),
        &Checkpoint {
            config_extra: companions.hf.config_keys.clone(),
            model: Some(model),
            tensor_files: vec![optimizer],
            extra_files: companions.files(),
        },
    );
    if let Err(e) = written {
        return failed_save(out, step, e);
    }
    SaveReport {
        lines: prune(out, keep),
        ..SaveReport::default()
    }
}

/// The report of a save that failed, naming the last good checkpoint.
pub(super) fn failed_save(out: &Path, step: u64, why: impl std::fmt::Display) -> SaveReport {
    let last = ckpt::resolve(out)
        .map(|dir| dir.display().to_string())
        .unwrap_or_else(|_| "none".into());
    SaveReport {
        failed: Some(format!(
            "checkpoint of step {step} NOT saved (last good checkpoint: {last}): {why}"
        )),
        ..SaveReport::default()
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
/// succeeded, the file's size, its tensors' length and its CRC-32C.
const RECORD_WORDS: usize = 4;

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
        // A shard is written with a CRC-32C; should it ever not be, the save fails.
        Ok(record) => match ckpt::digest_crc32c(&record.digest) {
            Some(crc) => {
                mine = [1, record.bytes as i64, record.len as i64, i64::from(crc)];
            }
            None => eprintln!(
                "[rank{rank}]: checkpoint of step {}: shard digest {:?} is no CRC-32C",
                state.step, record.digest
            ),
        },
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
                digest: ckpt::crc32c_digest(w[3] as u32),
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
        ..SaveReport::default()
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
    /// The state was copied and a writer thread is writing it (`background`): whether it
    /// failed is known later, from [`super::Saver::finished`].
    pub pending: bool,
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
/// beyond `cfg.keep_checkpoints`, on this thread; a failure is reported, not
/// returned, so that the caller (with the other ranks) decides what it costs.
pub(super) fn save_or_report(
    out: &Path,
    cfg: &TrainConfig,
    world: usize,
    model: &GPT,
    opt: &dyn Optimizer,
    state: &TrainState,
    tokenizer_json: Option<&str>,
) -> SaveReport {
    let optimizer = opt.state();
    let file = trainer_files::optimizer_file(&optimizer);
    save_file_or_report(out, cfg, world, model, file, state, tokenizer_json)
}

/// [`save_or_report`] with the optimizer's file as the caller made it (DiLoCo's holds its
/// outer state and every rank's inner state beside rank 0's AdamW state).
pub(crate) fn save_file_or_report(
    out: &Path,
    cfg: &TrainConfig,
    world: usize,
    model: &GPT,
    optimizer: TensorFile<'_>,
    state: &TrainState,
    tokenizer_json: Option<&str>,
) -> SaveReport {
    match Companions::new(cfg, world, model.config(), state, tokenizer_json) {
        Ok(companions) => write_and_prune(
            out,
            cfg.keep_checkpoints,
            state.step,
            model,
            optimizer,
            &companions,
        ),
        Err(e) => failed_save(out, state.step, e),
    }
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

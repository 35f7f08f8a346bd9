//! Saving and resuming a training run: the model and optimizer through
//! `cohort_gpt::checkpoint` (Hugging Face GPT-2 format, atomic writes), plus
//! the trainer's position (step, epoch, offset in the epoch's sample order)
//! and the shape of the job that produced it. Resuming restores all of it, so
//! the run continues bitwise as if it had never stopped: the learning rate
//! and dropout keys are functions of the step, the data of (epoch, offset).
//! Only rank 0 calls [`save`]; every rank calls [`load`].

use crate::config::TrainConfig;
use crate::TrainError;
use cohort_engine::optim::Optimizer;
use cohort_gpt::checkpoint::{self as ckpt, Checkpoint, TrainerState};
use cohort_gpt::GPT;
use serde_json::{json, Value};
use std::path::Path;

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
pub fn save(
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
    let name = format!("step-{:06}", state.step);
    ckpt::save(
        out,
        &name,
        &Checkpoint {
            model: Some(model),
            optimizer: Some(opt),
            trainer_state: Some(&trainer),
            extra_files: tokenizer_json
                .map(|json| vec![(cohort_tokenizer::TOKENIZER_FILE, json.as_bytes())])
                .unwrap_or_default(),
        },
    )?;
    Ok(())
}

/// Restores model, optimizer and position from the checkpoint at `dir` (a
/// checkpoint directory or a root with `latest`). The job must have the
/// shape that wrote it (world size, batch, accumulation, seed, data), or the
/// data order would silently differ: that is an error naming the setting.
pub fn load(
    dir: &Path,
    cfg: &TrainConfig,
    world: usize,
    model: &mut GPT,
    opt: &mut dyn Optimizer,
) -> Result<TrainState, TrainError> {
    let dir = ckpt::resolve(dir)?;
    ckpt::load_params_into(&dir, model)?;
    if !ckpt::load_optimizer_into(&dir, opt)? {
        return Err(TrainError::Resume {
            path: dir,
            reason: "it has no optimizer state (a model-only checkpoint cannot be resumed; \
                     start a new run from it instead)"
                .into(),
        });
    }
    let trainer = ckpt::load_trainer_state(&dir)?.ok_or_else(|| TrainError::Resume {
        path: dir.clone(),
        reason: "it has no trainer_state.json".into(),
    })?;
    let expect = [
        ("world_size", json!(world)),
        ("batch_size", json!(cfg.batch_size)),
        ("grad_accum", json!(cfg.grad_accum)),
        ("data", json!(cfg.data)),
    ];
    for (key, want) in expect {
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
    Ok(TrainState {
        step: trainer.step,
        epoch,
        offset: offset as usize,
    })
}

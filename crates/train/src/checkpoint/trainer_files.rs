//! What a trainer stores in a checkpoint beside the model: its optimizer's state
//! (`optimizer.safetensors`: every state buffer, with the optimizer's name and step) and its
//! position (`trainer_state.json`: step, seed and whatever else the run keeps). They go through
//! cohort-gpt's checkpoint files, so they are written, checksummed and replaced together with the
//! model, and the model crate never learns what an optimizer is.

use std::collections::HashMap;
use std::path::Path;

use cohort_engine::optim::{Optimizer, OptimizerState};
use cohort_gpt::checkpoint::{self as ckpt, CheckpointError, TensorFile};
use serde::{Deserialize, Serialize};

use crate::error::TrainError;

/// The optimizer's state buffers.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The trainer's position.
pub const TRAINER_STATE_FILE: &str = "trainer_state.json";

/// Where the trainer is: enough to continue as if it had not stopped. `extra` keeps any other
/// fields the trainer writes (data position, epoch, ...), round-tripped untouched.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed (the schedule's position: the next step runs `lr(step)`).
    pub step: u64,
    /// The run's seed (data order, dropout keys).
    pub seed: u64,
    /// Everything else the trainer keeps.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// The optimizer's state as a checkpoint tensor file.
pub fn optimizer_file<'a>(state: &OptimizerState<'a>) -> TensorFile<'a> {
    TensorFile {
        name: OPTIMIZER_FILE,
        tensors: state.buffers.clone(),
        metadata: HashMap::from([
            ("optimizer".to_string(), state.optimizer.clone()),
            ("step".to_string(), state.step.to_string()),
        ]),
    }
}

/// `trainer_state.json`'s bytes.
pub fn trainer_state_json(state: &TrainerState) -> Vec<u8> {
    serde_json::to_vec_pretty(state).expect("a TrainerState always serialises")
}

/// Restores `opt` from `dir/optimizer.safetensors`. Returns false, leaving `opt` untouched, when
/// the checkpoint has no optimizer state (e.g. a Hugging Face model to fine-tune).
pub fn load_optimizer_into(dir: &Path, opt: &mut dyn Optimizer) -> Result<bool, TrainError> {
    let Some(file) = ckpt::read_tensor_file(dir, OPTIMIZER_FILE)? else {
        return load_sharded_optimizer_into(dir, opt);
    };
    let format = |reason: String| CheckpointError::Format {
        path: file.path.clone(),
        reason,
    };
    let field = |key: &str| {
        file.metadata
            .get(key)
            .cloned()
            .ok_or_else(|| format(format!("metadata has no {key:?}")))
    };
    let optimizer = field("optimizer")?;
    let step: u64 = field("step")?
        .parse()
        .map_err(|e| format(format!("metadata step: {e}")))?;
    let state = OptimizerState {
        optimizer,
        step,
        buffers: file
            .tensors
            .iter()
            .map(|(n, b)| (n.clone(), b.as_slice()))
            .collect(),
    };
    opt.load_state(&state).map_err(|e| TrainError::Resume {
        path: file.path.clone(),
        reason: e.to_string(),
    })?;
    Ok(true)
}

/// The index metadata keys of a sharded checkpoint's optimizer: its name and step (the
/// moments themselves are buffers of the shards, named as the optimizer names them).
pub(crate) const SHARDED_OPTIMIZER_KEY: &str = "optimizer";
pub(crate) const SHARDED_STEP_KEY: &str = "optimizer_step";

/// Restores `opt` (over the whole model) from the shards of the sharded checkpoint `dir`.
/// Returns false when `dir` is not sharded or its shards hold no optimizer state.
fn load_sharded_optimizer_into(dir: &Path, opt: &mut dyn Optimizer) -> Result<bool, TrainError> {
    let Some(index) = ckpt::read_index(dir)? else {
        return Ok(false);
    };
    let Some(optimizer) = index.metadata.get(SHARDED_OPTIMIZER_KEY) else {
        return Ok(false);
    };
    let path = dir.join(ckpt::SHARD_INDEX_FILE);
    let step: u64 = (index.metadata.get(SHARDED_STEP_KEY))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| CheckpointError::Format {
            path: path.clone(),
            reason: format!("metadata has no numeric {SHARDED_STEP_KEY:?}"),
        })?;
    let names: Vec<&str> = (index.buffers.iter())
        .map(String::as_str)
        .filter(|b| *b != ckpt::PARAMS_BUFFER)
        .collect();
    let values = ckpt::read_ranges(dir, &index, &names, std::slice::from_ref(&(0..index.len)))?;
    let state = OptimizerState {
        optimizer: optimizer.clone(),
        step,
        buffers: names
            .iter()
            .zip(&values)
            .map(|(n, b)| (n.to_string(), b.as_slice()))
            .collect(),
    };
    opt.load_state(&state).map_err(|e| TrainError::Resume {
        path,
        reason: e.to_string(),
    })?;
    Ok(true)
}

/// The trainer state in `dir`, if the checkpoint has one.
pub fn load_trainer_state(dir: &Path) -> Result<Option<TrainerState>, CheckpointError> {
    let Some(bytes) = ckpt::read_file_verified(dir, TRAINER_STATE_FILE)? else {
        return Ok(None);
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| CheckpointError::Format {
            path: dir.join(TRAINER_STATE_FILE),
            reason: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_engine::optim::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule, Sgd, SgdConfig};
    use cohort_gpt::checkpoint::Checkpoint;
    use cohort_gpt::optim_groups::decay_mask;
    use cohort_gpt::{GPTConfig, GPT};

    fn tiny() -> GPTConfig {
        GPTConfig {
            vocab_size: 11,
            max_position_embeddings: 8,
            n_layers: 2,
            n_heads: 2,
            d_model: 8,
            d_ff: 16,
            dropout: 0.0,
            ..GPTConfig::default()
        }
    }

    fn save_trainer(
        root: &Path,
        name: &str,
        model: &GPT,
        opt: &dyn Optimizer,
        state: &TrainerState,
    ) -> std::path::PathBuf {
        let optimizer = opt.state();
        let json = trainer_state_json(state);
        ckpt::save(
            root,
            name,
            &Checkpoint {
                config_extra: Vec::new(),
                model: Some(model),
                tensor_files: vec![optimizer_file(&optimizer)],
                extra_files: vec![(TRAINER_STATE_FILE, &json)],
            },
        )
        .unwrap()
    }

    #[test]
    fn optimizer_and_trainer_state_round_trip() {
        let root = tempfile::tempdir().unwrap();
        let mut model = GPT::new(tiny(), 3).unwrap();
        let mut opt = AdamW::new(AdamWConfig::default(), decay_mask(model.param_views())).unwrap();
        let grads: Vec<f32> = (0..model.num_params())
            .map(|i| (i % 7) as f32 - 3.0)
            .collect();
        opt.step(model.params_mut(), &grads, 1e-3).unwrap();
        opt.step(model.params_mut(), &grads, 1e-3).unwrap();
        let mut extra = serde_json::Map::new();
        extra.insert("epoch".into(), 4.into());
        let state = TrainerState {
            step: 2,
            seed: 1234,
            extra,
        };
        let dir = save_trainer(root.path(), "step-2", &model, &opt, &state);
        let mut fresh =
            AdamW::new(AdamWConfig::default(), decay_mask(model.param_views())).unwrap();
        assert!(load_optimizer_into(&dir, &mut fresh).unwrap());
        assert_eq!(fresh.steps_taken(), 2);
        assert_eq!(fresh.exp_avg(), opt.exp_avg());
        assert_eq!(fresh.exp_avg_sq(), opt.exp_avg_sq());
        assert_eq!(load_trainer_state(&dir).unwrap(), Some(state));

        // state for another optimizer is refused, naming the file; a model-only checkpoint
        // has neither file
        let mut sgd = Sgd::new(
            SgdConfig {
                momentum: 0.9,
                ..Default::default()
            },
            decay_mask(model.param_views()),
        )
        .unwrap();
        let err = load_optimizer_into(&dir, &mut sgd).unwrap_err();
        assert!(matches!(err, TrainError::Resume { .. }), "{err}");
        assert!(err.to_string().contains(OPTIMIZER_FILE), "{err}");
        let bare = ckpt::save(
            root.path(),
            "bare",
            &Checkpoint {
                model: Some(&model),
                ..Default::default()
            },
        )
        .unwrap();
        assert!(!load_optimizer_into(&bare, &mut fresh).unwrap());
        assert_eq!(load_trainer_state(&bare).unwrap(), None);
    }

    /// The batch of step `step`: deterministic ids, labels = ids (the model shifts).
    fn batch(step: u64, b: usize, t: usize, v: usize) -> (Vec<u32>, Vec<i32>) {
        let ids: Vec<u32> = (0..b * t)
            .map(|i| ((step as usize * 7 + i * 3 + i / t) % v) as u32)
            .collect();
        let labels = ids.iter().map(|&x| x as i32).collect();
        (ids, labels)
    }

    /// One training step as the trainer runs it: dropout keyed by step, clip, AdamW on a
    /// warmup + cosine schedule.
    fn train_step(model: &mut GPT, opt: &mut AdamW, sched: &LrSchedule, step: u64) -> f32 {
        let (b, t) = (3, 8);
        let (ids, labels) = batch(step, b, t, model.config().vocab_size);
        model.set_dropout_key(77, 0, step);
        model.zero_grad();
        let loss = model
            .forward(
                cohort_gpt::Forward::new(&ids, b, t).labels(cohort_gpt::Labels::Aligned(&labels)),
            )
            .unwrap()
            .unwrap();
        model.backward(cohort_gpt::Backward::new()).unwrap();
        clip_grad_norm(model.grads_mut(), 1.0).unwrap();
        let (p, g) = model.params_and_grads_mut();
        opt.step(p, g, sched.lr(step)).unwrap();
        loss
    }

    #[test]
    fn save_load_continue_gives_bitwise_the_same_losses() {
        let cfg = GPTConfig {
            dropout: 0.1,
            ..tiny()
        };
        let sched = LrSchedule::warmup_cosine(3e-2, 3e-3, 2, 8).unwrap();
        let new_opt =
            |m: &GPT| AdamW::new(AdamWConfig::default(), decay_mask(m.param_views())).unwrap();

        let mut model = GPT::new(cfg.clone(), 5).unwrap();
        let mut opt = new_opt(&model);
        let straight: Vec<f32> = (0..8)
            .map(|s| train_step(&mut model, &mut opt, &sched, s))
            .collect();
        assert!(
            straight[7] < straight[0],
            "training makes progress: {straight:?}"
        );

        let root = tempfile::tempdir().unwrap();
        let mut first = GPT::new(cfg, 5).unwrap();
        let mut opt1 = new_opt(&first);
        let mut resumed: Vec<f32> = (0..4)
            .map(|s| train_step(&mut first, &mut opt1, &sched, s))
            .collect();
        let state = TrainerState {
            step: 4,
            seed: 77,
            ..Default::default()
        };
        let optimizer = opt1.state();
        let json = trainer_state_json(&state);
        ckpt::save(
            root.path(),
            "step-4",
            &Checkpoint {
                config_extra: Vec::new(),
                model: Some(&first),
                tensor_files: vec![optimizer_file(&optimizer)],
                extra_files: vec![(TRAINER_STATE_FILE, &json)],
            },
        )
        .unwrap();
        drop((first, opt1));

        let (mut second, dir) = ckpt::load_model(root.path()).unwrap();
        let mut opt2 = new_opt(&second);
        assert!(load_optimizer_into(&dir, &mut opt2).unwrap());
        let state = load_trainer_state(&dir).unwrap().unwrap();
        resumed.extend((state.step..8).map(|s| train_step(&mut second, &mut opt2, &sched, s)));

        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&resumed),
            bits(&straight),
            "{resumed:?} vs {straight:?}"
        );
        assert_eq!(second.params(), model.params());
    }
}

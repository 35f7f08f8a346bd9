//! `cohort checkpoint consolidate`: a sharded checkpoint (or any) written
//! again as one DDP checkpoint that Hugging Face's `from_pretrained` loads.
//! It never changes the checkpoint it reads.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use cohort_gpt::checkpoint::{self as ckpt, Checkpoint, CheckpointError};
use serde_json::Value;

use super::layout::is_shard_file;
use super::trainer_files;
use crate::error::TrainError;

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
        ckpt::SHA256SUMS_FILE,
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

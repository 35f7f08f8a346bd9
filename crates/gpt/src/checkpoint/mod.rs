//! Checkpoints in Hugging Face GPT-2 format, written so that a crash never costs the last good one.
//!
//! A checkpoint is a directory:
//!
//! ```text
//! ROOT/latest                  name of the newest complete checkpoint ("step-000100")
//! ROOT/step-000100/
//!     config.json              GPT-2's config (model_type "gpt2", n_embd, n_layer, ...)
//!     model.safetensors        GPT-2's tensor names and shapes (GPT2Model's, no prefix)
//!     *.safetensors, *.json    optional further files the caller hands in (a trainer's
//!                              optimizer.safetensors and trainer_state.json, vocab.json, ...)
//!     CHECKSUMS                CRC-32C and size of every file above (written last; older
//!                              checkpoints have SHA256SUMS, SHA-256 in `sha256sum` format)
//! ```
//!
//! A sharded checkpoint (written by several ranks at once, see `sharded.rs`) has the same
//! directory and files, but `shards.json` and one `shard-RRRRR-of-WWWWW.safetensors` per rank in
//! place of `model.safetensors`; `load_params_into` and [`load_model`] read either kind.
//!
//! `config.json` + `model.safetensors` are exactly what `GPT2LMHeadModel.from_pretrained(dir)`
//! reads (Conv1D weights stored `[in, out]`, as our flat layout already is), and loading accepts
//! what Hugging Face writes: the `transformer.` prefix, the `attn.bias` / `attn.masked_bias`
//! buffers of older files, a tied `lm_head.weight` copy.
//!
//! Atomicity: a checkpoint is written into `ROOT/.tmp-NAME`, every file fsynced, the directory
//! fsynced, then renamed to `ROOT/NAME`, `ROOT` fsynced, and only then is `latest` replaced (temp
//! file, fsync, rename, fsync). A crash at any point leaves the previous checkpoint and a `latest`
//! naming a complete one. Replacing a checkpoint of the same name moves the old one to
//! `ROOT/.old-NAME` first; if a crash strikes before the new one is in place, [`resolve`] falls
//! back to it. A save that fails (disk full, permissions) removes its temp directory and leaves
//! the previous checkpoints and `latest` as they were.
//!
//! Verification: `CHECKSUMS` is written after every other file, so a checkpoint that has it was
//! written whole. Every reader here checks the bytes it read against it and reports a mismatch
//! as [`CheckpointError::Corrupt`], naming the file. The sums are computed as the files are
//! written (see `integrity.rs` for why CRC-32C suffices, and for `SHA256SUMS`, the format of
//! older checkpoints, which every reader still checks; `sha256sum -c SHA256SUMS` checks those
//! by hand). Directories with neither (Hugging Face downloads, checkpoints of the oldest
//! versions) load unverified.
//!
//! The rest of the family (Llama, Qwen2: RMSNorm, RoPE, SwiGLU, grouped key/value heads) is
//! written and read in Hugging Face's `LlamaForCausalLM` / `Qwen2ForCausalLM` format instead
//! (`hf_llama.rs`: their config.json, their tensor names, [out, in] matrices, a sharded
//! `model.safetensors.index.json` and bf16/f16 weights read too).
//!
//! This module must never write a file in place, never load a tensor whose name, dtype or shape
//! differs from what the config expects, and never hand out bytes that contradict the checksums.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorInfo};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::{GPTConfig, GptError, ParamView, GPT};

#[cfg(test)]
mod checksum_tests;
#[cfg(test)]
mod cpu_cost;
mod further_files;
mod hf_config;
mod hf_llama;
mod integrity;
mod sharded;
mod tensors;
#[cfg(test)]
mod tests;

use further_files::*;
use hf_config::*;
use hf_llama::*;
use integrity::*;
use sharded::*;
use tensors::*;

pub use further_files::{read_file_verified, read_tensor_file, LoadedTensors, TensorFile};
pub use hf_config::load_config;
pub use hf_llama::INDEX_FILE;
pub use integrity::{verify, verify_except, write_file_atomic, SHA256SUMS_FILE};
pub use sharded::{
    abort_sharded, begin_sharded, commit_sharded, crc32c_digest, digest_crc32c, read_index,
    read_ranges, shard_file_name, staging_dir, write_shard, Piece, ShardIndex, ShardRecord,
    PARAMS_BUFFER, SHARD_INDEX_FILE,
};
pub use tensors::load_params_into;

/// The model's configuration, in Hugging Face's format.
pub const CONFIG_FILE: &str = "config.json";
/// The parameters.
pub const MODEL_FILE: &str = "model.safetensors";
/// In a checkpoint root: the name of the newest complete checkpoint.
pub const LATEST_FILE: &str = "latest";
/// The CRC-32C and size of every other file of a checkpoint (format 2; older checkpoints have
/// [`SHA256SUMS_FILE`] instead, still read).
pub const CHECKSUMS_FILE: &str = "CHECKSUMS";

/// What went wrong saving or loading a checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A file-system operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (`create`, `write`, `rename`, `fsync`, `read`, ...).
        op: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A file is not valid safetensors / JSON, or holds values we cannot use.
    #[error("{path}: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// `config.json` describes a model this implementation does not compute.
    #[error("{path}: unsupported {field} = {value}: {reason}")]
    UnsupportedConfig {
        /// The file.
        path: PathBuf,
        /// The config key.
        field: &'static str,
        /// Its value.
        value: String,
        /// Why it is unsupported.
        reason: &'static str,
    },
    /// The file has no tensor of this name, which the config needs.
    #[error("{path}: missing tensor(s) {names:?}")]
    MissingTensors {
        /// The file.
        path: PathBuf,
        /// The names expected but absent.
        names: Vec<String>,
    },
    /// The file has a tensor the config does not know.
    #[error("{path}: unexpected tensor {name:?} (not part of a model with this config)")]
    UnexpectedTensor {
        /// The file.
        path: PathBuf,
        /// The tensor's name as stored.
        name: String,
    },
    /// A tensor's shape differs from the config's.
    #[error("{path}: tensor {name:?} has shape {found:?}, the config expects {expected:?}")]
    ShapeMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape stored.
        found: Vec<usize>,
    },
    /// A tensor is not f32.
    #[error("{path}: tensor {name:?} has dtype {found}, expected F32")]
    DtypeMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The stored dtype.
        found: String,
    },
    /// The file stores an `lm_head.weight` that differs from `wte.weight` but the config ties them.
    #[error(
        "{path}: lm_head.weight differs from wte.weight but config.json has tie_word_embeddings"
    )]
    UntiedHead {
        /// The file.
        path: PathBuf,
    },
    /// A file's bytes contradict the checkpoint's checksums (`CHECKSUMS`, or an older
    /// checkpoint's `SHA256SUMS`, or a shard index): it was truncated, overwritten or damaged
    /// after the checkpoint was written.
    #[error(
        "{path}: corrupt: {what} {found} does not match {expected} in {list} \
         ({size} bytes; truncated or damaged after it was written)"
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What differs: the digest's algorithm (`CRC-32C`, `SHA-256`) or `size`.
        what: &'static str,
        /// What the checksums record (a digest as written there, or a size).
        expected: String,
        /// What the bytes read have.
        found: String,
        /// The file that records it.
        list: &'static str,
        /// The file's size.
        size: u64,
    },
    /// No checkpoint at this path: neither a `config.json` nor a `latest` pointer.
    #[error(
        "{path}: not a checkpoint (no {CONFIG_FILE}) nor a checkpoint root (no {LATEST_FILE})"
    )]
    NotACheckpoint {
        /// The path given.
        path: PathBuf,
    },
    /// A checkpoint name that is not a plain directory name.
    #[error("invalid checkpoint name {name:?}: must be a non-empty plain file name")]
    BadName {
        /// The name given.
        name: String,
    },
    /// A shard of a sharded checkpoint is missing, damaged or unreadable.
    #[error("shard of rank {rank} of {world}: {source}")]
    Shard {
        /// The rank that wrote it.
        rank: usize,
        /// The world size of the run that wrote the checkpoint.
        world: usize,
        /// What is wrong with its file (naming it).
        source: Box<CheckpointError>,
    },
    /// Building the model failed.
    #[error(transparent)]
    Model(#[from] GptError),
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.to_path_buf();
    move |source| CheckpointError::Io { op, path, source }
}

fn format_err(path: &Path, reason: impl ToString) -> CheckpointError {
    CheckpointError::Format {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// What to save. Only `model` is required.
#[derive(Default)]
pub struct Checkpoint<'a> {
    /// The model: config.json + model.safetensors.
    pub model: Option<&'a GPT>,
    /// Further safetensors files of flat f32 tensors (a trainer's optimizer state).
    pub tensor_files: Vec<TensorFile<'a>>,
    /// Further files (name, bytes), e.g. `vocab.json` or a trainer's state.
    pub extra_files: Vec<(&'a str, &'a [u8])>,
    /// Further keys of config.json that the model does not know but Hugging Face reads
    /// (`bos_token_id`, `eos_token_id`, `pad_token_id`: a tokenizer's); a key the model writes
    /// itself cannot be overridden.
    pub config_extra: Vec<(&'a str, serde_json::Value)>,
}

/// Writes every file of `ckpt` into the fresh directory `dir`, `CHECKSUMS` last, and fsyncs
/// them and `dir`.
fn write_files(dir: &Path, ckpt: &Checkpoint<'_>) -> Result<(), CheckpointError> {
    let mut written: Vec<(String, Sum)> = Vec::new();
    if let Some(model) = ckpt.model {
        written.extend(write_model_files(dir, model, &ckpt.config_extra)?);
    }
    let bad_name = |file: &str, written: &[(String, Sum)]| {
        file.is_empty()
            || file.contains(['/', '\\'])
            || file.starts_with('.')
            || file == CHECKSUMS_FILE
            || file == SHA256SUMS_FILE
            || written.iter().any(|(w, _)| w == file)
    };
    for file in &ckpt.tensor_files {
        if bad_name(file.name, &written) {
            return Err(CheckpointError::BadName {
                name: file.name.to_string(),
            });
        }
        let sum = write_tensor_file(dir, file)?;
        written.push((file.name.to_string(), sum));
    }
    for (file, bytes) in &ckpt.extra_files {
        if bad_name(file, &written) {
            return Err(CheckpointError::BadName {
                name: file.to_string(),
            });
        }
        let sum = write_bytes(&dir.join(file), bytes)?;
        written.push((file.to_string(), sum));
    }
    write_checksums(dir, &written)?;
    fsync(dir)
}

/// Writes the checkpoint `name` under `root` atomically and points `root/latest` at it; returns
/// its directory. See the module docs for the crash guarantees.
pub fn save(root: &Path, name: &str, ckpt: &Checkpoint<'_>) -> Result<PathBuf, CheckpointError> {
    if name.is_empty()
        || name == "."
        || name == ".."
        || name.starts_with('.')
        || name.contains(['/', '\\'])
        || name == LATEST_FILE
    {
        return Err(CheckpointError::BadName { name: name.into() });
    }
    let dest = root.join(name);
    save_dir(&dest, ckpt)?;
    write_file_atomic(&root.join(LATEST_FILE), format!("{name}\n").as_bytes())?;
    Ok(dest)
}

/// Writes the checkpoint into `dest` itself, atomically (a sibling temporary directory renamed
/// over it), with no `latest` pointer: a model directory as Hugging Face's `save_pretrained`
/// writes one.
pub fn save_dir(dest: &Path, ckpt: &Checkpoint<'_>) -> Result<(), CheckpointError> {
    let (root, name) = match (dest.parent(), dest.file_name().and_then(|n| n.to_str())) {
        (Some(root), Some(name)) if !name.starts_with('.') => (root, name),
        _ => {
            return Err(CheckpointError::BadName {
                name: dest.display().to_string(),
            })
        }
    };
    let root = if root.as_os_str().is_empty() {
        Path::new(".")
    } else {
        root
    };
    fs::create_dir_all(root).map_err(io("create", root))?;
    let tmp = root.join(format!(".tmp-{name}"));
    if tmp.exists() {
        // Left by a save that crashed; never referenced by `latest`.
        fs::remove_dir_all(&tmp).map_err(io("remove", &tmp))?;
    }
    fs::create_dir(&tmp).map_err(io("create", &tmp))?;
    if let Err(e) = write_files(&tmp, ckpt) {
        // A full disk is the usual cause: give the space back. Failing to is not worth
        // reporting over the write error; the next save of this name removes the rest.
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }

    install(root, name, &tmp, dest)
}

/// Moves the complete checkpoint `tmp` into `dest` (`root/name`), keeping a checkpoint already
/// there as `root/.old-NAME` until the new one is in place, and fsyncs `root`.
fn install(root: &Path, name: &str, tmp: &Path, dest: &Path) -> Result<(), CheckpointError> {
    let old = root.join(format!(".old-{name}"));
    if dest.exists() {
        if old.exists() {
            fs::remove_dir_all(&old).map_err(io("remove", &old))?;
        }
        fs::rename(dest, &old).map_err(io("rename", dest))?;
    }
    fs::rename(tmp, dest).map_err(io("rename", tmp))?;
    fsync(root)?;
    // The old copy, moved aside above or by a replace that crashed, is superseded now.
    if old.exists() {
        fs::remove_dir_all(&old).map_err(io("remove", &old))?;
    }
    Ok(())
}

/// The checkpoint directory `path` denotes: `path` itself when it holds a `config.json`, else the
/// one its `latest` pointer names (or that one's `.old-` copy, left by a crash mid-replace).
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    if path.join(CONFIG_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join(LATEST_FILE);
    let name = match fs::read_to_string(&latest) {
        Ok(s) => s.trim().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CheckpointError::NotACheckpoint {
                path: path.to_path_buf(),
            })
        }
        Err(e) => return Err(io("read", &latest)(e)),
    };
    for dir in [path.join(&name), path.join(format!(".old-{name}"))] {
        if dir.join(CONFIG_FILE).is_file() {
            return Ok(dir);
        }
    }
    Err(format_err(
        &latest,
        format!("names checkpoint {name:?}, which has no {CONFIG_FILE}"),
    ))
}

/// Builds the model a checkpoint describes (`path`: a checkpoint directory or a root with a
/// `latest` pointer) and loads its parameters. Returns the model and the resolved directory.
pub fn load_model(path: &Path) -> Result<(GPT, PathBuf), CheckpointError> {
    let dir = resolve(path)?;
    let cfg = load_config(&dir)?;
    let mut model = GPT::new(cfg, 0)?;
    load_params_into(&dir, &mut model)?;
    Ok((model, dir))
}

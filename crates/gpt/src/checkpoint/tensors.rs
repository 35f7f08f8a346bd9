//! The tensors: model.safetensors written from the flat parameter buffer under GPT-2's names,
//! and read back with every name, dtype and shape checked against the model's layout. It never
//! loads a tensor whose name, dtype or shape does not match: a mismatch is an error, not a cast.

use super::*;

/// A borrowed f32 tensor for the safetensors writer (little-endian, as the format requires).
pub(super) struct F32View<'a> {
    pub(super) shape: Vec<usize>,
    pub(super) data: &'a [f32],
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        // One tensor at a time is converted, so the copy costs one tensor's size, not the model's.
        Cow::Owned(self.data.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
    fn data_len(&self) -> usize {
        self.data.len() * 4
    }
}

/// Writes a safetensors file at `path` and fsyncs it.
pub(super) fn write_safetensors(
    path: &Path,
    tensors: Vec<(String, F32View<'_>)>,
    metadata: HashMap<String, String>,
) -> Result<(), CheckpointError> {
    safetensors::serialize_to_file(tensors, Some(metadata), path).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(source) => CheckpointError::Io {
            op: "write",
            path: path.to_path_buf(),
            source,
        },
        other => format_err(path, other),
    })?;
    // safetensors writes through a temp file, which is created 0600: give
    // the file the mode every other file of the checkpoint has.
    let mode = 0o666 & !process_umask();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode)).map_err(
        |source| CheckpointError::Io {
            op: "set the mode of",
            path: path.to_path_buf(),
            source,
        },
    )?;
    sort_header_metadata(path)?;
    fsync(path)
}

/// Rewrites the `__metadata__` entries of the safetensors file at `path` in key order, in
/// place. The safetensors crate writes them in the order of a `HashMap`, which differs from
/// process to process, so the same state saved twice (a resumed run and an unbroken one) would
/// differ in bytes and checksums. The sorted object is the same JSON at the same length; the
/// tensors and the rest of the header are untouched.
fn sort_header_metadata(path: &Path) -> Result<(), CheckpointError> {
    use std::io::{Seek, SeekFrom};
    const PREFIX: &[u8] = b"{\"__metadata__\":";
    let io = |op| {
        move |source| CheckpointError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    };
    let mut file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(io("open"))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(io("read"))?;
    // The header was just written by the safetensors crate; it is as long as it says.
    let mut header = vec![0u8; u64::from_le_bytes(len) as usize];
    file.read_exact(&mut header).map_err(io("read"))?;
    let Some(rest) = header.strip_prefix(PREFIX) else {
        return Ok(()); // no metadata
    };
    let mut stream = serde_json::Deserializer::from_slice(rest)
        .into_iter::<std::collections::BTreeMap<String, String>>();
    let sorted = match stream.next() {
        Some(Ok(sorted)) => sorted,
        Some(Err(e)) => return Err(format_err(path, e)),
        None => return Err(format_err(path, "an empty __metadata__")),
    };
    let end = stream.byte_offset();
    let bytes = serde_json::to_vec(&sorted).map_err(|e| format_err(path, e))?;
    if bytes.len() != end {
        return Err(format_err(
            path,
            format!("__metadata__ of {end} bytes rewritten as {}", bytes.len()),
        ));
    }
    file.seek(SeekFrom::Start((len.len() + PREFIX.len()) as u64))
        .map_err(io("seek in"))?;
    file.write_all(&bytes).map_err(io("write"))
}

/// The process's umask, from `/proc/self/status` (022 where it cannot be
/// read): reading it this way, unlike umask(2), changes nothing.
fn process_umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("Umask:"))?;
            u32::from_str_radix(line.split_whitespace().nth(1)?, 8).ok()
        })
        .unwrap_or(0o022)
}

/// Writes config.json and model.safetensors for `model` into the existing directory `dir`
/// (each file fsynced, not renamed: callers write into a directory they rename afterwards).
/// Writes `dir/config.json` of `config` in Hugging Face's format, with the further keys
/// `config_extra` (never overriding one of the model's own).
pub(super) fn write_config(
    dir: &Path,
    config: &GPTConfig,
    config_extra: &[(&str, serde_json::Value)],
) -> Result<(), CheckpointError> {
    let mut fields = if config.is_gpt2() {
        let hf = HfGpt2Config::from_config(config);
        match serde_json::to_value(&hf).map_err(|e| format_err(dir, e))? {
            serde_json::Value::Object(fields) => fields,
            _ => unreachable!("a struct serializes to an object"),
        }
    } else {
        llama_config_json(config)?
    };
    for (key, value) in config_extra {
        fields.entry(*key).or_insert_with(|| value.clone());
    }
    let json = serde_json::to_vec_pretty(&fields).map_err(|e| format_err(dir, e))?;
    write_bytes(&dir.join(CONFIG_FILE), &json)
}

pub(super) fn write_model_files(
    dir: &Path,
    model: &GPT,
    config_extra: &[(&str, serde_json::Value)],
) -> Result<(), CheckpointError> {
    write_config(dir, model.config(), config_extra)?;
    if !model.config().is_gpt2() {
        return write_llama_tensors(dir, model);
    }
    let params = model.params();
    let tensors = model
        .param_views()
        .iter()
        .map(|v| {
            let view = F32View {
                shape: v.shape.clone(),
                data: &params[v.range.clone()],
            };
            (v.name.clone(), view)
        })
        .collect();
    // Hugging Face refuses safetensors files without format "pt".
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_safetensors(&dir.join(MODEL_FILE), tensors, metadata)
}

pub(super) fn read_file(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    fs::read(path).map_err(io("read", path))
}

pub(super) fn parse_safetensors<'a>(
    path: &Path,
    bytes: &'a [u8],
) -> Result<SafeTensors<'a>, CheckpointError> {
    SafeTensors::deserialize(bytes).map_err(|e| format_err(path, e))
}

pub(super) fn copy_f32(dst: &mut [f32], src: &[u8]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

/// Whether a stored name is one of the causal-mask buffers some GPT-2 files carry
/// (`h.N.attn.bias`, `h.N.attn.masked_bias`): constants, not parameters.
pub(super) fn is_mask_buffer(name: &str) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    matches!(parts.as_slice(), ["h", l, "attn", "bias" | "masked_bias"] if l.parse::<usize>().is_ok())
}

/// Loads model.safetensors from `dir` into `model`'s parameters. Every tensor is checked (name,
/// dtype, shape) before any parameter is written, so a failed load leaves the model unchanged.
pub fn load_params_into(dir: &Path, model: &mut GPT) -> Result<(), CheckpointError> {
    let path = dir.join(MODEL_FILE);
    if !path.exists() && !dir.join(INDEX_FILE).exists() {
        // A sharded checkpoint keeps its parameters in the ranks' shards.
        if let Some(index) = read_index(dir)? {
            return load_sharded_params(dir, &index, model);
        }
    }
    if !model.config().is_gpt2() {
        return load_llama_params(dir, model);
    }
    let bytes = read_verified(dir, MODEL_FILE)?;
    let st = parse_safetensors(&path, &bytes)?;
    let views: Vec<ParamView> = model.param_views().to_vec();
    let mut stored = HashMap::new();
    for (name, t) in st.iter() {
        let key = name.strip_prefix("transformer.").unwrap_or(name);
        if is_mask_buffer(key) {
            continue;
        }
        if stored.insert(key, (name, t)).is_some() {
            return Err(format_err(&path, format!("tensor {key:?} stored twice")));
        }
    }
    // Checked in the model's order, so the first error reported is the first tensor at fault.
    let mut plan: Vec<(&ParamView, &[u8])> = Vec::with_capacity(views.len());
    let mut missing = Vec::new();
    for view in &views {
        let Some((name, t)) = stored.remove(view.name.as_str()) else {
            missing.push(view.name.clone());
            continue;
        };
        if t.dtype() != Dtype::F32 {
            return Err(CheckpointError::DtypeMismatch {
                path,
                name: name.to_string(),
                found: format!("{:?}", t.dtype()),
            });
        }
        if t.shape() != view.shape.as_slice() {
            return Err(CheckpointError::ShapeMismatch {
                path,
                name: name.to_string(),
                expected: view.shape.clone(),
                found: t.shape().to_vec(),
            });
        }
        plan.push((view, t.data()));
    }
    if !missing.is_empty() {
        return Err(CheckpointError::MissingTensors {
            path,
            names: missing,
        });
    }
    if model.config().tie_word_embeddings {
        // Files written with the head tied may still store it; accept an identical copy only.
        if let Some((_, head)) = stored.remove("lm_head.weight") {
            let wte = plan.iter().find(|(v, _)| v.name == "wte.weight");
            if wte.map(|(_, d)| *d) != Some(head.data()) {
                return Err(CheckpointError::UntiedHead { path });
            }
        }
    }
    if let Some(name) = stored.values().map(|(name, _)| *name).min() {
        return Err(CheckpointError::UnexpectedTensor {
            path,
            name: name.to_string(),
        });
    }
    let params = model.params_mut();
    for (view, data) in plan {
        let dst = &mut params[view.range.clone()];
        copy_f32(dst, data);
        // A model with a NaN or infinite weight computes nothing useful, and
        // training from it would only report divergence later: refuse it
        // here, by name (a file without checksums is loaded unverified).
        if let Some(i) = dst.iter().position(|x| !x.is_finite()) {
            return Err(format_err(
                &path,
                format!(
                    "tensor {:?} holds a non-finite value ({} at element {i})",
                    view.name, dst[i]
                ),
            ));
        }
    }
    Ok(())
}

//! The tensors: model.safetensors written from the flat parameter buffer under GPT-2's names,
//! and read back with every name, dtype and shape checked against the model's layout. It never
//! loads a tensor whose name, dtype or shape does not match: a mismatch is an error, not a cast.

use std::collections::BTreeMap;

use super::*;

/// A borrowed f32 tensor for the safetensors writer.
pub(super) struct F32View<'a> {
    pub(super) shape: Vec<usize>,
    pub(super) data: &'a [f32],
}

/// `data`'s bytes, little-endian as safetensors requires: the values' own memory on a
/// little-endian machine (no copy), a converted copy elsewhere.
fn le_bytes(data: &[f32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: an f32 is 4 initialised bytes with no padding, u8 has alignment 1, and the
        // slice covers exactly the memory of `data`, which it borrows.
        Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
        })
    } else {
        Cow::Owned(data.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// The header of a safetensors file of `tensors` (stored in this order) and `metadata`,
/// as the safetensors crate lays it out: `__metadata__` first, then each tensor's dtype,
/// shape and offsets, padded with spaces to a multiple of 8 bytes.
fn safetensors_header(
    path: &Path,
    tensors: &[(String, F32View<'_>)],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, CheckpointError> {
    let mut header = String::from("{");
    if !metadata.is_empty() {
        header.push_str(&format!("\"__metadata__\":{}", to_json(path, metadata)?));
    }
    let mut offset = 0;
    for (name, view) in tensors {
        if view.shape.iter().product::<usize>() != view.data.len() {
            return Err(format_err(
                path,
                format!(
                    "tensor {name:?} of shape {:?} given {} values",
                    view.shape,
                    view.data.len()
                ),
            ));
        }
        let bytes = std::mem::size_of_val(view.data);
        let info = TensorInfo {
            dtype: Dtype::F32,
            shape: view.shape.clone(),
            data_offsets: (offset, offset + bytes),
        };
        offset += bytes;
        if header.len() > 1 {
            header.push(',');
        }
        header.push_str(&format!(
            "{}:{}",
            to_json(path, name)?,
            to_json(path, &info)?
        ));
    }
    header.push('}');
    let mut header = header.into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    Ok(header)
}

fn to_json<T: Serialize + ?Sized>(path: &Path, value: &T) -> Result<String, CheckpointError> {
    serde_json::to_string(value).map_err(|e| format_err(path, e))
}

/// Writes a safetensors file of `tensors` (sorted by name, as the safetensors crate stores
/// them) with `metadata` at `path`, and fsyncs it. The values are written from their own
/// memory, summed on the way (nothing is copied into a buffer, nothing read back); the
/// metadata is stored in key order, so the same state always makes the same bytes. Returns
/// the file's sum.
pub(super) fn write_safetensors(
    path: &Path,
    mut tensors: Vec<(String, F32View<'_>)>,
    metadata: HashMap<String, String>,
) -> Result<Sum, CheckpointError> {
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(w) = tensors.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(format_err(path, format!("tensor {:?} given twice", w[0].0)));
    }
    let header = safetensors_header(path, &tensors, &metadata.into_iter().collect())?;
    let mut file = SumWriter::create(path)?;
    file.write(&(header.len() as u64).to_le_bytes())?;
    file.write(&header)?;
    for (_, view) in &tensors {
        file.write(&le_bytes(view.data))?;
    }
    file.finish()
}

/// Writes `dir/config.json` of `config` in Hugging Face's format, with the further keys
/// `config_extra` (never overriding one of the model's own); returns its sum.
pub(super) fn write_config(
    dir: &Path,
    config: &GPTConfig,
    config_extra: &[(&str, serde_json::Value)],
) -> Result<Sum, CheckpointError> {
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

/// Writes config.json and model.safetensors for `model` into the existing directory `dir`
/// (each file fsynced, not renamed: callers write into a directory they rename afterwards);
/// returns each file's name and sum.
pub(super) fn write_model_files(
    dir: &Path,
    model: &GPT,
    config_extra: &[(&str, serde_json::Value)],
) -> Result<Vec<(String, Sum)>, CheckpointError> {
    let config = write_config(dir, model.config(), config_extra)?;
    let tensors = if model.config().is_gpt2() {
        write_gpt2_tensors(dir, model)?
    } else {
        write_llama_tensors(dir, model)?
    };
    Ok(vec![
        (CONFIG_FILE.to_string(), config),
        (MODEL_FILE.to_string(), tensors),
    ])
}

/// Writes model.safetensors of a GPT-2 `model` into `dir`; returns its sum.
fn write_gpt2_tensors(dir: &Path, model: &GPT) -> Result<Sum, CheckpointError> {
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

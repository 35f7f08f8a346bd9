//! The trainer's files in a checkpoint: the optimizer's state buffers (optimizer.safetensors)
//! and the trainer's position (trainer_state.json), so that a resumed run continues bitwise.

use super::*;

pub(super) fn write_optimizer_file(
    path: &Path,
    opt: &dyn Optimizer,
) -> Result<(), CheckpointError> {
    let state = opt.state();
    let tensors = state
        .buffers
        .iter()
        .map(|(name, buf)| {
            let view = F32View {
                shape: vec![buf.len()],
                data: buf,
            };
            (name.clone(), view)
        })
        .collect();
    let metadata = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("optimizer".to_string(), state.optimizer.clone()),
        ("step".to_string(), state.step.to_string()),
    ]);
    write_safetensors(path, tensors, metadata)
}

/// Restores `opt` from `dir/optimizer.safetensors`. Returns false, leaving `opt` untouched, when
/// the checkpoint has no optimizer state (e.g. a Hugging Face model to fine-tune).
pub fn load_optimizer_into(dir: &Path, opt: &mut dyn Optimizer) -> Result<bool, CheckpointError> {
    let path = dir.join(OPTIMIZER_FILE);
    if !path.exists() {
        return Ok(false);
    }
    let bytes = read_verified(dir, OPTIMIZER_FILE)?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| format_err(&path, e))?;
    let info = meta.metadata().clone().unwrap_or_default();
    let field = |key: &str| {
        info.get(key)
            .cloned()
            .ok_or_else(|| format_err(&path, format!("metadata has no {key:?}")))
    };
    let optimizer = field("optimizer")?;
    let step: u64 = field("step")?
        .parse()
        .map_err(|e| format_err(&path, format!("metadata step: {e}")))?;
    let st = parse_safetensors(&path, &bytes)?;
    let mut owned = Vec::new();
    for (name, t) in st.iter() {
        if t.dtype() != Dtype::F32 || t.shape().len() != 1 {
            return Err(CheckpointError::DtypeMismatch {
                path,
                name: name.to_string(),
                found: format!("{:?} {:?}", t.dtype(), t.shape()),
            });
        }
        let mut buf = vec![0f32; t.shape()[0]];
        copy_f32(&mut buf, t.data());
        owned.push((name.to_string(), buf));
    }
    let state = OptimizerState {
        optimizer,
        step,
        buffers: owned
            .iter()
            .map(|(n, b)| (n.clone(), b.as_slice()))
            .collect(),
    };
    opt.load_state(&state)
        .map_err(|source| CheckpointError::Optimizer { path, source })?;
    Ok(true)
}

/// The trainer state in `dir`, if the checkpoint has one.
pub fn load_trainer_state(dir: &Path) -> Result<Option<TrainerState>, CheckpointError> {
    let path = dir.join(TRAINER_STATE_FILE);
    let bytes = match fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("read", &path)(e)),
    };
    check_digest(dir, TRAINER_STATE_FILE, &bytes)?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| format_err(&path, e))
}

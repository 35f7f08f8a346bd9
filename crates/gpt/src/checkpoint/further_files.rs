//! Further files a caller stores in a checkpoint beside the model: safetensors files of flat
//! f32 tensors with string metadata (a trainer keeps its optimizer state this way), and the
//! verified reading of any file. They are written and checksummed like the model's own files,
//! so a checkpoint is complete or absent as a whole; what they mean is the caller's business:
//! this module never interprets their contents.

use super::*;

/// A safetensors file of flat f32 tensors to write into a checkpoint.
pub struct TensorFile<'a> {
    /// The file's name inside the checkpoint directory.
    pub name: &'a str,
    /// (name, values) of each tensor, stored 1-D.
    pub tensors: Vec<(String, &'a [f32])>,
    /// String metadata stored in the file's header.
    pub metadata: HashMap<String, String>,
}

/// A tensor file read back from a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedTensors {
    /// The file's path.
    pub path: PathBuf,
    /// Its header's metadata.
    pub metadata: HashMap<String, String>,
    /// (name, values) of each tensor (safetensors does not keep the order they were written in).
    pub tensors: Vec<(String, Vec<f32>)>,
}

/// Writes `file` into `dir`; returns its sum.
pub(super) fn write_tensor_file(dir: &Path, file: &TensorFile<'_>) -> Result<Sum, CheckpointError> {
    let tensors = file
        .tensors
        .iter()
        .map(|(name, buf)| {
            let view = F32View {
                shape: vec![buf.len()],
                data: buf,
            };
            (name.clone(), view)
        })
        .collect();
    let mut metadata = file.metadata.clone();
    // Hugging Face refuses safetensors files without format "pt".
    metadata.insert("format".to_string(), "pt".to_string());
    write_safetensors(&dir.join(file.name), tensors, metadata)
}

/// Reads the tensor file `name` of checkpoint `dir`, checked against the checkpoint's checksums; `None` when
/// the checkpoint has no such file. Every tensor must be f32 and 1-D.
pub fn read_tensor_file(dir: &Path, name: &str) -> Result<Option<LoadedTensors>, CheckpointError> {
    let path = dir.join(name);
    if !path.exists() {
        return Ok(None);
    }
    let bytes = read_verified(dir, name)?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| format_err(&path, e))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let st = parse_safetensors(&path, &bytes)?;
    let mut tensors = Vec::new();
    for (tensor, t) in st.iter() {
        if t.dtype() != Dtype::F32 || t.shape().len() != 1 {
            return Err(CheckpointError::DtypeMismatch {
                path,
                name: tensor.to_string(),
                found: format!("{:?} {:?}", t.dtype(), t.shape()),
            });
        }
        let mut buf = vec![0f32; t.shape()[0]];
        copy_f32(&mut buf, t.data());
        tensors.push((tensor.to_string(), buf));
    }
    Ok(Some(LoadedTensors {
        path,
        metadata,
        tensors,
    }))
}

/// The bytes of file `name` of checkpoint `dir`, checked against the checkpoint's checksums; `None` when the
/// checkpoint has no such file.
pub fn read_file_verified(dir: &Path, name: &str) -> Result<Option<Vec<u8>>, CheckpointError> {
    let path = dir.join(name);
    let bytes = match fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("read", &path)(e)),
    };
    check_digest(dir, name, &bytes)?;
    Ok(Some(bytes))
}

//! A Llama GGUF file converted to a Hugging Face `LlamaForCausalLM` directory: config.json,
//! generation_config.json, model.safetensors (f32), tokenizer.json and tokenizer_config.json
//! (with the chat template). The directory is written beside its destination under a temporary
//! name and renamed into place when complete, so a failed conversion leaves nothing behind.

mod config;
mod tokenizer;
mod weights;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

pub use config::LlamaConfig;
pub use weights::{hf_name, permute_rows, unpermute_rows};

use crate::error::GgufError;
use crate::reader::GgufFile;

/// What a conversion read and wrote.
#[derive(Clone, Debug)]
pub struct Conversion {
    /// `general.architecture` ("llama").
    pub architecture: String,
    /// `general.name`, when the file has one.
    pub name: Option<String>,
    /// The model's hyperparameters.
    pub config: LlamaConfig,
    /// How many tensors of each ggml type the file holds ("Q4_1" → 210).
    pub tensor_types: BTreeMap<String, usize>,
    /// Parameters written.
    pub parameters: u64,
    /// The directory written.
    pub out: PathBuf,
}

/// Converts the GGUF file `gguf` into a Hugging Face directory `out`, which must not exist or be
/// empty.
pub fn convert_to_hf(gguf: &Path, out: &Path) -> Result<Conversion, GgufError> {
    let file = GgufFile::open(gguf)?;
    let architecture = file.str("general.architecture")?.to_string();
    if architecture != "llama" {
        return Err(GgufError::Unsupported {
            path: gguf.to_path_buf(),
            what: format!("architecture {architecture:?} (general.architecture)"),
            reason: "only \"llama\" (LlamaForCausalLM) is converted".into(),
        });
    }
    let config = LlamaConfig::from_file(&file)?;
    // The tokenizer first: it is the cheap part, and a file it refuses is refused before
    // hundreds of megabytes are written.
    let (tokenizer_json, tokenizer_config) = tokenizer::build(&file, config.context)?;

    let tmp = begin_dir(out)?;
    let written = (|| {
        let write_json = |name: &str, v: &serde_json::Value| {
            let p = tmp.join(name);
            let text = serde_json::to_string_pretty(v).unwrap_or_default() + "\n";
            fs::write(&p, text).map_err(GgufError::io("write", &p))
        };
        write_json("config.json", &config.config_json())?;
        write_json("generation_config.json", &config.generation_config_json())?;
        write_json("tokenizer_config.json", &tokenizer_config)?;
        let p = tmp.join("tokenizer.json");
        fs::write(&p, &tokenizer_json).map_err(GgufError::io("write", &p))?;
        weights::write_safetensors(&file, &config, &tmp.join("model.safetensors"))
    })();
    if let Err(e) =
        written.and_then(|()| fs::rename(&tmp, out).map_err(GgufError::io("rename", &tmp)))
    {
        // Most often a full disk: give the space back. Failing to is not worth reporting over
        // the error itself.
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }

    let mut tensor_types = BTreeMap::new();
    for t in file.tensors() {
        *tensor_types.entry(t.ty.to_string()).or_insert(0) += 1;
    }
    Ok(Conversion {
        architecture,
        name: file.opt_str("general.name")?.map(str::to_string),
        parameters: file.tensors().iter().map(|t| t.n_elements()).sum(),
        config,
        tensor_types,
        out: out.to_path_buf(),
    })
}

/// Checks that `out` is free (absent, or an empty directory, which a rename replaces) and makes
/// the temporary directory beside it that becomes it.
fn begin_dir(out: &Path) -> Result<PathBuf, GgufError> {
    if out.exists() {
        let empty = fs::read_dir(out)
            .map_err(GgufError::io("read", out))?
            .next()
            .is_none();
        if !empty {
            return Err(GgufError::OutputExists {
                path: out.to_path_buf(),
            });
        }
    }
    let name = out.file_name().ok_or_else(|| GgufError::Io {
        op: "name",
        path: out.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the output needs a directory name",
        ),
    })?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    fs::create_dir_all(parent).map_err(GgufError::io("create", parent))?;
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(GgufError::io("remove", &tmp))?;
    }
    fs::create_dir(&tmp).map_err(GgufError::io("create", &tmp))?;
    Ok(tmp)
}

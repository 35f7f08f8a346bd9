//! The seam between serving a model and executing it, as Triton's backends: a [`Backend`] says
//! what a loaded model version is (platform, input and output tensors) and checks what a
//! request's values must satisfy beyond type and shape; its [`Instance`]s execute batches. The
//! queue, the dynamic batcher, the instance threads, the metrics and the repository (the
//! `model`, `batcher`, `metrics` and `repository` modules) are the same for every backend.
//! Config `platform:` / `backend:` picks the backend ([`Kind`]); ensembles, which execute other
//! models rather than a file, are the `ensemble` module's.
//!
//! A backend never parses a request off the wire and never queues: it is handed checked
//! tensors, joined along the batch dimension.

pub(crate) mod gpt;
pub(crate) mod onnx;
mod onnx_dense;
pub(crate) mod tokenizer;

use std::path::Path;

use crate::config::ModelConfig;
use crate::error::ServeError;
use crate::tensor::{Request, Tensor, TensorSpec};
use crate::text::TextCodec;

/// Triton's platform of cohort's GPT checkpoints.
pub const GPT_PLATFORM: &str = "cohort_gpt";
/// Triton's platform of ONNX models (Triton runs them with its `onnxruntime` backend; cohort
/// with tract).
pub const ONNX_PLATFORM: &str = "onnxruntime_onnx";
/// Triton's platform of a pipeline of other models.
pub const ENSEMBLE_PLATFORM: &str = "ensemble";
/// cohort's tokenizer models' backend (and platform) name: text <-> token ids, as Triton users
/// write a Python model for.
pub const TOKENIZER_BACKEND: &str = tokenizer::BACKEND;

/// Which backend serves a model, from its config's `platform` / `backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A cohort GPT checkpoint (`platform: "cohort_gpt"` or `backend: "cohort"`; also a config
    /// naming neither, as repositories written before there were other backends).
    Gpt,
    /// `model.onnx` (`platform: "onnxruntime_onnx"` or `backend: "onnxruntime"`).
    Onnx,
    /// Steps through other models (`platform: "ensemble"`).
    Ensemble,
    /// Text <-> token ids with a `tokenizer.json` or `vocab.json` (`backend:
    /// "cohort_tokenizer"`).
    Tokenizer,
}

impl Kind {
    /// The backend `platform` / `backend` name, or why they name none cohort has.
    pub fn from_config(platform: Option<&str>, backend: Option<&str>) -> Result<Kind, String> {
        let by_platform = match platform.filter(|p| !p.is_empty()) {
            None => None,
            Some(GPT_PLATFORM) => Some(Kind::Gpt),
            Some(ONNX_PLATFORM) => Some(Kind::Onnx),
            Some(ENSEMBLE_PLATFORM) => Some(Kind::Ensemble),
            Some(TOKENIZER_BACKEND) => Some(Kind::Tokenizer),
            Some(other) => {
                return Err(format!(
                    "platform {other:?} is not served by cohort (it serves {GPT_PLATFORM}, \
                     {ONNX_PLATFORM}, {ENSEMBLE_PLATFORM}, {TOKENIZER_BACKEND})"
                ))
            }
        };
        let by_backend = match backend.filter(|b| !b.is_empty()) {
            None => None,
            Some("cohort") => Some(Kind::Gpt),
            Some("onnxruntime") => Some(Kind::Onnx),
            Some(TOKENIZER_BACKEND) => Some(Kind::Tokenizer),
            Some(other) => {
                return Err(format!(
                    "backend {other:?} is not served by cohort (it serves cohort, onnxruntime, \
                     {TOKENIZER_BACKEND})"
                ))
            }
        };
        match (by_platform, by_backend) {
            (Some(p), Some(b)) if p != b => Err(format!(
                "platform {:?} and backend {:?} name different backends",
                platform.unwrap_or_default(),
                backend.unwrap_or_default()
            )),
            (Some(k), _) | (None, Some(k)) => Ok(k),
            (None, None) => Ok(Kind::Gpt),
        }
    }

    /// Triton's platform name.
    pub fn platform(self) -> &'static str {
        match self {
            Kind::Gpt => GPT_PLATFORM,
            Kind::Onnx => ONNX_PLATFORM,
            Kind::Ensemble => ENSEMBLE_PLATFORM,
            Kind::Tokenizer => TOKENIZER_BACKEND,
        }
    }

    /// Triton's backend name (empty for an ensemble, as Triton writes it).
    pub fn backend(self) -> &'static str {
        match self {
            Kind::Gpt => "cohort",
            Kind::Onnx => "onnxruntime",
            Kind::Ensemble => "",
            Kind::Tokenizer => TOKENIZER_BACKEND,
        }
    }
}

/// What a loaded model version is, whichever backend executes it.
pub(crate) trait Backend: Send + Sync {
    /// The model's inputs, batch dimension first.
    fn inputs(&self) -> &[TensorSpec];
    /// The model's outputs, batch dimension first.
    fn outputs(&self) -> &[TensorSpec];
    /// Checks what a request's values must satisfy beyond their type and shape (token ids in
    /// the vocabulary, a sequence the model can take); the request is refused otherwise.
    fn check(&self, _request: &Request) -> Result<(), ServeError> {
        Ok(())
    }
    /// The text codec for the generate extension, or why the model has none.
    fn text(&self) -> Result<TextCodec, String>;
}

/// One copy of a model, executing on one thread (with its own thread pool, if any).
pub(crate) trait Instance: Send {
    /// Executes one batch: `inputs` are the requests' inputs joined along the batch
    /// dimension, in the model's input order. Returns one tensor per output (same rows) where
    /// `want` is true, None elsewhere.
    fn execute(&mut self, inputs: &[Tensor], want: &[bool]) -> Result<Vec<Option<Tensor>>, String>;

    /// The model that generates text token by token (the generate extension, decoupled
    /// streaming), if this backend does.
    fn decoder(&self) -> Option<&cohort_gpt::GPT> {
        None
    }
}

/// A model version read from its directory: what it is, and its instances.
pub(crate) struct Loaded {
    pub backend: Box<dyn Backend>,
    pub instances: Vec<Box<dyn Instance>>,
}

/// Reads the version in `version_dir` with backend `kind` (not an ensemble) and builds
/// `count` instances of `threads` threads each. `what` names the version in errors.
pub(crate) fn load(
    kind: Kind,
    what: &Version<'_>,
    version_dir: &Path,
    cfg: &ModelConfig,
    count: usize,
    threads: usize,
) -> Result<Loaded, ServeError> {
    match kind {
        Kind::Gpt => gpt::load(what, version_dir, cfg, count, threads),
        Kind::Onnx => onnx::load(what, version_dir, cfg, count, threads),
        Kind::Tokenizer => tokenizer::load(what, version_dir, cfg, count),
        Kind::Ensemble => Err(what
            .error("an ensemble has no model file to load (the ensemble module serves it)".into())),
    }
}

/// The model version being loaded, to name it in errors.
pub(crate) struct Version<'a> {
    pub model: &'a str,
    pub version: u64,
}

impl Version<'_> {
    /// A load error of this version.
    pub fn error(&self, reason: String) -> ServeError {
        ServeError::Backend {
            model: self.model.to_string(),
            version: self.version,
            reason,
        }
    }
}

/// Checks a config's `input` / `output` declarations against the model's tensors: each names
/// one of them, once, with its datatype and dims (without the batch dimension; -1 matches any
/// size).
pub(crate) fn check_declared(cfg: &ModelConfig, backend: &dyn Backend) -> Result<(), String> {
    check_section("input", &cfg.input, backend.inputs())?;
    check_section("output", &cfg.output, backend.outputs())
}

/// One section of [`check_declared`].
pub(crate) fn check_section(
    section: &str,
    entries: &[crate::config::TensorConfig],
    known: &[TensorSpec],
) -> Result<(), String> {
    for (i, t) in entries.iter().enumerate() {
        let Some(spec) = known.iter().find(|s| s.name == t.name) else {
            return Err(format!(
                "{section} {:?} is not a tensor of the model (it has {})",
                t.name,
                crate::tensor::names(known)
            ));
        };
        if entries[..i].iter().any(|o| o.name == t.name) {
            return Err(format!("{section} {:?} is declared twice", t.name));
        }
        if let Some(dt) = t
            .data_type
            .as_deref()
            .filter(|&d| d != spec.datatype.triton())
        {
            return Err(format!(
                "{section} {:?} has data_type {dt}; the model's is {}",
                t.name,
                spec.datatype.triton()
            ));
        }
        let dims = spec.config_dims();
        let agree = t.dims.len() == dims.len()
            && t.dims
                .iter()
                .zip(&dims)
                .all(|(&a, &b)| a == b || a < 0 || b < 0);
        if !t.dims.is_empty() && !agree {
            return Err(format!(
                "{section} {:?} has dims {:?}; the model's are {dims:?} (without the batch \
                 dimension)",
                t.name, t.dims
            ));
        }
    }
    Ok(())
}

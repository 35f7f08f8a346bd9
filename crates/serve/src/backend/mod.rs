//! The seam between serving a model and executing it, as Triton's backends: a [`Backend`] says
//! what a loaded model version is (platform, input and output tensors) and checks what a
//! request's values must satisfy beyond type and shape; its [`Instance`]s execute batches. The
//! queue, the dynamic batcher, the instance threads, the metrics and the repository (the
//! `model`, `batcher`, `metrics` and `repository` modules) are the same for every backend.
//! Config `platform:` / `backend:` picks the backend ([`Kind`]); ensembles, which execute other
//! models rather than a file, are the `model::ensemble` module's. Each backend also checks the
//! part of a config only it can judge, before anything is loaded ([`check_config`]); the
//! fields every model has are the `config` module's.
//!
//! A backend never parses a request off the wire, never queues and never reads another
//! model: it is handed checked tensors, joined along the batch dimension.

pub(crate) mod gpt;
pub(crate) mod onnx;
mod onnx_dense;
pub(crate) mod onnx_ort;
pub(crate) mod profile;
pub(crate) mod tokenizer;

use std::path::Path;

use crate::config::{Kind, ModelConfig, TensorConfig};
use crate::error::ServeError;
use crate::tensor::{Request, Tensor, TensorSpec};
use crate::text::TextCodec;

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
    /// The chat template `/v1/chat/completions` renders conversations with, or why the model
    /// has none.
    fn chat_template(&self) -> Result<std::sync::Arc<cohort_tokenizer::ChatTemplate>, String> {
        Err("this model has no chat template".into())
    }
    /// The token ids generation stops at (generation_config.json's `eos_token_id`, as
    /// `transformers`' `generate` and `cohort sample` read it); empty: none.
    fn eos_ids(&self) -> Vec<u32> {
        Vec::new()
    }
    /// What executes the model, for reports (`cohort bench serve`): the runtime and its
    /// threads; empty where there is one way only.
    fn describe(&self) -> String {
        String::new()
    }
    /// Executes `inputs` (one batch) `runs` times on a private copy of the model, timing each
    /// operator (`cohort bench serve --profile`); the serving instances are not involved.
    fn profile(&self, _inputs: &[Tensor], _runs: usize) -> Result<profile::OpProfile, String> {
        Err("its backend does not time its operators (only ONNX models' do)".into())
    }
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
        Kind::Onnx => onnx_ort::load(what, version_dir, cfg, count, threads),
        Kind::Tokenizer => tokenizer::load(what, version_dir, cfg, count),
        Kind::Ensemble => Err(what
            .error("an ensemble has no model file to load (the ensemble module serves it)".into())),
    }
}

/// Checks what `cfg` says that only backend `kind` can judge, before anything is read: a GPT's
/// declared tensors (its vocabulary is known once the checkpoint is read; the load checks
/// that), a tokenizer's layout (its config is where its tensors come from). An ONNX model's
/// are checked against `model.onnx` when it is loaded.
pub(crate) fn check_config(kind: Kind, cfg: &ModelConfig) -> Result<(), String> {
    match kind {
        Kind::Gpt => gpt::check_config(cfg),
        Kind::Onnx => Ok(()),
        Kind::Tokenizer => tokenizer::check_config(cfg),
        Kind::Ensemble => {
            Err("an ensemble's config is the ensemble module's to check, not a backend's".into())
        }
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
    entries: &[TensorConfig],
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

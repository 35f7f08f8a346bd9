//! Which backend serves a model: Triton's `platform` / `backend` names cohort knows, and the
//! [`Kind`] a config's pair of them picks. The names are config vocabulary, read before any
//! backend is asked; this module never names a backend's code (the `backend` module maps each
//! [`Kind`] to it).

/// Triton's platform of cohort's GPT checkpoints.
pub const GPT_PLATFORM: &str = "cohort_gpt";
/// Triton's platform of ONNX models (Triton runs them with its `onnxruntime` backend; cohort
/// with tract).
pub const ONNX_PLATFORM: &str = "onnxruntime_onnx";
/// Triton's platform of a pipeline of other models.
pub const ENSEMBLE_PLATFORM: &str = "ensemble";
/// cohort's tokenizer models' backend (and platform) name: text <-> token ids, as Triton users
/// write a Python model for.
pub const TOKENIZER_BACKEND: &str = "cohort_tokenizer";

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

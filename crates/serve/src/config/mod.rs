//! A model's serving configuration, read from `REPO/<model>/config.pbtxt` (Triton's protobuf
//! text) or `REPO/<model>/config.toml` (the same fields in TOML). Only Triton's fields that mean
//! something for cohort are read: `name`, `platform` / `backend` (which backend serves the
//! model: `cohort_gpt`, `onnxruntime_onnx`, `ensemble`, `cohort_tokenizer`), `max_batch_size`,
//! `dynamic_batching` (`preferred_batch_size`, `max_queue_delay_microseconds`,
//! `default_queue_policy.max_queue_size`), `instance_group` (`count`, `kind`),
//! `version_policy`, `parameters` (`inflight_batching`: whether concurrent generations share
//! batched decode steps; `kv_cache_dtype`: `fp32` or `bf16` keys and values in generation's
//! KV caches; `decode_weights`: `fp32`, `bf16` or `q8` matrices read by decode steps;
//! `backend`: `auto`, `onnxruntime` or `tract` runs an ONNX model),
//! `ensemble_scheduling` (steps with `input_map` / `output_map`), and
//! `input` / `output`, which must name the model's own tensors with their types (a GPT's
//! `input_ids`; `logits`, `next_token`; an ONNX model's are checked when `model.onnx` is read;
//! an ensemble's and a tokenizer's declare their tensors, BYTES ones as `TYPE_STRING`): a
//! config that declares a tensor the model does not have is refused at load, naming it. Other
//! fields Triton writes are accepted and ignored with a warning. A misspelt field inside a
//! known section is an error. A configuration can also come as JSON (Triton's
//! `load_model(config=...)` override), where an unused field is refused instead of ignored.
//!
//! This module is at the bottom of serving's imports: every other module reads a
//! [`ModelConfig`], and this one names none of them. It parses (pbtxt through its `pbtxt`
//! child, the spellings Triton's fields come in through `spellings`) and checks the fields every
//! model has; what only the backend serving a model can judge (the tensors it declares, the
//! sections it reads), that backend checks through the backend seam, and the constructors that
//! run both checks (`from_pbtxt`, `from_toml`, `from_json`, `load`) are the
//! `model::config_check` module's. This module never loads a model and never names a backend.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cohort_gpt::sample::{KvDtype, WeightFormat};
use serde::{Deserialize, Serialize};

mod pbtxt;
mod platform;
mod spellings;

pub use platform::{Kind, ENSEMBLE_PLATFORM, GPT_PLATFORM, ONNX_PLATFORM};

use crate::error::ServeError;
use spellings::{de_parameters, de_string_map, integers_from_strings, ser_parameters};

/// Triton's config file name.
pub const PBTXT_FILE: &str = "config.pbtxt";
/// The TOML alternative.
pub const TOML_FILE: &str = "config.toml";

/// Fields that are lists in Triton's ModelConfig; in pbtxt one occurrence is still a list.
const REPEATED: &[&str] = &[
    "preferred_batch_size",
    "instance_group",
    "versions",
    "input",
    "output",
    "dims",
    "gpus",
    "parameters",
    "step",
    "input_map",
    "output_map",
];

/// The `parameters` keys cohort reads, and what each takes.
const PARAMETERS: &[(&str, &str)] = &[
    (
        INFLIGHT_BATCHING,
        "\"true\" (the default: concurrent generations share decode steps) or \"false\" (each \
         generation has an instance to itself)",
    ),
    (
        KV_CACHE_DTYPE,
        "\"fp32\" (the default) or \"bf16\" (generation's KV caches in bf16: half the bytes)",
    ),
    (
        DECODE_WEIGHTS,
        "\"fp32\" (the default: the model's weights), \"bf16\" or \"q8\" (a copy of the matrices \
         that generation's decode steps read: a half or about a quarter of the bytes)",
    ),
    (
        MAX_PREFILL_TOKENS,
        "a positive integer: the most prompt tokens an in-flight decode step feeds besides the \
         step's first prompt (default 32; vLLM's max_num_batched_tokens)",
    ),
    (
        ONNX_BACKEND,
        "\"auto\" (the default: the ONNX Runtime library when it loads, else tract), \
         \"onnxruntime\" or \"tract\" (ONNX models only)",
    ),
];

/// The `parameters` key that picks the runtime of an ONNX model (the environment's
/// `COHORT_ONNX_BACKEND` when absent).
pub const ONNX_BACKEND: &str = "backend";

/// The `parameters` key that switches in-flight batching of generation.
pub const INFLIGHT_BATCHING: &str = "inflight_batching";

/// The `parameters` key that picks the number format of generation's KV caches (vLLM's
/// `--kv-cache-dtype`).
pub const KV_CACHE_DTYPE: &str = "kv_cache_dtype";

/// The `parameters` key that picks the weights generation's decode steps read (`cohort sample
/// --weights`; vLLM's `--quantization` for a served model).
pub const DECODE_WEIGHTS: &str = "decode_weights";

/// The `parameters` key that bounds the prompt tokens an in-flight decode step feeds.
pub const MAX_PREFILL_TOKENS: &str = "max_prefill_tokens";

/// `max_batch_size` when the config does not say.
pub const DEFAULT_MAX_BATCH_SIZE: usize = 8;

/// A model's configuration (Triton's `ModelConfig`, the fields cohort uses).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Must equal the model's directory name when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Triton's platform: `cohort_gpt`, `onnxruntime_onnx`, `ensemble` or `cohort_tokenizer`
    /// (see [`ModelConfig::kind`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    /// Triton's backend: `cohort`, `onnxruntime` or `cohort_tokenizer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The steps of an ensemble (`platform: "ensemble"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ensemble_scheduling: Option<EnsembleScheduling>,
    /// Most rows (sequences) one execution takes; a request's batch dimension may not exceed
    /// it. Must be at least 1 (cohort's models always have a batch dimension).
    #[serde(default = "default_max_batch_size")]
    pub max_batch_size: usize,
    /// Present: requests are queued and combined into batches; absent: each request executes
    /// alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic_batching: Option<DynamicBatching>,
    /// How many copies of the model execute concurrently (the counts are summed).
    #[serde(default)]
    pub instance_group: Vec<InstanceGroup>,
    /// Which versions of the repository directory are served.
    #[serde(default)]
    pub version_policy: VersionPolicy,
    /// Triton's input declarations; each must be one of the model's inputs.
    #[serde(default, skip_serializing)]
    pub input: Vec<TensorConfig>,
    /// Triton's output declarations; each must be one of the model's outputs.
    #[serde(default, skip_serializing)]
    pub output: Vec<TensorConfig>,
    /// Triton's free-form `parameters` (`parameters { key: "k" value: { string_value: "v" } }`
    /// in pbtxt, `{"k": {"string_value": "v"}}` in JSON, `k = "v"` under `[parameters]` in
    /// TOML). cohort reads `inflight_batching`; any other key is refused at load, since a
    /// parameter silently not applied would serve something other than what was asked for.
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "de_parameters",
        serialize_with = "ser_parameters"
    )]
    pub parameters: BTreeMap<String, String>,
    /// Triton fields cohort does not use, kept to report them.
    #[serde(flatten, skip_serializing)]
    pub ignored: BTreeMap<String, serde_json::Value>,
}

/// A tensor of Triton's `input` / `output` sections. Triton's configs describe a tensor without
/// its batch dimension: `input_ids` is `dims: [-1]` (the sequence), `logits` `[-1, vocab]`,
/// `next_token` `[1]` (Triton allows no empty dims; `reshape { shape: [] }` may say so).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorConfig {
    /// The tensor's name.
    pub name: String,
    /// Triton's type name (`TYPE_INT64`, `TYPE_FP32`); absent: not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_type: Option<String>,
    /// The shape without the batch dimension; -1 for any size. Empty: not checked.
    #[serde(default)]
    pub dims: Vec<i64>,
    /// Accepted as Triton writes it; it changes nothing here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reshape: Option<serde_json::Value>,
}

/// Triton's `ensemble_scheduling` section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnsembleScheduling {
    /// The steps, each executing one model.
    #[serde(default)]
    pub step: Vec<EnsembleStep>,
}

/// One step of an ensemble: a model, and which ensemble tensors are its inputs and outputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnsembleStep {
    /// The model the step executes.
    pub model_name: String,
    /// Its version; -1: the newest ready one when the request runs.
    #[serde(default = "latest_version")]
    pub model_version: i64,
    /// The step model's input name -> the ensemble tensor fed to it.
    #[serde(default, deserialize_with = "de_string_map")]
    pub input_map: BTreeMap<String, String>,
    /// The step model's output name -> the ensemble tensor it becomes.
    #[serde(default, deserialize_with = "de_string_map")]
    pub output_map: BTreeMap<String, String>,
}

fn latest_version() -> i64 {
    -1
}

fn default_max_batch_size() -> usize {
    DEFAULT_MAX_BATCH_SIZE
}

/// Triton's `dynamic_batching` section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DynamicBatching {
    /// Batch sizes (rows) to aim for; a batch that reaches the largest runs at once.
    #[serde(default)]
    pub preferred_batch_size: Vec<usize>,
    /// How long the oldest request may wait for others to join its batch.
    #[serde(default)]
    pub max_queue_delay_microseconds: u64,
    /// Queue bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_queue_policy: Option<QueuePolicy>,
    /// Accepted for Triton compatibility; requests are always answered in order per batch.
    #[serde(default)]
    pub preserve_ordering: bool,
}

/// Triton's `ModelQueuePolicy`, the field cohort uses.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QueuePolicy {
    /// Requests that may wait; more are rejected (HTTP 503). 0: the server's default.
    #[serde(default)]
    pub max_queue_size: usize,
    /// Other fields of the policy (timeouts, ...), not used.
    #[serde(flatten, skip_serializing)]
    pub ignored: BTreeMap<String, serde_json::Value>,
}

/// Triton's `instance_group` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceGroup {
    /// Instances in this group.
    #[serde(default = "one")]
    pub count: usize,
    /// `KIND_CPU` or `KIND_AUTO` (cohort has no other device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Other fields (name, gpus, ...), not used.
    #[serde(flatten, skip_serializing)]
    pub ignored: BTreeMap<String, serde_json::Value>,
}

fn one() -> usize {
    1
}

/// Triton's `version_policy`: which numbered version directories are served.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum VersionPolicy {
    /// The `num_versions` highest versions.
    Latest {
        /// How many.
        #[serde(default = "one_u32")]
        num_versions: u32,
    },
    /// Every version.
    All {},
    /// Exactly these versions (those present).
    Specific {
        /// The versions.
        versions: Vec<u64>,
    },
}

fn one_u32() -> u32 {
    1
}

impl Default for VersionPolicy {
    /// Triton's default: the latest version.
    fn default() -> Self {
        VersionPolicy::Latest { num_versions: 1 }
    }
}

impl VersionPolicy {
    /// The versions to serve out of those present (any order in, ascending out).
    pub fn select(&self, present: &[u64]) -> Vec<u64> {
        let mut v = present.to_vec();
        v.sort_unstable();
        v.dedup();
        match self {
            VersionPolicy::Latest { num_versions } => {
                let keep = (*num_versions as usize).min(v.len());
                v.split_off(v.len() - keep)
            }
            VersionPolicy::All {} => v,
            VersionPolicy::Specific { versions } => {
                v.retain(|x| versions.contains(x));
                v
            }
        }
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            name: None,
            platform: None,
            backend: None,
            ensemble_scheduling: None,
            max_batch_size: DEFAULT_MAX_BATCH_SIZE,
            dynamic_batching: None,
            instance_group: Vec::new(),
            version_policy: VersionPolicy::default(),
            input: Vec::new(),
            output: Vec::new(),
            parameters: BTreeMap::new(),
            ignored: BTreeMap::new(),
        }
    }
}

// Parsing. What these return is not checked yet: `check_fields` checks the fields every model
// has, and the constructors that check a config fully (`from_pbtxt`, `from_toml`, `from_json`,
// `load`) are the `model::config_check` module's, which asks the serving backend first.
impl ModelConfig {
    /// Parses config.pbtxt text (unchecked).
    pub(crate) fn parse_pbtxt(text: &str, path: &Path) -> Result<ModelConfig, ServeError> {
        let value = pbtxt::parse(text, REPEATED).map_err(|e| config_err(path, e))?;
        // the error names the field at fault (serde_json's alone does not, for a Value)
        serde_path_to_error::deserialize(value)
            .map_err(|e| config_err(path, format!("{}: {}", e.path(), e.inner())))
    }

    /// Parses config.toml text (unchecked).
    pub(crate) fn parse_toml(text: &str, path: &Path) -> Result<ModelConfig, ServeError> {
        toml::from_str(text).map_err(|e| config_err(path, e))
    }

    /// Reads the configuration of the model in `dir` (unchecked): its config.pbtxt or
    /// config.toml, or the defaults when it has neither. Returns the file read, if any.
    pub(crate) fn read(dir: &Path) -> Result<(ModelConfig, Option<PathBuf>), ServeError> {
        let (pbtxt, toml) = (dir.join(PBTXT_FILE), dir.join(TOML_FILE));
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|source| ServeError::Io {
                op: "read",
                path: p.to_path_buf(),
                source,
            })
        };
        match (pbtxt.is_file(), toml.is_file()) {
            (true, true) => Err(config_err(
                dir,
                format!("has both {PBTXT_FILE} and {TOML_FILE}; keep one"),
            )),
            (true, false) => Ok((Self::parse_pbtxt(&read(&pbtxt)?, &pbtxt)?, Some(pbtxt))),
            (false, true) => Ok((Self::parse_toml(&read(&toml)?, &toml)?, Some(toml))),
            (false, false) => Ok((ModelConfig::default(), None)),
        }
    }

    /// Parses a configuration given as JSON (Triton's `load_model(config=...)`), as Triton's
    /// clients write it: protobuf's JSON, where 64-bit integers may be strings. Unlike a
    /// config file, a field cohort would not use is an error, so that an override is never
    /// accepted and then silently not applied. Returns it (otherwise unchecked) with the path
    /// its errors name.
    pub(crate) fn parse_json(
        text: &str,
        model: &str,
    ) -> Result<(ModelConfig, PathBuf), ServeError> {
        let path = PathBuf::from(format!("config override of {model}"));
        let mut value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| config_err(&path, format!("JSON: {e}")))?;
        integers_from_strings(&mut value);
        let cfg: ModelConfig = serde_path_to_error::deserialize(value)
            .map_err(|e| config_err(&path, format!("{}: {}", e.path(), e.inner())))?;
        if let Some((k, v)) = cfg.ignored.iter().next() {
            return Err(config_err(
                &path,
                format!(
                    "field {k} ({v}) is not supported by cohort; an override may set name, \
                     platform, backend, max_batch_size, dynamic_batching, instance_group, \
                     version_policy, input, output, parameters, ensemble_scheduling"
                ),
            ));
        }
        let unused = |what: &str, ignored: &BTreeMap<String, serde_json::Value>| {
            ignored.keys().next().map(|k| {
                config_err(
                    &path,
                    format!("field {what}.{k} is not supported by cohort"),
                )
            })
        };
        if let Some(e) = cfg
            .dynamic_batching
            .as_ref()
            .and_then(|d| d.default_queue_policy.as_ref())
            .and_then(|q| unused("dynamic_batching.default_queue_policy", &q.ignored))
        {
            return Err(e);
        }
        if let Some(e) = cfg
            .instance_group
            .iter()
            .find_map(|g| unused("instance_group", &g.ignored))
        {
            return Err(e);
        }
        Ok((cfg, path))
    }

    /// Checks the fields every model has, whichever `kind` (the config's own) serves it: a
    /// batch size, batching, instances, parameters and version policy cohort can honour, and
    /// no ensemble steps outside an ensemble. What only the serving backend can judge (the
    /// tensors it declares, the sections it reads) is checked before this, by the backend.
    pub(crate) fn check_fields(self, kind: Kind, path: &Path) -> Result<ModelConfig, ServeError> {
        if kind != Kind::Ensemble && self.ensemble_scheduling.is_some() {
            return Err(config_err(
                path,
                format!(
                    "ensemble_scheduling is only for platform \"ensemble\" (this model's is {:?})",
                    kind.platform()
                ),
            ));
        }
        if self.max_batch_size == 0 {
            return Err(config_err(
                path,
                "max_batch_size must be at least 1: cohort serves models with a batch dimension \
                 (the first of every input and output)",
            ));
        }
        if let Some(db) = &self.dynamic_batching {
            if let Some(&p) = db
                .preferred_batch_size
                .iter()
                .find(|&&p| p == 0 || p > self.max_batch_size)
            {
                return Err(config_err(
                    path,
                    format!(
                        "preferred_batch_size {p} must be in 1..={} (max_batch_size)",
                        self.max_batch_size
                    ),
                ));
            }
        }
        for g in &self.instance_group {
            if g.count == 0 {
                return Err(config_err(path, "instance_group count must be at least 1"));
            }
            if let Some(kind) = &g.kind {
                if !matches!(kind.as_str(), "KIND_CPU" | "KIND_AUTO") {
                    return Err(config_err(
                        path,
                        format!(
                            "instance_group kind {kind}: cohort runs on the CPU only (KIND_CPU)"
                        ),
                    ));
                }
            }
        }
        for (k, v) in &self.parameters {
            let Some((_, takes)) = PARAMETERS.iter().find(|(name, _)| name == k) else {
                let known: Vec<&str> = PARAMETERS.iter().map(|(n, _)| *n).collect();
                return Err(config_err(
                    path,
                    format!(
                        "parameter {k:?} is not one cohort reads (it reads {})",
                        known.join(", ")
                    ),
                ));
            };
            let allowed = match k.as_str() {
                INFLIGHT_BATCHING => matches!(v.as_str(), "true" | "false"),
                KV_CACHE_DTYPE => matches!(v.as_str(), "fp32" | "bf16"),
                DECODE_WEIGHTS => matches!(v.as_str(), "fp32" | "bf16" | "q8"),
                MAX_PREFILL_TOKENS => v.parse::<usize>().is_ok_and(|n| n > 0),
                ONNX_BACKEND => matches!(v.as_str(), "auto" | "onnxruntime" | "tract"),
                _ => true,
            };
            if !allowed {
                return Err(config_err(
                    path,
                    format!("parameter {k} is {v:?}; it takes {takes}"),
                ));
            }
        }
        match &self.version_policy {
            VersionPolicy::Latest { num_versions: 0 } => {
                return Err(config_err(
                    path,
                    "version_policy latest num_versions must be >= 1",
                ))
            }
            VersionPolicy::Specific { versions } if versions.is_empty() => {
                return Err(config_err(
                    path,
                    "version_policy specific lists no versions",
                ))
            }
            _ => {}
        }
        Ok(self)
    }

    /// The backend that serves the model, from `platform` / `backend` (neither: cohort's GPT).
    pub fn kind(&self) -> Result<Kind, String> {
        Kind::from_config(self.platform.as_deref(), self.backend.as_deref())
    }

    /// Whether concurrent generations share decode steps (the `inflight_batching` parameter,
    /// on unless it is "false").
    pub fn inflight_batching(&self) -> bool {
        self.parameters.get(INFLIGHT_BATCHING).map(String::as_str) != Some("false")
    }

    /// The number format of generation's KV caches (the `kv_cache_dtype` parameter: bf16 when
    /// it is "bf16", else f32; [`ModelConfig`]'s checks refuse any other value).
    pub fn kv_cache_dtype(&self) -> KvDtype {
        match self.parameters.get(KV_CACHE_DTYPE).map(String::as_str) {
            Some("bf16") => KvDtype::Bf16,
            _ => KvDtype::F32,
        }
    }

    /// The prompt tokens an in-flight decode step feeds besides its first prompt (the
    /// `max_prefill_tokens` parameter), if the config sets them.
    pub fn max_prefill_tokens(&self) -> Option<usize> {
        self.parameters.get(MAX_PREFILL_TOKENS)?.parse().ok()
    }

    /// The weights generation's decode steps read (the `decode_weights` parameter: the model's
    /// f32 weights unless it names a copy; [`ModelConfig`]'s checks refuse other values).
    pub fn decode_weights(&self) -> WeightFormat {
        self.parameters
            .get(DECODE_WEIGHTS)
            .and_then(|v| v.parse().ok())
            .unwrap_or_default()
    }

    /// Instances to run: the sum of the instance groups' counts (1 without groups).
    pub fn instance_count(&self) -> usize {
        if self.instance_group.is_empty() {
            1
        } else {
            self.instance_group.iter().map(|g| g.count).sum()
        }
    }

    /// How long the batcher may hold the oldest request (zero without dynamic batching).
    pub fn max_queue_delay(&self) -> Duration {
        self.dynamic_batching.as_ref().map_or(Duration::ZERO, |d| {
            Duration::from_micros(d.max_queue_delay_microseconds)
        })
    }

    /// The configured queue bound, if any.
    pub fn max_queue_size(&self) -> Option<usize> {
        self.dynamic_batching
            .as_ref()
            .and_then(|d| d.default_queue_policy.as_ref())
            .map(|q| q.max_queue_size)
            .filter(|&n| n > 0)
    }

    /// Names of the top-level fields that were read but are not used.
    pub fn ignored_fields(&self) -> Vec<&str> {
        self.ignored.keys().map(String::as_str).collect()
    }
}

/// A config error naming the file (or override) at fault.
pub(crate) fn config_err(path: &Path, reason: impl ToString) -> ServeError {
    ServeError::Config {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

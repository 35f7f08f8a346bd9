//! A model's serving configuration, read from `REPO/<model>/config.pbtxt` (Triton's protobuf
//! text) or `REPO/<model>/config.toml` (the same fields in TOML). Only Triton's fields that mean
//! something for cohort are read: `name`, `platform` / `backend` (which backend serves the
//! model: `cohort_gpt`, `onnxruntime_onnx`, `ensemble`, `cohort_tokenizer`), `max_batch_size`,
//! `dynamic_batching` (`preferred_batch_size`, `max_queue_delay_microseconds`,
//! `default_queue_policy.max_queue_size`), `instance_group` (`count`, `kind`),
//! `version_policy`, `parameters` (`inflight_batching`: whether concurrent generations share
//! batched decode steps; `kv_cache_dtype`: `fp32` or `bf16` keys and values in generation's
//! KV caches), `ensemble_scheduling` (steps with `input_map` / `output_map`), and
//! `input` / `output`, which must name the model's own tensors with their types (a GPT's
//! `input_ids`; `logits`, `next_token`; an ONNX model's are checked when `model.onnx` is read;
//! an ensemble's and a tokenizer's declare their tensors, BYTES ones as `TYPE_STRING`): a
//! config that declares a tensor the model does not have is refused at load, naming it. Other
//! fields Triton writes are accepted and ignored with a warning. A misspelt field inside a
//! known section is an error. A configuration can also come as JSON (Triton's
//! `load_model(config=...)` override), where an unused field is refused instead of ignored.
//! This module never loads a model.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cohort_gpt::sample::KvDtype;
use serde::{Deserialize, Serialize};

use crate::backend::{check_section, Kind};
use crate::error::ServeError;
use crate::pbtxt;

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
];

/// The `parameters` key that switches in-flight batching of generation.
pub const INFLIGHT_BATCHING: &str = "inflight_batching";

/// The `parameters` key that picks the number format of generation's KV caches (vLLM's
/// `--kv-cache-dtype`).
pub const KV_CACHE_DTYPE: &str = "kv_cache_dtype";

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

/// Reads Triton's parameters in any of their three spellings into key -> string value.
fn de_parameters<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    use serde::de::Error;
    use serde_json::Value;
    let string_value = |key: &str, v: &Value| -> Result<String, D::Error> {
        match v {
            Value::String(s) => Ok(s.clone()),
            Value::Object(o) if o.len() == 1 && o.contains_key("string_value") => o["string_value"]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| {
                    D::Error::custom(format!("parameter {key}: string_value is not a string"))
                }),
            other => Err(D::Error::custom(format!(
                "parameter {key}: {other} is not {{ string_value: \"...\" }}"
            ))),
        }
    };
    let mut out = BTreeMap::new();
    match Value::deserialize(d)? {
        Value::Object(map) => {
            for (k, v) in &map {
                out.insert(k.clone(), string_value(k, v)?);
            }
        }
        Value::Array(entries) => {
            for e in &entries {
                let (Some(k), Some(v)) = (e.get("key").and_then(Value::as_str), e.get("value"))
                else {
                    return Err(D::Error::custom(format!(
                        "parameters entry {e} is not {{ key: \"...\" value: {{ string_value: \"...\" }} }}"
                    )));
                };
                out.insert(k.to_string(), string_value(k, v)?);
            }
        }
        other => {
            return Err(D::Error::custom(format!(
                "parameters: {other} is neither a map nor key/value entries"
            )))
        }
    }
    Ok(out)
}

/// Writes parameters as Triton's JSON does: key -> `{"string_value": v}`.
fn ser_parameters<S: serde::Serializer>(
    p: &BTreeMap<String, String>,
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(p.len()))?;
    for (k, v) in p {
        m.serialize_entry(k, &serde_json::json!({ "string_value": v }))?;
    }
    m.end()
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

/// Reads a protobuf map<string, string> in its spellings: pbtxt's repeated
/// `{ key: "k" value: "v" }` entries, JSON's or TOML's `{"k": "v"}`.
fn de_string_map<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    use serde::de::Error;
    use serde_json::Value;
    let mut out = BTreeMap::new();
    match Value::deserialize(d)? {
        Value::Object(map) => {
            for (k, v) in map {
                let v = v.as_str().ok_or_else(|| {
                    D::Error::custom(format!("map entry {k}: {v} is not a string"))
                })?;
                out.insert(k, v.to_string());
            }
        }
        Value::Array(entries) => {
            for e in &entries {
                let (Some(k), Some(v)) = (
                    e.get("key").and_then(Value::as_str),
                    e.get("value").and_then(Value::as_str),
                ) else {
                    return Err(D::Error::custom(format!(
                        "map entry {e} is not {{ key: \"...\" value: \"...\" }}"
                    )));
                };
                out.insert(k.to_string(), v.to_string());
            }
        }
        other => {
            return Err(D::Error::custom(format!(
                "{other} is neither a map nor key/value entries"
            )))
        }
    }
    Ok(out)
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

impl ModelConfig {
    /// Parses config.pbtxt text.
    pub fn from_pbtxt(text: &str, path: &Path) -> Result<ModelConfig, ServeError> {
        let value = pbtxt::parse(text, REPEATED).map_err(|e| config_err(path, e))?;
        // the error names the field at fault (serde_json's alone does not, for a Value)
        let cfg: ModelConfig = serde_path_to_error::deserialize(value)
            .map_err(|e| config_err(path, format!("{}: {}", e.path(), e.inner())))?;
        cfg.validate(path)
    }

    /// Parses config.toml text.
    pub fn from_toml(text: &str, path: &Path) -> Result<ModelConfig, ServeError> {
        let cfg: ModelConfig = toml::from_str(text).map_err(|e| config_err(path, e))?;
        cfg.validate(path)
    }

    /// The configuration of the model in `dir`: its config.pbtxt or config.toml, or the
    /// defaults when it has neither. Returns the file read, if any.
    pub fn load(dir: &Path) -> Result<(ModelConfig, Option<PathBuf>), ServeError> {
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
            (true, false) => Ok((Self::from_pbtxt(&read(&pbtxt)?, &pbtxt)?, Some(pbtxt))),
            (false, true) => Ok((Self::from_toml(&read(&toml)?, &toml)?, Some(toml))),
            (false, false) => Ok((ModelConfig::default(), None)),
        }
    }

    /// Parses a configuration given as JSON (Triton's `load_model(config=...)`), as Triton's
    /// clients write it: protobuf's JSON, where 64-bit integers may be strings. Unlike a
    /// config file, a field cohort would not use is an error, so that an override is never
    /// accepted and then silently not applied.
    pub fn from_json(text: &str, model: &str) -> Result<ModelConfig, ServeError> {
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
        cfg.validate(&path)
    }

    fn validate(self, path: &Path) -> Result<ModelConfig, ServeError> {
        let kind = self.kind().map_err(|e| config_err(path, e))?;
        match kind {
            Kind::Gpt => {
                // the vocabulary is known once the checkpoint is read; the load checks it
                let (inputs, outputs) = crate::backend::gpt::tensors(-1);
                check_section("input", &self.input, &inputs).map_err(|e| config_err(path, e))?;
                check_section("output", &self.output, &outputs).map_err(|e| config_err(path, e))?;
            }
            // checked against model.onnx when it is loaded
            Kind::Onnx => {}
            // the config is where a tokenizer model's tensors come from
            Kind::Tokenizer => {
                crate::backend::tokenizer::layout(&self).map_err(|e| config_err(path, e))?;
            }
            Kind::Ensemble => {
                crate::ensemble::check_config(&self).map_err(|e| config_err(path, e))?;
            }
        }
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

/// Protobuf's JSON writes 64-bit integers as strings (`"max_queue_delay_microseconds": "100"`);
/// turns those of the integer fields cohort reads back into numbers.
fn integers_from_strings(v: &mut serde_json::Value) {
    const INTEGER_FIELDS: &[&str] = &[
        "max_batch_size",
        "preferred_batch_size",
        "max_queue_delay_microseconds",
        "max_queue_size",
        "count",
        "num_versions",
        "versions",
        "dims",
    ];
    fn number(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::String(s) => {
                if let Ok(n) = s.parse::<i64>() {
                    *v = n.into();
                }
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(number),
            _ => {}
        }
    }
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                if INTEGER_FIELDS.contains(&k.as_str()) {
                    number(x);
                } else {
                    integers_from_strings(x);
                }
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(integers_from_strings),
        _ => {}
    }
}

fn config_err(path: &Path, reason: impl ToString) -> ServeError {
    ServeError::Config {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pbtxt_and_toml_give_the_same_config() {
        let pbtxt = r#"
            name: "m"
            backend: "cohort"
            max_batch_size: 16
            dynamic_batching {
              preferred_batch_size: [ 4, 8 ]
              max_queue_delay_microseconds: 500
              default_queue_policy { max_queue_size: 7 }
            }
            instance_group [ { count: 2 kind: KIND_CPU }, { count: 1 } ]
            version_policy: { latest: { num_versions: 2 } }
        "#;
        let toml = r#"
            name = "m"
            backend = "cohort"
            max_batch_size = 16
            [dynamic_batching]
            preferred_batch_size = [4, 8]
            max_queue_delay_microseconds = 500
            default_queue_policy = { max_queue_size = 7 }
            [[instance_group]]
            count = 2
            kind = "KIND_CPU"
            [[instance_group]]
            count = 1
            [version_policy]
            latest = { num_versions = 2 }
        "#;
        let a = ModelConfig::from_pbtxt(pbtxt, Path::new("config.pbtxt")).unwrap();
        let b = ModelConfig::from_toml(toml, Path::new("config.toml")).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.instance_count(), 3);
        assert_eq!(a.max_queue_delay(), Duration::from_micros(500));
        assert_eq!(a.max_queue_size(), Some(7));
        assert!(a.ignored_fields().is_empty());
        assert_eq!(a.kind(), Ok(Kind::Gpt));
        assert_eq!(a.version_policy, VersionPolicy::Latest { num_versions: 2 });
    }

    #[test]
    fn version_policies_select() {
        let present = [3, 1, 10, 2];
        assert_eq!(VersionPolicy::default().select(&present), [10]);
        assert_eq!(
            VersionPolicy::Latest { num_versions: 9 }.select(&present),
            [1, 2, 3, 10]
        );
        assert_eq!(VersionPolicy::All {}.select(&present), [1, 2, 3, 10]);
        assert_eq!(
            VersionPolicy::Specific {
                versions: vec![2, 4, 10]
            }
            .select(&present),
            [2, 10]
        );
        let p = ModelConfig::from_pbtxt(
            "version_policy { specific { versions: [1, 3] } }",
            Path::new("c"),
        )
        .unwrap();
        assert_eq!(
            p.version_policy,
            VersionPolicy::Specific {
                versions: vec![1, 3]
            }
        );
        let all = ModelConfig::from_pbtxt("version_policy { all { } }", Path::new("c")).unwrap();
        assert_eq!(all.version_policy, VersionPolicy::All {});
    }

    #[test]
    fn the_inflight_batching_parameter_reads_in_every_spelling() {
        let off = "parameters { key: \"inflight_batching\" value: { string_value: \"false\" } }";
        let p = ModelConfig::from_pbtxt(off, Path::new("c")).unwrap();
        assert!(!p.inflight_batching());
        let t = "[parameters]\ninflight_batching = \"false\"\n";
        assert_eq!(ModelConfig::from_toml(t, Path::new("c")).unwrap(), p);
        let j = r#"{"parameters": {"inflight_batching": {"string_value": "false"}}}"#;
        assert_eq!(ModelConfig::from_json(j, "m").unwrap(), p);
        assert!(ModelConfig::default().inflight_batching());
    }

    #[test]
    fn the_kv_cache_dtype_parameter_reads_in_every_spelling() {
        let bf16 = "parameters { key: \"kv_cache_dtype\" value: { string_value: \"bf16\" } }";
        let p = ModelConfig::from_pbtxt(bf16, Path::new("c")).unwrap();
        assert_eq!(p.kv_cache_dtype(), KvDtype::Bf16);
        let t = "[parameters]\nkv_cache_dtype = \"bf16\"\n";
        assert_eq!(ModelConfig::from_toml(t, Path::new("c")).unwrap(), p);
        let j = r#"{"parameters": {"kv_cache_dtype": {"string_value": "bf16"}}}"#;
        assert_eq!(ModelConfig::from_json(j, "m").unwrap(), p);
        let fp32 = "parameters { key: \"kv_cache_dtype\" value: { string_value: \"fp32\" } }";
        let p = ModelConfig::from_pbtxt(fp32, Path::new("c")).unwrap();
        assert_eq!(p.kv_cache_dtype(), KvDtype::F32);
        assert_eq!(ModelConfig::default().kv_cache_dtype(), KvDtype::F32);
    }

    #[test]
    fn bad_configs_are_clear_errors() {
        for (text, needle) in [
            ("max_batch_size: 0", "at least 1"),
            (
                "max_batch_size: 4 dynamic_batching { preferred_batch_size: 8 }",
                "preferred_batch_size 8",
            ),
            (
                "dynamic_batching { max_queue_delay_microsecond: 5 }",
                "max_queue_delay_microsecond",
            ),
            ("instance_group { kind: KIND_GPU }", "CPU only"),
            ("instance_group { count: 0 }", "at least 1"),
            ("version_policy { newest { } }", "newest"),
            ("max_batch_size: \"eight\"", "max_batch_size"),
            ("max_batch_size: 4 max_batch_size: 8", "max_batch_size"),
            ("max_batch_size 4", "line 1"),
            (
                "parameters { key: \"inflight_batching\" value: { string_value: \"no\" } }",
                "takes \"true\"",
            ),
            (
                "parameters { key: \"beam_width\" value: { string_value: \"4\" } }",
                "\"beam_width\" is not one cohort reads",
            ),
            ("parameters { key: \"inflight_batching\" }", "is not { key"),
            (
                "parameters { key: \"kv_cache_dtype\" value: { string_value: \"fp16\" } }",
                "parameter kv_cache_dtype is \"fp16\"; it takes \"fp32\" (the default) or \"bf16\"",
            ),
        ] {
            let err = ModelConfig::from_pbtxt(text, Path::new("m/config.pbtxt")).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains(needle) && msg.contains("m/config.pbtxt"),
                "{text}: {msg}"
            );
        }
    }

    #[test]
    fn a_directory_without_config_gets_the_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, file) = ModelConfig::load(dir.path()).unwrap();
        assert_eq!(cfg, ModelConfig::default());
        assert!(file.is_none());
        std::fs::write(dir.path().join(PBTXT_FILE), "max_batch_size: 2").unwrap();
        std::fs::write(dir.path().join(TOML_FILE), "max_batch_size = 2").unwrap();
        let err = ModelConfig::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("both"), "{err}");
    }

    #[test]
    fn input_and_output_sections_must_name_the_models_tensors() {
        let ok = r#"
            max_batch_size: 4
            input [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] } ]
            output [
              { name: "logits" data_type: TYPE_FP32 dims: [ -1, 50257 ] },
              { name: "next_token" data_type: TYPE_INT64 dims: [ 1 ] reshape: { shape: [ ] } }
            ]
        "#;
        let cfg = ModelConfig::from_pbtxt(ok, Path::new("m/config.pbtxt")).unwrap();
        assert_eq!(cfg.input[0].name, "input_ids");
        assert_eq!(cfg.output.len(), 2);
        assert!(cfg.ignored_fields().is_empty());
        for (text, needle) in [
            (
                "input [ { name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 16 ] } ]",
                "input \"INPUT0\" is not a tensor of the model (it has input_ids)",
            ),
            (
                "output { name: \"probs\" }",
                "output \"probs\" is not a tensor",
            ),
            (
                "input { name: \"input_ids\" data_type: TYPE_INT32 }",
                "data_type TYPE_INT32; the model's is TYPE_INT64",
            ),
            (
                "output { name: \"logits\" dims: [ 3, 4, 5 ] }",
                "has dims [3, 4, 5]; the model's are [-1, -1]",
            ),
            (
                "input { name: \"input_ids\" format: FORMAT_NCHW }",
                "format",
            ),
            (
                "output [ { name: \"logits\" }, { name: \"logits\" } ]",
                "declared twice",
            ),
        ] {
            let err = ModelConfig::from_pbtxt(text, Path::new("m/config.pbtxt"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }

    #[test]
    fn a_json_override_is_read_as_triton_writes_it_and_refuses_what_it_cannot_honour() {
        let cfg = ModelConfig::from_json(
            r#"{"name": "m", "platform": "cohort_gpt", "max_batch_size": "2",
                "dynamic_batching": {"preferred_batch_size": [2],
                                     "max_queue_delay_microseconds": "1500"},
                "instance_group": [{"count": 3, "kind": "KIND_CPU"}]}"#,
            "m",
        )
        .unwrap();
        assert_eq!(cfg.max_batch_size, 2);
        assert_eq!(cfg.instance_count(), 3);
        assert_eq!(cfg.max_queue_delay(), Duration::from_micros(1500));
        for (text, needle) in [
            (
                r#"{"backend": "tensorflow"}"#,
                "backend \"tensorflow\" is not served by cohort",
            ),
            (
                r#"{"platform": "onnxruntime_onnx", "backend": "cohort"}"#,
                "name different backends",
            ),
            (r#"{"sequence_batching": {}}"#, "field sequence_batching"),
            (
                r#"{"instance_group": [{"count": 1, "gpus": [0]}]}"#,
                "field instance_group.gpus",
            ),
            (
                r#"{"dynamic_batching": {"default_queue_policy": {"timeout_action": 1}}}"#,
                "default_queue_policy.timeout_action",
            ),
            (r#"{"max_batch_size": 0}"#, "at least 1"),
            (r#"{"input": [{"name": "x"}]}"#, "input \"x\""),
            (r#"{"max_batch_size": "#, "JSON"),
        ] {
            let err = ModelConfig::from_json(text, "m").unwrap_err().to_string();
            assert!(
                err.contains(needle) && err.contains("config override of m"),
                "{text}: {err}"
            );
        }
    }

    #[test]
    fn platform_and_backend_pick_the_backend_and_an_ensemble_is_checked() {
        let kind = |text: &str| ModelConfig::from_pbtxt(text, Path::new("c")).map(|c| c.kind());
        assert_eq!(kind("").unwrap(), Ok(Kind::Gpt));
        assert_eq!(
            kind("platform: \"onnxruntime_onnx\"").unwrap(),
            Ok(Kind::Onnx)
        );
        assert_eq!(kind("backend: \"onnxruntime\"").unwrap(), Ok(Kind::Onnx));
        let err = kind("platform: \"tensorrt_plan\"").unwrap_err().to_string();
        assert!(
            err.contains("platform \"tensorrt_plan\" is not served"),
            "{err}"
        );

        let ensemble = r#"
            platform: "ensemble"
            max_batch_size: 4
            input [ { name: "RAW" data_type: TYPE_FP32 dims: [ 3 ] } ]
            output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
            ensemble_scheduling { step [
              { model_name: "b" input_map { key: "x" value: "mid" }
                output_map { key: "y" value: "OUT" } },
              { model_name: "a" model_version: 2 input_map { key: "x" value: "RAW" }
                output_map [ { key: "y" value: "mid" } ] }
            ] }
        "#;
        let cfg = ModelConfig::from_pbtxt(ensemble, Path::new("c")).unwrap();
        assert_eq!(cfg.kind(), Ok(Kind::Ensemble));
        let steps = &cfg.ensemble_scheduling.as_ref().unwrap().step;
        assert_eq!((steps[0].model_version, steps[1].model_version), (-1, 2));
        assert_eq!(steps[1].output_map["y"], "mid");
        for (edit, needle) in [
            (("value: \"RAW\"", "value: \"nothing\""), "can never run"),
            (
                ("value: \"OUT\"", "value: \"other\""),
                "output \"OUT\" is in no step",
            ),
            (
                ("data_type: TYPE_FP32 dims: [ 3 ]", "dims: [ 3 ]"),
                "needs a data_type",
            ),
            (
                ("value: \"mid\" } ] }", "value: \"OUT\" } ] }"),
                "produced twice",
            ),
        ] {
            let text = ensemble.replace(edit.0, edit.1);
            let err = ModelConfig::from_pbtxt(&text, Path::new("c"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{needle:?} not in {err}");
        }
    }
}
